//! diffusers' `ResnetBlock2D`, `Downsample2D` and `Upsample2D`, shared by the UNet and the VAE.

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::module::interpolate;
use burn::tensor::ops::{InterpolateMode, InterpolateOptions};
use burn::tensor::Tensor;

use crate::error::Result;
use crate::nn::{add_per_channel, residual_add, Activation, Conv2d, ConvSpec, GroupNorm, Linear};
use crate::var_builder::VarBuilder;

/// Shape of a [`ResnetBlock2D`].
#[derive(Debug, Clone, Copy)]
pub struct ResnetSpec {
    pub c_in: usize,
    pub c_out: usize,
    /// Width of the time embedding, `None` for the VAE.
    pub temb_channels: Option<usize>,
    pub groups: usize,
    pub eps: f64,
    pub act: Activation,
}

/// Two normalised 3x3 convolutions with a time-embedding shift and a residual.
#[derive(Module, Debug)]
pub struct ResnetBlock2D<B: Backend> {
    pub norm1: GroupNorm<B>,
    pub conv1: Conv2d<B>,
    pub time_emb_proj: Option<Linear<B>>,
    pub norm2: GroupNorm<B>,
    pub conv2: Conv2d<B>,
    pub conv_shortcut: Option<Conv2d<B>>,
    #[module(skip)]
    pub act: Activation,
}

impl<B: Backend> ResnetBlock2D<B> {
    pub fn load(vb: &VarBuilder<B>, spec: ResnetSpec) -> Result<Self> {
        let time_emb_proj = match spec.temb_channels {
            Some(t) => Some(Linear::load(&vb.pp("time_emb_proj"), t, spec.c_out, true)?),
            None => None,
        };
        let conv_shortcut = if spec.c_in != spec.c_out {
            Some(Conv2d::load(
                &vb.pp("conv_shortcut"),
                ConvSpec::same(spec.c_in, spec.c_out, 1),
            )?)
        } else {
            None
        };
        Ok(Self {
            norm1: GroupNorm::load(&vb.pp("norm1"), spec.groups, spec.c_in, spec.eps)?,
            conv1: Conv2d::load(&vb.pp("conv1"), ConvSpec::same(spec.c_in, spec.c_out, 3))?,
            time_emb_proj,
            norm2: GroupNorm::load(&vb.pp("norm2"), spec.groups, spec.c_out, spec.eps)?,
            conv2: Conv2d::load(&vb.pp("conv2"), ConvSpec::same(spec.c_out, spec.c_out, 3))?,
            conv_shortcut,
            act: spec.act,
        })
    }

    pub fn forward(&self, x: Tensor<B, 4>, temb: Option<&Tensor<B, 2>>) -> Tensor<B, 4> {
        let h = self
            .conv1
            .forward(self.norm1.forward_then(x.clone(), self.act));
        let h = match (&self.time_emb_proj, temb) {
            (Some(proj), Some(temb)) => {
                let t = proj.forward(self.act.forward(temb.clone()));
                add_per_channel(h, t)
            }
            _ => h,
        };
        let h = self.conv2.forward(self.norm2.forward_then(h, self.act));
        let shortcut = match &self.conv_shortcut {
            Some(conv) => conv.forward(x),
            None => x,
        };
        residual_add(shortcut, h)
    }
}

/// A strided 3x3 convolution that halves height and width (`downsamplers.0.conv`).
#[derive(Module, Debug)]
pub struct Downsample2D<B: Backend> {
    pub conv: Conv2d<B>,
    /// The VAE's encoder pads right and bottom by one instead of symmetric padding.
    pub pad_asymmetric: bool,
}

impl<B: Backend> Downsample2D<B> {
    /// `padding` as diffusers' `downsample_padding`: 1 in the UNet, 0 in the VAE encoder.
    pub fn load(vb: &VarBuilder<B>, channels: usize, padding: usize) -> Result<Self> {
        let spec = ConvSpec {
            c_in: channels,
            c_out: channels,
            kernel: 3,
            stride: 2,
            padding,
        };
        Ok(Self {
            conv: Conv2d::load(&vb.pp("conv"), spec)?,
            pad_asymmetric: padding == 0,
        })
    }

    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let x = if self.pad_asymmetric {
            // Zeros of x's own dtype concatenated right and bottom: burn-flex's `pad` fills
            // with an f32 constant and panics on bf16/f16 tensors.
            let [n, c, h, _] = x.dims();
            let column = x.clone().slice([0..n, 0..c, 0..h, 0..1]).zeros_like();
            let x = Tensor::cat(vec![x, column], 3);
            let row = x.clone().slice([0..n, 0..c, 0..1]).zeros_like();
            Tensor::cat(vec![x, row], 2)
        } else {
            x
        };
        self.conv.forward(x)
    }
}

/// Nearest-neighbour upsampling by two (or to a given size), then a 3x3 convolution.
#[derive(Module, Debug)]
pub struct Upsample2D<B: Backend> {
    pub conv: Conv2d<B>,
}

impl<B: Backend> Upsample2D<B> {
    pub fn load(vb: &VarBuilder<B>, channels: usize) -> Result<Self> {
        Ok(Self {
            conv: Conv2d::load(&vb.pp("conv"), ConvSpec::same(channels, channels, 3))?,
        })
    }

    /// `size` overrides the doubled size, as the UNet does when the latent size is not a
    /// multiple of its total downsampling factor.
    pub fn forward(&self, x: Tensor<B, 4>, size: Option<[usize; 2]>) -> Tensor<B, 4> {
        let [_, _, h, w] = x.dims();
        let size = size.unwrap_or([h * 2, w * 2]);
        let up = interpolate(x, size, InterpolateOptions::new(InterpolateMode::Nearest));
        self.conv.forward(up)
    }
}
