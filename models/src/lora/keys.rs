//! Which layer of a model a LoRA name means: each model that takes LoRAs maps its Burn field
//! paths to the checkpoint's module names ([`LoraTarget`]), and kohya's other conventions (the
//! original SGM UNet's and BFL Flux's block names, fused projections) onto those.

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use super::file::LoraLayer;
use crate::clip::ClipTextModel;
use crate::pixart_transformer_2d::PixArtTransformer2DModel;
use crate::transformer_flux::FluxTransformer2DModel;
use crate::transformer_sd3::SD3Transformer2DModel;
use crate::unet_2d_condition::UNet2DConditionModel;

/// What kind of layer a LoRA can target, in the checkpoint's (PyTorch) terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoraLayerKind {
    /// `nn.Linear(d_in, d_out)`; Burn keeps the weight as `[d_in, d_out]`.
    Linear { d_in: usize, d_out: usize },
    /// `nn.Conv2d(c_in, c_out, kernel)`, weight `[c_out, c_in, k, k]`.
    Conv {
        c_in: usize,
        c_out: usize,
        kernel: usize,
    },
}

impl LoraLayerKind {
    pub(super) fn out(self) -> usize {
        match self {
            Self::Linear { d_out, .. } => d_out,
            Self::Conv { c_out, .. } => c_out,
        }
    }

    pub(super) fn fan_in(self) -> usize {
        match self {
            Self::Linear { d_in, .. } => d_in,
            Self::Conv { c_in, kernel, .. } => c_in * kernel * kernel,
        }
    }

    /// The PyTorch weight shape, for messages.
    pub(super) fn torch_shape(self) -> Vec<usize> {
        match self {
            Self::Linear { d_in, d_out } => vec![d_out, d_in],
            Self::Conv {
                c_in,
                c_out,
                kernel,
            } => vec![c_out, c_in, kernel, kernel],
        }
    }
}

/// A layer of a model that a LoRA can be fused into.
#[derive(Debug, Clone)]
pub struct LoraModule {
    /// The checkpoint's module name (`down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out.0`).
    pub name: String,
    /// The Burn field path of its weight (`down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out.weight`).
    pub path: String,
    pub kind: LoraLayerKind,
    /// Its weight is held in quantized blocks (a GGUF file), which a LoRA cannot be fused into.
    pub quantized: bool,
}

/// A model that takes LoRAs: how its Burn field paths map to the checkpoint's module names.
pub trait LoraTarget<B: Backend>: Module<B> {
    /// The checkpoint module name of the layer at Burn field path `path` (enum variants left
    /// out, no trailing `.weight`), the way the model's loader read it.
    fn checkpoint_module(path: &str) -> String;

    /// The kohya-style name (`_` for `.`) of this model's layer that a kohya file may call
    /// `name` by another convention, e.g. an SDXL UNet's original (SGM) block names;
    /// `None` when there is no other name.
    fn kohya_alias(&self, _name: &str) -> Option<String> {
        None
    }

    /// A kohya layer that stands for several of this model's layers, or for one with its
    /// output rows in another order (Flux's fused `img_attn_qkv` is diffusers' `to_q`,
    /// `to_k`, `to_v`); `None` when `name` is no such layer.
    fn kohya_split(&self, _name: &str) -> Option<KohyaSplit> {
        None
    }
}

/// How one kohya layer maps onto several layers of the model (kohya-style names).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KohyaSplit {
    /// The layer's output is the targets' outputs one after another (a fused qkv): each
    /// target takes its rows of the up matrix, all share the down matrix (a block-diagonal
    /// up, the "sparse" layout, comes out the same).
    Concat(Vec<String>),
    /// One target whose output halves come in the other order (the original Flux's final
    /// modulation is `shift, scale`, diffusers' `norm_out.linear` is `scale, shift`).
    SwapHalves(String),
}

pub(super) enum SplitError {
    Absent(String),
    Rows(String),
}

/// The per-target pairs of a kohya layer that [`KohyaSplit`] maps onto several layers.
pub(super) fn split_layer<'m>(
    layer: &LoraLayer,
    split: &KohyaSplit,
    find: impl Fn(&str) -> Option<&'m LoraModule>,
) -> std::result::Result<Vec<(LoraLayer, &'m LoraModule)>, SplitError> {
    let names: Vec<&String> = match split {
        KohyaSplit::Concat(names) => names.iter().collect(),
        KohyaSplit::SwapHalves(name) => vec![name],
    };
    let modules = names
        .iter()
        .map(|name| find(name).ok_or_else(|| SplitError::Absent(name.to_string())))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let (rows, rank) = (layer.up.1[0], layer.rank());
    let outs: Vec<usize> = modules.iter().map(|m| m.kind.out()).collect();
    let described = || {
        modules
            .iter()
            .map(|m| format!("{} {:?}", m.name, m.kind.torch_shape()))
            .collect::<Vec<_>>()
            .join(", ")
    };
    if outs.iter().sum::<usize>() != rows
        || (matches!(split, KohyaSplit::SwapHalves(_)) && !rows.is_multiple_of(2))
    {
        return Err(SplitError::Rows(described()));
    }
    // `(start, end)` row ranges of `up`, in order
    let take = |ranges: &[(usize, usize)]| -> (Vec<f32>, Vec<usize>) {
        let mut values = Vec::new();
        let mut n = 0;
        for &(start, end) in ranges {
            values.extend_from_slice(&layer.up.0[start * rank..end * rank]);
            n += end - start;
        }
        let mut shape = layer.up.1.clone();
        shape[0] = n;
        (values, shape)
    };
    let part = |up, module: &LoraModule| LoraLayer {
        name: module.name.clone(),
        key: format!("{} ({})", layer.key, module.name),
        down: layer.down.clone(),
        up,
        scaling: layer.scaling,
    };
    Ok(match split {
        KohyaSplit::Concat(_) => {
            let mut start = 0;
            modules
                .into_iter()
                .zip(outs)
                .map(|(module, out)| {
                    let up = take(&[(start, start + out)]);
                    start += out;
                    (part(up, module), module)
                })
                .collect()
        }
        KohyaSplit::SwapHalves(_) => {
            let up = take(&[(rows / 2, rows), (0, rows / 2)]);
            vec![(part(up, modules[0]), modules[0])]
        }
    })
}

/// The diffusers module name of a Burn field path in oxidiff's diffusers models: field names
/// equal checkpoint keys except `to_out` (`to_out.0`) and a feed-forward's `proj_in` /
/// `proj_out` (`net.0.proj` / `net.2`, also in Flux's and SD3's `ff_context`); PixArt's
/// optional size embedders sit in a `sizes` field that the checkpoint has no level for.
fn diffusers_module(path: &str) -> String {
    let segments: Vec<&str> = path.split('.').collect();
    let mut out = Vec::with_capacity(segments.len() + 2);
    for (i, segment) in segments.iter().enumerate() {
        let parent = i.checked_sub(1).map(|j| segments[j]);
        match (parent, *segment) {
            (_, "to_out") => out.extend(["to_out", "0"]),
            (Some("ff" | "ff_context"), "proj_in") => out.extend(["net", "0", "proj"]),
            (Some("ff" | "ff_context"), "proj_out") => out.extend(["net", "2"]),
            (Some("emb"), "sizes") => {}
            _ => out.push(segment),
        }
    }
    out.join(".")
}

impl<B: Backend> LoraTarget<B> for UNet2DConditionModel<B> {
    fn checkpoint_module(path: &str) -> String {
        diffusers_module(path)
    }

    /// kohya's SDXL LoRAs name UNet layers as the original (SGM/LDM) UNet does:
    /// `input_blocks_4_1_transformer_blocks_0_attn1_to_q`, `middle_block_0_in_layers_2`,
    /// `output_blocks_2_2_conv`, `label_emb_0_0`, ... This maps them the way diffusers'
    /// `_maybe_map_sgm_blocks_to_diffusers` and `_convert_unet_lora_key` do.
    fn kohya_alias(&self, name: &str) -> Option<String> {
        let per = self.down_blocks.first()?.resnets().len() + 1;
        let fixed = [
            ("input_blocks_0_0", "conv_in"),
            ("out_2", "conv_out"),
            ("time_embed_0", "time_embedding_linear_1"),
            ("time_embed_2", "time_embedding_linear_2"),
            ("label_emb_0_0", "add_embedding_linear_1"),
            ("label_emb_0_2", "add_embedding_linear_2"),
        ];
        if let Some((_, ours)) = fixed.iter().find(|(sgm, _)| *sgm == name) {
            return Some(ours.to_string());
        }
        let resnet = |rest: &str| -> Option<&'static str> {
            Some(match rest {
                "in_layers_2" => "conv1",
                "out_layers_3" => "conv2",
                "emb_layers_1" => "time_emb_proj",
                "skip_connection" => "conv_shortcut",
                _ => return None,
            })
        };
        if let Some(rest) = name.strip_prefix("input_blocks_") {
            let (i, rest) = leading_number(rest)?;
            let (j, rest) = leading_number(rest)?;
            let (block, layer) = (i.checked_sub(1)? / per, (i.checked_sub(1)?) % per);
            return match (j, rest) {
                (0, "op") => Some(format!("down_blocks_{block}_downsamplers_0_conv")),
                (0, rest) => Some(format!(
                    "down_blocks_{block}_resnets_{layer}_{}",
                    resnet(rest)?
                )),
                (1, rest) => Some(format!("down_blocks_{block}_attentions_{layer}_{rest}")),
                _ => None,
            };
        }
        if let Some(rest) = name.strip_prefix("middle_block_") {
            let (i, rest) = leading_number(rest)?;
            return match i {
                0 => Some(format!("mid_block_resnets_0_{}", resnet(rest)?)),
                1 => Some(format!("mid_block_attentions_0_{rest}")),
                2 => Some(format!("mid_block_resnets_1_{}", resnet(rest)?)),
                _ => None,
            };
        }
        if let Some(rest) = name.strip_prefix("output_blocks_") {
            let (i, rest) = leading_number(rest)?;
            let (j, rest) = leading_number(rest)?;
            let (block, layer) = (i / per, i % per);
            let has_attentions = !self.up_blocks.get(block)?.attentions().is_empty();
            return match (j, rest) {
                (0, rest) => Some(format!(
                    "up_blocks_{block}_resnets_{layer}_{}",
                    resnet(rest)?
                )),
                (1, "conv") if !has_attentions => {
                    Some(format!("up_blocks_{block}_upsamplers_0_conv"))
                }
                (1, rest) => Some(format!("up_blocks_{block}_attentions_{layer}_{rest}")),
                (2, "conv") => Some(format!("up_blocks_{block}_upsamplers_0_conv")),
                _ => None,
            };
        }
        None
    }
}

impl<B: Backend> LoraTarget<B> for SD3Transformer2DModel<B> {
    fn checkpoint_module(path: &str) -> String {
        diffusers_module(path)
    }
}

impl<B: Backend> LoraTarget<B> for PixArtTransformer2DModel<B> {
    fn checkpoint_module(path: &str) -> String {
        diffusers_module(path)
    }
}

impl<B: Backend> LoraTarget<B> for FluxTransformer2DModel<B> {
    fn checkpoint_module(path: &str) -> String {
        diffusers_module(path)
    }

    /// kohya/sd-scripts Flux LoRAs name layers as the original (BFL) Flux model does; this
    /// maps them as diffusers' `_convert_kohya_flux_lora_to_diffusers` does
    /// (`double_blocks_0_img_attn_proj` is `transformer_blocks.0.attn.to_out.0`, ...).
    fn kohya_alias(&self, name: &str) -> Option<String> {
        let fixed = [
            ("img_in", "x_embedder"),
            ("txt_in", "context_embedder"),
            (
                "time_in_in_layer",
                "time_text_embed_timestep_embedder_linear_1",
            ),
            (
                "time_in_out_layer",
                "time_text_embed_timestep_embedder_linear_2",
            ),
            (
                "vector_in_in_layer",
                "time_text_embed_text_embedder_linear_1",
            ),
            (
                "vector_in_out_layer",
                "time_text_embed_text_embedder_linear_2",
            ),
            (
                "guidance_in_in_layer",
                "time_text_embed_guidance_embedder_linear_1",
            ),
            (
                "guidance_in_out_layer",
                "time_text_embed_guidance_embedder_linear_2",
            ),
            ("final_layer_linear", "proj_out"),
        ];
        if let Some((_, ours)) = fixed.iter().find(|(bfl, _)| *bfl == name) {
            return Some(ours.to_string());
        }
        if let Some(rest) = name.strip_prefix("double_blocks_") {
            let (i, rest) = leading_number(rest)?;
            let block = format!("transformer_blocks_{i}");
            let layer = match rest {
                "img_attn_proj" => "attn_to_out_0",
                "img_mlp_0" => "ff_net_0_proj",
                "img_mlp_2" => "ff_net_2",
                "img_mod_lin" => "norm1_linear",
                "txt_attn_proj" => "attn_to_add_out",
                "txt_mlp_0" => "ff_context_net_0_proj",
                "txt_mlp_2" => "ff_context_net_2",
                "txt_mod_lin" => "norm1_context_linear",
                _ => return None,
            };
            return Some(format!("{block}_{layer}"));
        }
        if let Some(rest) = name.strip_prefix("single_blocks_") {
            let (i, rest) = leading_number(rest)?;
            let layer = match rest {
                "linear2" => "proj_out",
                "modulation_lin" => "norm_linear",
                _ => return None,
            };
            return Some(format!("single_transformer_blocks_{i}_{layer}"));
        }
        None
    }

    /// The fused projections of the original Flux: a double block's `img_attn_qkv` /
    /// `txt_attn_qkv`, a single block's `linear1` (q, k, v and the MLP's input), and the
    /// final modulation with its halves swapped (diffusers' `swap_scale_shift`).
    fn kohya_split(&self, name: &str) -> Option<KohyaSplit> {
        if name == "final_layer_adaLN_modulation_1" {
            return Some(KohyaSplit::SwapHalves("norm_out_linear".into()));
        }
        let concat = |block: String, layers: &[&str]| {
            Some(KohyaSplit::Concat(
                layers.iter().map(|l| format!("{block}_{l}")).collect(),
            ))
        };
        if let Some(rest) = name.strip_prefix("double_blocks_") {
            let (i, rest) = leading_number(rest)?;
            let block = format!("transformer_blocks_{i}_attn");
            return match rest {
                "img_attn_qkv" => concat(block, &["to_q", "to_k", "to_v"]),
                "txt_attn_qkv" => concat(block, &["add_q_proj", "add_k_proj", "add_v_proj"]),
                _ => None,
            };
        }
        if let Some(rest) = name.strip_prefix("single_blocks_") {
            let (i, rest) = leading_number(rest)?;
            let block = format!("single_transformer_blocks_{i}");
            return (rest == "linear1")
                .then(|| concat(block, &["attn_to_q", "attn_to_k", "attn_to_v", "proj_mlp"]))
                .flatten();
        }
        None
    }
}

/// `("12", "rest")` from `"12_rest"` (or `"12"`), as a number and what follows its `_`.
fn leading_number(text: &str) -> Option<(usize, &str)> {
    let end = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let number = text[..end].parse().ok()?;
    let rest = &text[end..];
    Some((number, rest.strip_prefix('_').unwrap_or(rest)))
}

impl<B: Backend> LoraTarget<B> for ClipTextModel<B> {
    /// `layers.N.q_proj` is `encoder.layers.N.self_attn.q_proj`, `layers.N.fc1` is
    /// `encoder.layers.N.mlp.fc1`; names are given without the optional `text_model.` level
    /// (LoRA names with it are matched too).
    fn checkpoint_module(path: &str) -> String {
        let segments: Vec<&str> = path.split('.').collect();
        match segments.as_slice() {
            ["layers", n, proj @ ("q_proj" | "k_proj" | "v_proj" | "out_proj")] => {
                format!("encoder.layers.{n}.self_attn.{proj}")
            }
            ["layers", n, fc @ ("fc1" | "fc2")] => format!("encoder.layers.{n}.mlp.{fc}"),
            _ => path.to_string(),
        }
    }
}

/// Tracks the Burn field path while a visitor or mapper walks a module.
#[derive(Default)]
pub(super) struct PathTracker {
    /// `(name, container type)` of each level entered.
    stack: Vec<(String, String)>,
}

impl PathTracker {
    pub(super) fn enter(&mut self, name: &str, container: &str) {
        self.stack.push((name.to_string(), container.to_string()));
    }

    pub(super) fn exit(&mut self) {
        self.stack.pop();
    }

    /// The path without enum variant names.
    pub(super) fn path(&self) -> String {
        self.stack
            .iter()
            .filter(|(_, container)| !container.starts_with("Enum:"))
            .map(|(name, _)| name.as_str())
            .collect::<Vec<_>>()
            .join(".")
    }

    /// The struct holding the current parameter and the parameter's field name.
    fn leaf(&self) -> Option<(&str, &str)> {
        self.stack
            .last()
            .map(|(name, container)| (name.as_str(), container.as_str()))
    }
}

struct Collector {
    tracker: PathTracker,
    /// Path, dims, whether a Linear, whether held quantized (its dense form not yet made).
    found: Vec<(String, Vec<usize>, bool, bool)>,
}

impl<B: Backend> ModuleVisitor<B> for Collector {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.tracker.enter(name, container_type);
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.tracker.exit();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let linear = match self.tracker.leaf() {
            Some(("weight", "Struct:Linear")) if D == 2 => true,
            Some(("weight", "Struct:Conv2d")) if D == 4 => false,
            _ => return,
        };
        // The lazy shape: asking for the value would dequantize a quantized weight (or convert
        // one that waits for its first use).
        self.found.push((
            self.tracker.path(),
            param.lazy_shape().to_vec(),
            linear,
            !param.is_initialized() && crate::nn::is_quantized_dense(param.id),
        ));
    }
}

/// The Linear and Conv2d layers of `model`, with their checkpoint names.
pub fn lora_modules<B: Backend, M: LoraTarget<B>>(model: &M) -> Vec<LoraModule> {
    let mut collector = Collector {
        tracker: PathTracker::default(),
        found: Vec::new(),
    };
    model.visit(&mut collector);
    collector
        .found
        .into_iter()
        .map(|(path, dims, linear, quantized)| {
            let module_path = path.strip_suffix(".weight").unwrap_or(&path);
            let kind = if linear {
                LoraLayerKind::Linear {
                    d_in: dims[0],
                    d_out: dims[1],
                }
            } else {
                LoraLayerKind::Conv {
                    c_out: dims[0],
                    c_in: dims[1],
                    kernel: dims[2],
                }
            };
            LoraModule {
                name: M::checkpoint_module(module_path),
                path,
                kind,
                quantized,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn module(name: &str, d_out: usize) -> LoraModule {
        LoraModule {
            name: name.into(),
            path: name.into(),
            kind: LoraLayerKind::Linear { d_in: 2, d_out },
            quantized: false,
        }
    }

    /// A rank-1 layer whose up column is `0, 1, 2, ...` (one value per output row).
    fn layer(rows: usize) -> LoraLayer {
        LoraLayer {
            name: "x".into(),
            key: "lora_unet_x".into(),
            down: (vec![1.0, 1.0], vec![1, 2]),
            up: ((0..rows).map(|i| i as f32).collect(), vec![rows, 1]),
            scaling: 0.5,
        }
    }

    #[test]
    fn kohya_splits_take_their_rows_of_up_and_share_down() {
        let modules = [module("q", 2), module("k", 2), module("mlp", 4)];
        let find = |name: &str| modules.iter().find(|m| m.name == name);
        let split = KohyaSplit::Concat(vec!["q".into(), "k".into(), "mlp".into()]);
        let Ok(parts) = split_layer(&layer(8), &split, find) else {
            panic!("8 rows split into 2 + 2 + 4");
        };
        let ups: Vec<(&str, Vec<f32>)> = parts
            .iter()
            .map(|(p, m)| (m.name.as_str(), p.up.0.clone()))
            .collect();
        assert_eq!(
            ups,
            vec![
                ("q", vec![0.0, 1.0]),
                ("k", vec![2.0, 3.0]),
                ("mlp", vec![4.0, 5.0, 6.0, 7.0])
            ]
        );
        assert!(parts
            .iter()
            .all(|(p, _)| p.down == layer(8).down && p.scaling == 0.5));
        assert!(matches!(
            split_layer(&layer(7), &split, find),
            Err(SplitError::Rows(_))
        ));
        let missing = KohyaSplit::Concat(vec!["q".into(), "v".into()]);
        assert!(matches!(
            split_layer(&layer(4), &missing, find),
            Err(SplitError::Absent(name)) if name == "v"
        ));
    }

    #[test]
    fn kohya_final_modulation_swaps_shift_and_scale() {
        let modules = [module("norm_out_linear", 4)];
        let find = |name: &str| modules.iter().find(|m| m.name == name);
        let split = KohyaSplit::SwapHalves("norm_out_linear".into());
        let Ok(parts) = split_layer(&layer(4), &split, find) else {
            panic!("4 rows fit");
        };
        assert_eq!(parts[0].0.up, (vec![2.0, 3.0, 0.0, 1.0], vec![4, 1]));
    }
}
