//! `txt2img`: generate images from a prompt with a diffusers-format Stable Diffusion model.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use burn::tensor::{Tensor, TensorData};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use oxidiff::latents::read_latents;
use oxidiff::pipelines::{GenerateRequest, LoadOptions, StableDiffusionPipeline};
use oxidiff::schedulers::TorchCpuGenerator;
use oxidiff::{Oxi, OxiDevice};

/// The model used when none is given: one step, no guidance, 512x512.
const DEFAULT_MODEL: &str = "stabilityai/sd-turbo";

#[derive(Parser, Debug)]
#[command(
    version,
    about = "Generate an image from a text prompt (Stable Diffusion 1.x/2.x)"
)]
struct Args {
    /// The prompt.
    prompt: String,
    /// A diffusers-format model folder, or a Hugging Face Hub id (`org/name[@revision]`) found in
    /// the local Hub cache or downloaded when online.
    #[arg(long, default_value = DEFAULT_MODEL)]
    model: String,
    /// Weight variant to load, e.g. `fp16` (`*.fp16.safetensors`).
    #[arg(long)]
    variant: Option<String>,
    #[arg(long, default_value = "")]
    negative_prompt: String,
    /// Denoising steps (default: 1 for sd-turbo, else 50).
    #[arg(long)]
    steps: Option<usize>,
    /// Classifier-free guidance scale; 1 or less disables guidance (default: 0 for sd-turbo,
    /// else 7.5).
    #[arg(long)]
    guidance: Option<f64>,
    /// Scheduler by diffusers class or short/A1111 name: pndm (PLMS), ddim, ddpm, euler,
    /// euler_a ("Euler a"), heun, lms, "DPM++ 2M", "DPM++ 2M Karras", "DPM++ 2M SDE", unipc.
    #[arg(long)]
    scheduler: Option<String>,
    /// Seed of the noise generator (PyTorch's CPU generator: same seed, same latents as
    /// diffusers). A random one is picked and printed when absent.
    #[arg(long)]
    seed: Option<u64>,
    /// Image width in pixels (a multiple of 8; default: the model's native size).
    #[arg(long)]
    width: Option<usize>,
    /// Image height in pixels (a multiple of 8; default: the model's native size).
    #[arg(long)]
    height: Option<usize>,
    /// Initial latents from a .npy or .safetensors file, shape [1, 4, height/8, width/8].
    #[arg(long)]
    latents: Option<PathBuf>,
    /// Output PNG file.
    #[arg(short, long, default_value = "txt2img.png")]
    output: PathBuf,
    /// Overwrite the output file if it exists.
    #[arg(long)]
    force: bool,
    /// Where to run: cpu, xla:cpu[:N] (XLA's CPU plugin), tpu[:N], cuda[:N], or a PJRT plugin
    /// path. PJRT devices run in eager mode (each op compiled once, then cached).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Compiled mode: each step's UNet call with classifier-free guidance is one XLA program,
    /// compiled once per image size and then reused (needs a PJRT --device). With
    /// OXIDIFF_COMPILE_CACHE=DIR executables are kept on disk for later runs;
    /// OXIDIFF_LOG_COMPILES=1 logs each compile.
    #[arg(long)]
    compile: bool,
    /// No progress bar.
    #[arg(long, short)]
    quiet: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<()> {
    if args.output.exists() && !args.force {
        bail!(
            "{} already exists; pass --force to overwrite it or choose another --output",
            args.output.display()
        );
    }
    if args.output.extension().and_then(|e| e.to_str()) != Some("png") {
        bail!(
            "--output must name a .png file, got {}",
            args.output.display()
        );
    }
    let turbo = args.model.trim_end_matches('/').ends_with("sd-turbo");
    let steps = args.steps.unwrap_or(if turbo { 1 } else { 50 });
    let guidance = args.guidance.unwrap_or(if turbo { 0.0 } else { 7.5 });
    let seed = args.seed.unwrap_or_else(random_seed);

    let device: OxiDevice = args
        .device
        .parse()
        .with_context(|| format!("--device {}", args.device))?;
    let started = Instant::now();
    let options = LoadOptions {
        variant: args.variant.clone(),
        scheduler: args.scheduler.clone(),
    };
    let mut pipe = StableDiffusionPipeline::<Oxi>::from_pretrained(&args.model, &options, &device)
        .with_context(|| format!("loading {}", args.model))?;
    if args.compile {
        pipe.compile()?;
    }
    let loaded = started.elapsed();

    let latents = match &args.latents {
        Some(path) => {
            let (values, shape) = read_latents(path)?;
            let shape: [usize; 4] = shape.as_slice().try_into().map_err(|_| {
                anyhow::anyhow!(
                    "{}: latents must have 4 dimensions [batch, 4, h/8, w/8], found {shape:?}",
                    path.display()
                )
            })?;
            Some(Tensor::<Oxi, 4>::from_data(
                TensorData::new(values, shape),
                &device,
            ))
        }
        None => None,
    };
    let request = GenerateRequest {
        prompts: vec![args.prompt.clone()],
        negative_prompts: if args.negative_prompt.is_empty() {
            Vec::new()
        } else {
            vec![args.negative_prompt.clone()]
        },
        num_inference_steps: steps,
        guidance_scale: guidance,
        width: args.width,
        height: args.height,
        seed,
        latents,
        ..Default::default()
    };

    let bar = if args.quiet {
        ProgressBar::hidden()
    } else {
        let bar = ProgressBar::new(steps as u64);
        bar.set_style(
            ProgressStyle::with_template("denoising {bar:30} {pos}/{len} [{elapsed}] {per_sec}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar
    };
    let mut generator = TorchCpuGenerator::new(seed);
    let generated = Instant::now();
    let output = pipe.generate_with(&request, &mut generator, |info| {
        bar.set_length(info.num_steps as u64);
        bar.set_position(info.step as u64 + 1);
    })?;
    bar.finish_and_clear();
    let images = output.images.context("the pipeline returned no images")?;
    images.save_png(0, &args.output)?;
    let mode = match pipe.compile_stats() {
        Some(stats) => format!(
            "compiled: {} program(s), {} XLA compile(s), {} from the disk cache",
            stats.programs, stats.xla_compiles, stats.disk_loads
        ),
        None => "eager".into(),
    };
    eprintln!(
        "wrote {} (seed {seed}, {steps} steps, guidance {guidance}, {}x{}, {device} {mode}; load {:.2}s, generate {:.2}s)",
        display(&args.output),
        images.width,
        images.height,
        loaded.as_secs_f64(),
        generated.elapsed().as_secs_f64()
    );
    Ok(())
}

fn display(path: &Path) -> String {
    path.display().to_string()
}

/// A seed from the clock and process id, for runs without `--seed` (printed so they can be
/// reproduced).
fn random_seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    (nanos ^ ((std::process::id() as u64) << 32)) % (1 << 53)
}
