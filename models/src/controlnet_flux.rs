//! `FluxControlNetModel`: a copy of the first double and single blocks of a Flux transformer
//! that turns a conditioning image into samples added to the transformer's image tokens, as
//! diffusers' `models/controlnets/controlnet_flux.py`, in its three layouts: InstantX's (the
//! packed VAE latents of the image through `controlnet_x_embedder`), InstantX's ControlNet-Union
//! (`num_mode`: a control mode's embedding, `controlnet_mode_embedder`, prepended to the text
//! tokens) and XLabs' (`conditioning_embedding_channels`: the pixel image through
//! `input_hint_block`, patchified like the latents; the transformer repeats its samples).
//!
//! Fields are named as the checkpoint keys (`controlnet_blocks.0`,
//! `controlnet_single_blocks.0`, `controlnet_x_embedder`); the embeddings and blocks are the
//! transformer's ([`crate::transformer_flux`]), the conditioning embedding the UNet
//! ControlNet's ([`crate::controlnet::ControlNetConditioningEmbedding`]).

use std::path::Path;

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Int, Tensor};
use serde::Deserialize;

use crate::config::load_json;
use crate::controlnet::ControlNetConditioningEmbedding;
use crate::dtype::{cast_to, dtype_of};
use crate::embeddings::RotaryEmbedding;
use crate::error::{ModelError, Result};
use crate::nn::{Embedding, Linear};
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

/// The widths of XLabs' conditioning embedding (diffusers fixes them; the image comes out 8
/// times smaller).
const HINT_CHANNELS: [usize; 4] = [16, 16, 16, 16];

/// A Flux ControlNet (diffusers' `FluxControlNetModel`).
#[derive(Module, Debug)]
pub struct FluxControlNetModel<B: Backend> {
    pub time_text_embed: FluxTimeTextEmbed<B>,
    pub context_embedder: Linear<B>,
    pub x_embedder: Linear<B>,
    pub transformer_blocks: Vec<FluxTransformerBlock<B>>,
    pub single_transformer_blocks: Vec<FluxSingleTransformerBlock<B>>,
    pub controlnet_blocks: Vec<Linear<B>>,
    pub controlnet_single_blocks: Vec<Linear<B>>,
    /// The packed conditioning latents' (or patchified conditioning embedding's) embedding.
    pub controlnet_x_embedder: Linear<B>,
    /// ControlNet-Union: one embedding per control mode (`num_mode` of them).
    pub controlnet_mode_embedder: Option<Embedding<B>>,
    /// XLabs: the pixel image's conditioning embedding (`conditioning_embedding_channels`).
    pub input_hint_block: Option<ControlNetConditioningEmbedding<B>>,
    /// The patch size of the conditioning embedding (config `patch_size`).
    pub patch_size: usize,
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
        let config = FluxTransformer2DConfig::from_file_any_patch(&path)?;
        let fields: ControlFields = load_json(&path)?;
        let bad = |reason: String| ModelError::Config {
            path: path.clone(),
            reason,
        };
        if fields.num_mode == Some(0) {
            return Err(bad("`num_mode` must be at least 1".into()));
        }
        if let Some(channels) = fields.conditioning_embedding_channels {
            let p = config.patch_size;
            if p == 0 || channels * p * p != config.in_channels {
                return Err(bad(format!(
                    "`conditioning_embedding_channels` {channels} times `patch_size` {p} squared \
                     must equal `in_channels` {} (the patchified embedding goes through \
                     `controlnet_x_embedder`)",
                    config.in_channels
                )));
            }
        }
        load_component(
            dir,
            &["diffusion_pytorch_model"],
            variant,
            dtype,
            device,
            |vb| Self::load(&config, &fields, vb),
        )
    }

    fn load(
        cfg: &FluxTransformer2DConfig,
        fields: &ControlFields,
        vb: VarBuilder<B>,
    ) -> Result<Self> {
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
            controlnet_mode_embedder: fields
                .num_mode
                .map(|n| Embedding::load(&vb.pp("controlnet_mode_embedder"), n, dim))
                .transpose()?,
            input_hint_block: fields
                .conditioning_embedding_channels
                .map(|c| {
                    ControlNetConditioningEmbedding::load_with(
                        &vb.pp("input_hint_block"),
                        3,
                        &HINT_CHANNELS,
                        c,
                    )
                })
                .transpose()?,
            patch_size: cfg.patch_size,
            guidance_embeds: cfg.guidance_embeds,
        })
    }

    /// How many control modes a ControlNet-Union has (`None` for other ControlNets).
    pub fn num_mode(&self) -> Option<usize> {
        self.controlnet_mode_embedder
            .as_ref()
            .map(|e| e.weight.dims()[0])
    }

    /// Whether this is an XLabs ControlNet: it takes the pixel image (through
    /// [`embed_pixels`](Self::embed_pixels)), not VAE latents, and the transformer repeats its
    /// samples over the double blocks.
    pub fn takes_pixels(&self) -> bool {
        self.input_hint_block.is_some()
    }

    /// Checks a control mode for this ControlNet: required below `num_mode` for a
    /// ControlNet-Union, refused for others.
    pub fn check_mode(&self, mode: Option<usize>) -> Result<()> {
        self.check_mode_given(mode.is_some())?;
        match (self.num_mode(), mode) {
            (Some(n), Some(m)) if m >= n => Err(ModelError::Input(format!(
                "control mode {m} is out of range: this ControlNet-Union has {n} modes (0 to {})",
                n - 1
            ))),
            _ => Ok(()),
        }
    }

    /// A mode is given exactly when this is a ControlNet-Union.
    fn check_mode_given(&self, given: bool) -> Result<()> {
        match (self.num_mode().is_some(), given) {
            (true, false) => Err(ModelError::Input(
                "a ControlNet-Union needs a control mode (`controlnet_mode` in diffusers); \
                 give one"
                    .into(),
            )),
            (false, true) => Err(ModelError::Input(
                "a control mode was given to a ControlNet without modes (not a \
                 ControlNet-Union); leave the mode unset"
                    .into(),
            )),
            _ => Ok(()),
        }
    }

    /// XLabs: the conditioning of `image` (`[batch, 3, height, width]`, in [-1, 1]) as the
    /// forward takes it: `input_hint_block` (8 times smaller), then `patch_size` patches
    /// packed like the latents, `[batch, tokens, in_channels]`. It does not change over the
    /// steps, so a pipeline makes it once.
    pub fn embed_pixels(&self, image: Tensor<B, 4>) -> Result<Tensor<B, 3>> {
        let Some(hint) = &self.input_hint_block else {
            return Err(ModelError::Input(
                "this Flux ControlNet takes VAE latents, not the pixel image (it has no \
                 `input_hint_block`)"
                    .into(),
            ));
        };
        let [b, _, h, w] = image.dims();
        let (p, down) = (self.patch_size, 1 << (HINT_CHANNELS.len() - 1));
        if h % (down * p) != 0 || w % (down * p) != 0 {
            return Err(ModelError::Input(format!(
                "the control image is {w}x{h}; this ControlNet needs both sides multiples of {}",
                down * p
            )));
        }
        let caller = dtype_of(&image);
        let dtype = dtype_of(&self.controlnet_x_embedder.weight.val());
        let cond = hint.forward(cast_to(image, dtype));
        let [_, c, h, w] = cond.dims();
        let (h, w) = (h / p, w / p);
        let packed = cond
            .reshape([b, c, h, p, w, p])
            .permute([0, 2, 4, 1, 3, 5])
            .reshape([b, h * w, c * p * p]);
        Ok(cast_to(packed, caller))
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
    /// packed latents `hidden_states` and the packed conditioning `cond` (both `[batch, image
    /// tokens, in_channels]`: VAE latents packed as the latents, or XLabs'
    /// [`embed_pixels`](Self::embed_pixels)), with the transformer's other inputs as it takes
    /// them (`timestep` in the pipeline's `t / 1000` scale, `guidance` for guidance-embedding
    /// ControlNets). A ControlNet-Union takes `mode` (`[batch]` indices, see
    /// [`check_mode`](Self::check_mode)): its embedding goes before the text tokens, with the
    /// first text token's rotary position; other ControlNets take none.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        hidden_states: Tensor<B, 3>,
        cond: Tensor<B, 3>,
        mode: Option<Tensor<B, 1, Int>>,
        encoder_hidden_states: Tensor<B, 3>,
        pooled_projections: Tensor<B, 2>,
        timestep: Tensor<B, 1>,
        guidance: Option<Tensor<B, 1>>,
        rope: &RotaryEmbedding<B>,
        scale: Tensor<B, 1>,
    ) -> Result<FluxControlSamples<B>> {
        let caller = dtype_of(&hidden_states);
        let dtype = dtype_of(&self.x_embedder.weight.val());
        self.check_mode_given(mode.is_some())?;
        let mode = self
            .controlnet_mode_embedder
            .as_ref()
            .zip(mode)
            .map(|(embedder, mode)| {
                let [b] = mode.dims();
                (embedder, mode.reshape([b, 1]))
            });
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
        // diffusers: the mode's embedding before the text, `txt_ids[:1]` before the text ids.
        let union_rope;
        let rope = match mode {
            Some((embedder, mode)) => {
                text = Tensor::cat(vec![cast_to(embedder.forward(mode), dtype), text], 1);
                let first =
                    |t: &Tensor<B, 2>| Tensor::cat(vec![t.clone().narrow(0, 0, 1), t.clone()], 0);
                union_rope = RotaryEmbedding {
                    cos: first(&rope.cos),
                    sin: first(&rope.sin),
                };
                &union_rope
            }
            None => rope,
        };
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
        Ok(FluxControlSamples {
            blocks,
            single_blocks,
            repeat: self.takes_pixels(),
        })
    }
}
