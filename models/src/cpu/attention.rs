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
