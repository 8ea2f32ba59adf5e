//! `txt2img`: generate images from a prompt with a diffusers-format model: Stable Diffusion
//! 1.x/2.x, SDXL, SD3/SD3.5, PixArt-Alpha/Sigma or Flux.1, picked by `model_index.json`'s `_class_name`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use burn::tensor::{FloatDType, Tensor, TensorData};
use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches, Parser};
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;

use oxidiff::latents::{encode_npy, read_latents};
use oxidiff::pipelines::host::read_f32;
use oxidiff::pipelines::hub::resolve_model_with_progress;
use oxidiff::pipelines::image::write_atomic;
use oxidiff::pipelines::lora::{hashes_field, prompt_with_tags, strip_prompt_tags};
use oxidiff::pipelines::parallel::ParallelConfig;
use oxidiff::pipelines::stable_diffusion_xl::SDXL_CLASS;
use oxidiff::pipelines::OutputType;
use oxidiff::pipelines::{
    is_single_file, pipeline_class, single_file_pipeline_class, CancelToken, GenerateRequest,
    GenerationParameters, LoadOptions, PipelineError, PipelineOutput, PixArtPipeline,
    PixArtRequest, SingleFileOptions, StableDiffusionPipeline, StableDiffusionXLPipeline, StepInfo,
    XlOptions, PIXART_CLASSES,
};
use oxidiff::pipelines::{FluxPipeline, FluxRequest, FLUX_CLASSES};
use oxidiff::pipelines::{LoraReport, LoraSpec};
use oxidiff::pipelines::{Sd3Request, StableDiffusion3Pipeline, SD3_CLASS};
use oxidiff::schedulers::TorchCpuGenerators;
use oxidiff::{Oxi, OxiDevice};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

/// Exit status after Ctrl-C (128 + SIGINT, as shells report it).
const INTERRUPTED: u8 = 130;

/// The model used when none is given: one step, no guidance, 512x512.
const DEFAULT_MODEL: &str = "stabilityai/sd-turbo";

/// Examples, environment and exit codes, after the flags in `--help`.
const AFTER_HELP: &str = "\
Examples:
  txt2img --model tests/fixtures/tiny-sd1 --steps 4 --seed 7 -o tiny.png \"a red apple\"
  txt2img --model stabilityai/stable-diffusion-xl-base-1.0 --variant fp16 --dtype bf16 \\
          --device tpu --compile --num-images 8 --batch-size 4 -o out/ \"a castle at dusk\"
  txt2img --from-png out/00003.png --steps 30 -o again.png

Environment:
  HF_HOME, HF_HUB_CACHE   the Hugging Face Hub cache (default ~/.cache/huggingface/hub)
  HF_HUB_OFFLINE=1        never download; a model not in the cache is an error naming the cache
  HF_TOKEN                token for gated or private Hub repositories
  RUST_LOG                log filter (default warn; info shows load, compile and timing events)
  OXIDIFF_COMPILE_CACHE   folder keeping --compile's executables between runs
  OXIDIFF_LOG_COMPILES=1  log every XLA compile with its reason and timings
  OXIDIFF_PJRT_PLUGIN     a PJRT plugin file used for every PJRT --device
  OXIDIFF_PLUGIN_DIR      a folder of plugins as tools/fetch-plugins.sh lays them out
  TPU_LIBRARY_PATH        libtpu for --device tpu

Exit codes: 0 success, 1 failure (one-line error), 2 usage error, 130 interrupted (Ctrl-C).";

/// `--output` when none is given (`txt2img.npy` for the .npy output types).
const DEFAULT_OUTPUT: &str = "txt2img.png";

#[derive(Parser, Debug)]
#[command(
    version,
    about = "Generate an image from a text prompt (Stable Diffusion 1.x/2.x, SDXL, SD3/SD3.5, PixArt-Alpha/Sigma, Flux.1)",
    after_help = AFTER_HELP
)]
struct Args {
    /// The prompt (optional with --from-png).
    prompt: Option<String>,
    /// Take prompt, negative prompt, steps, sampler, guidance, seed, size and (without
    /// --model) the model from the `parameters` text of a PNG that oxidiff (or an
    /// A1111-compatible tool) wrote; flags given as well override them.
    #[arg(long, value_name = "FILE.png")]
    from_png: Option<PathBuf>,
    /// A diffusers-format model folder, a Hugging Face Hub id (`org/name[@revision]`) found in
    /// the local Hub cache or downloaded when online, or a single-file checkpoint
    /// (`.safetensors` in the original LDM / A1111 layout: SD 1.x, 2.x, SDXL base; inpainting
    /// checkpoints and the SDXL refiner go to `img2img`).
    #[arg(long, default_value = DEFAULT_MODEL)]
    model: String,
    /// Whether `--model` was on the command line (else `--from-png` may name the model).
    #[arg(skip)]
    model_given: bool,
    /// For a single-file --model: a diffusers pipeline folder whose configs, scheduler and
    /// tokenizers to use (diffusers' `config=`); without it they come from the architecture's
    /// diffusers repository in the Hub cache, else built-in configs sized from the tensors.
    #[arg(long, value_name = "DIR")]
    config: Option<PathBuf>,
    /// For a single-file --model: the folder with `tokenizer/` (SDXL also `tokenizer_2/`), or a
    /// tokenizer folder itself (SD 1.x/2.x); a single file carries none.
    #[arg(long, value_name = "DIR")]
    tokenizer: Option<PathBuf>,
    /// Weight variant to load, e.g. `fp16` (`*.fp16.safetensors`).
    #[arg(long)]
    variant: Option<String>,
    /// What the image should not show (the unconditional prompt of classifier-free guidance).
    #[arg(long)]
    negative_prompt: Option<String>,
    /// Denoising steps (default: 1 for sd-turbo, 20 for PixArt, 28 for SD3 and Flux, else 50).
    #[arg(long)]
    steps: Option<usize>,
    /// Classifier-free guidance scale; 1 or less disables guidance (default: 0 for sd-turbo,
    /// 4.5 for PixArt, 7 for SD3, 3.5 for Flux dev's guidance embedding (schnell ignores it),
    /// else 7.5).
    #[arg(long)]
    guidance: Option<f64>,
    /// Scheduler by diffusers class (e.g. EulerDiscreteScheduler) or short/A1111 name: pndm
    /// (PLMS), ddim, ddpm, euler, euler_a ("Euler a"), heun, lms, "DPM++ 2M",
    /// "DPM++ 2M Karras", "DPM++ 2M SDE", "DPM++ SDE", DPM2, "DPM2 a", unipc, deis, lcm, tcd,
    /// flow_match_euler, flow_match_heun (default: the model's own).
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
    /// Initial latents from a .npy or .safetensors file, shape [1, 4, height/8, width/8]
    /// (multiplied by the scheduler's init_noise_sigma, as diffusers does); --output-type
    /// latents writes files of this shape.
    #[arg(long)]
    latents: Option<PathBuf>,
    /// Output file (.png, or .npy with --output-type npy/latents; default txt2img.png or
    /// txt2img.npy), or a folder (an existing one, or a path ending in `/`) for numbered
    /// files 00000.png, 00001.png, ... after the highest number already there. With
    /// --num-images N > 1 a file name gets -0, -1, ... before the extension.
    #[arg(short, long, default_value = DEFAULT_OUTPUT)]
    output: PathBuf,
    /// Overwrite output files that exist (numbered files in a folder never overwrite).
    #[arg(long)]
    force: bool,
    /// How many images to make (in batches of --batch-size); image i uses seed + i (as A1111
    /// numbers them), so its PNG's parameters make it again alone.
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
    /// Tensor parallelism with --compile: the denoiser's transformer blocks split over N
    /// devices from --device on (N must divide every attention's heads and feed-forward width).
    #[arg(long, default_value_t = 1, value_name = "N")]
    tp: usize,
    /// Data parallelism with --compile: each step's batch split over N devices (with --tp M,
    /// a mesh of N x M devices).
    #[arg(long, default_value_t = 1, value_name = "N")]
    dp: usize,
    /// T5 tokens per prompt for PixArt (default: 120 for Alpha, 300 for Sigma), SD3 (default
    /// 256, at most 512) and Flux (default and most: 512); longer prompts are cut with a warning.
    #[arg(long)]
    max_sequence_length: Option<usize>,
    /// PixArt: generate at exactly --width x --height instead of the nearest trained aspect
    /// ratio (diffusers' `use_resolution_binning=False`).
    #[arg(long)]
    no_resolution_binning: bool,
    /// Flux: true classifier-free guidance with --negative-prompt when above 1 (diffusers'
    /// `true_cfg_scale`; each step then runs the transformer twice). Default 1: off.
    #[arg(long, default_value_t = 1.0)]
    true_cfg_scale: f64,
    /// No progress bars and no `wrote ...` lines (errors and warnings still go to stderr).
    /// Progress is also off when stderr is not a terminal.
    #[arg(long, short)]
    quiet: bool,
    /// Images per denoising call: --num-images is made in batches of this size. Each image
    /// keeps its own seed (a generator per image, as diffusers' list of generators), so the
    /// images equal those made one by one.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1024))]
    batch_size: u64,
    /// What each output file holds: `png` (with the generation parameters), `npy` (the
    /// decoded image as float32 [height, width, 3] in [0, 1], one image of diffusers'
    /// `output_type="np"`), or `latents` (the final latents [1, 4, h/8, w/8] as float32 .npy,
    /// diffusers' `output_type="latent"`; the VAE is not run; readable by --latents).
    #[arg(long, value_enum, default_value_t = OutputKind::Png)]
    output_type: OutputKind,
    /// Precision of the weights: f32, or bf16 / f16 (weights cast after loading; the models
    /// compute in it, latents and scheduler math stay f32). bf16 and f16 work for Stable
    /// Diffusion 1.x/2.x, SDXL, SD3, Flux and PixArt on every device.
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    dtype: Precision,
    /// Hub revision (branch, tag or commit) of a Hub --model; the same as `org/name@REV`.
    #[arg(long, value_name = "REV")]
    revision: Option<String>,
    /// A LoRA to fuse into the UNet or transformer and the CLIP text encoders (SD 1.x/2.x,
    /// SDXL, SD3, Flux, PixArt), diffusers/PEFT or kohya/A1111 format (kohya: SD, SDXL and
    /// Flux), at SCALE (default 1); repeat for several. Recorded in the PNG as A1111 does:
    /// `<lora:NAME:SCALE>` after the prompt and a `Lora hashes` field.
    #[arg(long, value_name = "FILE[:SCALE]")]
    lora: Vec<LoraSpec>,
}

/// `--output-type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum OutputKind {
    Png,
    Npy,
    Latents,
}

impl OutputKind {
    fn extension(self) -> &'static str {
        match self {
            Self::Png => "png",
            Self::Npy | Self::Latents => "npy",
        }
    }
}

/// `--dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Precision {
    F32,
    Bf16,
    F16,
}

impl Precision {
    fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
        }
    }

    fn float_dtype(self) -> FloatDType {
        match self {
            Self::F32 => FloatDType::F32,
            Self::Bf16 => FloatDType::BF16,
            Self::F16 => FloatDType::F16,
        }
    }
}

/// The pipelines whose models compute in --dtype bf16/f16.
const REDUCED_PRECISION_CLASSES: [&str; 6] = [
    "StableDiffusionPipeline",
    SDXL_CLASS,
    SD3_CLASS,
    FLUX_CLASSES[0],
    PIXART_CLASSES[0],
    PIXART_CLASSES[1],
];

fn main() -> ExitCode {
    oxidiff::tune_allocator();
    let matches = Args::command().get_matches();
    let mut args = Args::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    args.model_given = matches.value_source("model") == Some(ValueSource::CommandLine);
    let progress = Progress::new(args.quiet);
    // Logs: `RUST_LOG` (default `warn`; `RUST_LOG=info` adds load, compile and timing events).
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let progress_events = tracing_subscriber::filter::filter_fn(|meta| {
        matches!(meta.target(), "oxidiff::load" | "oxidiff::compile")
    });
    tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_ansi(std::io::stderr().is_terminal())
                .with_filter(filter),
        )
        .with(ProgressLayer(progress.bar.clone()).with_filter(progress_events))
        .init();
    let result = run(args, &progress);
    progress.finish();
    match result {
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
    // `<lora:NAME:SCALE>` tags name LoRAs, not text: the prompt is encoded without them.
    let (prompt, tags) = strip_prompt_tags(&p.prompt);
    if !tags.is_empty() && args.lora.is_empty() && args.prompt.is_none() {
        eprintln!(
            "warning: {} was made with {}; pass --lora FILE:SCALE for each to make it again",
            path.display(),
            tags.join(" ")
        );
    }
    args.prompt.get_or_insert(prompt);
    args.negative_prompt.get_or_insert(p.negative_prompt);
    args.steps.get_or_insert(p.steps);
    args.guidance.get_or_insert(p.guidance_scale);
    args.seed.get_or_insert(p.seed);
    args.width.get_or_insert(p.width);
    args.height.get_or_insert(p.height);
    if args.scheduler.is_none() && !p.sampler.is_empty() {
        args.scheduler = Some(p.sampler);
    }
    if !args.model_given && !p.model.is_empty() {
        if !model_exists(&p.model) {
            bail!(
                "{} was made with model `{}`, which is neither a folder here nor a Hub id; \
                 pass --model PATH|ORG/NAME to make it again with that model",
                path.display(),
                p.model
            );
        }
        args.model = p.model;
    }
    Ok(())
}

/// Whether a model named in a PNG's parameters can be loaded: a path that exists here, or a
/// Hub id (`org/name[@rev]`, resolved from the cache or the network later).
fn model_exists(model: &str) -> bool {
    let path = Path::new(model);
    if path.exists() {
        return true;
    }
    let id = model.split('@').next().unwrap_or(model);
    let mut parts = id.split('/');
    matches!(
        (parts.next(), parts.next(), parts.next()),
        (Some(org), Some(name), None) if !org.is_empty() && !name.is_empty() && !model.starts_with('.')
    )
}

fn run(mut args: Args, progress: &Progress) -> Result<()> {
    apply_from_png(&mut args)?;
    let prompt = args.prompt.clone().unwrap_or_default();
    let negative_prompt = args.negative_prompt.clone().unwrap_or_default();
    let kind = args.output_type;
    let output = if kind != OutputKind::Png && args.output == Path::new(DEFAULT_OUTPUT) {
        PathBuf::from("txt2img.npy")
    } else {
        args.output.clone()
    };
    let outputs = output_paths(&output, args.num_images as usize, args.force, kind)?;
    if args.latents.is_some() && outputs.len() > 1 {
        bail!("--latents gives the initial latents of one image; use it with --num-images 1");
    }
    let seed = args.seed.unwrap_or_else(random_seed);
    let device: OxiDevice = args
        .device
        .parse()
        .with_context(|| format!("--device {}", args.device))?;
    let started = Instant::now();
    let dtype = args.dtype.float_dtype();
    let options = LoadOptions {
        variant: args.variant.clone(),
        scheduler: args.scheduler.clone(),
        dtype: (args.dtype != Precision::F32).then_some(dtype),
    };
    let single_file = is_single_file(Path::new(&args.model)).then(|| SingleFileOptions {
        load: options.clone(),
        config: args.config.clone(),
        tokenizer: args.tokenizer.clone(),
        prediction_type: None,
    });
    if single_file.is_none() && (args.config.is_some() || args.tokenizer.is_some()) {
        bail!("--config and --tokenizer apply to a single-file --model (a .safetensors file)");
    }
    if single_file.is_some() && args.variant.is_some() {
        bail!(
            "--variant picks weight files in a diffusers folder; {} is one file",
            args.model
        );
    }
    if single_file.is_some() && args.revision.is_some() {
        bail!(
            "--revision applies to Hub ids; {} is a local file",
            args.model
        );
    }
    let (dir, class, model) = match &single_file {
        Some(_) => {
            let path = PathBuf::from(&args.model);
            let class = single_file_pipeline_class(&path)
                .with_context(|| format!("loading {}", args.model))?;
            if class != "StableDiffusionPipeline" && class != SDXL_CLASS {
                bail!(
                    "{} is a checkpoint for {class} (an inpainting UNet or the SDXL refiner), \
                     which edits images: use the img2img binary (--image, and --mask for \
                     inpainting)",
                    args.model
                );
            }
            (path, class.to_string(), args.model.clone())
        }
        None => {
            let model = match &args.revision {
                Some(rev) if args.model.contains('@') => bail!(
                    "--revision {rev} and a revision in --model {}: give one of them",
                    args.model
                ),
                Some(rev) if Path::new(&args.model).exists() => bail!(
                    "--revision {rev} applies to Hub ids; {} is a local folder",
                    args.model
                ),
                Some(rev) => format!("{}@{rev}", args.model),
                None => args.model.clone(),
            };
            progress.phase(format!("resolving {model}"));
            // hf-hub draws its own download bars (bytes per file), under the same rule as ours.
            let show_downloads = !args.quiet && std::io::stderr().is_terminal();
            let dir = resolve_model_with_progress(&model, args.variant.as_deref(), show_downloads)
                .with_context(|| format!("loading {model}"))?;
            let class = pipeline_class(&dir).with_context(|| format!("loading {model}"))?;
            (dir, class, model)
        }
    };
    let pixart = PIXART_CLASSES.contains(&class.as_str());
    let flux = FLUX_CLASSES.contains(&class.as_str());
    let sd3 = class == SD3_CLASS;
    if (flux || sd3) && args.no_resolution_binning {
        bail!(
            "--no-resolution-binning applies to PixArt models; {} is a {class}",
            args.model
        );
    }
    if !flux && args.true_cfg_scale != 1.0 {
        bail!(
            "--true-cfg-scale applies to Flux models; {} is a {class}",
            args.model
        );
    }
    if !pixart
        && !flux
        && !sd3
        && (args.max_sequence_length.is_some() || args.no_resolution_binning)
    {
        bail!("--max-sequence-length and --no-resolution-binning apply to PixArt models (the length also to SD3 and Flux); {} is a {class}", args.model);
    }
    if args.dtype != Precision::F32 && !REDUCED_PRECISION_CLASSES.contains(&class.as_str()) {
        bail!(
            "--dtype {} is not supported for {class}, which computes in f32 only; use --dtype f32 \
             (bf16 and f16 work with {})",
            args.dtype.name(),
            REDUCED_PRECISION_CLASSES.join(", ")
        );
    }
    let turbo = args.model.trim_end_matches('/').ends_with("sd-turbo");
    let steps = args.steps.unwrap_or(if turbo {
        1
    } else if pixart {
        20
    } else if flux || sd3 {
        28
    } else {
        50
    });
    // diffusers' defaults: 7.5 for SD 1.x/2.x, 5 for SDXL, 4.5 for PixArt.
    let guidance = args.guidance.unwrap_or(if turbo {
        0.0
    } else if pixart {
        4.5
    } else if flux {
        3.5
    } else if sd3 {
        7.0
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
        output: if kind == OutputKind::Latents {
            OutputType::Latents
        } else {
            OutputType::Images
        },
        cancel: Some(interrupt_token()?),
        ..Default::default()
    };

    progress.phase(format!("loading {class}"));
    let mut pipe = match &single_file {
        Some(sf) => Pipeline::load_single_file(&dir, &class, sf, &device),
        None => Pipeline::load(&dir, &class, &options, &device),
    }
    .with_context(|| format!("loading {}", args.model))?;
    let mut loras = Vec::with_capacity(args.lora.len());
    for spec in &args.lora {
        let report = pipe
            .load_lora(spec)
            .with_context(|| format!("--lora {}", spec.path.display()))?;
        if !args.quiet {
            let layers: Vec<String> = report
                .layers
                .iter()
                .map(|(component, n)| format!("{n} {component} layers"))
                .collect();
            eprintln!(
                "fused LoRA {} at scale {} ({})",
                display(&report.path),
                report.scale,
                layers.join(", ")
            );
        }
        loras.push(report);
    }
    if args.compile {
        pipe.compile()?;
    }
    if args.tp != 1 || args.dp != 1 {
        if !args.compile {
            bail!("--tp and --dp partition the compiled step: add --compile (and a PJRT --device)");
        }
        pipe.enable_parallelism(ParallelConfig::new(args.dp, args.tp))?;
    }
    let loaded = started.elapsed();
    tracing::info!(seconds = loaded.as_secs_f64(), %class, "loaded");
    let pixart_options = (
        args.max_sequence_length,
        !args.no_resolution_binning,
        args.true_cfg_scale,
    );
    let sampler = args
        .scheduler
        .clone()
        .unwrap_or_else(|| pipe.scheduler_class().to_string());
    let batch_size = args.batch_size as usize;
    let batches = outputs.len().div_ceil(batch_size);
    let mut made = Vec::with_capacity(outputs.len());
    let mut batch_seconds = Vec::with_capacity(batches);
    for (b, paths) in outputs.chunks(batch_size).enumerate() {
        let first = (b * batch_size) as u64;
        let seeds: Vec<u64> = (0..paths.len() as u64).map(|i| seed + first + i).collect();
        let request = GenerateRequest {
            seed: seeds[0],
            num_images_per_prompt: paths.len(),
            ..request.clone()
        };
        let mut generator = TorchCpuGenerators::new(&seeds);
        let generated = Instant::now();
        let label = if batches > 1 {
            format!("batch {}/{batches}: denoising", b + 1)
        } else {
            "denoising".to_string()
        };
        progress.steps(&label, steps);
        let on_step = |info: StepInfo<'_, Oxi>| progress.step(&info, kind != OutputKind::Latents);
        let output = pipe.generate_with(request, pixart_options, &mut generator, on_step)?;
        let took = generated.elapsed();
        progress.phase("writing".into());
        for (j, (path, &image_seed)) in paths.iter().zip(&seeds).enumerate() {
            let (width, height) = match kind {
                OutputKind::Latents => {
                    let [_, c, h, w] = output.latents.dims();
                    let row = output.latents.clone().narrow(0, j, 1);
                    let values = read_f32(row)?;
                    write_atomic(path, &encode_npy(&values, &[1, c, h, w]))?;
                    let f = pipe.vae_scale_factor();
                    (w * f, h * f)
                }
                OutputKind::Npy | OutputKind::Png => {
                    let images = output
                        .images
                        .as_ref()
                        .context("the pipeline returned no images")?;
                    if kind == OutputKind::Npy {
                        let size = images.height * images.width * 3;
                        let values = &images.data[j * size..(j + 1) * size];
                        write_atomic(path, &encode_npy(values, &[images.height, images.width, 3]))?;
                    } else {
                        let mut extra = Vec::new();
                        if !loras.is_empty() {
                            extra.push(("Lora hashes".to_string(), hashes_field(&loras)));
                        }
                        extra.push((
                            "Version".into(),
                            format!("oxidiff {}", env!("CARGO_PKG_VERSION")),
                        ));
                        let parameters = GenerationParameters {
                            prompt: prompt_with_tags(&prompt, &loras),
                            negative_prompt: negative_prompt.clone(),
                            steps,
                            sampler: sampler.clone(),
                            guidance_scale: guidance,
                            seed: image_seed,
                            width: images.width,
                            height: images.height,
                            model: model.clone(),
                            extra,
                        };
                        images.save_png_with_parameters(j, path, Some(&parameters))?;
                    }
                    (images.width, images.height)
                }
            };
            // A batch's time is shared equally by its images.
            let per_image = took / paths.len() as u32;
            made.push((path, image_seed, width, height, per_image));
        }
        batch_seconds.push(took.as_secs_f64());
    }
    progress.finish();
    let mode = pipe.mode();
    if !args.quiet {
        for (path, image_seed, width, height, took) in &made {
            eprintln!(
                "wrote {} (seed {image_seed}, {steps} steps, guidance {guidance}, {width}x{height}, {device} {mode}, {}; load {:.2}s, generate {:.2}s)",
                display(path),
                args.dtype.name(),
                loaded.as_secs_f64(),
                took.as_secs_f64()
            );
        }
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
            "model": model,
            "loras": loras.iter().map(|l| serde_json::json!({
                "file": display(&l.path),
                "scale": l.scale,
                "hash": l.short_hash,
            })).collect::<Vec<_>>(),
            "pipeline": class,
            "device": device.to_string(),
            "mode": mode,
            "dtype": args.dtype.name(),
            "output_type": format!("{kind:?}").to_lowercase(),
            "batch_size": batch_size,
            "load_seconds": loaded.as_secs_f64(),
            "generate_seconds": made.iter().map(|m| m.4.as_secs_f64()).collect::<Vec<_>>(),
            "batch_seconds": batch_seconds,
        });
        println!("{summary}");
    }
    Ok(())
}

/// The progress display on stderr: one line for loading (per component), compiling (with the
/// reason), the denoising steps (with it/s) and decoding. Hidden with --quiet or when stderr is
/// not a terminal. Loading and compile phases arrive as `tracing` events (targets
/// `oxidiff::load` and `oxidiff::compile`), through [`ProgressLayer`].
struct Progress {
    bar: ProgressBar,
}

impl Progress {
    fn new(quiet: bool) -> Self {
        if quiet || !std::io::stderr().is_terminal() {
            return Self {
                bar: ProgressBar::hidden(),
            };
        }
        let bar = ProgressBar::new_spinner();
        bar.set_style(
            ProgressStyle::with_template("{spinner} {msg} [{elapsed}]")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        bar.enable_steady_tick(std::time::Duration::from_millis(120));
        Self { bar }
    }

    /// A phase without a count (loading, compiling, decoding, writing).
    fn phase(&self, message: String) {
        self.bar.set_message(message);
    }

    /// Starts counting `steps` denoising steps.
    fn steps(&self, label: &str, steps: usize) {
        self.bar.set_message(label.to_string());
        self.bar.set_style(
            ProgressStyle::with_template("{msg} {bar:30} {pos}/{len} [{elapsed}] {per_sec}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        self.bar.reset();
        self.bar.set_length(steps as u64);
        self.bar.set_position(0);
    }

    /// After each step; the VAE decode follows the last one when images are made.
    fn step(&self, info: &StepInfo<'_, Oxi>, decodes: bool) {
        self.bar.set_length(info.num_steps as u64);
        self.bar.set_position(info.step as u64 + 1);
        if decodes && info.step + 1 == info.num_steps {
            self.bar.set_message("decoding");
        }
    }

    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// Shows the pipelines' load events (`oxidiff::load`, one per component) and the compiler's
/// (`oxidiff::compile`, with the reason) on the progress line.
struct ProgressLayer(ProgressBar);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for ProgressLayer {
    fn on_event(
        &self,
        event: &tracing::Event<'_>,
        _ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        let get = |name: &str| {
            fields
                .0
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
                .unwrap_or_default()
        };
        match event.metadata().target() {
            "oxidiff::load" => self.0.set_message(format!("loading {}", get("component"))),
            "oxidiff::compile" => {
                self.0
                    .set_message(format!("compiling {} ({})", get("program"), get("reason")))
            }
            _ => {}
        }
    }
}

/// An event's fields as text.
#[derive(Default)]
struct Fields(Vec<(String, String)>);

impl tracing::field::Visit for Fields {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.push((field.name().to_string(), value.to_string()));
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0
            .push((field.name().to_string(), format!("{value:?}")));
    }
}

/// The pipeline `model_index.json`'s `_class_name` names.
enum Pipeline {
    Sd(Box<StableDiffusionPipeline<Oxi>>),
    Xl(Box<StableDiffusionXLPipeline<Oxi>>),
    PixArt(Box<PixArtPipeline<Oxi>>),
    Flux(Box<FluxPipeline<Oxi>>),
    Sd3(Box<StableDiffusion3Pipeline<Oxi>>),
}

impl Pipeline {
    fn load(dir: &Path, class: &str, options: &LoadOptions, device: &OxiDevice) -> Result<Self> {
        Ok(if FLUX_CLASSES.contains(&class) {
            Self::Flux(Box::new(FluxPipeline::from_dir(dir, options, device)?))
        } else if class == SD3_CLASS {
            Self::Sd3(Box::new(StableDiffusion3Pipeline::from_dir(
                dir, options, device,
            )?))
        } else if PIXART_CLASSES.contains(&class) {
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

    /// A single-file checkpoint: SD 1.x/2.x or SDXL, as `class` says.
    fn load_single_file(
        path: &Path,
        class: &str,
        options: &SingleFileOptions,
        device: &OxiDevice,
    ) -> Result<Self> {
        Ok(if class == SDXL_CLASS {
            Self::Xl(Box::new(StableDiffusionXLPipeline::from_single_file(
                path, options, device,
            )?))
        } else {
            Self::Sd(Box::new(StableDiffusionPipeline::from_single_file(
                path, options, device,
            )?))
        })
    }

    /// Fuses a LoRA into the denoiser (UNet or transformer) and the CLIP text encoders.
    fn load_lora(&mut self, spec: &LoraSpec) -> Result<LoraReport> {
        let (path, scale) = (&spec.path, spec.scale);
        Ok(match self {
            Self::Sd(pipe) => pipe.load_lora(path, scale)?,
            Self::Xl(pipe) => pipe.load_lora(path, scale)?,
            Self::PixArt(pipe) => pipe.load_lora(path, scale)?,
            Self::Flux(pipe) => pipe.load_lora(path, scale)?,
            Self::Sd3(pipe) => pipe.load_lora(path, scale)?,
        })
    }

    fn enable_parallelism(&mut self, config: ParallelConfig) -> Result<()> {
        match self {
            Self::Sd(pipe) => Ok(pipe.enable_parallelism(config)?),
            Self::PixArt(pipe) => Ok(pipe.enable_parallelism(config)?),
            Self::Xl(pipe) => Ok(pipe.enable_parallelism(config)?),
            Self::Flux(pipe) => Ok(pipe.enable_parallelism(config)?),
            Self::Sd3(pipe) => Ok(pipe.enable_parallelism(config)?),
        }
    }

    fn compile(&mut self) -> Result<()> {
        match self {
            Self::Sd(pipe) => Ok(pipe.compile()?),
            Self::Xl(pipe) => Ok(pipe.compile()?),
            Self::PixArt(pipe) => Ok(pipe.compile()?),
            Self::Flux(pipe) => Ok(pipe.compile()?),
            Self::Sd3(pipe) => Ok(pipe.compile()?),
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
            Self::Xl(pipe) => pipe.compile_stats().map(|s| s.programs),
            Self::PixArt(pipe) => pipe.compile_stats().map(|s| s.programs),
            Self::Flux(pipe) => pipe.compile_stats().map(|s| s.programs),
            Self::Sd3(pipe) => pipe.compile_stats().map(|s| s.programs),
        };
        match programs {
            Some(n) => format!("compiled: {n} program(s)"),
            None => "eager".into(),
        }
    }

    /// Pixels per latent cell.
    fn vae_scale_factor(&self) -> usize {
        match self {
            Self::Sd(pipe) => pipe.vae_scale_factor,
            Self::Xl(pipe) => pipe.vae_scale_factor,
            Self::PixArt(pipe) => pipe.vae_scale_factor,
            Self::Flux(pipe) => pipe.vae_scale_factor,
            Self::Sd3(pipe) => pipe.vae_scale_factor,
        }
    }

    fn scheduler_class(&self) -> &'static str {
        match self {
            Self::Sd(pipe) => pipe.scheduler.kind().class_name(),
            Self::Xl(pipe) => pipe.scheduler.kind().class_name(),
            Self::PixArt(pipe) => pipe.scheduler.kind().class_name(),
            Self::Flux(pipe) => pipe.scheduler.kind().class_name(),
            Self::Sd3(pipe) => pipe.scheduler.kind().class_name(),
        }
    }

    /// `(max_sequence_length, resolution_binning, true_cfg_scale)` only matter to PixArt, SD3
    /// (the length) and Flux.
    fn generate_with(
        &mut self,
        request: GenerateRequest<Oxi>,
        (max_sequence_length, resolution_binning, true_cfg_scale): (Option<usize>, bool, f64),
        generator: &mut TorchCpuGenerators,
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
            Self::Flux(pipe) => {
                let request = FluxRequest {
                    common: request,
                    max_sequence_length: max_sequence_length
                        .unwrap_or(oxidiff::pipelines::flux::FLUX_MAX_SEQUENCE_LENGTH),
                    true_cfg_scale,
                    ..Default::default()
                };
                pipe.generate_with(&request, generator, callback)
            }
            Self::Sd3(pipe) => {
                let request = Sd3Request {
                    common: request,
                    max_sequence_length: max_sequence_length.unwrap_or(256),
                    ..Default::default()
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
fn output_paths(
    output: &Path,
    count: usize,
    force: bool,
    kind: OutputKind,
) -> Result<Vec<PathBuf>> {
    let ext = kind.extension();
    let is_dir = output.is_dir() || output.as_os_str().to_string_lossy().ends_with('/');
    let paths: Vec<PathBuf> = if is_dir {
        std::fs::create_dir_all(output)
            .with_context(|| format!("creating the output folder {}", output.display()))?;
        let next = std::fs::read_dir(output)
            .with_context(|| format!("reading the output folder {}", output.display()))?
            .filter_map(|entry| {
                let name = entry.ok()?.file_name().into_string().ok()?;
                let stem = name
                    .strip_suffix(".png")
                    .or_else(|| name.strip_suffix(".npy"))?;
                stem.parse::<u64>().ok()
            })
            .max()
            .map_or(0, |n| n + 1);
        (0..count as u64)
            .map(|i| output.join(format!("{:05}.{ext}", next + i)))
            .collect()
    } else {
        if output.extension().and_then(|e| e.to_str()) != Some(ext) {
            let kind = format!("{kind:?}").to_lowercase();
            bail!(
                "--output must name a .{ext} file or a folder for --output-type {kind}, got {}",
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
                .map(|i| output.with_file_name(format!("{stem}-{i}.{ext}")))
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
