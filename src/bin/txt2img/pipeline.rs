//! The pipeline `model_index.json`'s `_class_name` names, as one enum over the five pipelines.

use std::path::Path;

use anyhow::Result;
use oxidiff::pipelines::parallel::ParallelConfig;
use oxidiff::pipelines::stable_diffusion_xl::SDXL_CLASS;
use oxidiff::pipelines::{
    FluxPipeline, FluxRequest, GenerateRequest, LoadOptions, LoraReport, LoraSpec, PipelineError,
    PipelineOutput, PixArtPipeline, PixArtRequest, Sd3Request, SingleFileOptions,
    StableDiffusion3Pipeline, StableDiffusionPipeline, StableDiffusionXLPipeline, StepInfo,
    XlOptions, FLUX_CLASSES, PIXART_CLASSES, SD3_CLASS,
};
use oxidiff::schedulers::TorchCpuGenerators;
use oxidiff::{Oxi, OxiDevice};

/// The pipeline `model_index.json`'s `_class_name` names.
pub enum Pipeline {
    Sd(Box<StableDiffusionPipeline<Oxi>>),
    Xl(Box<StableDiffusionXLPipeline<Oxi>>),
    PixArt(Box<PixArtPipeline<Oxi>>),
    Flux(Box<FluxPipeline<Oxi>>),
    Sd3(Box<StableDiffusion3Pipeline<Oxi>>),
}

impl Pipeline {
    pub fn load(
        dir: &Path,
        class: &str,
        options: &LoadOptions,
        device: &OxiDevice,
    ) -> Result<Self> {
        Ok(if FLUX_CLASSES.contains(&class) {
            Self::Flux(Box::new(FluxPipeline::from_dir(dir, options, device)?))
        } else if class == SD3_CLASS {
            Self::Sd3(Box::new(StableDiffusion3Pipeline::from_dir(
                dir, options, device,
            )?))
        } else if PIXART_CLASSES.contains(&class) {
            Self::PixArt(Box::new(PixArtPipeline::from_dir(dir, options, device)?))
        } else if class == SDXL_CLASS {
            Self::Xl(Box::new(StableDiffusionXLPipeline::from_dir(
                dir, options, device,
            )?))
        } else {
            Self::Sd(Box::new(StableDiffusionPipeline::from_dir(
                dir, options, device,
            )?))
        })
    }

    /// A single-file checkpoint: SD 1.x/2.x or SDXL, as `class` says.
    pub fn load_single_file(
        path: &Path,
        class: &str,
        options: &SingleFileOptions,
        device: &OxiDevice,
    ) -> Result<Self> {
        Ok(if class == SDXL_CLASS {
            Self::Xl(Box::new(StableDiffusionXLPipeline::from_single_file(
                path, options, device,
            )?))
        } else {
            Self::Sd(Box::new(StableDiffusionPipeline::from_single_file(
                path, options, device,
            )?))
        })
    }

    /// Fuses a LoRA into the denoiser (UNet or transformer) and the CLIP text encoders.
    pub fn load_lora(&mut self, spec: &LoraSpec) -> Result<LoraReport> {
        let (path, scale) = (&spec.path, spec.scale);
        Ok(match self {
            Self::Sd(pipe) => pipe.load_lora(path, scale)?,
            Self::Xl(pipe) => pipe.load_lora(path, scale)?,
            Self::PixArt(pipe) => pipe.load_lora(path, scale)?,
            Self::Flux(pipe) => pipe.load_lora(path, scale)?,
            Self::Sd3(pipe) => pipe.load_lora(path, scale)?,
        })
    }

    pub fn enable_parallelism(&mut self, config: ParallelConfig) -> Result<()> {
        match self {
            Self::Sd(pipe) => Ok(pipe.enable_parallelism(config)?),
            Self::PixArt(pipe) => Ok(pipe.enable_parallelism(config)?),
            Self::Xl(pipe) => Ok(pipe.enable_parallelism(config)?),
            Self::Flux(pipe) => Ok(pipe.enable_parallelism(config)?),
            Self::Sd3(pipe) => Ok(pipe.enable_parallelism(config)?),
        }
    }

    pub fn compile(&mut self) -> Result<()> {
        match self {
            Self::Sd(pipe) => Ok(pipe.compile()?),
            Self::Xl(pipe) => Ok(pipe.compile()?),
            Self::PixArt(pipe) => Ok(pipe.compile()?),
            Self::Flux(pipe) => Ok(pipe.compile()?),
            Self::Sd3(pipe) => Ok(pipe.compile()?),
        }
    }

    /// "eager", or what compiled mode built.
    pub fn mode(&self) -> String {
        let programs = match self {
            Self::Sd(pipe) => {
                return match pipe.compile_stats() {
                    Some(stats) => format!(
                        "compiled: {} program(s), {} XLA compile(s), {} from the disk cache",
                        stats.programs, stats.xla_compiles, stats.disk_loads
                    ),
                    None => "eager".into(),
                }
            }
            Self::Xl(pipe) => pipe.compile_stats().map(|s| s.programs),
            Self::PixArt(pipe) => pipe.compile_stats().map(|s| s.programs),
            Self::Flux(pipe) => pipe.compile_stats().map(|s| s.programs),
            Self::Sd3(pipe) => pipe.compile_stats().map(|s| s.programs),
        };
        match programs {
            Some(n) => format!("compiled: {n} program(s)"),
            None => "eager".into(),
        }
    }

    /// Pixels per latent cell.
    pub fn vae_scale_factor(&self) -> usize {
        match self {
            Self::Sd(pipe) => pipe.vae_scale_factor,
            Self::Xl(pipe) => pipe.vae_scale_factor,
            Self::PixArt(pipe) => pipe.vae_scale_factor,
            Self::Flux(pipe) => pipe.vae_scale_factor,
            Self::Sd3(pipe) => pipe.vae_scale_factor,
        }
    }

    pub fn scheduler_class(&self) -> &'static str {
        match self {
            Self::Sd(pipe) => pipe.scheduler.kind().class_name(),
            Self::Xl(pipe) => pipe.scheduler.kind().class_name(),
            Self::PixArt(pipe) => pipe.scheduler.kind().class_name(),
            Self::Flux(pipe) => pipe.scheduler.kind().class_name(),
            Self::Sd3(pipe) => pipe.scheduler.kind().class_name(),
        }
    }

    /// `(max_sequence_length, resolution_binning, true_cfg_scale)` only matter to PixArt, SD3
    /// (the length) and Flux.
    pub fn generate_with(
        &mut self,
        request: GenerateRequest<Oxi>,
        (max_sequence_length, resolution_binning, true_cfg_scale): (Option<usize>, bool, f64),
        generator: &mut TorchCpuGenerators,
        callback: impl FnMut(StepInfo<'_, Oxi>),
    ) -> Result<PipelineOutput<Oxi>, PipelineError> {
        match self {
            Self::Sd(pipe) => pipe.generate_with(&request, generator, callback),
            Self::Xl(pipe) => {
                pipe.generate_with(&request, &XlOptions::default(), generator, callback)
            }
            Self::PixArt(pipe) => {
                let request = PixArtRequest {
                    common: request,
                    max_sequence_length,
                    resolution_binning,
                };
                pipe.generate_with(&request, generator, callback)
            }
            Self::Flux(pipe) => {
                let request = FluxRequest {
                    common: request,
                    max_sequence_length: max_sequence_length
                        .unwrap_or(oxidiff::pipelines::flux::FLUX_MAX_SEQUENCE_LENGTH),
                    true_cfg_scale,
                    ..Default::default()
                };
                pipe.generate_with(&request, generator, callback)
            }
            Self::Sd3(pipe) => {
                let request = Sd3Request {
                    common: request,
                    max_sequence_length: max_sequence_length.unwrap_or(256),
                    ..Default::default()
                };
                pipe.generate_with(&request, generator, callback)
            }
        }
    }
}
