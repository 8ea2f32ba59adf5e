//! A1111's `Model hash`: the first 10 hex digits of the SHA-256 of a checkpoint file (its
//! "AutoV2" hash, the one Civitai lists). A diffusers folder has no one file; its hash is that of
//! its denoiser's weights (the UNet's or the transformer's files, in order), which are what tell
//! two checkpoints of one architecture apart.
//!
//! Hashing reads every byte, so hashes are kept in `hashes.json` in oxidiff's cache folder,
//! keyed by the file's absolute path, size and modification time, as A1111 keeps its
//! `cache.json`; a file changed since is hashed again. A cache that cannot be read or written
//! only costs time.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::UNIX_EPOCH;

use oxidiff_models::weights::Weights;
use oxidiff_models::ModelError;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{PipelineError, Result};

/// Hex digits of A1111's short model hash.
pub const SHORT_HASH_LEN: usize = 10;

/// The cache file's name in [`cache_dir`].
const CACHE_FILE: &str = "hashes.json";

/// One hashed file as the cache records it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct CachedHash {
    size: u64,
    modified_ns: u128,
    sha256: String,
}

/// Where oxidiff keeps its caches: `$OXIDIFF_CACHE_DIR`, `$XDG_CACHE_HOME/oxidiff` or
/// `~/.cache/oxidiff`.
pub fn cache_dir() -> Option<PathBuf> {
    let var = |name| std::env::var_os(name).filter(|v| !v.is_empty());
    var("OXIDIFF_CACHE_DIR").map(PathBuf::from).or_else(|| {
        var("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| var("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .map(|c| c.join("oxidiff"))
    })
}

/// The hashes of files hashed before, and where they are kept.
#[derive(Debug, Default)]
pub struct HashCache {
    path: Option<PathBuf>,
    entries: BTreeMap<String, CachedHash>,
    changed: bool,
}

impl HashCache {
    /// The user's cache ([`cache_dir`]); empty when it does not exist or does not parse.
    pub fn open() -> Self {
        Self::at(cache_dir().map(|d| d.join(CACHE_FILE)))
    }

    /// The cache kept in `path` (`None`: in memory only).
    pub fn at(path: Option<PathBuf>) -> Self {
        let entries = path
            .as_deref()
            .and_then(|p| std::fs::read(p).ok())
            .and_then(|bytes| serde_json::from_slice(&bytes).ok())
            .unwrap_or_default();
        Self {
            path,
            entries,
            changed: false,
        }
    }

    /// The full SHA-256 (hex) of `file`, from the cache when its size and modification time
    /// are the ones recorded, else read and recorded.
    pub fn sha256(&mut self, file: &Path) -> Result<String> {
        let io = |source| {
            PipelineError::Model(ModelError::Io {
                path: file.to_path_buf(),
                source,
            })
        };
        let absolute = std::fs::canonicalize(file).map_err(io)?;
        let meta = std::fs::metadata(&absolute).map_err(io)?;
        if !meta.is_file() {
            return Err(io(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "not a regular file, so it has no model hash",
            )));
        }
        let modified_ns = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        let key = absolute.to_string_lossy().into_owned();
        if let Some(hit) = self.entries.get(&key) {
            if hit.size == meta.len() && hit.modified_ns == modified_ns {
                return Ok(hit.sha256.clone());
            }
        }
        let mut reader = std::fs::File::open(&absolute).map_err(io)?;
        let sha256 = sha256_hex(&mut reader).map_err(io)?;
        self.entries.insert(
            key,
            CachedHash {
                size: meta.len(),
                modified_ns,
                sha256: sha256.clone(),
            },
        );
        self.changed = true;
        Ok(sha256)
    }

    /// A1111's short hash of a model: a single checkpoint file's, or a diffusers folder's
    /// denoiser weights' (`variant` picks the files the loader would).
    pub fn model_hash(&mut self, model: &Path, variant: Option<&str>) -> Result<String> {
        if model.is_file() {
            let full = self.sha256(model)?;
            return Ok(full[..SHORT_HASH_LEN].to_string());
        }
        let files = denoiser_files(model, variant)?;
        if let [one] = files.as_slice() {
            let full = self.sha256(one)?;
            return Ok(full[..SHORT_HASH_LEN].to_string());
        }
        // Shards: the hash of their hashes, in the index's order.
        let mut hasher = Sha256::new();
        for file in &files {
            hasher.update(self.sha256(file)?.as_bytes());
        }
        Ok(hex(&hasher.finalize())[..SHORT_HASH_LEN].to_string())
    }

    /// The files hashed before whose hash starts with `short`, in path order (nothing is read:
    /// a file never hashed is not found).
    pub fn files_with_hash(&self, short: &str) -> Vec<PathBuf> {
        self.entries
            .iter()
            .filter(|(path, e)| {
                e.sha256.get(..short.len()) == Some(short) && Path::new(path).is_file()
            })
            .map(|(path, _)| PathBuf::from(path))
            .collect()
    }

    /// Writes the cache back if a hash was added (a temp file renamed into place, so a reader
    /// never sees half a file); a failure is returned for the caller to ignore or report.
    pub fn save(&mut self) -> std::io::Result<()> {
        let (Some(path), true) = (&self.path, self.changed) else {
            return Ok(());
        };
        let dir = path.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir)?;
        let text = serde_json::to_vec_pretty(&self.entries).map_err(std::io::Error::other)?;
        static SAVES: AtomicU64 = AtomicU64::new(0);
        let n = SAVES.fetch_add(1, Ordering::Relaxed);
        let tmp = dir.join(format!(".{CACHE_FILE}.{}.{n}.tmp", std::process::id()));
        std::fs::write(&tmp, text)?;
        if let Err(e) = std::fs::rename(&tmp, path) {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        self.changed = false;
        Ok(())
    }
}

/// The weight files of a diffusers folder's denoiser (`unet/` or `transformer/`).
fn denoiser_files(model: &Path, variant: Option<&str>) -> Result<Vec<PathBuf>> {
    for component in ["unet", "transformer"] {
        let dir = model.join(component);
        if dir.is_dir() {
            let weights = Weights::from_component_dir(&dir, &["diffusion_pytorch_model"], variant)?;
            return Ok(weights.paths());
        }
    }
    Err(PipelineError::MissingComponent {
        dir: model.to_path_buf(),
        component: "unet or transformer (the denoiser, whose weights give the model hash)".into(),
    })
}

/// The SHA-256 (hex) of what `reader` holds from where it stands to its end.
pub(crate) fn sha256_hex(reader: &mut impl Read) -> std::io::Result<String> {
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let n = reader.read(&mut buffer)?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_hashed_as_a1111_does_and_rehashed_when_it_changes() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("model.safetensors");
        std::fs::write(&file, b"abc").unwrap();
        let cache_path = dir.path().join("cache/hashes.json");
        let mut cache = HashCache::at(Some(cache_path.clone()));
        // SHA-256("abc") = ba7816bf 8f01cfea ...
        assert_eq!(cache.model_hash(&file, None).unwrap(), "ba7816bf8f");
        cache.save().unwrap();
        let mut again = HashCache::at(Some(cache_path));
        assert_eq!(
            again.files_with_hash("ba7816bf8f"),
            vec![file.canonicalize().unwrap()]
        );
        std::fs::write(&file, b"abcd").unwrap();
        let modified = std::time::SystemTime::now() + std::time::Duration::from_secs(5);
        std::fs::File::options()
            .write(true)
            .open(&file)
            .unwrap()
            .set_modified(modified)
            .unwrap();
        // SHA-256("abcd") = 88d4266f d4e6338d ...
        assert_eq!(again.model_hash(&file, None).unwrap(), "88d4266fd4");
    }
}
