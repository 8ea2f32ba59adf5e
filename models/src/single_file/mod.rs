//! Single-file checkpoints: one `.safetensors` in the original LDM / A1111 key layout
//! (`model.diffusion_model.input_blocks.1.1.…`, `first_stage_model.…`, `cond_stage_model.…`,
//! SDXL's `conditioner.embedders.0/1.…`), read as diffusers' components, split as diffusers'
//! `single_file_utils`: detection ([`detect`]), renaming ([`rename`]) and configs ([`config`]).
//!
//! Where this sits: below the pipelines' `from_single_file`. Nothing is converted or copied, so
//! the models load unchanged.

pub mod config;
pub mod controlnet;
pub mod detect;
pub mod file;
pub mod flux;
pub mod gguf;
pub mod rename;

pub use controlnet::{ControlNetFile, ControlNetLayout, CONTROL_MODEL_PREFIX};
pub use detect::{
    SingleFileArch, KEY_CLIP, KEY_CONV_IN, KEY_OPEN_CLIP, KEY_OPEN_CLIP_SDXL,
    KEY_OPEN_CLIP_SDXL_REFINER, KEY_V1, KEY_V2, KEY_XL_BASE, KEY_XL_REFINER, UNET_PREFIX,
};
pub use file::SingleFile;
