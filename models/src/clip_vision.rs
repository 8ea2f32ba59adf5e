//! CLIP's image encoder with its projection head (transformers' `CLIPVisionModelWithProjection`):
//! the image encoder of IP-Adapter, read from an `image_encoder` folder.
//!
//! Patch and class embeddings, `pre_layrnorm` (sic, transformers' key), the encoder layers the
//! text model uses too ([`ClipEncoderLayer`], not causal here), `post_layernorm` on the class
//! token, then `visual_projection`. Keys load with or without the `vision_model.` prefix.

use std::path::Path;

use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor};
use serde::Deserialize;

use crate::clip::{ClipEncoderLayer, ClipLayerSpec};
use crate::error::{ModelError, Result};
use crate::nn::{Activation, Conv2d, Embedding, LayerNorm, Linear};
use crate::var_builder::{load_component, VarBuilder};

/// `image_encoder/config.json` (a transformers `CLIPVisionConfig`).
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct ClipVisionConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub projection_dim: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_channels: usize,
    pub image_size: usize,
    pub patch_size: usize,
    pub hidden_act: String,
    pub layer_norm_eps: f64,
}

impl Default for ClipVisionConfig {
    fn default() -> Self {
        // transformers' `CLIPVisionConfig()` defaults (ViT-B/32).
        Self {
            hidden_size: 768,
            intermediate_size: 3072,
            projection_dim: 512,
            num_hidden_layers: 12,
            num_attention_heads: 12,
            num_channels: 3,
            image_size: 224,
            patch_size: 32,
            hidden_act: "quick_gelu".into(),
            layer_norm_eps: 1e-5,
        }
    }
}

impl ClipVisionConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let config: Self = crate::clip::load_clip_part(path, "vision_config")?;
        crate::clip::check_encoder(
            path,
            &config.hidden_act,
            config.hidden_size,
            config.num_attention_heads,
            config.num_hidden_layers,
            &[
                ("intermediate_size", config.intermediate_size),
                ("projection_dim", config.projection_dim),
                ("image_size", config.image_size),
                ("num_channels", config.num_channels),
            ],
        )?;
        let bad = |reason: &str| ModelError::Config {
            path: path.to_path_buf(),
            reason: reason.into(),
        };
        if config.patch_size == 0 || !config.image_size.is_multiple_of(config.patch_size) {
            return Err(bad("`image_size` must be a multiple of `patch_size`"));
        }
        Ok(config)
    }

    /// Patches per image plus the class token.
    pub fn num_positions(&self) -> usize {
        (self.image_size / self.patch_size).pow(2) + 1
    }
}

/// transformers' `CLIPVisionEmbeddings`: a patch convolution (no bias), the class token and
/// learned position embeddings.
#[derive(Module, Debug)]
pub struct ClipVisionEmbeddings<B: Backend> {
    pub class_embedding: Param<Tensor<B, 1>>,
    pub patch_embedding: Conv2d<B>,
    pub position_embedding: Embedding<B>,
}

impl<B: Backend> ClipVisionEmbeddings<B> {
    fn load(vb: &VarBuilder<B>, cfg: &ClipVisionConfig) -> Result<Self> {
        let (d, p) = (cfg.hidden_size, cfg.patch_size);
        Ok(Self {
            class_embedding: vb.param("class_embedding", [d])?,
            patch_embedding: Conv2d {
                weight: vb.param("patch_embedding.weight", [d, cfg.num_channels, p, p])?,
                bias: None,
                stride: p,
                padding: 0,
                groups: 1,
            },
            position_embedding: Embedding::load(
                &vb.pp("position_embedding"),
                cfg.num_positions(),
                d,
            )?,
        })
    }

    /// `[batch, channels, size, size]` pixels to `[batch, patches + 1, hidden]`.
    fn forward(&self, pixel_values: Tensor<B, 4>) -> Tensor<B, 3> {
        let patches = self.patch_embedding.forward(pixel_values);
        let [b, d, h, w] = patches.dims();
        let patches = patches.reshape([b, d, h * w]).swap_dims(1, 2);
        let class = self
            .class_embedding
            .val()
            .reshape([1, 1, d])
            .expand([b, 1, d]);
        let x = Tensor::cat(vec![class, patches], 1);
        x + self.position_embedding.weight.val().unsqueeze::<3>()
    }
}

/// The outputs of the image encoder.
#[derive(Debug, Clone)]
pub struct ClipVisionOutput<B: Backend> {
    /// The class token after `post_layernorm` and `visual_projection`, `[batch, projection_dim]`.
    pub image_embeds: Tensor<B, 2>,
    /// The last layer's output, `[batch, patches + 1, hidden]` (before `post_layernorm`).
    pub last_hidden_state: Tensor<B, 3>,
}

/// transformers' `CLIPVisionModelWithProjection`.
#[derive(Module, Debug)]
pub struct ClipVisionModelWithProjection<B: Backend> {
    pub embeddings: ClipVisionEmbeddings<B>,
    pub pre_layrnorm: LayerNorm<B>,
    pub layers: Vec<ClipEncoderLayer<B>>,
    pub post_layernorm: LayerNorm<B>,
    pub visual_projection: Linear<B>,
    pub image_size: usize,
}

impl<B: Backend> ClipVisionModelWithProjection<B> {
    /// Loads an `image_encoder` folder (`config.json`, `model.safetensors`) with the float
    /// weights held in `dtype`.
    pub fn from_dir_in(dir: &Path, dtype: FloatDType, device: &B::Device) -> Result<Self> {
        let config = ClipVisionConfig::from_file(&dir.join("config.json"))?;
        load_component(dir, &["model"], None, dtype, device, |vb| {
            Self::load(&config, vb)
        })
    }

    pub fn load(cfg: &ClipVisionConfig, vb: VarBuilder<B>) -> Result<Self> {
        let act = Activation::from_name(&cfg.hidden_act).unwrap_or(Activation::QuickGelu);
        let vision = if vb.contains("vision_model.embeddings.class_embedding") {
            vb.pp("vision_model")
        } else {
            vb.clone()
        };
        let d = cfg.hidden_size;
        let spec = ClipLayerSpec {
            hidden: d,
            intermediate: cfg.intermediate_size,
            heads: cfg.num_attention_heads,
            eps: cfg.layer_norm_eps,
            act,
            causal: false,
        };
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| ClipEncoderLayer::load(&vision.pp("encoder.layers").pp(i), spec))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            embeddings: ClipVisionEmbeddings::load(&vision.pp("embeddings"), cfg)?,
            pre_layrnorm: LayerNorm::load(&vision.pp("pre_layrnorm"), d, cfg.layer_norm_eps)?,
            layers,
            post_layernorm: LayerNorm::load(&vision.pp("post_layernorm"), d, cfg.layer_norm_eps)?,
            visual_projection: Linear::load(
                &vb.pp("visual_projection"),
                d,
                cfg.projection_dim,
                false,
            )?,
            image_size: cfg.image_size,
        })
    }

    /// Width of `image_embeds` (`projection_dim`).
    pub fn projection_dim(&self) -> usize {
        self.visual_projection.dims()[1]
    }

    /// The embedded patches after `pre_layrnorm`, in the weights' dtype (see `crate::dtype`).
    fn embed(&self, pixel_values: Tensor<B, 4>) -> Result<Tensor<B, 3>> {
        let [_, _, h, w] = pixel_values.dims();
        if h != self.image_size || w != self.image_size {
            return Err(ModelError::Input(format!(
                "the image encoder takes {0}x{0} pixels, got {w}x{h}",
                self.image_size
            )));
        }
        let dtype = crate::dtype::dtype_of(&self.embeddings.patch_embedding.weight.val());
        let pixel_values = crate::dtype::cast_to(pixel_values, dtype);
        Ok(self
            .pre_layrnorm
            .forward(self.embeddings.forward(pixel_values)))
    }

    /// Encodes preprocessed pixels `[batch, channels, image_size, image_size]`.
    pub fn forward(&self, pixel_values: Tensor<B, 4>) -> Result<ClipVisionOutput<B>> {
        let mut x = self.embed(pixel_values)?;
        for layer in &self.layers {
            x = layer.forward(x);
        }
        let [b, _, d] = x.dims();
        let pooled = self
            .post_layernorm
            .forward(x.clone().narrow(1, 0, 1).reshape([b, d]));
        Ok(ClipVisionOutput {
            image_embeds: self.visual_projection.forward(pooled),
            last_hidden_state: x,
        })
    }

    /// transformers' `hidden_states[-2]`: the output of the last layer but one (the embedded
    /// patches for a one-layer encoder), `[batch, patches + 1, hidden]`; what IP-Adapter Plus
    /// reads.
    pub fn penultimate_hidden_state(&self, pixel_values: Tensor<B, 4>) -> Result<Tensor<B, 3>> {
        let mut x = self.embed(pixel_values)?;
        for layer in self.layers.iter().take(self.layers.len().saturating_sub(1)) {
            x = layer.forward(x);
        }
        Ok(x)
    }

    /// Width of the hidden states (`hidden_size`).
    pub fn hidden_size(&self) -> usize {
        self.post_layernorm.weight.dims()[0]
    }
}
