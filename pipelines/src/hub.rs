//! Finding a model: a local folder, or a Hugging Face Hub id in the standard Hub cache, fetched
//! with hf-hub when it is not there yet and the network is allowed.
//!
//! The cache layout is the one `huggingface_hub` writes:
//! `{cache}/models--{org}--{name}/refs/{revision}` holds a commit hash and
//! `{cache}/models--{org}--{name}/snapshots/{hash}/` the files. The cache folder is
//! `HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`; `HF_HUB_OFFLINE=1`
//! forbids the network and `HF_TOKEN` authenticates.

use std::path::{Path, PathBuf};

use crate::error::{PipelineError, Result};

/// A model reference as a user writes it: a folder, or `org/name` with an optional `@revision`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    Folder(PathBuf),
    Hub { repo_id: String, revision: String },
}

impl ModelSource {
    /// A path that exists is a folder; otherwise `org/name[@revision]` is a Hub id.
    pub fn parse(spec: &str) -> Result<Self> {
        let path = Path::new(spec);
        if path.exists() {
            return Ok(Self::Folder(path.to_path_buf()));
        }
        let (repo_id, revision) = match spec.split_once('@') {
            Some((id, rev)) => (id, rev),
            None => (spec, "main"),
        };
        let parts: Vec<&str> = repo_id.split('/').collect();
        let valid = |s: &str| {
            !s.is_empty()
                && s != "."
                && s != ".."
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        };
        if parts.len() == 2 && parts.iter().all(|p| valid(p)) && !revision.is_empty() {
            Ok(Self::Hub {
                repo_id: repo_id.to_string(),
                revision: revision.to_string(),
            })
        } else {
            Err(PipelineError::ModelNotFound {
                spec: spec.to_string(),
                hint: "no such folder, and not a Hub id of the form `org/name`; pass a \
                       diffusers-format folder (the one with model_index.json) or a Hub id \
                       such as stabilityai/sd-turbo"
                    .into(),
            })
        }
    }
}

/// The Hub cache folder from the environment.
pub fn hub_cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("HF_HUB_CACHE") {
        return PathBuf::from(dir);
    }
    if let Some(home) = std::env::var_os("HF_HOME") {
        return PathBuf::from(home).join("hub");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    home.join(".cache").join("huggingface").join("hub")
}

fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE")
        .map(|v| matches!(v.trim(), "1" | "true" | "TRUE" | "yes" | "on"))
        .unwrap_or(false)
}

/// The snapshot folder of `repo_id` at `revision` in `cache`, if it has a `model_index.json`.
pub fn cached_snapshot(cache: &Path, repo_id: &str, revision: &str) -> Option<PathBuf> {
    let repo_dir = cache.join(format!("models--{}", repo_id.replace('/', "--")));
    let is_hash = revision.len() == 40 && revision.chars().all(|c| c.is_ascii_hexdigit());
    let hash = if is_hash {
        revision.to_string()
    } else {
        std::fs::read_to_string(repo_dir.join("refs").join(revision))
            .ok()?
            .trim()
            .to_string()
    };
    if hash.is_empty() || hash.contains(['/', '\\', '.']) {
        return None;
    }
    let snapshot = repo_dir.join("snapshots").join(hash);
    snapshot
        .join("model_index.json")
        .is_file()
        .then_some(snapshot)
}

/// Resolves a model spec to a local folder, downloading from the Hub if needed and allowed
/// (with hf-hub's per-file byte progress bars on stderr).
pub fn resolve_model(spec: &str, variant: Option<&str>) -> Result<PathBuf> {
    resolve_model_with_progress(spec, variant, true)
}

/// [`resolve_model`], showing download progress only when `progress` is set (for `--quiet`).
pub fn resolve_model_with_progress(
    spec: &str,
    variant: Option<&str>,
    progress: bool,
) -> Result<PathBuf> {
    match ModelSource::parse(spec)? {
        ModelSource::Folder(dir) => Ok(dir),
        ModelSource::Hub { repo_id, revision } => {
            let cache = hub_cache_dir();
            if let Some(snapshot) = cached_snapshot(&cache, &repo_id, &revision) {
                return Ok(snapshot);
            }
            if offline() {
                return Err(PipelineError::ModelNotFound {
                    spec: spec.to_string(),
                    hint: format!(
                        "not in the Hub cache at {} and HF_HUB_OFFLINE is set; download it \
                         when online, or pass the path of a local diffusers folder with --model",
                        cache.display()
                    ),
                });
            }
            download(&cache, &repo_id, &revision, variant, progress).map_err(|reason| {
                PipelineError::ModelNotFound {
                    spec: spec.to_string(),
                    hint: format!(
                        "not in the Hub cache at {} and the download failed ({reason}); \
                         pass the path of a local diffusers-format folder instead \
                         (for example --model ./stable-diffusion-v1-5)",
                        cache.display()
                    ),
                }
            })
        }
    }
}

/// Whether a repo file is one a Stable Diffusion-style pipeline needs: configs, tokenizer files,
/// and safetensors weights of the wanted variant (never pickles).
/// A file name from the Hub's listing is untrusted: only plain relative paths of ordinary
/// components are ever fetched, so nothing lands outside the snapshot folder.
fn plain_relative(file: &str) -> bool {
    !file.is_empty()
        && !file.contains('\\')
        && file
            .split('/')
            .all(|part| !part.is_empty() && part != "." && part != "..")
}

fn wanted(file: &str, variant: Option<&str>) -> bool {
    if !plain_relative(file) {
        return false;
    }
    let name = file.rsplit('/').next().unwrap_or(file);
    let depth = file.matches('/').count();
    if file == "model_index.json" {
        return true;
    }
    if depth != 1 {
        return false;
    }
    if name.ends_with(".json") && !name.contains(".safetensors.index") {
        return true;
    }
    if file.starts_with("tokenizer") && name.ends_with(".txt") {
        return true;
    }
    let is_weights = name.ends_with(".safetensors") || name.ends_with(".safetensors.index.json");
    if !is_weights || file.starts_with("safety_checker") {
        return false;
    }
    match variant {
        Some(v) => name.contains(&format!(".{v}.")),
        None => {
            // Without a variant, take the plain files: `model.safetensors`, shards and index.
            let stem = name.split(".safetensors").next().unwrap_or(name);
            !stem.contains('.')
        }
    }
}

/// The files of a repo listing that a pipeline needs ([`wanted`]): with a `variant`, a
/// component folder that has no weights of that variant gets its plain weights instead, as
/// diffusers (and the local loader) fall back.
pub fn select_files(listing: &[String], variant: Option<&str>) -> Vec<String> {
    let folder = |f: &str| f.split_once('/').map(|(d, _)| d.to_string());
    let has_variant: std::collections::HashSet<String> = listing
        .iter()
        .filter(|f| variant.is_some() && wanted(f, variant) && is_weights(f))
        .filter_map(|f| folder(f))
        .collect();
    listing
        .iter()
        .filter(|f| {
            wanted(f, variant)
                || (variant.is_some()
                    && is_weights(f)
                    && wanted(f, None)
                    && folder(f).is_some_and(|d| !has_variant.contains(&d)))
        })
        .cloned()
        .collect()
}

fn is_weights(file: &str) -> bool {
    file.ends_with(".safetensors") || file.ends_with(".safetensors.index.json")
}

fn download(
    cache: &Path,
    repo_id: &str,
    revision: &str,
    variant: Option<&str>,
    progress: bool,
) -> std::result::Result<PathBuf, String> {
    let api = hf_hub::api::sync::ApiBuilder::new()
        .with_cache_dir(cache.to_path_buf())
        .with_token(std::env::var("HF_TOKEN").ok())
        .with_progress(progress)
        .build()
        .map_err(|e| e.to_string())?;
    let repo = api.repo(hf_hub::Repo::with_revision(
        repo_id.to_string(),
        hf_hub::RepoType::Model,
        revision.to_string(),
    ));
    let info = repo.info().map_err(|e| e.to_string())?;
    let listing: Vec<String> = info.siblings.iter().map(|s| s.rfilename.clone()).collect();
    let mut index = None;
    for file in select_files(&listing, variant) {
        let path = repo.get(&file).map_err(|e| e.to_string())?;
        if file == "model_index.json" {
            index = Some(path);
        }
    }
    index
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .ok_or_else(|| "the repository has no model_index.json: not a diffusers pipeline".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_configs_tokenizer_and_plain_safetensors_only() {
        assert!(wanted("model_index.json", None));
        assert!(wanted("unet/config.json", None));
        assert!(wanted("tokenizer/merges.txt", None));
        assert!(wanted("unet/diffusion_pytorch_model.safetensors", None));
        assert!(wanted("text_encoder/model.safetensors.index.json", None));
        assert!(wanted(
            "text_encoder/model-00001-of-00002.safetensors",
            None
        ));
        assert!(!wanted(
            "unet/diffusion_pytorch_model.fp16.safetensors",
            None
        ));
        assert!(!wanted("unet/diffusion_pytorch_model.bin", None));
        assert!(!wanted("v1-5-pruned.safetensors", None));
        assert!(!wanted("safety_checker/model.safetensors", None));
        // Names that would leave the snapshot folder are never fetched.
        for evil in [
            "../model_index.json",
            "../unet/config.json",
            "/etc/config.json",
            "unet/../../x.json",
            "unet//config.json",
            "./unet/config.json",
            "unet\\..\\..\\config.json",
        ] {
            assert!(!wanted(evil, None), "{evil}");
        }
        assert!(wanted(
            "unet/diffusion_pytorch_model.fp16.safetensors",
            Some("fp16")
        ));
        assert!(!wanted(
            "unet/diffusion_pytorch_model.safetensors",
            Some("fp16")
        ));
    }

    #[test]
    fn a_component_without_the_variant_gets_its_plain_weights() {
        let listing: Vec<String> = [
            "model_index.json",
            "unet/config.json",
            "unet/diffusion_pytorch_model.safetensors",
            "unet/diffusion_pytorch_model.fp16.safetensors",
            "unet/diffusion_pytorch_model.bin",
            "vae/config.json",
            "vae/diffusion_pytorch_model.safetensors",
            "text_encoder/model.safetensors.index.json",
            "text_encoder/model-00001-of-00002.safetensors",
            "text_encoder/model-00002-of-00002.safetensors",
            "text_encoder/pytorch_model.bin",
            "v1-5-pruned.safetensors",
        ]
        .map(String::from)
        .to_vec();
        let picked = select_files(&listing, Some("fp16"));
        assert_eq!(
            picked,
            [
                "model_index.json",
                "unet/config.json",
                "unet/diffusion_pytorch_model.fp16.safetensors",
                "vae/config.json",
                "vae/diffusion_pytorch_model.safetensors",
                "text_encoder/model.safetensors.index.json",
                "text_encoder/model-00001-of-00002.safetensors",
                "text_encoder/model-00002-of-00002.safetensors",
            ]
        );
        let plain = select_files(&listing, None);
        assert!(plain.contains(&"unet/diffusion_pytorch_model.safetensors".to_string()));
        assert!(!plain
            .iter()
            .any(|f| f.contains("fp16") || f.ends_with(".bin")));
    }

    #[test]
    fn parses_hub_ids_and_revisions() {
        assert_eq!(
            ModelSource::parse("stabilityai/sd-turbo@abc").unwrap(),
            ModelSource::Hub {
                repo_id: "stabilityai/sd-turbo".into(),
                revision: "abc".into()
            }
        );
        assert!(ModelSource::parse("../../etc/passwd-not-here").is_err());
        assert!(ModelSource::parse("a/b/c").is_err());
    }
}
