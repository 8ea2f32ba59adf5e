//! [`PjrtPlatform`]: the PJRT plugin a device belongs to, and the one client of each
//! platform the process shares: devices parse against it, eager clients run on it.

use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use crate::pjrt::{self, Client, NamedValue, Plugin, PluginKind};

/// The PJRT plugin a device belongs to.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum PjrtPlatform {
    /// XLA's CPU plugin (`xla:cpu`): a PJRT device on the host, for tests and
    /// for checking lowerings without an accelerator.
    XlaCpu,
    /// libtpu.
    Tpu,
    /// XLA's CUDA plugin.
    Cuda,
    /// A plugin file given by path.
    Path(PathBuf),
}

impl PjrtPlatform {
    /// The name [`Plugin::discover`](crate::pjrt::Plugin::discover) takes.
    pub fn plugin_name(&self) -> String {
        match self {
            Self::XlaCpu => "xla:cpu".into(),
            Self::Tpu => "tpu".into(),
            Self::Cuda => "cuda".into(),
            Self::Path(path) => path.display().to_string(),
        }
    }

    /// The plugin kind, when the platform names one.
    pub fn kind(&self) -> Option<PluginKind> {
        match self {
            Self::XlaCpu => Some(PluginKind::XlaCpu),
            Self::Tpu => Some(PluginKind::Tpu),
            Self::Cuda => Some(PluginKind::Cuda),
            Self::Path(_) => None,
        }
    }
}

impl fmt::Display for PjrtPlatform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.plugin_name())
    }
}

/// Environment variable: how many devices the XLA CPU plugin shows (default 2).
pub const XLA_CPU_DEVICES_ENV: &str = "OXIDIFF_XLA_CPU_DEVICES";

/// The process-wide PJRT client of a platform, created on first use.
pub fn shared_client(platform: &PjrtPlatform) -> pjrt::Result<Client> {
    /// Once per process ([`crate::process`]).
    #[derive(Default)]
    struct Clients(Mutex<HashMap<PjrtPlatform, Client>>);
    static CLIENTS: OnceLock<&'static Clients> = OnceLock::new();
    let mut clients = CLIENTS
        .get_or_init(|| crate::process::shared(Clients::default))
        .0
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(client) = clients.get(platform) {
        return Ok(client.clone());
    }
    let plugin = Plugin::discover(&platform.plugin_name())?;
    let client = if plugin.kind() == Some(pjrt::PluginKind::XlaCpu) {
        let count = std::env::var(XLA_CPU_DEVICES_ENV)
            .ok()
            .and_then(|v| v.parse::<i64>().ok())
            .unwrap_or(2);
        plugin.client_with_options(&[("cpu_device_count", NamedValue::Int64(count))])?
    } else {
        plugin.client()?
    };
    clients.insert(platform.clone(), client.clone());
    Ok(client)
}
