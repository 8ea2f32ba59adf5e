//! The down, middle and up blocks of [`crate::UNet2DConditionModel`], as diffusers'
//! `unet_2d_blocks.py`: each block loads its own `resnets`, `attentions` and re-samplers under
//! its key prefix and runs them in its own `forward`.

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::attention::{Transformer2DModel, Transformer2DSpec};
use crate::error::Result;
use crate::nn::Activation;
use crate::resnet::{Downsample2D, ResnetBlock2D, ResnetSpec, Upsample2D};
use crate::var_builder::VarBuilder;

/// The ResNet settings every block of one UNet shares.
#[derive(Debug, Clone, Copy)]
pub struct ResnetSettings {
    pub temb_channels: usize,
    pub groups: usize,
    pub eps: f64,
    pub act: Activation,
}

impl ResnetSettings {
    fn spec(self, c_in: usize, c_out: usize) -> ResnetSpec {
        ResnetSpec {
            c_in,
            c_out,
            temb_channels: Some(self.temb_channels),
            groups: self.groups,
            eps: self.eps,
            act: self.act,
        }
    }
}

/// Shape of a down block.
#[derive(Debug, Clone, Copy)]
pub struct DownBlockSpec {
    pub in_channels: usize,
    pub out_channels: usize,
    pub num_layers: usize,
    /// Every block but the last halves the resolution.
    pub add_downsample: bool,
    pub downsample_padding: usize,
    pub resnet: ResnetSettings,
}

impl DownBlockSpec {
    fn load_resnets<B: Backend>(&self, vb: &VarBuilder<B>) -> Result<Vec<ResnetBlock2D<B>>> {
        (0..self.num_layers)
            .map(|j| {
                let c_in = if j == 0 {
                    self.in_channels
                } else {
                    self.out_channels
                };
                ResnetBlock2D::load(
                    &vb.pp("resnets").pp(j),
                    self.resnet.spec(c_in, self.out_channels),
                )
            })
            .collect()
    }

    fn load_downsamplers<B: Backend>(&self, vb: &VarBuilder<B>) -> Result<Vec<Downsample2D<B>>> {
        if !self.add_downsample {
            return Ok(Vec::new());
        }
        Ok(vec![Downsample2D::load(
            &vb.pp("downsamplers").pp(0),
            self.out_channels,
            self.downsample_padding,
        )?])
    }
}

/// Shape of an up block: `num_layers` ResNets, each fed one skip connection (the last one from
/// the down block below, `in_channels` wide).
#[derive(Debug, Clone, Copy)]
pub struct UpBlockSpec {
    pub in_channels: usize,
    pub prev_output_channel: usize,
    pub out_channels: usize,
    pub num_layers: usize,
    /// Every block but the last doubles the resolution.
    pub add_upsample: bool,
    pub resnet: ResnetSettings,
}

impl UpBlockSpec {
    fn load_resnets<B: Backend>(&self, vb: &VarBuilder<B>) -> Result<Vec<ResnetBlock2D<B>>> {
        (0..self.num_layers)
            .map(|j| {
                let skip = if j + 1 == self.num_layers {
                    self.in_channels
                } else {
                    self.out_channels
                };
                let c_in = if j == 0 {
                    self.prev_output_channel
                } else {
                    self.out_channels
                };
                ResnetBlock2D::load(
                    &vb.pp("resnets").pp(j),
                    self.resnet.spec(c_in + skip, self.out_channels),
                )
            })
            .collect()
    }

    fn load_upsamplers<B: Backend>(&self, vb: &VarBuilder<B>) -> Result<Vec<Upsample2D<B>>> {
        if !self.add_upsample {
            return Ok(Vec::new());
        }
        Ok(vec![Upsample2D::load(
            &vb.pp("upsamplers").pp(0),
            self.out_channels,
        )?])
    }
}

/// The transformers of a cross-attention block, one after each ResNet.
fn load_attentions<B: Backend>(
    vb: &VarBuilder<B>,
    count: usize,
    spec: Transformer2DSpec,
) -> Result<Vec<Transformer2DModel<B>>> {
    (0..count)
        .map(|j| Transformer2DModel::load(&vb.pp("attentions").pp(j), spec))
        .collect()
}

/// Runs the downsamplers, keeping each output as a skip connection.
fn downsample<B: Backend>(
    downsamplers: &[Downsample2D<B>],
    mut x: Tensor<B, 4>,
    states: &mut Vec<Tensor<B, 4>>,
) -> Tensor<B, 4> {
    for down in downsamplers {
        x = down.forward(x);
        states.push(x.clone());
    }
    x
}

/// diffusers' `CrossAttnDownBlock2D`: (ResNet, transformer) pairs, then a downsampler.
#[derive(Module, Debug)]
pub struct CrossAttnDownBlock2D<B: Backend> {
    pub resnets: Vec<ResnetBlock2D<B>>,
    pub attentions: Vec<Transformer2DModel<B>>,
    pub downsamplers: Vec<Downsample2D<B>>,
}

impl<B: Backend> CrossAttnDownBlock2D<B> {
    pub fn load(
        vb: &VarBuilder<B>,
        spec: DownBlockSpec,
        transformer: Transformer2DSpec,
    ) -> Result<Self> {
        Ok(Self {
            resnets: spec.load_resnets(vb)?,
            attentions: load_attentions(vb, spec.num_layers, transformer)?,
            downsamplers: spec.load_downsamplers(vb)?,
        })
    }

    /// The block's output and its skip connections (one per layer and downsampler).
    pub fn forward(
        &self,
        mut x: Tensor<B, 4>,
        temb: &Tensor<B, 2>,
        context: &Tensor<B, 3>,
    ) -> (Tensor<B, 4>, Vec<Tensor<B, 4>>) {
        let mut states = Vec::with_capacity(self.resnets.len() + self.downsamplers.len());
        for (resnet, attention) in self.resnets.iter().zip(&self.attentions) {
            x = resnet.forward(x, Some(temb));
            x = attention.forward(x, context.clone());
            states.push(x.clone());
        }
        let x = downsample(&self.downsamplers, x, &mut states);
        (x, states)
    }
}

/// diffusers' `DownBlock2D`: ResNets, then a downsampler.
#[derive(Module, Debug)]
pub struct DownBlock2D<B: Backend> {
    pub resnets: Vec<ResnetBlock2D<B>>,
    pub downsamplers: Vec<Downsample2D<B>>,
}

impl<B: Backend> DownBlock2D<B> {
    pub fn load(vb: &VarBuilder<B>, spec: DownBlockSpec) -> Result<Self> {
        Ok(Self {
            resnets: spec.load_resnets(vb)?,
            downsamplers: spec.load_downsamplers(vb)?,
        })
    }

    /// The block's output and its skip connections (one per layer and downsampler).
    pub fn forward(
        &self,
        mut x: Tensor<B, 4>,
        temb: &Tensor<B, 2>,
    ) -> (Tensor<B, 4>, Vec<Tensor<B, 4>>) {
        let mut states = Vec::with_capacity(self.resnets.len() + self.downsamplers.len());
        for resnet in &self.resnets {
            x = resnet.forward(x, Some(temb));
            states.push(x.clone());
        }
        let x = downsample(&self.downsamplers, x, &mut states);
        (x, states)
    }
}

/// diffusers' `UNetMidBlock2DCrossAttn`: a ResNet, then (transformer, ResNet) pairs.
#[derive(Module, Debug)]
pub struct UNetMidBlock2DCrossAttn<B: Backend> {
    pub resnets: Vec<ResnetBlock2D<B>>,
    pub attentions: Vec<Transformer2DModel<B>>,
}

impl<B: Backend> UNetMidBlock2DCrossAttn<B> {
    /// One transformer between two ResNets, all `channels` wide.
    pub fn load(
        vb: &VarBuilder<B>,
        channels: usize,
        resnet: ResnetSettings,
        transformer: Transformer2DSpec,
    ) -> Result<Self> {
        Ok(Self {
            resnets: load_mid_resnets(vb, channels, resnet)?,
            attentions: load_attentions(vb, 1, transformer)?,
        })
    }

    pub fn forward(
        &self,
        x: Tensor<B, 4>,
        temb: &Tensor<B, 2>,
        context: &Tensor<B, 3>,
    ) -> Tensor<B, 4> {
        let Some((first, rest)) = self.resnets.split_first() else {
            return x;
        };
        let mut x = first.forward(x, Some(temb));
        for (attention, resnet) in self.attentions.iter().zip(rest) {
            x = attention.forward(x, context.clone());
            x = resnet.forward(x, Some(temb));
        }
        x
    }
}

/// diffusers' `UNetMidBlock2D` as `UNet2DConditionModel` builds it (`add_attention=False`):
/// two ResNets.
#[derive(Module, Debug)]
pub struct UNetMidBlock2D<B: Backend> {
    pub resnets: Vec<ResnetBlock2D<B>>,
}

impl<B: Backend> UNetMidBlock2D<B> {
    pub fn load(vb: &VarBuilder<B>, channels: usize, resnet: ResnetSettings) -> Result<Self> {
        Ok(Self {
            resnets: load_mid_resnets(vb, channels, resnet)?,
        })
    }

    pub fn forward(&self, mut x: Tensor<B, 4>, temb: &Tensor<B, 2>) -> Tensor<B, 4> {
        for resnet in &self.resnets {
            x = resnet.forward(x, Some(temb));
        }
        x
    }
}

fn load_mid_resnets<B: Backend>(
    vb: &VarBuilder<B>,
    channels: usize,
    resnet: ResnetSettings,
) -> Result<Vec<ResnetBlock2D<B>>> {
    (0..2)
        .map(|j| ResnetBlock2D::load(&vb.pp("resnets").pp(j), resnet.spec(channels, channels)))
        .collect()
}

/// diffusers' `CrossAttnUpBlock2D`: (ResNet over a skip connection, transformer) pairs, then
/// an upsampler.
#[derive(Module, Debug)]
pub struct CrossAttnUpBlock2D<B: Backend> {
    pub resnets: Vec<ResnetBlock2D<B>>,
    pub attentions: Vec<Transformer2DModel<B>>,
    pub upsamplers: Vec<Upsample2D<B>>,
}

impl<B: Backend> CrossAttnUpBlock2D<B> {
    pub fn load(
        vb: &VarBuilder<B>,
        spec: UpBlockSpec,
        transformer: Transformer2DSpec,
    ) -> Result<Self> {
        Ok(Self {
            resnets: spec.load_resnets(vb)?,
            attentions: load_attentions(vb, spec.num_layers, transformer)?,
            upsamplers: spec.load_upsamplers(vb)?,
        })
    }

    /// `res_hidden_states`: this block's skip connections, the last one taken first;
    /// `upsample_size`: the next block's resolution (so odd latent sizes still line up).
    pub fn forward(
        &self,
        mut x: Tensor<B, 4>,
        mut res_hidden_states: Vec<Tensor<B, 4>>,
        temb: &Tensor<B, 2>,
        context: &Tensor<B, 3>,
        upsample_size: Option<[usize; 2]>,
    ) -> Tensor<B, 4> {
        for (resnet, attention) in self.resnets.iter().zip(&self.attentions) {
            let skip = res_hidden_states.pop().unwrap_or_else(|| x.clone());
            x = resnet.forward(Tensor::cat(vec![x, skip], 1), Some(temb));
            x = attention.forward(x, context.clone());
        }
        upsample(&self.upsamplers, x, upsample_size)
    }
}

/// diffusers' `UpBlock2D`: ResNets over skip connections, then an upsampler.
#[derive(Module, Debug)]
pub struct UpBlock2D<B: Backend> {
    pub resnets: Vec<ResnetBlock2D<B>>,
    pub upsamplers: Vec<Upsample2D<B>>,
}

impl<B: Backend> UpBlock2D<B> {
    pub fn load(vb: &VarBuilder<B>, spec: UpBlockSpec) -> Result<Self> {
        Ok(Self {
            resnets: spec.load_resnets(vb)?,
            upsamplers: spec.load_upsamplers(vb)?,
        })
    }

    /// As [`CrossAttnUpBlock2D::forward`], without the transformers.
    pub fn forward(
        &self,
        mut x: Tensor<B, 4>,
        mut res_hidden_states: Vec<Tensor<B, 4>>,
        temb: &Tensor<B, 2>,
        upsample_size: Option<[usize; 2]>,
    ) -> Tensor<B, 4> {
        for resnet in &self.resnets {
            let skip = res_hidden_states.pop().unwrap_or_else(|| x.clone());
            x = resnet.forward(Tensor::cat(vec![x, skip], 1), Some(temb));
        }
        upsample(&self.upsamplers, x, upsample_size)
    }
}

fn upsample<B: Backend>(
    upsamplers: &[Upsample2D<B>],
    mut x: Tensor<B, 4>,
    size: Option<[usize; 2]>,
) -> Tensor<B, 4> {
    for up in upsamplers {
        x = up.forward(x, size);
    }
    x
}

/// An entry of `down_blocks`, by its `down_block_types` name.
// One per block: the variants' size difference does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum DownBlock<B: Backend> {
    CrossAttnDownBlock2D(CrossAttnDownBlock2D<B>),
    DownBlock2D(DownBlock2D<B>),
}

impl<B: Backend> DownBlock<B> {
    pub fn resnets(&self) -> &[ResnetBlock2D<B>] {
        match self {
            Self::CrossAttnDownBlock2D(block) => &block.resnets,
            Self::DownBlock2D(block) => &block.resnets,
        }
    }

    /// The transformers (none in a `DownBlock2D`).
    pub fn attentions(&self) -> &[Transformer2DModel<B>] {
        match self {
            Self::CrossAttnDownBlock2D(block) => &block.attentions,
            Self::DownBlock2D(_) => &[],
        }
    }

    /// The downsampler (none in the last block).
    pub fn downsamplers(&self) -> &[Downsample2D<B>] {
        match self {
            Self::CrossAttnDownBlock2D(block) => &block.downsamplers,
            Self::DownBlock2D(block) => &block.downsamplers,
        }
    }

    pub fn attentions_mut(&mut self) -> &mut [Transformer2DModel<B>] {
        match self {
            Self::CrossAttnDownBlock2D(block) => &mut block.attentions,
            Self::DownBlock2D(_) => &mut [],
        }
    }

    pub fn forward(
        &self,
        x: Tensor<B, 4>,
        temb: &Tensor<B, 2>,
        context: &Tensor<B, 3>,
    ) -> (Tensor<B, 4>, Vec<Tensor<B, 4>>) {
        match self {
            Self::CrossAttnDownBlock2D(block) => block.forward(x, temb, context),
            Self::DownBlock2D(block) => block.forward(x, temb),
        }
    }
}

/// The `mid_block`, by its `mid_block_type` name.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum MidBlock<B: Backend> {
    UNetMidBlock2DCrossAttn(UNetMidBlock2DCrossAttn<B>),
    UNetMidBlock2D(UNetMidBlock2D<B>),
}

impl<B: Backend> MidBlock<B> {
    /// The transformers (none in a `UNetMidBlock2D`).
    pub fn attentions(&self) -> &[Transformer2DModel<B>] {
        match self {
            Self::UNetMidBlock2DCrossAttn(block) => &block.attentions,
            Self::UNetMidBlock2D(_) => &[],
        }
    }

    pub fn attentions_mut(&mut self) -> &mut [Transformer2DModel<B>] {
        match self {
            Self::UNetMidBlock2DCrossAttn(block) => &mut block.attentions,
            Self::UNetMidBlock2D(_) => &mut [],
        }
    }

    pub fn forward(
        &self,
        x: Tensor<B, 4>,
        temb: &Tensor<B, 2>,
        context: &Tensor<B, 3>,
    ) -> Tensor<B, 4> {
        match self {
            Self::UNetMidBlock2DCrossAttn(block) => block.forward(x, temb, context),
            Self::UNetMidBlock2D(block) => block.forward(x, temb),
        }
    }
}

/// An entry of `up_blocks`, by its `up_block_types` name.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum UpBlock<B: Backend> {
    CrossAttnUpBlock2D(CrossAttnUpBlock2D<B>),
    UpBlock2D(UpBlock2D<B>),
}

impl<B: Backend> UpBlock<B> {
    pub fn resnets(&self) -> &[ResnetBlock2D<B>] {
        match self {
            Self::CrossAttnUpBlock2D(block) => &block.resnets,
            Self::UpBlock2D(block) => &block.resnets,
        }
    }

    /// The transformers (none in an `UpBlock2D`).
    pub fn attentions(&self) -> &[Transformer2DModel<B>] {
        match self {
            Self::CrossAttnUpBlock2D(block) => &block.attentions,
            Self::UpBlock2D(_) => &[],
        }
    }

    pub fn attentions_mut(&mut self) -> &mut [Transformer2DModel<B>] {
        match self {
            Self::CrossAttnUpBlock2D(block) => &mut block.attentions,
            Self::UpBlock2D(_) => &mut [],
        }
    }

    /// See [`CrossAttnUpBlock2D::forward`].
    pub fn forward(
        &self,
        x: Tensor<B, 4>,
        res_hidden_states: Vec<Tensor<B, 4>>,
        temb: &Tensor<B, 2>,
        context: &Tensor<B, 3>,
        upsample_size: Option<[usize; 2]>,
    ) -> Tensor<B, 4> {
        match self {
            Self::CrossAttnUpBlock2D(block) => {
                block.forward(x, res_hidden_states, temb, context, upsample_size)
            }
            Self::UpBlock2D(block) => block.forward(x, res_hidden_states, temb, upsample_size),
        }
    }
}
