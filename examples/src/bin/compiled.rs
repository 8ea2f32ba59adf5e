//! Compiled mode: `pipe.compile()` makes each denoising step's UNet call and classifier-free
//! guidance one XLA program. A new prompt, seed or guidance scale reuses it; a new image size
//! compiles once more. Runs the tiny test pipeline by default (offline).
//!
//! `cargo run --release -p oxidiff-examples --bin compiled -- [--device xla:cpu|tpu|cuda]
//! [--model DIR] [--output compiled.png]`; with `OXIDIFF_COMPILE_CACHE=DIR` a second run loads
//! the program from disk instead of compiling it.

use std::time::Instant;

use anyhow::Result;
use oxidiff::pipelines::{GenerateRequest, LoadOptions, StableDiffusionPipeline};
use oxidiff::{Oxi, OxiDevice};
use oxidiff_examples::{arg, TINY_SD1};

fn main() -> Result<()> {
    let device: OxiDevice = arg("--device")
        .unwrap_or_else(|| "xla:cpu".into())
        .parse()?;
    let model = arg("--model").unwrap_or_else(|| TINY_SD1.into());
    let output = arg("--output").unwrap_or_else(|| "compiled.png".into());
    let mut pipe =
        StableDiffusionPipeline::<Oxi>::from_pretrained(&model, &LoadOptions::default(), &device)?;
    pipe.compile()?;
    for (prompt, seed, guidance) in [("a red apple", 1, 7.5), ("a green pear", 2, 5.0)] {
        let started = Instant::now();
        let out = pipe.generate(&GenerateRequest {
            prompts: vec![prompt.into()],
            num_inference_steps: 4,
            guidance_scale: guidance,
            seed,
            ..Default::default()
        })?;
        let stats = pipe.compile_stats().unwrap_or_default();
        println!(
            "{prompt:?}: {:.2}s; programs {}, XLA compiles {}, disk loads {}",
            started.elapsed().as_secs_f64(),
            stats.programs,
            stats.xla_compiles,
            stats.disk_loads
        );
        out.images.expect("images").save_png(0, output.as_ref())?;
    }
    println!("wrote {output}");
    Ok(())
}
