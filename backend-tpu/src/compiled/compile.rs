//! The compile phase: the module compiled by PJRT for the device (or the
//! mesh), or loaded from the disk cache; [`CompileInfo`] says what it did.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::tensors::Tensors;
use super::trace::Signature;
use super::{compiles, lock, CompileError, CompiledFn};
use crate::compile_cache::{
    disk_key, entry_path, load_executable, remember_warm, store_executable,
};
use crate::device::OxiDevice;
use crate::pjrt::{self, CompileOptions, LoadedExecutable};

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
    /// Attention ops lowered to the kernel hub's kernels.
    pub kernel_calls: usize,
    /// Whether the executable came from the on-disk cache instead of a
    /// compile.
    pub from_disk: bool,
    /// Whether it was loaded from there ahead of the call, at warm start
    /// ([`CompiledFn::warm_start`]).
    pub warm_start: bool,
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
            if self.warm_start {
                "loaded from the disk cache at warm start"
            } else if self.from_disk {
                "loaded from the disk cache"
            } else {
                "compiled"
            },
            self.compile
        )?;
        if self.kernel_calls > 0 {
            write!(f, "; {} attentions as kernel hub calls", self.kernel_calls)?;
        }
        if let Some(rejected) = &self.rejected_cache_entry {
            write!(f, " (the disk cache entry {rejected})")?;
        }
        Ok(())
    }
}

/// An executable, and how it was obtained.
pub(super) struct Built {
    pub(super) executable: LoadedExecutable,
    /// Why it was built ([`CompileInfo::reason`]).
    pub(super) reason: String,
    pub(super) from_disk: bool,
    /// Loaded at warm start.
    pub(super) warm_start: bool,
    /// A refused disk cache entry, and why ([`CompileInfo::rejected_cache_entry`]).
    pub(super) rejected: Option<String>,
    /// Loading or compiling.
    pub(super) took: Duration,
}

impl<I: Tensors, O: Tensors, F: Fn(I) -> O> CompiledFn<I, O, F> {
    /// Compiles `module` (traced from `ops` ops, with `outputs` results) for
    /// `target`, or loads the executable an earlier process compiled.
    pub(super) fn compile(
        &self,
        module: &str,
        signature: &Signature,
        target: (&pjrt::Client, &pjrt::Device),
        device: &OxiDevice,
        ops: usize,
        outputs: usize,
    ) -> Result<Built, CompileError> {
        let name = &self.name;
        let (pjrt_client, pjrt_device) = target;
        let started = Instant::now();
        let key = disk_key(module, pjrt_client, pjrt_device.id());
        let disk = self
            .disk_cache
            .as_ref()
            .filter(|_| self.spmd.is_none())
            .map(|dir| entry_path(dir, &key));
        let mut rejected = None;
        let warmed = lock(&self.warmed).remove(&key);
        let warm_start = warmed.is_some();
        let loaded = warmed.or_else(|| {
            disk.as_ref().and_then(|path| {
                match load_executable(path, &key, pjrt_client, outputs) {
                    Ok(exe) => exe,
                    Err(why) => {
                        // Detected before the plugin sees the bytes (header,
                        // length, checksum) or refused by it: drop the entry and
                        // compile; the fresh executable replaces it.
                        let _ = std::fs::remove_file(path);
                        let message = format!("{}: {why}; rebuilt", path.display());
                        eprintln!("oxidiff: warning: `{name}`: the cached executable {message}");
                        rejected = Some(message);
                        None
                    }
                }
            })
        });
        let reason = self.compile_reason(signature);
        if loaded.is_none() {
            tracing::info!(target: "oxidiff::compile", program = %name, reason = %reason, "compiling");
        }
        let from_disk = loaded.is_some();
        let options = match &self.spmd {
            Some(spmd) => spmd.compile_options(),
            None => CompileOptions::on_device(i64::from(pjrt_device.id())),
        };
        let compiled = match loaded {
            Some(exe) => Ok(exe),
            None => pjrt_client.compile(module, &options).inspect(|exe| {
                compiles().fetch_add(1, Ordering::Relaxed);
                if let Some(path) = &disk {
                    if let Err(e) = store_executable(path, &key, exe) {
                        eprintln!(
                            "oxidiff: warning: `{name}`: the compile cache could not store {}: {e}",
                            path.display()
                        );
                    }
                }
            }),
        };
        let executable = compiled.map_err(|e| CompileError::Compile {
            name: name.clone(),
            device: device.clone(),
            ops,
            message: e.to_string(),
        })?;
        if let (Some(dir), Some(tag)) = (self.disk_cache.as_ref(), self.warm_tag.as_ref()) {
            if let Err(e) = remember_warm(dir, tag, &key, outputs) {
                eprintln!(
                    "oxidiff: warning: `{name}`: the compile cache could not list its program for warm starts in {}: {e}",
                    dir.display()
                );
            }
        }
        Ok(Built {
            executable,
            reason,
            from_disk,
            warm_start,
            rejected,
            took: started.elapsed(),
        })
    }

    /// Why a program is built for `signature`: the first call, or a new
    /// signature beside the cached ones.
    fn compile_reason(&self, signature: &Signature) -> String {
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
    }
}
