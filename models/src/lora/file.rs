//! LoRA files as they are written: diffusers/PEFT keys (`unet.<module>.lora_A.weight`, with
//! alphas in `lora_adapter_metadata`) and kohya/A1111 keys (`lora_unet_<module>.lora_down.weight`,
//! `alpha`), read into low-rank pairs per component and checked for consistency.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use crate::error::{ModelError, Result};
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

pub(super) fn list(items: &[String]) -> String {
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
    /// PEFT's `r`, the rank every layer without a `rank_pattern` entry has.
    rank: Option<usize>,
    rank_pattern: Vec<String>,
}

impl AdapterConfig {
    /// The rank the metadata gives `module`, unless a `rank_pattern` entry covers it.
    fn rank_for(&self, module: &str) -> Option<usize> {
        let patterned = self
            .rank_pattern
            .iter()
            .any(|p| module == p || module.ends_with(&format!(".{p}")));
        self.rank.filter(|_| !patterned)
    }

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
            // PEFT scales by `alpha / r` from the config: a file whose weights have another
            // rank than its metadata says is inconsistent, and either reading would guess.
            if let Some(r) = config.and_then(|c| c.rank_for(&name)) {
                if r != rank {
                    problems.push(format!(
                        "`{stem}` has rank {rank}, but the adapter metadata says `r: {r}`"
                    ));
                    continue;
                }
            }
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
        if let Some(r) = get("r") {
            let rank = r.as_u64().filter(|&r| r > 0).ok_or_else(|| {
                format!(
                    "`{}.r` must be a positive integer (the adapter's rank), got {r}",
                    component.name()
                )
            })?;
            config.rank = Some(rank as usize);
            any = true;
        }
        if let Some(serde_json::Value::Object(pattern)) = get("rank_pattern") {
            config.rank_pattern = pattern.keys().cloned().collect();
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
