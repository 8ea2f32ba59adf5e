//! What the CPU kernels share: moving tensors in and out of burn-flex, the switches that turn
//! a kernel off, an output pointer for parallel writers, and a vectorizable exponential.

use std::any::{Any, TypeId};
use std::sync::OnceLock;

use burn::tensor::backend::Backend;
use burn::tensor::{Bytes, DType, Tensor, TensorPrimitive};
use burn_flex::{FlexTensor, Layout};

/// Whether `B`'s float tensor is burn-flex's, the precondition of [`into_flex`] and [`from_flex`].
pub(crate) fn is_flex<B: Backend>() -> bool {
    TypeId::of::<B::FloatTensorPrimitive>() == TypeId::of::<FlexTensor>()
}

/// Whether the environment variable `var` asks for Burn's own kernel (`var=burn`), read once:
/// the CPU kernels ask on every call.
pub(crate) fn burn_requested(var: &str, cell: &'static OnceLock<bool>) -> bool {
    *cell.get_or_init(|| std::env::var_os(var).is_some_and(|v| v == "burn"))
}

/// `t`'s burn-flex tensor. The caller has checked that `B`'s float tensor is [`FlexTensor`].
pub(crate) fn into_flex<B: Backend, const D: usize>(t: Tensor<B, D>) -> FlexTensor {
    *(Box::new(t.into_primitive().tensor()) as Box<dyn Any>)
        .downcast::<FlexTensor>()
        .expect("the caller checked the backend's tensor type")
}

/// The [`Tensor`] of a burn-flex tensor, as [`into_flex`]'s inverse (same precondition).
pub(crate) fn from_flex<B: Backend, const D: usize>(t: FlexTensor) -> Tensor<B, D> {
    let t = *(Box::new(t) as Box<dyn Any>)
        .downcast::<B::FloatTensorPrimitive>()
        .expect("the caller checked the backend's tensor type");
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// A raw output pointer that tiles (and the attention kernel's blocks) write disjoint parts of.
pub(crate) struct OutPtr<T = f32>(pub(crate) *mut T);
impl<T> Clone for OutPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for OutPtr<T> {}
unsafe impl<T> Send for OutPtr<T> {}
unsafe impl<T> Sync for OutPtr<T> {}

impl<T> OutPtr<T> {
    /// The pointer `count` elements further (a method, so closures capture the whole `Sync`
    /// wrapper rather than its raw field).
    ///
    /// # Safety
    /// As `pointer::add`: the result stays inside the same allocation.
    pub(crate) unsafe fn add(self, count: usize) -> Self {
        Self(self.0.add(count))
    }
}

/// A matrix operand for [`f32_product`]: element `(i, j)` at `ptr + i * row + j * col`.
#[derive(Clone, Copy)]
pub(crate) struct Strided<P> {
    pub(crate) ptr: P,
    pub(crate) row: usize,
    pub(crate) col: usize,
}

impl<P> Strided<P> {
    /// Rows `row` apart, each row's elements adjacent.
    pub(crate) fn rows(ptr: P, row: usize) -> Self {
        Self { ptr, row, col: 1 }
    }

    /// Columns `col` apart, each column's elements adjacent (a transposed row-major matrix).
    pub(crate) fn columns(ptr: P, col: usize) -> Self {
        Self { ptr, row: 1, col }
    }
}

/// `dst = scale * lhs @ rhs` (`[m, k]` times `[k, n]`, `dst` overwritten) in f32 with the
/// `gemm` crate on the calling thread: the one way the kernels call it for their own jobs.
///
/// # Safety
/// Each operand covers its shape at its strides, and no one else touches `dst`'s elements
/// during the call.
pub(crate) unsafe fn f32_product(
    dims: [usize; 3],
    dst: Strided<*mut f32>,
    lhs: Strided<*const f32>,
    rhs: Strided<*const f32>,
    scale: f32,
) {
    f32_product_into(
        dims,
        dst,
        lhs,
        rhs,
        scale,
        Dst::Overwrite,
        gemm::Parallelism::None,
    )
}

/// What a product does with the values `dst` holds.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dst {
    /// Writes over them.
    Overwrite,
    /// Adds the product to them (a bias filled in first).
    Add,
}

/// [`f32_product`] with `dst`'s values treated as `dst_values` says, split across threads as
/// `parallelism` says.
///
/// # Safety
/// As [`f32_product`]; with [`Dst::Add`], `dst`'s elements are initialized.
pub(crate) unsafe fn f32_product_into(
    [m, n, k]: [usize; 3],
    dst: Strided<*mut f32>,
    lhs: Strided<*const f32>,
    rhs: Strided<*const f32>,
    scale: f32,
    dst_values: Dst,
    parallelism: gemm::Parallelism,
) {
    gemm::gemm(
        m,
        n,
        k,
        dst.ptr,
        dst.col as isize,
        dst.row as isize,
        dst_values == Dst::Add,
        lhs.ptr,
        lhs.col as isize,
        lhs.row as isize,
        rhs.ptr,
        rhs.col as isize,
        rhs.row as isize,
        if dst_values == Dst::Add { 1.0 } else { 0.0 },
        scale,
        false,
        false,
        false,
        parallelism,
    )
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
    let shifted = x * LOG2_E + ROUND;
    let n = shifted - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // `shifted`'s low mantissa bits hold `n` (as `2^22 + n`), so `(n + 127) << 23`, the bits
    // of `2^n`, comes from them without a float-to-int conversion (whose saturating semantics
    // keep `n as i32` from vectorizing).
    let scale = f32::from_bits(shifted.to_bits().wrapping_add(127) << 23);
    p * scale
}

/// `e^x` for `x <= 0` as [`exp_nonpositive`] (inputs below -87 give about 1.6e-38; a value
/// a rounding above 0 gives its exponential), in fused multiply-adds and a degree-5
/// polynomial (Cephes' `expf`), within 2 ulp (tested): for kernels that run at AVX2 width or
/// wider only, since without FMA instructions every `mul_add` is a call to libm.
#[inline(always)]
pub fn exp_nonpositive_fused(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0;
    // Only the lower bound: where `x` is a score less the maximum, it is at most a rounding
    // above 0.
    let x = x.max(-87.0);
    let shifted = x.mul_add(LOG2_E, ROUND);
    let n = shifted - ROUND;
    let r = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, x));
    let p = 1.987_569_1e-4f32
        .mul_add(r, 1.398_199_9e-3)
        .mul_add(r, 8.333_452e-3)
        .mul_add(r, 4.166_579_6e-2)
        .mul_add(r, 1.666_666_5e-1)
        .mul_add(r, 0.5);
    let p = p.mul_add(r * r, r) + 1.0;
    let scale = f32::from_bits(shifted.to_bits().wrapping_add(127) << 23);
    p * scale
}

/// Whether `dtype` is a half-precision float the CPU kernels take (computing in f32).
pub(crate) fn is_half(dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
}

/// `t` (f32, f16 or bf16, any layout) as a new contiguous f32 tensor, converted in parallel.
pub(crate) fn widen(t: &FlexTensor) -> FlexTensor {
    let t = t.to_contiguous();
    let shape = t.layout().shape().to_vec();
    let values: Vec<f32> = match t.dtype() {
        DType::F32 => return t,
        DType::BF16 => convert(t.storage::<half::bf16>(), half::bf16::to_f32),
        DType::F16 => {
            use rayon::prelude::*;
            let src = t.storage::<half::f16>();
            let mut out = vec![0.0f32; src.len()];
            let chunk =
                (16 * 1024).max(src.len().div_ceil(4 * rayon::current_num_threads().max(1)));
            out.par_chunks_mut(chunk)
                .zip(src.par_chunks(chunk))
                .for_each(|(d, s)| widen_f16(s, d));
            out
        }
        other => unreachable!("widen: {other:?} is not a float the CPU kernels take"),
    };
    FlexTensor::new(
        Bytes::from_elems(values),
        Layout::contiguous(shape.into()),
        DType::F32,
    )
}

/// f16 `src` widened into `dst` (as long), exactly: 16 values an instruction (`vcvtph2ps`)
/// where the CPU has AVX-512, else the `half` crate's slice conversion (F16C 8 at a time,
/// through a call per 8 values).
pub(crate) fn widen_f16(src: &[half::f16], dst: &mut [f32]) {
    use half::slice::HalfFloatSliceExt;
    #[cfg(target_arch = "x86_64")]
    if super::simd::width() == super::simd::VectorWidth::Avx512 {
        // SAFETY: `width` reports AVX-512 only where the CPU has AVX-512 F.
        unsafe { widen_f16_avx512(src, dst) };
        return;
    }
    src.convert_to_f32_slice(dst);
}

/// [`widen_f16`] on AVX-512.
///
/// # Safety
/// The CPU has AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn widen_f16_avx512(src: &[half::f16], dst: &mut [f32]) {
    use half::slice::HalfFloatSliceExt;
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm512_cvtph_ps, _mm512_storeu_ps};
    assert_eq!(src.len(), dst.len());
    let mut from = src.chunks_exact(16);
    let mut to = dst.chunks_exact_mut(16);
    for (from, to) in (&mut from).zip(&mut to) {
        // SAFETY: `from` holds 16 f16 (32 bytes, read unaligned) and `to` 16 f32.
        unsafe {
            let halves = _mm256_loadu_si256(from.as_ptr().cast::<__m256i>());
            _mm512_storeu_ps(to.as_mut_ptr(), _mm512_cvtph_ps(halves));
        }
    }
    from.remainder().convert_to_f32_slice(to.into_remainder());
}

/// A contiguous f32 tensor converted (in parallel, rounding to nearest even) to `dtype`.
pub(crate) fn narrow(t: FlexTensor, dtype: DType) -> FlexTensor {
    let t = t.to_contiguous();
    let shape = Layout::contiguous(t.layout().shape().to_vec().into());
    let src = t.storage::<f32>();
    let bytes = match dtype {
        DType::F32 => return t,
        DType::BF16 => Bytes::from_elems(convert(src, round_bf16)),
        DType::F16 => Bytes::from_elems(convert(src, half::f16::from_f32)),
        other => unreachable!("narrow: {other:?} is not a float the CPU kernels take"),
    };
    FlexTensor::new(bytes, shape, dtype)
}

/// `src` mapped through `f` into a new vector, in parallel chunks.
pub(crate) fn convert<S: Sync + Copy, D: Send + Copy + Default>(
    src: &[S],
    f: impl Fn(S) -> D + Sync,
) -> Vec<D> {
    use rayon::prelude::*;
    let mut out = vec![D::default(); src.len()];
    let chunk = (16 * 1024).max(src.len().div_ceil(4 * rayon::current_num_threads().max(1)));
    out.par_chunks_mut(chunk)
        .zip(src.par_chunks(chunk))
        .for_each(|(d, s)| {
            super::simd::vectorize!({
                for (d, s) in d.iter_mut().zip(s) {
                    *d = f(*s);
                }
            })
        });
    out
}

/// `len` bf16 zeros, allocated zeroed (fresh pages from the kernel need no zeroing pass, which
/// `vec![bf16::ZERO; len]` writes value by value).
pub(crate) fn zeroed_bf16(len: usize) -> Vec<half::bf16> {
    use half::vec::HalfBitsVecExt;
    vec![0u16; len].reinterpret_into()
}

/// `x` rounded to the nearest bf16 (ties to even), NaN kept NaN: `half::bf16::from_f32` in
/// branch-free integer arithmetic the compiler vectorizes (the library's has branches).
#[inline(always)]
pub fn round_bf16(x: f32) -> half::bf16 {
    let bits = x.to_bits();
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16;
    let nan = (bits >> 16) | 0x40;
    let is_nan = (bits & 0x7fff_ffff) > 0x7f80_0000;
    half::bf16::from_bits(if is_nan { nan } else { rounded } as u16)
}

/// Whether the CPU rounds f32 to bf16 in one instruction (`vcvtneps2bf16`, AVX512-BF16) and
/// the vector width allows AVX-512 ([`super::simd::width`]). Asked once.
pub(crate) fn bf16_instructions() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            super::simd::width() == super::simd::VectorWidth::Avx512
                && is_x86_feature_detected!("avx512bf16")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// `src[i] * factor + offset` rounded to bf16 (nearest even) into `dst` (as long), for a
/// `factor` of 1 or an `offset` of 0 (one f32 operation, rounded once either way): 16 values an
/// instruction where [`bf16_instructions`], else [`round_bf16`] a value at a time. The instruction flushes results below f32's normal range (magnitude under
/// 1.2e-38) to zero, where [`round_bf16`] keeps them.
#[inline(always)]
pub(crate) fn round_bf16_affine(src: &[f32], factor: f32, offset: f32, dst: &mut [half::bf16]) {
    assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    if bf16_instructions() {
        // SAFETY: `bf16_instructions` found AVX-512 (F, BW, VL) and AVX512-BF16.
        unsafe { round_bf16_affine_avx512(src, factor, offset, dst) };
        return;
    }
    debug_assert!(factor == 1.0 || offset == 0.0);
    for (d, s) in dst.iter_mut().zip(src) {
        *d = round_bf16(s * factor + offset);
    }
}

/// [`round_bf16_affine`] on AVX512-BF16.
///
/// # Safety
/// The CPU has AVX-512 F, BW, VL and AVX512-BF16; `src` and `dst` are equally long.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(crate) unsafe fn round_bf16_affine_avx512(
    src: &[f32],
    factor: f32,
    offset: f32,
    dst: &mut [half::bf16],
) {
    use std::arch::x86_64::*;
    let n = src.len();
    let (from, to) = (src.as_ptr(), dst.as_mut_ptr().cast::<i16>());
    let (factor, offset) = (_mm512_set1_ps(factor), _mm512_set1_ps(offset));
    let mut i = 0;
    while i + 16 <= n {
        let x = _mm512_fmadd_ps(_mm512_loadu_ps(from.add(i)), factor, offset);
        let rounded: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(x));
        _mm256_storeu_si256(to.add(i).cast::<__m256i>(), rounded);
        i += 16;
    }
    if i < n {
        let mask = tail_mask(n - i);
        let x = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, from.add(i)), factor, offset);
        let rounded: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(x));
        _mm256_mask_storeu_epi16(to.add(i), mask, rounded);
    }
}

/// The 16x16 transpose of 32-bit values on AVX-512: `rows[r]` lane `c` becomes lane `r` of
/// the result's vector `c`. Four rounds of 16 shuffles: 32-bit and 64-bit interleaves within
/// 128-bit lanes, then a 4x4 transpose of the 128-bit lanes.
///
/// # Safety
/// The CPU has AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn transpose_16x16(
    rows: [std::arch::x86_64::__m512i; 16],
) -> [std::arch::x86_64::__m512i; 16] {
    use std::arch::x86_64::*;
    let mut a = rows;
    for i in 0..8 {
        a[2 * i] = _mm512_unpacklo_epi32(rows[2 * i], rows[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(rows[2 * i], rows[2 * i + 1]);
    }
    // `b[4i + c]`, in 128-bit lane `l`: rows `4i..4i + 4` of column `4l + c`.
    let mut b = a;
    for i in 0..4 {
        b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    let mut out = b;
    for c in 0..4 {
        let low01 = _mm512_shuffle_i32x4::<0x44>(b[c], b[4 + c]);
        let high01 = _mm512_shuffle_i32x4::<0xee>(b[c], b[4 + c]);
        let low23 = _mm512_shuffle_i32x4::<0x44>(b[8 + c], b[12 + c]);
        let high23 = _mm512_shuffle_i32x4::<0xee>(b[8 + c], b[12 + c]);
        out[c] = _mm512_shuffle_i32x4::<0x88>(low01, low23);
        out[4 + c] = _mm512_shuffle_i32x4::<0xdd>(low01, low23);
        out[8 + c] = _mm512_shuffle_i32x4::<0x88>(high01, high23);
        out[12 + c] = _mm512_shuffle_i32x4::<0xdd>(high01, high23);
    }
    out
}

/// The mask of the first `count` (under 16) lanes of a 16-lane vector.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn tail_mask(count: usize) -> u16 {
    debug_assert!(count < 16);
    ((1u32 << count) - 1) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widen_f16_equals_the_half_crate_on_every_f16() {
        let all: Vec<half::f16> = (0..=u16::MAX).map(half::f16::from_bits).collect();
        // An odd length too, so the tail after the 16-value steps is taken.
        for src in [&all[..], &all[..all.len() - 5]] {
            let mut wide = vec![0.0f32; src.len()];
            widen_f16(src, &mut wide);
            for (h, w) in src.iter().zip(&wide) {
                assert_eq!(
                    w.to_bits(),
                    h.to_f32().to_bits(),
                    "f16 bits {:#06x}",
                    h.to_bits()
                );
            }
        }
    }

    #[test]
    fn affine_rounding_equals_round_bf16_outside_the_subnormals() {
        // Every bf16 upper half with low halves at the rounding boundary and beside it (ties
        // to even up and down), a few factors, and an odd length so the masked tail runs.
        let mut src = Vec::new();
        for high in (0..=u16::MAX as u32).step_by(7) {
            for low in [0u32, 0x7fff, 0x8000, 0x8001, 0xffff] {
                src.push(f32::from_bits(high << 16 | low));
            }
        }
        src.pop();
        for (factor, offset) in [(1.0f32, 0.0f32), (0.125, 0.0), (0.37, 0.0), (1.0, -0.75)] {
            let mut got = vec![half::bf16::ZERO; src.len()];
            round_bf16_affine(&src, factor, offset, &mut got);
            #[cfg(target_arch = "x86_64")]
            let instruction = bf16_instructions().then(|| {
                let mut out = vec![half::bf16::ZERO; src.len()];
                // SAFETY: `bf16_instructions` found the features.
                unsafe { round_bf16_affine_avx512(&src, factor, offset, &mut out) };
                out
            });
            #[cfg(not(target_arch = "x86_64"))]
            let instruction: Option<Vec<half::bf16>> = None;
            for paths in [Some(got), instruction].into_iter().flatten() {
                for (x, g) in src.iter().zip(&paths) {
                    let scaled = x * factor + offset;
                    let want = round_bf16(scaled);
                    if scaled.is_nan() {
                        assert!(g.is_nan(), "{x:e} * {factor} + {offset}: NaN stays NaN");
                    } else if scaled != 0.0 && scaled.abs() < f32::MIN_POSITIVE {
                        // Flushed to zero on the instruction, kept by `round_bf16`.
                        assert!(
                            g.to_f32() == 0.0 || *g == want,
                            "{x:e} * {factor} + {offset}"
                        );
                    } else {
                        assert_eq!(g.to_bits(), want.to_bits(), "{x:e} * {factor} + {offset}");
                    }
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn transpose_16x16_transposes() {
        use std::arch::x86_64::*;
        if !is_x86_feature_detected!("avx512f") {
            return;
        }
        let values: Vec<i32> = (0..256).collect();
        // SAFETY: AVX-512 F was detected; each row reads 16 of the 256 values.
        let got = unsafe {
            let rows =
                std::array::from_fn(|r| _mm512_loadu_si512(values[r * 16..].as_ptr().cast()));
            transpose_16x16(rows).map(|v| std::mem::transmute::<__m512i, [i32; 16]>(v))
        };
        for (c, column) in got.iter().enumerate() {
            for (r, v) in column.iter().enumerate() {
                assert_eq!(*v, (r * 16 + c) as i32, "row {r}, column {c}");
            }
        }
    }
}
