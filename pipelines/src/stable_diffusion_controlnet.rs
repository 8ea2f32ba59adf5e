//! `StableDiffusionControlNetPipeline`: SD 1.x/2.x text to image steered by one or more
//! ControlNets, as diffusers' `pipeline_controlnet.py` (several ControlNets are its
//! `MultiControlNetModel`: their residuals are summed).
//!
//! The components, prompt encoding, initial latents and decode are
//! [`StableDiffusionPipeline`]'s; each step runs every ControlNet inside its guidance window and
//! hands their residuals to the UNet. Compiled, the ControlNets, the UNet and guidance are one
//! program per input shape ([`ControlPrograms`](crate::control::ControlPrograms)).

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
use crate::error::Result;
use crate::loading::LoadOptions;
use crate::memory::{ComponentMemory, PlaceName};
use crate::stable_diffusion::StableDiffusionPipeline;

/// SD 1.x/2.x with ControlNets (diffusers' `StableDiffusionControlNetPipeline`). It is a
/// Stable Diffusion pipeline plus ControlNets, and derefs to that pipeline for its components
/// (tokenizer, encoders, VAE, scheduler, LoRA).
pub struct StableDiffusionControlNetPipeline<B: Backend> {
    pub pipe: StableDiffusionPipeline<B>,
    pub controlnets: Vec<ControlNetModel<B>>,
    /// The compiled controlled step, after [`compile`](Self::compile).
    pub programs: Option<ControlPrograms<B>>,
}

impl<B: Backend> std::ops::Deref for StableDiffusionControlNetPipeline<B> {
    type Target = StableDiffusionPipeline<B>;

    fn deref(&self) -> &Self::Target {
        &self.pipe
    }
}

impl<B: Backend> std::ops::DerefMut for StableDiffusionControlNetPipeline<B> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.pipe
    }
}

impl StableDiffusionControlNetPipeline<Oxi> {
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
        self.pipe.compile_on(Some(placement.clone()));
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

impl<B: Backend> StableDiffusionControlNetPipeline<B> {
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

    /// The pipeline `pipe` with `controlnets` (at least one), each checked against its UNet:
    /// a ControlNet made for another base model is an error naming what differs.
    pub fn new(
        pipe: StableDiffusionPipeline<B>,
        controlnets: Vec<ControlNetModel<B>>,
    ) -> Result<Self> {
        let device = pipe.unet_device();
        let controlnets = attach(controlnets, &device, |net| {
            unet_controlnet_fits(net, &pipe.unet, pipe.vae_scale_factor)
        })?;
        Ok(Self {
            pipe,
            controlnets,
            programs: None,
        })
    }

    /// Loads a Stable Diffusion folder and ControlNets: folders (each with `config.json` and
    /// `diffusion_pytorch_model.safetensors`) or single files ([`ControlNetModel::from_path`]).
    pub fn from_dir(
        dir: &Path,
        controlnets: &[&Path],
        options: &LoadOptions,
        device: &B::Device,
    ) -> Result<Self> {
        let pipe = StableDiffusionPipeline::from_dir(dir, options, device)?;
        let nets = load_each(controlnets, options, |dir, variant, dtype| {
            ControlNetModel::from_path(dir, variant, dtype, device)
        })?;
        Self::new(pipe, nets)
    }

    /// The Stable Diffusion pipeline without its ControlNets.
    pub fn into_inner(self) -> StableDiffusionPipeline<B> {
        self.pipe
    }

    /// diffusers' `__call__` defaults (50 steps, guidance 7.5).
    pub fn defaults(&self) -> PipelineDefaults {
        PipelineDefaults::STABLE_DIFFUSION
    }

    /// Generates with the default generator seeded by `req.seed`.
    pub fn generate(
        &mut self,
        req: &GenerateRequest<B>,
        control: &ControlRequest,
    ) -> Result<PipelineOutput<B>> {
        let mut generator = TorchCpuGenerator::new(req.seed);
        self.generate_with(req, control, &mut generator, |_| {})
    }

    /// Text to image under `control` (one [`Control`](crate::control::Control) per
    /// ControlNet). The size is the request's, else the first control image's (rounded down
    /// to a multiple of 8); the control images are resized to it. Noise is drawn from `noise`
    /// as [`StableDiffusionPipeline::generate_with`] draws it.
    pub fn generate_with(
        &mut self,
        req: &GenerateRequest<B>,
        control: &ControlRequest,
        noise: &mut dyn NoiseSource<B>,
        mut callback: impl FnMut(StepInfo<'_, B>),
    ) -> Result<PipelineOutput<B>> {
        control.check(self.controlnets.len())?;
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
        let batch = req.prompts.len() * req.num_images_per_prompt;
        let context = pipe.encode_context(req)?.to_device(&pipe.device);
        pipe.scheduler.set_timesteps(req.num_inference_steps)?;
        pipe.scheduler.set_eta(req.eta);
        let latents = crate::denoise::initial_latents(
            req,
            [batch, 4, height / f, width / f],
            (width, height),
            noise,
            pipe.scheduler.init_noise_sigma(),
            &pipe.device,
        )?;
        let timesteps = pipe.scheduler.timesteps().to_vec();
        let controls = Controls {
            nets: &self.controlnets,
            request: control,
            programs: self.programs.as_ref(),
        };
        let step = ControlStep::new(
            controls,
            (width, height),
            batch,
            &context,
            timesteps.len(),
            &pipe.device,
        )?;
        pipe.denoise_and_decode(
            &timesteps,
            latents,
            &context,
            None,
            Some(&step),
            req,
            noise,
            &mut callback,
        )
    }
}
