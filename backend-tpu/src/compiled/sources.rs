//! The sources phase: where each argument of the lowered function comes from
//! on every call (an input, a captured weight, a buffer the program owns, a
//! random state); captured convolution kernels are permuted here, once: from a mapped
//! checkpoint's bytes in place of their device copy in Burn's layout
//! ([`PjrtClient::upload_permuted`]), else on the device by a small program.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use burn_ir::{TensorId, TensorIr};

use super::run::upload_scalar;
use super::tensors::Tensors;
use super::{lock, CompiledFn};
use crate::compile_cache;
use crate::eager::PjrtClient;
use crate::lowering::{Argument, LoweredFunction, TensorType};
use crate::pjrt::{self, Buffer};

/// Where one argument of a program comes from on each call.
pub(super) enum Source {
    /// Input `k` of the call.
    Input(usize),
    /// A tensor the eager client holds (a captured weight), by id.
    Captured(TensorId),
    /// A buffer the program owns: a constant created and dropped during the
    /// trace, or a scalar of an op.
    Owned(Buffer),
    /// A buffer the compiled function keeps for all its programs: a captured
    /// convolution kernel, permuted once ([`Argument::Permuted`]).
    Shared(Arc<Buffer>),
    /// A fresh random state.
    Rng,
}

/// A program's arguments: their sources, and how many of each kind.
pub(super) struct Arguments {
    pub(super) sources: Vec<Source>,
    /// Captured tensors (weights, and constants of the trace).
    pub(super) captured: usize,
    pub(super) scalars: usize,
    pub(super) random: usize,
}

impl<I: Tensors, O: Tensors, F: Fn(I) -> O> CompiledFn<I, O, F> {
    /// The source of each argument of `function`, traced on `inputs`; a
    /// tensor in `released` (dropped or consumed in the trace) becomes the
    /// program's own buffer.
    pub(super) fn sources(
        &self,
        client: &PjrtClient,
        function: &LoweredFunction,
        inputs: &[TensorIr],
        released: &HashSet<TensorId>,
    ) -> Result<Arguments, String> {
        let (pjrt_client, pjrt_device) = client.target()?;
        let first_input: HashMap<TensorId, usize> = inputs
            .iter()
            .enumerate()
            .rev()
            .map(|(k, t)| (t.id, k))
            .collect();
        let mut sources = Vec::with_capacity(function.arguments.len());
        let (mut captured, mut scalars, mut random) = (0, 0, 0);
        // Weights the program also takes as they are: their device copies stay.
        let unpermuted: HashSet<TensorId> = function
            .arguments
            .iter()
            .filter_map(|(argument, _)| match argument {
                Argument::Tensor(id) => Some(*id),
                _ => None,
            })
            .collect();
        for (argument, ty) in &function.arguments {
            let source = match argument {
                Argument::Permuted { id, permutation } => {
                    captured += 1;
                    let key = (*id, permutation.clone());
                    let cached = lock(&self.kernels).get(&key).cloned();
                    match cached {
                        Some(buffer) => Source::Shared(buffer),
                        None if first_input.contains_key(id) => {
                            return Err(format!(
                                "input tensor {id} was lowered as a permuted kernel (a bug)"
                            ))
                        }
                        None => {
                            // A constant of the trace is the program's alone.
                            let owned = released.contains(id);
                            // A kernel the programs take permuted only, from a mapped
                            // checkpoint: uploaded permuted from its bytes in place of its
                            // device copy in Burn's layout, so the device never holds both (it
                            // is uploaded again in that layout if anything else needs it).
                            let from_host = if owned || unpermuted.contains(id) {
                                None
                            } else {
                                client.upload_permuted(*id, permutation).transpose()?
                            };
                            if let Some(buffer) = from_host {
                                let buffer = Arc::new(buffer);
                                lock(&self.kernels).insert(key, buffer.clone());
                                sources.push(Source::Shared(buffer));
                                continue;
                            }
                            client.restore([*id]);
                            let permuted = client.with_buffers(|buffers| {
                                let buffer = if owned { buffers.remove(id) } else { None };
                                match buffer.as_ref().or_else(|| buffers.get(id)) {
                                    Some(buffer) => self.permute_buffer(
                                        (pjrt_client, pjrt_device),
                                        buffer,
                                        ty,
                                        permutation,
                                    ),
                                    None => Err(format!(
                                        "tensor {id}, used by the traced ops, is not on the device"
                                    )),
                                }
                            })?;
                            if owned {
                                Source::Owned(permuted)
                            } else {
                                let buffer = Arc::new(permuted);
                                lock(&self.kernels).insert(key, buffer.clone());
                                Source::Shared(buffer)
                            }
                        }
                    }
                }
                Argument::Tensor(id) => {
                    if let Some(&k) = first_input.get(id) {
                        Source::Input(k)
                    } else if released.contains(id) {
                        captured += 1;
                        match client.with_buffers(|buffers| buffers.remove(id)) {
                            Some(buffer) => Source::Owned(buffer),
                            None => {
                                return Err(format!(
                                    "tensor {id}, used by the traced ops, is not on the device"
                                ))
                            }
                        }
                    } else {
                        captured += 1;
                        Source::Captured(*id)
                    }
                }
                Argument::Scalar(scalar) => {
                    scalars += 1;
                    Source::Owned(upload_scalar((pjrt_client, pjrt_device), *scalar, ty)?)
                }
                Argument::RngState => {
                    random += 1;
                    Source::Rng
                }
            };
            sources.push(source);
        }
        Ok(Arguments {
            sources,
            captured,
            scalars,
            random,
        })
    }
}

impl<I: Tensors, O: Tensors, F: Fn(I) -> O> CompiledFn<I, O, F> {
    /// `buffer` (of the tensor whose permutation by `permutation` has type `permuted`)
    /// transposed on its device by a small program, one per type and permutation, kept for
    /// the function's later programs and in the disk cache like them (counted with them).
    fn permute_buffer(
        &self,
        (client, device): (&pjrt::Client, &pjrt::Device),
        buffer: &Buffer,
        permuted: &TensorType,
        permutation: &[usize],
    ) -> Result<Buffer, String> {
        let mut dims = vec![0; permutation.len()];
        for (i, &p) in permutation.iter().enumerate() {
            dims[p] = permuted.dims[i];
        }
        let source = TensorType::new(dims, permuted.elem);
        let module = format!(
            "module @oxidiff_permute {{\n  func.func public @main(%arg0: {from}) -> ({to}) {{\n    %0 = stablehlo.transpose %arg0, dims = {permutation:?} : ({from}) -> {to}\n    return %0 : {to}\n  }}\n}}\n",
            from = source.mlir(),
            to = permuted.mlir(),
        );
        let mut transposes = lock(&self.transposes);
        if !transposes.programs.contains_key(&module) {
            let disk = self.disk_cache.as_deref().filter(|_| self.spmd.is_none());
            let (exe, from_disk) = compile_cache::load_or_compile(client, device, &module, disk, 1)
                .map_err(|e| format!("compiling a kernel transpose failed: {e}"))?;
            if from_disk {
                transposes.loaded += 1;
            } else {
                transposes.compiled += 1;
                super::compiles().fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            transposes.programs.insert(module.clone(), exe);
        }
        let mut out = transposes.programs[&module]
            .execute(&[buffer])
            .map_err(|e| format!("transposing a kernel failed: {e}"))?;
        out.pop()
            .ok_or_else(|| "a kernel transpose returned nothing (a bug)".to_string())
    }
}
