//! The f32 2-D convolution in NCHW for burn-flex behind [`super::conv::conv2d`]: im2col tiles
//! of whole row segments into gemm, Winograd F(2x2, 3x3) for large 3x3 stride-1 convolutions.
//! The half-precision kernels ([`super::conv_half`]) share its shapes and widen into it where
//! they have no kernel of their own.

use burn::tensor::DType;
use burn_flex::{FlexTensor, Layout};

use super::common::OutPtr;

/// Target number of output positions per tile: large enough for gemm to reach its peak,
/// small enough that the column buffer (`c_in * k * k` rows of it) stays near the caches.
const TILE_COLUMNS: usize = 1024;

/// With several threads, tiles narrower than this many output positions are not made: the
/// convolution runs one sample at a time and gemm splits each product across the threads.
const NARROW_TILE: usize = 256;

/// Below this many input positions (`PLANNED_SAMPLES * h * w`) a 3x3 convolution takes the
/// im2col path: transforming the weights on every call (`16 * c_out * c_in` values) then costs
/// more than the 2.25x fewer multiplies save.
const WINOGRAD_MIN_POSITIONS: usize = 1024;

/// The batch the kernel and the tiles are chosen for, whatever the real batch: two samples,
/// one image with classifier-free guidance. Planning from the real batch would give a sample
/// other tiles (other gemm shapes, so other roundings) in a batch of 4 than alone, and images
/// made in a batch would differ from the same images made one by one.
const PLANNED_SAMPLES: usize = 2;

/// Which kernel `nn::Conv2d` uses on burn-flex in f32, from `OXIDIFF_CPU_CONV` (read once): `burn`
/// (Burn's own `conv2d`), `im2col` (this module without Winograd) or, by default, `winograd`
/// (Winograd for 3x3 stride-1 convolutions of at least [`WINOGRAD_MIN_POSITIONS`] positions).
/// A diagnostic switch for comparing the kernels in one build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConvPath {
    Burn,
    Im2col,
    Winograd,
}

impl ConvPath {
    pub fn from_env() -> Self {
        static PATH: std::sync::OnceLock<ConvPath> = std::sync::OnceLock::new();
        *PATH.get_or_init(|| match std::env::var("OXIDIFF_CPU_CONV").as_deref() {
            Ok("burn") => Self::Burn,
            Ok("im2col") => Self::Im2col,
            _ => Self::Winograd,
        })
    }
}

/// Stride and padding of a square-kernel convolution (dilation 1, one group).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvGeometry {
    pub stride: usize,
    pub padding: usize,
}

/// The kernel on burn-flex tensors (f32, NCHW; any layout, made contiguous first).
pub(crate) fn conv2d_nchw_f32(
    x: &FlexTensor,
    weight: &FlexTensor,
    bias: Option<&FlexTensor>,
    geometry: ConvGeometry,
    path: ConvPath,
) -> FlexTensor {
    let x = x.to_contiguous();
    let weight = weight.to_contiguous();
    let ConvShape {
        n,
        c_in,
        h,
        w,
        c_out,
        k,
        s,
        p,
        h_out,
        w_out,
    } = ConvShape::of(&x, &weight, geometry);
    let plane_out = h_out * w_out;

    let mut out = vec![0.0f32; n * c_out * plane_out];
    if let Some(bias) = bias {
        let bias = bias.to_contiguous();
        let bias: &[f32] = bias.storage();
        for (channel, value) in out.chunks_exact_mut(plane_out).zip(bias.iter().cycle()) {
            channel.fill(*value);
        }
    }
    if plane_out > 0
        && c_out > 0
        && k == 3
        && s == 1
        && p == 1
        && path == ConvPath::Winograd
        && PLANNED_SAMPLES * h * w >= WINOGRAD_MIN_POSITIONS
    {
        let u = winograd::transform_weight(weight.storage(), c_out, c_in);
        winograd::conv(x.storage(), &u, &mut out, n, c_in, c_out, h, w);
    } else if plane_out > 0 && c_out > 0 {
        let problem = Problem {
            x: x.storage(),
            weight: weight.storage(),
            c_in,
            h,
            w,
            c_out,
            k,
            s,
            p,
            h_out,
            w_out,
        };
        problem.run(&mut out, n);
    }
    FlexTensor::new(
        burn::tensor::Bytes::from_elems(out),
        Layout::contiguous(vec![n, c_out, h_out, w_out].into()),
        DType::F32,
    )
}

/// The sizes of one convolution: input `[n, c_in, h, w]`, weight `[c_out, c_in, k, k]`,
/// stride `s`, padding `p`, output `[n, c_out, h_out, w_out]`.
pub(crate) struct ConvShape {
    pub(crate) n: usize,
    pub(crate) c_in: usize,
    pub(crate) h: usize,
    pub(crate) w: usize,
    pub(crate) c_out: usize,
    pub(crate) k: usize,
    pub(crate) s: usize,
    pub(crate) p: usize,
    pub(crate) h_out: usize,
    pub(crate) w_out: usize,
}

impl ConvShape {
    /// Read from the tensors' shapes (the caller checked that the kernel fits the padded input).
    pub(crate) fn of(x: &FlexTensor, weight: &FlexTensor, geometry: ConvGeometry) -> Self {
        let xs = x.layout().shape();
        let ws = weight.layout().shape();
        let (k, s, p) = (ws[2], geometry.stride, geometry.padding);
        Self {
            n: xs[0],
            c_in: xs[1],
            h: xs[2],
            w: xs[3],
            c_out: ws[0],
            k,
            s,
            p,
            h_out: (xs[2] + 2 * p - k) / s + 1,
            w_out: (xs[3] + 2 * p - k) / s + 1,
        }
    }
}

/// One convolution's sizes and data.
struct Problem<'a> {
    x: &'a [f32],
    weight: &'a [f32],
    c_in: usize,
    h: usize,
    w: usize,
    c_out: usize,
    k: usize,
    s: usize,
    p: usize,
    h_out: usize,
    w_out: usize,
}

impl Problem<'_> {
    fn pointwise(&self) -> bool {
        self.k == 1 && self.s == 1 && self.p == 0
    }

    /// Every (sample, tile of output rows), in parallel on rayon's pool.
    fn run(&self, out: &mut [f32], n: usize) {
        use rayon::prelude::*;
        let threads = rayon::current_num_threads();
        let mut rows = (TILE_COLUMNS / self.w_out).clamp(1, self.h_out);
        // With several threads, about four tiles per thread where the rows allow (for the
        // planned batch: a sample's tiles do not depend on the batch it is in).
        while threads > 1 && rows > 1 && PLANNED_SAMPLES * self.h_out.div_ceil(rows) < 4 * threads {
            rows = rows.div_ceil(2);
        }
        if threads > 1 && rows * self.w_out < NARROW_TILE {
            // Few output positions (the deep 8x8 and 16x16 layers): such tiles would make each
            // gemm a few columns wide and stream the whole weight matrix (59 MB for 1280
            // channels) once per tile. One gemm per sample instead, which gemm itself splits
            // across the threads, so the weights are read about once per sample.
            let ptr = OutPtr(out.as_mut_ptr());
            let len = if self.pointwise() {
                0
            } else {
                self.c_in * self.k * self.k * self.h_out * self.w_out
            };
            let mut col = vec![0.0f32; len];
            let parallel = gemm::Parallelism::Rayon(threads);
            for b in 0..n {
                // SAFETY: one sample at a time, all of its rows.
                unsafe { self.tile(ptr, &mut col, b, 0, self.h_out, parallel) };
            }
            return;
        }
        let tiles = self.h_out.div_ceil(rows);
        let ptr = OutPtr(out.as_mut_ptr());
        let col_len = self.c_in * self.k * self.k;
        (0..n * tiles).into_par_iter().for_each_init(
            || {
                vec![
                    0.0f32;
                    if self.pointwise() {
                        0
                    } else {
                        col_len * rows * self.w_out
                    }
                ]
            },
            |col, job| {
                let (b, tile) = (job / tiles, job % tiles);
                let row0 = tile * rows;
                let row1 = (row0 + rows).min(self.h_out);
                // SAFETY: tiles cover disjoint output rows of disjoint samples.
                unsafe { self.tile(ptr, col, b, row0, row1, gemm::Parallelism::None) };
            },
        );
    }

    /// Output rows `row0..row1` of sample `b`: gather the column buffer, one gemm into `out`.
    ///
    /// # Safety
    /// `out` points to `n * c_out * h_out * w_out` floats, and no other thread writes rows
    /// `row0..row1` of sample `b`.
    unsafe fn tile(
        &self,
        out: OutPtr,
        col: &mut [f32],
        b: usize,
        row0: usize,
        row1: usize,
        parallelism: gemm::Parallelism,
    ) {
        let plane_in = self.h * self.w;
        let plane_out = self.h_out * self.w_out;
        let cols = (row1 - row0) * self.w_out;
        let col_len = self.c_in * self.k * self.k;
        let x = &self.x[b * self.c_in * plane_in..(b + 1) * self.c_in * plane_in];
        let (rhs, rhs_rs): (&[f32], usize) = if self.pointwise() {
            (&x[row0 * self.w..], plane_in)
        } else {
            self.gather(&mut col[..col_len * cols], x, row0, row1);
            (&col[..col_len * cols], cols)
        };
        let dst = out.0.add(b * self.c_out * plane_out + row0 * self.w_out);
        gemm::gemm(
            self.c_out,
            cols,
            col_len,
            dst,
            1,
            plane_out as isize,
            true,
            self.weight.as_ptr(),
            1,
            col_len as isize,
            rhs.as_ptr(),
            1,
            rhs_rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }

    /// Fills `col` (see [`Im2col::gather`]).
    fn gather(&self, col: &mut [f32], x: &[f32], row0: usize, row1: usize) {
        self.im2col().gather(col, x, row0, row1);
    }

    fn im2col(&self) -> Im2col {
        Im2col {
            h: self.h,
            w: self.w,
            k: self.k,
            s: self.s,
            p: self.p,
            w_out: self.w_out,
        }
    }
}

/// The column buffer of a convolution: one sample's input `[c_in, h, w]` unrolled so that the
/// product of the weight `[c_out, c_in * k * k]` with it is the convolution.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Im2col {
    pub(crate) h: usize,
    pub(crate) w: usize,
    pub(crate) k: usize,
    pub(crate) s: usize,
    pub(crate) p: usize,
    pub(crate) w_out: usize,
}

impl Im2col {
    /// Fills `col` `[c_in * k * k, (row1 - row0) * w_out]`: row `(c, kh, kw)`, column
    /// `(oh, ow)` holds `x[c, oh * s + kh - p, ow * s + kw - p]`, zero outside the input.
    pub(crate) fn gather<T: Copy + Default>(
        &self,
        col: &mut [T],
        x: &[T],
        row0: usize,
        row1: usize,
    ) {
        self.gather_rows(col, 0, x, row0, row1);
    }

    /// [`Self::gather`] in parallel on rayon's pool, in chunks of rows of `col`.
    pub(crate) fn gather_parallel<T: Copy + Default + Send + Sync>(
        &self,
        col: &mut [T],
        x: &[T],
        row0: usize,
        row1: usize,
    ) {
        use rayon::prelude::*;
        /// Rows of `col` per job: a few hundred KiB of copying, far more than a job's cost.
        const ROWS: usize = 64;
        let cols = (row1 - row0) * self.w_out;
        if cols == 0 {
            return;
        }
        col.par_chunks_mut(cols * ROWS)
            .enumerate()
            .for_each(|(i, rows)| self.gather_rows(rows, i * ROWS, x, row0, row1));
    }

    /// Rows `first..` of [`Self::gather`]'s `col`, as many as `col` holds.
    fn gather_rows<T: Copy + Default>(
        &self,
        col: &mut [T],
        first: usize,
        x: &[T],
        row0: usize,
        row1: usize,
    ) {
        let zero = T::default();
        let (k, s, p, w, w_out) = (self.k, self.s, self.p, self.w, self.w_out);
        let cols = (row1 - row0) * w_out;
        for (r, dst) in col.chunks_exact_mut(cols).enumerate() {
            let r = first + r;
            let (c, kh, kw) = (r / (k * k), (r / k) % k, r % k);
            let plane = &x[c * self.h * w..(c + 1) * self.h * w];
            // Output columns whose input column `ow * s + kw - p` lies inside `0..w`.
            let ow_lo = p.saturating_sub(kw).div_ceil(s).min(w_out);
            let ow_hi = if w + p > kw {
                ((w + p - kw - 1) / s + 1).min(w_out)
            } else {
                0
            }
            .max(ow_lo);
            for (oh, line) in (row0..row1).zip(dst.chunks_exact_mut(w_out)) {
                let ih = (oh * s + kh) as isize - p as isize;
                if ih < 0 || ih as usize >= self.h {
                    line.fill(zero);
                    continue;
                }
                let src = &plane[ih as usize * w..(ih as usize + 1) * w];
                line[..ow_lo].fill(zero);
                line[ow_hi..].fill(zero);
                if ow_lo == ow_hi {
                    continue;
                }
                let first = ow_lo * s + kw - p;
                if s == 1 {
                    line[ow_lo..ow_hi].copy_from_slice(&src[first..first + (ow_hi - ow_lo)]);
                } else {
                    for (o, v) in line[ow_lo..ow_hi]
                        .iter_mut()
                        .zip(src[first..].iter().step_by(s))
                    {
                        *o = *v;
                    }
                }
            }
        }
    }
}

/// Winograd F(2x2, 3x3) for 3x3, stride 1, padding 1 convolutions: each 2x2 output tile from a
/// 4x4 input tile with 16 multiplies per (input, output) channel pair instead of 36, so the
/// gemm work is 2.25x smaller; the transforms are additions over contiguous rows (vectorised).
///
/// Per chunk of tile rows: `v[xi][c][t]` = `B^T d B` of every input tile, 16 gemms
/// `m[xi] = u[xi] @ v[xi]` with `u[xi][co][c]` = `G g G^T` of the weights, then `A^T m A` into
/// the output. Errors stay at f32 rounding (the transforms' coefficients are 0, +-1 and 1/2).
mod winograd {
    use rayon::prelude::*;

    use super::{OutPtr, PLANNED_SAMPLES};

    /// Tiles (2x2 output blocks) per gemm column block.
    const TILE_CHUNK: usize = 256;

    /// `u[xi][co][c]`: the weight `[co, c, 3, 3]` transformed by `G g G^T`.
    pub fn transform_weight(weight: &[f32], c_out: usize, c_in: usize) -> Vec<f32> {
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

    /// Convolves `x` `[n, c_in, h, w]` into `out` `[n, c_out, h, w]`, which holds the bias,
    /// in parallel over (sample, chunk of tile rows) on rayon's pool. With several threads the
    /// chunks shrink until there are about four per thread (a 32x32 input is one chunk of
    /// [`TILE_CHUNK`] tiles otherwise, and would run on one thread).
    #[allow(clippy::too_many_arguments)]
    pub fn conv(
        x: &[f32],
        u: &[f32],
        out: &mut [f32],
        n: usize,
        c_in: usize,
        c_out: usize,
        h: usize,
        w: usize,
    ) {
        let (th, tw) = (h.div_ceil(2), w.div_ceil(2));
        let mut rows_per_chunk = (TILE_CHUNK / tw).clamp(1, th);
        let threads = rayon::current_num_threads();
        while threads > 1
            && rows_per_chunk > 1
            && PLANNED_SAMPLES * th.div_ceil(rows_per_chunk) < 4 * threads
        {
            rows_per_chunk = rows_per_chunk.div_ceil(2);
        }
        let chunks = th.div_ceil(rows_per_chunk);
        let out_ptr = OutPtr(out.as_mut_ptr());
        (0..n * chunks).into_par_iter().for_each_init(
            || Scratch::new(c_in, c_out, rows_per_chunk * tw, tw),
            |scratch, job| {
                let (b, chunk) = (job / chunks, job % chunks);
                let x = &x[b * c_in * h * w..(b + 1) * c_in * h * w];
                // SAFETY: `out` holds `n * c_out * h * w` floats; sample `b`'s part starts here.
                let out = unsafe { out_ptr.add(b * c_out * h * w) };
                let row0 = chunk * rows_per_chunk;
                let row1 = (row0 + rows_per_chunk).min(th);
                // SAFETY: jobs write disjoint output rows of disjoint samples.
                unsafe { chunk_rows(x, u, out, scratch, c_in, c_out, h, w, row0, row1) };
            },
        );
    }

    struct Scratch {
        v: Vec<f32>,
        m: Vec<f32>,
        even: Vec<f32>,
        odd: Vec<f32>,
        cols: Vec<f32>,
    }

    impl Scratch {
        fn new(c_in: usize, c_out: usize, tiles: usize, tw: usize) -> Self {
            Self {
                v: vec![0.0; 16 * c_in * tiles],
                m: vec![0.0; 16 * c_out * tiles],
                even: vec![0.0; 4 * (tw + 1)],
                odd: vec![0.0; 4 * (tw + 1)],
                cols: vec![0.0; 16 * tw],
            }
        }
    }

    /// Tile rows `row0..row1` of one sample.
    #[allow(clippy::too_many_arguments)]
    unsafe fn chunk_rows(
        x: &[f32],
        u: &[f32],
        out: OutPtr,
        s: &mut Scratch,
        c_in: usize,
        c_out: usize,
        h: usize,
        w: usize,
        row0: usize,
        row1: usize,
    ) {
        let tw = w.div_ceil(2);
        let tiles = (row1 - row0) * tw;
        // Input transform into v[xi][c][t].
        for c in 0..c_in {
            let plane = &x[c * h * w..(c + 1) * h * w];
            for ti in row0..row1 {
                input_tile_row(plane, h, w, ti, tw, s);
                let t0 = (ti - row0) * tw;
                for xi in 0..16 {
                    let dst = &mut s.v[(xi * c_in + c) * tiles + t0..][..tw];
                    dst.copy_from_slice(&s.cols[xi * tw..(xi + 1) * tw]);
                }
            }
        }
        // 16 gemms: m[xi] [c_out, tiles] = u[xi] [c_out, c_in] @ v[xi] [c_in, tiles].
        for xi in 0..16 {
            gemm::gemm(
                c_out,
                tiles,
                c_in,
                s.m.as_mut_ptr().add(xi * c_out * tiles),
                1,
                tiles as isize,
                false,
                u.as_ptr().add(xi * c_out * c_in),
                1,
                c_in as isize,
                s.v.as_ptr().add(xi * c_in * tiles),
                1,
                tiles as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
        // Output transform A^T m A, A^T = [1 1 1 0; 0 1 -1 -1], added onto the bias.
        let plane_out = h * w;
        let mut y = vec![0.0f32; 4 * tw];
        for co in 0..c_out {
            let base = out.0.add(co * plane_out);
            for ti in row0..row1 {
                let t0 = (ti - row0) * tw;
                let m: [&[f32]; 16] =
                    std::array::from_fn(|xi| &s.m[(xi * c_out + co) * tiles + t0..][..tw]);
                let (y0, rest) = y.split_at_mut(tw);
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
                    let row = std::slice::from_raw_parts_mut(base.add(oh * w), w);
                    let even = &y[2 * dy * tw..][..tw];
                    let odd = &y[(2 * dy + 1) * tw..][..tw];
                    let mut pairs = row.chunks_exact_mut(2);
                    for ((pair, e), o) in (&mut pairs).zip(even).zip(odd) {
                        pair[0] += e;
                        pair[1] += o;
                    }
                    if let [last] = pairs.into_remainder() {
                        *last += even[tw - 1];
                    }
                }
            }
        }
    }

    /// `B^T d B` of the `tw` tiles of tile row `ti` of one channel plane into
    /// `s.cols[xi][j]`; B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1].
    fn input_tile_row(plane: &[f32], h: usize, w: usize, ti: usize, tw: usize, s: &mut Scratch) {
        let n = tw + 1;
        // Input rows 2 ti - 1 .. 2 ti + 3, split into padded even / odd columns:
        // even[m] = row[2m - 1], odd[m] = row[2m] (zero outside the plane).
        for r in 0..4 {
            let ih = (2 * ti + r) as isize - 1;
            let (even, odd) = (
                &mut s.even[r * n..(r + 1) * n],
                &mut s.odd[r * n..(r + 1) * n],
            );
            if ih < 0 || ih as usize >= h {
                even.fill(0.0);
                odd.fill(0.0);
                continue;
            }
            let row = &plane[ih as usize * w..(ih as usize + 1) * w];
            even.fill(0.0);
            odd.fill(0.0);
            for (e, v) in even[1..].iter_mut().zip(row.iter().skip(1).step_by(2)) {
                *e = *v;
            }
            for (o, v) in odd.iter_mut().zip(row.iter().step_by(2)) {
                *o = *v;
            }
        }
        // Tile j's columns are even[j], odd[j], even[j + 1], odd[j + 1]: d B per input row,
        // then B^T over the four rows.
        let even: [&[f32]; 4] = std::array::from_fn(|r| &s.even[r * n..][..n]);
        let odd: [&[f32]; 4] = std::array::from_fn(|r| &s.odd[r * n..][..n]);
        let (cols, _) = s.cols.split_at_mut(16 * tw);
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
