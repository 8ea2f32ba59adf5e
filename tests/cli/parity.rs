//! The binaries' PNGs against diffusers', and each model folder dispatched to its pipeline.

use std::process::Command;

use crate::common::{model_dir, stderr, txt2img, Golden};
use crate::write_npy;

fn sd1_args<'a>(model: &'a str, latents: &'a str, out: &'a str) -> Vec<&'a str> {
    vec![
        "--model",
        model,
        "--latents",
        latents,
        "--steps",
        "4",
        "--guidance",
        "7.5",
        "--negative-prompt",
        "blurry",
        "--scheduler",
        "pndm",
        "--quiet",
        "-o",
        out,
        "a photo of an astronaut riding a horse",
    ]
}

#[test]
fn png_with_latents_matches_diffusers_within_two_levels() {
    let tmp = tempfile::tempdir().unwrap();
    let golden = Golden::load("tiny-sd1");
    let (values, shape) = golden.host("pipe.latents");
    let latents = tmp.path().join("latents.npy");
    write_npy(&latents, &values, &shape);
    let out = tmp.path().join("out.png");
    let model = model_dir("tiny-sd1");
    let result = txt2img(&sd1_args(
        model.to_str().unwrap(),
        latents.to_str().unwrap(),
        out.to_str().unwrap(),
    ));
    assert!(result.status.success(), "{}", stderr(&result));
    let ours = image::open(&out).unwrap().to_rgb8();
    crate::common::assert_png_close(&ours, "tiny-sd1-pndm.png", 2);
}

#[test]
fn pixart_folder_is_recognised_and_its_png_matches_diffusers() {
    let tmp = tempfile::tempdir().unwrap();
    let golden = Golden::load("tiny-pixart-alpha");
    let (values, shape) = golden.host("pipe.latents");
    let latents = tmp.path().join("latents.npy");
    write_npy(&latents, &values, &shape);
    let out = tmp.path().join("out.png");
    let model = model_dir("tiny-pixart-alpha");
    let s = &golden.json["pipeline"];
    let (model, latents, out_str) = (
        model.to_str().unwrap(),
        latents.to_str().unwrap(),
        out.to_str().unwrap(),
    );
    // The defaults (20 steps, 4.5, 120 tokens, binning on) except the step count and size.
    let result = txt2img(&[
        "--model",
        model,
        "--latents",
        latents,
        "--steps",
        "4",
        "--width",
        "128",
        "--height",
        "200",
        "--quiet",
        "-o",
        out_str,
        s["prompt"].as_str().unwrap(),
    ]);
    assert!(result.status.success(), "{}", stderr(&result));
    let ours = image::open(&out).unwrap().to_rgb8();
    crate::common::assert_png_close(&ours, "tiny-pixart-alpha.png", 2);

    // Without binning the golden latents (made for the 304x208 bin) do not fit 200x128.
    let again = tmp.path().join("again.png");
    let result = txt2img(&[
        "--model",
        model,
        "--latents",
        latents,
        "--steps",
        "4",
        "--width",
        "128",
        "--height",
        "208",
        "--no-resolution-binning",
        "--max-sequence-length",
        "64",
        "--quiet",
        "-o",
        again.to_str().unwrap(),
        "a prompt",
    ]);
    assert!(!result.status.success());
    assert!(
        stderr(&result).contains("[1, 4, 26, 16]"),
        "{}",
        stderr(&result)
    );
    assert!(!again.exists());

    // A prompt longer than --max-sequence-length is cut, with a warning naming what is lost.
    let result = txt2img(&[
        "--model",
        model,
        "--steps",
        "1",
        "--width",
        "64",
        "--height",
        "64",
        "--no-resolution-binning",
        "--max-sequence-length",
        "8",
        "--quiet",
        "-o",
        again.to_str().unwrap(),
        "a photo of an astronaut riding a horse on the moon",
    ]);
    assert!(result.status.success(), "{}", stderr(&result));
    let log = stderr(&result);
    assert!(
        log.contains("longer than max_sequence_length (8 T5 tokens)")
            && log.contains("horse on the moon"),
        "{log}"
    );
    assert!(again.exists());
}

#[test]
fn sdxl_folder_is_dispatched_to_the_sdxl_pipeline() {
    use oxidiff::pipelines::{GenerateRequest, LoadOptions, StableDiffusionXLPipeline, XlRequest};
    let tmp = tempfile::tempdir().unwrap();
    let golden = Golden::load("tiny-sdxl");
    let (values, shape) = golden.host("pipe.latents");
    let latents = tmp.path().join("latents.npy");
    write_npy(&latents, &values, &shape);
    let out = tmp.path().join("out.png");
    let model = model_dir("tiny-sdxl");
    let prompt = "a photo of an astronaut riding a horse";
    let result = txt2img(&[
        "--model",
        model.to_str().unwrap(),
        "--latents",
        latents.to_str().unwrap(),
        "--steps",
        "4",
        "--negative-prompt",
        "blurry",
        "--quiet",
        "-o",
        out.to_str().unwrap(),
        prompt,
    ]);
    assert!(result.status.success(), "{}", stderr(&result));
    let ours = image::open(&out).unwrap().to_rgb8();
    assert_eq!(
        ours.dimensions(),
        (64, 64),
        "SDXL's default size from the tiny UNet"
    );

    // The same request through the library (diffusers' SDXL default guidance 5).
    let device = Default::default();
    let mut pipe = StableDiffusionXLPipeline::<crate::common::B>::from_dir(
        &model,
        &LoadOptions::default(),
        &device,
    )
    .unwrap();
    let request = GenerateRequest {
        prompts: vec![prompt.into()],
        negative_prompts: vec!["blurry".into()],
        num_inference_steps: 4,
        guidance_scale: 5.0,
        latents: Some(golden.tensor("pipe.latents")),
        ..Default::default()
    };
    let expected = pipe.generate(&XlRequest::new(request.clone())).unwrap();
    let expected = expected.images.unwrap().to_rgb8(0).unwrap();
    let max_diff = ours
        .as_raw()
        .iter()
        .zip(expected.as_raw())
        .map(|(a, b)| a.abs_diff(*b))
        .max()
        .unwrap();
    assert!(max_diff <= 1, "CLI and library differ by {max_diff} levels");
    let params = oxidiff::pipelines::GenerationParameters::from_png(&out).unwrap();
    assert_eq!(
        params.sampler, "Euler",
        "A1111's name for EulerDiscreteScheduler"
    );
    assert_eq!(params.guidance_scale, 5.0);
}

#[test]
fn sd3_folder_is_recognised_and_its_png_matches_diffusers() {
    let tmp = tempfile::tempdir().unwrap();
    let golden = Golden::load("tiny-sd3");
    let (values, shape) = golden.host("pipe.latents");
    let latents = tmp.path().join("latents.npy");
    write_npy(&latents, &values, &shape);
    let out = tmp.path().join("out.png");
    let model = model_dir("tiny-sd3");
    let s = &golden.json["pipeline"];
    let setting = |key: &str| s[key].to_string().trim_matches('"').to_string();
    let result = txt2img(&[
        "--model",
        model.to_str().unwrap(),
        "--latents",
        latents.to_str().unwrap(),
        "--steps",
        &setting("num_inference_steps"),
        "--guidance",
        &setting("guidance_scale"),
        "--negative-prompt",
        &setting("negative_prompt"),
        "--max-sequence-length",
        &setting("max_sequence_length"),
        "--width",
        &setting("width"),
        "--height",
        &setting("height"),
        "--quiet",
        "-o",
        out.to_str().unwrap(),
        &setting("prompt"),
    ]);
    assert!(result.status.success(), "{}", stderr(&result));
    let ours = image::open(&out).unwrap().to_rgb8();
    crate::common::assert_png_close(&ours, "tiny-sd3.png", 2);

    // Resolution binning is PixArt's; SD3 refuses the switch and writes nothing.
    let again = tmp.path().join("again.png");
    let result = txt2img(&[
        "--model",
        model.to_str().unwrap(),
        "--no-resolution-binning",
        "--quiet",
        "-o",
        again.to_str().unwrap(),
        "a prompt",
    ]);
    assert!(!result.status.success());
    assert!(
        stderr(&result).contains("--no-resolution-binning applies to PixArt"),
        "{}",
        stderr(&result)
    );
    assert!(!again.exists());
}

#[test]
fn img2img_binary_matches_diffusers_png_and_refuses_bad_strength() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_dir("tiny-sd1");
    let input = crate::common::fixtures().join("golden/img2img-input.png");
    let out = tmp.path().join("out.png");
    let args = |strength: &'static str| {
        vec![
            "--model".to_string(),
            model.to_str().unwrap().into(),
            "--image".into(),
            input.to_str().unwrap().into(),
            "--strength".into(),
            strength.into(),
            "--steps".into(),
            "4".into(),
            "--seed".into(),
            "42".into(),
            "--negative-prompt".into(),
            "blurry".into(),
            "-o".into(),
            out.to_str().unwrap().into(),
            "a photo of an astronaut riding a horse".into(),
        ]
    };
    let run = |args: Vec<String>| {
        Command::new(env!("CARGO_BIN_EXE_img2img"))
            .args(args)
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .expect("img2img runs")
    };
    let bad = run(args("1.5"));
    assert!(!bad.status.success());
    assert!(
        stderr(&bad).contains("strength must be in (0, 1]"),
        "{}",
        stderr(&bad)
    );
    assert!(!out.exists(), "nothing is written on bad input");

    let result = run(args("0.75"));
    assert!(result.status.success(), "{}", stderr(&result));
    let ours = image::open(&out).unwrap().to_rgb8();
    crate::common::assert_png_close(&ours, "img2img-pndm.png", 2);
}
