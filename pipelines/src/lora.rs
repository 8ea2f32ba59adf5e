//! LoRAs on a pipeline: `pipe.load_lora(path, scale)` fuses a LoRA file into the denoiser
//! (UNet or transformer) and the CLIP text encoders (see `oxidiff_models::lora` for the
//! formats and why fused), and what the CLI records of it.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use burn::tensor::backend::Backend;
use oxidiff_models::lora::{self, LoraComponent, LoraFile, LoraFormat, LoraTarget};
use oxidiff_models::{ClipTextModel, ModelError};

use crate::error::{PipelineError, Result};

/// A LoRA file and its scale, as `txt2img --lora FILE[:SCALE]` takes it (scale 1 when absent).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSpec {
    pub path: PathBuf,
    pub scale: f32,
}

impl FromStr for LoraSpec {
    type Err = String;

    /// `FILE` or `FILE:SCALE` ([`parse_path_scale`](crate::path_scale::parse_path_scale)).
    fn from_str(text: &str) -> std::result::Result<Self, String> {
        let (path, scale) = crate::path_scale::parse_path_scale(text, "LoRA")?;
        Ok(Self { path, scale })
    }
}

/// What a fused LoRA changed.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraReport {
    pub path: PathBuf,
    /// The file name without `.safetensors`, as A1111's `<lora:NAME:SCALE>` names it.
    pub name: String,
    pub scale: f32,
    pub format: LoraFormat,
    /// Layers changed per component (`unet` or `transformer`, `text_encoder`,
    /// `text_encoder_2`).
    pub layers: Vec<(&'static str, usize)>,
    /// A1111's short LoRA hash: the first 12 hex digits of the SHA-256 of the file's tensor
    /// data (everything after the header), as its `Lora hashes` field records it.
    pub short_hash: String,
}

impl LoraReport {
    /// A1111's prompt tag, `<lora:NAME:SCALE>`.
    pub fn prompt_tag(&self) -> String {
        format!("<lora:{}:{}>", self.name, format_scale(self.scale))
    }

    /// One entry of A1111's `Lora hashes` field, `NAME: HASH`.
    pub fn hash_entry(&self) -> String {
        format!("{}: {}", self.name, self.short_hash)
    }
}

/// The prompt as A1111 records it with LoRAs: `PROMPT <lora:NAME:SCALE> ...`.
pub fn prompt_with_tags(prompt: &str, loras: &[LoraReport]) -> String {
    let mut text = prompt.to_string();
    for report in loras {
        if !text.is_empty() {
            text.push(' ');
        }
        text.push_str(&report.prompt_tag());
    }
    text
}

/// Splits A1111's `<lora:NAME[:SCALE]>` tags off a prompt: the prompt without them (trailing
/// space trimmed) and the tags, in order. oxidiff's text encoders never see the tags.
pub fn strip_prompt_tags(prompt: &str) -> (String, Vec<String>) {
    let mut rest = String::with_capacity(prompt.len());
    let mut tags = Vec::new();
    let mut text = prompt;
    while let Some(start) = text.find("<lora:") {
        let Some(len) = text[start..].find('>') else {
            break;
        };
        rest.push_str(&text[..start]);
        tags.push(text[start..start + len + 1].to_string());
        text = &text[start + len + 1..];
    }
    rest.push_str(text);
    (rest.trim_end().to_string(), tags)
}

/// The `Lora hashes` field A1111 writes: `NAME: HASH, NAME: HASH`.
pub fn hashes_field(loras: &[LoraReport]) -> String {
    loras
        .iter()
        .map(LoraReport::hash_entry)
        .collect::<Vec<_>>()
        .join(", ")
}

fn format_scale(scale: f32) -> String {
    let text = format!("{scale}");
    text.strip_suffix(".0").map(str::to_string).unwrap_or(text)
}

/// The data hash A1111 uses for LoRAs (`addnet_hash_safetensors`), first 12 hex digits.
fn short_hash(path: &Path) -> Result<String> {
    let io = |source| {
        PipelineError::Model(ModelError::Io {
            path: path.to_path_buf(),
            source,
        })
    };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(io)?;
    file.seek(SeekFrom::Start(8 + u64::from_le_bytes(len)))
        .map_err(io)?;
    let hex = crate::model_hash::sha256_hex(&mut file).map_err(io)?;
    Ok(hex[..12].to_string())
}

/// The model a pipeline denoises with, as a LoRA names it: the UNet (`unet.`) or a DiT
/// (`transformer.`; kohya files call both `lora_unet_`).
pub(crate) struct Denoiser<'a, M> {
    pub model: &'a mut M,
    pub component: LoraComponent,
}

impl<'a, M> Denoiser<'a, M> {
    pub fn unet(model: &'a mut M) -> Self {
        Self {
            model,
            component: LoraComponent::Unet,
        }
    }

    pub fn transformer(model: &'a mut M) -> Self {
        Self {
            model,
            component: LoraComponent::Transformer,
        }
    }
}

/// Fuses the LoRA at `path` into the denoiser and `encoders`: the whole file is checked
/// against every model before any weight changes, so an error leaves the pipeline as it was.
pub(crate) fn fuse_into<B: Backend, M: LoraTarget<B> + Clone>(
    path: &Path,
    scale: f32,
    denoiser: Denoiser<'_, M>,
    encoders: &mut [(LoraComponent, &mut ClipTextModel<B>)],
    pipeline: &str,
    compiled: bool,
) -> Result<LoraReport> {
    let component = denoiser.component;
    if compiled {
        return Err(PipelineError::InvalidInput(format!(
            "load LoRAs before compile(): the compiled step of this {pipeline} holds the {}'s \
             current weights, so a LoRA fused now would not reach it",
            component.name()
        )));
    }
    if !scale.is_finite() {
        return Err(PipelineError::InvalidInput(format!(
            "LoRA scale {scale} for {} is not a finite number",
            path.display()
        )));
    }
    let file = LoraFile::open(path)?.kohya_denoiser(component);
    let mut available = vec![component];
    available.extend(encoders.iter().map(|(c, _)| *c));
    file.expect_components(&available, pipeline)?;
    let denoiser_plan = lora::plan(&*denoiser.model, &file, component, scale)?;
    let encoder_plans = encoders
        .iter()
        .map(|(component, encoder)| lora::plan(&**encoder, &file, *component, scale))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let short_hash = short_hash(path)?;
    let mut layers = Vec::new();
    let (fused, n) = lora::fuse(denoiser.model.clone(), &denoiser_plan);
    *denoiser.model = fused;
    if n > 0 {
        layers.push((component.name(), n));
    }
    for ((component, encoder), plan) in encoders.iter_mut().zip(&encoder_plans) {
        let (fused, n) = lora::fuse((**encoder).clone(), plan);
        **encoder = fused;
        if n > 0 {
            layers.push((component.name(), n));
        }
    }
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .map(|n| n.strip_suffix(".safetensors").unwrap_or(n).to_string())
        .unwrap_or_else(|| "lora".into());
    let report = LoraReport {
        path: path.to_path_buf(),
        name,
        scale,
        format: file.format,
        layers,
        short_hash,
    };
    tracing::info!(
        "fused LoRA {} at scale {} ({:?} format): {:?}",
        path.display(),
        scale,
        report.format,
        report.layers
    );
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lora_spec_parses_file_and_optional_scale() {
        let spec: LoraSpec = "a/b.safetensors:0.8".parse().unwrap();
        assert_eq!(spec.path, PathBuf::from("a/b.safetensors"));
        assert_eq!(spec.scale, 0.8);
        let spec: LoraSpec = "a/b.safetensors".parse().unwrap();
        assert_eq!(spec.scale, 1.0);
        let spec: LoraSpec = "C:\\x.safetensors".parse().unwrap();
        assert_eq!(spec.path, PathBuf::from("C:\\x.safetensors"));
        assert_eq!(spec.scale, 1.0);
        let spec: LoraSpec = "x.safetensors:-0.5".parse().unwrap();
        assert_eq!(spec.scale, -0.5);
        assert!("".parse::<LoraSpec>().is_err());
        assert!(":0.5".parse::<LoraSpec>().is_err());
        assert!("x:inf".parse::<LoraSpec>().is_err());
    }

    #[test]
    fn prompt_tag_and_hash_entry_read_like_a1111() {
        let report = LoraReport {
            path: "x/detail.safetensors".into(),
            name: "detail".into(),
            scale: 0.75,
            format: LoraFormat::Kohya,
            layers: vec![("unet", 3)],
            short_hash: "0123456789ab".into(),
        };
        assert_eq!(report.prompt_tag(), "<lora:detail:0.75>");
        assert_eq!(report.hash_entry(), "detail: 0123456789ab");
        assert_eq!(format_scale(1.0), "1");
        let both = [report.clone(), report.clone()];
        let prompt = prompt_with_tags("a cat", &both);
        assert_eq!(prompt, "a cat <lora:detail:0.75> <lora:detail:0.75>");
        assert_eq!(
            hashes_field(&both),
            "detail: 0123456789ab, detail: 0123456789ab"
        );
        let (text, tags) = strip_prompt_tags(&prompt);
        assert_eq!(text, "a cat");
        assert_eq!(tags, vec!["<lora:detail:0.75>", "<lora:detail:0.75>"]);
        assert_eq!(prompt_with_tags("", &both[..1]), "<lora:detail:0.75>");
        let (text, tags) = strip_prompt_tags("a <lora:x> b <lora:unclosed");
        assert_eq!(
            (text.as_str(), tags),
            ("a  b <lora:unclosed", vec!["<lora:x>".to_string()])
        );
    }
}
