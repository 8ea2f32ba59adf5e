//! IP-Adapter weights as diffusers' `load_ip_adapter` reads them: one safetensors file in the
//! original h94 layout, `image_proj.*` (the [`ImageProjection`] of the CLIP image embedding to
//! image tokens) and `ip_adapter.N.to_k_ip` / `to_v_ip` (the image branch of each UNet
//! cross-attention, [`IpAdapterAttention`]; N = 1, 3, 5, .. numbers the `attn2` processors in
//! diffusers' `attn_processors` order, as `_convert_ip_adapter_attn_to_diffusers` counts).
//!
//! Only the plain IP-Adapter (`image_proj.proj`, 4 tokens) is supported; the Plus resampler
//! and the Face ID variants are refused by name.

use std::path::Path;
use std::sync::Arc;

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor};

use crate::attention::IpAdapterAttention;
use crate::dtype::ToDType;
use crate::error::{ModelError, Result};
use crate::nn::{LayerNorm, Linear};
use crate::unet_2d_condition::UNet2DConditionModel;
use crate::var_builder::VarBuilder;
use crate::weights::Weights;

/// The image tokens of the plain IP-Adapter (diffusers fixes them at 4).
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
) -> Result<ImageProjection<B>> {
    let weights = Weights::from_standalone_file(path)?;
    if !weights.contains("image_proj.proj.weight") {
        let variant = if weights.contains("image_proj.latents") {
            "an IP-Adapter Plus (resampler) file, which oxidiff does not support yet"
        } else if weights.contains("image_proj.proj.3.weight") {
            "an IP-Adapter Full Face file, which oxidiff does not support"
        } else if weights.contains("image_proj.norm.weight") {
            "an IP-Adapter Face ID file, which oxidiff does not support"
        } else {
            "not an IP-Adapter file: it has no `image_proj.proj.weight` (expected the h94 layout: \
             `image_proj.*` and `ip_adapter.N.to_k_ip.weight` keys)"
        };
        return Err(refuse(path, variant));
    }
    let device = unet.conv_in.weight.device();
    let vb = VarBuilder::<B>::new(Arc::new(weights), &device).with_dtype(dtype);
    let weights = vb.weights().clone();
    let proj_shape = weights
        .shape("image_proj.proj.weight")
        .unwrap_or_default()
        .to_vec();
    let [rows, image_dim] = proj_shape[..] else {
        return Err(refuse(path, "`image_proj.proj.weight` is not a matrix"));
    };

    let mut blocks = unet.transformer_blocks_mut();
    let Some(first) = blocks.first() else {
        return Err(refuse(
            path,
            "the UNet has no cross-attention to attach it to",
        ));
    };
    let cross = first.attn2.to_k.dims()[0];
    if rows != IP_ADAPTER_TOKENS * cross {
        return Err(refuse(
            path,
            format!(
                "made for a UNet with cross_attention_dim {} (image_proj.proj.weight has {rows} \
                 rows, {IP_ADAPTER_TOKENS} tokens of that width), but this UNet's is {cross}: \
                 use the IP-Adapter file made for this base model (SD 1.x or SDXL)",
                rows as f64 / IP_ADAPTER_TOKENS as f64
            ),
        ));
    }
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
    let image_proj = ImageProjection {
        proj: Linear::load(&vb.pp("image_proj.proj"), image_dim, rows, true)?,
        norm: LayerNorm::load(&vb.pp("image_proj.norm"), cross, 1e-5)?,
        num_tokens: IP_ADAPTER_TOKENS,
    };
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
                num_tokens: IP_ADAPTER_TOKENS,
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
