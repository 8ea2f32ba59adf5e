//! One `txt2img` run: check the flags, resolve and load the model, generate in batches, write
//! the files and report them.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use burn::tensor::{FloatDType, Tensor, TensorData};
use oxidiff::cli::model_lookup::png_model_hash;
use oxidiff::cli::usage;
use oxidiff::cli::{
    closing_fields, error_message, file_name, model_name, random_seed, run_defaults, Precision,
    UsageError,
};
use oxidiff::execution::{Execution, PipelineBackend};
use oxidiff::latents::{encode_npy, read_latents};
use oxidiff::pipelines::compiled::CompileStats;
use oxidiff::pipelines::host::read_f32;
use oxidiff::pipelines::hub::resolve_model_with_progress;
use oxidiff::pipelines::lora::prompt_with_tags;
use oxidiff::pipelines::metadata::{encode_png, sampler_field, PARAMETERS_KEYWORD};
use oxidiff::pipelines::stable_diffusion_xl::SDXL_CLASS;
use oxidiff::pipelines::OutputType;
use oxidiff::pipelines::{
    is_single_file, pipeline_class, single_file_pipeline_class, AutoPipeline, CancelToken,
    FamilyOptions, GenerateRequest, GenerationParameters, LoadOptions, PipelineError,
    SingleFileOptions, StepInfo, FLUX_CLASSES, PIXART_CLASSES, SD3_CLASS,
};
use oxidiff::schedulers::TorchCpuGenerators;
use oxidiff::{Cpu, Oxi, OxiDevice};

use crate::args::{Args, OutputKind, DEFAULT_OUTPUT, REDUCED_PRECISION_CLASSES};
use crate::from_png::{apply_from_png, LATENTS_FIELD};
use crate::output::{display, Outputs};
use crate::progress::Progress;
use crate::INTERRUPTED;

/// A file written, for the summary.
struct Made {
    path: PathBuf,
    seed: u64,
    width: usize,
    height: usize,
    took: std::time::Duration,
}

/// Ctrl-C during a run of several files, after some were written.
#[derive(Debug, thiserror::Error)]
#[error(
    "interrupted after {done} of {steps} steps; {} of {total} files were written before it: {}",
    written.len(),
    written.join(", ")
)]
pub struct Interrupted {
    done: usize,
    steps: usize,
    written: Vec<String>,
    total: usize,
}

/// The command-line checks that need no model, made before anything loads: each failure is a
/// usage error (exit 2) naming the fix.
fn check_usage(args: &Args, device: &OxiDevice) -> Result<(), UsageError> {
    if (args.tp != 1 || args.dp != 1) && !args.compile {
        return Err(UsageError(
            "add --compile (and a PJRT --device): --tp and --dp partition the compiled step".into(),
        ));
    }
    if args.compile && !device.is_pjrt() {
        return Err(UsageError(format!(
            "add --device xla:cpu, tpu or cuda, or drop --compile: --compile needs a PJRT \
             device (--device {} runs eagerly)",
            args.device
        )));
    }
    if args.offload.text_encoders() && !device.is_pjrt() {
        return Err(UsageError(
            "drop --offload, or add a PJRT --device: on the CPU the weights are the \
             checkpoint's mapped pages already, with nothing to hand back"
                .into(),
        ));
    }
    let from_png = args.from_png.as_ref().map(|p| p.display().to_string());
    let source = |flag: &str| match &from_png {
        Some(png) => format!("{flag} (or the parameters of {png})"),
        None => flag.to_string(),
    };
    usage::image_size(
        &source("--width/--height"),
        args.width,
        args.height,
        args.max_pixels,
    )?;
    if let Some(steps) = args.steps {
        usage::steps(&source("--steps"), steps)?;
    }
    if let Some(guidance) = args.guidance {
        usage::finite(&source("--guidance"), guidance)?;
    }
    usage::finite("--true-cfg-scale", args.true_cfg_scale)?;
    args.control.check(args.max_pixels)?;
    args.ip_adapter.check()?;
    if args.ip_adapter.active() && (args.tp != 1 || args.dp != 1) {
        return Err(UsageError(
            "--ip-adapter does not split over devices yet: drop --tp/--dp (--compile works)".into(),
        ));
    }
    if args.control.active() && args.dp != 1 {
        return Err(UsageError(
            "--controlnet does not split the batch over devices: drop --dp (--tp splits the UNet \
             and the ControlNets)"
                .into(),
        ));
    }
    Ok(())
}

pub fn run(mut args: Args, progress: &Progress) -> Result<()> {
    // Before anything slow: Ctrl-C while the model resolves or loads stops the run at its
    // first step (a second Ctrl-C exits at once).
    let cancel = interrupt_token()?;
    apply_from_png(&mut args)?;
    let device: OxiDevice = args
        .device
        .parse()
        .with_context(|| format!("--device {}", args.device))?;
    check_usage(&args, &device)?;
    if args.latents.is_some() && args.num_images > 1 {
        bail!("--latents gives the initial latents of one image; use it with --num-images 1");
    }
    let prompt = args.prompt.clone().unwrap_or_default();
    let negative_prompt = args.negative_prompt.clone().unwrap_or_default();
    let kind = args.output_type;
    let output = if kind != OutputKind::Png && args.output == Path::new(DEFAULT_OUTPUT) {
        PathBuf::from("txt2img.npy")
    } else {
        args.output.clone()
    };
    let outputs = Outputs::plan(&output, args.num_images as usize, args.force, kind)?;
    let seed = args.seed.unwrap_or_else(random_seed);
    let started = Instant::now();
    let options = LoadOptions {
        variant: args.variant.clone(),
        scheduler: args.scheduler.clone(),
        dtype: args.dtype.load_dtype(),
        transformer: args.transformer.clone(),
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
    if single_file.is_some() && args.transformer.is_some() {
        bail!(
            "--transformer replaces the transformer of a diffusers Flux folder; {} is one file",
            args.model
        );
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
    let latents = match &args.latents {
        Some(path) => {
            let (values, shape) = read_latents(path)?;
            let shape: [usize; 4] = shape.as_slice().try_into().map_err(|_| {
                anyhow::anyhow!(
                    "{}: latents must have 4 dimensions [batch, 4, h/8, w/8], found {shape:?}",
                    path.display()
                )
            })?;
            // The latents set the image size: bounded as --width/--height are.
            let cells = shape[2].saturating_mul(shape[3]);
            if cells.saturating_mul(64) as u64 > args.max_pixels {
                return Err(UsageError(format!(
                    "pass --max-pixels N to use the latents {} ({}x{} cells, an image of about \
                     {} pixels): images are limited to {} pixels",
                    path.display(),
                    shape[3],
                    shape[2],
                    cells.saturating_mul(64),
                    args.max_pixels
                ))
                .into());
            }
            Some(TensorData::new(values, shape))
        }
        None => None,
    };
    let job = Job {
        args: &args,
        progress,
        prompt,
        negative_prompt,
        kind,
        outputs,
        seed,
        latents,
        cancel,
        started,
        dir,
        class,
        model,
        single_file,
        options,
        device_name: device.to_string(),
    };
    match device {
        // The plain CPU backend: the CPU kernels apply (the Oxi router hides its tensors).
        OxiDevice::Cpu => generate::<Cpu>(job, &Default::default()),
        device => generate::<Oxi>(job, &device),
    }
}

/// Everything a run settled before the model loads.
struct Job<'a> {
    args: &'a Args,
    progress: &'a Progress,
    prompt: String,
    negative_prompt: String,
    kind: OutputKind,
    outputs: Outputs,
    seed: u64,
    latents: Option<TensorData>,
    cancel: CancelToken,
    started: Instant,
    dir: PathBuf,
    class: String,
    model: String,
    single_file: Option<SingleFileOptions>,
    options: LoadOptions,
    device_name: String,
}

/// Loads the pipeline on backend `B`, generates every batch, writes the files and reports.
fn generate<B: PipelineBackend>(job: Job<'_>, device: &B::Device) -> Result<()> {
    let Job {
        args,
        progress,
        prompt,
        negative_prompt,
        kind,
        mut outputs,
        seed,
        latents,
        cancel,
        started,
        dir,
        class,
        model,
        single_file,
        options,
        device_name,
    } = job;
    let png_model = model_name(&model);
    progress.phase(format!("loading {class}"));
    let execution = Execution::from_flags(args.compile, args.dp, args.tp);
    let mut pipe = B::load(device, execution, || match &single_file {
        Some(sf) => AutoPipeline::<B>::from_single_file(&dir, sf, device),
        None => AutoPipeline::<B>::from_dir(&dir, &options, device),
    })
    .with_context(|| format!("loading {}", args.model))?;
    pipe.set_offload(args.offload);
    let png_hash = if kind == OutputKind::Png {
        progress.phase("hashing the model for the PNGs' Model hash".to_string());
        png_model_hash(&dir, &options).unwrap_or_else(|e| {
            eprintln!("warning: the PNGs get no Model hash: {}", error_message(&e));
            String::new()
        })
    } else {
        String::new()
    };
    let mut loras = Vec::with_capacity(args.lora.len());
    for spec in &args.lora {
        let report = pipe
            .load_lora(&spec.path, spec.scale)
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
    let mut control_modes = Vec::new();
    if args.control.active() {
        let nets = args
            .control
            .load::<B>(options.dtype.unwrap_or(FloatDType::F32), device)
            .context("loading --controlnet")?;
        control_modes = args.control.control_modes(&nets)?;
        pipe = pipe.with_controlnets(nets)?;
    }
    let ip_adapter_image = args.ip_adapter.image()?;
    if let Some(file) = &args.ip_adapter.ip_adapter {
        pipe.load_ip_adapter(
            file,
            args.ip_adapter.ip_adapter_image_encoder.as_deref(),
            args.ip_adapter.scale(),
        )
        .context("--ip-adapter")?;
    }
    B::prepare(&mut pipe, execution)?;
    let factor = pipe.vae_scale_factor();
    args.vae.apply(pipe.vae_mut(), factor)?;
    let loaded = started.elapsed();
    tracing::info!(seconds = loaded.as_secs_f64(), %class, "loaded");
    // diffusers' defaults of the pipeline; sd-turbo is run as its model card says.
    let (default_steps, default_guidance) = run_defaults(&args.model, &pipe.defaults());
    let steps = args.steps.unwrap_or(default_steps);
    let guidance = args.guidance.unwrap_or(default_guidance);
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
        latents: latents.map(|data| Tensor::<B, 4>::from_data(data, device)),
        output: if kind == OutputKind::Latents {
            OutputType::Latents
        } else {
            OutputType::Images
        },
        cancel: Some(cancel),
        ip_adapter_image,
        ..Default::default()
    };
    let family_options = FamilyOptions {
        max_sequence_length: args.max_sequence_length,
        resolution_binning: !args.no_resolution_binning,
        true_cfg_scale: args.true_cfg_scale,
        control: args.control.request_with_modes(&control_modes)?,
    };
    let scheduler = pipe.scheduler().kind();
    let sampler = sampler_field(args.scheduler.as_deref(), scheduler);
    let batch_size = args.batch_size as usize;
    let count = outputs.len();
    let batches = count.div_ceil(batch_size);
    let mut made = Vec::with_capacity(count);
    let mut batch_seconds = Vec::with_capacity(batches);
    let mut mode = B::mode(&pipe);
    for b in 0..batches {
        let first = b * batch_size;
        let in_batch = batch_size.min(count - first);
        let seeds: Vec<u64> = (0..in_batch as u64)
            .map(|i| seed + first as u64 + i)
            .collect();
        let request = GenerateRequest {
            seed: seeds[0],
            num_images_per_prompt: in_batch,
            ..request.clone()
        };
        let mut generator = TorchCpuGenerators::new(&seeds);
        let generated = Instant::now();
        let label = if batches > 1 {
            format!("batch {}/{batches}: denoising", b + 1)
        } else {
            "denoising".to_string()
        };
        progress.steps(&label);
        let on_step = |info: StepInfo<'_, B>| progress.step(&info, kind != OutputKind::Latents);
        let output = match pipe.generate_with(&request, &family_options, &mut generator, on_step) {
            Ok(output) => output,
            Err(PipelineError::Cancelled { done, total }) if !made.is_empty() => {
                return Err(Interrupted {
                    done,
                    steps: total,
                    written: made.iter().map(|m: &Made| display(&m.path)).collect(),
                    total: count,
                }
                .into())
            }
            Err(e) => return Err(e.into()),
        };
        let took = generated.elapsed();
        mode = B::mode(&pipe);
        progress.phase("writing".into());
        for (j, &image_seed) in seeds.iter().enumerate() {
            let (bytes, width, height) = match kind {
                OutputKind::Latents => {
                    let [_, c, h, w] = output.latents.dims();
                    let row = output.latents.clone().narrow(0, j, 1);
                    let values = read_f32(row)?;
                    let f = pipe.vae_scale_factor();
                    (encode_npy(&values, &[1, c, h, w]), w * f, h * f)
                }
                OutputKind::Npy | OutputKind::Png => {
                    let images = output
                        .images
                        .as_ref()
                        .context("the pipeline returned no images")?;
                    let bytes = if kind == OutputKind::Npy {
                        let size = images.height * images.width * 3;
                        let values = &images.data[j * size..(j + 1) * size];
                        encode_npy(values, &[images.height, images.width, 3])
                    } else {
                        let mut extra = Vec::new();
                        if let Some(path) = &args.latents {
                            extra.push((LATENTS_FIELD.to_string(), file_name(path)));
                        }
                        extra.extend(args.control.png_fields());
                        extra.extend(args.ip_adapter.png_fields());
                        extra.extend(closing_fields(&loras));
                        let parameters = GenerationParameters {
                            prompt: prompt_with_tags(&prompt, &loras),
                            negative_prompt: negative_prompt.clone(),
                            steps,
                            sampler: sampler.clone(),
                            guidance_scale: guidance,
                            seed: image_seed,
                            width: images.width,
                            height: images.height,
                            model: png_model.clone(),
                            model_hash: png_hash.clone(),
                            extra,
                        };
                        let rgb = images
                            .to_rgb8(j)
                            .context("the pipeline returned too few images")?;
                        encode_png(&rgb, &[(PARAMETERS_KEYWORD, parameters.to_text())])?
                    };
                    (bytes, images.width, images.height)
                }
            };
            let path = outputs.write(first + j, &bytes)?;
            // A batch's time is shared equally by its images.
            let per_image = took / in_batch as u32;
            if !args.quiet {
                progress.println(&format!(
                    "wrote {} (seed {image_seed}, {steps} steps, guidance {guidance}, {width}x{height}, {device_name} {mode}, {}; load {:.2}s, generate {:.2}s)",
                    display(&path),
                    args.dtype.name(),
                    loaded.as_secs_f64(),
                    per_image.as_secs_f64()
                ));
            }
            made.push(Made {
                path,
                seed: image_seed,
                width,
                height,
                took: per_image,
            });
        }
        batch_seconds.push(took.as_secs_f64());
    }
    progress.finish();
    if args.json {
        let summary = serde_json::json!({
            "files": made.iter().map(|m| display(&m.path)).collect::<Vec<_>>(),
            "seeds": made.iter().map(|m| m.seed).collect::<Vec<_>>(),
            "width": made.first().map(|m| m.width),
            "height": made.first().map(|m| m.height),
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
            "device": device_name,
            "mode": mode,
            "dtype": args.dtype.name(),
            "output_type": format!("{kind:?}").to_lowercase(),
            "batch_size": batch_size,
            "load_seconds": loaded.as_secs_f64(),
            "generate_seconds": made.iter().map(|m| m.took.as_secs_f64()).collect::<Vec<_>>(),
            "batch_seconds": batch_seconds,
            // XLA's work in this process: compiled mode's programs, and eager ops on the device.
            "compiled": B::compile_stats(&pipe).map(|s| {
                let counts = |s: CompileStats| serde_json::json!({
                    "programs": s.programs,
                    "xla_compiles": s.xla_compiles,
                    "disk_loads": s.disk_loads,
                });
                let mut all = counts(s);
                all["components"] = B::component_stats(&pipe)
                    .into_iter()
                    .map(|c| (c.component.to_string(), counts(c.stats)))
                    .collect::<serde_json::Map<_, _>>()
                    .into();
                all
            }),
            // Each component's weights: bytes in all, by the type held (dtype or GGML quant
            // type) and by place (the host or each device).
            "memory": B::memory(&pipe)
                .into_iter()
                .map(|c| {
                    let entry = serde_json::json!({
                        "bytes": c.memory.total(),
                        "held_as": c.memory.by_type,
                        "places": c.memory.by_place,
                    });
                    (c.component, entry)
                })
                .collect::<serde_json::Map<_, _>>(),
            "eager_ops": B::eager_stats(device).map(|s| serde_json::json!({
                "executed": s.executed,
                "xla_compiles": s.compiled,
                "disk_loads": s.disk_loads,
                "disk_rejects": s.disk_rejects,
            })),
        });
        println!("{summary}");
    }
    Ok(())
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
