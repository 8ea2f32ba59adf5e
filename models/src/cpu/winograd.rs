//! Winograd F(2x2, 3x3) for 3x3, stride 1, padding 1 convolutions, in f32
//! ([`super::conv_f32`]) and in bf16 ([`super::conv_half`]): each 2x2 output tile from a 4x4
//! input tile with 16 multiplies per (input, output) channel pair instead of 36, so the product
//! work is 2.25x smaller; the transforms are additions over contiguous rows (vectorised).
//!
//! Per chunk of tile rows: `v[xi][c][t]` = `B^T d B` of every input tile, 16 products
//! `m[xi] = u[xi] @ v[xi]` with `u[xi][co][c]` = `G g G^T` of the weights, then `A^T m A` into
//! the output. The transforms' coefficients are 0, +-1 and 1/2 and run in f32. In f32 the errors
//! stay at f32 rounding. In bf16 the transformed weights and tiles are rounded to bf16 for the
//! products (f32 sums), the one rounding each side takes that a direct bf16 convolution does
//! not: the output's error grows to about one bf16 rounding of its scale (tested against f64).

use std::sync::Arc;

use burn_flex::FlexTensor;
use half::bf16;
use rayon::prelude::*;

use super::aligned::Aligned;
use super::common::{f32_product, round_bf16_affine, widen, zeroed_bf16, OutPtr, Strided};
use super::conv_f32::{ConvShape, WinogradWeight, PLANNED_SAMPLES};
use super::half_gemm::{self, PackedB, BLOCK};
use super::weight_cache::WeightCache;

/// Tiles (2x2 output blocks) per product column block.
const TILE_CHUNK: usize = 256;

/// `u` of an f32 weight `[c_out, c_in, 3, 3]` (contiguous): with [`WinogradWeight::Kept`],
/// transformed on its first use and kept while it lives ([`WeightCache`]; transforming it on
/// every call cost as much as the products of a 16x16 plane), else made for this call.
pub(crate) fn weight_f32(
    weight: &FlexTensor,
    c_out: usize,
    c_in: usize,
    kept: WinogradWeight,
) -> Arc<Vec<f32>> {
    static CACHE: WeightCache<Vec<f32>> = WeightCache::new();
    let make = || transform_weight(weight.storage(), c_out, c_in);
    match kept {
        WinogradWeight::Kept => CACHE.get_or_make(weight, make),
        WinogradWeight::PerCall => Arc::new(make()),
    }
}

/// [`weight_f32`] for a bf16 weight: transformed in f32, rounded to bf16 once.
pub(crate) fn weight_bf16(
    weight: &FlexTensor,
    c_out: usize,
    c_in: usize,
    kept: WinogradWeight,
) -> Arc<Vec<bf16>> {
    static CACHE: WeightCache<Vec<bf16>> = WeightCache::new();
    let make = || {
        let u = transform_weight(widen(weight).storage(), c_out, c_in);
        let mut rounded = zeroed_bf16(u.len());
        round_bf16_affine(&u, 1.0, 0.0, &mut rounded);
        rounded
    };
    match kept {
        WinogradWeight::Kept => CACHE.get_or_make(weight, make),
        WinogradWeight::PerCall => Arc::new(make()),
    }
}

/// `u[xi][co][c]`: the weight `[co, c, 3, 3]` transformed by `G g G^T`.
fn transform_weight(weight: &[f32], c_out: usize, c_in: usize) -> Vec<f32> {
    let plane = c_out * c_in;
    let mut u = vec![0.0f32; 16 * plane];
    for (pair, g) in weight.chunks_exact(9).enumerate() {
        // G g (4x3), then (G g) G^T (4x4); G = [1 0 0; .5 .5 .5; .5 -.5 .5; 0 0 1].
        let mut gg = [[0.0f32; 3]; 4];
        for col in 0..3 {
            let (g0, g1, g2) = (g[col], g[3 + col], g[6 + col]);
            gg[0][col] = g0;
            gg[1][col] = 0.5 * (g0 + g1 + g2);
            gg[2][col] = 0.5 * (g0 - g1 + g2);
            gg[3][col] = g2;
        }
        for (row, r) in gg.iter().enumerate() {
            let vals = [
                r[0],
                0.5 * (r[0] + r[1] + r[2]),
                0.5 * (r[0] - r[1] + r[2]),
                r[2],
            ];
            for (col, v) in vals.into_iter().enumerate() {
                u[(row * 4 + col) * plane + pair] = v;
            }
        }
    }
    u
}

/// Tile rows per chunk and chunks per sample for an `h x w` plane. With several threads the
/// chunks shrink until there are about four per thread (a 32x32 input is one chunk of
/// [`TILE_CHUNK`] tiles otherwise, and would run on one thread).
fn chunking(h: usize, w: usize) -> (usize, usize) {
    let (th, tw) = (h.div_ceil(2), w.div_ceil(2));
    let mut rows_per_chunk = (TILE_CHUNK / tw).clamp(1, th);
    let threads = rayon::current_num_threads();
    while threads > 1
        && rows_per_chunk > 1
        && PLANNED_SAMPLES * th.div_ceil(rows_per_chunk) < 4 * threads
    {
        rows_per_chunk = rows_per_chunk.div_ceil(2);
    }
    (rows_per_chunk, th.div_ceil(rows_per_chunk))
}

/// Convolves `x` `[n, c_in, h, w]` with the transformed weights `u` ([`weight_f32`]) into
/// `out` `[n, c_out, h, w]`, which holds the bias, in parallel over (sample, chunk of tile
/// rows) on rayon's pool.
pub(crate) fn conv_f32(x: &[f32], u: &[f32], out: &mut [f32], shape: &ConvShape) {
    let &ConvShape {
        n,
        c_in,
        c_out,
        h,
        w,
        ..
    } = shape;
    let (rows_per_chunk, chunks) = chunking(h, w);
    let tw = w.div_ceil(2);
    let out_ptr = OutPtr(out.as_mut_ptr());
    (0..n * chunks).into_par_iter().for_each_init(
        || {
            let tiles = rows_per_chunk * tw;
            (
                Tiles::new(tw),
                vec![0.0f32; 16 * c_in * tiles],
                vec![0.0f32; 16 * c_out * tiles],
            )
        },
        |(s, v, m), job| {
            let (b, chunk) = (job / chunks, job % chunks);
            let x = &x[b * c_in * h * w..(b + 1) * c_in * h * w];
            let row0 = chunk * rows_per_chunk;
            let row1 = (row0 + rows_per_chunk).min(h.div_ceil(2));
            let tiles = (row1 - row0) * tw;
            s.transform_input(x, c_in, h, w, row0, row1, |xi, c, t0, cols| {
                v[(xi * c_in + c) * tiles + t0..][..tw].copy_from_slice(cols);
            });
            // 16 products: m[xi] [c_out, tiles] = u[xi] [c_out, c_in] @ v[xi] [c_in, tiles].
            for xi in 0..16 {
                // SAFETY: the three buffers hold the shapes given.
                unsafe {
                    f32_product(
                        [c_out, tiles, c_in],
                        Strided::rows(m.as_mut_ptr().add(xi * c_out * tiles), tiles),
                        Strided::rows(u.as_ptr().add(xi * c_out * c_in), c_in),
                        Strided::rows(v.as_ptr().add(xi * c_in * tiles), tiles),
                        1.0,
                    )
                };
            }
            // SAFETY: `out` holds `n * c_out * h * w` floats; sample `b`'s part starts here.
            let out = unsafe { out_ptr.add(b * c_out * h * w) };
            s.transform_output(
                m,
                c_out,
                tiles,
                c_out,
                h,
                w,
                row0,
                row1,
                |co, oh, even, odd| {
                    // SAFETY: jobs write disjoint output rows of disjoint samples.
                    let row =
                        unsafe { std::slice::from_raw_parts_mut(out.add((co * h + oh) * w).0, w) };
                    let mut pairs = row.chunks_exact_mut(2);
                    for ((pair, e), o) in (&mut pairs).zip(even).zip(odd) {
                        pair[0] += e;
                        pair[1] += o;
                    }
                    if let [last] = pairs.into_remainder() {
                        *last += even[tw - 1];
                    }
                },
            );
        },
    );
}

/// Convolves bf16 `x` `[n, c_in, h, w]` with the transformed weights `u` ([`weight_bf16`])
/// into `out` `[n, c_out, h, w]`, `bias` added to the f32 sums before they are rounded, in
/// parallel over (sample, chunk of tile rows) on rayon's pool; the products on [`half_gemm`]
/// (which must be [`available`](half_gemm::available)).
pub(crate) fn conv_bf16(x: &[bf16], u: &[bf16], bias: &[f32], out: &mut [bf16], shape: &ConvShape) {
    let &ConvShape {
        n,
        c_in,
        c_out,
        h,
        w,
        ..
    } = shape;
    let (rows_per_chunk, chunks) = chunking(h, w);
    let tw = w.div_ceil(2);
    // The products' f32 output: `c_out` rounded up to whole blocks of rows, each row the
    // chunk's tiles rounded up to whole blocks of columns.
    let ld = (rows_per_chunk * tw).next_multiple_of(BLOCK);
    let plane_m = c_out.next_multiple_of(BLOCK) * ld;
    let out_ptr = OutPtr(out.as_mut_ptr());
    (0..n * chunks).into_par_iter().for_each_init(
        || {
            (
                Tiles::new(tw),
                vec![bf16::ZERO; 16 * c_in * rows_per_chunk * tw],
                Aligned::<f32>::zeroed(16 * plane_m),
                vec![0.0f32; w],
            )
        },
        |(s, v, m, row_f32), job| {
            let (b, chunk) = (job / chunks, job % chunks);
            let x = &x[b * c_in * h * w..(b + 1) * c_in * h * w];
            let row0 = chunk * rows_per_chunk;
            let row1 = (row0 + rows_per_chunk).min(h.div_ceil(2));
            let tiles = (row1 - row0) * tw;
            s.transform_input(x, c_in, h, w, row0, row1, |xi, c, t0, cols| {
                let dst = &mut v[(xi * c_in + c) * tiles + t0..][..tw];
                round_bf16_affine(cols, 1.0, 0.0, dst);
            });
            let m = m.as_mut_slice();
            for xi in 0..16 {
                let packed = PackedB::from_rows(&v[xi * c_in * tiles..], tiles, c_in, tiles);
                half_gemm::gemm_f32_on_this_thread(
                    &u[xi * c_out * c_in..],
                    c_in,
                    c_out,
                    &packed,
                    &mut m[xi * plane_m..(xi + 1) * plane_m],
                    ld,
                );
            }
            // SAFETY: `out` holds `n * c_out * h * w` values; sample `b`'s part starts here.
            let out = unsafe { out_ptr.add(b * c_out * h * w) };
            s.transform_output(
                m,
                plane_m / ld,
                ld,
                c_out,
                h,
                w,
                row0,
                row1,
                |co, oh, even, odd| {
                    let mut pairs = row_f32.chunks_exact_mut(2);
                    for ((pair, e), o) in (&mut pairs).zip(even).zip(odd) {
                        pair[0] = *e;
                        pair[1] = *o;
                    }
                    if let [last] = pairs.into_remainder() {
                        *last = even[tw - 1];
                    }
                    // SAFETY: jobs write disjoint output rows of disjoint samples.
                    let row =
                        unsafe { std::slice::from_raw_parts_mut(out.add((co * h + oh) * w).0, w) };
                    round_bf16_affine(row_f32, 1.0, bias[co], row);
                },
            );
        },
    );
}

/// One job's scratch for the transforms of a row of `tw` tiles.
struct Tiles {
    tw: usize,
    even: Vec<f32>,
    odd: Vec<f32>,
    cols: Vec<f32>,
    y: Vec<f32>,
}

impl Tiles {
    fn new(tw: usize) -> Self {
        Self {
            tw,
            even: vec![0.0; 4 * (tw + 1)],
            odd: vec![0.0; 4 * (tw + 1)],
            cols: vec![0.0; 16 * tw],
            y: vec![0.0; 4 * tw],
        }
    }

    /// `B^T d B` of tile rows `row0..row1` of every channel of one sample's `x`
    /// `[c_in, h, w]`: `store(xi, c, t0, values)` receives element `xi` of the row's `tw` tiles
    /// of channel `c`, the first being tile `t0` of the chunk.
    #[allow(clippy::too_many_arguments)]
    fn transform_input<T: Copy + Into<f32>>(
        &mut self,
        x: &[T],
        c_in: usize,
        h: usize,
        w: usize,
        row0: usize,
        row1: usize,
        mut store: impl FnMut(usize, usize, usize, &[f32]),
    ) {
        let tw = self.tw;
        for c in 0..c_in {
            let plane = &x[c * h * w..(c + 1) * h * w];
            for ti in row0..row1 {
                self.input_tile_row(plane, h, w, ti);
                let t0 = (ti - row0) * tw;
                for xi in 0..16 {
                    store(xi, c, t0, &self.cols[xi * tw..(xi + 1) * tw]);
                }
            }
        }
    }

    /// `A^T m A` of tile rows `row0..row1` for every output channel, `A^T = [1 1 1 0; 0 1 -1
    /// -1]`, from `m` (element `xi` of channel `co`'s tiles at `m[(xi * rows_m + co) * ld..]`):
    /// `store(co, oh, even, odd)` receives output row `oh`'s even and odd columns.
    #[allow(clippy::too_many_arguments)]
    fn transform_output(
        &mut self,
        m: &[f32],
        rows_m: usize,
        ld: usize,
        c_out: usize,
        h: usize,
        w: usize,
        row0: usize,
        row1: usize,
        mut store: impl FnMut(usize, usize, &[f32], &[f32]),
    ) {
        let tw = self.tw;
        debug_assert!(w.div_ceil(2) == tw);
        for co in 0..c_out {
            for ti in row0..row1 {
                let t0 = (ti - row0) * tw;
                let m: [&[f32]; 16] =
                    std::array::from_fn(|xi| &m[(xi * rows_m + co) * ld + t0..][..tw]);
                let (y0, rest) = self.y.split_at_mut(tw);
                let (y1, rest) = rest.split_at_mut(tw);
                let (y2, y3) = rest.split_at_mut(tw);
                for j in 0..tw {
                    let s0 = |b: usize| m[b][j] + m[4 + b][j] + m[8 + b][j];
                    let s1 = |b: usize| m[4 + b][j] - m[8 + b][j] - m[12 + b][j];
                    y0[j] = s0(0) + s0(1) + s0(2);
                    y1[j] = s0(1) - s0(2) - s0(3);
                    y2[j] = s1(0) + s1(1) + s1(2);
                    y3[j] = s1(1) - s1(2) - s1(3);
                }
                for dy in 0..2 {
                    let oh = 2 * ti + dy;
                    if oh >= h {
                        break;
                    }
                    let even = &self.y[2 * dy * tw..][..tw];
                    let odd = &self.y[(2 * dy + 1) * tw..][..tw];
                    store(co, oh, even, odd);
                }
            }
        }
    }

    /// `B^T d B` of the `tw` tiles of tile row `ti` of one channel plane into
    /// `cols[xi][j]`; B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1].
    fn input_tile_row<T: Copy + Into<f32>>(&mut self, plane: &[T], h: usize, w: usize, ti: usize) {
        let tw = self.tw;
        let n = tw + 1;
        // Input rows 2 ti - 1 .. 2 ti + 3, split into padded even / odd columns:
        // even[m] = row[2m - 1], odd[m] = row[2m] (zero outside the plane).
        for r in 0..4 {
            let ih = (2 * ti + r) as isize - 1;
            let (even, odd) = (
                &mut self.even[r * n..(r + 1) * n],
                &mut self.odd[r * n..(r + 1) * n],
            );
            even.fill(0.0);
            odd.fill(0.0);
            if ih < 0 || ih as usize >= h {
                continue;
            }
            let row = &plane[ih as usize * w..(ih as usize + 1) * w];
            for (e, v) in even[1..].iter_mut().zip(row.iter().skip(1).step_by(2)) {
                *e = (*v).into();
            }
            for (o, v) in odd.iter_mut().zip(row.iter().step_by(2)) {
                *o = (*v).into();
            }
        }
        // Tile j's columns are even[j], odd[j], even[j + 1], odd[j + 1]: d B per input row,
        // then B^T over the four rows.
        let even: [&[f32]; 4] = std::array::from_fn(|r| &self.even[r * n..][..n]);
        let odd: [&[f32]; 4] = std::array::from_fn(|r| &self.odd[r * n..][..n]);
        let (cols, _) = self.cols.split_at_mut(16 * tw);
        let out: [&mut [f32]; 16] = {
            let mut rest = cols;
            std::array::from_fn(|_| {
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(tw);
                rest = tail;
                head
            })
        };
        for j in 0..tw {
            // d B for each input row r: columns even[j], odd[j], even[j + 1], odd[j + 1].
            let db = |r: usize| {
                let (d0, d1, d2, d3) = (even[r][j], odd[r][j], even[r][j + 1], odd[r][j + 1]);
                [d0 - d2, d1 + d2, d2 - d1, d1 - d3]
            };
            let (a0, a1, a2, a3) = (db(0), db(1), db(2), db(3));
            for b in 0..4 {
                out[b][j] = a0[b] - a2[b];
                out[4 + b][j] = a1[b] + a2[b];
                out[8 + b][j] = a2[b] - a1[b];
                out[12 + b][j] = a1[b] - a3[b];
            }
        }
    }
}
