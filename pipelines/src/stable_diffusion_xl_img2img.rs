//! `StableDiffusionXLImg2ImgPipeline`: SDXL image to image and the refiner, as diffusers'
//! `pipeline_stable_diffusion_xl_img2img.py`.
//!
//! The components, prompt encoding, denoising loop and decode are
//! [`StableDiffusionXLPipeline`]'s; what differs is the start: the input image's VAE latents
//! (or latents handed over by a base pipeline that stopped at `denoising_end`), noised to the
//! first timestep kept by `strength`, or taken as they are from `denoising_start` on (the
//! refiner's half of the schedule). Refiner checkpoints (`requires_aesthetics_score`) end
//! their time ids in an aesthetic score instead of the target size.

use std::path::Path;

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use oxidiff_models::ToDevice;
use oxidiff_schedulers::{NoiseSource, Scheduler, TorchCpuGenerator};

use crate::control::{ControlStep, Controls};
use crate::denoise::{check_request, GenerateRequest, PipelineDefaults, PipelineOutput, StepInfo};
use crate::error::{PipelineError, Result};
use crate::image::preprocess;
use crate::img2img::{check_strength, encode_image_latents, strength_timesteps};
use crate::loading::LoadOptions;
use crate::stable_diffusion_xl::{StableDiffusionXLPipeline, XlOptions, XlRequest};

/// The image-editing options of the SDXL img2img and inpaint pipelines; `Default` is
/// diffusers' img2img (strength 0.3, aesthetic scores 6 and 2.5);
/// [`inpainting`](Self::inpainting) is its inpainting (strength 0.9999).
#[derive(Debug, Clone, PartialEq)]
pub struct XlEditOptions {
    /// In (0, 1]: the part of the schedule that is run. Unused with `denoising_start`.
    pub strength: f64,
    /// Start at this fraction of the schedule, in (0, 1), with the given latents as they are
    /// (no noise added): the refiner's `denoising_start`, matching the base pipeline's
    /// `denoising_end`.
    pub denoising_start: Option<f64>,
    /// Refiners only (`requires_aesthetics_score`): the aesthetic score of the positive and of
    /// the negative time ids.
    pub aesthetic_score: f64,
    pub negative_aesthetic_score: f64,
    /// Inpainting only: diffusers' `padding_mask_crop` (see
    /// [`InpaintOptions`](crate::InpaintOptions)); image to image refuses it.
    pub padding_mask_crop: Option<usize>,
}

impl Default for XlEditOptions {
    fn default() -> Self {
        Self {
            strength: edit_strength(PipelineDefaults::STABLE_DIFFUSION_XL_IMG2IMG),
            denoising_start: None,
            aesthetic_score: 6.0,
            negative_aesthetic_score: 2.5,
            padding_mask_crop: None,
        }
    }
}

/// The strength of an editing pipeline's defaults (those consts always carry one).
fn edit_strength(defaults: PipelineDefaults) -> f64 {
    defaults.strength.unwrap_or(1.0)
}

impl XlEditOptions {
    /// diffusers' SDXL inpainting defaults: the image-to-image ones with strength 0.9999.
    pub fn inpainting() -> Self {
        Self {
            strength: edit_strength(PipelineDefaults::STABLE_DIFFUSION_XL_INPAINT),
            ..Self::default()
        }
    }
}

/// What SDXL image to image starts from.
#[derive(Debug, Clone)]
pub enum XlInitImage<'a, B: Backend> {
    /// An image (PNG, JPEG, WebP through the `image` crate), VAE-encoded.
    Image(&'a image::DynamicImage),
    /// Latents `[1 or batch, 4, h/8, w/8]`, e.g. a base pipeline's output with
    /// `denoising_end` and [`OutputType::Latents`](crate::OutputType::Latents).
    Latents(Tensor<B, 4>),
}

/// Checks the edit options: strength in (0, 1], `denoising_start` in (0, 1) and below
/// `denoising_end`.
pub(crate) fn check_edit(edit: &XlEditOptions, xl: &XlOptions) -> Result<()> {
    check_strength(edit.strength)?;
    if let Some(start) = edit.denoising_start {
        if !(start > 0.0 && start < 1.0) {
            return Err(PipelineError::InvalidInput(format!(
                "denoising_start must be in (0, 1), got {start}"
            )));
        }
        if let Some(end) = xl.denoising_end.filter(|&end| start >= end) {
            return Err(PipelineError::InvalidInput(format!(
                "denoising_start {start} must be below denoising_end {end}"
            )));
        }
    }
    Ok(())
}

/// The timesteps an edit runs (the scheduler already set for `steps`): from
/// `denoising_start` on when given (diffusers' cutoff `round(train * (1 - start))`, every
/// timestep below it, one more for second-order schedulers so a step is never split), else
/// the last `int(steps * strength)`; the scheduler's begin index is set to where they start.
pub(crate) fn edit_timesteps<B: Backend>(
    scheduler: &mut dyn Scheduler<B>,
    num_train_timesteps: usize,
    steps: usize,
    edit: &XlEditOptions,
) -> Result<Vec<f64>> {
    let Some(start) = edit.denoising_start else {
        return strength_timesteps(scheduler, steps, edit.strength);
    };
    let train = num_train_timesteps as f64;
    // Python's `round` rounds halves to even.
    let cutoff = (train - start * train).round_ties_even();
    let all = scheduler.timesteps();
    let mut count = all.iter().filter(|&&t| t < cutoff).count();
    if scheduler.order() == 2 && count % 2 == 0 {
        count += 1;
    }
    let count = count.min(all.len());
    if count == 0 {
        return Err(PipelineError::InvalidInput(format!(
            "denoising_start {start} with {steps} steps leaves no step to run; lower it or raise \
             the number of steps"
        )));
    }
    let t_start = all.len() - count;
    let timesteps = all[t_start..].to_vec();
    scheduler.set_begin_index(t_start);
    Ok(timesteps)
}

/// Image-to-image `add_time_ids` (positive, negative) for an image of `size` (h, w), as
/// diffusers' img2img `_get_add_time_ids`: the negative sizes default to the positive ones;
/// a refiner's ids are `[original, crop, aesthetic score]` (the negative with the negative
/// crop and score), others' `[original, crop, target]` (the negative with the positive crop,
/// as diffusers does).
pub(crate) fn edit_time_ids<B: Backend>(
    pipe: &StableDiffusionXLPipeline<B>,
    xl: &XlOptions,
    edit: &XlEditOptions,
    size: (usize, usize),
) -> (Vec<f32>, Vec<f32>) {
    let original = xl.original_size.unwrap_or(size);
    let target = xl.target_size.unwrap_or(size);
    let negative_original = xl.negative_original_size.unwrap_or(original);
    let negative_target = xl.negative_target_size.unwrap_or(target);
    let crop = xl.crops_coords_top_left;
    if pipe.requires_aesthetics_score {
        let ids = |(h, w): (usize, usize), (top, left): (usize, usize), score: f64| {
            vec![h as f32, w as f32, top as f32, left as f32, score as f32]
        };
        (
            ids(original, crop, edit.aesthetic_score),
            ids(
                negative_original,
                xl.negative_crops_coords_top_left,
                edit.negative_aesthetic_score,
            ),
        )
    } else {
        (
            pipe.time_ids(original, crop, target),
            pipe.time_ids(negative_original, crop, negative_target),
        )
    }
}

/// SDXL image to image (and the refiner) over a [`StableDiffusionXLPipeline`]'s components.
pub struct StableDiffusionXLImg2ImgPipeline<B: Backend> {
    pub pipe: StableDiffusionXLPipeline<B>,
}

impl<B: Backend> From<StableDiffusionXLPipeline<B>> for StableDiffusionXLImg2ImgPipeline<B> {
    fn from(pipe: StableDiffusionXLPipeline<B>) -> Self {
        Self { pipe }
    }
}

impl<B: Backend> StableDiffusionXLImg2ImgPipeline<B> {
    /// Loads an SDXL folder (or Hub id): a base or a refiner.
    pub fn from_pretrained(spec: &str, options: &LoadOptions, device: &B::Device) -> Result<Self> {
        StableDiffusionXLPipeline::from_pretrained(spec, options, device).map(Self::from)
    }

    /// Loads an SDXL pipeline folder for image to image.
    pub fn from_dir(dir: &Path, options: &LoadOptions, device: &B::Device) -> Result<Self> {
        options.refuse_transformer_file("SDXL img2img")?;
        StableDiffusionXLPipeline::from_dir(dir, options, device).map(Self::from)
    }

    /// diffusers' `__call__` defaults (steps, guidance 5.0, strength 0.3).
    pub fn defaults(&self) -> PipelineDefaults {
        PipelineDefaults::STABLE_DIFFUSION_XL_IMG2IMG
    }

    /// A request with diffusers' defaults (the strength is [`XlEditOptions::default`]'s).
    pub fn default_request(&self) -> XlRequest<B> {
        XlRequest::new(self.defaults().request())
    }

    /// Image to image with the default generator seeded by `request.common.seed`.
    pub fn generate(
        &mut self,
        request: &XlRequest<B>,
        edit: &XlEditOptions,
        image: XlInitImage<'_, B>,
    ) -> Result<PipelineOutput<B>> {
        let mut generator = TorchCpuGenerator::new(request.common.seed);
        self.generate_with(request, edit, image, &mut generator, |_| {})
    }

    /// Image to image from `image`: resized to `req.width` x `req.height` when given, else
    /// at its own size rounded down to a multiple of 8 (latents keep their size). Noise is
    /// drawn from `noise`: the VAE sample (images only), the initial noise (without
    /// `denoising_start`), then the scheduler's.
    pub fn generate_with(
        &mut self,
        request: &XlRequest<B>,
        edit: &XlEditOptions,
        image: XlInitImage<'_, B>,
        noise: &mut dyn NoiseSource<B>,
        callback: impl FnMut(StepInfo<'_, B>),
    ) -> Result<PipelineOutput<B>> {
        Self::generate_controlled_on(&mut self.pipe, request, edit, image, None, noise, callback)
    }

    /// [`generate_with`](Self::generate_with) with ControlNets (their control images resized
    /// to the image's size), for the SDXL ControlNet image-to-image pipeline, which takes no
    /// `denoising_start` or `denoising_end` (as diffusers').
    pub(crate) fn generate_controlled_on(
        pipe: &mut StableDiffusionXLPipeline<B>,
        request: &XlRequest<B>,
        edit: &XlEditOptions,
        image: XlInitImage<'_, B>,
        controls: Option<Controls<'_, B>>,
        noise: &mut dyn NoiseSource<B>,
        mut callback: impl FnMut(StepInfo<'_, B>),
    ) -> Result<PipelineOutput<B>> {
        let (req, xl) = (&request.common, &request.xl);
        check_edit(edit, xl)?;
        if controls.is_some() && (edit.denoising_start.is_some() || xl.denoising_end.is_some()) {
            return Err(PipelineError::InvalidInput(
                "SDXL ControlNet image to image runs the whole (strength-cut) schedule: leave \
                 denoising_start and denoising_end unset"
                    .into(),
            ));
        }
        if edit.padding_mask_crop.is_some() {
            return Err(PipelineError::InvalidInput(
                "padding_mask_crop crops to a mask's region: it applies to inpainting \
                 (StableDiffusionXLInpaintPipeline, `img2img --mask`), not to image to image"
                    .into(),
            ));
        }
        if req.latents.is_some() {
            return Err(PipelineError::InvalidInput(
                "image to image starts from the image's latents; pass latents as \
                 XlInitImage::Latents instead of initial latents"
                    .into(),
            ));
        }
        pipe.check_options(req, xl)?;
        let f = pipe.vae_scale_factor;
        let batch = req.prompts.len() * req.num_images_per_prompt;
        let pixels = match &image {
            XlInitImage::Image(image) => Some(preprocess::<B>(
                image,
                req.width,
                req.height,
                f,
                &pipe.vae.decoder.conv_in.weight.device(),
            )?),
            XlInitImage::Latents(latents) => {
                let [n, c, _, _] = latents.dims();
                if c != 4 || (n != 1 && n != batch) {
                    return Err(PipelineError::InvalidInput(format!(
                        "initial latents have shape {:?}; expected [1 or {batch}, 4, h/8, w/8]",
                        latents.dims()
                    )));
                }
                None
            }
        };
        let (height, width) = match (&pixels, &image) {
            (Some(p), _) => (p.dims()[2], p.dims()[3]),
            (None, XlInitImage::Latents(l)) => (l.dims()[2] * f, l.dims()[3] * f),
            (None, XlInitImage::Image(_)) => unreachable!("images are preprocessed"),
        };
        let sized = GenerateRequest {
            width: Some(width),
            height: Some(height),
            latents: None,
            cancel: None,
            ..req.clone()
        };
        let default = pipe.default_size();
        check_request(&sized, (default, default), f)?;
        if edit.denoising_start.is_none() {
            crate::img2img::check_strength_steps(edit.strength, req.num_inference_steps)?;
        }

        let (positive_ids, negative_ids) = edit_time_ids(pipe, xl, edit, (height, width));
        let condition = pipe.conditioning(req, xl, &positive_ids, &negative_ids)?;
        pipe.scheduler.set_timesteps(req.num_inference_steps)?;
        pipe.scheduler.set_eta(req.eta);
        let train = pipe.scheduler_config.num_train_timesteps;
        let timesteps = edit_timesteps(&mut *pipe.scheduler, train, req.num_inference_steps, edit)?;

        let init = match (pixels, image) {
            (Some(pixels), _) => {
                encode_image_latents(&pipe.vae, pixels, batch, noise, &pipe.device)?
            }
            (None, XlInitImage::Latents(latents)) => {
                let latents = latents.to_device(&pipe.device);
                if latents.dims()[0] < batch {
                    latents.repeat_dim(0, batch)
                } else {
                    latents
                }
            }
            (None, XlInitImage::Image(_)) => unreachable!("images are preprocessed"),
        };
        let latents = if edit.denoising_start.is_none() {
            let first_noise = noise.randn(init.dims(), &pipe.device)?;
            pipe.scheduler
                .add_noise(init, first_noise, &timesteps[..1])?
        } else {
            init
        };
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
        pipe.denoise_and_decode(
            &timesteps,
            latents,
            &condition,
            None,
            control.as_ref(),
            req,
            noise,
            &mut callback,
        )
    }
}

impl<B: Backend> ToDevice<B> for StableDiffusionXLImg2ImgPipeline<B> {
    fn to(self, device: &B::Device) -> Self {
        Self {
            pipe: self.pipe.to(device),
        }
    }
}
