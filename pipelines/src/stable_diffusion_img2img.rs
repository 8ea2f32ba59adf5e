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

use crate::error::{PipelineError, Result};
use crate::image::preprocess;
use crate::stable_diffusion::{
    GenerateRequest, LoadOptions, PipelineOutput, StableDiffusionPipeline, StepInfo,
};

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
        StableDiffusionPipeline::from_dir(dir, options, device).map(Self::from)
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
        mut callback: impl FnMut(StepInfo<'_, B>),
    ) -> Result<PipelineOutput<B>> {
        if !(strength > 0.0 && strength <= 1.0) {
            return Err(PipelineError::InvalidInput(format!(
                "strength must be in (0, 1], got {strength}"
            )));
        }
        if req.latents.is_some() {
            return Err(PipelineError::InvalidInput(
                "img2img starts from the image's latents; initial latents cannot be given".into(),
            ));
        }
        let pipe = &mut self.pipe;
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
        crate::loading::check_request(&sized, (default, default), f)?;
        let steps = req.num_inference_steps;
        let init_steps = ((steps as f64 * strength) as usize).min(steps);
        if init_steps == 0 {
            return Err(PipelineError::InvalidInput(format!(
                "strength {strength} with {steps} steps runs no step; raise the strength or \
                 the number of steps"
            )));
        }
        let batch = req.prompts.len() * req.num_images_per_prompt;
        let context = pipe.encode_context(req)?.to_device(&pipe.device);

        pipe.scheduler.set_timesteps(steps)?;
        pipe.scheduler.set_eta(req.eta);
        let order = pipe.scheduler.order();
        let t_start = (steps - init_steps) * order;
        let timesteps = pipe.scheduler.timesteps()[t_start..].to_vec();
        pipe.scheduler.set_begin_index(t_start);

        // VAE encode: a sample of the latent distribution, as diffusers' `retrieve_latents`.
        let dist = pipe.vae.encode(image);
        let sample_noise = noise.randn(dist.mean.dims(), &dist.mean.device())?;
        let init = dist
            .sample(sample_noise)
            .mul_scalar(pipe.vae.scaling_factor)
            .to_device(&pipe.device);
        let init = if batch > 1 {
            init.repeat_dim(0, batch)
        } else {
            init
        };
        let first_noise = noise.randn(init.dims(), &pipe.device)?;
        let latents = pipe
            .scheduler
            .add_noise(init, first_noise, &timesteps[..1])?;

        pipe.denoise_and_decode(&timesteps, latents, &context, req, noise, &mut callback)
    }
}

impl<B: Backend> ToDevice<B> for StableDiffusionImg2ImgPipeline<B> {
    fn to(self, device: &B::Device) -> Self {
        Self {
            pipe: self.pipe.to(device),
        }
    }
}
