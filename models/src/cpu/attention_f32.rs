//! The f32 multi-head attention for burn-flex behind [`super::attention::attention`]: each
//! head is read in place through gemm's strides, a block of queries at a time, and written
//! straight into the merged output. The half-precision kernels ([`super::attention_half`])
//! share its shapes and widen into it where they have no kernel of their own.

use super::common::{exp_nonpositive, f32_product, OutPtr, Strided};
use super::simd;

/// Queries per block: the block's scores (`QUERY_BLOCK * seq_kv` floats, 1 MiB at 4096 keys)
/// stay in the L2 cache between the two gemms.
const QUERY_BLOCK: usize = 64;

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
    /// Every (sample, head, block of queries), in parallel on rayon's pool: through
    /// [`super::attention_f32_flash`] where it [suits](super::attention_f32_flash::suits) this
    /// shape and CPU, else through the gemm crate's products.
    pub(crate) fn run(&self, q: &[f32], k: &[f32], v: &[f32], out: &mut [f32]) {
        use rayon::prelude::*;
        if super::attention_f32_flash::suits(self) {
            return super::attention_f32_flash::attention(self, q, k, v, out);
        }
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
        f32_product(
            [rows, s_kv, d],
            Strided::rows(scores.as_mut_ptr(), s_kv),
            Strided::rows(q.as_ptr().add(q0), inner),
            Strided::columns(k.as_ptr().add(kv0), inner),
            scale,
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
        f32_product(
            [rows, d, s_kv],
            Strided::rows(dst, inner),
            Strided::rows(scores.as_ptr(), s_kv),
            Strided::rows(v.as_ptr().add(kv0), inner),
            1.0,
        );
        for (r, sum) in sums[..rows].iter().enumerate() {
            let inv = 1.0 / sum;
            let row = std::slice::from_raw_parts_mut(dst.add(r * inner), d);
            row.iter_mut().for_each(|x| *x *= inv);
        }
    }
}

/// Replaces `row` by `exp(row - max(row))` and returns its sum (softmax before the division),
/// at this CPU's vector width ([`simd::vectorized`]).
pub(crate) fn exp_shifted(row: &mut [f32]) -> f32 {
    simd::vectorize!({
        let max = row_max(row);
        let mut sums = [0.0f32; LANES];
        let mut chunks = row.chunks_exact_mut(LANES);
        for c in &mut chunks {
            for (s, x) in sums.iter_mut().zip(c.iter_mut()) {
                *x = exp_nonpositive(*x - max);
                *s += *x;
            }
        }
        let mut tail = 0.0f32;
        for x in chunks.into_remainder() {
            *x = exp_nonpositive(*x - max);
            tail += *x;
        }
        sums.iter().sum::<f32>() + tail
    })
}

/// `exp((row - max) * scale)` written through `put` into `out` (as long as `row`), and its
/// sum: the half-precision attention's probabilities in one pass, the scores' scale (positive)
/// applied here; `max` is at least every value of `row`.
#[inline(always)]
pub(crate) fn exp_shifted_into<T>(
    row: &[f32],
    max: f32,
    scale: f32,
    out: &mut [T],
    put: impl Fn(f32) -> T,
) -> f32 {
    let out = &mut out[..row.len()];
    let mut sums = [0.0f32; LANES];
    let mut chunks = out.chunks_exact_mut(LANES);
    let mut rows = row.chunks_exact(LANES);
    for (o, x) in (&mut chunks).zip(&mut rows) {
        for ((s, o), x) in sums.iter_mut().zip(o.iter_mut()).zip(x) {
            let e = exp_nonpositive((*x - max) * scale);
            *o = put(e);
            *s += e;
        }
    }
    let mut tail = 0.0f32;
    for (o, x) in chunks.into_remainder().iter_mut().zip(rows.remainder()) {
        let e = exp_nonpositive((*x - max) * scale);
        *o = put(e);
        tail += e;
    }
    sums.iter().sum::<f32>() + tail
}

/// Lanes of the softmax's reductions: enough independent chains to fill two AVX-512
/// registers, so neither the maximum nor the sum waits on one long chain of additions.
const LANES: usize = 32;

/// `row`'s maximum, or 0 for a row of -inf (everything masked, which stays all zeros rather
/// than NaN; none occur here) or an empty one.
#[inline(always)]
pub(crate) fn row_max(row: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for c in &mut chunks {
        for (l, &x) in lanes.iter_mut().zip(c) {
            *l = l.max(x);
        }
    }
    let max = chunks
        .remainder()
        .iter()
        .chain(&lanes)
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    if max.is_finite() {
        max
    } else {
        0.0
    }
}
