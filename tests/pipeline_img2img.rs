//! `StableDiffusionImg2ImgPipeline` against diffusers on tiny-sd1 (`tools/golden/make_img2img.py`):
//! the preprocessed input PNG, per-step latents (PNDM, and Euler through `set_begin_index`) with
//! the VAE sample and initial noise drawn from the same seed as diffusers, the float image
//! within 1e-4 relative and the PNG within 2 levels; bad strengths are errors.

mod common;

use std::cell::RefCell;

use common::{assert_close, fixtures, model_dir, relative_error, Golden, B};
use oxidiff::pipelines::image::{load_image, preprocess};
use oxidiff::pipelines::{GenerateRequest, LoadOptions, StableDiffusionImg2ImgPipeline};
use oxidiff::schedulers::TorchCpuGenerator;

const TOL: f32 = 1e-4;

fn request(golden: &Golden) -> GenerateRequest<B> {
    let s = &golden.json["pipeline"];
    GenerateRequest {
        prompts: vec![s["prompt"].as_str().unwrap().into()],
        negative_prompts: vec![s["negative_prompt"].as_str().unwrap().into()],
        num_inference_steps: s["num_inference_steps"].as_u64().unwrap() as usize,
        guidance_scale: s["guidance_scale"].as_f64().unwrap(),
        seed: s["seed"].as_u64().unwrap(),
        ..Default::default()
    }
}

fn run(scheduler: &str) {
    let golden = Golden::load("img2img");
    let options = LoadOptions {
        scheduler: Some(scheduler.into()),
        ..Default::default()
    };
    let mut pipe = StableDiffusionImg2ImgPipeline::<B>::from_dir(
        &model_dir("tiny-sd1"),
        &options,
        &Default::default(),
    )
    .unwrap();
    let image = load_image(&fixtures().join("golden/img2img-input.png")).unwrap();
    let pre = preprocess::<B>(&image, None, None, 8, &Default::default()).unwrap();
    assert_close(&golden, "preprocessed", pre, 1e-6);

    let req = request(&golden);
    let strength = golden.json["pipeline"]["strength"].as_f64().unwrap();
    let steps = RefCell::new(Vec::new());
    let mut generator = TorchCpuGenerator::new(req.seed);
    let out = pipe
        .generate_with(&req, &image, strength, &mut generator, |info| {
            steps
                .borrow_mut()
                .push((info.timestep, info.latents.clone()))
        })
        .unwrap();
    let steps = steps.into_inner();
    let expected: Vec<f64> = golden.json["timesteps"][scheduler]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_eq!(steps.iter().map(|(t, _)| *t).collect::<Vec<_>>(), expected);
    for (i, (_, latents)) in steps.into_iter().enumerate() {
        assert_close(&golden, &format!("{scheduler}.step{i}"), latents, TOL);
    }
    let images = out.images.unwrap();
    let (expected, _) = golden.host(&format!("{scheduler}.image"));
    let err = relative_error(&images.data, &expected);
    eprintln!("{scheduler}.image: relative error {err:e}");
    assert!(err <= TOL, "image relative error {err:e}");
    common::assert_png_close(
        &images.to_rgb8(0).unwrap(),
        &format!("img2img-{scheduler}.png"),
        2,
    );
}

#[test]
fn img2img_pndm_matches_diffusers() {
    run("pndm");
}

#[test]
fn img2img_euler_matches_diffusers_from_the_begin_index() {
    run("euler");
}

#[test]
fn strength_outside_zero_one_and_unreadable_images_are_errors() {
    let golden = Golden::load("img2img");
    let mut pipe = StableDiffusionImg2ImgPipeline::<B>::from_dir(
        &model_dir("tiny-sd1"),
        &LoadOptions::default(),
        &Default::default(),
    )
    .unwrap();
    let image = load_image(&fixtures().join("golden/img2img-input.png")).unwrap();
    let req = request(&golden);
    for strength in [0.0, -0.5, 1.5, f64::NAN] {
        let err = pipe
            .generate(&req, &image, strength)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("strength must be in (0, 1]"),
            "{strength}: {err}"
        );
    }
    // 4 steps at strength 0.2 run int(0.8) = 0 steps.
    let err = pipe.generate(&req, &image, 0.2).unwrap_err().to_string();
    assert!(err.contains("runs no step"), "{err}");

    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("broken.png");
    std::fs::write(&bad, b"not a png").unwrap();
    let err = load_image(&bad).unwrap_err().to_string();
    assert!(err.contains("broken.png"), "{err}");
}
