//! Multi-head attention in bf16 and f16 for burn-flex, used by [`super::attention::attention`].
//! In bf16 on AMX, the key-blocked kernel of [`super::attention_flash`] where it suits the
//! keys (`attention_flash::suits`). Otherwise in bf16 (AMX or AVX512-BF16), per
//! (sample, head): the keys packed as `k^T` and the values once, then for
//! each block of queries `q k^T` as f32 scores, the softmax in f32 with the scale folded into
//! the exponentials, the probabilities rounded to bf16 (as torch's CPU flash attention does for
//! reduced precision) for `p v`, and the rows divided by their sums as they are rounded into
//! the bf16 output. Elsewhere (and in f16) the tensors are widened to f32 for the f32 kernel
//! and its output rounded back. The softmax's rows (`row_max`, `exp_row`) are shared by
//! both bf16 kernels.

use half::bf16;
use rayon::prelude::*;

use burn::tensor::{Bytes, DType};
use burn_flex::{FlexTensor, Layout};

use super::aligned::Aligned;
use super::attention_f32::{exp_shifted_into, Shape};
use super::attention_flash;
#[cfg(target_arch = "x86_64")]
use super::common::tail_mask;
use super::common::{
    bf16_instructions, narrow, round_bf16, round_bf16_affine, widen, zeroed_bf16, OutPtr,
};
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
        let kernel = match half_gemm::kernel() {
            Some(half_gemm::HalfKernel::Amx) if attention_flash::suits(shape.s_kv) => {
                attention_flash::attention
            }
            _ => bf16_products,
        };
        let mut out = zeroed_bf16(dims.iter().product());
        kernel(
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

/// Every (sample, head) in parallel on rayon's pool, its query blocks one after another: `q k^T`
/// stored as f32 scores straight from the product, the scale folded into the exponentials, the
/// probabilities rounded to bf16 for `p v`, and each output row divided by its sum as it is
/// rounded.
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
    // The scores' rows hold whole blocks of 32 keys, so the product stores its tiles whole.
    let ld_scores = s_kv.next_multiple_of(half_gemm::BLOCK);
    let ptr = OutPtr(out.as_mut_ptr());
    (0..batch * heads).into_par_iter().for_each_init(
        || {
            (
                Aligned::<f32>::zeroed(QUERY_BLOCK * ld_scores),
                Aligned::<bf16>::zeroed(QUERY_BLOCK * s_kv),
            )
        },
        |(scores, probs), job| {
            simd::vectorize!({
                let (sample, head) = (job / heads, job % heads);
                let (keys, values) = pack_head(k, v, shape, job);
                let mut row0 = 0;
                while row0 < s_q {
                    let rows = QUERY_BLOCK.min(s_q - row0);
                    let q0 = (sample * s_q + row0) * inner + head * d;
                    half_gemm::gemm_f32_on_this_thread(
                        &q[q0..],
                        inner,
                        rows,
                        &keys,
                        scores.as_mut_slice(),
                        ld_scores,
                    );
                    let mut sums = [0.0f32; QUERY_BLOCK];
                    for (r, (p, sum)) in probs
                        .as_mut_slice()
                        .chunks_exact_mut(s_kv)
                        .zip(sums.iter_mut())
                        .take(rows)
                        .enumerate()
                    {
                        let visible = masking.visible(row0 + r, s_kv);
                        let row = &scores.as_slice()[r * ld_scores..r * ld_scores + visible];
                        let (p_seen, p_masked) = p.split_at_mut(visible);
                        *sum = probabilities(row, scale, p_seen);
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
                                // SAFETY: this job alone writes head `head` of these query rows.
                                let dst = unsafe {
                                    std::slice::from_raw_parts_mut(ptr.add(at).0, block.cols)
                                };
                                round_bf16_affine(block.row(i), 1.0 / sums[r], 0.0, dst);
                            }
                        },
                    );
                    row0 += rows;
                }
            })
        },
    );
}

/// The keys of (sample, head) `job = sample * heads + head` packed as `k^T` (`head_dim` rows
/// of `s_kv` columns) and its values as they are (`s_kv` rows of `head_dim`), for the products
/// of both bf16 kernels.
#[inline(always)]
pub(crate) fn pack_head(k: &[bf16], v: &[bf16], shape: Shape, job: usize) -> (PackedB, PackedB) {
    let (s_kv, heads, d) = (shape.s_kv, shape.heads, shape.head_dim);
    let inner = heads * d;
    let kv0 = (job / heads) * s_kv * inner + (job % heads) * d;
    (
        PackedB::from_transposed(&k[kv0..], inner, d, s_kv),
        PackedB::from_rows(&v[kv0..], inner, s_kv, d),
    )
}

/// One row of softmax numerators: `probs[j] = bf16(e^((row[j] - max) * scale))` (`probs` as
/// long as `row`, `max` the row's maximum, or 0 for an empty row or one of -inf), and the f32
/// sum of the unrounded exponentials returned.
#[inline(always)]
fn probabilities(row: &[f32], scale: f32, probs: &mut [bf16]) -> f32 {
    let max = row_max(row);
    let max = if max.is_finite() { max } else { 0.0 };
    exp_row(row, max, scale, probs)
}

/// `row`'s maximum, -inf for an empty row: 16 lanes at a time on AVX-512 (see
/// [`bf16_instructions`]), else in portable arithmetic.
#[inline(always)]
pub(crate) fn row_max(row: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if bf16_instructions() {
        // SAFETY: `bf16_instructions` found AVX-512 F.
        return unsafe { row_max_avx512(row) };
    }
    row.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

/// `probs[j] = bf16(e^((row[j] - max) * scale))` (`probs` as long as `row`, `max` at least
/// every value of `row` and finite), and the f32 sum of the unrounded exponentials returned.
/// On AVX512-BF16 (see [`bf16_instructions`]) with `vscalefps` and `vcvtneps2bf16`, else in
/// portable arithmetic.
#[inline(always)]
pub(crate) fn exp_row(row: &[f32], max: f32, scale: f32, probs: &mut [bf16]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if bf16_instructions() {
        // SAFETY: `bf16_instructions` found AVX-512 (F, BW, VL) and AVX512-BF16.
        return unsafe { exp_row_avx512(row, max, scale, probs) };
    }
    exp_shifted_into(row, max, scale, probs, round_bf16)
}

/// [`row_max`] on AVX-512.
///
/// # Safety
/// The CPU has AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn row_max_avx512(row: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = row.len();
    let from = row.as_ptr();
    let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
    let (mut max0, mut max1) = (neg_inf, neg_inf);
    let mut i = 0;
    while i + 32 <= n {
        max0 = _mm512_max_ps(max0, _mm512_loadu_ps(from.add(i)));
        max1 = _mm512_max_ps(max1, _mm512_loadu_ps(from.add(i + 16)));
        i += 32;
    }
    while i < n {
        let mask = if n - i >= 16 {
            u16::MAX
        } else {
            tail_mask(n - i)
        };
        max0 = _mm512_max_ps(max0, _mm512_mask_loadu_ps(neg_inf, mask, from.add(i)));
        i += 16;
    }
    _mm512_reduce_max_ps(_mm512_max_ps(max0, max1))
}

/// [`exp_row`] on AVX-512: `e^x` as `2^t` for `t = x log2(e)`, split as `t = n + f` (`n` the
/// nearest integer, `|f| <= 1/2`), `2^f` by a degree-5 polynomial fitted for least maximum
/// relative error on `[-1/2, 1/2]` (1.6e-7, about f32's own rounding) and `2^n` applied by
/// `vscalefps`.
///
/// # Safety
/// The CPU has AVX-512 F, BW, VL and AVX512-BF16; `probs` is as long as `row`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn exp_row_avx512(row: &[f32], max: f32, scale: f32, probs: &mut [bf16]) -> f32 {
    use std::arch::x86_64::*;
    debug_assert_eq!(row.len(), probs.len());
    let n = row.len();
    let (from, to) = (row.as_ptr(), probs.as_mut_ptr().cast::<i16>());
    let c = scale * std::f32::consts::LOG2_E;
    let (times, minus) = (_mm512_set1_ps(c), _mm512_set1_ps(max * c));
    let floor = _mm512_set1_ps(-127.0);
    // The polynomial's coefficients, degree 5 down to 0.
    let terms = [
        1.327_647_1e-3f32,
        9.675_541e-3,
        5.550_713e-2,
        0.240_221_2,
        0.693_146_94,
        1.000_000_1,
    ];
    let exp = |x: __m512| {
        // `floor` first, so a NaN `t` stays NaN (`vmaxps` returns its second operand then),
        // and a score of -inf gives 0.
        let t = _mm512_max_ps(floor, _mm512_fmsub_ps(x, times, minus));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(t);
        let f = _mm512_sub_ps(t, n);
        let mut p = _mm512_set1_ps(terms[0]);
        for term in &terms[1..] {
            p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(*term));
        }
        _mm512_scalef_ps(p, n)
    };
    let store = |at: usize, e: __m512| {
        let rounded: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(e));
        _mm256_storeu_si256(to.add(at).cast::<__m256i>(), rounded);
    };
    // Two sums, so the additions of neighbouring steps do not wait on each other.
    let (mut sum0, mut sum1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let mut i = 0;
    while i + 32 <= n {
        let (e0, e1) = (
            exp(_mm512_loadu_ps(from.add(i))),
            exp(_mm512_loadu_ps(from.add(i + 16))),
        );
        sum0 = _mm512_add_ps(sum0, e0);
        sum1 = _mm512_add_ps(sum1, e1);
        store(i, e0);
        store(i + 16, e1);
        i += 32;
    }
    if i + 16 <= n {
        let e = exp(_mm512_loadu_ps(from.add(i)));
        sum0 = _mm512_add_ps(sum0, e);
        store(i, e);
        i += 16;
    }
    let mut sum = _mm512_add_ps(sum0, sum1);
    if i < n {
        let mask = tail_mask(n - i);
        let e = exp(_mm512_maskz_loadu_ps(mask, from.add(i)));
        sum = _mm512_mask_add_ps(sum, mask, sum, e);
        let rounded: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(e));
        _mm256_mask_storeu_epi16(to.add(i), mask, rounded);
    }
    _mm512_reduce_add_ps(sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both ways of computing a row's probabilities against f64: each within bf16's rounding
    /// (2^-8 relative) of the exact value, the sum within 1e-6 relative.
    #[test]
    fn probabilities_match_f64() {
        let scale = 1.0 / 40f32.sqrt();
        for len in [1usize, 15, 16, 17, 33, 300] {
            let row: Vec<f32> = (0..len)
                .map(|i| ((i * 7919 % 613) as f32 / 613.0 - 0.5) * 60.0)
                .collect();
            let max = row
                .iter()
                .copied()
                .fold(f64::NEG_INFINITY, |m, x| m.max(x as f64));
            let exact: Vec<f64> = row
                .iter()
                .map(|&x| ((x as f64 - max) * scale as f64).exp())
                .collect();
            let exact_sum: f64 = exact.iter().sum();
            let mut dispatched = vec![bf16::ZERO; len];
            let mut portable = vec![bf16::ZERO; len];
            let sums = [
                probabilities(&row, scale, &mut dispatched),
                exp_shifted_into(&row, max as f32, scale, &mut portable, round_bf16),
            ];
            for (sum, probs) in sums.iter().zip([&dispatched, &portable]) {
                let error = (*sum as f64 - exact_sum).abs() / exact_sum;
                assert!(error < 1e-6, "length {len}: sum {sum} against {exact_sum}");
                for (j, (p, e)) in probs.iter().zip(&exact).enumerate() {
                    let p = p.to_f32() as f64;
                    assert!(
                        (p - e).abs() <= e * 2f64.powi(-8) + 1e-37,
                        "length {len}, key {j}: {p} against {e}"
                    );
                }
            }
        }
    }
}
