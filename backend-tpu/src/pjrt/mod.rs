//! oxidiff's PJRT runtime layer: the bottom of `backend-tpu`, under the Burn
//! backend (client, lowering) and above the PJRT plugin.
//!
//! - [`Plugin`] loads a plugin (`xla:cpu`, `tpu`, `cuda` or a path) and checks
//!   its C API version; [`PluginSearch`] says where plugins are looked for.
//! - [`Client`] owns a `PJRT_Client`; [`Device`] is one of its devices.
//! - [`Shape`] + host bytes become a [`Buffer`] on a device and back.
//! - [`Client::compile`] turns StableHLO text into a [`LoadedExecutable`];
//!   [`Topology::compile`] compiles ahead of time for hardware that is not
//!   there (an [`Executable`]). [`CompileOptions`] encodes
//!   `CompileOptionsProto`.
//!
//! Every failed PJRT call is an [`Error::Pjrt`] with the function, the
//! plugin's code and message. All handles are `Send + Sync`: the PJRT C API is
//! thread safe.

pub(crate) mod api;
pub mod buffer;
pub mod client;
pub mod compile_options;
pub mod discovery;
pub mod error;
pub mod executable;
pub mod ffi;
pub mod hlo;
pub mod plugin;
pub mod topology;

pub use api::NamedValue;
pub use buffer::{Buffer, ElementType, NativeType, Shape};
pub use client::{Client, Device};
pub use compile_options::CompileOptions;
pub use discovery::{PluginKind, PluginSearch};
pub use error::{Error, ErrorCode, Result};
pub use executable::{CostAnalysis, Executable, LoadedExecutable};
pub use plugin::{
    tpu_device_present, Plugin, MIN_API_MINOR, XLA_CPU_DEFAULT_FLAGS, XLA_CPU_FLAGS_ENV,
};
pub use topology::{Topology, TopologyDevice};
