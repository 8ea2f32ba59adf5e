//! `AutoPipeline`: text to image with whichever pipeline a folder or single file holds, chosen
//! by its `_class_name` (diffusers' `AutoPipelineForText2Image`), with one registry of classes
//! and one dispatch for what every pipeline does.
//!
//! Where this sits: the top floor of the crate; it imports each pipeline and nothing imports
//! it.

use std::path::Path;

use burn::tensor::backend::Backend;
use oxidiff_backend_tpu::Oxi;
use oxidiff_models::AutoencoderKL;
use oxidiff_parallel::ParallelConfig;
use oxidiff_schedulers::{
    scheduler_from_config, NoiseSource, Scheduler, SchedulerConfig, TorchCpuGenerator,
};

use crate::compiled::{CompileStats, ComponentStats};
use crate::control::ControlNets;
use crate::control::ControlRequest;
use crate::denoise::{GenerateRequest, PipelineDefaults, PipelineOutput, StepInfo};
use crate::error::{PipelineError, Result};
use crate::flux::{FluxPipeline, FluxRequest, FLUX_CLASSES};
use crate::flux_controlnet::FluxControlNetPipeline;
use crate::loading::{pipeline_class, LoadOptions};
use crate::lora::LoraReport;
use crate::offload::Offload;
use crate::pixart::{PixArtPipeline, PixArtRequest, PIXART_CLASSES};
use crate::single_file::{single_file_pipeline_class, SingleFileOptions};
use crate::stable_diffusion::{StableDiffusionPipeline, SUPPORTED_CLASSES};
use crate::stable_diffusion_3::{Sd3Request, StableDiffusion3Pipeline, SD3_CLASS};
use crate::stable_diffusion_3_controlnet::StableDiffusion3ControlNetPipeline;
use crate::stable_diffusion_controlnet::StableDiffusionControlNetPipeline;
use crate::stable_diffusion_xl::{StableDiffusionXLPipeline, XlRequest, SDXL_CLASSES};
use crate::stable_diffusion_xl_controlnet::StableDiffusionXLControlNetPipeline;

/// The pipeline families [`AutoPipeline`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PipelineFamily {
    /// SD 1.x/2.x ([`StableDiffusionPipeline`]).
    StableDiffusion,
    /// SDXL ([`StableDiffusionXLPipeline`]).
    StableDiffusionXL,
    /// SD3 ([`StableDiffusion3Pipeline`]).
    StableDiffusion3,
    /// Flux.1 ([`FluxPipeline`]).
    Flux,
    /// PixArt-Alpha and -Sigma ([`PixArtPipeline`]).
    PixArt,
}

impl PipelineFamily {
    /// Every family, in the order [`supported_classes`](Self::supported_classes) lists them.
    pub const ALL: [Self; 5] = [
        Self::StableDiffusion,
        Self::StableDiffusionXL,
        Self::StableDiffusion3,
        Self::Flux,
        Self::PixArt,
    ];

    /// The `_class_name`s whose folders this family loads: the registry.
    pub fn classes(self) -> &'static [&'static str] {
        match self {
            Self::StableDiffusion => &SUPPORTED_CLASSES,
            Self::StableDiffusionXL => &SDXL_CLASSES,
            Self::StableDiffusion3 => &[SD3_CLASS],
            Self::Flux => &FLUX_CLASSES,
            Self::PixArt => &PIXART_CLASSES,
        }
    }

    /// The family that loads `class`, if any.
    pub fn from_class(class: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.classes().contains(&class))
    }

    /// Every `_class_name` [`AutoPipeline`] loads.
    pub fn supported_classes() -> Vec<&'static str> {
        Self::ALL
            .iter()
            .flat_map(|f| f.classes())
            .copied()
            .collect()
    }
}

/// The request fields only some families take; `Default` leaves each family at diffusers'
/// default. An option a family does not take is an error naming it.
#[derive(Debug, Clone, PartialEq)]
pub struct FamilyOptions {
    /// T5 tokens per prompt (SD3, Flux, PixArt); `None`: the family's default.
    pub max_sequence_length: Option<usize>,
    /// PixArt's aspect-ratio binning.
    pub resolution_binning: bool,
    /// Flux's true classifier-free guidance (1: off).
    pub true_cfg_scale: f64,
    /// The control images and settings of a pipeline with ControlNets
    /// ([`AutoPipeline::with_controlnets`]), one per ControlNet; required by it, refused by
    /// the others.
    pub control: Option<ControlRequest>,
}

impl Default for FamilyOptions {
    fn default() -> Self {
        Self {
            max_sequence_length: None,
            resolution_binning: true,
            true_cfg_scale: 1.0,
            control: None,
        }
    }
}

/// One of the text-to-image pipelines, loaded by its `_class_name`.
pub enum AutoPipeline<B: Backend> {
    StableDiffusion(Box<StableDiffusionPipeline<B>>),
    /// SD 1.x/2.x with ControlNets ([`with_controlnets`](AutoPipeline::with_controlnets)).
    StableDiffusionControlNet(Box<StableDiffusionControlNetPipeline<B>>),
    StableDiffusionXL(Box<StableDiffusionXLPipeline<B>>),
    /// SDXL with ControlNets ([`with_controlnets`](AutoPipeline::with_controlnets)).
    StableDiffusionXLControlNet(Box<StableDiffusionXLControlNetPipeline<B>>),
    StableDiffusion3(Box<StableDiffusion3Pipeline<B>>),
    /// SD3 with SD3 ControlNets ([`with_controlnets`](AutoPipeline::with_controlnets)).
    StableDiffusion3ControlNet(Box<StableDiffusion3ControlNetPipeline<B>>),
    Flux(Box<FluxPipeline<B>>),
    /// Flux with Flux ControlNets ([`with_controlnets`](AutoPipeline::with_controlnets)).
    FluxControlNet(Box<FluxControlNetPipeline<B>>),
    PixArt(Box<PixArtPipeline<B>>),
}

/// `$body` with `$pipe` bound to the concrete pipeline, whichever it is.
macro_rules! each {
    ($self:expr, $pipe:ident => $body:expr) => {
        match $self {
            AutoPipeline::StableDiffusion($pipe) => $body,
            AutoPipeline::StableDiffusionControlNet($pipe) => $body,
            AutoPipeline::StableDiffusionXL($pipe) => $body,
            AutoPipeline::StableDiffusionXLControlNet($pipe) => $body,
            AutoPipeline::StableDiffusion3($pipe) => $body,
            AutoPipeline::StableDiffusion3ControlNet($pipe) => $body,
            AutoPipeline::Flux($pipe) => $body,
            AutoPipeline::FluxControlNet($pipe) => $body,
            AutoPipeline::PixArt($pipe) => $body,
        }
    };
}

impl<B: Backend> AutoPipeline<B> {
    /// What the pipeline hands back between requests (each pipeline's `offload`).
    pub fn set_offload(&mut self, offload: Offload) {
        match self {
            Self::StableDiffusion(pipe) => pipe.offload = offload,
            Self::StableDiffusionControlNet(pipe) => pipe.pipe.offload = offload,
            Self::StableDiffusionXL(pipe) => pipe.offload = offload,
            Self::StableDiffusionXLControlNet(pipe) => pipe.pipe.offload = offload,
            Self::StableDiffusion3(pipe) => pipe.offload = offload,
            Self::StableDiffusion3ControlNet(pipe) => pipe.pipe.offload = offload,
            Self::Flux(pipe) => pipe.offload = offload,
            Self::FluxControlNet(pipe) => pipe.pipe.offload = offload,
            Self::PixArt(pipe) => pipe.offload = offload,
        }
    }

    /// Loads a diffusers-format folder, or a Hub id from the local cache.
    pub fn from_pretrained(spec: &str, options: &LoadOptions, device: &B::Device) -> Result<Self> {
        let dir = crate::hub::resolve_model(spec, options.variant.as_deref())?;
        Self::from_dir(&dir, options, device)
    }

    /// Loads a diffusers-format folder with the pipeline its `model_index.json` names; an
    /// unknown `_class_name` is an error naming it and the supported ones.
    pub fn from_dir(dir: &Path, options: &LoadOptions, device: &B::Device) -> Result<Self> {
        let class = pipeline_class(dir)?;
        let family = family_of(&class, &dir.join("model_index.json"))?;
        Ok(match family {
            PipelineFamily::StableDiffusion => Self::StableDiffusion(Box::new(
                StableDiffusionPipeline::from_dir(dir, options, device)?,
            )),
            PipelineFamily::StableDiffusionXL => Self::StableDiffusionXL(Box::new(
                StableDiffusionXLPipeline::from_dir(dir, options, device)?,
            )),
            PipelineFamily::StableDiffusion3 => Self::StableDiffusion3(Box::new(
                StableDiffusion3Pipeline::from_dir(dir, options, device)?,
            )),
            PipelineFamily::Flux => {
                Self::Flux(Box::new(FluxPipeline::from_dir(dir, options, device)?))
            }
            PipelineFamily::PixArt => {
                Self::PixArt(Box::new(PixArtPipeline::from_dir(dir, options, device)?))
            }
        })
    }

    /// Loads a single-file checkpoint (SD 1.x/2.x or SDXL, as its weights say).
    pub fn from_single_file(
        path: &Path,
        options: &SingleFileOptions,
        device: &B::Device,
    ) -> Result<Self> {
        let class = single_file_pipeline_class(path)?;
        Ok(match family_of(class, path)? {
            PipelineFamily::StableDiffusionXL => Self::StableDiffusionXL(Box::new(
                StableDiffusionXLPipeline::from_single_file(path, options, device)?,
            )),
            _ => Self::StableDiffusion(Box::new(StableDiffusionPipeline::from_single_file(
                path, options, device,
            )?)),
        })
    }

    /// The same pipeline steered by `controlnets` (diffusers' `from_pipe` with
    /// `controlnet=`): UNet ControlNets for SD 1.x/2.x and SDXL, SD3 ControlNets for SD3; each
    /// is checked against the denoiser.
    pub fn with_controlnets(self, controlnets: impl Into<ControlNets<B>>) -> Result<Self> {
        let wrong = |family: PipelineFamily| {
            Err(PipelineError::InvalidInput(format!(
                "ControlNets of this kind do not steer {family:?} pipelines: UNet ControlNets \
                 (ControlNetModel) are for SD 1.x/2.x and SDXL, SD3ControlNetModel for SD3, \
                 FluxControlNetModel for Flux; PixArt ControlNets are not implemented yet"
            )))
        };
        match (self, controlnets.into()) {
            (Self::StableDiffusion(pipe), ControlNets::Unet(nets)) => {
                Ok(Self::StableDiffusionControlNet(Box::new(
                    StableDiffusionControlNetPipeline::new(*pipe, nets)?,
                )))
            }
            (Self::StableDiffusionControlNet(pipe), nets) => {
                Self::StableDiffusion(Box::new(pipe.into_inner())).with_controlnets(nets)
            }
            (Self::StableDiffusionXL(pipe), ControlNets::Unet(nets)) => {
                Ok(Self::StableDiffusionXLControlNet(Box::new(
                    StableDiffusionXLControlNetPipeline::new(*pipe, nets)?,
                )))
            }
            (Self::StableDiffusionXLControlNet(pipe), nets) => {
                Self::StableDiffusionXL(Box::new(pipe.into_inner())).with_controlnets(nets)
            }
            (Self::StableDiffusion3(pipe), ControlNets::Sd3(nets)) => {
                Ok(Self::StableDiffusion3ControlNet(Box::new(
                    StableDiffusion3ControlNetPipeline::new(*pipe, nets)?,
                )))
            }
            (Self::StableDiffusion3ControlNet(pipe), nets) => {
                Self::StableDiffusion3(Box::new(pipe.into_inner())).with_controlnets(nets)
            }
            (Self::Flux(pipe), ControlNets::Flux(nets)) => Ok(Self::FluxControlNet(Box::new(
                FluxControlNetPipeline::new(*pipe, nets)?,
            ))),
            (Self::FluxControlNet(pipe), nets) => {
                Self::Flux(Box::new(pipe.into_inner())).with_controlnets(nets)
            }
            (other, _) => wrong(other.family()),
        }
    }

    /// Which family runs.
    pub fn family(&self) -> PipelineFamily {
        match self {
            Self::StableDiffusion(_) | Self::StableDiffusionControlNet(_) => {
                PipelineFamily::StableDiffusion
            }
            Self::StableDiffusionXL(_) | Self::StableDiffusionXLControlNet(_) => {
                PipelineFamily::StableDiffusionXL
            }
            Self::StableDiffusion3(_) | Self::StableDiffusion3ControlNet(_) => {
                PipelineFamily::StableDiffusion3
            }
            Self::Flux(_) | Self::FluxControlNet(_) => PipelineFamily::Flux,
            Self::PixArt(_) => PipelineFamily::PixArt,
        }
    }

    /// diffusers' `__call__` defaults of the pipeline that runs.
    pub fn defaults(&self) -> PipelineDefaults {
        each!(self, pipe => pipe.defaults())
    }

    /// A request with the pipeline's defaults ([`defaults`](Self::defaults)).
    pub fn default_request(&self) -> GenerateRequest<B> {
        self.defaults().request()
    }

    /// The default image size (width = height) of the loaded model.
    pub fn default_size(&self) -> usize {
        each!(self, pipe => pipe.default_size())
    }

    /// What each component's weights hold and where (each pipeline's `memory`).
    pub fn memory(
        &self,
        place: crate::memory::PlaceName<'_, B::Device>,
    ) -> Vec<crate::memory::ComponentMemory> {
        each!(self, pipe => pipe.memory(place))
    }

    /// The denoiser's device mesh and weight shards, after
    /// [`enable_parallelism`](AutoPipeline::enable_parallelism).
    pub fn spmd_placement(
        &self,
    ) -> Option<&std::sync::Arc<oxidiff_backend_tpu::spmd::SpmdPlacement>> {
        each!(self, pipe => pipe.spmd_placement())
    }

    /// Pixels per latent cell.
    pub fn vae_scale_factor(&self) -> usize {
        each!(self, pipe => pipe.vae_scale_factor)
    }

    /// The scheduler the loop runs.
    pub fn scheduler(&self) -> &dyn Scheduler<B> {
        each!(self, pipe => &*pipe.scheduler)
    }

    /// The scheduler's config: the checkpoint's, or as [`LoadOptions::scheduler`] switched it.
    pub fn scheduler_config(&self) -> &SchedulerConfig {
        each!(self, pipe => &pipe.scheduler_config)
    }

    /// Runs `config`'s scheduler from now on (diffusers' `pipe.scheduler =
    /// XScheduler.from_config(...)`); [`SchedulerConfig::switched_to_named`] makes one from a
    /// sampler name.
    pub fn set_scheduler_config(&mut self, config: SchedulerConfig) -> Result<()> {
        let scheduler = scheduler_from_config(&config)?;
        each!(self, pipe => {
            pipe.scheduler = scheduler;
            pipe.scheduler_config = config;
        });
        Ok(())
    }

    /// The VAE, for its tiling and slicing ([`AutoencoderKL::enable_tiling`]).
    pub fn vae_mut(&mut self) -> &mut AutoencoderKL<B> {
        each!(self, pipe => &mut pipe.vae)
    }

    /// Fuses a LoRA into the denoiser and the text encoders it targets, at `scale`.
    pub fn load_lora(&mut self, path: impl AsRef<Path>, scale: f32) -> Result<LoraReport> {
        each!(self, pipe => pipe.load_lora(path.as_ref(), scale))
    }

    /// Attaches an IP-Adapter at `scale` (Stable Diffusion 1.x/2.x and SDXL:
    /// [`StableDiffusionPipeline::load_ip_adapter`]); requests then need an
    /// `ip_adapter_image`. Before compiling.
    pub fn load_ip_adapter(
        &mut self,
        file: &Path,
        image_encoder: Option<&Path>,
        scale: f64,
    ) -> Result<()> {
        match self {
            Self::StableDiffusion(pipe) => {
                pipe.load_ip_adapter(file, image_encoder)?;
                pipe.set_ip_adapter_scale(scale)
            }
            Self::StableDiffusionXL(pipe) => {
                pipe.load_ip_adapter(file, image_encoder)?;
                pipe.set_ip_adapter_scale(scale)
            }
            Self::StableDiffusionControlNet(pipe) => {
                pipe.pipe.load_ip_adapter(file, image_encoder)?;
                pipe.pipe.set_ip_adapter_scale(scale)
            }
            Self::StableDiffusionXLControlNet(pipe) => {
                pipe.pipe.load_ip_adapter(file, image_encoder)?;
                pipe.pipe.set_ip_adapter_scale(scale)
            }
            _ => Err(PipelineError::InvalidInput(format!(
                "IP-Adapter applies to Stable Diffusion 1.x/2.x and SDXL pipelines, not to {:?} \
                 pipelines",
                self.family()
            ))),
        }
    }

    /// Generates with the given noise source and a callback after every step; `options` are
    /// the fields only some families take.
    pub fn generate_with(
        &mut self,
        req: &GenerateRequest<B>,
        options: &FamilyOptions,
        noise: &mut dyn NoiseSource<B>,
        callback: impl FnMut(StepInfo<'_, B>),
    ) -> Result<PipelineOutput<B>> {
        let family = self.family();
        let refuse = |option: &str, takers: &str| {
            Err(PipelineError::InvalidInput(format!(
                "{option} applies to {takers}, not to {family:?} pipelines; leave it at its default"
            )))
        };
        if options.true_cfg_scale != 1.0 && family != PipelineFamily::Flux {
            return refuse("true_cfg_scale", "Flux");
        }
        if !options.resolution_binning && family != PipelineFamily::PixArt {
            return refuse("resolution_binning = false", "PixArt");
        }
        let t5 = matches!(
            family,
            PipelineFamily::StableDiffusion3 | PipelineFamily::Flux | PipelineFamily::PixArt
        );
        if options.max_sequence_length.is_some() && !t5 {
            return refuse("max_sequence_length", "SD3, Flux and PixArt");
        }
        let controlled = matches!(
            self,
            Self::StableDiffusionControlNet(_)
                | Self::StableDiffusionXLControlNet(_)
                | Self::StableDiffusion3ControlNet(_)
                | Self::FluxControlNet(_)
        );
        if options.control.is_some() != controlled {
            return Err(PipelineError::InvalidInput(if controlled {
                "this pipeline has ControlNets: give their control images \
                 (FamilyOptions::control)"
                    .into()
            } else {
                "control images need ControlNets: load them with AutoPipeline::with_controlnets"
                    .into()
            }));
        }
        let defaults = self.defaults();
        let common = req.clone();
        match self {
            Self::StableDiffusion(pipe) => pipe.generate_with(req, noise, callback),
            Self::StableDiffusionControlNet(pipe) => {
                let control = options.control.clone().unwrap_or_default();
                pipe.generate_with(req, &control, noise, callback)
            }
            Self::StableDiffusionXL(pipe) => {
                pipe.generate_with(&XlRequest::new(common), noise, callback)
            }
            Self::StableDiffusionXLControlNet(pipe) => {
                let control = options.control.clone().unwrap_or_default();
                pipe.generate_with(&XlRequest::new(common), &control, noise, callback)
            }
            Self::StableDiffusion3(pipe) => {
                let request = Sd3Request {
                    common,
                    max_sequence_length: options
                        .max_sequence_length
                        .or(defaults.max_sequence_length)
                        .unwrap_or_default(),
                    ..Default::default()
                };
                pipe.generate_with(&request, noise, callback)
            }
            Self::StableDiffusion3ControlNet(pipe) => {
                let control = options.control.clone().unwrap_or_default();
                let request = Sd3Request {
                    common,
                    max_sequence_length: options
                        .max_sequence_length
                        .or(defaults.max_sequence_length)
                        .unwrap_or_default(),
                    ..Default::default()
                };
                // The control images' VAE samples from a generator of the request's seed, as
                // diffusers after `torch.manual_seed(seed)`.
                let mut control_noise = TorchCpuGenerator::new(request.common.seed);
                pipe.generate_with(&request, &control, noise, &mut control_noise, callback)
            }
            Self::Flux(pipe) => {
                let request = FluxRequest {
                    common,
                    max_sequence_length: options
                        .max_sequence_length
                        .or(defaults.max_sequence_length)
                        .unwrap_or_default(),
                    true_cfg_scale: options.true_cfg_scale,
                    ..Default::default()
                };
                pipe.generate_with(&request, noise, callback)
            }
            Self::FluxControlNet(pipe) => {
                let control = options.control.clone().unwrap_or_default();
                let request = FluxRequest {
                    common,
                    max_sequence_length: options
                        .max_sequence_length
                        .or(defaults.max_sequence_length)
                        .unwrap_or_default(),
                    true_cfg_scale: options.true_cfg_scale,
                    ..Default::default()
                };
                pipe.generate_with(&request, &control, noise, callback)
            }
            Self::PixArt(pipe) => {
                let request = PixArtRequest {
                    common,
                    max_sequence_length: options.max_sequence_length,
                    resolution_binning: options.resolution_binning,
                };
                pipe.generate_with(&request, noise, callback)
            }
        }
    }
}

impl AutoPipeline<Oxi> {
    /// Compiled mode for the pipeline's denoiser (each pipeline's `compile`).
    pub fn compile(&mut self) -> Result<()> {
        each!(self, pipe => pipe.compile())
    }

    /// The compiled denoiser spread over several devices (each pipeline's
    /// `enable_parallelism`).
    pub fn enable_parallelism(&mut self, config: impl Into<ParallelConfig>) -> Result<()> {
        let config = config.into();
        each!(self, pipe => pipe.enable_parallelism(config))
    }

    /// Compiled mode's counts (`None` when eager).
    pub fn compile_stats(&self) -> Option<CompileStats> {
        each!(self, pipe => pipe.compile_stats())
    }

    /// Compiled mode's counts per component (each pipeline's `component_stats`).
    pub fn component_stats(&self) -> Vec<ComponentStats> {
        each!(self, pipe => pipe.component_stats())
    }
}

/// The family that loads `class` (read from `source`), or an error naming both and the
/// supported classes.
fn family_of(class: &str, source: &Path) -> Result<PipelineFamily> {
    PipelineFamily::from_class(class).ok_or_else(|| PipelineError::UnsupportedPipeline {
        path: source.to_path_buf(),
        class: class.to_string(),
        supported: PipelineFamily::supported_classes().join(", "),
    })
}
