//! Adaptive normalisation of the diffusion transformers (diffusers' `normalization.py`).
//!
//! The modulation itself (`x * (1 + scale) + shift`) is applied by the blocks; here live the
//! layers that produce the scales and shifts from the timestep (and conditions).

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use burn::module::Param;
use burn::tensor::activation::silu;

use crate::embeddings::{MicroConditions, PixArtAlphaCombinedTimestepSizeEmbeddings};
use crate::error::Result;
use crate::nn::{layer_norm, Linear};
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

/// Column `i` of `n` equal chunks of a `[batch, n * dim]` modulation, as `[batch, 1, dim]`
/// (torch's `emb.chunk(n, dim=1)[i][:, None]`).
fn chunk<B: Backend>(emb: &Tensor<B, 2>, n: usize, i: usize) -> Tensor<B, 3> {
    let dim = emb.dims()[1] / n;
    emb.clone().narrow(1, i * dim, dim).unsqueeze_dim(1)
}

/// diffusers' `RMSNorm` (and `torch.nn.RMSNorm`) over the last dimension:
/// `x / sqrt(mean(x^2) + eps)`, times `weight` when the layer has one (`elementwise_affine`).
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
            Some(Param::from_tensor(vb.get("weight", [dim])?))
        } else {
            None
        };
        Ok(Self { weight, eps })
    }

    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let variance = x.clone().powi_scalar(2).mean_dim(D - 1);
        let normed = x / variance.add_scalar(self.eps).sqrt();
        match &self.weight {
            Some(w) => normed * w.val().unsqueeze(),
            None => normed,
        }
    }
}

/// What [`AdaLayerNormZero`] returns: the modulated input and the attention gate, then the
/// feed-forward's shift, scale and gate (each `[batch, 1, dim]`).
pub struct AdaLayerNormZeroOutput<B: Backend> {
    pub x: Tensor<B, 3>,
    pub gate_msa: Tensor<B, 3>,
    pub shift_mlp: Tensor<B, 3>,
    pub scale_mlp: Tensor<B, 3>,
    pub gate_mlp: Tensor<B, 3>,
}

/// diffusers' `AdaLayerNormZero` (adaLN-Zero of the MMDiT blocks, without its own
/// embedding): `linear(silu(emb))` gives six modulations; the input is layer-normed (no
/// affine, eps 1e-6) and modulated by the first two.
#[derive(Module, Debug)]
pub struct AdaLayerNormZero<B: Backend> {
    pub linear: Linear<B>,
}

impl<B: Backend> AdaLayerNormZero<B> {
    pub fn load(vb: &VarBuilder<B>, embedding_dim: usize) -> Result<Self> {
        Ok(Self {
            linear: Linear::load(&vb.pp("linear"), embedding_dim, 6 * embedding_dim, true)?,
        })
    }

    /// `x` `[batch, seq, dim]`, `emb` `[batch, dim]`.
    pub fn forward(&self, x: Tensor<B, 3>, emb: Tensor<B, 2>) -> AdaLayerNormZeroOutput<B> {
        let emb = self.linear.forward(silu(emb));
        let part = |i| chunk(&emb, 6, i);
        AdaLayerNormZeroOutput {
            x: modulate(layer_norm(x, 1e-6), part(0), part(1)),
            gate_msa: part(2),
            shift_mlp: part(3),
            scale_mlp: part(4),
            gate_mlp: part(5),
        }
    }
}

/// diffusers' `AdaLayerNormZeroSingle` (Flux's single-stream blocks): three modulations,
/// returns the modulated input and the gate `[batch, 1, dim]`.
#[derive(Module, Debug)]
pub struct AdaLayerNormZeroSingle<B: Backend> {
    pub linear: Linear<B>,
}

impl<B: Backend> AdaLayerNormZeroSingle<B> {
    pub fn load(vb: &VarBuilder<B>, embedding_dim: usize) -> Result<Self> {
        Ok(Self {
            linear: Linear::load(&vb.pp("linear"), embedding_dim, 3 * embedding_dim, true)?,
        })
    }

    pub fn forward(&self, x: Tensor<B, 3>, emb: Tensor<B, 2>) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let emb = self.linear.forward(silu(emb));
        let part = |i| chunk(&emb, 3, i);
        (modulate(layer_norm(x, 1e-6), part(0), part(1)), part(2))
    }
}

/// diffusers' `AdaLayerNormContinuous` with a layer norm without affine parameters (as Flux
/// and SD3 build their `norm_out`): `linear(silu(cond))` gives scale then shift.
#[derive(Module, Debug)]
pub struct AdaLayerNormContinuous<B: Backend> {
    pub linear: Linear<B>,
    pub eps: f64,
}

impl<B: Backend> AdaLayerNormContinuous<B> {
    pub fn load(
        vb: &VarBuilder<B>,
        embedding_dim: usize,
        conditioning_embedding_dim: usize,
        eps: f64,
    ) -> Result<Self> {
        Ok(Self {
            linear: Linear::load(
                &vb.pp("linear"),
                conditioning_embedding_dim,
                2 * embedding_dim,
                true,
            )?,
            eps,
        })
    }

    pub fn forward(&self, x: Tensor<B, 3>, conditioning: Tensor<B, 2>) -> Tensor<B, 3> {
        let emb = self.linear.forward(silu(conditioning));
        let (scale, shift) = (chunk(&emb, 2, 0), chunk(&emb, 2, 1));
        modulate(layer_norm(x, self.eps), shift, scale)
    }
}
