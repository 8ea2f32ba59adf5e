//! Key-blocked ("flash") f32 attention with the queries in the vector lanes, at AVX2 and
//! AVX-512 width: what [`super::attention_f32::Shape::run`] runs for unmasked attention where
//! this CPU has either.
//!
//! The gemm-based kernel computes a query block's scores over all keys with one product and
//! `p v` with a second, and the gemm crate packs both operands on every call: the block's
//! scores (1 MiB at 4096 keys) are copied into panels before `p v` reads them. Here nothing is
//! packed but the block of 64 queries, transposed once (`[head_dim][64]`):
//! - a score tile is 6 keys x 64 queries of accumulators; each step broadcasts one value of a
//!   key, read in place, against a vector of queries;
//! - the softmax runs down the keys, 64 queries at a time: its maximum, exponentials and sums
//!   are lane-wise, with no horizontal reductions;
//! - the keys come in blocks of [`KEYS`], whose scores stay in the L1 cache; the maximum is
//!   carried from block to block, and the sums and output so far are rescaled when it grows;
//! - `p v` accumulates the output transposed (`[head_dim][64]`), broadcasting one value of a
//!   value row, read in place, against a vector of probabilities.
//!
//! Each query's arithmetic is the same at either width (the lane tiles differ, no lane's order
//! of operations does), so both widths give the same bits, and a sample the same values in any
//! batch.

use rayon::prelude::*;

use super::attention_f32::{Masking, Shape};
use super::common::{exp_nonpositive_fused, OutPtr};
use super::simd::{self, VectorWidth};

/// Queries per block: the vector lanes of every tile.
const QUERIES: usize = 64;
/// Keys per block: the block's scores (`KEYS * QUERIES` floats, 30 KiB) stay in the L1 cache
/// between the scores, the softmax and `p v`. A multiple of [`TILE`].
const KEYS: usize = 120;
/// Keys per score tile and value columns per `p v` tile: with 64 queries (four AVX-512
/// registers) a tile holds 24 accumulators of the 32 registers.
const TILE: usize = 6;

/// Whether this kernel runs `shape` on this CPU: unmasked attention, AVX2 or AVX-512 (the
/// baseline width has no fused multiply-add, which the tiles are written in).
pub(crate) fn suits(shape: &Shape) -> bool {
    shape.masking == Masking::None && simd::width() >= VectorWidth::Avx2
}

/// Attention of `q`, `k`, `v` (`[batch, seq, heads * head_dim]`, contiguous) into `out` (as
/// `q`), every (sample, head, block of queries) in parallel on rayon's pool.
///
/// # Panics
/// Unless [`suits`] says this kernel runs `shape`.
pub(crate) fn attention(shape: &Shape, q: &[f32], k: &[f32], v: &[f32], out: &mut [f32]) {
    assert!(
        suits(shape),
        "the f32 flash kernel runs unmasked attention at AVX2 or wider"
    );
    let inner = shape.heads * shape.head_dim;
    assert_eq!(q.len(), shape.batch * shape.s_q * inner);
    assert_eq!(out.len(), q.len());
    assert_eq!(k.len(), shape.batch * shape.s_kv * inner);
    assert_eq!(v.len(), k.len());
    let blocks = shape.s_q.div_ceil(QUERIES);
    let ptr = OutPtr(out.as_mut_ptr());
    let wide = simd::width() == VectorWidth::Avx512;
    (0..shape.batch * shape.heads * blocks)
        .into_par_iter()
        .for_each_init(
            || Scratch::new(shape.head_dim),
            |scratch, job| {
                let block = job % blocks;
                let head = (job / blocks) % shape.heads;
                let sample = job / (blocks * shape.heads);
                let at = Block {
                    sample,
                    head,
                    row0: block * QUERIES,
                };
                // SAFETY: the lengths were checked above, and jobs write disjoint (sample,
                // head, query block) parts of `out`.
                if wide {
                    simd::vectorize!(unsafe { query_block::<64>(shape, q, k, v, ptr, scratch, at) })
                } else {
                    simd::vectorize!(unsafe { query_block::<16>(shape, q, k, v, ptr, scratch, at) })
                }
            },
        );
}

/// The last `$n` (below [`TILE`]) keys or columns of a block: `$tile::<$qt, $n>(args)`, the
/// tile's width a constant so that its accumulators stay in registers.
macro_rules! tail {
    ($n:expr, $tile:ident::<$qt:ident>($($arg:expr),*)) => {
        match $n {
            0 => {}
            1 => $tile::<$qt, 1>($($arg),*),
            2 => $tile::<$qt, 2>($($arg),*),
            3 => $tile::<$qt, 3>($($arg),*),
            4 => $tile::<$qt, 4>($($arg),*),
            n => {
                debug_assert_eq!(n, 5, "a tail is shorter than a tile");
                $tile::<$qt, 5>($($arg),*)
            }
        }
    };
}

/// One job's place: a sample, a head and its first query.
#[derive(Clone, Copy)]
struct Block {
    sample: usize,
    head: usize,
    row0: usize,
}

/// A job's working set, reused across the jobs of a thread.
struct Scratch {
    /// The block's queries, transposed: `[head_dim][QUERIES]`, zero past the last query.
    queries: Vec<f32>,
    /// A key block's scores, then probabilities: `[KEYS][QUERIES]`.
    scores: Vec<f32>,
    /// The output so far, transposed: `[head_dim][QUERIES]`.
    output: Vec<f32>,
}

impl Scratch {
    fn new(head_dim: usize) -> Self {
        Self {
            queries: vec![0.0; head_dim * QUERIES],
            scores: vec![0.0; KEYS * QUERIES],
            output: vec![0.0; head_dim * QUERIES],
        }
    }
}

/// The queries `at.row0 ..` (up to [`QUERIES`]) of one sample and head, in lane tiles of `QT`
/// queries (64 for AVX-512's registers, 16 for AVX2's).
///
/// # Safety
/// `q` and `out` hold `batch * s_q * heads * head_dim` floats, `k` and `v`
/// `batch * s_kv * heads * head_dim`, and no other thread writes this block of `out`.
#[inline(always)]
unsafe fn query_block<const QT: usize>(
    shape: &Shape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: OutPtr,
    scratch: &mut Scratch,
    at: Block,
) {
    let (d, s_kv) = (shape.head_dim, shape.s_kv);
    let inner = shape.heads * d;
    let rows = QUERIES.min(shape.s_q - at.row0);
    let q0 = (at.sample * shape.s_q + at.row0) * inner + at.head * d;
    let kv0 = at.sample * s_kv * inner + at.head * d;
    let scale = 1.0 / (d as f32).sqrt();
    let Scratch {
        queries,
        scores,
        output,
    } = scratch;
    for (i, lanes) in queries.chunks_exact_mut(QUERIES).enumerate() {
        for (r, x) in lanes.iter_mut().enumerate() {
            *x = if r < rows {
                *q.get_unchecked(q0 + r * inner + i)
            } else {
                0.0
            };
        }
    }
    output.fill(0.0);
    let mut max = [f32::NEG_INFINITY; QUERIES];
    let mut sum = [0.0f32; QUERIES];
    let mut k0 = 0;
    while k0 < s_kv {
        let kb = KEYS.min(s_kv - k0);
        let keys = k.as_ptr().add(kv0 + k0 * inner);
        let mut grown = max;
        for (t, grown) in grown.chunks_exact_mut(QT).enumerate() {
            let grown: &mut [f32; QT] = grown.try_into().unwrap_unchecked();
            let qt = queries.as_ptr().add(t * QT);
            let st = scores.as_mut_ptr().add(t * QT);
            let mut j = 0;
            while j + TILE <= kb {
                let (kt, sj) = (keys.add(j * inner), st.add(j * QUERIES));
                score_tile::<QT, TILE>(qt, kt, inner, d, sj);
                j += TILE;
            }
            let (kt, sj) = (keys.add(j * inner), st.add(j * QUERIES));
            tail!(kb - j, score_tile::<QT>(qt, kt, inner, d, sj));
            // The tile's maximum while its scores are in the L1 cache.
            for j in 0..kb {
                let row = &*(st.add(j * QUERIES) as *const [f32; QT]);
                for (m, &x) in grown.iter_mut().zip(row) {
                    *m = if x > *m { x } else { *m };
                }
            }
        }
        let block = &mut scores[..kb * QUERIES];
        softmax_block(block, &mut max, grown, &mut sum, output, scale);
        let values = v.as_ptr().add(kv0 + k0 * inner);
        for t in (0..QUERIES).step_by(QT) {
            let pt = scores.as_ptr().add(t);
            let ot = output.as_mut_ptr().add(t);
            let mut c = 0;
            while c + TILE <= d {
                value_tile::<QT, TILE>(pt, kb, values.add(c), inner, ot.add(c * QUERIES));
                c += TILE;
            }
            let (values, ot) = (values.add(c), ot.add(c * QUERIES));
            tail!(d - c, value_tile::<QT>(pt, kb, values, inner, ot));
        }
        k0 += kb;
    }
    let dst = out.0.add(q0);
    for (r, &total) in sum.iter().enumerate().take(rows) {
        let inv = 1.0 / total;
        let row = dst.add(r * inner);
        for c in 0..d {
            *row.add(c) = *output.get_unchecked(c * QUERIES + r) * inv;
        }
    }
}

/// Scores of `KT` keys (rows of `keys`, `stride` apart, read in place) against `QT` queries
/// (`queries`: `[d][QUERIES]` from this tile's first lane), unscaled, into `scores`
/// (`[KT][QUERIES]`, from this tile's first lane).
///
/// # Safety
/// The pointers cover what is read and written.
#[inline(always)]
unsafe fn score_tile<const QT: usize, const KT: usize>(
    queries: *const f32,
    keys: *const f32,
    stride: usize,
    d: usize,
    scores: *mut f32,
) {
    let mut acc = [[0.0f32; QT]; KT];
    for i in 0..d {
        let lanes = &*(queries.add(i * QUERIES) as *const [f32; QT]);
        for (kk, acc) in acc.iter_mut().enumerate() {
            let key = *keys.add(kk * stride + i);
            for (a, &x) in acc.iter_mut().zip(lanes) {
                *a = key.mul_add(x, *a);
            }
        }
    }
    for (kk, acc) in acc.iter().enumerate() {
        *(scores.add(kk * QUERIES) as *mut [f32; QT]) = *acc;
    }
}

/// `output[c][lane] += sum_j p[j][lane] * values[j][c]` for `CT` columns `c` (of value rows
/// `stride` apart, read in place) and `QT` queries, over `kb` keys.
///
/// # Safety
/// The pointers cover what is read and written.
#[inline(always)]
unsafe fn value_tile<const QT: usize, const CT: usize>(
    probs: *const f32,
    kb: usize,
    values: *const f32,
    stride: usize,
    output: *mut f32,
) {
    let mut acc: [[f32; QT]; CT] =
        std::array::from_fn(|c| *(output.add(c * QUERIES) as *const [f32; QT]));
    for j in 0..kb {
        let lanes = &*(probs.add(j * QUERIES) as *const [f32; QT]);
        let row = values.add(j * stride);
        for (c, acc) in acc.iter_mut().enumerate() {
            let value = *row.add(c);
            for (a, &p) in acc.iter_mut().zip(lanes) {
                *a = value.mul_add(p, *a);
            }
        }
    }
    for (c, acc) in acc.iter().enumerate() {
        *(output.add(c * QUERIES) as *mut [f32; QT]) = *acc;
    }
}

/// One key block's softmax step, lane-wise: the running maximum `max` (of unscaled scores)
/// becomes `grown` (which covers `scores`, `[kb][QUERIES]`), the scores become
/// `exp((score - max) * scale)`; the sums and the output so far are rescaled by
/// `exp((old - new max) * scale)` (1 where it did not grow; 0 before the first block, whose
/// maximum was -inf) and the block's probabilities added to the sums.
#[inline(always)]
fn softmax_block(
    scores: &mut [f32],
    max: &mut [f32; QUERIES],
    grown: [f32; QUERIES],
    sum: &mut [f32; QUERIES],
    output: &mut [f32],
    scale: f32,
) {
    let mut alpha = [0.0f32; QUERIES];
    for ((a, &old), &new) in alpha.iter_mut().zip(max.iter()).zip(&grown) {
        *a = exp_nonpositive_fused((old - new) * scale);
    }
    let mut sums = [0.0f32; QUERIES];
    for ((s, &total), &a) in sums.iter_mut().zip(sum.iter()).zip(&alpha) {
        *s = total * a;
    }
    // (x - m) * scale as one fused x * scale - m * scale.
    let mut shift = [0.0f32; QUERIES];
    for (s, &m) in shift.iter_mut().zip(&grown) {
        *s = -(m * scale);
    }
    for row in scores.chunks_exact_mut(QUERIES) {
        for ((x, s), &shift) in row.iter_mut().zip(sums.iter_mut()).zip(&shift) {
            let e = exp_nonpositive_fused(x.mul_add(scale, shift));
            *x = e;
            *s += e;
        }
    }
    *max = grown;
    *sum = sums;
    for row in output.chunks_exact_mut(QUERIES) {
        for (o, &a) in row.iter_mut().zip(&alpha) {
            *o *= a;
        }
    }
}
