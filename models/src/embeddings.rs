//! Timestep embeddings (diffusers' `Timesteps` and `TimestepEmbedding`).
//!
//! The frequency table is computed once on the host, exactly as diffusers computes it in f32;
//! the timestep itself stays a runtime tensor, so a compiled step never bakes it in.

use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use crate::error::Result;
use crate::nn::{Activation, Linear};
use crate::weights::VarBuilder;

/// Sinusoidal projection of timesteps, `get_timestep_embedding` in diffusers.
#[derive(Module, Debug)]
pub struct Timesteps<B: Backend> {
    /// `exp(-ln(max_period) * i / (half - shift))` for `i < half`, shape `[1, half]`.
    pub freqs: Param<Tensor<B, 2>>,
    pub flip_sin_to_cos: bool,
}

impl<B: Backend> Timesteps<B> {
    pub fn new(dim: usize, flip_sin_to_cos: bool, freq_shift: f64, device: &B::Device) -> Self {
        let half = dim / 2;
        let max_period = 10000f32;
        let freqs: Vec<f32> = (0..half)
            .map(|i| {
                let exponent = -max_period.ln() * i as f32;
                (exponent / (half as f32 - freq_shift as f32)).exp()
            })
            .collect();
        let freqs = Tensor::from_data(TensorData::new(freqs, [1, half]), device);
        Self {
            freqs: Param::from_tensor(freqs).set_require_grad(false),
            flip_sin_to_cos,
        }
    }

    /// `timesteps` of shape `[batch]` to embeddings `[batch, dim]`.
    pub fn forward(&self, timesteps: Tensor<B, 1>) -> Tensor<B, 2> {
        let args = timesteps.unsqueeze_dim::<2>(1) * self.freqs.val();
        let (sin, cos) = (args.clone().sin(), args.cos());
        if self.flip_sin_to_cos {
            Tensor::cat(vec![cos, sin], 1)
        } else {
            Tensor::cat(vec![sin, cos], 1)
        }
    }
}

/// Two linear layers with an activation between: `linear_1`, `linear_2`.
#[derive(Module, Debug)]
pub struct TimestepEmbedding<B: Backend> {
    pub linear_1: Linear<B>,
    pub linear_2: Linear<B>,
    #[module(skip)]
    pub act: Activation,
}

impl<B: Backend> TimestepEmbedding<B> {
    pub fn load(vb: &VarBuilder<B>, c_in: usize, dim: usize, act: Activation) -> Result<Self> {
        Ok(Self {
            linear_1: Linear::load(&vb.pp("linear_1"), c_in, dim, true)?,
            linear_2: Linear::load(&vb.pp("linear_2"), dim, dim, true)?,
            act,
        })
    }

    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.linear_2
            .forward(self.act.forward(self.linear_1.forward(x)))
    }
}
