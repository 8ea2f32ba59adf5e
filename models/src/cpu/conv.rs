//! 2-D convolution for burn-flex, used by [`crate::nn::Conv2d`]: f32 through
//! [`super::conv_f32`], bf16 and f16 through [`super::conv_half`].
//! Why burn-flex's own convolution is bypassed: `docs/cpu-kernels.md`.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};

use super::common::{from_flex, into_flex, is_flex, is_half};
use super::conv_f32::conv2d_nchw_f32;
pub use super::conv_f32::{conv2d_f32_slices, ConvGeometry, ConvPath};
use super::conv_half::conv2d_half;
pub use super::winograd::release_call_buffer;

/// The inputs handed back when [`conv2d`] does not apply.
pub type Unhandled<B> = (Tensor<B, 4>, Tensor<B, 4>, Option<Tensor<B, 1>>);

/// Convolves `x` `[n, c_in, h, w]` with `weight` `[c_out, c_in, k, k]` (plus `bias` `[c_out]`)
/// through the NCHW kernels of this module when the backend is burn-flex and the three share
/// one dtype, f32 or (through [`super::conv_half`]) bf16 or f16; otherwise returns the inputs
/// untouched (`Err`) for Burn's own `conv2d`. The kernel follows [`ConvPath::from_env`].
pub fn conv2d<B: Backend>(
    x: Tensor<B, 4>,
    weight: Tensor<B, 4>,
    bias: Option<Tensor<B, 1>>,
    geometry: ConvGeometry,
) -> Result<Tensor<B, 4>, Unhandled<B>> {
    conv2d_with(x, weight, bias, geometry, ConvPath::from_env())
}

/// [`conv2d`] with the kernel chosen by the caller (`ConvPath::Burn` always hands back).
pub fn conv2d_with<B: Backend>(
    x: Tensor<B, 4>,
    weight: Tensor<B, 4>,
    bias: Option<Tensor<B, 1>>,
    geometry: ConvGeometry,
    path: ConvPath,
) -> Result<Tensor<B, 4>, Unhandled<B>> {
    let square = weight.dims()[2] == weight.dims()[3];
    let dtype = x.dtype();
    let one_dtype = (dtype == DType::F32 || is_half(dtype))
        && weight.dtype() == dtype
        && bias.as_ref().is_none_or(|b| b.dtype() == dtype);
    if !is_flex::<B>()
        || !one_dtype
        || !square
        || geometry.stride == 0
        || x.dims()[1] != weight.dims()[1]
        || path == ConvPath::Burn
    {
        return Err((x, weight, bias));
    }
    let [h, w] = [x.dims()[2], x.dims()[3]];
    let k = weight.dims()[2];
    if h + 2 * geometry.padding < k || w + 2 * geometry.padding < k {
        return Err((x, weight, bias));
    }
    let (x, weight, bias) = (into_flex(x), into_flex(weight), bias.map(into_flex));
    let out = if dtype == DType::F32 {
        conv2d_nchw_f32(&x, &weight, bias.as_ref(), geometry, path)
    } else {
        conv2d_half(&x, &weight, bias.as_ref(), geometry, path)
    };
    Ok(from_flex(out))
}
