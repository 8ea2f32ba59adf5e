//! Loading a PJRT plugin: `dlopen`, `GetPjrtApi`, version check,
//! `PJRT_Plugin_Initialize` and the plugin's attributes.
//!
//! A plugin is loaded and initialized once per process: loading the same file
//! again returns the same [`Plugin`], and a plugin is never unloaded (XLA
//! plugins start threads and register globals that do not survive `dlclose`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use super::api::{pjrt_call, read_named_values, Api, NamedValue};
use super::discovery::{looks_like_path, PluginKind, PluginSearch};
use super::error::{Error, Result};
use super::ffi::{self, Padded};

/// The oldest PJRT C API minor version oxidiff accepts (major must be 0): the
/// oldest plugin it is tested against, `xla-cpu-pjrt` 0.0.1.
pub const MIN_API_MINOR: i32 = 81;

/// A loaded and initialized PJRT plugin. Cheap to clone.
#[derive(Clone)]
pub struct Plugin {
    pub(crate) inner: Arc<PluginInner>,
}

pub(crate) struct PluginInner {
    pub(crate) api: Api,
    pub(crate) kind: Option<PluginKind>,
    attributes: Vec<(String, NamedValue)>,
    /// Keeps the library mapped; never dropped (see the module docs).
    _library: &'static libloading::Library,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin")
            .field("path", self.path())
            .field("api_version", &self.api_version())
            .field("kind", &self.inner.kind)
            .finish()
    }
}

/// The plugins loaded, by path: once per process ([`crate::process`]).
struct Loaded(Mutex<HashMap<PathBuf, Plugin>>);

fn registry() -> &'static Mutex<HashMap<PathBuf, Plugin>> {
    static LOADED: OnceLock<&'static Loaded> = OnceLock::new();
    &LOADED
        .get_or_init(|| crate::process::shared(|| Loaded(Mutex::new(HashMap::new()))))
        .0
}

impl Plugin {
    /// Finds and loads the plugin for `name`: `xla:cpu`, `tpu`, `cuda`, or a
    /// path to a plugin `.so`. See [`PluginSearch`] for where it looks.
    pub fn discover(name: &str) -> Result<Plugin> {
        PluginSearch::from_env().load(name)
    }

    /// Loads the plugin file at `path`, guessing its kind from the file name
    /// (`libtpu*` is TPU, `*cuda*` CUDA, `*cpu*` XLA CPU).
    pub fn load(path: impl AsRef<Path>) -> Result<Plugin> {
        let path = path.as_ref();
        Self::load_as(path, PluginKind::guess_from_path(path))
    }

    /// Loads the plugin file at `path` as a plugin of `kind`: clients of it
    /// must report that kind's platform.
    pub fn load_as(path: impl AsRef<Path>, kind: Option<PluginKind>) -> Result<Plugin> {
        let path = path.as_ref();
        let canonical = path.canonicalize().map_err(|e| Error::Load {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        let mut loaded = registry()
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(plugin) = loaded.get(&canonical) {
            return Ok(plugin.clone());
        }
        if kind == Some(PluginKind::Tpu) {
            prepare_libtpu_environment();
        }
        if kind == Some(PluginKind::XlaCpu) {
            prepare_xla_cpu_environment(&canonical);
        }
        let plugin = Self::open(&canonical, kind)?;
        loaded.insert(canonical, plugin.clone());
        drop(loaded);
        crate::host_kernels::register_with(&plugin);
        Ok(plugin)
    }

    fn open(path: &Path, kind: Option<PluginKind>) -> Result<Plugin> {
        // SAFETY: loading a shared library runs its initializers. The caller
        // asked for this file as a PJRT plugin; PJRT plugins are ordinary
        // shared libraries whose initializers are safe to run once, and the
        // registry makes sure each file is opened once per process.
        let library = unsafe { libloading::Library::new(path) }.map_err(|e| Error::Load {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        // SAFETY: `GetPjrtApi` is declared by the PJRT header as
        // `const PJRT_Api* GetPjrtApi(void)`, which `GetPjrtApiFn` matches.
        let get_api: ffi::GetPjrtApiFn =
            match unsafe { library.get::<ffi::GetPjrtApiFn>(b"GetPjrtApi\0") } {
                Ok(symbol) => *symbol,
                Err(e) => {
                    return Err(Error::NotAPlugin {
                        path: path.to_path_buf(),
                        reason: format!("it exports no GetPjrtApi symbol ({e})"),
                    })
                }
            };
        // SAFETY: calling the plugin's entry point, which takes no arguments;
        // `library` is still loaded.
        let table = unsafe { get_api() };
        if table.is_null() {
            return Err(Error::NotAPlugin {
                path: path.to_path_buf(),
                reason: "GetPjrtApi returned null".to_string(),
            });
        }
        // SAFETY: a non-null `GetPjrtApi` result points to the plugin's static
        // `PJRT_Api`, whose first field is its `struct_size`.
        let api = unsafe { Api::from_raw(table, path.to_path_buf()) };
        check_version(&api)?;
        // From here on the plugin runs: it is never unloaded (module docs), so
        // leak the handle.
        let library: &'static libloading::Library = Box::leak(Box::new(library));

        let mut init = Padded::<ffi::PJRT_Plugin_Initialize_Args>::new();
        // SAFETY: the arguments hold no pointers; initialization runs once per
        // process because of the registry.
        unsafe { pjrt_call!(&api, PJRT_Plugin_Initialize, &mut init) }?;

        let mut attrs = Padded::<ffi::PJRT_Plugin_Attributes_Args>::new();
        // SAFETY: out-parameters only.
        unsafe { pjrt_call!(&api, PJRT_Plugin_Attributes, &mut attrs) }?;
        // SAFETY: the plugin returned an array of `num_attributes` values that
        // live as long as the process.
        let attributes = unsafe { read_named_values(attrs.attributes, attrs.num_attributes) };

        Ok(Plugin {
            inner: Arc::new(PluginInner {
                api,
                kind,
                attributes,
                _library: library,
            }),
        })
    }

    /// The plugin file (canonical path).
    pub fn path(&self) -> &PathBuf {
        self.inner.api.path()
    }

    /// `(major, minor)` of the PJRT C API the plugin implements.
    pub fn api_version(&self) -> (i32, i32) {
        self.inner.api.version()
    }

    /// Size in bytes of the plugin's function table (`PJRT_Api.struct_size`).
    pub fn api_table_size(&self) -> usize {
        self.inner.api.table_size()
    }

    /// What the plugin was loaded as, if known.
    pub fn kind(&self) -> Option<PluginKind> {
        self.inner.kind
    }

    /// The plugin's attributes (`xla_version`, `stablehlo_current_version`, ...).
    pub fn attributes(&self) -> &[(String, NamedValue)] {
        &self.inner.attributes
    }

    /// The attribute called `name`.
    pub fn attribute(&self, name: &str) -> Option<&NamedValue> {
        self.inner
            .attributes
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v)
    }

    pub(crate) fn api(&self) -> &Api {
        &self.inner.api
    }

    /// Registers `handler` (an `XLA_FFI_Handler*`) as the typed XLA FFI custom-call target
    /// `target` on `platform` (XLA's platform name: `Host` for the CPU), through the plugin's
    /// PJRT FFI extension. An error says why not: no such extension, or the plugin refused.
    pub(crate) fn register_ffi_handler(
        &self,
        target: &str,
        handler: *mut std::ffi::c_void,
        platform: &str,
    ) -> Result<()> {
        let refused = |reason: String| Error::Pjrt {
            function: "PJRT_FFI_Register_Handler",
            code: crate::pjrt::ErrorCode::Unimplemented,
            message: reason,
        };
        let mut extension =
            self.inner.api.table().extension_start as *mut ffi::PJRT_Extension_Header;
        let register = loop {
            // SAFETY: the chain is the plugin's static list of extensions, each beginning
            // with a `PJRT_Extension_Base`; it lives as long as the library (never unloaded).
            let Some(header) = (unsafe { extension.as_ref() }) else {
                return Err(refused("the plugin has no PJRT FFI extension".into()));
            };
            if header.type_ == ffi::PJRT_Extension_Type_FFI {
                if header.struct_size < std::mem::size_of::<ffi::PJRT_FFI_Extension>() {
                    return Err(refused(format!(
                        "its FFI extension ({} bytes) has no handler registration",
                        header.struct_size
                    )));
                }
                // SAFETY: an FFI extension at least this long is a `PJRT_FFI_Extension`.
                let ffi_extension = unsafe { &*(extension as *const ffi::PJRT_FFI_Extension) };
                match ffi_extension.register_handler {
                    Some(register) => break register,
                    None => return Err(refused("its FFI extension registers no handlers".into())),
                }
            }
            extension = header.next;
        };
        let mut args = ffi::PJRT_FFI_Register_Handler_Args {
            struct_size: std::mem::size_of::<ffi::PJRT_FFI_Register_Handler_Args>(),
            target_name: target.as_ptr().cast(),
            target_name_size: target.len(),
            handler,
            platform_name: platform.as_ptr().cast(),
            platform_name_size: platform.len(),
            traits: 0,
        };
        // SAFETY: the arguments point to live strings and a handler that lives as long as the
        // process (a function of this library); the plugin copies the names.
        let error =
            unsafe { register((&mut args as *mut ffi::PJRT_FFI_Register_Handler_Args).cast()) };
        let first = self.inner.api.check("PJRT_FFI_Register_Handler", error);
        if first.is_ok() {
            return first;
        }
        // A plugin from before FFI extension version 3 checks for the larger struct that
        // carries `api_version`.
        let mut args = ffi::PJRT_FFI_Register_Handler_Args_V2 {
            struct_size: std::mem::size_of::<ffi::PJRT_FFI_Register_Handler_Args_V2>(),
            target_name: target.as_ptr().cast(),
            target_name_size: target.len(),
            api_version: 1,
            handler,
            platform_name: platform.as_ptr().cast(),
            platform_name_size: platform.len(),
            traits: 0,
        };
        // SAFETY: as above.
        let error =
            unsafe { register((&mut args as *mut ffi::PJRT_FFI_Register_Handler_Args_V2).cast()) };
        self.inner
            .api
            .check("PJRT_FFI_Register_Handler", error)
            .map_err(|second| match first {
                Err(first) => refused(format!("{first}; with the older layout: {second}")),
                Ok(()) => second,
            })
    }
}

/// The plugins loaded in this process so far.
pub(crate) fn loaded() -> Vec<Plugin> {
    registry()
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .values()
        .cloned()
        .collect()
}

/// Loading is the plugin's side of a search: [`PluginSearch`] only finds files.
impl PluginSearch {
    /// Finds and loads the plugin for `name` (a kind name or a path).
    pub fn load(&self, name: &str) -> Result<Plugin> {
        if looks_like_path(name) {
            return Plugin::load(name);
        }
        let kind = PluginKind::from_name(name)
            .ok_or_else(|| Error::UnknownPluginName(name.to_string()))?;
        let path = self.locate(kind)?;
        Plugin::load_as(path, Some(kind))
    }
}

fn check_version(api: &Api) -> Result<()> {
    let (major, minor) = api.version();
    if major != ffi::PJRT_API_MAJOR || minor < MIN_API_MINOR {
        return Err(Error::UnsupportedApiVersion {
            path: api.path().clone(),
            major,
            minor,
            min_minor: MIN_API_MINOR,
        });
    }
    Ok(())
}

/// Whether this machine exposes a TPU to user space (`/dev/accel*` on TPU
/// VMs up to v4, `/dev/vfio` from v5 on).
pub fn tpu_device_present() -> bool {
    let accel = std::fs::read_dir("/dev")
        .map(|entries| {
            entries
                .flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with("accel"))
        })
        .unwrap_or(false);
    accel || Path::new("/dev/vfio").exists()
}

/// Without a TPU, libtpu asks the cloud metadata server about the machine and
/// retries for minutes; `TPU_SKIP_MDS_QUERY=1` makes it fail at once. Set it
/// (unless the user set it either way) before libtpu is loaded.
///
/// This changes the process environment; it runs once, under the plugin
/// registry lock, before libtpu's code is in the process.
fn prepare_libtpu_environment() {
    if std::env::var_os("TPU_SKIP_MDS_QUERY").is_none() && !tpu_device_present() {
        std::env::set_var("TPU_SKIP_MDS_QUERY", "1");
    }
}

/// Environment variable: the XLA flags oxidiff gives XLA's CPU plugin instead of
/// [`XLA_CPU_DEFAULT_FLAGS`] (space-separated, as in `XLA_FLAGS`; empty for none). Flags in
/// `XLA_FLAGS` itself are always passed, after these, so they win.
pub const XLA_CPU_FLAGS_ENV: &str = "OXIDIFF_XLA_CPU_FLAGS";

/// The XLA flags oxidiff sets for XLA's CPU plugin unless [`XLA_CPU_FLAGS_ENV`] says otherwise.
///
/// - `--xla_cpu_experimental_ynn_fusion_type=-individual_convolution`: XLA 0.11's CPU
///   backend hands each convolution to YNNPACK by default, which is slower than its Eigen
///   convolution on the UNet's deep layers; dots and attention stay on YNNPACK
///   (`docs/backend.md` has the measurements).
///
/// A flag is only passed when the plugin's library knows its name: XLA aborts the process on
/// an unknown flag, and other plugin versions name their options differently.
pub const XLA_CPU_DEFAULT_FLAGS: &[&str] =
    &["--xla_cpu_experimental_ynn_fusion_type=-individual_convolution"];

/// Puts oxidiff's XLA CPU flags ([`XLA_CPU_DEFAULT_FLAGS`], or [`XLA_CPU_FLAGS_ENV`]) in front
/// of the user's `XLA_FLAGS`, which XLA reads once, when it first builds its options.
///
/// This changes the process environment; it runs once, under the plugin registry lock,
/// before the plugin's code is in the process.
fn prepare_xla_cpu_environment(library: &Path) {
    let ours: Vec<String> = match std::env::var(XLA_CPU_FLAGS_ENV) {
        Ok(flags) => flags.split_whitespace().map(str::to_string).collect(),
        Err(_) => XLA_CPU_DEFAULT_FLAGS
            .iter()
            .filter(|flag| {
                let name = flag.trim_start_matches('-');
                let name = name.split('=').next().unwrap_or(name);
                file_contains(library, name.as_bytes())
            })
            .map(|flag| flag.to_string())
            .collect(),
    };
    let user = std::env::var("XLA_FLAGS").unwrap_or_default();
    // A flag the user's XLA_FLAGS already names (or that a parent process put there, and a
    // child inherited) is not added again: the environment, and the compile cache key made
    // from it, stay the same however often this runs.
    let flag_name = |flag: &str| flag.split('=').next().unwrap_or(flag).to_string();
    let named: Vec<String> = user.split_whitespace().map(flag_name).collect();
    let ours: Vec<String> = ours
        .into_iter()
        .filter(|flag| !named.contains(&flag_name(flag)))
        .collect();
    if ours.is_empty() {
        return;
    }
    let flags = ours.join(" ") + if user.is_empty() { "" } else { " " } + &user;
    tracing::debug!(target: "oxidiff::pjrt", xla_flags = %flags, "XLA CPU flags");
    std::env::set_var("XLA_FLAGS", flags);
}

/// Whether the file at `path` contains `needle`, read in blocks (a plugin is hundreds of MB).
fn file_contains(path: &Path, needle: &[u8]) -> bool {
    use std::io::Read;
    let Ok(mut file) = std::fs::File::open(path) else {
        return false;
    };
    let mut block = vec![0u8; (1 << 20) + needle.len()];
    let mut kept = 0;
    loop {
        let Ok(read) = file.read(&mut block[kept..]) else {
            return false;
        };
        if read == 0 {
            return false;
        }
        let end = kept + read;
        if block[..end].windows(needle.len()).any(|w| w == needle) {
            return true;
        }
        // Keep the tail, so a match across two reads is found.
        kept = (needle.len() - 1).min(end);
        block.copy_within(end - kept..end, 0);
    }
}

#[cfg(test)]
mod flag_tests {
    use super::*;

    #[test]
    fn file_contains_finds_a_needle_across_block_boundaries() {
        let dir = std::env::temp_dir().join(format!("oxidiff-flags-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("lib.so");
        let mut bytes = vec![b'x'; (1 << 20) - 3];
        bytes.extend_from_slice(b"xla_cpu_flag_name");
        bytes.extend_from_slice(&[b'y'; 100]);
        std::fs::write(&path, &bytes).unwrap();
        assert!(file_contains(&path, b"xla_cpu_flag_name"));
        assert!(!file_contains(&path, b"xla_cpu_other_flag"));
        assert!(!file_contains(&dir.join("missing.so"), b"x"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
