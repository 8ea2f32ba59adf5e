//! `SD3Transformer2DModel`: the MMDiT of Stable Diffusion 3 and 3.5, as diffusers'
//! `transformer_sd3.py`.
//!
//! Latents are cut into patches with a centre crop of a stored position table
//! (`pos_embed`, `pos_embed_max_size`); the timestep and the pooled text embedding make one
//! conditioning vector (`time_text_embed`); the text sequence is projected to the model width
//! (`context_embedder`). Each `JointTransformerBlock` modulates both streams with adaLN-Zero
//! and attends over them jointly; the last block only reads the context (`context_pre_only`).
//! SD3.5 adds per-head RMS norms of queries and keys (`qk_norm: rms_norm`), and SD3.5 Medium a
//! second, image-only attention in its first blocks (`dual_attention_layers`). The output is
//! modulated by the conditioning (`norm_out`), projected and un-patched.

use std::path::Path;

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor};
use oxidiff_parallel::{ShardRule, ShardedWidth, TensorParallel, TensorParallelPlan};
use serde::Deserialize;

use crate::attention::{FeedForward, FeedForwardActivation};
use crate::config::load_json;
use crate::dtype::{cast_to, dtype_of};
use crate::embeddings::{CombinedTimestepTextProjEmbeddings, PatchEmbed};
use crate::error::{ModelError, Result};
use crate::joint_attention::{
    ContextPreOnlyAttention, ImageSelfAttention, JointAttention, JointAttentionSpec,
};
use crate::memory::QuantizedBytes;
use crate::nn::{layer_norm, Linear};
use crate::normalization::{
    modulate, AdaLayerNormContinuous, AdaLayerNormZero, AdaLnZeroOutput, SD35AdaLayerNormZeroX,
};
use crate::var_builder::{load_component, VarBuilder};

/// `transformer/config.json`.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct SD3Transformer2DConfig {
    pub sample_size: usize,
    pub patch_size: usize,
    pub in_channels: usize,
    pub num_layers: usize,
    pub attention_head_dim: usize,
    pub num_attention_heads: usize,
    pub joint_attention_dim: usize,
    pub caption_projection_dim: usize,
    pub pooled_projection_dim: usize,
    pub out_channels: Option<usize>,
    pub pos_embed_max_size: usize,
    /// Blocks with a second, image-only attention (SD3.5 Medium: 0..=12).
    pub dual_attention_layers: Vec<usize>,
    /// `None` (SD3) or `rms_norm` (SD3.5).
    pub qk_norm: Option<String>,
}

impl Default for SD3Transformer2DConfig {
    fn default() -> Self {
        // diffusers' defaults (SD3 Medium).
        Self {
            sample_size: 128,
            patch_size: 2,
            in_channels: 16,
            num_layers: 18,
            attention_head_dim: 64,
            num_attention_heads: 18,
            joint_attention_dim: 4096,
            caption_projection_dim: 1152,
            pooled_projection_dim: 2048,
            out_channels: Some(16),
            pos_embed_max_size: 96,
            dual_attention_layers: Vec::new(),
            qk_norm: None,
        }
    }
}

impl SD3Transformer2DConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let config: Self = load_json(path)?;
        crate::config::check_transformer_sizes(
            path,
            &[
                ("in_channels", config.in_channels),
                ("out_channels", config.out_channels.unwrap_or(0)),
                ("joint_attention_dim", config.joint_attention_dim),
                ("caption_projection_dim", config.caption_projection_dim),
                ("pooled_projection_dim", config.pooled_projection_dim),
            ],
            [
                ("num_attention_heads", config.num_attention_heads),
                ("attention_head_dim", config.attention_head_dim),
            ],
            &[("num_layers", config.num_layers)],
        )?;
        use crate::config::{check_at_most, MAX_SAMPLE_SIZE};
        check_at_most("sample_size", config.sample_size, MAX_SAMPLE_SIZE, path)?;
        // The position table is `pos_embed_max_size^2` rows: SD3's 192 (96 for SD3.5 Medium's
        // 384); 1024 rows a side already covers 16384-pixel images at patch size 2.
        check_at_most("pos_embed_max_size", config.pos_embed_max_size, 1024, path)?;
        let invalid = |reason: String| ModelError::Config {
            path: path.to_path_buf(),
            reason,
        };
        if let Some(norm) = config.qk_norm.as_deref() {
            if norm != "rms_norm" {
                return Err(ModelError::Unsupported {
                    path: path.to_path_buf(),
                    reason: format!("`qk_norm: {norm}` (SD3 uses none, SD3.5 rms_norm)"),
                });
            }
        }
        if config.patch_size == 0
            || config.num_attention_heads == 0
            || config.attention_head_dim == 0
            || config.num_layers == 0
            || config.pos_embed_max_size == 0
        {
            return Err(invalid(
                "`patch_size`, `num_attention_heads`, `attention_head_dim`, `num_layers` and \
                 `pos_embed_max_size` must be positive"
                    .into(),
            ));
        }
        if config.num_layers > 1024 {
            return Err(invalid(format!(
                "`num_layers: {}` is not a real model",
                config.num_layers
            )));
        }
        if config.caption_projection_dim != config.inner_dim() {
            return Err(invalid(format!(
                "`caption_projection_dim` {} must equal the model width `num_attention_heads * \
                 attention_head_dim` = {} (the two streams attend jointly)",
                config.caption_projection_dim,
                config.inner_dim()
            )));
        }
        if let Some(&bad) = config
            .dual_attention_layers
            .iter()
            .find(|&&i| i >= config.num_layers)
        {
            return Err(invalid(format!(
                "`dual_attention_layers` names block {bad}, but there are {} blocks",
                config.num_layers
            )));
        }
        if config
            .dual_attention_layers
            .contains(&(config.num_layers - 1))
        {
            // The last block only reads the context; no released model gives it a second
            // attention (candle's MMDiT has no such block either).
            return Err(ModelError::Unsupported {
                path: path.to_path_buf(),
                reason: format!(
                    "`dual_attention_layers` names the last block {}, which is \
                     `context_pre_only`; dual attention is implemented for the other blocks",
                    config.num_layers - 1
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
}

/// The shape every block of one transformer shares.
#[derive(Debug, Clone, Copy)]
struct BlockSpec {
    dim: usize,
    attention: JointAttentionSpec,
}

impl BlockSpec {
    fn new(cfg: &SD3Transformer2DConfig) -> Self {
        Self {
            dim: cfg.inner_dim(),
            attention: JointAttentionSpec {
                dim: cfg.inner_dim(),
                heads: cfg.num_attention_heads,
                head_dim: cfg.attention_head_dim,
                qk_rms_norm: cfg.qk_norm.is_some(),
            },
        }
    }

    fn feed_forward<B: Backend>(&self, vb: &VarBuilder<B>, name: &str) -> Result<FeedForward<B>> {
        FeedForward::load_with(
            &vb.pp(name),
            self.dim,
            4 * self.dim,
            FeedForwardActivation::GeluTanh,
        )
    }
}

/// The gated feed-forward half of an adaLN-Zero stream: `x + gate_mlp * ff(modulated norm(x))`.
fn feed_forward_residual<B: Backend>(
    x: Tensor<B, 3>,
    m: AdaLnZeroOutput<B>,
    ff: &FeedForward<B>,
) -> Tensor<B, 3> {
    let h = modulate(layer_norm(x.clone(), 1e-6), m.shift_mlp, m.scale_mlp);
    x + m.gate_mlp * ff.forward(h)
}

/// A block that updates both streams: adaLN-Zero on each, joint attention, a feed-forward each
/// (candle's `MMDiTJointBlock`).
#[derive(Module, Debug)]
pub struct JointBlock<B: Backend> {
    pub norm1: AdaLayerNormZero<B>,
    pub norm1_context: AdaLayerNormZero<B>,
    pub attn: JointAttention<B>,
    pub ff: FeedForward<B>,
    pub ff_context: FeedForward<B>,
}

impl<B: Backend> JointBlock<B> {
    fn load(vb: &VarBuilder<B>, spec: BlockSpec) -> Result<Self> {
        Ok(Self {
            norm1: AdaLayerNormZero::load(&vb.pp("norm1"), spec.dim)?,
            norm1_context: AdaLayerNormZero::load(&vb.pp("norm1_context"), spec.dim)?,
            attn: JointAttention::load(&vb.pp("attn"), spec.attention)?,
            ff: spec.feed_forward(vb, "ff")?,
            ff_context: spec.feed_forward(vb, "ff_context")?,
        })
    }

    fn forward(
        &self,
        x: Tensor<B, 3>,
        context: Tensor<B, 3>,
        temb: Tensor<B, 2>,
    ) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let zero = self.norm1.forward(x.clone(), temb.clone());
        let m = self.norm1_context.forward(context.clone(), temb);
        let (attn, context_attn) = self.attn.forward(zero.x.clone(), m.x.clone());
        let x = feed_forward_residual(x + zero.gate_msa.clone() * attn, zero, &self.ff);
        let context = joint_context(context, m, context_attn, &self.ff_context);
        (context, x)
    }
}

/// The context stream of a block that updates it: `context + gate_msa * attention`, then its
/// feed-forward.
fn joint_context<B: Backend>(
    context: Tensor<B, 3>,
    m: AdaLnZeroOutput<B>,
    context_attn: Tensor<B, 3>,
    ff_context: &FeedForward<B>,
) -> Tensor<B, 3> {
    let context = context + m.gate_msa.clone() * context_attn;
    feed_forward_residual(context, m, ff_context)
}

/// SD3.5 Medium's first blocks (`use_dual_attention`): a [`JointBlock`] whose image stream also
/// attends to itself (`attn2`, modulated by the nine-chunk `SD35AdaLayerNormZeroX`; candle's
/// `MMDiTXJointBlock`).
#[derive(Module, Debug)]
pub struct DualAttentionJointBlock<B: Backend> {
    pub norm1: SD35AdaLayerNormZeroX<B>,
    pub norm1_context: AdaLayerNormZero<B>,
    pub attn: JointAttention<B>,
    pub attn2: ImageSelfAttention<B>,
    pub ff: FeedForward<B>,
    pub ff_context: FeedForward<B>,
}

impl<B: Backend> DualAttentionJointBlock<B> {
    fn load(vb: &VarBuilder<B>, spec: BlockSpec) -> Result<Self> {
        Ok(Self {
            norm1: SD35AdaLayerNormZeroX::load(&vb.pp("norm1"), spec.dim)?,
            norm1_context: AdaLayerNormZero::load(&vb.pp("norm1_context"), spec.dim)?,
            attn: JointAttention::load(&vb.pp("attn"), spec.attention)?,
            attn2: ImageSelfAttention::load(&vb.pp("attn2"), spec.attention)?,
            ff: spec.feed_forward(vb, "ff")?,
            ff_context: spec.feed_forward(vb, "ff_context")?,
        })
    }

    fn forward(
        &self,
        x: Tensor<B, 3>,
        context: Tensor<B, 3>,
        temb: Tensor<B, 2>,
    ) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let (zero, x2, gate2) = self.norm1.forward(x.clone(), temb.clone());
        let m = self.norm1_context.forward(context.clone(), temb);
        let (attn, context_attn) = self.attn.forward(zero.x.clone(), m.x.clone());
        let x = x + zero.gate_msa.clone() * attn;
        let x = x.clone() + gate2 * self.attn2.forward(x2);
        let x = feed_forward_residual(x, zero, &self.ff);
        let context = joint_context(context, m, context_attn, &self.ff_context);
        (context, x)
    }
}

/// The last block (`context_pre_only`): the context is attended to but not updated, so it has
/// a continuous norm and no `ff_context` (candle's `ContextQkvOnlyJointBlock`).
#[derive(Module, Debug)]
pub struct ContextPreOnlyJointBlock<B: Backend> {
    pub norm1: AdaLayerNormZero<B>,
    pub norm1_context: AdaLayerNormContinuous<B>,
    pub attn: ContextPreOnlyAttention<B>,
    pub ff: FeedForward<B>,
}

impl<B: Backend> ContextPreOnlyJointBlock<B> {
    fn load(vb: &VarBuilder<B>, spec: BlockSpec) -> Result<Self> {
        Ok(Self {
            norm1: AdaLayerNormZero::load(&vb.pp("norm1"), spec.dim)?,
            norm1_context: AdaLayerNormContinuous::load(
                &vb.pp("norm1_context"),
                spec.dim,
                spec.dim,
                1e-6,
            )?,
            attn: ContextPreOnlyAttention::load(&vb.pp("attn"), spec.attention)?,
            ff: spec.feed_forward(vb, "ff")?,
        })
    }

    fn forward(&self, x: Tensor<B, 3>, context: Tensor<B, 3>, temb: Tensor<B, 2>) -> Tensor<B, 3> {
        let zero = self.norm1.forward(x.clone(), temb.clone());
        let norm_context = self.norm1_context.forward(context, temb);
        let attn = self.attn.forward(zero.x.clone(), norm_context);
        feed_forward_residual(x + zero.gate_msa.clone() * attn, zero, &self.ff)
    }
}

/// diffusers' `JointTransformerBlock`, one type for each form its flags give it (as candle's
/// `mmdit/blocks.rs`).
// One per block: the variants' size difference does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum JointTransformerBlock<B: Backend> {
    Joint(JointBlock<B>),
    DualAttention(DualAttentionJointBlock<B>),
    ContextPreOnly(ContextPreOnlyJointBlock<B>),
}

impl<B: Backend> JointTransformerBlock<B> {
    pub(crate) fn load(
        vb: &VarBuilder<B>,
        cfg: &SD3Transformer2DConfig,
        context_pre_only: bool,
        dual_attention: bool,
    ) -> Result<Self> {
        let spec = BlockSpec::new(cfg);
        Ok(match (context_pre_only, dual_attention) {
            (true, _) => Self::ContextPreOnly(ContextPreOnlyJointBlock::load(vb, spec)?),
            (false, true) => Self::DualAttention(DualAttentionJointBlock::load(vb, spec)?),
            (false, false) => Self::Joint(JointBlock::load(vb, spec)?),
        })
    }

    /// One block: `(context, x)` in, `(context, x)` out; the context is `None` after the last.
    pub(crate) fn forward(
        &self,
        x: Tensor<B, 3>,
        context: Tensor<B, 3>,
        temb: Tensor<B, 2>,
    ) -> (Option<Tensor<B, 3>>, Tensor<B, 3>) {
        match self {
            Self::Joint(block) => {
                let (context, x) = block.forward(x, context, temb);
                (Some(context), x)
            }
            Self::DualAttention(block) => {
                let (context, x) = block.forward(x, context, temb);
                (Some(context), x)
            }
            Self::ContextPreOnly(block) => (None, block.forward(x, context, temb)),
        }
    }

    /// The attentions by name with their head counts: `attn`, and `attn2` in a dual-attention
    /// block.
    pub fn attention_heads(&self) -> Vec<(&'static str, usize)> {
        match self {
            Self::Joint(block) => vec![("attn", block.attn.heads)],
            Self::DualAttention(block) => {
                vec![("attn", block.attn.heads), ("attn2", block.attn2.heads)]
            }
            Self::ContextPreOnly(block) => vec![("attn", block.attn.heads)],
        }
    }

    /// The feed-forwards by name: `ff`, and `ff_context` unless `context_pre_only`.
    pub fn feed_forwards(&self) -> Vec<(&'static str, &FeedForward<B>)> {
        match self {
            Self::Joint(block) => vec![("ff", &block.ff), ("ff_context", &block.ff_context)],
            Self::DualAttention(block) => {
                vec![("ff", &block.ff), ("ff_context", &block.ff_context)]
            }
            Self::ContextPreOnly(block) => vec![("ff", &block.ff)],
        }
    }
}

/// The embedders an SD3 transformer and its ControlNets share: the latents' patch embedding
/// with its position table, the timestep and pooled-text embedding, the context projection.
pub(crate) fn load_embedders<B: Backend>(
    cfg: &SD3Transformer2DConfig,
    vb: &VarBuilder<B>,
) -> Result<(
    PatchEmbed<B>,
    CombinedTimestepTextProjEmbeddings<B>,
    Linear<B>,
)> {
    let dim = cfg.inner_dim();
    Ok((
        PatchEmbed::load_cropped(
            &vb.pp("pos_embed"),
            cfg.in_channels,
            dim,
            cfg.patch_size,
            cfg.sample_size,
            cfg.pos_embed_max_size,
        )?,
        CombinedTimestepTextProjEmbeddings::load(
            &vb.pp("time_text_embed"),
            dim,
            cfg.pooled_projection_dim,
        )?,
        Linear::load(
            &vb.pp("context_embedder"),
            cfg.joint_attention_dim,
            cfg.caption_projection_dim,
            true,
        )?,
    ))
}

/// diffusers' `SD3Transformer2DModel`.
#[derive(Module, Debug)]
pub struct SD3Transformer2DModel<B: Backend> {
    pub pos_embed: PatchEmbed<B>,
    pub time_text_embed: CombinedTimestepTextProjEmbeddings<B>,
    pub context_embedder: Linear<B>,
    pub transformer_blocks: Vec<JointTransformerBlock<B>>,
    pub norm_out: AdaLayerNormContinuous<B>,
    pub proj_out: Linear<B>,
    /// Weights kept in GGUF blocks (from `from_gguf_in`); empty otherwise.
    #[module(skip)]
    pub quantized: QuantizedBytes,
    pub patch_size: usize,
    pub in_channels: usize,
    pub out_channels: usize,
    pub joint_attention_dim: usize,
    pub pooled_projection_dim: usize,
}

impl<B: Backend> SD3Transformer2DModel<B> {
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
        let config = SD3Transformer2DConfig::from_file(&dir.join("config.json"))?;
        load_component(
            dir,
            &["diffusion_pytorch_model"],
            variant,
            dtype,
            device,
            |vb| Self::load(&config, vb),
        )
    }

    pub fn load(cfg: &SD3Transformer2DConfig, vb: VarBuilder<B>) -> Result<Self> {
        let dim = cfg.inner_dim();
        let p = cfg.patch_size;
        let out_channels = cfg.out_channels();
        let transformer_blocks = (0..cfg.num_layers)
            .map(|i| {
                JointTransformerBlock::load(
                    &vb.pp("transformer_blocks").pp(i),
                    cfg,
                    i + 1 == cfg.num_layers,
                    cfg.dual_attention_layers.contains(&i),
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let (pos_embed, time_text_embed, context_embedder) = load_embedders(cfg, &vb)?;
        Ok(Self {
            quantized: QuantizedBytes::default(),
            pos_embed,
            time_text_embed,
            context_embedder,
            transformer_blocks,
            norm_out: AdaLayerNormContinuous::load(&vb.pp("norm_out"), dim, dim, 1e-6)?,
            proj_out: Linear::load(&vb.pp("proj_out"), dim, p * p * out_channels, true)?,
            patch_size: p,
            in_channels: cfg.in_channels,
            out_channels,
            joint_attention_dim: cfg.joint_attention_dim,
            pooled_projection_dim: cfg.pooled_projection_dim,
        })
    }

    /// The device the weights live on.
    pub fn device(&self) -> B::Device {
        self.proj_out.weight.device()
    }

    /// Checks the shapes of a call: latents `[batch, in_channels, h, w]` with h and w multiples
    /// of the patch size and a patch grid within `pos_embed_max_size`; `batch` timesteps,
    /// prompt rows `[batch, seq, joint_attention_dim]` and pooled rows
    /// `[batch, pooled_projection_dim]`.
    pub fn check_inputs(
        &self,
        latents: [usize; 4],
        timesteps: usize,
        encoder_hidden_states: [usize; 3],
        pooled_projections: [usize; 2],
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
        if !self.pos_embed.fits(h / p, w / p) {
            return Err(ModelError::Input(format!(
                "latents of {h}x{w} make a {}x{} patch grid, larger than the transformer's \
                 `pos_embed_max_size` {}; use a smaller image",
                h / p,
                w / p,
                self.pos_embed.pos_embed_max_size.unwrap_or(0)
            )));
        }
        if encoder_hidden_states[2] != self.joint_attention_dim
            || pooled_projections[1] != self.pooled_projection_dim
        {
            return Err(ModelError::Input(format!(
                "the transformer takes prompt embeddings [batch, seq, {}] and pooled embeddings \
                 [batch, {}], got {encoder_hidden_states:?} and {pooled_projections:?}",
                self.joint_attention_dim, self.pooled_projection_dim
            )));
        }
        if encoder_hidden_states[0] != b || pooled_projections[0] != b || timesteps != b {
            return Err(ModelError::Input(format!(
                "batch sizes differ: latents {b}, prompt embeddings {}, pooled {}, timesteps \
                 {timesteps}",
                encoder_hidden_states[0], pooled_projections[0]
            )));
        }
        Ok(())
    }

    /// One denoiser call: latents `[batch, in_channels, h, w]`, timesteps `[batch]` (flow
    /// matching's `sigma * 1000`), prompt embeddings `[batch, seq, joint_attention_dim]` and
    /// pooled embeddings `[batch, pooled_projection_dim]`. Returns `[batch, out_channels, h, w]`.
    pub fn forward(
        &self,
        latents: Tensor<B, 4>,
        timestep: Tensor<B, 1>,
        encoder_hidden_states: Tensor<B, 3>,
        pooled_projections: Tensor<B, 2>,
    ) -> Result<Tensor<B, 4>> {
        self.check_inputs(
            latents.dims(),
            timestep.dims()[0],
            encoder_hidden_states.dims(),
            pooled_projections.dims(),
        )?;
        Ok(self.forward_checked(latents, timestep, encoder_hidden_states, pooled_projections))
    }

    /// [`forward`](Self::forward) with the blocks `skip_layers` left out (diffusers'
    /// `skip_layers`, for skip-layer guidance); an index past the last block is an error.
    pub fn forward_skipping(
        &self,
        latents: Tensor<B, 4>,
        timestep: Tensor<B, 1>,
        encoder_hidden_states: Tensor<B, 3>,
        pooled_projections: Tensor<B, 2>,
        skip_layers: &[usize],
    ) -> Result<Tensor<B, 4>> {
        self.check_inputs(
            latents.dims(),
            timestep.dims()[0],
            encoder_hidden_states.dims(),
            pooled_projections.dims(),
        )?;
        self.check_skip_layers(skip_layers)?;
        Ok(self.run(
            latents,
            timestep,
            encoder_hidden_states,
            pooled_projections,
            skip_layers,
        ))
    }

    /// Checks that every index names a block.
    pub fn check_skip_layers(&self, skip_layers: &[usize]) -> Result<()> {
        let blocks = self.transformer_blocks.len();
        match skip_layers.iter().find(|&&i| i >= blocks) {
            Some(i) => Err(ModelError::Input(format!(
                "skip layer {i} does not exist: the transformer has {blocks} blocks (0..{blocks})"
            ))),
            None => Ok(()),
        }
    }

    /// [`forward`](Self::forward) for inputs already passed through
    /// [`check_inputs`](Self::check_inputs) (a compiled step cannot return errors).
    pub fn forward_checked(
        &self,
        latents: Tensor<B, 4>,
        timestep: Tensor<B, 1>,
        encoder_hidden_states: Tensor<B, 3>,
        pooled_projections: Tensor<B, 2>,
    ) -> Tensor<B, 4> {
        self.run(
            latents,
            timestep,
            encoder_hidden_states,
            pooled_projections,
            &[],
        )
    }

    /// [`forward`](Self::forward) with an SD3 ControlNet's residuals added after the blocks
    /// that update the context (diffusers' `block_controlnet_hidden_states`: block `i` takes
    /// residual `int(i / (blocks / residuals))`). Inputs as
    /// [`check_controlled`](Self::check_controlled) accepts them.
    pub fn forward_controlled(
        &self,
        latents: Tensor<B, 4>,
        timestep: Tensor<B, 1>,
        encoder_hidden_states: Tensor<B, 3>,
        pooled_projections: Tensor<B, 2>,
        control: &[Tensor<B, 3>],
    ) -> Tensor<B, 4> {
        self.run_controlled(
            latents,
            timestep,
            encoder_hidden_states,
            pooled_projections,
            &[],
            control,
        )
    }

    /// Checks a controlled call: [`check_inputs`](Self::check_inputs), and 1 to `blocks`
    /// residuals, each `[batch, tokens, inner_dim]` for the latents' patch grid.
    pub fn check_controlled(
        &self,
        latents: [usize; 4],
        timesteps: usize,
        encoder_hidden_states: [usize; 3],
        pooled_projections: [usize; 2],
        control: &[[usize; 3]],
    ) -> Result<()> {
        self.check_inputs(
            latents,
            timesteps,
            encoder_hidden_states,
            pooled_projections,
        )?;
        let [b, _, h, w] = latents;
        let p = self.patch_size;
        let dim = self.context_embedder.weight.dims()[1];
        let expected = [b, (h / p) * (w / p), dim];
        let blocks = self.transformer_blocks.len();
        if control.is_empty() || control.len() > blocks {
            return Err(ModelError::Input(format!(
                "{} ControlNet residuals for {blocks} transformer blocks: give 1 to {blocks}",
                control.len()
            )));
        }
        if let Some(bad) = control.iter().find(|r| **r != expected) {
            return Err(ModelError::Input(format!(
                "a ControlNet residual is {bad:?}; the transformer's tokens are {expected:?}: \
                 the ControlNet was made for another model"
            )));
        }
        Ok(())
    }

    fn run(
        &self,
        latents: Tensor<B, 4>,
        timestep: Tensor<B, 1>,
        encoder_hidden_states: Tensor<B, 3>,
        pooled_projections: Tensor<B, 2>,
        skip_layers: &[usize],
    ) -> Tensor<B, 4> {
        self.run_controlled(
            latents,
            timestep,
            encoder_hidden_states,
            pooled_projections,
            skip_layers,
            &[],
        )
    }

    fn run_controlled(
        &self,
        latents: Tensor<B, 4>,
        timestep: Tensor<B, 1>,
        encoder_hidden_states: Tensor<B, 3>,
        pooled_projections: Tensor<B, 2>,
        skip_layers: &[usize],
        control: &[Tensor<B, 3>],
    ) -> Tensor<B, 4> {
        // Computed in the weights' dtype, returned in the caller's (see `crate::dtype`); the
        // timestep stays as given: its sinusoidal projection is computed in f32.
        let caller = dtype_of(&latents);
        let dtype = dtype_of(&self.proj_out.weight.val());
        let latents = cast_to(latents, dtype);
        let encoder_hidden_states = cast_to(encoder_hidden_states, dtype);
        let pooled_projections = cast_to(pooled_projections, dtype);
        let [b, _, h, w] = latents.dims();
        let p = self.patch_size;
        let (gh, gw) = (h / p, w / p);
        let mut x = self.pos_embed.forward(latents);
        let temb = self.time_text_embed.forward(timestep, pooled_projections);
        let mut context = Some(self.context_embedder.forward(encoder_hidden_states));
        for (i, block) in self.transformer_blocks.iter().enumerate() {
            if skip_layers.contains(&i) {
                continue;
            }
            // Only the last block drops the context, so every block before it has one.
            let Some(c) = context else { break };
            let (next, out) = block.forward(x, c, temb.clone());
            x = match next.is_some() && !control.is_empty() {
                // diffusers: `control[int(i / (len(blocks) / len(control)))]`.
                true => {
                    let interval = self.transformer_blocks.len() as f64 / control.len() as f64;
                    let k = ((i as f64 / interval) as usize).min(control.len() - 1);
                    out + cast_to(control[k].clone(), dtype)
                }
                false => out,
            };
            context = next;
        }
        let x = self.norm_out.forward(x, temb);
        let x = self.proj_out.forward(x);
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

/// Megatron-style: the projections into attention and the first feed-forward projection are
/// split by output features (whole heads per device, so the per-head QK norms stay local), the
/// projections out and the second feed-forward projection by input features, with one
/// all-reduce each. Embeddings, adaLN modulation and `proj_out` stay replicated.
impl<B: Backend> TensorParallel for SD3Transformer2DModel<B> {
    fn tensor_parallel_plan() -> TensorParallelPlan {
        const RULES: &[ShardRule] = &[
            ShardRule::column("transformer_blocks.*.attn.to_q"),
            ShardRule::column("transformer_blocks.*.attn.to_k"),
            ShardRule::column("transformer_blocks.*.attn.to_v"),
            ShardRule::column("transformer_blocks.*.attn.add_q_proj"),
            ShardRule::column("transformer_blocks.*.attn.add_k_proj"),
            ShardRule::column("transformer_blocks.*.attn.add_v_proj"),
            ShardRule::row("transformer_blocks.*.attn.to_out.0"),
            ShardRule::row("transformer_blocks.*.attn.to_add_out"),
            ShardRule::column("transformer_blocks.*.attn2.to_q"),
            ShardRule::column("transformer_blocks.*.attn2.to_k"),
            ShardRule::column("transformer_blocks.*.attn2.to_v"),
            ShardRule::row("transformer_blocks.*.attn2.to_out.0"),
            ShardRule::column("transformer_blocks.*.ff.net.0.proj"),
            ShardRule::row("transformer_blocks.*.ff.net.2"),
            ShardRule::column("transformer_blocks.*.ff_context.net.0.proj"),
            ShardRule::row("transformer_blocks.*.ff_context.net.2"),
        ];
        TensorParallelPlan {
            model: "SD3Transformer2DModel",
            rules: RULES,
        }
    }

    fn sharded_widths(&self) -> Vec<ShardedWidth> {
        let mut widths = Vec::new();
        for (i, block) in self.transformer_blocks.iter().enumerate() {
            let prefix = format!("transformer_blocks.{i}");
            for (name, heads) in block.attention_heads() {
                widths.push(ShardedWidth::heads(format!("{prefix}.{name}"), heads));
            }
            for (name, ff) in block.feed_forwards() {
                // Burn's Linear weight is [in, out]: net.2's input is the inner width.
                let width = ff.proj_out.weight.dims()[0];
                widths.push(ShardedWidth::feed_forward(
                    format!("{prefix}.{name}"),
                    width,
                ));
            }
        }
        widths
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dual_attention_in_the_context_pre_only_block_is_refused_naming_the_field() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        let config = |dual: &str| {
            format!(
                r#"{{"num_layers": 3, "attention_head_dim": 8, "num_attention_heads": 2,
                    "caption_projection_dim": 16, "dual_attention_layers": {dual}}}"#
            )
        };
        std::fs::write(&path, config("[0, 1]")).unwrap();
        assert!(SD3Transformer2DConfig::from_file(&path).is_ok());
        std::fs::write(&path, config("[2]")).unwrap();
        let err = SD3Transformer2DConfig::from_file(&path).unwrap_err();
        assert!(matches!(err, ModelError::Unsupported { .. }), "{err}");
        assert!(err.to_string().contains("dual_attention_layers"), "{err}");
    }
}
