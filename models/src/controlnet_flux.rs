//! `FluxControlNetModel`: a copy of the first double and single blocks of a Flux transformer
//! that turns the packed VAE latents of a conditioning image into samples added to the
//! transformer's image tokens, as diffusers' `models/controlnets/controlnet_flux.py` in
//! InstantX's layout (the latents through `controlnet_x_embedder`).
//!
//! Fields are named as the checkpoint keys (`controlnet_blocks.0`,
//! `controlnet_single_blocks.0`, `controlnet_x_embedder`); the embeddings and blocks are the
//! transformer's ([`crate::transformer_flux`]). XLabs' ControlNets (a conditioning embedding
//! on the image, `conditioning_embedding_channels`) and the Union ControlNets (`num_mode`) are
//! refused when loading, naming the field.

use std::path::Path;

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor};
use serde::Deserialize;

use crate::config::load_json;
use crate::dtype::{cast_to, dtype_of};
use crate::embeddings::RotaryEmbedding;
use crate::error::{ModelError, Result};
use crate::nn::Linear;
use crate::transformer_flux::{
    FluxControlSamples, FluxSingleTransformerBlock, FluxTimeTextEmbed, FluxTransformer2DConfig,
    FluxTransformer2DModel, FluxTransformerBlock,
};
use crate::var_builder::{load_component, VarBuilder};

/// The fields of a Flux ControlNet's `config.json` beyond the transformer's.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct ControlFields {
    num_mode: Option<usize>,
    conditioning_embedding_channels: Option<usize>,
}

/// A Flux ControlNet (diffusers' `FluxControlNetModel`, InstantX's layout).
#[derive(Module, Debug)]
pub struct FluxControlNetModel<B: Backend> {
    pub time_text_embed: FluxTimeTextEmbed<B>,
    pub context_embedder: Linear<B>,
    pub x_embedder: Linear<B>,
    pub transformer_blocks: Vec<FluxTransformerBlock<B>>,
    pub single_transformer_blocks: Vec<FluxSingleTransformerBlock<B>>,
    pub controlnet_blocks: Vec<Linear<B>>,
    pub controlnet_single_blocks: Vec<Linear<B>>,
    /// The packed conditioning latents' embedding.
    pub controlnet_x_embedder: Linear<B>,
    pub guidance_embeds: bool,
}

impl<B: Backend> FluxControlNetModel<B> {
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
        let path = dir.join("config.json");
        let config = FluxTransformer2DConfig::from_file(&path)?;
        let fields: ControlFields = load_json(&path)?;
        let unsupported = |reason: &str| ModelError::Unsupported {
            path: path.clone(),
            reason: reason.to_string(),
        };
        if fields.num_mode.is_some() {
            return Err(unsupported(
                "Flux ControlNet-Union (`num_mode`, a control mode per image) is not \
                 implemented yet",
            ));
        }
        if fields.conditioning_embedding_channels.is_some() {
            return Err(unsupported(
                "XLabs-style Flux ControlNets (`conditioning_embedding_channels`: the image \
                 through a conditioning embedding, samples repeated over the blocks) are not \
                 implemented yet",
            ));
        }
        load_component(
            dir,
            &["diffusion_pytorch_model"],
            variant,
            dtype,
            device,
            |vb| Self::load(&config, vb),
        )
    }

    pub fn load(cfg: &FluxTransformer2DConfig, vb: VarBuilder<B>) -> Result<Self> {
        let dim = cfg.inner_dim();
        let linears = |name: &str, n: usize| {
            (0..n)
                .map(|i| Linear::load(&vb.pp(name).pp(i), dim, dim, true))
                .collect::<Result<Vec<_>>>()
        };
        Ok(Self {
            time_text_embed: FluxTimeTextEmbed::load(&vb.pp("time_text_embed"), cfg)?,
            context_embedder: Linear::load(
                &vb.pp("context_embedder"),
                cfg.joint_attention_dim,
                dim,
                true,
            )?,
            x_embedder: Linear::load(&vb.pp("x_embedder"), cfg.in_channels, dim, true)?,
            transformer_blocks: (0..cfg.num_layers)
                .map(|i| FluxTransformerBlock::load(&vb.pp("transformer_blocks").pp(i), cfg))
                .collect::<Result<Vec<_>>>()?,
            single_transformer_blocks: (0..cfg.num_single_layers)
                .map(|i| {
                    FluxSingleTransformerBlock::load(&vb.pp("single_transformer_blocks").pp(i), cfg)
                })
                .collect::<Result<Vec<_>>>()?,
            controlnet_blocks: linears("controlnet_blocks", cfg.num_layers)?,
            controlnet_single_blocks: linears("controlnet_single_blocks", cfg.num_single_layers)?,
            controlnet_x_embedder: Linear::load(
                &vb.pp("controlnet_x_embedder"),
                cfg.in_channels,
                dim,
                true,
            )?,
            guidance_embeds: cfg.guidance_embeds,
        })
    }

    /// Checks that this ControlNet fits `transformer` (width, latent channels, text widths,
    /// at most as many blocks of each kind), naming what differs.
    pub fn check_fits(&self, transformer: &FluxTransformer2DModel<B>) -> Result<()> {
        let ours = (
            self.x_embedder.weight.dims(),
            self.context_embedder.weight.dims(),
        );
        let theirs = (
            transformer.x_embedder.weight.dims(),
            transformer.context_embedder.weight.dims(),
        );
        let (blocks, singles) = (
            self.transformer_blocks.len(),
            self.single_transformer_blocks.len(),
        );
        if ours != theirs
            || blocks > transformer.transformer_blocks.len()
            || singles > transformer.single_transformer_blocks.len()
        {
            return Err(ModelError::Input(format!(
                "this ControlNet was made for another model: its embedders are {ours:?} with \
                 {blocks} double and {singles} single blocks, the transformer's {theirs:?} with \
                 {} and {}; use a Flux ControlNet trained for this transformer",
                transformer.transformer_blocks.len(),
                transformer.single_transformer_blocks.len()
            )));
        }
        Ok(())
    }

    /// The samples (each `[batch, image tokens, dim]`, times `scale`, a `[1]` tensor) for the
    /// packed latents `hidden_states` and packed conditioning latents `cond` (both `[batch,
    /// image tokens, in_channels]`), with the transformer's other inputs as it takes them
    /// (`timestep` in the pipeline's `t / 1000` scale, `guidance` for guidance-embedding
    /// ControlNets). Inputs as the transformer's `check_inputs` accepts them, `cond` the
    /// latents' shape.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        hidden_states: Tensor<B, 3>,
        cond: Tensor<B, 3>,
        encoder_hidden_states: Tensor<B, 3>,
        pooled_projections: Tensor<B, 2>,
        timestep: Tensor<B, 1>,
        guidance: Option<Tensor<B, 1>>,
        rope: &RotaryEmbedding<B>,
        scale: Tensor<B, 1>,
    ) -> FluxControlSamples<B> {
        let caller = dtype_of(&hidden_states);
        let dtype = dtype_of(&self.x_embedder.weight.val());
        let image = self.x_embedder.forward(cast_to(hidden_states, dtype))
            + self.controlnet_x_embedder.forward(cast_to(cond, dtype));
        let timestep = cast_to(timestep, dtype).mul_scalar(1000.0);
        let guidance = guidance
            .filter(|_| self.guidance_embeds)
            .map(|g| cast_to(g, dtype).mul_scalar(1000.0));
        let temb =
            self.time_text_embed
                .forward(timestep, guidance, cast_to(pooled_projections, dtype));
        let mut text = self
            .context_embedder
            .forward(cast_to(encoder_hidden_states, dtype));
        let scale = cast_to(scale, caller).reshape([1, 1, 1]);
        let out =
            |zero: &Linear<B>, x: Tensor<B, 3>| cast_to(zero.forward(x), caller) * scale.clone();
        let mut image = image;
        let mut blocks = Vec::with_capacity(self.controlnet_blocks.len());
        for (block, zero) in self.transformer_blocks.iter().zip(&self.controlnet_blocks) {
            (text, image) = block.forward(image, text, temb.clone(), rope);
            blocks.push(out(zero, image.clone()));
        }
        let (text_len, image_len) = (text.dims()[1], image.dims()[1]);
        let mut joined = Tensor::cat(vec![text, image], 1);
        let mut single_blocks = Vec::with_capacity(self.controlnet_single_blocks.len());
        for (block, zero) in self
            .single_transformer_blocks
            .iter()
            .zip(&self.controlnet_single_blocks)
        {
            joined = block.forward(joined, temb.clone(), rope);
            single_blocks.push(out(zero, joined.clone().narrow(1, text_len, image_len)));
        }
        FluxControlSamples {
            blocks,
            single_blocks,
        }
    }
}
