//! Multi-head attention for burn-flex in f32, used by
//! [`crate::attention::multi_head_attention`]: each head is read in place through gemm's
//! strides, a block of queries at a time, and written straight into the merged output.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use burn_flex::{FlexTensor, Layout};

use super::attention_half::attention_half;
use super::common::{
    burn_requested, exp_nonpositive, from_flex, into_flex, is_flex, is_half, OutPtr,
};

/// Queries per block: the block's scores (`QUERY_BLOCK * seq_kv` floats, 1 MiB at 4096 keys)
/// stay in the L2 cache between the two gemms.
const QUERY_BLOCK: usize = 64;

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

/// Which keys each query sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Masking {
    /// All of them.
    None,
    /// Query `i` sees keys `0..=i` (the text encoders' causal self-attention; `seq_q` must
    /// equal `seq_kv`, else the inputs are handed back).
    Causal,
}

impl Masking {
    /// How many keys, from the first, query `row` sees.
    pub(crate) fn visible(self, row: usize, s_kv: usize) -> usize {
        match self {
            Self::None => s_kv,
            Self::Causal => (row + 1).min(s_kv),
        }
    }
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

/// The sizes of one attention call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    pub(crate) batch: usize,
    pub(crate) s_q: usize,
    pub(crate) s_kv: usize,
    pub(crate) heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) masking: Masking,
}

impl Shape {
    /// Every (sample, head, block of queries), in parallel on rayon's pool.
    pub(crate) fn run(&self, q: &[f32], k: &[f32], v: &[f32], out: &mut [f32]) {
        use rayon::prelude::*;
        let blocks = self.s_q.div_ceil(QUERY_BLOCK);
        let ptr = OutPtr(out.as_mut_ptr());
        (0..self.batch * self.heads * blocks)
            .into_par_iter()
            .for_each_init(
                || vec![0.0f32; QUERY_BLOCK * self.s_kv],
                |scores, job| {
                    let block = job % blocks;
                    let head = (job / blocks) % self.heads;
                    let sample = job / (blocks * self.heads);
                    // SAFETY: jobs write disjoint (sample, head, query block) parts of `out`.
                    unsafe { self.block(q, k, v, ptr, scores, sample, head, block) };
                },
            );
    }

    /// Queries `block * QUERY_BLOCK ..` of one sample and head.
    ///
    /// # Safety
    /// `q` and `out` hold `batch * s_q * heads * head_dim` floats, `k` and `v`
    /// `batch * s_kv * heads * head_dim`, and no other thread writes this block of `out`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn block(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: OutPtr,
        scores: &mut [f32],
        sample: usize,
        head: usize,
        block: usize,
    ) {
        let (d, s_kv) = (self.head_dim, self.s_kv);
        let inner = self.heads * d;
        let row0 = block * QUERY_BLOCK;
        let rows = QUERY_BLOCK.min(self.s_q - row0);
        let q0 = (sample * self.s_q + row0) * inner + head * d;
        let kv0 = sample * s_kv * inner + head * d;
        let scores = &mut scores[..rows * s_kv];
        let scale = 1.0 / (d as f32).sqrt();
        // scores [rows, s_kv] = scale * q [rows, d] @ k^T [d, s_kv]
        gemm::gemm(
            rows,
            s_kv,
            d,
            scores.as_mut_ptr(),
            1,
            s_kv as isize,
            false,
            q.as_ptr().add(q0),
            1,
            inner as isize,
            k.as_ptr().add(kv0),
            inner as isize,
            1,
            0.0,
            scale,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
        let mut sums = [0.0f32; QUERY_BLOCK];
        for (r, (row, sum)) in scores
            .chunks_exact_mut(s_kv)
            .zip(sums.iter_mut())
            .enumerate()
        {
            let (seen, masked) = row.split_at_mut(self.masking.visible(row0 + r, s_kv));
            *sum = exp_shifted(seen);
            masked.fill(0.0);
        }
        // out [rows, d] = p [rows, s_kv] @ v [s_kv, d], into the merged heads.
        let dst = out.0.add(q0);
        gemm::gemm(
            rows,
            d,
            s_kv,
            dst,
            1,
            inner as isize,
            false,
            scores.as_ptr(),
            1,
            s_kv as isize,
            v.as_ptr().add(kv0),
            1,
            inner as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
        for (r, sum) in sums[..rows].iter().enumerate() {
            let inv = 1.0 / sum;
            let row = std::slice::from_raw_parts_mut(dst.add(r * inner), d);
            row.iter_mut().for_each(|x| *x *= inv);
        }
    }
}

/// Replaces `row` by `exp(row - max(row))` and returns its sum (softmax before the division).
pub(crate) fn exp_shifted(row: &mut [f32]) -> f32 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    // A row of -inf (everything masked) stays all zeros rather than NaN; none occur here.
    let max = if max.is_finite() { max } else { 0.0 };
    row.iter_mut().for_each(|x| *x = exp_nonpositive(*x - max));
    row.iter().sum()
}
