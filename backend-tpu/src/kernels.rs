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

/// Environment variable: the kernel hub's folder (`kernels/` of this repository); unset, no
/// kernel is spliced.
pub const KERNELS_ENV: &str = "OXIDIFF_KERNELS";
/// Environment variable: where spliced kernels run when the device does not say: `interpret`
/// (any device: the interpret-mode artifacts, as the tests use on XLA's CPU plugin) or
/// `tpu:GENERATION`. On a TPU device its own generation is used.
pub const KERNEL_TARGET_ENV: &str = "OXIDIFF_KERNEL_TARGET";

/// The attention kernels a lowering may splice in: a hub and the target its program runs on.
#[derive(Debug)]
pub struct AttentionKernels {
    pub hub: KernelHub,
    pub target: KernelTarget,
    /// Reasons already logged, so each is logged once.
    logged: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl AttentionKernels {
    pub fn new(hub: KernelHub, target: KernelTarget) -> Self {
        Self {
            hub,
            target,
            logged: Default::default(),
        }
    }

    /// The kernels [`KERNELS_ENV`] enables for a program on a device of `device_kind` (PJRT's
    /// device kind, `TPU v5 lite`, `cpu`, ...): a TPU's own generation, else
    /// [`KERNEL_TARGET_ENV`]; `None` when the hub is not enabled or no target applies. Read
    /// once per device kind (so each miss is logged once).
    pub fn from_env(device_kind: &str) -> Option<std::sync::Arc<Self>> {
        type Cache = std::sync::Mutex<
            std::collections::HashMap<String, Option<std::sync::Arc<AttentionKernels>>>,
        >;
        static CACHE: std::sync::OnceLock<Cache> = std::sync::OnceLock::new();
        let mut cache = CACHE
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        cache
            .entry(device_kind.to_string())
            .or_insert_with(|| Self::read_env(device_kind).map(std::sync::Arc::new))
            .clone()
    }

    fn read_env(device_kind: &str) -> Option<Self> {
        let dir = std::env::var_os(KERNELS_ENV)?;
        let target = match tpu_generation(device_kind) {
            Some(generation) => KernelTarget::Tpu(generation),
            None => match std::env::var(KERNEL_TARGET_ENV).ok()?.as_str() {
                "interpret" => KernelTarget::Interpret,
                other => KernelTarget::Tpu(other.strip_prefix("tpu:")?.to_string()),
            },
        };
        Some(Self::new(KernelHub::open(Path::new(&dir)), target))
    }

    /// The flash attention kernel for q, k and v of `shape` in `dtype` with softmax scale
    /// `scale`; a miss is logged once (and the plain lowering used).
    pub fn flash_attention(&self, shape: &[usize], dtype: &str, scale: f64) -> Option<Kernel> {
        let found = self.hub.find(&KernelRequest {
            name: "flash_attention",
            shape,
            dtype,
            target: self.target.clone(),
        });
        let miss = match found {
            Ok(kernel) if (kernel.sm_scale - scale).abs() <= 1e-9 * scale.abs() => {
                return Some(kernel)
            }
            Ok(kernel) => format!(
                "kernel {} was exported for softmax scale {}, the attention uses {scale}",
                kernel.file.display(),
                kernel.sm_scale
            ),
            Err(miss) => miss.to_string(),
        };
        self.log_once(&miss);
        None
    }

    /// Logs why attention is lowered plainly, once per reason.
    pub fn log_once(&self, reason: &str) {
        let mut logged = self.logged.lock().unwrap_or_else(|p| p.into_inner());
        if logged.insert(reason.to_string()) {
            tracing::info!("plain attention lowering: {reason}");
        }
    }
}

/// The TPU generation of a PJRT device kind (`TPU v5 lite` and `TPU v5e` are v5e, `TPU v6
/// lite` and `TPU v6e` v6e, `TPU v5p` v5p, `TPU v4` v4); `None` for other devices.
pub fn tpu_generation(device_kind: &str) -> Option<String> {
    let rest = device_kind.strip_prefix("TPU ")?.to_ascii_lowercase();
    let mut words = rest.split_whitespace();
    let version = words.next()?;
    Some(match words.next() {
        Some("lite") => format!("{version}e"),
        _ => version.to_string(),
    })
}

/// The functions of an exported module, ready to append to another module: location
/// information dropped, the module wrapper removed, every function renamed with `prefix` (its
/// `@main` made private). Returns the functions' text and the name of the entry function.
pub fn inline_functions(mlir: &str, prefix: &str) -> Result<(String, String), String> {
    let stripped = strip_locations(mlir);
    let mut lines: Vec<&str> = stripped
        .lines()
        .filter(|l| !l.trim_start().starts_with("#loc") && !l.trim().is_empty())
        .collect();
    match (lines.first(), lines.last()) {
        (Some(first), Some(last)) if first.starts_with("module") && last.trim() == "}" => {
            lines.remove(0);
            lines.pop();
        }
        _ => return Err("not one `module { ... }`".into()),
    }
    let mut text = lines.join("\n");
    let mut names = Vec::new();
    for marker in ["func.func public @", "func.func private @"] {
        for (at, _) in text.match_indices(marker) {
            let name: String = text[at + marker.len()..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '.')
                .collect();
            names.push(name);
        }
    }
    if !names.iter().any(|n| n == "main") {
        return Err("no `@main` function".into());
    }
    // Longest names first, so that no name is renamed inside a longer one.
    names.sort_by_key(|n| std::cmp::Reverse(n.len()));
    for name in &names {
        text = text.replace(&format!("@{name}("), &format!("@{prefix}{name}("));
    }
    let text = text.replace(
        &format!("func.func public @{prefix}main("),
        &format!("func.func private @{prefix}main("),
    );
    Ok((format!("{text}\n"), format!("{prefix}main")))
}

/// `text` without its ` loc(...)` annotations (balanced parentheses, quoted strings skipped).
fn strip_locations(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(" loc(") {
        out.push_str(&rest[..at]);
        let mut depth = 0usize;
        let mut in_string = false;
        let mut escaped = false;
        let mut end = rest.len();
        for (i, c) in rest[at + 1..].char_indices() {
            if in_string {
                match (escaped, c) {
                    (true, _) => escaped = false,
                    (false, '\\') => escaped = true,
                    (false, '"') => in_string = false,
                    _ => {}
                }
                continue;
            }
            match c {
                '"' => in_string = true,
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth == 0 {
                        end = at + 1 + i + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::{inline_functions, tpu_generation};

    #[test]
    fn tpu_generations_follow_the_device_kind() {
        assert_eq!(tpu_generation("TPU v5 lite").as_deref(), Some("v5e"));
        assert_eq!(tpu_generation("TPU v6 lite").as_deref(), Some("v6e"));
        assert_eq!(tpu_generation("TPU v5p").as_deref(), Some("v5p"));
        assert_eq!(tpu_generation("TPU v4").as_deref(), Some("v4"));
        assert_eq!(tpu_generation("cpu"), None);
    }

    #[test]
    fn an_exported_module_inlines_renamed_without_locations() {
        let mlir = "#loc1 = loc(\"q\")\nmodule @jit_f attributes {a = 1 : i32} {\n  func.func public @main(%arg0: tensor<2xf32> loc(\"q\")) -> (tensor<2xf32> {jax.result_info = \"r\"}) {\n    %0 = call @f(%arg0) : (tensor<2xf32>) -> tensor<2xf32> loc(callsite(#loc1 at \"x(y)\"))\n    return %0 : tensor<2xf32> loc(#loc1)\n  } loc(#loc1)\n  func.func private @f(%arg0: tensor<2xf32>) -> tensor<2xf32> {\n    %0 = stablehlo.custom_call @tpu_custom_call(%arg0) : (tensor<2xf32>) -> tensor<2xf32>\n    return %0 : tensor<2xf32>\n  }\n}\n";
        let (text, entry) = inline_functions(mlir, "k0_").unwrap();
        assert_eq!(entry, "k0_main");
        assert!(!text.contains("loc("), "{text}");
        assert!(text.contains("func.func private @k0_main("), "{text}");
        assert!(text.contains("call @k0_f(%arg0)"), "{text}");
        assert!(text.contains("@tpu_custom_call("), "{text}");
        assert!(!text.contains("module"), "{text}");
    }
}
