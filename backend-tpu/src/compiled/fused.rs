//! Fused calls: a piece of code over [`Oxi`](crate::Oxi) tensors whose ops are recorded on
//! every call and run as one program, compiled once per structure. It suits small, stateful
//! code that host values steer, such as a scheduler step: the code runs on every call (its
//! host branches and state updates happen as usual), only its tensor ops are recorded, and
//! every scalar of them is a program argument ([`crate::lowering`]), so a new step index,
//! sigma or coefficient reuses the program. Every tensor the ops produced that a handle still
//! refers to when the code returns (its results, and what it kept, such as a multistep
//! scheduler's history) is an output of the program.
//!
//! Where [`CompiledFn`](super::CompiledFn) traces once per input signature and reruns the
//! program without the closure, a [`Fused`] call always runs the code; the saving is in the
//! device work: one execution instead of one per op, and one disk-cached executable per
//! structure instead of one per op. Ops that cannot be lowered run op by op instead.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use burn_ir::{TensorId, TensorIr};

use super::lower::lower_recorded_with;
use super::run::{bind_results, upload_rng_state, upload_scalar};
use super::trace::TraceGuard;
use super::{compiles, lock, CompileError};
use crate::compile_cache::{self, log_compiles};
use crate::device::OxiDevice;
use crate::eager::PjrtClient;
use crate::lowering::{Argument, LoweredFunction, Lowerer};
use crate::pjrt::{Buffer, LoadedExecutable};
use crate::recording::{tracing_any, Recording};

/// Counts of a [`Fused`] call so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FusedStats {
    /// Calls that recorded at least one op.
    pub calls: u64,
    /// Distinct structures met, one program each.
    pub programs: u64,
    /// Of those, how many XLA compiled; the others were loaded from the disk cache.
    pub xla_compiles: u64,
    pub disk_loads: u64,
    /// Calls whose ops ran one by one because they could not be lowered or compiled.
    pub eager_fallbacks: u64,
}

/// Code over tensors of one PJRT device run as one program per call (see the module docs).
pub struct Fused {
    name: String,
    /// Executables by module text (scalar-free, so one serves every scalar value).
    programs: Mutex<HashMap<String, Arc<LoadedExecutable>>>,
    stats: Mutex<FusedStats>,
    disk_cache: Option<PathBuf>,
}

impl Fused {
    /// A fused call named `name` (in logs and errors); executables are kept on disk where
    /// [`COMPILE_CACHE_ENV`](crate::compile_cache::COMPILE_CACHE_ENV) says.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            programs: Mutex::default(),
            stats: Mutex::default(),
            disk_cache: compile_cache::dir_from_env(),
        }
    }

    /// Keeps serialized executables in `dir` (as [`CompiledFn::with_disk_cache`](super::CompiledFn::with_disk_cache)).
    pub fn with_disk_cache(mut self, dir: impl Into<PathBuf>) -> Self {
        self.disk_cache = Some(dir.into());
        self
    }

    /// What was run so far.
    pub fn stats(&self) -> FusedStats {
        *lock(&self.stats)
    }

    /// Runs `f` with its ops on `device` recorded, then runs them as one program and binds
    /// every tensor they produced that is still referenced. On the CPU device, inside another
    /// trace, or for code without ops, `f` just runs. A program that cannot be built falls
    /// back to running the recorded ops one by one (counted in
    /// [`FusedStats::eager_fallbacks`]); only a failed execution is an error, and then the
    /// tensors `f` made are left without values (reading them fails).
    pub fn run<R>(&self, device: &OxiDevice, f: impl FnOnce() -> R) -> Result<R, CompileError> {
        let client = match crate::channel::pjrt_client(device) {
            Some(client) if !tracing_any() => client,
            _ => return Ok(f()),
        };
        let started = Instant::now();
        let guard = TraceGuard::start(device.clone(), client.clone());
        let result = f();
        let recording = guard.finish();
        if recording.ops.is_empty() {
            free(&client, recording.released.iter());
            return Ok(result);
        }
        lock(&self.stats).calls += 1;
        let live = recording.live();
        let program = lower_recorded_with(Lowerer::new(), &[], &recording.ops, &live)
            .map_err(|e| e.to_string())
            .and_then(|function| {
                let program = self.program(&client, &function, recording.ops.len(), started)?;
                Ok((function, program))
            });
        match program {
            Ok((function, program)) => {
                let ran = self.execute(&client, &function, &program, &live);
                free(&client, recording.released.iter());
                ran.map_err(|message| CompileError::Run {
                    name: self.name.clone(),
                    device: device.clone(),
                    message,
                })?;
            }
            Err(why) => {
                tracing::debug!(target: "oxidiff::compile", program = %self.name, %why, "ran op by op");
                lock(&self.stats).eager_fallbacks += 1;
                replay(&client, recording);
            }
        }
        Ok(result)
    }

    /// The executable of `function`: cached, loaded from disk, or compiled.
    fn program(
        &self,
        client: &PjrtClient,
        function: &LoweredFunction,
        ops: usize,
        started: Instant,
    ) -> Result<Arc<LoadedExecutable>, String> {
        if let Some(exe) = lock(&self.programs).get(&function.module) {
            return Ok(exe.clone());
        }
        let (pjrt_client, pjrt_device) = client.target()?;
        let compile_started = Instant::now();
        let (exe, from_disk) = compile_cache::load_or_compile(
            pjrt_client,
            pjrt_device,
            &function.module,
            self.disk_cache.as_deref(),
            function.results.len(),
        )
        .map_err(|e| format!("compiling it failed: {e}"))?;
        {
            let mut stats = lock(&self.stats);
            stats.programs += 1;
            if from_disk {
                stats.disk_loads += 1;
            } else {
                stats.xla_compiles += 1;
                compiles().fetch_add(1, Ordering::Relaxed);
            }
        }
        if log_compiles() {
            eprintln!(
                "oxidiff: fused `{}`: new structure ({ops} ops, {} arguments, {} outputs), recorded and lowered in {:.1?}, {} in {:.1?}",
                self.name,
                function.arguments.len(),
                function.results.len(),
                compile_started.duration_since(started),
                if from_disk { "loaded from the disk cache" } else { "compiled" },
                compile_started.elapsed(),
            );
        }
        let exe = Arc::new(exe);
        lock(&self.programs).insert(function.module.clone(), exe.clone());
        Ok(exe)
    }

    /// Runs `exe` on the arguments `function` names (this call's tensors, scalars and random
    /// states) and binds its results to the `live` tensors.
    fn execute(
        &self,
        client: &PjrtClient,
        function: &LoweredFunction,
        exe: &LoadedExecutable,
        live: &[TensorIr],
    ) -> Result<(), String> {
        let (pjrt_client, pjrt_device) = client.target()?;
        let mut owned: Vec<Buffer> = Vec::new();
        let mut tensors: Vec<TensorId> = Vec::new();
        for (argument, ty) in &function.arguments {
            match argument {
                Argument::Tensor(id) => tensors.push(*id),
                Argument::Scalar(scalar) => {
                    owned.push(upload_scalar((pjrt_client, pjrt_device), *scalar, ty)?);
                }
                Argument::RngState => {
                    let devices = std::slice::from_ref(pjrt_device);
                    owned.extend(upload_rng_state(client, pjrt_client, devices)?);
                }
                Argument::Permuted { .. } => {
                    return Err("a permuted kernel in a fused call (a bug)".to_string())
                }
            }
        }
        client.restore(tensors.iter().copied());
        let results = client.with_buffers(|buffers| {
            let (mut owned, mut tensors) = (owned.iter(), tensors.iter());
            let mut args = Vec::with_capacity(function.arguments.len());
            for (argument, _) in &function.arguments {
                let buffer = match argument {
                    Argument::Tensor(_) => {
                        let id = tensors.next().ok_or("an argument is missing (a bug)")?;
                        buffers.get(id).ok_or_else(|| {
                            format!("tensor {id}, which the fused ops read, is not on the device (was it produced by an op that failed?)")
                        })?
                    }
                    _ => owned.next().ok_or("an argument is missing (a bug)")?,
                };
                args.push(buffer);
            }
            exe.execute(&args)
                .map_err(|e| format!("execution failed: {e}"))
        })?;
        let ids: Vec<TensorId> = live.iter().map(|t| t.id).collect();
        bind_results(client, &ids, results)
    }
}

/// Frees the buffers of `ids` in the eager client.
fn free<'a>(client: &PjrtClient, ids: impl Iterator<Item = &'a TensorId>) {
    client.with_buffers(|buffers| {
        for id in ids {
            buffers.remove(id);
        }
    });
}

/// Runs the recorded ops one by one on the eager client, then frees what the code released
/// and what it made and dropped.
fn replay(client: &PjrtClient, recording: Recording) {
    let Recording { ops, released, .. } = &recording;
    for op in ops.iter().cloned() {
        client.register_op(op);
    }
    free(client, released.iter());
    free(client, recording.gone());
}
