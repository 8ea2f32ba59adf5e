//! The components' configs of a single file: the released models' configs with every size the
//! tensors show taken from the tensors.

use super::detect::{
    first_keys, SingleFileArch, CLIP_PREFIX, KEY_CONV_IN, OPEN_CLIP_PREFIX,
    OPEN_CLIP_REFINER_PREFIX, OPEN_CLIP_SDXL_PREFIX, UNET_PREFIX,
};
use super::file::SingleFile;
use crate::autoencoder_kl::AutoencoderKLConfig;
use crate::clip::ClipTextConfig;
use crate::config::PerBlock;
use crate::error::{ModelError, Result};
use crate::unet_2d_condition::UNet2DConditionConfig;

impl SingleFile {
    /// The UNet config: the released model's (SD 1.5, SD 2.1, SDXL base) with the channels,
    /// block types, depths, context width and projection type read from the tensors. Head
    /// counts follow the released models (8 heads for SD 1, 64 channels a head for SD 2 and
    /// SDXL); `norm_num_groups` (32) cannot be read from a tensor: a checkpoint with other
    /// values needs a `config` folder.
    pub fn unet_config(&self, prediction_v: bool) -> Result<UNet2DConditionConfig> {
        let p = UNET_PREFIX;
        let layers = self.unet_layers_per_block()?;
        let n = self.count_indices(&format!("{p}input_blocks."));
        let blocks = n / (layers + 1);
        let mut channels = Vec::with_capacity(blocks);
        let mut down = Vec::with_capacity(blocks);
        let mut depth = Vec::with_capacity(blocks);
        let mut context_dim = None;
        let mut linear = false;
        for b in 0..blocks {
            let first = 1 + b * (layers + 1);
            channels.push(self.dim(&format!("{p}input_blocks.{first}.0.out_layers.3.weight"), 0)?);
            let attn = format!("{p}input_blocks.{first}.1.");
            if let Some(shape) = self.shape(&format!("{attn}proj_in.weight")) {
                linear = shape.len() == 2;
                down.push("CrossAttnDownBlock2D".to_string());
                depth.push(self.count_indices(&format!("{attn}transformer_blocks.")));
                context_dim.get_or_insert(
                    self.dim(&format!("{attn}transformer_blocks.0.attn2.to_k.weight"), 1)?,
                );
            } else {
                down.push("DownBlock2D".to_string());
                depth.push(1);
            }
        }
        let up = (0..blocks)
            .map(|b| {
                let attn = format!("{p}output_blocks.{}.1.proj_in.weight", b * (layers + 1));
                if self.weights.contains(&attn) {
                    "CrossAttnUpBlock2D".to_string()
                } else {
                    "UpBlock2D".to_string()
                }
            })
            .collect();
        let mid = if self
            .weights
            .contains(&format!("{p}middle_block.1.proj_in.weight"))
        {
            "UNetMidBlock2DCrossAttn"
        } else {
            "UNetMidBlock2D"
        };
        let heads = match self.arch {
            SingleFileArch::Sd1 => PerBlock::One(8),
            _ => PerBlock::Each(channels.iter().map(|c| (c / 64).max(1)).collect()),
        };
        let mut config = UNet2DConditionConfig {
            sample_size: Some(PerBlock::One(self.default_image_size(prediction_v) / 8)),
            in_channels: self.dim(KEY_CONV_IN, 1)?,
            out_channels: self.dim(&format!("{p}out.2.weight"), 0)?,
            down_block_types: down,
            mid_block_type: Some(mid.into()),
            up_block_types: up,
            block_out_channels: channels,
            layers_per_block: PerBlock::One(layers),
            cross_attention_dim: PerBlock::One(context_dim.unwrap_or(768)),
            transformer_layers_per_block: if depth.iter().all(|&d| d == 1) {
                PerBlock::One(1)
            } else {
                PerBlock::Each(depth)
            },
            attention_head_dim: heads,
            use_linear_projection: linear,
            upcast_attention: self.arch == SingleFileArch::Sd2 && prediction_v,
            ..UNet2DConditionConfig::default()
        };
        if let Some(ids) = self.time_ids() {
            config.addition_embed_type = Some("text_time".into());
            // `add_embedding` takes the pooled text embeds and 6 sinusoidal time ids (5 for the
            // refiner, whose last id is the aesthetic score): 2816 = 1280 + 6 * 256 for SDXL
            // base, 2560 = 1280 + 5 * 256 for the refiner.
            let input = self.dim(&format!("{p}label_emb.0.0.weight"), 1)?;
            let prefix = self.open_clip_prefix().unwrap_or(OPEN_CLIP_SDXL_PREFIX);
            let pooled = self.dim(&format!("{prefix}text_projection"), 1)?;
            let per_id = input.saturating_sub(pooled) / ids;
            if per_id == 0 || pooled + ids * per_id != input {
                return Err(ModelError::UnknownArchitecture {
                    path: self.path.clone(),
                    reason: format!(
                        "the UNet's `label_emb.0.0.weight` takes {input} inputs, which is not \
                         the pooled text width {pooled} plus {ids} time-id embeddings"
                    ),
                    looked_for: format!("`{p}label_emb.0.0.weight`"),
                    found: first_keys(&self.weights),
                });
            }
            config.addition_time_embed_dim = Some(per_id);
            config.projection_class_embeddings_input_dim = Some(input);
        }
        Ok(config)
    }

    /// How many time ids SDXL's added condition embeds: 6 for the base (original size, crop,
    /// target size), 5 for the refiner (original size, crop, aesthetic score); `None` for SD.
    pub fn time_ids(&self) -> Option<usize> {
        match self.arch {
            SingleFileArch::SdxlBase => Some(6),
            SingleFileArch::SdxlRefiner => Some(5),
            SingleFileArch::Sd1 | SingleFileArch::Sd2 => None,
        }
    }

    /// The VAE config: channels, depth and latent width from the tensors, the scaling factor of
    /// the released model (0.13025 for SDXL, else 0.18215).
    pub fn vae_config(&self, prediction_v: bool) -> Result<AutoencoderKLConfig> {
        let p = self.vae_prefix();
        let blocks = self.count_indices(&format!("{p}encoder.down."));
        let channels = (0..blocks)
            .map(|i| self.dim(&format!("{p}encoder.down.{i}.block.0.conv2.weight"), 0))
            .collect::<Result<Vec<_>>>()?;
        Ok(AutoencoderKLConfig {
            in_channels: self.dim(&format!("{p}encoder.conv_in.weight"), 1)?,
            out_channels: self.dim(&format!("{p}decoder.conv_out.weight"), 0)?,
            down_block_types: vec!["DownEncoderBlock2D".into(); blocks],
            up_block_types: vec!["UpDecoderBlock2D".into(); blocks],
            block_out_channels: channels,
            layers_per_block: self.count_indices(&format!("{p}encoder.down.0.block.")),
            latent_channels: self.dim(&format!("{p}decoder.conv_in.weight"), 1)?,
            sample_size: Some(self.default_image_size(prediction_v)),
            scaling_factor: if self.arch.is_sdxl() {
                0.13025
            } else {
                0.18215
            },
            ..AutoencoderKLConfig::default()
        })
    }

    /// The first text encoder's config: widths, depth and vocabulary from the tensors, 64
    /// channels a head, the activation of the released encoder (quick GELU for CLIP ViT-L,
    /// GELU for OpenCLIP); SD 2 uses all but the last OpenCLIP block.
    pub fn text_encoder_config(&self) -> Result<ClipTextConfig> {
        match self.arch {
            SingleFileArch::Sd2 => {
                let blocks =
                    self.count_indices(&format!("{OPEN_CLIP_PREFIX}transformer.resblocks."));
                let mut config = self.open_clip_config(OPEN_CLIP_PREFIX)?;
                config.num_hidden_layers = blocks.saturating_sub(1).max(1);
                config.projection_dim = 512;
                Ok(config)
            }
            _ => {
                let prefix = self.clip_prefix().unwrap_or(CLIP_PREFIX);
                let t = format!("{prefix}text_model.");
                let token = format!("{t}embeddings.token_embedding.weight");
                let hidden = self.dim(&token, 1)?;
                Ok(ClipTextConfig {
                    vocab_size: self.dim(&token, 0)?,
                    hidden_size: hidden,
                    intermediate_size: self
                        .dim(&format!("{t}encoder.layers.0.mlp.fc1.weight"), 0)?,
                    projection_dim: hidden,
                    num_hidden_layers: self.count_indices(&format!("{t}encoder.layers.")),
                    num_attention_heads: self.clip_heads(hidden)?,
                    max_position_embeddings: self
                        .dim(&format!("{t}embeddings.position_embedding.weight"), 0)?,
                    hidden_act: "quick_gelu".into(),
                    bos_token_id: 0,
                    eos_token_id: 2,
                    pad_token_id: Some(1),
                    ..ClipTextConfig::default()
                })
            }
        }
    }

    /// 64 channels a head, as every released CLIP/OpenCLIP text encoder has.
    fn clip_heads(&self, hidden: usize) -> Result<usize> {
        if hidden == 0 || !hidden.is_multiple_of(64) {
            return Err(ModelError::Config {
                path: self.path.clone(),
                reason: format!(
                    "the text encoder is {hidden} wide, not a multiple of the released \
                     encoders' 64 channels a head: its head count cannot be inferred, pass the \
                     matching diffusers folder as `config`"
                ),
            });
        }
        Ok(hidden / 64)
    }

    /// SDXL's `text_encoder_2` config (OpenCLIP bigG, every block, with projection; the
    /// refiner's from `conditioner.embedders.0.model.`).
    pub fn text_encoder_2_config(&self) -> Result<ClipTextConfig> {
        let prefix = match self.arch {
            SingleFileArch::SdxlRefiner => OPEN_CLIP_REFINER_PREFIX,
            _ => OPEN_CLIP_SDXL_PREFIX,
        };
        let mut config = self.open_clip_config(prefix)?;
        config.num_hidden_layers = self.count_indices(&format!("{prefix}transformer.resblocks."));
        config.projection_dim = self.dim(&format!("{prefix}text_projection"), 1)?;
        Ok(config)
    }

    fn open_clip_config(&self, prefix: &str) -> Result<ClipTextConfig> {
        let token = format!("{prefix}token_embedding.weight");
        let hidden = self.dim(&token, 1)?;
        Ok(ClipTextConfig {
            vocab_size: self.dim(&token, 0)?,
            hidden_size: hidden,
            intermediate_size: self.dim(
                &format!("{prefix}transformer.resblocks.0.mlp.c_fc.weight"),
                0,
            )?,
            projection_dim: hidden,
            num_hidden_layers: 0,
            num_attention_heads: self.clip_heads(hidden)?,
            max_position_embeddings: self.dim(&format!("{prefix}positional_embedding"), 0)?,
            hidden_act: "gelu".into(),
            bos_token_id: 0,
            eos_token_id: 2,
            pad_token_id: Some(1),
            ..ClipTextConfig::default()
        })
    }

    /// The image size the released model was trained at (diffusers'
    /// `DIFFUSERS_TO_LDM_DEFAULT_IMAGE_SIZE_MAP`; 512 for SD 2 base, an epsilon model, and for
    /// SD 2 inpainting).
    pub fn default_image_size(&self, prediction_v: bool) -> usize {
        match self.arch {
            SingleFileArch::Sd1 => 512,
            SingleFileArch::Sd2 if prediction_v => 768,
            SingleFileArch::Sd2 => 512,
            SingleFileArch::SdxlBase | SingleFileArch::SdxlRefiner => 1024,
        }
    }

    /// Whether an SD 2 checkpoint predicts v, as diffusers decides without a config: v unless
    /// the checkpoint's `global_step` is 875000 (SD 2 base). SD 2 inpainting (released as
    /// `stable-diffusion-2-inpainting`, epsilon) and other architectures predict noise.
    pub fn predicts_v(&self) -> bool {
        if self.arch != SingleFileArch::Sd2 || self.inpainting {
            return false;
        }
        match self.weights.read_f32("global_step") {
            Ok((values, _)) => values.first().is_none_or(|&s| s != 875000.0),
            Err(_) => true,
        }
    }
}
