//! oxidiff's CPU kernels as host kernels of compiled programs on XLA's CPU plugin
//! ([`oxidiff_backend_tpu::host_kernels`]): compiled mode installs them before its first
//! trace, so a program for `xla:cpu` runs its f32 convolutions, attention and matrix products
//! in the CPU backend's kernels (Winograd, im2col; flash attention; the `gemm` crate) instead
//! of XLA's.

use oxidiff_backend_tpu::host_kernels::{
    self, HostCall, HostKernel, ATTENTION_F32, CONV2D_F32, MATMUL_F32,
};
use oxidiff_models::cpu::attention::{attention_f32_slices, Masking};
use oxidiff_models::cpu::conv::{conv2d_f32_slices, ConvGeometry};
use oxidiff_models::cpu::linear::matmul_f32_slices;

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
        host_kernels::install(HostKernel {
            target: MATMUL_F32,
            run: matmul_f32,
        });
    });
}

/// [`CONV2D_F32`]: input `[n, c_in, h, w]`, kernel `[c_out, c_in, k, k]` and optionally a
/// bias `[c_out]`, attributes `stride` and `padding`; one result `[n, c_out, h_out, w_out]`.
fn conv2d_f32(call: &mut HostCall<'_>) -> Result<(), String> {
    let (x, weight, bias) = match &call.args[..] {
        [x, weight] => (x, weight, None),
        [x, weight, bias] => (x, weight, Some(bias.f32s()?)),
        args => return Err(format!("{} operands, expected 2 or 3", args.len())),
    };
    let (x_dims, w_dims) = (dims(x.shape(), "input")?, dims(weight.shape(), "kernel")?);
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
    conv2d_f32_slices(x, x_dims, weight, w_dims, bias, geometry, out.f32s_mut()?)
}

/// [`ATTENTION_F32`]: queries `[batch, s_q, heads, head_dim]`, keys and values `[batch, s_kv,
/// heads, head_dim]`, attribute `causal`; one result as the queries.
fn attention_f32(call: &mut HostCall<'_>) -> Result<(), String> {
    let [q, k, v] = &call.args[..] else {
        return Err(format!("{} operands, expected 3", call.args.len()));
    };
    let [batch, s_q, heads, head_dim] = dims(q.shape(), "queries")?;
    let [_, s_kv, _, _] = dims(k.shape(), "keys")?;
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

/// [`MATMUL_F32`]: `a` `[m, k]`, `b` `[k, n]` and optionally a bias `[n]`; one result `[m,
/// n]`.
fn matmul_f32(call: &mut HostCall<'_>) -> Result<(), String> {
    let (a, b, bias) = match &call.args[..] {
        [a, b] => (a, b, None),
        [a, b, bias] => (a, b, Some(bias.f32s()?)),
        args => return Err(format!("{} operands, expected 2 or 3", args.len())),
    };
    let ([m, k], [k_b, n]) = (
        dims(a.shape(), "left side")?,
        dims(b.shape(), "right side")?,
    );
    if k != k_b {
        return Err(format!("a [{m}, {k}] x [{k_b}, {n}] product"));
    }
    let (a, b) = (a.f32s()?, b.f32s()?);
    let [out] = &mut call.results[..] else {
        return Err("expected one result".into());
    };
    matmul_f32_slices(a, b, bias, [m, k, n], out.f32s_mut()?)
}

/// `shape` as `N` dimensions, or an error naming `what`.
fn dims<const N: usize>(shape: Vec<usize>, what: &str) -> Result<[usize; N], String> {
    shape
        .try_into()
        .map_err(|s: Vec<usize>| format!("the {what} has rank {}, expected {N}", s.len()))
}
