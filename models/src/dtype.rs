//! Float precision of a model's weights: [`ToDType`] casts every float parameter (diffusers'
//! `pipe.to(torch.bfloat16)`), and models that honour it compute in their weights' dtype and
//! return results in the caller's dtype, so a pipeline keeps its latents in f32.
//!
//! Burn 0.21 refuses binary ops between tensors of different float dtypes (`DTypeMismatch`), on
//! burn-flex and on the PJRT backend alike, so the casts sit at the model boundary:
//! [`UNet2DConditionModel`](crate::UNet2DConditionModel), the Flux, SD3 and PixArt
//! transformers and [`AutoencoderKL`](crate::AutoencoderKL) do it; the CLIP and T5 text
//! encoders' outputs are in their weights' dtype (their input is token ids). Inside, what
//! diffusers keeps in f32 stays f32 and is cast where it meets the weights: sinusoidal
//! timestep projections, Flux's rotary embedding, group-norm statistics.

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, FloatDType, Int, Tensor};

/// Casts every float parameter of a module to one dtype.
struct CastParams(FloatDType);

impl<B: Backend> ModuleMapper<B> for CastParams {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        if !param.is_initialized() {
            // A quantized weight's lazy dense form: cast when (if ever) it is made.
            let dtype = self.0;
            return param.init_mapper(move |t| cast_to(t, dtype));
        }
        let (id, tensor, mapper) = param.consume();
        Param::from_mapped_value(id, cast_to(tensor, self.0), mapper)
    }

    /// Integers stay as they are, and lazy ones (a quantized weight's device blocks) lazy:
    /// Burn's default would make them.
    fn map_int<const D: usize>(
        &mut self,
        param: Param<Tensor<B, D, Int>>,
    ) -> Param<Tensor<B, D, Int>> {
        param
    }

    fn map_bool<const D: usize>(
        &mut self,
        param: Param<Tensor<B, D, Bool>>,
    ) -> Param<Tensor<B, D, Bool>> {
        param
    }
}

/// A module whose float weights can be cast to another precision.
pub trait ToDType<B: Backend>: Sized {
    /// The same module with every float parameter in `dtype` (a no-op for those already in it).
    #[must_use]
    fn to_dtype(self, dtype: FloatDType) -> Self;
}

impl<B: Backend, M: Module<B>> ToDType<B> for M {
    fn to_dtype(self, dtype: FloatDType) -> Self {
        self.map(&mut CastParams(dtype))
    }
}

/// `x` in `dtype` (no op when it already is).
pub(crate) fn cast_to<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    dtype: FloatDType,
) -> Tensor<B, D> {
    if FloatDType::from(x.dtype()) == dtype {
        x
    } else {
        x.cast(dtype)
    }
}

/// The float dtype of a weight tensor.
pub(crate) fn dtype_of<B: Backend, const D: usize>(weight: &Tensor<B, D>) -> FloatDType {
    FloatDType::from(weight.dtype())
}
