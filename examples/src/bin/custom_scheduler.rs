//! Custom schedulers: swap the checkpoint's scheduler by name (A1111 or diffusers class, as
//! `txt2img --scheduler`), or edit its config and build one from it, keeping the checkpoint's
//! betas as diffusers' `XScheduler.from_config(pipe.scheduler.config, ...)` does. CPU, tiny
//! test pipeline by default (offline).
//!
//! `cargo run --release -p oxidiff-examples --bin custom_scheduler -- [--model DIR]
//! [--output-dir .]`

use anyhow::Result;
use oxidiff::pipelines::{GenerateRequest, LoadOptions, StableDiffusionPipeline};
use oxidiff::schedulers::{scheduler_from_config, SchedulerKind};
use oxidiff::Cpu;
use oxidiff_examples::{arg, TINY_SD1};

fn main() -> Result<()> {
    let model = arg("--model").unwrap_or_else(|| TINY_SD1.into());
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
    // 1. By name, as the CLI does.
    pipe.set_scheduler("Euler a")?;
    let out = pipe.generate(&request)?;
    out.images
        .expect("images")
        .save_png(0, &dir.join("euler_a.png"))?;
    // 2. From an edited config: UniPC with Karras sigmas and trailing timesteps.
    let mut config = pipe
        .scheduler_config
        .switched_to(SchedulerKind::UniPcMultistep);
    config.use_karras_sigmas = true;
    config.timestep_spacing = Some(oxidiff::schedulers::TimestepSpacing::Trailing);
    pipe.scheduler = scheduler_from_config(&config)?;
    pipe.scheduler_config = config;
    let out = pipe.generate(&request)?;
    out.images
        .expect("images")
        .save_png(0, &dir.join("unipc_karras.png"))?;
    println!(
        "wrote euler_a.png and unipc_karras.png in {}",
        dir.display()
    );
    Ok(())
}
