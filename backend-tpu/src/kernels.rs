//! The kernel hub: hand-written kernels as versioned artifacts, found by name, shape, dtype and
//! target. `tools/kernels/` exports JAX's Pallas kernels as StableHLO into `kernels/NAME/`: for
//! each shape bucket and dtype, a `tpu` artifact (a `tpu_custom_call` carrying the Mosaic
//! kernel, which libtpu compiles for its chip) and an `interpret` artifact (the same kernel in
//! Pallas' interpret mode: plain StableHLO, run and tested on XLA's CPU plugin), listed in
//! `manifest.json` with their source, jax version, parameters and sha256. Nothing here needs
//! Python: an artifact is read, checked and handed on as MLIR text.
//!
//! A request the hub cannot serve is a [`KernelMiss`] whose `Display` is a one-line reason (no
//! kernel of that name, no bucket of that shape or dtype, another TPU generation, another jax
//! version, a damaged file), so the caller logs it once and uses the plain lowering.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use sha2::{Digest, Sha256};

/// The jax version whose exports this build reads: the custom call's ABI and the interpret
/// mode's lowering are jax's, so artifacts of another version are refused.
pub const JAX_VERSION: &str = "0.10.2";

/// Where a kernel is to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelTarget {
    /// A TPU of this generation (`v5e`, `v6e`): the Mosaic custom call.
    Tpu(String),
    /// Any XLA device, the kernel interpreted as plain StableHLO (XLA's CPU plugin in tests).
    Interpret,
}

impl fmt::Display for KernelTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Tpu(generation) => write!(f, "TPU {generation}"),
            Self::Interpret => f.write_str("interpret mode"),
        }
    }
}

/// What a caller asks the hub for.
#[derive(Debug, Clone)]
pub struct KernelRequest<'a> {
    pub name: &'a str,
    /// The kernel's input shape (for attention: `[batch, heads, sequence, head_dim]`).
    pub shape: &'a [usize],
    /// `float32` or `bfloat16`, as numpy names them.
    pub dtype: &'a str,
    pub target: KernelTarget,
}

/// An artifact found and checked: its StableHLO module, `@main(q, k, v)` for attention.
#[derive(Debug, Clone)]
pub struct Kernel {
    pub name: String,
    pub file: PathBuf,
    pub mlir: String,
    /// The softmax scale the kernel was exported with.
    pub sm_scale: f64,
}

/// Why the hub serves no kernel for a request: one line, for a log.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KernelMiss {
    #[error("no kernel `{name}` in the kernel hub {dir}")]
    NoKernel { name: String, dir: PathBuf },
    #[error("kernel `{name}` was exported with jax {found}; this build reads jax {JAX_VERSION}'s exports: export it again with tools/kernels/")]
    JaxVersion { name: String, found: String },
    #[error(
        "kernel `{name}` has no artifact for {shape:?} {dtype} ({target}); it has {available}"
    )]
    NoBucket {
        name: String,
        shape: Vec<usize>,
        dtype: String,
        target: KernelTarget,
        available: String,
    },
    #[error("kernel `{name}` for {shape:?} {dtype} is not exported for TPU {generation} (only {generations})")]
    Generation {
        name: String,
        shape: Vec<usize>,
        dtype: String,
        generation: String,
        generations: String,
    },
    #[error("kernel artifact {file} is damaged ({reason}): export it again with tools/kernels/")]
    Damaged { file: PathBuf, reason: String },
}

/// `manifest.json` of one kernel.
#[derive(Debug, Clone, Deserialize)]
struct Manifest {
    kernel: String,
    jax: String,
    artifacts: Vec<Artifact>,
}

#[derive(Debug, Clone, Deserialize)]
struct Artifact {
    file: String,
    target: String,
    #[serde(default)]
    tpu_generations: Vec<String>,
    shape: Vec<usize>,
    dtype: String,
    sm_scale: f64,
    sha256: String,
}

/// The kernels of one folder (`kernels/`): each subfolder with a `manifest.json`.
#[derive(Debug, Clone)]
pub struct KernelHub {
    dir: PathBuf,
    kernels: Vec<(PathBuf, Result<Manifest, String>)>,
}

impl KernelHub {
    /// Reads the manifests under `dir`. A manifest that cannot be read is kept as a reason, so
    /// a request for that kernel says why it misses; a missing `dir` is an empty hub.
    pub fn open(dir: &Path) -> Self {
        let mut kernels = Vec::new();
        if let Ok(entries) = std::fs::read_dir(dir) {
            let mut folders: Vec<PathBuf> = entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.join("manifest.json").is_file())
                .collect();
            folders.sort();
            for folder in folders {
                let path = folder.join("manifest.json");
                let manifest = std::fs::read_to_string(&path)
                    .map_err(|e| e.to_string())
                    .and_then(|text| serde_json::from_str(&text).map_err(|e| e.to_string()));
                kernels.push((folder, manifest));
            }
        }
        Self {
            dir: dir.to_path_buf(),
            kernels,
        }
    }

    /// The names of the kernels it holds (readable manifests only).
    pub fn names(&self) -> Vec<String> {
        self.kernels
            .iter()
            .filter_map(|(_, m)| m.as_ref().ok().map(|m| m.kernel.clone()))
            .collect()
    }

    /// The artifact for `request`, read and checked against its sha256.
    pub fn find(&self, request: &KernelRequest<'_>) -> Result<Kernel, KernelMiss> {
        let name = request.name;
        let (folder, manifest) = self
            .kernels
            .iter()
            .find(|(folder, m)| match m {
                Ok(m) => m.kernel == name,
                Err(_) => folder.file_name().is_some_and(|f| f == name),
            })
            .ok_or_else(|| KernelMiss::NoKernel {
                name: name.to_string(),
                dir: self.dir.clone(),
            })?;
        let manifest = manifest.as_ref().map_err(|reason| KernelMiss::Damaged {
            file: folder.join("manifest.json"),
            reason: reason.clone(),
        })?;
        if manifest.jax != JAX_VERSION {
            return Err(KernelMiss::JaxVersion {
                name: name.to_string(),
                found: manifest.jax.clone(),
            });
        }
        let kind = match request.target {
            KernelTarget::Tpu(_) => "tpu",
            KernelTarget::Interpret => "interpret",
        };
        let candidates: Vec<&Artifact> = manifest
            .artifacts
            .iter()
            .filter(|a| a.target == kind)
            .collect();
        let artifact = candidates
            .iter()
            .find(|a| a.shape == request.shape && a.dtype == request.dtype)
            .ok_or_else(|| KernelMiss::NoBucket {
                name: name.to_string(),
                shape: request.shape.to_vec(),
                dtype: request.dtype.to_string(),
                target: request.target.clone(),
                available: candidates
                    .iter()
                    .map(|a| format!("{:?} {}", a.shape, a.dtype))
                    .collect::<Vec<_>>()
                    .join(", "),
            })?;
        if let KernelTarget::Tpu(generation) = &request.target {
            if !artifact.tpu_generations.contains(generation) {
                return Err(KernelMiss::Generation {
                    name: name.to_string(),
                    shape: request.shape.to_vec(),
                    dtype: request.dtype.to_string(),
                    generation: generation.clone(),
                    generations: artifact.tpu_generations.join(", "),
                });
            }
        }
        let file = folder.join(&artifact.file);
        let damaged = |reason: String| KernelMiss::Damaged {
            file: file.clone(),
            reason,
        };
        let bytes = std::fs::read(&file).map_err(|e| damaged(e.to_string()))?;
        let digest: String = Sha256::digest(&bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        if digest != artifact.sha256 {
            return Err(damaged(format!(
                "sha256 {digest}, the manifest says {}",
                artifact.sha256
            )));
        }
        let mlir = String::from_utf8(bytes).map_err(|e| damaged(e.to_string()))?;
        Ok(Kernel {
            name: name.to_string(),
            file,
            mlir,
            sm_scale: artifact.sm_scale,
        })
    }
}
