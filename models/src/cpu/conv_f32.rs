//! The f32 2-D convolution in NCHW for burn-flex behind [`super::conv::conv2d`]: im2col tiles
//! of whole row segments into gemm, Winograd ([`super::winograd`]) for large 3x3 stride-1
//! convolutions.
//! The half-precision kernels ([`super::conv_half`]) share its shapes and widen into it where
//! they have no kernel of their own.

use burn::tensor::DType;
use burn_flex::{FlexTensor, Layout};

use super::common::{f32_product_into, Dst, OutPtr, Strided};
use super::winograd::{self, Tiling, Transform, F2, F4};

/// Target number of output positions per tile: large enough for gemm to reach its peak,
/// small enough that the column buffer (`c_in * k * k` rows of it) stays near the caches.
const TILE_COLUMNS: usize = 1024;

/// With several threads, tiles narrower than this many output positions are not made: the
/// convolution runs one sample at a time and gemm splits each product across the threads.
const NARROW_TILE: usize = 256;

/// Below this many input positions (`PLANNED_SAMPLES * h * w`: planes under 16x16) a 3x3
/// convolution takes the im2col path. Winograd's transformed weights (16/9 of the weight, kept
/// while it lives) would then hold the most memory (a UNet's widest layers are its smallest
/// planes) for little or no time saved (measured on SD 1.5's 8x8 level: bf16 slower, f32 a few
/// percent faster).
const WINOGRAD_MIN_POSITIONS: usize = 512;

/// From this many input positions (`PLANNED_SAMPLES * h * w`: planes of 32x32 and larger) an
/// f32 3x3 convolution takes Winograd F(4x4, 3x3) rather than F(2x2, 3x3): 36 products per
/// 4x4 output tile where F(2x2, 3x3) has 64, for transforms that cost about as much per output.
/// Its weight transform (36/9 of the weight) is made on every call: on these planes that costs
/// little beside the products, and kept it would add the most memory.
const WINOGRAD_F4_MIN_POSITIONS: usize = 2048;

/// The largest weight transform kept beside its weight: a 1280x640 3x3 convolution's in f32 (52
/// MB), a 1280x1280 one's in bf16. Larger ones (SD 1.5's 1280x1280 layers in f32, 105 MB each,
/// and wider ones) are kept only in place of a mapped weight's own pages, and made on every
/// call otherwise: kept beside their weights, they took a 512x512 f32 image's peak memory past
/// diffusers'.
const WINOGRAD_KEPT_MAX_BYTES: usize = 64 << 20;

/// The batch the kernel and the tiles are chosen for, whatever the real batch: two samples,
/// one image with classifier-free guidance. Planning from the real batch would give a sample
/// other tiles (other gemm shapes, so other roundings) in a batch of 4 than alone, and images
/// made in a batch would differ from the same images made one by one.
pub(crate) const PLANNED_SAMPLES: usize = 2;

/// Which kernel `nn::Conv2d` uses on burn-flex in f32, from `OXIDIFF_CPU_CONV` (read once): `burn`
/// (Burn's own `conv2d`), `im2col` (this module without Winograd), `winograd-f2` (Winograd
/// F(2x2, 3x3) only) or, by default, `winograd` (Winograd for 3x3 stride-1 convolutions of at
/// least [`WINOGRAD_MIN_POSITIONS`] positions, F(4x4, 3x3) in f32 from
/// [`WINOGRAD_F4_MIN_POSITIONS`]). A diagnostic switch for comparing the kernels in one build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConvPath {
    Burn,
    Im2col,
    WinogradF2,
    Winograd,
}

impl ConvPath {
    pub fn from_env() -> Self {
        static PATH: std::sync::OnceLock<ConvPath> = std::sync::OnceLock::new();
        *PATH.get_or_init(|| match std::env::var("OXIDIFF_CPU_CONV").as_deref() {
            Ok("burn") => Self::Burn,
            Ok("im2col") => Self::Im2col,
            Ok("winograd-f2") => Self::WinogradF2,
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
    let shape = ConvShape::of(&x, &weight, geometry);
    let mut out = vec![0.0f32; shape.n * shape.c_out * shape.h_out * shape.w_out];
    if let Some(bias) = bias {
        let bias = bias.to_contiguous();
        fill_bias(&mut out, bias.storage(), &shape);
    }
    let source = TransformSource::Tensor(&weight);
    convolve(
        x.storage(),
        weight.storage(),
        &shape,
        path,
        source,
        &mut out,
    );
    FlexTensor::new(
        burn::tensor::Bytes::from_elems(out),
        Layout::contiguous(vec![shape.n, shape.c_out, shape.h_out, shape.w_out].into()),
        DType::F32,
    )
}

/// Each output channel's plane of `out` `[n, c_out, h_out, w_out]` set to its `bias` value,
/// which the kernels then add the convolution to.
fn fill_bias(out: &mut [f32], bias: &[f32], shape: &ConvShape) {
    let plane_out = shape.h_out * shape.w_out;
    for (channel, value) in out
        .chunks_exact_mut(plane_out.max(1))
        .zip(bias.iter().cycle())
    {
        channel.fill(*value);
    }
}

/// The kernel on plain slices, for buffers that are not Burn tensors (a compiled program's on
/// XLA's CPU plugin, through `oxidiff_backend_tpu::host_kernels`): `x` `[n, c_in, h, w]`,
/// `weight` `[c_out, c_in, k, k]` and `bias` `[c_out]`, contiguous, into `out` `[n, c_out,
/// h_out, w_out]`, which is overwritten. Winograd's weight transforms are made for the call,
/// in a buffer kept for the next ([`winograd::transform_for_call`]).
/// The same shapes give the same bits as [`conv2d_nchw_f32`].
pub fn conv2d_f32_slices(
    x: &[f32],
    x_dims: [usize; 4],
    weight: &[f32],
    weight_dims: [usize; 4],
    bias: Option<&[f32]>,
    geometry: ConvGeometry,
    out: &mut [f32],
) -> Result<(), String> {
    let [n, c_in, h, w] = x_dims;
    let [c_out, w_in, k, k2] = weight_dims;
    let (s, p) = (geometry.stride, geometry.padding);
    if w_in != c_in || k != k2 || s == 0 || h + 2 * p < k || w + 2 * p < k {
        return Err(format!(
            "input {x_dims:?} and kernel {weight_dims:?} (stride {s}, padding {p}) are not a square-kernel convolution"
        ));
    }
    let shape = ConvShape {
        n,
        c_in,
        h,
        w,
        c_out,
        k,
        s,
        p,
        h_out: (h + 2 * p - k) / s + 1,
        w_out: (w + 2 * p - k) / s + 1,
    };
    let lengths = [
        (x.len(), n * c_in * h * w, "input"),
        (weight.len(), c_out * c_in * k * k, "kernel"),
        (bias.map_or(c_out, <[f32]>::len), c_out, "bias"),
        (out.len(), n * c_out * shape.h_out * shape.w_out, "output"),
    ];
    if let Some((len, expected, what)) = lengths.iter().find(|(len, expected, _)| len != expected) {
        return Err(format!(
            "the {what} holds {len} values, its shape {expected}"
        ));
    }
    match bias {
        Some(bias) => fill_bias(out, bias, &shape),
        None => out.fill(0.0),
    }
    let source = TransformSource::Slice;
    convolve(x, weight, &shape, ConvPath::from_env(), source, out);
    Ok(())
}

/// Where [`convolve`] gets a Winograd weight transform.
enum TransformSource<'a> {
    /// The CPU backend's weight tensor: F(2x2, 3x3)'s transform is kept with it where it is
    /// small or replaces a mapped weight ([`winograd::weight_f32`]); F(4x4, 3x3)'s is made for
    /// the call.
    Tensor(&'a FlexTensor),
    /// A compiled program's buffer, known only by its values: both transforms are made for the
    /// call, in the spare buffer kept from call to call ([`winograd::transform_for_call`]).
    /// Allocated anew, the largest (over a glibc per-thread arena's 64 MiB heap) came back as
    /// fresh pages on every call, faulted in on the calling thread.
    Slice,
}

impl TransformSource<'_> {
    /// `weight`'s transform for tiling `W`, made for this call: anew for the CPU backend
    /// (which keeps its large F(2x2, 3x3) transforms, so nothing this size is allocated per
    /// call), in the spare buffer for a compiled program's host kernel.
    fn for_call<W: Tiling>(&self, weight: &[f32], c_out: usize, c_in: usize) -> Transform {
        match self {
            Self::Tensor(_) => {
                Transform::Made(winograd::transform_weight::<W>(weight, c_out, c_in))
            }
            Self::Slice => {
                Transform::ForCall(winograd::transform_for_call::<W>(weight, c_out, c_in))
            }
        }
    }
}

/// Adds the convolution of `x` with `weight` to `out` (zeros or the bias): Winograd where
/// [`ConvShape::winograd`] picks it (its weight transform as `source` says), im2col and gemm
/// otherwise.
fn convolve(
    x: &[f32],
    weight: &[f32],
    shape: &ConvShape,
    path: ConvPath,
    source: TransformSource<'_>,
    out: &mut [f32],
) {
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
    } = *shape;
    if let Some(tiling) = shape.winograd(path, 4) {
        match tiling {
            Winograd::F2(size) => {
                let u = match source {
                    TransformSource::Tensor(w) => {
                        Transform::Kept(winograd::weight_f32(w, c_out, c_in, size))
                    }
                    TransformSource::Slice => source.for_call::<F2>(weight, c_out, c_in),
                };
                winograd::conv_f32::<F2>(x, &u, out, shape);
            }
            Winograd::F4 => {
                let u = source.for_call::<F4>(weight, c_out, c_in);
                winograd::conv_f32::<F4>(x, &u, out, shape);
            }
        }
    } else if h_out * w_out > 0 && c_out > 0 {
        let problem = Problem {
            x,
            weight,
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
        problem.run(out, n);
    }
}

/// The size class of a convolution's Winograd weight transform, which decides where it is held
/// ([`super::winograd::weight_f32`]); the values are the same wherever it is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TransformSize {
    /// Up to [`WINOGRAD_KEPT_MAX_BYTES`]: kept while its weight lives.
    Small,
    /// Larger: kept only where it replaces the weight's own pages (a weight held as the mapped
    /// checkpoint), made on every call otherwise.
    Large,
}

/// The Winograd tiling a convolution takes, with its weight transform's size class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Winograd {
    /// F(2x2, 3x3) ([`super::winograd::F2`]).
    F2(TransformSize),
    /// F(4x4, 3x3) ([`super::winograd::F4`]), in f32 only; its transform is made on every call
    /// (`TransformSource::for_call`).
    F4,
}

/// The sizes of one convolution: input `[n, c_in, h, w]`, weight `[c_out, c_in, k, k]`,
/// stride `s`, padding `p`, output `[n, c_out, h_out, w_out]`.
#[derive(Debug, Clone, Copy)]
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
    /// Whether this convolution takes Winograd on `path` with weights of `elem_bytes`, in
    /// which tiling, and how large its transform is: 3x3, stride 1, padding 1, something to
    /// compute, and a plane of at least [`WINOGRAD_MIN_POSITIONS`] positions for
    /// [`PLANNED_SAMPLES`] samples; F(4x4, 3x3) in f32 from [`WINOGRAD_F4_MIN_POSITIONS`]. The
    /// choice depends on the shapes alone, never on what ran before or where the weight lies,
    /// so a convolution always gives the same bits.
    pub(crate) fn winograd(&self, path: ConvPath, elem_bytes: usize) -> Option<Winograd> {
        let positions = PLANNED_SAMPLES * self.h * self.w;
        if !matches!(path, ConvPath::Winograd | ConvPath::WinogradF2)
            || (self.k, self.s, self.p) != (3, 1, 1)
            || self.h_out * self.w_out == 0
            || self.c_out == 0
            || positions < WINOGRAD_MIN_POSITIONS
        {
            return None;
        }
        if path == ConvPath::Winograd && elem_bytes == 4 && positions >= WINOGRAD_F4_MIN_POSITIONS {
            return Some(Winograd::F4);
        }
        Some(Winograd::F2(
            if 16 * self.c_out * self.c_in * elem_bytes <= WINOGRAD_KEPT_MAX_BYTES {
                TransformSize::Small
            } else {
                TransformSize::Large
            },
        ))
    }

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
        f32_product_into(
            [self.c_out, cols, col_len],
            Strided::rows(dst, plane_out),
            Strided::rows(self.weight.as_ptr(), col_len),
            Strided::rows(rhs.as_ptr(), rhs_rs),
            1.0,
            Dst::Add,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(c_in: usize, c_out: usize, side: usize, k: usize) -> ConvShape {
        let p = k / 2;
        ConvShape {
            n: 2,
            c_in,
            h: side,
            w: side,
            c_out,
            k,
            s: 1,
            p,
            h_out: side,
            w_out: side,
        }
    }

    /// SD 1.5's UNet levels: Winograd from 16x16 planes whatever the transform's size (F(2x2,
    /// 3x3)'s up to 64 MiB small), F(4x4, 3x3) in f32 from 32x32, none below 16x16, none for
    /// other kernels or on im2col.
    #[test]
    fn winograd_tiling_and_transform_size_by_shape() {
        use TransformSize::{Large, Small};
        use Winograd::{F2, F4};
        let winograd = |c_in, c_out, side, k, bytes| {
            shape(c_in, c_out, side, k).winograd(ConvPath::Winograd, bytes)
        };
        assert_eq!(winograd(320, 320, 64, 3, 4), Some(F4));
        assert_eq!(winograd(640, 960, 32, 3, 4), Some(F4));
        assert_eq!(winograd(640, 640, 32, 3, 2), Some(F2(Small)));
        assert_eq!(winograd(640, 640, 16, 3, 4), Some(F2(Small)));
        assert_eq!(winograd(1280, 640, 16, 3, 4), Some(F2(Small)));
        assert_eq!(winograd(1280, 1280, 16, 3, 4), Some(F2(Large)));
        assert_eq!(winograd(1280, 1280, 16, 3, 2), Some(F2(Small)));
        assert_eq!(winograd(2560, 1280, 16, 3, 2), Some(F2(Large)));
        assert_eq!(winograd(1280, 1280, 32, 3, 2), Some(F2(Small)));
        assert_eq!(winograd(2560, 1280, 64, 3, 4), Some(F4));
        assert_eq!(
            shape(320, 320, 64, 3).winograd(ConvPath::WinogradF2, 4),
            Some(F2(Small))
        );
        assert_eq!(winograd(1280, 1280, 8, 3, 2), None);
        assert_eq!(winograd(320, 320, 8, 3, 4), None);
        assert_eq!(winograd(320, 320, 64, 1, 4), None);
        assert_eq!(shape(320, 320, 64, 3).winograd(ConvPath::Im2col, 4), None);
    }
}
