//! The lower phase: a recording (inputs, ops, outputs) to one StableHLO
//! function through the shared [`Lowerer`].

use burn_ir::{OperationIr, TensorId, TensorIr};

use super::tensors::Tensors;
use super::{host_kernel_allowed, kernels_last, CompileError, CompiledFn};
use crate::host_kernels::{available, TARGETS};
use crate::kernels::AttentionKernels;
use crate::lowering::{LowerError, LoweredFunction, Lowerer};

impl<I: Tensors, O: Tensors, F: Fn(I) -> O> CompiledFn<I, O, F> {
    /// Lowers a trace: inputs first, then the ops; an output nothing
    /// computed (a captured tensor returned as is) becomes an argument too.
    /// Attention goes to the kernel hub's kernels for a device of `device_kind` where
    /// [`AttentionKernels::from_env`] enables them (in a partitioned program, each device's
    /// own rows and heads: [`Lowerer::with_kernels_over`]); f32 convolutions and attention to
    /// oxidiff's host kernels where `plugin` registered them ([`crate::host_kernels`]).
    pub(super) fn lower(
        &self,
        inputs: &[TensorIr],
        ops: &[OperationIr],
        outputs: &[TensorIr],
        device_kind: &str,
        plugin: &crate::pjrt::Plugin,
    ) -> Result<LoweredFunction, CompileError> {
        // Kernels in the convolutions' layout, permuted once when the sources
        // are gathered; a partitioned program keeps Burn's layout, which its
        // shardings name.
        let mut lowerer = if self.spmd.is_none() && kernels_last() {
            Lowerer::with_kernels_last()
        } else {
            Lowerer::new()
        };
        if self.spmd.is_none() {
            lowerer = lowerer.with_host_kernels(
                TARGETS
                    .into_iter()
                    .filter(|target| host_kernel_allowed(target) && available(plugin, target)),
            );
        }
        if let Some(kernels) = AttentionKernels::from_env(device_kind) {
            lowerer = match &self.spmd {
                None => lowerer.with_kernels(kernels),
                Some(spmd) => lowerer.with_kernels_over(kernels, *spmd.placement.mesh()),
            };
        }
        lower_recorded_with(lowerer, inputs, ops, outputs).map_err(|source| CompileError::Lower {
            name: self.name.clone(),
            source,
        })
    }
}

/// Lowers a recorded program into one StableHLO function: `inputs` become
/// `%arg0..` in order, then `ops` are lowered; every tensor an op reads that
/// is neither an input nor produced by an op (a captured weight) becomes a
/// further argument ([`Argument::Tensor`]), and so does an output nothing
/// computed. Compiled mode lowers its traces with this, and ahead-of-time
/// compilation can lower a recording of the [`Traced`](crate::trace::Traced)
/// backend the same way.
pub fn lower_recorded(
    inputs: &[TensorIr],
    ops: &[OperationIr],
    outputs: &[TensorIr],
) -> Result<LoweredFunction, LowerError> {
    lower_recorded_with(Lowerer::new(), inputs, ops, outputs)
}

/// [`lower_recorded`] with a configured `lowerer` (such as
/// [`Lowerer::with_kernels_last`]).
pub fn lower_recorded_with(
    mut lowerer: Lowerer,
    inputs: &[TensorIr],
    ops: &[OperationIr],
    outputs: &[TensorIr],
) -> Result<LoweredFunction, LowerError> {
    for ir in inputs {
        lowerer.declare_input(ir)?;
    }
    for op in ops {
        if matches!(op, OperationIr::Init(_) | OperationIr::Drop(_)) {
            continue;
        }
        lowerer.lower(op)?;
    }
    for ir in outputs {
        if !lowerer.has_value(ir.id) {
            lowerer.declare_input(ir)?;
        }
    }
    let ids: Vec<TensorId> = outputs.iter().map(|t| t.id).collect();
    lowerer.finish(&ids)
}
