//! [`OxiDevice`]: where a tensor of the [`Oxi`](crate::Oxi) backend lives, the
//! CPU (burn-flex) or a PJRT device, parsed from strings like `"tpu:3"`.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::{Mutex, OnceLock};

use burn_backend::backend::Device;
use burn_backend::{DeviceId, DeviceOps};

use crate::platform::shared_client;
pub use crate::platform::PjrtPlatform;

/// A device of the [`Oxi`](crate::Oxi) backend.
///
/// User code picks one by parsing a string: `"cpu"`, `"xla:cpu"`,
/// `"xla:cpu:1"`, `"tpu"`, `"tpu:3"`, `"cuda"`, `"cuda:0"`, or a plugin path
/// (`"/opt/pjrt/libfoo.so:0"`). Parsing a PJRT device loads its plugin and
/// checks the index exists, so a bad device fails there, with a message,
/// and not at the first tensor operation.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum OxiDevice {
    /// The host CPU, computed by burn-flex.
    #[default]
    Cpu,
    /// Device `index` (among the plugin's addressable devices) of a PJRT
    /// plugin.
    Pjrt {
        platform: PjrtPlatform,
        index: usize,
    },
}

/// Why a device string does not name a usable device.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("unknown device `{0}`: use cpu, xla:cpu[:N], tpu[:N], cuda[:N] or a path to a PJRT plugin .so[:N]")]
    Unknown(String),
    #[error("device `{device}`: `{index}` is not a device index (a number from 0)")]
    BadIndex { device: String, index: String },
    #[error("device {device} does not exist: this machine has {count} {platform} device(s)")]
    OutOfRange {
        device: String,
        count: usize,
        platform: String,
    },
    /// The plugin's error is part of the message (not a separate `source`), so that
    /// `{:#}`-style printing does not repeat it.
    #[error("device {device}: {cause}")]
    Pjrt {
        device: String,
        cause: crate::pjrt::Error,
    },
}

impl OxiDevice {
    /// Device `index` of the XLA CPU plugin.
    pub fn xla_cpu(index: usize) -> Self {
        Self::Pjrt {
            platform: PjrtPlatform::XlaCpu,
            index,
        }
    }

    /// Device `index` of libtpu.
    pub fn tpu(index: usize) -> Self {
        Self::Pjrt {
            platform: PjrtPlatform::Tpu,
            index,
        }
    }

    /// Whether the device is a PJRT device.
    pub fn is_pjrt(&self) -> bool {
        matches!(self, Self::Pjrt { .. })
    }

    /// Checks that the device exists: loads the plugin, creates its
    /// process-wide client and looks the index up.
    pub fn check(&self) -> Result<(), DeviceError> {
        let Self::Pjrt { platform, index } = self else {
            return Ok(());
        };
        let client = shared_client(platform).map_err(|cause| DeviceError::Pjrt {
            device: self.to_string(),
            cause,
        })?;
        if *index >= client.device_count() {
            return Err(DeviceError::OutOfRange {
                device: self.to_string(),
                count: client.device_count(),
                platform: platform.to_string(),
            });
        }
        Ok(())
    }
}

impl fmt::Display for OxiDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Pjrt { platform, index } => write!(f, "{platform}:{index}"),
        }
    }
}

impl FromStr for OxiDevice {
    type Err = DeviceError;

    /// Parses and checks a device (see [`OxiDevice`]).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let device = parse_unchecked(s)?;
        device.check()?;
        Ok(device)
    }
}

/// Parses a device string without loading any plugin.
pub fn parse_unchecked(s: &str) -> Result<OxiDevice, DeviceError> {
    let text = s.trim();
    let lower = text.to_ascii_lowercase();
    if lower == "cpu" {
        return Ok(OxiDevice::Cpu);
    }
    let named = [
        ("xla:cpu", PjrtPlatform::XlaCpu),
        ("tpu", PjrtPlatform::Tpu),
        ("cuda", PjrtPlatform::Cuda),
    ];
    for (name, platform) in named {
        if let Some(rest) = lower.strip_prefix(name) {
            let index = match rest {
                "" => 0,
                _ => match rest.strip_prefix(':') {
                    Some(index) => parse_index(text, index)?,
                    None => continue,
                },
            };
            return Ok(OxiDevice::Pjrt { platform, index });
        }
    }
    if text.contains('/') || text.contains(".so") {
        let (path, index) = match text.rsplit_once(':') {
            Some((path, index)) if index.chars().all(|c| c.is_ascii_digit()) => {
                (path, parse_index(text, index)?)
            }
            _ => (text, 0),
        };
        return Ok(OxiDevice::Pjrt {
            platform: PjrtPlatform::Path(PathBuf::from(path)),
            index,
        });
    }
    Err(DeviceError::Unknown(s.to_string()))
}

fn parse_index(device: &str, index: &str) -> Result<usize, DeviceError> {
    index.parse().map_err(|_| DeviceError::BadIndex {
        device: device.to_string(),
        index: index.to_string(),
    })
}

/// Plugin paths seen in devices, so that a [`DeviceId`] (two numbers) can
/// name a path platform: type id `PATH_TYPE_BASE + position`.
fn path_registry() -> &'static Mutex<Vec<PathBuf>> {
    struct Paths(Mutex<Vec<PathBuf>>);
    static PATHS: OnceLock<&'static Paths> = OnceLock::new();
    &PATHS
        .get_or_init(|| crate::process::shared(|| Paths(Mutex::new(Vec::new()))))
        .0
}

const PATH_TYPE_BASE: u16 = 16;

impl Device for OxiDevice {
    fn from_id(device_id: DeviceId) -> Self {
        let index = device_id.index_id as usize;
        let platform = match device_id.type_id {
            0 => return Self::Cpu,
            1 => PjrtPlatform::XlaCpu,
            2 => PjrtPlatform::Tpu,
            3 => PjrtPlatform::Cuda,
            other => {
                let paths = path_registry()
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
                match other
                    .checked_sub(PATH_TYPE_BASE)
                    .and_then(|i| paths.get(i as usize))
                {
                    Some(path) => PjrtPlatform::Path(path.clone()),
                    // Only ids made by `to_id` exist; fall back to the CPU.
                    None => return Self::Cpu,
                }
            }
        };
        Self::Pjrt { platform, index }
    }

    fn to_id(&self) -> DeviceId {
        match self {
            Self::Cpu => DeviceId::new(0, 0),
            Self::Pjrt { platform, index } => {
                let type_id = match platform {
                    PjrtPlatform::XlaCpu => 1,
                    PjrtPlatform::Tpu => 2,
                    PjrtPlatform::Cuda => 3,
                    PjrtPlatform::Path(path) => {
                        let mut paths = path_registry()
                            .lock()
                            .unwrap_or_else(|poisoned| poisoned.into_inner());
                        let position = match paths.iter().position(|p| p == path) {
                            Some(position) => position,
                            None => {
                                paths.push(path.clone());
                                paths.len() - 1
                            }
                        };
                        PATH_TYPE_BASE.saturating_add(position as u16)
                    }
                };
                DeviceId::new(type_id, *index as u16)
            }
        }
    }
}

impl DeviceOps for OxiDevice {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_strings_parse_and_print_back() {
        for (text, shown) in [
            ("cpu", "cpu"),
            ("CPU", "cpu"),
            ("xla:cpu", "xla:cpu:0"),
            ("xla:cpu:1", "xla:cpu:1"),
            ("tpu", "tpu:0"),
            ("tpu:3", "tpu:3"),
            ("cuda", "cuda:0"),
            ("cuda:0", "cuda:0"),
            ("/opt/pjrt/libx.so", "/opt/pjrt/libx.so:0"),
            ("/opt/pjrt/libx.so:2", "/opt/pjrt/libx.so:2"),
        ] {
            let device = parse_unchecked(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(device.to_string(), shown, "{text}");
            assert_eq!(OxiDevice::from_id(device.to_id()), device, "{text}");
        }
    }

    #[test]
    fn bad_device_strings_are_refused() {
        for text in ["gpu0", "tpux", "tpu:x", "xla:cpu:-1", "metal"] {
            assert!(parse_unchecked(text).is_err(), "{text}");
        }
        let message = parse_unchecked("metal").err().map(|e| e.to_string());
        assert!(message.is_some_and(|m| m.contains("xla:cpu")));
    }
}
