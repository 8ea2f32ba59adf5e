//! `AutoPipeline` against the concrete pipelines: each tiny fixture folder loads by its
//! `_class_name`, reports its family and diffusers' `__call__` defaults, and gives bit for bit
//! the latents its concrete pipeline gives for the same request and seed; an unknown
//! `_class_name` is an error naming it and the supported ones. The same for the editing auto
//! pipelines (`AutoPipelineForImage2Image`, `AutoPipelineForInpainting`), which also refuse
//! the families that do not edit and the options their pipeline does not take.
//!
//! Both sides run the same code on the same backend, so the latents must be equal, not close.

mod common;

use common::{model_dir, to_vec, B};
use oxidiff::pipelines::{
    AutoPipeline, AutoPipelineForImage2Image, AutoPipelineForInpainting, EditOptions,
    FamilyOptions, FluxPipeline, FluxRequest, GenerateRequest, LoadOptions, OutputType,
    PipelineDefaults, PipelineError, PipelineFamily, PixArtPipeline, PixArtRequest, Sd3Request,
    StableDiffusion3Pipeline, StableDiffusionImg2ImgPipeline, StableDiffusionInpaintPipeline,
    StableDiffusionPipeline, StableDiffusionXLImg2ImgPipeline, StableDiffusionXLInpaintPipeline,
    StableDiffusionXLPipeline, XlEditOptions, XlInitImage, XlRequest,
};
use oxidiff::schedulers::TorchCpuGenerator;

/// Two steps at 64x64 with the family's guidance, latents only.
fn request(guidance_scale: f64) -> GenerateRequest<B> {
    GenerateRequest {
        prompts: vec!["a red apple".into()],
        negative_prompts: vec!["blurry".into()],
        num_inference_steps: 2,
        guidance_scale,
        width: Some(64),
        height: Some(64),
        seed: 7,
        output: OutputType::Latents,
        ..Default::default()
    }
}

/// Loads `fixture` with `AutoPipeline`, checks its family and defaults, and returns its
/// latents for [`request`] at the default guidance.
fn auto_latents(
    fixture: &str,
    family: PipelineFamily,
    defaults: PipelineDefaults,
) -> (GenerateRequest<B>, Vec<f32>) {
    let device = Default::default();
    let mut auto =
        AutoPipeline::<B>::from_dir(&model_dir(fixture), &LoadOptions::default(), &device).unwrap();
    assert_eq!(auto.family(), family, "{fixture}");
    assert_eq!(auto.defaults(), defaults, "{fixture}");
    let default_request = auto.default_request();
    assert_eq!(
        default_request.num_inference_steps,
        defaults.num_inference_steps
    );
    assert_eq!(default_request.guidance_scale, defaults.guidance_scale);
    let req = request(defaults.guidance_scale);
    let out = auto
        .generate_with(
            &req,
            &FamilyOptions::default(),
            &mut TorchCpuGenerator::new(req.seed),
            |_| {},
        )
        .unwrap();
    (req, to_vec(out.latents))
}

#[test]
fn auto_pipeline_matches_stable_diffusion() {
    let (req, auto) = auto_latents(
        "tiny-sd1",
        PipelineFamily::StableDiffusion,
        PipelineDefaults::STABLE_DIFFUSION,
    );
    let device = Default::default();
    let mut pipe = StableDiffusionPipeline::<B>::from_dir(
        &model_dir("tiny-sd1"),
        &LoadOptions::default(),
        &device,
    )
    .unwrap();
    let out = pipe.generate(&req).unwrap();
    assert_eq!(auto, to_vec(out.latents));
}

#[test]
fn auto_pipeline_matches_sdxl_with_diffusers_guidance() {
    let (req, auto) = auto_latents(
        "tiny-sdxl",
        PipelineFamily::StableDiffusionXL,
        PipelineDefaults::STABLE_DIFFUSION_XL,
    );
    // diffusers' SDXL default, in the library itself.
    assert_eq!(req.guidance_scale, 5.0);
    let device = Default::default();
    let mut pipe = StableDiffusionXLPipeline::<B>::from_dir(
        &model_dir("tiny-sdxl"),
        &LoadOptions::default(),
        &device,
    )
    .unwrap();
    assert_eq!(pipe.defaults().guidance_scale, 5.0);
    let default = XlRequest::<B>::default();
    assert_eq!(
        (
            default.common.guidance_scale,
            default.common.num_inference_steps
        ),
        (5.0, 50),
        "XlRequest::default() is diffusers' StableDiffusionXLPipeline.__call__"
    );
    let out = pipe.generate(&XlRequest::new(req.clone())).unwrap();
    assert_eq!(auto, to_vec(out.latents));

    // The editing pipelines' own defaults (diffusers 0.42's `__call__` signatures).
    let img2img = StableDiffusionXLImg2ImgPipeline::from(pipe);
    let request = img2img.default_request();
    assert_eq!(request.common.guidance_scale, 5.0);
    assert_eq!(img2img.defaults().strength, Some(0.3));
    assert_eq!(XlEditOptions::default().strength, 0.3);
    let inpaint = StableDiffusionXLInpaintPipeline::from(img2img.pipe);
    assert_eq!(inpaint.default_request().common.guidance_scale, 7.5);
    assert_eq!(inpaint.defaults().strength, Some(0.9999));
    assert_eq!(XlEditOptions::inpainting().strength, 0.9999);
}

#[test]
fn auto_pipeline_matches_sd3() {
    let (req, auto) = auto_latents(
        "tiny-sd3",
        PipelineFamily::StableDiffusion3,
        PipelineDefaults::STABLE_DIFFUSION_3,
    );
    let device = Default::default();
    let mut pipe = StableDiffusion3Pipeline::<B>::from_dir(
        &model_dir("tiny-sd3"),
        &LoadOptions::default(),
        &device,
    )
    .unwrap();
    let defaults = Sd3Request::<B>::default();
    assert_eq!(defaults.max_sequence_length, 256);
    let out = pipe
        .generate(&Sd3Request {
            common: req,
            ..defaults
        })
        .unwrap();
    assert_eq!(auto, to_vec(out.latents));
}

#[test]
fn auto_pipeline_matches_flux() {
    let (req, auto) = auto_latents(
        "tiny-flux-dev",
        PipelineFamily::Flux,
        PipelineDefaults::FLUX,
    );
    let device = Default::default();
    let mut pipe = FluxPipeline::<B>::from_dir(
        &model_dir("tiny-flux-dev"),
        &LoadOptions::default(),
        &device,
    )
    .unwrap();
    let defaults = FluxRequest::<B>::default();
    assert_eq!(defaults.max_sequence_length, 512);
    let out = pipe
        .generate(&FluxRequest {
            common: req,
            ..defaults
        })
        .unwrap();
    assert_eq!(auto, to_vec(out.latents));
}

#[test]
fn auto_pipeline_matches_pixart() {
    let (req, auto) = auto_latents(
        "tiny-pixart-alpha",
        PipelineFamily::PixArt,
        PipelineDefaults::PIXART_ALPHA,
    );
    let device = Default::default();
    let mut pipe = PixArtPipeline::<B>::from_dir(
        &model_dir("tiny-pixart-alpha"),
        &LoadOptions::default(),
        &device,
    )
    .unwrap();
    let out = pipe
        .generate(&PixArtRequest {
            common: req,
            ..Default::default()
        })
        .unwrap();
    assert_eq!(auto, to_vec(out.latents));
}

#[test]
fn every_fixture_class_has_a_family() {
    for (fixture, family) in [
        ("tiny-sd2", PipelineFamily::StableDiffusion),
        ("tiny-sd1-inpaint", PipelineFamily::StableDiffusion),
        ("tiny-sdxl-refiner", PipelineFamily::StableDiffusionXL),
        ("tiny-sdxl-inpaint", PipelineFamily::StableDiffusionXL),
        ("tiny-flux-schnell", PipelineFamily::Flux),
    ] {
        let class = oxidiff::pipelines::pipeline_class(&model_dir(fixture)).unwrap();
        assert_eq!(
            PipelineFamily::from_class(&class),
            Some(family),
            "{fixture}"
        );
    }
}

#[test]
fn family_options_a_family_does_not_take_are_refused() {
    let device = Default::default();
    let mut auto =
        AutoPipeline::<B>::from_dir(&model_dir("tiny-sd1"), &LoadOptions::default(), &device)
            .unwrap();
    let options = FamilyOptions {
        true_cfg_scale: 4.0,
        ..Default::default()
    };
    let err = auto
        .generate_with(
            &request(7.5),
            &options,
            &mut TorchCpuGenerator::new(0),
            |_| {},
        )
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("true_cfg_scale") && err.contains("Flux"),
        "{err}"
    );
}

#[test]
fn unknown_class_is_an_error_naming_it_and_the_supported_ones() {
    let dir = std::env::temp_dir().join(format!("oxidiff-auto-unknown-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("model_index.json"),
        r#"{"_class_name": "KandinskyV22Pipeline"}"#,
    )
    .unwrap();
    let device = Default::default();
    let result = AutoPipeline::<B>::from_dir(&dir, &LoadOptions::default(), &device);
    std::fs::remove_dir_all(&dir).unwrap();
    let err = match result {
        Err(e @ PipelineError::UnsupportedPipeline { .. }) => e.to_string(),
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("an unknown class loaded"),
    };
    assert!(err.contains("KandinskyV22Pipeline"), "{err}");
    for class in PipelineFamily::supported_classes() {
        assert!(err.contains(class), "{class} missing from: {err}");
    }
}

/// The error `auto` gives for `req` (empty when it generates).
fn refusal(auto: &mut AutoPipeline<B>, req: &GenerateRequest<B>) -> String {
    auto.generate_with(
        req,
        &FamilyOptions::default(),
        &mut TorchCpuGenerator::new(0),
        |_| {},
    )
    .err()
    .map(|e| e.to_string())
    .unwrap_or_default()
}

#[test]
fn every_family_refuses_an_absurd_size_or_non_finite_scales_before_allocating() {
    // 20000x20000 is over the library's bound (2^28 pixels): refused by the request check every
    // pipeline runs, before latents of 25 million values per channel are made.
    let device = Default::default();
    for fixture in [
        "tiny-sd1",
        "tiny-sdxl",
        "tiny-sd3",
        "tiny-flux-dev",
        "tiny-pixart-alpha",
    ] {
        let mut auto =
            AutoPipeline::<B>::from_dir(&model_dir(fixture), &LoadOptions::default(), &device)
                .unwrap();
        let req = GenerateRequest {
            width: Some(20_000),
            height: Some(20_000),
            ..request(auto.defaults().guidance_scale)
        };
        let err = refusal(&mut auto, &req);
        assert!(
            err.contains("20000x20000") && err.contains("pixels"),
            "{fixture}: {err}"
        );
        // Non-finite guidance and eta are input errors, not NaN latents blamed on the weights.
        let guidance = auto.defaults().guidance_scale;
        for (req, needle) in [
            (
                GenerateRequest {
                    guidance_scale: f64::NAN,
                    ..request(guidance)
                },
                "guidance scale must be a finite number, got NaN",
            ),
            (
                GenerateRequest {
                    guidance_scale: f64::INFINITY,
                    ..request(guidance)
                },
                "got inf",
            ),
            (
                GenerateRequest {
                    eta: f64::NAN,
                    ..request(guidance)
                },
                "eta must be a number from 0",
            ),
            (
                GenerateRequest {
                    eta: -1.0,
                    ..request(guidance)
                },
                "got -1",
            ),
        ] {
            let err = refusal(&mut auto, &req);
            assert!(err.contains(needle), "{fixture}: {needle:?} not in {err:?}");
        }
    }
}

/// The golden edit input and its mask (the same size).
fn edit_inputs() -> (image::DynamicImage, image::DynamicImage) {
    let golden = common::fixtures().join("golden");
    let image = image::open(golden.join("img2img-input.png")).unwrap();
    let mask = image::open(golden.join("inpaint-mask.png")).unwrap();
    (image, mask)
}

#[test]
fn auto_image2image_runs_each_familys_pipeline_with_its_defaults() {
    let device = Default::default();
    let (image, _) = edit_inputs();
    let cases = [
        (
            "tiny-sd1",
            PipelineFamily::StableDiffusion,
            "StableDiffusionImg2ImgPipeline",
            PipelineDefaults::STABLE_DIFFUSION_IMG2IMG,
        ),
        (
            "tiny-sdxl",
            PipelineFamily::StableDiffusionXL,
            "StableDiffusionXLImg2ImgPipeline",
            PipelineDefaults::STABLE_DIFFUSION_XL_IMG2IMG,
        ),
    ];
    for (fixture, family, class, defaults) in cases {
        let dir = model_dir(fixture);
        let mut auto =
            AutoPipelineForImage2Image::<B>::from_dir(&dir, &LoadOptions::default(), &device)
                .unwrap();
        assert_eq!(
            (auto.family(), auto.pipeline_class(), auto.defaults()),
            (family, class, defaults),
            "{fixture}"
        );
        let req = GenerateRequest {
            num_inference_steps: 4,
            ..request(defaults.guidance_scale)
        };
        let ours = auto
            .generate_with(
                &req,
                &EditOptions::default(),
                &image,
                &mut TorchCpuGenerator::new(req.seed),
                |_| {},
            )
            .unwrap();
        // The concrete pipeline at diffusers' default strength.
        let strength = defaults.strength.unwrap();
        let mut generator = TorchCpuGenerator::new(req.seed);
        let theirs = match family {
            PipelineFamily::StableDiffusion => StableDiffusionImg2ImgPipeline::<B>::from_dir(
                &dir,
                &LoadOptions::default(),
                &device,
            )
            .unwrap()
            .generate_with(&req, &image, strength, &mut generator, |_| {}),
            _ => StableDiffusionXLImg2ImgPipeline::<B>::from_dir(
                &dir,
                &LoadOptions::default(),
                &device,
            )
            .unwrap()
            .generate_with(
                &XlRequest::new(req.clone()),
                &XlEditOptions {
                    strength,
                    ..Default::default()
                },
                XlInitImage::Image(&image),
                &mut generator,
                |_| {},
            ),
        }
        .unwrap();
        assert_eq!(to_vec(ours.latents), to_vec(theirs.latents), "{fixture}");
    }
}

#[test]
fn auto_inpainting_runs_each_familys_pipeline_with_its_defaults() {
    let device = Default::default();
    let (image, mask) = edit_inputs();
    let options = EditOptions {
        strength: Some(0.75),
        ..Default::default()
    };
    let cases = [
        (
            "tiny-sd1-inpaint",
            PipelineFamily::StableDiffusion,
            "StableDiffusionInpaintPipeline",
            PipelineDefaults::STABLE_DIFFUSION_INPAINT,
        ),
        (
            "tiny-sdxl",
            PipelineFamily::StableDiffusionXL,
            "StableDiffusionXLInpaintPipeline",
            PipelineDefaults::STABLE_DIFFUSION_XL_INPAINT,
        ),
    ];
    for (fixture, family, class, defaults) in cases {
        let dir = model_dir(fixture);
        let mut auto =
            AutoPipelineForInpainting::<B>::from_dir(&dir, &LoadOptions::default(), &device)
                .unwrap();
        assert_eq!(
            (auto.family(), auto.pipeline_class(), auto.defaults()),
            (family, class, defaults),
            "{fixture}"
        );
        assert_eq!(
            auto.default_request().guidance_scale,
            defaults.guidance_scale
        );
        let req = GenerateRequest {
            num_inference_steps: 4,
            ..request(defaults.guidance_scale)
        };
        let ours = auto
            .generate_with(
                &req,
                &options,
                &image,
                &mask,
                &mut TorchCpuGenerator::new(req.seed),
                |_| {},
            )
            .unwrap();
        let mut generator = TorchCpuGenerator::new(req.seed);
        let theirs = match family {
            PipelineFamily::StableDiffusion => StableDiffusionInpaintPipeline::<B>::from_dir(
                &dir,
                &LoadOptions::default(),
                &device,
            )
            .unwrap()
            .generate_with(&req, &image, &mask, 0.75, &mut generator, |_| {}),
            _ => StableDiffusionXLInpaintPipeline::<B>::from_dir(
                &dir,
                &LoadOptions::default(),
                &device,
            )
            .unwrap()
            .generate_with(
                &XlRequest::new(req.clone()),
                &XlEditOptions {
                    strength: 0.75,
                    ..XlEditOptions::inpainting()
                },
                &image,
                &mask,
                &mut generator,
                |_| {},
            ),
        }
        .unwrap();
        assert_eq!(to_vec(ours.latents), to_vec(theirs.latents), "{fixture}");
    }
}

#[test]
fn auto_editing_refuses_other_families_and_options_the_pipeline_does_not_take() {
    let device = Default::default();
    let (image, mask) = edit_inputs();
    // A Flux folder: named, with the classes that edit, before any weight is read.
    let err = AutoPipelineForImage2Image::<B>::from_dir(
        &model_dir("tiny-flux-dev"),
        &LoadOptions::default(),
        &device,
    )
    .err()
    .map(|e| e.to_string())
    .unwrap_or_default();
    assert!(
        err.contains("FluxPipeline")
            && err.contains("cannot do image to image")
            && err.contains("StableDiffusionXLImg2ImgPipeline"),
        "{err}"
    );
    let err = AutoPipelineForInpainting::<B>::from_dir(
        &model_dir("tiny-sd3"),
        &LoadOptions::default(),
        &device,
    )
    .err()
    .map(|e| e.to_string())
    .unwrap_or_default();
    assert!(err.contains("cannot do inpainting"), "{err}");

    let req = request(7.5);
    let mut img2img = AutoPipelineForImage2Image::<B>::from_dir(
        &model_dir("tiny-sd1"),
        &LoadOptions::default(),
        &device,
    )
    .unwrap();
    let refused = [
        EditOptions {
            aesthetic_score: 7.0,
            ..Default::default()
        },
        EditOptions {
            padding_mask_crop: Some(8),
            ..Default::default()
        },
        EditOptions {
            strength: Some(1.5),
            ..Default::default()
        },
    ];
    for options in &refused {
        let result = img2img.generate_with(
            &req,
            options,
            &image,
            &mut TorchCpuGenerator::new(0),
            |_| {},
        );
        assert!(
            matches!(result, Err(PipelineError::InvalidInput(_))),
            "{options:?}: {:?}",
            result.err()
        );
    }
    let mut inpaint = AutoPipelineForInpainting::<B>::from_dir(
        &model_dir("tiny-sd1"),
        &LoadOptions::default(),
        &device,
    )
    .unwrap();
    let err = inpaint
        .generate_with(
            &req,
            &refused[0],
            &image,
            &mask,
            &mut TorchCpuGenerator::new(0),
            |_| {},
        )
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.contains("aesthetic scores apply to SDXL refiners"),
        "{err}"
    );
}
