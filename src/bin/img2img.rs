//! `img2img`: edit an input image with a diffusers-format Stable Diffusion 1.x/2.x or SDXL
//! model, or a single-file checkpoint (image to image, or inpainting with `--mask`). The
//! pipeline follows `model_index.json`'s class (a single file's detected architecture), as
//! `txt2img` does.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use burn::tensor::backend::Backend;
use clap::Parser;
use oxidiff::cli::control::ControlArgs;
use oxidiff::cli::ip_adapter::IpAdapterArgs;
use oxidiff::cli::model_lookup::png_model_hash;
use oxidiff::cli::output::{check_writable, parent_dir, write_new, Existing, OutputError};
use oxidiff::cli::usage::{self, DEFAULT_MAX_PIXELS};
use oxidiff::cli::vae::VaeArgs;
use oxidiff::cli::{closing_fields, error_message, model_name, UsageError};
use oxidiff::files::check_regular;
use oxidiff::pipelines::image::{load_image, load_mask};
use oxidiff::pipelines::lora::prompt_with_tags;
use oxidiff::pipelines::metadata::{encode_png, sampler_field, PARAMETERS_KEYWORD};
use oxidiff::pipelines::PipelineFamily;
use oxidiff::pipelines::{
    is_single_file, resolve_model, AutoPipelineForImage2Image, AutoPipelineForInpainting,
    EditOptions, GenerateRequest, GenerationParameters, Images, LoadOptions, LoraReport, LoraSpec,
    Result as PipelineResult, SingleFileOptions, StepInfo,
};
use oxidiff::schedulers::{SchedulerKind, TorchCpuGenerator};
use oxidiff::{Cpu, Oxi, OxiDevice};

#[derive(Parser, Debug)]
#[command(
    version,
    about = "Edit an image from a text prompt: image to image, or inpainting with --mask \
             (Stable Diffusion 1.x/2.x and SDXL)"
)]
struct Args {
    prompt: String,
    /// The input image (PNG, JPEG or WebP); its size, rounded down to a multiple of 8, unless
    /// --width/--height are given.
    #[arg(long)]
    image: PathBuf,
    /// Inpaint: repaint the white part of this mask (PNG, JPEG or WebP, the image's size;
    /// converted to grayscale and binarized at half intensity), keep the black part.
    #[arg(long)]
    mask: Option<PathBuf>,
    /// With --mask: inpaint only the box around the mask's nonzero pixels, grown by N pixels
    /// and to the output's aspect ratio, at the output size, then paste it back into the
    /// image (diffusers' `padding_mask_crop`); the output keeps the input image's size.
    #[arg(long, value_name = "N")]
    padding_mask_crop: Option<usize>,
    /// How much to change the image, in (0, 1]: the fraction of the steps that are run.
    /// Default as diffusers: 0.8 (SD image to image), 1 (SD inpainting), 0.3 (SDXL image to
    /// image), 0.9999 (SDXL inpainting).
    #[arg(long)]
    strength: Option<f64>,
    /// A diffusers-format model folder, a Hub id in the local Hub cache, or a single-file
    /// checkpoint (`.safetensors` in the LDM / A1111 layout: SD 1.x/2.x, SDXL base, their
    /// inpainting versions, the SDXL refiner).
    #[arg(long)]
    model: String,
    /// For a single-file --model: a diffusers pipeline folder whose configs, scheduler and
    /// tokenizers to use (diffusers' `config=`), as txt2img's --config.
    #[arg(long, value_name = "DIR")]
    config: Option<PathBuf>,
    /// For a single-file --model: the folder with `tokenizer/` (SDXL also `tokenizer_2/`), or a
    /// tokenizer folder itself (SD 1.x/2.x).
    #[arg(long, value_name = "DIR")]
    tokenizer: Option<PathBuf>,
    #[arg(long)]
    variant: Option<String>,
    #[arg(long)]
    negative_prompt: Option<String>,
    #[arg(long, default_value_t = 50)]
    steps: usize,
    /// Classifier-free guidance scale; default as diffusers: 7.5, or 5 for SDXL image to
    /// image.
    #[arg(long)]
    guidance: Option<f64>,
    /// Scheduler by diffusers class or short/A1111 name (as txt2img).
    #[arg(long)]
    scheduler: Option<String>,
    /// Seed of the generator (PyTorch's CPU generator: the same VAE sample and noise as
    /// diffusers with `torch.Generator().manual_seed(seed)`).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long)]
    width: Option<usize>,
    #[arg(long)]
    height: Option<usize>,
    /// SDXL refiners (`requires_aesthetics_score`): the aesthetic score of the prompt.
    #[arg(long, default_value_t = 6.0)]
    aesthetic_score: f64,
    /// SDXL refiners: the aesthetic score of the negative prompt.
    #[arg(long, default_value_t = 2.5)]
    negative_aesthetic_score: f64,
    /// The most pixels (width x height) the output may have, as txt2img's --max-pixels.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_PIXELS)]
    max_pixels: u64,
    #[arg(short, long, default_value = "img2img.png")]
    output: PathBuf,
    #[arg(long)]
    force: bool,
    /// cpu, xla:cpu[:N], tpu[:N], cuda[:N].
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Compiled mode on a PJRT device, as txt2img's: each UNet call (with guidance and, for
    /// 9-channel inpainting UNets, the mask channels) is one XLA program.
    #[arg(long)]
    compile: bool,
    /// A LoRA to fuse into the UNet and text encoders, diffusers/PEFT or kohya/A1111 format,
    /// at SCALE (default 1); repeat for several. Recorded in the PNG as txt2img records it
    /// (`<lora:NAME:SCALE>` after the prompt, a `Lora hashes` field).
    #[arg(long, value_name = "FILE[:SCALE]")]
    lora: Vec<LoraSpec>,
    #[command(flatten)]
    vae: VaeArgs,
    #[command(flatten)]
    control: ControlArgs,
    #[command(flatten)]
    ip_adapter: IpAdapterArgs,
}

/// Fuses each `--lora` with `load` (the pipeline's `load_lora`), before any compile.
fn fuse_loras(
    specs: &[LoraSpec],
    mut load: impl FnMut(&Path, f32) -> oxidiff::pipelines::Result<LoraReport>,
) -> Result<Vec<LoraReport>> {
    let mut reports = Vec::with_capacity(specs.len());
    for spec in specs {
        let report = load(&spec.path, spec.scale)
            .with_context(|| format!("--lora {}", spec.path.display()))?;
        let layers: Vec<String> = report
            .layers
            .iter()
            .map(|(component, n)| format!("{n} {component} layers"))
            .collect();
        eprintln!(
            "fused LoRA {} at scale {} ({})",
            report.path.display(),
            report.scale,
            layers.join(", ")
        );
        reports.push(report);
    }
    Ok(reports)
}

fn main() -> ExitCode {
    oxidiff::tune_allocator();
    // Logs: `RUST_LOG` (default `warn`), as txt2img's.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let message = oxidiff::cli::error_message(e.as_ref());
            tracing::info!(%message, "the full error");
            eprintln!("error: {}", oxidiff::cli::short_report(&message));
            if e.chain().any(|cause| cause.is::<UsageError>()) {
                ExitCode::from(2)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

/// The command-line checks that need no model, made before anything is read: each failure is
/// a usage error (exit 2) naming the fix.
fn check_usage(args: &Args, device: &OxiDevice) -> Result<(), UsageError> {
    if args.compile && !device.is_pjrt() {
        return Err(UsageError(format!(
            "add --device xla:cpu, tpu or cuda, or drop --compile: --compile needs a PJRT \
             device (--device {} runs eagerly)",
            args.device
        )));
    }
    if let Some(strength) = args.strength {
        usage::unit_interval("--strength", strength)?;
    }
    if let Some(guidance) = args.guidance {
        usage::finite("--guidance", guidance)?;
    }
    usage::finite("--aesthetic-score", args.aesthetic_score)?;
    usage::finite("--negative-aesthetic-score", args.negative_aesthetic_score)?;
    usage::steps("--steps", args.steps)?;
    usage::image_size("--width/--height", args.width, args.height, args.max_pixels)?;
    args.control.check(args.max_pixels)?;
    args.ip_adapter.check()?;
    Ok(())
}

fn run(args: Args) -> Result<()> {
    let device: OxiDevice = args
        .device
        .parse()
        .with_context(|| format!("--device {}", args.device))?;
    check_usage(&args, &device)?;
    if args.padding_mask_crop.is_some() && args.mask.is_none() {
        bail!(
            "--padding-mask-crop crops to the mask's region: it needs --mask (the part to \
             repaint, white)"
        );
    }
    let existing = if args.force {
        Existing::Replace
    } else {
        Existing::Keep
    };
    check_writable(parent_dir(&args.output))?;
    if existing == Existing::Keep && args.output.exists() {
        return Err(OutputError::Exists {
            path: args.output.clone(),
        }
        .into());
    }
    // Inputs are read and checked before the model is loaded, their size from the header
    // before any pixel is decoded.
    for (what, path) in [
        ("input image", Some(&args.image)),
        ("mask", args.mask.as_ref()),
    ] {
        let Some(path) = path else { continue };
        check_regular(path, what)?;
        if let Ok((w, h)) = image::image_dimensions(path) {
            if usage::pixels_within(w as usize, h as usize, args.max_pixels).is_none() {
                return Err(UsageError(format!(
                    "pass --max-pixels N to read the {what} {} ({w}x{h}): images are limited to \
                     {} pixels",
                    path.display(),
                    args.max_pixels
                ))
                .into());
            }
        }
    }
    let image = load_image(&args.image)?;
    let mask = match &args.mask {
        Some(path) => {
            let mask = load_mask(path)?;
            if (mask.width(), mask.height()) != (image.width(), image.height()) {
                bail!(
                    "the mask {} is {}x{} but the image {} is {}x{}; give a mask of the image's \
                     size (white repaints, black keeps)",
                    path.display(),
                    mask.width(),
                    mask.height(),
                    args.image.display(),
                    image.width(),
                    image.height()
                );
            }
            Some(mask)
        }
        None => None,
    };
    let options = LoadOptions {
        variant: args.variant.clone(),
        scheduler: args.scheduler.clone(),
        ..Default::default()
    };
    let source = if is_single_file(Path::new(&args.model)) {
        if args.variant.is_some() {
            bail!(
                "--variant picks weight files in a diffusers folder; {} is one file",
                args.model
            );
        }
        Source::File(
            PathBuf::from(&args.model),
            SingleFileOptions {
                load: options,
                config: args.config.clone(),
                tokenizer: args.tokenizer.clone(),
                prediction_type: None,
            },
        )
    } else {
        if args.config.is_some() || args.tokenizer.is_some() {
            bail!("--config and --tokenizer apply to a single-file --model (a .safetensors file)");
        }
        let dir = resolve_model(&args.model, args.variant.as_deref())
            .with_context(|| format!("loading {}", args.model))?;
        Source::Dir(dir, options)
    };
    let edited = match device {
        // The plain CPU backend, where oxidiff's CPU kernels apply.
        OxiDevice::Cpu => edit::<Cpu>(&args, &source, &Default::default(), &image, mask.as_ref())?,
        device => edit::<Oxi>(&args, &source, &device, &image, mask.as_ref())?,
    };
    let Edited {
        images: output_images,
        sampler,
        pipeline,
        compiled,
        loras,
        strength,
        guidance,
    } = edited;
    let images: Images = output_images.context("the pipeline returned no images")?;
    let model_hash = match &source {
        Source::File(path, sf) => png_model_hash(path, &sf.load),
        Source::Dir(dir, options) => png_model_hash(dir, options),
    }
    .unwrap_or_else(|e| {
        eprintln!("warning: the PNG gets no Model hash: {}", error_message(&e));
        String::new()
    });
    let mut extra = vec![("Denoising strength".into(), strength.to_string())];
    extra.extend(args.control.png_fields());
    extra.extend(args.ip_adapter.png_fields());
    extra.extend(closing_fields(&loras));
    let parameters = GenerationParameters {
        prompt: prompt_with_tags(&args.prompt, &loras),
        negative_prompt: args.negative_prompt.clone().unwrap_or_default(),
        steps: args.steps,
        sampler: sampler_field(args.scheduler.as_deref(), sampler),
        guidance_scale: guidance,
        seed: args.seed,
        width: images.width,
        height: images.height,
        model: model_name(&args.model),
        model_hash,
        extra,
    };
    let rgb = images
        .to_rgb8(0)
        .context("the pipeline returned no images")?;
    let png = encode_png(&rgb, &[(PARAMETERS_KEYWORD, parameters.to_text())])?;
    write_new(&args.output, &png, existing)?;
    let mode = match compiled {
        Some(programs) => format!("compiled: {programs} program(s)"),
        None => "eager".into(),
    };
    eprintln!(
        "wrote {} ({pipeline}, seed {}, strength {strength}, {}x{}, {mode})",
        args.output.display(),
        args.seed,
        images.width,
        images.height
    );
    Ok(())
}

/// Where the model comes from: a diffusers folder or a single-file checkpoint.
enum Source {
    Dir(PathBuf, LoadOptions),
    File(PathBuf, SingleFileOptions),
}

/// The library's editing pipeline `--mask` picks.
enum Editor<B: Backend> {
    Image2Image(AutoPipelineForImage2Image<B>),
    Inpainting(AutoPipelineForInpainting<B>),
}

/// Calls `$body` with `$pipe` bound to whichever auto pipeline edits.
macro_rules! each {
    ($editor:expr, $pipe:ident => $body:expr) => {
        match $editor {
            Editor::Image2Image($pipe) => $body,
            Editor::Inpainting($pipe) => $body,
        }
    };
}

impl<B: Backend> Editor<B> {
    fn load(source: &Source, inpainting: bool, device: &B::Device) -> PipelineResult<Self> {
        Ok(match (source, inpainting) {
            (Source::Dir(dir, options), false) => {
                Self::Image2Image(AutoPipelineForImage2Image::from_dir(dir, options, device)?)
            }
            (Source::Dir(dir, options), true) => {
                Self::Inpainting(AutoPipelineForInpainting::from_dir(dir, options, device)?)
            }
            (Source::File(path, options), false) => Self::Image2Image(
                AutoPipelineForImage2Image::from_single_file(path, options, device)?,
            ),
            (Source::File(path, options), true) => Self::Inpainting(
                AutoPipelineForInpainting::from_single_file(path, options, device)?,
            ),
        })
    }
}

/// What img2img needs of a backend beyond Burn's: compiled mode where it has one
/// (`check_usage` refuses `--compile` on the CPU).
trait EditBackend: Backend {
    fn compile(editor: &mut Editor<Self>) -> Result<()>;
    /// Programs compiled mode built (`None` when eager).
    fn programs(editor: &Editor<Self>) -> Option<u64>;
}

impl EditBackend for Cpu {
    fn compile(_: &mut Editor<Self>) -> Result<()> {
        bail!("--compile needs a PJRT device")
    }
    fn programs(_: &Editor<Self>) -> Option<u64> {
        None
    }
}

impl EditBackend for Oxi {
    fn compile(editor: &mut Editor<Self>) -> Result<()> {
        Ok(each!(editor, pipe => pipe.compile())?)
    }
    fn programs(editor: &Editor<Self>) -> Option<u64> {
        each!(editor, pipe => pipe.compile_stats()).map(|s| s.programs)
    }
}

/// What an edit produced, for the PNG and the summary line.
struct Edited {
    images: Option<Images>,
    sampler: SchedulerKind,
    pipeline: &'static str,
    compiled: Option<u64>,
    loras: Vec<LoraReport>,
    strength: f64,
    guidance: f64,
}

/// Loads the library's editing pipeline on backend `B` and edits `image` (inpaints with
/// `mask`), with its diffusers defaults where no flag is given.
fn edit<B: EditBackend>(
    args: &Args,
    source: &Source,
    device: &B::Device,
    image: &image::DynamicImage,
    mask: Option<&image::DynamicImage>,
) -> Result<Edited> {
    let mut editor = Editor::<B>::load(source, mask.is_some(), device)
        .with_context(|| format!("loading {}", args.model))?;
    if args.control.active() {
        let nets = args
            .control
            .load::<B>(burn::tensor::FloatDType::F32, device)
            .context("loading --controlnet")?
            .into_unet("img2img")?;
        editor = match editor {
            Editor::Image2Image(pipe) => Editor::Image2Image(pipe.with_controlnets(nets)?),
            Editor::Inpainting(pipe) => Editor::Inpainting(pipe.with_controlnets(nets)?),
        };
    }
    let loras = fuse_loras(
        &args.lora,
        |p, s| each!(&mut editor, pipe => pipe.load_lora(p, s)),
    )?;
    let ip_adapter_image = args.ip_adapter.image()?;
    if let Some(file) = &args.ip_adapter.ip_adapter {
        let encoder = args.ip_adapter.ip_adapter_image_encoder.as_deref();
        let scale = args.ip_adapter.scale();
        each!(&mut editor, pipe => pipe.load_ip_adapter(file, encoder, scale))
            .context("--ip-adapter")?;
    }
    if args.compile {
        B::compile(&mut editor)?;
    }
    each!(&mut editor, pipe => {
        let factor = pipe.vae_scale_factor();
        args.vae.apply(pipe.vae_mut(), factor)
    })?;
    let defaults = each!(&editor, pipe => pipe.defaults());
    // The aesthetic scores are SDXL refiners' (the library refuses them elsewhere); img2img
    // leaves them out for other models, as its help says.
    let xl = each!(&editor, pipe => pipe.family()) == PipelineFamily::StableDiffusionXL;
    let refiner_scores = if xl {
        (args.aesthetic_score, args.negative_aesthetic_score)
    } else {
        let d = EditOptions::default();
        (d.aesthetic_score, d.negative_aesthetic_score)
    };
    let options = EditOptions {
        strength: args.strength,
        aesthetic_score: refiner_scores.0,
        negative_aesthetic_score: refiner_scores.1,
        padding_mask_crop: args.padding_mask_crop,
        control: args.control.request()?,
    };
    let strength = options.strength_or(defaults);
    let guidance = args.guidance.unwrap_or(defaults.guidance_scale);
    let request = GenerateRequest {
        prompts: vec![args.prompt.clone()],
        // An empty negative prompt is none (SDXL then zeroes it, as diffusers does for `None`).
        negative_prompts: args
            .negative_prompt
            .iter()
            .filter(|n| !n.is_empty())
            .cloned()
            .collect(),
        num_inference_steps: args.steps,
        guidance_scale: guidance,
        width: args.width,
        height: args.height,
        seed: args.seed,
        ip_adapter_image,
        ..Default::default()
    };
    let mut generator = TorchCpuGenerator::new(args.seed);
    let no_callback = |_: StepInfo<'_, B>| {};
    let out = match (&mut editor, mask) {
        (Editor::Image2Image(pipe), _) => {
            pipe.generate_with(&request, &options, image, &mut generator, no_callback)?
        }
        (Editor::Inpainting(pipe), Some(mask)) => {
            pipe.generate_with(&request, &options, image, mask, &mut generator, no_callback)?
        }
        (Editor::Inpainting(_), None) => bail!("inpainting needs --mask"),
    };
    Ok(Edited {
        images: out.images,
        sampler: each!(&editor, pipe => pipe.scheduler().kind()),
        pipeline: each!(&editor, pipe => pipe.pipeline_class()),
        compiled: B::programs(&editor),
        loras,
        strength,
        guidance,
    })
}
