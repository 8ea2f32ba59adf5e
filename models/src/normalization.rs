//! Adaptive normalisation of the diffusion transformers (diffusers' `normalization.py`).
//!
//! The modulation itself (`x * (1 + scale) + shift`) is applied by the blocks; here live the
//! layers that produce the scales and shifts from the timestep (and conditions).

use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::embeddings::{MicroConditions, PixArtAlphaCombinedTimestepSizeEmbeddings};
use crate::error::Result;
use crate::nn::{Activation, Linear};
use crate::var_builder::VarBuilder;

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
            .forward(Activation::Silu.forward(embedded.clone()));
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

/// diffusers' `RMSNorm` over the last dimension: `x / sqrt(mean(x^2) + eps)`, times `weight`
/// when it has one (`elementwise_affine`). The QK norm of SD3.5 and Flux (per head).
#[derive(Module, Debug)]
pub struct RMSNorm<B: Backend> {
    pub weight: Option<Param<Tensor<B, 1>>>,
    pub eps: f64,
}

impl<B: Backend> RMSNorm<B> {
    pub fn load(
        vb: &VarBuilder<B>,
        dim: usize,
        eps: f64,
        elementwise_affine: bool,
    ) -> Result<Self> {
        let weight = if elementwise_affine {
            Some(vb.param("weight", [dim])?)
        } else {
            None
        };
        Ok(Self { weight, eps })
    }

    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let variance = x.clone().powi_scalar(2).mean_dim(D - 1);
        let normed = x * variance.add_scalar(self.eps).sqrt().recip();
        match &self.weight {
            Some(weight) => normed * weight.val().unsqueeze(),
            None => normed,
        }
    }
}

/// The `N` modulation vectors `[batch, 1, dim]` of `linear(silu(emb))`, in diffusers' chunk
/// order.
fn modulation_chunks<B: Backend, const N: usize>(
    linear: &Linear<B>,
    emb: Tensor<B, 2>,
) -> [Tensor<B, 3>; N] {
    let out = linear.forward(Activation::Silu.forward(emb));
    let [b, width] = out.dims();
    let out: Tensor<B, 3> = out.reshape([b, N, width / N]);
    std::array::from_fn(|i| out.clone().narrow(1, i, 1))
}

/// What [`AdaLayerNormZero`] returns: the modulated input and the other four vectors, each
/// `[batch, 1, dim]`.
#[derive(Debug, Clone)]
pub struct AdaLnZeroOutput<B: Backend> {
    pub x: Tensor<B, 3>,
    pub gate_msa: Tensor<B, 3>,
    pub shift_mlp: Tensor<B, 3>,
    pub scale_mlp: Tensor<B, 3>,
    pub gate_mlp: Tensor<B, 3>,
}

/// diffusers' `AdaLayerNormZero` (adaLN-Zero, without its own embedding: `emb` is given):
/// `linear(silu(emb))` in six chunks (shift, scale, gate of the attention, then of the MLP);
/// the input is layer-normed (no affine, eps 1e-6) and modulated by the first two.
#[derive(Module, Debug)]
pub struct AdaLayerNormZero<B: Backend> {
    pub linear: Linear<B>,
}

impl<B: Backend> AdaLayerNormZero<B> {
    pub fn load(vb: &VarBuilder<B>, dim: usize) -> Result<Self> {
        Ok(Self {
            linear: Linear::load(&vb.pp("linear"), dim, 6 * dim, true)?,
        })
    }

    pub fn forward(&self, x: Tensor<B, 3>, emb: Tensor<B, 2>) -> AdaLnZeroOutput<B> {
        let [shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp] =
            modulation_chunks(&self.linear, emb);
        AdaLnZeroOutput {
            x: modulate(crate::nn::layer_norm(x, 1e-6), shift_msa, scale_msa),
            gate_msa,
            shift_mlp,
            scale_mlp,
            gate_mlp,
        }
    }
}

/// diffusers' `SD35AdaLayerNormZeroX` (SD3.5 Medium's dual-attention blocks): nine chunks, the
/// [`AdaLayerNormZero`] six plus shift, scale and gate of the second attention, whose input is
/// the same normed `x` modulated by those. Returns the zero output and `(x2, gate_msa2)`.
#[derive(Module, Debug)]
pub struct SD35AdaLayerNormZeroX<B: Backend> {
    pub linear: Linear<B>,
}

impl<B: Backend> SD35AdaLayerNormZeroX<B> {
    pub fn load(vb: &VarBuilder<B>, dim: usize) -> Result<Self> {
        Ok(Self {
            linear: Linear::load(&vb.pp("linear"), dim, 9 * dim, true)?,
        })
    }

    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        emb: Tensor<B, 2>,
    ) -> (AdaLnZeroOutput<B>, Tensor<B, 3>, Tensor<B, 3>) {
        let [shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp, shift_msa2, scale_msa2, gate_msa2] =
            modulation_chunks(&self.linear, emb);
        let normed = crate::nn::layer_norm(x, 1e-6);
        let x2 = modulate(normed.clone(), shift_msa2, scale_msa2);
        let out = AdaLnZeroOutput {
            x: modulate(normed, shift_msa, scale_msa),
            gate_msa,
            shift_mlp,
            scale_mlp,
            gate_mlp,
        };
        (out, x2, gate_msa2)
    }
}

/// diffusers' `AdaLayerNormContinuous` with `elementwise_affine=False` and a layer norm (as
/// SD3 and Flux use it): `linear(silu(cond))` gives scale then shift (that order), applied to
/// the parameter-free layer norm of `x`.
#[derive(Module, Debug)]
pub struct AdaLayerNormContinuous<B: Backend> {
    pub linear: Linear<B>,
    pub eps: f64,
}

impl<B: Backend> AdaLayerNormContinuous<B> {
    pub fn load(vb: &VarBuilder<B>, dim: usize, conditioning_dim: usize, eps: f64) -> Result<Self> {
        Ok(Self {
            linear: Linear::load(&vb.pp("linear"), conditioning_dim, 2 * dim, true)?,
            eps,
        })
    }

    pub fn forward(&self, x: Tensor<B, 3>, conditioning: Tensor<B, 2>) -> Tensor<B, 3> {
        let [scale, shift] = modulation_chunks(&self.linear, conditioning);
        modulate(crate::nn::layer_norm(x, self.eps), shift, scale)
    }
}

/// diffusers' `AdaLayerNormZeroSingle` (Flux's single-stream blocks): three chunks (shift,
/// scale, gate); returns the modulated parameter-free layer norm of `x` (eps 1e-6) and the
/// gate `[batch, 1, dim]`.
#[derive(Module, Debug)]
pub struct AdaLayerNormZeroSingle<B: Backend> {
    pub linear: Linear<B>,
}

impl<B: Backend> AdaLayerNormZeroSingle<B> {
    pub fn load(vb: &VarBuilder<B>, dim: usize) -> Result<Self> {
        Ok(Self {
            linear: Linear::load(&vb.pp("linear"), dim, 3 * dim, true)?,
        })
    }

    pub fn forward(&self, x: Tensor<B, 3>, emb: Tensor<B, 2>) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let [shift_msa, scale_msa, gate_msa] = modulation_chunks(&self.linear, emb);
        (
            modulate(crate::nn::layer_norm(x, 1e-6), shift_msa, scale_msa),
            gate_msa,
        )
    }
}
