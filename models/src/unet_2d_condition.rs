//! `UNet2DConditionModel`: the denoiser of Stable Diffusion 1.x and 2.x.
//!
//! Read beside diffusers' `unet_2d_condition.py`: the fields are named as the checkpoint keys
//! (`down_blocks.0.resnets.0.conv1`); the blocks are in [`crate::unet_2d_blocks`].

use std::path::Path;

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor};

use crate::attention::{BasicTransformerBlock, Transformer2DModel};
use crate::dtype::{cast_to, dtype_of};
use crate::embeddings::{TimestepEmbedding, Timesteps};
use crate::error::Result;
use crate::nn::{Activation, Conv2d, ConvSpec, GroupNorm};
use crate::parallel::{block_widths, set_geglu_groups};
use crate::unet_2d_blocks::{
    CrossAttnUpBlock2D, DownBlock, MidBlock, UpBlock, UpBlock2D, UpBlockSpec,
};
pub use crate::unet_2d_condition_config::UNet2DConditionConfig;
pub use crate::unet_conditioning::{AddedCondition, ControlResiduals};
use crate::unet_layout::{
    check_added_condition, embed_added, embed_time, TimeEmbeddings, UNetLayout,
};
use crate::var_builder::{load_component, VarBuilder};
use oxidiff_parallel::{ShardRule, ShardedWidth, TensorParallel, TensorParallelPlan};

/// The conditional UNet of Stable Diffusion.
#[derive(Module, Debug)]
pub struct UNet2DConditionModel<B: Backend> {
    pub time_proj: Timesteps<B>,
    pub time_embedding: TimestepEmbedding<B>,
    /// SDXL (`text_time`): sinusoidal embedding of each `time_ids` entry.
    pub add_time_proj: Option<Timesteps<B>>,
    /// SDXL: `TimestepEmbedding` over `[text_embeds, time_ids embeddings]`, added to `temb`.
    pub add_embedding: Option<TimestepEmbedding<B>>,
    pub conv_in: Conv2d<B>,
    pub down_blocks: Vec<DownBlock<B>>,
    pub mid_block: Option<MidBlock<B>>,
    pub up_blocks: Vec<UpBlock<B>>,
    pub conv_norm_out: GroupNorm<B>,
    pub conv_out: Conv2d<B>,
    #[module(skip)]
    pub act: Activation,
    pub center_input_sample: bool,
}

impl<B: Backend> UNet2DConditionModel<B> {
    /// Loads `unet/config.json` and the weights of the `unet` folder.
    pub fn from_dir(dir: &Path, variant: Option<&str>, device: &B::Device) -> Result<Self> {
        Self::from_dir_in(dir, variant, FloatDType::F32, device)
    }

    /// The same, with the float weights held in `dtype`: read straight into it, so a checkpoint
    /// stored in it is used in place and any other is converted once, never through f32 (what
    /// the model computes at load, such as sinusoidal tables, is cast after).
    pub fn from_dir_in(
        dir: &Path,
        variant: Option<&str>,
        dtype: FloatDType,
        device: &B::Device,
    ) -> Result<Self> {
        let config = UNet2DConditionConfig::from_file(&dir.join("config.json"))?;
        load_component(
            dir,
            &["diffusion_pytorch_model"],
            variant,
            dtype,
            device,
            |vb| Self::load(&config, &dir.join("config.json"), vb),
        )
    }

    /// Builds the model from a parsed config; `config_path` is used in messages.
    pub fn load(
        cfg: &UNet2DConditionConfig,
        config_path: &Path,
        vb: VarBuilder<B>,
    ) -> Result<Self> {
        cfg.validate(config_path)?;
        let layout = UNetLayout::new(cfg, config_path)?;
        let n = layout.channels.len();
        let channels = &layout.channels;
        let TimeEmbeddings {
            time_proj,
            time_embedding,
            add_time_proj,
            add_embedding,
        } = layout.load_time_embeddings(cfg, &vb)?;
        let conv_in = Conv2d::load(
            &vb.pp("conv_in"),
            ConvSpec::same(cfg.in_channels, channels[0], cfg.conv_in_kernel),
        )?;
        let down_blocks = layout.load_down_blocks(cfg, &vb)?;
        let mid_block = layout.load_mid_block(cfg, &vb)?;

        let mut up_blocks = Vec::with_capacity(n);
        let reversed: Vec<usize> = channels.iter().rev().copied().collect();
        let mut c_out = reversed[0];
        for (i, kind) in cfg.up_block_types.iter().enumerate() {
            let rev = n - 1 - i;
            let vb_block = vb.pp("up_blocks").pp(i);
            let c_prev = c_out;
            c_out = reversed[i];
            let spec = UpBlockSpec {
                in_channels: reversed[(i + 1).min(n - 1)],
                prev_output_channel: c_prev,
                out_channels: c_out,
                num_layers: layout.layers[rev] + 1,
                add_upsample: i + 1 < n,
                resnet: layout.resnet,
            };
            up_blocks.push(if kind == "CrossAttnUpBlock2D" {
                UpBlock::CrossAttnUpBlock2D(CrossAttnUpBlock2D::load(
                    &vb_block,
                    spec,
                    layout.transformer(c_out, rev),
                )?)
            } else {
                UpBlock::UpBlock2D(UpBlock2D::load(&vb_block, spec)?)
            });
        }

        Ok(Self {
            time_proj,
            time_embedding,
            add_time_proj,
            add_embedding,
            conv_in,
            down_blocks,
            mid_block,
            up_blocks,
            conv_norm_out: GroupNorm::load(
                &vb.pp("conv_norm_out"),
                layout.groups,
                channels[0],
                cfg.norm_eps,
            )?,
            conv_out: Conv2d::load(
                &vb.pp("conv_out"),
                ConvSpec::same(channels[0], cfg.out_channels, cfg.conv_out_kernel),
            )?,
            act: layout.act,
            center_input_sample: cfg.center_input_sample,
        })
    }

    /// The transformer blocks in diffusers' `attn_processors` order: the down blocks, the up
    /// blocks, then the mid block (diffusers registers them so); each block's `attn2` is one
    /// IP-Adapter processor.
    pub fn transformer_blocks_mut(&mut self) -> Vec<&mut BasicTransformerBlock<B>> {
        let down = self.down_blocks.iter_mut().map(|b| b.attentions_mut());
        let up = self.up_blocks.iter_mut().map(|b| b.attentions_mut());
        let mid = self.mid_block.iter_mut().map(|b| b.attentions_mut());
        down.chain(up)
            .chain(mid)
            .flat_map(|attentions| attentions.iter_mut())
            .flat_map(|attention| attention.transformer_blocks.iter_mut())
            .collect()
    }

    /// How many image tokens an attached IP-Adapter takes at the end of the context (0
    /// without one): the rows a ControlNet, which attends to the text alone, leaves out.
    pub fn ip_adapter_tokens(&self) -> usize {
        let down = self.down_blocks.iter().map(|b| b.attentions());
        let up = self.up_blocks.iter().map(|b| b.attentions());
        let mid = self.mid_block.iter().map(|b| b.attentions());
        down.chain(up)
            .chain(mid)
            .flatten()
            .flat_map(|attention| &attention.transformer_blocks)
            .find_map(|block| block.ip_adapter.as_ref().map(|ip| ip.num_tokens))
            .unwrap_or(0)
    }

    /// Whether the UNet needs [`AddedCondition`] (SDXL's `text_time`).
    pub fn needs_added_condition(&self) -> bool {
        self.add_embedding.is_some()
    }

    /// Predicts noise (or v, or the sample) for latents `[batch, c, h, w]` at `timestep`
    /// (`[batch]` or `[1]`), conditioned on `encoder_hidden_states` `[batch, seq, dim]`.
    /// For UNets without an addition embedding (SD 1.x/2.x); an SDXL UNet called this way
    /// skips its `add_embedding` (use [`forward_with_condition`](Self::forward_with_condition)).
    pub fn forward(
        &self,
        sample: Tensor<B, 4>,
        timestep: Tensor<B, 1>,
        encoder_hidden_states: Tensor<B, 3>,
    ) -> Tensor<B, 4> {
        self.forward_inner(sample, timestep, encoder_hidden_states, None, None)
    }

    /// Checks SDXL's added condition against this UNet and a latents batch, from shapes
    /// alone (so a compiled step can check before tracing): required by `text_time` UNets,
    /// refused by others, as diffusers does.
    pub fn check_added_condition(
        &self,
        batch: usize,
        added: Option<&AddedCondition<B>>,
    ) -> Result<()> {
        check_added_condition(
            self.add_time_proj.as_ref(),
            self.add_embedding.as_ref(),
            batch,
            added,
        )
    }

    /// [`forward`](Self::forward) with SDXL's added conditioning, which an SDXL UNet requires
    /// and other UNets refuse (see [`check_added_condition`](Self::check_added_condition)).
    pub fn forward_with_condition(
        &self,
        sample: Tensor<B, 4>,
        timestep: Tensor<B, 1>,
        encoder_hidden_states: Tensor<B, 3>,
        added: Option<&AddedCondition<B>>,
    ) -> Result<Tensor<B, 4>> {
        self.forward_controlled(sample, timestep, encoder_hidden_states, added, None)
    }

    /// [`forward_with_condition`](Self::forward_with_condition) with a ControlNet's residuals
    /// added to the skip connections and to the mid block's output (diffusers'
    /// `down_block_additional_residuals` / `mid_block_additional_residual`); they must have
    /// the shapes of this UNet's ([`ControlResiduals`]).
    pub fn forward_controlled(
        &self,
        sample: Tensor<B, 4>,
        timestep: Tensor<B, 1>,
        encoder_hidden_states: Tensor<B, 3>,
        added: Option<&AddedCondition<B>>,
        control: Option<&ControlResiduals<B>>,
    ) -> Result<Tensor<B, 4>> {
        self.check_added_condition(sample.dims()[0], added)?;
        Ok(
            self.forward_controlled_checked(
                sample,
                timestep,
                encoder_hidden_states,
                added,
                control,
            ),
        )
    }

    /// [`forward_controlled`](Self::forward_controlled) for an added condition already passed
    /// through [`check_added_condition`](Self::check_added_condition) (a compiled step cannot
    /// return errors).
    pub fn forward_controlled_checked(
        &self,
        sample: Tensor<B, 4>,
        timestep: Tensor<B, 1>,
        encoder_hidden_states: Tensor<B, 3>,
        added: Option<&AddedCondition<B>>,
        control: Option<&ControlResiduals<B>>,
    ) -> Tensor<B, 4> {
        let dtype = dtype_of(&self.conv_in.weight.val());
        let aug = embed_added(
            self.add_time_proj.as_ref(),
            self.add_embedding.as_ref(),
            added,
            dtype,
        );
        self.forward_inner(sample, timestep, encoder_hidden_states, aug, control)
    }

    /// The channels of each skip connection, in order (what a ControlNet's residuals must
    /// match).
    pub fn skip_channels(&self) -> Vec<usize> {
        let mut skips = vec![self.conv_in.weight.dims()[0]];
        for block in &self.down_blocks {
            for resnet in block.resnets() {
                skips.push(resnet.conv2.weight.dims()[0]);
            }
            for down in block.downsamplers() {
                skips.push(down.conv.weight.dims()[0]);
            }
        }
        skips
    }

    fn forward_inner(
        &self,
        sample: Tensor<B, 4>,
        timestep: Tensor<B, 1>,
        encoder_hidden_states: Tensor<B, 3>,
        aug: Option<Tensor<B, 2>>,
        control: Option<&ControlResiduals<B>>,
    ) -> Tensor<B, 4> {
        // Computed in the weights' dtype, returned in the caller's (see `crate::dtype`).
        let (caller, dtype) = (dtype_of(&sample), dtype_of(&self.conv_in.weight.val()));
        let sample = cast_to(sample, dtype);
        let timestep = cast_to(timestep, dtype);
        let encoder_hidden_states = cast_to(encoder_hidden_states, dtype);
        let batch = sample.dims()[0];
        let temb = embed_time(&self.time_proj, &self.time_embedding, timestep, batch);
        let temb = match aug {
            Some(aug) => temb + aug,
            None => temb,
        };
        let ctx = encoder_hidden_states;

        let sample = if self.center_input_sample {
            sample.mul_scalar(2.0).sub_scalar(1.0)
        } else {
            sample
        };
        let mut x = self.conv_in.forward(sample);
        let mut skips = vec![x.clone()];
        for block in &self.down_blocks {
            let (out, states) = block.forward(x, &temb, &ctx);
            x = out;
            skips.extend(states);
        }
        if let Some(control) = control {
            for (skip, residual) in skips.iter_mut().zip(&control.down) {
                *skip = skip.clone() + cast_to(residual.clone(), dtype);
            }
        }
        if let Some(mid) = &self.mid_block {
            x = mid.forward(x, &temb, &ctx);
        }
        if let Some(control) = control {
            x = x + cast_to(control.mid.clone(), dtype);
        }
        for block in &self.up_blocks {
            // `skips` holds exactly one entry per up-block resnet, by construction.
            let own = skips.split_off(skips.len().saturating_sub(block.resnets().len()));
            let size = skips.last().map(|s| {
                let d = s.dims();
                [d[2], d[3]]
            });
            x = block.forward(x, own, &temb, &ctx, size);
        }
        let x = self.conv_norm_out.forward_then(x, self.act);
        cast_to(self.conv_out.forward(x), caller)
    }
}

/// The tensor-parallel rules of the transformer blocks at each `$block` path (with `*`
/// segments): attention q/k/v and the first feed-forward projection column-wise, the attention
/// output and the second projection row-wise (Megatron's split: one all-reduce after each
/// attention and each feed-forward).
macro_rules! transformer_block_rules {
    ($($block:literal),+) => {
        [$(
            ShardRule::column(concat!($block, ".attn1.to_q")),
            ShardRule::column(concat!($block, ".attn1.to_k")),
            ShardRule::column(concat!($block, ".attn1.to_v")),
            ShardRule::row(concat!($block, ".attn1.to_out.0")),
            ShardRule::column(concat!($block, ".attn2.to_q")),
            ShardRule::column(concat!($block, ".attn2.to_k")),
            ShardRule::column(concat!($block, ".attn2.to_v")),
            ShardRule::row(concat!($block, ".attn2.to_out.0")),
            ShardRule::column(concat!($block, ".ff.net.0.proj")),
            ShardRule::row(concat!($block, ".ff.net.2")),
        )+]
    };
}
pub(crate) use transformer_block_rules;

const UNET_RULES: [ShardRule; 30] = transformer_block_rules!(
    "down_blocks.*.attentions.*.transformer_blocks.*",
    "mid_block.attentions.*.transformer_blocks.*",
    "up_blocks.*.attentions.*.transformer_blocks.*"
);

/// The UNet's plan: the transformer blocks of every cross-attention down, mid and up block.
/// The ResNets, convolutions, norms and the time embedding stay replicated. GEGLU's
/// `ff.net.0.proj` packs value and gate side by side; a contiguous column split would put the
/// values and the gates on different devices (and XLA would move half the projection between
/// them). So its columns are placed shard-aligned instead: device `t` gets value slice `t`
/// with gate slice `t` ([`crate::ShardedParam::packed`]), and the forward pass reads them in
/// that order ([`set_tensor_parallel_degree`](TensorParallel::set_tensor_parallel_degree)).
impl<B: Backend> TensorParallel for UNet2DConditionModel<B> {
    fn tensor_parallel_plan() -> TensorParallelPlan {
        TensorParallelPlan {
            model: "UNet2DConditionModel",
            rules: &UNET_RULES,
        }
    }

    fn set_tensor_parallel_degree(&mut self, tp: usize) {
        let attentions = self
            .down_blocks
            .iter_mut()
            .flat_map(|b| b.attentions_mut().iter_mut())
            .chain(
                self.mid_block
                    .iter_mut()
                    .flat_map(|m| m.attentions_mut().iter_mut()),
            )
            .chain(
                self.up_blocks
                    .iter_mut()
                    .flat_map(|b| b.attentions_mut().iter_mut()),
            );
        set_transformer_geglu_groups(attentions, tp);
    }

    fn sharded_widths(&self) -> Vec<ShardedWidth> {
        let mut widths = Vec::new();
        for (i, block) in self.down_blocks.iter().enumerate() {
            widths.extend(attention_widths(
                &format!("down_blocks.{i}"),
                block.attentions(),
            ));
        }
        if let Some(mid) = &self.mid_block {
            widths.extend(attention_widths("mid_block", mid.attentions()));
        }
        for (i, block) in self.up_blocks.iter().enumerate() {
            widths.extend(attention_widths(
                &format!("up_blocks.{i}"),
                block.attentions(),
            ));
        }
        widths
    }
}

/// Groups the GEGLU columns of every feed-forward in `attentions` for `tp` devices
/// ([`set_geglu_groups`]).
pub(crate) fn set_transformer_geglu_groups<'a, B: Backend + 'a>(
    attentions: impl Iterator<Item = &'a mut Transformer2DModel<B>>,
    tp: usize,
) {
    let mut feed_forwards: Vec<_> = attentions
        .flat_map(|t| t.transformer_blocks.iter_mut().map(|block| &mut block.ff))
        .collect();
    set_geglu_groups(&mut feed_forwards, tp);
}

/// The widths of the sharded layers of a block's transformers (`{prefix}.attentions.{a}`).
pub(crate) fn attention_widths<B: Backend>(
    prefix: &str,
    attentions: &[Transformer2DModel<B>],
) -> Vec<ShardedWidth> {
    let mut widths = Vec::new();
    for (a, transformer) in attentions.iter().enumerate() {
        for (t, block) in transformer.transformer_blocks.iter().enumerate() {
            widths.extend(block_widths(
                &format!("{prefix}.attentions.{a}.transformer_blocks.{t}"),
                &[("attn1", &block.attn1), ("attn2", &block.attn2)],
                &block.ff,
            ));
        }
    }
    widths
}
