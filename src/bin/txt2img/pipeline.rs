//! The backend a run uses: `--device cpu` runs on the plain CPU backend ([`Cpu`], burn-flex
//! with oxidiff's CPU kernels, the path the benchmark measures), a PJRT device on [`Oxi`].
//! The pipeline itself is the library's [`AutoPipeline`].

use anyhow::Result;
use burn::tensor::backend::Backend;
use oxidiff::pipelines::parallel::ParallelConfig;
use oxidiff::pipelines::AutoPipeline;
use oxidiff::{Cpu, Oxi};

use crate::args::Args;

/// What the CLI needs of a backend beyond Burn's: compiled mode where it has one.
pub trait CliBackend: Backend {
    /// Compiled mode and parallelism as the flags ask (`check_usage` has refused them where
    /// the device has no PJRT client).
    fn prepare(pipe: &mut AutoPipeline<Self>, args: &Args) -> Result<()>;

    /// "eager", or what compiled mode built.
    fn mode(pipe: &AutoPipeline<Self>) -> String;
}

impl CliBackend for Cpu {
    fn prepare(_: &mut AutoPipeline<Self>, _: &Args) -> Result<()> {
        Ok(())
    }

    fn mode(_: &AutoPipeline<Self>) -> String {
        "eager".into()
    }
}

impl CliBackend for Oxi {
    fn prepare(pipe: &mut AutoPipeline<Self>, args: &Args) -> Result<()> {
        if args.compile {
            pipe.compile()?;
        }
        if args.tp != 1 || args.dp != 1 {
            pipe.enable_parallelism(ParallelConfig::new(args.dp, args.tp))?;
        }
        Ok(())
    }

    fn mode(pipe: &AutoPipeline<Self>) -> String {
        match pipe.compile_stats() {
            Some(stats) => format!(
                "compiled: {} program(s), {} XLA compile(s), {} from the disk cache",
                stats.programs, stats.xla_compiles, stats.disk_loads
            ),
            None => "eager".into(),
        }
    }
}
