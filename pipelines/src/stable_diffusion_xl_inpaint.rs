//! `StableDiffusionXLInpaintPipeline`: SDXL inpainting, as diffusers'
//! `pipeline_stable_diffusion_xl_inpaint.py`.
//!
//! [`StableDiffusionXLPipeline`]'s components and loop with the inpainting of
//! [`crate::inpaint`] (a 9-channel inpainting UNet, or the masked-latent
//! method for 4-channel ones), the strength / `denoising_start` schedule and time ids of
//! [`StableDiffusionXLImg2ImgPipeline`](crate::StableDiffusionXLImg2ImgPipeline).

use std::path::Path;

use burn::tensor::backend::Backend;
use oxidiff_models::ToDevice;
use oxidiff_schedulers::{NoiseSource, TorchCpuGenerator};

use crate::control::{ControlStep, Controls};
use crate::denoise::{check_request, GenerateRequest, PipelineDefaults, PipelineOutput, StepInfo};
use crate::error::{PipelineError, Result};
use crate::image::{preprocess, preprocess_mask};
use crate::img2img::check_strength_steps;
use crate::inpaint::{
    check_mask_size, crop_for_request, inpaint_channels, prepare_inpaint, InpaintStart,
};
use crate::loading::LoadOptions;
use crate::stable_diffusion_xl::{StableDiffusionXLPipeline, XlRequest};
use crate::stable_diffusion_xl_img2img::{
    check_edit, edit_time_ids, edit_timesteps, XlEditOptions,
};

/// SDXL inpainting over a [`StableDiffusionXLPipeline`]'s components.
pub struct StableDiffusionXLInpaintPipeline<B: Backend> {
    pub pipe: StableDiffusionXLPipeline<B>,
}

impl<B: Backend> From<StableDiffusionXLPipeline<B>> for StableDiffusionXLInpaintPipeline<B> {
    fn from(pipe: StableDiffusionXLPipeline<B>) -> Self {
        Self { pipe }
    }
}

impl<B: Backend> StableDiffusionXLInpaintPipeline<B> {
    /// Loads an SDXL folder (or Hub id), an inpainting one or an ordinary one.
    pub fn from_pretrained(spec: &str, options: &LoadOptions, device: &B::Device) -> Result<Self> {
        StableDiffusionXLPipeline::from_pretrained(spec, options, device).map(Self::from)
    }

    /// Loads an SDXL pipeline folder for inpainting.
    pub fn from_dir(dir: &Path, options: &LoadOptions, device: &B::Device) -> Result<Self> {
        options.refuse_transformer_file("SDXL inpainting")?;
        StableDiffusionXLPipeline::from_dir(dir, options, device).map(Self::from)
    }

    /// The UNet's input channels: 9 for an inpainting UNet, 4 for the masked-latent method.
    pub fn unet_in_channels(&self) -> usize {
        self.pipe.unet.conv_in.weight.dims()[1]
    }

    /// diffusers' `__call__` defaults (steps, guidance 7.5, strength 0.9999).
    pub fn defaults(&self) -> PipelineDefaults {
        PipelineDefaults::STABLE_DIFFUSION_XL_INPAINT
    }

    /// A request with diffusers' defaults (the strength is [`XlEditOptions::inpainting`]'s).
    pub fn default_request(&self) -> XlRequest<B> {
        XlRequest::new(self.defaults().request())
    }

    /// Inpaints with the default generator seeded by `request.common.seed`.
    pub fn generate(
        &mut self,
        request: &XlRequest<B>,
        edit: &XlEditOptions,
        image: &image::DynamicImage,
        mask: &image::DynamicImage,
    ) -> Result<PipelineOutput<B>> {
        let mut generator = TorchCpuGenerator::new(request.common.seed);
        self.generate_with(request, edit, image, mask, &mut generator, |_| {})
    }

    /// Repaints the white part of `mask` (same size as `image`). Image and mask are resized
    /// to `req.width` x `req.height` when given, else kept at the image's size rounded down
    /// to a multiple of 8 (diffusers defaults to the UNet's sample size). With
    /// `edit.denoising_start` the image's latents are not noised (a refiner continuing a
    /// base's `denoising_end`). Noise is drawn in diffusers' order (see
    /// `prepare_inpaint` in `crate::inpaint`), then the scheduler's.
    #[allow(clippy::too_many_arguments)]
    pub fn generate_with(
        &mut self,
        request: &XlRequest<B>,
        edit: &XlEditOptions,
        image: &image::DynamicImage,
        mask: &image::DynamicImage,
        noise: &mut dyn NoiseSource<B>,
        callback: impl FnMut(StepInfo<'_, B>),
    ) -> Result<PipelineOutput<B>> {
        let images = (image, mask);
        Self::generate_controlled_on(&mut self.pipe, request, edit, images, None, noise, callback)
    }

    /// [`generate_with`](Self::generate_with) with ControlNets (their control images resized
    /// to the image's size; the guidance windows are fractions of the steps from
    /// `denoising_start` on, before `denoising_end`, as diffusers'), for the SDXL ControlNet
    /// inpainting pipeline. `padding_mask_crop` is refused with ControlNets.
    pub(crate) fn generate_controlled_on(
        pipe: &mut StableDiffusionXLPipeline<B>,
        request: &XlRequest<B>,
        edit: &XlEditOptions,
        (image, mask): (&image::DynamicImage, &image::DynamicImage),
        controls: Option<Controls<'_, B>>,
        noise: &mut dyn NoiseSource<B>,
        mut callback: impl FnMut(StepInfo<'_, B>),
    ) -> Result<PipelineOutput<B>> {
        let (req, xl) = (&request.common, &request.xl);
        if controls.is_some() && edit.padding_mask_crop.is_some() {
            return Err(PipelineError::InvalidInput(
                "padding_mask_crop with ControlNets is not implemented yet; inpaint the whole \
                 image"
                    .into(),
            ));
        }
        check_edit(edit, xl)?;
        if edit.denoising_start.is_none() {
            check_strength_steps(edit.strength, req.num_inference_steps)?;
        }
        check_mask_size(image, mask)?;
        let channels = inpaint_channels(pipe.unet.conv_in.weight.dims()[1])?;
        pipe.check_options(req, xl)?;
        let f = pipe.vae_scale_factor;
        let vae_device = pipe.vae.decoder.conv_in.weight.device();
        let (original, original_mask) = (image, mask);
        let cropped = crop_for_request(
            image,
            mask,
            (req.width, req.height),
            f,
            edit.padding_mask_crop,
            req.output,
        )?;
        let (image, mask) = match &cropped {
            Some(c) => (&c.image, &c.mask),
            None => (image, mask),
        };
        let image = preprocess::<B>(image, req.width, req.height, f, &vae_device)?;
        let [_, _, height, width] = image.dims();
        let mask = preprocess_mask::<B>(mask, width, height, &vae_device)?;
        let sized = GenerateRequest {
            width: Some(width),
            height: Some(height),
            latents: None,
            cancel: None,
            ..req.clone()
        };
        let default = pipe.default_size();
        check_request(&sized, (default, default), f)?;

        let (positive_ids, negative_ids) = edit_time_ids(pipe, xl, edit, (height, width));
        let condition = pipe.conditioning(req, xl, &positive_ids, &negative_ids)?;
        pipe.scheduler.set_timesteps(req.num_inference_steps)?;
        pipe.scheduler.set_eta(req.eta);
        let train = pipe.scheduler_config.num_train_timesteps;
        let timesteps = edit_timesteps(&mut *pipe.scheduler, train, req.num_inference_steps, edit)?;
        let start = InpaintStart {
            strength: edit.strength,
            first_timestep: timesteps[0],
            add_noise: edit.denoising_start.is_none(),
            latents: req.latents.as_ref(),
        };
        let batch = req.prompts.len() * req.num_images_per_prompt;
        let (latents, inpaint) = prepare_inpaint(
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
            .map(|c| {
                ControlStep::new(
                    c,
                    (width, height),
                    batch,
                    &condition.context,
                    timesteps.len(),
                    &pipe.device,
                )
            })
            .transpose()?
            .map(|step| step.with_added(&condition.added));
        let timesteps = pipe.cut_at_denoising_end(timesteps, xl);
        let mut out = pipe.denoise_and_decode(
            &timesteps,
            latents,
            &condition,
            Some(&inpaint),
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

impl<B: Backend> ToDevice<B> for StableDiffusionXLInpaintPipeline<B> {
    fn to(self, device: &B::Device) -> Self {
        Self {
            pipe: self.pipe.to(device),
        }
    }
}
