//! Adaptive normalisation of the diffusion transformers (diffusers' `normalization.py`).
//!
//! The modulation itself (`x * (1 + scale) + shift`) is applied by the blocks; here live the
//! layers that produce the scales and shifts from the timestep (and conditions).

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::embeddings::{MicroConditions, PixArtAlphaCombinedTimestepSizeEmbeddings};
use crate::error::Result;
use crate::nn::Linear;
use crate::weights::VarBuilder;

/// diffusers' `AdaLayerNormSingle` (adaLN-single of PixArt): one timestep embedding shared by
/// every block, projected once to the six modulation vectors of all blocks.
#[derive(Module, Debug)]
pub struct AdaLayerNormSingle<B: Backend> {
    pub emb: PixArtAlphaCombinedTimestepSizeEmbeddings<B>,
    pub linear: Linear<B>,
}

impl<B: Backend> AdaLayerNormSingle<B> {
    pub fn load(vb: &VarBuilder<B>, dim: usize, use_additional_conditions: bool) -> Result<Self> {
        Ok(Self {
            emb: PixArtAlphaCombinedTimestepSizeEmbeddings::load(
                &vb.pp("emb"),
                dim,
                use_additional_conditions,
            )?,
            linear: Linear::load(&vb.pp("linear"), dim, 6 * dim, true)?,
        })
    }

    /// Returns `(modulation [batch, 6 * dim], embedded_timestep [batch, dim])`.
    pub fn forward(
        &self,
        timestep: Tensor<B, 1>,
        conditions: Option<&MicroConditions<B>>,
    ) -> (Tensor<B, 2>, Tensor<B, 2>) {
        let embedded = self.emb.forward(timestep, conditions);
        let modulation = self
            .linear
            .forward(burn::tensor::activation::silu(embedded.clone()));
        (modulation, embedded)
    }
}

/// `x * (1 + scale) + shift`, with `scale` and `shift` of shape `[batch, 1, dim]`.
pub fn modulate<B: Backend>(
    x: Tensor<B, 3>,
    shift: Tensor<B, 3>,
    scale: Tensor<B, 3>,
) -> Tensor<B, 3> {
    x * scale.add_scalar(1.0) + shift
}
