//! Multi-head attention in bf16 and f16 for burn-flex, used by [`super::attention::attention`].
//! In bf16 where [`super::half_gemm`] runs (AMX or AVX512-BF16), per (sample, head): the keys
//! packed as `k^T` and the values once, then for each block of queries `q k^T` into f32
//! scores, the softmax in f32, the probabilities rounded to bf16 (as torch's CPU flash
//! attention does for reduced precision) for `p v`, and the rows divided by their sums as they
//! are rounded into the bf16 output. Elsewhere (and in f16) the tensors are widened to f32 for
//! the f32 kernel and its output rounded back.

use half::bf16;
use rayon::prelude::*;

use burn::tensor::{Bytes, DType};
use burn_flex::{FlexTensor, Layout};

use super::aligned::Aligned;
use super::attention_f32::{exp_shifted_into, Shape};
use super::common::{narrow, round_bf16, widen, zeroed_bf16, OutPtr};
use super::half_gemm::{self, PackedB};
use super::simd;

/// Queries per block: its f32 scores and bf16 probabilities (`6 * QUERY_BLOCK * seq_kv` bytes,
/// 1.5 MiB at 4096 keys) stay in the L2 cache between the two products.
const QUERY_BLOCK: usize = 64;

/// Attention of half-precision `q`, `k`, `v` (contiguous, all of `q`'s dtype; the caller checked
/// the shapes), heads merged in the output's last dimension.
pub(crate) fn attention_half(
    q: &FlexTensor,
    k: &FlexTensor,
    v: &FlexTensor,
    shape: Shape,
) -> FlexTensor {
    let dtype = q.dtype();
    let dims = vec![shape.batch, shape.s_q, shape.heads * shape.head_dim];
    if dtype == DType::BF16 && half_gemm::available() {
        let mut out = zeroed_bf16(dims.iter().product());
        bf16_products(
            q.storage::<bf16>(),
            k.storage::<bf16>(),
            v.storage::<bf16>(),
            shape,
            &mut out,
        );
        return FlexTensor::new(
            Bytes::from_elems(out),
            Layout::contiguous(dims.into()),
            DType::BF16,
        );
    }
    let (q, k, v) = (widen(q), widen(k), widen(v));
    let mut out = vec![0.0f32; dims.iter().product()];
    shape.run(q.storage(), k.storage(), v.storage(), &mut out);
    let out = FlexTensor::new(
        Bytes::from_elems(out),
        Layout::contiguous(dims.into()),
        DType::F32,
    );
    narrow(out, dtype)
}

/// Every (sample, head) in parallel on rayon's pool, its query blocks one after another.
fn bf16_products(q: &[bf16], k: &[bf16], v: &[bf16], shape: Shape, out: &mut [bf16]) {
    let Shape {
        batch,
        s_q,
        s_kv,
        heads,
        head_dim: d,
        masking,
    } = shape;
    let inner = heads * d;
    let scale = 1.0 / (d as f32).sqrt();
    let ptr = OutPtr(out.as_mut_ptr());
    (0..batch * heads).into_par_iter().for_each_init(
        || {
            (
                vec![0.0f32; QUERY_BLOCK * s_kv],
                Aligned::<bf16>::zeroed(QUERY_BLOCK * s_kv),
            )
        },
        |(scores, probs), job| {
            simd::vectorize!({
                let (sample, head) = (job / heads, job % heads);
                let kv0 = sample * s_kv * inner + head * d;
                let keys = PackedB::from_transposed(&k[kv0..], inner, d, s_kv);
                let values = PackedB::from_rows(&v[kv0..], inner, s_kv, d);
                let mut row0 = 0;
                while row0 < s_q {
                    let rows = QUERY_BLOCK.min(s_q - row0);
                    let q0 = (sample * s_q + row0) * inner + head * d;
                    let scores_ptr = OutPtr(scores.as_mut_ptr());
                    half_gemm::gemm_on_this_thread(
                        &q[q0..],
                        inner,
                        rows,
                        &keys,
                        #[inline(always)]
                        |block| {
                            for i in 0..block.rows {
                                let at = (block.row0 + i) * s_kv + block.col0;
                                // SAFETY: blocks are disjoint parts of `scores` (`rows * s_kv`).
                                let dst = unsafe {
                                    std::slice::from_raw_parts_mut(scores_ptr.add(at).0, block.cols)
                                };
                                for (d, s) in dst.iter_mut().zip(block.row(i)) {
                                    *d = s * scale;
                                }
                            }
                        },
                    );
                    let mut sums = [0.0f32; QUERY_BLOCK];
                    for (r, ((row, p), sum)) in scores[..rows * s_kv]
                        .chunks_exact_mut(s_kv)
                        .zip(probs.as_mut_slice().chunks_exact_mut(s_kv))
                        .zip(sums.iter_mut())
                        .enumerate()
                    {
                        let visible = masking.visible(row0 + r, s_kv);
                        let (p_seen, p_masked) = p.split_at_mut(visible);
                        *sum = exp_shifted_into(&row[..visible], p_seen, round_bf16);
                        p_masked.fill(bf16::ZERO);
                    }
                    half_gemm::gemm_on_this_thread(
                        probs.as_slice(),
                        s_kv,
                        rows,
                        &values,
                        #[inline(always)]
                        |block| {
                            for i in 0..block.rows {
                                let r = block.row0 + i;
                                let at = q0 + r * inner + block.col0;
                                let inv = 1.0 / sums[r];
                                // SAFETY: this job alone writes head `head` of these query rows.
                                let dst = unsafe {
                                    std::slice::from_raw_parts_mut(ptr.add(at).0, block.cols)
                                };
                                for (d, s) in dst.iter_mut().zip(block.row(i)) {
                                    *d = round_bf16(s * inv);
                                }
                            }
                        },
                    );
                    row0 += rows;
                }
            })
        },
    );
}
