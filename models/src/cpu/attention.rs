//! Multi-head attention for burn-flex, used by [`crate::attention::multi_head_attention`]: f32
//! through [`super::attention_f32`], bf16 and f16 through [`super::attention_half`].

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use burn_flex::{FlexTensor, Layout};

pub use super::attention_f32::Masking;
use super::attention_f32::Shape;
use super::attention_half::attention_half;
use super::common::{burn_requested, from_flex, into_flex, is_flex, is_half};

/// The inputs handed back when [`attention`] does not apply.
pub type Unhandled<B> = (Tensor<B, 3>, Tensor<B, 3>, Tensor<B, 3>);

/// Softmax attention of `q` `[batch, seq_q, heads * head_dim]` over `k`, `v`
/// `[batch, seq_kv, heads * head_dim]`, scaled by `1 / sqrt(head_dim)`, heads merged back in
/// the output's last dimension, when the backend is burn-flex and the three share one dtype,
/// f32 or (through [`super::attention_half`]) bf16 or f16; otherwise the inputs untouched
/// (`Err`) for Burn's own `attention`.
pub fn attention<B: Backend>(
    q: Tensor<B, 3>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
    heads: usize,
) -> Result<Tensor<B, 3>, Unhandled<B>> {
    masked_attention(q, k, v, heads, Masking::None)
}
/// [`attention`] with the keys masked as `masking` says.
pub fn masked_attention<B: Backend>(
    q: Tensor<B, 3>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
    heads: usize,
    masking: Masking,
) -> Result<Tensor<B, 3>, Unhandled<B>> {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let [b, s_q, inner] = q.dims();
    let [b_k, s_kv, inner_k] = k.dims();
    let dtype = q.dtype();
    let one_dtype =
        (dtype == DType::F32 || is_half(dtype)) && k.dtype() == dtype && v.dtype() == dtype;
    if !is_flex::<B>()
        || !one_dtype
        || heads == 0
        || inner % heads != 0
        || v.dims() != k.dims()
        || (b_k, inner_k) != (b, inner)
        || s_kv == 0
        || (masking == Masking::Causal && s_q != s_kv)
        || burn_requested("OXIDIFF_CPU_ATTENTION", &OFF)
    {
        return Err((q, k, v));
    }
    let to_flex = |t: Tensor<B, 3>| into_flex(t).to_contiguous();
    let (q, k, v) = (to_flex(q), to_flex(k), to_flex(v));
    let shape = Shape {
        batch: b,
        s_q,
        s_kv,
        heads,
        head_dim: inner / heads,
        masking,
    };
    if dtype != DType::F32 {
        return Ok(from_flex(attention_half(&q, &k, &v, shape)));
    }
    let mut out = vec![0.0f32; b * s_q * inner];
    shape.run(q.storage(), k.storage(), v.storage(), &mut out);
    let out = FlexTensor::new(
        burn::tensor::Bytes::from_elems(out),
        Layout::contiguous(vec![b, s_q, inner].into()),
        DType::F32,
    );
    Ok(from_flex(out))
}

/// f32 attention on plain slices, for buffers that are not Burn tensors (a compiled program's
/// on XLA's CPU plugin, through `oxidiff_backend_tpu::host_kernels`): `q` `[batch, s_q, heads,
/// head_dim]` and `k`, `v` `[batch, s_kv, heads, head_dim]`, contiguous (`dims` is `[batch,
/// s_q, s_kv, heads, head_dim]`), scaled by `1 / sqrt(head_dim)`, into `out` (as `q`), which
/// is overwritten. The same kernel and bits as [`attention`] on burn-flex.
pub fn attention_f32_slices(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: [usize; 5],
    masking: Masking,
    out: &mut [f32],
) -> Result<(), String> {
    let [batch, s_q, s_kv, heads, head_dim] = dims;
    if s_kv == 0 || (masking == Masking::Causal && s_q != s_kv) {
        return Err(format!("attention {dims:?} with {masking:?} keys"));
    }
    let inner = heads * head_dim;
    let lengths = [
        (q.len(), batch * s_q * inner, "queries"),
        (k.len(), batch * s_kv * inner, "keys"),
        (v.len(), batch * s_kv * inner, "values"),
        (out.len(), batch * s_q * inner, "output"),
    ];
    if let Some((len, expected, what)) = lengths.iter().find(|(len, expected, _)| len != expected) {
        return Err(format!(
            "the {what} hold {len} values, their shape {expected}"
        ));
    }
    let shape = Shape {
        batch,
        s_q,
        s_kv,
        heads,
        head_dim,
        masking,
    };
    out.fill(0.0);
    shape.run(q, k, v, out);
    Ok(())
}
