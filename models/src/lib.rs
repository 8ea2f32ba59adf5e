//! oxidiff's models: the networks of diffusion pipelines, written once and generic over a Burn
//! [`Backend`](burn::tensor::backend::Backend), so the same code runs on the CPU backend and on
//! PJRT devices.
//!
//! Where this sits: pipelines call these models; the models call only Burn's tensor API. Each
//! model is built straight from a diffusers checkpoint folder: field names follow the checkpoint
//! keys (`down_blocks.0.resnets.0.conv1`), so a file reads beside diffusers' Python class of the
//! same name.

pub mod attention;
pub mod autoencoder_kl;
pub mod clip;
pub mod clip_vision;
pub mod config;
pub mod controlnet;
pub mod controlnet_flux;
pub mod controlnet_sd3;
pub mod cpu;
pub mod device;
pub mod dtype;
pub mod embeddings;
pub mod error;
pub mod gguf;
pub mod ip_adapter;
pub mod joint_attention;
pub mod lora;
pub mod memory;
pub mod nn;
pub mod normalization;
pub mod parallel;
pub mod pixart_transformer_2d;
pub mod program;
pub mod resnet;
pub mod safetensors_check;
pub mod single_file;
pub mod t5;
pub mod tokenizer;
pub mod transformer_flux;
pub mod transformer_sd3;
pub mod unet_2d_blocks;
pub mod unet_2d_condition;
pub mod unet_2d_condition_config;
pub mod unet_conditioning;
mod unet_layout;
pub mod vae_tiling;
pub mod var_builder;
mod weight_data;
pub mod weights;

pub use autoencoder_kl::{AutoencoderKL, AutoencoderKLConfig, LatentDist};
pub use clip::{ClipTextConfig, ClipTextModel, ClipTextOutput};
pub use clip_vision::{ClipVisionConfig, ClipVisionModelWithProjection, ClipVisionOutput};
pub use controlnet::{ControlNetConfig, ControlNetModel, ControlResiduals};
pub use controlnet_flux::FluxControlNetModel;
pub use controlnet_sd3::{SD3ControlNetConfig, SD3ControlNetModel};
pub use device::ToDevice;
pub use dtype::ToDType;
pub use error::{ModelError, Result};
pub use ip_adapter::{ImageProjection, IpAdapterPlusImageProjection, IpImageProjection};
pub use oxidiff_parallel::{TensorParallel, TensorParallelPlan};
pub use parallel::{sharded_params, ShardedParam};
pub use pixart_transformer_2d::{PixArtTransformer2DConfig, PixArtTransformer2DModel};
pub use program::{ProgramSlot, TensorProgram};
pub use single_file::{ControlNetFile, ControlNetLayout, SingleFile, SingleFileArch};
pub use t5::{T5Config, T5EncoderModel};
pub use tokenizer::{ClipTokenizer, Encoded, MaskedTokens, T5Tokenizer};
pub use transformer_flux::{FluxTransformer2DConfig, FluxTransformer2DModel};
pub use transformer_sd3::{SD3Transformer2DConfig, SD3Transformer2DModel};
pub use unet_2d_condition::{AddedCondition, UNet2DConditionConfig, UNet2DConditionModel};
pub use var_builder::VarBuilder;
pub use weights::{TensorView, Weights};
