//! How a binary runs a loaded [`AutoPipeline`]: eagerly, or compiled (optionally spread over
//! several devices), on the plain CPU backend ([`Cpu`]) or on [`Oxi`]. `txt2img` and
//! `oxidiff-server` share it, so both report compiled mode the same way.

use burn::tensor::backend::Backend;
use oxidiff_backend_tpu::eager::Stats as EagerStats;
use oxidiff_pipelines::compiled::{CompileStats, ComponentStats};
use oxidiff_pipelines::memory::{ComponentMemory, HOST};
use oxidiff_pipelines::parallel::ParallelConfig;
use oxidiff_pipelines::{AutoPipeline, Result};

use crate::{Cpu, Oxi, OxiDevice};

/// Eager (each op at once) or compiled (the denoiser as one XLA program per input signature).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Execution {
    #[default]
    Eager,
    /// Compiled, over the devices `parallel` names (the default: one device).
    Compiled(ParallelConfig),
}

impl Execution {
    /// From the binaries' flags: `--compile`, `--dp`, `--tp`.
    pub fn from_flags(compile: bool, dp: usize, tp: usize) -> Self {
        if compile {
            Self::Compiled(ParallelConfig::new(dp, tp))
        } else {
            Self::Eager
        }
    }
}

/// A backend a binary runs pipelines on: what it needs beyond Burn's [`Backend`].
pub trait PipelineBackend: Backend {
    /// Applies `execution` to a loaded pipeline. Compiled mode on a backend without a PJRT
    /// client is refused (the binaries check it before loading).
    fn prepare(pipe: &mut AutoPipeline<Self>, execution: Execution) -> Result<()>;

    /// Runs `load` (the pipeline's load on `device`) the way `execution` wants the weights
    /// placed: under tensor parallelism on a PJRT device they are staged on the host, so
    /// [`prepare`](Self::prepare) sends each device only its shards
    /// ([`stage_weights`](oxidiff_pipelines::parallel::stage_weights)).
    fn load<T>(_device: &Self::Device, _execution: Execution, load: impl FnOnce() -> T) -> T {
        load()
    }

    /// Compiled mode's counts summed over the components, `None` when eager.
    fn compile_stats(pipe: &AutoPipeline<Self>) -> Option<CompileStats> {
        let components = Self::component_stats(pipe);
        (!components.is_empty()).then(|| {
            components
                .iter()
                .fold(CompileStats::default(), |sum, c| sum + c.stats)
        })
    }

    /// Compiled mode's counts per component (the denoiser, the VAE's encoder and decoder);
    /// empty when eager.
    fn component_stats(pipe: &AutoPipeline<Self>) -> Vec<ComponentStats>;

    /// What each component's weights hold, by type and by place: the host or each device (a
    /// denoiser spread over several devices by its shards there).
    fn memory(pipe: &AutoPipeline<Self>) -> Vec<ComponentMemory>;

    /// What eager mode did so far on `device`'s PJRT client (ops run, XLA compiles, loads from
    /// the compile cache); `None` off PJRT devices.
    fn eager_stats(device: &Self::Device) -> Option<EagerStats>;

    /// "eager", or what compiled mode built.
    fn mode(pipe: &AutoPipeline<Self>) -> String {
        match Self::compile_stats(pipe) {
            Some(stats) => format!(
                "compiled: {} program(s), {} XLA compile(s), {} from the disk cache",
                stats.programs, stats.xla_compiles, stats.disk_loads
            ),
            None => "eager".into(),
        }
    }
}

impl PipelineBackend for Cpu {
    fn prepare(_: &mut AutoPipeline<Self>, execution: Execution) -> Result<()> {
        match execution {
            Execution::Eager => Ok(()),
            Execution::Compiled(_) => Err(oxidiff_pipelines::PipelineError::InvalidInput(
                "compiled mode needs a PJRT device (xla:cpu, tpu or cuda); the plain CPU \
                 backend runs eagerly"
                    .into(),
            )),
        }
    }

    fn component_stats(_: &AutoPipeline<Self>) -> Vec<ComponentStats> {
        Vec::new()
    }

    fn memory(pipe: &AutoPipeline<Self>) -> Vec<ComponentMemory> {
        pipe.memory(&|_| HOST.to_string())
    }

    fn eager_stats(_: &Self::Device) -> Option<EagerStats> {
        None
    }
}

impl PipelineBackend for Oxi {
    fn prepare(pipe: &mut AutoPipeline<Self>, execution: Execution) -> Result<()> {
        if let Execution::Compiled(parallel) = execution {
            pipe.compile()?;
            if parallel != ParallelConfig::default() {
                pipe.enable_parallelism(parallel)?;
            }
        }
        Ok(())
    }

    fn load<T>(device: &Self::Device, execution: Execution, load: impl FnOnce() -> T) -> T {
        match execution {
            Execution::Compiled(parallel) if parallel.tp() > 1 => {
                oxidiff_pipelines::parallel::stage_weights(device, load)
            }
            _ => load(),
        }
    }

    fn component_stats(pipe: &AutoPipeline<Self>) -> Vec<ComponentStats> {
        pipe.component_stats()
    }

    fn memory(pipe: &AutoPipeline<Self>) -> Vec<ComponentMemory> {
        let place = |device: &OxiDevice| match device {
            OxiDevice::Cpu => HOST.to_string(),
            device => device.to_string(),
        };
        let mut all = pipe.memory(&place);
        // A partitioned denoiser's weights are where its placement put them: its shards and
        // the replicated weights copied to each device of the mesh.
        if let Some(placement) = pipe.spmd_placement() {
            if let Some(denoiser) = all
                .iter_mut()
                .find(|c| c.component == "unet" || c.component == "transformer")
            {
                denoiser.memory.by_place = placement
                    .partition_devices()
                    .iter()
                    .zip(placement.weight_bytes())
                    .map(|(device, bytes)| (device.to_string(), bytes.sharded + bytes.replicated))
                    .collect();
            }
            // ControlNets run in the denoiser's program: their weights are in its placement,
            // counted under the denoiser.
            for net in all
                .iter_mut()
                .filter(|c| c.component.starts_with("controlnet"))
            {
                net.memory.by_place.clear();
            }
        }
        all
    }

    fn eager_stats(device: &Self::Device) -> Option<EagerStats> {
        oxidiff_backend_tpu::pjrt_client(device).map(|client| client.stats())
    }
}
