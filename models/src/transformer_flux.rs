//! `FluxTransformer2DModel`: the rectified-flow transformer of Flux.1 (dev and schnell), as
//! diffusers' `transformer_flux.py`.
//!
//! Packed latent tokens (`x_embedder`) and T5 tokens (`context_embedder`) go through
//! double-stream blocks (each stream its own adaLN-Zero, projections and feed-forward, one
//! joint attention with RMS-normed q/k), then single-stream blocks over the joined sequence
//! (attention and MLP in parallel from one modulated input); the conditioning is the embedded
//! timestep plus the pooled CLIP embedding, plus the embedded guidance scale for the
//! guidance-distilled dev model. Positions enter only through 3-axis rotary embeddings of q
//! and k. The output is the velocity of every latent token, `[batch, seq, out_channels]`.

use std::path::Path;

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor};
use oxidiff_parallel::{ShardRule, ShardedWidth, TensorParallel, TensorParallelPlan};
use serde::Deserialize;

use crate::attention::{scaled_dot_product_attention, FeedForward, FeedForwardActivation};
use crate::config::load_json;
use crate::dtype::{cast_to, dtype_of};
use crate::embeddings::{
    apply_rotary_emb, CombinedTimestepGuidanceTextProjEmbeddings,
    CombinedTimestepTextProjEmbeddings, FluxPosEmbed, RotaryEmbedding,
};
use crate::error::{ModelError, Result};
use crate::memory::QuantizedBytes;
use crate::nn::{layer_norm, Activation, Linear};
use crate::normalization::{
    modulate, AdaLayerNormContinuous, AdaLayerNormZero, AdaLayerNormZeroSingle, RMSNorm,
};
use crate::var_builder::{load_component, VarBuilder};

/// `transformer/config.json`.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct FluxTransformer2DConfig {
    pub patch_size: usize,
    pub in_channels: usize,
    pub out_channels: Option<usize>,
    pub num_layers: usize,
    pub num_single_layers: usize,
    pub attention_head_dim: usize,
    pub num_attention_heads: usize,
    pub joint_attention_dim: usize,
    pub pooled_projection_dim: usize,
    pub guidance_embeds: bool,
    pub axes_dims_rope: Vec<usize>,
}

impl Default for FluxTransformer2DConfig {
    fn default() -> Self {
        // diffusers' defaults (FLUX.1 schnell; dev sets `guidance_embeds`).
        Self {
            patch_size: 1,
            in_channels: 64,
            out_channels: None,
            num_layers: 19,
            num_single_layers: 38,
            attention_head_dim: 128,
            num_attention_heads: 24,
            joint_attention_dim: 4096,
            pooled_projection_dim: 768,
            guidance_embeds: false,
            axes_dims_rope: vec![16, 56, 56],
        }
    }
}

impl FluxTransformer2DConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let config = Self::from_file_any_patch(path)?;
        if config.patch_size != 1 {
            // The pipelines pack 2x2 latent patches themselves; diffusers' model only scales
            // its output width by patch_size^2 and nothing un-patches it.
            return Err(ModelError::Unsupported {
                path: path.to_path_buf(),
                reason: format!(
                    "`patch_size: {}` (Flux packs latents in the pipeline; the model uses 1)",
                    config.patch_size
                ),
            });
        }
        Ok(config)
    }

    /// The config with any `patch_size` (a Flux ControlNet's patches its conditioning
    /// embedding with it; the transformer needs 1).
    pub(crate) fn from_file_any_patch(path: &Path) -> Result<Self> {
        let config: Self = load_json(path)?;
        crate::config::check_transformer_sizes(
            path,
            &[
                ("in_channels", config.in_channels),
                ("out_channels", config.out_channels.unwrap_or(0)),
                ("joint_attention_dim", config.joint_attention_dim),
                ("pooled_projection_dim", config.pooled_projection_dim),
            ],
            [
                ("num_attention_heads", config.num_attention_heads),
                ("attention_head_dim", config.attention_head_dim),
            ],
            &[
                ("num_layers", config.num_layers),
                ("num_single_layers", config.num_single_layers),
            ],
        )?;
        let bad = |reason: String| ModelError::Config {
            path: path.to_path_buf(),
            reason,
        };
        if config.num_attention_heads == 0 || config.attention_head_dim == 0 {
            return Err(bad(
                "`num_attention_heads` and `attention_head_dim` must be positive".into(),
            ));
        }
        let rope: usize = config.axes_dims_rope.iter().sum();
        if rope != config.attention_head_dim || config.axes_dims_rope.iter().any(|d| d % 2 != 0) {
            return Err(bad(format!(
                "`axes_dims_rope` {:?} must be even numbers that add up to `attention_head_dim` {}",
                config.axes_dims_rope, config.attention_head_dim
            )));
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

/// `[batch, seq, inner]` to `[batch, heads, seq, head_dim]`.
fn split_heads<B: Backend>(x: Tensor<B, 3>, heads: usize) -> Tensor<B, 4> {
    let [b, s, inner] = x.dims();
    x.reshape([b, s, heads, inner / heads]).swap_dims(1, 2)
}

/// q, k, v of one stream, heads split, q and k RMS-normed.
fn qkv<B: Backend>(
    x: Tensor<B, 3>,
    (q, k, v): (&Linear<B>, &Linear<B>, &Linear<B>),
    (norm_q, norm_k): (&RMSNorm<B>, &RMSNorm<B>),
    heads: usize,
) -> [Tensor<B, 4>; 3] {
    [
        norm_q.forward(split_heads(q.forward(x.clone()), heads)),
        norm_k.forward(split_heads(k.forward(x.clone()), heads)),
        split_heads(v.forward(x), heads),
    ]
}

/// Rotates q and k, attends, merges heads: `[batch, seq, inner]`.
fn attend<B: Backend>([q, k, v]: [Tensor<B, 4>; 3], rope: &RotaryEmbedding<B>) -> Tensor<B, 3> {
    let q = apply_rotary_emb(q, rope);
    let k = apply_rotary_emb(k, rope);
    let out = scaled_dot_product_attention(q, k, v);
    let [b, h, s, d] = out.dims();
    out.swap_dims(1, 2).reshape([b, s, h * d])
}

/// diffusers' `FluxAttention` of a double-stream block: q/k/v of the image stream with
/// per-head RMS norms (`norm_q`, `norm_k`), the text stream's own projections (`add_*_proj`,
/// `norm_added_*`), and an output projection for each (`to_out`, `to_add_out`).
#[derive(Module, Debug)]
pub struct FluxAttention<B: Backend> {
    pub to_q: Linear<B>,
    pub to_k: Linear<B>,
    pub to_v: Linear<B>,
    pub norm_q: RMSNorm<B>,
    pub norm_k: RMSNorm<B>,
    pub to_out: Linear<B>,
    pub add_q_proj: Linear<B>,
    pub add_k_proj: Linear<B>,
    pub add_v_proj: Linear<B>,
    pub norm_added_q: RMSNorm<B>,
    pub norm_added_k: RMSNorm<B>,
    pub to_add_out: Linear<B>,
    pub heads: usize,
}

impl<B: Backend> FluxAttention<B> {
    fn load(vb: &VarBuilder<B>, dim: usize, heads: usize, head_dim: usize) -> Result<Self> {
        let inner = heads * head_dim;
        let linear = |name: &str, d_in, d_out| Linear::load(&vb.pp(name), d_in, d_out, true);
        let norm = |name: &str| RMSNorm::load(&vb.pp(name), head_dim, 1e-6, true);
        Ok(Self {
            to_q: linear("to_q", dim, inner)?,
            to_k: linear("to_k", dim, inner)?,
            to_v: linear("to_v", dim, inner)?,
            norm_q: norm("norm_q")?,
            norm_k: norm("norm_k")?,
            to_out: linear("to_out.0", inner, dim)?,
            add_q_proj: linear("add_q_proj", dim, inner)?,
            add_k_proj: linear("add_k_proj", dim, inner)?,
            add_v_proj: linear("add_v_proj", dim, inner)?,
            norm_added_q: norm("norm_added_q")?,
            norm_added_k: norm("norm_added_k")?,
            to_add_out: linear("to_add_out", inner, dim)?,
            heads,
        })
    }

    /// Joint attention: the text tokens first, then the image tokens, as one sequence;
    /// returns `(image, text)` after their output projections.
    fn forward(
        &self,
        image: Tensor<B, 3>,
        text: Tensor<B, 3>,
        rope: &RotaryEmbedding<B>,
    ) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let text_len = text.dims()[1];
        let image_len = image.dims()[1];
        let [iq, ik, iv] = qkv(
            image,
            (&self.to_q, &self.to_k, &self.to_v),
            (&self.norm_q, &self.norm_k),
            self.heads,
        );
        let [tq, tk, tv] = qkv(
            text,
            (&self.add_q_proj, &self.add_k_proj, &self.add_v_proj),
            (&self.norm_added_q, &self.norm_added_k),
            self.heads,
        );
        let joined = [
            Tensor::cat(vec![tq, iq], 2),
            Tensor::cat(vec![tk, ik], 2),
            Tensor::cat(vec![tv, iv], 2),
        ];
        let attended = attend(joined, rope);
        let text_out = attended.clone().narrow(1, 0, text_len);
        let image_out = attended.narrow(1, text_len, image_len);
        (
            self.to_out.forward(image_out),
            self.to_add_out.forward(text_out),
        )
    }
}

/// diffusers' `FluxAttention` of a single-stream block (`pre_only`): self-attention over the
/// joined sequence without an output projection (the block's `proj_out` takes its output).
#[derive(Module, Debug)]
pub struct FluxSingleAttention<B: Backend> {
    pub to_q: Linear<B>,
    pub to_k: Linear<B>,
    pub to_v: Linear<B>,
    pub norm_q: RMSNorm<B>,
    pub norm_k: RMSNorm<B>,
    pub heads: usize,
}

impl<B: Backend> FluxSingleAttention<B> {
    fn load(vb: &VarBuilder<B>, dim: usize, heads: usize, head_dim: usize) -> Result<Self> {
        let inner = heads * head_dim;
        let linear = |name: &str| Linear::load(&vb.pp(name), dim, inner, true);
        let norm = |name: &str| RMSNorm::load(&vb.pp(name), head_dim, 1e-6, true);
        Ok(Self {
            to_q: linear("to_q")?,
            to_k: linear("to_k")?,
            to_v: linear("to_v")?,
            norm_q: norm("norm_q")?,
            norm_k: norm("norm_k")?,
            heads,
        })
    }

    fn forward(&self, x: Tensor<B, 3>, rope: &RotaryEmbedding<B>) -> Tensor<B, 3> {
        let qkv = qkv(
            x,
            (&self.to_q, &self.to_k, &self.to_v),
            (&self.norm_q, &self.norm_k),
            self.heads,
        );
        attend(qkv, rope)
    }
}

/// diffusers' `FluxTransformerBlock` (double stream): image and text streams with their own
/// adaLN-Zero modulation, joint attention, and their own feed-forwards.
#[derive(Module, Debug)]
pub struct FluxTransformerBlock<B: Backend> {
    pub norm1: AdaLayerNormZero<B>,
    pub norm1_context: AdaLayerNormZero<B>,
    pub attn: FluxAttention<B>,
    pub ff: FeedForward<B>,
    pub ff_context: FeedForward<B>,
}

impl<B: Backend> FluxTransformerBlock<B> {
    pub(crate) fn load(vb: &VarBuilder<B>, cfg: &FluxTransformer2DConfig) -> Result<Self> {
        let dim = cfg.inner_dim();
        let ff = |name: &str| {
            FeedForward::load_with(&vb.pp(name), dim, 4 * dim, FeedForwardActivation::GeluTanh)
        };
        Ok(Self {
            norm1: AdaLayerNormZero::load(&vb.pp("norm1"), dim)?,
            norm1_context: AdaLayerNormZero::load(&vb.pp("norm1_context"), dim)?,
            attn: FluxAttention::load(
                &vb.pp("attn"),
                dim,
                cfg.num_attention_heads,
                cfg.attention_head_dim,
            )?,
            ff: ff("ff")?,
            ff_context: ff("ff_context")?,
        })
    }

    /// Returns `(text, image)` hidden states.
    pub(crate) fn forward(
        &self,
        image: Tensor<B, 3>,
        text: Tensor<B, 3>,
        temb: Tensor<B, 2>,
        rope: &RotaryEmbedding<B>,
    ) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let img = self.norm1.forward(image.clone(), temb.clone());
        let txt = self.norm1_context.forward(text.clone(), temb);
        let (attn_out, context_attn_out) = self.attn.forward(img.x, txt.x, rope);

        let image = image + img.gate_msa * attn_out;
        let normed = modulate(
            layer_norm(image.clone(), 1e-6),
            img.shift_mlp,
            img.scale_mlp,
        );
        let image = image.clone() + img.gate_mlp * self.ff.forward(normed);

        let text = text + txt.gate_msa * context_attn_out;
        let normed = modulate(layer_norm(text.clone(), 1e-6), txt.shift_mlp, txt.scale_mlp);
        let text = text.clone() + txt.gate_mlp * self.ff_context.forward(normed);
        (text, image)
    }
}

/// diffusers' `FluxSingleTransformerBlock` (single stream, over text and image tokens joined):
/// one modulated input feeds attention and an MLP in parallel; `proj_out` maps their
/// concatenation back to the width, gated, with a residual.
#[derive(Module, Debug)]
pub struct FluxSingleTransformerBlock<B: Backend> {
    pub norm: AdaLayerNormZeroSingle<B>,
    pub proj_mlp: Linear<B>,
    pub proj_out: Linear<B>,
    pub attn: FluxSingleAttention<B>,
}

impl<B: Backend> FluxSingleTransformerBlock<B> {
    pub(crate) fn load(vb: &VarBuilder<B>, cfg: &FluxTransformer2DConfig) -> Result<Self> {
        let dim = cfg.inner_dim();
        let mlp_hidden = 4 * dim;
        Ok(Self {
            norm: AdaLayerNormZeroSingle::load(&vb.pp("norm"), dim)?,
            proj_mlp: Linear::load(&vb.pp("proj_mlp"), dim, mlp_hidden, true)?,
            proj_out: Linear::load(&vb.pp("proj_out"), dim + mlp_hidden, dim, true)?,
            attn: FluxSingleAttention::load(
                &vb.pp("attn"),
                dim,
                cfg.num_attention_heads,
                cfg.attention_head_dim,
            )?,
        })
    }

    /// `x` is the joined sequence `[batch, text + image, dim]`.
    pub(crate) fn forward(
        &self,
        x: Tensor<B, 3>,
        temb: Tensor<B, 2>,
        rope: &RotaryEmbedding<B>,
    ) -> Tensor<B, 3> {
        let (normed, gate) = self.norm.forward(x.clone(), temb);
        let mlp = Activation::GeluTanh.forward(self.proj_mlp.forward(normed.clone()));
        let attn = self.attn.forward(normed, rope);
        let joined = Tensor::cat(vec![attn, mlp], 2);
        x + gate * self.proj_out.forward(joined)
    }
}

/// The conditioning embedding of a Flux transformer: diffusers picks the class by
/// `guidance_embeds`.
// One per model: the variants' size difference (a few hundred bytes) does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum FluxTimeTextEmbed<B: Backend> {
    /// schnell: timestep and pooled text.
    TimestepText(CombinedTimestepTextProjEmbeddings<B>),
    /// dev: timestep, guidance scale and pooled text.
    TimestepGuidanceText(CombinedTimestepGuidanceTextProjEmbeddings<B>),
}

impl<B: Backend> FluxTimeTextEmbed<B> {
    /// The embedding `cfg.guidance_embeds` picks.
    pub(crate) fn load(vb: &VarBuilder<B>, cfg: &FluxTransformer2DConfig) -> Result<Self> {
        let (dim, pooled) = (cfg.inner_dim(), cfg.pooled_projection_dim);
        Ok(if cfg.guidance_embeds {
            Self::TimestepGuidanceText(CombinedTimestepGuidanceTextProjEmbeddings::load(
                vb, dim, pooled,
            )?)
        } else {
            Self::TimestepText(CombinedTimestepTextProjEmbeddings::load(vb, dim, pooled)?)
        })
    }

    /// `guidance` is used only by the guidance embedding (callers check it is given).
    pub fn forward(
        &self,
        timestep: Tensor<B, 1>,
        guidance: Option<Tensor<B, 1>>,
        pooled: Tensor<B, 2>,
    ) -> Tensor<B, 2> {
        match (self, guidance) {
            (Self::TimestepGuidanceText(embed), Some(guidance)) => {
                embed.forward(timestep, guidance, pooled)
            }
            (Self::TimestepGuidanceText(embed), None) => {
                // Unreachable through `forward`, which checks; zero guidance keeps it total.
                let guidance = timestep.zeros_like();
                embed.forward(timestep, guidance, pooled)
            }
            (Self::TimestepText(embed), _) => embed.forward(timestep, pooled),
        }
    }
}

/// What a Flux ControlNet adds: one sample per double block it has and one per single block,
/// each `[batch, image tokens, dim]`.
#[derive(Debug, Clone)]
pub struct FluxControlSamples<B: Backend> {
    pub blocks: Vec<Tensor<B, 3>>,
    pub single_blocks: Vec<Tensor<B, 3>>,
    /// diffusers' `controlnet_blocks_repeat` (XLabs' ControlNets): double block `i` takes
    /// sample `i % samples` instead of `i // ceil(blocks / samples)`.
    pub repeat: bool,
}

impl<B: Backend> FluxControlSamples<B> {
    /// The element-wise sum of two ControlNets' samples, as diffusers' multi-ControlNet sums
    /// them (as many as the shorter list has; the first one's `repeat`, as diffusers takes the
    /// first ControlNet's).
    pub fn sum(self, other: Self) -> Self {
        let add = |a: Vec<Tensor<B, 3>>, b: Vec<Tensor<B, 3>>| {
            a.into_iter().zip(b).map(|(a, b)| a + b).collect()
        };
        Self {
            blocks: add(self.blocks, other.blocks),
            single_blocks: add(self.single_blocks, other.single_blocks),
            repeat: self.repeat,
        }
    }
}

/// diffusers' `FluxTransformer2DModel`.
#[derive(Module, Debug)]
pub struct FluxTransformer2DModel<B: Backend> {
    pub time_text_embed: FluxTimeTextEmbed<B>,
    pub context_embedder: Linear<B>,
    pub x_embedder: Linear<B>,
    pub transformer_blocks: Vec<FluxTransformerBlock<B>>,
    pub single_transformer_blocks: Vec<FluxSingleTransformerBlock<B>>,
    pub norm_out: AdaLayerNormContinuous<B>,
    pub proj_out: Linear<B>,
    #[module(skip)]
    pub pos_embed: FluxPosEmbed,
    /// Weights kept in GGUF blocks (from [`from_gguf_in`](Self::from_gguf_in)); empty otherwise.
    #[module(skip)]
    pub quantized: QuantizedBytes,
    pub in_channels: usize,
    pub out_channels: usize,
    pub joint_attention_dim: usize,
    pub pooled_projection_dim: usize,
}

impl<B: Backend> FluxTransformer2DModel<B> {
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
        let config = FluxTransformer2DConfig::from_file(&dir.join("config.json"))?;
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
        let transformer_blocks = (0..cfg.num_layers)
            .map(|i| FluxTransformerBlock::load(&vb.pp("transformer_blocks").pp(i), cfg))
            .collect::<Result<Vec<_>>>()?;
        let single_transformer_blocks = (0..cfg.num_single_layers)
            .map(|i| {
                FluxSingleTransformerBlock::load(&vb.pp("single_transformer_blocks").pp(i), cfg)
            })
            .collect::<Result<Vec<_>>>()?;
        let out_channels = cfg.out_channels();
        Ok(Self {
            time_text_embed: FluxTimeTextEmbed::load(&vb.pp("time_text_embed"), cfg)?,
            context_embedder: Linear::load(
                &vb.pp("context_embedder"),
                cfg.joint_attention_dim,
                dim,
                true,
            )?,
            x_embedder: Linear::load(&vb.pp("x_embedder"), cfg.in_channels, dim, true)?,
            transformer_blocks,
            single_transformer_blocks,
            norm_out: AdaLayerNormContinuous::load(&vb.pp("norm_out"), dim, dim, 1e-6)?,
            proj_out: Linear::load(
                &vb.pp("proj_out"),
                dim,
                cfg.patch_size.pow(2) * out_channels,
                true,
            )?,
            quantized: QuantizedBytes::default(),
            pos_embed: FluxPosEmbed {
                theta: 10000.0,
                axes_dim: cfg.axes_dims_rope.clone(),
            },
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

    /// Whether this is a guidance-distilled model (dev) that takes the guidance scale as an
    /// input (`guidance_embeds`).
    pub fn guidance_embeds(&self) -> bool {
        matches!(
            self.time_text_embed,
            FluxTimeTextEmbed::TimestepGuidanceText(_)
        )
    }

    /// The rotary tables for text ids then image ids (each `[seq][3]`), as diffusers'
    /// forward computes them from `torch.cat((txt_ids, img_ids))`.
    pub fn rotary_embedding(
        &self,
        txt_ids: &[Vec<f32>],
        img_ids: &[Vec<f32>],
        device: &B::Device,
    ) -> RotaryEmbedding<B> {
        let ids: Vec<Vec<f32>> = txt_ids.iter().chain(img_ids).cloned().collect();
        self.pos_embed.forward(&ids, device)
    }

    /// Checks the shapes of a call: image tokens `[batch, seq, in_channels]`, text
    /// `[batch, text_seq, joint_attention_dim]`, pooled `[batch, pooled_projection_dim]`,
    /// `batch` timesteps, a guidance scale exactly when the model embeds one, and rotary
    /// tables for `text_seq + seq` positions.
    pub fn check_inputs(
        &self,
        hidden_states: [usize; 3],
        encoder_hidden_states: [usize; 3],
        pooled: [usize; 2],
        timesteps: usize,
        guidance: Option<usize>,
        rope_positions: usize,
    ) -> Result<()> {
        let [b, seq, c] = hidden_states;
        let err = |m: String| Err(ModelError::Input(m));
        if c != self.in_channels {
            return err(format!(
                "the transformer takes packed latents [batch, seq, {}], got {hidden_states:?}",
                self.in_channels
            ));
        }
        if encoder_hidden_states[2] != self.joint_attention_dim
            || pooled[1] != self.pooled_projection_dim
        {
            return err(format!(
                "text embeddings must be [batch, seq, {}] and pooled [batch, {}], got {:?} and \
                 {:?}: the text encoders do not match this transformer",
                self.joint_attention_dim, self.pooled_projection_dim, encoder_hidden_states, pooled
            ));
        }
        if encoder_hidden_states[0] != b || pooled[0] != b || timesteps != b {
            return err(format!(
                "batch sizes differ: latents {b}, text {}, pooled {}, timesteps {timesteps}",
                encoder_hidden_states[0], pooled[0]
            ));
        }
        match (self.guidance_embeds(), guidance) {
            (true, None) => return err(
                "this transformer embeds the guidance scale (guidance_embeds, Flux dev); pass it"
                    .into(),
            ),
            (true, Some(g)) if g != b => {
                return err(format!("{g} guidance values for a batch of {b}"));
            }
            _ => {}
        }
        if rope_positions != seq + encoder_hidden_states[1] {
            return err(format!(
                "rotary tables for {rope_positions} positions, but the sequence has {} text and \
                 {seq} image tokens",
                encoder_hidden_states[1]
            ));
        }
        Ok(())
    }

    /// One denoiser call, as diffusers' forward: `hidden_states` packed latents
    /// `[batch, seq, in_channels]`, `encoder_hidden_states` T5 `[batch, text_seq, dim]`,
    /// `pooled_projections` CLIP `[batch, pooled_dim]`, `timestep` `[batch]` in the pipeline's
    /// `t / 1000` scale, `guidance` `[batch]` for dev models (ignored without a guidance
    /// embedder, as schnell), and the rotary tables of the text and image ids
    /// ([`rotary_embedding`](Self::rotary_embedding)). Returns `[batch, seq, out_channels]`.
    pub fn forward(
        &self,
        hidden_states: Tensor<B, 3>,
        encoder_hidden_states: Tensor<B, 3>,
        pooled_projections: Tensor<B, 2>,
        timestep: Tensor<B, 1>,
        guidance: Option<Tensor<B, 1>>,
        image_rotary_emb: &RotaryEmbedding<B>,
    ) -> Result<Tensor<B, 3>> {
        self.check_inputs(
            hidden_states.dims(),
            encoder_hidden_states.dims(),
            pooled_projections.dims(),
            timestep.dims()[0],
            guidance.as_ref().map(|g| g.dims()[0]),
            image_rotary_emb.cos.dims()[0],
        )?;
        Ok(self.forward_checked(
            hidden_states,
            encoder_hidden_states,
            pooled_projections,
            timestep,
            guidance,
            image_rotary_emb,
        ))
    }

    /// [`forward`](Self::forward) for inputs already passed through
    /// [`check_inputs`](Self::check_inputs) (a compiled step cannot return errors; a dev
    /// model called without guidance here embeds a guidance of 0).
    pub fn forward_checked(
        &self,
        hidden_states: Tensor<B, 3>,
        encoder_hidden_states: Tensor<B, 3>,
        pooled_projections: Tensor<B, 2>,
        timestep: Tensor<B, 1>,
        guidance: Option<Tensor<B, 1>>,
        image_rotary_emb: &RotaryEmbedding<B>,
    ) -> Tensor<B, 3> {
        self.forward_controlled(
            hidden_states,
            encoder_hidden_states,
            pooled_projections,
            timestep,
            guidance,
            image_rotary_emb,
            None,
        )
    }

    /// Checks that a ControlNet's `blocks` double and `singles` single samples fit: at most
    /// as many as the transformer has blocks of each kind (their shapes follow from a
    /// ControlNet that fits the transformer, run on the same latents).
    pub fn check_control(&self, blocks: usize, singles: usize) -> Result<()> {
        let counts = [
            (blocks, self.transformer_blocks.len(), "double"),
            (singles, self.single_transformer_blocks.len(), "single"),
        ];
        for (got, have, kind) in counts {
            if got > have {
                return Err(ModelError::Input(format!(
                    "{got} ControlNet samples for the transformer's {have} {kind} blocks: the \
                     ControlNet was made for another model"
                )));
            }
        }
        Ok(())
    }

    /// [`forward_checked`](Self::forward_checked) with a Flux ControlNet's samples added to the
    /// image tokens after the blocks (diffusers' `controlnet_block_samples` and
    /// `controlnet_single_block_samples`; each `[batch, image tokens, dim]`, counts checked by
    /// [`check_control`](Self::check_control)).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_controlled(
        &self,
        hidden_states: Tensor<B, 3>,
        encoder_hidden_states: Tensor<B, 3>,
        pooled_projections: Tensor<B, 2>,
        timestep: Tensor<B, 1>,
        guidance: Option<Tensor<B, 1>>,
        image_rotary_emb: &RotaryEmbedding<B>,
        control: Option<&FluxControlSamples<B>>,
    ) -> Tensor<B, 3> {
        // Computed in the weights' dtype, returned in the caller's (see `crate::dtype`); the
        // rotary tables stay as given (f32), as diffusers applies them in f32.
        let caller = dtype_of(&hidden_states);
        let dtype = dtype_of(&self.proj_out.weight.val());
        let hidden_states = cast_to(hidden_states, dtype);
        let encoder_hidden_states = cast_to(encoder_hidden_states, dtype);
        let pooled_projections = cast_to(pooled_projections, dtype);
        let mut image = self.x_embedder.forward(hidden_states);
        let timestep = cast_to(timestep, dtype).mul_scalar(1000.0);
        let guidance = guidance
            .filter(|_| self.guidance_embeds())
            .map(|g| cast_to(g, dtype).mul_scalar(1000.0));
        let temb = self
            .time_text_embed
            .forward(timestep, guidance, pooled_projections);
        let mut text = self.context_embedder.forward(encoder_hidden_states);
        // diffusers: block `i` takes sample `i // ceil(blocks / samples)`, or `i % samples`
        // for double blocks when the samples repeat.
        let sample = |samples: &[Tensor<B, 3>], i: usize, blocks: usize, repeat: bool| {
            let index = if repeat {
                i % samples.len()
            } else {
                i / blocks.div_ceil(samples.len()).max(1)
            };
            cast_to(samples[index.min(samples.len() - 1)].clone(), dtype)
        };
        let blocks = self.transformer_blocks.len();
        for (i, block) in self.transformer_blocks.iter().enumerate() {
            (text, image) = block.forward(image, text, temb.clone(), image_rotary_emb);
            if let Some(control) = control.filter(|c| !c.blocks.is_empty()) {
                image = image + sample(&control.blocks, i, blocks, control.repeat);
            }
        }
        // diffusers joins and splits the streams in every single block; joining once is the
        // same computation (a ControlNet's samples go to the image part).
        let text_len = text.dims()[1];
        let image_len = image.dims()[1];
        let mut joined = Tensor::cat(vec![text, image], 1);
        let singles = self.single_transformer_blocks.len();
        for (i, block) in self.single_transformer_blocks.iter().enumerate() {
            joined = block.forward(joined, temb.clone(), image_rotary_emb);
            if let Some(control) = control.filter(|c| !c.single_blocks.is_empty()) {
                let text = joined.clone().narrow(1, 0, text_len);
                let image = joined.narrow(1, text_len, image_len)
                    + sample(&control.single_blocks, i, singles, false);
                joined = Tensor::cat(vec![text, image], 1);
            }
        }
        let image = joined.narrow(1, text_len, image_len);
        cast_to(
            self.proj_out.forward(self.norm_out.forward(image, temb)),
            caller,
        )
    }
}

/// The tensor-parallel plan, as diffusers' `_tp_plan`: attention q/k/v (both streams), the
/// single blocks' `proj_mlp` and the feed-forwards' first projections split by output
/// features; the double blocks' attention outputs and the feed-forwards' second projections
/// by input features. Split heads keep the per-head RMS norms and rotary embeddings local.
///
/// The single blocks' `proj_out` stays replicated: its input is the concatenation
/// `[attention (dim), mlp (4 dim)]`, and a device holds a slice of each half, not a contiguous
/// slice of the whole, so a plain row-wise split would pair the wrong rows (diffusers needs a
/// special `PackedRowwiseParallel` for it). The modulation linears and embedders are
/// replicated too.
pub const FLUX_TENSOR_PARALLEL_PLAN: TensorParallelPlan = TensorParallelPlan {
    model: "FluxTransformer2DModel",
    rules: &[
        ShardRule::column("transformer_blocks.*.attn.to_q"),
        ShardRule::column("transformer_blocks.*.attn.to_k"),
        ShardRule::column("transformer_blocks.*.attn.to_v"),
        ShardRule::row("transformer_blocks.*.attn.to_out.0"),
        ShardRule::column("transformer_blocks.*.attn.add_q_proj"),
        ShardRule::column("transformer_blocks.*.attn.add_k_proj"),
        ShardRule::column("transformer_blocks.*.attn.add_v_proj"),
        ShardRule::row("transformer_blocks.*.attn.to_add_out"),
        ShardRule::column("transformer_blocks.*.ff.net.0.proj"),
        ShardRule::row("transformer_blocks.*.ff.net.2"),
        ShardRule::column("transformer_blocks.*.ff_context.net.0.proj"),
        ShardRule::row("transformer_blocks.*.ff_context.net.2"),
        ShardRule::column("single_transformer_blocks.*.attn.to_q"),
        ShardRule::column("single_transformer_blocks.*.attn.to_k"),
        ShardRule::column("single_transformer_blocks.*.attn.to_v"),
        ShardRule::column("single_transformer_blocks.*.proj_mlp"),
    ],
};

impl<B: Backend> TensorParallel for FluxTransformer2DModel<B> {
    fn tensor_parallel_plan() -> TensorParallelPlan {
        FLUX_TENSOR_PARALLEL_PLAN
    }

    fn sharded_widths(&self) -> Vec<ShardedWidth> {
        let mut widths = Vec::new();
        for (i, block) in self.transformer_blocks.iter().enumerate() {
            let prefix = format!("transformer_blocks.{i}");
            widths.push(ShardedWidth::heads(
                format!("{prefix}.attn"),
                block.attn.heads,
            ));
            for (name, ff) in [("ff", &block.ff), ("ff_context", &block.ff_context)] {
                // Burn's Linear weight is [in, out]: net.2's input is the inner width.
                let width = ff.proj_out.weight.dims()[0];
                widths.push(ShardedWidth::feed_forward(
                    format!("{prefix}.{name}"),
                    width,
                ));
            }
        }
        for (i, block) in self.single_transformer_blocks.iter().enumerate() {
            let prefix = format!("single_transformer_blocks.{i}");
            widths.push(ShardedWidth::heads(
                format!("{prefix}.attn"),
                block.attn.heads,
            ));
            let width = block.proj_mlp.weight.dims()[1];
            widths.push(ShardedWidth::feed_forward(
                format!("{prefix}.proj_mlp"),
                width,
            ));
        }
        widths
    }
}
