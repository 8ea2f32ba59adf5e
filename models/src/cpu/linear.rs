//! `x W + b` on burn-flex, used by [`crate::nn::Linear`], whose weight `[in, out]` is a
//! transposed view of the checkpoint's `[out, in]` tensor.
//!
//! In bf16 where [`super::half_gemm`] runs (AMX or AVX512-BF16), with the weight in that
//! layout, the product is computed transposed: the checkpoint's rows are the left side of a
//! [`super::half_gemm`] product, read in place, and the rows of `x` are packed into the pair layout on each call (as many values as `x`, far
//! fewer than the product's work). A weight in any other layout (one cast by
//! [`crate::ToDType`], which makes it contiguous `[in, out]`) is packed instead, once, and the
//! packing kept while the weight lives: packing it on every call would read and write it once
//! per call, as much memory traffic as the product itself for short sequences (the packed
//! copies live in a [`WeightCache`], which follows a weight changed in place). The f32 sums
//! are rounded once into the bf16 output with the bias added.
//!
//! In f32, few rows are multiplied in the weight's own orientation; more go to Burn's `linear`.

use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::{Bytes, DType, Tensor};
use burn_flex::{FlexTensor, Layout};
use half::bf16;
use rayon::prelude::*;

use super::common::{
    bf16_instructions, f32_product, f32_product_into, from_flex, into_flex, is_flex, round_bf16,
    widen, zeroed_bf16, Dst, OutPtr, Strided,
};
#[cfg(target_arch = "x86_64")]
use super::common::{tail_mask, transpose_16x16};
use super::half_gemm::{self, PackedB};
use super::weight_cache::WeightCache;

/// The inputs handed back when [`linear`] does not apply.
pub type Unhandled<B, const D: usize> = (Tensor<B, D>, Tensor<B, 2>, Option<Tensor<B, 1>>);

/// Rows up to which an f32 product with a checkpoint-layout weight is computed transposed.
const FEW_ROWS: usize = 100000;

/// `x W + b` for `x` `[..., in]`, `weight` `[in, out]`, `bias` `[out]` on burn-flex: in bf16
/// where [`half_gemm::available`], and in f32 for few rows (computed transposed); otherwise
/// the inputs untouched (`Err`) for Burn's `linear`.
pub fn linear<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
) -> Result<Tensor<B, D>, Unhandled<B, D>> {
    let all = |dtype| {
        x.dtype() == dtype
            && weight.dtype() == dtype
            && bias.as_ref().is_none_or(|b| b.dtype() == dtype)
    };
    let [d_in, d_out] = weight.dims();
    if !is_flex::<B>()
        || x.dims()[D - 1] != d_in
        || bias.as_ref().is_some_and(|b| b.dims()[0] != d_out)
    {
        return Err((x, weight, bias));
    }
    let rows = x.shape().num_elements() / d_in.max(1);
    if all(DType::F32) && rows <= FEW_ROWS && is_checkpoint_layout(&weight) {
        return Ok(few_rows_f32(x, weight, bias));
    }
    if !all(DType::BF16) || !half_gemm::available() {
        return Err((x, weight, bias));
    }
    let checkpoint_layout = is_checkpoint_layout(&weight);
    let mut shape = x.dims().to_vec();
    let x = into_flex(x).to_contiguous();
    let weight = into_flex(weight);
    let bias: Vec<f32> = match bias {
        Some(b) => widen(&into_flex(b)).storage::<f32>().to_vec(),
        None => vec![0.0; d_out],
    };
    let m = x.layout().num_elements() / d_in.max(1);
    let mut out = zeroed_bf16(m * d_out);
    let ptr = OutPtr(out.as_mut_ptr());
    let x_rows = x.storage::<bf16>();
    if checkpoint_layout {
        // `(W^T x^T)^T`: the checkpoint's `[out, in]` rows are the left side, read in place,
        // and the rows of `x` are packed (as the transpose of the right side) on each call;
        // a block of the product is `out[j][i]` for outputs `i` and rows `j` of `x`.
        let stored = &weight.storage::<bf16>()[weight.layout().start_offset()..];
        let packed_x = PackedB::from_transposed(x_rows, d_in, d_in, m);
        half_gemm::gemm(
            stored,
            d_in,
            d_out,
            &packed_x,
            #[inline(always)]
            |block| {
                let bias = &bias[block.row0..block.row0 + block.rows];
                #[cfg(target_arch = "x86_64")]
                if bf16_instructions() {
                    // SAFETY: the features are there; the block's `cols` rows of `rows`
                    // outputs from `at` are its own disjoint part of `out`.
                    unsafe {
                        let at = ptr.add(block.col0 * d_out + block.row0).0;
                        store_transposed_avx512(&block, bias, at, d_out);
                    }
                    return;
                }
                for j in 0..block.cols {
                    let at = (block.col0 + j) * d_out + block.row0;
                    // SAFETY: blocks are disjoint parts of `out`.
                    let dst = unsafe { std::slice::from_raw_parts_mut(ptr.add(at).0, block.rows) };
                    for (i, (d, b)) in dst.iter_mut().zip(bias).enumerate() {
                        *d = round_bf16(block.values[i * half_gemm::BLOCK + j] + b);
                    }
                }
            },
        );
    } else {
        let packed = packed_weight(&weight);
        half_gemm::gemm(
            x_rows,
            d_in,
            m,
            &packed,
            #[inline(always)]
            |block| {
                for i in 0..block.rows {
                    let at = (block.row0 + i) * d_out + block.col0;
                    // SAFETY: blocks are disjoint parts of `out`.
                    let dst = unsafe { std::slice::from_raw_parts_mut(ptr.add(at).0, block.cols) };
                    let bias = &bias[block.col0..block.col0 + block.cols];
                    for ((d, v), b) in dst.iter_mut().zip(block.row(i)).zip(bias) {
                        *d = round_bf16(v + b);
                    }
                }
            },
        );
    }
    shape[D - 1] = d_out;
    Ok(from_flex(FlexTensor::new(
        Bytes::from_elems(out),
        Layout::contiguous(shape.into()),
        DType::BF16,
    )))
}

/// A block of `(W^T x^T)` (rows: outputs, columns: rows of `x`) plus `bias` (one value per
/// output) rounded to bf16 and stored transposed from `out` (`d_out` values from one row of
/// `x` to the next), in 16x16 transposes.
///
/// # Safety
/// The CPU has AVX-512 F, BW, VL and AVX512-BF16; `bias` holds `block.rows` values; `out`
/// holds `block.cols` rows of `block.rows` values, `d_out` apart.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn store_transposed_avx512(
    block: &half_gemm::Block<'_>,
    bias: &[f32],
    out: *mut bf16,
    d_out: usize,
) {
    use std::arch::x86_64::*;
    const HALF: usize = half_gemm::BLOCK / 2;
    let values = block.values.as_ptr();
    for i0 in (0..block.rows).step_by(HALF) {
        let outputs = (block.rows - i0).min(HALF);
        let mask = if outputs == HALF {
            u16::MAX
        } else {
            tail_mask(outputs)
        };
        let bias = _mm512_maskz_loadu_ps(mask, bias.as_ptr().add(i0));
        for j0 in (0..block.cols).step_by(HALF) {
            // Rows past `block.rows` hold stale sums; their lanes are never stored.
            let rows = std::array::from_fn(|i| {
                _mm512_loadu_si512(
                    values
                        .add((i0 + i) * half_gemm::BLOCK + j0)
                        .cast::<__m512i>(),
                )
            });
            let columns = transpose_16x16(rows);
            for (j, column) in columns.iter().take(block.cols - j0).enumerate() {
                let sums = _mm512_add_ps(_mm512_castsi512_ps(*column), bias);
                let rounded: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(sums));
                let at = out.add((j0 + j) * d_out + i0).cast::<i16>();
                _mm256_mask_storeu_epi16(at, mask, rounded);
            }
        }
    }
}

/// Whether `weight` `[in, out]` is the transposed view of a contiguous `[out, in]` tensor, as
/// [`crate::var_builder::VarBuilder::get_linear_weight`] loads it.
fn is_checkpoint_layout<B: Backend>(weight: &Tensor<B, 2>) -> bool {
    let flex = into_flex(weight.clone());
    flex.layout().strides() == [1, flex.layout().shape()[0] as isize]
}

/// `x W + b` in f32 for few rows of `x`, computed as `(W^T x^T)^T`: `W^T` is the checkpoint's
/// contiguous `[out, in]`, packed by the `gemm` crate a block of rows at a time (`x W` has it
/// pack the whole weight before it starts on each call). Up to [`SPLIT_MAX_COLUMNS`]
/// rows of `x` go to [`product_split_by_outputs`], more to Burn's matmul. The transposed
/// result is copied back in tiles with the bias added on the way (burn-flex's strided bias
/// add would read it one element at a time).
fn few_rows_f32<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
) -> Tensor<B, D> {
    let mut dims = x.dims();
    let [d_in, d_out] = weight.dims();
    let rows = x.shape().num_elements() / d_in.max(1);
    let x = x.reshape([rows, d_in]);
    let columns = invariant_columns(rows, d_out, d_in);
    let x = if columns > rows {
        let zeros = Tensor::zeros([columns - rows, d_in], &x.device());
        Tensor::cat(vec![x, zeros], 0)
    } else {
        x
    };
    let out_t = if columns <= SPLIT_MAX_COLUMNS {
        product_split_by_outputs(x, weight, columns)
    } else {
        weight.transpose().matmul(x.transpose()).unsqueeze::<3>()
    };
    // The bias goes in with the transpose (one pass over the output, not two).
    let out = match bias {
        Some(bias) => match super::elementwise::transpose_add(out_t, bias) {
            Ok(out) => out,
            Err((t, bias)) => t.swap_dims(1, 2) + bias.unsqueeze::<3>(),
        },
        None => super::elementwise::transpose(out_t).unwrap_or_else(|t| t.swap_dims(1, 2)),
    }
    .reshape([columns, d_out]);
    let out = if columns > rows {
        out.narrow(0, 0, rows)
    } else {
        out
    };
    dims[D - 1] = d_out;
    out.reshape(dims)
}

/// Most columns (rows of `x`) for which [`product_split_by_outputs`] computes the product:
/// each of its jobs packs all of `x`, which costs little only while `x` is small next to the
/// weight. Larger products go to Burn's matmul, where the `gemm` crate packs `x` once, in
/// parallel.
const SPLIT_MAX_COLUMNS: usize = 512;

/// Fewest outputs per job of [`product_split_by_outputs`] before the split points are rounded
/// down to multiples of 16: each job keeps more than 128, so that no job meets the `gemm`
/// crate's kernels for small products (see [`invariant_columns`]: at least 2 columns).
const SPLIT_MIN_OUTPUTS: usize = 160;

/// `W^T x^T` `[1, out, columns]` for the contiguous `x` `[columns, in]` and the
/// checkpoint-layout `weight` `[in, out]`, each job of rayon's pool taking a block of outputs
/// (rows of `W^T`) whole, with the `gemm` crate on that thread. Handed the whole product,
/// the `gemm` crate packs the weight on the calling thread before its threads start when it
/// has at most two row blocks, which idles the other threads for the text encoders' short
/// sequences; split by outputs, every job packs its own part. Each output's sum runs over the
/// same blocks of `in` in the same order whatever the split, so the bits do not depend on the
/// number of threads.
fn product_split_by_outputs<B: Backend>(
    x: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    columns: usize,
) -> Tensor<B, 3> {
    let [d_in, d_out] = weight.dims();
    let x = into_flex(x).to_contiguous();
    let weight = into_flex(weight);
    let x = &x.storage::<f32>()[x.layout().start_offset()..];
    let w = &weight.storage::<f32>()[weight.layout().start_offset()..];
    assert!(
        w.len() >= d_out * d_in && x.len() >= columns * d_in,
        "the operands are shorter than their shapes"
    );
    let jobs = rayon::current_num_threads()
        .min(d_out / SPLIT_MIN_OUTPUTS)
        .max(1);
    let bound = |job: usize| match job {
        0 => 0,
        j if j == jobs => d_out,
        j => j * d_out / jobs / 16 * 16,
    };
    let mut out = vec![0.0f32; d_out * columns];
    let ptr = OutPtr(out.as_mut_ptr());
    (0..jobs).into_par_iter().for_each(|job| {
        let (row0, row1) = (bound(job), bound(job + 1));
        // SAFETY: jobs write disjoint rows `row0..row1` of `out` (`d_out` rows of `columns`
        // values); the weight's rows `row0..row1` of `d_in` values and `x`'s `columns` rows of
        // `d_in` values are in bounds.
        unsafe {
            f32_product(
                [row1 - row0, columns, d_in],
                Strided::rows(ptr.add(row0 * columns).0, columns),
                Strided::rows(w.as_ptr().add(row0 * d_in), d_in),
                Strided::columns(x.as_ptr(), d_in),
                1.0,
            )
        };
    });
    from_flex(FlexTensor::new(
        Bytes::from_elems(out),
        Layout::contiguous(vec![1, d_out, columns].into()),
        DType::F32,
    ))
}

/// How many columns (rows of `x`, padded with zeros) a product of `m` outputs over `k` inputs
/// is computed with, so that every row of `x` is rounded the same whatever the row count, and a
/// batch's images equal the same images made alone. The `gemm` crate takes other kernels, with
/// other summation orders, for small products: a matrix-vector product for one column, dot
/// products while `m * n <= 256`, and 512-deep blocks instead of evenly split ones while both
/// sides are at most 64 (which changes sums only for `k > 512`). Padding past those bounds
/// costs little: those products are the ones with few rows.
fn invariant_columns(rows: usize, m: usize, k: usize) -> usize {
    let mut columns = rows.max(2).max(256 / m.max(1) + 1);
    if k > 512 && m <= 64 {
        columns = columns.max(65);
    }
    columns
}

/// The packed form of `weight` `[in, out]`, from the cache when this storage was packed before.
fn packed_weight(weight: &FlexTensor) -> Arc<PackedB> {
    static CACHE: WeightCache<PackedB> = WeightCache::new();
    CACHE.get_or_make(weight, || {
        let shape = weight.layout().shape();
        let (k, n) = (shape[0], shape[1]);
        let contiguous = weight.to_contiguous();
        PackedB::from_rows(contiguous.storage::<bf16>(), n, k, n)
    })
}

/// `a b + bias` on plain slices, for buffers that are not Burn tensors (a compiled program's
/// on XLA's CPU plugin, through `oxidiff_backend_tpu::host_kernels`): `a` `[m, k]`, `b` `[k,
/// n]` and `bias` `[n]`, contiguous, into `out` `[m, n]`, which is overwritten; the `gemm`
/// crate on rayon's pool, as Burn's matmul on burn-flex computes the products with many rows.
pub fn matmul_f32_slices(
    a: &[f32],
    b: &[f32],
    bias: Option<&[f32]>,
    [m, k, n]: [usize; 3],
    out: &mut [f32],
) -> Result<(), String> {
    let lengths = [
        (a.len(), m * k, "left side"),
        (b.len(), k * n, "right side"),
        (bias.map_or(n, <[f32]>::len), n, "bias"),
        (out.len(), m * n, "output"),
    ];
    if let Some((len, expected, what)) = lengths.iter().find(|(len, expected, _)| len != expected) {
        return Err(format!(
            "the {what} of a [{m}, {k}] x [{k}, {n}] product holds {len} values, its shape {expected}"
        ));
    }
    if out.is_empty() {
        return Ok(());
    }
    let dst_values = match bias {
        Some(bias) => {
            out.chunks_exact_mut(n)
                .for_each(|row| row.copy_from_slice(bias));
            Dst::Add
        }
        None => Dst::Overwrite,
    };
    if k == 0 {
        if bias.is_none() {
            out.fill(0.0);
        }
        return Ok(());
    }
    let threads = rayon::current_num_threads();
    let parallelism = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the buffers hold their shapes (checked above), row-major; `out` is this call's
    // alone (`&mut`), and holds the bias where the products are added to it.
    unsafe {
        f32_product_into(
            [m, n, k],
            Strided::rows(out.as_mut_ptr(), n),
            Strided::rows(a.as_ptr(), k),
            Strided::rows(b.as_ptr(), n),
            1.0,
            dst_values,
            parallelism,
        )
    };
    Ok(())
}
