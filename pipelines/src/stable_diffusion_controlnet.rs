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
use burn::tensor::FloatDType;
use oxidiff_backend_tpu::Oxi;
use oxidiff_models::{ControlNetModel, ToDevice};
use oxidiff_parallel::ParallelConfig;
use oxidiff_schedulers::{NoiseSource, TorchCpuGenerator};

use crate::compiled::{CompileStats, ComponentStats};
use crate::control::{
    check_controlnets, control_component_stats, not_parallel, ControlPrograms, ControlRequest,
    ControlStep, Controls,
};
use crate::denoise::{check_request, GenerateRequest, PipelineDefaults, PipelineOutput, StepInfo};
use crate::error::{PipelineError, Result};
use crate::loading::LoadOptions;
use crate::memory::{component_memory, ComponentMemory, PlaceName};
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
        self.programs = Some(ControlPrograms::new(&self.pipe.unet, &self.controlnets));
        Ok(())
    }

    /// Tensor and data parallelism are not implemented for ControlNet pipelines yet: an error
    /// saying so (`compile` works).
    pub fn enable_parallelism(&mut self, _config: impl Into<ParallelConfig>) -> Result<()> {
        Err(not_parallel())
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
        control_component_stats(self.pipe.component_stats(), self.programs.as_ref())
    }
}

impl<B: Backend> StableDiffusionControlNetPipeline<B> {
    /// The denoiser's device mesh and weight shards, after `enable_parallelism`.
    pub fn spmd_placement(
        &self,
    ) -> Option<&std::sync::Arc<oxidiff_backend_tpu::spmd::SpmdPlacement>> {
        None
    }

    /// What each component's weights hold and where (`place` names a device): `txt2img
    /// --json`'s `memory`.
    pub fn memory(&self, place: PlaceName<'_, B::Device>) -> Vec<ComponentMemory> {
        let mut all = self.pipe.memory(place);
        for (i, net) in self.controlnets.iter().enumerate() {
            let name = match self.controlnets.len() {
                1 => "controlnet".to_string(),
                _ => format!("controlnet_{i}"),
            };
            all.push(component_memory(&name, net, None, place));
        }
        all
    }

    /// The pipeline `pipe` with `controlnets` (at least one), each checked against its UNet:
    /// a ControlNet made for another base model is an error naming what differs.
    pub fn new(
        pipe: StableDiffusionPipeline<B>,
        controlnets: Vec<ControlNetModel<B>>,
    ) -> Result<Self> {
        if controlnets.is_empty() {
            return Err(PipelineError::InvalidInput(
                "a ControlNet pipeline needs at least one ControlNet".into(),
            ));
        }
        check_controlnets(&controlnets, &pipe.unet, pipe.vae_scale_factor)?;
        let device = pipe.unet_device();
        let controlnets = controlnets.into_iter().map(|n| n.to(&device)).collect();
        Ok(Self {
            pipe,
            controlnets,
            programs: None,
        })
    }

    /// Loads a Stable Diffusion folder and ControlNet folders (each with `config.json` and
    /// `diffusion_pytorch_model.safetensors`).
    pub fn from_dir(
        dir: &Path,
        controlnets: &[&Path],
        options: &LoadOptions,
        device: &B::Device,
    ) -> Result<Self> {
        let pipe = StableDiffusionPipeline::from_dir(dir, options, device)?;
        let nets = controlnets
            .iter()
            .map(|path| {
                ControlNetModel::from_dir_in(
                    path,
                    options.variant.as_deref(),
                    options.dtype.unwrap_or(FloatDType::F32),
                    device,
                )
                .map_err(PipelineError::from)
            })
            .collect::<Result<Vec<_>>>()?;
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
