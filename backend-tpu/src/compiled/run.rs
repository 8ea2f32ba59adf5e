//! The run phase on one device: the arguments gathered from their sources
//! (fresh random states uploaded), one execution, the results bound to the
//! output tensors in the eager client.

use std::collections::HashMap;

use burn_ir::{TensorId, TensorIr};

use super::sources::Source;
use super::tensors::Tensors;
use super::{CompileError, CompiledFn, Program};
use crate::device::OxiDevice;
use crate::eager::PjrtClient;
use crate::pjrt::{self, Buffer, ElementType};

impl<I: Tensors, O: Tensors, F: Fn(I) -> O> CompiledFn<I, O, F> {
    /// Executes `program` on the inputs `inputs`, binding its results to
    /// `outputs` in the eager client.
    pub(super) fn run(
        &self,
        client: &PjrtClient,
        device: &OxiDevice,
        program: &Program,
        inputs: &[TensorIr],
        outputs: &[TensorId],
        copies: &HashMap<usize, Buffer>,
    ) -> Result<(), CompileError> {
        if let Some(spmd) = &self.spmd {
            return self.run_spmd(spmd, client, device, program, inputs, outputs);
        }
        let run_error = |message: String| CompileError::Run {
            name: self.name.clone(),
            device: device.clone(),
            message,
        };
        let (pjrt_client, pjrt_device) = client.target().map_err(run_error)?;
        let mut rng_states = Vec::new();
        for source in &program.sources {
            if matches!(source, Source::Rng) {
                let devices = std::slice::from_ref(pjrt_device);
                let states = upload_rng_state(client, pjrt_client, devices).map_err(run_error)?;
                rng_states.extend(states);
            }
        }
        // Weights whose device copy was given up for a permuted one, where this program takes
        // them as they are (another program's permuted kernel).
        client.restore(program.sources.iter().filter_map(|source| match source {
            Source::Captured(id) => Some(*id),
            _ => None,
        }));
        let results = client.with_buffers(|buffers| {
            let mut rng_states = rng_states.iter();
            let mut args = Vec::with_capacity(program.sources.len());
            for source in &program.sources {
                let buffer = match source {
                    Source::Input(k) if copies.contains_key(k) => &copies[k],
                    Source::Input(k) => buffers.get(&inputs[*k].id).ok_or_else(|| {
                        format!(
                            "input {k} (tensor {}) is not on the device (was it produced by an op that failed?)",
                            inputs[*k].id
                        )
                    })?,
                    Source::Captured(id) => buffers.get(id).ok_or_else(|| {
                        format!(
                            "tensor {id}, which the closure captured (a weight), is no longer on the device: keep the module the closure uses alive, or make a new compiled function after replacing it"
                        )
                    })?,
                    Source::Owned(buffer) => buffer,
                    Source::Shared(buffer) => buffer,
                    Source::Rng => rng_states
                        .next()
                        .ok_or_else(|| "a random state is missing (a bug)".to_string())?,
                };
                args.push(buffer);
            }
            if client.device_memory_is_host_heap() {
                wait_for_inputs(&program.sources, &args);
            }
            program
                .executable
                .execute(&args)
                .map_err(|e| format!("execution failed: {e}"))
        });
        let results = results.map_err(run_error)?;
        bind_results(client, outputs, results).map_err(run_error)
    }
}

/// Waits until the program's inputs (`args` of [`Source::Input`]) are computed, on XLA's CPU
/// plugin, before it runs. The plugin allocates a run's working memory (one block the size of
/// its buffer assignment's peak) when the run is dispatched, not when its inputs are ready: a
/// denoising loop dispatched each step's program while the last step's still ran, so two
/// blocks of the UNet's program were live at once, moving among three places in the heap. A
/// run whose inputs are ready starts at once, so nothing is lost but dispatching ahead. It
/// waits under the eager client's lock, as the hand-backs' waits for work in flight do (the
/// inputs' computations are already dispatched and need no lock to finish). A failed input is
/// left to the run to report.
fn wait_for_inputs(sources: &[Source], args: &[&Buffer]) {
    for (source, buffer) in sources.iter().zip(args) {
        if matches!(source, Source::Input(_)) {
            let _ = buffer.ready();
        }
    }
}

/// `scalar` (an op's scalar argument of type `ty`) as a rank-0 buffer on `device`.
pub(super) fn upload_scalar(
    (client, device): (&pjrt::Client, &pjrt::Device),
    scalar: burn_ir::ScalarIr,
    ty: &crate::lowering::TensorType,
) -> Result<Buffer, String> {
    let shape = pjrt::Shape::new(ty.elem, Vec::new());
    client
        .buffer_from_host(&crate::host::scalar_bytes(scalar, ty.elem), &shape, device)
        .map_err(|e| format!("uploading a scalar failed: {e}"))
}

/// One fresh random state (`[seed, draw]` from the device's counter),
/// uploaded to each of `devices`.
pub(super) fn upload_rng_state(
    client: &PjrtClient,
    pjrt_client: &pjrt::Client,
    devices: &[pjrt::Device],
) -> Result<Vec<Buffer>, String> {
    let bytes: Vec<u8> = client
        .next_rng_state()
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect();
    let shape = pjrt::Shape::new(ElementType::U64, vec![2]);
    devices
        .iter()
        .map(|d| pjrt_client.buffer_from_host(&bytes, &shape, d))
        .collect::<pjrt::Result<Vec<_>>>()
        .map_err(|e| format!("uploading a random state failed: {e}"))
}

/// Binds a program's `results` to the tensors `outputs` in the eager client.
pub(super) fn bind_results(
    client: &PjrtClient,
    outputs: &[TensorId],
    results: Vec<Buffer>,
) -> Result<(), String> {
    if results.len() != outputs.len() {
        return Err(format!(
            "the program returned {} outputs, expected {}",
            results.len(),
            outputs.len()
        ));
    }
    client.with_buffers(|buffers| {
        for (id, buffer) in outputs.iter().zip(results) {
            buffers.insert(*id, buffer);
        }
    });
    Ok(())
}
