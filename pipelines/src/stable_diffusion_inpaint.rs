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
//! as diffusers' mask `VaeImageProcessor` does ([`preprocess_mask`]). [`InpaintCondition`] and
//! `prepare_inpaint` are shared with SDXL inpainting.

use std::path::Path;

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use oxidiff_models::{AutoencoderKL, ToDevice};
use oxidiff_schedulers::{
    NoiseSource, Result as SchedulerResult, Scheduler, SchedulerKind, TimestepOptions,
    TorchCpuGenerator,
};

use crate::error::{PipelineError, Result};
use crate::image::{preprocess, preprocess_mask, resize_nearest};
use crate::stable_diffusion::{
    GenerateRequest, LoadOptions, PipelineOutput, StableDiffusionPipeline, StepInfo,
};
use crate::stable_diffusion_img2img::{
    check_strength, check_strength_steps, encode_image_latents, strength_timesteps,
};

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
    output: crate::stable_diffusion::OutputType,
) -> Result<Option<crate::mask_crop::CroppedInputs>> {
    let Some(padding) = padding_mask_crop else {
        return Ok(None);
    };
    if output == crate::stable_diffusion::OutputType::Latents {
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
        StableDiffusionPipeline::from_dir(dir, options, device).map(Self::from)
    }

    /// The UNet's input channels: 9 for an inpainting UNet, 4 for the masked-latent method.
    pub fn unet_in_channels(&self) -> usize {
        self.pipe.unet.conv_in.weight.dims()[1]
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
        mut callback: impl FnMut(StepInfo<'_, B>),
    ) -> Result<PipelineOutput<B>> {
        let strength = options.strength;
        check_strength(strength)?;
        check_strength_steps(strength, req.num_inference_steps)?;
        check_mask_size(image, mask)?;
        let channels = inpaint_channels(self.unet_in_channels())?;
        let pipe = &mut self.pipe;
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
        crate::loading::check_request(&sized, (default, default), f)?;
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
        let mut out = pipe.denoise_and_decode(
            &timesteps,
            latents,
            &context,
            Some(&condition),
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
