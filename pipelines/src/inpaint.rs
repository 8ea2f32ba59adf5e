//! What inpainting adds to a denoising loop, shared by SD and SDXL inpainting: the UNet's
//! extra input channels or the masked-latent blend ([`InpaintCondition`]), the initial latents
//! in diffusers' draw order (`prepare_inpaint`), the input checks and `padding_mask_crop`.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use oxidiff_models::AutoencoderKL;
use oxidiff_schedulers::{
    NoiseSource, Result as SchedulerResult, Scheduler, SchedulerKind, TimestepOptions,
};

use crate::denoise::OutputType;
use crate::error::{PipelineError, Result};
use crate::image::resize_nearest;
use crate::img2img::encode_image_latents;

/// What inpainting adds to a denoising loop (built by `prepare_inpaint`).
#[derive(Debug, Clone)]
pub struct InpaintCondition<B: Backend> {
    /// 9-channel UNets: `[mask, masked_image_latents]`, `[batch, 5, h, w]`, appended to the
    /// scaled latents of every UNet call.
    pub unet_extra: Option<Tensor<B, 4>>,
    /// 4-channel UNets: the masked-latent blend after every scheduler step.
    pub blend: Option<LatentBlend<B>>,
}

/// The masked-latent method's state: `latents = (1 - mask) * add_noise(image_latents, noise,
/// t_next) + mask * latents` after each step (the clean `image_latents` after the last).
#[derive(Debug, Clone)]
pub struct LatentBlend<B: Backend> {
    pub image_latents: Tensor<B, 4>,
    pub noise: Tensor<B, 4>,
    /// `[batch, 4, h, w]`: 1 where the image is repainted.
    pub mask: Tensor<B, 4>,
}

impl<B: Backend> InpaintCondition<B> {
    /// The UNet input: the scaled latents, with the extra channels of a 9-channel UNet.
    pub(crate) fn unet_input(condition: Option<&Self>, sample: Tensor<B, 4>) -> Tensor<B, 4> {
        match condition.and_then(|c| c.unet_extra.as_ref()) {
            Some(extra) => Tensor::cat(vec![sample, extra.clone()], 1),
            None => sample,
        }
    }

    /// `inner`, with the masked-latent blend after every step when there is one. Wrapping the
    /// scheduler keeps the shared denoising loop as it is for every pipeline.
    pub(crate) fn scheduler<'a>(
        &'a self,
        inner: &'a mut dyn Scheduler<B>,
        timesteps: &[f64],
    ) -> MaskedLatents<'a, B> {
        MaskedLatents {
            inner,
            blend: self.blend.as_ref(),
            timesteps: timesteps.to_vec(),
            step: 0,
        }
    }
}

/// A scheduler whose every `step` is followed by the masked-latent blend of [`LatentBlend`]
/// (with `t_next` the loop's next timestep), as diffusers' inpainting loop does for 4-channel
/// UNets; everything else is the inner scheduler's.
pub(crate) struct MaskedLatents<'a, B: Backend> {
    inner: &'a mut dyn Scheduler<B>,
    blend: Option<&'a LatentBlend<B>>,
    timesteps: Vec<f64>,
    step: usize,
}

impl<B: Backend> Scheduler<B> for MaskedLatents<'_, B> {
    fn kind(&self) -> SchedulerKind {
        self.inner.kind()
    }

    fn set_timesteps(&mut self, num_inference_steps: usize) -> SchedulerResult<()> {
        self.inner.set_timesteps(num_inference_steps)
    }

    fn timesteps(&self) -> &[f64] {
        self.inner.timesteps()
    }

    fn init_noise_sigma(&self) -> f64 {
        self.inner.init_noise_sigma()
    }

    fn order(&self) -> usize {
        self.inner.order()
    }

    fn scale_model_input(
        &self,
        sample: Tensor<B, 4>,
        timestep: f64,
    ) -> SchedulerResult<Tensor<B, 4>> {
        self.inner.scale_model_input(sample, timestep)
    }

    fn step(
        &mut self,
        model_output: Tensor<B, 4>,
        timestep: f64,
        sample: Tensor<B, 4>,
        noise: &mut dyn NoiseSource<B>,
    ) -> SchedulerResult<Tensor<B, 4>> {
        let latents = self.inner.step(model_output, timestep, sample, noise)?;
        let Some(blend) = self.blend else {
            return Ok(latents);
        };
        self.step += 1;
        let proper = match self.timesteps.get(self.step) {
            Some(&next) => {
                self.inner
                    .add_noise(blend.image_latents.clone(), blend.noise.clone(), &[next])?
            }
            None => blend.image_latents.clone(),
        };
        let keep = blend.mask.ones_like() - blend.mask.clone();
        Ok(keep * proper + blend.mask.clone() * latents)
    }

    fn add_noise(
        &self,
        original: Tensor<B, 4>,
        noise: Tensor<B, 4>,
        timesteps: &[f64],
    ) -> SchedulerResult<Tensor<B, 4>> {
        self.inner.add_noise(original, noise, timesteps)
    }

    fn sigmas(&self) -> Option<&[f64]> {
        self.inner.sigmas()
    }

    fn set_begin_index(&mut self, begin_index: usize) {
        self.inner.set_begin_index(begin_index)
    }

    fn set_eta(&mut self, eta: f64) {
        self.inner.set_eta(eta)
    }

    fn set_timesteps_with(
        &mut self,
        num_inference_steps: usize,
        options: &TimestepOptions,
    ) -> SchedulerResult<()> {
        self.inner.set_timesteps_with(num_inference_steps, options)
    }
}

/// The UNet's input channels: 4 (masked-latent method) or 9 (inpainting UNet); others are an
/// error naming the count.
pub(crate) fn inpaint_channels(in_channels: usize) -> Result<usize> {
    match in_channels {
        4 | 9 => Ok(in_channels),
        n => Err(PipelineError::InvalidInput(format!(
            "inpainting needs a UNet with 4 input channels (the masked-latent method) or 9 (an \
             inpainting UNet: latents, mask and masked-image latents); this one has {n}"
        ))),
    }
}

/// Checks that the UNet takes the loop's input: the latents' channels plus the inpainting
/// channels (none outside inpainting). An inpainting UNet (9 channels) outside inpainting, or
/// any UNet whose `in_channels` do not fit, is an error naming the fix instead of a shape
/// failure inside the first convolution.
pub(crate) fn check_unet_input<B: Backend>(
    unet: &oxidiff_models::UNet2DConditionModel<B>,
    latents: &Tensor<B, 4>,
    inpaint: Option<&InpaintCondition<B>>,
) -> Result<()> {
    let want = unet.conv_in.weight.dims()[1];
    let extra = inpaint
        .and_then(|c| c.unet_extra.as_ref())
        .map_or(0, |e| e.dims()[1]);
    let got = latents.dims()[1] + extra;
    if got == want {
        return Ok(());
    }
    let hint = if want == 9 && inpaint.is_none() {
        "it is an inpainting UNet: inpaint with a mask (StableDiffusionInpaintPipeline, \
         StableDiffusionXLInpaintPipeline, `img2img --mask`)"
            .to_string()
    } else {
        format!("the UNet's `in_channels` is {want}")
    };
    Err(PipelineError::InvalidInput(format!(
        "the UNet takes {want} input channels but this pipeline gives it {got}; {hint}"
    )))
}

/// Checks that image and mask have the same size (before any resizing).
pub(crate) fn check_mask_size(
    image: &image::DynamicImage,
    mask: &image::DynamicImage,
) -> Result<()> {
    let (image_size, mask_size) = (
        (image.width(), image.height()),
        (mask.width(), mask.height()),
    );
    if image_size != mask_size {
        return Err(PipelineError::InvalidInput(format!(
            "the mask is {}x{} but the image is {}x{}; give a mask of the image's size \
             (white repaints, black keeps)",
            mask_size.0, mask_size.1, image_size.0, image_size.1
        )));
    }
    Ok(())
}

/// How the initial latents of an inpainting run are made.
#[derive(Debug, Clone, Copy)]
pub(crate) struct InpaintStart<'a, B: Backend> {
    pub strength: f64,
    /// The first timestep of the (strength-cut) schedule, where the image is noised to.
    pub first_timestep: f64,
    /// `false` for SDXL's `denoising_start`: the latents are the image's, not noised.
    pub add_noise: bool,
    /// Caller-given initial noise (diffusers' `latents=`), scaled by `init_noise_sigma`.
    pub latents: Option<&'a Tensor<B, 4>>,
}

/// diffusers' inpainting `prepare_latents` and `prepare_mask_latents`, with the random draws
/// in diffusers' order: the image's VAE sample (4-channel UNets, strength below 1, or no
/// added noise), the initial noise, then the masked image's VAE sample (always, as
/// diffusers). `image` is `[1, 3, H, W]` in `[-1, 1]` and `mask` `[1, 1, H, W]` binary, both on
/// the VAE's device; returns the initial latents and the loop's condition, on `device`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn prepare_inpaint<B: Backend>(
    vae: &AutoencoderKL<B>,
    scheduler: &dyn Scheduler<B>,
    vae_scale_factor: usize,
    unet_channels: usize,
    image: Tensor<B, 4>,
    mask: Tensor<B, 4>,
    batch: usize,
    start: InpaintStart<'_, B>,
    noise: &mut dyn NoiseSource<B>,
    device: &B::Device,
) -> Result<(Tensor<B, 4>, InpaintCondition<B>)> {
    let [_, _, height, width] = image.dims();
    let f = vae_scale_factor;
    let shape = [batch, 4, height / f, width / f];
    let strength_max = start.strength == 1.0;
    let needs_image =
        unet_channels == 4 || !start.add_noise || (start.latents.is_none() && !strength_max);
    let image_latents = if needs_image {
        Some(encode_image_latents(
            vae,
            image.clone(),
            batch,
            noise,
            device,
        )?)
    } else {
        None
    };
    let sigma = scheduler.init_noise_sigma();
    let (latents, initial_noise) = match (start.add_noise, start.latents, &image_latents) {
        (false, _, Some(image_latents)) => (image_latents.clone(), noise.randn(shape, device)?),
        (true, Some(given), _) => {
            if given.dims() != shape {
                return Err(PipelineError::InvalidInput(format!(
                    "initial latents have shape {:?}, expected {shape:?} for {batch} image(s) of \
                     {width}x{height}",
                    given.dims()
                )));
            }
            let given = given.clone().to_device(device);
            (given.clone().mul_scalar(sigma), given)
        }
        (true, None, image_latents) => {
            let drawn = noise.randn(shape, device)?;
            let latents = match image_latents {
                Some(image_latents) if !strength_max => scheduler.add_noise(
                    image_latents.clone(),
                    drawn.clone(),
                    &[start.first_timestep],
                )?,
                _ => drawn.clone().mul_scalar(sigma),
            };
            (latents, drawn)
        }
        (false, _, None) => unreachable!("the image is encoded when no noise is added"),
    };

    // `init_image * (mask < 0.5)`: the image with the repainted region blacked out (0).
    let keep = mask.clone().lower_elem(0.5).float().repeat_dim(1, 3);
    let masked_image = image * keep;
    let masked_latents = encode_image_latents(vae, masked_image, batch, noise, device)?;
    let mask = resize_nearest(mask, width / f, height / f)?
        .to_device(device)
        .repeat_dim(0, batch);

    let condition = if unet_channels == 9 {
        InpaintCondition {
            unet_extra: Some(Tensor::cat(vec![mask, masked_latents], 1)),
            blend: None,
        }
    } else {
        let image_latents = image_latents.ok_or_else(|| {
            PipelineError::InvalidInput(format!(
                "inpainting needs a UNet with 4 input channels (masked-latent blending) or 9 \
                 (an inpainting UNet); this one has {unet_channels}"
            ))
        })?;
        InpaintCondition {
            unet_extra: None,
            blend: Some(LatentBlend {
                image_latents,
                noise: initial_noise,
                mask: mask.repeat_dim(1, 4),
            }),
        }
    };
    Ok((latents, condition))
}

/// What an SD inpainting call takes besides prompt, image and mask; `Default` is diffusers'
/// (strength 1, no crop).
#[derive(Debug, Clone, PartialEq)]
pub struct InpaintOptions {
    /// In (0, 1]: the part of the schedule that is run (1: from pure noise).
    pub strength: f64,
    /// diffusers' `padding_mask_crop`: inpaint only the box around the mask's nonzero pixels,
    /// grown by this many pixels and to the output's aspect ratio, at the output size, then
    /// paste the result back into the original image, blended by the mask
    /// ([`crate::mask_crop`]); the images come back at the original image's size.
    pub padding_mask_crop: Option<usize>,
}

impl Default for InpaintOptions {
    fn default() -> Self {
        Self {
            strength: 1.0,
            padding_mask_crop: None,
        }
    }
}

/// The output size of an inpainting run (`req` size, else the image's rounded down to a
/// multiple of `factor`) and, with `padding_mask_crop`, image and mask cut to the crop region
/// and filled to that size.
pub(crate) fn crop_for_request<'a>(
    image: &'a image::DynamicImage,
    mask: &'a image::DynamicImage,
    (width, height): (Option<usize>, Option<usize>),
    factor: usize,
    padding_mask_crop: Option<usize>,
    output: OutputType,
) -> Result<Option<crate::mask_crop::CroppedInputs>> {
    let Some(padding) = padding_mask_crop else {
        return Ok(None);
    };
    if output == OutputType::Latents {
        return Err(PipelineError::InvalidInput(
            "padding_mask_crop pastes decoded images back into the original: it needs image \
             output, not latents"
                .into(),
        ));
    }
    let round = |v: u32| {
        let v = v as usize;
        v - v % factor.max(1)
    };
    let size = (
        width.unwrap_or(round(image.width())),
        height.unwrap_or(round(image.height())),
    );
    crate::mask_crop::crop_inputs(image, mask, size, padding).map(Some)
}
