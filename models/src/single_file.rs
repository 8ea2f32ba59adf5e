//! Single-file checkpoints: one `.safetensors` in the original LDM / A1111 key layout
//! (`model.diffusion_model.input_blocks.1.1.…`, `first_stage_model.…`, `cond_stage_model.…`,
//! SDXL's `conditioner.embedders.0/1.…`), read as diffusers' components.
//!
//! Where this sits: below the pipelines' `from_single_file`. Nothing is converted or copied: each
//! component gets a [`Weights::view`] that gives the file's tensors the diffusers names the
//! models ask for (the inverse of nothing: the same renaming as diffusers'
//! `convert_ldm_unet_checkpoint`, `convert_ldm_vae_checkpoint`, `convert_ldm_clip_checkpoint` and
//! `convert_open_clip_checkpoint`), so the models load unchanged. The architecture is detected
//! from the keys as diffusers' `infer_diffusers_model_type` does (also inpainting checkpoints,
//! whose UNet takes 9 input channels, and the SDXL refiner), and configs are the released
//! models' with every size that the tensors show taken from the tensors.

use std::collections::{BTreeSet, HashSet};
use std::path::{Path, PathBuf};

use crate::autoencoder_kl::AutoencoderKLConfig;
use crate::clip::ClipTextConfig;
use crate::config::PerBlock;
use crate::error::{ModelError, Result};
use crate::unet_2d_condition::UNet2DConditionConfig;
use crate::weights::{TensorView, Weights};

/// The UNet's key prefix.
pub const UNET_PREFIX: &str = "model.diffusion_model.";
/// diffusers' `CHECKPOINT_KEY_NAMES["v1"]`.
pub const KEY_V1: &str = "model.diffusion_model.output_blocks.11.0.skip_connection.weight";
/// diffusers' `CHECKPOINT_KEY_NAMES["v2"]` (SD 2 when its context width is 1024).
pub const KEY_V2: &str =
    "model.diffusion_model.input_blocks.2.1.transformer_blocks.0.attn2.to_k.weight";
/// diffusers' `CHECKPOINT_KEY_NAMES["xl_base"]`.
pub const KEY_XL_BASE: &str =
    "conditioner.embedders.1.model.transformer.resblocks.9.mlp.c_proj.bias";
/// diffusers' `CHECKPOINT_KEY_NAMES["open_clip_sdxl"]`: SDXL's OpenCLIP encoder, any depth.
pub const KEY_OPEN_CLIP_SDXL: &str = "conditioner.embedders.1.model.positional_embedding";
/// diffusers' `CHECKPOINT_KEY_NAMES["xl_refiner"]`: the refiner's OpenCLIP bigG, block 9.
pub const KEY_XL_REFINER: &str =
    "conditioner.embedders.0.model.transformer.resblocks.9.mlp.c_proj.bias";
/// diffusers' `CHECKPOINT_KEY_NAMES["open_clip_sdxl_refiner"]`: the refiner's OpenCLIP, any depth.
pub const KEY_OPEN_CLIP_SDXL_REFINER: &str = "conditioner.embedders.0.model.text_projection";
/// diffusers' `CHECKPOINT_KEY_NAMES["open_clip"]`: SD 2's OpenCLIP encoder.
pub const KEY_OPEN_CLIP: &str = "cond_stage_model.model.token_embedding.weight";
/// diffusers' `CHECKPOINT_KEY_NAMES["clip"]`: SD 1's CLIP encoder.
pub const KEY_CLIP: &str =
    "cond_stage_model.transformer.text_model.embeddings.position_embedding.weight";
/// diffusers' `CHECKPOINT_KEY_NAMES["inpainting"]` (9 input channels) and `["instruct-pix2pix"]` (8).
pub const KEY_CONV_IN: &str = "model.diffusion_model.input_blocks.0.0.weight";

const CLIP_PREFIX: &str = "cond_stage_model.transformer.";
const CLIP_SDXL_PREFIX: &str = "conditioner.embedders.0.transformer.";
const OPEN_CLIP_PREFIX: &str = "cond_stage_model.model.";
const OPEN_CLIP_SDXL_PREFIX: &str = "conditioner.embedders.1.model.";
const OPEN_CLIP_REFINER_PREFIX: &str = "conditioner.embedders.0.model.";
/// diffusers' `LDM_VAE_KEYS`.
const VAE_PREFIXES: [&str; 2] = ["first_stage_model.", "vae."];

/// The architectures a single file can hold (diffusers' model types `v1`, `v2`, `xl_base`,
/// `xl_refiner`; inpainting checkpoints of the first three are [`SingleFile::inpainting`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SingleFileArch {
    /// Stable Diffusion 1.x: CLIP ViT-L text encoder under `cond_stage_model.transformer.`.
    Sd1,
    /// Stable Diffusion 2.x: OpenCLIP ViT-H under `cond_stage_model.model.`.
    Sd2,
    /// SDXL base: CLIP ViT-L (`conditioner.embedders.0`) and OpenCLIP ViT-bigG
    /// (`conditioner.embedders.1`).
    SdxlBase,
    /// The SDXL refiner: only OpenCLIP ViT-bigG with projection (`conditioner.embedders.0.model.`)
    /// and a UNet whose added condition takes 5 time ids (the aesthetic score).
    SdxlRefiner,
}

impl SingleFileArch {
    /// diffusers' name of the model type.
    pub fn diffusers_name(self) -> &'static str {
        match self {
            Self::Sd1 => "v1",
            Self::Sd2 => "v2",
            Self::SdxlBase => "xl_base",
            Self::SdxlRefiner => "xl_refiner",
        }
    }

    /// The Hub repository diffusers takes configs and tokenizers from for this type
    /// (`DIFFUSERS_DEFAULT_PIPELINE_PATHS`).
    pub fn default_repo(self) -> &'static str {
        match self {
            Self::Sd1 => "stable-diffusion-v1-5/stable-diffusion-v1-5",
            Self::Sd2 => "stabilityai/stable-diffusion-2-1",
            Self::SdxlBase => "stabilityai/stable-diffusion-xl-base-1.0",
            Self::SdxlRefiner => "stabilityai/stable-diffusion-xl-refiner-1.0",
        }
    }

    /// Whether this is an SDXL architecture (base or refiner).
    pub fn is_sdxl(self) -> bool {
        matches!(self, Self::SdxlBase | Self::SdxlRefiner)
    }
}

/// One single-file checkpoint, opened and classified.
#[derive(Debug)]
pub struct SingleFile {
    pub path: PathBuf,
    pub arch: SingleFileArch,
    /// An inpainting checkpoint: the UNet takes 9 input channels (latents, mask, masked-image
    /// latents), diffusers' model types `inpainting`, `inpainting_v2`, `xl_inpaint`.
    pub inpainting: bool,
    weights: Weights,
}

/// Extensions of PyTorch pickle checkpoints.
const PICKLE_EXTENSIONS: [&str; 5] = ["ckpt", "pt", "pth", "bin", "pkl"];

impl SingleFile {
    /// Opens `path` (refusing pickles, checking the safetensors header) and detects the
    /// architecture from its keys.
    pub fn open(path: &Path) -> Result<Self> {
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
        let weights = match Weights::from_files(std::slice::from_ref(&real)) {
            Ok(w) => w,
            Err(e) => {
                if let Some(kind) = pickle_magic(&real) {
                    return Err(ModelError::Pickle {
                        path: path.to_path_buf(),
                        kind: format!("{kind} with a .{ext} name"),
                    });
                }
                return Err(rename_path(e, &real, path));
            }
        };
        Self::from_weights(path, weights)
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

    fn shape(&self, key: &str) -> Option<&[usize]> {
        self.weights.shape(key)
    }

    fn dim(&self, key: &str, axis: usize) -> Result<usize> {
        self.shape(key)
            .and_then(|s| s.get(axis).copied())
            .ok_or_else(|| ModelError::MissingKey {
                key: key.to_string(),
                files: self.weights.file_list(),
            })
    }

    fn vae_prefix(&self) -> &'static str {
        // diffusers takes the last prefix that any key starts with.
        let mut prefix = VAE_PREFIXES[0];
        for p in VAE_PREFIXES {
            if self.weights.keys().any(|k| k.starts_with(p)) {
                prefix = p;
            }
        }
        prefix
    }

    /// `(name, source, view)` of every UNet tensor.
    pub fn unet_names(&self) -> Result<Vec<(String, String, TensorView)>> {
        let layers = self.unet_layers_per_block()?;
        let mut names = Vec::new();
        for key in self.weights.keys() {
            let Some(rest) = key.strip_prefix(UNET_PREFIX) else {
                continue;
            };
            if let Some(name) = unet_name(rest, layers) {
                names.push((name, key.to_string(), TensorView::Whole));
            }
        }
        names.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(names)
    }

    /// The UNet's tensors under diffusers' names (`down_blocks.0.resnets.0.conv1.weight`).
    pub fn unet_weights(&self) -> Result<Weights> {
        self.weights.view(self.unet_names()?)
    }

    /// `(name, source, view)` of every VAE tensor.
    pub fn vae_names(&self) -> Vec<(String, String, TensorView)> {
        let prefix = self.vae_prefix();
        let up_blocks = self.count_indices(&format!("{prefix}decoder.up."));
        let mut names = Vec::new();
        for key in self.weights.keys() {
            let Some(rest) = key.strip_prefix(prefix) else {
                continue;
            };
            if rest.starts_with("loss.") {
                continue;
            }
            let Some(name) = vae_name(rest, up_blocks) else {
                continue;
            };
            // The mid-block attention's q/k/v/proj_out are 1x1 convolutions in the LDM VAE,
            // linear layers in diffusers' (`conv_attn_to_linear`).
            let view = match self.shape(key) {
                Some(s) if name.contains("mid_block.attentions.") && s.len() > 2 => {
                    TensorView::Reshape(s[..2].to_vec())
                }
                _ => TensorView::Whole,
            };
            names.push((name, key.to_string(), view));
        }
        names.sort_by(|a, b| a.0.cmp(&b.0));
        names
    }

    /// The VAE's tensors under diffusers' names.
    pub fn vae_weights(&self) -> Result<Weights> {
        self.weights.view(self.vae_names())
    }

    /// The prefix of the (first) CLIP ViT-L text encoder in transformers' layout.
    fn clip_prefix(&self) -> Option<&'static str> {
        match self.arch {
            SingleFileArch::Sd1 => Some(CLIP_PREFIX),
            SingleFileArch::SdxlBase => Some(CLIP_SDXL_PREFIX),
            SingleFileArch::Sd2 | SingleFileArch::SdxlRefiner => None,
        }
    }

    /// The prefix of the OpenCLIP text encoder.
    fn open_clip_prefix(&self) -> Option<&'static str> {
        match self.arch {
            SingleFileArch::Sd2 => Some(OPEN_CLIP_PREFIX),
            SingleFileArch::SdxlBase => Some(OPEN_CLIP_SDXL_PREFIX),
            SingleFileArch::SdxlRefiner => Some(OPEN_CLIP_REFINER_PREFIX),
            SingleFileArch::Sd1 => None,
        }
    }

    /// `(name, source, view)` of SD 1's / SDXL's first CLIP encoder: the keys are transformers'
    /// own under a prefix (diffusers' `convert_ldm_clip_checkpoint`).
    pub fn clip_names(&self) -> Vec<(String, String, TensorView)> {
        let Some(prefix) = self.clip_prefix() else {
            return Vec::new();
        };
        let mut names: Vec<_> = self
            .weights
            .keys()
            .filter_map(|key| {
                let rest = key.strip_prefix(prefix)?;
                (!rest.ends_with("position_ids"))
                    .then(|| (rest.to_string(), key.to_string(), TensorView::Whole))
            })
            .collect();
        names.sort_by(|a, b| a.0.cmp(&b.0));
        names
    }

    /// `(name, source, view)` of the OpenCLIP encoder as a transformers CLIP text model of
    /// `layers` layers (diffusers' `convert_open_clip_checkpoint`): the fused `in_proj` split
    /// into q/k/v, `text_projection` transposed (kept only `with_projection`), the blocks past
    /// `layers` left out (SD 2 uses the penultimate layer: diffusers drops block 23 of 24).
    pub fn open_clip_names(
        &self,
        layers: usize,
        with_projection: bool,
    ) -> Result<Vec<(String, String, TensorView)>> {
        let Some(prefix) = self.open_clip_prefix() else {
            return Ok(Vec::new());
        };
        let mut names = Vec::new();
        let fixed = [
            (
                "positional_embedding",
                "text_model.embeddings.position_embedding.weight",
            ),
            (
                "token_embedding.weight",
                "text_model.embeddings.token_embedding.weight",
            ),
            ("ln_final.weight", "text_model.final_layer_norm.weight"),
            ("ln_final.bias", "text_model.final_layer_norm.bias"),
        ];
        for (ldm, diffusers) in fixed {
            names.push((
                diffusers.to_string(),
                format!("{prefix}{ldm}"),
                TensorView::Whole,
            ));
        }
        if with_projection {
            names.push((
                "text_projection.weight".into(),
                format!("{prefix}text_projection"),
                TensorView::Transpose,
            ));
        }
        let blocks = format!("{prefix}transformer.resblocks.");
        for key in self.weights.keys() {
            let Some(rest) = key.strip_prefix(&blocks) else {
                continue;
            };
            let Some((index, tail)) = rest.split_once('.') else {
                continue;
            };
            let Ok(i) = index.parse::<usize>() else {
                continue;
            };
            if i >= layers {
                continue;
            }
            let layer = format!("text_model.encoder.layers.{i}");
            if let Some(kind) = tail.strip_prefix("attn.in_proj_") {
                let width = self.dim(key, 0)? / 3;
                for (j, part) in ["q_proj", "k_proj", "v_proj"].iter().enumerate() {
                    names.push((
                        format!("{layer}.self_attn.{part}.{kind}"),
                        key.to_string(),
                        TensorView::Rows {
                            start: j * width,
                            count: width,
                        },
                    ));
                }
                continue;
            }
            let renamed = tail
                .replace("ln_1", "layer_norm1")
                .replace("ln_2", "layer_norm2")
                .replace("mlp.c_fc", "mlp.fc1")
                .replace("mlp.c_proj", "mlp.fc2")
                .replace("attn.out_proj", "self_attn.out_proj");
            names.push((
                format!("{layer}.{renamed}"),
                key.to_string(),
                TensorView::Whole,
            ));
        }
        names.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(names)
    }

    /// The first text encoder's tensors (SD 1's CLIP, SD 2's OpenCLIP with `layers` layers,
    /// SDXL's `text_encoder`) under transformers' names.
    pub fn text_encoder_weights(&self, layers: usize) -> Result<Weights> {
        match self.arch {
            SingleFileArch::Sd2 => self.weights.view(self.open_clip_names(layers, false)?),
            _ => self.weights.view(self.clip_names()),
        }
    }

    /// SDXL's `text_encoder_2` (OpenCLIP bigG with projection; the refiner's only encoder) of
    /// `layers` layers.
    pub fn text_encoder_2_weights(&self, layers: usize) -> Result<Weights> {
        self.weights.view(self.open_clip_names(layers, true)?)
    }

    /// The file's tensors that no component takes, other than the ones every LDM checkpoint
    /// carries and diffusers ignores too (EMA copies, the DDPM schedule buffers, position ids,
    /// `logit_scale`, SD 2's unused last text block): worth a warning, since diffusers drops
    /// them silently.
    pub fn unmapped_keys(&self, text_layers: usize, text_2_layers: usize) -> Result<Vec<String>> {
        let mut used: HashSet<String> = HashSet::new();
        let mut all = self.unet_names()?;
        all.extend(self.vae_names());
        all.extend(self.clip_names());
        match self.arch {
            SingleFileArch::Sd2 => all.extend(self.open_clip_names(text_layers, false)?),
            SingleFileArch::SdxlBase | SingleFileArch::SdxlRefiner => {
                all.extend(self.open_clip_names(text_2_layers, true)?)
            }
            SingleFileArch::Sd1 => {}
        }
        used.extend(all.into_iter().map(|(_, source, _)| source));
        let open_clip_blocks = self
            .open_clip_prefix()
            .map(|p| format!("{p}transformer.resblocks."));
        let mut unmapped: Vec<String> = self
            .weights
            .keys()
            .filter(|k| !used.contains(*k) && !ignorable(k, self.arch))
            .filter(|k| {
                // SD 2's blocks past the penultimate one are unused by design.
                !(self.arch == SingleFileArch::Sd2
                    && open_clip_blocks
                        .as_deref()
                        .is_some_and(|p| k.starts_with(p)))
            })
            .map(str::to_string)
            .collect();
        unmapped.sort();
        Ok(unmapped)
    }

    /// Down/up blocks' resnet count, from the numbering of `input_blocks`: block b holds
    /// `layers` resnets and (but the last) a downsampler, so `n * layers + (n - 1)` blocks
    /// follow `input_blocks.0`.
    pub fn unet_layers_per_block(&self) -> Result<usize> {
        let input = format!("{UNET_PREFIX}input_blocks.");
        let mut indices = BTreeSet::new();
        let mut downsamplers = BTreeSet::new();
        for key in self.weights.keys() {
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
                path: self.path.clone(),
                reason: format!(
                    "the UNet's input blocks ({total} after `input_blocks.0`, {} downsamplers) \
                     do not form equal down blocks",
                    downsamplers.len()
                ),
                looked_for: format!("`{UNET_PREFIX}input_blocks.N.0.op.weight`"),
                found: first_keys(&self.weights),
            });
        }
        Ok((total - downsamplers.len()) / blocks)
    }

    /// How many distinct `N` follow `prefix` in the keys (`prefix N.…`).
    fn count_indices(&self, prefix: &str) -> usize {
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

    /// The UNet config: the released model's (SD 1.5, SD 2.1, SDXL base) with the channels,
    /// block types, depths, context width and projection type read from the tensors. Head
    /// counts follow the released models (8 heads for SD 1, 64 channels a head for SD 2 and
    /// SDXL); `norm_num_groups` (32) cannot be read from a tensor: a checkpoint with other
    /// values needs a `config` folder.
    pub fn unet_config(&self, prediction_v: bool) -> Result<UNet2DConditionConfig> {
        let p = UNET_PREFIX;
        let layers = self.unet_layers_per_block()?;
        let n = self.count_indices(&format!("{p}input_blocks."));
        let blocks = n / (layers + 1);
        let mut channels = Vec::with_capacity(blocks);
        let mut down = Vec::with_capacity(blocks);
        let mut depth = Vec::with_capacity(blocks);
        let mut context_dim = None;
        let mut linear = false;
        for b in 0..blocks {
            let first = 1 + b * (layers + 1);
            channels.push(self.dim(&format!("{p}input_blocks.{first}.0.out_layers.3.weight"), 0)?);
            let attn = format!("{p}input_blocks.{first}.1.");
            if let Some(shape) = self.shape(&format!("{attn}proj_in.weight")) {
                linear = shape.len() == 2;
                down.push("CrossAttnDownBlock2D".to_string());
                depth.push(self.count_indices(&format!("{attn}transformer_blocks.")));
                context_dim.get_or_insert(
                    self.dim(&format!("{attn}transformer_blocks.0.attn2.to_k.weight"), 1)?,
                );
            } else {
                down.push("DownBlock2D".to_string());
                depth.push(1);
            }
        }
        let up = (0..blocks)
            .map(|b| {
                let attn = format!("{p}output_blocks.{}.1.proj_in.weight", b * (layers + 1));
                if self.weights.contains(&attn) {
                    "CrossAttnUpBlock2D".to_string()
                } else {
                    "UpBlock2D".to_string()
                }
            })
            .collect();
        let mid = if self
            .weights
            .contains(&format!("{p}middle_block.1.proj_in.weight"))
        {
            "UNetMidBlock2DCrossAttn"
        } else {
            "UNetMidBlock2D"
        };
        let heads = match self.arch {
            SingleFileArch::Sd1 => PerBlock::One(8),
            _ => PerBlock::Each(channels.iter().map(|c| (c / 64).max(1)).collect()),
        };
        let mut config = UNet2DConditionConfig {
            sample_size: Some(PerBlock::One(self.default_image_size(prediction_v) / 8)),
            in_channels: self.dim(KEY_CONV_IN, 1)?,
            out_channels: self.dim(&format!("{p}out.2.weight"), 0)?,
            down_block_types: down,
            mid_block_type: Some(mid.into()),
            up_block_types: up,
            block_out_channels: channels,
            layers_per_block: PerBlock::One(layers),
            cross_attention_dim: PerBlock::One(context_dim.unwrap_or(768)),
            transformer_layers_per_block: if depth.iter().all(|&d| d == 1) {
                PerBlock::One(1)
            } else {
                PerBlock::Each(depth)
            },
            attention_head_dim: heads,
            use_linear_projection: linear,
            upcast_attention: self.arch == SingleFileArch::Sd2 && prediction_v,
            ..UNet2DConditionConfig::default()
        };
        if let Some(ids) = self.time_ids() {
            config.addition_embed_type = Some("text_time".into());
            // `add_embedding` takes the pooled text embeds and 6 sinusoidal time ids (5 for the
            // refiner, whose last id is the aesthetic score): 2816 = 1280 + 6 * 256 for SDXL
            // base, 2560 = 1280 + 5 * 256 for the refiner.
            let input = self.dim(&format!("{p}label_emb.0.0.weight"), 1)?;
            let prefix = self.open_clip_prefix().unwrap_or(OPEN_CLIP_SDXL_PREFIX);
            let pooled = self.dim(&format!("{prefix}text_projection"), 1)?;
            let per_id = input.saturating_sub(pooled) / ids;
            if per_id == 0 || pooled + ids * per_id != input {
                return Err(ModelError::UnknownArchitecture {
                    path: self.path.clone(),
                    reason: format!(
                        "the UNet's `label_emb.0.0.weight` takes {input} inputs, which is not \
                         the pooled text width {pooled} plus {ids} time-id embeddings"
                    ),
                    looked_for: format!("`{p}label_emb.0.0.weight`"),
                    found: first_keys(&self.weights),
                });
            }
            config.addition_time_embed_dim = Some(per_id);
            config.projection_class_embeddings_input_dim = Some(input);
        }
        Ok(config)
    }

    /// How many time ids SDXL's added condition embeds: 6 for the base (original size, crop,
    /// target size), 5 for the refiner (original size, crop, aesthetic score); `None` for SD.
    pub fn time_ids(&self) -> Option<usize> {
        match self.arch {
            SingleFileArch::SdxlBase => Some(6),
            SingleFileArch::SdxlRefiner => Some(5),
            SingleFileArch::Sd1 | SingleFileArch::Sd2 => None,
        }
    }

    /// The VAE config: channels, depth and latent width from the tensors, the scaling factor of
    /// the released model (0.13025 for SDXL, else 0.18215).
    pub fn vae_config(&self, prediction_v: bool) -> Result<AutoencoderKLConfig> {
        let p = self.vae_prefix();
        let blocks = self.count_indices(&format!("{p}encoder.down."));
        let channels = (0..blocks)
            .map(|i| self.dim(&format!("{p}encoder.down.{i}.block.0.conv2.weight"), 0))
            .collect::<Result<Vec<_>>>()?;
        Ok(AutoencoderKLConfig {
            in_channels: self.dim(&format!("{p}encoder.conv_in.weight"), 1)?,
            out_channels: self.dim(&format!("{p}decoder.conv_out.weight"), 0)?,
            down_block_types: vec!["DownEncoderBlock2D".into(); blocks],
            up_block_types: vec!["UpDecoderBlock2D".into(); blocks],
            block_out_channels: channels,
            layers_per_block: self.count_indices(&format!("{p}encoder.down.0.block.")),
            latent_channels: self.dim(&format!("{p}decoder.conv_in.weight"), 1)?,
            sample_size: Some(self.default_image_size(prediction_v)),
            scaling_factor: if self.arch.is_sdxl() {
                0.13025
            } else {
                0.18215
            },
            ..AutoencoderKLConfig::default()
        })
    }

    /// The first text encoder's config: widths, depth and vocabulary from the tensors, 64
    /// channels a head, the activation of the released encoder (quick GELU for CLIP ViT-L,
    /// GELU for OpenCLIP); SD 2 uses all but the last OpenCLIP block.
    pub fn text_encoder_config(&self) -> Result<ClipTextConfig> {
        match self.arch {
            SingleFileArch::Sd2 => {
                let blocks =
                    self.count_indices(&format!("{OPEN_CLIP_PREFIX}transformer.resblocks."));
                let mut config = self.open_clip_config(OPEN_CLIP_PREFIX)?;
                config.num_hidden_layers = blocks.saturating_sub(1).max(1);
                config.projection_dim = 512;
                Ok(config)
            }
            _ => {
                let prefix = self.clip_prefix().unwrap_or(CLIP_PREFIX);
                let t = format!("{prefix}text_model.");
                let token = format!("{t}embeddings.token_embedding.weight");
                let hidden = self.dim(&token, 1)?;
                Ok(ClipTextConfig {
                    vocab_size: self.dim(&token, 0)?,
                    hidden_size: hidden,
                    intermediate_size: self
                        .dim(&format!("{t}encoder.layers.0.mlp.fc1.weight"), 0)?,
                    projection_dim: hidden,
                    num_hidden_layers: self.count_indices(&format!("{t}encoder.layers.")),
                    num_attention_heads: self.clip_heads(hidden)?,
                    max_position_embeddings: self
                        .dim(&format!("{t}embeddings.position_embedding.weight"), 0)?,
                    hidden_act: "quick_gelu".into(),
                    bos_token_id: 0,
                    eos_token_id: 2,
                    pad_token_id: Some(1),
                    ..ClipTextConfig::default()
                })
            }
        }
    }

    /// 64 channels a head, as every released CLIP/OpenCLIP text encoder has.
    fn clip_heads(&self, hidden: usize) -> Result<usize> {
        if hidden == 0 || !hidden.is_multiple_of(64) {
            return Err(ModelError::Config {
                path: self.path.clone(),
                reason: format!(
                    "the text encoder is {hidden} wide, not a multiple of the released \
                     encoders' 64 channels a head: its head count cannot be inferred, pass the \
                     matching diffusers folder as `config`"
                ),
            });
        }
        Ok(hidden / 64)
    }

    /// SDXL's `text_encoder_2` config (OpenCLIP bigG, every block, with projection; the
    /// refiner's from `conditioner.embedders.0.model.`).
    pub fn text_encoder_2_config(&self) -> Result<ClipTextConfig> {
        let prefix = match self.arch {
            SingleFileArch::SdxlRefiner => OPEN_CLIP_REFINER_PREFIX,
            _ => OPEN_CLIP_SDXL_PREFIX,
        };
        let mut config = self.open_clip_config(prefix)?;
        config.num_hidden_layers = self.count_indices(&format!("{prefix}transformer.resblocks."));
        config.projection_dim = self.dim(&format!("{prefix}text_projection"), 1)?;
        Ok(config)
    }

    fn open_clip_config(&self, prefix: &str) -> Result<ClipTextConfig> {
        let token = format!("{prefix}token_embedding.weight");
        let hidden = self.dim(&token, 1)?;
        Ok(ClipTextConfig {
            vocab_size: self.dim(&token, 0)?,
            hidden_size: hidden,
            intermediate_size: self.dim(
                &format!("{prefix}transformer.resblocks.0.mlp.c_fc.weight"),
                0,
            )?,
            projection_dim: hidden,
            num_hidden_layers: 0,
            num_attention_heads: self.clip_heads(hidden)?,
            max_position_embeddings: self.dim(&format!("{prefix}positional_embedding"), 0)?,
            hidden_act: "gelu".into(),
            bos_token_id: 0,
            eos_token_id: 2,
            pad_token_id: Some(1),
            ..ClipTextConfig::default()
        })
    }

    /// The image size the released model was trained at (diffusers'
    /// `DIFFUSERS_TO_LDM_DEFAULT_IMAGE_SIZE_MAP`; 512 for SD 2 base, an epsilon model, and for
    /// SD 2 inpainting).
    pub fn default_image_size(&self, prediction_v: bool) -> usize {
        match self.arch {
            SingleFileArch::Sd1 => 512,
            SingleFileArch::Sd2 if prediction_v => 768,
            SingleFileArch::Sd2 => 512,
            SingleFileArch::SdxlBase | SingleFileArch::SdxlRefiner => 1024,
        }
    }

    /// Whether an SD 2 checkpoint predicts v, as diffusers decides without a config: v unless
    /// the checkpoint's `global_step` is 875000 (SD 2 base). SD 2 inpainting (released as
    /// `stable-diffusion-2-inpainting`, epsilon) and other architectures predict noise.
    pub fn predicts_v(&self) -> bool {
        if self.arch != SingleFileArch::Sd2 || self.inpainting {
            return false;
        }
        match self.weights.read_f32("global_step") {
            Ok((values, _)) => values.first().is_none_or(|&s| s != 875000.0),
            Err(_) => true,
        }
    }
}

/// diffusers' name of UNet tensor `rest` (the key after `model.diffusion_model.`), as
/// `convert_ldm_unet_checkpoint` renames it; `None` for keys it does not take.
fn unet_name(rest: &str, layers: usize) -> Option<String> {
    const FIXED: [(&str, &str); 7] = [
        ("time_embed.0.", "time_embedding.linear_1."),
        ("time_embed.2.", "time_embedding.linear_2."),
        ("input_blocks.0.0.", "conv_in."),
        ("out.0.", "conv_norm_out."),
        ("out.2.", "conv_out."),
        ("label_emb.0.0.", "add_embedding.linear_1."),
        ("label_emb.0.2.", "add_embedding.linear_2."),
    ];
    for (ldm, diffusers) in FIXED {
        if let Some(param) = rest.strip_prefix(ldm) {
            return Some(format!("{diffusers}{param}"));
        }
    }
    let (section, rest) = rest.split_once('.')?;
    let (index, rest) = rest.split_once('.')?;
    let i: usize = index.parse().ok()?;
    let (part, tail) = rest.split_once('.')?;
    let resnet = |tail: &str| {
        tail.replace("in_layers.0", "norm1")
            .replace("in_layers.2", "conv1")
            .replace("out_layers.0", "norm2")
            .replace("out_layers.3", "conv2")
            .replace("emb_layers.1", "time_emb_proj")
            .replace("skip_connection", "conv_shortcut")
    };
    match section {
        "input_blocks" if i > 0 => {
            let (block, layer) = ((i - 1) / (layers + 1), (i - 1) % (layers + 1));
            match part {
                "0" => match tail.strip_prefix("op.") {
                    Some(param) => Some(format!("down_blocks.{block}.downsamplers.0.conv.{param}")),
                    None => Some(format!(
                        "down_blocks.{block}.resnets.{layer}.{}",
                        resnet(tail)
                    )),
                },
                "1" => Some(format!("down_blocks.{block}.attentions.{layer}.{tail}")),
                _ => None,
            }
        }
        "middle_block" => match i {
            0 | 2 => Some(format!(
                "mid_block.resnets.{}.{}",
                i / 2,
                resnet(&format!("{part}.{tail}"))
            )),
            1 => Some(format!("mid_block.attentions.0.{part}.{tail}")),
            _ => None,
        },
        "output_blocks" => {
            let (block, layer) = (i / (layers + 1), i % (layers + 1));
            match (part, tail.strip_prefix("conv.")) {
                ("0", _) => Some(format!(
                    "up_blocks.{block}.resnets.{layer}.{}",
                    resnet(tail)
                )),
                ("1" | "2", Some(param)) => {
                    Some(format!("up_blocks.{block}.upsamplers.0.conv.{param}"))
                }
                ("1", None) => Some(format!("up_blocks.{block}.attentions.{layer}.{tail}")),
                _ => None,
            }
        }
        _ => None,
    }
}

/// diffusers' name of VAE tensor `rest` (the key after `first_stage_model.`), as
/// `convert_ldm_vae_checkpoint` renames it; the decoder's `up.N` count backwards.
fn vae_name(rest: &str, up_blocks: usize) -> Option<String> {
    let (coder, tail) = rest.split_once('.')?;
    if coder == "quant_conv" || coder == "post_quant_conv" {
        return Some(rest.to_string());
    }
    if coder != "encoder" && coder != "decoder" {
        return None;
    }
    if let Some(param) = tail.strip_prefix("norm_out.") {
        return Some(format!("{coder}.conv_norm_out.{param}"));
    }
    if tail.starts_with("conv_in.") || tail.starts_with("conv_out.") {
        return Some(rest.to_string());
    }
    let resnet = |t: &str| t.replace("nin_shortcut", "conv_shortcut");
    if let Some(mid) = tail.strip_prefix("mid.") {
        let (part, param) = mid.split_once('.')?;
        return match part {
            "block_1" => Some(format!("{coder}.mid_block.resnets.0.{}", resnet(param))),
            "block_2" => Some(format!("{coder}.mid_block.resnets.1.{}", resnet(param))),
            "attn_1" => {
                let (layer, p) = param.split_once('.')?;
                let layer = match layer {
                    "norm" => "group_norm",
                    "q" => "to_q",
                    "k" => "to_k",
                    "v" => "to_v",
                    "proj_out" => "to_out.0",
                    _ => return None,
                };
                Some(format!("{coder}.mid_block.attentions.0.{layer}.{p}"))
            }
            _ => None,
        };
    }
    let (kind, tail) = tail.split_once('.')?;
    let (index, tail) = tail.split_once('.')?;
    let i: usize = index.parse().ok()?;
    let (blocks, sampler, block) = match (coder, kind) {
        ("encoder", "down") => ("down_blocks", "downsample", i),
        ("decoder", "up") if i < up_blocks => ("up_blocks", "upsample", up_blocks - 1 - i),
        _ => return None,
    };
    if let Some(param) = tail.strip_prefix(&format!("{sampler}.conv.")) {
        let samplers = if sampler == "downsample" {
            "downsamplers"
        } else {
            "upsamplers"
        };
        return Some(format!(
            "{coder}.{blocks}.{block}.{samplers}.0.conv.{param}"
        ));
    }
    let rest = tail.strip_prefix("block.")?;
    Some(format!("{coder}.{blocks}.{block}.resnets.{}", resnet(rest)))
}

/// Keys every LDM checkpoint may carry that no diffusers component takes.
fn ignorable(key: &str, arch: SingleFileArch) -> bool {
    const SCHEDULE: [&str; 13] = [
        "betas",
        "alphas_cumprod",
        "alphas_cumprod_prev",
        "sqrt_alphas_cumprod",
        "sqrt_one_minus_alphas_cumprod",
        "log_one_minus_alphas_cumprod",
        "sqrt_recip_alphas_cumprod",
        "sqrt_recipm1_alphas_cumprod",
        "posterior_variance",
        "posterior_log_variance_clipped",
        "posterior_mean_coef1",
        "posterior_mean_coef2",
        "logvar",
    ];
    SCHEDULE.contains(&key)
        || key == "global_step"
        || key.starts_with("model_ema.")
        || key.ends_with("position_ids")
        || key.ends_with("logit_scale")
        || key.starts_with("first_stage_model.loss.")
        || (arch == SingleFileArch::Sd2 && key == "cond_stage_model.model.text_projection")
}

/// The architecture, decided in diffusers' order (`infer_diffusers_model_type`), with the
/// text-encoder keys deciding where diffusers' width checks cannot (checkpoints narrower than
/// the released ones, as the test fixtures are).
fn detect(weights: &Weights, path: &Path) -> Result<SingleFileArch> {
    let looked_for = format!(
        "`{KEY_CONV_IN}` (the UNet), then `{KEY_V2}` of width 1024 or `{KEY_OPEN_CLIP}` \
         (SD 2), `{KEY_XL_BASE}` or `{KEY_OPEN_CLIP_SDXL}` (SDXL base), `{KEY_XL_REFINER}` or \
         `{KEY_OPEN_CLIP_SDXL_REFINER}` (SDXL refiner), `{KEY_CLIP}` (SD 1)"
    );
    let unknown = |reason: String| ModelError::UnknownArchitecture {
        path: path.to_path_buf(),
        reason,
        looked_for: looked_for.clone(),
        found: first_keys(weights),
    };
    let Some(conv_in) = weights.shape(KEY_CONV_IN) else {
        let reason =
            if weights.contains("conv_in.weight") || weights.contains("encoder.conv_in.weight") {
                "it has no `model.diffusion_model.` UNet; its keys are diffusers' own (one \
             component's weights file): load the diffusers folder it belongs to instead"
                    .to_string()
            } else {
                "it has no `model.diffusion_model.` UNet".to_string()
            };
        return Err(unknown(reason));
    };
    if conv_in.get(1) == Some(&8) {
        return Err(unknown(
            "it is an InstructPix2Pix checkpoint (an 8-channel UNet input), which \
             from_single_file does not load"
                .into(),
        ));
    }
    if weights.shape(KEY_V2).and_then(|s| s.last()) == Some(&1024)
        || weights.contains(KEY_OPEN_CLIP)
    {
        return Ok(SingleFileArch::Sd2);
    }
    if weights.contains(KEY_XL_BASE) || weights.contains(KEY_OPEN_CLIP_SDXL) {
        if !weights.contains(&format!(
            "{CLIP_SDXL_PREFIX}{}",
            &KEY_CLIP[CLIP_PREFIX.len()..]
        )) {
            return Err(unknown(
                "it has SDXL's second text encoder but not its first \
                 (`conditioner.embedders.0.transformer.`)"
                    .into(),
            ));
        }
        return Ok(SingleFileArch::SdxlBase);
    }
    if weights.contains(KEY_XL_REFINER) || weights.contains(KEY_OPEN_CLIP_SDXL_REFINER) {
        if conv_in.get(1) == Some(&9) {
            return Err(unknown(
                "it is an SDXL refiner with a 9-channel (inpainting) UNet, which diffusers has \
                 no pipeline for"
                    .into(),
            ));
        }
        return Ok(SingleFileArch::SdxlRefiner);
    }
    if weights.contains(KEY_CLIP) {
        return Ok(SingleFileArch::Sd1);
    }
    Err(unknown(
        "it has a UNet but no text encoder this loader knows (neither CLIP under \
         `cond_stage_model.transformer.` nor OpenCLIP under `cond_stage_model.model.` / \
         `conditioner.embedders.`)"
            .into(),
    ))
}

/// A few of the file's keys, sorted, for messages.
fn first_keys(weights: &Weights) -> String {
    let mut keys: Vec<&str> = weights.keys().collect();
    keys.sort_unstable();
    let n = keys.len();
    let shown: Vec<String> = keys.iter().take(5).map(|k| format!("`{k}`")).collect();
    if n == 0 {
        "none (the file holds no tensors)".into()
    } else if n > 5 {
        format!("{} (of {n})", shown.join(", "))
    } else {
        shown.join(", ")
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unet_keys_are_renamed_as_diffusers_does() {
        let cases = [
            ("time_embed.0.weight", "time_embedding.linear_1.weight"),
            ("input_blocks.0.0.bias", "conv_in.bias"),
            (
                "input_blocks.1.0.in_layers.0.weight",
                "down_blocks.0.resnets.0.norm1.weight",
            ),
            (
                "input_blocks.2.0.emb_layers.1.bias",
                "down_blocks.0.resnets.1.time_emb_proj.bias",
            ),
            (
                "input_blocks.3.0.op.weight",
                "down_blocks.0.downsamplers.0.conv.weight",
            ),
            (
                "input_blocks.4.0.skip_connection.weight",
                "down_blocks.1.resnets.0.conv_shortcut.weight",
            ),
            (
                "input_blocks.5.1.transformer_blocks.0.attn1.to_q.weight",
                "down_blocks.1.attentions.1.transformer_blocks.0.attn1.to_q.weight",
            ),
            (
                "middle_block.0.out_layers.3.weight",
                "mid_block.resnets.0.conv2.weight",
            ),
            (
                "middle_block.1.proj_in.weight",
                "mid_block.attentions.0.proj_in.weight",
            ),
            (
                "middle_block.2.in_layers.2.bias",
                "mid_block.resnets.1.conv1.bias",
            ),
            (
                "output_blocks.2.1.conv.weight",
                "up_blocks.0.upsamplers.0.conv.weight",
            ),
            (
                "output_blocks.5.2.conv.bias",
                "up_blocks.1.upsamplers.0.conv.bias",
            ),
            (
                "output_blocks.5.1.norm.weight",
                "up_blocks.1.attentions.2.norm.weight",
            ),
            (
                "output_blocks.11.0.skip_connection.weight",
                "up_blocks.3.resnets.2.conv_shortcut.weight",
            ),
            ("out.2.weight", "conv_out.weight"),
            ("label_emb.0.2.bias", "add_embedding.linear_2.bias"),
        ];
        for (ldm, diffusers) in cases {
            assert_eq!(unet_name(ldm, 2).as_deref(), Some(diffusers), "{ldm}");
        }
    }

    #[test]
    fn vae_keys_are_renamed_as_diffusers_does() {
        let cases = [
            ("encoder.norm_out.weight", "encoder.conv_norm_out.weight"),
            (
                "encoder.down.1.block.0.nin_shortcut.weight",
                "encoder.down_blocks.1.resnets.0.conv_shortcut.weight",
            ),
            (
                "encoder.down.0.downsample.conv.bias",
                "encoder.down_blocks.0.downsamplers.0.conv.bias",
            ),
            (
                "decoder.up.3.block.2.conv1.weight",
                "decoder.up_blocks.0.resnets.2.conv1.weight",
            ),
            (
                "decoder.up.1.upsample.conv.weight",
                "decoder.up_blocks.2.upsamplers.0.conv.weight",
            ),
            (
                "decoder.mid.attn_1.proj_out.bias",
                "decoder.mid_block.attentions.0.to_out.0.bias",
            ),
            (
                "decoder.mid.attn_1.norm.weight",
                "decoder.mid_block.attentions.0.group_norm.weight",
            ),
            (
                "encoder.mid.block_2.norm2.bias",
                "encoder.mid_block.resnets.1.norm2.bias",
            ),
            ("post_quant_conv.weight", "post_quant_conv.weight"),
        ];
        for (ldm, diffusers) in cases {
            assert_eq!(vae_name(ldm, 4).as_deref(), Some(diffusers), "{ldm}");
        }
    }
}
