//! Flags: help and usage errors, bad values, seeds, batches and dtypes.

use crate::common::{model_dir, png_level_diff, stderr, txt2img};
use crate::{fails_with, succeeds};

#[test]
fn help_names_every_flag_and_usage_errors_exit_2_with_the_fix() {
    let help = txt2img(&["--help"]);
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
        "--ip-adapter",
        "--ip-adapter-image",
        "--ip-adapter-scale",
        "--ip-adapter-image-encoder",
    ] {
        assert!(text.contains(flag), "--help lacks {flag}:\n{text}");
    }
    assert!(
        text.contains("possible values: png, npy, latents"),
        "{text}"
    );
    let wrong = txt2img(&["--stepz", "3", "x"]);
    assert_eq!(wrong.status.code(), Some(2));
    let msg = stderr(&wrong);
    assert!(
        msg.contains("unexpected argument '--stepz'") && msg.contains("--steps"),
        "{msg}"
    );
    let bad_value = txt2img(&["--steps", "many", "x"]);
    assert_eq!(bad_value.status.code(), Some(2));
}

#[test]
fn bad_size_unknown_scheduler_and_missing_model_are_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.png");
    let o = out.to_str().unwrap();
    let model = model_dir("tiny-sd1");
    let m = model.to_str().unwrap();
    // A usage error (exit 2) since the size is checked before the model loads.
    let odd = txt2img(&["--model", m, "--width", "60", "--steps", "1", "-o", o, "x"]);
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
    let usage = txt2img(&["--steps"]);
    assert_eq!(usage.status.code(), Some(2), "usage errors exit 2");
}

#[test]
fn pixart_options_on_a_stable_diffusion_model_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.png");
    let model = model_dir("tiny-sd1");
    let result = txt2img(&[
        "--model",
        model.to_str().unwrap(),
        "--no-resolution-binning",
        "-o",
        out.to_str().unwrap(),
        "a prompt",
    ]);
    assert!(!result.status.success());
    assert!(
        stderr(&result).contains("apply to PixArt models"),
        "{}",
        stderr(&result)
    );
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
        let result = txt2img(&args);
        let msg = stderr(&result);
        assert_eq!(result.status.code(), Some(code), "{msg}");
        assert!(msg.contains(needle), "{needle}: {msg}");
        assert_eq!(msg.trim().lines().count(), 1, "one line: {msg}");
        assert!(!out.exists());
    }
}

#[test]
fn same_seed_same_png_different_seed_different_png() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_dir("tiny-sd1");
    let run = |seed: &str, name: &str| -> Vec<u8> {
        let out = tmp.path().join(name);
        let result = txt2img(&[
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
        ]);
        assert!(result.status.success(), "{}", stderr(&result));
        std::fs::read(out).unwrap()
    };
    let a = run("42", "a.png");
    assert_eq!(a, run("42", "b.png"));
    assert_ne!(a, run("43", "c.png"));
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
    // Bit for bit: the CPU kernels choose their products' shapes per sample, not per batch
    // (models/tests/cpu_batch_invariance.rs). Another image's noise would change nearly every
    // pixel.
    for name in ["00000.png", "00001.png", "00002.png"] {
        let read = |dir: &std::path::Path| image::open(dir.join(name)).unwrap().to_rgb8();
        let diff = png_level_diff(&read(&one), &read(&batched));
        assert_eq!(
            diff, 0,
            "{name}: batch of 2 (then 1) differs from one by one by {diff} levels"
        );
    }
    let params =
        oxidiff::pipelines::GenerationParameters::from_png(&batched.join("00001.png")).unwrap();
    assert_eq!(params.seed, 6);
    let usage = txt2img(&["--model", m, "--batch-size", "0", "x"]);
    assert_eq!(usage.status.code(), Some(2), "{}", stderr(&usage));
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
    let usage = txt2img(&["--model", m, "--dtype", "f64", "x"]);
    assert_eq!(usage.status.code(), Some(2));
    assert!(
        stderr(&usage).contains("possible values: f32, bf16, f16"),
        "{}",
        stderr(&usage)
    );
}
