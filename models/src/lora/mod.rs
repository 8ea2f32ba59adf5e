//! LoRAs fused into a model's weights: the UNet, the SD3/Flux/PixArt transformers and the
//! CLIP text encoders, split as diffusers' `loaders`: the file formats ([`file`]), which layer a
//! key names ([`keys`]), and the fusing ([`fusing`]).
//!
//! Pipelines open a file with [`LoraFile::open`], resolve it against each of their models with
//! [`plan`] and then [`fuse`] it. Fused, not applied on the fly: the fused model is the same
//! plain model with other weight values, so a compiled step traces the very program it would
//! without a LoRA; the cost is that unloading means fusing the negated scale or reloading.

pub mod file;
pub mod fusing;
pub mod keys;

pub use file::{LoraComponent, LoraFile, LoraFormat, LoraLayer};
pub use fusing::{fuse, plan, LoraPlan};
pub use keys::{lora_modules, KohyaSplit, LoraLayerKind, LoraModule, LoraTarget};
