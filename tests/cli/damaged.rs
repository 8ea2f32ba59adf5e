//! Damaged model folders: every fault names its file or key, and nothing is written.

use std::path::{Path, PathBuf};

use crate::common::{copy_dir, model_dir, stderr};
use crate::one_step;

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

/// Replaces `from` by `to` in a text file of a damaged model copy.
fn edit(file: &Path, from: &str, to: &str) {
    let text = std::fs::read_to_string(file).unwrap();
    assert!(text.contains(from), "{} has no {from:?}", file.display());
    std::fs::write(file, text.replace(from, to)).unwrap();
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
