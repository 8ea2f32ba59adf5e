//! The oxidiff side of the SD 1.5 benchmark (`tools/bench/sd15.sh` runs both sides and prints
//! the ratios): the same random-weight SD 1.5-architecture folder, the same timings as
//! `tools/bench/sd15_diffusers.py`, printed as one JSON line.
//!
//! `bench_sd15 DIR [--size 256] [--steps 4] [--repeat 2] [--load-only]`; threads follow `RAYON_NUM_THREADS`.

use std::time::Instant;

use anyhow::{Context, Result};
use burn::tensor::{Tensor, TensorData};
use oxidiff::pipelines::{GenerateRequest, LoadOptions, StableDiffusionPipeline};
use oxidiff::schedulers::{NoiseSource, TorchCpuGenerator};
use oxidiff::Cpu;
use oxidiff_examples::peak_rss_bytes;

fn arg(args: &[String], name: &str, default: usize) -> Result<usize> {
    match args.iter().position(|a| a == name) {
        Some(i) => args
            .get(i + 1)
            .context("missing value")?
            .parse()
            .with_context(|| format!("{name} takes a number")),
        None => Ok(default),
    }
}

/// Runs `f` once to warm up, then `repeat` times; returns the fastest time in seconds.
fn timed(repeat: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..repeat.max(1))
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let dir = args
        .get(1)
        .context("usage: bench_sd15 DIR [--size N] [--steps N] [--repeat N]")?;
    let size = arg(&args, "--size", 256)?;
    let steps = arg(&args, "--steps", 4)?;
    let repeat = arg(&args, "--repeat", 2)?;
    let device = Default::default();

    let start = Instant::now();
    let mut pipe =
        StableDiffusionPipeline::<Cpu>::from_pretrained(dir, &LoadOptions::default(), &device)?;
    let load = start.elapsed().as_secs_f64();
    if args.iter().any(|a| a == "--load-only") {
        println!(
            "{}",
            serde_json::json!({"load_s": load, "peak_rss_bytes": peak_rss_bytes()})
        );
        return Ok(());
    }

    let prompts = vec![
        "a photo of an astronaut riding a horse".to_string(),
        String::new(),
    ];
    let ctx = pipe.encode_prompts(&prompts, 1)?;
    let text = timed(repeat, || {
        let _ = pipe.encode_prompts(&prompts, 1).map(|t| t.into_data());
    });
    let lat = size / 8;
    let mut gen = TorchCpuGenerator::new(0);
    let sample: Tensor<Cpu, 4> = NoiseSource::<Cpu>::randn(&mut gen, [2, 4, lat, lat], &device)?;
    let t = Tensor::<Cpu, 1>::from_data(TensorData::new(vec![501f32], [1]), &device);
    let unet = timed(repeat, || {
        let _ = pipe
            .unet
            .forward(sample.clone(), t.clone(), ctx.clone())
            .into_data();
    });
    let latents: Tensor<Cpu, 4> = NoiseSource::<Cpu>::randn(&mut gen, [1, 4, lat, lat], &device)?;
    let vae = timed(repeat, || {
        let _ = pipe
            .vae
            .decode(latents.clone().div_scalar(0.18215))
            .into_data();
    });
    let request = GenerateRequest {
        prompts: vec![prompts[0].clone()],
        num_inference_steps: steps,
        guidance_scale: 7.5,
        width: Some(size),
        height: Some(size),
        ..Default::default()
    };
    let start = Instant::now();
    pipe.generate(&request)?;
    let e2e = start.elapsed().as_secs_f64();
    let threads = std::env::var("RAYON_NUM_THREADS").ok();
    println!(
        "{}",
        serde_json::json!({
            "impl": "oxidiff", "backend": "burn-flex", "threads": threads, "size": size,
            "steps": steps, "load_s": load, "text_encode_s": text, "unet_step_s": unet,
            "vae_decode_s": vae, "end_to_end_s": e2e, "peak_rss_bytes": peak_rss_bytes(),
        })
    );
    Ok(())
}
