//! Step time of the compiled denoising step (UNet + classifier-free guidance) on XLA's CPU
//! plugin with 1, 2 and 4 devices, tensor parallel and data parallel, as
//! `pipe.enable_parallelism` partitions it.
//!
//! `parallel_bench [MODEL_DIR] [--batch 4] [--size 64] [--repeat 10]` (MODEL_DIR a diffusers
//! pipeline folder or its `unet/`, default the tiny test pipeline).
//!
//! XLA's CPU "devices" are threads of one process on the same cores (two on the development
//! machine), so more devices cannot run faster here: the numbers show what partitioning costs
//! (collectives, smaller kernels, copying inputs to each device), not a speed-up.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use burn::tensor::Tensor;
use oxidiff::backend::spmd::{Layout, SpmdPlacement};
use oxidiff::backend::CompiledFn;
use oxidiff::models::UNet2DConditionModel;
use oxidiff::pipelines::guided_noise;
use oxidiff::pipelines::parallel::{enable_parallelism, ParallelConfig};
use oxidiff::{Oxi, OxiDevice};

type Inputs = (
    Tensor<Oxi, 4>,
    Tensor<Oxi, 1>,
    Tensor<Oxi, 3>,
    Tensor<Oxi, 1>,
);
type Step = CompiledFn<Inputs, Tensor<Oxi, 4>, Box<dyn Fn(Inputs) -> Tensor<Oxi, 4>>>;

fn value(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn number(args: &[String], name: &str, default: usize) -> Result<usize> {
    value(args, name)
        .map(|s| {
            s.parse()
                .with_context(|| format!("{name} {s}: not a number"))
        })
        .transpose()
        .map(|v| v.unwrap_or(default))
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    // Before the first XLA client: four CPU devices.
    std::env::set_var(oxidiff::backend::eager::XLA_CPU_DEVICES_ENV, "4");
    let mut unet_dir = args
        .get(1)
        .filter(|a| !a.starts_with("--"))
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("tests/fixtures/tiny-sd1"));
    if unet_dir.join("unet").is_dir() {
        unet_dir = unet_dir.join("unet");
    }
    let batch = number(&args, "--batch", 4)?;
    let size = number(&args, "--size", 64)?;
    let repeat = number(&args, "--repeat", 10)?.max(1);
    if size % 8 != 0 {
        bail!("--size {size}: must be a multiple of 8");
    }
    let latent = size / 8;
    let device: OxiDevice = "xla:cpu:0".parse()?;
    let config = oxidiff::models::UNet2DConditionConfig::from_file(&unet_dir.join("config.json"))?;
    let context_dim = match &config.cross_attention_dim {
        oxidiff::models::config::PerBlock::One(d) => *d,
        oxidiff::models::config::PerBlock::Each(dims) => dims.first().copied().unwrap_or(768),
    };

    println!(
        "compiled UNet step with guidance on XLA's CPU plugin (4 devices): {}, batch {batch} ({} UNet rows), {size}x{size}, {repeat} timed calls each",
        unet_dir.display(),
        2 * batch
    );
    println!(
        "note: the CPU devices are threads sharing this machine's {} cores, so this shows the overhead of partitioning, not a speed-up",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!(
        "{:<12} {:>10} {:>10} {:>10} {:>12} {:>14}",
        "mode", "min ms", "median", "max", "first call", "split KiB/dev"
    );
    let modes = [
        ("1 device", ParallelConfig::new(1, 1)),
        ("tp 2", ParallelConfig::new(1, 2)),
        ("tp 4", ParallelConfig::new(1, 4)),
        ("dp 2", ParallelConfig::new(2, 1)),
        ("dp 4", ParallelConfig::new(4, 1)),
    ];
    for (name, parallel) in modes {
        let mut unet = UNet2DConditionModel::<Oxi>::from_dir(&unet_dir, None, &device)?;
        let placement: Option<Arc<SpmdPlacement>> = if parallel.is_parallel() {
            Some(enable_parallelism(&mut unet, &device, parallel)?)
        } else {
            None
        };
        let f: Box<dyn Fn(Inputs) -> Tensor<Oxi, 4>> =
            Box::new(move |(s, t, c, g)| guided_noise(&unet, s, t, c, g));
        let mut step: Step = CompiledFn::new("unet+cfg", f);
        if let Some(placement) = &placement {
            step = step.with_spmd(
                placement.clone(),
                vec![
                    Layout::BatchSplit(0),
                    Layout::Replicated,
                    Layout::BatchSplit(0),
                    Layout::Replicated,
                ],
            );
        }
        let inputs = || -> Inputs {
            (
                Tensor::ones([batch, config.in_channels, latent, latent], &device),
                Tensor::from_floats([500.0], &device),
                Tensor::ones([2 * batch, 77, context_dim], &device).mul_scalar(0.1),
                Tensor::from_floats([7.5], &device),
            )
        };
        let call = |step: &Step| -> Result<Duration> {
            let x = inputs();
            // Inputs uploaded before the clock starts; the read waits for the program.
            let started = Instant::now();
            let out = step.call(x).map_err(|e| anyhow::anyhow!("{e}"))?;
            let _ = out.into_data();
            Ok(started.elapsed())
        };
        let first = call(&step)?;
        let mut times = (0..repeat)
            .map(|_| call(&step))
            .collect::<Result<Vec<_>>>()?;
        times.sort();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let split = placement
            .as_ref()
            .map(|p| p.weight_bytes()[0].sharded / 1024)
            .unwrap_or(0);
        println!(
            "{name:<12} {:>10.2} {:>10.2} {:>10.2} {:>10.0}ms {:>14}",
            ms(times[0]),
            ms(times[times.len() / 2]),
            ms(times[times.len() - 1]),
            ms(first),
            split
        );
    }
    Ok(())
}
