//! The README's Rust example: generate one image with the tiny test pipeline on the CPU, and,
//! with `--device xla:cpu` (after `tools/fetch-plugins.sh`), on XLA's CPU plugin in compiled mode.
//!
//! `cargo run --release -p oxidiff-examples --bin generate [-- --device xla:cpu]`

use anyhow::Result;
use oxidiff::pipelines::{GenerateRequest, LoadOptions, StableDiffusionPipeline};
use oxidiff::{Oxi, OxiDevice, ToDevice};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let device: OxiDevice = match args.iter().position(|a| a == "--device") {
        Some(i) => args
            .get(i + 1)
            .map(String::as_str)
            .unwrap_or("cpu")
            .parse()?,
        None => OxiDevice::Cpu,
    };
    let model = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/tiny-sd1");
    let options = LoadOptions {
        scheduler: Some("DPM++ 2M Karras".into()),
        ..Default::default()
    };
    let pipe = StableDiffusionPipeline::<Oxi>::from_pretrained(model, &options, &OxiDevice::Cpu)?;
    let mut pipe = pipe.to(&device);
    if device.is_pjrt() {
        pipe.compile()?;
    }
    let out = pipe.generate(&GenerateRequest {
        prompts: vec!["a photo of an astronaut riding a horse".into()],
        negative_prompts: vec!["blurry".into()],
        num_inference_steps: 20,
        guidance_scale: 7.5,
        seed: 42,
        ..Default::default()
    })?;
    let images = out.images.ok_or_else(|| anyhow::anyhow!("no images"))?;
    images.save_png(0, "astronaut.png".as_ref())?;
    println!("wrote astronaut.png ({device})");
    Ok(())
}
