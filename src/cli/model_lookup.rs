//! The model a PNG names, found again: its `Model:` field is a Hub id or a bare folder or file
//! name (never this machine's path), so `--from-png` looks for that name in the model folders
//! (`--model-dir`, `OXIDIFF_MODEL_DIRS`, the working folder) and the Hub cache, and checks the
//! PNG's `Model hash` against what it finds, as A1111 finds a checkpoint by name or hash.

use std::path::{Path, PathBuf};

use oxidiff_pipelines::hub::hub_cache_dir;
use oxidiff_pipelines::model_hash::HashCache;
use oxidiff_pipelines::{LoadOptions, Result};

/// The environment variable with more model folders, separated as `PATH` is.
pub const MODEL_DIRS_VAR: &str = "OXIDIFF_MODEL_DIRS";

/// A1111's `Model hash` of the model being run (the GGUF transformer file when one replaces
/// the folder's), read through the user's hash cache, which is saved for the next run.
pub fn png_model_hash(model: &Path, options: &LoadOptions) -> Result<String> {
    let mut cache = HashCache::open();
    let hash = match &options.transformer {
        Some(file) => cache.model_hash(file, None)?,
        None => cache.model_hash(model, options.variant.as_deref())?,
    };
    if let Err(e) = cache.save() {
        tracing::debug!("the model hash cache was not saved: {e}");
    }
    Ok(hash)
}

/// The folders searched for a model by name: `given` (`--model-dir`, in order), then
/// [`MODEL_DIRS_VAR`]'s, then the working folder.
pub fn model_dirs(given: &[PathBuf]) -> Vec<PathBuf> {
    let mut dirs = given.to_vec();
    if let Some(var) = std::env::var_os(MODEL_DIRS_VAR) {
        dirs.extend(std::env::split_paths(&var).filter(|d| !d.as_os_str().is_empty()));
    }
    dirs.push(PathBuf::from("."));
    dirs
}

/// Where a PNG's model was found.
#[derive(Debug, Clone, PartialEq)]
pub enum FoundModel {
    /// A folder or single file by the PNG's name; `hash_differs` holds this model's hash when
    /// the PNG recorded another (the image will differ).
    ByName {
        path: PathBuf,
        hash_differs: Option<String>,
    },
    /// A model of another name whose hash is the PNG's (known from an earlier run's hash).
    ByHash { path: PathBuf },
    /// A Hub cache snapshot of a repo whose name is the PNG's.
    HubCache { repo_id: String },
}

impl FoundModel {
    /// What to pass as `--model`.
    pub fn spec(&self) -> String {
        match self {
            Self::ByName { path, .. } | Self::ByHash { path } => path.display().to_string(),
            Self::HubCache { repo_id } => repo_id.clone(),
        }
    }
}

/// Looks for the model `name` (a folder `NAME` with `model_index.json` or a file
/// `NAME.safetensors`) in `dirs`, then in the Hub cache (a repo `ORG/NAME`), then by `hash`
/// among the models hashed before. `None` when nothing matches.
pub fn find_model(name: &str, hash: &str, dirs: &[PathBuf]) -> Option<FoundModel> {
    if !plain_name(name) {
        return None;
    }
    let by_name = dirs.iter().find_map(|dir| {
        let folder = dir.join(name);
        if folder.join("model_index.json").is_file() {
            return Some(folder);
        }
        let file = dir.join(format!("{name}.safetensors"));
        file.is_file().then_some(file)
    });
    if let Some(path) = by_name {
        let hash_differs = if hash.is_empty() {
            None
        } else {
            // A model that cannot be hashed is still the one by that name; the run names it.
            let ours = png_model_hash(&path, &LoadOptions::default()).ok();
            ours.filter(|h| !h.eq_ignore_ascii_case(hash))
        };
        return Some(FoundModel::ByName { path, hash_differs });
    }
    if let Some(repo_id) = hub_repo_named(&hub_cache_dir(), name) {
        return Some(FoundModel::HubCache { repo_id });
    }
    if hash.is_empty() {
        return None;
    }
    HashCache::open()
        .files_with_hash(&hash.to_ascii_lowercase())
        .into_iter()
        .find_map(|file| model_of_file(&file))
        .map(|path| FoundModel::ByHash { path })
}

/// A single path component: a name a PNG may give, never a path to follow.
fn plain_name(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && !name.contains(['/', '\\'])
        && !name.contains('\0')
}

/// The one repo `ORG/NAME` of the Hub cache (`models--ORG--NAME`) with a snapshot.
fn hub_repo_named(cache: &Path, name: &str) -> Option<String> {
    let suffix = format!("--{name}");
    let mut repos = std::fs::read_dir(cache)
        .ok()?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|dir| {
            let rest = dir.strip_prefix("models--")?;
            let org = rest.strip_suffix(&suffix)?;
            (!org.is_empty() && !org.contains("--")).then(|| format!("{org}/{name}"))
        })
        .filter(|id| oxidiff_pipelines::hub::cached_snapshot(cache, id, "main").is_some());
    let first = repos.next()?;
    repos.next().is_none().then_some(first)
}

/// The model a hashed file stands for: a single file itself, or the diffusers folder whose
/// denoiser weights it is (`DIR/unet/...` or `DIR/transformer/...`).
fn model_of_file(file: &Path) -> Option<PathBuf> {
    let component = file.parent()?;
    let folder = component.parent()?;
    let is_denoiser = matches!(
        component.file_name().and_then(|n| n.to_str()),
        Some("unet" | "transformer")
    );
    if is_denoiser && folder.join("model_index.json").is_file() {
        return Some(folder.to_path_buf());
    }
    (file.extension().and_then(|e| e.to_str()) == Some("safetensors")).then(|| file.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_are_paths_are_never_followed() {
        for name in ["", ".", "..", "../x", "a/b", "/etc/passwd", "a\\b"] {
            assert!(!plain_name(name), "{name:?}");
            assert_eq!(find_model(name, "", &[PathBuf::from(".")]), None);
        }
        assert!(plain_name("stable-diffusion-v1-5"));
    }

    #[test]
    fn a_hub_cache_repo_is_found_by_its_name_when_it_is_the_only_one() {
        let cache = tempfile::tempdir().unwrap();
        let snapshot = |repo: &str| {
            let dir = cache.path().join(repo);
            std::fs::create_dir_all(dir.join("refs")).unwrap();
            std::fs::write(dir.join("refs/main"), "abc123").unwrap();
            let snap = dir.join("snapshots/abc123");
            std::fs::create_dir_all(&snap).unwrap();
            std::fs::write(snap.join("model_index.json"), "{}").unwrap();
        };
        snapshot("models--runwayml--stable-diffusion-v1-5");
        assert_eq!(
            hub_repo_named(cache.path(), "stable-diffusion-v1-5").as_deref(),
            Some("runwayml/stable-diffusion-v1-5")
        );
        assert_eq!(hub_repo_named(cache.path(), "v1-5"), None);
        snapshot("models--someone--stable-diffusion-v1-5");
        assert_eq!(hub_repo_named(cache.path(), "stable-diffusion-v1-5"), None);
    }
}
