//! `SD3ControlNetModel`: a copy of the first blocks of an SD3 transformer that turns the VAE
//! latents of a conditioning image into residuals added to the transformer's blocks, as
//! diffusers' `models/controlnets/controlnet_sd3.py` (InstantX's SD3 ControlNets and those
//! `from_transformer` makes).
//!
//! Fields are named as the checkpoint keys (`pos_embed_input`, `controlnet_blocks.0`); the
//! embeddings and blocks are the transformer's ([`crate::transformer_sd3`]), every block a full
//! joint block (none `context_pre_only`).

use std::path::Path;

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor};
use serde::Deserialize;

use crate::config::{check_at_most, load_json, MAX_DIMENSION};
use crate::dtype::{cast_to, dtype_of};
use crate::embeddings::{CombinedTimestepTextProjEmbeddings, PatchEmbed};
use crate::error::{ModelError, Result};
use crate::nn::Linear;
use crate::transformer_sd3::{
    load_embedders, JointTransformerBlock, SD3Transformer2DConfig, SD3Transformer2DModel,
};
use crate::var_builder::{load_component, VarBuilder};

/// The fields of `controlnet/config.json` beyond the transformer's.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
struct ControlFields {
    extra_conditioning_channels: usize,
    force_zeros_for_pooled_projection: bool,
    use_pos_embed: bool,
    pos_embed_type: Option<String>,
    joint_attention_dim: Option<usize>,
}

impl Default for ControlFields {
    fn default() -> Self {
        Self {
            extra_conditioning_channels: 0,
            force_zeros_for_pooled_projection: true,
            use_pos_embed: true,
            pos_embed_type: Some("sincos".into()),
            joint_attention_dim: Some(4096),
        }
    }
}

/// `config.json` of an SD3 ControlNet: a transformer config (its `num_layers` blocks) plus the
/// conditioning fields.
#[derive(Debug, Clone)]
pub struct SD3ControlNetConfig {
    pub transformer: SD3Transformer2DConfig,
    /// Channels of the conditioning latents beyond the transformer's (inpainting ControlNets'
    /// mask); 0 for the others.
    pub extra_conditioning_channels: usize,
    /// The pipeline gives this ControlNet zero pooled projections and unshifted latents
    /// (InstantX's), instead of the prompt's pooled projections and the VAE's shift.
    pub force_zeros_for_pooled_projection: bool,
}

impl SD3ControlNetConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let transformer = SD3Transformer2DConfig::from_file(path)?;
        let fields: ControlFields = load_json(path)?;
        let unsupported = |reason: &str| ModelError::Unsupported {
            path: path.to_path_buf(),
            reason: reason.to_string(),
        };
        if !fields.use_pos_embed || fields.pos_embed_type.as_deref() != Some("sincos") {
            return Err(unsupported(
                "SD3 ControlNets without the sincos position embedding (`use_pos_embed: false` \
                 or `pos_embed_type`, SD3.5 Large's) are not implemented yet",
            ));
        }
        if fields.joint_attention_dim.is_none() {
            return Err(unsupported(
                "SD3 ControlNets of single-stream blocks (`joint_attention_dim: null`) are not \
                 implemented yet",
            ));
        }
        check_at_most(
            "extra_conditioning_channels",
            fields.extra_conditioning_channels,
            MAX_DIMENSION,
            path,
        )?;
        Ok(Self {
            transformer,
            extra_conditioning_channels: fields.extra_conditioning_channels,
            force_zeros_for_pooled_projection: fields.force_zeros_for_pooled_projection,
        })
    }
}

/// An SD3 ControlNet (diffusers' `SD3ControlNetModel`).
#[derive(Module, Debug)]
pub struct SD3ControlNetModel<B: Backend> {
    pub pos_embed: PatchEmbed<B>,
    pub time_text_embed: CombinedTimestepTextProjEmbeddings<B>,
    pub context_embedder: Linear<B>,
    pub transformer_blocks: Vec<JointTransformerBlock<B>>,
    /// One linear ("zero") layer per block, its residual.
    pub controlnet_blocks: Vec<Linear<B>>,
    /// The conditioning latents' patch embedding (no positions).
    pub pos_embed_input: PatchEmbed<B>,
    pub force_zeros_for_pooled_projection: bool,
    /// Latent channels of the conditioning input (the transformer's plus the extra ones).
    pub cond_channels: usize,
}

impl<B: Backend> SD3ControlNetModel<B> {
    /// Loads a ControlNet folder (`config.json` and `diffusion_pytorch_model.safetensors`).
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
        let config = SD3ControlNetConfig::from_file(&dir.join("config.json"))?;
        load_component(
            dir,
            &["diffusion_pytorch_model"],
            variant,
            dtype,
            device,
            |vb| Self::load(&config, vb),
        )
    }

    pub fn load(config: &SD3ControlNetConfig, vb: VarBuilder<B>) -> Result<Self> {
        let cfg = &config.transformer;
        let dim = cfg.inner_dim();
        let p = cfg.patch_size;
        let transformer_blocks = (0..cfg.num_layers)
            .map(|i| {
                JointTransformerBlock::load(
                    &vb.pp("transformer_blocks").pp(i),
                    cfg,
                    false,
                    cfg.dual_attention_layers.contains(&i),
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let controlnet_blocks = (0..cfg.num_layers)
            .map(|i| Linear::load(&vb.pp("controlnet_blocks").pp(i), dim, dim, true))
            .collect::<Result<Vec<_>>>()?;
        let cond_channels = cfg.in_channels + config.extra_conditioning_channels;
        let (pos_embed, time_text_embed, context_embedder) = load_embedders(cfg, &vb)?;
        Ok(Self {
            pos_embed,
            time_text_embed,
            context_embedder,
            transformer_blocks,
            controlnet_blocks,
            pos_embed_input: PatchEmbed::load_without_positions(
                &vb.pp("pos_embed_input"),
                cond_channels,
                dim,
                p,
            )?,
            force_zeros_for_pooled_projection: config.force_zeros_for_pooled_projection,
            cond_channels,
        })
    }

    /// Checks that this ControlNet fits `transformer` (width, latent channels, text widths,
    /// patch size, at most one residual per block), naming what differs.
    pub fn check_fits(&self, transformer: &SD3Transformer2DModel<B>) -> Result<()> {
        let ours = (
            self.context_embedder.weight.dims(),
            self.pos_embed.proj.weight.dims(),
            self.time_text_embed.text_embedder.linear_1.weight.dims()[0],
        );
        let theirs = (
            transformer.context_embedder.weight.dims(),
            transformer.pos_embed.proj.weight.dims(),
            transformer.pooled_projection_dim,
        );
        if ours != theirs || self.transformer_blocks.len() > transformer.transformer_blocks.len() {
            return Err(ModelError::Input(format!(
                "this ControlNet was made for another model: its context embedder, patch \
                 embedding and pooled width are {ours:?} with {} blocks, the transformer's \
                 {theirs:?} with {}; use an SD3 ControlNet trained for this transformer",
                self.transformer_blocks.len(),
                transformer.transformer_blocks.len()
            )));
        }
        Ok(())
    }

    /// The residuals (one `[batch, tokens, dim]` per block, times `scale`, a `[1]` tensor) for
    /// `latents` (`[batch, 16, h, w]`) at `timestep` with the text `encoder_hidden_states` and
    /// `pooled_projections`, and the conditioning latents `cond` (`[batch, cond_channels, h,
    /// w]`). Inputs as the transformer's `check_inputs` accepts them, `cond` as
    /// [`check_cond`](Self::check_cond) does.
    pub fn forward(
        &self,
        latents: Tensor<B, 4>,
        timestep: Tensor<B, 1>,
        encoder_hidden_states: Tensor<B, 3>,
        pooled_projections: Tensor<B, 2>,
        cond: Tensor<B, 4>,
        scale: Tensor<B, 1>,
    ) -> Vec<Tensor<B, 3>> {
        let caller = dtype_of(&latents);
        let dtype = dtype_of(&self.context_embedder.weight.val());
        let x = self.pos_embed.forward(cast_to(latents, dtype));
        let temb = self
            .time_text_embed
            .forward(timestep, cast_to(pooled_projections, dtype));
        let mut context = self
            .context_embedder
            .forward(cast_to(encoder_hidden_states, dtype));
        let mut x = x + self.pos_embed_input.forward(cast_to(cond, dtype));
        let scale = cast_to(scale, caller).reshape([1, 1, 1]);
        let mut residuals = Vec::with_capacity(self.controlnet_blocks.len());
        for (block, zero) in self.transformer_blocks.iter().zip(&self.controlnet_blocks) {
            let (next, out) = block.forward(x, context.clone(), temb.clone());
            // Every block of a ControlNet updates the context.
            context = next.unwrap_or(context);
            residuals.push(cast_to(zero.forward(out.clone()), caller) * scale.clone());
            x = out;
        }
        residuals
    }

    /// Checks the conditioning latents against the latents: same batch and size, this
    /// ControlNet's channels.
    pub fn check_cond(&self, latents: [usize; 4], cond: [usize; 4]) -> Result<()> {
        let [b, _, h, w] = latents;
        if cond != [b, self.cond_channels, h, w] {
            return Err(ModelError::Input(format!(
                "the control latents are {cond:?}; expected [{b}, {}, {h}, {w}] for latents \
                 {latents:?}",
                self.cond_channels
            )));
        }
        Ok(())
    }
}
