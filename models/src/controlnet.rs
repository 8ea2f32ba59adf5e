//! `ControlNetModel`: a trainable copy of a UNet's down half that turns a conditioning image
//! (edges, depth, pose) into residuals added to the UNet's skip connections and mid block, as
//! diffusers' `models/controlnets/controlnet.py` (SD 1.x/2.x and SDXL ControlNets).
//!
//! Fields are named as the checkpoint keys (`controlnet_down_blocks.3`,
//! `controlnet_cond_embedding.blocks.0`); the down and mid blocks are the UNet's
//! ([`crate::unet_layout`]).

use std::path::Path;

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor};
use serde::Deserialize;

use crate::config::{check_at_most, load_json, MAX_DIMENSION};
use crate::dtype::{cast_to, dtype_of};
use crate::embeddings::{TimestepEmbedding, Timesteps};
use crate::error::{ModelError, Result};
use crate::nn::{Conv2d, ConvSpec};
use crate::unet_2d_blocks::{DownBlock, MidBlock};
use crate::unet_2d_condition::UNet2DConditionModel;
use crate::unet_2d_condition_config::UNet2DConditionConfig;
use crate::unet_conditioning::AddedCondition;
pub use crate::unet_conditioning::ControlResiduals;
use crate::unet_layout::{
    check_added_condition, embed_added, embed_time, TimeEmbeddings, UNetLayout,
};
use crate::var_builder::{load_component, VarBuilder};
use oxidiff_parallel::{ShardRule, ShardedWidth, TensorParallel, TensorParallelPlan};

/// `controlnet/config.json`: a UNet config's down half plus the conditioning fields, with
/// diffusers' defaults.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct ControlNetConfig {
    #[serde(flatten)]
    pub unet: UNet2DConditionConfig,
    /// Channels of the conditioning image (3: RGB).
    pub conditioning_channels: usize,
    /// The conditioning embedding's convolutions; each after the first halves the size.
    pub conditioning_embedding_out_channels: Vec<usize>,
    /// `rgb`, or `bgr` (the image's channels are flipped first).
    pub controlnet_conditioning_channel_order: String,
    /// Shuffle ControlNets: residuals averaged over space, and guess mode always on.
    pub global_pool_conditions: bool,
}

impl Default for ControlNetConfig {
    fn default() -> Self {
        Self {
            unet: UNet2DConditionConfig::default(),
            conditioning_channels: 3,
            conditioning_embedding_out_channels: vec![16, 32, 96, 256],
            controlnet_conditioning_channel_order: "rgb".into(),
            global_pool_conditions: false,
        }
    }
}

impl ControlNetConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        load_json::<Self>(path)?.completed(path)
    }

    /// The config with the up half the UNet checks want (a ControlNet has none: it mirrors
    /// the down half), validated; `path` names it in messages.
    pub fn completed(mut self, path: &Path) -> Result<Self> {
        self.unet.up_block_types = self
            .unet
            .down_block_types
            .iter()
            .rev()
            .map(|d| d.replace("Down", "Up"))
            .collect();
        self.validate(path)?;
        Ok(self)
    }

    /// Rejects configurations this model does not implement, naming the field.
    pub fn validate(&self, path: &Path) -> Result<()> {
        self.unet.validate(path)?;
        let config = |reason: String| ModelError::Config {
            path: path.to_path_buf(),
            reason,
        };
        if self.unet.mid_block_type.as_deref() != Some("UNetMidBlock2DCrossAttn") {
            return Err(ModelError::Unsupported {
                path: path.to_path_buf(),
                reason: format!(
                    "ControlNet `mid_block_type: {:?}` (only UNetMidBlock2DCrossAttn)",
                    self.unet.mid_block_type
                ),
            });
        }
        if !matches!(
            self.controlnet_conditioning_channel_order.as_str(),
            "rgb" | "bgr"
        ) {
            return Err(config(format!(
                "`controlnet_conditioning_channel_order: {}` (rgb or bgr)",
                self.controlnet_conditioning_channel_order
            )));
        }
        let embedding = &self.conditioning_embedding_out_channels;
        if embedding.is_empty() || embedding.len() > 8 {
            return Err(config(format!(
                "`conditioning_embedding_out_channels` has {} entries (1 to 8)",
                embedding.len()
            )));
        }
        check_at_most(
            "conditioning_channels",
            self.conditioning_channels,
            MAX_DIMENSION,
            path,
        )?;
        for &c in embedding {
            check_at_most(
                "conditioning_embedding_out_channels",
                c,
                MAX_DIMENSION,
                path,
            )?;
        }
        Ok(())
    }

    /// How many times smaller than the conditioning image the latents are.
    pub fn conditioning_downscale(&self) -> usize {
        1 << (self.conditioning_embedding_out_channels.len() - 1)
    }
}

/// diffusers' `ControlNetConditioningEmbedding`: the conditioning image down to the latents'
/// size and the UNet's first width (convolutions with SiLU, every second one of stride 2).
#[derive(Module, Debug)]
pub struct ControlNetConditioningEmbedding<B: Backend> {
    pub conv_in: Conv2d<B>,
    pub blocks: Vec<Conv2d<B>>,
    pub conv_out: Conv2d<B>,
}

impl<B: Backend> ControlNetConditioningEmbedding<B> {
    fn load(vb: &VarBuilder<B>, cfg: &ControlNetConfig, embedding_channels: usize) -> Result<Self> {
        Self::load_with(
            vb,
            cfg.conditioning_channels,
            &cfg.conditioning_embedding_out_channels,
            embedding_channels,
        )
    }

    /// The embedding of `conditioning_channels` image channels through `ch` (at least one
    /// width; each step after the first halves the size) to `embedding_channels`.
    pub(crate) fn load_with(
        vb: &VarBuilder<B>,
        conditioning_channels: usize,
        ch: &[usize],
        embedding_channels: usize,
    ) -> Result<Self> {
        let conv_in = Conv2d::load(
            &vb.pp("conv_in"),
            ConvSpec::same(conditioning_channels, ch[0], 3),
        )?;
        let mut blocks = Vec::with_capacity(2 * (ch.len() - 1));
        for (i, pair) in ch.windows(2).enumerate() {
            let (c_in, c_out) = (pair[0], pair[1]);
            blocks.push(Conv2d::load(
                &vb.pp("blocks").pp(2 * i),
                ConvSpec::same(c_in, c_in, 3),
            )?);
            blocks.push(Conv2d::load(
                &vb.pp("blocks").pp(2 * i + 1),
                ConvSpec {
                    stride: 2,
                    ..ConvSpec::same(c_in, c_out, 3)
                },
            )?);
        }
        let conv_out = Conv2d::load(
            &vb.pp("conv_out"),
            ConvSpec::same(ch[ch.len() - 1], embedding_channels, 3),
        )?;
        Ok(Self {
            conv_in,
            blocks,
            conv_out,
        })
    }

    pub(crate) fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let mut x = crate::nn::silu(self.conv_in.forward(x));
        for block in &self.blocks {
            x = crate::nn::silu(block.forward(x));
        }
        self.conv_out.forward(x)
    }
}

/// The conditioning image's channel order a ControlNet was trained on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChannelOrder {
    Rgb,
    Bgr,
}

/// A ControlNet (diffusers' `ControlNetModel`).
#[derive(Module, Debug)]
pub struct ControlNetModel<B: Backend> {
    pub time_proj: Timesteps<B>,
    pub time_embedding: TimestepEmbedding<B>,
    /// SDXL ControlNets (`text_time`).
    pub add_time_proj: Option<Timesteps<B>>,
    pub add_embedding: Option<TimestepEmbedding<B>>,
    pub conv_in: Conv2d<B>,
    pub controlnet_cond_embedding: ControlNetConditioningEmbedding<B>,
    pub down_blocks: Vec<DownBlock<B>>,
    /// The 1x1 ("zero") convolutions on each skip connection.
    pub controlnet_down_blocks: Vec<Conv2d<B>>,
    pub mid_block: MidBlock<B>,
    pub controlnet_mid_block: Conv2d<B>,
    #[module(skip)]
    pub channel_order: ChannelOrder,
    pub global_pool_conditions: bool,
    /// How many times smaller than the conditioning image the latents are.
    pub conditioning_downscale: usize,
}

/// The text width the first cross-attention of `blocks` takes, if any block has one.
fn context_width<B: Backend>(blocks: &[DownBlock<B>]) -> Option<usize> {
    blocks
        .iter()
        .flat_map(|b| b.attentions())
        .flat_map(|t| &t.transformer_blocks)
        .next()
        .map(|block| block.attn2.to_k.dims()[0])
}

impl<B: Backend> ControlNetModel<B> {
    /// Loads `config.json` and the weights of a ControlNet folder (a `controlnet/` component
    /// or a standalone ControlNet as the Hub has them).
    pub fn from_dir(dir: &Path, variant: Option<&str>, device: &B::Device) -> Result<Self> {
        Self::from_dir_in(dir, variant, FloatDType::F32, device)
    }

    /// The same, with the float weights held in `dtype`.
    pub fn from_dir_in(
        dir: &Path,
        variant: Option<&str>,
        dtype: FloatDType,
        device: &B::Device,
    ) -> Result<Self> {
        let path = dir.join("config.json");
        let config = ControlNetConfig::from_file(&path)?;
        load_component(
            dir,
            &["diffusion_pytorch_model"],
            variant,
            dtype,
            device,
            |vb| Self::load(&config, &path, vb),
        )
    }

    /// Builds the model from a parsed config; `config_path` is used in messages.
    pub fn load(cfg: &ControlNetConfig, config_path: &Path, vb: VarBuilder<B>) -> Result<Self> {
        cfg.validate(config_path)?;
        let unet = &cfg.unet;
        let layout = UNetLayout::new(unet, config_path)?;
        let TimeEmbeddings {
            time_proj,
            time_embedding,
            add_time_proj,
            add_embedding,
        } = layout.load_time_embeddings(unet, &vb)?;
        let c0 = layout.channels[0];
        let conv_in = Conv2d::load(
            &vb.pp("conv_in"),
            ConvSpec::same(unet.in_channels, c0, unet.conv_in_kernel),
        )?;
        let controlnet_cond_embedding =
            ControlNetConditioningEmbedding::load(&vb.pp("controlnet_cond_embedding"), cfg, c0)?;
        let down_blocks = layout.load_down_blocks(unet, &vb)?;
        let mid_block = layout
            .load_mid_block(unet, &vb)?
            .ok_or_else(|| ModelError::Config {
                path: config_path.to_path_buf(),
                reason: "a ControlNet needs a mid block".into(),
            })?;
        // One zero convolution per skip connection: conv_in's, each layer's, each downsampler's.
        let mut skips = vec![c0];
        let n = layout.channels.len();
        for (i, &c) in layout.channels.iter().enumerate() {
            skips.extend(std::iter::repeat_n(c, layout.layers[i]));
            if i + 1 < n {
                skips.push(c);
            }
        }
        let controlnet_down_blocks = skips
            .iter()
            .enumerate()
            .map(|(i, &c)| {
                Conv2d::load(
                    &vb.pp("controlnet_down_blocks").pp(i),
                    ConvSpec::same(c, c, 1),
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let c_mid = layout.channels[n - 1];
        let controlnet_mid_block = Conv2d::load(
            &vb.pp("controlnet_mid_block"),
            ConvSpec::same(c_mid, c_mid, 1),
        )?;
        Ok(Self {
            time_proj,
            time_embedding,
            add_time_proj,
            add_embedding,
            conv_in,
            controlnet_cond_embedding,
            down_blocks,
            controlnet_down_blocks,
            mid_block,
            controlnet_mid_block,
            channel_order: if cfg.controlnet_conditioning_channel_order == "bgr" {
                ChannelOrder::Bgr
            } else {
                ChannelOrder::Rgb
            },
            global_pool_conditions: cfg.global_pool_conditions,
            conditioning_downscale: cfg.conditioning_downscale(),
        })
    }

    /// The channels of each residual, in order.
    pub fn residual_channels(&self) -> Vec<usize> {
        self.controlnet_down_blocks
            .iter()
            .map(|conv| conv.weight.dims()[0])
            .collect()
    }

    /// Whether this ControlNet was made for `unet`: the same skip connections (count and
    /// channels), latent channels, text context width and added conditioning; otherwise an
    /// error naming what differs.
    pub fn check_fits(&self, unet: &UNet2DConditionModel<B>) -> Result<()> {
        let mismatch = |what: String| {
            Err(ModelError::Input(format!(
            "this ControlNet was made for another base model: {what}; use a ControlNet trained \
             for this pipeline's UNet"
        )))
        };
        let (ours, theirs) = (self.residual_channels(), unet.skip_channels());
        if ours != theirs {
            return mismatch(format!(
                "its residual channels are {ours:?}, the UNet's skip connections {theirs:?}"
            ));
        }
        // The latents it sees (an inpainting UNet takes mask channels besides).
        let latent = unet.conv_out.weight.dims()[0];
        let own = self.conv_in.weight.dims()[1];
        if own != latent {
            return mismatch(format!(
                "it takes {own} latent channels, the UNet makes {latent}"
            ));
        }
        if let (Some(ours), Some(theirs)) = (
            context_width(&self.down_blocks),
            context_width(&unet.down_blocks),
        ) {
            if ours != theirs {
                return mismatch(format!(
                    "its cross-attention takes {ours}-wide text, the UNet's {theirs}-wide"
                ));
            }
        }
        if self.add_embedding.is_some() != unet.needs_added_condition() {
            return mismatch(
                "one of them has SDXL's added conditioning (`addition_embed_type: text_time`) \
                 and the other not"
                    .into(),
            );
        }
        Ok(())
    }

    /// The residuals for `sample` (`[batch, 4, h, w]`, scaled by the scheduler) at `timestep`
    /// with text `encoder_hidden_states` and the conditioning image `cond` (`[batch, 3, h * s,
    /// w * s]` in [0, 1], `s` the conditioning downscale), multiplied by `scale`. In
    /// `guess_mode` (or for `global_pool_conditions` ControlNets) the residuals are scaled
    /// from 0.1 (first) to 1 (mid) as diffusers does.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        sample: Tensor<B, 4>,
        timestep: Tensor<B, 1>,
        encoder_hidden_states: Tensor<B, 3>,
        cond: Tensor<B, 4>,
        scale: f64,
        guess_mode: bool,
        added: Option<&AddedCondition<B>>,
    ) -> Result<ControlResiduals<B>> {
        let scale = Tensor::from_floats([scale as f32], &sample.device());
        self.check_input(sample.dims(), cond.dims(), added)?;
        Ok(self.residuals(
            sample,
            timestep,
            encoder_hidden_states,
            cond,
            scale,
            guess_mode,
            added,
        ))
    }

    /// Checks a call's shapes: the control image `cond` against the latents `sample` (batch,
    /// and size times the conditioning downscale) and the added condition against the model.
    pub fn check_input(
        &self,
        sample: [usize; 4],
        cond: [usize; 4],
        added: Option<&AddedCondition<B>>,
    ) -> Result<()> {
        let [batch, _, h, w] = sample;
        let [cb, _, ch, cw] = cond;
        let s = self.conditioning_downscale;
        if cb != batch || ch != h * s || cw != w * s {
            return Err(ModelError::Input(format!(
                "the control image batch is {cond:?}; expected [{batch}, 3, {}, {}] for latents \
                 {sample:?}",
                h * s,
                w * s,
            )));
        }
        check_added_condition(
            self.add_time_proj.as_ref(),
            self.add_embedding.as_ref(),
            batch,
            added,
        )
    }

    /// [`forward`](Self::forward) on inputs [`check_input`](Self::check_input) accepted, with
    /// the conditioning scale a `[1]` tensor (a runtime input of compiled programs).
    #[allow(clippy::too_many_arguments)]
    pub fn residuals(
        &self,
        sample: Tensor<B, 4>,
        timestep: Tensor<B, 1>,
        encoder_hidden_states: Tensor<B, 3>,
        cond: Tensor<B, 4>,
        scale: Tensor<B, 1>,
        guess_mode: bool,
        added: Option<&AddedCondition<B>>,
    ) -> ControlResiduals<B> {
        let batch = sample.dims()[0];
        let (caller, dtype) = (dtype_of(&sample), dtype_of(&self.conv_in.weight.val()));
        let sample = cast_to(sample, dtype);
        let ctx = cast_to(encoder_hidden_states, dtype);
        let cond = cast_to(cond, dtype);
        let cond = match self.channel_order {
            ChannelOrder::Rgb => cond,
            ChannelOrder::Bgr => cond.flip([1]),
        };
        let temb = embed_time(
            &self.time_proj,
            &self.time_embedding,
            cast_to(timestep, dtype),
            batch,
        );
        let temb = match embed_added(
            self.add_time_proj.as_ref(),
            self.add_embedding.as_ref(),
            added,
            dtype,
        ) {
            Some(aug) => temb + aug,
            None => temb,
        };
        let mut x = self.conv_in.forward(sample) + self.controlnet_cond_embedding.forward(cond);
        let mut skips = vec![x.clone()];
        for block in &self.down_blocks {
            let (out, states) = block.forward(x, &temb, &ctx);
            x = out;
            skips.extend(states);
        }
        let x = self.mid_block.forward(x, &temb, &ctx);
        let down: Vec<Tensor<B, 4>> = skips
            .into_iter()
            .zip(&self.controlnet_down_blocks)
            .map(|(skip, conv)| conv.forward(skip))
            .collect();
        let mid = self.controlnet_mid_block.forward(x);
        let guess = guess_mode || self.global_pool_conditions;
        // torch.logspace(-1, 0, n + 1): 0.1 up to 1, the last for the mid block.
        let n = down.len();
        let ramp = |i: usize| {
            if guess {
                10f64.powf(-1.0 + i as f64 / n as f64)
            } else {
                1.0
            }
        };
        let scale = cast_to(scale, caller).reshape([1, 1, 1, 1]);
        let pool = |r: Tensor<B, 4>| {
            if self.global_pool_conditions {
                r.mean_dim(2).mean_dim(3)
            } else {
                r
            }
        };
        let down = down
            .into_iter()
            .enumerate()
            .map(|(i, r)| cast_to(pool(r.mul_scalar(ramp(i))), caller) * scale.clone())
            .collect();
        let mid = cast_to(pool(mid.mul_scalar(ramp(n))), caller) * scale;
        ControlResiduals { down, mid }
    }
}

const CONTROLNET_RULES: [ShardRule; 20] = crate::unet_2d_condition::transformer_block_rules!(
    "down_blocks.*.attentions.*.transformer_blocks.*",
    "mid_block.attentions.*.transformer_blocks.*"
);

/// The ControlNet's plan is the UNet's on the half it copies: the transformer blocks of its
/// down and mid blocks split as [`UNet2DConditionModel`]'s (GEGLU's packed columns grouped per
/// device); the convolutions, the conditioning embedding and the zero convolutions stay
/// replicated.
impl<B: Backend> TensorParallel for ControlNetModel<B> {
    fn tensor_parallel_plan() -> TensorParallelPlan {
        TensorParallelPlan {
            model: "ControlNetModel",
            rules: &CONTROLNET_RULES,
        }
    }

    fn set_tensor_parallel_degree(&mut self, tp: usize) {
        let attentions = self
            .down_blocks
            .iter_mut()
            .flat_map(|b| b.attentions_mut().iter_mut())
            .chain(self.mid_block.attentions_mut().iter_mut());
        crate::unet_2d_condition::set_transformer_geglu_groups(attentions, tp);
    }

    fn sharded_widths(&self) -> Vec<ShardedWidth> {
        let mut widths = Vec::new();
        for (i, block) in self.down_blocks.iter().enumerate() {
            widths.extend(crate::unet_2d_condition::attention_widths(
                &format!("down_blocks.{i}"),
                block.attentions(),
            ));
        }
        widths.extend(crate::unet_2d_condition::attention_widths(
            "mid_block",
            self.mid_block.attentions(),
        ));
        widths
    }
}
