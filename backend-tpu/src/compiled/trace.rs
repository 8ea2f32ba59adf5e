//! The trace phase: the closure runs once on the real inputs while the
//! thread records its ops ([`recording`]); the recording, the closure's
//! outputs and what it released are the trace. [`Signature`] keys it.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use burn_backend::DType;
use burn_ir::{TensorId, TensorIr};
use burn_router::RouterTensor;

use super::tensors::Tensors;
use super::CompiledFn;
use crate::channel::OxiClient;
use crate::device::OxiDevice;
use crate::eager::PjrtClient;
use crate::recording::{self, Recording};

/// One run of the closure under a recording.
pub(super) struct Trace {
    pub(super) recording: Recording,
    /// The closure's output tensors.
    pub(super) outputs: Vec<RouterTensor<OxiClient>>,
    /// Tensors from outside the trace that it dropped or consumed: freed (or
    /// kept by the program) once it has run.
    pub(super) released: HashSet<TensorId>,
    /// Running the closure.
    pub(super) took: Duration,
}

impl<I: Tensors, O: Tensors, F: Fn(I) -> O> CompiledFn<I, O, F> {
    /// Runs the closure on `tensors` (on `device`) while recording its ops.
    pub(super) fn trace(
        &self,
        client: &PjrtClient,
        device: &OxiDevice,
        tensors: Vec<RouterTensor<OxiClient>>,
    ) -> Trace {
        let started = Instant::now();
        let guard = TraceGuard::start(device.clone(), client.clone());
        let outputs = (self.f)(I::unflatten(&mut tensors.into_iter()));
        let mut out_tensors = Vec::new();
        outputs.flatten(&mut out_tensors);
        let recording = guard.finish();
        let took = started.elapsed();
        let released = recording.released.iter().copied().collect();
        Trace {
            recording,
            outputs: out_tensors,
            released,
            took,
        }
    }
}

/// Ends the recording when dropped; if the trace did not finish (the closure
/// panicked), frees what it released.
pub(super) struct TraceGuard {
    client: PjrtClient,
    finished: bool,
}

impl TraceGuard {
    pub(super) fn start(device: OxiDevice, client: PjrtClient) -> Self {
        recording::start(device);
        Self {
            client,
            finished: false,
        }
    }

    pub(super) fn finish(mut self) -> Recording {
        self.finished = true;
        recording::take().expect("the recording was started by this guard")
    }
}

impl Drop for TraceGuard {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        if let Some(recording) = recording::take() {
            self.client.with_buffers(|buffers| {
                for id in &recording.released {
                    buffers.remove(id);
                }
            });
        }
    }
}

/// The cache key: device, input shapes and dtypes, and which inputs are the
/// same tensor (index of the first input with the same id).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) struct Signature {
    device: OxiDevice,
    inputs: Vec<(Vec<usize>, DType)>,
    pub(super) aliases: Vec<usize>,
}

impl Signature {
    pub(super) fn of(device: &OxiDevice, inputs: &[TensorIr]) -> Self {
        let aliases = inputs
            .iter()
            .map(|t| {
                inputs
                    .iter()
                    .position(|u| u.id == t.id)
                    .expect("the tensor itself is in the list")
            })
            .collect();
        Self {
            device: device.clone(),
            inputs: inputs.iter().map(|t| (t.shape.to_vec(), t.dtype)).collect(),
            aliases,
        }
    }

    pub(super) fn describe(&self) -> String {
        let inputs = self
            .inputs
            .iter()
            .map(|(dims, dtype)| format!("{dtype:?}{dims:?}"))
            .collect::<Vec<_>>()
            .join(", ");
        format!("({inputs}) on {}", self.device)
    }
}
