//! What `UNet2DConditionModel` and `ControlNetModel` build alike from a UNet config: the
//! per-block settings, the time embeddings (with SDXL's added embedding), the down blocks and
//! the mid block, and the time-embedding half of the forward pass. diffusers writes these twice
//! (`unet_2d_condition.py`, `controlnet.py`); here they are written once.

use std::path::Path;

use burn::tensor::backend::Backend;
use burn::tensor::FloatDType;
use burn::tensor::Tensor;

use crate::attention::Transformer2DSpec;
use crate::dtype::cast_to;
use crate::embeddings::{TimestepEmbedding, Timesteps};
use crate::error::{ModelError, Result};
use crate::nn::Activation;
use crate::unet_2d_blocks::{
    CrossAttnDownBlock2D, DownBlock, DownBlock2D, DownBlockSpec, MidBlock, ResnetSettings,
    UNetMidBlock2D, UNetMidBlock2DCrossAttn,
};
use crate::unet_2d_condition_config::UNet2DConditionConfig;
use crate::unet_conditioning::AddedCondition;
use crate::var_builder::VarBuilder;

/// The per-block settings of a (validated) UNet config, expanded to one entry per block.
pub(crate) struct UNetLayout {
    pub channels: Vec<usize>,
    pub heads: Vec<usize>,
    pub layers: Vec<usize>,
    pub context_dims: Vec<usize>,
    pub transformer_layers: Vec<usize>,
    pub only_cross: Vec<bool>,
    pub resnet: ResnetSettings,
    pub act: Activation,
    pub temb_dim: usize,
    pub groups: usize,
    pub use_linear_projection: bool,
}

impl UNetLayout {
    pub fn new(cfg: &UNet2DConditionConfig, config_path: &Path) -> Result<Self> {
        let n = cfg.block_out_channels.len();
        let channels = cfg.block_out_channels.clone();
        let act = Activation::from_name(&cfg.act_fn).unwrap_or(Activation::Silu);
        let temb_dim = channels[0] * 4;
        Ok(Self {
            heads: cfg.heads(config_path)?,
            layers: cfg
                .layers_per_block
                .expand(n, "layers_per_block", config_path)?,
            context_dims: cfg
                .cross_attention_dim
                .expand(n, "cross_attention_dim", config_path)?,
            transformer_layers: cfg.transformer_layers_per_block.expand(
                n,
                "transformer_layers_per_block",
                config_path,
            )?,
            only_cross: cfg
                .only_cross_attention
                .expand(n, "only_cross_attention", config_path)?,
            resnet: ResnetSettings {
                temb_channels: temb_dim,
                groups: cfg.norm_num_groups,
                eps: cfg.norm_eps,
                act,
            },
            act,
            temb_dim,
            groups: cfg.norm_num_groups,
            use_linear_projection: cfg.use_linear_projection,
            channels,
        })
    }

    /// The transformer of block `i` at `channels` channels.
    pub fn transformer(&self, channels: usize, i: usize) -> Transformer2DSpec {
        Transformer2DSpec {
            channels,
            heads: self.heads[i],
            context_dim: self.context_dims[i],
            layers: self.transformer_layers[i],
            norm_num_groups: self.groups,
            use_linear_projection: self.use_linear_projection,
            only_cross_attention: self.only_cross[i],
        }
    }

    /// `time_proj`, `time_embedding` and, for `addition_embed_type: text_time` (SDXL),
    /// `add_time_proj` and `add_embedding`.
    pub fn load_time_embeddings<B: Backend>(
        &self,
        cfg: &UNet2DConditionConfig,
        vb: &VarBuilder<B>,
    ) -> Result<TimeEmbeddings<B>> {
        let device = vb.device().clone();
        let c0 = self.channels[0];
        let time_proj = Timesteps::new(c0, cfg.flip_sin_to_cos, cfg.freq_shift, &device);
        let time_embedding =
            TimestepEmbedding::load(&vb.pp("time_embedding"), c0, self.temb_dim, self.act)?;
        let (add_time_proj, add_embedding) = match (
            cfg.addition_embed_type.as_deref(),
            cfg.addition_time_embed_dim,
            cfg.projection_class_embeddings_input_dim,
        ) {
            (Some("text_time"), Some(dim), Some(c_in)) => (
                Some(Timesteps::new(
                    dim,
                    cfg.flip_sin_to_cos,
                    cfg.freq_shift,
                    &device,
                )),
                // diffusers builds it with TimestepEmbedding's default activation, not `act_fn`.
                Some(TimestepEmbedding::load(
                    &vb.pp("add_embedding"),
                    c_in,
                    self.temb_dim,
                    Activation::Silu,
                )?),
            ),
            _ => (None, None),
        };
        Ok(TimeEmbeddings {
            time_proj,
            time_embedding,
            add_time_proj,
            add_embedding,
        })
    }

    /// `down_blocks.*`.
    pub fn load_down_blocks<B: Backend>(
        &self,
        cfg: &UNet2DConditionConfig,
        vb: &VarBuilder<B>,
    ) -> Result<Vec<DownBlock<B>>> {
        let n = self.channels.len();
        let mut down_blocks = Vec::with_capacity(n);
        let mut c_out = self.channels[0];
        for (i, kind) in cfg.down_block_types.iter().enumerate() {
            let vb_block = vb.pp("down_blocks").pp(i);
            let c_in = c_out;
            c_out = self.channels[i];
            let spec = DownBlockSpec {
                in_channels: c_in,
                out_channels: c_out,
                num_layers: self.layers[i],
                add_downsample: i + 1 < n,
                downsample_padding: cfg.downsample_padding,
                resnet: self.resnet,
            };
            down_blocks.push(if kind == "CrossAttnDownBlock2D" {
                DownBlock::CrossAttnDownBlock2D(CrossAttnDownBlock2D::load(
                    &vb_block,
                    spec,
                    self.transformer(c_out, i),
                )?)
            } else {
                DownBlock::DownBlock2D(DownBlock2D::load(&vb_block, spec)?)
            });
        }
        Ok(down_blocks)
    }

    /// `mid_block`, if the config has one.
    pub fn load_mid_block<B: Backend>(
        &self,
        cfg: &UNet2DConditionConfig,
        vb: &VarBuilder<B>,
    ) -> Result<Option<MidBlock<B>>> {
        let n = self.channels.len();
        let c_mid = self.channels[n - 1];
        let vb_mid = vb.pp("mid_block");
        Ok(match cfg.mid_block_type.as_deref() {
            None => None,
            Some("UNetMidBlock2DCrossAttn") => Some(MidBlock::UNetMidBlock2DCrossAttn(
                UNetMidBlock2DCrossAttn::load(
                    &vb_mid,
                    c_mid,
                    self.resnet,
                    self.transformer(c_mid, n - 1),
                )?,
            )),
            Some(_) => Some(MidBlock::UNetMidBlock2D(UNetMidBlock2D::load(
                &vb_mid,
                c_mid,
                self.resnet,
            )?)),
        })
    }
}

/// The time embeddings a UNet-shaped model loads (fields of the model itself, so their keys
/// stay the checkpoint's).
pub(crate) struct TimeEmbeddings<B: Backend> {
    pub time_proj: Timesteps<B>,
    pub time_embedding: TimestepEmbedding<B>,
    pub add_time_proj: Option<Timesteps<B>>,
    pub add_embedding: Option<TimestepEmbedding<B>>,
}

/// `temb` for `timestep` (`[batch]` or `[1]`, in the weights' dtype) over a batch of `batch`.
pub(crate) fn embed_time<B: Backend>(
    time_proj: &Timesteps<B>,
    time_embedding: &TimestepEmbedding<B>,
    timestep: Tensor<B, 1>,
    batch: usize,
) -> Tensor<B, 2> {
    let timestep = if timestep.dims()[0] == batch {
        timestep
    } else {
        timestep.repeat_dim(0, batch)
    };
    time_embedding.forward(time_proj.forward(timestep))
}

/// Checks SDXL's added condition against a model's addition embedding and a latents batch,
/// from shapes alone: required by `text_time` models, refused by others, as diffusers does.
pub(crate) fn check_added_condition<B: Backend>(
    add_time_proj: Option<&Timesteps<B>>,
    add_embedding: Option<&TimestepEmbedding<B>>,
    batch: usize,
    added: Option<&AddedCondition<B>>,
) -> Result<()> {
    match (add_time_proj, add_embedding, added) {
        (Some(proj), Some(embedding), Some(cond)) => {
            let [b, n] = cond.time_ids.dims();
            let [tb, tw] = cond.text_embeds.dims();
            if b != batch || tb != batch {
                return Err(ModelError::Input(format!(
                    "added condition for batch {b} (text_embeds {:?}), latents batch {batch}",
                    cond.text_embeds.dims()
                )));
            }
            let width = tw + n * proj.freqs.dims()[1] * 2;
            let want = embedding.linear_1.weight.dims()[0];
            if width != want {
                return Err(ModelError::Input(format!(
                    "the added condition is {width} wide ({tw} text_embeds + {n} time ids), \
                     `add_embedding` expects {want} (`projection_class_embeddings_input_dim`)"
                )));
            }
            Ok(())
        }
        (Some(_), _, None) => Err(ModelError::Input(
            "this UNet has `addition_embed_type: text_time` (SDXL) and needs \
             `text_embeds` and `time_ids`"
                .into(),
        )),
        (None, _, Some(_)) => Err(ModelError::Input(
            "this UNet has no addition embedding; `text_embeds`/`time_ids` are for SDXL UNets"
                .into(),
        )),
        _ => Ok(()),
    }
}

/// SDXL's added embedding of `added` (checked by [`check_added_condition`]), in `dtype`;
/// `None` for models without one.
pub(crate) fn embed_added<B: Backend>(
    add_time_proj: Option<&Timesteps<B>>,
    add_embedding: Option<&TimestepEmbedding<B>>,
    added: Option<&AddedCondition<B>>,
    dtype: FloatDType,
) -> Option<Tensor<B, 2>> {
    match (add_time_proj, add_embedding, added) {
        (Some(proj), Some(embedding), Some(cond)) => {
            let [b, n] = cond.time_ids.dims();
            let time_embeds = proj
                .forward(cast_to(cond.time_ids.clone(), dtype).reshape([b * n]))
                .reshape([b as i32, -1]);
            let text_embeds = cast_to(cond.text_embeds.clone(), dtype);
            let input = Tensor::cat(vec![text_embeds, time_embeds], 1);
            Some(embedding.forward(input))
        }
        _ => None,
    }
}
