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
//! # Layers
//! - [`pjrt`]: oxidiff's own thin runtime over the PJRT C API (plugins,
//!   clients, buffers, executables).
//! - [`lowering`]: Burn's `OperationIr` to StableHLO text, one op or a
//!   sequence of ops per function; eager and compiled mode share it.
//! - [`eager`]: the PJRT client of one device in eager mode: lower, compile
//!   once per module text, execute, keep buffers by tensor id.
//! - [`channel`] and [`device`]: the burn-router plumbing that makes them one
//!   Burn backend.
//! - [`compiled`]: compiled mode: a closure over [`Oxi`] tensors traced
//!   once per input signature into one StableHLO program, compiled once and
//!   cached (weights and scalars are runtime arguments).
//! - [`trace`]: a backend that records ops instead of running them (checking
//!   lowerings without a device).
//!
//! # Design
//! burn-router's `BackendRouter<C: RunnerChannel>` implements all of Burn's
//! `Backend` by turning each call into an `OperationIr` for the channel's
//! `RunnerClient`. burn-router's ready-made multi-backend channel needs every
//! backend to be a `BackendIr`, which a PJRT client is not (it compiles IR,
//! it has no Rust tensor type), so [`OxiChannel`] is our own: its client
//! ([`OxiClient`]) is an enum of burn-router's `Runner<Flex>` for
//! [`OxiDevice::Cpu`] and an [`eager::PjrtClient`] for
//! [`OxiDevice::Pjrt`]. burn-router keeps one client per device (by
//! `DeviceId`); PJRT clients are process-wide per plugin and shared by the
//! devices of a plugin (the XLA CPU plugin shows `OXIDIFF_XLA_CPU_DEVICES`
//! devices, default 2).
//!
//! Tensors move between devices through the host: [`channel::HostBridge`]
//! hands a tensor over as `TensorData`, read from the source
//! (`read_tensor_async`) and registered on the target
//! (`register_tensor_data`), so `Tensor::to_device` and `Module::to_device`
//! work between any two devices.
//!
//! Eager mode lowers each op to a one-op StableHLO module whose scalars are
//! runtime arguments, compiles it once per module text (structure, shapes,
//! dtypes) and device, runs it, and keeps the outputs as PJRT buffers by
//! `TensorId`; `Drop` ops and inputs consumed by an op free their buffers.
//!
//! Errors: `RunnerClient` methods cannot return them, so a failing op on a
//! PJRT device (not lowered, failed to compile or run) is recorded, later
//! ops depending on it are skipped, and the error, naming the op, is returned
//! by the next read or `sync` of that device (see [`eager`]); nothing panics
//! inside `register_op`, which also runs from `Drop`. `"tpu:3".parse()`
//! checks the device exists ("device tpu:3 does not exist: this machine has
//! N tpu device(s)"). Moving a tensor off a device with a recorded error
//! panics with that error (the bridge cannot return it).
//!
//! # Ops lowered
//! Elementwise: add, sub, mul, div, remainder, powf, powi (tensor and scalar
//! forms), abs, neg, exp, log, log1p, sqrt, sin, cos, tan, tanh, sinh, cosh,
//! the inverse trigonometric functions, atan2, erf, recip, floor, ceil,
//! round, trunc, clamp, is_nan, is_inf, comparisons, mask_where, mask_fill,
//! bool and bitwise ops, casts. Reductions: sum, mean, prod, max, min,
//! max_abs (whole tensor and per dim), argmax, argmin, max/min with indices,
//! cumsum, cumprod, cummax, cummin. Shapes: reshape, swap_dims, permute,
//! flip, expand, slice (positive steps), slice_assign (unit steps), cat,
//! repeat_dim, gather, select, scatter and select_assign (add, mul, min, max,
//! assign), embedding. Linear algebra and modules: matmul
//! with broadcast batch dims, linear, conv1d/2d/3d (stride, padding,
//! dilation, groups), conv_transpose1d/2d/3d, avg_pool2d, max_pool2d,
//! interpolate (nearest, bilinear), attention (mask, bias, scale, softcap,
//! causal). Creation: zeros, ones, full, empty, random (uniform, normal,
//! bernoulli through `stablehlo.rng_bit_generator`). Activations arrive
//! decomposed into these. Not lowered yet (a clear error names them):
//! scatter_nd/gather_nd, unfold, sort/topk,
//! adaptive pools, pools with indices, bicubic/lanczos interpolation,
//! deformable conv, fft, quantization, backward ops, int random.
//!
//! # Why a hand-written FFI and not the `pjrt-sys` crate
//! `pjrt-sys` generates its bindings with bindgen at build time (so every
//! build needs libclang, and protoc for its protos) from one pinned header,
//! API 0.54. Plugins check the `struct_size` of every argument struct and
//! reject callers whose structs are smaller than theirs ("Unexpected
//! PJRT_Client_Create_Args size: expected 88, got 72"), so bindings frozen at
//! an old header fail against current plugins (API 0.115 and up). The header
//! only ever appends fields and functions, so [`pjrt::ffi`] declares the
//! subset oxidiff uses by hand, sends every argument struct zero-padded with a
//! `struct_size` that covers the padding, and checks the plugin's function
//! table is long enough before calling into it. It needs no C toolchain, and
//! `CompileOptionsProto` is encoded with `prost` derive, no protoc.
//!
//! # Plugins
//! `tools/fetch-plugins.sh` fetches the pinned XLA CPU plugin
//! (`lammps-jax-pjrt-cpu` 0.11.2) and libtpu (0.0.52) into `<repo>/.plugins`;
//! see [`pjrt::discovery`] for every place searched.

pub mod channel;
pub mod compiled;
pub mod device;
pub mod eager;
pub mod lowering;
pub mod pjrt;
pub mod spmd;
pub mod trace;

pub use channel::{OxiChannel, OxiClient};
pub use compiled::{CompileError, CompiledFn};
pub use device::{DeviceError, OxiDevice, PjrtPlatform};

/// The Burn backend of oxidiff: CPU and PJRT devices, picked per tensor by
/// [`OxiDevice`].
pub type Oxi = burn_router::BackendRouter<OxiChannel>;

/// The eager client of a PJRT device (for its [`eager::Stats`] and test hooks such as
/// [`eager::PjrtClient::inject_fault`]); `None` for the CPU device.
pub fn pjrt_client(device: &OxiDevice) -> Option<eager::PjrtClient> {
    match burn_router::get_client::<OxiChannel>(device) {
        OxiClient::Pjrt(client) => Some(client),
        OxiClient::Cpu(_) => None,
    }
}
