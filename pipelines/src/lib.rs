//! oxidiff's pipelines: prompt in, image out.
//!
//! Where this sits: a pipeline encodes the prompt, drives a scheduler from `oxidiff-schedulers`,
//! calls the denoiser and the VAE from `oxidiff-models`, and post-processes the images. It knows
//! nothing of the device beyond the Burn backend it is generic over.
//!
//! Pipelines: [`StableDiffusionPipeline`] (SD 1.x/2.x), [`StableDiffusionImg2ImgPipeline`],
//! [`StableDiffusionXLPipeline`], [`StableDiffusion3Pipeline`], [`FluxPipeline`],
//! [`PixArtPipeline`] and the inpainting variants, each standing on the shared [`denoise`]
//! floor; [`AutoPipeline`] loads whichever a folder's `_class_name` names (for editing
//! [`AutoPipelineForImage2Image`] and [`AutoPipelineForInpainting`]),
//! [`resolve_model`] finds a folder or a Hub id in the local Hub cache.
//!
//! # Several images, each with its own seed
//!
//! A batch drawn from one generator per image ([`TorchCpuGenerators`], diffusers' list of
//! generators) gives each image exactly what it gets alone with its seed:
//!
//! ```
//! use oxidiff_backend_tpu::{Oxi, OxiDevice};
//! use oxidiff_pipelines::{GenerateRequest, LoadOptions, OutputType, StableDiffusionPipeline};
//! use oxidiff_schedulers::{TorchCpuGenerator, TorchCpuGenerators};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let model = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/tiny-sd1");
//! let device = OxiDevice::Cpu;
//! let mut pipe = StableDiffusionPipeline::<Oxi>::from_dir(model.as_ref(), &LoadOptions::default(), &device)?;
//! let request = GenerateRequest {
//!     prompts: vec!["a red apple".into()],
//!     num_inference_steps: 2,
//!     num_images_per_prompt: 2,
//!     output: OutputType::Latents, // skip the VAE: the final latents only
//!     ..Default::default()
//! };
//! let batch = pipe.generate_with(&request, &mut TorchCpuGenerators::new(&[7, 8]), |_| {})?;
//! let alone = GenerateRequest { num_images_per_prompt: 1, ..request.clone() };
//! let second = pipe.generate_with(&alone, &mut TorchCpuGenerator::new(8), |_| {})?;
//! let row = batch.latents.narrow(0, 1, 1).into_data().to_vec::<f32>()?;
//! let single = second.latents.into_data().to_vec::<f32>()?;
//! let diff = row.iter().zip(&single).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
//! assert!(diff < 1e-4, "batched and alone differ by {diff}");
//! # Ok(())
//! # }
//! ```
//!
//! [`TorchCpuGenerators`]: oxidiff_schedulers::TorchCpuGenerators

// The ground floor, shared by every pipeline.
pub mod compiled;
pub mod control;
pub mod denoise;
pub mod error;
pub mod guard;
pub mod host;
pub mod host_kernels;
pub mod hub;
pub mod image;
pub mod img2img;
pub mod inpaint;
pub mod ip_adapter;
pub mod loading;
pub mod lora;
pub mod mask_crop;
pub mod memory;
pub mod metadata;
pub mod model_hash;
pub mod offload;
pub mod parallel;
pub mod path_scale;
pub mod pixart_bins;
pub mod resample;
mod truncation;

// One pipeline a file, side by side.
pub mod flux;
pub mod flux_controlnet;
pub mod pixart;
pub mod stable_diffusion;
pub mod stable_diffusion_3;
pub mod stable_diffusion_3_controlnet;
pub mod stable_diffusion_controlnet;
pub mod stable_diffusion_controlnet_img2img;
pub mod stable_diffusion_controlnet_inpaint;
pub mod stable_diffusion_img2img;
pub mod stable_diffusion_inpaint;
pub mod stable_diffusion_xl;
pub mod stable_diffusion_xl_controlnet;
pub mod stable_diffusion_xl_controlnet_img2img;
pub mod stable_diffusion_xl_controlnet_inpaint;
pub mod stable_diffusion_xl_img2img;
pub mod stable_diffusion_xl_inpaint;

// Above the pipelines: loading by class or file, ahead-of-time tracing.
pub mod aot;
pub mod auto;
pub mod auto_edit;
pub mod single_file;

pub use auto::{AutoPipeline, FamilyOptions, PipelineFamily};
pub use auto_edit::{AutoPipelineForImage2Image, AutoPipelineForInpainting, EditOptions};
pub use compiled::{CompileStats, CompiledCall, ComponentStats, SchedulerProgram, WarmStart};
pub use control::{Control, ControlNets, ControlRequest};
pub use denoise::{GenerateRequest, OutputType, PipelineDefaults, PipelineOutput, StepInfo};
pub use error::{PipelineError, Result};
pub use flux::{FluxPipeline, FluxPromptEmbeds, FluxRequest, FLUX_CLASSES};
pub use flux_controlnet::FluxControlNetPipeline;
pub use guard::CancelToken;
pub use hub::{resolve_model, ModelSource};
pub use image::Images;
pub use inpaint::InpaintOptions;
pub use ip_adapter::{ClipImageProcessor, IpAdapter};
pub use loading::{pipeline_class, LoadOptions};
pub use lora::{LoraReport, LoraSpec};
pub use metadata::GenerationParameters;
pub use offload::Offload;
pub use pixart::{
    PixArtAlphaPipeline, PixArtCompiled, PixArtPipeline, PixArtRequest, PixArtSigmaPipeline,
    PixArtVariant, PIXART_CLASSES,
};
pub use single_file::{is_single_file, single_file_pipeline_class, SingleFileOptions};
pub use stable_diffusion::{guided_noise, GuidedStepInputs, StableDiffusionPipeline};
pub use stable_diffusion_3::{Sd3PromptEmbeds, Sd3Request, StableDiffusion3Pipeline, SD3_CLASS};
pub use stable_diffusion_3_controlnet::StableDiffusion3ControlNetPipeline;
pub use stable_diffusion_controlnet::StableDiffusionControlNetPipeline;
pub use stable_diffusion_controlnet_img2img::StableDiffusionControlNetImg2ImgPipeline;
pub use stable_diffusion_controlnet_inpaint::StableDiffusionControlNetInpaintPipeline;
pub use stable_diffusion_img2img::StableDiffusionImg2ImgPipeline;
pub use stable_diffusion_inpaint::StableDiffusionInpaintPipeline;
pub use stable_diffusion_xl::{StableDiffusionXLPipeline, XlOptions, XlPromptEmbeds, XlRequest};
pub use stable_diffusion_xl_controlnet::StableDiffusionXLControlNetPipeline;
pub use stable_diffusion_xl_controlnet_img2img::StableDiffusionXLControlNetImg2ImgPipeline;
pub use stable_diffusion_xl_controlnet_inpaint::StableDiffusionXLControlNetInpaintPipeline;
pub use stable_diffusion_xl_img2img::{
    StableDiffusionXLImg2ImgPipeline, XlEditOptions, XlInitImage,
};
pub use stable_diffusion_xl_inpaint::StableDiffusionXLInpaintPipeline;
