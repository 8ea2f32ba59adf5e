//! The `txt2img` and `img2img` binaries, run as a user runs them: parity with diffusers' PNGs,
//! flags, outputs, the Hub cache, PNG metadata, progress, and clear errors on bad input with
//! nothing written. One test binary, a module per theme.

#[path = "../common/mod.rs"]
mod common;

mod compile_cache;
mod control;
mod damaged;
mod flags;
mod hub;
mod ip_adapter;
mod metadata;
mod outputs;
mod parity;
mod progress;
mod vae;

use std::path::Path;
use std::process::Output;

use common::{stderr, txt2img, txt2img_env};

/// Writes golden latents as a float32 `.npy`.
fn write_npy(path: &Path, values: &[f32], shape: &[usize]) {
    std::fs::write(path, oxidiff::latents::encode_npy(values, shape)).unwrap();
}

/// One quick step of the tiny model (or `model`) into `out`.
fn one_step(model: &Path, out: &Path) -> Output {
    txt2img(&[
        "--model",
        model.to_str().unwrap(),
        "--steps",
        "1",
        "--quiet",
        "-o",
        out.to_str().unwrap(),
        "x",
    ])
}

/// Runs txt2img expecting failure (exit 1), a message containing `needle`, and no output file.
fn fails_with(args: &[&str], needle: &str, out: &Path) {
    let result = txt2img(args);
    let msg = stderr(&result);
    assert_eq!(result.status.code(), Some(1), "{msg}");
    assert!(msg.contains(needle), "expected {needle:?} in: {msg}");
    assert!(!msg.contains("panicked"), "{msg}");
    assert!(!out.exists(), "nothing must be written on failure");
}

/// Runs txt2img expecting success; returns its stderr.
fn succeeds(args: &[&str], envs: &[(&str, &Path)]) -> String {
    let result = txt2img_env(args, envs);
    assert!(result.status.success(), "{}", stderr(&result));
    stderr(&result)
}
