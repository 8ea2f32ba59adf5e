//! `StableDiffusionInpaintPipeline` against diffusers on tiny-sd1 (`tools/golden/make_inpaint.py`):
//! the binarized grayscale mask, and per-step latents, float image (1e-4 relative) and PNG
//! (2 levels) of a 9-channel inpainting UNet and of the masked-latent method with tiny-sd1's
//! own 4-channel UNet, each with PNDM at strength 1 and Euler at strength 0.75; bad input (mask
//! of another size, strength outside (0, 1], unreadable mask file) is a clear error.

mod common;

use std::cell::RefCell;

use common::golden_run::check_run;
use common::{assert_close, fixtures, model_dir, Golden, B};
use oxidiff::models::UNet2DConditionModel;
use oxidiff::pipelines::image::{load_image, load_mask, preprocess_mask};
use oxidiff::pipelines::{GenerateRequest, LoadOptions, StableDiffusionInpaintPipeline};
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
        guidance_scale: s["sd_guidance_scale"].as_f64().unwrap(),
        seed: s["seed"].as_u64().unwrap(),
        ..Default::default()
    }
}

/// tiny-sd1 with `scheduler`, and the 9-channel UNet fixture in place of its own when asked
/// (diffusers' `from_pretrained(..., unet=...)`).
fn pipeline(scheduler: &str, nine_channels: bool) -> StableDiffusionInpaintPipeline<B> {
    let options = LoadOptions {
        scheduler: Some(scheduler.into()),
        ..Default::default()
    };
    let mut pipe = StableDiffusionInpaintPipeline::<B>::from_dir(
        &model_dir("tiny-sd1"),
        &options,
        &Default::default(),
    )
    .unwrap();
    if nine_channels {
        pipe.pipe.unet = UNet2DConditionModel::from_dir(
            &fixtures().join("tiny-sd1-inpaint-unet"),
            None,
            &Default::default(),
        )
        .unwrap();
        assert_eq!(pipe.unet_in_channels(), 9);
    }
    pipe
}

fn inputs() -> (image::DynamicImage, image::DynamicImage) {
    (
        load_image(&fixtures().join("golden/img2img-input.png")).unwrap(),
        load_mask(&fixtures().join("golden/inpaint-mask.png")).unwrap(),
    )
}

fn run(case: &str, scheduler: &str, nine_channels: bool) {
    let golden = golden();
    let mut pipe = pipeline(scheduler, nine_channels);
    let (image, mask) = inputs();
    let req = request(&golden);
    let strength = golden.json["settings"]["strength"][scheduler]
        .as_f64()
        .unwrap();
    let steps = RefCell::new(Vec::new());
    let mut generator = TorchCpuGenerator::new(req.seed);
    let out = pipe
        .generate_with(&req, &image, &mask, strength, &mut generator, |info| {
            steps
                .borrow_mut()
                .push((info.timestep, info.latents.clone()))
        })
        .unwrap();
    check_run(&golden, case, steps.into_inner(), out.images.unwrap());
}

#[test]
fn mask_is_grayscale_binarized_as_diffusers() {
    let golden = golden();
    let (_, mask) = inputs();
    let ours = preprocess_mask::<B>(&mask, 64, 64, &Default::default()).unwrap();
    assert_close(&golden, "mask_condition", ours, 0.0);
}

#[test]
fn nine_channel_unet_pndm_strength_1_matches_diffusers() {
    run("sd9-pndm", "pndm", true);
}

#[test]
fn nine_channel_unet_euler_strength_075_matches_diffusers() {
    run("sd9-euler", "euler", true);
}

#[test]
fn masked_latents_pndm_strength_1_matches_diffusers() {
    run("sd4-pndm", "pndm", false);
}

#[test]
fn masked_latents_euler_strength_075_matches_diffusers() {
    run("sd4-euler", "euler", false);
}

#[test]
fn mask_size_strength_and_unreadable_mask_are_errors() {
    let golden = golden();
    let mut pipe = pipeline("pndm", false);
    let (image, mask) = inputs();
    let req = request(&golden);

    let small = mask.resize_exact(32, 48, image::imageops::FilterType::Nearest);
    let err = pipe
        .generate(&req, &image, &small, 1.0)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("the mask is 32x48 but the image is 64x64"),
        "{err}"
    );

    for strength in [0.0, -0.5, 1.5, f64::NAN] {
        let err = pipe
            .generate(&req, &image, &mask, strength)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("strength must be in (0, 1]"),
            "{strength}: {err}"
        );
    }
    // 4 steps at strength 0.2 run int(0.8) = 0 steps.
    let err = pipe
        .generate(&req, &image, &mask, 0.2)
        .unwrap_err()
        .to_string();
    assert!(err.contains("runs no step"), "{err}");

    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("broken-mask.png");
    std::fs::write(&bad, b"not a png").unwrap();
    let err = load_mask(&bad).unwrap_err().to_string();
    assert!(
        err.contains("cannot read the mask") && err.contains("broken-mask.png"),
        "{err}"
    );
}

/// diffusers' `latents=`: the given noise replaces the first draw (scaled by
/// `init_noise_sigma`); the masked image's VAE sample is still drawn, so handing in the
/// generator's first draw and the generator after it gives the seeded run exactly.
#[test]
fn given_initial_noise_replaces_the_first_draw() {
    let golden = golden();
    let mut pipe = pipeline("pndm", true);
    let (image, mask) = inputs();
    let req = request(&golden);
    let seeded = pipe.generate(&req, &image, &mask, 1.0).unwrap();

    let mut generator = TorchCpuGenerator::new(req.seed);
    let first = oxidiff::schedulers::NoiseSource::<B>::randn(
        &mut generator,
        [1, 4, 8, 8],
        &Default::default(),
    )
    .unwrap();
    let given = GenerateRequest {
        latents: Some(first),
        ..req.clone()
    };
    let out = pipe
        .generate_with(&given, &image, &mask, 1.0, &mut generator, |_| {})
        .unwrap();
    assert_eq!(
        common::to_vec(out.latents),
        common::to_vec(seeded.latents),
        "same draws, same result"
    );
}

#[test]
fn an_inpainting_unet_outside_inpainting_is_an_error_not_a_panic() {
    let golden = golden();
    let mut pipe = pipeline("pndm", true).pipe;
    let err = pipe.generate(&request(&golden)).unwrap_err().to_string();
    assert!(
        err.contains("takes 9 input channels but this pipeline gives it 4")
            && err.contains("inpaint with a mask"),
        "{err}"
    );
}

/// Inputs whose size is not a multiple of 8 (or not the requested one) are resized with PIL's
/// Lanczos filter, as diffusers' processors do: the preprocessed image and masks (grayscale
/// and RGB) equal diffusers' exactly.
#[test]
fn resized_images_and_masks_equal_diffusers_preprocessing() {
    let golden = golden();
    let image = load_image(&fixtures().join("golden/resize-input.png")).unwrap();
    let mask = load_mask(&fixtures().join("golden/resize-mask.png")).unwrap();
    assert!(matches!(mask, image::DynamicImage::ImageLuma8(_)));
    let rgb_mask = image::DynamicImage::ImageRgb8(mask.to_rgb8());
    let device = Default::default();
    for name in ["default", "down", "up"] {
        let size = &golden.json["resize_sizes"][name];
        let (height, width) = (
            size[0].as_u64().map(|v| v as usize),
            size[1].as_u64().map(|v| v as usize),
        );
        let pre =
            oxidiff::pipelines::image::preprocess::<B>(&image, width, height, 8, &device).unwrap();
        let [_, _, h, w] = pre.dims();
        assert_close(&golden, &format!("resize.image.{name}"), pre, 0.0);
        let ours = preprocess_mask::<B>(&mask, w, h, &device).unwrap();
        assert_close(&golden, &format!("resize.mask.{name}"), ours, 0.0);
        let ours = preprocess_mask::<B>(&rgb_mask, w, h, &device).unwrap();
        assert_close(&golden, &format!("resize.rgb_mask.{name}"), ours, 0.0);
    }
}
