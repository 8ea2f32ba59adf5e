//! The recording of a compiled function's trace: while a thread traces for a
//! device, the eager client hands each op it is given to [`intercept`], which
//! keeps it instead of running it. Thread-local, so other threads and devices
//! stay eager. Compiled mode starts and ends recordings; eager mode only asks.

use std::cell::RefCell;
use std::collections::HashSet;

use burn_ir::{OperationIr, TensorId, TensorStatus};

use crate::device::OxiDevice;

/// The ops one thread issued on one device while tracing.
pub(crate) struct Recording {
    device: OxiDevice,
    pub(crate) ops: Vec<OperationIr>,
    /// Tensors produced by recorded ops.
    produced: HashSet<TensorId>,
    /// Tensors from outside the trace that were dropped or consumed in it:
    /// freed (or kept by the program) once it has run.
    pub(crate) released: Vec<TensorId>,
}

impl Recording {
    fn record(&mut self, op: OperationIr) {
        match &op {
            OperationIr::Init(_) => return,
            OperationIr::Drop(tensor) => {
                if !self.produced.contains(&tensor.id) {
                    self.released.push(tensor.id);
                }
                return;
            }
            _ => {}
        }
        for input in op.inputs() {
            if input.status == TensorStatus::ReadWrite && !self.produced.contains(&input.id) {
                self.released.push(input.id);
            }
        }
        for output in op.outputs() {
            self.produced.insert(output.id);
        }
        self.ops.push(op);
    }
}

thread_local! {
    static RECORDING: RefCell<Option<Recording>> = const { RefCell::new(None) };
}

/// Records `op` if this thread is tracing for the device `device()` names;
/// otherwise gives it back to run eagerly.
pub(crate) fn intercept(
    op: OperationIr,
    device: impl FnOnce() -> OxiDevice,
) -> Option<OperationIr> {
    let mut op = Some(op);
    let _ = RECORDING.try_with(|cell| {
        if let Some(recording) = cell.borrow_mut().as_mut() {
            if recording.device == device() {
                if let Some(op) = op.take() {
                    recording.record(op);
                }
            }
        }
    });
    op
}

/// Whether this thread is tracing for `device`.
pub(crate) fn is_tracing(device: &OxiDevice) -> bool {
    RECORDING
        .try_with(|cell| cell.borrow().as_ref().is_some_and(|r| &r.device == device))
        .unwrap_or(false)
}

pub(crate) fn tracing_any() -> bool {
    RECORDING
        .try_with(|cell| cell.borrow().is_some())
        .unwrap_or(false)
}

/// Starts recording this thread's ops on `device`.
pub(crate) fn start(device: OxiDevice) {
    RECORDING.with(|cell| {
        *cell.borrow_mut() = Some(Recording {
            device,
            ops: Vec::new(),
            produced: HashSet::new(),
            released: Vec::new(),
        })
    });
}

/// Ends this thread's recording and returns it (`None` when there is none).
pub(crate) fn take() -> Option<Recording> {
    RECORDING
        .try_with(|cell| cell.borrow_mut().take())
        .ok()
        .flatten()
}
