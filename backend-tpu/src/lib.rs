//! oxidiff's Burn backend over PJRT: [`Oxi`], one backend type whose tensors
//! live on the CPU (burn-flex) or on any PJRT device (TPU, XLA CUDA, XLA CPU).
//!
//! ```no_run
//! use burn::tensor::Tensor;
//! use oxidiff_backend_tpu::{Oxi, OxiDevice};
//!
//! let tpu: OxiDevice = "tpu:0".parse()?; // or "cpu", "xla:cpu:1", "cuda"
//! let x = Tensor::<Oxi, 2>::ones([2, 3], &OxiDevice::Cpu);
//! let y = (x.to_device(&tpu) * 2.0).exp(); // runs on the TPU
//! let back = y.to_device(&OxiDevice::Cpu);
//! # Ok::<(), oxidiff_backend_tpu::DeviceError>(())
//! ```
//!
//! # Layers, from the top down
//! - [`channel`]: the burn-router channel that makes [`Oxi`] one backend: the
//!   CPU client (burn-flex) or a PJRT device's client, by [`OxiDevice`]
//!   ([`device`], parsed from strings; [`platform`] keeps one PJRT client per
//!   plugin).
//! - [`eager`]: the client of one PJRT device: lower each op, compile once per
//!   module text, execute, keep buffers by tensor id.
//! - [`compiled`]: a closure over [`Oxi`] tensors traced once per input
//!   signature into one program, compiled once and cached; [`spmd`] runs it
//!   partitioned over a device mesh.
//! - [`lowering`]: Burn's `OperationIr` to StableHLO text, shared by eager and
//!   compiled mode.
//! - [`pjrt`]: oxidiff's thin runtime over the PJRT C API (plugins, clients,
//!   buffers, executables).
//! - [`trace`]: a backend that records ops instead of running them (checking
//!   lowerings without a device).
//!
//! Imports point down the layers; `docs/backend.md` follows a tensor
//! through them and keeps the design notes and the list of ops lowered.

pub mod channel;
pub mod compile_cache;
pub mod compiled;
pub mod device;
pub mod eager;
mod host;
pub mod host_kernels;
pub mod kernels;
pub mod lowering;
pub mod pjrt;
pub mod platform;
mod process;
mod recording;
pub mod spmd;
pub(crate) mod staging;
pub mod trace;

pub use channel::{pjrt_client, OxiChannel, OxiClient};
pub use compiled::{CompileError, CompiledFn};
pub use device::{DeviceError, OxiDevice, PjrtPlatform};

/// The Burn backend of oxidiff: CPU and PJRT devices, picked per tensor by
/// [`OxiDevice`].
pub type Oxi = burn_router::BackendRouter<OxiChannel>;
