//! The compiled denoising step for hardware that is not here: the same step that
//! [`StableDiffusionPipeline::compile`](crate::StableDiffusionPipeline::compile) runs
//! ([`guided_noise`]: UNet plus classifier-free guidance), recorded on the `Traced` backend
//! (shapes without values, weights without loading them onto a device) and lowered by the same
//! [`lower_recorded`] as compiled mode, into one StableHLO module that a TPU topology can
//! compile ahead of time (`Topology::compile`, libtpu without a TPU); the VAE's encoder and
//! decoder likewise ([`trace_vae`]). [`trace_denoiser`] traces any pipeline's denoiser program
//! (SD 1.x/2.x, SDXL, SD3/SD3.5, Flux) in the dtype and with the kernel hub's kernels compiled mode would
//! use, also from a checkpoint's safetensors header alone ([`Weights::from_header`]), so the
//! released models' programs are compiled ahead of time without their weights.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::tensor::{FloatDType, Tensor, TensorData};
use oxidiff_backend_tpu::compiled::lower_recorded;
use oxidiff_backend_tpu::kernels::AttentionKernels;
use oxidiff_backend_tpu::lowering::{Argument, LoweredFunction};
use oxidiff_backend_tpu::trace::{
    attention_ops, float_ir, take_ops, take_program, OperationIr, TensorIr, Traced,
};
use oxidiff_backend_tpu::OxiDevice;
use oxidiff_models::config::PerBlock;
use oxidiff_models::embeddings::RotaryEmbedding;
use oxidiff_models::transformer_flux::{FluxTransformer2DConfig, FluxTransformer2DModel};
use oxidiff_models::transformer_sd3::{SD3Transformer2DConfig, SD3Transformer2DModel};
use oxidiff_models::unet_conditioning::AddedCondition;
use oxidiff_models::var_builder::{build_component, VarBuilder};
use oxidiff_models::weights::Weights;
use oxidiff_models::{
    AutoencoderKL, ClipTextModel, T5EncoderModel, UNet2DConditionConfig, UNet2DConditionModel,
};
use oxidiff_schedulers::{scheduler_from_config, SchedulerConfig, TorchCpuGenerator};

use crate::error::{PipelineError, Result};
use crate::flux::{flux_velocity, latent_image_ids, FluxPromptEmbeds};
use crate::parallel::{split_weights, ParallelConfig, ParallelTarget};
use crate::stable_diffusion::guided_noise;
use oxidiff_backend_tpu::spmd::{Layout, Mesh};
use oxidiff_models::TensorParallel;
use std::collections::HashMap;

/// CLIP's sequence length, the context rows of SD 1.x/2.x.
const CONTEXT_LEN: usize = 77;

/// The traced backend records per device, for every thread: one trace at a time, so two
/// callers tracing at once (tests run in parallel) do not get each other's ops.
static TRACING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// One traced denoising step as a StableHLO module.
#[derive(Debug, Clone)]
pub struct TracedStep {
    /// The module text: `@main(inputs..., weights...)`; the inputs are `sample, timestep,
    /// context, guidance` for SD, `sample, timestep, context, text_embeds, time_ids` for SDXL,
    /// `sample, timesteps, prompt_embeds, pooled_prompt_embeds` for SD3, `latents, timestep,
    /// guidance, prompt_embeds, pooled_prompt_embeds, cos, sin` for Flux.
    pub module: String,
    /// Ops recorded.
    pub ops: usize,
    /// Arguments after the four inputs: the UNet's weights (and the ops' scalars).
    pub weights: usize,
    /// Bytes of those weight arguments.
    pub weight_bytes: usize,
    /// The latents' shape `[batch, channels, height/8, width/8]`.
    pub latents: [usize; 4],
    /// Whether the UNet sees classifier-free guidance's doubled batch (`2 * batch` rows; SD's
    /// program also combines the halves, SDXL's pipeline does that outside the program).
    pub guidance: bool,
    /// Devices the module is partitioned over (`mhlo.num_partitions`; 1 unless traced by
    /// [`trace_parallel_step`]).
    pub partitions: usize,
    /// Attention ops in the program.
    pub attentions: usize,
    /// Of those, the ones lowered to a kernel hub call ([`TraceSettings::kernels`]).
    pub kernel_calls: usize,
}

/// How [`trace_denoiser`] traces: the dtype the weights are held in (as `--dtype` loads them;
/// f32 by default) and the kernel hub's attention kernels to splice in, as compiled mode does
/// with `OXIDIFF_KERNELS` (none by default).
#[derive(Clone)]
pub struct TraceSettings {
    pub dtype: FloatDType,
    pub kernels: Option<Arc<AttentionKernels>>,
    /// Partitioned as the pipeline's `enable_parallelism` partitions it (one module for all
    /// devices); `None` for one device.
    pub parallel: Option<TraceParallel>,
}

impl Default for TraceSettings {
    fn default() -> Self {
        Self {
            dtype: FloatDType::F32,
            kernels: None,
            parallel: None,
        }
    }
}

/// A partitioned trace: `config` over the first `config.devices()` of the `devices` devices a
/// topology has. The model's split weights and the batch inputs carry their `mhlo.sharding`
/// (for `CompileOptions::spmd`), and kernels run per device
/// ([`Lowerer::with_kernels_over`](oxidiff_backend_tpu::lowering::Lowerer::with_kernels_over)).
/// The config is checked as on a real mesh.
#[derive(Debug, Clone)]
pub struct TraceParallel {
    pub config: ParallelConfig,
    pub devices: usize,
}

/// The inputs a denoiser program is traced for: `batch` images of latents `latent_height` x
/// `latent_width` (the image's size over the VAE's factor of 8), with classifier-free guidance
/// (the UNet then sees `2 * batch` rows; Flux's program never holds it), and `text_tokens`
/// rows of text (CLIP's 77; Flux's T5 `max_sequence_length`, 512 for dev).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DenoiserInputs {
    pub batch: usize,
    pub latent_height: usize,
    pub latent_width: usize,
    pub guidance: bool,
    pub text_tokens: usize,
}

impl DenoiserInputs {
    /// One `height` x `width` image with guidance and CLIP's 77 tokens (an SD or SDXL run).
    pub fn image(height: usize, width: usize) -> Self {
        Self {
            batch: 1,
            latent_height: height / 8,
            latent_width: width / 8,
            guidance: true,
            text_tokens: CONTEXT_LEN,
        }
    }
}

/// Traces [`guided_noise`] for the UNet in `unet_dir` (a diffusers `unet/` folder) on latents
/// of `batch` x `latent_height` x `latent_width`, with classifier-free guidance when
/// `guidance` is set, and lowers it to one module.
pub fn trace_guided_step(
    unet_dir: &Path,
    variant: Option<&str>,
    batch: usize,
    latent_height: usize,
    latent_width: usize,
    guidance: bool,
) -> Result<TracedStep> {
    let inputs = DenoiserInputs {
        batch,
        latent_height,
        latent_width,
        guidance,
        text_tokens: CONTEXT_LEN,
    };
    trace_unet_step(unet_dir, variant, inputs, &TraceSettings::default())
}

/// [`trace_guided_step`] partitioned as
/// [`StableDiffusionPipeline::enable_parallelism`](crate::StableDiffusionPipeline::enable_parallelism)
/// partitions it, over `devices` devices (a TPU topology's): the UNet's split weights and the
/// batch inputs carry their `mhlo.sharding`, for `CompileOptions::spmd` over the topology's
/// first `config.devices()` devices. The config is checked as on a real mesh.
pub fn trace_parallel_step(
    unet_dir: &Path,
    variant: Option<&str>,
    [batch, latent_height, latent_width]: [usize; 3],
    guidance: bool,
    config: &ParallelConfig,
    devices: usize,
) -> Result<TracedStep> {
    let inputs = DenoiserInputs {
        batch,
        latent_height,
        latent_width,
        guidance,
        text_tokens: CONTEXT_LEN,
    };
    let settings = TraceSettings {
        parallel: Some(TraceParallel {
            config: *config,
            devices,
        }),
        ..TraceSettings::default()
    };
    trace_unet_step(unet_dir, variant, inputs, &settings)
}

/// Traces the denoiser program that `pipe.compile()` runs for the model in `dir` (a diffusers
/// `unet/` or `transformer/` folder, by its config's `_class_name`) and lowers it to one
/// module, with `settings`' dtype and kernels:
/// - an SD 1.x/2.x UNet: the UNet and classifier-free guidance ([`trace_guided_step`]);
/// - an SDXL UNet: the UNet on the doubled batch with its added condition (text embeddings and
///   time ids), as [`StableDiffusionXLPipeline::compile`](crate::StableDiffusionXLPipeline::compile)
///   compiles it (guidance is combined outside the program);
/// - an SD3/SD3.5 transformer: its call on the doubled batch, with the timesteps, text and
///   pooled embeddings as inputs, as
///   [`StableDiffusion3Pipeline::compile`](crate::StableDiffusion3Pipeline::compile) compiles
///   it (guidance is combined outside the program; `text_tokens` is CLIP's 77 plus T5's
///   `max_sequence_length`, 333 by default);
/// - a Flux transformer: [`flux_velocity`] (packing, the transformer, unpacking) with the
///   timestep, guidance, text and rotary tables as inputs, as
///   [`FluxPipeline::compile`](crate::FluxPipeline::compile) compiles it.
///
/// The weights come from `dir`'s safetensors files, or, where `dir` holds
/// `diffusion_pytorch_model.header.json`, from that header alone ([`Weights::from_header`]).
pub fn trace_denoiser(
    dir: &Path,
    variant: Option<&str>,
    inputs: DenoiserInputs,
    settings: &TraceSettings,
) -> Result<TracedStep> {
    let config_path = dir.join("config.json");
    let class = config_class(&config_path)?;
    match class.as_str() {
        "UNet2DConditionModel" => trace_unet_step(dir, variant, inputs, settings),
        "FluxTransformer2DModel" => trace_flux_step(dir, variant, inputs, settings),
        "SD3Transformer2DModel" => trace_sd3_step(dir, variant, inputs, settings),
        other => Err(PipelineError::Compile(format!(
            "{}: `_class_name: {other}` has no denoiser program to trace (UNet2DConditionModel, \
             SD3Transformer2DModel and FluxTransformer2DModel do)",
            config_path.display()
        ))),
    }
}

/// The weights a traced model is built from (see [`trace_denoiser`]).
fn trace_weights(dir: &Path, variant: Option<&str>) -> Result<Weights> {
    let header = dir.join(HEADER_FILE);
    Ok(if header.is_file() {
        Weights::from_header(&header)?
    } else {
        Weights::from_component_dir(dir, &["diffusion_pytorch_model"], variant)?
    })
}

/// A component folder's weights header ([`trace_denoiser`]).
const HEADER_FILE: &str = "diffusion_pytorch_model.header.json";

/// A config's `_class_name`.
fn config_class(path: &PathBuf) -> Result<String> {
    #[derive(serde::Deserialize)]
    struct Class {
        #[serde(rename = "_class_name")]
        class: Option<String>,
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| PipelineError::Compile(format!("{}: {e}", path.display())))?;
    let class: Class = serde_json::from_str(&text)
        .map_err(|e| PipelineError::Compile(format!("{}: {e}", path.display())))?;
    class
        .class
        .ok_or_else(|| PipelineError::Compile(format!("{}: no `_class_name`", path.display())))
}

/// The lowering of a traced program, with `kernels` spliced in where given (per device on a
/// partitioned program's `mesh`).
fn lower(
    inputs: &[TensorIr],
    ops: &[OperationIr],
    outputs: &[TensorIr],
    kernels: Option<&Arc<AttentionKernels>>,
    mesh: Option<Mesh>,
    what: &str,
) -> Result<LoweredFunction> {
    let mut lowerer = oxidiff_backend_tpu::lowering::Lowerer::new();
    if let Some(kernels) = kernels {
        lowerer = match mesh {
            None => lowerer.with_kernels(kernels.clone()),
            Some(mesh) => lowerer.with_kernels_over(kernels.clone(), mesh),
        };
    }
    oxidiff_backend_tpu::compiled::lower_recorded_with(lowerer, inputs, ops, outputs)
        .map_err(|e| PipelineError::Compile(format!("lowering the traced {what}: {e}")))
}

fn trace_unet_step(
    unet_dir: &Path,
    variant: Option<&str>,
    shape: DenoiserInputs,
    settings: &TraceSettings,
) -> Result<TracedStep> {
    let config_path = unet_dir.join("config.json");
    let config = UNet2DConditionConfig::from_file(&config_path)?;
    let context_dim = context_width(&config);
    let _one_at_a_time = TRACING
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let device = OxiDevice::Cpu;
    let (unet, split) = traced_model(unet_dir, variant, settings, "UNet2DConditionModel", |vb| {
        UNet2DConditionModel::load(&config, &config_path, vb)
    })?;

    let DenoiserInputs {
        batch,
        latent_height,
        latent_width,
        guidance,
        text_tokens,
    } = shape;
    let latents = [
        batch,
        unet.conv_in.weight.dims()[1],
        latent_height,
        latent_width,
    ];
    let rows = if guidance { 2 * batch } else { batch };
    let zeros = |shape: Vec<usize>| TensorData::new(vec![0f32; shape.iter().product()], shape);
    let timestep = Tensor::<Traced, 1>::from_data(zeros(vec![1]), &device);
    let context =
        Tensor::<Traced, 3>::from_data(zeros(vec![rows, text_tokens, context_dim]), &device);
    // Each with its inputs' layouts as the pipeline's step lays them out when partitioned.
    let (inputs, noise, layouts) = match added_text_width(&config) {
        // SDXL: the UNet on all rows with its added condition, as the pipeline compiles it;
        // every input split by batch where it divides.
        Some(text_width) => {
            let sample = Tensor::<Traced, 4>::from_data(
                zeros(vec![rows, latents[1], latent_height, latent_width]),
                &device,
            );
            let added = AddedCondition {
                text_embeds: Tensor::from_data(zeros(vec![rows, text_width]), &device),
                time_ids: Tensor::from_data(zeros(vec![rows, 6]), &device),
            };
            unet.check_added_condition(rows, Some(&added))?;
            let inputs = vec![
                float_ir(&sample),
                float_ir(&timestep),
                float_ir(&context),
                float_ir(&added.text_embeds),
                float_ir(&added.time_ids),
            ];
            let noise =
                unet.forward_controlled_checked(sample, timestep, context, Some(&added), None);
            let layouts = vec![Layout::BatchSplit(0); inputs.len()];
            (inputs, noise, layouts)
        }
        None => {
            let sample = Tensor::<Traced, 4>::from_data(zeros(latents.to_vec()), &device);
            let scale = Tensor::<Traced, 1>::from_data(zeros(vec![1]), &device);
            let inputs = vec![
                float_ir(&sample),
                float_ir(&timestep),
                float_ir(&context),
                float_ir(&scale),
            ];
            // SD: latents and context split by batch where it divides.
            let layouts = vec![
                Layout::BatchSplit(0),
                Layout::Replicated,
                Layout::BatchSplit(0),
                Layout::Replicated,
            ];
            let noise = guided_noise(&unet, sample, timestep, context, scale);
            (inputs, noise, layouts)
        }
    };
    finish_step(
        &device,
        &inputs,
        float_ir(&noise),
        settings,
        &split,
        &layouts,
        (latents, guidance),
        "UNet step",
    )
}

/// The model `name` in `dir` built by `build` on the traced backend (call with [`TRACING`]
/// held), its weights in `settings.dtype` ([`trace_weights`]), the ops of its loading dropped,
/// and split as `settings.parallel` asks: its weights' layouts by tensor, checked as on a real
/// mesh (empty for one device).
fn traced_model<M>(
    dir: &Path,
    variant: Option<&str>,
    settings: &TraceSettings,
    name: &str,
    build: impl FnOnce(VarBuilder<Traced>) -> oxidiff_models::error::Result<M>,
) -> Result<(M, HashMap<oxidiff_backend_tpu::spmd::TensorId, Layout>)>
where
    M: burn::module::Module<Traced> + TensorParallel,
{
    let device = OxiDevice::Cpu;
    let weights = trace_weights(dir, variant)?;
    let mut model = build_component(weights, settings.dtype, &device, build)?;
    let _loading = take_ops(&device);
    let Some(TraceParallel { config, devices }) = &settings.parallel else {
        return Ok((model, HashMap::new()));
    };
    let widths = model.sharded_widths();
    config.validate(&ParallelTarget {
        model: name,
        widths: &widths,
        device: "the topology",
        devices_available: *devices,
        compiled_pjrt: true,
    })?;
    model.set_tensor_parallel_degree(config.tp());
    let split = split_weights::<Traced, _>(&model, config)
        .into_iter()
        .collect();
    Ok((model, split))
}

/// The ops recorded since the model's inputs were made, lowered from `inputs` to `output`
/// (with `settings`' kernels) and partitioned as `settings.parallel` asks: the inputs laid out
/// as `layouts`, the weights as `split`; the result whole on every device.
#[allow(clippy::too_many_arguments)]
fn finish_step(
    device: &OxiDevice,
    inputs: &[TensorIr],
    output: TensorIr,
    settings: &TraceSettings,
    split: &HashMap<oxidiff_backend_tpu::spmd::TensorId, Layout>,
    layouts: &[Layout],
    (latents, guidance): ([usize; 4], bool),
    what: &str,
) -> Result<TracedStep> {
    let ops = take_ops(device);
    let mesh = settings
        .parallel
        .as_ref()
        .map(|p| Mesh::new(p.config.dp(), p.config.tp()));
    let function = lower(
        inputs,
        &ops,
        &[output],
        settings.kernels.as_ref(),
        mesh,
        what,
    )?;
    let (module, partitions) = match mesh {
        Some(mesh) => {
            let shardings: Vec<String> = function
                .arguments
                .iter()
                .enumerate()
                .map(|(i, (argument, ty))| {
                    let layout = match argument {
                        _ if i < layouts.len() => layouts[i],
                        Argument::Tensor(id) => {
                            split.get(id).copied().unwrap_or(Layout::Replicated)
                        }
                        _ => Layout::Replicated,
                    };
                    let layout = if layout.check(&mesh, &ty.dims).is_ok() {
                        layout
                    } else {
                        Layout::Replicated
                    };
                    layout.hlo_sharding(&mesh, ty.dims.len())
                })
                .collect();
            let results = vec![Layout::Replicated.hlo_sharding(&mesh, 0); function.results.len()];
            (
                function.partitioned(mesh.partitions(), &shardings, &results),
                mesh.partitions(),
            )
        }
        None => (function.module.clone(), 1),
    };
    let (weights, weight_bytes) = weight_arguments(&function, inputs.len());
    Ok(TracedStep {
        ops: ops.len(),
        weights,
        weight_bytes,
        module,
        latents,
        guidance,
        partitions,
        attentions: attention_ops(&ops),
        kernel_calls: function.kernel_calls,
    })
}

/// The width of SDXL's added text embeddings (`None` without `addition_embed_type: text_time`).
fn added_text_width(config: &UNet2DConditionConfig) -> Option<usize> {
    if config.addition_embed_type.as_deref() != Some("text_time") {
        return None;
    }
    let total = config.projection_class_embeddings_input_dim?;
    let time = config.addition_time_embed_dim?;
    total.checked_sub(6 * time)
}

fn trace_flux_step(
    dir: &Path,
    variant: Option<&str>,
    shape: DenoiserInputs,
    settings: &TraceSettings,
) -> Result<TracedStep> {
    let config = FluxTransformer2DConfig::from_file(&dir.join("config.json"))?;
    let _one_at_a_time = TRACING
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let device = OxiDevice::Cpu;
    let (transformer, split) =
        traced_model(dir, variant, settings, "FluxTransformer2DModel", |vb| {
            FluxTransformer2DModel::load(&config, vb)
        })?;
    let DenoiserInputs {
        batch,
        latent_height,
        latent_width,
        text_tokens,
        ..
    } = shape;
    let channels = config.in_channels / 4;
    let latents = [batch, channels, latent_height, latent_width];
    let zeros = |shape: Vec<usize>| TensorData::new(vec![0f32; shape.iter().product()], shape);
    let sample = Tensor::<Traced, 4>::from_data(zeros(latents.to_vec()), &device);
    let timestep = Tensor::<Traced, 1>::from_data(zeros(vec![1]), &device);
    let guidance = Tensor::<Traced, 1>::from_data(zeros(vec![1]), &device);
    let text = FluxPromptEmbeds {
        prompt_embeds: Tensor::from_data(
            zeros(vec![batch, text_tokens, config.joint_attention_dim]),
            &device,
        ),
        pooled_prompt_embeds: Tensor::from_data(
            zeros(vec![batch, config.pooled_projection_dim]),
            &device,
        ),
    };
    let img_ids = latent_image_ids(latent_height / 2, latent_width / 2);
    let txt_ids = vec![vec![0.0; 3]; text_tokens];
    let RotaryEmbedding { cos, sin } = transformer.rotary_embedding(&txt_ids, &img_ids, &device);
    // The tables are inputs of the compiled step, not ops of it.
    let _tables = take_ops(&device);
    let inputs = vec![
        float_ir(&sample),
        float_ir(&timestep),
        float_ir(&guidance),
        float_ir(&text.prompt_embeds),
        float_ir(&text.pooled_prompt_embeds),
        float_ir(&cos),
        float_ir(&sin),
    ];
    let velocity = flux_velocity(
        &transformer,
        sample,
        timestep,
        guidance,
        &text,
        &RotaryEmbedding { cos, sin },
    );
    // As the pipeline's step: latents, timestep, guidance and text split by batch where it
    // divides; the rotary tables whole on every device.
    let mut layouts = vec![Layout::BatchSplit(0); 5];
    layouts.extend([Layout::Replicated, Layout::Replicated]);
    finish_step(
        &device,
        &inputs,
        float_ir(&velocity),
        settings,
        &split,
        &layouts,
        (latents, false),
        "Flux transformer call",
    )
}

fn trace_sd3_step(
    dir: &Path,
    variant: Option<&str>,
    shape: DenoiserInputs,
    settings: &TraceSettings,
) -> Result<TracedStep> {
    let config = SD3Transformer2DConfig::from_file(&dir.join("config.json"))?;
    let _one_at_a_time = TRACING
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let device = OxiDevice::Cpu;
    let (transformer, split) =
        traced_model(dir, variant, settings, "SD3Transformer2DModel", |vb| {
            SD3Transformer2DModel::load(&config, vb)
        })?;
    let DenoiserInputs {
        batch,
        latent_height,
        latent_width,
        guidance,
        text_tokens,
    } = shape;
    let rows = if guidance { 2 * batch } else { batch };
    let latents = [batch, config.in_channels, latent_height, latent_width];
    let zeros = |shape: Vec<usize>| TensorData::new(vec![0f32; shape.iter().product()], shape);
    let sample = Tensor::<Traced, 4>::from_data(
        zeros(vec![rows, config.in_channels, latent_height, latent_width]),
        &device,
    );
    let timestep = Tensor::<Traced, 1>::from_data(zeros(vec![rows]), &device);
    let context = Tensor::<Traced, 3>::from_data(
        zeros(vec![rows, text_tokens, config.joint_attention_dim]),
        &device,
    );
    let pooled =
        Tensor::<Traced, 2>::from_data(zeros(vec![rows, config.pooled_projection_dim]), &device);
    transformer.check_inputs(sample.dims(), rows, context.dims(), pooled.dims())?;
    let inputs = vec![
        float_ir(&sample),
        float_ir(&timestep),
        float_ir(&context),
        float_ir(&pooled),
    ];
    let velocity = transformer.forward_checked(sample, timestep, context, pooled);
    // As the pipeline's step: every input split by batch where it divides.
    let layouts = vec![Layout::BatchSplit(0); inputs.len()];
    finish_step(
        &device,
        &inputs,
        float_ir(&velocity),
        settings,
        &split,
        &layouts,
        (latents, guidance),
        "SD3 transformer call",
    )
}

/// One traced part of a pipeline run as its own program in compiled mode (a half of the VAE, a
/// text encoder's layers), as a StableHLO module `@main(inputs..., weights...)`.
#[derive(Debug, Clone)]
pub struct TracedPart {
    pub module: String,
    /// Ops recorded.
    pub ops: usize,
    /// Weight arguments after the inputs.
    pub weights: usize,
    /// Bytes of those weight arguments.
    pub weight_bytes: usize,
}

/// Which half of the VAE to trace, on which input.
#[derive(Debug, Clone, Copy)]
pub enum VaeHalf {
    /// Images `[batch, 3, height, width]` to latent moments.
    Encoder {
        batch: usize,
        height: usize,
        width: usize,
    },
    /// Unscaled latents `[batch, channels, height/8, width/8]` to images.
    Decoder {
        batch: usize,
        latent_height: usize,
        latent_width: usize,
    },
}

/// Traces `half` of the VAE in `vae_dir` (a diffusers `vae/` folder) and lowers it to one
/// module, as [`trace_guided_step`] does for the UNet.
pub fn trace_vae(vae_dir: &Path, variant: Option<&str>, half: VaeHalf) -> Result<TracedPart> {
    let _one_at_a_time = TRACING
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let device = OxiDevice::Cpu;
    let vae = AutoencoderKL::<Traced>::from_dir(vae_dir, variant, &device)?;
    let _loading = take_ops(&device);
    let zeros = |shape: [usize; 4]| {
        let data = TensorData::new(vec![0f32; shape.iter().product()], shape);
        Tensor::<Traced, 4>::from_data(data, &device)
    };
    let (input, output) = match half {
        VaeHalf::Encoder {
            batch,
            height,
            width,
        } => {
            let image = zeros([batch, 3, height, width]);
            (float_ir(&image), float_ir(&vae.run_encoder(image)))
        }
        VaeHalf::Decoder {
            batch,
            latent_height,
            latent_width,
        } => {
            let channels = vae.decoder.conv_in.weight.dims()[1];
            let latents = zeros([batch, channels, latent_height, latent_width]);
            (float_ir(&latents), float_ir(&vae.run_decoder(latents)))
        }
    };
    traced_part(&device, &[input], output, "VAE")
}

/// Traces the compiled ControlNet step ([`ControlPrograms`](crate::control::ControlPrograms):
/// the ControlNets in `controlnet_dirs`, the UNet in `unet_dir` and classifier-free guidance)
/// on latents of `batch` x `latent_height` x `latent_width`, and lowers it to one module whose
/// inputs are the latents, the UNet's input, timestep, context, guidance scale, then each
/// ControlNet's image and `[1]` scale.
pub fn trace_controlled_step(
    unet_dir: &Path,
    controlnet_dirs: &[&Path],
    batch: usize,
    latent_height: usize,
    latent_width: usize,
) -> Result<TracedPart> {
    use oxidiff_models::ControlNetModel;

    use crate::control::{controlled_prediction, StepTensors};

    let width = context_width(&UNet2DConditionConfig::from_file(
        &unet_dir.join("config.json"),
    )?);
    let _one_at_a_time = TRACING
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let device = OxiDevice::Cpu;
    let unet = UNet2DConditionModel::<Traced>::from_dir(unet_dir, None, &device)?;
    let nets = controlnet_dirs
        .iter()
        .map(|dir| ControlNetModel::<Traced>::from_dir(dir, None, &device))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let _loading = take_ops(&device);
    let zeros = |shape: Vec<usize>| TensorData::new(vec![0f32; shape.iter().product()], shape);
    let tensor4 = |shape: Vec<usize>| Tensor::<Traced, 4>::from_data(zeros(shape), &device);
    let tensor1 = || Tensor::<Traced, 1>::from_data(zeros(vec![1]), &device);
    let rows = 2 * batch;
    let channels = unet.conv_in.weight.dims()[1];
    let latents = vec![batch, channels, latent_height, latent_width];
    let step = StepTensors {
        sample: tensor4(latents.clone()),
        unet_input: tensor4(latents),
        timestep: tensor1(),
        context: Tensor::<Traced, 3>::from_data(zeros(vec![rows, CONTEXT_LEN, width]), &device),
        guidance: tensor1(),
    };
    let mut inputs = vec![
        float_ir(&step.sample),
        float_ir(&step.unet_input),
        float_ir(&step.timestep),
        float_ir(&step.context),
        float_ir(&step.guidance),
    ];
    let steer: Vec<_> = nets
        .iter()
        .map(|net| {
            let s = net.conditioning_downscale;
            let image = tensor4(vec![rows, 3, latent_height * s, latent_width * s]);
            let scale = tensor1();
            inputs.push(float_ir(&image));
            inputs.push(float_ir(&scale));
            (net, image, scale)
        })
        .collect();
    unet.check_added_condition(2 * batch, None)?;
    let prediction = controlled_prediction(&unet, &steer, false, step, None);
    traced_part(&device, &inputs, float_ir(&prediction), "ControlNet step")
}

/// Traces every step of the scheduler `config` makes, over `num_inference_steps` steps on
/// latents of `shape`, as compiled mode fuses them
/// ([`SchedulerProgram`](crate::compiled::SchedulerProgram)): each step's ops, with the
/// tensors it returns or keeps (a multistep scheduler's history) as results, lowered to one
/// module. Steps of one structure give the same module (their sigmas and coefficients are
/// arguments), so each distinct module is returned once, in the order first met; `weights`
/// counts its tensor arguments (latents, model output, history, noise).
pub fn trace_scheduler_steps(
    config: &SchedulerConfig,
    num_inference_steps: usize,
    shape: [usize; 4],
) -> Result<Vec<TracedPart>> {
    let _one_at_a_time = TRACING
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let device = OxiDevice::Cpu;
    let mut scheduler = scheduler_from_config::<Traced>(config)?;
    scheduler.set_timesteps(num_inference_steps)?;
    let zeros = || {
        let values = vec![0f32; shape.iter().product()];
        Tensor::<Traced, 4>::from_data(TensorData::new(values, shape), &device)
    };
    let mut noise = TorchCpuGenerator::new(0);
    let mut sample = zeros();
    let _before = take_ops(&device);
    let mut parts: Vec<TracedPart> = Vec::new();
    for t in scheduler.timesteps().to_vec() {
        let input = scheduler.scale_model_input(sample.clone(), t)?;
        drop(input);
        let _scaling = take_ops(&device);
        sample = scheduler.step(zeros(), t, sample, &mut noise)?;
        let (ops, live) = take_program(&device);
        let function = lower_recorded(&[], &ops, &live).map_err(|e| {
            PipelineError::Compile(format!("lowering the traced scheduler step at {t}: {e}"))
        })?;
        if parts.iter().all(|part| part.module != function.module) {
            let (weights, weight_bytes) = weight_arguments(&function, 0);
            parts.push(TracedPart {
                ops: ops.len(),
                weights,
                weight_bytes,
                module: function.module,
            });
        }
    }
    Ok(parts)
}

/// Which text encoder to trace, on how many rows of how many tokens.
#[derive(Debug, Clone, Copy)]
pub enum TextEncoderPart {
    /// CLIP's layers and final norm ([`compile_clip`](crate::compiled::compile_clip)).
    Clip { batch: usize, tokens: usize },
    /// T5's blocks and final norm ([`compile_t5`](crate::compiled::compile_t5)).
    T5 { batch: usize, tokens: usize },
}

/// Traces a text encoder in `dir` (a diffusers `text_encoder*/` folder) as compiled mode
/// compiles it, and lowers it to one module, as [`trace_vae`] does for the VAE.
pub fn trace_text_encoder(
    dir: &Path,
    variant: Option<&str>,
    part: TextEncoderPart,
) -> Result<TracedPart> {
    let _one_at_a_time = TRACING
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let device = OxiDevice::Cpu;
    let zeros = |shape: Vec<usize>| TensorData::new(vec![0f32; shape.iter().product()], shape);
    let (inputs, output) = match part {
        TextEncoderPart::Clip { batch, tokens } => {
            let clip = ClipTextModel::<Traced>::from_dir(dir, false, variant, &device)?;
            let _loading = take_ops(&device);
            let width = clip.token_embedding.weight.dims()[1];
            let x = Tensor::<Traced, 3>::from_data(zeros(vec![batch, tokens, width]), &device);
            (vec![float_ir(&x)], float_ir(&clip.run_layers(x)))
        }
        TextEncoderPart::T5 { batch, tokens } => {
            let t5 = T5EncoderModel::<Traced>::from_dir(dir, variant, &device)?;
            let _loading = take_ops(&device);
            let width = t5.shared.weight.dims()[1];
            let heads = t5.block[0].self_attention.heads;
            let x = Tensor::<Traced, 3>::from_data(zeros(vec![batch, tokens, width]), &device);
            let bias =
                Tensor::<Traced, 4>::from_data(zeros(vec![batch, heads, tokens, tokens]), &device);
            let inputs = vec![float_ir(&x), float_ir(&bias)];
            (inputs, float_ir(&t5.run_blocks(x, bias)))
        }
    };
    traced_part(&device, &inputs, output, "text encoder")
}

/// The ops recorded on `device` since the model loaded, lowered to one module from `inputs`
/// to `output` (`what` names the part in errors).
fn traced_part(
    device: &OxiDevice,
    inputs: &[TensorIr],
    output: TensorIr,
    what: &str,
) -> Result<TracedPart> {
    let ops = take_ops(device);
    let function = lower_recorded(inputs, &ops, &[output])
        .map_err(|e| PipelineError::Compile(format!("lowering the traced {what}: {e}")))?;
    let (weights, weight_bytes) = weight_arguments(&function, inputs.len());
    Ok(TracedPart {
        ops: ops.len(),
        weights,
        weight_bytes,
        module: function.module,
    })
}

/// The text width a UNet attends to (its config's first `cross_attention_dim`).
fn context_width(config: &UNet2DConditionConfig) -> usize {
    match &config.cross_attention_dim {
        PerBlock::One(d) => *d,
        PerBlock::Each(dims) => dims.first().copied().unwrap_or(768),
    }
}

/// The count and bytes of the tensor arguments of `function` after its first `inputs` (the
/// weights; the ops' scalars are not counted).
fn weight_arguments(function: &LoweredFunction, inputs: usize) -> (usize, usize) {
    let weights: Vec<_> = function
        .arguments
        .iter()
        .skip(inputs)
        .filter(|(argument, _)| matches!(argument, Argument::Tensor(_)))
        .collect();
    let bytes = weights
        .iter()
        .map(|(_, ty)| ty.dims.iter().product::<usize>() * ty.elem.byte_size())
        .sum();
    (weights.len(), bytes)
}

/// Traces attention as the models compute it (Burn's `attention` on `[batch, heads, seq,
/// head_dim]` q, k and v, scale `1/sqrt(head_dim)`, no mask) in `dtype` and lowers it to one
/// module `@main(q, k, v)`: plainly, or with `kernels` as compiled mode splices the
/// [kernel hub](oxidiff_backend_tpu::kernels)'s kernels in, to compare the two ahead of time.
pub fn trace_attention(
    shape: [usize; 4],
    dtype: FloatDType,
    kernels: Option<Arc<AttentionKernels>>,
) -> Result<TracedPart> {
    use burn::tensor::module::attention;
    use burn::tensor::ops::AttentionModuleOptions;
    let _one_at_a_time = TRACING
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let device = OxiDevice::Cpu;
    let _before = take_ops(&device);
    let n: usize = shape.iter().product();
    // Made in f32 and cast: the trace's ops start after the casts, so the module takes q, k
    // and v in `dtype`.
    let input = || {
        Tensor::<Traced, 4>::from_data(TensorData::new(vec![0f32; n], shape), &device).cast(dtype)
    };
    let (q, k, v) = (input(), input(), input());
    let _casts = take_ops(&device);
    let inputs = [float_ir(&q), float_ir(&k), float_ir(&v)];
    let out = attention(
        q,
        k,
        v,
        None,
        None,
        AttentionModuleOptions {
            scale: Some(1.0 / (shape[3] as f64).sqrt()),
            softcap: None,
            is_causal: false,
        },
    );
    let ops = take_ops(&device);
    let function = lower(
        &inputs,
        &ops,
        &[float_ir(&out)],
        kernels.as_ref(),
        None,
        "attention",
    )?;
    let (weights, weight_bytes) = weight_arguments(&function, inputs.len());
    Ok(TracedPart {
        ops: ops.len(),
        weights,
        weight_bytes,
        module: function.module,
    })
}
