//! Eager mode on a PJRT device: every op Burn registers is lowered on its own
//! ([`lowering::lower_op`]), compiled once per module text (which encodes
//! the op's structure, shapes and dtypes but no scalar), and executed at
//! once on the device's buffers. With a compile cache folder
//! ([`COMPILE_CACHE_ENV`](crate::compile_cache::COMPILE_CACHE_ENV)) each op's
//! executable is also kept on disk, so a later process loads it instead of
//! compiling it again.
//!
//! # Errors
//! `RunnerClient` methods cannot return errors, so a failing op (not
//! lowered, failed to compile or run, an input that is missing because an
//! earlier op failed) is recorded: its outputs stay unbound, later ops that
//! need them are skipped, and the first recorded error is returned by the
//! next read of a tensor and by `sync` (Burn's `into_data` then panics with
//! it, naming the op). Nothing panics inside `register_op`, which also runs
//! from `Drop`.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use burn_backend::{DType, DTypeUsage, DTypeUsageSet, ExecutionError, TensorData};
use burn_ir::{BaseOperationIr, ModuleOperationIr, OperationIr, TensorId, TensorIr, TensorStatus};

use crate::compile_cache::{self, disk_key, entry_path, load_executable, store_executable};
use crate::device::{OxiDevice, PjrtPlatform};
use crate::host::{dims_i64, read_buffer, scalar_bytes};
use crate::lowering::{self, element_type, Argument, LoweredFunction};
use crate::pjrt::{self, Buffer, Client, CompileOptions, Device, ElementType, LoadedExecutable};
pub use crate::platform::{shared_client, XLA_CPU_DEVICES_ENV};
use crate::recording;
use crate::staging::StagedTensor;

/// At most this many scalar buffers are kept per device.
const SCALAR_CACHE_SIZE: usize = 4096;

/// The eager client of one PJRT device. Cheap to clone.
#[derive(Clone)]
pub struct PjrtClient {
    inner: Arc<Inner>,
}

struct Inner {
    platform: PjrtPlatform,
    index: usize,
    /// The device, or why there is none.
    target: std::result::Result<(Client, Device), String>,
    /// Where op executables are kept between processes, if anywhere: the compile cache's
    /// `eager/` folder, beside compiled mode's programs.
    disk_cache: Option<PathBuf>,
    state: Mutex<State>,
    next_id: AtomicU64,
}

#[derive(Default)]
struct State {
    buffers: HashMap<TensorId, Buffer>,
    /// Tensors kept on the host until first needed ([`PjrtClient::stage_uploads`]).
    staged: HashMap<TensorId, StagedTensor>,
    /// The stored bytes of uploaded tensors that came from a memory-mapped file (the
    /// checkpoint's own bytes, no copy), or are a transpose of such a tensor (the same bytes
    /// read through the permutation), so a tensor whose device copy was given up
    /// ([`PjrtClient::upload_permuted`], [`PjrtClient::release`]) is uploaded again when
    /// something needs it.
    mapped: HashMap<TensorId, StagedTensor>,
    /// Those of `mapped` whose device copy was given up: an op or read that needs one uploads
    /// it again first (nothing to check while this is empty, as in eager mode).
    released: HashSet<TensorId>,
    /// Embedding tables looked up on the host ([`PjrtClient::embed_from_file`]).
    tables_on_host: HashSet<TensorId>,
    /// Set by a release on XLA's CPU plugin ([`PjrtClient::release`]): for how many of the
    /// compiled programs run next the host heap's free memory is handed back first, once the
    /// work in flight is done (two). A buffer a computation still read when it was released
    /// is freed only once that computation's run ends, which can come after its outputs are
    /// ready and the next program starts; by the second program, the first has been waited for.
    /// (Eager ops come too soon after: the ops right after a text encode.) ...
    trims_before_programs: u8,
    /// ... and before the first released tensor is uploaded again, so that the upload does not
    /// come on top of what computations freed meanwhile.
    trim_before_restore: bool,
    /// Open [`StagingGuard`]s: while any is, new tensors are staged instead of uploaded.
    staging: usize,
    /// Rank-0 buffers of scalar arguments, by element type and bytes.
    scalars: HashMap<(ElementType, Vec<u8>), Buffer>,
    executables: HashMap<String, Arc<LoadedExecutable>>,
    /// The first error since the last read or sync.
    error: Option<String>,
    /// Random state: seed and a counter of random ops.
    seed: u64,
    draws: u64,
    stats: Stats,
    /// A failure to report instead of running an op (see [`PjrtClient::inject_fault`]).
    fault: Option<InjectedFault>,
    /// Whether the disk cache's trouble was already reported (once per device).
    disk_cache_warned: bool,
}

impl State {
    /// Records `result`'s error unless an earlier one is pending (the first is reported).
    fn keep_first_error(&mut self, result: OpResult<()>) {
        if let Err(e) = result {
            self.error.get_or_insert(e);
        }
    }
}

/// A device fault scheduled by a test: op number `after` (counted from the call) fails.
struct InjectedFault {
    after: u64,
    message: String,
}

/// Counters of what eager mode did, for benchmarks and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Ops executed.
    pub executed: u64,
    /// Executables compiled (in neither cache).
    pub compiled: u64,
    /// Executables loaded from the disk cache instead of compiled.
    pub disk_loads: u64,
    /// Disk cache entries refused (damaged, or not loadable by this plugin) and compiled again.
    pub disk_rejects: u64,
    /// Live device buffers.
    pub buffers: usize,
    /// Tensors staged on the host, not yet on the device.
    pub staged: usize,
    /// Bytes copied from the host to this device (tensors registered, staged tensors
    /// uploaded, released ones uploaded again; not the shards
    /// [`SpmdPlacement`](crate::spmd::SpmdPlacement) places).
    pub uploaded_bytes: u64,
    /// Bytes of device copies given up ([`PjrtClient::release`]).
    pub released_bytes: u64,
    /// Times the host heap's free memory was handed back to the kernel (XLA's CPU plugin: at
    /// a release, after it, when an embedding table leaves the device for the host, and
    /// [`PjrtClient::return_free_host_memory`]).
    pub host_heap_returns: u64,
    /// Embedding lookups done on the host, in a table read from a mapped file.
    pub host_lookups: u64,
}

type OpResult<T> = std::result::Result<T, String>;

impl PjrtClient {
    /// The client of device `index` of `platform`. A device that does not
    /// exist gives a client whose every op fails with the reason.
    pub fn new(platform: PjrtPlatform, index: usize) -> Self {
        let device = OxiDevice::Pjrt {
            platform: platform.clone(),
            index,
        };
        let target = shared_client(&platform)
            .map_err(|e| format!("device {device}: {e}"))
            .and_then(|client| match client.device(index) {
                Ok(d) => Ok((client, d)),
                Err(_) => Err(format!(
                    "device {device} does not exist: this machine has {} {platform} device(s)",
                    client.device_count()
                )),
            });
        Self {
            inner: Arc::new(Inner {
                platform,
                index,
                target,
                disk_cache: compile_cache::dir_from_env().map(|dir| dir.join("eager")),
                state: Mutex::new(State::default()),
                next_id: AtomicU64::new(0),
            }),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The device.
    pub fn device(&self) -> OxiDevice {
        OxiDevice::Pjrt {
            platform: self.inner.platform.clone(),
            index: self.inner.index,
        }
    }

    /// Devices of this device's platform (0 when the plugin has none).
    pub fn platform_device_count(&self) -> usize {
        self.target().map_or(0, |(client, _)| client.device_count())
    }

    /// What eager mode did so far on this device.
    pub fn stats(&self) -> Stats {
        let state = self.state();
        Stats {
            buffers: state.buffers.len(),
            staged: state.staged.len(),
            ..state.stats
        }
    }

    /// Stages the tensors registered on this device from now until the guard drops: they stay
    /// on the host, in the loader's bytes (the mapped checkpoint's), and their transposes are
    /// recorded as views, until something needs them on the device, when each is uploaded
    /// once. Tensor parallelism places staged weights as shards cut straight from those bytes
    /// ([`SpmdPlacement::new`](crate::spmd::SpmdPlacement::new)), so the first device never
    /// holds a split weight whole. [`upload_staged`](Self::upload_staged) uploads what is left.
    pub fn stage_uploads(&self) -> StagingGuard {
        self.state().staging += 1;
        StagingGuard {
            client: self.clone(),
        }
    }

    /// Uploads every staged tensor now (freeing the host bytes they held); returns the
    /// first upload error, if any.
    pub fn upload_staged(&self) -> Result<(), String> {
        let mut state = self.state();
        self.upload_all_staged(&mut state)
    }

    fn upload_all_staged(&self, state: &mut State) -> Result<(), String> {
        let ids: Vec<TensorId> = state.staged.keys().copied().collect();
        let mut first = Ok(());
        for id in ids {
            if let Err(e) = self.upload_staged_one(state, id) {
                first = first.and(Err(e));
            }
        }
        first
    }

    /// Moves staged tensor `id` (if it is one) to the device.
    fn upload_staged_one(&self, state: &mut State, id: TensorId) -> Result<(), String> {
        let Some(staged) = state.staged.remove(&id) else {
            return Ok(());
        };
        let (buffer, bytes) = self.copy_to_device(&staged)?;
        state.stats.uploaded_bytes += bytes as u64;
        state.buffers.insert(id, buffer);
        if staged.is_mapped() {
            state.mapped.insert(id, staged);
        }
        Ok(())
    }

    /// Tensor `id` permuted by `permutation` (`stablehlo.transpose`'s), uploaded straight from
    /// its stored bytes when they are a mapped file's, its device copy in its own layout given
    /// up first, so the device never holds both (it is uploaded again, [`restore`](Self::restore),
    /// when something needs it in its own layout: eager ops and reads do so on their own);
    /// `None` when the tensor has no such bytes.
    pub(crate) fn upload_permuted(
        &self,
        id: TensorId,
        permutation: &[usize],
    ) -> Option<Result<Buffer, String>> {
        let mut state = self.state();
        let stored = state.mapped.get(&id)?.permuted(permutation)?;
        state.buffers.remove(&id);
        state.released.insert(id);
        Some(self.copy_to_device(&stored).map(|(buffer, bytes)| {
            state.stats.uploaded_bytes += bytes as u64;
            buffer
        }))
    }

    /// Gives up the device copies of those of `ids` whose bytes are a memory-mapped file's (a
    /// checkpoint's weights, or a transpose of one): their device memory is freed now, and the
    /// next op, program or read that needs one uploads it again from the file
    /// ([`restore`](Self::restore)). Other tensors stay. Returns the bytes given up.
    ///
    /// On XLA's CPU plugin the device memory is the process's heap, which the binaries keep
    /// once freed (the `oxidiff` binaries' `tune_allocator`); there the freed memory is also
    /// handed back to the kernel: now, before each of the next two compiled programs (a buffer
    /// a computation still reads is freed when its run ends), and before the first of them is
    /// uploaded again.
    pub fn release(&self, ids: impl IntoIterator<Item = TensorId>) -> usize {
        let mut state = self.state();
        let host_heap = self.device_memory_is_host_heap();
        if host_heap {
            Self::wait_for_work_in_flight(&state);
        }
        let mut bytes = 0;
        for id in ids {
            let Some(stored) = state.mapped.get(&id) else {
                continue;
            };
            let size = stored.byte_size();
            if state.buffers.remove(&id).is_some() {
                state.released.insert(id);
                bytes += size;
            }
        }
        state.stats.released_bytes += bytes as u64;
        if bytes > 0 && host_heap {
            state.trims_before_programs = 2;
            state.trim_before_restore = true;
            state.stats.host_heap_returns += 1;
            drop(state);
            crate::host::return_free_heap();
        }
        bytes
    }

    /// Whether this device's memory is the process's heap (XLA's CPU plugin).
    pub fn device_memory_is_host_heap(&self) -> bool {
        self.inner.platform == PjrtPlatform::XlaCpu
    }

    /// On XLA's CPU plugin, hands the free memory of the process's heap (the device memory
    /// computations freed, which the binaries keep: `tune_allocator`) back to the kernel once
    /// the work in flight is done; nothing elsewhere. A pipeline handing components back
    /// between requests calls it between components, so that the next one's memory does not
    /// come on top of what the last one freed.
    pub fn return_free_host_memory(&self) {
        if !self.device_memory_is_host_heap() {
            return;
        }
        Self::return_free_heap_when_idle(&mut self.state());
    }

    /// Waits until every buffer is computed: a buffer dropped while a computation reads it is
    /// freed when that computation ends, so then the memory it held is free. (A failure here
    /// is reported by the next read of the failed computation's output.)
    fn wait_for_work_in_flight(state: &State) {
        for buffer in state.buffers.values() {
            let _ = buffer.ready();
        }
    }

    /// Hands the host heap's free memory back once the work in flight is done.
    fn return_free_heap_when_idle(state: &mut State) {
        Self::wait_for_work_in_flight(state);
        state.stats.host_heap_returns += 1;
        crate::host::return_free_heap();
    }

    /// Uploads again those of `ids` whose device copy was given up
    /// ([`upload_permuted`](Self::upload_permuted)); a failed upload is recorded as a failed
    /// op's error is.
    pub(crate) fn restore(&self, ids: impl IntoIterator<Item = TensorId>) {
        let mut state = self.state();
        if state.released.is_empty() {
            return;
        }
        if state.trims_before_programs > 0 {
            state.trims_before_programs -= 1;
            Self::return_free_heap_when_idle(&mut state);
        }
        for id in ids {
            let restored = self.restore_one(&mut state, id);
            state.keep_first_error(restored);
        }
    }

    /// [`restore`](Self::restore) for one tensor, under the state's lock.
    fn restore_one(&self, state: &mut State, id: TensorId) -> Result<(), String> {
        if !state.released.contains(&id) || !state.mapped.contains_key(&id) {
            return Ok(());
        }
        if std::mem::take(&mut state.trim_before_restore) {
            Self::return_free_heap_when_idle(state);
        }
        let Some(stored) = state.mapped.get(&id) else {
            return Ok(());
        };
        let (buffer, bytes) = self.copy_to_device(stored)?;
        state.stats.uploaded_bytes += bytes as u64;
        state.buffers.insert(id, buffer);
        state.released.remove(&id);
        Ok(())
    }

    /// Copies `stored` (dense, or the strided view it records) to this client's device and
    /// hands its mapped pages back once there; returns the buffer and the bytes copied.
    fn copy_to_device(&self, stored: &StagedTensor) -> Result<(Buffer, usize), String> {
        let (client, device) = self.target()?;
        let copied = stored
            .upload(client, device, None)
            .map_err(|e| format!("copying a tensor to {} failed: {e}", self.device()))?;
        stored.release_mapped_pages();
        Ok(copied)
    }

    /// Staged tensor `id`, removed from this client (placed elsewhere by the caller).
    pub(crate) fn take_staged(&self, id: TensorId) -> Option<StagedTensor> {
        self.state().staged.remove(&id)
    }

    /// Device buffer `id`, removed from this client (placed elsewhere by the caller); staged
    /// tensors stay staged.
    pub(crate) fn take_buffer(&self, id: TensorId) -> Option<Buffer> {
        let mut state = self.state();
        let restored = self.restore_one(&mut state, id);
        state.keep_first_error(restored);
        state.mapped.remove(&id);
        state.released.remove(&id);
        state.buffers.remove(&id)
    }

    /// Test hook for error handling: the `after`-th op executed from now on this device fails
    /// with `message`, the way a PJRT error mid-run does (out of device memory, a plugin
    /// fault): the op's outputs are never made, later ops that need them are skipped, and the
    /// next read or sync returns the error. Only eager ops count (compiled programs do not).
    pub fn inject_fault(&self, after: u64, message: impl Into<String>) {
        self.state().fault = Some(InjectedFault {
            after: after.max(1),
            message: message.into(),
        });
    }

    pub fn create_empty_handle(&self) -> TensorId {
        TensorId::new(self.inner.next_id.fetch_add(1, Ordering::Relaxed))
    }

    pub fn seed(&self, seed: u64) {
        let mut state = self.state();
        state.seed = seed;
        state.draws = 0;
    }

    pub fn dtype_usage(&self, dtype: DType) -> DTypeUsageSet {
        match element_type(dtype) {
            Some(ElementType::F64) if self.inner.platform == PjrtPlatform::Tpu => {
                DTypeUsageSet::empty()
            }
            Some(_) => DTypeUsage::Storage | DTypeUsage::Arithmetic,
            None => DTypeUsageSet::empty(),
        }
    }

    /// Executes `op` now, recording any failure (module docs).
    pub fn register_op(&self, op: OperationIr) {
        // While this thread traces a compiled function for this device, the
        // op is recorded instead (see [`recording`]).
        let Some(op) = recording::intercept(op, || self.device()) else {
            return;
        };
        let mut state = self.state();
        if self.view_of_staged(&mut state, &op) {
            return;
        }
        match &op {
            OperationIr::Init(_) => {}
            OperationIr::Drop(tensor) => {
                state.buffers.remove(&tensor.id);
                state.staged.remove(&tensor.id);
                state.mapped.remove(&tensor.id);
                state.released.remove(&tensor.id);
                state.tables_on_host.remove(&tensor.id);
            }
            _ => {
                if !state.staged.is_empty() {
                    for input in op.inputs() {
                        let uploaded = self.upload_staged_one(&mut state, input.id);
                        state.keep_first_error(uploaded);
                    }
                }
                let executed = match self.embed_from_file(&mut state, &op) {
                    Some(looked_up) => looked_up,
                    None => {
                        if !state.released.is_empty() {
                            for input in op.inputs() {
                                let restored = self.restore_one(&mut state, input.id);
                                state.keep_first_error(restored);
                            }
                        }
                        self.execute(&mut state, &op)
                    }
                };
                if executed.is_ok() {
                    Self::map_view(&mut state, &op);
                }
                state.keep_first_error(executed);
                // Inputs consumed by the op (no `Drop` will come for them).
                for input in op.inputs() {
                    if input.status == TensorStatus::ReadWrite {
                        state.buffers.remove(&input.id);
                        state.mapped.remove(&input.id);
                        state.released.remove(&input.id);
                    }
                }
            }
        }
    }

    /// An embedding lookup in a table read from a memory-mapped file, done on the host: the
    /// rows the indices name are read from the file and only they are uploaded. A text
    /// encoder's token table (152 MB for CLIP-L, 526 MB for T5-XXL in f32) serves a few dozen
    /// rows a prompt, so at its first lookup its device copy is given up (on XLA's CPU plugin
    /// the heap's free memory is then handed back, as at a [`release`](Self::release)), and
    /// the table stays in the file from then on. A table something else uploads again
    /// afterwards stays on the device and is looked up there. `None` for any other op (or a
    /// table this cannot read), which then runs as usual.
    fn embed_from_file(&self, state: &mut State, op: &OperationIr) -> Option<OpResult<()>> {
        // Burn's `embedding` reaches the router as a select of rows.
        let (weights, indices, out) = match op {
            OperationIr::Module(ModuleOperationIr::Embedding(e)) => {
                (&e.weights, &e.indices, &e.out)
            }
            OperationIr::BaseFloat(BaseOperationIr::Select(s)) if s.dim == 0 => {
                (&s.tensor, &s.indices, &s.out)
            }
            _ => return None,
        };
        let on_device = state.buffers.contains_key(&weights.id);
        if on_device && state.tables_on_host.contains(&weights.id) {
            return None;
        }
        let table = state.mapped.get(&weights.id)?;
        let ids = state.buffers.get(&indices.id)?;
        let ids = read_buffer(ids, indices.shape.clone(), indices.dtype).ok()?;
        let rows: Vec<usize> = ids
            .iter::<i64>()
            .map(|i| usize::try_from(i).ok())
            .collect::<Option<_>>()?;
        let bytes = table.rows(rows)?;
        let shape = pjrt::Shape::new(table.element(), dims_i64(&out.shape));
        let (client, device) = match self.target() {
            Ok(target) => target,
            Err(e) => return Some(Err(e)),
        };
        Some(match client.buffer_from_host(&bytes, &shape, device) {
            Ok(buffer) => {
                state.stats.executed += 1;
                state.stats.host_lookups += 1;
                state.stats.uploaded_bytes += bytes.len() as u64;
                state.buffers.insert(out.id, buffer);
                if state.tables_on_host.insert(weights.id) && on_device {
                    state.buffers.remove(&weights.id);
                    state.released.insert(weights.id);
                    if self.device_memory_is_host_heap() {
                        Self::return_free_heap_when_idle(state);
                    }
                }
                Ok(())
            }
            Err(err) => Err(format!(
                "uploading an embedding lookup to {} failed: {err}",
                self.device()
            )),
        })
    }

    /// Records the mapped bytes of a transpose or permutation just run on a tensor that has
    /// them (how `Linear` holds its checkpoint's `[out, in]` weight as `[in, out]`): the same
    /// bytes read through the permutation, so its device copy too can be given up and uploaded
    /// again from the file.
    fn map_view(state: &mut State, op: &OperationIr) {
        if let Some((_, out, view)) = reordered(op, &state.mapped) {
            state.mapped.insert(out.id, view);
        }
    }

    /// Records a transpose or permutation of a staged tensor as a staged view instead of
    /// running it; `false` for any other op.
    fn view_of_staged(&self, state: &mut State, op: &OperationIr) -> bool {
        let Some((input, out, view)) = reordered(op, &state.staged) else {
            return false;
        };
        if input.status == TensorStatus::ReadWrite {
            state.staged.remove(&input.id);
        }
        state.staged.insert(out.id, view);
        true
    }

    pub(crate) fn target(&self) -> OpResult<&(Client, Device)> {
        self.inner.target.as_ref().map_err(Clone::clone)
    }

    fn execute(&self, state: &mut State, op: &OperationIr) -> OpResult<()> {
        // The op's name only for errors (formatting it costs microseconds).
        let name = || lowering::op_name(op);
        let (client, device) = self.target()?;
        // Skip ops whose inputs are gone because an earlier op failed.
        for input in op.inputs() {
            if !state.buffers.contains_key(&input.id) {
                return Err(state.error.clone().unwrap_or_else(|| {
                    format!(
                        "op {} on {}: input tensor {} is not on the device",
                        name(),
                        self.device(),
                        input.id
                    )
                }));
            }
        }
        if let Some(fault) = &mut state.fault {
            fault.after -= 1;
            if fault.after == 0 {
                let message = state.fault.take().map(|f| f.message).unwrap_or_default();
                return Err(format!(
                    "op {} on {}: execution failed: {message}",
                    name(),
                    self.device()
                ));
            }
        }
        let function = lowering::lower_op(op).map_err(|e| format!("on {}: {e}", self.device()))?;
        let executable = match state.executables.get(&function.module) {
            Some(exe) => exe.clone(),
            None => {
                let exe = Arc::new(self.load_or_compile(state, (client, device), &function, op)?);
                state
                    .executables
                    .insert(function.module.clone(), exe.clone());
                exe
            }
        };
        let outputs = self.run(state, &executable, &function, op)?;
        for ((id, _), buffer) in function.results.iter().zip(outputs) {
            state.buffers.insert(*id, buffer);
        }
        state.stats.executed += 1;
        Ok(())
    }

    /// The executable of `function`: from the disk cache when an earlier process stored it,
    /// else compiled (and stored). A damaged entry or an unwritable folder is reported once per
    /// device and costs only a compile.
    fn load_or_compile(
        &self,
        state: &mut State,
        (client, device): (&Client, &Device),
        function: &LoweredFunction,
        op: &OperationIr,
    ) -> OpResult<LoadedExecutable> {
        let module = &function.module;
        let disk = self.inner.disk_cache.as_ref().map(|dir| {
            let key = disk_key(module, client, device.id());
            (entry_path(dir, &key), key)
        });
        if let Some((path, key)) = &disk {
            let started = std::time::Instant::now();
            match load_executable(path, key, client, function.results.len()) {
                Ok(Some(exe)) => {
                    state.stats.disk_loads += 1;
                    if compile_cache::log_compiles() {
                        eprintln!(
                            "oxidiff: eager op {} on {}: loaded from the disk cache in {:.1?}",
                            lowering::op_name(op),
                            self.device(),
                            started.elapsed()
                        );
                    }
                    return Ok(exe);
                }
                Ok(None) => {}
                Err(why) => {
                    let _ = std::fs::remove_file(path);
                    state.stats.disk_rejects += 1;
                    self.warn_once(
                        state,
                        format!(
                            "the cached executable {}: {why}; compiled again",
                            path.display()
                        ),
                    );
                }
            }
        }
        if compile_cache::log_compiles() {
            eprintln!(
                "oxidiff: eager op {} on {}: compiling (not cached in this process{})",
                lowering::op_name(op),
                self.device(),
                if disk.is_some() { " nor on disk" } else { "" }
            );
        }
        let options = CompileOptions::on_device(i64::from(device.id()));
        let exe = client.compile(module, &options).map_err(|e| {
            format!(
                "op {} on {}: compiling its StableHLO failed: {e}\n{module}",
                lowering::op_name(op),
                self.device(),
            )
        })?;
        state.stats.compiled += 1;
        if let Some((path, key)) = &disk {
            if let Err(e) = store_executable(path, key, &exe) {
                self.warn_once(
                    state,
                    format!(
                        "could not store {} ({e}); eager ops are compiled in every process",
                        path.display()
                    ),
                );
            }
        }
        Ok(exe)
    }

    /// One line on stderr about the compile cache, the first time only.
    fn warn_once(&self, state: &mut State, message: String) {
        if !std::mem::replace(&mut state.disk_cache_warned, true) {
            eprintln!(
                "oxidiff: warning: compile cache of {}: {message} (further cache warnings for this device are left out)",
                self.device()
            );
        }
    }

    /// Gathers the arguments (uploading scalars) and executes.
    fn run(
        &self,
        state: &mut State,
        executable: &LoadedExecutable,
        function: &LoweredFunction,
        op: &OperationIr,
    ) -> OpResult<Vec<Buffer>> {
        let name = || lowering::op_name(op);
        let (client, device) = self.target()?;
        // Scalars are small immutable buffers: keep them by value, so a
        // model's recurring constants (eps, scales) are uploaded once. The
        // random state changes every time and is uploaded fresh.
        let mut rng_states = Vec::new();
        let mut scalar_keys = Vec::new();
        for (argument, ty) in &function.arguments {
            let (bytes, cached) = match argument {
                Argument::Tensor(_) | Argument::Permuted { .. } => continue,
                Argument::Scalar(scalar) => (scalar_bytes(*scalar, ty.elem), true),
                Argument::RngState => {
                    state.draws += 1;
                    let words = [state.seed, state.draws];
                    (words.iter().flat_map(|w| w.to_le_bytes()).collect(), false)
                }
            };
            let key = (ty.elem, bytes);
            if cached && state.scalars.contains_key(&key) {
                scalar_keys.push(key);
                continue;
            }
            let shape = pjrt::Shape::new(ty.elem, dims_i64(&ty.dims));
            let buffer = client
                .buffer_from_host(&key.1, &shape, device)
                .map_err(|e| format!("op {}: uploading a scalar failed: {e}", name()))?;
            if cached {
                if state.scalars.len() >= SCALAR_CACHE_SIZE {
                    state.scalars.clear();
                }
                state.scalars.insert(key.clone(), buffer);
                scalar_keys.push(key);
            } else {
                rng_states.push(buffer);
            }
        }
        let mut scalars = scalar_keys.iter();
        let mut rng_states = rng_states.iter();
        let mut args = Vec::with_capacity(function.arguments.len());
        for (argument, _) in &function.arguments {
            let buffer = match argument {
                Argument::Tensor(id) => state.buffers.get(id),
                // Eager lowering keeps Burn's layouts.
                Argument::Permuted { .. } => None,
                Argument::Scalar(_) => scalars.next().and_then(|key| state.scalars.get(key)),
                Argument::RngState => rng_states.next(),
            };
            match buffer {
                Some(buffer) => args.push(buffer),
                None => {
                    return Err(format!(
                        "op {}: argument {argument:?} is not on the device",
                        name()
                    ))
                }
            }
        }
        let outputs = executable
            .execute(&args)
            .map_err(|e| format!("op {} on {}: execution failed: {e}", name(), self.device()))?;
        if outputs.len() != function.results.len() {
            return Err(format!(
                "op {}: the executable returned {} outputs, expected {}",
                name(),
                outputs.len(),
                function.results.len()
            ));
        }
        Ok(outputs)
    }

    /// Runs `f` on the device buffers by tensor id (compiled mode binds its
    /// inputs, captured weights and outputs through this).
    /// Staged tensors are uploaded first (an upload that fails leaves its tensor unbound and
    /// records the error, as a failed op does).
    pub(crate) fn with_buffers<R>(&self, f: impl FnOnce(&mut HashMap<TensorId, Buffer>) -> R) -> R {
        let mut state = self.state();
        if !state.staged.is_empty() {
            let uploaded = self.upload_all_staged(&mut state);
            state.keep_first_error(uploaded);
        }
        f(&mut state.buffers)
    }

    /// The next random state (`[seed, draw]`), as eager random ops draw it.
    pub(crate) fn next_rng_state(&self) -> [u64; 2] {
        let mut state = self.state();
        state.draws += 1;
        [state.seed, state.draws]
    }

    /// Copies host data to the device (or stages it, under [`stage_uploads`](Self::stage_uploads));
    /// returns the new tensor's IR.
    pub fn register_tensor_data_ir(&self, data: TensorData) -> TensorIr {
        let ir = TensorIr {
            id: self.create_empty_handle(),
            shape: data.shape.clone(),
            status: TensorStatus::ReadWrite,
            dtype: data.dtype,
        };
        let staged = match StagedTensor::from_data(data) {
            Ok(staged) => staged,
            Err(e) => {
                self.state().keep_first_error(Err(e));
                return ir;
            }
        };
        if self.state().staging > 0 {
            self.state().staged.insert(ir.id, staged);
            return ir;
        }
        // Copied outside the state's lock.
        let copied = self.copy_to_device(&staged);
        let mut state = self.state();
        match copied {
            Ok((buffer, bytes)) => {
                state.stats.uploaded_bytes += bytes as u64;
                state.buffers.insert(ir.id, buffer);
                if staged.is_mapped() {
                    state.mapped.insert(ir.id, staged);
                }
            }
            Err(e) => state.keep_first_error(Err(e)),
        }
        ir
    }

    /// Copies a tensor to the host; frees it when the read consumes it. The
    /// first recorded error, if any, is returned instead (and cleared).
    pub fn read_tensor(&self, tensor: TensorIr) -> Result<TensorData, ExecutionError> {
        if recording::is_tracing(&self.device()) {
            return Err(ExecutionError::WithContext {
                reason: format!(
                    "tensor {} on {} was read while tracing a compiled function: a compiled function cannot depend on tensor values on the host; compute it on the device or pass it as an input",
                    tensor.id,
                    self.device()
                ),
            });
        }
        let mut state = self.state();
        let uploaded = self.upload_staged_one(&mut state, tensor.id);
        state.keep_first_error(uploaded);
        let restored = self.restore_one(&mut state, tensor.id);
        state.keep_first_error(restored);
        if let Some(reason) = state.error.take() {
            return Err(ExecutionError::WithContext { reason });
        }
        let data = match state.buffers.get(&tensor.id) {
            Some(buffer) => {
                read_buffer(buffer, tensor.shape.clone(), tensor.dtype).map_err(|e| {
                    ExecutionError::WithContext {
                        reason: format!("reading a tensor from {} failed: {e}", self.device()),
                    }
                })?
            }
            None => {
                return Err(ExecutionError::WithContext {
                    reason: format!(
                        "tensor {} is not on {} (was it produced by an op that failed?)",
                        tensor.id,
                        self.device()
                    ),
                })
            }
        };
        if tensor.status == TensorStatus::ReadWrite {
            state.buffers.remove(&tensor.id);
            state.mapped.remove(&tensor.id);
            state.released.remove(&tensor.id);
        }
        Ok(data)
    }

    /// Waits for all work; returns (and clears) the first recorded error.
    pub fn sync(&self) -> Result<(), ExecutionError> {
        let mut state = self.state();
        if let Some(reason) = state.error.take() {
            return Err(ExecutionError::WithContext { reason });
        }
        for buffer in state.buffers.values() {
            buffer.ready().map_err(|e| ExecutionError::WithContext {
                reason: format!("a computation on {} failed: {e}", self.device()),
            })?;
        }
        Ok(())
    }
}

/// For a transpose or permutation of one of `tensors` (host bytes: staged or mapped), its input,
/// its output and the view of the input's bytes it makes; `None` for any other op.
fn reordered<'a>(
    op: &'a OperationIr,
    tensors: &HashMap<TensorId, StagedTensor>,
) -> Option<(&'a TensorIr, &'a TensorIr, StagedTensor)> {
    match op {
        OperationIr::BaseFloat(BaseOperationIr::SwapDims(o)) => {
            let view = tensors.get(&o.input.id)?.swapped(o.dim1, o.dim2)?;
            Some((&o.input, &o.out, view))
        }
        OperationIr::BaseFloat(BaseOperationIr::Permute(o)) => {
            let view = tensors.get(&o.input.id)?.permuted(&o.axes)?;
            Some((&o.input, &o.out, view))
        }
        _ => None,
    }
}

/// While alive, tensors registered on the client's device are staged on the host
/// ([`PjrtClient::stage_uploads`]).
pub struct StagingGuard {
    client: PjrtClient,
}

impl Drop for StagingGuard {
    fn drop(&mut self) {
        let mut state = self.client.state();
        state.staging = state.staging.saturating_sub(1);
    }
}
