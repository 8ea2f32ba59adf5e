//! The oxidiff side of the SD 1.5 benchmark (`tools/bench/sd15.sh` runs every mode and
//! diffusers, then prints the ratios): the same random-weight SD 1.5-architecture folder (or
//! any diffusers folder, e.g. `tests/fixtures/tiny-sd1`), the same timings as
//! `tools/bench/sd15_diffusers.py`, printed as one JSON line.
//!
//! `bench_sd15 DIR [--size 256] [--steps 4] [--repeat 3] [--mode cpu|eager|compiled]
//! [--unet-only] [--load-only]`
//!
//! Modes: `cpu` is the burn-flex CPU backend; `eager` and `compiled` run on XLA's CPU plugin
//! (`xla:cpu`), op by op or with the denoising step (UNet + classifier-free guidance) as one
//! XLA program. The UNet step is timed as the pipeline runs it: latents `[1, 4, h/8, w/8]`,
//! guidance 7.5, so the UNet sees batch 2. Threads follow `RAYON_NUM_THREADS` (burn-flex); pin
//! the process (`taskset -c 0`) to give XLA's thread pool one core too.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use oxidiff::pipelines::{guided_noise, GenerateRequest, LoadOptions, StableDiffusionPipeline};
use oxidiff::schedulers::{NoiseSource, TorchCpuGenerator};
use oxidiff::{Cpu, Oxi, OxiDevice};
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

/// Timings of `repeat` runs after one warm-up run (whose time is kept apart: it includes
/// compiles in the PJRT modes).
struct Timed {
    first: f64,
    times: Vec<f64>,
}

impl Timed {
    fn run(repeat: usize, mut f: impl FnMut() -> Result<()>) -> Result<Self> {
        let start = Instant::now();
        f()?;
        let first = start.elapsed().as_secs_f64();
        let mut times = Vec::new();
        for _ in 0..repeat.max(1) {
            let start = Instant::now();
            f()?;
            times.push(start.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        Ok(Self { first, times })
    }

    fn min(&self) -> f64 {
        self.times[0]
    }

    fn json(&self) -> serde_json::Value {
        let n = self.times.len();
        serde_json::json!({
            "first_s": self.first,
            "min_s": self.times[0],
            "median_s": self.times[n / 2],
            "max_s": self.times[n - 1],
            "repeats": n,
        })
    }
}

struct Options {
    dir: String,
    size: usize,
    steps: usize,
    repeat: usize,
    unet_only: bool,
    mode: String,
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let dir = args
        .get(1)
        .filter(|a| !a.starts_with("--"))
        .context("usage: bench_sd15 DIR [--size N] [--steps N] [--repeat N] [--mode cpu|eager|compiled] [--unet-only] [--load-only]")?;
    let mode = args
        .iter()
        .position(|a| a == "--mode")
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| "cpu".into());
    let options = Options {
        dir: dir.clone(),
        size: arg(&args, "--size", 256)?,
        steps: arg(&args, "--steps", 4)?,
        repeat: arg(&args, "--repeat", 3)?,
        unet_only: args.iter().any(|a| a == "--unet-only"),
        mode: mode.clone(),
    };
    let load_only = args.iter().any(|a| a == "--load-only");
    match mode.as_str() {
        "cpu" => bench::<Cpu>(&options, &Default::default(), load_only, |_| Ok(())),
        "eager" | "compiled" => {
            let device: OxiDevice = "xla:cpu".parse()?;
            bench::<Oxi>(&options, &device, load_only, |pipe| {
                if mode == "compiled" {
                    pipe.compile()?;
                }
                Ok(())
            })
        }
        other => bail!("--mode {other}: use cpu, eager or compiled"),
    }
}

fn bench<B: Backend>(
    options: &Options,
    device: &B::Device,
    load_only: bool,
    prepare: impl FnOnce(&mut StableDiffusionPipeline<B>) -> Result<()>,
) -> Result<()> {
    let start = Instant::now();
    let mut pipe = StableDiffusionPipeline::<B>::from_pretrained(
        &options.dir,
        &LoadOptions::default(),
        device,
    )?;
    prepare(&mut pipe)?;
    let load = start.elapsed().as_secs_f64();
    if load_only {
        println!(
            "{}",
            serde_json::json!({"load_s": load, "peak_rss_bytes": peak_rss_bytes()})
        );
        return Ok(());
    }

    let prompts = vec![
        String::new(),
        "a photo of an astronaut riding a horse".to_string(),
    ];
    let ctx = pipe.encode_prompts(&prompts, 1)?.to_device(device);
    let lat = options.size / 8;
    let mut gen = TorchCpuGenerator::new(0);
    let sample: Tensor<B, 4> = NoiseSource::<B>::randn(&mut gen, [1, 4, lat, lat], device)?;
    let t = Tensor::<B, 1>::from_data(TensorData::new(vec![501f32], [1]), device);
    let guidance = Tensor::<B, 1>::from_data(TensorData::new(vec![7.5f32], [1]), device);
    let unet = Timed::run(options.repeat, || {
        let noise = match &pipe.compiled {
            Some(step) => {
                step.guided_noise(sample.clone(), t.clone(), ctx.clone(), guidance.clone())?
            }
            None => guided_noise(
                &pipe.unet,
                sample.clone(),
                t.clone(),
                ctx.clone(),
                guidance.clone(),
            ),
        };
        let _ = noise.into_data();
        Ok(())
    })?;
    let mut report = serde_json::json!({
        "impl": "oxidiff", "mode": options.mode, "threads": std::env::var("RAYON_NUM_THREADS").ok(),
        "size": options.size, "steps": options.steps, "load_s": load,
        "unet_step_s": unet.min(), "unet_step": unet.json(),
    });
    if !options.unet_only {
        let text = Timed::run(options.repeat, || {
            let _ = pipe.encode_prompts(&prompts, 1)?.into_data();
            Ok(())
        })?;
        let latents: Tensor<B, 4> =
            NoiseSource::<B>::randn(&mut gen, [1, 4, lat, lat], &pipe.vae_device())?;
        let vae = Timed::run(options.repeat, || {
            let _ = pipe
                .vae
                .decode(latents.clone().div_scalar(0.18215))
                .into_data();
            Ok(())
        })?;
        let request = GenerateRequest {
            prompts: vec![prompts[1].clone()],
            num_inference_steps: options.steps,
            guidance_scale: 7.5,
            width: Some(options.size),
            height: Some(options.size),
            ..Default::default()
        };
        let start = Instant::now();
        pipe.generate(&request)?;
        let e2e = start.elapsed().as_secs_f64();
        report["text_encode_s"] = text.min().into();
        report["vae_decode_s"] = vae.min().into();
        report["end_to_end_s"] = e2e.into();
    }
    if let Some(stats) = pipe.compiled.as_ref().map(|c| c.compile_stats()) {
        report["xla_compiles"] = stats.xla_compiles.into();
    }
    report["peak_rss_bytes"] = peak_rss_bytes().into();
    println!("{report}");
    Ok(())
}
