//! Compiled mode: a Rust closure over [`Oxi`] tensors on a PJRT device,
//! traced once per input signature into one StableHLO program, compiled once,
//! and then run as a single executable. It sits beside [`eager`](crate::eager)
//! on the same device client and shares its lowering and buffers; captured
//! weights stay device buffers passed as arguments, and values that change
//! between calls must be tensor inputs (as in `jax.jit`). `docs/backend.md`
//! explains the design.
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
//! A call with a new signature goes through the phases in order, one file
//! each: [`trace`], [`lower`], [`sources`], [`shard`], [`donate`],
//! [`compile`] (with [`crate::compile_cache`]), then [`run`] or [`spmd_run`]; a cached
//! signature only runs.

mod compile;
mod donate;
mod fused;
mod lower;
mod run;
mod shard;
mod sources;
mod spmd_run;
mod tensors;
mod trace;

use std::collections::HashMap;
use std::marker::PhantomData;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use burn_backend::{DType, Shape};
use burn_ir::{TensorId, TensorIr, TensorStatus};
use burn_router::RouterTensor;

pub use compile::CompileInfo;
pub use fused::{Fused, FusedStats};
pub use lower::{lower_recorded, lower_recorded_with};
pub use tensors::Tensors;

use shard::SpmdRun;
use sources::Source;
use tensors::ir_of;
use trace::{Signature, Trace};

use crate::channel::OxiClient;
use crate::compile_cache::{self, log_compiles};
use crate::device::OxiDevice;
use crate::eager::PjrtClient;
use crate::lowering::LowerError;
use crate::pjrt::{self, Buffer, LoadedExecutable};
use crate::recording::tracing_any;
use crate::spmd::{Layout, SpmdPlacement};

pub use crate::compile_cache::{COMPILE_CACHE_ENV, LOG_COMPILES_ENV};

/// Environment variable: `0` keeps convolution kernels in Burn's layout
/// inside compiled programs, instead of passing them permuted once
/// ([`Lowerer::with_kernels_last`](crate::lowering::Lowerer::with_kernels_last),
/// the default), for comparisons.
pub const KERNELS_LAST_ENV: &str = "OXIDIFF_KERNELS_LAST";

/// XLA compiles of compiled mode, once per process ([`crate::process`]).
pub(crate) struct Compiles(pub(crate) AtomicU64);

pub(crate) fn compiles() -> &'static AtomicU64 {
    static COMPILES: std::sync::OnceLock<&'static Compiles> = std::sync::OnceLock::new();
    &COMPILES
        .get_or_init(|| crate::process::shared(|| Compiles(AtomicU64::new(0))))
        .0
}

/// Environment variable, for comparisons: `0` keeps compiled programs on XLA's CPU plugin on
/// XLA's own lowering instead of oxidiff's host kernels ([`crate::host_kernels`]); a
/// comma-separated list of custom-call targets (such as `oxidiff_conv2d_f32`) keeps those
/// alone. Unset, every kernel the plugin registered is called.
pub const HOST_KERNELS_ENV: &str = "OXIDIFF_HOST_KERNELS";

/// Whether programs may call the host kernel `target`, as [`HOST_KERNELS_ENV`] says.
fn host_kernel_allowed(target: &str) -> bool {
    match std::env::var(HOST_KERNELS_ENV) {
        Err(_) => true,
        Ok(v) if v == "0" => false,
        Ok(v) if v == "1" => true,
        Ok(list) => list.split(',').any(|t| t.trim() == target),
    }
}

fn kernels_last() -> bool {
    std::env::var(KERNELS_LAST_ENV).map_or(true, |v| v != "0")
}

/// XLA compiles run by every [`CompiledFn`] of the process so far (loads
/// from the disk cache do not count).
pub fn compile_count() -> u64 {
    compiles().load(Ordering::Relaxed)
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
    /// The warm-start tag ([`warm_start`](Self::warm_start)) its programs are listed under.
    warm_tag: Option<String>,
    /// Executables loaded at warm start and not used yet, by disk cache key.
    warmed: Mutex<HashMap<String, LoadedExecutable>>,
    /// Captured convolution kernels in the layout the programs take them
    /// (`Lowerer::with_kernels_last`), made on the first trace that needs
    /// them, by tensor and permutation.
    kernels: Mutex<PermutedKernels>,
    /// The small programs that permute those kernels, one per type and permutation, and how
    /// many were compiled or loaded from the disk cache.
    transposes: Mutex<Transposes>,
    _io: PhantomData<fn(I) -> O>,
}

/// Kernel-transpose programs by module text, with their counts.
#[derive(Default)]
struct Transposes {
    programs: HashMap<String, LoadedExecutable>,
    compiled: u64,
    loaded: u64,
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
            disk_cache: compile_cache::dir_from_env(),
            spmd: None,
            warm_tag: None,
            warmed: Mutex::default(),
            kernels: Mutex::default(),
            transposes: Mutex::default(),
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

    /// Warm start: loads now, from the disk cache, the programs this function built under
    /// `tag` in earlier processes (for their last few input signatures), so that its first
    /// calls on `device` run at once instead of loading their executables then; and lists
    /// under `tag` each program it builds from now on. `tag` names the function and what it
    /// traces (a model's component and architecture): programs listed under it for another
    /// plugin, its flags or another device are skipped, and a program loaded here but never
    /// called again only costs its load. Nothing without a disk cache, for partitioned
    /// functions, or off PJRT devices.
    pub fn warm_start(mut self, tag: impl Into<String>, device: &OxiDevice) -> Self {
        let tag = tag.into();
        let (Some(dir), None) = (&self.disk_cache, &self.spmd) else {
            return self;
        };
        let Some(client) = crate::channel::pjrt_client(device) else {
            return self;
        };
        let Ok((pjrt_client, pjrt_device)) = client.target() else {
            return self;
        };
        let started = Instant::now();
        let mut warmed = HashMap::new();
        for (key, outputs) in compile_cache::warm_keys(dir, &tag, pjrt_client, pjrt_device.id()) {
            let path = compile_cache::entry_path(dir, &key);
            // A damaged entry is reported (and replaced) when a call needs it.
            if let Ok(Some(exe)) = compile_cache::load_executable(&path, &key, pjrt_client, outputs)
            {
                warmed.insert(key, exe);
            }
        }
        if log_compiles() {
            eprintln!(
                "oxidiff: warm start of `{}`: {} program(s) loaded from the disk cache in {:.1?}",
                self.name,
                warmed.len(),
                started.elapsed()
            );
        }
        self.warmed = Mutex::new(warmed);
        self.warm_tag = Some(tag);
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

    /// XLA compiles this function ran: programs not loaded from the disk cache, and the small
    /// programs that lay captured kernels out for them.
    pub fn xla_compiles(&self) -> u64 {
        let programs = lock(&self.log).iter().filter(|i| !i.from_disk).count() as u64;
        programs + lock(&self.transposes).compiled
    }

    /// Executables this function loaded from the disk cache instead of compiling (programs
    /// and kernel transposes).
    pub fn disk_loads(&self) -> u64 {
        let programs = lock(&self.log).iter().filter(|i| i.from_disk).count() as u64;
        programs + lock(&self.transposes).loaded
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

    /// Traces the closure on `tensors`, builds its program and runs it; the
    /// program is cached under `signature` once it ran.
    fn trace_and_compile(
        &self,
        client: PjrtClient,
        device: OxiDevice,
        signature: Signature,
        tensors: Vec<RouterTensor<OxiClient>>,
        irs: Vec<TensorIr>,
    ) -> Result<O, CompileError> {
        let traced = self.trace(&client, &device, tensors);
        let result = self.build_and_run(&client, &device, &signature, &irs, &traced);
        // What the trace dropped or consumed is freed whether or not the
        // program was built and ran (the program owns what it kept).
        client.with_buffers(|buffers| {
            for id in &traced.released {
                buffers.remove(id);
            }
        });
        let program = result?;
        lock(&self.programs).insert(signature, program);
        Ok(O::unflatten(&mut traced.outputs.into_iter()))
    }

    /// The phases after the trace, in order: lower, gather the arguments'
    /// sources, partition, donate, compile (or load from disk), run.
    fn build_and_run(
        &self,
        client: &PjrtClient,
        device: &OxiDevice,
        signature: &Signature,
        irs: &[TensorIr],
        traced: &Trace,
    ) -> Result<Arc<Program>, CompileError> {
        let name = &self.name;
        let run_error = |message: String| CompileError::Run {
            name: name.clone(),
            device: device.clone(),
            message,
        };
        let (_, out_device) = self.pjrt_client(&traced.outputs, "output")?;
        if out_device != *device {
            return Err(CompileError::Placement {
                name: name.clone(),
                message: format!("its outputs are on {out_device} but its inputs on {device}"),
            });
        }
        let out_irs: Vec<TensorIr> = traced.outputs.iter().map(ir_of).collect();
        let ops = traced.recording.ops.len();

        let (pjrt_client, pjrt_device) = client.target().map_err(run_error)?;
        let started = Instant::now();
        let mut function = self.lower(
            irs,
            &traced.recording.ops,
            &out_irs,
            pjrt_device.kind(),
            pjrt_client.plugin(),
        )?;
        let lower = started.elapsed();

        let arguments = self
            .sources(client, &function, irs, &traced.released)
            .map_err(run_error)?;
        let (mut module, replicas) = self.partition(device, &mut function, &arguments.sources)?;
        let donated = self.mark_donations(
            &mut module,
            signature,
            &arguments.sources,
            &function,
            out_irs.len(),
        )?;
        let built = self.compile(
            &module,
            signature,
            (pjrt_client, pjrt_device),
            device,
            ops,
            out_irs.len(),
        )?;

        let info = CompileInfo {
            reason: built.reason,
            ops,
            module_bytes: module.len(),
            arguments: arguments.sources.len(),
            inputs: irs.len(),
            captured: arguments.captured,
            scalars: arguments.scalars,
            random: arguments.random,
            donated: donated.len(),
            kernel_calls: function.kernel_calls,
            from_disk: built.from_disk,
            warm_start: built.warm_start,
            rejected_cache_entry: built.rejected,
            trace: traced.took,
            lower,
            compile: built.took,
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
            executable: built.executable,
            sources: arguments.sources,
            outputs: out_irs.iter().map(|t| (t.shape.clone(), t.dtype)).collect(),
            donated,
            replicas,
        });
        let copies = self.donated_copies(client, device, &program, irs, &traced.released)?;
        let out_ids: Vec<TensorId> = out_irs.iter().map(|t| t.id).collect();
        let started = Instant::now();
        self.run(client, device, &program, irs, &out_ids, &copies)?;
        if log_compiles() {
            eprintln!(
                "oxidiff: `{name}`'s first run (enqueued) took {:.1?}",
                started.elapsed()
            );
        }
        Ok(program)
    }
}
