//! oxidiff's CPU kernels as host kernels of compiled programs on XLA's CPU plugin
//! ([`oxidiff_backend_tpu::host_kernels`]): compiled mode installs them before its first
//! trace, so a program for `xla:cpu` runs its f32 convolutions and attention in the CPU
//! backend's kernels (Winograd, im2col; flash attention) instead of XLA's.

use oxidiff_backend_tpu::host_kernels::{self, HostCall, HostKernel, ATTENTION_F32, CONV2D_F32};
use oxidiff_models::cpu::attention::{attention_f32_slices, Masking};
use oxidiff_models::cpu::conv::{conv2d_f32_slices, ConvGeometry};

/// Installs the host kernels (once per process; later calls return at once).
pub fn install() {
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| {
        host_kernels::install(HostKernel {
            target: CONV2D_F32,
            run: conv2d_f32,
        });
        host_kernels::install(HostKernel {
            target: ATTENTION_F32,
            run: attention_f32,
        });
    });
}

/// [`CONV2D_F32`]: input `[n, c_in, h, w]`, kernel `[c_out, c_in, k, k]`, attributes `stride`
/// and `padding`; one result `[n, c_out, h_out, w_out]`.
fn conv2d_f32(call: &mut HostCall<'_>) -> Result<(), String> {
    let [x, weight] = &call.args[..] else {
        return Err(format!("{} operands, expected 2", call.args.len()));
    };
    let (x_dims, w_dims) = (rank4(x.shape(), "input")?, rank4(weight.shape(), "kernel")?);
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

/// [`ATTENTION_F32`]: queries `[batch, s_q, heads, head_dim]`, keys and values `[batch, s_kv,
/// heads, head_dim]`, attribute `causal`; one result as the queries.
fn attention_f32(call: &mut HostCall<'_>) -> Result<(), String> {
    let [q, k, v] = &call.args[..] else {
        return Err(format!("{} operands, expected 3", call.args.len()));
    };
    let [batch, s_q, heads, head_dim] = rank4(q.shape(), "queries")?;
    let [_, s_kv, _, _] = rank4(k.shape(), "keys")?;
    let masking = match call.attr("causal")? {
        0 => Masking::None,
        _ => Masking::Causal,
    };
    let (q, k, v) = (q.f32s()?, k.f32s()?, v.f32s()?);
    let [out] = &mut call.results[..] else {
        return Err("expected one result".into());
    };
    let dims = [batch, s_q, s_kv, heads, head_dim];
    attention_f32_slices(q, k, v, dims, masking, out.f32s_mut()?)
}

/// `shape` as four dimensions, or an error naming `what`.
fn rank4(shape: Vec<usize>, what: &str) -> Result<[usize; 4], String> {
    shape
        .try_into()
        .map_err(|s: Vec<usize>| format!("the {what} has rank {}, expected 4", s.len()))
}
