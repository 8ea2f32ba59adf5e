//! Multi-head attention for the burn-flex CPU backend in f32, used by
//! [`crate::attention::multi_head_attention`].
//!
//! burn-flex 0.21 attends over `[batch, heads, seq, head_dim]` tensors, so the heads of the
//! `[batch, seq, heads * head_dim]` projections are first copied out (a strided permute), and
//! for long sequences it computes scores and outputs in scalar loops with a scalar `expf`.
//! Profiles of the SD 1.5 UNet step at 512x512 (4096 tokens at the top level) put that kernel
//! at about 36% of the step. Here each head is read in place through gemm's strides:
//! for a block of queries, `scores = scale * q @ k^T` is one gemm, the softmax runs over each
//! row with a vectorizable exponential, `out = p @ v` is a second gemm that writes the block
//! straight into the merged `[batch, seq, heads * head_dim]` output, and the rows are divided
//! by their sums there (`head_dim` values a row instead of `seq_kv`).
//!
//! [`attention`] applies only when the backend's float tensor is burn-flex's [`FlexTensor`] and
//! the inputs are f32, without bias or causal mask; otherwise it hands the tensors back and the
//! caller uses Burn's `attention`. Other backends (the PJRT one, compiled traces) never see it.

use std::any::TypeId;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use burn_flex::{FlexTensor, Layout};

use crate::cpu_conv::{from_flex, into_flex, OutPtr};

/// Queries per block: the block's scores (`QUERY_BLOCK * seq_kv` floats, 1 MiB at 4096 keys)
/// stay in the L2 cache between the two gemms.
const QUERY_BLOCK: usize = 64;

/// The inputs handed back when [`attention`] does not apply.
pub type Unhandled<B> = (Tensor<B, 3>, Tensor<B, 3>, Tensor<B, 3>);

/// Softmax attention of `q` `[batch, seq_q, heads * head_dim]` over `k`, `v`
/// `[batch, seq_kv, heads * head_dim]`, scaled by `1 / sqrt(head_dim)`, heads merged back in
/// the output's last dimension, when the backend is burn-flex in f32; otherwise the inputs
/// untouched (`Err`) for Burn's own `attention`.
pub fn attention<B: Backend>(
    q: Tensor<B, 3>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
    heads: usize,
) -> Result<Tensor<B, 3>, Unhandled<B>> {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let [b, s_q, inner] = q.dims();
    let [b_k, s_kv, inner_k] = k.dims();
    let f32_only = [&q, &k, &v].iter().all(|t| t.dtype() == DType::F32);
    if TypeId::of::<B::FloatTensorPrimitive>() != TypeId::of::<FlexTensor>()
        || !f32_only
        || heads == 0
        || inner % heads != 0
        || v.dims() != k.dims()
        || (b_k, inner_k) != (b, inner)
        || s_kv == 0
        || crate::cpu_elementwise::burn_requested("OXIDIFF_CPU_ATTENTION", &OFF)
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
    };
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
struct Shape {
    batch: usize,
    s_q: usize,
    s_kv: usize,
    heads: usize,
    head_dim: usize,
}

impl Shape {
    /// Every (sample, head, block of queries), in parallel on rayon's pool.
    fn run(&self, q: &[f32], k: &[f32], v: &[f32], out: &mut [f32]) {
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
        for (row, sum) in scores.chunks_exact_mut(s_kv).zip(sums.iter_mut()) {
            *sum = exp_shifted(row);
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
fn exp_shifted(row: &mut [f32]) -> f32 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    // A row of -inf (everything masked) stays all zeros rather than NaN; none occur here.
    let max = if max.is_finite() { max } else { 0.0 };
    row.iter_mut().for_each(|x| *x = exp_nonpositive(*x - max));
    row.iter().sum()
}

/// `e^x` for `x <= 0`, within 4 ulp (tested), in branch-free arithmetic the compiler vectorizes
/// (unlike libm's `expf`): `x = n ln 2 + r` with `|r| <= ln 2 / 2`, a degree-6 Taylor
/// polynomial for `e^r` (remainder below 1.2e-7 relative) and `2^n` built in the exponent bits.
/// Inputs below -87 (where `e^x` < 1.6e-38) give about 1.6e-38.
#[inline(always)]
pub fn exp_nonpositive(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Adding and subtracting 1.5 * 2^23 rounds to the nearest integer in two adds.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 0.0);
    let n = (x * LOG2_E + ROUND) - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    p * scale
}
