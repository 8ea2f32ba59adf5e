//! Compiled mode: a Rust closure over [`Oxi`] tensors on a PJRT device,
//! traced once per input signature into one StableHLO program, compiled once,
//! and then run as a single executable. It sits beside [`eager`](crate::eager)
//! on the same device client and shares its [`Lowerer`] and buffers.
//!
//! ```no_run
//! use burn_tensor::Tensor;
//! use oxidiff_backend_tpu::compiled::CompiledFn;
//! use oxidiff_backend_tpu::{Oxi, OxiDevice};
//!
//! let device: OxiDevice = "xla:cpu".parse()?;
//! let w = Tensor::<Oxi, 2>::ones([8, 4], &device);
//! let step = CompiledFn::new("mlp", |(x, scale): (Tensor<Oxi, 2>, Tensor<Oxi, 1>)| {
//!     x.matmul(w.clone()).tanh() * scale.unsqueeze()
//! });
//! let x = Tensor::<Oxi, 2>::ones([2, 8], &device);
//! let y = step.call((x, Tensor::from_floats([0.5], &device)))?; // traces and compiles
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Design
//! - **Tracing** reuses the eager client: while a thread traces for a device,
//!   [`PjrtClient::register_op`] hands each op to [`intercept`], which records
//!   it instead of running it (a thread-local recording, so other threads and
//!   devices stay eager). The closure runs once on the real input tensors;
//!   the ops it issues are the program. Reading a tensor on the device while
//!   tracing is an error (a program cannot depend on host values).
//! - **Inputs** are the closure's tensors, declared first, in order, as
//!   `%arg0..`. The signature that keys the cache is the device, the inputs'
//!   shapes and dtypes, and which inputs are the same tensor.
//! - **Weights** need no special path: every tensor an op reads that was not
//!   produced inside the trace and is not an input (a module's parameter the
//!   closure captured, a constant uploaded during the trace) becomes a
//!   function argument of the lowering ([`Argument::Tensor`] with its
//!   [`TensorId`]), and each call passes the device buffer the eager client
//!   already holds for that id. Weights are never inlined: the program is a
//!   function of them and they stay device buffers. A tensor created during
//!   the trace and dropped in it (its `Drop` arrives while recording) is kept
//!   by the program itself, so later calls still find it. The closure owns or
//!   borrows the module it captures, so its parameters outlive the
//!   [`CompiledFn`].
//! - **Scalars** of ops (`x * 0.5`, eps, fill values) are rank-0 arguments
//!   in the lowering already; compiled mode uploads them once, at trace time,
//!   and passes them on every call. Values that change from call to call
//!   (timestep, guidance scale) must be **tensor inputs**: the closure is
//!   traced once per signature, so a Rust value it reads is frozen at trace
//!   time, as in `jax.jit`. Random ops take a fresh `rng_bit_generator`
//!   state from the device's seeded counter on every call, as in eager mode.
//! - **Outputs**: on the tracing call the closure's own output tensors get the
//!   executable's results; on cached calls new tensors are made with the
//!   traced shapes and dtypes, without running the closure.
//! - Tensors the closure dropped or consumed (inputs included) are freed after
//!   the program ran, as eager mode would have freed them.
//! - Calling a [`CompiledFn`] inside another one's closure inlines it into
//!   the outer trace.
//!
//! - **Donation** ([`CompiledFn::donate`]): an output may take over an
//!   input's buffer (`tf.aliasing_output` on the argument), so a denoising
//!   step that replaces its latents needs no second buffer. An input tensor
//!   still referenced elsewhere is copied first, so donation is never visible.
//! - **On-disk cache** ([`CompiledFn::with_disk_cache`], or
//!   [`COMPILE_CACHE_ENV`]): executables are serialized under a hash of the
//!   module text and of the plugin's platform, version and device; a later
//!   process still traces and lowers (milliseconds) but loads instead of
//!   compiling. Each entry carries its key, its length and a checksum, which
//!   are checked before the plugin sees the bytes: a stale, truncated or
//!   corrupted entry (or one the plugin refuses) is deleted, compiled again
//!   and rewritten, and the reason is kept in
//!   [`CompileInfo::rejected_cache_entry`].
//! - **Structure**: the program cache is keyed by the input signature only,
//!   so the closure's traced ops must be a function of its inputs' shapes
//!   and dtypes (branching on `dims()` is fine, branching on a captured Rust
//!   value that changes between calls is not: the first trace would be
//!   reused silently). Make such a value a tensor input, or build one
//!   [`CompiledFn`] per variant.
//! - **Convolution kernels** that the closure captured are passed in the
//!   layout XLA's convolutions want, `[spatial.., in, out]`
//!   ([`Lowerer::with_kernels_last`]): each is transposed once, on the first
//!   trace that needs it, and kept by the [`CompiledFn`] for all its
//!   programs. Otherwise XLA transposes every kernel on every call (the SD
//!   1.5 UNet's step on one core: 3.7-4.4 s with, 2.2 s without). The
//!   permuted copies cost the kernels' size in device memory once more.
//!   [`KERNELS_LAST_ENV`] turns this off; partitioned programs keep Burn's
//!   layout.
//! - [`lower_recorded`] is the lowering of a whole recording; ahead-of-time
//!   compilation for hardware that is not here lowers a recording of the
//!   [`Traced`](crate::trace::Traced) backend with it.
//!
//! Every program built increments [`CompiledFn::compiles`] and is recorded
//! in [`CompiledFn::compile_log`]; XLA compiles (not loads from disk) also
//! count in [`CompiledFn::xla_compiles`] and the process-wide
//! [`compile_count`]. Each is printed to stderr with its reason and timings
//! when [`LOG_COMPILES_ENV`] is set.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use burn_backend::{DType, Shape};
use burn_ir::{OperationIr, TensorId, TensorIr, TensorStatus};
use burn_router::RouterTensor;
use burn_tensor::{Bool, Int, Tensor, TensorPrimitive};

use crate::channel::OxiClient;
use crate::device::OxiDevice;
use crate::eager::{scalar_bytes, PjrtClient};
use crate::lowering::{Argument, LowerError, LoweredFunction, Lowerer, TensorType};
use crate::pjrt::{self, Buffer, CompileOptions, ElementType, LoadedExecutable};
use crate::spmd::{Layout, SpmdPlacement};
use crate::Oxi;

/// Environment variable: when set (to anything but `0`), every compile is
/// printed to stderr with its reason and timings.
pub const LOG_COMPILES_ENV: &str = "OXIDIFF_LOG_COMPILES";

/// Environment variable: a directory for the on-disk cache of compiled
/// executables ([`CompiledFn::with_disk_cache`]).
pub const COMPILE_CACHE_ENV: &str = "OXIDIFF_COMPILE_CACHE";

/// Environment variable: `0` keeps convolution kernels in Burn's layout
/// inside compiled programs, instead of passing them permuted once
/// ([`Lowerer::with_kernels_last`], the default), for comparisons.
pub const KERNELS_LAST_ENV: &str = "OXIDIFF_KERNELS_LAST";

static COMPILES: AtomicU64 = AtomicU64::new(0);

fn kernels_last() -> bool {
    std::env::var(KERNELS_LAST_ENV).map_or(true, |v| v != "0")
}

fn log_compiles() -> bool {
    std::env::var(LOG_COMPILES_ENV).is_ok_and(|v| v != "0")
}

/// XLA compiles run by every [`CompiledFn`] of the process so far (loads
/// from the disk cache do not count).
pub fn compile_count() -> u64 {
    COMPILES.load(Ordering::Relaxed)
}

/// Why a compiled function could not run.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CompileError {
    /// The inputs or outputs are not tensors of one PJRT device.
    #[error("compiled function `{name}`: {message}")]
    Placement { name: String, message: String },
    /// A donation ([`CompiledFn::donate`]) that cannot hold.
    #[error("compiled function `{name}`: donating input {input} to output {output}: {message}")]
    Donation {
        name: String,
        input: usize,
        output: usize,
        message: String,
    },
    /// The traced ops could not be lowered.
    #[error("compiled function `{name}`: {source}")]
    Lower {
        name: String,
        #[source]
        source: LowerError,
    },
    /// PJRT rejected the program.
    #[error("compiled function `{name}` on {device}: compiling its StableHLO ({ops} ops) failed: {message}")]
    Compile {
        name: String,
        device: OxiDevice,
        ops: usize,
        message: String,
    },
    /// Running it failed (a missing buffer, a failed upload or execution).
    #[error("compiled function `{name}` on {device}: {message}")]
    Run {
        name: String,
        device: OxiDevice,
        message: String,
    },
}

// ---- tensors in and out ------------------------------------------------

/// What a compiled function takes and returns: an [`Oxi`] tensor (float,
/// int or bool, any rank) or a tuple of up to six of them.
pub trait Tensors: Sized {
    /// Appends the router tensors, in order.
    fn flatten(self, out: &mut Vec<RouterTensor<OxiClient>>);
    /// Rebuilds from router tensors, in the order [`flatten`](Self::flatten)
    /// wrote them.
    fn unflatten(tensors: &mut std::vec::IntoIter<RouterTensor<OxiClient>>) -> Self;
}

fn next_tensor(
    tensors: &mut std::vec::IntoIter<RouterTensor<OxiClient>>,
) -> RouterTensor<OxiClient> {
    tensors
        .next()
        .expect("compiled function: fewer tensors than the signature's type has (a bug)")
}

impl<const D: usize> Tensors for Tensor<Oxi, D> {
    fn flatten(self, out: &mut Vec<RouterTensor<OxiClient>>) {
        out.push(match self.into_primitive() {
            TensorPrimitive::Float(t) | TensorPrimitive::QFloat(t) => t,
        });
    }

    fn unflatten(tensors: &mut std::vec::IntoIter<RouterTensor<OxiClient>>) -> Self {
        Tensor::from_primitive(TensorPrimitive::Float(next_tensor(tensors)))
    }
}

impl<const D: usize> Tensors for Tensor<Oxi, D, Int> {
    fn flatten(self, out: &mut Vec<RouterTensor<OxiClient>>) {
        out.push(self.into_primitive());
    }

    fn unflatten(tensors: &mut std::vec::IntoIter<RouterTensor<OxiClient>>) -> Self {
        Tensor::from_primitive(next_tensor(tensors))
    }
}

impl<const D: usize> Tensors for Tensor<Oxi, D, Bool> {
    fn flatten(self, out: &mut Vec<RouterTensor<OxiClient>>) {
        out.push(self.into_primitive());
    }

    fn unflatten(tensors: &mut std::vec::IntoIter<RouterTensor<OxiClient>>) -> Self {
        Tensor::from_primitive(next_tensor(tensors))
    }
}

macro_rules! tuple_tensors {
    ($($t:ident),+) => {
        impl<$($t: Tensors),+> Tensors for ($($t,)+) {
            #[allow(non_snake_case)]
            fn flatten(self, out: &mut Vec<RouterTensor<OxiClient>>) {
                let ($($t,)+) = self;
                $($t.flatten(out);)+
            }

            fn unflatten(tensors: &mut std::vec::IntoIter<RouterTensor<OxiClient>>) -> Self {
                ($($t::unflatten(tensors),)+)
            }
        }
    };
}

tuple_tensors!(A);
tuple_tensors!(A, B);
tuple_tensors!(A, B, C);
tuple_tensors!(A, B, C, D);
tuple_tensors!(A, B, C, D, E);
tuple_tensors!(A, B, C, D, E, F);

/// The metadata of a router tensor, without consuming or dropping it.
fn ir_of(tensor: &RouterTensor<OxiClient>) -> TensorIr {
    // The clone makes the count at least 2, so `into_ir` reports `ReadOnly`
    // and dropping the clone registers nothing.
    tensor.clone().into_ir()
}

// ---- recording -----------------------------------------------------------

/// The ops one thread issued on one device while tracing.
struct Recording {
    device: OxiDevice,
    ops: Vec<OperationIr>,
    /// Tensors produced by recorded ops.
    produced: HashSet<TensorId>,
    /// Tensors from outside the trace that were dropped or consumed in it:
    /// freed (or kept by the program) once it has run.
    released: Vec<TensorId>,
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

fn tracing_any() -> bool {
    RECORDING
        .try_with(|cell| cell.borrow().is_some())
        .unwrap_or(false)
}

/// Ends the recording when dropped; if the trace did not finish (the closure
/// panicked), frees what it released.
struct TraceGuard {
    client: PjrtClient,
    finished: bool,
}

impl TraceGuard {
    fn start(device: OxiDevice, client: PjrtClient) -> Self {
        RECORDING.with(|cell| {
            *cell.borrow_mut() = Some(Recording {
                device,
                ops: Vec::new(),
                produced: HashSet::new(),
                released: Vec::new(),
            })
        });
        Self {
            client,
            finished: false,
        }
    }

    fn finish(mut self) -> Recording {
        self.finished = true;
        RECORDING
            .with(|cell| cell.borrow_mut().take())
            .expect("the recording was started by this guard")
    }
}

impl Drop for TraceGuard {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        if let Ok(Some(recording)) = RECORDING.try_with(|cell| cell.borrow_mut().take()) {
            self.client.with_buffers(|buffers| {
                for id in &recording.released {
                    buffers.remove(id);
                }
            });
        }
    }
}

// ---- the compiled function ---------------------------------------------

/// The cache key: device, input shapes and dtypes, and which inputs are the
/// same tensor (index of the first input with the same id).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Signature {
    device: OxiDevice,
    inputs: Vec<(Vec<usize>, DType)>,
    aliases: Vec<usize>,
}

impl Signature {
    fn of(device: &OxiDevice, inputs: &[TensorIr]) -> Self {
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

    fn describe(&self) -> String {
        let inputs = self
            .inputs
            .iter()
            .map(|(dims, dtype)| format!("{dtype:?}{dims:?}"))
            .collect::<Vec<_>>()
            .join(", ");
        format!("({inputs}) on {}", self.device)
    }
}

/// Where one argument of a program comes from on each call.
enum Source {
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

/// One compiled program of a [`CompiledFn`].
struct Program {
    executable: LoadedExecutable,
    sources: Vec<Source>,
    /// Shapes and dtypes of the outputs, for the tensors of cached calls.
    outputs: Vec<(Shape, DType)>,
    /// Inputs whose buffers the program may reuse for an output.
    donated: Vec<usize>,
    /// Partitioned programs: copies of each owned argument (by argument index) on the
    /// mesh's other devices, in partition order from partition 1.
    replicas: HashMap<usize, Vec<Buffer>>,
}

/// How a partitioned function runs ([`CompiledFn::with_spmd`]).
struct SpmdRun {
    placement: Arc<SpmdPlacement>,
    /// The layout of each input, by position (missing ones are replicated).
    inputs: Vec<Layout>,
}

impl SpmdRun {
    /// Input `k`'s layout for shape `dims`: a batch split that does not divide (a batch of
    /// one on two devices) keeps the input whole, and the partitioner splits what it can.
    fn input_layout(&self, k: usize, dims: &[usize]) -> Layout {
        match self.inputs.get(k).copied().unwrap_or(Layout::Replicated) {
            layout @ Layout::BatchSplit(_)
                if layout.check(self.placement.mesh(), dims).is_err() =>
            {
                Layout::Replicated
            }
            layout => layout,
        }
    }
}

/// What one compile did, for logs, tests and benchmarks.
#[derive(Clone, Debug)]
pub struct CompileInfo {
    /// Why it compiled: the new input signature, and those already cached.
    pub reason: String,
    /// Ops traced (the program's size).
    pub ops: usize,
    /// Bytes of StableHLO text.
    pub module_bytes: usize,
    /// Arguments of the program, and how many are inputs, captured tensors
    /// (weights), scalars and random states.
    pub arguments: usize,
    pub inputs: usize,
    pub captured: usize,
    pub scalars: usize,
    pub random: usize,
    /// Inputs donated to outputs (`tf.aliasing_output`).
    pub donated: usize,
    /// Whether the executable came from the on-disk cache instead of a
    /// compile.
    pub from_disk: bool,
    /// A cache entry that was found but refused (stale, truncated, corrupt,
    /// or not loadable by the plugin), and why; it was replaced.
    pub rejected_cache_entry: Option<String>,
    /// Running the closure while recording.
    pub trace: Duration,
    /// Lowering the recording to StableHLO.
    pub lower: Duration,
    /// PJRT compile.
    pub compile: Duration,
}

impl std::fmt::Display for CompileInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}; traced {} ops in {:.1?}, lowered to {} KiB of StableHLO with {} arguments ({} inputs, {} donated, {} captured tensors, {} scalars, {} random states) in {:.1?}, {} in {:.1?}",
            self.reason,
            self.ops,
            self.trace,
            self.module_bytes / 1024,
            self.arguments,
            self.inputs,
            self.donated,
            self.captured,
            self.scalars,
            self.random,
            self.lower,
            if self.from_disk {
                "loaded from the disk cache"
            } else {
                "compiled"
            },
            self.compile
        )?;
        if let Some(rejected) = &self.rejected_cache_entry {
            write!(f, " (the disk cache entry {rejected})")?;
        }
        Ok(())
    }
}

/// A closure over [`Oxi`] tensors on one PJRT device, compiled into one
/// program per input signature (see the module docs).
pub struct CompiledFn<I, O, F> {
    name: String,
    f: F,
    programs: Mutex<HashMap<Signature, Arc<Program>>>,
    log: Mutex<Vec<CompileInfo>>,
    /// `(input, output)` pairs: the output may reuse the input's buffer.
    donations: Vec<(usize, usize)>,
    /// Where serialized executables are kept between processes.
    disk_cache: Option<PathBuf>,
    /// Partitioned over a device mesh, when set.
    spmd: Option<SpmdRun>,
    /// Captured convolution kernels in the layout the programs take them
    /// ([`Lowerer::with_kernels_last`]), made on the first trace that needs
    /// them, by tensor and permutation.
    kernels: Mutex<PermutedKernels>,
    _io: PhantomData<fn(I) -> O>,
}

/// Permuted copies of captured kernels, by tensor and permutation.
type PermutedKernels = HashMap<(TensorId, Vec<usize>), Arc<Buffer>>;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl<I: Tensors, O: Tensors, F: Fn(I) -> O> CompiledFn<I, O, F> {
    /// Wraps `f`; nothing is traced or compiled before the first call.
    /// `name` appears in logs and errors.
    pub fn new(name: impl Into<String>, f: F) -> Self {
        Self {
            name: name.into(),
            f,
            programs: Mutex::default(),
            log: Mutex::default(),
            donations: Vec::new(),
            disk_cache: std::env::var_os(COMPILE_CACHE_ENV).map(PathBuf::from),
            spmd: None,
            kernels: Mutex::default(),
            _io: PhantomData,
        }
    }

    /// Keeps serialized executables in `dir` (created if missing), keyed by
    /// a hash of the module text, the plugin's platform and version, the
    /// compiler flags (`XLA_FLAGS`, `LIBTPU_INIT_ARGS`) and the device: a later
    /// process skips the XLA compile of a program it traces again. The default is [`COMPILE_CACHE_ENV`], if set.
    pub fn with_disk_cache(mut self, dir: impl Into<PathBuf>) -> Self {
        self.disk_cache = Some(dir.into());
        self
    }

    /// Lets output `output` reuse the device buffer of input `input` (buffer
    /// donation, `tf.aliasing_output`): a step that replaces its latents
    /// then needs no second buffer for them. Both must have the same shape
    /// and dtype, and the input must not be passed twice in one call. An
    /// input tensor that is still referenced elsewhere when the call takes it
    /// is copied first, so donation never changes what other tensors hold.
    pub fn donate(mut self, input: usize, output: usize) -> Self {
        self.donations.push((input, output));
        self
    }

    /// Runs the function as one program partitioned over `placement`'s device mesh by XLA
    /// (GSPMD, see [`spmd`](crate::spmd)): weights as `placement` laid them out (split ones as
    /// shards, the others replicated), input `k` as `inputs[k]` (missing ones replicated),
    /// results replicated and returned on the mesh's first device, where the inputs must live.
    /// Partitioned programs skip donation and the disk cache.
    pub fn with_spmd(mut self, placement: Arc<SpmdPlacement>, inputs: Vec<Layout>) -> Self {
        self.spmd = Some(SpmdRun { placement, inputs });
        self.disk_cache = None;
        self
    }

    /// The device mesh and weights of a partitioned function ([`with_spmd`](Self::with_spmd)).
    pub fn spmd_placement(&self) -> Option<&Arc<SpmdPlacement>> {
        self.spmd.as_ref().map(|spmd| &spmd.placement)
    }

    /// The opcodes of each program's optimized HLO with their counts (XLA's program after
    /// its passes, the SPMD partitioner's collectives included: `all-reduce`,
    /// `collective-permute`, `all-gather`, ...), one map per program built so far.
    pub fn optimized_opcode_counts(
        &self,
    ) -> Result<Vec<std::collections::BTreeMap<String, usize>>, CompileError> {
        let programs: Vec<Arc<Program>> = lock(&self.programs).values().cloned().collect();
        programs
            .iter()
            .map(|program| {
                let read = || -> pjrt::Result<_> {
                    let (format, bytes) = program.executable.executable()?.optimized_program()?;
                    pjrt::hlo::opcode_counts(&format, &bytes)
                };
                read().map_err(|e| CompileError::Placement {
                    name: self.name.clone(),
                    message: format!("reading the optimized program: {e}"),
                })
            })
            .collect()
    }

    /// The name given to [`new`](Self::new).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Programs this function built so far, one per input signature (traced,
    /// lowered, and compiled or loaded from the disk cache).
    pub fn compiles(&self) -> u64 {
        lock(&self.log).len() as u64
    }

    /// XLA compiles this function ran (programs not loaded from the disk
    /// cache).
    pub fn xla_compiles(&self) -> u64 {
        lock(&self.log).iter().filter(|i| !i.from_disk).count() as u64
    }

    /// Programs this function loaded from the disk cache instead of
    /// compiling.
    pub fn disk_loads(&self) -> u64 {
        lock(&self.log).iter().filter(|i| i.from_disk).count() as u64
    }

    /// What each compile did, in order.
    pub fn compile_log(&self) -> Vec<CompileInfo> {
        lock(&self.log).clone()
    }

    /// Runs the function: the cached program for these inputs' signature, or
    /// a new one traced from the closure and compiled first. All inputs must
    /// live on one PJRT device; the outputs live there too.
    pub fn call(&self, inputs: I) -> Result<O, CompileError> {
        if tracing_any() {
            // Inside another compiled function's trace: inline.
            return Ok((self.f)(inputs));
        }
        let mut tensors = Vec::new();
        inputs.flatten(&mut tensors);
        let (client, device) = self.pjrt_client(&tensors, "input")?;
        let irs: Vec<TensorIr> = tensors.iter().map(ir_of).collect();
        let signature = Signature::of(&device, &irs);
        let cached = lock(&self.programs).get(&signature).cloned();
        let Some(program) = cached else {
            return self.trace_and_compile(client, device, signature, tensors, irs);
        };
        let router = tensors[0].client.clone();
        let ids: Vec<TensorId> = program
            .outputs
            .iter()
            .map(|_| client.create_empty_handle())
            .collect();
        // A donated input held only by this call is consumed here (its
        // buffer is gone after the run); one held elsewhere too is copied.
        let mut tensors: Vec<Option<RouterTensor<OxiClient>>> =
            tensors.into_iter().map(Some).collect();
        let mut consumed = Vec::new();
        let mut copies = HashMap::new();
        for &k in &program.donated {
            if let Some(tensor) = tensors[k].take() {
                let ir = tensor.into_ir();
                if ir.status == TensorStatus::ReadWrite {
                    consumed.push(ir.id);
                } else {
                    copies.insert(k, self.copy_input(&client, &device, k, ir.id)?);
                }
            }
        }
        let result = self.run(&client, &device, &program, &irs, &ids, &copies);
        client.with_buffers(|buffers| {
            for id in &consumed {
                buffers.remove(id);
            }
        });
        result?;
        // The other inputs are consumed: dropping them frees their buffers.
        drop(tensors);
        let outputs: Vec<_> = ids
            .into_iter()
            .zip(&program.outputs)
            .map(|(id, (shape, dtype))| {
                RouterTensor::new(id, shape.clone(), *dtype, router.clone())
            })
            .collect();
        Ok(O::unflatten(&mut outputs.into_iter()))
    }

    /// The eager client of the one PJRT device all `tensors` live on.
    fn pjrt_client(
        &self,
        tensors: &[RouterTensor<OxiClient>],
        what: &str,
    ) -> Result<(PjrtClient, OxiDevice), CompileError> {
        let placement = |message: String| CompileError::Placement {
            name: self.name.clone(),
            message,
        };
        let mut found: Option<(PjrtClient, OxiDevice)> = None;
        for (k, tensor) in tensors.iter().enumerate() {
            let OxiClient::Pjrt(client) = &tensor.client else {
                return Err(placement(format!(
                    "{what} {k} is on the cpu device: compiled functions run on a PJRT device; move it there with `to_device`"
                )));
            };
            let device = client.device();
            match &found {
                Some((_, first)) if *first != device => {
                    return Err(placement(format!(
                        "{what} {k} is on {device} but {what} 0 is on {first}: a compiled function runs on one device"
                    )))
                }
                Some(_) => {}
                None => found = Some((client.clone(), device)),
            }
        }
        found.ok_or_else(|| {
            placement(format!(
                "it has no {what} tensor, so no device: pass at least one {what} on a PJRT device"
            ))
        })
    }

    fn trace_and_compile(
        &self,
        client: PjrtClient,
        device: OxiDevice,
        signature: Signature,
        tensors: Vec<RouterTensor<OxiClient>>,
        irs: Vec<TensorIr>,
    ) -> Result<O, CompileError> {
        let name = &self.name;
        let lower_error = |source| CompileError::Lower {
            name: name.clone(),
            source,
        };
        let run_error = |message: String| CompileError::Run {
            name: name.clone(),
            device: device.clone(),
            message,
        };

        // Trace.
        let started = Instant::now();
        let guard = TraceGuard::start(device.clone(), client.clone());
        let outputs = (self.f)(I::unflatten(&mut tensors.into_iter()));
        let mut out_tensors = Vec::new();
        outputs.flatten(&mut out_tensors);
        let recording = guard.finish();
        let trace = started.elapsed();
        let released: HashSet<TensorId> = recording.released.iter().copied().collect();
        let free_released = || {
            client.with_buffers(|buffers| {
                for id in &released {
                    buffers.remove(id);
                }
            })
        };
        let out_device = match self.pjrt_client(&out_tensors, "output") {
            Ok((_, d)) => d,
            Err(e) => {
                free_released();
                return Err(e);
            }
        };
        if out_device != device {
            free_released();
            return Err(CompileError::Placement {
                name: name.clone(),
                message: format!("its outputs are on {out_device} but its inputs on {device}"),
            });
        }
        let out_irs: Vec<TensorIr> = out_tensors.iter().map(ir_of).collect();

        // Lower: inputs first, then the ops; an output nothing computed (a
        // captured tensor returned as is) becomes an argument too.
        let started = Instant::now();
        // Kernels in the convolutions' layout, permuted once below; a
        // partitioned program keeps Burn's layout, which its shardings name.
        let lowerer = if self.spmd.is_none() && kernels_last() {
            Lowerer::with_kernels_last()
        } else {
            Lowerer::new()
        };
        let lowered = lower_recorded_with(lowerer, &irs, &recording.ops, &out_irs);
        let function = match lowered {
            Ok(f) => f,
            Err(e) => {
                free_released();
                return Err(lower_error(e));
            }
        };
        let lower = started.elapsed();

        // Where each argument comes from.
        let (pjrt_client, pjrt_device) = match client.target() {
            Ok(t) => t,
            Err(e) => {
                free_released();
                return Err(run_error(e));
            }
        };
        let first_input: HashMap<TensorId, usize> = irs
            .iter()
            .enumerate()
            .rev()
            .map(|(k, t)| (t.id, k))
            .collect();
        let mut sources = Vec::with_capacity(function.arguments.len());
        let (mut captured, mut scalars, mut random) = (0, 0, 0);
        let mut transposes = HashMap::new();
        for (argument, ty) in &function.arguments {
            let source = match argument {
                Argument::Permuted { id, permutation } => {
                    captured += 1;
                    let key = (*id, permutation.clone());
                    let cached = lock(&self.kernels).get(&key).cloned();
                    let prepared = match cached {
                        Some(buffer) => Ok(Source::Shared(buffer)),
                        None if first_input.contains_key(id) => Err(format!(
                            "input tensor {id} was lowered as a permuted kernel (a bug)"
                        )),
                        None => {
                            // A constant of the trace is the program's alone.
                            let owned = released.contains(id);
                            let permuted = client.with_buffers(|buffers| {
                                let buffer = if owned { buffers.remove(id) } else { None };
                                match buffer.as_ref().or_else(|| buffers.get(id)) {
                                    Some(buffer) => permute_buffer(
                                        pjrt_client,
                                        pjrt_device,
                                        buffer,
                                        ty,
                                        permutation,
                                        &mut transposes,
                                    ),
                                    None => Err(format!(
                                        "tensor {id}, used by the traced ops, is not on the device"
                                    )),
                                }
                            });
                            permuted.map(|buffer| {
                                if owned {
                                    Source::Owned(buffer)
                                } else {
                                    let buffer = Arc::new(buffer);
                                    lock(&self.kernels).insert(key, buffer.clone());
                                    Source::Shared(buffer)
                                }
                            })
                        }
                    };
                    match prepared {
                        Ok(source) => source,
                        Err(e) => {
                            free_released();
                            return Err(run_error(e));
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
                                free_released();
                                return Err(run_error(format!(
                                    "tensor {id}, used by the traced ops, is not on the device"
                                )));
                            }
                        }
                    } else {
                        captured += 1;
                        Source::Captured(*id)
                    }
                }
                Argument::Scalar(scalar) => {
                    scalars += 1;
                    let shape = pjrt::Shape::new(ty.elem, Vec::new());
                    let bytes = scalar_bytes(*scalar, ty.elem);
                    match pjrt_client.buffer_from_host(&bytes, &shape, pjrt_device) {
                        Ok(buffer) => Source::Owned(buffer),
                        Err(e) => {
                            free_released();
                            return Err(run_error(format!("uploading a scalar failed: {e}")));
                        }
                    }
                }
                Argument::RngState => {
                    random += 1;
                    Source::Rng
                }
            };
            sources.push(source);
        }

        // Partitioned: shardings on the arguments and results, no donation.
        let spmd_module = self.spmd.as_ref().map(|spmd| {
            let mesh = spmd.placement.mesh();
            if spmd.placement.device() != device {
                return Err(format!(
                    "its inputs are on {device} but its device mesh starts at {}",
                    spmd.placement.device()
                ));
            }
            let mut shardings = Vec::with_capacity(sources.len());
            for (source, (_, ty)) in sources.iter().zip(&function.arguments) {
                let layout = match source {
                    Source::Input(k) => spmd.input_layout(*k, &ty.dims),
                    Source::Captured(id) => spmd.placement.layout_of(*id),
                    _ => Layout::Replicated,
                };
                layout
                    .check(mesh, &ty.dims)
                    .map_err(|e| format!("an argument of type {}: {e}", ty.mlir()))?;
                shardings.push(layout.hlo_sharding(mesh, ty.dims.len()));
            }
            let results = vec![Layout::Replicated.hlo_sharding(mesh, 0); function.results.len()];
            Ok(function.partitioned(mesh.partitions(), &shardings, &results))
        });
        let mut module = match spmd_module {
            Some(Ok(module)) => module,
            Some(Err(message)) => {
                free_released();
                return Err(CompileError::Placement {
                    name: name.clone(),
                    message,
                });
            }
            None => function.module,
        };
        let mut replicas = HashMap::new();
        if let Some(spmd) = &self.spmd {
            for (i, source) in sources.iter().enumerate() {
                if let Source::Owned(buffer) = source {
                    let copies = spmd.placement.devices()[1..]
                        .iter()
                        .map(|d| buffer.copy_to_device(d))
                        .collect::<pjrt::Result<Vec<_>>>();
                    match copies {
                        Ok(copies) => {
                            replicas.insert(i, copies);
                        }
                        Err(e) => {
                            free_released();
                            return Err(run_error(format!("replicating a constant: {e}")));
                        }
                    }
                }
            }
        }

        // Donations: mark the argument, check the types.
        let mut donated = Vec::new();
        let donations: &[(usize, usize)] = if self.spmd.is_some() {
            &[]
        } else {
            &self.donations
        };
        for &(input, output) in donations {
            let checked = (|| {
                if input >= irs.len() || output >= out_irs.len() {
                    return Err(format!(
                        "the function has {} inputs and {} outputs",
                        irs.len(),
                        out_irs.len()
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
                mark_donation(&mut module, argument, &in_ty.mlir(), output)
            })();
            if let Err(message) = checked {
                free_released();
                return Err(CompileError::Donation {
                    name: name.clone(),
                    input,
                    output,
                    message,
                });
            }
            donated.push(input);
        }

        // Compile, or load the executable an earlier process compiled.
        let started = Instant::now();
        let key = disk_key(&module, pjrt_client, pjrt_device.id());
        let disk = self
            .disk_cache
            .as_ref()
            .filter(|_| self.spmd.is_none())
            .map(|dir| dir.join(format!("{key}.pjrt")));
        let mut rejected = None;
        let loaded = disk.as_ref().and_then(|path| {
            match load_executable(path, &key, pjrt_client, out_irs.len()) {
                Ok(exe) => exe,
                Err(why) => {
                    // Detected before the plugin sees the bytes (header,
                    // length, checksum) or refused by it: drop the entry and
                    // compile; the fresh executable replaces it.
                    let _ = std::fs::remove_file(path);
                    let message = format!("{}: {why}; rebuilt", path.display());
                    if log_compiles() {
                        eprintln!("oxidiff: `{name}`: the cached executable {message}");
                    }
                    rejected = Some(message);
                    None
                }
            }
        });
        let reason = {
            let programs = lock(&self.programs);
            if programs.is_empty() {
                format!("first call, inputs {}", signature.describe())
            } else {
                let cached = programs
                    .keys()
                    .map(Signature::describe)
                    .collect::<Vec<_>>()
                    .join("; ");
                format!(
                    "new input signature {} (cached: {cached})",
                    signature.describe()
                )
            }
        };
        if loaded.is_none() {
            tracing::info!(target: "oxidiff::compile", program = %name, reason = %reason, "compiling");
        }
        let from_disk = loaded.is_some();
        let options = match &self.spmd {
            Some(spmd) => {
                let ids: Vec<i64> = spmd
                    .placement
                    .devices()
                    .iter()
                    .map(|d| i64::from(d.id()))
                    .collect();
                CompileOptions::spmd(&ids)
            }
            None => CompileOptions::on_device(i64::from(pjrt_device.id())),
        };
        let compiled = match loaded {
            Some(exe) => Ok(exe),
            None => pjrt_client.compile(&module, &options).inspect(|exe| {
                COMPILES.fetch_add(1, Ordering::Relaxed);
                if let Some(path) = &disk {
                    store_executable(path, &key, exe);
                }
            }),
        };
        let executable = match compiled {
            Ok(exe) => exe,
            Err(e) => {
                free_released();
                return Err(CompileError::Compile {
                    name: name.clone(),
                    device: device.clone(),
                    ops: recording.ops.len(),
                    message: e.to_string(),
                });
            }
        };
        let compile = started.elapsed();

        let info = CompileInfo {
            reason,
            ops: recording.ops.len(),
            module_bytes: module.len(),
            arguments: sources.len(),
            inputs: irs.len(),
            captured,
            scalars,
            random,
            donated: donated.len(),
            from_disk,
            rejected_cache_entry: rejected,
            trace,
            lower,
            compile,
        };
        if log_compiles() {
            eprintln!(
                "oxidiff: compiled `{name}` (#{} of it, {} in the process): {info}",
                lock(&self.log).len() + 1,
                compile_count()
            );
        }
        lock(&self.log).push(info);

        let program = Arc::new(Program {
            executable,
            sources,
            outputs: out_irs.iter().map(|t| (t.shape.clone(), t.dtype)).collect(),
            donated,
            replicas,
        });
        // A donated input the closure dropped is freed after the run anyway;
        // one still referenced elsewhere is copied.
        let mut copies = HashMap::new();
        for &k in &program.donated {
            if !released.contains(&irs[k].id) {
                match self.copy_input(&client, &device, k, irs[k].id) {
                    Ok(copy) => {
                        copies.insert(k, copy);
                    }
                    Err(e) => {
                        free_released();
                        return Err(e);
                    }
                }
            }
        }
        let out_ids: Vec<TensorId> = out_irs.iter().map(|t| t.id).collect();
        let result = self.run(&client, &device, &program, &irs, &out_ids, &copies);
        free_released();
        result?;
        lock(&self.programs).insert(signature, program);
        Ok(O::unflatten(&mut out_tensors.into_iter()))
    }

    /// A copy of input `k` (tensor `id`) to donate in its place.
    fn copy_input(
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

    /// Executes `program` on the inputs `inputs`, binding its results to
    /// `outputs` in the eager client.
    fn run(
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
                let bytes: Vec<u8> = client
                    .next_rng_state()
                    .iter()
                    .flat_map(|w| w.to_le_bytes())
                    .collect();
                let shape = pjrt::Shape::new(ElementType::U64, vec![2]);
                let buffer = pjrt_client
                    .buffer_from_host(&bytes, &shape, pjrt_device)
                    .map_err(|e| run_error(format!("uploading a random state failed: {e}")))?;
                rng_states.push(buffer);
            }
        }
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
            program
                .executable
                .execute(&args)
                .map_err(|e| format!("execution failed: {e}"))
        });
        let results = results.map_err(run_error)?;
        if results.len() != outputs.len() {
            return Err(run_error(format!(
                "the program returned {} outputs, expected {}",
                results.len(),
                outputs.len()
            )));
        }
        client.with_buffers(|buffers| {
            for (id, buffer) in outputs.iter().zip(results) {
                buffers.insert(*id, buffer);
            }
        });
        Ok(())
    }

    /// Executes a partitioned `program` on its mesh: each input split or copied per its
    /// layout, each weight as placed, one argument list per device; binds partition 0's
    /// (replicated) results to `outputs`.
    fn run_spmd(
        &self,
        spmd: &SpmdRun,
        client: &PjrtClient,
        device: &OxiDevice,
        program: &Program,
        inputs: &[TensorIr],
        outputs: &[TensorId],
    ) -> Result<(), CompileError> {
        let run_error = |message: String| CompileError::Run {
            name: self.name.clone(),
            device: device.clone(),
            message,
        };
        let placement = &spmd.placement;
        if placement.device() != *device {
            return Err(run_error(format!(
                "its inputs are on {device} but its device mesh starts at {}",
                placement.device()
            )));
        }
        let mesh = placement.mesh();
        let devices = placement.devices();
        let (pjrt_client, _) = client.target().map_err(run_error)?;

        // Each input used, one buffer per partition (`None`: the input's own buffer).
        let mut input_parts: HashMap<usize, Vec<Option<Buffer>>> = HashMap::new();
        for source in &program.sources {
            let Source::Input(k) = *source else {
                continue;
            };
            if input_parts.contains_key(&k) {
                continue;
            }
            let layout = spmd.input_layout(k, &inputs[k].shape);
            let id = inputs[k].id;
            let parts = client.with_buffers(|buffers| -> Result<Vec<Option<Buffer>>, String> {
                let full = buffers.get(&id).ok_or_else(|| {
                    format!("input {k} (tensor {id}) is not on the device (was it produced by an op that failed?)")
                })?;
                if layout == Layout::Replicated {
                    let mut parts = vec![None];
                    for d in &devices[1..] {
                        let copy = full
                            .copy_to_device(d)
                            .map_err(|e| format!("copying input {k}: {e}"))?;
                        parts.push(Some(copy));
                    }
                    return Ok(parts);
                }
                let shape = full.shape().map_err(|e| e.to_string())?;
                let dims: Vec<usize> = shape.dims.iter().map(|&d| d as usize).collect();
                layout
                    .check(mesh, &dims)
                    .map_err(|e| format!("input {k}: {e}"))?;
                let bytes = full.to_host().map_err(|e| e.to_string())?;
                let part_dims: Vec<i64> = layout
                    .part_dims(mesh, &dims)
                    .iter()
                    .map(|&d| d as i64)
                    .collect();
                let part_shape = pjrt::Shape::new(shape.element_type, part_dims);
                let elem = shape.element_type.byte_size();
                (0..mesh.partitions())
                    .map(|p| {
                        let part = layout.part_of(mesh, p, &bytes, &dims, elem);
                        pjrt_client
                            .buffer_from_host(&part, &part_shape, &devices[p])
                            .map(Some)
                            .map_err(|e| format!("splitting input {k}: {e}"))
                    })
                    .collect()
            });
            input_parts.insert(k, parts.map_err(run_error)?);
        }
        // The same random state on every device.
        let mut rng_states = Vec::new();
        for source in &program.sources {
            if matches!(source, Source::Rng) {
                let bytes: Vec<u8> = client
                    .next_rng_state()
                    .iter()
                    .flat_map(|w| w.to_le_bytes())
                    .collect();
                let shape = pjrt::Shape::new(ElementType::U64, vec![2]);
                let states = devices
                    .iter()
                    .map(|d| pjrt_client.buffer_from_host(&bytes, &shape, d))
                    .collect::<pjrt::Result<Vec<_>>>()
                    .map_err(|e| run_error(format!("uploading a random state failed: {e}")))?;
                rng_states.push(states);
            }
        }
        // The executable's device order, as partitions.
        let order = program
            .executable
            .addressable_devices()
            .iter()
            .map(|d| {
                devices
                    .iter()
                    .position(|m| m.index() == d.index())
                    .ok_or_else(|| {
                        format!(
                            "the executable runs on device {} outside its mesh",
                            d.index()
                        )
                    })
            })
            .collect::<Result<Vec<usize>, String>>()
            .map_err(run_error)?;
        let captured: Vec<TensorId> = program
            .sources
            .iter()
            .filter_map(|s| match s {
                Source::Captured(id) => Some(*id),
                _ => None,
            })
            .collect();
        let results = placement
            .with_weights(&captured, |view| -> Result<Vec<Vec<Buffer>>, String> {
                let mut lists: Vec<Vec<&Buffer>> = Vec::with_capacity(order.len());
                for &p in &order {
                    let mut rng = rng_states.iter();
                    let mut args = Vec::with_capacity(program.sources.len());
                    for (i, source) in program.sources.iter().enumerate() {
                        let buffer = match source {
                            Source::Input(k) => match &input_parts[k][p] {
                                Some(part) => part,
                                None => view.eager.get(&inputs[*k].id).ok_or_else(|| {
                                    format!("input {k} is no longer on the device")
                                })?,
                            },
                            Source::Captured(id) => view.weight(*id, p).ok_or_else(|| {
                                format!("tensor {id}, which the closure captured (a weight), is no longer on the device: keep the module the closure uses alive")
                            })?,
                            Source::Owned(buffer) if p == 0 => buffer,
                            Source::Owned(_) => program
                                .replicas
                                .get(&i)
                                .and_then(|copies| copies.get(p - 1))
                                .ok_or_else(|| "a constant's copy is missing (a bug)".to_string())?,
                            Source::Shared(_) => {
                                return Err(
                                    "a partitioned program has a permuted kernel (a bug)"
                                        .to_string(),
                                )
                            }
                            Source::Rng => rng
                                .next()
                                .map(|states| &states[p])
                                .ok_or_else(|| "a random state is missing (a bug)".to_string())?,
                        };
                        args.push(buffer);
                    }
                    lists.push(args);
                }
                let lists: Vec<&[&Buffer]> = lists.iter().map(Vec::as_slice).collect();
                program
                    .executable
                    .execute_sharded(&lists)
                    .map_err(|e| format!("execution failed: {e}"))
            })
            .map_err(run_error)?
            .map_err(run_error)?;
        let first = order.iter().position(|&p| p == 0).unwrap_or(0);
        let Some(mine) = results.into_iter().nth(first) else {
            return Err(run_error(
                "the program returned no results for the first device".into(),
            ));
        };
        if mine.len() != outputs.len() {
            return Err(run_error(format!(
                "the program returned {} outputs, expected {}",
                mine.len(),
                outputs.len()
            )));
        }
        client.with_buffers(|buffers| {
            for (id, buffer) in outputs.iter().zip(mine) {
                buffers.insert(*id, buffer);
            }
        });
        Ok(())
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

/// `buffer` (of the tensor whose permutation by `permutation` has type
/// `permuted`) transposed on its device by a small program, one per type and
/// permutation in `programs`.
fn permute_buffer(
    client: &pjrt::Client,
    device: &pjrt::Device,
    buffer: &Buffer,
    permuted: &TensorType,
    permutation: &[usize],
    programs: &mut HashMap<String, LoadedExecutable>,
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
    if !programs.contains_key(&module) {
        let options = CompileOptions::on_device(i64::from(device.id()));
        let exe = client
            .compile(&module, &options)
            .map_err(|e| format!("compiling a kernel transpose failed: {e}"))?;
        programs.insert(module.clone(), exe);
    }
    let mut out = programs[&module]
        .execute(&[buffer])
        .map_err(|e| format!("transposing a kernel failed: {e}"))?;
    out.pop()
        .ok_or_else(|| "a kernel transpose returned nothing (a bug)".to_string())
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

/// FNV-1a, 64 bits: a hash that is the same in every process and build.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for part in parts {
        for &byte in part.iter().chain(&(part.len() as u64).to_le_bytes()) {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    }
    hash
}

/// The on-disk cache key of `module` compiled by `client` for `device_id`:
/// the module's hash and that of the plugin version and device.
fn disk_key(module: &str, client: &pjrt::Client, device_id: i32) -> String {
    // The compiler's options are part of the target: an executable built under other
    // `XLA_FLAGS` (oxidiff's XLA CPU defaults included, set before the plugin loaded) or
    // `LIBTPU_INIT_ARGS` is not the one this process would build.
    let flags = |name: &str| std::env::var(name).unwrap_or_default();
    let target = fnv1a(&[
        client.platform_name().as_bytes(),
        client.platform_version().as_bytes(),
        &device_id.to_le_bytes(),
        env!("CARGO_PKG_VERSION").as_bytes(),
        flags("XLA_FLAGS").as_bytes(),
        flags("LIBTPU_INIT_ARGS").as_bytes(),
    ]);
    format!("{:016x}-{target:016x}", fnv1a(&[module.as_bytes()]))
}

/// The first bytes of an on-disk cache entry; the number is the format's
/// version.
const CACHE_MAGIC: &[u8; 16] = b"oxidiff-pjrt-v1\n";

/// An on-disk cache entry: [`CACHE_MAGIC`], the key (u32 length, bytes),
/// the payload's length (u64) and FNV-1a hash (u64), then the plugin's
/// serialized executable. The plugin never sees bytes whose length or hash
/// do not match (a truncated or corrupted file could crash it).
fn encode_entry(key: &str, payload: &[u8]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(payload.len() + key.len() + 40);
    bytes.extend_from_slice(CACHE_MAGIC);
    bytes.extend_from_slice(&(key.len() as u32).to_le_bytes());
    bytes.extend_from_slice(key.as_bytes());
    bytes.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&fnv1a(&[payload]).to_le_bytes());
    bytes.extend_from_slice(payload);
    bytes
}

/// The payload of an entry written by [`encode_entry`] for `key`, or why it
/// is not one.
fn decode_entry<'a>(bytes: &'a [u8], key: &str) -> Result<&'a [u8], String> {
    fn take<'b>(bytes: &mut &'b [u8], n: usize) -> Result<&'b [u8], String> {
        if bytes.len() < n {
            return Err("truncated header".to_string());
        }
        let (head, rest) = bytes.split_at(n);
        *bytes = rest;
        Ok(head)
    }
    fn word<const N: usize>(bytes: &mut &[u8]) -> Result<[u8; N], String> {
        take(bytes, N).map(|b| b.try_into().expect("N bytes"))
    }
    let mut rest = bytes;
    if take(&mut rest, CACHE_MAGIC.len())? != CACHE_MAGIC {
        return Err("not an oxidiff cache entry of this version".to_string());
    }
    let key_len = u32::from_le_bytes(word(&mut rest)?) as usize;
    if take(&mut rest, key_len)? != key.as_bytes() {
        return Err("written for another module or plugin (stale)".to_string());
    }
    let len = u64::from_le_bytes(word(&mut rest)?);
    let hash = u64::from_le_bytes(word(&mut rest)?);
    if rest.len() as u64 != len {
        return Err(format!(
            "truncated or padded: {} payload bytes, the header says {len}",
            rest.len()
        ));
    }
    if fnv1a(&[rest]) != hash {
        return Err("corrupt: the payload's checksum does not match".to_string());
    }
    Ok(rest)
}

/// The executable cached at `path`: `Ok(None)` when there is no entry,
/// `Err(why)` when there is one that cannot be used.
fn load_executable(
    path: &Path,
    key: &str,
    client: &pjrt::Client,
    outputs: usize,
) -> Result<Option<LoadedExecutable>, String> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("unreadable ({e})")),
    };
    let payload = decode_entry(&bytes, key)?;
    let exe = client
        .deserialize_and_load(payload)
        .map_err(|e| format!("the plugin did not load it ({e})"))?;
    if exe.num_outputs() != outputs {
        return Err(format!(
            "it has {} outputs, the program {outputs}",
            exe.num_outputs()
        ));
    }
    Ok(Some(exe))
}

/// Writes `exe` to `path` (through a temporary file, so a reader never sees
/// half a file). Failures only cost a compile later, so they are logged.
fn store_executable(path: &Path, key: &str, exe: &LoadedExecutable) {
    let result = (|| -> Result<(), String> {
        let bytes = encode_entry(key, &exe.serialize().map_err(|e| e.to_string())?);
        let dir = path.parent().ok_or("no directory")?;
        std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, bytes).map_err(|e| e.to_string())?;
        std::fs::rename(&tmp, path).map_err(|e| e.to_string())
    })();
    if let Err(e) = result {
        if log_compiles() {
            eprintln!(
                "oxidiff: storing a compiled executable in {} failed: {e}",
                path.display()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_entries_round_trip_and_damage_is_detected() {
        let payload: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        let entry = encode_entry("k1", &payload);
        assert_eq!(decode_entry(&entry, "k1").unwrap(), &payload[..]);
        assert!(decode_entry(&entry, "k2").unwrap_err().contains("stale"));
        assert!(decode_entry(&entry[..entry.len() - 1], "k1")
            .unwrap_err()
            .contains("truncated"));
        assert!(decode_entry(&entry[..10], "k1").is_err());
        let mut flipped = entry.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert!(decode_entry(&flipped, "k1")
            .unwrap_err()
            .contains("corrupt"));
        assert!(decode_entry(b"garbage", "k1").is_err());
    }
}
