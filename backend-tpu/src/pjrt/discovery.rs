//! Finding a PJRT plugin by name: `xla:cpu`, `tpu`, `cuda`, or a path.
//!
//! Places searched, in order:
//! 1. `OXIDIFF_PJRT_PLUGIN`: an explicit plugin file, used for every name;
//! 2. for `tpu`, `TPU_LIBRARY_PATH` (libtpu's own variable);
//! 3. plugin directories, each holding `<package>-<version>/<file>.so` as
//!    `tools/fetch-plugins.sh` lays them out: `OXIDIFF_PLUGIN_DIR` if set, the
//!    `.plugins` directory of the checkout this crate was built from, and the
//!    user cache `$XDG_CACHE_HOME/oxidiff/plugins` (`~/.cache/oxidiff/plugins`);
//! 4. Python site-packages where `pip install` puts the same packages
//!    (virtualenv, conda, `~/.local`, pyenv, `/usr/local`, `/usr`,
//!    `PYTHONPATH`), found by looking at those directories, not by running
//!    Python.

use std::env;
use std::path::{Path, PathBuf};

use super::error::{Error, Result};

/// The pinned plugin packages `tools/fetch-plugins.sh` installs.
pub const CPU_PLUGIN_PACKAGE: &str = "lammps-jax-pjrt-cpu";
pub const CPU_PLUGIN_VERSION: &str = "0.11.2";
pub const TPU_PLUGIN_PACKAGE: &str = "libtpu";
pub const TPU_PLUGIN_VERSION: &str = "0.0.52";

/// The kind of device a plugin drives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PluginKind {
    /// XLA's CPU plugin.
    XlaCpu,
    /// libtpu.
    Tpu,
    /// XLA's CUDA plugin (jax-cuda12-pjrt / jax-cuda13-pjrt).
    Cuda,
}

/// Where a kind's plugin file sits inside a plugin directory
/// (`<package>-<version>/<file>`) and inside site-packages.
struct Layout {
    /// Packages in order of preference; the first version listed is pinned.
    packages: &'static [(&'static str, &'static str, &'static str)],
    /// Paths relative to a site-packages directory.
    site_packages: &'static [&'static str],
}

impl PluginKind {
    /// The kind a plugin name asks for, if it is one of the known names.
    pub fn from_name(name: &str) -> Option<Self> {
        match name.to_ascii_lowercase().as_str() {
            "xla:cpu" | "cpu" | "xla-cpu" => Some(Self::XlaCpu),
            "tpu" | "libtpu" => Some(Self::Tpu),
            "cuda" | "gpu" | "xla:cuda" => Some(Self::Cuda),
            _ => None,
        }
    }

    /// A guess from a plugin file name.
    pub fn guess_from_path(path: &Path) -> Option<Self> {
        let name = path.file_name()?.to_string_lossy().to_ascii_lowercase();
        if name.contains("libtpu") {
            Some(Self::Tpu)
        } else if name.contains("cuda") {
            Some(Self::Cuda)
        } else if name.contains("cpu") {
            Some(Self::XlaCpu)
        } else {
            None
        }
    }

    /// The name used in oxidiff's device strings.
    pub fn name(self) -> &'static str {
        match self {
            Self::XlaCpu => "xla:cpu",
            Self::Tpu => "tpu",
            Self::Cuda => "cuda",
        }
    }

    /// The platform names a client of this kind may report.
    pub fn platform_names(self) -> &'static [&'static str] {
        match self {
            Self::XlaCpu => &["cpu"],
            Self::Tpu => &["tpu"],
            Self::Cuda => &["cuda", "gpu"],
        }
    }

    fn layout(self) -> Layout {
        match self {
            Self::XlaCpu => Layout {
                packages: &[
                    (
                        CPU_PLUGIN_PACKAGE,
                        CPU_PLUGIN_VERSION,
                        "pjrt_c_api_cpu_plugin.so",
                    ),
                    ("xla-cpu-pjrt", "0.0.1", "xla_cpu_pjrt.so"),
                ],
                site_packages: &[
                    "lammps_jax_pjrt_cpu/pjrt_c_api_cpu_plugin.so",
                    "xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so",
                ],
            },
            Self::Tpu => Layout {
                packages: &[(TPU_PLUGIN_PACKAGE, TPU_PLUGIN_VERSION, "libtpu.so")],
                site_packages: &["libtpu/libtpu.so"],
            },
            Self::Cuda => Layout {
                packages: &[
                    ("jax-cuda13-pjrt", "", "xla_cuda_plugin.so"),
                    ("jax-cuda12-pjrt", "", "xla_cuda_plugin.so"),
                ],
                site_packages: &[
                    "jax_plugins/xla_cuda13/xla_cuda_plugin.so",
                    "jax_plugins/xla_cuda12/xla_cuda_plugin.so",
                ],
            },
        }
    }

    /// The exact command that installs this kind's plugin.
    pub fn install_hint(self) -> String {
        let script = fetch_script();
        match self {
            Self::XlaCpu => format!(
                "Install it with `{script} --only cpu` (fetches {CPU_PLUGIN_PACKAGE}=={CPU_PLUGIN_VERSION} into {}), \
                 or `pip install {CPU_PLUGIN_PACKAGE}=={CPU_PLUGIN_VERSION}`, or set OXIDIFF_PJRT_PLUGIN to a plugin .so.",
                default_fetch_dir().display()
            ),
            Self::Tpu => format!(
                "Install it with `{script} --only tpu` (fetches {TPU_PLUGIN_PACKAGE}=={TPU_PLUGIN_VERSION} into {}), \
                 or `pip install {TPU_PLUGIN_PACKAGE}=={TPU_PLUGIN_VERSION}`, or set TPU_LIBRARY_PATH to libtpu.so.",
                default_fetch_dir().display()
            ),
            Self::Cuda => "Install it with `pip install jax-cuda12-pjrt` (or jax-cuda13-pjrt), \
                 or set OXIDIFF_PJRT_PLUGIN to xla_cuda_plugin.so."
                .to_string(),
        }
    }
}

/// The checkout this crate was built from (where `tools/` and `.plugins` are).
fn checkout_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

fn fetch_script() -> String {
    checkout_root()
        .join("tools/fetch-plugins.sh")
        .display()
        .to_string()
}

/// Where `tools/fetch-plugins.sh` puts plugins when given no directory.
fn default_fetch_dir() -> PathBuf {
    env::var_os("OXIDIFF_PLUGIN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| checkout_root().join(".plugins"))
}

/// `$XDG_CACHE_HOME/oxidiff/plugins`, or `~/.cache/oxidiff/plugins`.
pub fn user_plugin_dir() -> Option<PathBuf> {
    let cache = env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(cache.join("oxidiff").join("plugins"))
}

/// Where to look for plugins; [`PluginSearch::from_env`] fills it from the
/// environment, and the `with_*` methods add places.
#[derive(Clone, Debug, Default)]
pub struct PluginSearch {
    /// An explicit plugin file used for every name (`OXIDIFF_PJRT_PLUGIN`).
    pub explicit: Option<PathBuf>,
    /// libtpu's own override (`TPU_LIBRARY_PATH`).
    pub tpu_library_path: Option<PathBuf>,
    /// Directories laid out as `<package>-<version>/<file>.so`.
    pub plugin_dirs: Vec<PathBuf>,
    /// Python site-packages directories.
    pub site_packages: Vec<PathBuf>,
}

impl PluginSearch {
    /// The places listed in the module docs.
    pub fn from_env() -> Self {
        let non_empty = |name: &str| {
            env::var_os(name)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        let mut plugin_dirs = Vec::new();
        plugin_dirs.extend(non_empty("OXIDIFF_PLUGIN_DIR"));
        plugin_dirs.push(checkout_root().join(".plugins"));
        plugin_dirs.extend(user_plugin_dir());
        dedup(&mut plugin_dirs);
        Self {
            explicit: non_empty("OXIDIFF_PJRT_PLUGIN"),
            tpu_library_path: non_empty("TPU_LIBRARY_PATH"),
            plugin_dirs,
            site_packages: site_packages_dirs(),
        }
    }

    /// Also looks in `dir` (a plugin directory), before the others.
    pub fn with_plugin_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.plugin_dirs.insert(0, dir.into());
        dedup(&mut self.plugin_dirs);
        self
    }

    /// The plugin file for `kind`, or an error listing every place searched
    /// and how to install one.
    pub fn locate(&self, kind: PluginKind) -> Result<PathBuf> {
        let mut searched = Vec::new();
        let explicit = [
            ("OXIDIFF_PJRT_PLUGIN", self.explicit.as_ref(), true),
            (
                "TPU_LIBRARY_PATH",
                self.tpu_library_path.as_ref(),
                kind == PluginKind::Tpu,
            ),
        ];
        for (var, value, applies) in explicit {
            if !applies {
                continue;
            }
            match value {
                Some(path) if path.is_file() => return Ok(path.clone()),
                // An explicit setting that is wrong is an error, not a reason
                // to quietly pick another plugin.
                Some(path) => {
                    return Err(Error::PluginNotFound {
                        name: kind.name().to_string(),
                        searched: vec![format!("${var} = {} (no such file)", path.display())],
                        install: format!("Fix or unset {var}. {}", kind.install_hint()),
                    })
                }
                None => searched.push(format!("${var} (not set)")),
            }
        }
        let layout = kind.layout();
        for dir in &self.plugin_dirs {
            for (package, version, file) in layout.packages {
                if !version.is_empty() {
                    let pinned = dir.join(format!("{package}-{version}")).join(file);
                    if pinned.is_file() {
                        return Ok(pinned);
                    }
                }
                if let Some(found) = newest_versioned(dir, package, file) {
                    return Ok(found);
                }
                searched.push(
                    dir.join(format!("{package}-*"))
                        .join(file)
                        .display()
                        .to_string(),
                );
            }
        }
        for site in &self.site_packages {
            for rel in layout.site_packages {
                let candidate = site.join(rel);
                if candidate.is_file() {
                    return Ok(candidate);
                }
                searched.push(candidate.display().to_string());
            }
        }
        if self.site_packages.is_empty() {
            searched.push("Python site-packages (none found)".to_string());
        }
        Err(Error::PluginNotFound {
            name: kind.name().to_string(),
            searched,
            install: kind.install_hint(),
        })
    }
}

pub(super) fn looks_like_path(name: &str) -> bool {
    name.contains('/') || name.ends_with(".so")
}

fn dedup(dirs: &mut Vec<PathBuf>) {
    let mut seen = std::collections::HashSet::new();
    dirs.retain(|d| seen.insert(d.clone()));
}

/// `dir/<package>-<version>/file` with the highest version (by name).
fn newest_versioned(dir: &Path, package: &str, file: &str) -> Option<PathBuf> {
    let prefix = format!("{package}-");
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .map(|e| e.path().join(file))
        .filter(|p| p.is_file())
        .collect();
    sort_newest_first(&mut found);
    found.into_iter().next()
}

/// Subdirectories of `base` named `python3*`, each joined with `leaf`.
fn python_dirs(base: &Path, leaf: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(base) else {
        return Vec::new();
    };
    let mut dirs: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
        .map(|e| e.path().join(leaf))
        .filter(|p| p.is_dir())
        .collect();
    sort_newest_first(&mut dirs);
    dirs
}

/// Sorts paths by the numbers in their names, highest first (`3.13` before
/// `3.9`).
fn sort_newest_first(paths: &mut [PathBuf]) {
    let key = |p: &PathBuf| -> Vec<u64> {
        p.to_string_lossy()
            .split(|c: char| !c.is_ascii_digit())
            .filter_map(|n| n.parse().ok())
            .collect()
    };
    paths.sort_by_key(|p| std::cmp::Reverse(key(p)));
}

/// Python site-packages directories that exist on this machine, most
/// specific first.
fn site_packages_dirs() -> Vec<PathBuf> {
    let var = |name: &str| {
        env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let mut dirs = Vec::new();
    if let Some(paths) = env::var_os("PYTHONPATH") {
        dirs.extend(env::split_paths(&paths).filter(|p| p.is_dir()));
    }
    for prefix in [var("VIRTUAL_ENV"), var("CONDA_PREFIX")]
        .into_iter()
        .flatten()
    {
        dirs.extend(python_dirs(&prefix.join("lib"), "site-packages"));
    }
    let home = var("HOME");
    if let Some(home) = &home {
        dirs.extend(python_dirs(&home.join(".local/lib"), "site-packages"));
    }
    let pyenv = var("PYENV_ROOT").or_else(|| home.as_ref().map(|h| h.join(".pyenv")));
    if let Some(versions) = pyenv.map(|p| p.join("versions")) {
        if let Ok(entries) = std::fs::read_dir(&versions) {
            let mut prefixes: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
            sort_newest_first(&mut prefixes);
            for prefix in prefixes {
                dirs.extend(python_dirs(&prefix.join("lib"), "site-packages"));
            }
        }
    }
    for base in ["/usr/local/lib", "/usr/lib"] {
        dirs.extend(python_dirs(Path::new(base), "site-packages"));
        dirs.extend(python_dirs(Path::new(base), "dist-packages"));
    }
    let debian = Path::new("/usr/lib/python3/dist-packages");
    if debian.is_dir() {
        dirs.push(debian.to_path_buf());
    }
    dedup(&mut dirs);
    dirs
}
