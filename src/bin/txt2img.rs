//! `txt2img`: generate images from a prompt with a diffusers-format model: Stable Diffusion
//! 1.x/2.x or PixArt-Alpha/Sigma, picked by `model_index.json`'s `_class_name`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use burn::tensor::{Tensor, TensorData};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use oxidiff::latents::read_latents;
use oxidiff::pipelines::stable_diffusion_xl::SDXL_CLASS;
use oxidiff::pipelines::{
    pipeline_class, resolve_model, CancelToken, GenerateRequest, GenerationParameters, LoadOptions,
    PipelineError, PipelineOutput, PixArtPipeline, PixArtRequest, StableDiffusionPipeline,
    StableDiffusionXLPipeline, StepInfo, XlOptions, PIXART_CLASSES,
};
use oxidiff::schedulers::TorchCpuGenerator;
use oxidiff::{Oxi, OxiDevice};

/// Exit status after Ctrl-C (128 + SIGINT, as shells report it).
const INTERRUPTED: u8 = 130;

/// The model used when none is given: one step, no guidance, 512x512.
const DEFAULT_MODEL: &str = "stabilityai/sd-turbo";

#[derive(Parser, Debug)]
#[command(
    version,
    about = "Generate an image from a text prompt (Stable Diffusion 1.x/2.x, SDXL, PixArt-Alpha/Sigma)"
)]
struct Args {
    /// The prompt (optional with --from-png).
    prompt: Option<String>,
    /// Take prompt, negative prompt, steps, sampler, guidance, seed and size from the
    /// `parameters` text of a PNG that oxidiff (or an A1111-compatible tool) wrote; flags given
    /// as well override them.
    #[arg(long, value_name = "FILE.png")]
    from_png: Option<PathBuf>,
    /// A diffusers-format model folder, or a Hugging Face Hub id (`org/name[@revision]`) found in
    /// the local Hub cache or downloaded when online.
    #[arg(long, default_value = DEFAULT_MODEL)]
    model: String,
    /// Weight variant to load, e.g. `fp16` (`*.fp16.safetensors`).
    #[arg(long)]
    variant: Option<String>,
    #[arg(long)]
    negative_prompt: Option<String>,
    /// Denoising steps (default: 1 for sd-turbo, 20 for PixArt, else 50).
    #[arg(long)]
    steps: Option<usize>,
    /// Classifier-free guidance scale; 1 or less disables guidance (default: 0 for sd-turbo,
    /// 4.5 for PixArt, else 7.5).
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
    /// Output PNG file, or a folder (an existing one, or a path ending in `/`) for numbered
    /// files 00000.png, 00001.png, ... after the highest number already there. With
    /// --num-images N > 1 a file name gets -0, -1, ... before `.png`.
    #[arg(short, long, default_value = "txt2img.png")]
    output: PathBuf,
    /// Overwrite output files that exist (numbered files in a folder never overwrite).
    #[arg(long)]
    force: bool,
    /// How many images to make, one after another; image i uses seed + i (as A1111 numbers
    /// them), so its PNG's parameters make it again alone.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    num_images: u64,
    /// Print a machine-readable summary on stdout: files, seeds, size, device, mode, timings.
    #[arg(long)]
    json: bool,
    /// Where to run: cpu, xla:cpu[:N] (XLA's CPU plugin), tpu[:N], cuda[:N], or a PJRT plugin
    /// path. PJRT devices run in eager mode (each op compiled once, then cached).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Compiled mode: each denoiser call (for Stable Diffusion with classifier-free guidance;
    /// the PixArt transformer) is one XLA program, compiled once per image size and then reused
    /// (needs a PJRT --device). With OXIDIFF_COMPILE_CACHE=DIR executables are kept on disk for
    /// later runs; OXIDIFF_LOG_COMPILES=1 logs each compile.
    #[arg(long)]
    compile: bool,
    /// T5 tokens per prompt for PixArt (default: 120 for Alpha, 300 for Sigma); longer
    /// prompts are cut with a warning.
    #[arg(long)]
    max_sequence_length: Option<usize>,
    /// PixArt: generate at exactly --width x --height instead of the nearest trained aspect
    /// ratio (diffusers' `use_resolution_binning=False`).
    #[arg(long)]
    no_resolution_binning: bool,
    /// No progress bar.
    #[arg(long, short)]
    quiet: bool,
}

fn main() -> ExitCode {
    oxidiff::tune_allocator();
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
            let interrupted = e.chain().any(|cause| {
                matches!(
                    cause.downcast_ref::<PipelineError>(),
                    Some(PipelineError::Cancelled { .. })
                )
            });
            if interrupted {
                ExitCode::from(INTERRUPTED)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

/// Fills what the user left out from `--from-png`'s parameters; explicit flags win.
fn apply_from_png(args: &mut Args) -> Result<()> {
    let Some(path) = &args.from_png else {
        if args.prompt.is_none() {
            bail!("no prompt given: pass it as the last argument, or use --from-png FILE.png");
        }
        return Ok(());
    };
    let p = GenerationParameters::from_png(path)?;
    args.prompt.get_or_insert(p.prompt);
    args.negative_prompt.get_or_insert(p.negative_prompt);
    args.steps.get_or_insert(p.steps);
    args.guidance.get_or_insert(p.guidance_scale);
    args.seed.get_or_insert(p.seed);
    args.width.get_or_insert(p.width);
    args.height.get_or_insert(p.height);
    if args.scheduler.is_none() && !p.sampler.is_empty() {
        args.scheduler = Some(p.sampler);
    }
    Ok(())
}

fn run(mut args: Args) -> Result<()> {
    apply_from_png(&mut args)?;
    let prompt = args.prompt.clone().unwrap_or_default();
    let negative_prompt = args.negative_prompt.clone().unwrap_or_default();
    let outputs = output_paths(&args.output, args.num_images as usize, args.force)?;
    if args.latents.is_some() && outputs.len() > 1 {
        bail!("--latents gives the initial latents of one image; use it with --num-images 1");
    }
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
    let dir = resolve_model(&args.model, args.variant.as_deref())
        .with_context(|| format!("loading {}", args.model))?;
    let class = pipeline_class(&dir).with_context(|| format!("loading {}", args.model))?;
    let pixart = PIXART_CLASSES.contains(&class.as_str());
    if !pixart && (args.max_sequence_length.is_some() || args.no_resolution_binning) {
        bail!("--max-sequence-length and --no-resolution-binning apply to PixArt models; {} is a {class}", args.model);
    }
    let turbo = args.model.trim_end_matches('/').ends_with("sd-turbo");
    let steps = args.steps.unwrap_or(if turbo {
        1
    } else if pixart {
        20
    } else {
        50
    });
    // diffusers' defaults: 7.5 for SD 1.x/2.x, 5 for SDXL, 4.5 for PixArt.
    let guidance = args.guidance.unwrap_or(if turbo {
        0.0
    } else if pixart {
        4.5
    } else if class == SDXL_CLASS {
        5.0
    } else {
        7.5
    });
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
        prompts: vec![prompt.clone()],
        negative_prompts: if negative_prompt.is_empty() {
            Vec::new()
        } else {
            vec![negative_prompt.clone()]
        },
        num_inference_steps: steps,
        guidance_scale: guidance,
        width: args.width,
        height: args.height,
        seed,
        latents,
        cancel: Some(interrupt_token()?),
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
    let progress = |info: StepInfo<'_, Oxi>| {
        bar.set_length(info.num_steps as u64);
        bar.set_position(info.step as u64 + 1);
    };
    let mut pipe = Pipeline::load(&dir, &class, &options, &device)
        .with_context(|| format!("loading {}", args.model))?;
    if args.compile {
        pipe.compile()?;
    }
    let loaded = started.elapsed();
    let pixart_options = (args.max_sequence_length, !args.no_resolution_binning);
    let sampler = args
        .scheduler
        .clone()
        .unwrap_or_else(|| pipe.scheduler_class().to_string());
    let mut made = Vec::with_capacity(outputs.len());
    for (i, path) in outputs.iter().enumerate() {
        let image_seed = seed + i as u64;
        let request = GenerateRequest {
            seed: image_seed,
            ..request.clone()
        };
        let mut generator = TorchCpuGenerator::new(image_seed);
        let generated = Instant::now();
        let output = pipe.generate_with(request, pixart_options, &mut generator, &progress)?;
        let images = output.images.context("the pipeline returned no images")?;
        let parameters = GenerationParameters {
            prompt: prompt.clone(),
            negative_prompt: negative_prompt.clone(),
            steps,
            sampler: sampler.clone(),
            guidance_scale: guidance,
            seed: image_seed,
            width: images.width,
            height: images.height,
            model: args.model.clone(),
            extra: vec![(
                "Version".into(),
                format!("oxidiff {}", env!("CARGO_PKG_VERSION")),
            )],
        };
        images.save_png_with_parameters(0, path, Some(&parameters))?;
        made.push((
            path,
            image_seed,
            images.width,
            images.height,
            generated.elapsed(),
        ));
    }
    bar.finish_and_clear();
    let mode = pipe.mode();
    for (path, image_seed, width, height, took) in &made {
        eprintln!(
            "wrote {} (seed {image_seed}, {steps} steps, guidance {guidance}, {width}x{height}, {device} {mode}; load {:.2}s, generate {:.2}s)",
            display(path),
            loaded.as_secs_f64(),
            took.as_secs_f64()
        );
    }
    if args.json {
        let summary = serde_json::json!({
            "files": made.iter().map(|m| display(m.0)).collect::<Vec<_>>(),
            "seeds": made.iter().map(|m| m.1).collect::<Vec<_>>(),
            "width": made.first().map(|m| m.2),
            "height": made.first().map(|m| m.3),
            "steps": steps,
            "guidance": guidance,
            "sampler": sampler,
            "model": args.model,
            "pipeline": class,
            "device": device.to_string(),
            "mode": mode,
            "load_seconds": loaded.as_secs_f64(),
            "generate_seconds": made.iter().map(|m| m.4.as_secs_f64()).collect::<Vec<_>>(),
        });
        println!("{summary}");
    }
    Ok(())
}

/// The pipeline `model_index.json`'s `_class_name` names.
enum Pipeline {
    Sd(Box<StableDiffusionPipeline<Oxi>>),
    Xl(Box<StableDiffusionXLPipeline<Oxi>>),
    PixArt(Box<PixArtPipeline<Oxi>>),
}

impl Pipeline {
    fn load(dir: &Path, class: &str, options: &LoadOptions, device: &OxiDevice) -> Result<Self> {
        Ok(if PIXART_CLASSES.contains(&class) {
            Self::PixArt(Box::new(PixArtPipeline::from_dir(dir, options, device)?))
        } else if class == SDXL_CLASS {
            Self::Xl(Box::new(StableDiffusionXLPipeline::from_dir(
                dir, options, device,
            )?))
        } else {
            Self::Sd(Box::new(StableDiffusionPipeline::from_dir(
                dir, options, device,
            )?))
        })
    }

    fn compile(&mut self) -> Result<()> {
        match self {
            Self::Sd(pipe) => Ok(pipe.compile()?),
            Self::Xl(pipe) => Ok(pipe.compile()?),
            Self::PixArt(pipe) => Ok(pipe.compile()?),
        }
    }

    /// "eager", or what compiled mode built.
    fn mode(&self) -> String {
        let programs = match self {
            Self::Sd(pipe) => {
                return match pipe.compile_stats() {
                    Some(stats) => format!(
                        "compiled: {} program(s), {} XLA compile(s), {} from the disk cache",
                        stats.programs, stats.xla_compiles, stats.disk_loads
                    ),
                    None => "eager".into(),
                }
            }
            Self::Xl(pipe) => pipe.compiles(),
            Self::PixArt(pipe) => pipe.compiles(),
        };
        match programs {
            Some(n) => format!("compiled: {n} program(s)"),
            None => "eager".into(),
        }
    }

    fn scheduler_class(&self) -> &'static str {
        match self {
            Self::Sd(pipe) => pipe.scheduler.kind().class_name(),
            Self::Xl(pipe) => pipe.scheduler.kind().class_name(),
            Self::PixArt(pipe) => pipe.scheduler.kind().class_name(),
        }
    }

    /// `(max_sequence_length, resolution_binning)` only matter to PixArt.
    fn generate_with(
        &mut self,
        request: GenerateRequest<Oxi>,
        (max_sequence_length, resolution_binning): (Option<usize>, bool),
        generator: &mut TorchCpuGenerator,
        callback: impl FnMut(StepInfo<'_, Oxi>),
    ) -> Result<PipelineOutput<Oxi>, PipelineError> {
        match self {
            Self::Sd(pipe) => pipe.generate_with(&request, generator, callback),
            Self::Xl(pipe) => {
                pipe.generate_with(&request, &XlOptions::default(), generator, callback)
            }
            Self::PixArt(pipe) => {
                let request = PixArtRequest {
                    common: request,
                    max_sequence_length,
                    resolution_binning,
                };
                pipe.generate_with(&request, generator, callback)
            }
        }
    }
}

/// A token that Ctrl-C cancels: the pipeline stops after the current step and nothing is
/// written; a second Ctrl-C exits at once.
fn interrupt_token() -> Result<CancelToken> {
    let cancel = CancelToken::new();
    let on_interrupt = cancel.clone();
    ctrlc::set_handler(move || {
        if on_interrupt.is_cancelled() {
            std::process::exit(i32::from(INTERRUPTED));
        }
        on_interrupt.cancel();
    })
    .context("installing the Ctrl-C handler")?;
    Ok(cancel)
}

/// Where the images go: `output` itself, `stem-i.png` beside it for several images, or numbered
/// files in a folder after the highest number already there. Existing files are refused unless
/// `force`, before anything is generated.
fn output_paths(output: &Path, count: usize, force: bool) -> Result<Vec<PathBuf>> {
    let is_dir = output.is_dir() || output.as_os_str().to_string_lossy().ends_with('/');
    let paths: Vec<PathBuf> = if is_dir {
        std::fs::create_dir_all(output)
            .with_context(|| format!("creating the output folder {}", output.display()))?;
        let next = std::fs::read_dir(output)
            .with_context(|| format!("reading the output folder {}", output.display()))?
            .filter_map(|entry| {
                let name = entry.ok()?.file_name().into_string().ok()?;
                name.strip_suffix(".png")?.parse::<u64>().ok()
            })
            .max()
            .map_or(0, |n| n + 1);
        (0..count as u64)
            .map(|i| output.join(format!("{:05}.png", next + i)))
            .collect()
    } else {
        if output.extension().and_then(|e| e.to_str()) != Some("png") {
            bail!(
                "--output must name a .png file or a folder, got {}",
                output.display()
            );
        }
        if count == 1 {
            vec![output.to_path_buf()]
        } else {
            let stem = output
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            (0..count)
                .map(|i| output.with_file_name(format!("{stem}-{i}.png")))
                .collect()
        }
    };
    if !force {
        if let Some(existing) = paths.iter().find(|p| p.exists()) {
            bail!(
                "{} already exists; pass --force to overwrite it or choose another --output",
                existing.display()
            );
        }
    }
    Ok(paths)
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
