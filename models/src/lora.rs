//! LoRA files (diffusers/PEFT and kohya/A1111 format), fused into a model's weights: the
//! UNet, the SD3/Flux/PixArt transformers and the CLIP text encoders.
//!
//! Where this sits: pipelines open a file with [`LoraFile::open`], resolve it against each of
//! their models with [`plan`] (every key must name an existing layer of the right shape) and
//! then [`fuse`] it: `W += scale * alpha / rank * up @ down` for each layer, as diffusers'
//! `fuse_lora(lora_scale=scale)` does.
//!
//! **Fused, not applied on the fly.** The fused model is the same plain UNet or text encoder
//! with other weight values, so eager mode costs nothing extra per step and compiled mode,
//! whose program takes the weights as parameters, traces the very program it would trace
//! without a LoRA (same ops, same shapes: the XLA executable cached on disk is reused). An
//! on-the-fly LoRA would add two matmuls per layer to every step and a new program for each
//! set of LoRAs. The cost: a fused LoRA is not unloaded by itself (fuse it again with the
//! negated scale, or reload the model), and changing its scale means fusing the difference.
//!
//! Layers are found by the checkpoint's own module names (`down_blocks.0.attentions.0.
//! transformer_blocks.0.attn1.to_q`): each model that takes LoRAs says, in its
//! [`LoraTarget`] impl, how a Burn field path maps to that name, so a kohya key
//! (`lora_unet_down_blocks_0_..._attn1_to_q`) is the same name with `_` for `.`; kohya's SDXL
//! files, which use the original (SGM) UNet's block names, go through
//! [`LoraTarget::kohya_alias`]; kohya's Flux files, which use the original (BFL) Flux's
//! names and fused projections (`double_blocks_0_img_attn_qkv`), through `kohya_alias` and
//! [`LoraTarget::kohya_split`].

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use crate::clip::ClipTextModel;
use crate::error::{ModelError, Result};
use crate::pixart_transformer_2d::PixArtTransformer2DModel;
use crate::transformer_flux::FluxTransformer2DModel;
use crate::transformer_sd3::SD3Transformer2DModel;
use crate::unet_2d_condition::UNet2DConditionModel;
use crate::weights::Weights;

/// The part of a pipeline a LoRA layer belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LoraComponent {
    Unet,
    /// The denoiser of SD3, Flux and PixArt (`transformer.`; kohya files call it `lora_unet_`
    /// too, see [`LoraFile::kohya_denoiser`]).
    Transformer,
    TextEncoder,
    /// SDXL's second text encoder (`text_encoder_2.`, kohya `lora_te2_`).
    TextEncoder2,
}

impl LoraComponent {
    /// The diffusers component name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Unet => "unet",
            Self::Transformer => "transformer",
            Self::TextEncoder => "text_encoder",
            Self::TextEncoder2 => "text_encoder_2",
        }
    }
}

/// How the file names its keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoraFormat {
    /// diffusers/PEFT: `unet.<module>.lora_A.weight` / `lora_B.weight` (also the older
    /// `lora.down.weight` / `lora.up.weight`), alphas in the `lora_adapter_metadata`.
    Diffusers,
    /// kohya-ss / A1111 / civitai: `lora_unet_<module>.lora_down.weight` / `lora_up.weight` /
    /// `alpha`, with `.` in module names written as `_`.
    Kohya,
}

/// One layer's low-rank pair, as read from the file.
#[derive(Debug, Clone)]
pub struct LoraLayer {
    /// The module as the file names it, without the component prefix
    /// (`down_blocks.0.attentions.0.proj_in`, or kohya's `down_blocks_0_attentions_0_proj_in`).
    pub name: String,
    /// The file's key stem, for messages (`lora_unet_down_blocks_0_attentions_0_proj_in`).
    pub key: String,
    /// `[rank, fan_in]` or `[rank, c_in, k, k]`.
    pub down: (Vec<f32>, Vec<usize>),
    /// `[out, rank]` or `[out, rank, 1, 1]`.
    pub up: (Vec<f32>, Vec<usize>),
    /// `alpha / rank` (`alpha / sqrt(rank)` for rsLoRA); 1 when the file gives no alpha.
    pub scaling: f32,
}

impl LoraLayer {
    pub fn rank(&self) -> usize {
        self.down.1.first().copied().unwrap_or(0)
    }
}

/// A LoRA file, parsed and checked for shape consistency (not yet against a model).
#[derive(Debug, Clone)]
pub struct LoraFile {
    pub path: PathBuf,
    pub format: LoraFormat,
    pub layers: BTreeMap<LoraComponent, Vec<LoraLayer>>,
}

/// How many keys a message lists before it says "and N more".
const LISTED: usize = 12;

fn list(items: &[String]) -> String {
    let mut text = items
        .iter()
        .take(LISTED)
        .cloned()
        .collect::<Vec<_>>()
        .join("; ");
    if items.len() > LISTED {
        text.push_str(&format!("; and {} more", items.len() - LISTED));
    }
    text
}

#[derive(Default)]
struct Parts {
    down: Option<String>,
    up: Option<String>,
    alpha: Option<String>,
}

/// The PEFT config diffusers writes into `__metadata__["lora_adapter_metadata"]`, per component.
#[derive(Default)]
struct AdapterConfig {
    lora_alpha: Option<f32>,
    alpha_pattern: Vec<(String, f32)>,
    use_rslora: bool,
}

impl AdapterConfig {
    fn alpha_for(&self, module: &str) -> Option<f32> {
        self.alpha_pattern
            .iter()
            .find(|(pattern, _)| module == pattern || module.ends_with(&format!(".{pattern}")))
            .map(|(_, alpha)| *alpha)
            .or(self.lora_alpha)
    }
}

impl LoraFile {
    /// Reads a LoRA safetensors file (its header checked like every checkpoint's). Any key that
    /// is not a LoRA down/up/alpha of a UNet or text encoder is an error naming it: nothing is
    /// dropped silently.
    pub fn open(path: &Path) -> Result<Self> {
        let weights = Weights::from_standalone_file(path)?;
        let err = |reason: String| ModelError::Lora {
            path: path.to_path_buf(),
            reason,
        };
        let mut keys: Vec<&str> = weights.keys().collect();
        keys.sort_unstable();
        if keys.is_empty() {
            return Err(err("the file holds no tensors".into()));
        }
        let mut groups: BTreeMap<(LoraComponent, String), (String, Parts)> = BTreeMap::new();
        let mut unknown = Vec::new();
        let (mut kohya, mut diffusers) = (0usize, 0usize);
        for &key in &keys {
            let Some((component, stem, part, is_kohya)) = classify(key) else {
                unknown.push(format!("`{key}`"));
                continue;
            };
            if is_kohya {
                kohya += 1;
            } else {
                diffusers += 1;
            }
            let (component_prefix, name) = stem;
            let entry = groups
                .entry((component, name))
                .or_insert_with(|| (component_prefix.to_string(), Parts::default()));
            let slot = match part {
                Part::Down => &mut entry.1.down,
                Part::Up => &mut entry.1.up,
                Part::Alpha => &mut entry.1.alpha,
            };
            if let Some(previous) = slot.replace(key.to_string()) {
                unknown.push(format!(
                    "`{key}` (a second weight for the layer of `{previous}`)"
                ));
            }
        }
        if !unknown.is_empty() {
            return Err(err(format!(
                "{} key(s) are not LoRA weights oxidiff can fuse: {}. oxidiff reads \
                 diffusers/PEFT LoRAs (`unet.<module>.lora_A.weight` / `lora_B.weight`, \
                 `transformer.<module>...`) and kohya/A1111 LoRAs \
                 (`lora_unet_<module>.lora_down.weight` / `lora_up.weight` / `alpha`, also \
                 `lora_transformer_`, `lora_te_`, `lora_te1_`, `lora_te2_`); LoHa, LoKr, DoRA \
                 and LoRA biases are not supported",
                unknown.len(),
                list(&unknown)
            )));
        }
        if kohya > 0 && diffusers > 0 {
            return Err(err(
                "the file mixes kohya (`lora_unet_...`) and diffusers (`unet....`) keys".into(),
            ));
        }
        let format = if kohya > 0 {
            LoraFormat::Kohya
        } else {
            LoraFormat::Diffusers
        };
        let configs = adapter_configs(&weights).map_err(err)?;
        let mut layers: BTreeMap<LoraComponent, Vec<LoraLayer>> = BTreeMap::new();
        let mut problems = Vec::new();
        for ((component, name), (prefix, parts)) in groups {
            let stem = format!("{prefix}{name}");
            let (Some(down_key), Some(up_key)) = (parts.down, parts.up) else {
                problems.push(format!(
                    "`{stem}` has no {} weight",
                    if format == LoraFormat::Kohya {
                        "lora_down/lora_up pair (one is missing)"
                    } else {
                        "lora_A/lora_B pair (one is missing)"
                    }
                ));
                continue;
            };
            let down = weights.read_f32(&down_key)?;
            let up = weights.read_f32(&up_key)?;
            let rank = down.1.first().copied().unwrap_or(0);
            let consistent = down.1.len() >= 2
                && (up.1.len() == 2 || (up.1.len() == 4 && up.1[2] == 1 && up.1[3] == 1))
                && up.1[1] == rank
                && rank > 0;
            if down.0.iter().chain(&up.0).any(|v| !v.is_finite()) {
                problems.push(format!("`{stem}`: its weights hold NaN or infinite values"));
                continue;
            }
            if !consistent {
                problems.push(format!(
                    "`{stem}`: down {:?} and up {:?} are not a low-rank pair (down [rank, in..], \
                     up [out, rank])",
                    down.1, up.1
                ));
                continue;
            }
            let config = configs.get(&component);
            let alpha = match &parts.alpha {
                Some(key) => {
                    let (values, _) = weights.read_f32(key)?;
                    match values.as_slice() {
                        [alpha] if alpha.is_finite() => Some(*alpha),
                        _ => {
                            problems.push(format!("`{key}` is not a single finite number"));
                            continue;
                        }
                    }
                }
                None => config.and_then(|c| c.alpha_for(&name)),
            };
            let rslora = config.is_some_and(|c| c.use_rslora);
            let scaling = match alpha {
                Some(alpha) if rslora => alpha / (rank as f32).sqrt(),
                Some(alpha) => alpha / rank as f32,
                None => 1.0,
            };
            layers.entry(component).or_default().push(LoraLayer {
                name,
                key: stem,
                down,
                up,
                scaling,
            });
        }
        if !problems.is_empty() {
            return Err(err(list(&problems)));
        }
        Ok(Self {
            path: path.to_path_buf(),
            format,
            layers,
        })
    }

    /// kohya files name every denoiser `lora_unet_`, a DiT's too: for a pipeline whose
    /// denoiser is a transformer, this files a kohya file's UNet layers under
    /// [`LoraComponent::Transformer`].
    pub fn kohya_denoiser(mut self, denoiser: LoraComponent) -> Self {
        if self.format == LoraFormat::Kohya && denoiser != LoraComponent::Unet {
            if let Some(layers) = self.layers.remove(&LoraComponent::Unet) {
                self.layers.entry(denoiser).or_default().extend(layers);
            }
        }
        self
    }

    /// The components this file has layers for.
    pub fn components(&self) -> Vec<LoraComponent> {
        self.layers.keys().copied().collect()
    }

    /// Layers for `component` (empty when the file has none).
    pub fn layers_of(&self, component: LoraComponent) -> &[LoraLayer] {
        self.layers.get(&component).map_or(&[], Vec::as_slice)
    }

    /// Errors when the file has layers for a component the pipeline lacks (an SDXL LoRA's
    /// `text_encoder_2` on SD 1.x).
    pub fn expect_components(&self, available: &[LoraComponent], model: &str) -> Result<()> {
        let extra: Vec<String> = self
            .layers
            .iter()
            .filter(|(c, _)| !available.contains(c))
            .map(|(c, l)| format!("{} ({} layers, e.g. `{}`)", c.name(), l.len(), l[0].key))
            .collect();
        if extra.is_empty() {
            return Ok(());
        }
        Err(ModelError::Lora {
            path: self.path.clone(),
            reason: format!(
                "it has layers for {}, which {model} does not have: the LoRA is for another \
                 model family",
                extra.join(", ")
            ),
        })
    }
}

enum Part {
    Down,
    Up,
    Alpha,
}

/// `(component, (key prefix, module name), part, is_kohya)` of a LoRA key, or `None`.
fn classify(key: &str) -> Option<(LoraComponent, (&str, String), Part, bool)> {
    const KOHYA: [(&str, LoraComponent); 5] = [
        ("lora_unet_", LoraComponent::Unet),
        // kohya-style keys over diffusers' transformer module names, a Flux layout diffusers
        // reads in `_convert_mixture_state_dict_to_diffusers`
        ("lora_transformer_", LoraComponent::Transformer),
        ("lora_te_", LoraComponent::TextEncoder),
        ("lora_te1_", LoraComponent::TextEncoder),
        ("lora_te2_", LoraComponent::TextEncoder2),
    ];
    for (prefix, component) in KOHYA {
        if let Some(rest) = key.strip_prefix(prefix) {
            let (name, suffix) = rest.split_once('.')?;
            let part = match suffix {
                "lora_down.weight" => Part::Down,
                "lora_up.weight" => Part::Up,
                "alpha" => Part::Alpha,
                _ => return None,
            };
            return (!name.is_empty()).then(|| (component, (prefix, name.to_string()), part, true));
        }
    }
    const DIFFUSERS: [(&str, LoraComponent); 4] = [
        ("unet.", LoraComponent::Unet),
        ("transformer.", LoraComponent::Transformer),
        ("text_encoder.", LoraComponent::TextEncoder),
        ("text_encoder_2.", LoraComponent::TextEncoder2),
    ];
    const SUFFIXES: [(&str, Part); 9] = [
        (".lora_A.weight", Part::Down),
        (".lora_B.weight", Part::Up),
        (".lora.down.weight", Part::Down),
        (".lora.up.weight", Part::Up),
        (".lora_linear_layer.down.weight", Part::Down),
        (".lora_linear_layer.up.weight", Part::Up),
        (".alpha", Part::Alpha),
        // diffusers' older attention-processor LoRAs: `attn1.processor.to_q_lora.down.weight`
        ("_lora.down.weight", Part::Down),
        ("_lora.up.weight", Part::Up),
    ];
    for (prefix, component) in DIFFUSERS {
        if let Some(rest) = key.strip_prefix(prefix) {
            for (suffix, part) in SUFFIXES {
                if let Some(name) = rest.strip_suffix(suffix) {
                    let name = if suffix.starts_with('_') {
                        processor_module(component, name)?
                    } else {
                        name.to_string()
                    };
                    return (!name.is_empty()).then_some((component, (prefix, name), part, false));
                }
            }
            return None;
        }
    }
    None
}

/// The layer an attention-processor LoRA key names (`...attn1.processor.to_out` is the UNet's
/// `...attn1.to_out.0`; a text encoder's `self_attn.to_q` is its `self_attn.q_proj`), as
/// diffusers' `convert_state_dict_to_diffusers` maps them.
fn processor_module(component: LoraComponent, name: &str) -> Option<String> {
    let (parent, projection) = name.rsplit_once('.')?;
    let parent = parent.strip_suffix(".processor").unwrap_or(parent);
    let projection = match (component, projection) {
        (LoraComponent::Unet, "to_q" | "to_k" | "to_v") => projection,
        (LoraComponent::Unet, "to_out") => "to_out.0",
        (_, "to_q") => "q_proj",
        (_, "to_k") => "k_proj",
        (_, "to_v") => "v_proj",
        (_, "to_out") => "out_proj",
        _ => return None,
    };
    Some(format!("{parent}.{projection}"))
}

/// The PEFT configs diffusers stores as `lora_adapter_metadata` (`unet.lora_alpha`, ...).
fn adapter_configs(
    weights: &Weights,
) -> std::result::Result<HashMap<LoraComponent, AdapterConfig>, String> {
    let mut configs = HashMap::new();
    let Some(text) = weights.metadata().get("lora_adapter_metadata") else {
        return Ok(configs);
    };
    let value: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| format!("`lora_adapter_metadata` is not valid JSON: {e}"))?;
    let serde_json::Value::Object(fields) = value else {
        return Err("`lora_adapter_metadata` is not a JSON object".into());
    };
    for component in [
        LoraComponent::Unet,
        LoraComponent::Transformer,
        LoraComponent::TextEncoder,
        LoraComponent::TextEncoder2,
    ] {
        let get = |name: &str| fields.get(&format!("{}.{name}", component.name()));
        let mut config = AdapterConfig::default();
        let mut any = false;
        if let Some(alpha) = get("lora_alpha") {
            config.lora_alpha = Some(
                alpha
                    .as_f64()
                    .ok_or_else(|| format!("`{}.lora_alpha` is not a number", component.name()))?
                    as f32,
            );
            any = true;
        }
        if let Some(serde_json::Value::Object(pattern)) = get("alpha_pattern") {
            for (module, alpha) in pattern {
                let alpha = alpha
                    .as_f64()
                    .ok_or_else(|| format!("alpha_pattern entry `{module}` is not a number"))?;
                config.alpha_pattern.push((module.clone(), alpha as f32));
            }
            any = true;
        }
        config.use_rslora = get("use_rslora").and_then(serde_json::Value::as_bool) == Some(true);
        if get("use_dora").and_then(serde_json::Value::as_bool) == Some(true) {
            return Err(format!(
                "the {} adapter is a DoRA (`use_dora`), which oxidiff does not support",
                component.name()
            ));
        }
        if any || config.use_rslora {
            configs.insert(component, config);
        }
    }
    Ok(configs)
}

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
    fn out(self) -> usize {
        match self {
            Self::Linear { d_out, .. } => d_out,
            Self::Conv { c_out, .. } => c_out,
        }
    }

    fn fan_in(self) -> usize {
        match self {
            Self::Linear { d_in, .. } => d_in,
            Self::Conv { c_in, kernel, .. } => c_in * kernel * kernel,
        }
    }

    /// The PyTorch weight shape, for messages.
    fn torch_shape(self) -> Vec<usize> {
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

enum SplitError {
    Absent(String),
    Rows(String),
}

/// The per-target pairs of a kohya layer that [`KohyaSplit`] maps onto several layers.
fn split_layer<'m>(
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
struct PathTracker {
    /// `(name, container type)` of each level entered.
    stack: Vec<(String, String)>,
}

impl PathTracker {
    fn enter(&mut self, name: &str, container: &str) {
        self.stack.push((name.to_string(), container.to_string()));
    }

    fn exit(&mut self) {
        self.stack.pop();
    }

    /// The path without enum variant names.
    fn path(&self) -> String {
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
    found: Vec<(String, Vec<usize>, bool)>,
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
        self.found
            .push((self.tracker.path(), param.val().dims().to_vec(), linear));
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
        .map(|(path, dims, linear)| {
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
            }
        })
        .collect()
}

/// One layer's update: `factor * up @ down`, shaped for the Burn weight.
#[derive(Debug, Clone)]
struct Delta {
    up: Vec<f32>,
    down: Vec<f32>,
    rank: usize,
    kind: LoraLayerKind,
    factor: f32,
}

impl Delta {
    fn tensor<B: Backend, const D: usize>(
        &self,
        device: &B::Device,
        dims: [usize; D],
    ) -> Tensor<B, D> {
        let (out, fan_in) = (self.kind.out(), self.kind.fan_in());
        let up =
            Tensor::<B, 2>::from_data(TensorData::new(self.up.clone(), [out, self.rank]), device);
        let down = Tensor::<B, 2>::from_data(
            TensorData::new(self.down.clone(), [self.rank, fan_in]),
            device,
        );
        let delta = up.matmul(down).mul_scalar(self.factor);
        match self.kind {
            LoraLayerKind::Linear { .. } => delta.transpose().reshape(dims),
            LoraLayerKind::Conv { .. } => delta.reshape(dims),
        }
    }
}

/// A LoRA's layers for one model, resolved and shape-checked; [`fuse`] applies it.
#[derive(Debug, Clone, Default)]
pub struct LoraPlan {
    deltas: HashMap<String, Delta>,
}

impl LoraPlan {
    /// How many layers it changes.
    pub fn len(&self) -> usize {
        self.deltas.len()
    }

    pub fn is_empty(&self) -> bool {
        self.deltas.is_empty()
    }
}

/// Resolves `file`'s layers for `component` against `model` (scaled by `scale`). Every layer
/// must name an existing Linear or Conv2d of matching shape; otherwise the error lists each
/// key that does not fit, with both shapes (a LoRA for another architecture fails here, before
/// any weight changes).
pub fn plan<B: Backend, M: LoraTarget<B>>(
    model: &M,
    file: &LoraFile,
    component: LoraComponent,
    scale: f32,
) -> Result<LoraPlan> {
    let layers = file.layers_of(component);
    if layers.is_empty() {
        return Ok(LoraPlan::default());
    }
    let modules = lora_modules(model);
    let mut by_name: HashMap<String, &LoraModule> = HashMap::new();
    for module in &modules {
        match file.format {
            LoraFormat::Diffusers => by_name.insert(module.name.clone(), module),
            LoraFormat::Kohya => by_name.insert(module.name.replace('.', "_"), module),
        };
    }
    let find = |name: &str| {
        by_name
            .get(name)
            .copied()
            .or_else(|| {
                name.strip_prefix("text_model.")
                    .or_else(|| name.strip_prefix("text_model_"))
                    .and_then(|n| by_name.get(n).copied())
            })
            .or_else(|| {
                let alias = (file.format == LoraFormat::Kohya)
                    .then(|| model.kohya_alias(name))
                    .flatten()?;
                by_name.get(&alias).copied()
            })
    };
    let mut deltas = HashMap::new();
    let (mut misfits, mut absent) = (Vec::new(), Vec::new());
    let mut resolved: Vec<(std::borrow::Cow<LoraLayer>, &LoraModule)> = Vec::new();
    for layer in layers {
        if let Some(module) = find(&layer.name) {
            resolved.push((std::borrow::Cow::Borrowed(layer), module));
            continue;
        }
        let split = (file.format == LoraFormat::Kohya)
            .then(|| model.kohya_split(&layer.name))
            .flatten();
        let Some(split) = split else {
            absent.push(format!("`{}`", layer.key));
            continue;
        };
        match split_layer(layer, &split, |name| by_name.get(name).copied()) {
            Ok(parts) => resolved.extend(
                parts
                    .into_iter()
                    .map(|(part, module)| (std::borrow::Cow::Owned(part), module)),
            ),
            Err(SplitError::Absent(name)) => {
                absent.push(format!("`{}` (its part `{name}`)", layer.key))
            }
            Err(SplitError::Rows(targets)) => misfits.push(format!(
                "`{}` (up {:?}) against `{}` together",
                layer.key, layer.up.1, targets
            )),
        }
    }
    for (layer, module) in resolved {
        let (kind, rank) = (module.kind, layer.rank());
        // Checked: a hostile header may pair a zero dimension with huge ones.
        let down_fan_in = layer.down.1[1..]
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .unwrap_or(usize::MAX);
        let fits = down_fan_in == kind.fan_in()
            && layer.up.1[0] == kind.out()
            && match kind {
                LoraLayerKind::Linear { .. } => layer.down.1[2..].iter().all(|&d| d == 1),
                LoraLayerKind::Conv { c_in, kernel, .. } => {
                    layer.down.1.len() == 2 || layer.down.1[1..] == [c_in, kernel, kernel]
                }
            };
        if !fits {
            misfits.push(format!(
                "`{}` (down {:?}, up {:?}) against `{}` of shape {:?}",
                layer.key,
                layer.down.1,
                layer.up.1,
                module.name,
                kind.torch_shape()
            ));
            continue;
        }
        if deltas.contains_key(&module.path) {
            misfits.push(format!(
                "`{}`: a second LoRA pair for layer `{}`",
                layer.key, module.name
            ));
            continue;
        }
        deltas.insert(
            module.path.clone(),
            Delta {
                up: layer.up.0.clone(),
                down: layer.down.0.clone(),
                rank,
                kind,
                factor: scale * layer.scaling,
            },
        );
    }
    if !misfits.is_empty() || !absent.is_empty() {
        let mut parts = Vec::new();
        if !misfits.is_empty() {
            parts.push(format!("shapes that do not fit: {}", list(&misfits)));
        }
        if !absent.is_empty() {
            parts.push(format!(
                "layers the {} does not have: {}",
                component.name(),
                list(&absent)
            ));
        }
        return Err(ModelError::Lora {
            path: file.path.clone(),
            reason: format!(
                "{} of its {} {} layers do not match this model (is the LoRA for another \
                 model, e.g. SD 1.x against SDXL?); nothing was fused. {}",
                misfits.len() + absent.len(),
                layers.len(),
                component.name(),
                parts.join(". ")
            ),
        });
    }
    Ok(LoraPlan { deltas })
}

struct Fuser<'a> {
    tracker: PathTracker,
    plan: &'a LoraPlan,
    applied: usize,
}

impl<B: Backend> ModuleMapper<B> for Fuser<'_> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.tracker.enter(name, container_type);
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.tracker.exit();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let Some(delta) = self.plan.deltas.get(&self.tracker.path()) else {
            return param;
        };
        self.applied += 1;
        param.map(|weight| {
            let update = delta.tensor::<B, D>(&weight.device(), weight.dims());
            let dtype = weight.dtype();
            weight + update.cast(dtype)
        })
    }
}

/// Adds a planned LoRA to `model`'s weights (on their devices, in their dtype). Returns the
/// model and how many layers changed.
pub fn fuse<B: Backend, M: LoraTarget<B>>(model: M, plan: &LoraPlan) -> (M, usize) {
    if plan.is_empty() {
        return (model, 0);
    }
    let mut fuser = Fuser {
        tracker: PathTracker::default(),
        plan,
        applied: 0,
    };
    let model = model.map(&mut fuser);
    let applied = fuser.applied;
    (model, applied)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn module(name: &str, d_out: usize) -> LoraModule {
        LoraModule {
            name: name.into(),
            path: name.into(),
            kind: LoraLayerKind::Linear { d_in: 2, d_out },
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
