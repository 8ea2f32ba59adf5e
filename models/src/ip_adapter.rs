//! IP-Adapter weights as diffusers' `load_ip_adapter` reads them: one safetensors file in the
//! original h94 layout, `image_proj.*` (the [`ImageProjection`] of the CLIP image embedding to
//! image tokens) and `ip_adapter.N.to_k_ip` / `to_v_ip` (the image branch of each UNet
//! cross-attention, [`IpAdapterAttention`]; N = 1, 3, 5, .. numbers the `attn2` processors in
//! diffusers' `attn_processors` order, as `_convert_ip_adapter_attn_to_diffusers` counts).
//!
//! The plain IP-Adapter (`image_proj.proj`, 4 tokens from the image embedding) and IP-Adapter
//! Plus (`image_proj.latents`, the resampler over the encoder's penultimate hidden states) are
//! supported; the Full Face and Face ID variants are refused by name.

use std::path::Path;
use std::sync::Arc;

use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor};

use crate::attention::{multi_head_attention, IpAdapterAttention};
use crate::dtype::ToDType;
use crate::error::{ModelError, Result};
use crate::nn::{Activation, LayerNorm, Linear};
use crate::unet_2d_condition::UNet2DConditionModel;
use crate::var_builder::VarBuilder;
use crate::weights::Weights;

/// The image tokens of the plain IP-Adapter (diffusers fixes them at 4; Plus has its
/// `latents`' count).
pub const IP_ADAPTER_TOKENS: usize = 4;

/// diffusers' `ImageProjection` (h94's `image_proj`): the image embedding through a linear
/// layer to `num_tokens * cross_attention_dim`, reshaped to tokens, then a layer norm.
#[derive(Module, Debug)]
pub struct ImageProjection<B: Backend> {
    pub proj: Linear<B>,
    pub norm: LayerNorm<B>,
    pub num_tokens: usize,
}

impl<B: Backend> ImageProjection<B> {
    /// `[batch, image_embed_dim]` to image tokens `[batch, num_tokens, cross_attention_dim]`.
    pub fn forward(&self, image_embeds: Tensor<B, 2>) -> Tensor<B, 3> {
        let batch = image_embeds.dims()[0];
        let tokens = self.proj.forward(image_embeds);
        let width = tokens.dims()[1] / self.num_tokens;
        self.norm
            .forward(tokens.reshape([batch, self.num_tokens, width]))
    }

    /// The image embedding width it takes (the image encoder's `projection_dim`).
    pub fn image_embed_dim(&self) -> usize {
        self.proj.dims()[0]
    }
}

/// One block of IP-Adapter Plus's resampler (diffusers' `IPAdapterPlusImageProjectionBlock`), in
/// the original layout: `0` the perceiver attention (`norm1` on the image features, `norm2` on
/// the latents, `to_q`, `to_kv`, `to_out`, 64-wide heads, no biases), `1` the feed-forward
/// (`1.0` a layer norm, `1.1` and `1.3` linear layers around an exact GELU, no biases).
#[derive(Module, Debug)]
pub struct ResamplerBlock<B: Backend> {
    pub norm1: LayerNorm<B>,
    pub norm2: LayerNorm<B>,
    pub to_q: Linear<B>,
    pub to_kv: Linear<B>,
    pub to_out: Linear<B>,
    pub ff_norm: LayerNorm<B>,
    pub ff_in: Linear<B>,
    pub ff_out: Linear<B>,
    pub heads: usize,
}

/// The width of each head of the resampler's attention (fixed in IP-Adapter Plus).
const RESAMPLER_HEAD_DIM: usize = 64;

impl<B: Backend> ResamplerBlock<B> {
    fn load(vb: &VarBuilder<B>, hidden: usize, path: &Path) -> Result<Self> {
        let attn = vb.pp(0);
        let inner = attn
            .weights()
            .shape(&attn.key("to_q.weight"))
            .map(|s| s[0])
            .unwrap_or(0);
        if inner == 0 || !inner.is_multiple_of(RESAMPLER_HEAD_DIM) {
            return Err(refuse(
                path,
                format!(
                    "`{}` must have a multiple of {RESAMPLER_HEAD_DIM} rows (64-wide heads)",
                    attn.key("to_q.weight")
                ),
            ));
        }
        let ff = vb.pp(1);
        let ff_inner = ff
            .weights()
            .shape(&ff.key("1.weight"))
            .map(|s| s[0])
            .unwrap_or(4 * hidden);
        Ok(Self {
            norm1: LayerNorm::load(&attn.pp("norm1"), hidden, 1e-5)?,
            norm2: LayerNorm::load(&attn.pp("norm2"), hidden, 1e-5)?,
            to_q: Linear::load(&attn.pp("to_q"), hidden, inner, false)?,
            to_kv: Linear::load(&attn.pp("to_kv"), hidden, 2 * inner, false)?,
            to_out: Linear::load(&attn.pp("to_out"), inner, hidden, false)?,
            ff_norm: LayerNorm::load(&ff.pp(0), hidden, 1e-5)?,
            ff_in: Linear::load(&ff.pp(1), hidden, ff_inner, false)?,
            ff_out: Linear::load(&ff.pp(3), ff_inner, hidden, false)?,
            heads: inner / RESAMPLER_HEAD_DIM,
        })
    }

    fn forward(&self, x: Tensor<B, 3>, latents: Tensor<B, 3>) -> Tensor<B, 3> {
        let normed = self.norm2.forward(latents.clone());
        let context = Tensor::cat(vec![self.norm1.forward(x), normed.clone()], 1);
        let kv = self.to_kv.forward(context);
        let inner = kv.dims()[2] / 2;
        let k = kv.clone().narrow(2, 0, inner);
        let v = kv.narrow(2, inner, inner);
        let q = self.to_q.forward(normed);
        let attended = multi_head_attention(q, k, v, self.heads, false);
        let latents = self.to_out.forward(attended) + latents;
        let hidden =
            Activation::Gelu.forward(self.ff_in.forward(self.ff_norm.forward(latents.clone())));
        self.ff_out.forward(hidden) + latents
    }
}

/// diffusers' `IPAdapterPlusImageProjection` (h94's `Resampler`): learned query `latents`
/// attend to the image encoder's penultimate hidden states through the blocks, then
/// `proj_out` and `norm_out` give `num_queries` image tokens.
#[derive(Module, Debug)]
pub struct IpAdapterPlusImageProjection<B: Backend> {
    pub latents: Param<Tensor<B, 3>>,
    pub proj_in: Linear<B>,
    pub layers: Vec<ResamplerBlock<B>>,
    pub proj_out: Linear<B>,
    pub norm_out: LayerNorm<B>,
}

impl<B: Backend> IpAdapterPlusImageProjection<B> {
    /// Hidden states `[batch, patches + 1, embed_dims]` to `[batch, num_queries, output_dims]`.
    pub fn forward(&self, hidden_states: Tensor<B, 3>) -> Tensor<B, 3> {
        let batch = hidden_states.dims()[0];
        let [_, queries, width] = self.latents.dims();
        let mut latents = self.latents.val().expand([batch, queries, width]);
        let x = self.proj_in.forward(hidden_states);
        for block in &self.layers {
            latents = block.forward(x.clone(), latents);
        }
        self.norm_out.forward(self.proj_out.forward(latents))
    }
}

/// An IP-Adapter's image projection: what it reads from the image encoder and how it makes
/// the image tokens.
// The resampler is larger than the plain projection; an adapter holds one.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum IpImageProjection<B: Backend> {
    /// The plain IP-Adapter: the projected image embedding (`image_embeds`).
    Plain(ImageProjection<B>),
    /// IP-Adapter Plus: the penultimate hidden states (`hidden_states[-2]`).
    Plus(IpAdapterPlusImageProjection<B>),
}

impl<B: Backend> IpImageProjection<B> {
    /// Image tokens per image.
    pub fn num_tokens(&self) -> usize {
        match self {
            Self::Plain(p) => p.num_tokens,
            Self::Plus(p) => p.latents.dims()[1],
        }
    }

    /// The width of what it reads: the image embedding's (plain) or the hidden states' (Plus).
    pub fn input_width(&self) -> usize {
        match self {
            Self::Plain(p) => p.image_embed_dim(),
            Self::Plus(p) => p.proj_in.dims()[0],
        }
    }
}

fn refuse(path: &Path, reason: impl Into<String>) -> ModelError {
    ModelError::IpAdapter {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Reads an IP-Adapter file for `unet`, attaches its image branch to each of the UNet's
/// cross-attentions at `scale` and returns the image projection. Every key and shape is checked
/// before the UNet changes; weights are held in `dtype` on the UNet's device.
pub fn load_ip_adapter<B: Backend>(
    path: &Path,
    unet: &mut UNet2DConditionModel<B>,
    scale: f64,
    dtype: FloatDType,
) -> Result<IpImageProjection<B>> {
    let weights = Weights::from_standalone_file(path)?;
    let plus = weights.contains("image_proj.latents");
    if !plus && !weights.contains("image_proj.proj.weight") {
        let variant = if weights.contains("image_proj.proj.3.weight") {
            "an IP-Adapter Full Face file, which oxidiff does not support"
        } else if weights.contains("image_proj.norm.weight")
            || weights.contains("image_proj.perceiver_resampler.proj_in.weight")
        {
            "an IP-Adapter Face ID file, which oxidiff does not support"
        } else {
            "not an IP-Adapter file: it has no `image_proj.proj.weight` nor \
             `image_proj.latents` (expected the h94 layout: `image_proj.*` and \
             `ip_adapter.N.to_k_ip.weight` keys)"
        };
        return Err(refuse(path, variant));
    }
    let device = unet.conv_in.weight.device();
    let vb = VarBuilder::<B>::new(Arc::new(weights), &device).with_dtype(dtype);
    let weights = vb.weights().clone();
    let shape = |key: &str| weights.shape(key).unwrap_or_default().to_vec();

    let mut blocks = unet.transformer_blocks_mut();
    let Some(first) = blocks.first() else {
        return Err(refuse(
            path,
            "the UNet has no cross-attention to attach it to",
        ));
    };
    let cross = first.attn2.to_k.dims()[0];
    let mismatch = |width: usize, key: &str| {
        refuse(
            path,
            format!(
                "made for a UNet with cross_attention_dim {width} (from `{key}`), but this \
                 UNet's is {cross}: use the IP-Adapter file made for this base model (SD 1.x or \
                 SDXL)"
            ),
        )
    };
    let (image_proj, num_tokens) = if plus {
        let [1, queries, hidden] = shape("image_proj.latents")[..] else {
            return Err(refuse(
                path,
                "`image_proj.latents` must be [1, queries, width]",
            ));
        };
        let [_, embed] = shape("image_proj.proj_in.weight")[..] else {
            return Err(refuse(
                path,
                "`image_proj.proj_in.weight` is missing or not a matrix",
            ));
        };
        let [out, _] = shape("image_proj.proj_out.weight")[..] else {
            return Err(refuse(
                path,
                "`image_proj.proj_out.weight` is missing or not a matrix",
            ));
        };
        if out != cross {
            return Err(mismatch(out, "image_proj.proj_out.weight"));
        }
        let depth = (0..)
            .take_while(|i| weights.contains(&format!("image_proj.layers.{i}.0.to_q.weight")))
            .count();
        let proj = vb.pp("image_proj");
        let layers = (0..depth)
            .map(|i| ResamplerBlock::load(&proj.pp("layers").pp(i), hidden, path))
            .collect::<Result<Vec<_>>>()?;
        let projection = IpAdapterPlusImageProjection {
            latents: proj.param("latents", [1, queries, hidden])?,
            proj_in: Linear::load(&proj.pp("proj_in"), embed, hidden, true)?,
            layers,
            proj_out: Linear::load(&proj.pp("proj_out"), hidden, out, true)?,
            norm_out: LayerNorm::load(&proj.pp("norm_out"), out, 1e-5)?,
        };
        (IpImageProjection::Plus(projection), queries)
    } else {
        let [rows, image_dim] = shape("image_proj.proj.weight")[..] else {
            return Err(refuse(path, "`image_proj.proj.weight` is not a matrix"));
        };
        if rows != IP_ADAPTER_TOKENS * cross {
            return Err(mismatch(rows / IP_ADAPTER_TOKENS, "image_proj.proj.weight"));
        }
        let projection = ImageProjection {
            proj: Linear::load(&vb.pp("image_proj.proj"), image_dim, rows, true)?,
            norm: LayerNorm::load(&vb.pp("image_proj.norm"), cross, 1e-5)?,
            num_tokens: IP_ADAPTER_TOKENS,
        };
        (IpImageProjection::Plain(projection), IP_ADAPTER_TOKENS)
    };
    let found = weights
        .keys()
        .filter(|k| k.starts_with("ip_adapter.") && k.ends_with(".to_k_ip.weight"))
        .count();
    if found != blocks.len() {
        return Err(refuse(
            path,
            format!(
                "it has {found} cross-attention key/value pairs (`ip_adapter.N.to_k_ip.weight`), \
                 but this UNet has {} cross-attentions: use the IP-Adapter file made for this \
                 base model",
                blocks.len()
            ),
        ));
    }
    let attentions = blocks
        .iter()
        .enumerate()
        .map(|(i, block)| {
            let hidden = block.attn2.to_q.dims()[1];
            let vb = vb.pp("ip_adapter").pp(2 * i + 1);
            if !vb.contains("to_k_ip.weight") || !vb.contains("to_v_ip.weight") {
                return Err(refuse(
                    path,
                    format!(
                        "`ip_adapter.{0}.to_k_ip.weight` or `ip_adapter.{0}.to_v_ip.weight` is \
                         missing (one pair per cross-attention, numbered 1, 3, 5, ..): the file \
                         is incomplete or in another layout",
                        2 * i + 1
                    ),
                ));
            }
            Ok(IpAdapterAttention {
                to_k_ip: Linear::load(&vb.pp("to_k_ip"), cross, hidden, false)?,
                to_v_ip: Linear::load(&vb.pp("to_v_ip"), cross, hidden, false)?,
                num_tokens,
                scale,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    for (block, ip) in blocks.iter_mut().zip(attentions) {
        block.ip_adapter = Some(ip.to_dtype(dtype));
    }
    Ok(image_proj.to_dtype(dtype))
}

/// Sets the weight of every attached image branch (diffusers' `set_ip_adapter_scale`).
pub fn set_ip_adapter_scale<B: Backend>(unet: &mut UNet2DConditionModel<B>, scale: f64) {
    for block in unet.transformer_blocks_mut() {
        if let Some(ip) = &mut block.ip_adapter {
            ip.scale = scale;
        }
    }
}

/// Removes the image branches (diffusers' `unload_ip_adapter`).
pub fn unload_ip_adapter<B: Backend>(unet: &mut UNet2DConditionModel<B>) {
    for block in unet.transformer_blocks_mut() {
        block.ip_adapter = None;
    }
}
