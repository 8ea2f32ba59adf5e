//! `PixArtTransformer2DModel`: the diffusion transformer of PixArt-Alpha and PixArt-Sigma, as
//! diffusers' `pixart_transformer_2d.py`.
//!
//! Latents are cut into patches (`pos_embed`), the timestep is embedded once and projected to
//! every block's modulation (`adaln_single`, adaLN-single), the T5 caption is projected to the
//! model width (`caption_projection`); each block modulates a self-attention and a
//! feed-forward and cross-attends to the caption (with its padding mask); the final layer
//! modulates, projects and un-patches. With learned sigma (`out_channels` 8) the output holds
//! the noise prediction and the variance; pipelines keep the first `in_channels`.

use std::path::Path;

use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor, TensorData};
use serde::Deserialize;

use crate::attention::{Attention, AttentionSpec, FeedForward, FeedForwardActivation};
use crate::config::load_json;
use crate::dtype::{cast_to, dtype_of};
use crate::embeddings::{MicroConditions, PatchEmbed, PixArtAlphaTextProjection};
use crate::error::{ModelError, Result};
use crate::nn::{layer_norm, Linear};
use crate::normalization::{modulate, AdaLayerNormSingle};
use crate::parallel::block_widths;
use crate::unet_2d_condition::transformer_block_rules;
use crate::var_builder::{load_component, VarBuilder};
use oxidiff_parallel::{ShardRule, ShardedWidth, TensorParallel, TensorParallelPlan};

/// `transformer/config.json`.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct PixArtTransformer2DConfig {
    pub num_attention_heads: usize,
    pub attention_head_dim: usize,
    pub in_channels: usize,
    pub out_channels: Option<usize>,
    pub num_layers: usize,
    pub cross_attention_dim: Option<usize>,
    pub attention_bias: bool,
    pub sample_size: usize,
    pub patch_size: usize,
    pub activation_fn: String,
    pub norm_type: String,
    pub norm_elementwise_affine: bool,
    pub norm_eps: f64,
    pub interpolation_scale: Option<f64>,
    pub use_additional_conditions: Option<bool>,
    pub caption_channels: Option<usize>,
    pub attention_type: Option<String>,
}

impl Default for PixArtTransformer2DConfig {
    fn default() -> Self {
        // diffusers' defaults (PixArt-XL-2).
        Self {
            num_attention_heads: 16,
            attention_head_dim: 72,
            in_channels: 4,
            out_channels: Some(8),
            num_layers: 28,
            cross_attention_dim: Some(1152),
            attention_bias: true,
            sample_size: 128,
            patch_size: 2,
            activation_fn: "gelu-approximate".into(),
            norm_type: "ada_norm_single".into(),
            norm_elementwise_affine: false,
            norm_eps: 1e-6,
            interpolation_scale: None,
            use_additional_conditions: None,
            caption_channels: None,
            attention_type: Some("default".into()),
        }
    }
}

impl PixArtTransformer2DConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let config: Self = load_json(path)?;
        crate::config::check_transformer_sizes(
            path,
            &[
                ("in_channels", config.in_channels),
                ("out_channels", config.out_channels.unwrap_or(0)),
                (
                    "cross_attention_dim",
                    config.cross_attention_dim.unwrap_or(0),
                ),
                ("caption_channels", config.caption_channels.unwrap_or(0)),
            ],
            [
                ("num_attention_heads", config.num_attention_heads),
                ("attention_head_dim", config.attention_head_dim),
            ],
            &[("num_layers", config.num_layers)],
        )?;
        use crate::config::{check_at_most, MAX_SAMPLE_SIZE};
        check_at_most("sample_size", config.sample_size, MAX_SAMPLE_SIZE, path)?;
        let unsupported = |reason: String| ModelError::Unsupported {
            path: path.to_path_buf(),
            reason,
        };
        if config.norm_type != "ada_norm_single" {
            return Err(unsupported(format!(
                "`norm_type: {}` (PixArt uses ada_norm_single)",
                config.norm_type
            )));
        }
        if config.norm_elementwise_affine {
            return Err(unsupported("`norm_elementwise_affine: true`".into()));
        }
        if let Some(kind) = config.attention_type.as_deref() {
            if kind != "default" {
                return Err(unsupported(format!("`attention_type: {kind}`")));
            }
        }
        if FeedForwardActivation::from_name(&config.activation_fn).is_none() {
            return Err(unsupported(format!(
                "`activation_fn: {}`",
                config.activation_fn
            )));
        }
        if config.patch_size == 0 || config.num_attention_heads == 0 || config.num_layers == 0 {
            return Err(ModelError::Config {
                path: path.to_path_buf(),
                reason: "`patch_size`, `num_attention_heads` and `num_layers` must be positive"
                    .into(),
            });
        }
        if config.uses_additional_conditions() && !config.inner_dim().is_multiple_of(3) {
            return Err(ModelError::Config {
                path: path.to_path_buf(),
                reason: format!(
                    "micro-conditions need a width divisible by 3, got {}",
                    config.inner_dim()
                ),
            });
        }
        Ok(config)
    }

    /// The model width, `num_attention_heads * attention_head_dim`.
    pub fn inner_dim(&self) -> usize {
        self.num_attention_heads * self.attention_head_dim
    }

    pub fn out_channels(&self) -> usize {
        self.out_channels.unwrap_or(self.in_channels)
    }

    /// diffusers' default: micro-conditions for the 1024px models (`sample_size` 128).
    pub fn uses_additional_conditions(&self) -> bool {
        self.use_additional_conditions
            .unwrap_or(self.sample_size == 128)
    }

    /// diffusers' default: `max(sample_size / 64, 1)`.
    pub fn interpolation_scale(&self) -> f64 {
        self.interpolation_scale
            .unwrap_or_else(|| (self.sample_size / 64).max(1) as f64)
    }
}

/// diffusers' `BasicTransformerBlock` with `norm_type: ada_norm_single`: modulated
/// self-attention, cross-attention to the caption, modulated feed-forward, the norms without
/// parameters and the per-block `scale_shift_table` `[6, dim]` added to the shared modulation.
#[derive(Module, Debug)]
pub struct PixArtTransformerBlock<B: Backend> {
    pub attn1: Attention<B>,
    pub attn2: Attention<B>,
    pub ff: FeedForward<B>,
    pub scale_shift_table: Param<Tensor<B, 2>>,
    pub norm_eps: f64,
}

impl<B: Backend> PixArtTransformerBlock<B> {
    fn load(vb: &VarBuilder<B>, cfg: &PixArtTransformer2DConfig) -> Result<Self> {
        let dim = cfg.inner_dim();
        let spec = |context_dim| AttentionSpec {
            query_dim: dim,
            context_dim,
            heads: cfg.num_attention_heads,
            head_dim: cfg.attention_head_dim,
            qkv_bias: cfg.attention_bias,
        };
        let act = FeedForwardActivation::from_name(&cfg.activation_fn)
            .unwrap_or(FeedForwardActivation::GeluTanh);
        Ok(Self {
            attn1: Attention::load(&vb.pp("attn1"), spec(dim))?,
            attn2: Attention::load(
                &vb.pp("attn2"),
                spec(cfg.cross_attention_dim.unwrap_or(dim)),
            )?,
            ff: FeedForward::load_with(&vb.pp("ff"), dim, dim * 4, act)?,
            scale_shift_table: vb.param("scale_shift_table", [6, dim])?,
            norm_eps: cfg.norm_eps,
        })
    }

    /// `modulation` `[batch, 6 * dim]`; `caption_bias` the cross-attention mask as a logit bias.
    fn forward(
        &self,
        x: Tensor<B, 3>,
        caption: Tensor<B, 3>,
        caption_bias: Option<Tensor<B, 4>>,
        modulation: Tensor<B, 2>,
    ) -> Tensor<B, 3> {
        let [b, _, dim] = x.dims();
        let table = self.scale_shift_table.val().unsqueeze::<3>() + modulation.reshape([b, 6, dim]);
        let part = |i: usize| table.clone().narrow(1, i, 1);
        let (shift_msa, scale_msa, gate_msa) = (part(0), part(1), part(2));
        let (shift_mlp, scale_mlp, gate_mlp) = (part(3), part(4), part(5));

        let h = modulate(layer_norm(x.clone(), self.norm_eps), shift_msa, scale_msa);
        let x = gate_msa * self.attn1.forward(h, None) + x;
        let x = self
            .attn2
            .forward_with_bias(x.clone(), Some(caption), caption_bias)
            + x;
        let h = modulate(layer_norm(x.clone(), self.norm_eps), shift_mlp, scale_mlp);
        gate_mlp * self.ff.forward(h) + x
    }
}

/// diffusers' `PixArtTransformer2DModel`.
#[derive(Module, Debug)]
pub struct PixArtTransformer2DModel<B: Backend> {
    pub pos_embed: PatchEmbed<B>,
    pub transformer_blocks: Vec<PixArtTransformerBlock<B>>,
    /// `[2, dim]`: shift and scale of the final layer, added to the embedded timestep.
    pub scale_shift_table: Param<Tensor<B, 2>>,
    pub proj_out: Linear<B>,
    pub adaln_single: AdaLayerNormSingle<B>,
    pub caption_projection: Option<PixArtAlphaTextProjection<B>>,
    pub patch_size: usize,
    pub out_channels: usize,
    pub in_channels: usize,
}

impl<B: Backend> PixArtTransformer2DModel<B> {
    /// Loads a `transformer` folder.
    pub fn from_dir(dir: &Path, variant: Option<&str>, device: &B::Device) -> Result<Self> {
        Self::from_dir_in(dir, variant, FloatDType::F32, device)
    }

    /// The same, with the float weights held in `dtype`: read straight into it, so a checkpoint
    /// stored in it is used in place and any other is converted once, never through f32 (what
    /// the model computes at load, such as sinusoidal tables, is cast after).
    pub fn from_dir_in(
        dir: &Path,
        variant: Option<&str>,
        dtype: FloatDType,
        device: &B::Device,
    ) -> Result<Self> {
        let config = PixArtTransformer2DConfig::from_file(&dir.join("config.json"))?;
        load_component(
            dir,
            &["diffusion_pytorch_model"],
            variant,
            dtype,
            device,
            |vb| Self::load(&config, vb),
        )
    }

    pub fn load(cfg: &PixArtTransformer2DConfig, vb: VarBuilder<B>) -> Result<Self> {
        let dim = cfg.inner_dim();
        let p = cfg.patch_size;
        let out_channels = cfg.out_channels();
        let transformer_blocks = (0..cfg.num_layers)
            .map(|i| PixArtTransformerBlock::load(&vb.pp("transformer_blocks").pp(i), cfg))
            .collect::<Result<Vec<_>>>()?;
        let caption_projection = match cfg.caption_channels {
            Some(channels) => Some(PixArtAlphaTextProjection::load(
                &vb.pp("caption_projection"),
                channels,
                dim,
            )?),
            None => None,
        };
        Ok(Self {
            pos_embed: PatchEmbed::load(
                &vb.pp("pos_embed"),
                cfg.in_channels,
                dim,
                p,
                cfg.sample_size,
                cfg.interpolation_scale(),
            )?,
            transformer_blocks,
            scale_shift_table: vb.param("scale_shift_table", [2, dim])?,
            proj_out: Linear::load(&vb.pp("proj_out"), dim, p * p * out_channels, true)?,
            adaln_single: AdaLayerNormSingle::load(
                &vb.pp("adaln_single"),
                dim,
                cfg.uses_additional_conditions(),
            )?,
            caption_projection,
            patch_size: p,
            out_channels,
            in_channels: cfg.in_channels,
        })
    }

    /// The device the weights live on.
    pub fn device(&self) -> B::Device {
        self.proj_out.weight.device()
    }

    /// Whether the model takes micro-conditions (resolution, aspect ratio).
    pub fn uses_micro_conditions(&self) -> bool {
        self.adaln_single.emb.sizes.is_some()
    }

    /// diffusers' `(1 - mask) * -10000` bias `[batch, 1, 1, seq]` from a 0/1 caption mask.
    pub fn caption_mask_bias(mask: &[Vec<u32>], device: &B::Device) -> Tensor<B, 4> {
        let (batch, seq) = (mask.len(), mask.first().map(Vec::len).unwrap_or(0));
        let values: Vec<f32> = mask
            .iter()
            .flatten()
            .map(|&m| (1.0 - m as f32) * -10000.0)
            .collect();
        Tensor::<B, 2>::from_data(TensorData::new(values, [batch, seq]), device)
            .reshape([batch, 1, 1, seq])
    }

    /// Checks the shapes of a call: latents `[batch, in_channels, h, w]` with h and w
    /// multiples of the patch size, `batch` timesteps and caption rows, and the
    /// micro-conditions when the model uses them.
    pub fn check_inputs(
        &self,
        latents: [usize; 4],
        timesteps: usize,
        caption: [usize; 3],
        has_conditions: bool,
    ) -> Result<()> {
        let [b, c, h, w] = latents;
        let p = self.patch_size;
        if c != self.in_channels || h % p != 0 || w % p != 0 {
            return Err(ModelError::Input(format!(
                "the transformer takes latents [batch, {}, h, w] with h and w multiples of {p}, \
                 got {latents:?}",
                self.in_channels,
            )));
        }
        if caption[0] != b || timesteps != b {
            return Err(ModelError::Input(format!(
                "batch sizes differ: latents {b}, caption {}, timesteps {timesteps}",
                caption[0]
            )));
        }
        if self.uses_micro_conditions() && !has_conditions {
            return Err(ModelError::Input(
                "this transformer uses micro-conditions (resolution and aspect ratio); pass them"
                    .into(),
            ));
        }
        Ok(())
    }

    /// One denoiser call: latents `[batch, in_channels, h, w]`, timesteps `[batch]`, caption
    /// `[batch, seq, caption_channels]` with its mask bias
    /// ([`caption_mask_bias`](Self::caption_mask_bias)), and the micro-conditions when the
    /// model uses them. Returns `[batch, out_channels, h, w]`.
    pub fn forward(
        &self,
        latents: Tensor<B, 4>,
        timestep: Tensor<B, 1>,
        caption: Tensor<B, 3>,
        caption_bias: Option<Tensor<B, 4>>,
        conditions: Option<&MicroConditions<B>>,
    ) -> Result<Tensor<B, 4>> {
        self.check_inputs(
            latents.dims(),
            timestep.dims()[0],
            caption.dims(),
            conditions.is_some(),
        )?;
        Ok(self.forward_checked(latents, timestep, caption, caption_bias, conditions))
    }

    /// [`forward`](Self::forward) for inputs already passed through
    /// [`check_inputs`](Self::check_inputs) (a compiled step cannot return errors).
    pub fn forward_checked(
        &self,
        latents: Tensor<B, 4>,
        timestep: Tensor<B, 1>,
        caption: Tensor<B, 3>,
        caption_bias: Option<Tensor<B, 4>>,
        conditions: Option<&MicroConditions<B>>,
    ) -> Tensor<B, 4> {
        // Computed in the weights' dtype, returned in the caller's (see `crate::dtype`); the
        // timestep and micro-conditions stay as given: their sinusoidal projections are
        // computed in f32.
        let caller = dtype_of(&latents);
        let dtype = dtype_of(&self.proj_out.weight.val());
        let latents = cast_to(latents, dtype);
        let caption = cast_to(caption, dtype);
        let caption_bias = caption_bias.map(|bias| cast_to(bias, dtype));
        let [b, _, h, w] = latents.dims();
        let p = self.patch_size;
        let (gh, gw) = (h / p, w / p);
        let mut x = self.pos_embed.forward(latents);
        let (modulation, embedded) = self.adaln_single.forward(timestep, conditions);
        let caption = match &self.caption_projection {
            Some(projection) => projection.forward(caption),
            None => caption,
        };
        for block in &self.transformer_blocks {
            x = block.forward(x, caption.clone(), caption_bias.clone(), modulation.clone());
        }
        let table = self.scale_shift_table.val().unsqueeze::<3>() + embedded.unsqueeze_dim::<3>(1);
        let shift = table.clone().narrow(1, 0, 1);
        let scale = table.narrow(1, 1, 1);
        let x = modulate(layer_norm(x, 1e-6), shift, scale);
        let x = self.proj_out.forward(x);
        debug_assert_eq!(x.dims()[1], gh * gw);
        // Un-patch: [b, gh, gw, p, q, c] -> [b, c, gh, p, gw, q].
        let c_out = self.out_channels;
        let x: Tensor<B, 6> = x.reshape([b, gh, gw, p, p, c_out]);
        cast_to(
            x.permute([0, 5, 1, 3, 2, 4])
                .reshape([b, c_out, gh * p, gw * p]),
            caller,
        )
    }
}

const PIXART_RULES: [ShardRule; 10] = transformer_block_rules!("transformer_blocks.*");

/// PixArt's plan: each transformer block's attentions and feed-forward (GELU, so no packed
/// value and gate); the patch embedding, caption projection, adaLN-single and the final
/// projection stay replicated.
impl<B: Backend> TensorParallel for PixArtTransformer2DModel<B> {
    fn tensor_parallel_plan() -> TensorParallelPlan {
        TensorParallelPlan {
            model: "PixArtTransformer2DModel",
            rules: &PIXART_RULES,
        }
    }

    fn sharded_widths(&self) -> Vec<ShardedWidth> {
        self.transformer_blocks
            .iter()
            .enumerate()
            .flat_map(|(i, block)| {
                block_widths(
                    &format!("transformer_blocks.{i}"),
                    &[("attn1", &block.attn1), ("attn2", &block.attn2)],
                    &block.ff,
                )
            })
            .collect()
    }
}
