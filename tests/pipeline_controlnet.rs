//! `StableDiffusionControlNetPipeline` against diffusers' (tools/golden/make_controlnet.py), and
//! `StableDiffusionXLControlNetPipeline` (make_controlnet_sdxl.py):
//! one ControlNet, two with guidance windows, guess mode, image to image and inpainting, each
//! within 2 PNG levels; the control
//! really changes the image; bad input (a ControlNet of another base model, control images not
//! matching the ControlNets, bad windows) is refused before anything runs.

mod common;

use common::{assert_png_close, fixtures, model_dir, png_level_diff, B};
use oxidiff::models::ControlNetModel;
use oxidiff::pipelines::{
    Control, ControlRequest, FluxControlNetPipeline, FluxRequest, GenerateRequest, InpaintOptions,
    LoadOptions, Sd3Request, StableDiffusion3ControlNetPipeline,
    StableDiffusionControlNetImg2ImgPipeline, StableDiffusionControlNetInpaintPipeline,
    StableDiffusionControlNetPipeline, StableDiffusionPipeline,
    StableDiffusionXLControlNetImg2ImgPipeline, StableDiffusionXLControlNetInpaintPipeline,
    StableDiffusionXLControlNetPipeline, StableDiffusionXLPipeline, XlEditOptions, XlInitImage,
    XlRequest,
};

fn request() -> GenerateRequest<B> {
    GenerateRequest {
        prompts: vec!["a photo of an astronaut riding a horse".into()],
        negative_prompts: vec!["blurry".into()],
        num_inference_steps: 4,
        guidance_scale: 7.5,
        seed: 42,
        ..Default::default()
    }
}

fn control_image() -> image::DynamicImage {
    image::open(fixtures().join("golden").join("controlnet-input.png")).unwrap()
}

fn pipeline(nets: &[&str]) -> StableDiffusionControlNetPipeline<B> {
    let dirs: Vec<_> = nets.iter().map(|n| model_dir(n)).collect();
    let refs: Vec<&std::path::Path> = dirs.iter().map(|d| d.as_path()).collect();
    StableDiffusionControlNetPipeline::<B>::from_dir(
        &model_dir("tiny-sd1"),
        &refs,
        &LoadOptions::default(),
        &Default::default(),
    )
    .unwrap()
}

fn run(
    pipe: &mut StableDiffusionControlNetPipeline<B>,
    control: &ControlRequest,
) -> image::RgbImage {
    let out = pipe.generate(&request(), control).unwrap();
    out.images.unwrap().to_rgb8(0).unwrap()
}

#[test]
fn one_controlnet_matches_diffusers_and_changes_the_image() {
    let mut pipe = pipeline(&["tiny-controlnet-sd1"]);
    let control = ControlRequest {
        controls: vec![Control::new(control_image())],
        guess_mode: false,
    };
    let ours = run(&mut pipe, &control);
    assert_png_close(&ours, "controlnet-sd1-single.png", 2);
    // The same request without ControlNet is another image.
    let plain = StableDiffusionControlNetPipeline::into_inner(pipe)
        .generate(&GenerateRequest {
            width: Some(64),
            height: Some(64),
            ..request()
        })
        .unwrap()
        .images
        .unwrap()
        .to_rgb8(0)
        .unwrap();
    assert!(png_level_diff(&plain, &ours) > 10);
}

#[test]
fn two_controlnets_with_guidance_windows_and_guess_mode_match_diffusers() {
    let mut pipe = pipeline(&["tiny-controlnet-sd1", "tiny-controlnet-sd1-b"]);
    let image = control_image();
    let control = ControlRequest {
        controls: vec![
            Control {
                scale: 0.8,
                guidance_start: 0.0,
                guidance_end: 0.75,
                ..Control::new(image.clone())
            },
            Control {
                scale: 0.5,
                guidance_start: 0.25,
                guidance_end: 1.0,
                ..Control::new(image.clone())
            },
        ],
        guess_mode: false,
    };
    assert_png_close(&run(&mut pipe, &control), "controlnet-sd1-multi.png", 2);

    let mut one = pipeline(&["tiny-controlnet-sd1"]);
    let guess = ControlRequest {
        controls: vec![Control {
            scale: 0.9,
            ..Control::new(image)
        }],
        guess_mode: true,
    };
    assert_png_close(&run(&mut one, &guess), "controlnet-sd1-guess.png", 2);
}

#[test]
fn controlnets_of_another_model_and_bad_controls_are_refused() {
    let device = Default::default();
    // tiny-sd2's UNet has one layer per block: the residuals do not fit.
    let sd2 = StableDiffusionPipeline::<B>::from_dir(
        &model_dir("tiny-sd2"),
        &LoadOptions::default(),
        &device,
    )
    .unwrap();
    let net =
        ControlNetModel::<B>::from_dir(&model_dir("tiny-controlnet-sd1"), None, &device).unwrap();
    let err = StableDiffusionControlNetPipeline::new(sd2, vec![net])
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.contains("made for another base model") && err.contains("skip connections"),
        "{err}"
    );

    let mut pipe = pipeline(&["tiny-controlnet-sd1"]);
    let image = control_image();
    let bad = [
        (
            ControlRequest {
                controls: vec![Control::new(image.clone()), Control::new(image.clone())],
                guess_mode: false,
            },
            "2 control images for 1 ControlNets",
        ),
        (ControlRequest::default(), "0 control images"),
        (
            ControlRequest {
                controls: vec![Control {
                    guidance_end: 1.5,
                    ..Control::new(image.clone())
                }],
                guess_mode: false,
            },
            "must lie in [0, 1]",
        ),
        (
            ControlRequest {
                controls: vec![Control {
                    guidance_start: 0.6,
                    guidance_end: 0.4,
                    ..Control::new(image.clone())
                }],
                guess_mode: false,
            },
            "must be below its end",
        ),
    ];
    for (control, needle) in bad {
        let err = pipe
            .generate(&request(), &control)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains(needle), "{needle}: {err}");
    }
}

#[test]
fn controlnet_img2img_and_inpaint_match_diffusers() {
    let golden = fixtures().join("golden");
    let init = image::open(golden.join("img2img-input.png")).unwrap();
    let mask = image::open(golden.join("inpaint-mask.png")).unwrap();
    let control = ControlRequest {
        controls: vec![Control {
            scale: 0.8,
            guidance_end: 0.8,
            ..Control::new(control_image())
        }],
        guess_mode: false,
    };
    let mut img2img =
        StableDiffusionControlNetImg2ImgPipeline::from(pipeline(&["tiny-controlnet-sd1"]));
    let out = img2img.generate(&request(), &init, 0.75, &control).unwrap();
    assert_png_close(
        &out.images.unwrap().to_rgb8(0).unwrap(),
        "controlnet-sd1-img2img.png",
        2,
    );
    let mut inpaint = StableDiffusionControlNetInpaintPipeline::from(img2img.pipe);
    let options = InpaintOptions {
        strength: 0.75,
        padding_mask_crop: None,
    };
    let out = inpaint
        .generate(&request(), &init, &mask, &options, &control)
        .unwrap();
    assert_png_close(
        &out.images.unwrap().to_rgb8(0).unwrap(),
        "controlnet-sd1-inpaint.png",
        2,
    );
}

/// `StableDiffusionXLControlNetPipeline` on tiny-sdxl with the ControlNets of
/// tools/golden/make_controlnet_sdxl.py (the control image and prompt above, guidance 5.0).
fn xl_run(nets: &[&str], control: &ControlRequest) -> image::RgbImage {
    let dirs: Vec<_> = nets.iter().map(|n| model_dir(n)).collect();
    let refs: Vec<&std::path::Path> = dirs.iter().map(|d| d.as_path()).collect();
    let mut pipe = StableDiffusionXLControlNetPipeline::<B>::from_dir(
        &model_dir("tiny-sdxl"),
        &refs,
        &LoadOptions::default(),
        &Default::default(),
    )
    .unwrap();
    let request = XlRequest::new(GenerateRequest {
        guidance_scale: 5.0,
        ..request()
    });
    let out = pipe.generate(&request, control).unwrap();
    out.images.unwrap().to_rgb8(0).unwrap()
}

#[test]
fn sdxl_controlnets_with_windows_and_guess_mode_match_diffusers() {
    let image = control_image();
    let single = ControlRequest {
        controls: vec![Control::new(image.clone())],
        guess_mode: false,
    };
    let ours = xl_run(&["tiny-controlnet-sdxl"], &single);
    assert_png_close(&ours, "controlnet-sdxl-single.png", 2);
    let multi = ControlRequest {
        controls: vec![
            Control {
                scale: 0.8,
                guidance_start: 0.0,
                guidance_end: 0.75,
                ..Control::new(image.clone())
            },
            Control {
                scale: 0.5,
                guidance_start: 0.25,
                guidance_end: 1.0,
                ..Control::new(image.clone())
            },
        ],
        guess_mode: false,
    };
    let two = xl_run(&["tiny-controlnet-sdxl", "tiny-controlnet-sdxl-b"], &multi);
    assert_png_close(&two, "controlnet-sdxl-multi.png", 2);
    let guess = ControlRequest {
        controls: vec![Control {
            scale: 0.9,
            ..Control::new(image)
        }],
        guess_mode: true,
    };
    let guessed = xl_run(&["tiny-controlnet-sdxl"], &guess);
    assert_png_close(&guessed, "controlnet-sdxl-guess.png", 2);
    assert!(png_level_diff(&ours, &guessed) > 10);
}

#[test]
fn an_sd1_controlnet_is_refused_by_sdxl_and_an_sdxl_one_by_sd1() {
    let device = Default::default();
    let sd1_net =
        ControlNetModel::<B>::from_dir(&model_dir("tiny-controlnet-sd1"), None, &device).unwrap();
    let xl = StableDiffusionXLPipeline::<B>::from_dir(
        &model_dir("tiny-sdxl"),
        &LoadOptions::default(),
        &device,
    )
    .unwrap();
    let err = StableDiffusionXLControlNetPipeline::new(xl, vec![sd1_net])
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("ControlNet 0"), "{err}");
    let xl_net =
        ControlNetModel::<B>::from_dir(&model_dir("tiny-controlnet-sdxl"), None, &device).unwrap();
    let sd1 = StableDiffusionPipeline::<B>::from_dir(
        &model_dir("tiny-sd1"),
        &LoadOptions::default(),
        &device,
    )
    .unwrap();
    let err = StableDiffusionControlNetPipeline::new(sd1, vec![xl_net])
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("ControlNet 0"), "{err}");
}

#[test]
fn sdxl_controlnet_img2img_and_inpaint_match_diffusers() {
    let golden = fixtures().join("golden");
    let init = image::open(golden.join("img2img-input.png")).unwrap();
    let mask = image::open(golden.join("inpaint-mask.png")).unwrap();
    let control = ControlRequest {
        controls: vec![Control {
            scale: 0.8,
            guidance_end: 0.8,
            ..Control::new(control_image())
        }],
        guess_mode: false,
    };
    let net = model_dir("tiny-controlnet-sdxl");
    let pipe = StableDiffusionXLControlNetPipeline::<B>::from_dir(
        &model_dir("tiny-sdxl"),
        &[net.as_path()],
        &LoadOptions::default(),
        &Default::default(),
    )
    .unwrap();
    let request = XlRequest::new(GenerateRequest {
        guidance_scale: 5.0,
        ..request()
    });
    let edit = XlEditOptions {
        strength: 0.75,
        ..XlEditOptions::default()
    };
    let mut img2img = StableDiffusionXLControlNetImg2ImgPipeline::from(pipe);
    assert_eq!(img2img.default_edit().strength, 0.8);
    let out = img2img
        .generate(&request, &edit, XlInitImage::Image(&init), &control)
        .unwrap();
    assert_png_close(
        &out.images.unwrap().to_rgb8(0).unwrap(),
        "controlnet-sdxl-img2img.png",
        2,
    );
    // diffusers' SDXL ControlNet img2img has no denoising_start: refused, not ignored.
    let refiner_half = XlEditOptions {
        denoising_start: Some(0.5),
        ..edit.clone()
    };
    let err = img2img
        .generate(&request, &refiner_half, XlInitImage::Image(&init), &control)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("denoising_start"), "{err}");

    let mut inpaint = StableDiffusionXLControlNetInpaintPipeline::from(img2img.pipe);
    let out = inpaint
        .generate(&request, &edit, &init, &mask, &control)
        .unwrap();
    assert_png_close(
        &out.images.unwrap().to_rgb8(0).unwrap(),
        "controlnet-sdxl-inpaint.png",
        2,
    );
}

/// `StableDiffusion3ControlNetPipeline` on tiny-sd3 with the ControlNets of
/// tools/golden/make_controlnet_sd3.py (tiny-sd3's settings, seed 42 for both generators).
fn sd3_run(nets: &[&str], control: &ControlRequest) -> image::RgbImage {
    let dirs: Vec<_> = nets.iter().map(|n| model_dir(n)).collect();
    let refs: Vec<&std::path::Path> = dirs.iter().map(|d| d.as_path()).collect();
    let mut pipe = StableDiffusion3ControlNetPipeline::<B>::from_dir(
        &model_dir("tiny-sd3"),
        &refs,
        &LoadOptions::default(),
        &Default::default(),
    )
    .unwrap();
    let request = Sd3Request {
        common: GenerateRequest {
            prompts: vec!["A photo of an astronaut riding a horse on the moon".into()],
            negative_prompts: vec!["blurry, low quality".into()],
            num_inference_steps: 3,
            guidance_scale: 5.0,
            width: Some(48),
            height: Some(64),
            seed: 42,
            ..Default::default()
        },
        max_sequence_length: 24,
        ..Default::default()
    };
    let out = pipe.generate(&request, control).unwrap();
    out.images.unwrap().to_rgb8(0).unwrap()
}

#[test]
fn sd3_controlnets_match_diffusers() {
    let image = control_image();
    let scaled = |scale, guidance_start, guidance_end| Control {
        scale,
        guidance_start,
        guidance_end,
        ..Control::new(image.clone())
    };
    let one = |control| ControlRequest {
        controls: vec![control],
        guess_mode: false,
    };
    // InstantX-style (zero pooled projections, no VAE shift), then the prompt's pooled
    // projections and the shift.
    let single = sd3_run(&["tiny-controlnet-sd3"], &one(scaled(1.0, 0.0, 1.0)));
    assert_png_close(&single, "controlnet-sd3-single.png", 2);
    let b = sd3_run(&["tiny-controlnet-sd3-b"], &one(scaled(0.7, 0.0, 1.0)));
    assert_png_close(&b, "controlnet-sd3-single-b.png", 2);
    let multi = ControlRequest {
        controls: vec![scaled(0.8, 0.0, 0.7), scaled(0.5, 0.3, 1.0)],
        guess_mode: false,
    };
    let both = sd3_run(&["tiny-controlnet-sd3", "tiny-controlnet-sd3-b"], &multi);
    assert_png_close(&both, "controlnet-sd3-multi.png", 2);
    assert!(png_level_diff(&single, &b) > 10);
}

/// `FluxControlNetPipeline` on tiny-flux-dev with the ControlNets `nets` of
/// tools/golden/make_controlnet_flux.py and make_controlnet_flux_variants.py.
fn flux_pipe(nets: &[&str]) -> oxidiff::pipelines::Result<FluxControlNetPipeline<B>> {
    let dirs: Vec<_> = nets.iter().map(|n| model_dir(n)).collect();
    let refs: Vec<&std::path::Path> = dirs.iter().map(|d| d.as_path()).collect();
    FluxControlNetPipeline::<B>::from_dir(
        &model_dir("tiny-flux-dev"),
        &refs,
        &LoadOptions::default(),
        &Default::default(),
    )
}

/// The golden scripts' request: tiny-flux-dev's settings, seed 42.
fn flux_request() -> FluxRequest<B> {
    FluxRequest {
        common: GenerateRequest {
            prompts: vec!["A photo of an astronaut riding a horse on the moon".into()],
            num_inference_steps: 4,
            guidance_scale: 3.5,
            width: Some(96),
            height: Some(64),
            seed: 42,
            ..Default::default()
        },
        max_sequence_length: 24,
        ..Default::default()
    }
}

fn flux_run(nets: &[&str], control: &ControlRequest) -> image::RgbImage {
    let mut pipe = flux_pipe(nets).unwrap();
    let out = pipe.generate(&flux_request(), control).unwrap();
    out.images.unwrap().to_rgb8(0).unwrap()
}

#[test]
fn flux_controlnets_match_diffusers() {
    let image = control_image();
    let scaled = |scale, guidance_start, guidance_end| Control {
        scale,
        guidance_start,
        guidance_end,
        ..Control::new(image.clone())
    };
    let single = ControlRequest {
        controls: vec![scaled(0.9, 0.0, 1.0)],
        guess_mode: false,
    };
    let one = flux_run(&["tiny-controlnet-flux"], &single);
    assert_png_close(&one, "controlnet-flux-single.png", 2);
    let multi = ControlRequest {
        controls: vec![scaled(0.8, 0.0, 0.75), scaled(0.6, 0.25, 1.0)],
        guess_mode: false,
    };
    let two = flux_run(&["tiny-controlnet-flux", "tiny-controlnet-flux-b"], &multi);
    assert_png_close(&two, "controlnet-flux-multi.png", 2);
    assert!(png_level_diff(&one, &two) > 10);
}

/// A control of `image` at `scale` with `mode`, over the window [`start`, `end`].
fn moded(
    image: &image::DynamicImage,
    scale: f64,
    mode: Option<usize>,
    window: (f64, f64),
) -> Control {
    Control {
        scale,
        control_mode: mode,
        guidance_start: window.0,
        guidance_end: window.1,
        ..Control::new(image.clone())
    }
}

fn controls(controls: Vec<Control>) -> ControlRequest {
    ControlRequest {
        controls,
        guess_mode: false,
    }
}

/// InstantX's ControlNet-Union (tools/golden/make_controlnet_flux_variants.py): one mode, and
/// one Union serving two images with their own modes and windows (diffusers'
/// `FluxMultiControlNetModel` with one net), each within 2 PNG levels of diffusers; another
/// mode gives another image.
#[test]
fn flux_union_controlnet_matches_diffusers() {
    let image = control_image();
    let union = ["tiny-controlnet-flux-union"];
    let two = flux_run(
        &union,
        &controls(vec![moded(&image, 0.9, Some(2), (0.0, 1.0))]),
    );
    assert_png_close(&two, "controlnet-flux-union.png", 2);
    let multi = controls(vec![
        moded(&image, 0.8, Some(0), (0.0, 0.75)),
        moded(&image.fliph(), 0.6, Some(3), (0.25, 1.0)),
    ]);
    assert_png_close(
        &flux_run(&union, &multi),
        "controlnet-flux-union-multi.png",
        2,
    );
    // One mode token among 25 text tokens steers the tiny model gently: diffusers measures 4
    // levels between modes 2 and 0, more than the 2 levels the goldens allow.
    let zero = flux_run(
        &union,
        &controls(vec![moded(&image, 0.9, Some(0), (0.0, 1.0))]),
    );
    let moved = png_level_diff(&two, &zero);
    eprintln!("mode 2 against mode 0: {moved} levels");
    assert!(moved > 2, "{moved}");
}

/// An XLabs-style Flux ControlNet (conditioning embedding on the pixel image, samples repeated
/// over the double blocks) within 2 PNG levels of diffusers; the control changes the image.
#[test]
fn flux_xlabs_controlnet_matches_diffusers() {
    let image = control_image();
    let xlabs = flux_run(
        &["tiny-controlnet-flux-xlabs"],
        &controls(vec![moded(&image, 0.9, None, (0.0, 1.0))]),
    );
    assert_png_close(&xlabs, "controlnet-flux-xlabs.png", 2);
    let off = flux_run(
        &["tiny-controlnet-flux-xlabs"],
        &controls(vec![moded(&image, 0.0, None, (0.0, 1.0))]),
    );
    let moved = png_level_diff(&xlabs, &off);
    eprintln!("XLabs at scale 0.9 against 0: {moved} levels");
    assert!(moved > 10, "{moved}");
}

/// Control modes are checked before anything runs: required for a Union, below its
/// `num_mode`, refused for other ControlNets and other pipelines; XLabs and InstantX
/// ControlNets are not mixed.
#[test]
fn flux_control_modes_are_checked() {
    let image = control_image();
    let request = flux_request();
    let message = |nets: &[&str], mode: Option<usize>| {
        let mut pipe = flux_pipe(nets).unwrap();
        let control = controls(vec![moded(&image, 1.0, mode, (0.0, 1.0))]);
        match pipe.generate(&request, &control) {
            Ok(_) => panic!("{nets:?} with mode {mode:?} ran"),
            Err(e) => e.to_string(),
        }
    };
    let missing = message(&["tiny-controlnet-flux-union"], None);
    assert!(missing.contains("needs a control mode"), "{missing}");
    let range = message(&["tiny-controlnet-flux-union"], Some(4));
    assert!(
        range.contains("out of range") && range.contains("4 modes"),
        "{range}"
    );
    let plain = message(&["tiny-controlnet-flux"], Some(0));
    assert!(plain.contains("without modes"), "{plain}");
    let xlabs = message(&["tiny-controlnet-flux-xlabs"], Some(1));
    assert!(xlabs.contains("without modes"), "{xlabs}");
    let other = controls(vec![moded(&image, 1.0, Some(0), (0.0, 1.0))]).check(1);
    assert!(other
        .unwrap_err()
        .to_string()
        .contains("only Flux ControlNet-Unions"));
    let mixed = flux_pipe(&["tiny-controlnet-flux", "tiny-controlnet-flux-xlabs"]);
    assert!(mixed
        .err()
        .unwrap()
        .to_string()
        .contains("cannot be combined"));
}
