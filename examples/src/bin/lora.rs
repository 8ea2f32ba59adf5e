//! LoRA: fuse one or more LoRA files (diffusers/PEFT or kohya/A1111 format) into a pipeline's
//! UNet and text encoders, each at its own scale, then generate as usual. Fused weights keep
//! compiled mode free of recompiles; fuse before `compile()`. CPU, tiny test pipeline and its
//! test LoRAs by default (offline).
//!
//! `cargo run --release -p oxidiff-examples --bin lora -- [--model DIR]
//! [--lora FILE[:SCALE]] [--output-dir .]`

use anyhow::Result;
use oxidiff::pipelines::{GenerateRequest, LoadOptions, LoraSpec, StableDiffusionPipeline};
use oxidiff::Cpu;
use oxidiff_examples::{arg, TINY_SD1};

const TINY_LORA: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tests/fixtures/lora/tiny-sd1-peft.safetensors"
);

fn main() -> Result<()> {
    let model = arg("--model").unwrap_or_else(|| TINY_SD1.into());
    let lora: LoraSpec = arg("--lora")
        .unwrap_or_else(|| format!("{TINY_LORA}:0.8"))
        .parse()
        .map_err(anyhow::Error::msg)?;
    let dir = std::path::PathBuf::from(arg("--output-dir").unwrap_or_else(|| ".".into()));
    let device = Default::default();
    let mut pipe =
        StableDiffusionPipeline::<Cpu>::from_pretrained(&model, &LoadOptions::default(), &device)?;
    let request = GenerateRequest {
        prompts: vec!["a watercolor fox".into()],
        num_inference_steps: 8,
        seed: 3,
        ..Default::default()
    };
    let base = pipe.generate(&request)?;
    base.images
        .expect("images")
        .save_png(0, &dir.join("base.png"))?;
    let report = pipe.load_lora(&lora.path, lora.scale)?;
    for (component, layers) in &report.layers {
        println!("{}: {layers} {component} layers changed", report.name);
    }
    let with_lora = pipe.generate(&request)?;
    with_lora
        .images
        .expect("images")
        .save_png(0, &dir.join("lora.png"))?;
    println!(
        "wrote base.png and lora.png ({} at scale {}) in {}",
        report.name,
        report.scale,
        dir.display()
    );
    Ok(())
}
