//! The one compiled denoiser every pipeline holds: a step's denoiser call (a tuple of input
//! tensors to the model output) as XLA programs, traced on first use and cached by input
//! shapes, optionally partitioned over a device mesh.
//!
//! Where this sits: beside `denoise.rs` on the ground floor; it wraps backend-tpu's
//! `CompiledFn` so that pipelines generic over the backend can hold it, built only for `Oxi`.

use std::collections::BTreeMap;
use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use oxidiff_backend_tpu::compiled::Tensors;
use oxidiff_backend_tpu::spmd::{Layout, SpmdPlacement};
use oxidiff_backend_tpu::{CompiledFn, Oxi};

use crate::error::{PipelineError, Result};

/// Counts of compiled mode (each pipeline's `compile_stats`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CompileStats {
    /// Programs built, one per input signature (image size, batch, guidance on or off).
    pub programs: u64,
    /// Of those, how many XLA compiled; the others were loaded from the on-disk cache.
    pub xla_compiles: u64,
    pub disk_loads: u64,
}

/// What a compiled call offers, object-safe so the backend type stays a parameter.
trait CompiledCall<B: Backend, I> {
    fn call(&self, inputs: I) -> Result<Tensor<B, 4>>;
    fn stats(&self) -> CompileStats;
    fn spmd_placement(&self) -> Option<&Arc<SpmdPlacement>>;
    fn optimized_opcode_counts(&self) -> Result<Vec<BTreeMap<String, usize>>>;
}

type StepFn<I> = Box<dyn Fn(I) -> Tensor<Oxi, 4>>;

fn compile_error(e: impl std::fmt::Display) -> PipelineError {
    PipelineError::Compile(e.to_string())
}

impl<I: Tensors> CompiledCall<Oxi, I> for CompiledFn<I, Tensor<Oxi, 4>, StepFn<I>> {
    fn call(&self, inputs: I) -> Result<Tensor<Oxi, 4>> {
        CompiledFn::call(self, inputs).map_err(compile_error)
    }

    fn stats(&self) -> CompileStats {
        CompileStats {
            programs: self.compiles(),
            xla_compiles: self.xla_compiles(),
            disk_loads: self.disk_loads(),
        }
    }

    fn spmd_placement(&self) -> Option<&Arc<SpmdPlacement>> {
        CompiledFn::spmd_placement(self)
    }

    fn optimized_opcode_counts(&self) -> Result<Vec<BTreeMap<String, usize>>> {
        CompiledFn::optimized_opcode_counts(self).map_err(compile_error)
    }
}

/// A pipeline's denoiser call with inputs `I` (a tuple of tensors) run as compiled programs.
pub struct CompiledDenoiser<B: Backend, I> {
    inner: Box<dyn CompiledCall<B, I>>,
}

impl<B: Backend, I> CompiledDenoiser<B, I> {
    /// Runs the call: traced and compiled for a new input signature, cached otherwise.
    pub fn call(&self, inputs: I) -> Result<Tensor<B, 4>> {
        self.inner.call(inputs)
    }

    /// What was compiled so far.
    pub fn compile_stats(&self) -> CompileStats {
        self.inner.stats()
    }

    /// The device mesh and weight shards, when the call runs partitioned.
    pub fn spmd_placement(&self) -> Option<&Arc<SpmdPlacement>> {
        self.inner.spmd_placement()
    }

    /// Opcode counts of each compiled program's optimized HLO (the collectives of a
    /// partitioned one among them); empty when not compiled by XLA here.
    pub fn optimized_opcode_counts(&self) -> Result<Vec<BTreeMap<String, usize>>> {
        self.inner.optimized_opcode_counts()
    }
}

impl<I: Tensors + 'static> CompiledDenoiser<Oxi, I> {
    /// `step` compiled as program `name`; with a `placement`, partitioned over its mesh with
    /// input `k` laid out as `layouts[k]`.
    pub fn new(
        name: &str,
        step: impl Fn(I) -> Tensor<Oxi, 4> + 'static,
        placement: Option<Arc<SpmdPlacement>>,
        layouts: Vec<Layout>,
    ) -> Self {
        let step: StepFn<I> = Box::new(step);
        let f = CompiledFn::new(name, step);
        let f = match placement {
            Some(placement) => f.with_spmd(placement, layouts),
            None => f,
        };
        Self { inner: Box::new(f) }
    }
}
