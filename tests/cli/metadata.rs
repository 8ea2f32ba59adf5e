//! The PNG's `parameters` text: written, read back by `--from-png`, and its errors.

use crate::common::{model_dir, stderr, txt2img};
use crate::fails_with;

#[test]
fn png_parameters_round_trip_through_from_png() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_dir("tiny-sd1");
    let first = tmp.path().join("first.png");
    let result = txt2img(&[
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
    ]);
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
    let result = txt2img(&[
        "--model",
        model.to_str().unwrap(),
        "--from-png",
        first.to_str().unwrap(),
        "--quiet",
        "-o",
        again.to_str().unwrap(),
    ]);
    assert!(result.status.success(), "{}", stderr(&result));
    assert_eq!(
        std::fs::read(&first).unwrap(),
        std::fs::read(&again).unwrap()
    );

    // Without --model, the PNG's `Model:` is used (here the fixture's folder, by its name from
    // the folder holding it).
    let same_model = tmp.path().join("same-model.png");
    let result = std::process::Command::new(env!("CARGO_BIN_EXE_txt2img"))
        .args([
            "--from-png",
            first.to_str().unwrap(),
            "--quiet",
            "-o",
            same_model.to_str().unwrap(),
        ])
        .current_dir(model.parent().unwrap())
        .env("HF_HUB_OFFLINE", "1")
        .env_remove("HF_HUB_CACHE")
        .output()
        .unwrap();
    assert!(result.status.success(), "{}", stderr(&result));
    assert_eq!(
        std::fs::read(&first).unwrap(),
        std::fs::read(&same_model).unwrap()
    );

    // A flag given with --from-png wins over the file's value.
    let other = tmp.path().join("other.png");
    let result = txt2img(&[
        "--model",
        model.to_str().unwrap(),
        "--from-png",
        first.to_str().unwrap(),
        "--seed",
        "99",
        "--quiet",
        "-o",
        other.to_str().unwrap(),
    ]);
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
        model_hash: String::new(),
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

/// The first 10 hex digits of a file's SHA-256: A1111's `Model hash`.
fn short_sha256(path: &std::path::Path) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(std::fs::read(path).unwrap());
    digest.iter().take(5).map(|b| format!("{b:02x}")).collect()
}

/// The PNG `input` with its parameters' `Model:` and `Model hash:` replaced, written to `output`.
fn with_model(input: &std::path::Path, model: &str, hash: &str, output: &std::path::Path) {
    let mut params = oxidiff::pipelines::GenerationParameters::from_png(input).unwrap();
    params.model = model.into();
    params.model_hash = hash.into();
    let rgb = image::open(input).unwrap().to_rgb8();
    let png = oxidiff::pipelines::metadata::encode_png(&rgb, &[("parameters", params.to_text())])
        .unwrap();
    std::fs::write(output, png).unwrap();
}

#[test]
fn the_png_records_a1111s_model_hash_and_from_png_finds_the_model_by_name_or_hash() {
    let tmp = tempfile::tempdir().unwrap();
    let models = tmp.path().join("models");
    let mine = models.join("mine");
    crate::common::copy_dir(&model_dir("tiny-sd1"), &mine);
    let cache = tmp.path().join("cache");
    let hub = tmp.path().join("hub");
    let envs: [(&str, &std::path::Path); 2] =
        [("OXIDIFF_CACHE_DIR", &cache), ("HF_HUB_CACHE", &hub)];
    let first = tmp.path().join("first.png");
    let common = [
        "--steps", "2", "--width", "64", "--height", "64", "--seed", "5",
    ];
    let mut args = vec![
        "--model",
        mine.to_str().unwrap(),
        "-o",
        first.to_str().unwrap(),
    ];
    args.extend(common);
    args.push("a lighthouse");
    crate::succeeds(&args, &envs);
    let params = oxidiff::pipelines::GenerationParameters::from_png(&first).unwrap();
    let unet = mine.join("unet/diffusion_pytorch_model.safetensors");
    assert_eq!(params.model, "mine");
    assert_eq!(
        params.model_hash,
        short_sha256(&unet),
        "the denoiser weights' hash"
    );
    assert!(
        cache.join("hashes.json").is_file(),
        "the hash is cached for the next run"
    );

    // Found by name in --model-dir, its hash checked: the same image, bit for bit.
    let by_name = tmp.path().join("by-name.png");
    let log = crate::succeeds(
        &[
            "--from-png",
            first.to_str().unwrap(),
            "--model-dir",
            models.to_str().unwrap(),
            "-o",
            by_name.to_str().unwrap(),
        ],
        &envs,
    );
    assert!(!log.contains("warning"), "{log}");
    assert_eq!(
        std::fs::read(&first).unwrap(),
        std::fs::read(&by_name).unwrap()
    );

    // A PNG that names the model otherwise (another user's name for it) is found by its hash,
    // among the models hashed here before.
    let theirs = tmp.path().join("theirs.png");
    with_model(&first, "their-name-for-it", &params.model_hash, &theirs);
    let by_hash = tmp.path().join("by-hash.png");
    let log = crate::succeeds(
        &[
            "--from-png",
            theirs.to_str().unwrap(),
            "-o",
            by_hash.to_str().unwrap(),
        ],
        &envs,
    );
    assert!(log.contains("which has its hash"), "{log}");
    assert_eq!(
        std::fs::read(&first).unwrap(),
        std::fs::read(&by_hash).unwrap()
    );

    // The name found with another hash: run, and say the image will differ.
    let other_hash = tmp.path().join("other-hash.png");
    with_model(&first, "mine", "0123456789", &other_hash);
    let differs = tmp.path().join("differs.png");
    let log = crate::succeeds(
        &[
            "--from-png",
            other_hash.to_str().unwrap(),
            "--model-dir",
            models.to_str().unwrap(),
            "-o",
            differs.to_str().unwrap(),
        ],
        &envs,
    );
    assert!(log.contains("the image will differ"), "{log}");

    // Neither name nor hash known: an error naming the folders searched and the fix.
    let unknown = tmp.path().join("unknown.png");
    with_model(&first, "nowhere", "0123456789", &unknown);
    let out = tmp.path().join("never.png");
    let result = crate::common::txt2img_env(
        &[
            "--from-png",
            unknown.to_str().unwrap(),
            "--model-dir",
            models.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ],
        &envs,
    );
    let msg = stderr(&result);
    assert_eq!(result.status.code(), Some(1), "{msg}");
    for needle in [
        "`nowhere`",
        "0123456789",
        models.to_str().unwrap(),
        "--model-dir",
    ] {
        assert!(msg.contains(needle), "expected {needle:?} in: {msg}");
    }
    assert!(!out.exists());
}
