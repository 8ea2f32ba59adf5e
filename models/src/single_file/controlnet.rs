//! A ControlNet in one file, read as diffusers' `ControlNetModel.from_single_file` reads it:
//! lllyasviel's original layout (the `control_v11p_sd15_*` files A1111 users have: keys under
//! `control_model.`, or bare), renamed as `convert_controlnet_checkpoint`, or diffusers' own
//! names in one `.safetensors` file (the SDXL ControlNets are shared that way). The config is
//! a diffusers folder's when one is given, else read from the tensors.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::FloatDType;

use super::detect::{first_keys, UNET_PREFIX};
use super::file::{layers_per_block, open_safetensors};
use super::rename::unet_name;
use crate::config::PerBlock;
use crate::controlnet::{ControlNetConfig, ControlNetModel};
use crate::dtype::ToDType;
use crate::error::{ModelError, Result};
use crate::unet_2d_condition_config::UNet2DConditionConfig;
use crate::var_builder::VarBuilder;
use crate::weights::{TensorView, Weights};

/// The original layout's prefix when a ControlNet is saved with (or inside) a whole model.
pub const CONTROL_MODEL_PREFIX: &str = "control_model.";

/// How a single ControlNet file names its tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlNetLayout {
    /// lllyasviel's names (`input_blocks`, `zero_convs`, `input_hint_block`,
    /// `middle_block_out`) after this prefix (`control_model.` or none).
    Original { prefix: &'static str },
    /// diffusers' `ControlNetModel` names.
    Diffusers,
}

/// A single-file ControlNet, opened and classified.
#[derive(Debug)]
pub struct ControlNetFile {
    pub path: PathBuf,
    pub layout: ControlNetLayout,
    weights: Weights,
}

impl ControlNetFile {
    /// Opens `path` (pickles refused, the header checked) and classifies its keys.
    pub fn open(path: &Path) -> Result<Self> {
        Self::from_weights(path, open_safetensors(path)?)
    }

    /// Classifies tensors already opened ([`Weights::shapes_only`] of a layout, say); `path`
    /// names them in messages.
    pub fn from_weights(path: &Path, weights: Weights) -> Result<Self> {
        let unknown = |reason: &str| ModelError::NotAControlNet {
            path: path.to_path_buf(),
            reason: reason.into(),
            looked_for: format!(
                "`{CONTROL_MODEL_PREFIX}input_hint_block.0.weight` (lllyasviel's layout) or \
                 `controlnet_cond_embedding.conv_in.weight` (diffusers')"
            ),
            found: first_keys(&weights),
        };
        if weights.keys().any(|k| k.starts_with("lora_controlnet")) {
            return Err(unknown(
                "it is a Control-LoRA (low-rank ControlNet weights on top of the UNet's), which \
                 oxidiff does not run; use a full ControlNet",
            ));
        }
        let layout =
            if weights.contains(&format!("{CONTROL_MODEL_PREFIX}input_hint_block.0.weight")) {
                ControlNetLayout::Original {
                    prefix: CONTROL_MODEL_PREFIX,
                }
            } else if weights.contains("input_hint_block.0.weight") {
                ControlNetLayout::Original { prefix: "" }
            } else if weights.contains("controlnet_cond_embedding.conv_in.weight")
                && weights.contains("time_embedding.linear_1.weight")
            {
                ControlNetLayout::Diffusers
            } else if weights
                .keys()
                .any(|k| k.starts_with("controlnet_x_embedder") || k.starts_with("pos_embed_input"))
            {
                return Err(unknown(
                "it looks like an SD3 or Flux ControlNet, which oxidiff loads from its diffusers \
                 folder (config.json beside the weights): pass the folder",
            ));
            } else if weights.keys().any(|k| k.starts_with(UNET_PREFIX)) {
                return Err(unknown(
                    "it is a whole Stable Diffusion checkpoint (a UNet under \
                 `model.diffusion_model.`) without a ControlNet: pass it as the model",
                ));
            } else {
                return Err(unknown(
                    "its keys are of no ControlNet layout oxidiff knows",
                ));
            };
        Ok(Self {
            path: path.to_path_buf(),
            layout,
            weights,
        })
    }

    /// `(diffusers name, key in the file, view)` of every ControlNet tensor; tensors of the
    /// file outside `control_model.` (a whole model saved with it) are left out, as diffusers
    /// leaves them.
    pub fn names(&self) -> Result<Vec<(String, String, TensorView)>> {
        let ControlNetLayout::Original { prefix } = self.layout else {
            let mut names: Vec<_> = self
                .weights
                .keys()
                .map(|k| (k.to_string(), k.to_string(), TensorView::Whole))
                .collect();
            names.sort_by(|a, b| a.0.cmp(&b.0));
            return Ok(names);
        };
        let layers = layers_per_block(&self.weights, prefix, &self.path)?;
        let hint = format!("{prefix}input_hint_block.");
        let last_hint = self
            .weights
            .keys()
            .filter_map(|k| {
                k.strip_prefix(&hint)?
                    .split('.')
                    .next()?
                    .parse::<usize>()
                    .ok()
            })
            .max()
            .unwrap_or(0);
        let mut names = Vec::new();
        for key in self.weights.keys() {
            let Some(rest) = key.strip_prefix(prefix) else {
                continue;
            };
            let name = original_name(rest, layers, last_hint).ok_or_else(|| {
                ModelError::NotAControlNet {
                    path: self.path.clone(),
                    reason: format!(
                        "tensor `{key}` is not part of a ControlNet in lllyasviel's layout"
                    ),
                    looked_for: "`input_blocks`, `middle_block`, `zero_convs`, \
                                 `input_hint_block`, `middle_block_out`, `time_embed`"
                        .into(),
                    found: first_keys(&self.weights),
                }
            })?;
            names.push((name, key.to_string(), TensorView::Whole));
        }
        names.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(names)
    }

    /// The ControlNet's tensors under diffusers' names.
    pub fn weights(&self) -> Result<Weights> {
        self.weights.view(self.names()?)
    }

    /// The config read from the tensors: channels, block types, depths, context width, the
    /// projection type, the conditioning embedding and SDXL's added condition. What no tensor
    /// shows follows the released ControlNets: 8 heads with convolution projections (SD 1.x),
    /// 64 channels a head with linear ones (SD 2.x, SDXL), 32 norm groups, 256-wide time ids;
    /// a ControlNet with other values needs its diffusers config.
    pub fn config(&self) -> Result<ControlNetConfig> {
        let w = self.weights()?;
        let dim = |key: &str, axis: usize| {
            w.shape(key)
                .and_then(|s| s.get(axis).copied())
                .ok_or_else(|| ModelError::MissingKey {
                    key: key.to_string(),
                    files: self.path.display().to_string(),
                })
        };
        let count = |prefix: &str| {
            w.keys()
                .filter_map(|k| {
                    k.strip_prefix(prefix)?
                        .split('.')
                        .next()?
                        .parse::<usize>()
                        .ok()
                })
                .collect::<std::collections::BTreeSet<_>>()
                .len()
        };
        let blocks = count("down_blocks.");
        let layers = count("down_blocks.0.resnets.");
        let mut channels = Vec::with_capacity(blocks);
        let mut down = Vec::with_capacity(blocks);
        let mut depth = Vec::with_capacity(blocks);
        let mut context = None;
        let mut linear = false;
        for b in 0..blocks {
            channels.push(dim(&format!("down_blocks.{b}.resnets.0.conv1.weight"), 0)?);
            let attn = format!("down_blocks.{b}.attentions.0.");
            if let Some(shape) = w.shape(&format!("{attn}proj_in.weight")) {
                linear = shape.len() == 2;
                down.push("CrossAttnDownBlock2D".to_string());
                depth.push(count(&format!("{attn}transformer_blocks.")));
                context.get_or_insert(dim(
                    &format!("{attn}transformer_blocks.0.attn2.to_k.weight"),
                    1,
                )?);
            } else {
                down.push("DownBlock2D".to_string());
                depth.push(1);
            }
        }
        let embedding = &"controlnet_cond_embedding.";
        let mut embedding_channels = vec![dim(&format!("{embedding}conv_in.weight"), 0)?];
        let embedding_blocks = count(&format!("{embedding}blocks."));
        for k in (1..embedding_blocks).step_by(2) {
            embedding_channels.push(dim(&format!("{embedding}blocks.{k}.weight"), 0)?);
        }
        let mut unet = UNet2DConditionConfig {
            in_channels: dim("conv_in.weight", 1)?,
            down_block_types: down,
            mid_block_type: Some("UNetMidBlock2DCrossAttn".into()),
            block_out_channels: channels.clone(),
            layers_per_block: PerBlock::One(layers),
            cross_attention_dim: PerBlock::One(context.unwrap_or(768)),
            transformer_layers_per_block: if depth.iter().all(|&d| d == 1) {
                PerBlock::One(1)
            } else {
                PerBlock::Each(depth)
            },
            attention_head_dim: if linear {
                PerBlock::Each(channels.iter().map(|c| (c / 64).max(1)).collect())
            } else {
                PerBlock::One(8)
            },
            use_linear_projection: linear,
            ..UNet2DConditionConfig::default()
        };
        if let Some(shape) = w.shape("add_embedding.linear_1.weight") {
            // SDXL's added condition: the pooled text embeds and 6 time ids of 256 channels.
            let input = shape.get(1).copied().unwrap_or(0);
            if input <= 6 * 256 {
                return Err(ModelError::NotAControlNet {
                    path: self.path.clone(),
                    reason: format!(
                        "its added condition takes {input} inputs, not SDXL's pooled text \
                         embeds and 6 time ids of 256; pass the ControlNet's diffusers config"
                    ),
                    looked_for: "`add_embedding.linear_1.weight`".into(),
                    found: first_keys(&self.weights),
                });
            }
            unet.addition_embed_type = Some("text_time".into());
            unet.addition_time_embed_dim = Some(256);
            unet.projection_class_embeddings_input_dim = Some(input);
        }
        ControlNetConfig {
            unet,
            conditioning_channels: dim(&format!("{embedding}conv_in.weight"), 1)?,
            conditioning_embedding_out_channels: embedding_channels,
            ..ControlNetConfig::default()
        }
        .completed(&self.path)
    }
}

/// diffusers' name of ControlNet tensor `rest` (the key after the prefix) in lllyasviel's
/// layout, as `convert_controlnet_checkpoint` renames it; `last_hint` is the index of the
/// conditioning embedding's last convolution (14 in the released models).
fn original_name(rest: &str, layers: usize, last_hint: usize) -> Option<String> {
    let (section, tail) = rest.split_once('.')?;
    match section {
        "zero_convs" => {
            let (i, param) = tail.split_once(".0.")?;
            Some(format!("controlnet_down_blocks.{i}.{param}"))
        }
        "middle_block_out" => Some(format!("controlnet_mid_block.{}", tail.strip_prefix("0.")?)),
        "input_hint_block" => {
            let (i, param) = tail.split_once('.')?;
            let i: usize = i.parse().ok()?;
            let e = "controlnet_cond_embedding";
            match i {
                0 => Some(format!("{e}.conv_in.{param}")),
                i if i == last_hint => Some(format!("{e}.conv_out.{param}")),
                i if i % 2 == 0 => Some(format!("{e}.blocks.{}.{param}", i / 2 - 1)),
                _ => None,
            }
        }
        "input_blocks" | "middle_block" | "time_embed" | "label_emb" => unet_name(rest, layers),
        _ => None,
    }
}

impl<B: Backend> ControlNetModel<B> {
    /// Loads a ControlNet folder ([`ControlNetModel::from_dir_in`]) or a single file
    /// ([`ControlNetModel::from_single_file`], with the `config.json` beside it if there is
    /// one), weights held in `dtype`.
    pub fn from_path(
        path: &Path,
        variant: Option<&str>,
        dtype: FloatDType,
        device: &B::Device,
    ) -> Result<Self> {
        if !path.is_file() {
            return Self::from_dir_in(path, variant, dtype, device);
        }
        let beside = path
            .parent()
            .map(|p| p.join("config.json"))
            .filter(|c| c.is_file());
        Self::from_single_file(path, beside.as_deref(), dtype, device)
    }

    /// Loads a single-file ControlNet ([`ControlNetFile`]), weights held in `dtype`; `config`
    /// is a diffusers ControlNet folder or its `config.json` (diffusers' `config=`), else the
    /// config is read from the tensors ([`ControlNetFile::config`]). Every tensor of the
    /// ControlNet must be used, so a config that does not fit is an error.
    pub fn from_single_file(
        path: &Path,
        config: Option<&Path>,
        dtype: FloatDType,
        device: &B::Device,
    ) -> Result<Self> {
        let file = ControlNetFile::open(path)?;
        let (config, config_path) = match config {
            Some(c) => {
                let json = if c.is_dir() {
                    c.join("config.json")
                } else {
                    c.to_path_buf()
                };
                (ControlNetConfig::from_file(&json)?, json)
            }
            None => (file.config()?, path.to_path_buf()),
        };
        let weights = Arc::new(file.weights()?);
        let vb = VarBuilder::new(weights.clone(), device).with_dtype(dtype);
        let model = Self::load(&config, &config_path, vb)?.to_dtype(dtype);
        if let Some((count, names)) = weights.unused_summary() {
            return Err(ModelError::Config {
                path: config_path,
                reason: format!(
                    "the ControlNet built from it does not use {count} tensors of {} (diffusers \
                     names: {names}): the config does not fit the file; pass the ControlNet's \
                     diffusers config",
                    path.display(),
                ),
            });
        }
        Ok(model)
    }
}

#[cfg(test)]
mod tests {
    use super::original_name;

    #[test]
    fn original_keys_are_renamed_as_diffusers_does() {
        let cases = [
            ("time_embed.2.bias", "time_embedding.linear_2.bias"),
            ("input_blocks.0.0.weight", "conv_in.weight"),
            (
                "input_blocks.4.1.proj_in.weight",
                "down_blocks.1.attentions.0.proj_in.weight",
            ),
            (
                "input_blocks.9.0.op.bias",
                "down_blocks.2.downsamplers.0.conv.bias",
            ),
            (
                "middle_block.2.out_layers.3.weight",
                "mid_block.resnets.1.conv2.weight",
            ),
            ("zero_convs.11.0.weight", "controlnet_down_blocks.11.weight"),
            ("middle_block_out.0.bias", "controlnet_mid_block.bias"),
            (
                "input_hint_block.0.weight",
                "controlnet_cond_embedding.conv_in.weight",
            ),
            (
                "input_hint_block.2.bias",
                "controlnet_cond_embedding.blocks.0.bias",
            ),
            (
                "input_hint_block.12.weight",
                "controlnet_cond_embedding.blocks.5.weight",
            ),
            (
                "input_hint_block.14.weight",
                "controlnet_cond_embedding.conv_out.weight",
            ),
        ];
        for (original, diffusers) in cases {
            assert_eq!(
                original_name(original, 2, 14).as_deref(),
                Some(diffusers),
                "{original}"
            );
        }
        assert_eq!(original_name("input_hint_block.3.weight", 2, 14), None);
        assert_eq!(
            original_name("output_blocks.0.0.in_layers.0.weight", 2, 14),
            None
        );
    }
}
