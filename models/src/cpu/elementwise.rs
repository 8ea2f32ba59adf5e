//! Group norm (with fused SiLU), layer norm, GEGLU and sequence transposes for burn-flex in
//! f32, bf16 and f16 (computed in f32), each one or two parallel passes over rows on rayon's
//! pool.
//! `OXIDIFF_CPU_ELEMENTWISE=burn` (read once) turns them off, to compare.

use std::sync::OnceLock;

use burn::tensor::backend::Backend;
use burn::tensor::{Bytes, DType, Tensor};
use burn_flex::{FlexTensor, Layout};
use rayon::prelude::*;

use super::common::{
    burn_requested, exp_nonpositive, from_flex, into_flex, is_flex, is_half, round_bf16, widen,
};
use super::simd;

/// Fewest elements worth a job of their own on rayon's pool.
const MIN_JOB: usize = 16 * 1024;

/// Whether the kernels apply to backend `B` and these tensors: burn-flex, all of one dtype, f32,
/// bf16 or f16 (half precision is computed in f32 and rounded once on the way out).
fn applies<B: Backend>(dtypes: &[DType]) -> bool {
    static OFF: OnceLock<bool> = OnceLock::new();
    let first = dtypes[0];
    is_flex::<B>()
        && (first == DType::F32 || is_half(first))
        && dtypes.iter().all(|d| *d == first)
        && !burn_requested("OXIDIFF_CPU_ELEMENTWISE", &OFF)
}

/// An element type the kernels read and write, computing in f32.
trait Elem: burn::tensor::Element + bytemuck::Pod + Default + Send + Sync {
    const DTYPE: DType;
    fn get(self) -> f32;
    fn put(v: f32) -> Self;
}

impl Elem for f32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn get(self) -> f32 {
        self
    }
    #[inline(always)]
    fn put(v: f32) -> Self {
        v
    }
}

impl Elem for half::bf16 {
    const DTYPE: DType = DType::BF16;
    #[inline(always)]
    fn get(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn put(v: f32) -> Self {
        round_bf16(v)
    }
}

impl Elem for half::f16 {
    const DTYPE: DType = DType::F16;
    #[inline(always)]
    fn get(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn put(v: f32) -> Self {
        Self::from_f32(v)
    }
}

/// Runs `$f::<E>` for the element type of `$dtype` (one of [`applies`]'s).
macro_rules! by_dtype {
    ($dtype:expr, $f:ident ( $($arg:expr),* )) => {
        match $dtype {
            DType::BF16 => $f::<half::bf16>($($arg),*),
            DType::F16 => $f::<half::f16>($($arg),*),
            _ => $f::<f32>($($arg),*),
        }
    };
}

/// How many rows of `row_len` elements one job takes: about four jobs per thread, none smaller
/// than [`MIN_JOB`] elements.
fn rows_per_job(rows: usize, row_len: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    let by_threads = rows.div_ceil(4 * threads);
    let by_size = MIN_JOB.div_ceil(row_len.max(1));
    by_threads.max(by_size).clamp(1, rows.max(1))
}

/// Whether `t` is contiguous and covers its whole buffer from the start.
fn is_whole(t: &FlexTensor) -> bool {
    t.is_contiguous()
        && t.layout().start_offset() == 0
        && t.bytes().len() == t.layout().num_elements() * t.dtype().size()
}

/// A new contiguous tensor of `shape` holding `data`.
fn tensor_of<E: Elem>(data: Vec<E>, shape: Vec<usize>) -> FlexTensor {
    FlexTensor::new(
        Bytes::from_elems(data),
        Layout::contiguous(shape.into()),
        E::DTYPE,
    )
}

/// `t` as a contiguous tensor that no one else holds, so its storage may be overwritten:
/// `t` itself when it already is one, otherwise a copy (made in parallel).
fn writable<E: Elem>(t: FlexTensor) -> FlexTensor {
    if is_whole(&t) && t.is_unique() {
        return t;
    }
    let shape = t.layout().shape().to_vec();
    if is_whole(&t) {
        let src = t.storage::<E>();
        let mut data = vec![E::default(); src.len()];
        let chunk = MIN_JOB.max(src.len().div_ceil(4 * rayon::current_num_threads().max(1)));
        data.par_chunks_mut(chunk)
            .zip(src.par_chunks(chunk))
            .for_each(|(d, s)| d.copy_from_slice(s));
        return tensor_of(data, shape);
    }
    let copy = t.to_contiguous();
    drop(t);
    if copy.is_unique() && is_whole(&copy) {
        copy
    } else {
        writable::<E>(copy)
    }
}

/// The sum of `f(x)` over `x`, in f32 lanes the compiler vectorizes, blocks of 1024 added in f64.
#[inline(always)]
fn sum_of<E: Elem>(x: &[E], f: impl Fn(f32) -> f32) -> f64 {
    let mut total = 0.0f64;
    for block in x.chunks(1024) {
        let mut lanes = [0.0f32; 16];
        let mut chunks = block.chunks_exact(16);
        for c in &mut chunks {
            for i in 0..16 {
                lanes[i] += f(c[i].get());
            }
        }
        let tail: f32 = chunks.remainder().iter().map(|&v| f(v.get())).sum();
        total += lanes.iter().map(|&l| l as f64).sum::<f64>() + tail as f64;
    }
    total
}

/// Mean and biased variance of `x` (two passes, the second around the mean).
#[inline(always)]
fn mean_var<E: Elem>(x: &[E]) -> (f32, f32) {
    let n = x.len().max(1) as f64;
    let mean = (sum_of(x, |v| v) / n) as f32;
    let var = (sum_of(x, |v| (v - mean) * (v - mean)) / n) as f32;
    (mean, var)
}

/// `x * sigmoid(x)`, branch-free: `e = exp(-|x|)` never overflows, and the sigmoid is
/// `1 / (1 + e)` for `x >= 0`, `e / (1 + e)` below.
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    let e = exp_nonpositive(-x.abs());
    let sigmoid = if x >= 0.0 { 1.0 } else { e } / (1.0 + e);
    x * sigmoid
}

/// `erf(x)` within 1.5e-7 absolute (Abramowitz and Stegun 7.1.26), branch-free.
#[inline(always)]
pub fn erf(x: f32) -> f32 {
    let a = x.abs();
    let t = 1.0 / (1.0 + 0.327_591_1 * a);
    let poly = t
        * (0.254_829_6
            + t * (-0.284_496_74 + t * (1.421_413_7 + t * (-1.453_152 + t * 1.061_405_4))));
    let y = 1.0 - poly * exp_nonpositive(-a * a);
    y.copysign(x)
}

/// The exact (erf) GELU, `x / 2 * (1 + erf(x / sqrt(2)))`.
#[inline(always)]
pub fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2))
}

/// `tanh(x)`, branch-free from [`exp_nonpositive`]: `(1 - e) / (1 + e)` with `e = exp(-2|x|)`,
/// the sign put back.
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let e = exp_nonpositive(-2.0 * x.abs());
    ((1.0 - e) / (1.0 + e)).copysign(x)
}

/// The tanh-approximated GELU (`gelu_pytorch_tanh`).
#[inline(always)]
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + tanh(SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)))
}

/// OpenAI CLIP's `x * sigmoid(1.702 x)`.
#[inline(always)]
pub fn quick_gelu(x: f32) -> f32 {
    let y = 1.702 * x;
    let e = exp_nonpositive(-y.abs());
    let sigmoid = if y >= 0.0 { 1.0 } else { e } / (1.0 + e);
    x * sigmoid
}

/// `f` applied to every element of `x` in one parallel pass (in place when `x` is the only
/// holder of its storage), computing in f32; or `x` back where the kernels do not apply.
/// Burn's activations take several passes (`x * sigmoid(a x)` is three), on one thread.
pub fn map<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    f: impl Fn(f32) -> f32 + Sync,
) -> Result<Tensor<B, D>, Tensor<B, D>> {
    if !applies::<B>(&[x.dtype()]) {
        return Err(x);
    }
    let dtype = x.dtype();
    let t = into_flex(x);
    Ok(from_flex(by_dtype!(dtype, map_typed(t, &f))))
}

fn map_typed<E: Elem>(mut t: FlexTensor, f: &(impl Fn(f32) -> f32 + Sync)) -> FlexTensor {
    let len = t.layout().num_elements();
    let chunk = MIN_JOB.max(len.div_ceil(4 * rayon::current_num_threads().max(1)));
    if is_whole(&t) && t.is_unique() {
        t.storage_mut::<E>()
            .par_chunks_mut(chunk)
            .for_each(|c| simd::vectorize!(c.iter_mut().for_each(|v| *v = E::put(f(v.get())))));
        return t;
    }
    // Shared (or a view): read the source once into the new buffer, rather than copying it
    // first and mapping the copy.
    let src = t.to_contiguous();
    let shape = src.layout().shape().to_vec();
    let mut out = vec![E::default(); len];
    out.par_chunks_mut(chunk)
        .zip(src.storage::<E>().par_chunks(chunk))
        .for_each(|(d, s)| {
            simd::vectorize!({
                for (d, s) in d.iter_mut().zip(s) {
                    *d = E::put(f(s.get()));
                }
            })
        });
    tensor_of(out, shape)
}

/// The data of a 1-D parameter as f32 values.
fn values<B: Backend>(t: &Tensor<B, 1>) -> Vec<f32> {
    widen(&into_flex(t.clone())).storage::<f32>().to_vec()
}

/// `torch.nn.GroupNorm` over `x` `[n, c, ...]`, then SiLU when `silu` is set, or `x` back.
pub fn group_norm<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    weight: &Tensor<B, 1>,
    bias: &Tensor<B, 1>,
    groups: usize,
    eps: f64,
    silu_after: bool,
) -> Result<Tensor<B, D>, Tensor<B, D>> {
    let dims = x.dims();
    if D < 2
        || groups == 0
        || !dims[1].is_multiple_of(groups)
        || !applies::<B>(&[x.dtype(), weight.dtype(), bias.dtype()])
    {
        return Err(x);
    }
    let (c, rest) = (dims[1], dims[2..].iter().product::<usize>());
    let (weight, bias) = (values(weight), values(bias));
    let dtype = x.dtype();
    let t = into_flex(x);
    let norm = GroupNormRows {
        weight: &weight,
        bias: &bias,
        groups,
        per_group: c / groups,
        rest,
        eps,
        silu_after,
    };
    Ok(from_flex(by_dtype!(dtype, group_norm_typed(t, &norm))))
}

/// A group norm's parameters and sizes.
struct GroupNormRows<'a> {
    weight: &'a [f32],
    bias: &'a [f32],
    groups: usize,
    per_group: usize,
    rest: usize,
    eps: f64,
    silu_after: bool,
}

fn group_norm_typed<E: Elem>(t: FlexTensor, norm: &GroupNormRows<'_>) -> FlexTensor {
    let GroupNormRows {
        weight,
        bias,
        groups,
        per_group,
        rest,
        eps,
        silu_after,
    } = *norm;
    let mut t = writable::<E>(t);
    let group_len = per_group * rest;
    if group_len > 0 {
        t.storage_mut::<E>()
            .par_chunks_mut(group_len)
            .enumerate()
            .for_each(|(job, data)| {
                simd::vectorize!({
                    let g = job % groups;
                    let (mean, var) = mean_var(data);
                    let inv_std = 1.0 / (var + eps as f32).sqrt();
                    for (j, channel) in data.chunks_mut(rest.max(1)).enumerate() {
                        let ch = g * per_group + j;
                        // `(x - mean) * scale + bias`, not PyTorch's `x * scale + shift`: the same
                        // cost, without the cancellation when the mean is large.
                        let (scale, shift) = (weight[ch] * inv_std, bias[ch]);
                        if silu_after {
                            channel
                                .iter_mut()
                                .for_each(|v| *v = E::put(silu((v.get() - mean) * scale + shift)));
                        } else {
                            channel
                                .iter_mut()
                                .for_each(|v| *v = E::put((v.get() - mean) * scale + shift));
                        }
                    }
                })
            });
    }
    t
}

/// Layer norm over the last dimension of `x`, with `affine = (weight, bias)` or without, or `x`
/// back.
pub fn layer_norm<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    affine: Option<(&Tensor<B, 1>, &Tensor<B, 1>)>,
    eps: f64,
) -> Result<Tensor<B, D>, Tensor<B, D>> {
    let mut dtypes = vec![x.dtype()];
    if let Some((w, b)) = affine {
        dtypes.extend([w.dtype(), b.dtype()]);
    }
    let width = x.dims()[D - 1];
    if width == 0 || !applies::<B>(&dtypes) {
        return Err(x);
    }
    let affine = affine.map(|(w, b)| (values(w), values(b)));
    let dtype = x.dtype();
    let t = into_flex(x);
    Ok(from_flex(by_dtype!(
        dtype,
        layer_norm_typed(t, affine.as_ref(), width, eps)
    )))
}

fn layer_norm_typed<E: Elem>(
    t: FlexTensor,
    affine: Option<&(Vec<f32>, Vec<f32>)>,
    width: usize,
    eps: f64,
) -> FlexTensor {
    let mut t = writable::<E>(t);
    let data = t.storage_mut::<E>();
    let rows = data.len() / width;
    let per_job = rows_per_job(rows, width);
    data.par_chunks_mut(per_job * width).for_each(|chunk| {
        simd::vectorize!({
            for row in chunk.chunks_mut(width) {
                let (mean, var) = mean_var(row);
                let inv_std = 1.0 / (var + eps as f32).sqrt();
                match affine {
                    Some((w, b)) => affine_row(row, mean, inv_std, w, b),
                    None => row
                        .iter_mut()
                        .for_each(|v| *v = E::put((v.get() - mean) * inv_std)),
                }
            }
        })
    });
    t
}

/// `row[i] = (row[i] - mean) * inv_std * weight[i] + bias[i]`, indexed for the reason
/// [`geglu_row`] is.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn affine_row<E: Elem>(row: &mut [E], mean: f32, inv_std: f32, weight: &[f32], bias: &[f32]) {
    let (weight, bias) = (&weight[..row.len()], &bias[..row.len()]);
    for i in 0..row.len() {
        row[i] = E::put((row[i].get() - mean) * inv_std * weight[i] + bias[i]);
    }
}

/// GEGLU over `projected` `[..., 2 * inner]`: `value * gelu(gate)` with the value the first
/// half of the last dimension and the gate the second (diffusers' `GEGLU`), or `projected` back.
pub fn geglu<B: Backend, const D: usize>(
    projected: Tensor<B, D>,
) -> Result<Tensor<B, D>, Tensor<B, D>> {
    let dims = projected.dims();
    let width = dims[D - 1];
    if width == 0 || !width.is_multiple_of(2) || !applies::<B>(&[projected.dtype()]) {
        return Err(projected);
    }
    let dtype = projected.dtype();
    let t = into_flex(projected).to_contiguous();
    Ok(from_flex(by_dtype!(dtype, geglu_typed(&t, dims.to_vec()))))
}

fn geglu_typed<E: Elem>(t: &FlexTensor, dims: Vec<usize>) -> FlexTensor {
    let width = dims[dims.len() - 1];
    let inner = width / 2;
    let src = t.storage::<E>();
    let rows = src.len() / width;
    let mut out = vec![E::default(); rows * inner];
    let per_job = rows_per_job(rows, width);
    out.par_chunks_mut(per_job * inner)
        .zip(src.par_chunks(per_job * width))
        .for_each(|(out, src)| {
            simd::vectorize!({
                for (o, s) in out.chunks_mut(inner).zip(src.chunks(width)) {
                    let (value, gate) = s.split_at(inner);
                    geglu_row(o, value, gate);
                }
            })
        });
    let mut shape = dims;
    let last = shape.len() - 1;
    shape[last] = inner;
    tensor_of(out, shape)
}

/// `out[i] = value[i] * gelu(gate[i])`, indexed over slices cut to one length: the iterator
/// form (a zip of zips) is left to a fold the compiler does not inline, so it would not be
/// vectorized at [`simd::vectorize!`]'s width.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn geglu_row<E: Elem>(out: &mut [E], value: &[E], gate: &[E]) {
    let (value, gate) = (&value[..out.len()], &gate[..out.len()]);
    for i in 0..out.len() {
        out[i] = E::put(value[i].get() * gelu(gate[i].get()));
    }
}

/// `x` `[b, m, n]` transposed to a contiguous `[b, n, m]`, copied in 16x16 blocks in parallel,
/// or `x` back. Burn's `swap_dims` is a view, and burn-flex reads a permuted operand one
/// element at a time through a strided iterator in every operation that meets it.
pub fn transpose<B: Backend>(x: Tensor<B, 3>) -> Result<Tensor<B, 3>, Tensor<B, 3>> {
    if !applies::<B>(&[x.dtype()]) {
        return Err(x);
    }
    let [b, m, n] = x.dims();
    let dtype = x.dtype();
    let t = into_flex(x).to_contiguous();
    Ok(from_flex(by_dtype!(
        dtype,
        transpose_typed(&t, b, m, n, None)
    )))
}

/// [`transpose`] of an f32 `x` `[b, m, n]` with `bias[i]` added to the values of row `i`, in
/// the same pass: `(W^T x^T)^T + b` of a linear layer without a second pass over its output.
/// Each value is rounded once, as by the transpose followed by a broadcast add. Both handed
/// back unless both are f32 on burn-flex and `bias` has `m` values.
pub fn transpose_add<B: Backend>(
    x: Tensor<B, 3>,
    bias: Tensor<B, 1>,
) -> Result<Tensor<B, 3>, (Tensor<B, 3>, Tensor<B, 1>)> {
    let [b, m, n] = x.dims();
    if !applies::<B>(&[x.dtype(), bias.dtype()]) || x.dtype() != DType::F32 || bias.dims() != [m] {
        return Err((x, bias));
    }
    let (t, bias) = (
        into_flex(x).to_contiguous(),
        into_flex(bias).to_contiguous(),
    );
    let bias = bias.storage::<f32>();
    Ok(from_flex(transpose_typed::<f32>(&t, b, m, n, Some(bias))))
}

/// Rows of the output (columns of the input) each job writes.
const TRANSPOSE_JOB: usize = 32;

/// `t` `[b, m, n]` as `[b, n, m]`, `bias[i]` (if any) added to every value of row `i`.
fn transpose_typed<E: Elem + std::ops::Add<Output = E>>(
    t: &FlexTensor,
    b: usize,
    m: usize,
    n: usize,
    bias: Option<&[E]>,
) -> FlexTensor {
    let src = t.storage::<E>();
    let len = b * m * n;
    let mut out: Vec<E> = Vec::with_capacity(len);
    let wide = simd::width() == simd::VectorWidth::Avx512;
    if len > 0 {
        out.spare_capacity_mut()[..len]
            .par_chunks_mut(n * m)
            .zip(src.par_chunks(m * n))
            .for_each(|(dst, src)| {
                dst.par_chunks_mut(TRANSPOSE_JOB * m)
                    .enumerate()
                    .for_each(|(job, dst)| {
                        transpose_columns(src, m, n, job * TRANSPOSE_JOB, dst, wide, bias)
                    });
            });
    }
    // SAFETY: every output row was written: each job writes all `m` values of its rows.
    unsafe { out.set_len(len) };
    tensor_of(out, vec![b, n, m])
}

/// Columns `j0..` of `src` `[m, n]` (as many as `dst` holds rows of `m`) written as the rows
/// of `dst`, 16x16 blocks at a time: with `wide` (AVX-512) each block is 16 loads, a transpose
/// in registers and 16 stores of whole rows; else one value at a time. Element by element the
/// rows of a block would be written a value at a time, 16 lines at once that are a power of
/// two apart (the UNet's sequences): the same cache set, missed on every store.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
fn transpose_columns<E: Copy + std::ops::Add<Output = E>>(
    src: &[E],
    m: usize,
    n: usize,
    j0: usize,
    dst: &mut [std::mem::MaybeUninit<E>],
    wide: bool,
    bias: Option<&[E]>,
) {
    const BLOCK: usize = 16;
    let cols = dst.len() / m;
    assert!(cols * m == dst.len() && j0 + cols <= n && src.len() >= m * n);
    assert!(bias.is_none_or(|b| b.len() == m));
    let size = std::mem::size_of::<E>();
    for c0 in (0..cols).step_by(BLOCK) {
        let block_cols = BLOCK.min(cols - c0);
        for r0 in (0..m).step_by(BLOCK) {
            let block_rows = BLOCK.min(m - r0);
            #[cfg(target_arch = "x86_64")]
            // The bias is added in f32 lanes only: a 16-bit bias takes the element-wise path.
            if wide && (size == 4 || (size == 2 && bias.is_none())) {
                // SAFETY: the CPU has AVX-512 (F, BW, VL); the block's rows and columns lie
                // inside `src` and `dst` (checked above), and the masks cover only those. A
                // bias of 4-byte elements is f32: `transpose_add` is its only caller.
                unsafe {
                    transpose_block_avx512(
                        src.as_ptr().add(r0 * n + j0 + c0).cast(),
                        n,
                        dst.as_mut_ptr().add(c0 * m + r0).cast(),
                        m,
                        BlockShape {
                            rows: block_rows,
                            cols: block_cols,
                            size,
                        },
                        bias.map(|b| b.as_ptr().add(r0).cast()),
                    )
                };
                continue;
            }
            for c in c0..c0 + block_cols {
                let line = &mut dst[c * m + r0..c * m + r0 + block_rows];
                for (r, out) in line.iter_mut().enumerate() {
                    let value = src[(r0 + r) * n + j0 + c];
                    out.write(match bias {
                        Some(bias) => value + bias[r0 + r],
                        None => value,
                    });
                }
            }
        }
    }
}

/// One block of a transpose: `rows x cols` (each at most 16) elements of `size` bytes.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct BlockShape {
    rows: usize,
    cols: usize,
    size: usize,
}

/// One block of `rows x cols` (each at most 16) elements of `size` bytes (2 or 4): rows of
/// `src` (`src_stride` elements apart) become rows of `dst` (`dst_stride` apart). 16-bit
/// values are widened to 32-bit lanes for the transpose and narrowed on the way out. With
/// `bias` (f32 values only), `bias[r]` is added to source row `r`.
///
/// # Safety
/// The CPU has AVX-512 F, BW and VL; `src` holds `rows` rows of `cols` elements and `dst`
/// `cols` rows of `rows`, at those strides; `bias`, if given, holds `rows` f32 values and
/// `size` is 4.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn transpose_block_avx512(
    src: *const u8,
    src_stride: usize,
    dst: *mut u8,
    dst_stride: usize,
    shape: BlockShape,
    bias: Option<*const f32>,
) {
    use super::common::{tail_mask, transpose_16x16};
    use std::arch::x86_64::*;
    let BlockShape { rows, cols, size } = shape;
    let mask = |count: usize| {
        if count == 16 {
            u16::MAX
        } else {
            tail_mask(count)
        }
    };
    let (col_mask, row_mask) = (mask(cols), mask(rows));
    let mut lines = [_mm512_setzero_si512(); 16];
    for (r, line) in lines.iter_mut().enumerate().take(rows) {
        let at = src.add(r * src_stride * size);
        *line = if size == 4 {
            _mm512_maskz_loadu_epi32(col_mask, at.cast())
        } else {
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(col_mask, at.cast()))
        };
        if let Some(bias) = bias {
            let sum = _mm512_add_ps(_mm512_castsi512_ps(*line), _mm512_set1_ps(*bias.add(r)));
            *line = _mm512_castps_si512(sum);
        }
    }
    let columns = transpose_16x16(lines);
    for (c, column) in columns.iter().enumerate().take(cols) {
        let at = dst.add(c * dst_stride * size);
        if size == 4 {
            _mm512_mask_storeu_epi32(at.cast(), row_mask, *column);
        } else {
            _mm256_mask_storeu_epi16(at.cast(), row_mask, _mm512_cvtepi32_epi16(*column));
        }
    }
}

/// `a + b` for two tensors of one shape and dtype in one parallel pass, written into whichever
/// of them no one else holds (a new buffer when both are shared), or both back where the
/// kernels do not apply. Each sum is rounded once, as Burn's add rounds it, so the result is
/// the same bits; burn-flex adds half precision one element at a time through a branching
/// conversion.
pub fn add<B: Backend, const D: usize>(
    a: Tensor<B, D>,
    b: Tensor<B, D>,
) -> Result<Tensor<B, D>, (Tensor<B, D>, Tensor<B, D>)> {
    if a.dims() != b.dims() || !applies::<B>(&[a.dtype(), b.dtype()]) {
        return Err((a, b));
    }
    let dtype = a.dtype();
    let (a, b) = (into_flex(a), into_flex(b));
    Ok(from_flex(by_dtype!(dtype, add_typed(a, b))))
}

fn add_typed<E: Elem>(a: FlexTensor, b: FlexTensor) -> FlexTensor {
    let owned = |t: &FlexTensor| is_whole(t) && t.is_unique();
    let (mut into, other) = match (owned(&a), owned(&b)) {
        (true, _) => (a, b.to_contiguous()),
        (false, true) => (b, a.to_contiguous()),
        (false, false) => {
            // Both shared: the sums go straight into a new buffer, one pass.
            let (a, b) = (a.to_contiguous(), b.to_contiguous());
            let shape = a.layout().shape().to_vec();
            let (a, b) = (a.storage::<E>(), b.storage::<E>());
            let mut out = vec![E::default(); a.len()];
            let chunk = MIN_JOB.max(a.len().div_ceil(4 * rayon::current_num_threads().max(1)));
            out.par_chunks_mut(chunk)
                .zip(a.par_chunks(chunk).zip(b.par_chunks(chunk)))
                .for_each(|(d, (a, b))| simd::vectorize!(sum_row(d, a, b)));
            return tensor_of(out, shape);
        }
    };
    let src = other.storage::<E>();
    let chunk = MIN_JOB.max(src.len().div_ceil(4 * rayon::current_num_threads().max(1)));
    into.storage_mut::<E>()
        .par_chunks_mut(chunk)
        .zip(src.par_chunks(chunk))
        .for_each(|(d, s)| simd::vectorize!(add_row(d, s)));
    into
}

/// `out[i] = a[i] + b[i]`, in f32, rounded once.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn sum_row<E: Elem>(out: &mut [E], a: &[E], b: &[E]) {
    let (a, b) = (&a[..out.len()], &b[..out.len()]);
    for i in 0..out.len() {
        out[i] = E::put(a[i].get() + b[i].get());
    }
}

/// `into[i] += other[i]`, in f32, rounded once.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn add_row<E: Elem>(into: &mut [E], other: &[E]) {
    let other = &other[..into.len()];
    for i in 0..into.len() {
        into[i] = E::put(into[i].get() + other[i].get());
    }
}

/// `x + t` for `x` `[n, c, ...]` and `t` `[n, c]` broadcast over the rest (a ResNet block's
/// time embedding), in one parallel pass, in place where `x` is unique; or both back.
pub fn add_per_channel<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    t: Tensor<B, 2>,
) -> Result<Tensor<B, D>, (Tensor<B, D>, Tensor<B, 2>)> {
    let dims = x.dims();
    if D < 2 || t.dims() != [dims[0], dims[1]] || !applies::<B>(&[x.dtype(), t.dtype()]) {
        return Err((x, t));
    }
    let rest = dims[2..].iter().product::<usize>();
    let dtype = x.dtype();
    let offsets = widen(&into_flex(t)).storage::<f32>().to_vec();
    let x = into_flex(x);
    Ok(from_flex(by_dtype!(
        dtype,
        add_per_channel_typed(x, &offsets, rest)
    )))
}

fn add_per_channel_typed<E: Elem>(x: FlexTensor, offsets: &[f32], rest: usize) -> FlexTensor {
    let mut x = writable::<E>(x);
    if rest > 0 {
        x.storage_mut::<E>()
            .par_chunks_mut(rest)
            .zip(offsets.par_iter())
            .with_min_len(MIN_JOB.div_ceil(rest))
            .for_each(|(plane, &offset)| {
                simd::vectorize!(plane.iter_mut().for_each(|v| *v = E::put(v.get() + offset)))
            });
    }
    x
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `src` `[m, n]` transposed by [`transpose_columns`] in jobs of `TRANSPOSE_JOB` rows.
    fn transposed<E: Copy + Default + std::ops::Add<Output = E>>(
        src: &[E],
        m: usize,
        n: usize,
        wide: bool,
    ) -> Vec<E> {
        let mut out = vec![std::mem::MaybeUninit::new(E::default()); m * n];
        for (job, dst) in out.chunks_mut(TRANSPOSE_JOB * m).enumerate() {
            transpose_columns(src, m, n, job * TRANSPOSE_JOB, dst, wide, None);
        }
        // SAFETY: every element was initialized above.
        out.into_iter()
            .map(|v| unsafe { v.assume_init() })
            .collect()
    }

    #[test]
    fn transposed_blocks_equal_the_definition_for_32_and_16_bit_values_at_every_width() {
        let wide = [false, simd::width() == simd::VectorWidth::Avx512];
        for (m, n) in [
            (1, 1),
            (3, 70),
            (16, 16),
            (17, 33),
            (40, 64),
            (320, 48),
            (65, 1),
        ] {
            let words: Vec<u32> = (0..m * n)
                .map(|i| (i as u32).wrapping_mul(2_654_435_761))
                .collect();
            let halves: Vec<u16> = words.iter().map(|w| (w >> 16) as u16).collect();
            let expect_words: Vec<u32> = (0..n * m).map(|i| words[(i % m) * n + i / m]).collect();
            let expect_halves: Vec<u16> = (0..n * m).map(|i| halves[(i % m) * n + i / m]).collect();
            for wide in wide {
                assert_eq!(
                    transposed(&words, m, n, wide),
                    expect_words,
                    "{m}x{n}, {wide}"
                );
                assert_eq!(
                    transposed(&halves, m, n, wide),
                    expect_halves,
                    "{m}x{n}, {wide}"
                );
            }
        }
    }

    #[test]
    fn a_bias_added_in_the_transpose_equals_adding_it_after() {
        let wide = [false, simd::width() == simd::VectorWidth::Avx512];
        for (m, n) in [(1, 3), (17, 33), (320, 48), (40, 70)] {
            let src: Vec<f32> = (0..m * n).map(|i| (i as f32 * 0.37).sin() * 1e3).collect();
            let bias: Vec<f32> = (0..m).map(|i| (i as f32 * 1.7).cos() * 1e-3).collect();
            let expect: Vec<u32> = (0..n * m)
                .map(|i| (src[(i % m) * n + i / m] + bias[i % m]).to_bits())
                .collect();
            for wide in wide {
                let mut out = vec![std::mem::MaybeUninit::new(0f32); m * n];
                for (job, dst) in out.chunks_mut(TRANSPOSE_JOB * m).enumerate() {
                    transpose_columns(&src, m, n, job * TRANSPOSE_JOB, dst, wide, Some(&bias));
                }
                // SAFETY: every element was initialized above.
                let got: Vec<u32> = out
                    .into_iter()
                    .map(|v| unsafe { v.assume_init() }.to_bits())
                    .collect();
                assert_eq!(got, expect, "{m}x{n}, wide {wide}");
            }
        }
    }
}
