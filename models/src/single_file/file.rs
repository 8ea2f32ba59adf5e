//! A single-file checkpoint opened: pickles refused, the safetensors header checked, the
//! architecture detected, and the key prefixes of its components.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use super::detect::{
    detect, first_keys, SingleFileArch, CLIP_PREFIX, CLIP_SDXL_PREFIX, KEY_CONV_IN,
    OPEN_CLIP_PREFIX, OPEN_CLIP_REFINER_PREFIX, OPEN_CLIP_SDXL_PREFIX, UNET_PREFIX, VAE_PREFIXES,
};
use crate::error::{ModelError, Result};
use crate::weights::Weights;

/// One single-file checkpoint, opened and classified.
#[derive(Debug)]
pub struct SingleFile {
    pub path: PathBuf,
    pub arch: SingleFileArch,
    /// An inpainting checkpoint: the UNet takes 9 input channels (latents, mask, masked-image
    /// latents), diffusers' model types `inpainting`, `inpainting_v2`, `xl_inpaint`.
    pub inpainting: bool,
    pub(super) weights: Weights,
}

/// Extensions of PyTorch pickle checkpoints.
const PICKLE_EXTENSIONS: [&str; 5] = ["ckpt", "pt", "pth", "bin", "pkl"];

impl SingleFile {
    /// Opens `path` (refusing pickles, checking the safetensors header) and detects the
    /// architecture from its keys.
    pub fn open(path: &Path) -> Result<Self> {
        Self::from_weights(path, open_safetensors(path)?)
    }

    /// Classifies tensors already opened (for example [`Weights::shapes_only`] of a layout);
    /// `path` names them in messages.
    pub fn from_weights(path: &Path, weights: Weights) -> Result<Self> {
        let arch = detect(&weights, path)?;
        let inpainting = weights.shape(KEY_CONV_IN).and_then(|s| s.get(1)) == Some(&9);
        Ok(Self {
            path: path.to_path_buf(),
            arch,
            inpainting,
            weights,
        })
    }

    /// diffusers' model type (`infer_diffusers_model_type`): `v1`, `v2`, `xl_base`,
    /// `xl_refiner`, or for inpainting checkpoints `inpainting`, `inpainting_v2`, `xl_inpaint`.
    pub fn model_type(&self) -> &'static str {
        match (self.arch, self.inpainting) {
            (SingleFileArch::Sd1, true) => "inpainting",
            (SingleFileArch::Sd2, true) => "inpainting_v2",
            (SingleFileArch::SdxlBase, true) => "xl_inpaint",
            (arch, _) => arch.diffusers_name(),
        }
    }

    /// The Hub repository diffusers takes configs and tokenizers from for this checkpoint
    /// (`DIFFUSERS_DEFAULT_PIPELINE_PATHS` of its model type).
    pub fn default_repo(&self) -> &'static str {
        match (self.arch, self.inpainting) {
            (SingleFileArch::Sd1, true) => "stable-diffusion-v1-5/stable-diffusion-inpainting",
            (SingleFileArch::Sd2, true) => "stabilityai/stable-diffusion-2-inpainting",
            (SingleFileArch::SdxlBase, true) => "diffusers/stable-diffusion-xl-1.0-inpainting-0.1",
            (arch, _) => arch.default_repo(),
        }
    }

    /// All tensors of the file, under their own names.
    pub fn weights(&self) -> &Weights {
        &self.weights
    }

    pub(super) fn shape(&self, key: &str) -> Option<&[usize]> {
        self.weights.shape(key)
    }

    pub(super) fn dim(&self, key: &str, axis: usize) -> Result<usize> {
        self.shape(key)
            .and_then(|s| s.get(axis).copied())
            .ok_or_else(|| ModelError::MissingKey {
                key: key.to_string(),
                files: self.weights.file_list(),
            })
    }

    pub(super) fn vae_prefix(&self) -> &'static str {
        // diffusers takes the last prefix that any key starts with.
        let mut prefix = VAE_PREFIXES[0];
        for p in VAE_PREFIXES {
            if self.weights.keys().any(|k| k.starts_with(p)) {
                prefix = p;
            }
        }
        prefix
    }

    /// The prefix of the (first) CLIP ViT-L text encoder in transformers' layout.
    pub(super) fn clip_prefix(&self) -> Option<&'static str> {
        match self.arch {
            SingleFileArch::Sd1 => Some(CLIP_PREFIX),
            SingleFileArch::SdxlBase => Some(CLIP_SDXL_PREFIX),
            SingleFileArch::Sd2 | SingleFileArch::SdxlRefiner => None,
        }
    }

    /// The prefix of the OpenCLIP text encoder.
    pub(super) fn open_clip_prefix(&self) -> Option<&'static str> {
        match self.arch {
            SingleFileArch::Sd2 => Some(OPEN_CLIP_PREFIX),
            SingleFileArch::SdxlBase => Some(OPEN_CLIP_SDXL_PREFIX),
            SingleFileArch::SdxlRefiner => Some(OPEN_CLIP_REFINER_PREFIX),
            SingleFileArch::Sd1 => None,
        }
    }

    /// Down/up blocks' resnet count, from the numbering of `input_blocks`.
    pub fn unet_layers_per_block(&self) -> Result<usize> {
        layers_per_block(&self.weights, UNET_PREFIX, &self.path)
    }

    /// How many distinct `N` follow `prefix` in the keys (`prefix N.…`).
    pub(super) fn count_indices(&self, prefix: &str) -> usize {
        self.weights
            .keys()
            .filter_map(|k| {
                k.strip_prefix(prefix)?
                    .split('.')
                    .next()?
                    .parse::<usize>()
                    .ok()
            })
            .collect::<BTreeSet<_>>()
            .len()
    }
}

/// Down blocks' resnet count of an LDM UNet (or ControlNet) whose keys start with `prefix`,
/// from the numbering of `input_blocks`: block b holds `layers` resnets and (but the last) a
/// downsampler, so `n * layers + (n - 1)` blocks follow `input_blocks.0`.
pub(crate) fn layers_per_block(weights: &Weights, prefix: &str, path: &Path) -> Result<usize> {
    let input = format!("{prefix}input_blocks.");
    let mut indices = BTreeSet::new();
    let mut downsamplers = BTreeSet::new();
    for key in weights.keys() {
        let Some(rest) = key.strip_prefix(&input) else {
            continue;
        };
        let Some((i, tail)) = rest.split_once('.') else {
            continue;
        };
        let Ok(i) = i.parse::<usize>() else { continue };
        if i == 0 {
            continue;
        }
        indices.insert(i);
        if tail.starts_with("0.op.") {
            downsamplers.insert(i);
        }
    }
    let blocks = downsamplers.len() + 1;
    let total = indices.len();
    let contiguous = indices.iter().copied().eq(1..=total);
    if !contiguous || total < blocks || !(total - downsamplers.len()).is_multiple_of(blocks) {
        return Err(ModelError::UnknownArchitecture {
            path: path.to_path_buf(),
            reason: format!(
                "the input blocks ({total} after `input_blocks.0`, {} downsamplers) do not \
                 form equal down blocks",
                downsamplers.len()
            ),
            looked_for: format!("`{prefix}input_blocks.N.0.op.weight`"),
            found: first_keys(weights),
        });
    }
    Ok((total - downsamplers.len()) / blocks)
}

/// The tensors of a single `.safetensors` file the user named: pickles (by extension or by
/// their first bytes) refused with the reason, a link followed, errors naming the path given.
pub(crate) fn open_safetensors(path: &Path) -> Result<Weights> {
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase)
        .unwrap_or_default();
    if PICKLE_EXTENSIONS.contains(&ext.as_str()) {
        return Err(ModelError::Pickle {
            path: path.to_path_buf(),
            kind: format!("a .{ext} file"),
        });
    }
    // The user named this file: a link is followed to where it points (model folders
    // commonly link to a shared download folder).
    let real = path.canonicalize().map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    match Weights::from_files(std::slice::from_ref(&real)) {
        Ok(w) => Ok(w),
        Err(e) => {
            if let Some(kind) = pickle_magic(&real) {
                return Err(ModelError::Pickle {
                    path: path.to_path_buf(),
                    kind: format!("{kind} with a .{ext} name"),
                });
            }
            Err(rename_path(e, &real, path))
        }
    }
}

/// What kind of pickle the file starts like, if any: PyTorch's zip archive or a bare pickle.
fn pickle_magic(path: &Path) -> Option<&'static str> {
    use std::io::Read;
    let mut head = [0u8; 4];
    std::fs::File::open(path).ok()?.read_exact(&mut head).ok()?;
    if head == *b"PK\x03\x04" {
        Some("a PyTorch zip archive")
    } else if head[0] == 0x80 && (2..=5).contains(&head[1]) {
        Some("a bare pickle")
    } else {
        None
    }
}

/// Errors name the path the user gave, not the link target.
fn rename_path(error: ModelError, real: &Path, given: &Path) -> ModelError {
    match error {
        ModelError::Safetensors { path, reason } if path == real => ModelError::Safetensors {
            path: given.to_path_buf(),
            reason,
        },
        ModelError::Io { path, source } if path == real => ModelError::Io {
            path: given.to_path_buf(),
            source,
        },
        other => other,
    }
}
