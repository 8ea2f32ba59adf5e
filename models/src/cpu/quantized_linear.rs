//! `x W^T + b` on burn-flex with `W` kept in GGML blocks ([`QuantizedMatrix`]), used by
//! [`crate::nn::Linear`] for weights loaded from a GGUF file.
//!
//! The weight is never dequantized whole: the output features are cut into tiles, and each
//! tile's rows of `W` are dequantized into a small f32 buffer (about a megabyte, so it stays in
//! cache) and multiplied at once with all rows of `x`, tiles in parallel. The product is in
//! f32; an f16 or bf16 `x` is widened first and the output rounded back to its dtype.

use burn::tensor::backend::Backend;
use burn::tensor::{Bytes, DType, Tensor};
use burn_flex::{FlexTensor, Layout};
use rayon::prelude::*;

use super::common::{f32_product, from_flex, into_flex, is_flex, narrow, widen, OutPtr, Strided};
use crate::gguf::QuantizedMatrix;

/// Values of `W` dequantized per tile at most (1 MiB of f32).
const TILE_VALUES: usize = 1 << 18;

/// The inputs handed back when [`linear`] does not apply.
pub type Unhandled<B, const D: usize> = (Tensor<B, D>, Option<Tensor<B, 1>>);

/// `x W^T + b` for `x` `[..., in]`, `weight` `[out, in]` in blocks and `bias` `[out]` on
/// burn-flex (f32, f16 or bf16 `x`); otherwise the inputs untouched (`Err`).
pub fn linear<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    weight: &QuantizedMatrix,
    bias: Option<Tensor<B, 1>>,
) -> Result<Tensor<B, D>, Unhandled<B, D>> {
    let (d_out, d_in) = (weight.rows(), weight.cols());
    let dtype = x.dtype();
    if !is_flex::<B>()
        || !matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
        || x.dims()[D - 1] != d_in
        || bias.as_ref().is_some_and(|b| b.dims()[0] != d_out)
    {
        return Err((x, bias));
    }
    let mut dims = x.dims();
    let x = widen(&into_flex(x));
    let xs = x.storage::<f32>();
    let m = xs.len() / d_in.max(1);
    let mut out = vec![0f32; m * d_out];
    if m > 0 && d_in > 0 {
        product(xs, m, weight, &mut out);
    }
    if let Some(bias) = bias {
        let bias = widen(&into_flex(bias));
        let bias = bias.storage::<f32>();
        out.par_chunks_mut(d_out)
            .for_each(|row| row.iter_mut().zip(bias).for_each(|(o, b)| *o += b));
    }
    dims[D - 1] = d_out;
    let out = FlexTensor::new(
        Bytes::from_elems(out),
        Layout::contiguous(dims.to_vec().into()),
        DType::F32,
    );
    Ok(from_flex(narrow(out, dtype)))
}

/// `out[m, out] = x[m, in] W^T`, a tile of `W`'s rows at a time.
fn product(x: &[f32], m: usize, weight: &QuantizedMatrix, out: &mut [f32]) {
    let (n, k) = (weight.rows(), weight.cols());
    let tile = (TILE_VALUES / k).clamp(8, 256).min(n);
    let tiles = n.div_ceil(tile);
    let dst = OutPtr(out.as_mut_ptr());
    (0..tiles).into_par_iter().for_each_init(
        || vec![0f32; tile * k],
        |buf, t| {
            let start = t * tile;
            let rows = tile.min(n - start);
            let w = &mut buf[..rows * k];
            weight.dequantize_rows(start, w);
            // SAFETY: tile `t` writes only columns `start..start + rows` of every row of `out`
            // (`m` rows of `n`), which no other tile touches; `x` and `w` are read-only slices
            // of the sizes given.
            unsafe {
                f32_product(
                    [m, rows, k],
                    Strided::rows(dst.add(start).0, n),
                    Strided::rows(x.as_ptr(), k),
                    Strided::columns(w.as_ptr(), k),
                    1.0,
                );
            }
        },
    );
}
