//! The ground floor every pipeline stands on: the request and output types, the request
//! checks, classifier-free guidance, the one denoising loop and the VAE decode.
//!
//! Where this sits: below every pipeline file and above nothing of theirs; it imports only the
//! crate's helpers (`guard`, `image`, `error`), the models and the schedulers.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use oxidiff_models::AutoencoderKL;
use oxidiff_schedulers::{NoiseSource, Scheduler};

use crate::compiled::SchedulerProgram;
use crate::error::{PipelineError, Result};
use crate::guard::{self, CancelToken, Stage};
use crate::image::{postprocess, Images};

/// What the pipeline returns.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum OutputType {
    /// 8-bit RGB images (and the float arrays they come from).
    #[default]
    Images,
    /// Only the final latents; the VAE is not run.
    Latents,
}

/// One text-to-image request; `Default` gives Stable Diffusion's defaults (50 steps, guidance
/// 7.5). Each pipeline's own defaults: its `defaults()` and `default_request()`.
#[derive(Debug, Clone)]
pub struct GenerateRequest<B: Backend> {
    pub prompts: Vec<String>,
    /// One negative prompt for all prompts, one per prompt, or none (empty string).
    pub negative_prompts: Vec<String>,
    pub num_inference_steps: usize,
    pub guidance_scale: f64,
    /// Defaults to the denoiser's `sample_size` times the VAE scale factor.
    pub width: Option<usize>,
    pub height: Option<usize>,
    pub num_images_per_prompt: usize,
    /// Seed of the default generator (PyTorch's CPU generator, so seeds match diffusers').
    pub seed: u64,
    /// Initial latents `[batch, 4, h/8, w/8]` instead of drawn ones (scaled by the scheduler's
    /// `init_noise_sigma`, as diffusers does).
    pub latents: Option<Tensor<B, 4>>,
    /// DDIM's eta.
    pub eta: f64,
    pub output: OutputType,
    /// Checked after every step: once cancelled, the generation stops with
    /// [`PipelineError::Cancelled`].
    pub cancel: Option<CancelToken>,
    /// The image prompt, for a pipeline with an IP-Adapter loaded (diffusers'
    /// `ip_adapter_image`).
    pub ip_adapter_image: Option<image::DynamicImage>,
}

impl<B: Backend> Default for GenerateRequest<B> {
    fn default() -> Self {
        PipelineDefaults::STABLE_DIFFUSION.request()
    }
}

impl<B: Backend> GenerateRequest<B> {
    /// Whether classifier-free guidance runs (diffusers' `do_classifier_free_guidance`:
    /// a scale above 1).
    pub fn does_guidance(&self) -> bool {
        does_guidance(self.guidance_scale)
    }
}

/// diffusers' `__call__` defaults of one pipeline family; the image size comes from the loaded
/// model (each pipeline's `default_size()`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PipelineDefaults {
    pub num_inference_steps: usize,
    pub guidance_scale: f64,
    /// T5 tokens per prompt, for the families with a T5 encoder.
    pub max_sequence_length: Option<usize>,
    /// The part of the schedule run from the given image, for image to image and inpainting.
    pub strength: Option<f64>,
}

impl PipelineDefaults {
    /// `StableDiffusionPipeline.__call__`.
    pub const STABLE_DIFFUSION: Self = Self {
        num_inference_steps: 50,
        guidance_scale: 7.5,
        max_sequence_length: None,
        strength: None,
    };
    /// `StableDiffusionImg2ImgPipeline.__call__`.
    pub const STABLE_DIFFUSION_IMG2IMG: Self = Self {
        strength: Some(0.8),
        ..Self::STABLE_DIFFUSION
    };
    /// `StableDiffusionInpaintPipeline.__call__`.
    pub const STABLE_DIFFUSION_INPAINT: Self = Self {
        strength: Some(1.0),
        ..Self::STABLE_DIFFUSION
    };
    /// `StableDiffusionXLPipeline.__call__`.
    pub const STABLE_DIFFUSION_XL: Self = Self {
        num_inference_steps: 50,
        guidance_scale: 5.0,
        max_sequence_length: None,
        strength: None,
    };
    /// `StableDiffusionXLImg2ImgPipeline.__call__` (the refiner's too).
    pub const STABLE_DIFFUSION_XL_IMG2IMG: Self = Self {
        strength: Some(0.3),
        ..Self::STABLE_DIFFUSION_XL
    };
    /// `StableDiffusionXLInpaintPipeline.__call__`: guidance 7.5, unlike SDXL's other two.
    pub const STABLE_DIFFUSION_XL_INPAINT: Self = Self {
        guidance_scale: 7.5,
        strength: Some(0.9999),
        ..Self::STABLE_DIFFUSION_XL
    };
    /// `StableDiffusionXLControlNetImg2ImgPipeline.__call__`: strength 0.8.
    pub const STABLE_DIFFUSION_XL_CONTROLNET_IMG2IMG: Self = Self {
        strength: Some(0.8),
        ..Self::STABLE_DIFFUSION_XL
    };
    /// `StableDiffusionXLControlNetInpaintPipeline.__call__`: guidance 5.0, strength 0.9999.
    pub const STABLE_DIFFUSION_XL_CONTROLNET_INPAINT: Self = Self {
        strength: Some(0.9999),
        ..Self::STABLE_DIFFUSION_XL
    };
    /// `StableDiffusion3Pipeline.__call__`.
    pub const STABLE_DIFFUSION_3: Self = Self {
        num_inference_steps: 28,
        guidance_scale: 7.0,
        max_sequence_length: Some(256),
        strength: None,
    };
    /// `FluxPipeline.__call__`.
    pub const FLUX: Self = Self {
        num_inference_steps: 28,
        guidance_scale: 3.5,
        max_sequence_length: Some(512),
        strength: None,
    };
    /// `PixArtAlphaPipeline.__call__` (Sigma's differs only in the sequence length).
    pub const PIXART_ALPHA: Self = Self {
        num_inference_steps: 20,
        guidance_scale: 4.5,
        max_sequence_length: Some(120),
        strength: None,
    };
    /// `PixArtSigmaPipeline.__call__`.
    pub const PIXART_SIGMA: Self = Self {
        max_sequence_length: Some(300),
        ..Self::PIXART_ALPHA
    };

    /// A request with these steps and guidance, everything else as [`GenerateRequest`]'s.
    pub fn request<B: Backend>(&self) -> GenerateRequest<B> {
        GenerateRequest {
            prompts: Vec::new(),
            negative_prompts: Vec::new(),
            num_inference_steps: self.num_inference_steps,
            guidance_scale: self.guidance_scale,
            width: None,
            height: None,
            num_images_per_prompt: 1,
            seed: 0,
            latents: None,
            eta: 0.0,
            output: OutputType::Images,
            cancel: None,
            ip_adapter_image: None,
        }
    }
}

/// What a step callback sees.
pub struct StepInfo<'a, B: Backend> {
    pub step: usize,
    pub num_steps: usize,
    pub timestep: f64,
    pub latents: &'a Tensor<B, 4>,
}

/// The pipeline's result.
#[derive(Debug, Clone)]
pub struct PipelineOutput<B: Backend> {
    /// Final latents (before the VAE scaling is undone).
    pub latents: Tensor<B, 4>,
    /// Images, unless only latents were asked for.
    pub images: Option<Images>,
}

/// The largest image a request may ask for, in pixels: past it the latents alone would take
/// gigabytes. The CLI's `--max-pixels` is much tighter by default.
pub const MAX_IMAGE_PIXELS: u64 = 1 << 28;

/// Refuses an image of more than [`MAX_IMAGE_PIXELS`], before anything of its size is made.
pub fn check_image_pixels(w: usize, h: usize) -> Result<()> {
    if (w as u64).saturating_mul(h as u64) > MAX_IMAGE_PIXELS {
        return Err(PipelineError::InvalidInput(format!(
            "{w}x{h} is more than {MAX_IMAGE_PIXELS} pixels (16384x16384); the pipelines refuse \
             it before allocating anything (the default size comes from the UNet or \
             transformer's `sample_size` when width and height are not given)"
        )));
    }
    Ok(())
}

/// Checks prompts, negative prompts, steps and images per prompt; returns the image size
/// (`default` when not given), which must be a positive multiple of `factor`.
pub fn check_request<B: Backend>(
    req: &GenerateRequest<B>,
    default: (usize, usize),
    factor: usize,
) -> Result<(usize, usize)> {
    if req.prompts.is_empty() {
        return Err(PipelineError::InvalidInput(
            "the prompt list is empty".into(),
        ));
    }
    let n = req.negative_prompts.len();
    if n > 1 && n != req.prompts.len() {
        return Err(PipelineError::InvalidInput(format!(
            "{n} negative prompts for {} prompts: give one, or one per prompt",
            req.prompts.len()
        )));
    }
    if req.num_inference_steps == 0 {
        return Err(PipelineError::InvalidInput(
            "the number of steps must be at least 1".into(),
        ));
    }
    if req.num_images_per_prompt == 0 {
        return Err(PipelineError::InvalidInput(
            "images per prompt must be at least 1".into(),
        ));
    }
    // NaN or Inf here would reach every latent and be blamed on the weights at the first step.
    if !req.guidance_scale.is_finite() {
        return Err(PipelineError::InvalidInput(format!(
            "the guidance scale must be a finite number, got {}",
            req.guidance_scale
        )));
    }
    if !(0.0..=1.0).contains(&req.eta) {
        return Err(PipelineError::InvalidInput(format!(
            "DDIM's eta must be a number from 0 (deterministic) to 1, got {}",
            req.eta
        )));
    }
    let (w, h) = (
        req.width.unwrap_or(default.0),
        req.height.unwrap_or(default.1),
    );
    let f = factor;
    check_image_pixels(w, h)?;
    if w == 0 || h == 0 || w % f != 0 || h % f != 0 {
        return Err(PipelineError::InvalidInput(format!(
            "width and height must be positive multiples of {f}, got {w}x{h}; try {}x{}",
            (w.max(f) / f) * f,
            (h.max(f) / f) * f
        )));
    }
    Ok((w, h))
}

/// One value per prompt from `values` for `n` prompts: none means `fallback`, one is repeated,
/// `n` are kept; another count is an error naming `what`.
pub fn per_prompt(
    values: &[String],
    fallback: &[String],
    n: usize,
    what: &str,
) -> Result<Vec<String>> {
    match values.len() {
        0 => Ok(fallback.to_vec()),
        1 => Ok(vec![values[0].clone(); n]),
        got if got == n => Ok(values.to_vec()),
        got => Err(PipelineError::InvalidInput(format!(
            "{got} {what} for {n} prompts: give one, or one per prompt"
        ))),
    }
}

/// One negative prompt per prompt: none means the empty string, one is repeated.
pub fn negatives_for<B: Backend>(req: &GenerateRequest<B>) -> Result<Vec<String>> {
    let n = req.prompts.len();
    per_prompt(
        &req.negative_prompts,
        &vec![String::new(); n],
        n,
        "negative prompts",
    )
}

/// The request's latents (checked against `shape`) or a draw from `noise`, times the
/// scheduler's `init_noise_sigma`, on `device`.
pub fn initial_latents<B: Backend>(
    req: &GenerateRequest<B>,
    shape: [usize; 4],
    (width, height): (usize, usize),
    noise: &mut dyn NoiseSource<B>,
    init_noise_sigma: f64,
    device: &B::Device,
) -> Result<Tensor<B, 4>> {
    let latents = match &req.latents {
        Some(l) => {
            if l.dims() != shape {
                return Err(PipelineError::InvalidInput(format!(
                    "initial latents have shape {:?}, expected {shape:?} for {} image(s) of \
                     {width}x{height}",
                    l.dims(),
                    shape[0]
                )));
            }
            l.clone().to_device(device)
        }
        None => noise.randn(shape, device)?,
    };
    Ok(latents.mul_scalar(init_noise_sigma))
}

/// Whether a guidance scale turns classifier-free guidance on: above 1, as diffusers.
pub fn does_guidance(scale: f64) -> bool {
    scale > 1.0
}

/// Classifier-free guidance on a `[2 * batch, ...]` prediction ordered [unconditional, text].
pub fn guide<B: Backend>(prediction: Tensor<B, 4>, batch: usize, scale: f64) -> Tensor<B, 4> {
    let uncond = prediction.clone().narrow(0, 0, batch);
    let text = prediction.narrow(0, batch, batch);
    uncond.clone() + (text - uncond).mul_scalar(scale)
}

/// Classifier-free guidance around a denoiser `f` that sees the doubled batch
/// `[sample; sample]` (its context holds the negative prompts first), for pipelines whose
/// denoiser call does not guide itself: `uncond + scale * (text - uncond)`, or the plain call
/// when guidance is off.
pub fn with_guidance<B: Backend>(
    sample: Tensor<B, 4>,
    scale: f64,
    f: impl FnOnce(Tensor<B, 4>) -> Result<Tensor<B, 4>>,
) -> Result<Tensor<B, 4>> {
    if !does_guidance(scale) {
        return f(sample);
    }
    let batch = sample.dims()[0];
    let prediction = f(Tensor::cat(vec![sample.clone(), sample], 0))?;
    Ok(guide(prediction, batch, scale))
}

/// The state a denoising loop starts from; [`run`](Self::run) drives it.
pub struct DenoisingLoop<'a, B: Backend> {
    pub scheduler: &'a mut dyn Scheduler<B>,
    /// Possibly a part of the scheduler's (strength, `denoising_end`).
    pub timesteps: &'a [f64],
    pub latents: Tensor<B, 4>,
    /// Its guidance scale (a runtime input of the denoiser) and cancel token are used.
    pub req: &'a GenerateRequest<B>,
    /// Where the latents live: the denoiser's device.
    pub device: &'a B::Device,
    pub noise: &'a mut dyn NoiseSource<B>,
    /// Compiled mode: the scheduler step as one program per step.
    pub step_program: Option<&'a SchedulerProgram<B>>,
}

impl<B: Backend> DenoisingLoop<'_, B> {
    /// The scheduler loop shared by the pipelines: the scaled model input, the guided
    /// denoiser call `denoise(sample, timestep, guidance)` (classifier-free guidance is the
    /// denoiser's, e.g. [`with_guidance`] around its call), the scheduler step, the NaN guard,
    /// the callback and cancellation.
    pub fn run(
        self,
        mut denoise: impl FnMut(Tensor<B, 4>, Tensor<B, 1>, Tensor<B, 1>) -> Result<Tensor<B, 4>>,
        callback: &mut impl FnMut(StepInfo<'_, B>),
    ) -> Result<Tensor<B, 4>> {
        let Self {
            scheduler,
            timesteps,
            mut latents,
            req,
            device,
            noise,
            step_program,
        } = self;
        // A runtime input of compiled steps, so a new guidance scale does not recompile.
        let guidance = Tensor::<B, 1>::from_data(
            TensorData::new(vec![req.guidance_scale as f32], [1]),
            device,
        );
        for (step, &t) in timesteps.iter().enumerate() {
            let model_input = scheduler.scale_model_input(latents.clone(), t)?;
            let timestep = Tensor::<B, 1>::from_data(TensorData::new(vec![t as f32], [1]), device);
            let noise_pred = denoise(model_input, timestep, guidance.clone())?;
            let prediction = noise_pred.clone();
            latents = match step_program {
                Some(program) => {
                    program.run(device, || scheduler.step(noise_pred, t, latents, noise))??
                }
                None => scheduler.step(noise_pred, t, latents, noise)?,
            };
            let class = scheduler.kind().class_name();
            guard::check_step(&latents, &prediction, step, t, class)?;
            callback(StepInfo {
                step,
                num_steps: timesteps.len(),
                timestep: t,
                latents: &latents,
            });
            if let Some(cancel) = &req.cancel {
                cancel.check(step + 1, timesteps.len())?;
            }
        }
        Ok(latents)
    }
}

/// Undoes the VAE scaling and decodes on the VAE's device, with the NaN guard: `[n, 3, h, w]`
/// in `[-1, 1]`. On XLA's CPU plugin the host memory is handed back first
/// ([`before_decoding`](crate::offload::before_decoding)).
pub fn decode_to_tensor<B: Backend>(
    vae: &AutoencoderKL<B>,
    latents: &Tensor<B, 4>,
) -> Result<Tensor<B, 4>> {
    crate::offload::before_decoding(vae);
    let device = vae.decoder.conv_in.weight.device();
    let decoded = vae.decode_scaled(latents.clone().to_device(&device));
    guard::ensure_finite(&decoded, Stage::VaeDecode)?;
    Ok(decoded)
}

/// [`decode_to_tensor`] and the post-processing to images, unless only latents were asked for.
pub fn decode_latents<B: Backend>(
    vae: &AutoencoderKL<B>,
    latents: &Tensor<B, 4>,
    output: OutputType,
) -> Result<Option<Images>> {
    match output {
        OutputType::Latents => Ok(None),
        OutputType::Images => Ok(Some(postprocess(decode_to_tensor(vae, latents)?)?)),
    }
}
