//! Winograd convolutions for 3x3, stride 1, padding 1 kernels: F(2x2, 3x3) in f32
//! ([`super::conv_f32`]) and in bf16 ([`super::conv_half`]), F(4x4, 3x3) in f32 on large planes.
//! F(2x2, 3x3) makes each 2x2 output tile from a 4x4 input tile with 16 multiplies per (input,
//! output) channel pair instead of 36 (2.25x less product work); F(4x4, 3x3) each 4x4 tile from
//! a 6x6 one with 36 instead of 144 (4x less). The transforms are additions and small multiples
//! over contiguous rows of tiles (vectorised).
//!
//! Per chunk of tile rows: `v[xi][c][t]` = `B^T d B` of every input tile, one product
//! `m[xi] = u[xi] @ v[xi]` per tile element `xi` with `u[xi][co][c]` = `G g G^T` of the weights,
//! then `A^T m A` into the output. The transforms run in f32. F(2x2, 3x3)'s coefficients are 0,
//! +-1 and 1/2, so in f32 its errors stay at f32 rounding; F(4x4, 3x3)'s (up to 8, and 1/6 and
//! 1/24) add a few more roundings per value (tested against f64). In bf16 the transformed
//! weights and tiles are rounded to bf16 for the products (f32 sums), the one rounding each
//! side takes that a direct bf16 convolution does not: the output's error grows to about one
//! bf16 rounding of its scale (tested against f64); F(4x4, 3x3) would amplify it, so bf16 takes
//! F(2x2, 3x3) only.

use std::sync::Arc;

use burn_flex::FlexTensor;
use half::bf16;
use rayon::prelude::*;

use super::aligned::Aligned;
use super::common::{f32_product, round_bf16_affine, widen, zeroed_bf16, OutPtr, Strided};
use super::conv_f32::{ConvShape, TransformSize, PLANNED_SAMPLES};
use super::half_gemm::{self, PackedB, BLOCK};
use super::simd;
use super::weight_cache::WeightCache;
use crate::weights;

/// Tiles per product column block.
const TILE_CHUNK: usize = 256;

/// The fewest tiles a chunk is split down to for more threads: each chunk's products pack
/// their weights again, and narrower ones spent more on that than on multiplying (F(4x4, 3x3)
/// on 32x32 planes with 2 threads had made chunks of 16 tiles).
const MIN_CHUNK_TILES: usize = 64;

/// Pairs (output, input channel) per job of [`transform_weight`]: a whole number of
/// [`LANES`].
const TRANSFORM_JOB: usize = 1 << 13;

/// Pairs transformed side by side in [`transform_pairs`], one per vector lane.
const LANES: usize = 16;

/// `u` of an f32 weight `[c_out, c_in, 3, 3]` (contiguous) for F(2x2, 3x3), held as [`held`]
/// says.
pub(crate) fn weight_f32(
    weight: &FlexTensor,
    c_out: usize,
    c_in: usize,
    size: TransformSize,
) -> Arc<Vec<f32>> {
    static CACHE: WeightCache<Vec<f32>> = WeightCache::new();
    held(&CACHE, weight, size, || {
        transform_weight::<F2>(weight.storage(), c_out, c_in)
    })
}

/// [`weight_f32`] for a bf16 weight and F(2x2, 3x3): transformed in f32, rounded to bf16 once.
pub(crate) fn weight_bf16(
    weight: &FlexTensor,
    c_out: usize,
    c_in: usize,
    size: TransformSize,
) -> Arc<Vec<bf16>> {
    static CACHE: WeightCache<Vec<bf16>> = WeightCache::new();
    held(&CACHE, weight, size, || {
        let u = transform_weight::<F2>(widen(weight).storage(), c_out, c_in);
        let mut rounded = zeroed_bf16(u.len());
        round_bf16_affine(&u, 1.0, 0.0, &mut rounded);
        rounded
    })
}

/// `weight`'s transform, made by `make`: kept while the weight lives ([`WeightCache`]) where
/// it is [`TransformSize::Small`] or where the weight is held as the mapped checkpoint, made
/// for this call otherwise. A kept transform is all the convolution reads of its weight, so a
/// mapped weight's pages are handed back once it is made (a later read of the weight faults them
/// in again): a large transform then takes the weight's place in memory rather than adding
/// to it. Made on every call, a small weight's transform cost as much as the products of a 16x16
/// plane.
fn held<T>(
    cache: &WeightCache<T>,
    weight: &FlexTensor,
    size: TransformSize,
    make: impl FnOnce() -> T,
) -> Arc<T> {
    if size == TransformSize::Large && !weights::is_mapped(weight.bytes()) {
        return Arc::new(make());
    }
    cache.get_or_make(weight, || {
        let u = make();
        weights::release_if_mapped(weight.bytes());
        u
    })
}

/// `u[xi][co][c]`: the weight `[co, c, 3, 3]` transformed by `G g G^T` of the tiling `W`, in
/// parallel over blocks of pairs. F(4x4, 3x3) makes it on every call: 36/9 of the weight, kept
/// it would hold the most memory for the least time (the products it serves are the largest).
pub(crate) fn transform_weight<W: Tiling>(weight: &[f32], c_out: usize, c_in: usize) -> Vec<f32> {
    let mut u = vec![0.0f32; W::ELEMS * c_out * c_in];
    transform_weight_into::<W>(weight, c_out, c_in, &mut u);
    u
}

/// [`transform_weight`] for one call, in a buffer kept for the next call's transform
/// ([`CallBuffer`]): a compiled program's host kernel makes every transform per call, and one of
/// a large layer is tens of megabytes. Allocated anew on every call, it can come back from the
/// allocator as fresh pages (from a glibc per-thread arena always so above 64 MiB, its largest
/// heap, unless the process keeps one arena as `oxidiff::tune_allocator` does), and faulting
/// them in cost more than making the transform. The spare stays held (the largest transform
/// seen), so the CPU backend, which keeps its large transforms, does not use it.
pub(crate) fn transform_for_call<W: Tiling>(
    weight: &[f32],
    c_out: usize,
    c_in: usize,
) -> CallBuffer {
    let mut u = CallBuffer::take(W::ELEMS * c_out * c_in);
    transform_weight_into::<W>(weight, c_out, c_in, &mut u.values);
    u
}

/// A weight's transform as a convolution reads it: kept while its weight lives
/// ([`weight_f32`]), made for this call ([`transform_weight`]), or made for this call in the
/// spare buffer ([`transform_for_call`]).
pub(crate) enum Transform {
    Kept(Arc<Vec<f32>>),
    Made(Vec<f32>),
    ForCall(CallBuffer),
}

impl std::ops::Deref for Transform {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        match self {
            Self::Kept(u) => u,
            Self::Made(u) => u,
            Self::ForCall(u) => u,
        }
    }
}

/// A buffer of `f32`s for a transform made for one call, handed back on drop to a one-buffer
/// spare kept for the next (the largest one seen, so its pages stay in place from one call to
/// the next; a call made while another holds the spare allocates its own).
pub(crate) struct CallBuffer {
    values: Vec<f32>,
}

/// The spare [`CallBuffer`].
static SPARE: std::sync::Mutex<Vec<f32>> = std::sync::Mutex::new(Vec::new());

/// Frees the spare [`CallBuffer`]: the largest transform a call made so far (105 MB for SD
/// 1.5's 1280-channel upsampler at F(2x2, 3x3)) is not held while layers with smaller ones run
/// (a VAE's decode after a UNet's steps); the next call allocates it again.
pub fn release_call_buffer() {
    *SPARE.lock().unwrap_or_else(|e| e.into_inner()) = Vec::new();
}

impl CallBuffer {
    /// `len` values of unspecified content (the caller writes them all): what the spare held
    /// before, zeros past that.
    fn take(len: usize) -> Self {
        let mut values = std::mem::take(&mut *SPARE.lock().unwrap_or_else(|e| e.into_inner()));
        values.resize(len, 0.0);
        Self { values }
    }
}

impl std::ops::Deref for CallBuffer {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        &self.values
    }
}

impl Drop for CallBuffer {
    fn drop(&mut self) {
        let mut spare = SPARE.lock().unwrap_or_else(|e| e.into_inner());
        if self.values.capacity() > spare.capacity() {
            *spare = std::mem::take(&mut self.values);
        }
    }
}

/// [`transform_weight`] into `u`, which holds `W::ELEMS * c_out * c_in` values; every one is
/// written.
fn transform_weight_into<W: Tiling>(weight: &[f32], c_out: usize, c_in: usize, u: &mut [f32]) {
    let plane = c_out * c_in;
    assert_eq!(weight.len(), 9 * plane, "a [c_out, c_in, 3, 3] weight");
    assert_eq!(
        u.len(),
        W::ELEMS * plane,
        "a transform of the weight's size"
    );
    if plane == 0 {
        return;
    }
    // Each job's part of each of the planes `u[xi]`.
    let mut jobs: Vec<Vec<&mut [f32]>> = (0..plane.div_ceil(TRANSFORM_JOB))
        .map(|_| Vec::with_capacity(W::ELEMS))
        .collect();
    for u_xi in u.chunks_exact_mut(plane) {
        for (job, part) in jobs.iter_mut().zip(u_xi.chunks_mut(TRANSFORM_JOB)) {
            job.push(part);
        }
    }
    jobs.into_par_iter()
        .zip(weight.par_chunks(9 * TRANSFORM_JOB))
        .for_each(|(mut parts, g)| simd::vectorize!(transform_pairs::<W>(g, &mut parts)));
}

/// `G g G^T` of the pairs `g` (9 values each) into `u[xi][pair]`, [`LANES`] pairs side by
/// side.
#[inline(always)]
fn transform_pairs<W: Tiling>(g: &[f32], u: &mut [&mut [f32]]) {
    let side = W::OUT + 2;
    let pairs = g.len() / 9;
    for b0 in (0..pairs).step_by(LANES) {
        let n = LANES.min(pairs - b0);
        // e[i][l]: element i of pair b0 + l.
        let mut e = [[0.0f32; LANES]; 9];
        for l in 0..n {
            for (i, e) in e.iter_mut().enumerate() {
                e[l] = g[(b0 + l) * 9 + i];
            }
        }
        // G g (side x 3), then (G g) G^T (side x side).
        let mut gg = [[[0.0f32; LANES]; 3]; 6];
        for col in 0..3 {
            for l in 0..LANES {
                let column = W::g(e[col][l], e[3 + col][l], e[6 + col][l]);
                for (row, value) in column.into_iter().take(side).enumerate() {
                    gg[row][col][l] = value;
                }
            }
        }
        for (row, r) in gg.iter().take(side).enumerate() {
            let mut vals = [[0.0f32; LANES]; 6];
            for l in 0..LANES {
                let values = W::g(r[0][l], r[1][l], r[2][l]);
                for (col, value) in values.into_iter().take(side).enumerate() {
                    vals[col][l] = value;
                }
            }
            for (col, v) in vals.iter().take(side).enumerate() {
                u[row * side + col][b0..b0 + n].copy_from_slice(&v[..n]);
            }
        }
    }
}

/// Tile rows per chunk and chunks per sample for an `h x w` plane in tiles of `W`. With several
/// threads the chunks shrink until there are about four per thread (a 32x32 input is one chunk
/// of [`TILE_CHUNK`] tiles otherwise, and would run on one thread), but not below
/// [`MIN_CHUNK_TILES`] tiles.
fn chunking<W: Tiling>(h: usize, w: usize) -> (usize, usize) {
    let (th, tw) = (h.div_ceil(W::OUT), w.div_ceil(W::OUT));
    let mut rows_per_chunk = (TILE_CHUNK / tw).clamp(1, th);
    let threads = rayon::current_num_threads();
    while threads > 1
        && rows_per_chunk > 1
        && PLANNED_SAMPLES * th.div_ceil(rows_per_chunk) < 4 * threads
        && rows_per_chunk.div_ceil(2) * tw >= MIN_CHUNK_TILES
    {
        rows_per_chunk = rows_per_chunk.div_ceil(2);
    }
    (rows_per_chunk, th.div_ceil(rows_per_chunk))
}

/// Convolves `x` `[n, c_in, h, w]` with the transformed weights `u` ([`weight_f32`] for
/// [`F2`], [`transform_weight`] for [`F4`]) into `out` `[n, c_out, h, w]`, which holds the
/// bias, in parallel over (sample, chunk of tile rows) on rayon's pool.
pub(crate) fn conv_f32<W: Tiling>(x: &[f32], u: &[f32], out: &mut [f32], shape: &ConvShape) {
    let &ConvShape {
        n,
        c_in,
        c_out,
        h,
        w,
        ..
    } = shape;
    let (rows_per_chunk, chunks) = chunking::<W>(h, w);
    let tw = w.div_ceil(W::OUT);
    let out_ptr = OutPtr(out.as_mut_ptr());
    (0..n * chunks).into_par_iter().for_each_init(
        || {
            let tiles = rows_per_chunk * tw;
            (
                W::new(tw),
                vec![0.0f32; W::ELEMS * c_in * tiles],
                vec![0.0f32; W::ELEMS * c_out * tiles],
            )
        },
        |(s, v, m), job| {
            simd::vectorize!({
                let (b, chunk) = (job / chunks, job % chunks);
                let x = &x[b * c_in * h * w..(b + 1) * c_in * h * w];
                let row0 = chunk * rows_per_chunk;
                let row1 = (row0 + rows_per_chunk).min(h.div_ceil(W::OUT));
                let tiles = (row1 - row0) * tw;
                s.transform_input(x, c_in, h, w, row0, row1, |xi, c, t0, cols| {
                    v[(xi * c_in + c) * tiles + t0..][..tw].copy_from_slice(cols);
                });
                // m[xi] [c_out, tiles] = u[xi] [c_out, c_in] @ v[xi] [c_in, tiles].
                for xi in 0..W::ELEMS {
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
                s.transform_output(m, c_out, tiles, c_out, h, row0, row1, |co, oh, y| {
                    // SAFETY: jobs write disjoint output rows of disjoint samples.
                    let row =
                        unsafe { std::slice::from_raw_parts_mut(out.add((co * h + oh) * w).0, w) };
                    W::scatter_row(row, y, tw, |d, v| *d += v);
                });
            })
        },
    );
}

/// Convolves bf16 `x` `[n, c_in, h, w]` with the transformed weights `u` ([`weight_bf16`])
/// into `out` `[n, c_out, h, w]` by F(2x2, 3x3), `bias` added to the f32 sums before they are
/// rounded, in parallel over (sample, chunk of tile rows) on rayon's pool; the products on
/// [`half_gemm`] (which must be [`available`](half_gemm::available)).
pub(crate) fn conv_bf16(x: &[bf16], u: &[bf16], bias: &[f32], out: &mut [bf16], shape: &ConvShape) {
    let &ConvShape {
        n,
        c_in,
        c_out,
        h,
        w,
        ..
    } = shape;
    let (rows_per_chunk, chunks) = chunking::<F2>(h, w);
    let tw = w.div_ceil(2);
    // The products' f32 output: `c_out` rounded up to whole blocks of rows, each row the
    // chunk's tiles rounded up to whole blocks of columns.
    let ld = (rows_per_chunk * tw).next_multiple_of(BLOCK);
    let plane_m = c_out.next_multiple_of(BLOCK) * ld;
    let out_ptr = OutPtr(out.as_mut_ptr());
    (0..n * chunks).into_par_iter().for_each_init(
        || {
            (
                F2::new(tw),
                vec![bf16::ZERO; 16 * c_in * rows_per_chunk * tw],
                Aligned::<f32>::zeroed(16 * plane_m),
                vec![0.0f32; w],
            )
        },
        |(s, v, m, row_f32), job| {
            simd::vectorize!({
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
                s.transform_output(m, plane_m / ld, ld, c_out, h, row0, row1, |co, oh, y| {
                    F2::scatter_row(row_f32, y, tw, |d, v| *d = v);
                    // SAFETY: jobs write disjoint output rows of disjoint samples.
                    let row =
                        unsafe { std::slice::from_raw_parts_mut(out.add((co * h + oh) * w).0, w) };
                    round_bf16_affine(row_f32, 1.0, bias[co], row);
                });
            })
        },
    );
}

/// A Winograd tiling F(OUT x OUT, 3x3): its transforms over one row of `tw` tiles, and the
/// job scratch they use.
pub(crate) trait Tiling: Send + Sized {
    /// The output tile's side.
    const OUT: usize;
    /// Elements of a transformed tile, `(OUT + 2)^2`: the products per chunk.
    const ELEMS: usize = (Self::OUT + 2) * (Self::OUT + 2);

    fn new(tw: usize) -> Self;

    /// `G` times one column `(g0, g1, g2)` of a 3x3 kernel: the first `OUT + 2` values.
    fn g(g0: f32, g1: f32, g2: f32) -> [f32; 6];

    /// `B^T d B` of the `tw` tiles of tile row `ti` of one channel plane into
    /// [`TileRow::cols`].
    fn input_tile_row<T: Copy + Into<f32>>(&mut self, plane: &[T], h: usize, w: usize, ti: usize);

    /// The row of tiles' buffers.
    fn row(&self) -> &TileRow;

    /// `A^T m A` of one tile row, `m[xi]` the `tw` tiles' element `xi`, into [`TileRow::y`].
    fn output_tile_row(&mut self, m: &[&[f32]]);

    /// `put(row[x], value)` for every column `x` of an output row from its `OUT` runs `y` of
    /// one [`TileRow::y`] row.
    #[inline(always)]
    fn scatter_row(row: &mut [f32], y: &[f32], tw: usize, put: impl Fn(&mut f32, f32)) {
        let mut groups = row.chunks_exact_mut(Self::OUT);
        for (j, group) in (&mut groups).enumerate() {
            for (dx, dst) in group.iter_mut().enumerate() {
                put(dst, y[dx * tw + j]);
            }
        }
        for (dx, dst) in groups.into_remainder().iter_mut().enumerate() {
            put(dst, y[dx * tw + tw - 1]);
        }
    }

    /// `B^T d B` of tile rows `row0..row1` of every channel of one sample's `x`
    /// `[c_in, h, w]`: `store(xi, c, t0, values)` receives element `xi` of the row's `tw` tiles
    /// of channel `c`, the first being tile `t0` of the chunk.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
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
        let tw = self.row().tw;
        for c in 0..c_in {
            let plane = &x[c * h * w..(c + 1) * h * w];
            for ti in row0..row1 {
                self.input_tile_row(plane, h, w, ti);
                let t0 = (ti - row0) * tw;
                for xi in 0..Self::ELEMS {
                    store(xi, c, t0, &self.row().cols[xi * tw..(xi + 1) * tw]);
                }
            }
        }
    }

    /// `A^T m A` of tile rows `row0..row1` for every output channel, from `m` (element `xi` of
    /// channel `co`'s tiles at `m[(xi * rows_m + co) * ld..]`): `store(co, oh, y)` receives
    /// output row `oh` as `OUT` runs of `tw` values ([`Self::scatter_row`] lays them out).
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn transform_output(
        &mut self,
        m: &[f32],
        rows_m: usize,
        ld: usize,
        c_out: usize,
        h: usize,
        row0: usize,
        row1: usize,
        mut store: impl FnMut(usize, usize, &[f32]),
    ) {
        let tw = self.row().tw;
        for co in 0..c_out {
            for ti in row0..row1 {
                let t0 = (ti - row0) * tw;
                let m: [&[f32]; 36] = std::array::from_fn(|xi| {
                    if xi < Self::ELEMS {
                        &m[(xi * rows_m + co) * ld + t0..][..tw]
                    } else {
                        &[]
                    }
                });
                self.output_tile_row(&m[..Self::ELEMS]);
                for dy in 0..Self::OUT {
                    let oh = Self::OUT * ti + dy;
                    if oh >= h {
                        break;
                    }
                    store(
                        co,
                        oh,
                        &self.row().y[dy * Self::OUT * tw..][..Self::OUT * tw],
                    );
                }
            }
        }
    }
}

/// The buffers of a row of `tw` tiles that every tiling has.
pub(crate) struct TileRow {
    tw: usize,
    /// The last input transform: `ELEMS` runs of `tw` values, `cols[xi * tw + j]` element `xi`
    /// of tile `j`.
    cols: Vec<f32>,
    /// The last output transform: for each of the `OUT` output rows, `OUT` runs of `tw` values
    /// (`y[(dy * OUT + dx) * tw + j]` is column `OUT * j + dx` of row `dy`).
    y: Vec<f32>,
}

impl TileRow {
    fn new<W: Tiling>(tw: usize) -> Self {
        Self {
            tw,
            cols: vec![0.0; W::ELEMS * tw],
            y: vec![0.0; W::OUT * W::OUT * tw],
        }
    }
}

/// The first `N` runs of `len` values of `buf`, as mutable slices.
#[inline(always)]
fn runs<const N: usize>(buf: &mut [f32], len: usize) -> [&mut [f32]; N] {
    let mut rest = &mut buf[..N * len];
    std::array::from_fn(|_| {
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(len);
        rest = tail;
        head
    })
}

/// F(2x2, 3x3): one job's scratch for the transforms of a row of `tw` tiles.
pub(crate) struct F2 {
    row: TileRow,
    even: Vec<f32>,
    odd: Vec<f32>,
}

impl Tiling for F2 {
    const OUT: usize = 2;

    fn new(tw: usize) -> Self {
        Self {
            row: TileRow::new::<Self>(tw),
            even: vec![0.0; 4 * (tw + 1)],
            odd: vec![0.0; 4 * (tw + 1)],
        }
    }

    /// G = [1 0 0; .5 .5 .5; .5 -.5 .5; 0 0 1].
    #[inline(always)]
    fn g(g0: f32, g1: f32, g2: f32) -> [f32; 6] {
        [g0, 0.5 * (g0 + g1 + g2), 0.5 * (g0 - g1 + g2), g2, 0.0, 0.0]
    }

    fn row(&self) -> &TileRow {
        &self.row
    }

    /// A^T = [1 1 1 0; 0 1 -1 -1].
    #[inline(always)]
    fn output_tile_row(&mut self, m: &[&[f32]]) {
        let tw = self.row.tw;
        let [y0, y1, y2, y3] = runs::<4>(&mut self.row.y, tw);
        for j in 0..tw {
            let s0 = |b: usize| m[b][j] + m[4 + b][j] + m[8 + b][j];
            let s1 = |b: usize| m[4 + b][j] - m[8 + b][j] - m[12 + b][j];
            y0[j] = s0(0) + s0(1) + s0(2);
            y1[j] = s0(1) - s0(2) - s0(3);
            y2[j] = s1(0) + s1(1) + s1(2);
            y3[j] = s1(1) - s1(2) - s1(3);
        }
    }

    /// B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1].
    #[inline(always)]
    fn input_tile_row<T: Copy + Into<f32>>(&mut self, plane: &[T], h: usize, w: usize, ti: usize) {
        let tw = self.row.tw;
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
        let out = runs::<16>(&mut self.row.cols, tw);
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

/// F(4x4, 3x3) with the points 0, +-1, +-2: one job's scratch for the transforms of a row of
/// `tw` tiles.
pub(crate) struct F4 {
    row: TileRow,
    /// Six input rows, each split into four phases `phase[q][m] = row[4m + q - 1]`.
    phases: Vec<f32>,
    /// `A^T m` of the last tile row, before the columns' `A`.
    z: Vec<f32>,
}

impl F4 {
    /// `B^T d` of one column `d` of a 6x6 tile (and `d B` of one of its rows):
    /// B^T = [4 0 -5 0 1 0; 0 -4 -4 1 1 0; 0 4 -4 -1 1 0; 0 -2 -1 2 1 0; 0 2 -1 -2 1 0;
    /// 0 4 0 -5 0 1].
    #[inline(always)]
    fn bt([d0, d1, d2, d3, d4, d5]: [f32; 6]) -> [f32; 6] {
        let (s, t) = (d3 + d4, d1 + d2);
        let (u, v) = (d4 - d3, d1 - d2);
        let (p, q) = (d4 - d2, 2.0 * (d3 - d1));
        [
            4.0 * d0 - 5.0 * d2 + d4,
            s - 4.0 * t,
            u + 4.0 * v,
            p + q,
            p - q,
            4.0 * d1 - 5.0 * d3 + d5,
        ]
    }

    /// `A^T m` of one column of six: A^T = [1 1 1 1 1 0; 0 1 -1 2 -2 0; 0 1 1 4 4 0;
    /// 0 1 -1 8 -8 1].
    #[inline(always)]
    fn at([m0, m1, m2, m3, m4, m5]: [f32; 6]) -> [f32; 4] {
        let (s12, d12, s34, d34) = (m1 + m2, m1 - m2, m3 + m4, m3 - m4);
        [
            m0 + s12 + s34,
            d12 + 2.0 * d34,
            s12 + 4.0 * s34,
            d12 + 8.0 * d34 + m5,
        ]
    }
}

impl Tiling for F4 {
    const OUT: usize = 4;

    fn new(tw: usize) -> Self {
        Self {
            row: TileRow::new::<Self>(tw),
            phases: vec![0.0; 6 * 4 * (tw + 1)],
            z: vec![0.0; 24 * tw],
        }
    }

    /// G = [1/4 0 0; -1/6 -1/6 -1/6; -1/6 1/6 -1/6; 1/24 1/12 1/6; 1/24 -1/12 1/6; 0 0 1].
    #[inline(always)]
    fn g(g0: f32, g1: f32, g2: f32) -> [f32; 6] {
        let (a, b) = (g0 * (1.0 / 24.0) + g2 * (1.0 / 6.0), g1 * (1.0 / 12.0));
        [
            g0 * 0.25,
            (g0 + g1 + g2) * (-1.0 / 6.0),
            (g0 - g1 + g2) * (-1.0 / 6.0),
            a + b,
            a - b,
            g2,
        ]
    }

    fn row(&self) -> &TileRow {
        &self.row
    }

    #[inline(always)]
    fn output_tile_row(&mut self, m: &[&[f32]]) {
        let tw = self.row.tw;
        // z[dy][b]: A^T over the tile's rows a, for each column b.
        let z = runs::<24>(&mut self.z, tw);
        for j in 0..tw {
            for b in 0..6 {
                let column = Self::at(std::array::from_fn(|a| m[a * 6 + b][j]));
                for (dy, value) in column.into_iter().enumerate() {
                    z[dy * 6 + b][j] = value;
                }
            }
        }
        let y = runs::<16>(&mut self.row.y, tw);
        for j in 0..tw {
            for dy in 0..4 {
                let row = Self::at(std::array::from_fn(|b| z[dy * 6 + b][j]));
                for (dx, value) in row.into_iter().enumerate() {
                    y[dy * 4 + dx][j] = value;
                }
            }
        }
    }

    #[inline(always)]
    fn input_tile_row<T: Copy + Into<f32>>(&mut self, plane: &[T], h: usize, w: usize, ti: usize) {
        let tw = self.row.tw;
        let n = tw + 1;
        // Input rows 4 ti - 1 .. 4 ti + 5, each split into four phases (zero outside the plane).
        for r in 0..6 {
            let phases = &mut self.phases[r * 4 * n..(r + 1) * 4 * n];
            phases.fill(0.0);
            let ih = (4 * ti + r) as isize - 1;
            if ih < 0 || ih as usize >= h {
                continue;
            }
            let row = &plane[ih as usize * w..(ih as usize + 1) * w];
            for (x, v) in row.iter().enumerate() {
                let t = x + 1;
                phases[(t % 4) * n + t / 4] = (*v).into();
            }
        }
        // Tile j's columns are phases 0..4 at j, then phases 0 and 1 at j + 1: d B per input
        // row, then B^T over the six rows.
        let phase = |r: usize, q: usize| &self.phases[(r * 4 + q) * n..][..n];
        let p: [[&[f32]; 4]; 6] = std::array::from_fn(|r| std::array::from_fn(|q| phase(r, q)));
        let out = runs::<36>(&mut self.row.cols, tw);
        for j in 0..tw {
            let e: [[f32; 6]; 6] = std::array::from_fn(|r| {
                let p = &p[r];
                Self::bt([p[0][j], p[1][j], p[2][j], p[3][j], p[0][j + 1], p[1][j + 1]])
            });
            for b in 0..6 {
                let column = Self::bt(std::array::from_fn(|r| e[r][b]));
                for (a, value) in column.into_iter().enumerate() {
                    out[a * 6 + b][j] = value;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|i| {
                ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) % 1000) as f32 / 500.0
                    - 1.0
            })
            .collect()
    }

    /// The tests that use the one spare buffer, one at a time.
    static SPARE_TESTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// `release_call_buffer` frees the spare a call left; the next call allocates its own and
    /// leaves it as the spare again.
    #[test]
    fn the_spare_buffer_is_freed_and_made_again() {
        let _one = SPARE_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        let weight = values(9 * 19 * 23, 5);
        drop(transform_for_call::<F2>(&weight, 19, 23));
        assert!(SPARE.lock().unwrap().capacity() >= 16 * 19 * 23);
        release_call_buffer();
        assert_eq!(SPARE.lock().unwrap().capacity(), 0);
        let again = transform_for_call::<F2>(&weight, 19, 23);
        assert_eq!(&*again, &transform_weight::<F2>(&weight, 19, 23)[..]);
        drop(again);
        assert!(SPARE.lock().unwrap().capacity() >= 16 * 19 * 23);
    }

    /// A transform made for a call reuses the spare buffer of an earlier, larger one: every
    /// value is written again, so it equals a transform made in a fresh buffer, for both
    /// tilings and odd channel counts.
    #[test]
    fn a_transform_for_a_call_equals_a_fresh_one_after_a_larger_one() {
        let _one = SPARE_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        let (big_out, big_in) = (37, 29);
        let big = transform_for_call::<F4>(&values(9 * big_out * big_in, 1), big_out, big_in);
        let big_len = big.len();
        drop(big);
        for (c_out, c_in, seed) in [(5, 3, 2), (17, 11, 3), (1, 1, 4)] {
            let weight = values(9 * c_out * c_in, seed);
            let f2 = transform_for_call::<F2>(&weight, c_out, c_in);
            assert_eq!(&*f2, &transform_weight::<F2>(&weight, c_out, c_in)[..]);
            drop(f2);
            let f4 = transform_for_call::<F4>(&weight, c_out, c_in);
            assert_eq!(f4.len(), 36 * c_out * c_in);
            assert!(f4.len() < big_len);
            assert_eq!(&*f4, &transform_weight::<F4>(&weight, c_out, c_in)[..]);
        }
    }
}
