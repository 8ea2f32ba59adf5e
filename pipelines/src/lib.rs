//! oxidiff's pipelines: prompt in, image out.
//!
//! Where this sits: a pipeline encodes the prompt, drives a scheduler from `oxidiff-schedulers`,
//! calls the denoiser and the VAE from `oxidiff-models`, and post-processes the images. It knows
//! nothing of the device beyond the Burn backend it is generic over.

pub mod aot;
pub mod error;
pub mod hub;
pub mod image;
pub mod stable_diffusion;

pub use error::{PipelineError, Result};
pub use hub::{resolve_model, ModelSource};
pub use image::Images;
pub use stable_diffusion::{
    guided_noise, CompileStats, Denoiser, GenerateRequest, LoadOptions, OutputType, PipelineOutput,
    StableDiffusionPipeline, StepInfo,
};
