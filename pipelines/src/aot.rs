//! The compiled denoising step for hardware that is not here: the same step that
//! [`StableDiffusionPipeline::compile`](crate::StableDiffusionPipeline::compile) runs
//! ([`guided_noise`]: UNet plus classifier-free guidance), recorded on the `Traced` backend
//! (shapes without values, weights without loading them onto a device) and lowered by the same
//! [`lower_recorded`] as compiled mode, into one StableHLO module that a TPU topology can
//! compile ahead of time (`Topology::compile`, libtpu without a TPU); the VAE's encoder and
//! decoder likewise ([`trace_vae`]).

use std::path::Path;

use burn::tensor::{Tensor, TensorData};
use oxidiff_backend_tpu::compiled::lower_recorded;
use oxidiff_backend_tpu::lowering::{Argument, LoweredFunction};
use oxidiff_backend_tpu::trace::{float_ir, take_ops, TensorIr, Traced};
use oxidiff_backend_tpu::OxiDevice;
use oxidiff_models::config::PerBlock;
use oxidiff_models::{
    AutoencoderKL, ClipTextModel, T5EncoderModel, UNet2DConditionConfig, UNet2DConditionModel,
};

use crate::error::{PipelineError, Result};
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
    /// The module text: `@main(sample, timestep, context, guidance, weights...)`.
    pub module: String,
    /// Ops recorded.
    pub ops: usize,
    /// Arguments after the four inputs: the UNet's weights (and the ops' scalars).
    pub weights: usize,
    /// Bytes of those weight arguments.
    pub weight_bytes: usize,
    /// The latents' shape `[batch, channels, height/8, width/8]`.
    pub latents: [usize; 4],
    /// Whether classifier-free guidance is in the step (the UNet then sees batch `2 * batch`).
    pub guidance: bool,
    /// Devices the module is partitioned over (`mhlo.num_partitions`; 1 unless traced by
    /// [`trace_parallel_step`]).
    pub partitions: usize,
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
    trace_step(
        unet_dir,
        variant,
        [batch, latent_height, latent_width],
        guidance,
        None,
    )
}

/// [`trace_guided_step`] partitioned as
/// [`StableDiffusionPipeline::enable_parallelism`](crate::StableDiffusionPipeline::enable_parallelism)
/// partitions it, over `devices` devices (a TPU topology's): the UNet's split weights and the
/// batch inputs carry their `mhlo.sharding`, for `CompileOptions::spmd` over the topology's
/// first `config.devices()` devices. The config is checked as on a real mesh.
pub fn trace_parallel_step(
    unet_dir: &Path,
    variant: Option<&str>,
    latents: [usize; 3],
    guidance: bool,
    config: &ParallelConfig,
    devices: usize,
) -> Result<TracedStep> {
    trace_step(
        unet_dir,
        variant,
        latents,
        guidance,
        Some((config, devices)),
    )
}

fn trace_step(
    unet_dir: &Path,
    variant: Option<&str>,
    [batch, latent_height, latent_width]: [usize; 3],
    guidance: bool,
    parallel: Option<(&ParallelConfig, usize)>,
) -> Result<TracedStep> {
    let context_dim = context_width(unet_dir)?;
    let _one_at_a_time = TRACING
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let device = OxiDevice::Cpu;
    let mut unet = UNet2DConditionModel::<Traced>::from_dir(unet_dir, variant, &device)?;
    let _loading = take_ops(&device);
    let split: HashMap<_, _> = match parallel {
        Some((config, devices)) => {
            let widths = unet.sharded_widths();
            config.validate(&ParallelTarget {
                model: "UNet2DConditionModel",
                widths: &widths,
                device: "the topology",
                devices_available: devices,
                compiled_pjrt: true,
            })?;
            unet.set_tensor_parallel_degree(config.tp());
            split_weights::<Traced, _>(&unet, config)
                .into_iter()
                .collect()
        }
        None => HashMap::new(),
    };

    let latents = [
        batch,
        unet.conv_in.weight.dims()[1],
        latent_height,
        latent_width,
    ];
    let rows = if guidance { 2 * batch } else { batch };
    let zeros = |shape: Vec<usize>| TensorData::new(vec![0f32; shape.iter().product()], shape);
    let sample = Tensor::<Traced, 4>::from_data(zeros(latents.to_vec()), &device);
    let timestep = Tensor::<Traced, 1>::from_data(zeros(vec![1]), &device);
    let context =
        Tensor::<Traced, 3>::from_data(zeros(vec![rows, CONTEXT_LEN, context_dim]), &device);
    let scale = Tensor::<Traced, 1>::from_data(zeros(vec![1]), &device);
    let inputs = vec![
        float_ir(&sample),
        float_ir(&timestep),
        float_ir(&context),
        float_ir(&scale),
    ];
    let noise = guided_noise(&unet, sample, timestep, context, scale);
    let outputs = vec![float_ir(&noise)];
    let ops = take_ops(&device);
    let function = lower_recorded(&inputs, &ops, &outputs)
        .map_err(|e| PipelineError::Compile(format!("lowering the traced UNet step: {e}")))?;
    let (module, partitions) = match parallel {
        Some((config, _)) => {
            let mesh = Mesh::new(config.dp(), config.tp());
            // As the pipeline's step: latents and context split by batch when it divides.
            let input_layouts = [
                Layout::BatchSplit(0),
                Layout::Replicated,
                Layout::BatchSplit(0),
                Layout::Replicated,
            ];
            let shardings: Vec<String> = function
                .arguments
                .iter()
                .enumerate()
                .map(|(i, (argument, ty))| {
                    let layout = match argument {
                        _ if i < input_layouts.len() => input_layouts[i],
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
    })
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

    let width = context_width(unet_dir)?;
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

/// The text width the UNet in `unet_dir` attends to (its config's first `cross_attention_dim`).
fn context_width(unet_dir: &Path) -> Result<usize> {
    let config = UNet2DConditionConfig::from_file(&unet_dir.join("config.json"))?;
    Ok(match &config.cross_attention_dim {
        PerBlock::One(d) => *d,
        PerBlock::Each(dims) => dims.first().copied().unwrap_or(768),
    })
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
    dtype: burn::tensor::FloatDType,
    kernels: Option<std::sync::Arc<oxidiff_backend_tpu::kernels::AttentionKernels>>,
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
    let mut lowerer = oxidiff_backend_tpu::lowering::Lowerer::new();
    if let Some(kernels) = kernels {
        lowerer = lowerer.with_kernels(kernels);
    }
    let function = oxidiff_backend_tpu::compiled::lower_recorded_with(
        lowerer,
        &inputs,
        &ops,
        &[float_ir(&out)],
    )
    .map_err(|e| PipelineError::Compile(format!("lowering the traced attention: {e}")))?;
    let (weights, weight_bytes) = weight_arguments(&function, inputs.len());
    Ok(TracedPart {
        ops: ops.len(),
        weights,
        weight_bytes,
        module: function.module,
    })
}
