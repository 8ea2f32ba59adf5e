//! CLIP text encoders: `CLIPTextModel` (SD 1.x/2.x) and `CLIPTextModelWithProjection` (SDXL's and
//! SD3's second encoder), as transformers writes them.
//!
//! transformers 5 saves `CLIPTextModel` without the `text_model.` key prefix while Hub checkpoints
//! have it; both load.

use std::path::Path;

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Int, Tensor, TensorData};
use serde::Deserialize;

use crate::attention::multi_head_attention;
use crate::config::load_json;
use crate::error::{ModelError, Result};
use crate::nn::{Activation, Embedding, LayerNorm, Linear};
use crate::program::ProgramSlot;
use crate::var_builder::{load_component, VarBuilder};

/// `text_encoder/config.json` (a transformers `CLIPTextConfig`).
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct ClipTextConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub projection_dim: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub max_position_embeddings: usize,
    pub hidden_act: String,
    pub layer_norm_eps: f64,
    pub bos_token_id: i64,
    pub eos_token_id: i64,
    pub pad_token_id: Option<i64>,
}

impl Default for ClipTextConfig {
    fn default() -> Self {
        Self {
            vocab_size: 49408,
            hidden_size: 512,
            intermediate_size: 2048,
            projection_dim: 512,
            num_hidden_layers: 12,
            num_attention_heads: 8,
            max_position_embeddings: 77,
            hidden_act: "quick_gelu".into(),
            layer_norm_eps: 1e-5,
            bos_token_id: 49406,
            eos_token_id: 49407,
            pad_token_id: Some(1),
        }
    }
}

impl ClipTextConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let config: Self = load_clip_part(path, "text_config")?;
        check_encoder(
            path,
            &config.hidden_act,
            config.hidden_size,
            config.num_attention_heads,
            config.num_hidden_layers,
            &[
                ("vocab_size", config.vocab_size),
                ("intermediate_size", config.intermediate_size),
                ("projection_dim", config.projection_dim),
                ("max_position_embeddings", config.max_position_embeddings),
            ],
        )?;
        Ok(config)
    }
}

/// One part of a CLIP config (`text_config`, `vision_config`) in `path`: nested in a full
/// `CLIPConfig`, or the file itself.
pub(crate) fn load_clip_part<T: serde::de::DeserializeOwned>(path: &Path, part: &str) -> Result<T> {
    let value: serde_json::Value = load_json(path)?;
    match value.get(part) {
        Some(nested) => crate::config::parse_json(&nested.to_string(), path),
        None => crate::config::parse_json(&value.to_string(), path),
    }
}

/// The checks the text and vision encoders' configs share: a known activation, sizes within
/// bounds (`sizes` besides the hidden width and heads), heads dividing the hidden width.
pub(crate) fn check_encoder(
    path: &Path,
    hidden_act: &str,
    hidden: usize,
    heads: usize,
    layers: usize,
    sizes: &[(&str, usize)],
) -> Result<()> {
    use crate::config::{check_at_most, MAX_DIMENSION};
    if Activation::from_name(hidden_act).is_none() {
        return Err(ModelError::Unsupported {
            path: path.to_path_buf(),
            reason: format!("`hidden_act: {hidden_act}`"),
        });
    }
    for &(field, value) in [("hidden_size", hidden), ("num_attention_heads", heads)]
        .iter()
        .chain(sizes)
    {
        check_at_most(field, value, MAX_DIMENSION, path)?;
    }
    check_at_most("num_hidden_layers", layers, 1024, path)?;
    if heads == 0 || !hidden.is_multiple_of(heads) {
        return Err(ModelError::Config {
            path: path.to_path_buf(),
            reason: "`hidden_size` must be a multiple of `num_attention_heads`".into(),
        });
    }
    Ok(())
}

/// The shape of a [`ClipEncoderLayer`], shared by the text and vision encoders.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ClipLayerSpec {
    pub hidden: usize,
    pub intermediate: usize,
    pub heads: usize,
    pub eps: f64,
    pub act: Activation,
    /// The text encoder masks future tokens; the vision encoder attends to every patch.
    pub causal: bool,
}

/// One pre-norm transformer layer (transformers' `CLIPEncoderLayer`), of the text and the
/// vision encoder alike.
#[derive(Module, Debug)]
pub struct ClipEncoderLayer<B: Backend> {
    pub q_proj: Linear<B>,
    pub k_proj: Linear<B>,
    pub v_proj: Linear<B>,
    pub out_proj: Linear<B>,
    pub layer_norm1: LayerNorm<B>,
    pub fc1: Linear<B>,
    pub fc2: Linear<B>,
    pub layer_norm2: LayerNorm<B>,
    pub heads: usize,
    #[module(skip)]
    pub act: Activation,
    #[module(skip)]
    pub causal: bool,
}

impl<B: Backend> ClipEncoderLayer<B> {
    pub(crate) fn load(vb: &VarBuilder<B>, spec: ClipLayerSpec) -> Result<Self> {
        let (d, ff, eps) = (spec.hidden, spec.intermediate, spec.eps);
        let attn = vb.pp("self_attn");
        let mlp = vb.pp("mlp");
        Ok(Self {
            q_proj: Linear::load(&attn.pp("q_proj"), d, d, true)?,
            k_proj: Linear::load(&attn.pp("k_proj"), d, d, true)?,
            v_proj: Linear::load(&attn.pp("v_proj"), d, d, true)?,
            out_proj: Linear::load(&attn.pp("out_proj"), d, d, true)?,
            layer_norm1: LayerNorm::load(&vb.pp("layer_norm1"), d, eps)?,
            fc1: Linear::load(&mlp.pp("fc1"), d, ff, true)?,
            fc2: Linear::load(&mlp.pp("fc2"), ff, d, true)?,
            layer_norm2: LayerNorm::load(&vb.pp("layer_norm2"), d, eps)?,
            heads: spec.heads,
            act: spec.act,
            causal: spec.causal,
        })
    }

    pub(crate) fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let h = self.layer_norm1.forward(x.clone());
        let attn = multi_head_attention(
            self.q_proj.forward(h.clone()),
            self.k_proj.forward(h.clone()),
            self.v_proj.forward(h),
            self.heads,
            self.causal,
        );
        let x = x + self.out_proj.forward(attn);
        let h = self.layer_norm2.forward(x.clone());
        x + self.fc2.forward(self.act.forward(self.fc1.forward(h)))
    }
}

/// The outputs of a CLIP text encoder.
#[derive(Debug, Clone)]
pub struct ClipTextOutput<B: Backend> {
    /// `[batch, seq, hidden]`, after the final layer norm.
    pub last_hidden_state: Tensor<B, 3>,
    /// The hidden state at each prompt's end-of-text token, `[batch, hidden]`.
    pub pooler_output: Tensor<B, 2>,
    /// The output of each layer before the final norm (`hidden_states[1..]` in transformers),
    /// filled only when asked for (SDXL uses the penultimate one).
    pub hidden_states: Vec<Tensor<B, 3>>,
    /// `pooler_output` through `text_projection`, for the model with projection.
    pub text_embeds: Option<Tensor<B, 2>>,
}

/// CLIP's text transformer, with the optional projection head.
#[derive(Module, Debug)]
pub struct ClipTextModel<B: Backend> {
    pub token_embedding: Embedding<B>,
    pub position_embedding: Embedding<B>,
    pub layers: Vec<ClipEncoderLayer<B>>,
    pub final_layer_norm: LayerNorm<B>,
    pub text_projection: Option<Linear<B>>,
    pub eos_token_id: i64,
    pub max_positions: usize,
    /// Compiled mode: the layers and the final norm ([`run_layers`](Self::run_layers)) as one
    /// program; empty: their ops.
    #[module(skip)]
    pub layers_program: ProgramSlot,
}

impl<B: Backend> ClipTextModel<B> {
    /// Loads `CLIPTextModel` (or, with `with_projection`, `CLIPTextModelWithProjection`) from a
    /// `text_encoder` folder.
    pub fn from_dir(
        dir: &Path,
        with_projection: bool,
        variant: Option<&str>,
        device: &B::Device,
    ) -> Result<Self> {
        Self::from_dir_in(dir, with_projection, variant, FloatDType::F32, device)
    }

    /// The same, with the float weights held in `dtype`: read straight into it, so a checkpoint
    /// stored in it is used in place and any other is converted once, never through f32 (what
    /// the model computes at load, such as sinusoidal tables, is cast after).
    pub fn from_dir_in(
        dir: &Path,
        with_projection: bool,
        variant: Option<&str>,
        dtype: FloatDType,
        device: &B::Device,
    ) -> Result<Self> {
        let path = dir.join("config.json");
        let config = ClipTextConfig::from_file(&path)?;
        load_component(dir, &["model"], variant, dtype, device, |vb| {
            Self::load(&config, with_projection, vb)
        })
    }

    pub fn load(cfg: &ClipTextConfig, with_projection: bool, vb: VarBuilder<B>) -> Result<Self> {
        let act = Activation::from_name(&cfg.hidden_act).unwrap_or(Activation::QuickGelu);
        let text = if vb.contains("text_model.embeddings.token_embedding.weight") {
            vb.pp("text_model")
        } else {
            vb.clone()
        };
        let d = cfg.hidden_size;
        let emb = text.pp("embeddings");
        let spec = ClipLayerSpec {
            hidden: d,
            intermediate: cfg.intermediate_size,
            heads: cfg.num_attention_heads,
            eps: cfg.layer_norm_eps,
            act,
            causal: true,
        };
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| ClipEncoderLayer::load(&text.pp("encoder.layers").pp(i), spec))
            .collect::<Result<Vec<_>>>()?;
        let text_projection = if with_projection {
            Some(Linear::load(
                &vb.pp("text_projection"),
                d,
                cfg.projection_dim,
                false,
            )?)
        } else {
            None
        };
        Ok(Self {
            token_embedding: Embedding::load(&emb.pp("token_embedding"), cfg.vocab_size, d)?,
            position_embedding: Embedding::load(
                &emb.pp("position_embedding"),
                cfg.max_position_embeddings,
                d,
            )?,
            layers,
            final_layer_norm: LayerNorm::load(&text.pp("final_layer_norm"), d, cfg.layer_norm_eps)?,
            text_projection,
            eos_token_id: cfg.eos_token_id,
            max_positions: cfg.max_position_embeddings,
            layers_program: ProgramSlot::default(),
        })
    }

    /// The layers and the final norm as ops on embedded tokens `[batch, seq, hidden]`: each
    /// layer's output, then the normed last one, stacked `[layers + 1, batch, seq, hidden]`;
    /// what a layers program computes (one output, whether or not the caller wants the
    /// hidden states).
    pub fn run_layers(&self, x: Tensor<B, 3>) -> Tensor<B, 4> {
        let mut x = x;
        let mut outputs = Vec::with_capacity(self.layers.len() + 1);
        for layer in &self.layers {
            x = layer.forward(x);
            outputs.push(x.clone());
        }
        outputs.push(self.final_layer_norm.forward(x));
        Tensor::stack(outputs, 0)
    }

    /// Encodes token ids (each row the same length, at most `max_position_embeddings`).
    pub fn forward(
        &self,
        input_ids: &[Vec<u32>],
        output_hidden_states: bool,
    ) -> Result<ClipTextOutput<B>> {
        let batch = input_ids.len();
        let seq = input_ids.first().map(Vec::len).unwrap_or(0);
        if batch == 0 || seq == 0 {
            return Err(ModelError::Input("no tokens to encode".into()));
        }
        if input_ids.iter().any(|row| row.len() != seq) || seq > self.max_positions {
            return Err(ModelError::Input(format!(
                "token rows must share one length of at most {}",
                self.max_positions
            )));
        }
        let device = self.token_embedding.weight.device();
        let flat: Vec<i64> = input_ids.iter().flatten().map(|&t| t as i64).collect();
        let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(flat, [batch, seq]), &device);
        let positions = Tensor::<B, 1, Int>::arange(0..seq as i64, &device).unsqueeze::<2>();
        let x = self.token_embedding.forward(ids) + self.position_embedding.forward(positions);
        let program = self.layers_program.get::<B, Tensor<B, 3>, 4>();
        let (last_hidden_state, hidden_states) = match program.and_then(|p| p.run(x.clone())) {
            Some(stack) => {
                let [_, batch, seq, width] = stack.dims();
                let layer = |i: usize| stack.clone().narrow(0, i, 1).reshape([batch, seq, width]);
                let layers = self.layers.len();
                let hidden_states = match output_hidden_states {
                    true => (0..layers).map(layer).collect(),
                    false => Vec::new(),
                };
                (layer(layers), hidden_states)
            }
            None => {
                let mut x = x;
                let mut hidden_states = Vec::new();
                for layer in &self.layers {
                    x = layer.forward(x);
                    if output_hidden_states {
                        hidden_states.push(x.clone());
                    }
                }
                (self.final_layer_norm.forward(x), hidden_states)
            }
        };

        // The pooled token: the first end-of-text token, or (legacy configs with eos id 2) the
        // highest id, as transformers does.
        let rows: Vec<Tensor<B, 2>> = input_ids
            .iter()
            .enumerate()
            .map(|(b, row)| {
                let pos = if self.eos_token_id == 2 {
                    row.iter()
                        .enumerate()
                        .max_by_key(|(i, &t)| (t, std::cmp::Reverse(*i)))
                        .map(|(i, _)| i)
                        .unwrap_or(0)
                } else {
                    row.iter()
                        .position(|&t| i64::from(t) == self.eos_token_id)
                        .unwrap_or(seq - 1)
                };
                last_hidden_state
                    .clone()
                    .narrow(0, b, 1)
                    .narrow(1, pos, 1)
                    .reshape([1, -1])
            })
            .collect();
        let pooler_output = Tensor::cat(rows, 0);
        let text_embeds = self
            .text_projection
            .as_ref()
            .map(|p| p.forward(pooler_output.clone()));
        Ok(ClipTextOutput {
            last_hidden_state,
            pooler_output,
            hidden_states,
            text_embeds,
        })
    }
}
