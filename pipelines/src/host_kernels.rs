//! oxidiff's CPU kernels as host kernels of compiled programs on XLA's CPU plugin
//! ([`oxidiff_backend_tpu::host_kernels`]): compiled mode installs them before its first
//! trace, so a program for `xla:cpu` runs its f32 convolutions in the CPU backend's kernel
//! (Winograd, im2col) instead of XLA's.

use oxidiff_backend_tpu::host_kernels::{self, HostCall, HostKernel, CONV2D_F32};
use oxidiff_models::cpu::conv::{conv2d_f32_slices, ConvGeometry};

/// Installs the host kernels (once per process; later calls return at once).
pub fn install() {
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| {
        host_kernels::install(HostKernel {
            target: CONV2D_F32,
            run: conv2d_f32,
        });
    });
}

/// [`CONV2D_F32`]: input `[n, c_in, h, w]`, kernel `[c_out, c_in, k, k]`, attributes `stride`
/// and `padding`; one result `[n, c_out, h_out, w_out]`.
fn conv2d_f32(call: &mut HostCall<'_>) -> Result<(), String> {
    let [x, weight] = &call.args[..] else {
        return Err(format!("{} operands, expected 2", call.args.len()));
    };
    let dims4 = |shape: Vec<usize>, what: &str| -> Result<[usize; 4], String> {
        shape
            .try_into()
            .map_err(|s: Vec<usize>| format!("the {what} has rank {}, expected 4", s.len()))
    };
    let (x_dims, w_dims) = (dims4(x.shape(), "input")?, dims4(weight.shape(), "kernel")?);
    let attr = |name| {
        call.attr(name)
            .and_then(|v| usize::try_from(v).map_err(|_| format!("{name} is {v}")))
    };
    let geometry = ConvGeometry {
        stride: attr("stride")?,
        padding: attr("padding")?,
    };
    let (x, weight) = (x.f32s()?, weight.f32s()?);
    let [out] = &mut call.results[..] else {
        return Err("expected one result".into());
    };
    conv2d_f32_slices(x, x_dims, weight, w_dims, geometry, out.f32s_mut()?)
}
