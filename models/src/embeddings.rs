//! Timestep, text and position embeddings (diffusers' `embeddings.py`: `Timesteps`,
//! `TimestepEmbedding`, PixArt's patch and caption embeddings, the combined timestep / guidance
//! / pooled-text embedding of Flux, and Flux's rotary position embedding).
//!
//! The frequency table is computed once on the host, exactly as diffusers computes it in f32;
//! the timestep itself stays a runtime tensor, so a compiled step never bakes it in.

use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor, TensorData};

use crate::dtype::{cast_to, dtype_of};
use crate::error::Result;
use crate::nn::{Activation, Linear};
use crate::var_builder::VarBuilder;

/// Sinusoidal projection of timesteps, `get_timestep_embedding` in diffusers.
#[derive(Module, Debug)]
pub struct Timesteps<B: Backend> {
    /// `exp(-ln(max_period) * i / (half - shift))` for `i < half`, shape `[1, half]`.
    pub freqs: Param<Tensor<B, 2>>,
    pub flip_sin_to_cos: bool,
    /// The table in f32 on the host: with reduced-precision weights the projection is still
    /// computed in f32 (as diffusers' `get_timestep_embedding`), since `t * freq` for
    /// `t ~ 1000` leaves no correct phase in bf16.
    #[module(skip)]
    pub host_freqs: Vec<f32>,
}

impl<B: Backend> Timesteps<B> {
    pub fn new(dim: usize, flip_sin_to_cos: bool, freq_shift: f64, device: &B::Device) -> Self {
        let half = dim / 2;
        let max_period = 10000f32;
        let freqs: Vec<f32> = (0..half)
            .map(|i| {
                let exponent = -max_period.ln() * i as f32;
                (exponent / (half as f32 - freq_shift as f32)).exp()
            })
            .collect();
        let table = Tensor::from_data(TensorData::new(freqs.clone(), [1, half]), device);
        Self {
            freqs: Param::from_tensor(table).set_require_grad(false),
            flip_sin_to_cos,
            host_freqs: freqs,
        }
    }

    /// `timesteps` of shape `[batch]` to embeddings `[batch, dim]`, computed in f32 and
    /// returned in the dtype of the module's weights (`freqs`).
    pub fn forward(&self, timesteps: Tensor<B, 1>) -> Tensor<B, 2> {
        let freqs = self.freqs.val();
        let dtype = dtype_of(&freqs);
        let freqs = if dtype == FloatDType::F32 {
            freqs
        } else {
            let half = self.host_freqs.len();
            Tensor::from_data(
                TensorData::new(self.host_freqs.clone(), [1, half]),
                &freqs.device(),
            )
        };
        let args = cast_to(timesteps, FloatDType::F32).unsqueeze_dim::<2>(1) * freqs;
        let (sin, cos) = (args.clone().sin(), args.cos());
        let emb = if self.flip_sin_to_cos {
            Tensor::cat(vec![cos, sin], 1)
        } else {
            Tensor::cat(vec![sin, cos], 1)
        };
        cast_to(emb, dtype)
    }
}

/// Two linear layers with an activation between: `linear_1`, `linear_2`.
#[derive(Module, Debug)]
pub struct TimestepEmbedding<B: Backend> {
    pub linear_1: Linear<B>,
    pub linear_2: Linear<B>,
    #[module(skip)]
    pub act: Activation,
}

impl<B: Backend> TimestepEmbedding<B> {
    pub fn load(vb: &VarBuilder<B>, c_in: usize, dim: usize, act: Activation) -> Result<Self> {
        Ok(Self {
            linear_1: Linear::load(&vb.pp("linear_1"), c_in, dim, true)?,
            linear_2: Linear::load(&vb.pp("linear_2"), dim, dim, true)?,
            act,
        })
    }

    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.linear_2
            .forward(self.act.forward(self.linear_1.forward(x)))
    }
}

/// diffusers' `get_2d_sincos_pos_embed` for a `grid_h x grid_w` patch grid: `[grid_h * grid_w,
/// dim]`, row-major over the grid, the first half of each row encoding the column and the
/// second half the row. Positions are `i / (grid / base_size) / interpolation_scale` in f32,
/// the sines in f64, as diffusers computes them.
pub fn sincos_pos_embed_2d(
    dim: usize,
    grid_h: usize,
    grid_w: usize,
    base_size: usize,
    interpolation_scale: f64,
) -> Vec<f32> {
    let coords = |n: usize| -> Vec<f32> {
        let step = (n as f64 / base_size as f64) as f32;
        (0..n)
            .map(|i| i as f32 / step / interpolation_scale as f32)
            .collect()
    };
    let (rows, cols) = (coords(grid_h), coords(grid_w));
    let quarter = dim / 4;
    let omega: Vec<f64> = (0..quarter)
        .map(|i| 1.0 / 10000f64.powf(i as f64 / (dim as f64 / 4.0)))
        .collect();
    let mut out = Vec::with_capacity(grid_h * grid_w * dim);
    for &row in &rows {
        for &col in &cols {
            for pos in [col, row] {
                let pos = f64::from(pos);
                out.extend(omega.iter().map(|w| (pos * w).sin() as f32));
                out.extend(omega.iter().map(|w| (pos * w).cos() as f32));
            }
        }
    }
    out
}

/// diffusers' `PatchEmbed`: a `patch x patch` convolution with stride `patch` (`proj`),
/// flattened to tokens, plus the 2D sincos position embedding. PixArt computes it for the
/// input's own grid (not stored in checkpoints); SD3 (`pos_embed_max_size`) stores one table
/// for a `max x max` grid (`pos_embed.pos_embed`) and crops its centre to the input's grid.
#[derive(Module, Debug)]
pub struct PatchEmbed<B: Backend> {
    pub proj: crate::nn::Conv2d<B>,
    /// SD3's `[1, max * max, dim]` table, when `pos_embed_max_size` is set.
    pub pos_embed: Option<Param<Tensor<B, 3>>>,
    pub pos_embed_max_size: Option<usize>,
    pub patch_size: usize,
    /// The native grid side, `sample_size / patch_size`: positions are scaled to it.
    pub base_size: usize,
    pub interpolation_scale: f64,
    /// Whether positions are added at all (`pos_embed_type=None`: the SD3 ControlNet's input
    /// embedding adds none).
    pub positions: bool,
}

impl<B: Backend> PatchEmbed<B> {
    pub fn load(
        vb: &VarBuilder<B>,
        in_channels: usize,
        dim: usize,
        patch_size: usize,
        sample_size: usize,
        interpolation_scale: f64,
    ) -> Result<Self> {
        let spec = crate::nn::ConvSpec {
            c_in: in_channels,
            c_out: dim,
            kernel: patch_size,
            stride: patch_size,
            padding: 0,
        };
        Ok(Self {
            proj: crate::nn::Conv2d::load(&vb.pp("proj"), spec)?,
            pos_embed: None,
            pos_embed_max_size: None,
            patch_size,
            base_size: (sample_size / patch_size).max(1),
            interpolation_scale,
            positions: true,
        })
    }

    /// The convolution alone, no positions (diffusers' `PatchEmbed(pos_embed_type=None)`).
    pub fn load_without_positions(
        vb: &VarBuilder<B>,
        in_channels: usize,
        dim: usize,
        patch_size: usize,
    ) -> Result<Self> {
        let mut embed = Self::load(vb, in_channels, dim, patch_size, patch_size, 1.0)?;
        embed.positions = false;
        Ok(embed)
    }

    /// SD3's patch embedding with a `max_size x max_size` position table (interpolation scale
    /// 1): read from `pos_embed` where the checkpoint has it (a persistent buffer in diffusers),
    /// else computed as diffusers computes it.
    pub fn load_cropped(
        vb: &VarBuilder<B>,
        in_channels: usize,
        dim: usize,
        patch_size: usize,
        sample_size: usize,
        max_size: usize,
    ) -> Result<Self> {
        let mut embed = Self::load(vb, in_channels, dim, patch_size, sample_size, 1.0)?;
        let shape = [1, max_size * max_size, dim];
        let table = if vb.contains("pos_embed") {
            vb.get("pos_embed", shape)?
        } else {
            let values = sincos_pos_embed_2d(dim, max_size, max_size, embed.base_size, 1.0);
            Tensor::from_data(TensorData::new(values, shape), vb.device())
        };
        embed.pos_embed = Some(Param::from_tensor(table).set_require_grad(false));
        embed.pos_embed_max_size = Some(max_size);
        Ok(embed)
    }

    /// Whether a `grid_h x grid_w` patch grid fits the stored table (always, without one).
    pub fn fits(&self, grid_h: usize, grid_w: usize) -> bool {
        self.pos_embed_max_size
            .is_none_or(|max| grid_h <= max && grid_w <= max)
    }

    /// `[batch, c, h, w]` latents to `[batch, (h / p) * (w / p), dim]` tokens.
    pub fn forward(&self, latent: Tensor<B, 4>) -> Tensor<B, 3> {
        let x = self.proj.forward(latent);
        let [b, dim, gh, gw] = x.dims();
        let tokens = x.reshape([b, dim, gh * gw]).swap_dims(1, 2);
        if !self.positions {
            return tokens;
        }
        if let (Some(table), Some(max)) = (&self.pos_embed, self.pos_embed_max_size) {
            // The centre crop, as diffusers' `cropped_pos_embed` (callers check the fit).
            let (top, left) = ((max - gh) / 2, (max - gw) / 2);
            let grid: Tensor<B, 3> = table.val().reshape([max, max, dim]);
            let pos = grid
                .narrow(0, top, gh)
                .narrow(1, left, gw)
                .reshape([1, gh * gw, dim]);
            return tokens + pos;
        }
        let pos = sincos_pos_embed_2d(dim, gh, gw, self.base_size, self.interpolation_scale);
        let pos = Tensor::<B, 2>::from_data(TensorData::new(pos, [gh * gw, dim]), &tokens.device())
            .cast(dtype_of(&tokens));
        tokens + pos.unsqueeze::<3>()
    }
}

/// diffusers' `PixArtAlphaTextProjection`: `linear_1`, an activation (tanh GELU for PixArt's
/// caption, SiLU for SD3's pooled text), `linear_2`.
#[derive(Module, Debug)]
pub struct PixArtAlphaTextProjection<B: Backend> {
    pub linear_1: Linear<B>,
    pub linear_2: Linear<B>,
    #[module(skip)]
    pub act: Activation,
}

impl<B: Backend> PixArtAlphaTextProjection<B> {
    /// The caption projection with tanh GELU (`act_fn="gelu_tanh"`).
    pub fn load(vb: &VarBuilder<B>, in_features: usize, hidden: usize) -> Result<Self> {
        Self::load_with(vb, in_features, hidden, Activation::GeluTanh)
    }

    /// The projection with another activation (`act_fn="silu"` in SD3's time-text embedding).
    pub fn load_with(
        vb: &VarBuilder<B>,
        in_features: usize,
        hidden: usize,
        act: Activation,
    ) -> Result<Self> {
        Ok(Self {
            linear_1: Linear::load(&vb.pp("linear_1"), in_features, hidden, true)?,
            linear_2: Linear::load(&vb.pp("linear_2"), hidden, hidden, true)?,
            act,
        })
    }

    pub fn forward<const D: usize>(&self, caption: Tensor<B, D>) -> Tensor<B, D> {
        let h = self.act.forward(self.linear_1.forward(caption));
        self.linear_2.forward(h)
    }
}

/// diffusers' `CombinedTimestepTextProjEmbeddings` (SD3): the sinusoidal timestep embedding
/// plus the projected pooled text embedding, `[batch, dim]`.
#[derive(Module, Debug)]
pub struct CombinedTimestepTextProjEmbeddings<B: Backend> {
    pub time_proj: Timesteps<B>,
    pub timestep_embedder: TimestepEmbedding<B>,
    pub text_embedder: PixArtAlphaTextProjection<B>,
}

impl<B: Backend> CombinedTimestepTextProjEmbeddings<B> {
    pub fn load(vb: &VarBuilder<B>, dim: usize, pooled_projection_dim: usize) -> Result<Self> {
        Ok(Self {
            time_proj: Timesteps::new(256, true, 0.0, vb.device()),
            timestep_embedder: TimestepEmbedding::load(
                &vb.pp("timestep_embedder"),
                256,
                dim,
                Activation::Silu,
            )?,
            text_embedder: PixArtAlphaTextProjection::load_with(
                &vb.pp("text_embedder"),
                pooled_projection_dim,
                dim,
                Activation::Silu,
            )?,
        })
    }

    /// `timestep` `[batch]` and `pooled` `[batch, pooled_projection_dim]` to `[batch, dim]`.
    pub fn forward(&self, timestep: Tensor<B, 1>, pooled: Tensor<B, 2>) -> Tensor<B, 2> {
        let t = self
            .timestep_embedder
            .forward(self.time_proj.forward(timestep));
        t + self.text_embedder.forward(pooled)
    }
}

/// PixArt-Alpha's micro-conditions: the image resolution `[batch, 2]` (height, width) and
/// aspect ratio `[batch, 1]` of the 1024px models.
#[derive(Debug, Clone)]
pub struct MicroConditions<B: Backend> {
    pub resolution: Tensor<B, 2>,
    pub aspect_ratio: Tensor<B, 2>,
}

/// The size embedders of `PixArtAlphaCombinedTimestepSizeEmbeddings` (`resolution_embedder`,
/// `aspect_ratio_embedder`), present when `use_additional_conditions`.
#[derive(Module, Debug)]
pub struct SizeEmbedders<B: Backend> {
    pub additional_condition_proj: Timesteps<B>,
    pub resolution_embedder: TimestepEmbedding<B>,
    pub aspect_ratio_embedder: TimestepEmbedding<B>,
}

/// diffusers' `PixArtAlphaCombinedTimestepSizeEmbeddings`: the timestep embedding, plus the
/// embedded micro-conditions when the model has them.
#[derive(Module, Debug)]
pub struct PixArtAlphaCombinedTimestepSizeEmbeddings<B: Backend> {
    pub time_proj: Timesteps<B>,
    pub timestep_embedder: TimestepEmbedding<B>,
    pub sizes: Option<SizeEmbedders<B>>,
}

impl<B: Backend> PixArtAlphaCombinedTimestepSizeEmbeddings<B> {
    pub fn load(vb: &VarBuilder<B>, dim: usize, use_additional_conditions: bool) -> Result<Self> {
        let device = vb.device();
        let sizes = if use_additional_conditions {
            let size_dim = dim / 3;
            Some(SizeEmbedders {
                additional_condition_proj: Timesteps::new(256, true, 0.0, device),
                resolution_embedder: TimestepEmbedding::load(
                    &vb.pp("resolution_embedder"),
                    256,
                    size_dim,
                    Activation::Silu,
                )?,
                aspect_ratio_embedder: TimestepEmbedding::load(
                    &vb.pp("aspect_ratio_embedder"),
                    256,
                    size_dim,
                    Activation::Silu,
                )?,
            })
        } else {
            None
        };
        Ok(Self {
            time_proj: Timesteps::new(256, true, 0.0, device),
            timestep_embedder: TimestepEmbedding::load(
                &vb.pp("timestep_embedder"),
                256,
                dim,
                Activation::Silu,
            )?,
            sizes,
        })
    }

    /// `timestep` `[batch]` to `[batch, dim]`, plus the embedded `conditions` when the model
    /// has size embedders (callers check they are given: [`Self::needs_conditions`]).
    pub fn forward(
        &self,
        timestep: Tensor<B, 1>,
        conditions: Option<&MicroConditions<B>>,
    ) -> Tensor<B, 2> {
        let emb = self
            .timestep_embedder
            .forward(self.time_proj.forward(timestep));
        let (Some(sizes), Some(cond)) = (&self.sizes, conditions) else {
            return emb;
        };
        let batch = emb.dims()[0];
        let embed = |values: Tensor<B, 2>, embedder: &TimestepEmbedding<B>| {
            let flat = values.flatten::<1>(0, 1);
            let projected = sizes.additional_condition_proj.forward(flat);
            embedder.forward(projected).reshape([batch as i64, -1])
        };
        let resolution = embed(cond.resolution.clone(), &sizes.resolution_embedder);
        let aspect = embed(cond.aspect_ratio.clone(), &sizes.aspect_ratio_embedder);
        emb + Tensor::cat(vec![resolution, aspect], 1)
    }

    /// Whether the model embeds micro-conditions (and so needs them).
    pub fn needs_conditions(&self) -> bool {
        self.sizes.is_some()
    }
}

/// diffusers' `CombinedTimestepGuidanceTextProjEmbeddings` (Flux dev, guidance-distilled):
/// [`CombinedTimestepTextProjEmbeddings`] plus the guidance scale embedded like a timestep
/// (`guidance_embedder`), `[batch, dim]`.
#[derive(Module, Debug)]
pub struct CombinedTimestepGuidanceTextProjEmbeddings<B: Backend> {
    pub time_proj: Timesteps<B>,
    pub timestep_embedder: TimestepEmbedding<B>,
    pub guidance_embedder: TimestepEmbedding<B>,
    pub text_embedder: PixArtAlphaTextProjection<B>,
}

impl<B: Backend> CombinedTimestepGuidanceTextProjEmbeddings<B> {
    pub fn load(vb: &VarBuilder<B>, dim: usize, pooled_projection_dim: usize) -> Result<Self> {
        let embedder =
            |name: &str| TimestepEmbedding::load(&vb.pp(name), 256, dim, Activation::Silu);
        Ok(Self {
            time_proj: Timesteps::new(256, true, 0.0, vb.device()),
            timestep_embedder: embedder("timestep_embedder")?,
            guidance_embedder: embedder("guidance_embedder")?,
            text_embedder: PixArtAlphaTextProjection::load_with(
                &vb.pp("text_embedder"),
                pooled_projection_dim,
                dim,
                Activation::Silu,
            )?,
        })
    }

    /// `timestep` and `guidance` `[batch]`, `pooled` `[batch, pooled_projection_dim]` to
    /// `[batch, dim]`.
    pub fn forward(
        &self,
        timestep: Tensor<B, 1>,
        guidance: Tensor<B, 1>,
        pooled: Tensor<B, 2>,
    ) -> Tensor<B, 2> {
        let t = self
            .timestep_embedder
            .forward(self.time_proj.forward(timestep));
        let g = self
            .guidance_embedder
            .forward(self.time_proj.forward(guidance));
        t + g + self.text_embedder.forward(pooled)
    }
}

/// diffusers' `get_1d_rotary_pos_embed` as Flux calls it (`use_real`,
/// `repeat_interleave_real`, f64 frequencies): cos and sin `[positions.len() * dim]`, row-major
/// `[position, dim]`, each frequency `theta^(-2i/dim)` repeated for both halves of its pair.
pub fn get_1d_rotary_pos_embed(dim: usize, positions: &[f32], theta: f64) -> (Vec<f32>, Vec<f32>) {
    let freqs: Vec<f64> = (0..dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f64 / dim as f64))
        .collect();
    let mut cos = Vec::with_capacity(positions.len() * dim);
    let mut sin = Vec::with_capacity(positions.len() * dim);
    for &pos in positions {
        for &f in &freqs {
            let angle = f64::from(pos) * f;
            let (s, c) = (angle.sin() as f32, angle.cos() as f32);
            cos.extend([c, c]);
            sin.extend([s, s]);
        }
    }
    (cos, sin)
}

/// Rotary position embedding tables `[seq, head_dim]` (cos and sin), as [`FluxPosEmbed`]
/// makes them; a runtime input of a compiled step (they depend only on the image size).
#[derive(Debug, Clone)]
pub struct RotaryEmbedding<B: Backend> {
    pub cos: Tensor<B, 2>,
    pub sin: Tensor<B, 2>,
}

impl<B: Backend> RotaryEmbedding<B> {
    /// The tables on `device`.
    pub fn to_device(self, device: &B::Device) -> Self {
        Self {
            cos: self.cos.to_device(device),
            sin: self.sin.to_device(device),
        }
    }
}

/// diffusers' `FluxPosEmbed`: multi-axis RoPE. Each position id has one coordinate per axis
/// (Flux: 0, row, column); axis `i` gets `axes_dim[i]` of the head's channels.
#[derive(Debug, Clone, PartialEq)]
pub struct FluxPosEmbed {
    pub theta: f64,
    pub axes_dim: Vec<usize>,
}

impl FluxPosEmbed {
    /// The tables for position `ids` (`[seq][axes]`), computed on the host in f64 as diffusers
    /// does, then placed on `device`.
    pub fn forward<B: Backend>(&self, ids: &[Vec<f32>], device: &B::Device) -> RotaryEmbedding<B> {
        let dim: usize = self.axes_dim.iter().sum();
        let seq = ids.len();
        let tables: Vec<(Vec<f32>, Vec<f32>)> = self
            .axes_dim
            .iter()
            .enumerate()
            .map(|(axis, &d)| {
                let pos: Vec<f32> = ids
                    .iter()
                    .map(|id| id.get(axis).copied().unwrap_or(0.0))
                    .collect();
                get_1d_rotary_pos_embed(d, &pos, self.theta)
            })
            .collect();
        // Concatenate the axes along the channel dimension, position by position.
        let mut cos = Vec::with_capacity(seq * dim);
        let mut sin = Vec::with_capacity(seq * dim);
        for row in 0..seq {
            for ((c, s), &d) in tables.iter().zip(&self.axes_dim) {
                cos.extend_from_slice(&c[row * d..(row + 1) * d]);
                sin.extend_from_slice(&s[row * d..(row + 1) * d]);
            }
        }
        RotaryEmbedding {
            cos: Tensor::from_data(TensorData::new(cos, [seq, dim]), device),
            sin: Tensor::from_data(TensorData::new(sin, [seq, dim]), device),
        }
    }
}

/// diffusers' `apply_rotary_emb` (`use_real`, `use_real_unbind_dim=-1`: channel pairs
/// `(2i, 2i + 1)` rotate together) on `x` `[batch, heads, seq, head_dim]`. As diffusers, the
/// rotation is computed in the tables' dtype (f32) and returned in `x`'s.
pub fn apply_rotary_emb<B: Backend>(x: Tensor<B, 4>, rope: &RotaryEmbedding<B>) -> Tensor<B, 4> {
    let dtype = dtype_of(&x);
    let x = cast_to(x, dtype_of(&rope.cos));
    let [b, h, s, d] = x.dims();
    let pairs: Tensor<B, 5> = x.clone().reshape([b, h, s, d / 2, 2]);
    let real = pairs.clone().narrow(4, 0, 1);
    let imag = pairs.narrow(4, 1, 1);
    let rotated: Tensor<B, 4> = Tensor::cat(vec![imag.neg(), real], 4).reshape([b, h, s, d]);
    let out = x * rope.cos.clone().unsqueeze::<4>() + rotated * rope.sin.clone().unsqueeze::<4>();
    cast_to(out, dtype)
}
