//! The T5 encoder (`T5EncoderModel` of transformers), the text encoder of PixArt, SD3 and Flux.
//!
//! T5 v1.1 as those pipelines use it: RMS layer norm without bias or mean, self-attention
//! without scaling of the logits and with a learned relative-position bias (bucketed, shared by
//! all layers, owned by the first), and the gated-GELU feed-forward (`gelu_new`). The original
//! T5's ReLU feed-forward loads too. Keys as transformers writes them:
//! `encoder.block.0.layer.0.SelfAttention.q.weight`, `shared.weight`.

use std::path::Path;

use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{FloatDType, Int, Tensor, TensorData};
use serde::Deserialize;

use crate::config::load_json;
use crate::error::{ModelError, Result};
use crate::nn::{Activation, Embedding, Linear};
use crate::program::ProgramSlot;
use crate::var_builder::{load_component, VarBuilder};

/// `text_encoder/config.json` (a transformers `T5Config`).
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct T5Config {
    pub vocab_size: usize,
    pub d_model: usize,
    pub d_kv: usize,
    pub d_ff: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub relative_attention_num_buckets: usize,
    pub relative_attention_max_distance: usize,
    pub layer_norm_epsilon: f64,
    /// `gated-gelu` (v1.1), `relu` (original T5), or `gated-ACT` / `ACT`.
    pub feed_forward_proj: String,
    /// The activation transformers derives from `feed_forward_proj` (`gelu_new` for gated-gelu).
    pub dense_act_fn: Option<String>,
}

impl Default for T5Config {
    fn default() -> Self {
        // google/t5-v1_1-xxl, the encoder of PixArt, SD3 and Flux.
        Self {
            vocab_size: 32128,
            d_model: 4096,
            d_kv: 64,
            d_ff: 10240,
            num_layers: 24,
            num_heads: 64,
            relative_attention_num_buckets: 32,
            relative_attention_max_distance: 128,
            layer_norm_epsilon: 1e-6,
            feed_forward_proj: "gated-gelu".into(),
            dense_act_fn: None,
        }
    }
}

/// How the feed-forward block is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FeedForwardKind {
    /// `wi_0` (activated) times `wi_1`, else one `wi`.
    pub gated: bool,
    pub act: Activation,
}

impl T5Config {
    pub fn from_file(path: &Path) -> Result<Self> {
        let config: Self = load_json(path)?;
        crate::config::check_transformer_sizes(
            path,
            &[
                ("vocab_size", config.vocab_size),
                ("d_model", config.d_model),
                ("d_ff", config.d_ff),
                (
                    "relative_attention_num_buckets",
                    config.relative_attention_num_buckets,
                ),
            ],
            [("num_heads", config.num_heads), ("d_kv", config.d_kv)],
            &[("num_layers", config.num_layers)],
        )?;
        config.feed_forward(path)?;
        if config.num_heads == 0 || config.d_kv == 0 || config.num_layers == 0 {
            return Err(ModelError::Config {
                path: path.to_path_buf(),
                reason: "`num_heads`, `d_kv` and `num_layers` must be positive".into(),
            });
        }
        if config.relative_attention_num_buckets < 4 || config.relative_attention_max_distance < 2 {
            return Err(ModelError::Config {
                path: path.to_path_buf(),
                reason: "`relative_attention_num_buckets` must be at least 4 and \
                         `relative_attention_max_distance` at least 2"
                    .into(),
            });
        }
        Ok(config)
    }

    /// Parses `feed_forward_proj` the way transformers does (`gated-gelu` means `gelu_new`).
    pub fn feed_forward(&self, path: &Path) -> Result<FeedForwardKind> {
        let proj = self.feed_forward_proj.as_str();
        let (gated, act_name) = match proj.strip_prefix("gated-") {
            Some(act) => (true, act),
            None => (false, proj),
        };
        let act_name = match (proj, &self.dense_act_fn) {
            ("gated-gelu", _) => "gelu_new",
            (_, Some(explicit)) if gated => explicit.as_str(),
            _ => act_name,
        };
        let act = Activation::from_name(act_name).ok_or_else(|| ModelError::Unsupported {
            path: path.to_path_buf(),
            reason: format!("`feed_forward_proj: {proj}` (activation `{act_name}`)"),
        })?;
        Ok(FeedForwardKind { gated, act })
    }
}

/// T5's RMS norm: `x / sqrt(mean(x^2) + eps) * weight`, no mean subtracted and no bias.
#[derive(Module, Debug)]
pub struct T5LayerNorm<B: Backend> {
    pub weight: Param<Tensor<B, 1>>,
    pub eps: f64,
}

impl<B: Backend> T5LayerNorm<B> {
    pub fn load(vb: &VarBuilder<B>, dim: usize, eps: f64) -> Result<Self> {
        Ok(Self {
            weight: vb.param("weight", [dim])?,
            eps,
        })
    }

    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let variance = x.clone().powi_scalar(2).mean_dim(D - 1);
        let normed = x * variance.add_scalar(self.eps).sqrt().recip();
        normed * self.weight.val().unsqueeze()
    }
}

/// `T5Attention` of an encoder layer: `q`, `k`, `v`, `o`, none with bias.
#[derive(Module, Debug)]
pub struct T5Attention<B: Backend> {
    pub q: Linear<B>,
    pub k: Linear<B>,
    pub v: Linear<B>,
    pub o: Linear<B>,
    /// `[num_buckets, heads]`, only in the first layer.
    pub relative_attention_bias: Option<Embedding<B>>,
    pub heads: usize,
}

impl<B: Backend> T5Attention<B> {
    fn load(vb: &VarBuilder<B>, cfg: &T5Config, has_bias: bool) -> Result<Self> {
        let inner = cfg.num_heads * cfg.d_kv;
        let d = cfg.d_model;
        Ok(Self {
            q: Linear::load(&vb.pp("q"), d, inner, false)?,
            k: Linear::load(&vb.pp("k"), d, inner, false)?,
            v: Linear::load(&vb.pp("v"), d, inner, false)?,
            o: Linear::load(&vb.pp("o"), inner, d, false)?,
            relative_attention_bias: if has_bias {
                Some(Embedding::load(
                    &vb.pp("relative_attention_bias"),
                    cfg.relative_attention_num_buckets,
                    cfg.num_heads,
                )?)
            } else {
                None
            },
            heads: cfg.num_heads,
        })
    }

    /// `bias` is `[batch, heads, seq, seq]`: position bias plus the padding mask.
    fn forward(&self, x: Tensor<B, 3>, bias: Tensor<B, 4>) -> Tensor<B, 3> {
        let [b, s, _] = x.dims();
        let split = |t: Tensor<B, 3>| {
            let inner = t.dims()[2];
            t.reshape([b, s, self.heads, inner / self.heads])
                .swap_dims(1, 2)
        };
        let q = split(self.q.forward(x.clone()));
        let k = split(self.k.forward(x.clone()));
        let v = split(self.v.forward(x));
        // T5 folds the 1/sqrt(d) into its initialisation: the logits are not scaled.
        let out = attention(
            q,
            k,
            v,
            None,
            Some(bias),
            AttentionModuleOptions {
                scale: Some(1.0),
                softcap: None,
                is_causal: false,
            },
        );
        let inner = out.dims()[1] * out.dims()[3];
        self.o.forward(out.swap_dims(1, 2).reshape([b, s, inner]))
    }
}

/// `T5DenseGatedActDense` (`wi_0`, `wi_1`, `wo`) or `T5DenseActDense` (`wi`, `wo`).
#[derive(Module, Debug)]
pub struct T5DenseActDense<B: Backend> {
    pub wi_0: Linear<B>,
    pub wi_1: Option<Linear<B>>,
    pub wo: Linear<B>,
    #[module(skip)]
    pub act: Activation,
}

impl<B: Backend> T5DenseActDense<B> {
    fn load(vb: &VarBuilder<B>, cfg: &T5Config, kind: FeedForwardKind) -> Result<Self> {
        let (d, ff) = (cfg.d_model, cfg.d_ff);
        let (wi_0, wi_1) = if kind.gated {
            (
                Linear::load(&vb.pp("wi_0"), d, ff, false)?,
                Some(Linear::load(&vb.pp("wi_1"), d, ff, false)?),
            )
        } else {
            (Linear::load(&vb.pp("wi"), d, ff, false)?, None)
        };
        Ok(Self {
            wi_0,
            wi_1,
            wo: Linear::load(&vb.pp("wo"), ff, d, false)?,
            act: kind.act,
        })
    }

    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let hidden = self.act.forward(self.wi_0.forward(x.clone()));
        let hidden = match &self.wi_1 {
            Some(wi_1) => hidden * wi_1.forward(x),
            None => hidden,
        };
        self.wo.forward(hidden)
    }
}

/// One encoder block: `layer.0` (norm, self-attention) and `layer.1` (norm, feed-forward).
#[derive(Module, Debug)]
pub struct T5Block<B: Backend> {
    pub self_attention: T5Attention<B>,
    pub attention_norm: T5LayerNorm<B>,
    pub dense: T5DenseActDense<B>,
    pub ff_norm: T5LayerNorm<B>,
}

impl<B: Backend> T5Block<B> {
    fn load(
        vb: &VarBuilder<B>,
        cfg: &T5Config,
        kind: FeedForwardKind,
        first: bool,
    ) -> Result<Self> {
        let (attn, ff) = (vb.pp("layer.0"), vb.pp("layer.1"));
        let eps = cfg.layer_norm_epsilon;
        Ok(Self {
            self_attention: T5Attention::load(&attn.pp("SelfAttention"), cfg, first)?,
            attention_norm: T5LayerNorm::load(&attn.pp("layer_norm"), cfg.d_model, eps)?,
            dense: T5DenseActDense::load(&ff.pp("DenseReluDense"), cfg, kind)?,
            ff_norm: T5LayerNorm::load(&ff.pp("layer_norm"), cfg.d_model, eps)?,
        })
    }

    fn forward(&self, x: Tensor<B, 3>, bias: Tensor<B, 4>) -> Tensor<B, 3> {
        let h = self
            .self_attention
            .forward(self.attention_norm.forward(x.clone()), bias);
        let x = x + h;
        let h = self.dense.forward(self.ff_norm.forward(x.clone()));
        x + h
    }
}

/// transformers' `T5EncoderModel`.
#[derive(Module, Debug)]
pub struct T5EncoderModel<B: Backend> {
    /// `shared` (tied to `encoder.embed_tokens`).
    pub shared: Embedding<B>,
    pub block: Vec<T5Block<B>>,
    pub final_layer_norm: T5LayerNorm<B>,
    pub num_buckets: usize,
    pub max_distance: usize,
    /// Compiled mode's program for the blocks and the final norm ([`run_blocks`](Self::run_blocks)),
    /// if one is installed; else they run op by op.
    #[module(skip)]
    pub blocks_program: ProgramSlot,
}

impl<B: Backend> T5EncoderModel<B> {
    /// Loads a `text_encoder` folder (`config.json` and safetensors weights).
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
        let path = dir.join("config.json");
        let config = T5Config::from_file(&path)?;
        load_component(dir, &["model"], variant, dtype, device, |vb| {
            Self::load(&config, &path, vb)
        })
    }

    /// Builds the encoder from weights; `config_path` is only used in messages.
    pub fn load(cfg: &T5Config, config_path: &Path, vb: VarBuilder<B>) -> Result<Self> {
        let kind = cfg.feed_forward(config_path)?;
        // The embedding is saved once, as `shared` or as the tied `encoder.embed_tokens`.
        let embed = if vb.contains("shared.weight") || !vb.contains("encoder.embed_tokens.weight") {
            vb.pp("shared")
        } else {
            vb.pp("encoder.embed_tokens")
        };
        let encoder = vb.pp("encoder");
        let block = (0..cfg.num_layers)
            .map(|i| T5Block::load(&encoder.pp("block").pp(i), cfg, kind, i == 0))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            shared: Embedding::load(&embed, cfg.vocab_size, cfg.d_model)?,
            block,
            final_layer_norm: T5LayerNorm::load(
                &encoder.pp("final_layer_norm"),
                cfg.d_model,
                cfg.layer_norm_epsilon,
            )?,
            num_buckets: cfg.relative_attention_num_buckets,
            max_distance: cfg.relative_attention_max_distance,
            blocks_program: ProgramSlot::default(),
        })
    }

    /// The device the weights live on.
    pub fn device(&self) -> B::Device {
        self.shared.weight.device()
    }

    /// Encodes token ids `[batch][seq]` (one length for all rows) to the last hidden state
    /// `[batch, seq, d_model]`. `attention_mask` (1 keep, 0 padding; same shape) hides padding
    /// keys as transformers does; `None` attends to every token.
    pub fn forward(
        &self,
        input_ids: &[Vec<u32>],
        attention_mask: Option<&[Vec<u32>]>,
    ) -> Result<Tensor<B, 3>> {
        let batch = input_ids.len();
        let seq = input_ids.first().map(Vec::len).unwrap_or(0);
        if batch == 0 || seq == 0 {
            return Err(ModelError::Input("no tokens to encode".into()));
        }
        if input_ids.iter().any(|row| row.len() != seq) {
            return Err(ModelError::Input(
                "token rows must share one length (pad them)".into(),
            ));
        }
        let vocab = self.shared.weight.dims()[0];
        if let Some(bad) = input_ids.iter().flatten().find(|&&t| t as usize >= vocab) {
            return Err(ModelError::Input(format!(
                "token id {bad} is outside the T5 vocabulary of {vocab}: tokenizer and text \
                 encoder do not match"
            )));
        }
        if let Some(mask) = attention_mask {
            if mask.len() != batch || mask.iter().any(|row| row.len() != seq) {
                return Err(ModelError::Input(format!(
                    "the attention mask must have the shape of the token ids, [{batch}, {seq}]"
                )));
            }
        }
        let device = self.device();
        let flat: Vec<i64> = input_ids.iter().flatten().map(|&t| i64::from(t)).collect();
        let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(flat, [batch, seq]), &device);
        let x = self.shared.forward(ids);

        let heads = self.block[0].self_attention.heads;
        let position_bias = self.position_bias(seq)?; // [1, heads, seq, seq]
        let bias = match attention_mask {
            Some(mask) => {
                // transformers adds the dtype's lowest value where the mask is 0 (the bias
                // follows the weights' dtype: burn refuses mixed-dtype sums).
                let dtype = crate::dtype::dtype_of(&position_bias);
                let lowest = match dtype {
                    FloatDType::F16 => -65504.0,
                    FloatDType::BF16 => -3.389_531_4e38,
                    _ => f32::MIN,
                };
                let values: Vec<f32> = mask
                    .iter()
                    .flatten()
                    .map(|&m| if m == 0 { lowest } else { 0.0 })
                    .collect();
                let mask_bias =
                    Tensor::<B, 2>::from_data(TensorData::new(values, [batch, seq]), &device)
                        .cast(dtype)
                        .reshape([batch, 1, 1, seq]);
                position_bias.expand([batch, heads, seq, seq])
                    + mask_bias.expand([batch, heads, seq, seq])
            }
            None => position_bias.expand([batch, heads, seq, seq]),
        };
        let [batch, seq, width] = x.dims();
        let out = self
            .blocks_program
            .run_or((x, bias), |(x, bias)| self.run_blocks(x, bias));
        Ok(out.reshape([batch, seq, width]))
    }

    /// The blocks and the final norm as ops on embedded tokens `[batch, seq, d_model]` with
    /// the attention bias `[batch, heads, seq, seq]`, the output as `[1, batch, seq, d_model]`
    /// (programs return rank 4): what a blocks program computes.
    pub fn run_blocks(&self, x: Tensor<B, 3>, bias: Tensor<B, 4>) -> Tensor<B, 4> {
        let mut x = x;
        for block in &self.block {
            x = block.forward(x, bias.clone());
        }
        self.final_layer_norm.forward(x).unsqueeze::<4>()
    }

    /// The relative-position bias `[1, heads, seq, seq]` of the first layer's table.
    fn position_bias(&self, seq: usize) -> Result<Tensor<B, 4>> {
        let table = self.block[0]
            .self_attention
            .relative_attention_bias
            .as_ref()
            .ok_or_else(|| {
                ModelError::Input("the first T5 layer has no relative_attention_bias".into())
            })?;
        let buckets: Vec<i64> = (0..seq)
            .flat_map(|q| {
                (0..seq).map(move |k| {
                    relative_position_bucket(
                        k as i64 - q as i64,
                        self.num_buckets,
                        self.max_distance,
                    ) as i64
                })
            })
            .collect();
        let ids =
            Tensor::<B, 2, Int>::from_data(TensorData::new(buckets, [seq, seq]), &self.device());
        // [seq, seq, heads] -> [1, heads, seq, seq]
        let values = table.forward(ids);
        Ok(values.permute([2, 0, 1]).unsqueeze::<4>())
    }
}

/// T5's bidirectional bucket of a relative position `key - query`: half the buckets for each
/// sign, exact for small distances and logarithmic up to `max_distance` (computed in f32 like
/// transformers, so the truncations agree).
pub fn relative_position_bucket(relative: i64, num_buckets: usize, max_distance: usize) -> usize {
    let half = num_buckets / 2;
    let mut bucket = if relative > 0 { half } else { 0 };
    let distance = relative.unsigned_abs() as usize;
    let max_exact = half / 2;
    bucket += if distance < max_exact {
        distance
    } else {
        let scaled = (distance as f32 / max_exact as f32).ln()
            / (max_distance as f32 / max_exact as f32).ln()
            * (half - max_exact) as f32;
        (max_exact + scaled as usize).min(half - 1)
    };
    bucket
}

#[cfg(test)]
mod tests {
    use super::relative_position_bucket;

    #[test]
    fn buckets_match_transformers_t5() {
        // transformers' T5Attention._relative_position_bucket(rel, True, 32, 128).
        let expected_neg: Vec<usize> = vec![0, 1, 2, 3, 4, 5, 6, 7, 8, 8, 8, 8, 9, 9, 9];
        let got: Vec<usize> = (0..15)
            .map(|d| relative_position_bucket(-d, 32, 128))
            .collect();
        assert_eq!(got, expected_neg);
        let cases = [
            (1, 17),
            (200, 31),
            (-200, 15),
            (7, 23),
            (8, 24),
            (-8, 8),
            (127, 31),
            (128, 31),
            (-127, 15),
            (-128, 15),
            (33, 28),
            (-33, 12),
        ];
        for (relative, bucket) in cases {
            assert_eq!(
                relative_position_bucket(relative, 32, 128),
                bucket,
                "{relative}"
            );
        }
    }
}
