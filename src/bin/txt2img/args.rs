//! `txt2img`'s command line: the flags, their defaults and `--help`'s text.

use std::path::PathBuf;

use clap::Parser;
use oxidiff::cli::control::ControlArgs;
use oxidiff::cli::ip_adapter::IpAdapterArgs;
use oxidiff::cli::usage::DEFAULT_MAX_PIXELS;
use oxidiff::cli::vae::VaeArgs;
use oxidiff::cli::Precision;
use oxidiff::pipelines::stable_diffusion_xl::SDXL_CLASS;
use oxidiff::pipelines::LoraSpec;
use oxidiff::pipelines::{FLUX_CLASSES, PIXART_CLASSES, SD3_CLASS};

/// The model used when none is given: one step, no guidance, 512x512.
pub const DEFAULT_MODEL: &str = "stabilityai/sd-turbo";

/// Examples, environment and exit codes, after the flags in `--help`.
const AFTER_HELP: &str = "\
Examples:
  txt2img --model tests/fixtures/tiny-sd1 --steps 4 --seed 7 -o tiny.png \"a red apple\"
  txt2img --model stabilityai/stable-diffusion-xl-base-1.0 --variant fp16 --dtype bf16 \\
          --device tpu --compile --num-images 8 --batch-size 4 -o out/ \"a castle at dusk\"
  txt2img --from-png out/00003.png --steps 30 -o again.png
  txt2img --model runwayml/stable-diffusion-v1-5 --ip-adapter ip-adapter_sd15.safetensors \\
          --ip-adapter-image cat.png --ip-adapter-scale 0.6 \"a cat in a hat\"

Environment:
  HF_HOME, HF_HUB_CACHE   the Hugging Face Hub cache (default ~/.cache/huggingface/hub)
  HF_HUB_OFFLINE=1        never download; a model not in the cache is an error naming the cache
  HF_TOKEN                token for gated or private Hub repositories
  RUST_LOG                log filter (default warn; info shows load, compile and timing events)
  OXIDIFF_COMPILE_CACHE   folder keeping XLA executables (eager and --compile) between runs
  OXIDIFF_MODEL_DIRS      folders where --from-png looks for the model a PNG names
  OXIDIFF_CACHE_DIR       oxidiff's cache folder (model hashes; default ~/.cache/oxidiff)
  OXIDIFF_LOG_COMPILES=1  log every XLA compile with its reason and timings
  OXIDIFF_PJRT_PLUGIN     a PJRT plugin file used for every PJRT --device
  OXIDIFF_PLUGIN_DIR      a folder of plugins as tools/fetch-plugins.sh lays them out
  TPU_LIBRARY_PATH        libtpu for --device tpu

Exit codes: 0 success, 1 failure (an error of at most 3 lines), 2 usage error (refused before
the model loads), 130 interrupted (Ctrl-C; the files written before it are named).";

/// `--output` when none is given (`txt2img.npy` for the .npy output types).
pub const DEFAULT_OUTPUT: &str = "txt2img.png";

#[derive(Parser, Debug)]
#[command(
    version,
    about = "Generate an image from a text prompt (Stable Diffusion 1.x/2.x, SDXL, SD3/SD3.5, PixArt-Alpha/Sigma, Flux.1)",
    after_help = AFTER_HELP
)]
pub struct Args {
    /// The prompt (optional with --from-png).
    pub prompt: Option<String>,
    /// Take prompt, negative prompt, steps, sampler, guidance, seed, size and (without
    /// --model) the model from the `parameters` text of a PNG that oxidiff (or an
    /// A1111-compatible tool) wrote; flags given as well override them.
    #[arg(long, value_name = "FILE.png")]
    pub from_png: Option<PathBuf>,
    /// A folder holding models (repeatable): where `--from-png` looks for the model its PNG
    /// names (a folder `NAME` or a file `NAME.safetensors`), before `OXIDIFF_MODEL_DIRS`, the
    /// working folder and the Hub cache.
    #[arg(long, value_name = "DIR")]
    pub model_dir: Vec<PathBuf>,
    /// A diffusers-format model folder, a Hugging Face Hub id (`org/name[@revision]`) found in
    /// the local Hub cache or downloaded when online, or a single-file checkpoint
    /// (`.safetensors` in the original LDM / A1111 layout: SD 1.x, 2.x, SDXL base; inpainting
    /// checkpoints and the SDXL refiner go to `img2img`).
    #[arg(long, default_value = DEFAULT_MODEL)]
    pub model: String,
    /// Whether `--model` was on the command line (else `--from-png` may name the model).
    #[arg(skip)]
    pub model_given: bool,
    /// For a single-file --model: a diffusers pipeline folder whose configs, scheduler and
    /// tokenizers to use (diffusers' `config=`); without it they come from the architecture's
    /// diffusers repository in the Hub cache, else built-in configs sized from the tensors.
    #[arg(long, value_name = "DIR")]
    pub config: Option<PathBuf>,
    /// For a single-file --model: the folder with `tokenizer/` (SDXL also `tokenizer_2/`), or a
    /// tokenizer folder itself (SD 1.x/2.x); a single file carries none.
    #[arg(long, value_name = "DIR")]
    pub tokenizer: Option<PathBuf>,
    /// Weight variant to load, e.g. `fp16` (`*.fp16.safetensors`).
    #[arg(long)]
    pub variant: Option<String>,
    /// A GGUF file (Q8_0, Q4_K, ... as city96 publishes for FLUX.1) replacing the transformer
    /// of the Flux folder --model, read with that folder's `transformer/config.json`; quantized
    /// weights stay quantized in memory.
    #[arg(long, value_name = "FILE.gguf")]
    pub transformer: Option<PathBuf>,
    /// What the image should not show (the unconditional prompt of classifier-free guidance).
    #[arg(long)]
    pub negative_prompt: Option<String>,
    /// Denoising steps (default: 1 for sd-turbo, 20 for PixArt, 28 for SD3 and Flux, else 50).
    #[arg(long)]
    pub steps: Option<usize>,
    /// Classifier-free guidance scale; 1 or less disables guidance (default: 0 for sd-turbo,
    /// 4.5 for PixArt, 7 for SD3, 3.5 for Flux dev's guidance embedding (schnell ignores it),
    /// else 7.5).
    #[arg(long)]
    pub guidance: Option<f64>,
    /// Scheduler by diffusers class (e.g. EulerDiscreteScheduler) or short/A1111 name: pndm
    /// (PLMS), ddim, ddpm, euler, euler_a ("Euler a"), heun, lms, "DPM++ 2M",
    /// "DPM++ 2M Karras", "DPM++ 2M SDE", "DPM++ SDE", DPM2, "DPM2 a", unipc, deis, lcm, tcd,
    /// flow_match_euler, flow_match_heun (default: the model's own).
    #[arg(long)]
    pub scheduler: Option<String>,
    /// Seed of the noise generator (PyTorch's CPU generator: same seed, same latents as
    /// diffusers). A random one is picked and printed when absent.
    #[arg(long)]
    pub seed: Option<u64>,
    /// The most pixels (width x height) an image may have; larger sizes are refused before the
    /// model loads (default 2048x2048 = 4194304).
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_PIXELS)]
    pub max_pixels: u64,
    /// Image width in pixels (a multiple of 8; default: the model's native size).
    #[arg(long)]
    pub width: Option<usize>,
    /// Image height in pixels (a multiple of 8; default: the model's native size).
    #[arg(long)]
    pub height: Option<usize>,
    /// Initial latents from a .npy or .safetensors file, shape [1, 4, height/8, width/8]
    /// (multiplied by the scheduler's init_noise_sigma, as diffusers does); --output-type
    /// latents writes files of this shape.
    #[arg(long)]
    pub latents: Option<PathBuf>,
    /// Output file (.png, or .npy with --output-type npy/latents; default txt2img.png or
    /// txt2img.npy), or a folder (an existing one, or a path ending in `/`) for numbered
    /// files 00000.png, 00001.png, ... after the highest number already there. With
    /// --num-images N > 1 a file name gets -0, -1, ... before the extension.
    #[arg(short, long, default_value = DEFAULT_OUTPUT)]
    pub output: PathBuf,
    /// Overwrite output files that exist (numbered files in a folder never overwrite).
    #[arg(long)]
    pub force: bool,
    /// How many images to make (in batches of --batch-size); image i uses seed + i (as A1111
    /// numbers them), so its PNG's parameters make it again alone.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub num_images: u64,
    /// Print a machine-readable summary on stdout: files, seeds, size, device, mode, timings.
    #[arg(long)]
    pub json: bool,
    /// Where to run: cpu, xla:cpu[:N] (XLA's CPU plugin), tpu[:N], cuda[:N], or a PJRT plugin
    /// path. PJRT devices run in eager mode (each op compiled once, then cached).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Compiled mode: each denoiser call (for Stable Diffusion with classifier-free guidance;
    /// the PixArt transformer) is one XLA program, compiled once per image size and then reused
    /// (needs a PJRT --device). With OXIDIFF_COMPILE_CACHE=DIR executables (eager ops' too) are
    /// kept on disk for later runs; OXIDIFF_LOG_COMPILES=1 logs each compile.
    #[arg(long)]
    pub compile: bool,
    /// On a PJRT device, `text-encoders` frees the text encoders' device memory once each
    /// request's prompts are encoded and uploads them again from the checkpoint for the next
    /// (less memory while denoising, one upload per request); default `off`.
    #[arg(long, default_value = "off", value_name = "off|text-encoders")]
    pub offload: oxidiff::pipelines::Offload,
    /// Tensor parallelism with --compile: the denoiser's transformer blocks split over N
    /// devices from --device on (N must divide every attention's heads and feed-forward width).
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub tp: usize,
    /// Data parallelism with --compile: each step's batch split over N devices (with --tp M,
    /// a mesh of N x M devices).
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub dp: usize,
    /// T5 tokens per prompt for PixArt (default: 120 for Alpha, 300 for Sigma), SD3 (default
    /// 256, at most 512) and Flux (default and most: 512); longer prompts are cut with a warning.
    #[arg(long)]
    pub max_sequence_length: Option<usize>,
    /// PixArt: generate at exactly --width x --height instead of the nearest trained aspect
    /// ratio (diffusers' `use_resolution_binning=False`).
    #[arg(long)]
    pub no_resolution_binning: bool,
    /// Flux: true classifier-free guidance with --negative-prompt when above 1 (diffusers'
    /// `true_cfg_scale`; each step then runs the transformer twice). Default 1: off.
    #[arg(long, default_value_t = 1.0)]
    pub true_cfg_scale: f64,
    /// No progress bars and no `wrote ...` lines (errors and warnings still go to stderr).
    /// Progress is also off when stderr is not a terminal.
    #[arg(long, short)]
    pub quiet: bool,
    /// Images per denoising call: --num-images is made in batches of this size. Each image
    /// keeps its own seed (a generator per image, as diffusers' list of generators), so the
    /// images equal those made one by one.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub batch_size: u64,
    /// What each output file holds: `png` (with the generation parameters), `npy` (the
    /// decoded image as float32 [height, width, 3] in [0, 1], one image of diffusers'
    /// `output_type="np"`), or `latents` (the final latents [1, 4, h/8, w/8] as float32 .npy,
    /// diffusers' `output_type="latent"`; the VAE is not run; readable by --latents).
    #[arg(long, value_enum, default_value_t = OutputKind::Png)]
    pub output_type: OutputKind,
    /// Precision of the weights: f32, or bf16 / f16 (weights cast after loading; the models
    /// compute in it, latents and scheduler math stay f32). bf16 and f16 work for Stable
    /// Diffusion 1.x/2.x, SDXL, SD3, Flux and PixArt on every device.
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    pub dtype: Precision,
    /// Hub revision (branch, tag or commit) of a Hub --model; the same as `org/name@REV`.
    #[arg(long, value_name = "REV")]
    pub revision: Option<String>,
    /// A LoRA to fuse into the UNet or transformer and the CLIP text encoders (SD 1.x/2.x,
    /// SDXL, SD3, Flux, PixArt), diffusers/PEFT or kohya/A1111 format (kohya: SD, SDXL and
    /// Flux), at SCALE (default 1); repeat for several. Recorded in the PNG as A1111 does:
    /// `<lora:NAME:SCALE>` after the prompt and a `Lora hashes` field.
    #[arg(long, value_name = "FILE[:SCALE]")]
    pub lora: Vec<LoraSpec>,
    #[command(flatten)]
    pub vae: VaeArgs,
    #[command(flatten)]
    pub control: ControlArgs,
    #[command(flatten)]
    pub ip_adapter: IpAdapterArgs,
}

/// `--output-type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputKind {
    Png,
    Npy,
    Latents,
}

impl OutputKind {
    pub fn extension(self) -> &'static str {
        match self {
            Self::Png => "png",
            Self::Npy | Self::Latents => "npy",
        }
    }
}

/// The pipelines whose models compute in --dtype bf16/f16.
pub const REDUCED_PRECISION_CLASSES: [&str; 6] = [
    "StableDiffusionPipeline",
    SDXL_CLASS,
    SD3_CLASS,
    FLUX_CLASSES[0],
    PIXART_CLASSES[0],
    PIXART_CLASSES[1],
];
