//! Key-blocked ("flash") bf16 attention on AMX, used by [`super::attention_half`] where
//! [`super::half_gemm::kernel`] is AMX: per (sample, head) and block of 64 queries, the keys in
//! blocks of 256, each block's `q k^T` scores, probabilities and `p v` kept in the L2 cache, with the softmax's maximum carried from block to block (the sums so far and the
//! output so far rescaled when it grows). Materializing a query block's scores over all keys
//! (64 x 4096 floats at a 512x512 image's outer levels) sent every score and probability
//! through the L2 cache and beyond.
//!
//! Numerics as the unblocked kernel: f32 scores and sums, probabilities rounded to bf16 for
//! `p v` (relative to the running maximum; torch's CPU flash attention does the same), the
//! output divided by its f32 sum and rounded once.

use half::bf16;
use rayon::prelude::*;

use super::aligned::Aligned;
use super::amx::{self, LeftTiles, BLOCK, TILE_K, TILE_ROWS};
use super::attention_f32::Shape;
use super::attention_half::{exp_row, pack_head, row_max};
use super::common::{round_bf16_affine, OutPtr};
use super::simd;

/// Queries per block: two blocks of 32 rows share each tile of keys and values loaded.
const QUERIES: usize = 64;
/// Keys per block: the block's scores (`QUERIES * KEYS` floats, 64 KiB) and probabilities
/// (32 KiB) stay in the L2 cache. Blocks of 128 keys were no faster at 4096 keys and slower at
/// 1024 (the softmax's per-row work is per block).
const KEYS: usize = 256;

/// Whether this kernel beats the unblocked one for `s_kv` keys: for one block of keys (the
/// text's 77 tokens: the scores come straight from the tiles, the queries read in place) and
/// for more keys than the L2 cache holds a query block's scores and probabilities of (over
/// 2048). In between (1024 keys, a 256x256 image's outer level) the rescaling between blocks
/// costs more than the cache saves. Measured with `attention_bench` on AMX, 1 thread.
pub(crate) fn suits(s_kv: usize) -> bool {
    s_kv <= KEYS || s_kv > 2048
}

/// Attention of bf16 `q`, `k`, `v` (`[batch, seq, heads * head_dim]`, contiguous) into `out`
/// (as `q`), every (sample, head) in parallel on rayon's pool.
///
/// # Panics
/// Unless AMX is this process's bf16 kernel ([`super::half_gemm::kernel`]).
pub(crate) fn attention(q: &[bf16], k: &[bf16], v: &[bf16], shape: Shape, out: &mut [bf16]) {
    assert!(amx::available(), "the flash kernel runs on AMX");
    let Shape {
        batch,
        heads,
        head_dim: d,
        ..
    } = shape;
    let d_pad = d.next_multiple_of(BLOCK);
    let ptr = OutPtr(out.as_mut_ptr());
    (0..batch * heads).into_par_iter().for_each_init(
        || Scratch {
            queries: Aligned::zeroed(QUERIES * d_pad),
            scores: Aligned::zeroed(QUERIES * KEYS),
            probs: Aligned::zeroed(QUERIES * KEYS),
            sums: Aligned::zeroed(QUERIES * d_pad),
        },
        |scratch, job| simd::vectorize!(head(q, k, v, shape, job, scratch, ptr)),
    );
}

/// A job's buffers, each on a cache line for the tiles.
struct Scratch {
    /// The block's queries, `d_pad` values a row, zero past the head's `d`.
    queries: Aligned<bf16>,
    /// `q k^T` of the block's queries and keys, `KEYS` floats a row.
    scores: Aligned<f32>,
    /// The scores' probabilities, `KEYS` values a row, zero past the keys a row sees.
    probs: Aligned<bf16>,
    /// The output so far, `d_pad` floats a row.
    sums: Aligned<f32>,
}

/// One (sample, head): `job = sample * heads + head`.
#[inline(always)]
fn head(
    q: &[bf16],
    k: &[bf16],
    v: &[bf16],
    shape: Shape,
    job: usize,
    scratch: &mut Scratch,
    out: OutPtr<bf16>,
) {
    let Shape {
        s_q,
        s_kv,
        heads,
        head_dim: d,
        masking,
        ..
    } = shape;
    let inner = heads * d;
    let d_pad = d.next_multiple_of(BLOCK);
    let scale = 1.0 / (d as f32).sqrt();
    let (sample, head) = (job / heads, job % heads);
    let (keys, values) = pack_head(k, v, shape, job);
    debug_assert_eq!(keys.k_pad(), d_pad);
    let key_panel = keys.k_pad() / 2 * TILE_ROWS;
    let value_panel = values.k_pad() / 2 * TILE_ROWS;
    // SAFETY: `attention` checked that AMX is there.
    unsafe { amx::configure_thread() };
    let mut row0 = 0;
    while row0 < s_q {
        let rows = QUERIES.min(s_q - row0);
        let row_blocks = rows.div_ceil(BLOCK);
        let q0 = (sample * s_q + row0) * inner + head * d;
        for (r, dst) in scratch
            .queries
            .as_mut_slice()
            .chunks_exact_mut(d_pad)
            .enumerate()
        {
            if r < rows {
                dst[..d].copy_from_slice(&q[q0 + r * inner..q0 + r * inner + d]);
            } else {
                dst.fill(bf16::ZERO);
            }
        }
        scratch.sums.as_mut_slice().fill(0.0);
        let mut max = [f32::NEG_INFINITY; QUERIES];
        let mut total = [0.0f32; QUERIES];
        let mut key0 = 0;
        while key0 < s_kv {
            let len = KEYS.min(s_kv - key0);
            let len_pad = len.next_multiple_of(BLOCK);
            // Scores: each 32-key block of `k^T` against every 32-row block of queries.
            for col in (0..len_pad).step_by(BLOCK) {
                let panel = (key0 + col) / TILE_ROWS;
                for block in 0..row_blocks {
                    // SAFETY: the query tiles lie in `queries` (`QUERIES` rows of `d_pad`), the
                    // key panels `panel, panel + 1` exist (keys padded to 32), and the 32x32
                    // scores at (`block * 32`, `col`) lie in `scores` (`QUERIES` rows of `KEYS`).
                    unsafe {
                        amx::block_2x2(
                            query_tiles(scratch.queries.as_slice(), d_pad, block * BLOCK, 0),
                            keys.panels()[panel * key_panel..].as_ptr().cast::<u16>(),
                            key_panel * 4,
                            d_pad / TILE_K,
                            scratch.scores.as_mut_slice()[block * BLOCK * KEYS + col..]
                                .as_mut_ptr(),
                            KEYS * 4,
                            false,
                        );
                    }
                }
            }
            // The softmax so far: the running maximum, the probabilities against it, the sums
            // and the output rescaled where the maximum grew.
            for r in 0..rows {
                let seen = masking
                    .visible(row0 + r, s_kv)
                    .saturating_sub(key0)
                    .min(len);
                let scores = &scratch.scores.as_slice()[r * KEYS..r * KEYS + seen];
                let probs = &mut scratch.probs.as_mut_slice()[r * KEYS..(r + 1) * KEYS];
                let grown = max[r].max(row_max(scores));
                if grown == f32::NEG_INFINITY {
                    probs.fill(bf16::ZERO);
                    continue;
                }
                let (seen_probs, rest) = probs.split_at_mut(seen);
                rest.fill(bf16::ZERO);
                let sum = exp_row(scores, grown, scale, seen_probs);
                if grown > max[r] {
                    let factor = if max[r] == f32::NEG_INFINITY {
                        0.0
                    } else {
                        ((max[r] - grown) * scale).exp()
                    };
                    total[r] *= factor;
                    for s in &mut scratch.sums.as_mut_slice()[r * d_pad..(r + 1) * d_pad] {
                        *s *= factor;
                    }
                    max[r] = grown;
                }
                total[r] += sum;
            }
            // `p v`, added to the output so far.
            for col in (0..d_pad).step_by(BLOCK) {
                let panel = col / TILE_ROWS;
                let b = &values.panels()[panel * value_panel + key0 / 2 * TILE_ROWS..];
                for block in 0..row_blocks {
                    let probs = &scratch.probs.as_slice()[block * BLOCK * KEYS..];
                    // SAFETY: 32 rows of `len_pad` probabilities lie in `probs` (`KEYS` a row,
                    // rows past `rows` zero or finite leftovers never written out); the value
                    // panels hold `len_pad` keys from `key0` (padded with zero keys to 32); the
                    // 32x32 sums at (`block * 32`, `col`) lie in `sums`.
                    unsafe {
                        amx::block_2x2(
                            LeftTiles {
                                top: probs.as_ptr().cast::<u16>(),
                                bottom: probs[TILE_ROWS * KEYS..].as_ptr().cast::<u16>(),
                                row_bytes: KEYS * 2,
                                step_bytes: TILE_K * 2,
                            },
                            b.as_ptr().cast::<u16>(),
                            value_panel * 4,
                            len_pad / TILE_K,
                            scratch.sums.as_mut_slice()[block * BLOCK * d_pad + col..].as_mut_ptr(),
                            d_pad * 4,
                            true,
                        );
                    }
                }
            }
            key0 += len;
        }
        let rows_out = scratch.sums.as_slice().chunks_exact(d_pad).zip(&total);
        for (r, (sums, total)) in rows_out.take(rows).enumerate() {
            let at = q0 + r * inner;
            // SAFETY: this job alone writes head `head` of these query rows.
            let dst = unsafe { std::slice::from_raw_parts_mut(out.add(at).0, d) };
            round_bf16_affine(&sums[..d], 1.0 / total, 0.0, dst);
        }
        row0 += rows;
    }
}

/// The tiles of 32 query rows from `row0`, from step `step` of the head's values.
fn query_tiles(queries: &[bf16], d_pad: usize, row0: usize, step: usize) -> LeftTiles {
    let top = queries[row0 * d_pad + step * TILE_K..]
        .as_ptr()
        .cast::<u16>();
    LeftTiles {
        top,
        bottom: top.wrapping_add(TILE_ROWS * d_pad),
        row_bytes: d_pad * 2,
        step_bytes: TILE_K * 2,
    }
}
