//! Which architecture a single file holds, from its keys, as diffusers'
//! `infer_diffusers_model_type` decides (`CHECKPOINT_KEY_NAMES`).

use std::path::Path;

use crate::error::{ModelError, Result};
use crate::weights::Weights;

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

pub(super) const CLIP_PREFIX: &str = "cond_stage_model.transformer.";
pub(super) const CLIP_SDXL_PREFIX: &str = "conditioner.embedders.0.transformer.";
pub(super) const OPEN_CLIP_PREFIX: &str = "cond_stage_model.model.";
pub(super) const OPEN_CLIP_SDXL_PREFIX: &str = "conditioner.embedders.1.model.";
pub(super) const OPEN_CLIP_REFINER_PREFIX: &str = "conditioner.embedders.0.model.";
/// diffusers' `LDM_VAE_KEYS`.
pub(super) const VAE_PREFIXES: [&str; 2] = ["first_stage_model.", "vae."];

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

/// The architecture, decided in diffusers' order (`infer_diffusers_model_type`), with the
/// text-encoder keys deciding where diffusers' width checks cannot (checkpoints narrower than
/// the released ones, as the test fixtures are).
pub(super) fn detect(weights: &Weights, path: &Path) -> Result<SingleFileArch> {
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
pub(super) fn first_keys(weights: &Weights) -> String {
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
