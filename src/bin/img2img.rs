//! `img2img`: edit an input image with a diffusers-format Stable Diffusion 1.x/2.x model.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::Parser;
use oxidiff::pipelines::image::load_image;
use oxidiff::pipelines::{
    GenerateRequest, GenerationParameters, LoadOptions, StableDiffusionImg2ImgPipeline,
};
use oxidiff::schedulers::TorchCpuGenerator;
use oxidiff::{Oxi, OxiDevice};

#[derive(Parser, Debug)]
#[command(
    version,
    about = "Edit an image from a text prompt (Stable Diffusion 1.x/2.x image to image)"
)]
struct Args {
    prompt: String,
    /// The input image (PNG, JPEG or WebP); its size, rounded down to a multiple of 8, unless
    /// --width/--height are given.
    #[arg(long)]
    image: PathBuf,
    /// How much to change the image, in (0, 1]: the fraction of the steps that are run.
    #[arg(long, default_value_t = 0.8)]
    strength: f64,
    /// A diffusers-format model folder or a Hub id in the local Hub cache.
    #[arg(long)]
    model: String,
    #[arg(long)]
    variant: Option<String>,
    #[arg(long)]
    negative_prompt: Option<String>,
    #[arg(long, default_value_t = 50)]
    steps: usize,
    #[arg(long, default_value_t = 7.5)]
    guidance: f64,
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
    #[arg(short, long, default_value = "img2img.png")]
    output: PathBuf,
    #[arg(long)]
    force: bool,
    /// cpu, xla:cpu[:N], tpu[:N], cuda[:N].
    #[arg(long, default_value = "cpu")]
    device: String,
}

fn main() -> ExitCode {
    oxidiff::tune_allocator();
    match run(Args::parse()) {
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
    let image = load_image(&args.image)?;
    let device: OxiDevice = args
        .device
        .parse()
        .with_context(|| format!("--device {}", args.device))?;
    let options = LoadOptions {
        variant: args.variant.clone(),
        scheduler: args.scheduler.clone(),
    };
    let mut pipe =
        StableDiffusionImg2ImgPipeline::<Oxi>::from_pretrained(&args.model, &options, &device)
            .with_context(|| format!("loading {}", args.model))?;
    let negative_prompt = args.negative_prompt.clone().unwrap_or_default();
    let request = GenerateRequest {
        prompts: vec![args.prompt.clone()],
        negative_prompts: if negative_prompt.is_empty() {
            Vec::new()
        } else {
            vec![negative_prompt.clone()]
        },
        num_inference_steps: args.steps,
        guidance_scale: args.guidance,
        width: args.width,
        height: args.height,
        seed: args.seed,
        ..Default::default()
    };
    let mut generator = TorchCpuGenerator::new(args.seed);
    let output = pipe.generate_with(&request, &image, args.strength, &mut generator, |_| {})?;
    let images = output.images.context("the pipeline returned no images")?;
    let parameters = GenerationParameters {
        prompt: args.prompt.clone(),
        negative_prompt,
        steps: args.steps,
        sampler: args
            .scheduler
            .clone()
            .unwrap_or_else(|| pipe.pipe.scheduler.kind().class_name().to_string()),
        guidance_scale: args.guidance,
        seed: args.seed,
        width: images.width,
        height: images.height,
        model: args.model.clone(),
        extra: vec![
            ("Denoising strength".into(), args.strength.to_string()),
            (
                "Version".into(),
                format!("oxidiff {}", env!("CARGO_PKG_VERSION")),
            ),
        ],
    };
    images.save_png_with_parameters(0, &args.output, Some(&parameters))?;
    eprintln!(
        "wrote {} (seed {}, strength {}, {}x{})",
        args.output.display(),
        args.seed,
        args.strength,
        images.width,
        images.height
    );
    Ok(())
}
