//! What a UNet's forward pass takes besides latents, timestep and text: SDXL's added
//! condition and a ControlNet's residuals. Their own file, so that the UNet, the ControlNet
//! and the layout they share all stand on it and on nothing of each other.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

/// SDXL's extra conditioning (`added_cond_kwargs` in diffusers): the pooled projection of the
/// second text encoder and the six size/crop numbers per image.
#[derive(Debug, Clone)]
pub struct AddedCondition<B: Backend> {
    /// `[batch, projection_dim]`.
    pub text_embeds: Tensor<B, 2>,
    /// `[batch, 6]`: original (h, w), crop top-left (top, left), target (h, w).
    pub time_ids: Tensor<B, 2>,
}

/// What a ControlNet adds to a UNet: one residual per skip connection and one for the mid
/// block's output (diffusers' `down_block_res_samples` / `mid_block_res_sample`).
#[derive(Debug, Clone)]
pub struct ControlResiduals<B: Backend> {
    pub down: Vec<Tensor<B, 4>>,
    pub mid: Tensor<B, 4>,
}

/// The sum of two ControlNets' residuals (diffusers' `MultiControlNetModel`).
impl<B: Backend> std::ops::Add for ControlResiduals<B> {
    type Output = Self;

    fn add(self, other: Self) -> Self {
        Self {
            down: self
                .down
                .into_iter()
                .zip(other.down)
                .map(|(a, b)| a + b)
                .collect(),
            mid: self.mid + other.mid,
        }
    }
}

impl<B: Backend> ControlResiduals<B> {
    /// Zeros for the unconditional half of a guided batch, then these (guess mode with
    /// classifier-free guidance: only the conditional half is controlled).
    pub fn after_zeros(self) -> Self {
        let pad = |r: Tensor<B, 4>| Tensor::cat(vec![r.zeros_like(), r], 0);
        Self {
            down: self.down.into_iter().map(pad).collect(),
            mid: pad(self.mid),
        }
    }
}
