//! SDXL image to image, inpainting and the base-to-refiner handoff against diffusers on
//! tiny-sdxl (`tools/golden/make_inpaint.py`): per-step latents and float images within 1e-4
//! relative, PNGs within 2 levels; the refiner is a folder with `requires_aesthetics_score` and
//! a UNet taking 5 time ids, and also stabilityai's layout with only `text_encoder_2`
//! (`tools/golden/make_refiner.py`). Bad input (strength, `denoising_start`, mask size, a refiner UNet
//! without `requires_aesthetics_score`) is a clear error.

mod common;

use std::cell::RefCell;

use burn::tensor::Tensor;
use common::golden_run::{check_run, TOL};
use common::{assert_close, copy_dir, fixtures, model_dir, to_vec, Golden, B};
use oxidiff::pipelines::image::{load_image, load_mask};
use oxidiff::pipelines::{
    GenerateRequest, LoadOptions, OutputType, StableDiffusionXLImg2ImgPipeline,
    StableDiffusionXLInpaintPipeline, StableDiffusionXLPipeline, XlEditOptions, XlInitImage,
    XlOptions, XlRequest,
};
use oxidiff::schedulers::TorchCpuGenerator;

fn golden() -> Golden {
    Golden::load("inpaint")
}

fn request(golden: &Golden) -> GenerateRequest<B> {
    let s = &golden.json["settings"];
    GenerateRequest {
        prompts: vec![s["prompt"].as_str().unwrap().into()],
        negative_prompts: vec![s["negative_prompt"].as_str().unwrap().into()],
        num_inference_steps: s["num_inference_steps"].as_u64().unwrap() as usize,
        guidance_scale: s["xl_guidance_scale"].as_f64().unwrap(),
        seed: s["seed"].as_u64().unwrap(),
        ..Default::default()
    }
}

fn strength(golden: &Golden, case: &str) -> f64 {
    golden.json["settings"]["strength"][case].as_f64().unwrap()
}

fn input_image() -> image::DynamicImage {
    load_image(&fixtures().join("golden/img2img-input.png")).unwrap()
}

type Steps = RefCell<Vec<(f64, Tensor<B, 4>)>>;

fn recorder(steps: &Steps) -> impl FnMut(oxidiff::pipelines::StepInfo<'_, B>) + '_ {
    |info| {
        steps
            .borrow_mut()
            .push((info.timestep, info.latents.clone()))
    }
}

/// tiny-sdxl with the refiner UNet (5 time ids) as a refiner folder: class
/// `StableDiffusionXLImg2ImgPipeline`, `requires_aesthetics_score` as given.
fn refiner_folder(requires_aesthetics_score: bool) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&model_dir("tiny-sdxl"), dir.path());
    let unet = dir.path().join("unet");
    std::fs::remove_dir_all(&unet).unwrap();
    copy_dir(&fixtures().join("tiny-sdxl-refiner-unet"), &unet);
    let index_path = dir.path().join("model_index.json");
    let mut index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index_path).unwrap()).unwrap();
    index["_class_name"] = "StableDiffusionXLImg2ImgPipeline".into();
    index["requires_aesthetics_score"] = requires_aesthetics_score.into();
    std::fs::write(&index_path, index.to_string()).unwrap();
    dir
}

#[test]
fn sdxl_img2img_matches_diffusers() {
    let golden = golden();
    let mut pipe = StableDiffusionXLImg2ImgPipeline::<B>::from_dir(
        &model_dir("tiny-sdxl"),
        &LoadOptions::default(),
        &Default::default(),
    )
    .unwrap();
    let req = request(&golden);
    let edit = XlEditOptions {
        strength: strength(&golden, "xl-img2img"),
        ..Default::default()
    };
    let image = input_image();
    let steps = RefCell::new(Vec::new());
    let mut generator = TorchCpuGenerator::new(req.seed);
    let out = pipe
        .generate_with(
            &XlRequest::new(req.clone()),
            &edit,
            XlInitImage::Image(&image),
            &mut generator,
            recorder(&steps),
        )
        .unwrap();
    check_run(
        &golden,
        "xl-img2img",
        steps.into_inner(),
        out.images.unwrap(),
    );
}

fn sdxl_inpaint(case: &str, nine_channels: bool) {
    let golden = golden();
    let mut pipe = StableDiffusionXLInpaintPipeline::<B>::from_dir(
        &model_dir("tiny-sdxl"),
        &LoadOptions::default(),
        &Default::default(),
    )
    .unwrap();
    if nine_channels {
        pipe.pipe.unet = oxidiff::models::UNet2DConditionModel::from_dir(
            &fixtures().join("tiny-sdxl-inpaint-unet"),
            None,
            &Default::default(),
        )
        .unwrap();
    }
    assert_eq!(pipe.unet_in_channels(), if nine_channels { 9 } else { 4 });
    let req = request(&golden);
    let edit = XlEditOptions {
        strength: strength(&golden, "xl-inpaint"),
        ..Default::default()
    };
    let image = input_image();
    let mask = load_mask(&fixtures().join("golden/inpaint-mask.png")).unwrap();
    let steps = RefCell::new(Vec::new());
    let mut generator = TorchCpuGenerator::new(req.seed);
    let out = pipe
        .generate_with(
            &XlRequest::new(req.clone()),
            &edit,
            &image,
            &mask,
            &mut generator,
            recorder(&steps),
        )
        .unwrap();
    check_run(&golden, case, steps.into_inner(), out.images.unwrap());
}

#[test]
fn sdxl_inpaint_masked_latents_matches_diffusers() {
    sdxl_inpaint("xl-inpaint", false);
}

#[test]
fn sdxl_inpaint_nine_channel_unet_matches_diffusers() {
    sdxl_inpaint("xl9-inpaint", true);
}

/// diffusers adds one evaluation for second-order schedulers so that `denoising_start` never
/// splits a Heun step: 5 of Heun's 7 timesteps run from 0.5.
#[test]
fn heun_refiner_from_denoising_start_matches_diffusers() {
    let golden = golden();
    let refiner_settings = &golden.json["settings"]["refiner"];
    let folder = refiner_folder(true);
    let options = LoadOptions {
        scheduler: Some("heun".into()),
        ..Default::default()
    };
    let mut refiner = StableDiffusionXLImg2ImgPipeline::<B>::from_dir(
        folder.path(),
        &options,
        &Default::default(),
    )
    .unwrap();
    let edit = XlEditOptions {
        denoising_start: Some(refiner_settings["denoising_end"].as_f64().unwrap()),
        aesthetic_score: refiner_settings["aesthetic_score"].as_f64().unwrap(),
        negative_aesthetic_score: refiner_settings["negative_aesthetic_score"]
            .as_f64()
            .unwrap(),
        ..Default::default()
    };
    let req = request(&golden);
    let steps = RefCell::new(Vec::new());
    let mut generator = TorchCpuGenerator::new(req.seed);
    let out = refiner
        .generate_with(
            &XlRequest::new(req.clone()),
            &edit,
            XlInitImage::Latents(golden.tensor("xl-base.latents")),
            &mut generator,
            recorder(&steps),
        )
        .unwrap();
    check_run(
        &golden,
        "xl-refiner-heun",
        steps.into_inner(),
        out.images.unwrap(),
    );
}

#[test]
fn base_denoising_end_hands_latents_to_the_refiner_as_diffusers() {
    let golden = golden();
    let refiner_settings = &golden.json["settings"]["refiner"];
    let split = refiner_settings["denoising_end"].as_f64().unwrap();
    let req = request(&golden);

    let mut base = StableDiffusionXLPipeline::<B>::from_dir(
        &model_dir("tiny-sdxl"),
        &LoadOptions::default(),
        &Default::default(),
    )
    .unwrap();
    let base_req = GenerateRequest {
        width: Some(64),
        height: Some(64),
        output: OutputType::Latents,
        ..req.clone()
    };
    let base_req = XlRequest {
        common: base_req,
        xl: XlOptions {
            denoising_end: Some(split),
            ..Default::default()
        },
    };
    let steps = RefCell::new(Vec::new());
    let mut generator = TorchCpuGenerator::new(req.seed);
    let handoff = base
        .generate_with(&base_req, &mut generator, recorder(&steps))
        .unwrap();
    assert!(handoff.images.is_none());
    let steps = steps.into_inner();
    assert_eq!(steps.len(), 2, "denoising_end 0.5 keeps 2 of 4 steps");
    for (i, (_, latents)) in steps.into_iter().enumerate() {
        assert_close(&golden, &format!("xl-base.step{i}"), latents, TOL);
    }
    assert_close(&golden, "xl-base.latents", handoff.latents.clone(), TOL);

    let folder = refiner_folder(true);
    let mut refiner = StableDiffusionXLImg2ImgPipeline::<B>::from_dir(
        folder.path(),
        &LoadOptions::default(),
        &Default::default(),
    )
    .unwrap();
    assert!(refiner.pipe.requires_aesthetics_score);
    let edit = XlEditOptions {
        denoising_start: Some(split),
        aesthetic_score: refiner_settings["aesthetic_score"].as_f64().unwrap(),
        negative_aesthetic_score: refiner_settings["negative_aesthetic_score"]
            .as_f64()
            .unwrap(),
        ..Default::default()
    };
    let steps = RefCell::new(Vec::new());
    let mut generator = TorchCpuGenerator::new(req.seed);
    let out = refiner
        .generate_with(
            &XlRequest::new(req.clone()),
            &edit,
            XlInitImage::Latents(handoff.latents),
            &mut generator,
            recorder(&steps),
        )
        .unwrap();
    check_run(
        &golden,
        "xl-refiner",
        steps.into_inner(),
        out.images.unwrap(),
    );
}

#[test]
fn bad_edits_and_a_refiner_unet_without_aesthetics_are_errors() {
    let golden = golden();
    let req = request(&golden);
    let image = input_image();
    let mask = load_mask(&fixtures().join("golden/inpaint-mask.png")).unwrap();
    let mut pipe = StableDiffusionXLInpaintPipeline::<B>::from_dir(
        &model_dir("tiny-sdxl"),
        &LoadOptions::default(),
        &Default::default(),
    )
    .unwrap();
    let req = XlRequest::new(req);
    for strength in [0.0, 1.01, f64::NAN] {
        let edit = XlEditOptions {
            strength,
            ..Default::default()
        };
        let err = pipe
            .generate(&req, &edit, &image, &mask)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("strength must be in (0, 1]"),
            "{strength}: {err}"
        );
    }
    let small = mask.crop_imm(0, 0, 64, 56);
    let err = pipe
        .generate(&req, &XlEditOptions::default(), &image, &small)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("the mask is 64x56 but the image is 64x64"),
        "{err}"
    );

    let mut img2img = StableDiffusionXLImg2ImgPipeline::from(pipe.pipe);
    let cases = [
        (Some(1.0), None, "denoising_start must be in (0, 1)"),
        (Some(0.6), Some(0.5), "must be below denoising_end"),
    ];
    for (start, end, expected) in cases {
        let edit = XlEditOptions {
            denoising_start: start,
            ..Default::default()
        };
        let mut req = req.clone();
        req.xl.denoising_end = end;
        let err = img2img
            .generate(&req, &edit, XlInitImage::Image(&image))
            .unwrap_err()
            .to_string();
        assert!(err.contains(expected), "{start:?} {end:?}: {err}");
    }

    let folder = refiner_folder(false);
    let err = StableDiffusionXLImg2ImgPipeline::<B>::from_dir(
        folder.path(),
        &LoadOptions::default(),
        &Default::default(),
    )
    .err()
    .expect("a 5-time-id UNet without requires_aesthetics_score is refused")
    .to_string();
    assert!(err.contains("requires_aesthetics_score"), "{err}");
}

/// `tests/fixtures/tiny-sdxl-refiner` copied into a temp folder with `model_index.json` edited
/// by `edit` (symlinked components are copied as folders).
fn edited_refiner(edit: impl FnOnce(&mut serde_json::Value)) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&model_dir("tiny-sdxl-refiner"), dir.path());
    let index_path = dir.path().join("model_index.json");
    let mut index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index_path).unwrap()).unwrap();
    edit(&mut index);
    std::fs::write(&index_path, index.to_string()).unwrap();
    dir
}

/// stabilityai's refiner layout (`text_encoder`/`tokenizer` `[null, null]`, only
/// `text_encoder_2`) against diffusers (`tools/golden/make_refiner.py`), continuing the base's
/// `denoising_end` latents and from an image: the context is text_encoder_2's penultimate
/// states alone.
#[test]
fn refiner_without_the_first_text_encoder_matches_diffusers() {
    let golden = Golden::load("refiner");
    let inpaint = self::golden();
    let settings = &golden.json["settings"];
    let refiner_settings = &settings["refiner"];
    let mut refiner = StableDiffusionXLImg2ImgPipeline::<B>::from_dir(
        &model_dir("tiny-sdxl-refiner"),
        &LoadOptions::default(),
        &Default::default(),
    )
    .unwrap();
    assert!(refiner.pipe.text_encoder.is_none() && refiner.pipe.tokenizer.is_none());
    assert!(refiner.pipe.requires_aesthetics_score);
    let scores = XlEditOptions {
        aesthetic_score: refiner_settings["aesthetic_score"].as_f64().unwrap(),
        negative_aesthetic_score: refiner_settings["negative_aesthetic_score"]
            .as_f64()
            .unwrap(),
        ..Default::default()
    };
    let (data, shape) = inpaint.host("xl-base.latents");
    let handoff = Tensor::<B, 4>::from_data(
        burn::tensor::TensorData::new(data, [shape[0], shape[1], shape[2], shape[3]]),
        &Default::default(),
    );
    let image = input_image();
    let cases = [
        (
            "xl-refiner-te2",
            XlEditOptions {
                denoising_start: Some(refiner_settings["denoising_end"].as_f64().unwrap()),
                ..scores.clone()
            },
            XlInitImage::Latents(handoff),
        ),
        (
            "xl-refiner-te2-image",
            XlEditOptions {
                strength: settings["strength"].as_f64().unwrap(),
                ..scores.clone()
            },
            XlInitImage::Image(&image),
        ),
    ];
    for (case, edit, init) in cases {
        let steps = RefCell::new(Vec::new());
        let mut generator = TorchCpuGenerator::new(request(&golden).seed);
        let out = refiner
            .generate_with(
                &XlRequest::new(request(&golden)),
                &edit,
                init,
                &mut generator,
                recorder(&steps),
            )
            .unwrap();
        check_run(&golden, case, steps.into_inner(), out.images.unwrap());
    }
}

/// `LoadOptions::dtype` casts the refiner's components (there is no first encoder to cast).
#[test]
fn refiner_without_the_first_text_encoder_casts_to_bf16() {
    use burn::tensor::FloatDType;
    let options = LoadOptions {
        dtype: Some(FloatDType::BF16),
        ..Default::default()
    };
    let mut refiner = StableDiffusionXLImg2ImgPipeline::<B>::from_dir(
        &model_dir("tiny-sdxl-refiner"),
        &options,
        &Default::default(),
    )
    .unwrap();
    let pipe = &refiner.pipe;
    for weight in [
        pipe.text_encoder_2.token_embedding.weight.val().dtype(),
        pipe.unet.conv_in.weight.val().dtype(),
        pipe.vae.decoder.conv_in.weight.val().dtype(),
    ] {
        assert_eq!(
            FloatDType::from(weight),
            FloatDType::BF16,
            "weights not cast"
        );
    }
    // make_refiner.py's `xl-refiner-te2-image` request, which make_half.py ran in bf16 too.
    let golden = Golden::load("refiner");
    let settings = &golden.json["settings"];
    let edit = XlEditOptions {
        strength: settings["strength"].as_f64().unwrap(),
        aesthetic_score: settings["refiner"]["aesthetic_score"].as_f64().unwrap(),
        negative_aesthetic_score: settings["refiner"]["negative_aesthetic_score"]
            .as_f64()
            .unwrap(),
        ..Default::default()
    };
    let out = refiner
        .generate(
            &XlRequest::new(request(&golden)),
            &edit,
            XlInitImage::Image(&input_image()),
        )
        .unwrap();
    let ours = out.images.unwrap().data;
    let (f32_image, _) = golden.host("xl-refiner-te2-image.image");
    let from_f32 = common::relative_error(&ours, &f32_image);
    assert!(
        from_f32 > 0.0,
        "bf16 refiner image equals f32: not computed in bf16"
    );
    // diffusers' own bf16 run of the request, within the bound derived from its distance to
    // its f32 run (tests/common/half.rs).
    use common::half::{DiffusersHalf, HalfBound};
    let half = DiffusersHalf::load();
    for (part, values) in [("latents", to_vec(out.latents)), ("image", ours)] {
        let err = common::relative_error(&values, &half.values("sdxl-refiner", "bf16", part));
        let bound = half.bound("sdxl-refiner", "bf16", part, HalfBound::FromF32Distance);
        eprintln!("bf16 refiner {part}: {err:e} from diffusers' bf16 (bound {bound:e})");
        assert!(
            err <= bound,
            "bf16 refiner {part}: {err:e} from diffusers' bf16 run exceeds {bound:e}"
        );
    }
    eprintln!("bf16 refiner image: {from_f32:e} from diffusers' f32");
}

#[test]
fn refiner_without_the_first_text_encoder_rejects_what_needs_it() {
    // A LoRA with `text_encoder` layers: an error naming them; the pipeline is unchanged.
    let mut refiner = StableDiffusionXLPipeline::<B>::from_dir(
        &model_dir("tiny-sdxl-refiner"),
        &LoadOptions::default(),
        &Default::default(),
    )
    .unwrap();
    for file in [
        "tiny-sdxl-peft.safetensors",
        "tiny-sdxl-kohya-sgm.safetensors",
    ] {
        let err = refiner
            .load_lora(fixtures().join("lora").join(file), 1.0)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("layers for text_encoder (") && err.contains("without a first text"),
            "{file}: {err}"
        );
    }

    // `text_encoder` absent but `tokenizer` listed: which prompt goes where is ambiguous.
    let folder = edited_refiner(|index| {
        index["tokenizer"] = serde_json::json!(["transformers", "CLIPTokenizer"]);
    });
    let err = StableDiffusionXLImg2ImgPipeline::<B>::from_dir(
        folder.path(),
        &LoadOptions::default(),
        &Default::default(),
    )
    .err()
    .expect("a tokenizer without its text encoder is refused")
    .to_string();
    assert!(err.contains("must both be listed"), "{err}");

    // A UNet whose context width needs both encoders (the two-encoder refiner UNet).
    let folder = edited_refiner(|_| {});
    let unet = folder.path().join("unet");
    std::fs::remove_dir_all(&unet).unwrap();
    copy_dir(&fixtures().join("tiny-sdxl-refiner-unet"), &unet);
    let err = StableDiffusionXLImg2ImgPipeline::<B>::from_dir(
        folder.path(),
        &LoadOptions::default(),
        &Default::default(),
    )
    .err()
    .expect("a UNet for two encoders on one is refused")
    .to_string();
    assert!(
        err.contains("`cross_attention_dim` is 16") && err.contains("has no text_encoder"),
        "{err}"
    );
}
