//! The oxidiff side of the benchmark suite (`tools/bench/run.py` runs it beside
//! `tools/bench/diffusers_bench.py`, alternately, and prints the ratios): one diffusers folder
//! (the tiny test pipeline, or the random-weight SD 1.5 architecture), the same measurements
//! as the diffusers script, printed as one JSON line.
//!
//! `bench DIR [--size 256] [--steps 4] [--repeat 3] [--e2e-repeat 1] [--mode cpu|eager|compiled]
//! [--dtype f32|bf16|f16] [--variant fp16] [--offload off|text-encoders] [--unet-only] [--text-only]
//! [--load-only]` (`--offload` as `txt2img --offload`, for the eager and compiled modes; `--dtype` as
//! `txt2img --dtype`: the weights and the models' compute in that dtype, latents and the
//! scheduler in f32; `--variant` as diffusers' `variant`: which weight files are read)
//!
//! Measured, in this order, in one process:
//! - `load_s`: `from_pretrained` (and `compile()` in compiled mode, which only wraps the calls);
//! - `first_generation_s` and `time_to_first_image_s` (from the start of `main`: load plus the
//!   first whole generation, with its compiles in compiled mode);
//! - `unet_step`: one denoising step's denoiser call as the pipeline makes it: latents
//!   `[1, 4, h/8, w/8]`, guidance 7.5, so the UNet sees batch 2, then the guidance combination;
//! - `text_encode`: tokenizing and encoding the prompt and the empty negative prompt (at least
//!   [`TEXT_REPEAT_MIN`] timed calls, as the diffusers script: a fraction of a second each);
//! - `vae_decode`: decoding `[1, 4, h/8, w/8]` latents;
//! - `end_to_end`: a whole generation (DDIM, `--steps`, guidance 7.5, 8-bit image out);
//! - `peak_rss_bytes`: the process's `VmHWM` at the end (`peak_rss_after_load_bytes` and
//!   `peak_rss_after_first_image_bytes`: at those points).
//!
//! Each timing is `{first_s, min_s, median_s, max_s, repeats, times_s, cpu_times_s}` (wall
//! clock; `cpu_times_s`: the process's CPU time per call, all threads): `first_s` is the warm-up call,
//! the others are over `--repeat` calls after it (for end to end: `--e2e-repeat` generations
//! after the first one, which is its warm-up).
//!
//! Modes: `cpu` is the burn-flex CPU backend; `eager` and `compiled` run on XLA's CPU plugin
//! (`xla:cpu`), op by op or with the denoising step (UNet + classifier-free guidance) as one
//! XLA program and the VAE decoder as another. Threads follow `RAYON_NUM_THREADS` (burn-flex); XLA's thread pool takes the
//! cores the process may run on, so pin the process (`taskset -c 0`) to give it one.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor, TensorData};
use oxidiff::models::cpu::half_gemm::HalfKernel;
use oxidiff::models::vae_tiling::VaeTiling;
use oxidiff::pipelines::{
    guided_noise, GenerateRequest, LoadOptions, Offload, StableDiffusionPipeline,
};
use oxidiff::schedulers::{NoiseSource, TorchCpuGenerator};
use oxidiff::{Cpu, Oxi, OxiDevice};
use oxidiff_examples::{peak_rss_bytes, process_cpu_seconds};

const USAGE: &str = "usage: bench DIR [--size N] [--steps N] [--repeat N] [--e2e-repeat N] \
                     [--mode cpu|eager|compiled] [--device xla:cpu|cuda|tpu] [--dtype f32|bf16|f16] [--variant NAME] [--offload off|text-encoders] [--unet-only] [--text-only] [--load-only] \
                     [--vae-only] [--vae-tile-size N]";

/// Prints `report` as the one JSON line, with the peak RSS at this point.
fn finish(mut report: serde_json::Value) -> Result<()> {
    report["peak_rss_bytes"] = peak_rss_bytes().into();
    println!("{report}");
    Ok(())
}

/// The fewest timed text encodes, whatever `--repeat` says: the stage is short enough that two
/// calls leave its ratio to the machine's noise.
const TEXT_REPEAT_MIN: usize = 10;

fn arg(args: &[String], name: &str, default: usize) -> Result<usize> {
    match args.iter().position(|a| a == name) {
        Some(i) => args
            .get(i + 1)
            .with_context(|| format!("{name} needs a value\n{USAGE}"))?
            .parse()
            .with_context(|| format!("{name} takes a number\n{USAGE}")),
        None => Ok(default),
    }
}

/// Timings of `repeat` runs after one warm-up run (whose time is kept apart: it includes
/// compiles in the PJRT modes).
struct Timed {
    first: f64,
    times: Vec<f64>,
    cpu_times: Vec<f64>,
}

impl Timed {
    fn run(repeat: usize, mut f: impl FnMut() -> Result<()>) -> Result<Self> {
        let start = Instant::now();
        f()?;
        Self::after_warmup(start.elapsed().as_secs_f64(), repeat, f)
    }

    /// `repeat` timed runs after a warm-up that took `first` seconds.
    fn after_warmup(first: f64, repeat: usize, mut f: impl FnMut() -> Result<()>) -> Result<Self> {
        let (mut times, mut cpu_times) = (Vec::new(), Vec::new());
        for _ in 0..repeat.max(1) {
            let (start, cpu) = (Instant::now(), process_cpu_seconds());
            f()?;
            times.push(start.elapsed().as_secs_f64());
            cpu_times.push(process_cpu_seconds() - cpu);
        }
        times.sort_by(f64::total_cmp);
        cpu_times.sort_by(f64::total_cmp);
        Ok(Self {
            first,
            times,
            cpu_times,
        })
    }

    fn json(&self) -> serde_json::Value {
        let n = self.times.len();
        serde_json::json!({
            "first_s": self.first,
            "min_s": self.times[0],
            "median_s": self.times[n / 2],
            "max_s": self.times[n - 1],
            "repeats": n,
            "times_s": self.times,
            "cpu_times_s": self.cpu_times,
        })
    }
}

struct Options {
    dir: String,
    size: usize,
    steps: usize,
    repeat: usize,
    e2e_repeat: usize,
    unet_only: bool,
    /// Only `text_encode` (after its warm-up), then exit: for profiling the text encoder.
    text_only: bool,
    load_only: bool,
    /// One timed VAE decode at `--size` (no warm-up: large sizes take minutes), then exit.
    vae_only: bool,
    /// Decode in tiles of this many pixels (diffusers' `enable_tiling`); 0: whole.
    vae_tile_size: usize,
    mode: String,
    dtype: Option<FloatDType>,
    variant: Option<String>,
    offload: Offload,
}

fn main() -> Result<()> {
    let started = Instant::now();
    oxidiff::tune_allocator();
    let args: Vec<String> = std::env::args().collect();
    let dir = args
        .get(1)
        .filter(|a| !a.starts_with("--"))
        .context(USAGE)?;
    let mode = match args.iter().position(|a| a == "--mode") {
        Some(i) => args.get(i + 1).context(USAGE)?.clone(),
        None => "cpu".into(),
    };
    let options = Options {
        dir: dir.clone(),
        size: arg(&args, "--size", 256)?,
        steps: arg(&args, "--steps", 4)?,
        repeat: arg(&args, "--repeat", 3)?,
        e2e_repeat: arg(&args, "--e2e-repeat", 1)?,
        unet_only: args.iter().any(|a| a == "--unet-only"),
        text_only: args.iter().any(|a| a == "--text-only"),
        load_only: args.iter().any(|a| a == "--load-only"),
        vae_only: args.iter().any(|a| a == "--vae-only"),
        vae_tile_size: arg(&args, "--vae-tile-size", 0)?,
        mode: mode.clone(),
        dtype: match args.iter().position(|a| a == "--dtype") {
            None => None,
            Some(i) => match args.get(i + 1).map(String::as_str) {
                Some("f32") => None,
                Some("bf16") => Some(FloatDType::BF16),
                Some("f16") => Some(FloatDType::F16),
                _ => bail!("--dtype: use f32, bf16 or f16\n{USAGE}"),
            },
        },
        variant: match args.iter().position(|a| a == "--variant") {
            None => None,
            Some(i) => Some(args.get(i + 1).context(USAGE)?.clone()),
        },
        offload: match args.iter().position(|a| a == "--offload") {
            None => Offload::Off,
            Some(i) => args.get(i + 1).context(USAGE)?.parse()?,
        },
    };
    if options.size == 0 || !options.size.is_multiple_of(8) {
        bail!("--size {}: use a positive multiple of 8", options.size);
    }
    match mode.as_str() {
        "cpu" => bench::<Cpu>(&options, &Default::default(), started, |_| Ok(())),
        "eager" | "compiled" => {
            let name = match args.iter().position(|a| a == "--device") {
                Some(i) => args.get(i + 1).context(USAGE)?.as_str(),
                None => "xla:cpu",
            };
            let device: OxiDevice = name.parse()?;
            bench::<Oxi>(&options, &device, started, |pipe| {
                pipe.offload = options.offload;
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
    started: Instant,
    prepare: impl FnOnce(&mut StableDiffusionPipeline<B>) -> Result<()>,
) -> Result<()> {
    let start = Instant::now();
    let load_options = LoadOptions {
        scheduler: Some("DDIMScheduler".into()),
        dtype: options.dtype,
        variant: options.variant.clone(),
        transformer: None,
    };
    let mut pipe =
        StableDiffusionPipeline::<B>::from_pretrained(&options.dir, &load_options, device)
            .with_context(|| format!("loading {}", options.dir))?;
    prepare(&mut pipe)?;
    let load = start.elapsed().as_secs_f64();
    let mut report = serde_json::json!({
        "impl": "oxidiff", "mode": options.mode,
        "dtype": options.dtype.map_or("f32".to_string(), |d| format!("{d:?}").to_lowercase()),
        "kernels": match (options.dtype, oxidiff::models::cpu::half_gemm::kernel()) {
            (None | Some(FloatDType::F32), _) => format!(
                "f32 at {} (products: the gemm crate)",
                oxidiff::models::cpu::simd::width().name()
            ),
            (Some(FloatDType::F16), _) => "f16 products: widened to f32".to_string(),
            (_, Some(HalfKernel::Amx)) => "bf16 products: AMX".to_string(),
            (_, Some(HalfKernel::Avx512Bf16)) => "bf16 products: AVX512-BF16".to_string(),
            (_, None) => "bf16 products: widened to f32".to_string(),
        },
        "threads": std::env::var("RAYON_NUM_THREADS").ok().and_then(|t| t.parse::<usize>().ok()),
        "size": options.size, "steps": options.steps, "load_s": load,
        "offload": pipe.offload.to_string(),
        "peak_rss_after_load_bytes": peak_rss_bytes(),
    });
    if options.vae_tile_size > 0 {
        let tiling = VaeTiling::new(options.vae_tile_size, pipe.vae_scale_factor)?;
        pipe.vae.enable_tiling(tiling);
        report["vae_tile_size"] = options.vae_tile_size.into();
    }
    if options.vae_only {
        let lat = options.size / 8;
        let mut gen = TorchCpuGenerator::new(1);
        let latents: Tensor<B, 4> =
            NoiseSource::<B>::randn(&mut gen, [1, 4, lat, lat], &pipe.vae_device())?;
        let vae = Timed::after_warmup(f64::NAN, 1, || {
            let _ = pipe
                .vae
                .decode(latents.clone().div_scalar(0.18215))
                .into_data();
            Ok(())
        })?;
        report["vae_decode"] = vae.json();
        return finish(report);
    }
    if options.load_only {
        return finish(report);
    }

    let prompt = "a photo of an astronaut riding a horse".to_string();
    let request = GenerateRequest {
        prompts: vec![prompt.clone()],
        num_inference_steps: options.steps,
        guidance_scale: 7.5,
        width: Some(options.size),
        height: Some(options.size),
        ..Default::default()
    };
    let mut first_generation = 0.0;
    if !(options.unet_only || options.text_only) {
        let start = Instant::now();
        pipe.generate(&request)?;
        first_generation = start.elapsed().as_secs_f64();
        report["first_generation_s"] = first_generation.into();
        report["time_to_first_image_s"] = started.elapsed().as_secs_f64().into();
        report["peak_rss_after_first_image_bytes"] = peak_rss_bytes().into();
    }

    let prompts = vec![String::new(), prompt];
    if options.text_only {
        let text = Timed::run(options.repeat.max(TEXT_REPEAT_MIN), || {
            let _ = pipe.encode_prompts(&prompts, 1)?.into_data();
            Ok(())
        })?;
        report["text_encode"] = text.json();
        return finish(report);
    }
    let ctx = pipe.encode_prompts(&prompts, 1)?.to_device(device);
    let lat = options.size / 8;
    let mut gen = TorchCpuGenerator::new(0);
    let sample: Tensor<B, 4> = NoiseSource::<B>::randn(&mut gen, [1, 4, lat, lat], device)?;
    let t = Tensor::<B, 1>::from_data(TensorData::new(vec![501f32], [1]), device);
    let guidance = Tensor::<B, 1>::from_data(TensorData::new(vec![7.5f32], [1]), device);
    let unet = Timed::run(options.repeat, || {
        let noise = match &pipe.compiled {
            Some(step) => step.call((sample.clone(), t.clone(), ctx.clone(), guidance.clone()))?,
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
    report["unet_step"] = unet.json();
    if !options.unet_only {
        let text = Timed::run(options.repeat.max(TEXT_REPEAT_MIN), || {
            let _ = pipe.encode_prompts(&prompts, 1)?.into_data();
            Ok(())
        })?;
        report["text_encode"] = text.json();
        let latents: Tensor<B, 4> =
            NoiseSource::<B>::randn(&mut gen, [1, 4, lat, lat], &pipe.vae_device())?;
        let vae = Timed::run(options.repeat, || {
            // As `generate` does before its decode.
            oxidiff::pipelines::offload::before_decoding(&pipe.vae);
            let _ = pipe
                .vae
                .decode(latents.clone().div_scalar(0.18215))
                .into_data();
            Ok(())
        })?;
        report["vae_decode"] = vae.json();
        let e2e = Timed::after_warmup(first_generation, options.e2e_repeat, || {
            pipe.generate(&request)?;
            Ok(())
        })?;
        report["end_to_end"] = e2e.json();
    }
    if let Some(stats) = pipe.compiled.as_ref().map(|c| c.compile_stats()) {
        let vae = oxidiff::pipelines::compiled::vae_compile_stats(&pipe.vae);
        let vae_compiles: u64 = vae.iter().map(|c| c.stats.xla_compiles).sum();
        report["xla_compiles"] = (stats.xla_compiles + vae_compiles).into();
    }
    finish(report)
}
