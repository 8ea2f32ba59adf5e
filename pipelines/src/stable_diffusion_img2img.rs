//! `StableDiffusionImg2ImgPipeline`: SD 1.x/2.x image to image, as diffusers'
//! `pipeline_stable_diffusion_img2img.py`.
//!
//! The same components and loop as [`StableDiffusionPipeline`]; the loop starts part-way:
//! the input image is VAE-encoded (a sample of the latent distribution, times the scaling
//! factor), noised to the first kept timestep with the scheduler's `add_noise`, and denoised
//! over the last `int(steps * strength)` steps.

use std::path::Path;

use burn::tensor::backend::Backend;
use oxidiff_models::ToDevice;
use oxidiff_schedulers::{NoiseSource, TorchCpuGenerator};

use crate::control::{ControlStep, Controls};
use crate::denoise::{check_request, GenerateRequest, PipelineDefaults, PipelineOutput, StepInfo};
use crate::error::{PipelineError, Result};
use crate::image::preprocess;
use crate::img2img::{
    check_strength, check_strength_steps, encode_image_latents, strength_timesteps,
};
use crate::loading::LoadOptions;
use crate::stable_diffusion::StableDiffusionPipeline;

/// SD 1.x/2.x image-to-image over a [`StableDiffusionPipeline`]'s components (diffusers'
/// `StableDiffusionImg2ImgPipeline.from_pipe`).
pub struct StableDiffusionImg2ImgPipeline<B: Backend> {
    pub pipe: StableDiffusionPipeline<B>,
}

impl<B: Backend> From<StableDiffusionPipeline<B>> for StableDiffusionImg2ImgPipeline<B> {
    fn from(pipe: StableDiffusionPipeline<B>) -> Self {
        Self { pipe }
    }
}

impl<B: Backend> StableDiffusionImg2ImgPipeline<B> {
    /// Loads a Stable Diffusion folder (or Hub id) for image to image.
    pub fn from_pretrained(spec: &str, options: &LoadOptions, device: &B::Device) -> Result<Self> {
        StableDiffusionPipeline::from_pretrained(spec, options, device).map(Self::from)
    }

    /// Loads a Stable Diffusion pipeline folder for image to image.
    pub fn from_dir(dir: &Path, options: &LoadOptions, device: &B::Device) -> Result<Self> {
        options.refuse_transformer_file("Stable Diffusion img2img")?;
        StableDiffusionPipeline::from_dir(dir, options, device).map(Self::from)
    }

    /// diffusers' `__call__` defaults (50 steps, guidance 7.5, strength 0.8); `.request()` gives a
    /// request with them, `.strength` the strength to pass.
    pub fn defaults(&self) -> PipelineDefaults {
        PipelineDefaults::STABLE_DIFFUSION_IMG2IMG
    }

    /// A request with diffusers' steps and guidance (the strength is `defaults().strength`).
    pub fn default_request(&self) -> GenerateRequest<B> {
        self.defaults().request()
    }

    /// Generates from `image` with the default generator seeded by `req.seed`.
    pub fn generate(
        &mut self,
        req: &GenerateRequest<B>,
        image: &image::DynamicImage,
        strength: f64,
    ) -> Result<PipelineOutput<B>> {
        let mut generator = TorchCpuGenerator::new(req.seed);
        self.generate_with(req, image, strength, &mut generator, |_| {})
    }

    /// Image to image: `strength` in (0, 1] is how much of the schedule is run (1: all of it,
    /// from pure noise plus the image's latents). The image is resized to `req.width` x
    /// `req.height` when given, else to its own size rounded down to a multiple of 8. Noise is
    /// drawn from `noise`: first the VAE sample, then the initial noise, then the scheduler's.
    pub fn generate_with(
        &mut self,
        req: &GenerateRequest<B>,
        image: &image::DynamicImage,
        strength: f64,
        noise: &mut dyn NoiseSource<B>,
        callback: impl FnMut(StepInfo<'_, B>),
    ) -> Result<PipelineOutput<B>> {
        Self::generate_controlled_on(&mut self.pipe, req, image, strength, None, noise, callback)
    }

    /// [`generate_with`](Self::generate_with) with ControlNets (their control images resized
    /// to the image's size), for the ControlNet image-to-image pipeline.
    pub(crate) fn generate_controlled_on(
        pipe: &mut StableDiffusionPipeline<B>,
        req: &GenerateRequest<B>,
        image: &image::DynamicImage,
        strength: f64,
        controls: Option<Controls<'_, B>>,
        noise: &mut dyn NoiseSource<B>,
        mut callback: impl FnMut(StepInfo<'_, B>),
    ) -> Result<PipelineOutput<B>> {
        check_strength(strength)?;
        if req.latents.is_some() {
            return Err(PipelineError::InvalidInput(
                "img2img starts from the image's latents; initial latents cannot be given".into(),
            ));
        }
        let f = pipe.vae_scale_factor;
        let image = preprocess::<B>(image, req.width, req.height, f, &pipe.vae_device())?;
        let [_, _, h, w] = image.dims();
        let sized = GenerateRequest {
            width: Some(w),
            height: Some(h),
            latents: None,
            cancel: None,
            ..req.clone()
        };
        let default = pipe.default_size();
        check_request(&sized, (default, default), f)?;
        let steps = req.num_inference_steps;
        check_strength_steps(strength, steps)?;
        let batch = req.prompts.len() * req.num_images_per_prompt;
        let context = pipe.encode_context(req)?.to_device(&pipe.device);

        pipe.scheduler.set_timesteps(steps)?;
        pipe.scheduler.set_eta(req.eta);
        let timesteps = strength_timesteps(&mut *pipe.scheduler, steps, strength)?;

        let init = encode_image_latents(&pipe.vae, image, batch, noise, &pipe.device)?;
        let first_noise = noise.randn(init.dims(), &pipe.device)?;
        let latents = pipe
            .scheduler
            .add_noise(init, first_noise, &timesteps[..1])?;

        let control = controls
            .map(|c| ControlStep::new(c, (w, h), batch, &context, timesteps.len(), &pipe.device))
            .transpose()?;
        pipe.denoise_and_decode(
            &timesteps,
            latents,
            &context,
            None,
            control.as_ref(),
            req,
            noise,
            &mut callback,
        )
    }
}

impl<B: Backend> ToDevice<B> for StableDiffusionImg2ImgPipeline<B> {
    fn to(self, device: &B::Device) -> Self {
        Self {
            pipe: self.pipe.to(device),
        }
    }
}
