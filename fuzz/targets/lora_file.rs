//! A LoRA file from a stranger: opening it gives a LoRA or an error naming the file, never a
//! panic, and a LoRA that opens is resolved against tiny-sd1's UNet and text encoder (an error
//! for keys that fit no layer) and, when it fits, fused into them with finite shapes intact.

use std::path::PathBuf;

use burn_flex::Flex;
use oxidiff_models::lora::{self, LoraComponent, LoraFile};
use oxidiff_models::{ClipTextModel, UNet2DConditionModel};

/// tiny-sd1 in the repository, from the fuzz crate (`fuzz/`) or the root crate's tests.
fn fixture(part: &str) -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let root = if manifest.ends_with("fuzz") {
        manifest.join("..")
    } else {
        manifest
    };
    root.join("tests/fixtures/tiny-sd1").join(part)
}

thread_local! {
    static MODELS: (UNet2DConditionModel<Flex>, ClipTextModel<Flex>) = {
        let device = Default::default();
        (
            UNet2DConditionModel::from_dir(&fixture("unet"), None, &device).expect("tiny-sd1 unet"),
            ClipTextModel::from_dir(&fixture("text_encoder"), false, None, &device)
                .expect("tiny-sd1 text encoder"),
        )
    };
}

/// One input: returns normally or panics (a finding).
pub fn run(data: &[u8]) {
    let dir = tempfile::tempdir_in(std::env::temp_dir()).expect("temp dir");
    let path = dir.path().join("lora.safetensors");
    std::fs::write(&path, data).expect("write");
    let file = match LoraFile::open(&path) {
        Ok(file) => file,
        Err(e) => {
            assert!(
                e.to_string().contains("lora.safetensors"),
                "error without the file: {e}"
            );
            return;
        }
    };
    MODELS.with(|(unet, text_encoder)| {
        if let Ok(plan) = lora::plan(unet, &file, LoraComponent::Unet, 0.5) {
            let (fused, n) = lora::fuse(unet.clone(), &plan);
            assert_eq!(n, plan.len());
            assert_eq!(fused.conv_in.weight.dims(), unet.conv_in.weight.dims());
        }
        if let Ok(plan) = lora::plan(text_encoder, &file, LoraComponent::TextEncoder, 0.5) {
            let (fused, n) = lora::fuse(text_encoder.clone(), &plan);
            assert_eq!(n, plan.len());
            assert_eq!(fused.layers.len(), text_encoder.layers.len());
        }
    });
}
