//! The `txt2img` binary: parity with diffusers' PNG, seeds, the Hub cache, and clear errors on
//! bad input with nothing written.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::{model_dir, Golden};

fn txt2img(args: &[&str], envs: &[(&str, &Path)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_txt2img"));
    cmd.args(args)
        .env("HF_HUB_OFFLINE", "1")
        .env_remove("HF_HUB_CACHE");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd.output().expect("txt2img runs")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Writes golden latents as a float32 `.npy`.
fn write_npy(path: &Path, values: &[f32], shape: &[usize]) {
    std::fs::write(path, oxidiff::latents::encode_npy(values, shape)).unwrap();
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

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
    let result = txt2img(
        &sd1_args(
            model.to_str().unwrap(),
            latents.to_str().unwrap(),
            out.to_str().unwrap(),
        ),
        &[],
    );
    assert!(result.status.success(), "{}", stderr(&result));
    let ours = image::open(&out).unwrap().to_rgb8();
    common::assert_png_close(&ours, "tiny-sd1-pndm.png", 2);
}

#[test]
fn same_seed_same_png_different_seed_different_png() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_dir("tiny-sd1");
    let run = |seed: &str, name: &str| -> Vec<u8> {
        let out = tmp.path().join(name);
        let result = txt2img(
            &[
                "--model",
                model.to_str().unwrap(),
                "--steps",
                "2",
                "--guidance",
                "7.5",
                "--seed",
                seed,
                "--quiet",
                "-o",
                out.to_str().unwrap(),
                "a red apple",
            ],
            &[],
        );
        assert!(result.status.success(), "{}", stderr(&result));
        std::fs::read(out).unwrap()
    };
    let a = run("42", "a.png");
    assert_eq!(a, run("42", "b.png"));
    assert_ne!(a, run("43", "c.png"));
}

#[test]
fn hub_id_resolves_from_a_hand_made_cache_offline() {
    let cache = tempfile::tempdir().unwrap();
    let repo = cache.path().join("models--oxidiff--tiny-sd1");
    let rev = "0123456789abcdef0123456789abcdef01234567";
    copy_dir(&model_dir("tiny-sd1"), &repo.join("snapshots").join(rev));
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), rev).unwrap();
    let out = cache.path().join("out.png");
    let result = txt2img(
        &[
            "--model",
            "oxidiff/tiny-sd1",
            "--steps",
            "1",
            "--seed",
            "1",
            "--quiet",
            "-o",
            out.to_str().unwrap(),
            "a red apple",
        ],
        &[("HF_HUB_CACHE", cache.path())],
    );
    assert!(result.status.success(), "{}", stderr(&result));
    assert!(out.is_file());

    let missing = txt2img(
        &[
            "--model",
            "oxidiff/not-cached",
            "-o",
            out.to_str().unwrap(),
            "--force",
            "x",
        ],
        &[("HF_HUB_CACHE", cache.path())],
    );
    assert_eq!(missing.status.code(), Some(1));
    let msg = stderr(&missing);
    assert!(msg.contains(&cache.path().display().to_string()), "{msg}");
    assert!(msg.contains("HF_HUB_OFFLINE"), "{msg}");
}

/// One quick step of the tiny model (or `model`) into `out`.
fn one_step(model: &Path, out: &Path) -> Output {
    txt2img(
        &[
            "--model",
            model.to_str().unwrap(),
            "--steps",
            "1",
            "--quiet",
            "-o",
            out.to_str().unwrap(),
            "x",
        ],
        &[],
    )
}

/// Replaces `from` by `to` in a text file of a damaged model copy.
fn edit(file: &Path, from: &str, to: &str) {
    let text = std::fs::read_to_string(file).unwrap();
    assert!(text.contains(from), "{} has no {from:?}", file.display());
    std::fs::write(file, text.replace(from, to)).unwrap();
}

/// Runs txt2img expecting failure (exit 1), a message containing `needle`, and no output file.
fn fails_with(args: &[&str], needle: &str, out: &Path) {
    let result = txt2img(args, &[]);
    let msg = stderr(&result);
    assert_eq!(result.status.code(), Some(1), "{msg}");
    assert!(msg.contains(needle), "expected {needle:?} in: {msg}");
    assert!(!msg.contains("panicked"), "{msg}");
    assert!(!out.exists(), "nothing must be written on failure");
}

#[test]
fn bad_size_unknown_scheduler_and_missing_model_are_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.png");
    let o = out.to_str().unwrap();
    let model = model_dir("tiny-sd1");
    let m = model.to_str().unwrap();
    // A usage error (exit 2) since the size is checked before the model loads.
    let odd = txt2img(
        &["--model", m, "--width", "60", "--steps", "1", "-o", o, "x"],
        &[],
    );
    assert_eq!(odd.status.code(), Some(2), "{}", stderr(&odd));
    assert!(stderr(&odd).contains("multiples of 8"), "{}", stderr(&odd));
    assert!(!out.exists());
    fails_with(
        &["--model", m, "--scheduler", "warp-drive", "-o", o, "x"],
        "euler_a",
        &out,
    );
    fails_with(
        &["--model", "/no/such/folder", "-o", o, "x"],
        "not found",
        &out,
    );
    let usage = txt2img(&["--steps"], &[]);
    assert_eq!(usage.status.code(), Some(2), "usage errors exit 2");
}

#[test]
fn existing_output_is_not_overwritten_without_force() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("keep.png");
    std::fs::write(&out, b"precious").unwrap();
    let result = one_step(&model_dir("tiny-sd1"), &out);
    assert_eq!(result.status.code(), Some(1));
    assert!(stderr(&result).contains("--force"));
    assert_eq!(std::fs::read(&out).unwrap(), b"precious");
}

/// A copy of tiny-sd1 that `damage` breaks; returns the stderr of a run on it.
fn run_on_damaged(damage: impl FnOnce(&Path)) -> (String, PathBuf, tempfile::TempDir) {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    copy_dir(&model_dir("tiny-sd1"), &model);
    damage(&model);
    let out = tmp.path().join("out.png");
    let result = one_step(&model, &out);
    assert_eq!(result.status.code(), Some(1), "{}", stderr(&result));
    assert!(!out.exists());
    (stderr(&result), model, tmp)
}

#[test]
fn missing_component_folder_is_named() {
    let (msg, _, _tmp) = run_on_damaged(|m| std::fs::remove_dir_all(m.join("vae")).unwrap());
    assert!(msg.contains("vae"), "{msg}");
    assert!(!msg.contains("panicked"), "{msg}");
}

#[test]
fn truncated_safetensors_names_the_file() {
    let (msg, _, _tmp) = run_on_damaged(|m| {
        let f = m.join("unet/diffusion_pytorch_model.safetensors");
        let bytes = std::fs::read(&f).unwrap();
        std::fs::write(&f, &bytes[..bytes.len() / 2]).unwrap();
    });
    assert!(
        msg.contains("unet/diffusion_pytorch_model.safetensors"),
        "{msg}"
    );
    assert!(msg.contains("truncated"), "{msg}");
}

#[test]
fn missing_weights_file_is_named() {
    let (msg, _, _tmp) = run_on_damaged(|m| {
        std::fs::remove_file(m.join("vae/diffusion_pytorch_model.safetensors")).unwrap()
    });
    assert!(msg.contains("diffusion_pytorch_model.safetensors"), "{msg}");
}

#[test]
fn wrong_shape_names_key_expected_and_found() {
    let (msg, _, _tmp) = run_on_damaged(|m| {
        edit(
            &m.join("unet/config.json"),
            "\"cross_attention_dim\": 32",
            "\"cross_attention_dim\": 48",
        )
    });
    assert!(msg.contains("attn2.to_k.weight"), "{msg}");
    assert!(
        msg.contains("expects [16, 48]") && msg.contains("shape [16, 32]"),
        "{msg}"
    );
}

#[test]
fn config_field_of_wrong_type_is_named() {
    let (msg, _, _tmp) = run_on_damaged(|m| {
        edit(
            &m.join("vae/config.json"),
            "\"layers_per_block\": 1",
            "\"layers_per_block\": \"one\"",
        )
    });
    assert!(msg.contains("layers_per_block"), "{msg}");
    assert!(msg.contains("vae/config.json"), "{msg}");
}

#[test]
fn unknown_scheduler_class_in_config_is_named() {
    let (msg, _, _tmp) = run_on_damaged(|m| {
        edit(
            &m.join("scheduler/scheduler_config.json"),
            "PNDMScheduler",
            "WarpScheduler",
        )
    });
    assert!(msg.contains("WarpScheduler"), "{msg}");
}

#[test]
fn png_parameters_round_trip_through_from_png() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_dir("tiny-sd1");
    let first = tmp.path().join("first.png");
    let result = txt2img(
        &[
            "--model",
            model.to_str().unwrap(),
            "--steps",
            "3",
            "--guidance",
            "6.5",
            "--seed",
            "1234",
            "--scheduler",
            "Euler a",
            "--negative-prompt",
            "blurry, lowres",
            "--width",
            "128",
            "--height",
            "64",
            "--quiet",
            "-o",
            first.to_str().unwrap(),
            "a castle: on a hill, at dusk",
        ],
        &[],
    );
    assert!(result.status.success(), "{}", stderr(&result));
    let params = oxidiff::pipelines::GenerationParameters::from_png(&first).unwrap();
    assert_eq!(params.prompt, "a castle: on a hill, at dusk");
    assert_eq!(params.negative_prompt, "blurry, lowres");
    assert_eq!((params.steps, params.seed), (3, 1234));
    assert_eq!((params.width, params.height), (128, 64));
    assert_eq!(params.sampler, "Euler a");
    assert_eq!(params.guidance_scale, 6.5);
    assert_eq!(
        params.model, "tiny-sd1",
        "the folder's name, not a path of this machine"
    );

    // The parameters alone reproduce the image, bit for bit.
    let again = tmp.path().join("again.png");
    let result = txt2img(
        &[
            "--model",
            model.to_str().unwrap(),
            "--from-png",
            first.to_str().unwrap(),
            "--quiet",
            "-o",
            again.to_str().unwrap(),
        ],
        &[],
    );
    assert!(result.status.success(), "{}", stderr(&result));
    assert_eq!(
        std::fs::read(&first).unwrap(),
        std::fs::read(&again).unwrap()
    );

    // Without --model, the PNG's `Model:` is used (here the fixture's folder, by its name from
    // the folder holding it).
    let same_model = tmp.path().join("same-model.png");
    let result = Command::new(env!("CARGO_BIN_EXE_txt2img"))
        .args([
            "--from-png",
            first.to_str().unwrap(),
            "--quiet",
            "-o",
            same_model.to_str().unwrap(),
        ])
        .current_dir(model.parent().unwrap())
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    assert!(result.status.success(), "{}", stderr(&result));
    assert_eq!(
        std::fs::read(&first).unwrap(),
        std::fs::read(&same_model).unwrap()
    );

    // A flag given with --from-png wins over the file's value.
    let other = tmp.path().join("other.png");
    let result = txt2img(
        &[
            "--model",
            model.to_str().unwrap(),
            "--from-png",
            first.to_str().unwrap(),
            "--seed",
            "99",
            "--quiet",
            "-o",
            other.to_str().unwrap(),
        ],
        &[],
    );
    assert!(result.status.success(), "{}", stderr(&result));
    let params = oxidiff::pipelines::GenerationParameters::from_png(&other).unwrap();
    assert_eq!((params.seed, params.steps), (99, 3));
    assert_ne!(
        std::fs::read(&first).unwrap(),
        std::fs::read(&other).unwrap()
    );
}

#[test]
fn from_png_without_parameters_and_missing_prompt_are_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_dir("tiny-sd1");
    let plain = tmp.path().join("plain.png");
    image::RgbImage::from_pixel(8, 8, image::Rgb([1, 2, 3]))
        .save(&plain)
        .unwrap();
    let out = tmp.path().join("out.png");
    let o = out.to_str().unwrap();
    let m = model.to_str().unwrap();
    fails_with(
        &["--model", m, "--from-png", plain.to_str().unwrap(), "-o", o],
        "has no `parameters` text chunk",
        &out,
    );
    fails_with(&["--model", m, "-o", o], "no prompt given", &out);
    let not_png = tmp.path().join("not.png");
    std::fs::write(&not_png, b"GIF89a").unwrap();
    fails_with(
        &[
            "--model",
            m,
            "--from-png",
            not_png.to_str().unwrap(),
            "-o",
            o,
        ],
        "not a readable PNG file",
        &out,
    );
    // A PNG whose model is not here names it and the fix.
    let params = oxidiff::pipelines::GenerationParameters {
        prompt: "a cat".into(),
        negative_prompt: String::new(),
        steps: 2,
        sampler: "PNDMScheduler".into(),
        guidance_scale: 7.5,
        seed: 1,
        width: 64,
        height: 64,
        model: tmp.path().join("gone/model").to_str().unwrap().into(),
        extra: Vec::new(),
    };
    let elsewhere = tmp.path().join("elsewhere.png");
    let png = oxidiff::pipelines::metadata::encode_png(
        &image::RgbImage::new(8, 8),
        &[("parameters", params.to_text())],
    )
    .unwrap();
    std::fs::write(&elsewhere, png).unwrap();
    fails_with(
        &["--from-png", elsewhere.to_str().unwrap(), "-o", o],
        "pass --model",
        &out,
    );
}

#[test]
fn ctrl_c_stops_after_the_current_step_writes_nothing_and_exits_130() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_dir("tiny-sd1");
    let out = tmp.path().join("out.png");
    // Enough steps that the run is still denoising when the signal arrives.
    let child = Command::new(env!("CARGO_BIN_EXE_txt2img"))
        .args([
            "--model",
            model.to_str().unwrap(),
            "--steps",
            "1000",
            "--scheduler",
            "euler",
            "--seed",
            "1",
            "--quiet",
            "-o",
            out.to_str().unwrap(),
            "a long run",
        ])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("txt2img starts");
    std::thread::sleep(std::time::Duration::from_secs(3));
    let sent = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let started = std::time::Instant::now();
    let result = child.wait_with_output().unwrap();
    let msg = stderr(&result);
    assert_eq!(result.status.code(), Some(130), "{msg}");
    assert!(msg.contains("interrupted after"), "{msg}");
    assert!(msg.contains("of 1000 steps; nothing was written"), "{msg}");
    assert!(
        started.elapsed().as_secs() < 30,
        "it must stop after the current step"
    );
    // No image and no temporary file left behind.
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
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
    let result = txt2img(
        &[
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
        ],
        &[],
    );
    assert!(result.status.success(), "{}", stderr(&result));
    let ours = image::open(&out).unwrap().to_rgb8();
    common::assert_png_close(&ours, "tiny-pixart-alpha.png", 2);

    // Without binning the golden latents (made for the 304x208 bin) do not fit 200x128.
    let again = tmp.path().join("again.png");
    let result = txt2img(
        &[
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
        ],
        &[],
    );
    assert!(!result.status.success());
    assert!(
        stderr(&result).contains("[1, 4, 26, 16]"),
        "{}",
        stderr(&result)
    );
    assert!(!again.exists());

    // A prompt longer than --max-sequence-length is cut, with a warning naming what is lost.
    let result = txt2img(
        &[
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
        ],
        &[],
    );
    assert!(result.status.success(), "{}", stderr(&result));
    let log = stderr(&result);
    assert!(
        log.contains("longer than 8 T5 tokens") && log.contains("horse on the moon"),
        "{log}"
    );
    assert!(again.exists());
}

#[test]
fn pixart_options_on_a_stable_diffusion_model_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.png");
    let model = model_dir("tiny-sd1");
    let result = txt2img(
        &[
            "--model",
            model.to_str().unwrap(),
            "--no-resolution-binning",
            "-o",
            out.to_str().unwrap(),
            "a prompt",
        ],
        &[],
    );
    assert!(!result.status.success());
    assert!(
        stderr(&result).contains("apply to PixArt models"),
        "{}",
        stderr(&result)
    );
}

#[test]
fn sdxl_folder_is_dispatched_to_the_sdxl_pipeline() {
    use oxidiff::pipelines::{GenerateRequest, LoadOptions, StableDiffusionXLPipeline, XlOptions};
    let tmp = tempfile::tempdir().unwrap();
    let golden = Golden::load("tiny-sdxl");
    let (values, shape) = golden.host("pipe.latents");
    let latents = tmp.path().join("latents.npy");
    write_npy(&latents, &values, &shape);
    let out = tmp.path().join("out.png");
    let model = model_dir("tiny-sdxl");
    let prompt = "a photo of an astronaut riding a horse";
    let result = txt2img(
        &[
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
        ],
        &[],
    );
    assert!(result.status.success(), "{}", stderr(&result));
    let ours = image::open(&out).unwrap().to_rgb8();
    assert_eq!(
        ours.dimensions(),
        (64, 64),
        "SDXL's default size from the tiny UNet"
    );

    // The same request through the library (diffusers' SDXL default guidance 5).
    let device = Default::default();
    let mut pipe =
        StableDiffusionXLPipeline::<common::B>::from_dir(&model, &LoadOptions::default(), &device)
            .unwrap();
    let request = GenerateRequest {
        prompts: vec![prompt.into()],
        negative_prompts: vec!["blurry".into()],
        num_inference_steps: 4,
        guidance_scale: 5.0,
        latents: Some(golden.tensor("pipe.latents")),
        ..Default::default()
    };
    let expected = pipe.generate(&request, &XlOptions::default()).unwrap();
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
fn img2img_binary_matches_diffusers_png_and_refuses_bad_strength() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_dir("tiny-sd1");
    let input = common::fixtures().join("golden/img2img-input.png");
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
    common::assert_png_close(&ours, "img2img-pndm.png", 2);
}

#[test]
fn num_images_into_a_folder_are_numbered_seeded_and_summarised_as_json() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_dir("tiny-sd1");
    let m = model.to_str().unwrap();
    let folder = tmp.path().join("out");
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::write(folder.join("00004.png"), b"an earlier image").unwrap();
    let result = txt2img(
        &[
            "--model",
            m,
            "--steps",
            "2",
            "--seed",
            "10",
            "--num-images",
            "3",
            "--json",
            "--quiet",
            "-o",
            folder.to_str().unwrap(),
            "a red apple",
        ],
        &[],
    );
    assert!(result.status.success(), "{}", stderr(&result));
    let summary: serde_json::Value =
        serde_json::from_slice(&result.stdout).expect("--json prints one JSON object");
    let files: Vec<String> = summary["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap().to_string())
        .collect();
    let expected: Vec<String> = ["00005.png", "00006.png", "00007.png"]
        .iter()
        .map(|n| folder.join(n).display().to_string())
        .collect();
    assert_eq!(files, expected);
    assert_eq!(summary["seeds"], serde_json::json!([10, 11, 12]));
    assert_eq!(summary["steps"], 2);
    assert_eq!(summary["pipeline"], "StableDiffusionPipeline");
    assert_eq!(summary["generate_seconds"].as_array().unwrap().len(), 3);
    // The earlier file is untouched, and each image is the one its own seed makes alone.
    assert_eq!(
        std::fs::read(folder.join("00004.png")).unwrap(),
        b"an earlier image"
    );
    let params =
        oxidiff::pipelines::GenerationParameters::from_png(&folder.join("00006.png")).unwrap();
    assert_eq!(params.seed, 11);
    let alone = tmp.path().join("alone.png");
    let result = txt2img(
        &[
            "--model",
            m,
            "--steps",
            "2",
            "--seed",
            "11",
            "--quiet",
            "-o",
            alone.to_str().unwrap(),
            "a red apple",
        ],
        &[],
    );
    assert!(result.status.success(), "{}", stderr(&result));
    assert_eq!(
        std::fs::read(&alone).unwrap(),
        std::fs::read(folder.join("00006.png")).unwrap()
    );
}

#[test]
fn num_images_beside_a_file_name_never_overwrite_without_force() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_dir("tiny-sd1");
    let m = model.to_str().unwrap();
    let out = tmp.path().join("pic.png");
    let args = |force: bool| {
        let mut a = vec![
            "--model",
            m,
            "--steps",
            "1",
            "--seed",
            "3",
            "--num-images",
            "2",
            "--quiet",
            "-o",
            out.to_str().unwrap(),
            "x",
        ];
        if force {
            a.insert(0, "--force");
        }
        a
    };
    let result = txt2img(&args(false), &[]);
    assert!(result.status.success(), "{}", stderr(&result));
    let first = tmp.path().join("pic-0.png");
    assert!(first.is_file() && tmp.path().join("pic-1.png").is_file());
    assert!(!out.exists());
    let before = std::fs::read(&first).unwrap();
    let again = txt2img(&args(false), &[]);
    assert_eq!(again.status.code(), Some(1));
    assert!(
        stderr(&again).contains(&format!("{} already exists", first.display())),
        "{}",
        stderr(&again)
    );
    assert_eq!(std::fs::read(&first).unwrap(), before);
    let forced = txt2img(&args(true), &[]);
    assert!(forced.status.success(), "{}", stderr(&forced));

    let latents = tmp.path().join("l.npy");
    write_npy(&latents, &[0.0; 4 * 8 * 8], &[1, 4, 8, 8]);
    let o = tmp.path().join("other.png");
    fails_with(
        &[
            "--model",
            m,
            "--latents",
            latents.to_str().unwrap(),
            "--num-images",
            "2",
            "-o",
            o.to_str().unwrap(),
            "x",
        ],
        "use it with --num-images 1",
        &o,
    );
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
    let result = txt2img(
        &[
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
        ],
        &[],
    );
    assert!(result.status.success(), "{}", stderr(&result));
    let ours = image::open(&out).unwrap().to_rgb8();
    common::assert_png_close(&ours, "tiny-sd3.png", 2);

    // Resolution binning is PixArt's; SD3 refuses the switch and writes nothing.
    let again = tmp.path().join("again.png");
    let result = txt2img(
        &[
            "--model",
            model.to_str().unwrap(),
            "--no-resolution-binning",
            "--quiet",
            "-o",
            again.to_str().unwrap(),
            "a prompt",
        ],
        &[],
    );
    assert!(!result.status.success());
    assert!(
        stderr(&result).contains("--no-resolution-binning applies to PixArt"),
        "{}",
        stderr(&result)
    );
    assert!(!again.exists());
}

/// Runs txt2img expecting success; returns its stderr.
fn succeeds(args: &[&str], envs: &[(&str, &Path)]) -> String {
    let result = txt2img(args, envs);
    assert!(result.status.success(), "{}", stderr(&result));
    stderr(&result)
}

#[test]
fn batch_size_gives_the_images_of_one_by_one_runs_bit_for_bit() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_dir("tiny-sd1");
    let m = model.to_str().unwrap();
    // Euler a draws noise at every step: each image must keep its own generator.
    let run = |folder: &str, batch: &str| {
        let out = tmp.path().join(folder);
        let o = format!("{}/", out.display());
        succeeds(
            &[
                "--model",
                m,
                "--steps",
                "2",
                "--seed",
                "5",
                "--num-images",
                "3",
                "--batch-size",
                batch,
                "--scheduler",
                "euler_a",
                "--quiet",
                "-o",
                &o,
                "x",
            ],
            &[],
        );
        out
    };
    let (one, batched) = (run("one", "1"), run("batched", "2"));
    for name in ["00000.png", "00001.png", "00002.png"] {
        assert_eq!(
            std::fs::read(one.join(name)).unwrap(),
            std::fs::read(batched.join(name)).unwrap(),
            "{name}: batch of 2 (then 1) differs from one by one"
        );
    }
    let params =
        oxidiff::pipelines::GenerationParameters::from_png(&batched.join("00001.png")).unwrap();
    assert_eq!(params.seed, 6);
    let usage = txt2img(&["--model", m, "--batch-size", "0", "x"], &[]);
    assert_eq!(usage.status.code(), Some(2), "{}", stderr(&usage));
}

#[test]
fn output_type_npy_holds_the_float_image_of_the_png() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_dir("tiny-sd1");
    let m = model.to_str().unwrap();
    let (png, npy) = (tmp.path().join("a.png"), tmp.path().join("a.npy"));
    let common = ["--model", m, "--steps", "2", "--seed", "9", "--quiet"];
    succeeds(
        &[&common[..], &["-o", png.to_str().unwrap(), "x"]].concat(),
        &[],
    );
    succeeds(
        &[
            &common[..],
            &["--output-type", "npy", "-o", npy.to_str().unwrap(), "x"],
        ]
        .concat(),
        &[],
    );
    let (values, shape) = oxidiff::latents::read_latents(&npy).unwrap();
    assert_eq!(shape, vec![64, 64, 3], "[height, width, 3]");
    assert!(values.iter().all(|v| (0.0..=1.0).contains(v)));
    // The PNG is the array rounded to 8 bits, as diffusers' numpy_to_pil.
    let rgb = image::open(&png).unwrap().to_rgb8();
    for (v, byte) in values.iter().zip(rgb.as_raw()) {
        assert_eq!((v * 255.0).round() as u8, *byte);
    }
    // A .png name for npy output is refused with the fix.
    let wrong = tmp.path().join("b.png");
    fails_with(
        &[
            &common[..],
            &["--output-type", "npy", "-o", wrong.to_str().unwrap(), "x"],
        ]
        .concat(),
        "must name a .npy file",
        &wrong,
    );
}

#[test]
fn output_type_latents_are_the_final_latents_and_feed_latents() {
    use oxidiff::pipelines::{GenerateRequest, LoadOptions, StableDiffusionPipeline};
    let tmp = tempfile::tempdir().unwrap();
    let model = model_dir("tiny-sd1");
    let m = model.to_str().unwrap();
    let folder = tmp.path().join("lat");
    let f = format!("{}/", folder.display());
    succeeds(
        &[
            "--model",
            m,
            "--steps",
            "3",
            "--seed",
            "21",
            "--num-images",
            "2",
            "--output-type",
            "latents",
            "--quiet",
            "-o",
            &f,
            "x",
        ],
        &[],
    );
    // Numbered .npy files, each [1, 4, h/8, w/8].
    let (second, shape) = oxidiff::latents::read_latents(&folder.join("00001.npy")).unwrap();
    assert_eq!(shape, vec![1, 4, 8, 8]);
    // The library's final latents for seed 22 (image 1) on the CLI's backend, bit for bit.
    let device = oxidiff::OxiDevice::Cpu;
    let mut pipe =
        StableDiffusionPipeline::<oxidiff::Oxi>::from_dir(&model, &LoadOptions::default(), &device)
            .unwrap();
    let out = pipe
        .generate(&GenerateRequest {
            prompts: vec!["x".into()],
            num_inference_steps: 3,
            seed: 22,
            output: oxidiff::pipelines::OutputType::Latents,
            ..Default::default()
        })
        .unwrap();
    assert!(out.images.is_none());
    let expected = out.latents.into_data().to_vec::<f32>().unwrap();
    assert_eq!(second, expected);
    // The file is accepted by --latents (same layout and shape).
    let png = tmp.path().join("from-latents.png");
    let written = folder.join("00000.npy");
    succeeds(
        &[
            "--model",
            m,
            "--steps",
            "1",
            "--latents",
            written.to_str().unwrap(),
            "--quiet",
            "-o",
            png.to_str().unwrap(),
            "x",
        ],
        &[],
    );
    assert!(png.is_file());
}

#[test]
fn dtype_bf16_and_f16_compute_in_reduced_precision_and_pixart_too() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_dir("tiny-sd1");
    let m = model.to_str().unwrap();
    let run = |dtype: &str| {
        let out = tmp.path().join(format!("{dtype}.png"));
        let o = out.to_str().unwrap();
        succeeds(
            &[
                "--model", m, "--steps", "2", "--seed", "5", "--dtype", dtype, "--quiet", "-o", o,
                "x",
            ],
            &[],
        );
        image::open(&out).unwrap().to_rgb8().into_raw()
    };
    let full = run("f32");
    for (dtype, mean_limit) in [("bf16", 3.0), ("f16", 1.0)] {
        let reduced = run(dtype);
        let diffs: Vec<u32> = full
            .iter()
            .zip(&reduced)
            .map(|(a, b)| u32::from(a.abs_diff(*b)))
            .collect();
        let mean = diffs.iter().sum::<u32>() as f64 / diffs.len() as f64;
        // bf16 keeps 8 mantissa bits, f16 11: the image moves by about a level (observed
        // means 1.05 and 0.14 levels), never by a different picture.
        assert!(mean <= mean_limit, "{dtype}: mean difference {mean} levels");
        assert!(
            diffs.iter().any(|&d| d > 0),
            "{dtype} gave the f32 image exactly: the weights were not cast"
        );
    }
    // The transformer pipelines compute in bf16 too (their closeness to f32: tests/dtype.rs).
    let out = tmp.path().join("pixart.png");
    let pixart = model_dir("tiny-pixart-alpha");
    succeeds(
        &[
            "--model",
            pixart.to_str().unwrap(),
            "--steps",
            "1",
            "--width",
            "32",
            "--height",
            "32",
            "--no-resolution-binning",
            "--dtype",
            "bf16",
            "--quiet",
            "-o",
            out.to_str().unwrap(),
            "x",
        ],
        &[],
    );
    assert!(out.is_file());
    let usage = txt2img(&["--model", m, "--dtype", "f64", "x"], &[]);
    assert_eq!(usage.status.code(), Some(2));
    assert!(
        stderr(&usage).contains("possible values: f32, bf16, f16"),
        "{}",
        stderr(&usage)
    );
}

/// A Hub cache folder with `org/name` at two commits: `main` -> `a...`, tag `v1` -> `b...`.
fn hand_made_cache(root: &Path) -> (String, String) {
    let repo = root.join("models--oxidiff--tiny");
    let (main, v1) = ("a".repeat(40), "b".repeat(40));
    copy_dir(&model_dir("tiny-sd1"), &repo.join("snapshots").join(&main));
    copy_dir(&model_dir("tiny-sd2"), &repo.join("snapshots").join(&v1));
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), &main).unwrap();
    std::fs::write(repo.join("refs/v1"), &v1).unwrap();
    (main, v1)
}

#[test]
fn revision_pins_a_snapshot_and_hf_home_locates_the_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path().join("hf");
    let cache = home.join("hub");
    let (_, v1) = hand_made_cache(&cache);
    let run = |model: &str, extra: &[&str], name: &str| {
        let out = tmp.path().join(name);
        let o = out.to_str().unwrap().to_string();
        let args = [
            &[
                "--model", model, "--steps", "1", "--seed", "1", "--quiet", "--json",
            ][..],
            extra,
            &["-o", &o, "x"],
        ]
        .concat();
        let result = txt2img(&args, &[("HF_HOME", &home)]);
        assert!(result.status.success(), "{}", stderr(&result));
        image::open(out).unwrap().to_rgb8().into_raw()
    };
    // HF_HOME/hub is the cache when HF_HUB_CACHE is unset; main is tiny-sd1, v1 tiny-sd2.
    let main = run("oxidiff/tiny", &[], "main.png");
    let tagged = run("oxidiff/tiny", &["--revision", "v1"], "v1.png");
    let by_hash = run(&format!("oxidiff/tiny@{v1}"), &[], "hash.png");
    assert_ne!(main, tagged, "--revision v1 must load the other snapshot");
    assert_eq!(
        tagged, by_hash,
        "a tag and its commit hash are the same snapshot"
    );
    let params =
        oxidiff::pipelines::GenerationParameters::from_png(&tmp.path().join("v1.png")).unwrap();
    assert_eq!(params.model, "oxidiff/tiny@v1");

    // An uncached revision offline names the cache folder; both spellings at once are refused.
    let out = tmp.path().join("none.png");
    let o = out.to_str().unwrap();
    let missing = txt2img(
        &["--model", "oxidiff/tiny", "--revision", "v2", "-o", o, "x"],
        &[("HF_HOME", &home)],
    );
    assert_eq!(missing.status.code(), Some(1));
    let msg = stderr(&missing);
    assert!(
        msg.contains(&cache.display().to_string()) && msg.contains("HF_HUB_OFFLINE"),
        "{msg}"
    );
    assert_eq!(msg.trim().lines().count(), 1, "one-line error: {msg}");
    let both = txt2img(
        &[
            "--model",
            "oxidiff/tiny@v1",
            "--revision",
            "v1",
            "-o",
            o,
            "x",
        ],
        &[("HF_HOME", &home)],
    );
    assert!(
        stderr(&both).contains("give one of them"),
        "{}",
        stderr(&both)
    );
    assert!(!out.exists());
}

#[test]
fn variant_loads_fp16_files_and_falls_back_per_component() {
    let tmp = tempfile::tempdir().unwrap();
    // tiny-sd2 has an fp16 UNet only: the other components load their plain files.
    let model = model_dir("tiny-sd2");
    let out = tmp.path().join("fp16.png");
    succeeds(
        &[
            "--model",
            model.to_str().unwrap(),
            "--variant",
            "fp16",
            "--steps",
            "1",
            "--seed",
            "1",
            "--quiet",
            "-o",
            out.to_str().unwrap(),
            "x",
        ],
        &[],
    );
    assert!(out.is_file());
}

#[test]
fn quiet_and_non_terminal_stderr_show_no_progress_and_rust_log_adds_events() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_dir("tiny-sd1");
    let m = model.to_str().unwrap();
    let a = tmp.path().join("a.png");
    // stderr is a pipe here: no progress line, but the `wrote` line.
    let msg = succeeds(
        &["--model", m, "--steps", "2", "-o", a.to_str().unwrap(), "x"],
        &[],
    );
    assert!(msg.contains("wrote ") && msg.contains("(seed "), "{msg}");
    assert!(!msg.contains("denoising"), "{msg}");
    let b = tmp.path().join("b.png");
    let msg = succeeds(
        &[
            "--model",
            m,
            "--steps",
            "2",
            "-q",
            "-o",
            b.to_str().unwrap(),
            "x",
        ],
        &[],
    );
    assert!(
        msg.trim().is_empty(),
        "--quiet prints nothing on success: {msg}"
    );
    // RUST_LOG=info: structured load events, one per component.
    let c = tmp.path().join("c.png");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_txt2img"));
    cmd.args([
        "--model",
        m,
        "--steps",
        "1",
        "-q",
        "-o",
        c.to_str().unwrap(),
        "x",
    ])
    .env("RUST_LOG", "info");
    let result = cmd.output().unwrap();
    let log = stderr(&result);
    assert!(result.status.success(), "{log}");
    for component in ["tokenizer", "text_encoder", "unet", "vae", "scheduler"] {
        assert!(
            log.contains(&format!("component=\"{component}\"")),
            "{component}: {log}"
        );
    }
    assert!(log.contains("loaded"), "{log}");
}

#[test]
fn help_names_every_flag_and_usage_errors_exit_2_with_the_fix() {
    let help = txt2img(&["--help"], &[]);
    assert_eq!(help.status.code(), Some(0));
    let text = String::from_utf8_lossy(&help.stdout);
    for flag in [
        "--from-png",
        "--model",
        "--variant",
        "--negative-prompt",
        "--steps",
        "--guidance",
        "--scheduler",
        "--seed",
        "--width",
        "--height",
        "--latents",
        "--output",
        "--force",
        "--num-images",
        "--json",
        "--device",
        "--compile",
        "--max-sequence-length",
        "--no-resolution-binning",
        "--quiet",
        "--batch-size",
        "--output-type",
        "--dtype",
        "--revision",
        "--version",
    ] {
        assert!(text.contains(flag), "--help lacks {flag}:\n{text}");
    }
    assert!(
        text.contains("possible values: png, npy, latents"),
        "{text}"
    );
    let wrong = txt2img(&["--stepz", "3", "x"], &[]);
    assert_eq!(wrong.status.code(), Some(2));
    let msg = stderr(&wrong);
    assert!(
        msg.contains("unexpected argument '--stepz'") && msg.contains("--steps"),
        "{msg}"
    );
    let bad_value = txt2img(&["--steps", "many", "x"], &[]);
    assert_eq!(bad_value.status.code(), Some(2));
}

#[test]
fn bad_device_and_compile_on_the_cpu_are_one_line_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_dir("tiny-sd1");
    let m = model.to_str().unwrap();
    let out = tmp.path().join("o.png");
    let o = out.to_str().unwrap();
    for (args, needle, code) in [
        (
            vec!["--model", m, "--device", "warp:9", "-o", o, "x"],
            "--device warp:9",
            1,
        ),
        (
            vec!["--model", m, "--compile", "--steps", "1", "-o", o, "x"],
            "--compile needs a PJRT device",
            2,
        ),
    ] {
        let result = txt2img(&args, &[]);
        let msg = stderr(&result);
        assert_eq!(result.status.code(), Some(code), "{msg}");
        assert!(msg.contains(needle), "{needle}: {msg}");
        assert_eq!(msg.trim().lines().count(), 1, "one line: {msg}");
        assert!(!out.exists());
    }
}
