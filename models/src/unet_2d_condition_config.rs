//! `UNet2DConditionConfig`: `unet/config.json` with diffusers' defaults, and the checks that
//! refuse what the UNet (and the ControlNet built from the same fields) does not implement.

use std::path::Path;

use serde::Deserialize;

use crate::config::{
    check_at_most, check_groups, load_json, PerBlock, MAX_DIMENSION, MAX_SAMPLE_SIZE,
};
use crate::error::{ModelError, Result};
use crate::nn::Activation;

/// `unet/config.json`, with diffusers' defaults.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct UNet2DConditionConfig {
    pub sample_size: Option<PerBlock<usize>>,
    pub in_channels: usize,
    pub out_channels: usize,
    pub center_input_sample: bool,
    pub flip_sin_to_cos: bool,
    pub freq_shift: f64,
    pub down_block_types: Vec<String>,
    pub mid_block_type: Option<String>,
    pub up_block_types: Vec<String>,
    pub only_cross_attention: PerBlock<bool>,
    pub block_out_channels: Vec<usize>,
    pub layers_per_block: PerBlock<usize>,
    pub downsample_padding: usize,
    pub mid_block_scale_factor: f64,
    pub act_fn: String,
    pub norm_num_groups: usize,
    pub norm_eps: f64,
    pub cross_attention_dim: PerBlock<usize>,
    pub transformer_layers_per_block: PerBlock<usize>,
    pub attention_head_dim: PerBlock<usize>,
    pub num_attention_heads: Option<PerBlock<usize>>,
    pub dual_cross_attention: bool,
    pub use_linear_projection: bool,
    /// Only changes numerics in half precision (attention scores in f32); oxidiff computes
    /// attention scores in the activation dtype, which is f32 on the CPU.
    pub upcast_attention: bool,
    pub class_embed_type: Option<String>,
    pub addition_embed_type: Option<String>,
    pub encoder_hid_dim_type: Option<String>,
    pub time_cond_proj_dim: Option<usize>,
    /// SDXL (`addition_embed_type: "text_time"`): the sinusoidal width of each `time_ids` entry.
    pub addition_time_embed_dim: Option<usize>,
    /// SDXL: the input width of `add_embedding` (pooled text embeds + 6 time-id embeddings).
    pub projection_class_embeddings_input_dim: Option<usize>,
    /// A list that replaces the reversed `transformer_layers_per_block` of the up blocks.
    pub reverse_transformer_layers_per_block: Option<serde_json::Value>,
    pub resnet_time_scale_shift: String,
    pub time_embedding_type: String,
    pub conv_in_kernel: usize,
    pub conv_out_kernel: usize,
}

impl Default for UNet2DConditionConfig {
    fn default() -> Self {
        Self {
            sample_size: None,
            in_channels: 4,
            out_channels: 4,
            center_input_sample: false,
            flip_sin_to_cos: true,
            freq_shift: 0.0,
            down_block_types: vec![
                "CrossAttnDownBlock2D".into(),
                "CrossAttnDownBlock2D".into(),
                "CrossAttnDownBlock2D".into(),
                "DownBlock2D".into(),
            ],
            mid_block_type: Some("UNetMidBlock2DCrossAttn".into()),
            up_block_types: vec![
                "UpBlock2D".into(),
                "CrossAttnUpBlock2D".into(),
                "CrossAttnUpBlock2D".into(),
                "CrossAttnUpBlock2D".into(),
            ],
            only_cross_attention: PerBlock::One(false),
            block_out_channels: vec![320, 640, 1280, 1280],
            layers_per_block: PerBlock::One(2),
            downsample_padding: 1,
            mid_block_scale_factor: 1.0,
            act_fn: "silu".into(),
            norm_num_groups: 32,
            norm_eps: 1e-5,
            cross_attention_dim: PerBlock::One(1280),
            transformer_layers_per_block: PerBlock::One(1),
            attention_head_dim: PerBlock::One(8),
            num_attention_heads: None,
            dual_cross_attention: false,
            use_linear_projection: false,
            upcast_attention: false,
            class_embed_type: None,
            addition_embed_type: None,
            encoder_hid_dim_type: None,
            time_cond_proj_dim: None,
            addition_time_embed_dim: None,
            projection_class_embeddings_input_dim: None,
            reverse_transformer_layers_per_block: None,
            resnet_time_scale_shift: "default".into(),
            time_embedding_type: "positional".into(),
            conv_in_kernel: 3,
            conv_out_kernel: 3,
        }
    }
}

/// More layers per block than any released UNet has (SDXL: 10 transformer layers); a larger
/// count in a config is a corrupt or hostile file, refused before any layer is built.
const MAX_LAYERS_PER_BLOCK: usize = 64;

impl UNet2DConditionConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let config: Self = load_json(path)?;
        config.validate(path)?;
        Ok(config)
    }

    /// Rejects configurations this model does not implement, naming the field.
    pub fn validate(&self, path: &Path) -> Result<()> {
        let unsupported = |reason: String| {
            Err(ModelError::Unsupported {
                path: path.to_path_buf(),
                reason,
            })
        };
        let n = self.block_out_channels.len();
        self.check_sizes(path)?;
        if n == 0 || self.down_block_types.len() != n || self.up_block_types.len() != n {
            return Err(ModelError::Config {
                path: path.to_path_buf(),
                reason: format!(
                    "`down_block_types` ({}), `up_block_types` ({}) and `block_out_channels` ({}) \
                     must have the same, non-zero length",
                    self.down_block_types.len(),
                    self.up_block_types.len(),
                    n
                ),
            });
        }
        for name in &self.down_block_types {
            if !matches!(name.as_str(), "CrossAttnDownBlock2D" | "DownBlock2D") {
                return unsupported(format!("down block type `{name}`"));
            }
        }
        for name in &self.up_block_types {
            if !matches!(name.as_str(), "CrossAttnUpBlock2D" | "UpBlock2D") {
                return unsupported(format!("up block type `{name}`"));
            }
        }
        if let Some(mid) = &self.mid_block_type {
            if !matches!(mid.as_str(), "UNetMidBlock2DCrossAttn" | "UNetMidBlock2D") {
                return unsupported(format!("mid block type `{mid}`"));
            }
        }
        let optional = [
            ("class_embed_type", &self.class_embed_type),
            ("encoder_hid_dim_type", &self.encoder_hid_dim_type),
        ];
        for (field, value) in optional {
            if let Some(v) = value {
                return unsupported(format!(
                    "`{field}: {v}` (SD 1.x/2.x and SDXL UNets have none)"
                ));
            }
        }
        match self.addition_embed_type.as_deref() {
            None => {}
            Some("text_time")
                if self
                    .addition_time_embed_dim
                    .is_none_or(|d| d == 0 || d % 2 == 1)
                    || self
                        .projection_class_embeddings_input_dim
                        .is_none_or(|d| d == 0) =>
            {
                return Err(ModelError::Config {
                    path: path.to_path_buf(),
                    reason: "`addition_embed_type: text_time` needs an even \
                             `addition_time_embed_dim` and a positive \
                             `projection_class_embeddings_input_dim`"
                        .into(),
                });
            }
            Some("text_time") => {}
            Some(v) => {
                return unsupported(format!(
                    "`addition_embed_type: {v}` (only SDXL's `text_time` is implemented)"
                ))
            }
        }
        if self
            .reverse_transformer_layers_per_block
            .as_ref()
            .is_some_and(|v| !v.is_null())
        {
            return unsupported("`reverse_transformer_layers_per_block`".into());
        }
        if self.time_cond_proj_dim.is_some() {
            return unsupported("`time_cond_proj_dim` (guidance-distilled UNets)".into());
        }
        if self.dual_cross_attention {
            return unsupported("`dual_cross_attention`".into());
        }
        if self.resnet_time_scale_shift != "default" {
            return unsupported(format!(
                "`resnet_time_scale_shift: {}`",
                self.resnet_time_scale_shift
            ));
        }
        if self.time_embedding_type != "positional" {
            return unsupported(format!(
                "`time_embedding_type: {}`",
                self.time_embedding_type
            ));
        }
        if self.mid_block_scale_factor != 1.0 {
            return unsupported("`mid_block_scale_factor` other than 1".into());
        }
        if self.conv_in_kernel.is_multiple_of(2) || self.conv_out_kernel.is_multiple_of(2) {
            return unsupported("even `conv_in_kernel`/`conv_out_kernel`".into());
        }
        if Activation::from_name(&self.act_fn).is_none() {
            return unsupported(format!("`act_fn: {}`", self.act_fn));
        }
        let depths = [
            ("layers_per_block", &self.layers_per_block),
            (
                "transformer_layers_per_block",
                &self.transformer_layers_per_block,
            ),
        ];
        for (field, depth) in depths {
            let deepest = depth.expand(n, field, path)?.into_iter().max().unwrap_or(0);
            if deepest > MAX_LAYERS_PER_BLOCK {
                return Err(ModelError::Config {
                    path: path.to_path_buf(),
                    reason: format!(
                        "`{field}: {deepest}` is not a real UNet (at most \
                         {MAX_LAYERS_PER_BLOCK} layers per block are accepted)"
                    ),
                });
            }
        }
        check_groups(
            self.norm_num_groups,
            &self.block_out_channels,
            "block_out_channels",
            path,
        )?;
        let heads = self.heads(path)?;
        for (&channels, &h) in self.block_out_channels.iter().zip(&heads) {
            if h == 0 || !channels.is_multiple_of(h) {
                return Err(ModelError::Config {
                    path: path.to_path_buf(),
                    reason: format!(
                        "{channels} channels cannot be split into {h} attention heads \
                         (`attention_head_dim`/`num_attention_heads` must divide \
                         `block_out_channels`)"
                    ),
                });
            }
        }
        Ok(())
    }

    /// Bounds every size the model builds tables or layers from before the weights are read
    /// (a timestep table from `block_out_channels[0]`, the default latents from `sample_size`).
    fn check_sizes(&self, path: &Path) -> Result<()> {
        let each = |p: &PerBlock<usize>| match p {
            PerBlock::One(v) => vec![*v],
            PerBlock::Each(list) => list.clone(),
        };
        let mut sizes: Vec<(&str, usize)> = vec![
            ("in_channels", self.in_channels),
            ("out_channels", self.out_channels),
            ("norm_num_groups", self.norm_num_groups),
            ("conv_in_kernel", self.conv_in_kernel),
            ("conv_out_kernel", self.conv_out_kernel),
            (
                "block_out_channels (entries)",
                self.block_out_channels.len(),
            ),
        ];
        sizes.extend(
            self.block_out_channels
                .iter()
                .map(|&c| ("block_out_channels", c)),
        );
        sizes.extend(
            each(&self.cross_attention_dim)
                .into_iter()
                .map(|c| ("cross_attention_dim", c)),
        );
        sizes.extend(
            each(&self.attention_head_dim)
                .into_iter()
                .map(|c| ("attention_head_dim", c)),
        );
        if let Some(heads) = &self.num_attention_heads {
            sizes.extend(each(heads).into_iter().map(|c| ("num_attention_heads", c)));
        }
        let optional = [
            ("addition_time_embed_dim", self.addition_time_embed_dim),
            (
                "projection_class_embeddings_input_dim",
                self.projection_class_embeddings_input_dim,
            ),
            ("time_cond_proj_dim", self.time_cond_proj_dim),
        ];
        sizes.extend(optional.iter().filter_map(|(f, v)| v.map(|v| (*f, v))));
        for (field, value) in sizes {
            check_at_most(field, value, MAX_DIMENSION, path)?;
        }
        if let Some(sample) = &self.sample_size {
            for v in each(sample) {
                check_at_most("sample_size", v, MAX_SAMPLE_SIZE, path)?;
            }
        }
        Ok(())
    }

    /// Attention heads per block. diffusers' configs call this `attention_head_dim` for
    /// historical reasons: it is the number of heads unless `num_attention_heads` is given.
    pub fn heads(&self, path: &Path) -> Result<Vec<usize>> {
        let n = self.block_out_channels.len();
        match &self.num_attention_heads {
            Some(h) => h.expand(n, "num_attention_heads", path),
            None => self
                .attention_head_dim
                .expand(n, "attention_head_dim", path),
        }
    }
}
