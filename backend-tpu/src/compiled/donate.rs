//! The donate phase: an output may take over an input's buffer
//! (`tf.aliasing_output` on the argument); an input still referenced
//! elsewhere is copied first, so donation is never visible.

use std::collections::{HashMap, HashSet};

use burn_ir::{TensorId, TensorIr};

use super::sources::Source;
use super::tensors::Tensors;
use super::trace::Signature;
use super::{CompileError, CompiledFn, Program};
use crate::device::OxiDevice;
use crate::eager::PjrtClient;
use crate::lowering::LoweredFunction;
use crate::pjrt::Buffer;

impl<I: Tensors, O: Tensors, F: Fn(I) -> O> CompiledFn<I, O, F> {
    /// Marks each donation in `module` after checking it holds; returns the
    /// donated inputs. Partitioned programs donate nothing.
    pub(super) fn mark_donations(
        &self,
        module: &mut String,
        signature: &Signature,
        sources: &[Source],
        function: &LoweredFunction,
        outputs: usize,
    ) -> Result<Vec<usize>, CompileError> {
        let mut donated = Vec::new();
        if self.spmd.is_some() {
            return Ok(donated);
        }
        let inputs = signature.aliases.len();
        for &(input, output) in &self.donations {
            let checked = (|| {
                if input >= inputs || output >= outputs {
                    return Err(format!(
                        "the function has {inputs} inputs and {outputs} outputs"
                    ));
                }
                let alias = signature.aliases[input];
                if signature
                    .aliases
                    .iter()
                    .enumerate()
                    .any(|(k, &a)| a == alias && k != input)
                {
                    return Err("the input tensor is passed more than once".to_string());
                }
                let argument = sources
                    .iter()
                    .position(|s| matches!(s, Source::Input(k) if *k == input))
                    .ok_or_else(|| "the input is not an argument".to_string())?;
                let in_ty = &function.arguments[argument].1;
                let out_ty = &function.results[output].1;
                if in_ty != out_ty {
                    return Err(format!(
                        "the input is {} but the output {}",
                        in_ty.mlir(),
                        out_ty.mlir()
                    ));
                }
                mark_donation(module, argument, &in_ty.mlir(), output)
            })();
            if let Err(message) = checked {
                return Err(CompileError::Donation {
                    name: self.name.clone(),
                    input,
                    output,
                    message,
                });
            }
            donated.push(input);
        }
        Ok(donated)
    }

    /// Copies of the donated inputs of the tracing call that are still
    /// referenced elsewhere (one the closure dropped is freed after the run
    /// anyway, so it is donated as is).
    pub(super) fn donated_copies(
        &self,
        client: &PjrtClient,
        device: &OxiDevice,
        program: &Program,
        inputs: &[TensorIr],
        released: &HashSet<TensorId>,
    ) -> Result<HashMap<usize, Buffer>, CompileError> {
        let mut copies = HashMap::new();
        for &k in &program.donated {
            if !released.contains(&inputs[k].id) {
                copies.insert(k, self.copy_input(client, device, k, inputs[k].id)?);
            }
        }
        Ok(copies)
    }

    /// A copy of input `k` (tensor `id`) to donate in its place.
    pub(super) fn copy_input(
        &self,
        client: &PjrtClient,
        device: &OxiDevice,
        k: usize,
        id: TensorId,
    ) -> Result<Buffer, CompileError> {
        let run_error = |message: String| CompileError::Run {
            name: self.name.clone(),
            device: device.clone(),
            message,
        };
        let (_, pjrt_device) = client.target().map_err(run_error)?;
        client
            .with_buffers(|buffers| match buffers.get(&id) {
                Some(buffer) => buffer
                    .copy_to_device(pjrt_device)
                    .map_err(|e| format!("copying donated input {k} failed: {e}")),
                None => Err(format!("input {k} (tensor {id}) is not on the device")),
            })
            .map_err(run_error)
    }
}

/// Adds `tf.aliasing_output = output` to argument `argument` (of type `ty`)
/// of `@main` in `module`.
fn mark_donation(
    module: &mut String,
    argument: usize,
    ty: &str,
    output: usize,
) -> Result<(), String> {
    let header = module
        .find("func.func public @main(")
        .ok_or_else(|| "the module has no @main (a bug)".to_string())?;
    let header_end = header + module[header..].find('\n').unwrap_or(module.len() - header);
    let needle = format!("%arg{argument}: {ty}");
    let at = module[header..header_end]
        .match_indices(&needle)
        .map(|(i, _)| header + i + needle.len())
        .find(|&end| matches!(module.as_bytes().get(end), Some(b',' | b')')))
        .ok_or_else(|| format!("argument {argument} is not in the signature of @main (a bug)"))?;
    module.insert_str(at, &format!(" {{tf.aliasing_output = {output} : i32}}"));
    Ok(())
}
