//! `StableDiffusionInpaintPipeline`: SD 1.x/2.x inpainting, as diffusers'
//! `pipeline_stable_diffusion_inpaint.py`.
//!
//! Two kinds of UNet, told apart by `in_channels`:
//! - 9 channels (inpainting checkpoints such as `stable-diffusion-inpainting`): the scaled
//!   latents, the mask at latent size and the VAE latents of the masked image are
//!   concatenated on the channel axis at every step;
//! - 4 channels (any ordinary checkpoint): the masked-latent method; after every scheduler step
//!   the region to keep is replaced by the original image's latents noised to the next
//!   timestep (`add_noise`), so only the masked region is generated.
//!
//! The mask is an image (white repaints, black keeps), converted to grayscale and binarized
//! as diffusers' mask `VaeImageProcessor` does ([`preprocess_mask`]); what inpainting adds to
//! the loop is shared with SDXL's (`crate::inpaint`).

use std::path::Path;

use burn::tensor::backend::Backend;
use oxidiff_models::ToDevice;
use oxidiff_schedulers::{NoiseSource, TorchCpuGenerator};

use crate::control::{ControlStep, Controls};
use crate::denoise::{check_request, GenerateRequest, PipelineDefaults, PipelineOutput, StepInfo};
use crate::error::Result;
use crate::image::{preprocess, preprocess_mask};
use crate::img2img::{check_strength, check_strength_steps, strength_timesteps};
use crate::inpaint::{
    check_mask_size, crop_for_request, inpaint_channels, prepare_inpaint, InpaintOptions,
    InpaintStart,
};
use crate::loading::LoadOptions;
use crate::stable_diffusion::StableDiffusionPipeline;

/// SD 1.x/2.x inpainting over a [`StableDiffusionPipeline`]'s components (diffusers'
/// `StableDiffusionInpaintPipeline.from_pipe`).
pub struct StableDiffusionInpaintPipeline<B: Backend> {
    pub pipe: StableDiffusionPipeline<B>,
}

impl<B: Backend> From<StableDiffusionPipeline<B>> for StableDiffusionInpaintPipeline<B> {
    fn from(pipe: StableDiffusionPipeline<B>) -> Self {
        Self { pipe }
    }
}

impl<B: Backend> StableDiffusionInpaintPipeline<B> {
    /// Loads a Stable Diffusion folder (or Hub id), an inpainting one or an ordinary one.
    pub fn from_pretrained(spec: &str, options: &LoadOptions, device: &B::Device) -> Result<Self> {
        StableDiffusionPipeline::from_pretrained(spec, options, device).map(Self::from)
    }

    /// Loads a Stable Diffusion pipeline folder for inpainting.
    pub fn from_dir(dir: &Path, options: &LoadOptions, device: &B::Device) -> Result<Self> {
        options.refuse_transformer_file("Stable Diffusion inpainting")?;
        StableDiffusionPipeline::from_dir(dir, options, device).map(Self::from)
    }

    /// The UNet's input channels: 9 for an inpainting UNet, 4 for the masked-latent method.
    pub fn unet_in_channels(&self) -> usize {
        self.pipe.unet.conv_in.weight.dims()[1]
    }

    /// diffusers' `__call__` defaults (50 steps, guidance 7.5, strength 1.0); `.request()` gives a
    /// request with them, `.strength` the strength to pass.
    pub fn defaults(&self) -> PipelineDefaults {
        PipelineDefaults::STABLE_DIFFUSION_INPAINT
    }

    /// A request with diffusers' steps and guidance (the strength is `defaults().strength`).
    pub fn default_request(&self) -> GenerateRequest<B> {
        self.defaults().request()
    }

    /// Inpaints with the default generator seeded by `req.seed`.
    pub fn generate(
        &mut self,
        req: &GenerateRequest<B>,
        image: &image::DynamicImage,
        mask: &image::DynamicImage,
        strength: f64,
    ) -> Result<PipelineOutput<B>> {
        let mut generator = TorchCpuGenerator::new(req.seed);
        self.generate_with(req, image, mask, strength, &mut generator, |_| {})
    }

    /// Repaints the white part of `mask` (same size as `image`) from the prompt. `strength` in
    /// (0, 1] is the part of the schedule that is run (diffusers' default 1: from pure noise).
    /// Image and mask are resized to `req.width` x `req.height` when given, else kept at the
    /// image's size rounded down to a multiple of 8 (diffusers defaults to the UNet's sample
    /// size; pass the size to match it for other images). Noise is drawn from `noise` in
    /// diffusers' order (see `prepare_inpaint`), then the scheduler's.
    pub fn generate_with(
        &mut self,
        req: &GenerateRequest<B>,
        image: &image::DynamicImage,
        mask: &image::DynamicImage,
        strength: f64,
        noise: &mut dyn NoiseSource<B>,
        callback: impl FnMut(StepInfo<'_, B>),
    ) -> Result<PipelineOutput<B>> {
        let options = InpaintOptions {
            strength,
            ..Default::default()
        };
        self.generate_with_options(req, image, mask, &options, noise, callback)
    }

    /// [`generate_with`](Self::generate_with) with every option, `padding_mask_crop` too.
    pub fn generate_with_options(
        &mut self,
        req: &GenerateRequest<B>,
        image: &image::DynamicImage,
        mask: &image::DynamicImage,
        options: &InpaintOptions,
        noise: &mut dyn NoiseSource<B>,
        callback: impl FnMut(StepInfo<'_, B>),
    ) -> Result<PipelineOutput<B>> {
        Self::generate_controlled_on(
            &mut self.pipe,
            req,
            image,
            mask,
            options,
            None,
            noise,
            callback,
        )
    }

    /// [`generate_with_options`](Self::generate_with_options) with ControlNets (their
    /// control images resized to the inpainted region's size), for the ControlNet inpaint
    /// pipeline.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn generate_controlled_on(
        pipe: &mut StableDiffusionPipeline<B>,
        req: &GenerateRequest<B>,
        image: &image::DynamicImage,
        mask: &image::DynamicImage,
        options: &InpaintOptions,
        controls: Option<Controls<'_, B>>,
        noise: &mut dyn NoiseSource<B>,
        mut callback: impl FnMut(StepInfo<'_, B>),
    ) -> Result<PipelineOutput<B>> {
        let strength = options.strength;
        check_strength(strength)?;
        check_strength_steps(strength, req.num_inference_steps)?;
        check_mask_size(image, mask)?;
        let channels = inpaint_channels(pipe.unet.conv_in.weight.dims()[1])?;
        let f = pipe.vae_scale_factor;
        let vae_device = pipe.vae_device();
        let (original, original_mask) = (image, mask);
        let cropped = crop_for_request(
            image,
            mask,
            (req.width, req.height),
            f,
            options.padding_mask_crop,
            req.output,
        )?;
        let (image, mask) = match &cropped {
            Some(c) => (&c.image, &c.mask),
            None => (image, mask),
        };
        let image = preprocess::<B>(image, req.width, req.height, f, &vae_device)?;
        let [_, _, h, w] = image.dims();
        let mask = preprocess_mask::<B>(mask, w, h, &vae_device)?;
        let sized = GenerateRequest {
            width: Some(w),
            height: Some(h),
            latents: None,
            cancel: None,
            ..req.clone()
        };
        let default = pipe.default_size();
        check_request(&sized, (default, default), f)?;
        let batch = req.prompts.len() * req.num_images_per_prompt;
        let context = pipe.encode_context(req)?.to_device(&pipe.device);

        pipe.scheduler.set_timesteps(req.num_inference_steps)?;
        pipe.scheduler.set_eta(req.eta);
        let timesteps =
            strength_timesteps(&mut *pipe.scheduler, req.num_inference_steps, strength)?;
        let start = InpaintStart {
            strength,
            first_timestep: timesteps[0],
            add_noise: true,
            latents: req.latents.as_ref(),
        };
        let (latents, condition) = prepare_inpaint(
            &pipe.vae,
            &*pipe.scheduler,
            f,
            channels,
            image,
            mask,
            batch,
            start,
            noise,
            &pipe.device,
        )?;
        let control = controls
            .map(|c| ControlStep::new(c, (w, h), batch, &context, timesteps.len(), &pipe.device))
            .transpose()?;
        let mut out = pipe.denoise_and_decode(
            &timesteps,
            latents,
            &context,
            Some(&condition),
            control.as_ref(),
            req,
            noise,
            &mut callback,
        )?;
        if let Some(c) = cropped {
            out.images = out
                .images
                .map(|images| {
                    crate::mask_crop::paste_back(images, original_mask, original, c.region)
                })
                .transpose()?;
        }
        Ok(out)
    }
}

impl<B: Backend> ToDevice<B> for StableDiffusionInpaintPipeline<B> {
    fn to(self, device: &B::Device) -> Self {
        Self {
            pipe: self.pipe.to(device),
        }
    }
}
