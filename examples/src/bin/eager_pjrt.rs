//! Text to image on a PJRT device in eager mode: every op is lowered to StableHLO, compiled
//! once per (op, shapes, dtypes) and cached, so the first image pays the compiles and the
//! second does not. Runs the tiny test pipeline by default (offline).
//!
//! `cargo run --release -p oxidiff-examples --bin eager_pjrt -- [--device xla:cpu|tpu|cuda]
//! [--model DIR] [--output eager.png]` (after `tools/fetch-plugins.sh` for `xla:cpu`)

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
    let output = arg("--output").unwrap_or_else(|| "eager.png".into());
    // Loaded straight onto the device: weights become device buffers.
    let mut pipe =
        StableDiffusionPipeline::<Oxi>::from_pretrained(&model, &LoadOptions::default(), &device)?;
    let mut request = GenerateRequest {
        prompts: vec!["a lighthouse on a cliff".into()],
        num_inference_steps: 4,
        seed: 1,
        ..Default::default()
    };
    for run in ["first (compiles each op)", "second (cached ops)"] {
        let started = Instant::now();
        let out = pipe.generate(&request)?;
        println!("{run}: {:.2}s on {device}", started.elapsed().as_secs_f64());
        out.images.expect("images").save_png(0, output.as_ref())?;
        request.seed += 1;
    }
    println!("wrote {output}");
    Ok(())
}
