//! Parallelism for a denoiser (diffusers' `enable_parallelism`): a [`ParallelConfig`] checked
//! against the model's tensor-parallel plan and the devices there are, the split weights placed
//! as shards on a `dp x tp` device mesh ([`SpmdPlacement`]), and the compiled step run as one
//! program partitioned by XLA over the mesh.
//!
//! [`enable_parallelism`] does this for any model with a plan (the denoiser alone: then wrap
//! its call with [`CompiledFn::with_spmd`](oxidiff_backend_tpu::CompiledFn::with_spmd));
//! [`StableDiffusionPipeline::enable_parallelism`](crate::StableDiffusionPipeline::enable_parallelism)
//! does it for the pipeline's UNet and compiled step.

use std::sync::Arc;

use burn::module::Module;
use burn::tensor::TensorPrimitive;
use oxidiff_backend_tpu::spmd::{HasTensorId, Layout, Mesh, SpmdPlacement, TensorId};
use oxidiff_backend_tpu::{pjrt_client, Oxi, OxiDevice};
use oxidiff_models::{sharded_params, TensorParallel};
pub use oxidiff_parallel::{
    DataParallelConfig, ParallelConfig, ParallelError, ParallelTarget, TensorParallelConfig,
};

use crate::error::{PipelineError, Result};

/// The split weights of `model` (on `device`), as tensor ids and layouts, per its plan and
/// `config`: a [`Layout::TensorSplit`] of the dimension the plan splits (Burn's `Linear` weight
/// is `[in, out]`: column-wise splits dimension 1, row-wise dimension 0).
pub fn split_weights<B, M>(model: &M, config: &ParallelConfig) -> Vec<(TensorId, Layout)>
where
    B: burn::tensor::backend::Backend,
    M: Module<B> + TensorParallel,
    B::FloatTensorPrimitive: HasTensorId,
{
    if config.tp() <= 1 {
        return Vec::new();
    }
    sharded_params::<B, M>(model, &M::tensor_parallel_plan())
        .into_iter()
        // Quantized weights are not split (no model here loads them).
        .filter_map(|param| match &param.tensor {
            TensorPrimitive::Float(t) => Some((
                t.tensor_id(),
                match param.packed {
                    1 => Layout::TensorSplit(param.split_dim),
                    packed => Layout::PackedTensorSplit(param.split_dim, packed),
                },
            )),
            TensorPrimitive::QFloat(_) => None,
        })
        .collect()
}

/// Checks `config` for `model` on `device`, readies its forward pass for the split
/// ([`TensorParallel::set_tensor_parallel_degree`]) and places its weights on the mesh it
/// names (devices `device`, `device + 1`, ...): each split weight as one shard per device (the
/// whole buffer leaves `device`), the others copied to every device on first use. After this
/// the model's split weights live only in the returned placement: run the model through a
/// [`CompiledFn`](oxidiff_backend_tpu::CompiledFn) made [`with_spmd`](oxidiff_backend_tpu::CompiledFn::with_spmd)
/// on it, not eagerly.
pub fn enable_parallelism<M>(
    model: &mut M,
    device: &OxiDevice,
    config: ParallelConfig,
) -> Result<Arc<SpmdPlacement>>
where
    M: Module<Oxi> + TensorParallel,
{
    enable_parallelism_with::<M, M>(model, &mut [], device, config)
}

/// [`enable_parallelism`] for a model and the models that run with it in one program (the
/// UNet and its ControlNets): each checked against its own plan, all split over one mesh.
pub fn enable_parallelism_with<M, N>(
    model: &mut M,
    with: &mut [N],
    device: &OxiDevice,
    config: ParallelConfig,
) -> Result<Arc<SpmdPlacement>>
where
    M: Module<Oxi> + TensorParallel,
    N: Module<Oxi> + TensorParallel,
{
    let available = match (device, pjrt_client(device)) {
        (OxiDevice::Pjrt { index, .. }, Some(client)) => {
            client.platform_device_count().saturating_sub(*index)
        }
        _ => 1,
    };
    let device_name = device.to_string();
    let validate = |model: &'static str, widths: Vec<oxidiff_parallel::ShardedWidth>| {
        config.validate(&ParallelTarget {
            model,
            widths: &widths,
            device: &device_name,
            devices_available: available,
            compiled_pjrt: device.is_pjrt(),
        })
    };
    validate(M::tensor_parallel_plan().model, model.sharded_widths())?;
    for net in with.iter() {
        validate(N::tensor_parallel_plan().model, net.sharded_widths())?;
    }
    let set_degree = |model: &mut M, with: &mut [N], tp: usize| {
        model.set_tensor_parallel_degree(tp);
        for net in with.iter_mut() {
            net.set_tensor_parallel_degree(tp);
        }
    };
    set_degree(model, with, config.tp());
    let mut split = split_weights::<Oxi, M>(model, &config);
    for net in with.iter() {
        split.extend(split_weights::<Oxi, N>(net, &config));
    }
    let placement = SpmdPlacement::new(device, Mesh::new(config.dp(), config.tp()), &split)
        .map_err(|e| {
            set_degree(model, with, 1);
            PipelineError::Device(e)
        })?;
    // What a staged load left on the host (the replicated weights, the other components)
    // goes to the device now, once, and the host lets go of it.
    if let Some(client) = pjrt_client(device) {
        client.upload_staged().map_err(PipelineError::Device)?;
    }
    Ok(Arc::new(placement))
}

/// Runs `load` (building models on `device`) with their weights staged on the host
/// ([`PjrtClient::stage_uploads`](oxidiff_backend_tpu::eager::PjrtClient::stage_uploads)):
/// each stays in the loader's bytes (the memory-mapped checkpoint's, when it stores the dtype)
/// until needed. Load a pipeline this way before [`enable_parallelism`] with tensor
/// parallelism, as transformers loads with a `tp_plan`: the split weights then go from the
/// file to their devices as shards, and the first device never holds them whole;
/// `enable_parallelism` uploads the rest. Anything used before that is uploaded when it is
/// used. Off PJRT devices `load` runs as it is.
///
/// ```no_run
/// # use oxidiff_backend_tpu::{Oxi, OxiDevice};
/// # use oxidiff_pipelines::{AutoPipeline, LoadOptions};
/// # use oxidiff_pipelines::parallel::{stage_weights, TensorParallelConfig};
/// let device: OxiDevice = "xla:cpu:0".parse()?;
/// let mut pipe = stage_weights(&device, || {
///     AutoPipeline::<Oxi>::from_pretrained("model-dir", &LoadOptions::default(), &device)
/// })?;
/// pipe.compile()?;
/// pipe.enable_parallelism(TensorParallelConfig::new(2))?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn stage_weights<T>(device: &OxiDevice, load: impl FnOnce() -> T) -> T {
    match pjrt_client(device) {
        Some(client) => {
            let _staging = client.stage_uploads();
            load()
        }
        None => load(),
    }
}

/// Compiled mode's first check: the denoiser (`component`: `UNet`, `transformer`) must be on a
/// PJRT device; the error otherwise names where it is and the fix.
pub(crate) fn require_pjrt(component: &str, device: &OxiDevice) -> Result<()> {
    if device.is_pjrt() {
        return Ok(());
    }
    Err(PipelineError::Compile(format!(
        "the {component} is on {device}; compiled mode needs a PJRT device \
         (move the pipeline first, e.g. to xla:cpu, tpu or cuda)"
    )))
}
