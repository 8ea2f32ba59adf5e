//! `StableDiffusionXLControlNetPipeline`: SDXL text to image steered by one or more
//! ControlNets, as diffusers' `pipeline_controlnet_sd_xl.py` (several ControlNets are its
//! `MultiControlNetModel`: their residuals are summed).
//!
//! The components, prompt encoding, time ids, initial latents and decode are
//! [`StableDiffusionXLPipeline`]'s; each step runs every ControlNet inside its guidance window,
//! with SDXL's added condition, and hands their residuals to the UNet; compiled, as the SD
//! 1.x/2.x ControlNet pipeline.

use std::path::Path;

use burn::tensor::backend::Backend;
use oxidiff_backend_tpu::Oxi;
use oxidiff_models::ControlNetModel;
use oxidiff_parallel::ParallelConfig;
use oxidiff_schedulers::{NoiseSource, TorchCpuGenerator};

use crate::compiled::{CompileStats, ComponentStats};
use crate::control::{
    attach, control_parallelism, load_each, merged_component_stats, unet_controlnet_fits,
    with_controlnet_memory, ControlPrograms, ControlRequest, ControlStep, Controls,
};
use crate::denoise::{check_request, GenerateRequest, PipelineDefaults, PipelineOutput, StepInfo};
use crate::error::{PipelineError, Result};
use crate::loading::LoadOptions;
use crate::memory::{ComponentMemory, PlaceName};
use crate::stable_diffusion_xl::{StableDiffusionXLPipeline, XlRequest};

/// SDXL with ControlNets (diffusers' `StableDiffusionXLControlNetPipeline`). It derefs to the
/// SDXL pipeline for its components (tokenizers, encoders, VAE, scheduler, LoRA).
pub struct StableDiffusionXLControlNetPipeline<B: Backend> {
    pub pipe: StableDiffusionXLPipeline<B>,
    pub controlnets: Vec<ControlNetModel<B>>,
    /// The compiled controlled step, after [`compile`](Self::compile).
    pub programs: Option<ControlPrograms<B>>,
}

impl<B: Backend> std::ops::Deref for StableDiffusionXLControlNetPipeline<B> {
    type Target = StableDiffusionXLPipeline<B>;

    fn deref(&self) -> &Self::Target {
        &self.pipe
    }
}

impl<B: Backend> std::ops::DerefMut for StableDiffusionXLControlNetPipeline<B> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.pipe
    }
}

impl StableDiffusionXLControlNetPipeline<Oxi> {
    /// Compiled mode: the base pipeline's programs (text encoders, VAE) and, per input shape,
    /// one program for the ControlNets, the UNet and guidance together ([`ControlPrograms`]),
    /// with the control images, scales and guidance windows as runtime inputs. Needs the UNet
    /// on a PJRT device.
    pub fn compile(&mut self) -> Result<()> {
        self.pipe.compile()?;
        self.programs = Some(ControlPrograms::new(
            &self.pipe.unet,
            &self.controlnets,
            None,
        ));
        Ok(())
    }

    /// Tensor parallelism, as the base pipeline's `enable_parallelism`: the UNet and every
    /// ControlNet split by their plans over `tp_degree` devices, the controlled step one
    /// program partitioned by XLA. Data parallelism is refused (`--dp`), as is anything the
    /// base pipeline refuses, before anything moves.
    pub fn enable_parallelism(&mut self, config: impl Into<ParallelConfig>) -> Result<()> {
        crate::ip_adapter::refuse_parallel(self.pipe.ip_adapter.as_ref())?;
        let placement =
            control_parallelism(&mut self.pipe.unet, &mut self.controlnets, config.into())?;
        self.pipe.compile_on(Some(placement.clone()))?;
        self.programs = Some(ControlPrograms::new(
            &self.pipe.unet,
            &self.controlnets,
            Some(placement),
        ));
        Ok(())
    }

    /// Compiled mode's counts (`None` when eager): the controlled step's programs and the
    /// base pipeline's.
    pub fn compile_stats(&self) -> Option<CompileStats> {
        let programs = self.programs.as_ref()?.compile_stats();
        Some(programs + self.pipe.compile_stats().unwrap_or_default())
    }

    /// Compiled mode's counts per component, the ControlNets counted with the UNet (one
    /// program holds them).
    pub fn component_stats(&self) -> Vec<ComponentStats> {
        let programs = self.programs.as_ref().map(|p| p.compile_stats());
        merged_component_stats(self.pipe.component_stats(), "unet", programs)
    }
}

impl<B: Backend> StableDiffusionXLControlNetPipeline<B> {
    /// The denoiser's device mesh and weight shards, after `enable_parallelism`.
    pub fn spmd_placement(
        &self,
    ) -> Option<&std::sync::Arc<oxidiff_backend_tpu::spmd::SpmdPlacement>> {
        self.programs.as_ref()?.spmd_placement()
    }

    /// What each component's weights hold and where (`place` names a device): `txt2img
    /// --json`'s `memory`.
    pub fn memory(&self, place: PlaceName<'_, B::Device>) -> Vec<ComponentMemory> {
        with_controlnet_memory(self.pipe.memory(place), &self.controlnets, place)
    }

    /// The pipeline `pipe` with `controlnets` (at least one), each checked against its UNet
    /// (an SD 1.x ControlNet, or one without SDXL's added conditioning, is an error naming
    /// what differs). A refiner folder is refused: diffusers' pipeline takes a base model.
    pub fn new(
        pipe: StableDiffusionXLPipeline<B>,
        controlnets: Vec<ControlNetModel<B>>,
    ) -> Result<Self> {
        if pipe.requires_aesthetics_score {
            return Err(PipelineError::InvalidInput(format!(
                "{} is an SDXL refiner (requires_aesthetics_score): ControlNets steer a base \
                 SDXL model; load the base model's folder",
                pipe.source.display()
            )));
        }
        let device = pipe.device.clone();
        let controlnets = attach(controlnets, &device, |net| {
            unet_controlnet_fits(net, &pipe.unet, pipe.vae_scale_factor)
        })?;
        Ok(Self {
            pipe,
            controlnets,
            programs: None,
        })
    }

    /// Loads an SDXL folder and ControlNets: folders (each with `config.json` and
    /// `diffusion_pytorch_model.safetensors`) or single files ([`ControlNetModel::from_path`]).
    pub fn from_dir(
        dir: &Path,
        controlnets: &[&Path],
        options: &LoadOptions,
        device: &B::Device,
    ) -> Result<Self> {
        let pipe = StableDiffusionXLPipeline::from_dir(dir, options, device)?;
        let nets = load_each(controlnets, options, |dir, variant, dtype| {
            ControlNetModel::from_path(dir, variant, dtype, device)
        })?;
        Self::new(pipe, nets)
    }

    /// The SDXL pipeline without its ControlNets.
    pub fn into_inner(self) -> StableDiffusionXLPipeline<B> {
        self.pipe
    }

    /// diffusers' `__call__` defaults (50 steps, guidance 5.0).
    pub fn defaults(&self) -> PipelineDefaults {
        PipelineDefaults::STABLE_DIFFUSION_XL
    }

    /// Generates with the default generator seeded by `request.common.seed`.
    pub fn generate(
        &mut self,
        request: &XlRequest<B>,
        control: &ControlRequest,
    ) -> Result<PipelineOutput<B>> {
        let mut generator = TorchCpuGenerator::new(request.common.seed);
        self.generate_with(request, control, &mut generator, |_| {})
    }

    /// Text to image under `control` (one [`Control`](crate::control::Control) per
    /// ControlNet). The size is the request's, else the first control image's (rounded down
    /// to a multiple of 8), and the time ids' default sizes are that size, as diffusers takes
    /// them from the prepared image. Noise is drawn from `noise` as
    /// [`StableDiffusionXLPipeline::generate_with`] draws it.
    pub fn generate_with(
        &mut self,
        request: &XlRequest<B>,
        control: &ControlRequest,
        noise: &mut dyn NoiseSource<B>,
        mut callback: impl FnMut(StepInfo<'_, B>),
    ) -> Result<PipelineOutput<B>> {
        control.check(self.controlnets.len())?;
        let (req, xl) = (&request.common, &request.xl);
        let pipe = &mut self.pipe;
        let f = pipe.vae_scale_factor;
        let (width, height) = control.size(req.width, req.height, f);
        let sized = GenerateRequest {
            width: Some(width),
            height: Some(height),
            latents: None,
            cancel: None,
            ..req.clone()
        };
        check_request(&sized, (width, height), f)?;
        pipe.check_options(req, xl)?;
        let (positive_ids, negative_ids) = pipe.time_ids_for(xl, (height, width));
        let condition = pipe.conditioning(req, xl, &positive_ids, &negative_ids)?;
        pipe.scheduler.set_timesteps(req.num_inference_steps)?;
        pipe.scheduler.set_eta(req.eta);
        let batch = req.prompts.len() * req.num_images_per_prompt;
        let latents = crate::denoise::initial_latents(
            req,
            [batch, 4, height / f, width / f],
            (width, height),
            noise,
            pipe.scheduler.init_noise_sigma(),
            &pipe.device,
        )?;
        // The guidance windows are fractions of the whole schedule, before `denoising_end`.
        let scheduled = pipe.scheduler.timesteps().to_vec();
        let steps = scheduled.len();
        let timesteps = pipe.cut_at_denoising_end(scheduled, xl);
        let controls = Controls {
            nets: &self.controlnets,
            request: control,
            programs: self.programs.as_ref(),
        };
        let step = ControlStep::new(
            controls,
            (width, height),
            batch,
            &condition.context,
            steps,
            &pipe.device,
        )?
        .with_added(&condition.added);
        pipe.denoise_and_decode(
            &timesteps,
            latents,
            &condition,
            None,
            Some(&step),
            req,
            noise,
            &mut callback,
        )
    }
}
