//! The recording of a compiled function's trace: while a thread traces for a
//! device, the eager client hands each op it is given to [`intercept`], which
//! keeps it instead of running it. Per thread, so other threads and devices
//! stay eager. Compiled mode starts and ends recordings; eager mode only asks.
//! Kept by thread id in process-wide state, not in a `thread_local`: see [`crate::process`].

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::thread::ThreadId;

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
    /// Tensors produced by recorded ops and then dropped or consumed by a later one: no
    /// handle refers to them any more.
    gone: HashSet<TensorId>,
}

impl Recording {
    /// An empty recording of the ops on `device`.
    pub(crate) fn new(device: OxiDevice) -> Self {
        Self {
            device,
            ops: Vec::new(),
            produced: HashSet::new(),
            released: Vec::new(),
            gone: HashSet::new(),
        }
    }

    pub(crate) fn record(&mut self, op: OperationIr) {
        match &op {
            OperationIr::Init(_) => return,
            OperationIr::Drop(tensor) => {
                if self.produced.contains(&tensor.id) {
                    self.gone.insert(tensor.id);
                } else {
                    self.released.push(tensor.id);
                }
                return;
            }
            _ => {}
        }
        for input in op.inputs() {
            if input.status == TensorStatus::ReadWrite {
                if self.produced.contains(&input.id) {
                    self.gone.insert(input.id);
                } else {
                    self.released.push(input.id);
                }
            }
        }
        for output in op.outputs() {
            self.produced.insert(output.id);
        }
        self.ops.push(op);
    }

    /// The tensors the recorded ops produced that a handle still refers to (the trace's
    /// results, and whatever the traced code kept, such as a scheduler's history), in the
    /// order they were produced.
    pub(crate) fn live(&self) -> Vec<burn_ir::TensorIr> {
        let mut seen = HashSet::new();
        self.ops
            .iter()
            .flat_map(|op| op.outputs())
            .filter(|t| !self.gone.contains(&t.id) && seen.insert(t.id))
            .cloned()
            .collect()
    }

    /// The tensors the recorded ops produced that no handle refers to any more.
    pub(crate) fn gone(&self) -> impl Iterator<Item = &TensorId> {
        self.gone.iter()
    }
}

/// The recordings in progress, by thread, once per process ([`crate::process`]): the code
/// that starts a trace and the eager client that hands it ops may be different copies of this
/// crate (evcxr cells).
#[derive(Default)]
struct Recordings {
    /// How many threads are recording: eager ops skip the lock while none is.
    active: AtomicUsize,
    by_thread: Mutex<HashMap<ThreadId, Recording>>,
}

fn recordings() -> &'static Recordings {
    static RECORDINGS: OnceLock<&'static Recordings> = OnceLock::new();
    RECORDINGS.get_or_init(|| crate::process::shared(Recordings::default))
}

/// Runs `f` on this thread's recording, if it has one.
fn with_mine<R>(f: impl FnOnce(&mut Recording) -> R) -> Option<R> {
    let recordings = recordings();
    if recordings.active.load(Ordering::Acquire) == 0 {
        return None;
    }
    let mut by_thread = recordings
        .by_thread
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    by_thread.get_mut(&std::thread::current().id()).map(f)
}

/// Records `op` if this thread is tracing for the device `device()` names;
/// otherwise gives it back to run eagerly.
pub(crate) fn intercept(
    op: OperationIr,
    device: impl FnOnce() -> OxiDevice,
) -> Option<OperationIr> {
    let mut op = Some(op);
    with_mine(|recording| {
        if recording.device == device() {
            if let Some(op) = op.take() {
                recording.record(op);
            }
        }
    });
    op
}

/// Whether this thread is tracing for `device`.
pub(crate) fn is_tracing(device: &OxiDevice) -> bool {
    with_mine(|recording| &recording.device == device).unwrap_or(false)
}

pub(crate) fn tracing_any() -> bool {
    with_mine(|_| ()).is_some()
}

/// Starts recording this thread's ops on `device`.
pub(crate) fn start(device: OxiDevice) {
    let recordings = recordings();
    let mut by_thread = recordings
        .by_thread
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let recording = Recording::new(device);
    if by_thread
        .insert(std::thread::current().id(), recording)
        .is_none()
    {
        recordings.active.fetch_add(1, Ordering::Release);
    }
}

/// Ends this thread's recording and returns it (`None` when there is none).
pub(crate) fn take() -> Option<Recording> {
    let recordings = recordings();
    let mut by_thread = recordings
        .by_thread
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let taken = by_thread.remove(&std::thread::current().id());
    if taken.is_some() {
        recordings.active.fetch_sub(1, Ordering::Release);
    }
    taken
}
