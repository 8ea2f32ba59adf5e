//! `padding_mask_crop` against diffusers (`tools/golden/make_mask_crop.py`): the crop region of
//! `get_crop_region`, image and mask cut and filled to a 64x48 output (`resize_mode="fill"`, its
//! stretched edge row included) exactly, per-step latents of SD (9-channel UNet) and SDXL
//! (masked latents) inpainting within 1e-4 relative, and the result pasted back over the
//! 64x64 original (`apply_overlay`, blended by the grey part of the mask) within 2 PNG levels.
//! Bad input (an all-black mask, a crop with latent output, with SDXL image to image, or with
//! img2img and no --mask) is a clear error.

mod common;

use std::cell::RefCell;

use burn::tensor::Tensor;
use common::{assert_close, fixtures, model_dir, Golden, B};
use oxidiff::pipelines::image::{load_image, load_mask, preprocess, preprocess_mask};
use oxidiff::pipelines::mask_crop::{crop_and_fill, crop_region};
use oxidiff::pipelines::{
    GenerateRequest, Images, InpaintOptions, LoadOptions, OutputType,
    StableDiffusionInpaintPipeline, StableDiffusionXLImg2ImgPipeline,
    StableDiffusionXLInpaintPipeline, XlEditOptions, XlInitImage, XlRequest,
};
use oxidiff::schedulers::TorchCpuGenerator;

const TOL: f32 = 1e-4;

fn golden() -> Golden {
    Golden::load("mask-crop")
}

fn inputs() -> (image::DynamicImage, image::DynamicImage) {
    (
        load_image(&fixtures().join("golden/img2img-input.png")).unwrap(),
        load_mask(&fixtures().join("golden/crop-mask.png")).unwrap(),
    )
}

fn setting(golden: &Golden, key: &str) -> u64 {
    golden.json["settings"][key].as_u64().unwrap()
}

fn request(golden: &Golden, guidance: &str) -> GenerateRequest<B> {
    let s = &golden.json["settings"];
    GenerateRequest {
        prompts: vec![s["prompt"].as_str().unwrap().into()],
        negative_prompts: vec![s["negative_prompt"].as_str().unwrap().into()],
        num_inference_steps: setting(golden, "num_inference_steps") as usize,
        guidance_scale: s[guidance].as_f64().unwrap(),
        seed: setting(golden, "seed"),
        width: Some(setting(golden, "width") as usize),
        height: Some(setting(golden, "height") as usize),
        ..Default::default()
    }
}

type Steps = RefCell<Vec<(f64, Tensor<B, 4>)>>;

fn recorder(steps: &Steps) -> impl FnMut(oxidiff::pipelines::StepInfo<'_, B>) + '_ {
    |info| {
        steps
            .borrow_mut()
            .push((info.timestep, info.latents.clone()))
    }
}

/// Timesteps exactly, per-step latents within 1e-4, the pasted-back PNG within 2 levels.
fn check(golden: &Golden, case: &str, steps: Steps, images: Images) {
    let steps = steps.into_inner();
    let expected: Vec<f64> = golden.json["timesteps"][case]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_eq!(steps.iter().map(|(t, _)| *t).collect::<Vec<_>>(), expected);
    for (i, (_, latents)) in steps.into_iter().enumerate() {
        assert_close(golden, &format!("{case}.step{i}"), latents, TOL);
    }
    assert_eq!(
        (images.width, images.height),
        (64, 64),
        "the original's size"
    );
    common::assert_png_close(
        &images.to_rgb8(0).unwrap(),
        &format!("mask-crop-{case}.png"),
        2,
    );
}

#[test]
fn crop_region_and_filled_inputs_are_diffusers() {
    let golden = golden();
    let (image, mask) = inputs();
    let (w, h) = (
        setting(&golden, "width") as usize,
        setting(&golden, "height") as usize,
    );
    let pad = setting(&golden, "padding_mask_crop") as usize;
    let region = crop_region(&mask, w, h, pad).unwrap();
    let want: Vec<usize> = golden.json["crop_region"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect();
    assert_eq!(vec![region.x1, region.y1, region.x2, region.y2], want);
    let device = Default::default();
    let filled = image::DynamicImage::ImageRgb8(crop_and_fill(&image.to_rgb8(), region, w, h));
    let pixels = preprocess::<B>(&filled, Some(w), Some(h), 8, &device).unwrap();
    assert_close(&golden, "crop.image", pixels, 1e-6);
    let filled_mask =
        image::DynamicImage::ImageLuma8(crop_and_fill(&mask.to_luma8(), region, w, h));
    let mask_pixels = preprocess_mask::<B>(&filled_mask, w, h, &device).unwrap();
    assert_close(&golden, "crop.mask", mask_pixels, 0.0);
}

#[test]
fn sd_inpaint_with_padding_mask_crop_matches_diffusers() {
    let golden = golden();
    let mut pipe = StableDiffusionInpaintPipeline::<B>::from_dir(
        &model_dir("tiny-sd1-inpaint"),
        &LoadOptions::default(),
        &Default::default(),
    )
    .unwrap();
    assert_eq!(pipe.unet_in_channels(), 9);
    let (image, mask) = inputs();
    let req = request(&golden, "sd_guidance_scale");
    let options = InpaintOptions {
        strength: golden.json["settings"]["strength"]["sd9-crop"]
            .as_f64()
            .unwrap(),
        padding_mask_crop: Some(setting(&golden, "padding_mask_crop") as usize),
    };
    let steps = Steps::default();
    let mut generator = TorchCpuGenerator::new(req.seed);
    let out = pipe
        .generate_with_options(
            &req,
            &image,
            &mask,
            &options,
            &mut generator,
            recorder(&steps),
        )
        .unwrap();
    check(&golden, "sd9-crop", steps, out.images.unwrap());

    // An all-black mask has no region; latent output cannot be pasted back.
    let black = image::DynamicImage::ImageLuma8(image::GrayImage::new(64, 64));
    let err = pipe
        .generate_with_options(&req, &image, &black, &options, &mut generator, |_| {})
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("all black"), "{err}");
    let latents = GenerateRequest {
        output: OutputType::Latents,
        ..req.clone()
    };
    let err = pipe
        .generate_with_options(&latents, &image, &mask, &options, &mut generator, |_| {})
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("not latents"), "{err}");
}

#[test]
fn sdxl_inpaint_with_padding_mask_crop_matches_diffusers() {
    let golden = golden();
    let mut pipe = StableDiffusionXLInpaintPipeline::<B>::from_dir(
        &model_dir("tiny-sdxl"),
        &LoadOptions::default(),
        &Default::default(),
    )
    .unwrap();
    let (image, mask) = inputs();
    let req = request(&golden, "xl_guidance_scale");
    let edit = XlEditOptions {
        strength: golden.json["settings"]["strength"]["xl-crop"]
            .as_f64()
            .unwrap(),
        padding_mask_crop: Some(setting(&golden, "padding_mask_crop") as usize),
        ..Default::default()
    };
    let steps = Steps::default();
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
    check(&golden, "xl-crop", steps, out.images.unwrap());

    // Image to image has no mask to crop to.
    let mut img2img = StableDiffusionXLImg2ImgPipeline::from(pipe.pipe);
    let err = img2img
        .generate(
            &XlRequest::new(req.clone()),
            &edit,
            XlInitImage::Image(&image),
        )
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("applies to inpainting"), "{err}");
}

#[test]
fn img2img_padding_mask_crop_writes_diffusers_png_and_needs_a_mask() {
    let golden = golden();
    let tmp = tempfile::tempdir().unwrap();
    let s = &golden.json["settings"];
    let out = tmp.path().join("crop.png");
    let (input, mask) = (
        fixtures().join("golden/img2img-input.png"),
        fixtures().join("golden/crop-mask.png"),
    );
    let model = model_dir("tiny-sd1-inpaint");
    let (steps, seed, guidance, pad, width, height) = (
        s["num_inference_steps"].to_string(),
        s["seed"].to_string(),
        s["sd_guidance_scale"].to_string(),
        s["padding_mask_crop"].to_string(),
        s["width"].to_string(),
        s["height"].to_string(),
    );
    let mut args = vec![
        "--model",
        model.to_str().unwrap(),
        "--image",
        input.to_str().unwrap(),
        "--steps",
        &steps,
        "--seed",
        &seed,
        "--guidance",
        &guidance,
        "--width",
        &width,
        "--height",
        &height,
        "--negative-prompt",
        s["negative_prompt"].as_str().unwrap(),
        "--padding-mask-crop",
        &pad,
        "-o",
        out.to_str().unwrap(),
        s["prompt"].as_str().unwrap(),
    ];
    let img2img = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_img2img"))
            .args(args)
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .unwrap()
    };
    // Without --mask: a usage error, nothing written.
    let result = img2img(&args);
    let err = String::from_utf8_lossy(&result.stderr);
    assert_eq!(result.status.code(), Some(1), "{err}");
    assert!(err.contains("needs --mask"), "{err}");
    assert!(!out.exists());

    args.splice(0..0, ["--mask", mask.to_str().unwrap()]);
    let result = img2img(&args);
    let err = String::from_utf8_lossy(&result.stderr);
    assert!(result.status.success(), "{err}");
    let ours = image::open(&out).unwrap().to_rgb8();
    common::assert_png_close(&ours, "mask-crop-sd9-crop.png", 2);
}
