//! oxidiff's pipelines: prompt in, image out.
//!
//! Where this sits: a pipeline encodes the prompt, drives a scheduler from `oxidiff-schedulers`,
//! calls the denoiser and the VAE from `oxidiff-models`, and post-processes the images. It knows
//! nothing of the device beyond the Burn backend it is generic over.

pub mod aot;
pub mod error;
pub mod guard;
pub mod host;
pub mod hub;
pub mod image;
pub mod loading;
pub mod metadata;
pub mod parallel;
pub mod pixart;
pub mod pixart_bins;
pub mod stable_diffusion;

pub use error::{PipelineError, Result};
pub use guard::CancelToken;
pub use hub::{resolve_model, ModelSource};
pub use image::Images;
pub use loading::pipeline_class;
pub use metadata::GenerationParameters;
pub use pixart::{
    PixArtAlphaPipeline, PixArtDenoiser, PixArtPipeline, PixArtRequest, PixArtSigmaPipeline,
    PixArtVariant, PIXART_CLASSES,
};
pub use stable_diffusion::{
    guided_noise, CompileStats, Denoiser, GenerateRequest, LoadOptions, OutputType, PipelineOutput,
    StableDiffusionPipeline, StepInfo,
};
pub mod stable_diffusion_xl;
pub use stable_diffusion_xl::{StableDiffusionXLPipeline, XlDenoiser, XlOptions, XlPromptEmbeds};
pub mod stable_diffusion_img2img;
pub use stable_diffusion_img2img::StableDiffusionImg2ImgPipeline;
