//! `StableDiffusionPipeline`: text to image with SD 1.x and 2.x, step for step as diffusers'
//! `pipeline_stable_diffusion.py`.
//!
//! Prompt -> CLIP tokenizer -> CLIP text encoder; latents from the generator (or the caller);
//! the scheduler loop with classifier-free guidance batched in one UNet call; the VAE decode.

use std::path::{Path, PathBuf};

use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor, TensorData};
use oxidiff_backend_tpu::spmd::{DeviceWeightBytes, Layout, SpmdPlacement};
use oxidiff_backend_tpu::{CompiledFn, Oxi};
use oxidiff_models::{
    AutoencoderKL, ClipTextModel, ClipTokenizer, ToDevice, UNet2DConditionConfig,
    UNet2DConditionModel,
};
use oxidiff_parallel::ParallelConfig;
use oxidiff_schedulers::{
    scheduler_from_config, NoiseSource, Scheduler, SchedulerConfig, TorchCpuGenerator,
};
use std::collections::BTreeMap;
use std::sync::Arc;

use crate::error::{PipelineError, Result};
use crate::guard::{self, CancelToken, Stage};
use crate::image::{postprocess, Images};
use crate::stable_diffusion_inpaint::InpaintCondition;

/// The pipeline classes this type loads (`_class_name` in `model_index.json`).
pub const SUPPORTED_CLASSES: [&str; 3] = [
    "StableDiffusionPipeline",
    "StableDiffusionImg2ImgPipeline",
    "StableDiffusionInpaintPipeline",
];

/// How a pipeline is loaded.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// Weight file variant, e.g. `fp16` for `diffusion_pytorch_model.fp16.safetensors`.
    pub variant: Option<String>,
    /// Replace the checkpoint's scheduler (keeping its betas config): a diffusers class name or
    /// a short/A1111 name, with A1111's option words (`ddim`, `euler_a`, `DPM++ 2M Karras`).
    pub scheduler: Option<String>,
    /// Cast the weights to this float dtype after loading (diffusers' `torch_dtype`); `None`
    /// keeps f32 (weights stored as f16/bf16 are read into f32). Stable Diffusion, SDXL, Flux,
    /// SD3 and PixArt compute in it and keep latents and scheduler math in f32.
    pub dtype: Option<FloatDType>,
}

/// What the pipeline returns.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum OutputType {
    /// 8-bit RGB images (and the float arrays they come from).
    #[default]
    Images,
    /// Only the final latents; the VAE is not run.
    Latents,
}

/// One text-to-image request; `Default` gives diffusers' defaults (50 steps, guidance 7.5).
#[derive(Debug, Clone)]
pub struct GenerateRequest<B: Backend> {
    pub prompts: Vec<String>,
    /// One negative prompt for all prompts, one per prompt, or none (empty string).
    pub negative_prompts: Vec<String>,
    pub num_inference_steps: usize,
    pub guidance_scale: f64,
    /// Defaults to the UNet's `sample_size` times the VAE scale factor.
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
}

impl<B: Backend> Default for GenerateRequest<B> {
    fn default() -> Self {
        Self {
            prompts: Vec::new(),
            negative_prompts: Vec::new(),
            num_inference_steps: 50,
            guidance_scale: 7.5,
            width: None,
            height: None,
            num_images_per_prompt: 1,
            seed: 0,
            latents: None,
            eta: 0.0,
            output: OutputType::Images,
            cancel: None,
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

/// One denoiser evaluation with classifier-free guidance, as diffusers' loop does it: when
/// `context` holds twice as many rows as `sample` (negative prompts first), the UNet runs once
/// on the batch `[sample; sample]` and the two halves are combined as
/// `uncond + guidance * (text - uncond)`; otherwise it is the plain UNet call and `guidance` is
/// unused. `sample` is already scaled by the scheduler (`scale_model_input`); `guidance` is a
/// `[1]` tensor, so in compiled mode it is a runtime input, not a constant. The eager loop and
/// the compiled step both run this function.
pub fn guided_noise<B: Backend>(
    unet: &UNet2DConditionModel<B>,
    sample: Tensor<B, 4>,
    timestep: Tensor<B, 1>,
    context: Tensor<B, 3>,
    guidance: Tensor<B, 1>,
) -> Tensor<B, 4> {
    let batch = sample.dims()[0];
    if context.dims()[0] != 2 * batch {
        return unet.forward(sample, timestep, context);
    }
    let noise_pred = unet.forward(
        Tensor::cat(vec![sample.clone(), sample], 0),
        timestep,
        context,
    );
    let uncond = noise_pred.clone().narrow(0, 0, batch);
    let text = noise_pred.narrow(0, batch, batch);
    uncond.clone() + (text - uncond) * guidance.reshape([1, 1, 1, 1])
}

/// The guided denoiser call ([`guided_noise`]) run some other way than eagerly, e.g. as one
/// compiled XLA program ([`StableDiffusionPipeline::compile`]).
pub trait Denoiser<B: Backend> {
    /// [`guided_noise`] of the pipeline's UNet.
    fn guided_noise(
        &self,
        sample: Tensor<B, 4>,
        timestep: Tensor<B, 1>,
        context: Tensor<B, 3>,
        guidance: Tensor<B, 1>,
    ) -> Result<Tensor<B, 4>>;

    /// What was compiled so far.
    fn compile_stats(&self) -> CompileStats;

    /// The device mesh and weight shards, when the denoiser runs partitioned
    /// ([`StableDiffusionPipeline::enable_parallelism`]).
    fn spmd_placement(&self) -> Option<&Arc<SpmdPlacement>> {
        None
    }

    /// Opcode counts of each compiled program's optimized HLO (the collectives of a
    /// partitioned one among them); empty when not compiled by XLA here.
    fn optimized_opcode_counts(&self) -> Result<Vec<BTreeMap<String, usize>>> {
        Ok(Vec::new())
    }
}

/// Counts of compiled mode ([`StableDiffusionPipeline::compile_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CompileStats {
    /// Programs built, one per input signature (image size, batch, guidance on or off).
    pub programs: u64,
    /// Of those, how many XLA compiled; the others were loaded from the on-disk cache.
    pub xla_compiles: u64,
    pub disk_loads: u64,
}

/// Stable Diffusion 1.x/2.x text-to-image.
pub struct StableDiffusionPipeline<B: Backend> {
    pub tokenizer: ClipTokenizer,
    pub text_encoder: ClipTextModel<B>,
    pub unet: UNet2DConditionModel<B>,
    pub vae: AutoencoderKL<B>,
    pub scheduler_config: SchedulerConfig,
    pub scheduler: Box<dyn Scheduler<B>>,
    pub vae_scale_factor: usize,
    /// The UNet's native latent size, for the default width and height.
    pub sample_size: usize,
    /// Where latents live and the denoising loop runs: the UNet's device.
    pub device: B::Device,
    pub source: PathBuf,
    /// The compiled denoiser, when [`compile`](Self::compile) was called.
    pub compiled: Option<Box<dyn Denoiser<B>>>,
}

impl<B: Backend> StableDiffusionPipeline<B> {
    /// Loads a diffusers-format folder, or a Hub id from the local cache (downloading it when
    /// online and not cached).
    pub fn from_pretrained(spec: &str, options: &LoadOptions, device: &B::Device) -> Result<Self> {
        let dir = crate::hub::resolve_model(spec, options.variant.as_deref())?;
        Self::from_dir(&dir, options, device)
    }

    /// Loads a diffusers-format pipeline folder.
    pub fn from_dir(dir: &Path, options: &LoadOptions, device: &B::Device) -> Result<Self> {
        crate::loading::check_pipeline_class(dir, &SUPPORTED_CLASSES)?;
        let component = |name: &str| crate::loading::component(dir, name);
        let variant = options.variant.as_deref();
        let tokenizer = ClipTokenizer::from_dir(&component("tokenizer")?)?;
        let text_encoder =
            ClipTextModel::from_dir(&component("text_encoder")?, false, variant, device)?;
        let unet_dir = component("unet")?;
        let unet_config = UNet2DConditionConfig::from_file(&unet_dir.join("config.json"))?;
        let unet = UNet2DConditionModel::from_dir(&unet_dir, variant, device)?;
        if unet.needs_added_condition() {
            return Err(PipelineError::UnsupportedPipeline {
                path: unet_dir.join("config.json"),
                class: "UNet2DConditionModel with `addition_embed_type: text_time`".into(),
                supported: "an SDXL UNet: load the folder with StableDiffusionXLPipeline".into(),
            });
        }
        let vae_dir = component("vae")?;
        let vae_config =
            oxidiff_models::AutoencoderKLConfig::from_file(&vae_dir.join("config.json"))?;
        let vae = AutoencoderKL::from_dir(&vae_dir, variant, device)?;
        let (scheduler_config, scheduler) = crate::loading::load_scheduler(dir, options)?;
        let sample_size = match &unet_config.sample_size {
            Some(oxidiff_models::config::PerBlock::One(s)) => *s,
            Some(oxidiff_models::config::PerBlock::Each(v)) => v.first().copied().unwrap_or(64),
            None => 64,
        };
        let cast = crate::loading::Cast(options.dtype);
        Ok(Self {
            tokenizer,
            text_encoder: cast.apply(text_encoder),
            unet: cast.apply(unet),
            vae: cast.apply(vae),
            scheduler_config,
            scheduler,
            vae_scale_factor: vae_config.scale_factor(),
            sample_size,
            device: device.clone(),
            source: dir.to_path_buf(),
            compiled: None,
        })
    }

    /// The device the text encoder runs on.
    pub fn text_encoder_device(&self) -> B::Device {
        self.text_encoder.token_embedding.weight.device()
    }

    /// The device the UNet (and the denoising loop) runs on.
    pub fn unet_device(&self) -> B::Device {
        self.unet.conv_in.weight.device()
    }

    /// The device the VAE runs on.
    pub fn vae_device(&self) -> B::Device {
        self.vae.decoder.conv_in.weight.device()
    }

    /// Places each component on its own device, as TPU users do when a whole pipeline does not
    /// fit one chip (for example the text encoder on the CPU and the UNet on the TPU).
    #[must_use]
    pub fn to_components(
        mut self,
        text_encoder: &B::Device,
        unet: &B::Device,
        vae: &B::Device,
    ) -> Self {
        self.text_encoder = self.text_encoder.to(text_encoder);
        self.unet = self.unet.to(unet);
        self.vae = self.vae.to(vae);
        self.device = unet.clone();
        // A compiled denoiser holds the UNet of its device: compile again after moving.
        self.compiled = None;
        self
    }

    /// Fuses a LoRA file (diffusers/PEFT or kohya/A1111 format) into the UNet and the text
    /// encoder at `scale`, as diffusers' `load_lora_weights(path)` + `fuse_lora(lora_scale=scale)`:
    /// `W += scale * alpha / rank * up @ down`. Call it several times for several LoRAs, before
    /// [`compile`](StableDiffusionPipeline::compile). Keys that fit no layer are an error naming
    /// them, and the pipeline is left unchanged.
    pub fn load_lora(
        &mut self,
        path: impl AsRef<Path>,
        scale: f32,
    ) -> Result<crate::lora::LoraReport> {
        crate::lora::fuse_into(
            path.as_ref(),
            scale,
            crate::lora::Denoiser::unet(&mut self.unet),
            &mut [(
                oxidiff_models::lora::LoraComponent::TextEncoder,
                &mut self.text_encoder,
            )],
            "Stable Diffusion pipeline",
            self.compiled.is_some(),
        )
    }

    /// Swaps the scheduler for another algorithm, keeping the checkpoint's betas config
    /// (diffusers' `XScheduler.from_config(pipe.scheduler.config)`); `name` as in
    /// [`LoadOptions::scheduler`].
    pub fn set_scheduler(&mut self, name: &str) -> Result<()> {
        let config = self.scheduler_config.switched_to_named(name)?;
        self.scheduler = scheduler_from_config(&config)?;
        self.scheduler_config = config;
        Ok(())
    }

    /// The default image size: the UNet's `sample_size` times the VAE factor (512 for SD 1.5).
    pub fn default_size(&self) -> usize {
        self.sample_size * self.vae_scale_factor
    }

    /// Encodes prompts to CLIP hidden states `[n * images_per_prompt, 77, dim]`.
    pub fn encode_prompts(
        &self,
        prompts: &[String],
        images_per_prompt: usize,
    ) -> Result<Tensor<B, 3>> {
        let mut rows = Vec::with_capacity(prompts.len() * images_per_prompt);
        for prompt in prompts {
            let encoded = self.tokenizer.encode(prompt)?;
            if encoded.truncated {
                let kept = self.tokenizer.decode(&encoded.ids).unwrap_or_default();
                tracing::warn!(
                    "the prompt is longer than CLIP's {} tokens and was cut; only this part is used: {kept:?}",
                    self.tokenizer.max_length()
                );
            }
            for _ in 0..images_per_prompt {
                rows.push(encoded.ids.clone());
            }
        }
        Ok(self.text_encoder.forward(&rows, false)?.last_hidden_state)
    }

    /// The UNet's text context for a request: the prompts' embeddings, preceded (with
    /// guidance) by the negative prompts' (an empty string when none is given).
    pub fn encode_context(&self, req: &GenerateRequest<B>) -> Result<Tensor<B, 3>> {
        let prompt_embeds = self.encode_prompts(&req.prompts, req.num_images_per_prompt)?;
        if req.guidance_scale <= 1.0 {
            return Ok(prompt_embeds);
        }
        let negatives = crate::loading::negatives_for(req);
        let negative_embeds = self.encode_prompts(&negatives, req.num_images_per_prompt)?;
        Ok(Tensor::cat(vec![negative_embeds, prompt_embeds], 0))
    }

    fn validate(&self, req: &GenerateRequest<B>) -> Result<(usize, usize)> {
        let default = self.default_size();
        crate::loading::check_request(req, (default, default), self.vae_scale_factor)
    }

    /// Generates with the default generator seeded by `req.seed`.
    pub fn generate(&mut self, req: &GenerateRequest<B>) -> Result<PipelineOutput<B>> {
        let mut generator = TorchCpuGenerator::new(req.seed);
        self.generate_with(req, &mut generator, |_| {})
    }

    /// Generates with the given noise source (initial latents and scheduler noise are drawn from
    /// it, in that order) and a callback after every step.
    pub fn generate_with(
        &mut self,
        req: &GenerateRequest<B>,
        noise: &mut dyn NoiseSource<B>,
        mut callback: impl FnMut(StepInfo<'_, B>),
    ) -> Result<PipelineOutput<B>> {
        let (width, height) = self.validate(req)?;
        let batch = req.prompts.len() * req.num_images_per_prompt;
        let context = self.encode_context(req)?.to_device(&self.device);
        self.scheduler.set_timesteps(req.num_inference_steps)?;
        self.scheduler.set_eta(req.eta);
        let f = self.vae_scale_factor;
        let latents = crate::loading::initial_latents(
            req,
            [batch, 4, height / f, width / f],
            (width, height),
            noise,
            self.scheduler.init_noise_sigma(),
            &self.device,
        )?;
        let timesteps = self.scheduler.timesteps().to_vec();
        self.denoise_and_decode(
            &timesteps,
            latents,
            &context,
            None,
            req,
            noise,
            &mut callback,
        )
    }

    /// The denoising loop over `timesteps` from `latents` with the UNet (compiled or eager) and
    /// the text `context`, then the VAE decode; text-to-image, image-to-image and inpainting
    /// (`inpaint`: extra UNet input channels or the masked-latent blend) share it.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn denoise_and_decode(
        &mut self,
        timesteps: &[f64],
        latents: Tensor<B, 4>,
        context: &Tensor<B, 3>,
        inpaint: Option<&InpaintCondition<B>>,
        req: &GenerateRequest<B>,
        noise: &mut dyn NoiseSource<B>,
        callback: &mut impl FnMut(StepInfo<'_, B>),
    ) -> Result<PipelineOutput<B>> {
        crate::stable_diffusion_inpaint::check_unet_input(&self.unet, &latents, inpaint)?;
        let (unet, compiled) = (&self.unet, &self.compiled);
        let mut blended;
        let scheduler: &mut dyn Scheduler<B> = match inpaint {
            Some(condition) => {
                blended = condition.scheduler(&mut *self.scheduler, timesteps);
                &mut blended
            }
            None => &mut *self.scheduler,
        };
        let latents = denoising_loop(
            scheduler,
            timesteps,
            latents,
            req,
            &self.device,
            noise,
            |model_input, timestep, guidance| {
                let model_input = InpaintCondition::unet_input(inpaint, model_input);
                match compiled {
                    Some(denoiser) => {
                        denoiser.guided_noise(model_input, timestep, context.clone(), guidance)
                    }
                    None => Ok(guided_noise(
                        unet,
                        model_input,
                        timestep,
                        context.clone(),
                        guidance,
                    )),
                }
            },
            callback,
        )?;
        let images = decode_latents(&self.vae, &latents, req.output)?;
        Ok(PipelineOutput { latents, images })
    }
}

/// The scheduler loop shared by the pipelines: the scaled model input, the guided denoiser
/// call `denoise(sample, timestep, guidance)` (classifier-free guidance is the denoiser's:
/// [`guided_noise`], or [`with_guidance`] around another call), the scheduler step, the NaN
/// guard, the callback and cancellation, over `timesteps` (possibly a prefix of the
/// scheduler's, for `denoising_end`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn denoising_loop<B: Backend>(
    scheduler: &mut dyn Scheduler<B>,
    timesteps: &[f64],
    mut latents: Tensor<B, 4>,
    req: &GenerateRequest<B>,
    device: &B::Device,
    noise: &mut dyn NoiseSource<B>,
    mut denoise: impl FnMut(Tensor<B, 4>, Tensor<B, 1>, Tensor<B, 1>) -> Result<Tensor<B, 4>>,
    callback: &mut impl FnMut(StepInfo<'_, B>),
) -> Result<Tensor<B, 4>> {
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
        latents = scheduler.step(noise_pred, t, latents, noise)?;
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

/// Classifier-free guidance around a denoiser `f` that sees the doubled batch
/// `[sample; sample]` (its context holds the negative prompts first), for pipelines whose
/// denoiser call is not [`guided_noise`]: `uncond + scale * (text - uncond)`, or the plain call
/// when `scale <= 1`.
pub(crate) fn with_guidance<B: Backend>(
    sample: Tensor<B, 4>,
    scale: f64,
    f: impl FnOnce(Tensor<B, 4>) -> Result<Tensor<B, 4>>,
) -> Result<Tensor<B, 4>> {
    if scale <= 1.0 {
        return f(sample);
    }
    let batch = sample.dims()[0];
    let prediction = f(Tensor::cat(vec![sample.clone(), sample], 0))?;
    Ok(crate::loading::guide(prediction, batch, scale))
}

/// Undoes the VAE scaling, decodes on the VAE's device and post-processes (unless only
/// latents were asked for).
pub(crate) fn decode_latents<B: Backend>(
    vae: &AutoencoderKL<B>,
    latents: &Tensor<B, 4>,
    output: OutputType,
) -> Result<Option<Images>> {
    match output {
        OutputType::Latents => Ok(None),
        OutputType::Images => {
            let device = vae.decoder.conv_in.weight.device();
            let on_vae = latents.clone().to_device(&device);
            let decoded = vae.decode_scaled(on_vae);
            guard::ensure_finite(&decoded, Stage::VaeDecode)?;
            Ok(Some(postprocess(decoded)?))
        }
    }
}

impl<B: Backend> ToDevice<B> for StableDiffusionPipeline<B> {
    /// Moves every component to `device`: `pipe.to(&"tpu".parse()?)`.
    fn to(self, device: &B::Device) -> Self {
        self.to_components(device, device, device)
    }
}

/// The compiled step's inputs: scaled latents, timestep, text context, guidance scale.
type StepInputs = (
    Tensor<Oxi, 4>,
    Tensor<Oxi, 1>,
    Tensor<Oxi, 3>,
    Tensor<Oxi, 1>,
);
type StepFn = Box<dyn Fn(StepInputs) -> Tensor<Oxi, 4>>;
type GuidedStep = CompiledFn<StepInputs, Tensor<Oxi, 4>, StepFn>;

impl Denoiser<Oxi> for GuidedStep {
    fn guided_noise(
        &self,
        sample: Tensor<Oxi, 4>,
        timestep: Tensor<Oxi, 1>,
        context: Tensor<Oxi, 3>,
        guidance: Tensor<Oxi, 1>,
    ) -> Result<Tensor<Oxi, 4>> {
        self.call((sample, timestep, context, guidance))
            .map_err(|e| PipelineError::Compile(e.to_string()))
    }

    fn compile_stats(&self) -> CompileStats {
        CompileStats {
            programs: self.compiles(),
            xla_compiles: self.xla_compiles(),
            disk_loads: self.disk_loads(),
        }
    }

    fn spmd_placement(&self) -> Option<&Arc<SpmdPlacement>> {
        CompiledFn::spmd_placement(self)
    }

    fn optimized_opcode_counts(&self) -> Result<Vec<BTreeMap<String, usize>>> {
        CompiledFn::optimized_opcode_counts(self).map_err(|e| PipelineError::Compile(e.to_string()))
    }
}

impl StableDiffusionPipeline<Oxi> {
    /// Compiled mode: from the next generation on, each denoising step's UNet call and
    /// classifier-free guidance ([`guided_noise`]: both halves batched, then combined) are one
    /// XLA program, traced and compiled on first use and cached by input shapes. Timestep and
    /// guidance scale are runtime inputs and the weights are device buffers passed in, so a new
    /// prompt, seed, guidance scale, scheduler or step count reuses the program; a new size or
    /// batch, or switching guidance on or off (the context's batch changes), compiles once
    /// more. With `OXIDIFF_COMPILE_CACHE=DIR` executables are also kept on disk for later
    /// processes. Needs the UNet on a PJRT device (`xla:cpu`, `tpu`, `cuda`); the scheduler
    /// step and the VAE stay eager.
    pub fn compile(&mut self) -> Result<()> {
        crate::parallel::require_pjrt("UNet", &self.unet_device())?;
        let unet = self.unet.clone();
        // The traced structure depends only on the input shapes (guidance on or off is the
        // context's batch), which key the program cache, so a cached program always matches.
        let step: StepFn = Box::new(move |(sample, timestep, context, guidance)| {
            guided_noise(&unet, sample, timestep, context, guidance)
        });
        let compiled: GuidedStep = CompiledFn::new("unet+cfg", step);
        self.compiled = Some(Box::new(compiled));
        Ok(())
    }

    /// Spreads the compiled denoising step over several devices, as diffusers'
    /// `pipe.enable_parallelism(config)`: tensor parallelism splits the UNet's transformer
    /// blocks (its [plan](oxidiff_models::TensorParallel)) over `tp_degree` devices, data
    /// parallelism splits each step's batch (latents and text context) over `dp_degree`; both
    /// form one `dp x tp` mesh of devices from the UNet's device on. The step is then one XLA
    /// program partitioned by GSPMD (XLA inserts the all-reduces), replacing
    /// [`compile`](Self::compile)'s; results come back to the UNet's device, where the
    /// scheduler and the VAE run as before. The split weights leave the UNet's device: each
    /// device holds its shard ([`parallel_weight_bytes`](Self::parallel_weight_bytes)).
    /// Errors, before anything moves: a degree that does not divide every sharded layer's
    /// heads and feed-forward width, more devices than the platform has, a UNet not on a PJRT
    /// device.
    pub fn enable_parallelism(&mut self, config: impl Into<ParallelConfig>) -> Result<()> {
        let device = self.unet_device();
        let placement =
            crate::parallel::enable_parallelism(&mut self.unet, &device, config.into())?;
        let unet = self.unet.clone();
        let step: StepFn = Box::new(move |(sample, timestep, context, guidance)| {
            guided_noise(&unet, sample, timestep, context, guidance)
        });
        // Latents and context split by batch (data parallel); timestep and scale whole.
        let inputs = vec![
            Layout::BatchSplit(0),
            Layout::Replicated,
            Layout::BatchSplit(0),
            Layout::Replicated,
        ];
        let compiled: GuidedStep = CompiledFn::new("unet+cfg", step).with_spmd(placement, inputs);
        self.compiled = Some(Box::new(compiled));
        Ok(())
    }

    /// Weight bytes on each device of the mesh after
    /// [`enable_parallelism`](Self::enable_parallelism) (`None` otherwise): the split
    /// weights' shards, and the replicated ones once the first step ran.
    pub fn parallel_weight_bytes(&self) -> Option<Vec<DeviceWeightBytes>> {
        let placement = self.compiled.as_ref()?.spmd_placement()?;
        Some(placement.weight_bytes())
    }

    /// Programs compiled so far in compiled mode (`None` when eager).
    pub fn compiles(&self) -> Option<u64> {
        self.compiled.as_ref().map(|c| c.compile_stats().programs)
    }

    /// Compiled mode's counts (`None` when eager).
    pub fn compile_stats(&self) -> Option<CompileStats> {
        self.compiled.as_ref().map(|c| c.compile_stats())
    }
}
