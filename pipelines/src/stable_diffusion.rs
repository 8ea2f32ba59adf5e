//! `StableDiffusionPipeline`: text to image with SD 1.x and 2.x, step for step as diffusers'
//! `pipeline_stable_diffusion.py`.
//!
//! Prompt -> CLIP tokenizer -> CLIP text encoder; latents from the generator (or the caller);
//! the scheduler loop with classifier-free guidance batched in one UNet call; the VAE decode.

use std::path::{Path, PathBuf};

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use oxidiff_backend_tpu::spmd::{DeviceWeightBytes, Layout, SpmdPlacement};
use oxidiff_backend_tpu::Oxi;
use oxidiff_models::{
    AutoencoderKL, ClipTextModel, ClipTokenizer, ToDevice, UNet2DConditionConfig,
    UNet2DConditionModel,
};
use oxidiff_parallel::ParallelConfig;
use oxidiff_schedulers::{
    scheduler_from_config, NoiseSource, Scheduler, SchedulerConfig, TorchCpuGenerator,
};
use std::sync::Arc;

use crate::compiled::{CompileStats, CompiledCall, ComponentStats, SchedulerProgram, WarmStart};
use crate::control::ControlStep;
use crate::denoise::{
    check_request, decode_latents, negatives_for, DenoisingLoop, GenerateRequest, PipelineDefaults,
    PipelineOutput, StepInfo,
};
use crate::error::{PipelineError, Result};
use crate::inpaint::{check_unet_input, InpaintCondition};
use crate::ip_adapter::{append_image_tokens, IpAdapter};
use crate::loading::LoadOptions;
use crate::memory::{component_memory, ComponentMemory, PlaceName};
use crate::offload::Offload;
use crate::truncation::warn_if_clip_cut;

/// The pipeline classes this type loads (`_class_name` in `model_index.json`).
pub const SUPPORTED_CLASSES: [&str; 3] = [
    "StableDiffusionPipeline",
    "StableDiffusionImg2ImgPipeline",
    "StableDiffusionInpaintPipeline",
];

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
    combine_halves(noise_pred, batch, guidance)
}

/// `uncond + guidance * (text - uncond)` over a doubled batch's prediction (negative half
/// first), `guidance` a `[1]` tensor (a runtime input of compiled steps).
pub(crate) fn combine_halves<B: Backend>(
    prediction: Tensor<B, 4>,
    batch: usize,
    guidance: Tensor<B, 1>,
) -> Tensor<B, 4> {
    let uncond = prediction.clone().narrow(0, 0, batch);
    let text = prediction.narrow(0, batch, batch);
    uncond.clone() + (text - uncond) * guidance.reshape([1, 1, 1, 1])
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
    pub compiled: Option<CompiledCall<B, GuidedStepInputs<B>>>,
    /// Compiled mode's scheduler step, when the pipeline was compiled.
    pub scheduler_program: Option<SchedulerProgram<B>>,
    /// The attached IP-Adapter ([`load_ip_adapter`](Self::load_ip_adapter)).
    pub ip_adapter: Option<IpAdapter<B>>,
    /// What is handed back between requests ([`Offload::TextEncoders`]: the text encoder,
    /// after each request's prompts are encoded).
    pub offload: Offload,
}

impl<B: Backend> StableDiffusionPipeline<B> {
    /// The denoiser's device mesh and weight shards, after `enable_parallelism`.
    pub fn spmd_placement(
        &self,
    ) -> Option<&std::sync::Arc<oxidiff_backend_tpu::spmd::SpmdPlacement>> {
        self.compiled.as_ref()?.spmd_placement()
    }

    /// What each component's weights hold and where (`place` names a device): `txt2img
    /// --json`'s `memory`.
    pub fn memory(&self, place: PlaceName<'_, B::Device>) -> Vec<ComponentMemory> {
        let mut all = vec![
            component_memory("text_encoder", &self.text_encoder, None, place),
            component_memory("unet", &self.unet, None, place),
            component_memory("vae", &self.vae, None, place),
        ];
        if let Some(adapter) = &self.ip_adapter {
            all.extend(adapter.memory(place));
        }
        all
    }

    /// Loads a diffusers-format folder, or a Hub id from the local cache (downloading it when
    /// online and not cached).
    pub fn from_pretrained(spec: &str, options: &LoadOptions, device: &B::Device) -> Result<Self> {
        let dir = crate::hub::resolve_model(spec, options.variant.as_deref())?;
        Self::from_dir(&dir, options, device)
    }

    /// Loads a diffusers-format pipeline folder.
    pub fn from_dir(dir: &Path, options: &LoadOptions, device: &B::Device) -> Result<Self> {
        options.refuse_transformer_file("Stable Diffusion")?;
        crate::loading::check_pipeline_class(dir, &SUPPORTED_CLASSES)?;
        let component = |name: &str| crate::loading::component(dir, name);
        let variant = options.variant.as_deref();
        let dtype = options.weights_dtype();
        let tokenizer = ClipTokenizer::from_dir(&component("tokenizer")?)?;
        let text_encoder =
            ClipTextModel::from_dir_in(&component("text_encoder")?, false, variant, dtype, device)?;
        let unet_dir = component("unet")?;
        let unet_config = UNet2DConditionConfig::from_file(&unet_dir.join("config.json"))?;
        let unet = UNet2DConditionModel::from_dir_in(&unet_dir, variant, dtype, device)?;
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
        let vae = AutoencoderKL::from_dir_in(&vae_dir, variant, dtype, device)?;
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
            scheduler_program: None,
            offload: Offload::default(),
            ip_adapter: None,
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
        self.ip_adapter = self.ip_adapter.map(|a| a.to_device(unet));
        // A compiled denoiser holds the UNet of its device: compile again after moving.
        self.compiled = None;
        self.scheduler_program = None;
        // The VAE's and text encoders' programs too (they hold the weights they were built for).
        self.vae.clear_programs();
        self.text_encoder.layers_program.clear();
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

    /// diffusers' `__call__` defaults (steps, guidance) of this pipeline; `.request()` gives a
    /// request with them.
    pub fn defaults(&self) -> PipelineDefaults {
        PipelineDefaults::STABLE_DIFFUSION
    }

    /// A request with diffusers' defaults (`GenerateRequest::default()`).
    pub fn default_request(&self) -> GenerateRequest<B> {
        self.defaults().request()
    }

    /// Encodes prompts to CLIP hidden states `[n * images_per_prompt, 77, dim]` (then hands
    /// the text encoder back, as [`offload`](Self::offload) says).
    pub fn encode_prompts(
        &self,
        prompts: &[String],
        images_per_prompt: usize,
    ) -> Result<Tensor<B, 3>> {
        let encoded = self.encode_prompts_kept(prompts, images_per_prompt);
        self.offload.after_encoding(&self.text_encoder);
        encoded
    }

    /// [`encode_prompts`](Self::encode_prompts) without the offload.
    fn encode_prompts_kept(
        &self,
        prompts: &[String],
        images_per_prompt: usize,
    ) -> Result<Tensor<B, 3>> {
        let mut rows = Vec::with_capacity(prompts.len() * images_per_prompt);
        for prompt in prompts {
            let encoded = self.tokenizer.encode(prompt)?;
            warn_if_clip_cut(&self.tokenizer, &encoded);
            for _ in 0..images_per_prompt {
                rows.push(encoded.ids.clone());
            }
        }
        Ok(self.text_encoder.forward(&rows, false)?.last_hidden_state)
    }

    /// The UNet's text context for a request: the prompts' embeddings, preceded (with
    /// guidance) by the negative prompts' (an empty string when none is given); with an
    /// IP-Adapter, each row ends with the image tokens of `req.ip_adapter_image`.
    /// The text encoder is handed back after both, as [`offload`](Self::offload) says.
    pub fn encode_context(&self, req: &GenerateRequest<B>) -> Result<Tensor<B, 3>> {
        let encoded = self.encode_both(req);
        self.offload.after_encoding(&self.text_encoder);
        append_image_tokens(
            self.ip_adapter.as_ref(),
            req.ip_adapter_image.as_ref(),
            encoded?,
            req.does_guidance(),
        )
    }

    /// The prompts' embeddings, preceded (with guidance) by the negative prompts'.
    fn encode_both(&self, req: &GenerateRequest<B>) -> Result<Tensor<B, 3>> {
        let prompt_embeds = self.encode_prompts_kept(&req.prompts, req.num_images_per_prompt)?;
        if !req.does_guidance() {
            return Ok(prompt_embeds);
        }
        let negatives = negatives_for(req)?;
        let negative_embeds = self.encode_prompts_kept(&negatives, req.num_images_per_prompt)?;
        Ok(Tensor::cat(vec![negative_embeds, prompt_embeds], 0))
    }

    /// Attaches an IP-Adapter weight file (h94 layout, safetensors), as diffusers'
    /// `load_ip_adapter`, at scale 1: its image branches go into the UNet's cross-attentions,
    /// and each request then needs an `ip_adapter_image`. `image_encoder` is the
    /// `CLIPVisionModelWithProjection` folder; without one, `image_encoder/` next to the file,
    /// then in the model folder. A second call replaces the adapter. Before
    /// [`compile`](Self::compile).
    pub fn load_ip_adapter(&mut self, file: &Path, image_encoder: Option<&Path>) -> Result<()> {
        let compiled = self.compiled.is_some();
        crate::ip_adapter::attach(
            &mut self.ip_adapter,
            &mut self.unet,
            &self.source,
            file,
            image_encoder,
            compiled,
        )
    }

    /// The weight of the image branches (diffusers' `set_ip_adapter_scale`; 0 turns the image
    /// prompt off).
    pub fn set_ip_adapter_scale(&mut self, scale: f64) -> Result<()> {
        let compiled = self.compiled.is_some();
        crate::ip_adapter::set_scale(&mut self.ip_adapter, &mut self.unet, scale, compiled)
    }

    /// Removes the IP-Adapter (diffusers' `unload_ip_adapter`).
    pub fn unload_ip_adapter(&mut self) -> Result<()> {
        let compiled = self.compiled.is_some();
        crate::ip_adapter::detach(&mut self.ip_adapter, &mut self.unet, compiled)
    }

    fn validate(&self, req: &GenerateRequest<B>) -> Result<(usize, usize)> {
        let default = self.default_size();
        check_request(req, (default, default), self.vae_scale_factor)
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
        let latents = crate::denoise::initial_latents(
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
        control: Option<&ControlStep<'_, B>>,
        req: &GenerateRequest<B>,
        noise: &mut dyn NoiseSource<B>,
        callback: &mut impl FnMut(StepInfo<'_, B>),
    ) -> Result<PipelineOutput<B>> {
        check_unet_input(&self.unet, &latents, inpaint)?;
        let (unet, compiled) = (&self.unet, &self.compiled);
        let mut step = 0;
        let mut blended;
        let scheduler: &mut dyn Scheduler<B> = match inpaint {
            Some(condition) => {
                blended = condition.scheduler(&mut *self.scheduler, timesteps);
                &mut blended
            }
            None => &mut *self.scheduler,
        };
        let latents = DenoisingLoop {
            scheduler,
            timesteps,
            latents,
            req,
            device: &self.device,
            noise,
            step_program: self.scheduler_program.as_ref(),
        }
        .run(
            |model_input, timestep, guidance| {
                // The loop calls this once per step, in order.
                let i = step;
                step += 1;
                if let Some(control) = control {
                    return control.noise(
                        unet,
                        i,
                        model_input,
                        inpaint,
                        timestep,
                        context,
                        guidance,
                    );
                }
                let model_input = InpaintCondition::unet_input(inpaint, model_input);
                match compiled {
                    Some(denoiser) => {
                        denoiser.call((model_input, timestep, context.clone(), guidance))
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

impl<B: Backend> ToDevice<B> for StableDiffusionPipeline<B> {
    /// Moves every component to `device`: `pipe.to(&"tpu".parse()?)`.
    fn to(self, device: &B::Device) -> Self {
        self.to_components(device, device, device)
    }
}

/// The compiled step's inputs ([`guided_noise`]'s): scaled latents, timestep, text context,
/// guidance scale.
pub type GuidedStepInputs<B> = (Tensor<B, 4>, Tensor<B, 1>, Tensor<B, 3>, Tensor<B, 1>);

impl StableDiffusionPipeline<Oxi> {
    /// Compiled mode: from the next generation on, each denoising step's UNet call and
    /// classifier-free guidance ([`guided_noise`]: both halves batched, then combined) are one
    /// XLA program, traced and compiled on first use and cached by input shapes. Timestep and
    /// guidance scale are runtime inputs and the weights are device buffers passed in, so a new
    /// prompt, seed, guidance scale, scheduler or step count reuses the program; a new size or
    /// batch, or switching guidance on or off (the context's batch changes), compiles once
    /// more. With `OXIDIFF_COMPILE_CACHE=DIR` executables are also kept on disk for later
    /// processes. The VAE's encoder and decoder become programs too
    /// ([`compile_vae`](crate::compiled::compile_vae)), and so do the text encoder's layers
    /// and the scheduler step ([`SchedulerProgram`]: one program per step structure, its
    /// scalars as arguments, so no step, step count or scheduler config recompiles). Needs the
    /// UNet on a PJRT device (`xla:cpu`, `tpu`, `cuda`).
    pub fn compile(&mut self) -> Result<()> {
        crate::parallel::require_pjrt("UNet", &self.unet_device())?;
        self.compile_on(None);
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
        crate::ip_adapter::refuse_parallel(self.ip_adapter.as_ref())?;
        let device = self.unet_device();
        let placement =
            crate::parallel::enable_parallelism(&mut self.unet, &device, config.into())?;
        self.compile_on(Some(placement));
        Ok(())
    }

    pub(crate) fn compile_on(&mut self, placement: Option<Arc<SpmdPlacement>>) {
        self.scheduler_program = Some(SchedulerProgram::new());
        crate::compiled::compile_vae(&mut self.vae);
        crate::compiled::compile_clip(&mut self.text_encoder, "text_encoder");
        let unet = self.unet.clone();
        let warm = WarmStart::of("unet", &unet, self.unet_device());
        // The traced structure depends only on the input shapes (guidance on or off is the
        // context's batch), which key the program cache, so a cached program always matches.
        let step = move |(sample, timestep, context, guidance): GuidedStepInputs<Oxi>| {
            guided_noise(&unet, sample, timestep, context, guidance)
        };
        // Latents and context split by batch (data parallel); timestep and scale whole.
        let layouts = vec![
            Layout::BatchSplit(0),
            Layout::Replicated,
            Layout::BatchSplit(0),
            Layout::Replicated,
        ];
        self.compiled = Some(CompiledCall::warm_started(
            "unet+cfg", step, placement, layouts, warm,
        ));
    }

    /// Weight bytes on each device of the mesh after
    /// [`enable_parallelism`](Self::enable_parallelism) (`None` otherwise): the split
    /// weights' shards, and the replicated ones once the first step ran.
    pub fn parallel_weight_bytes(&self) -> Option<Vec<DeviceWeightBytes>> {
        let placement = self.compiled.as_ref()?.spmd_placement()?;
        Some(placement.weight_bytes())
    }

    /// Compiled mode's counts (`None` when eager).
    pub fn compile_stats(&self) -> Option<CompileStats> {
        self.compiled.as_ref().map(|c| c.compile_stats())
    }

    /// Compiled mode's counts per component: the text encoders', the unet's (as
    /// [`compile_stats`](Self::compile_stats)), the VAE encoder's and decoder's.
    pub fn component_stats(&self) -> Vec<ComponentStats> {
        crate::compiled::component_stats(
            &[("text_encoder", &self.text_encoder)],
            None,
            "unet",
            self.compile_stats(),
            self.scheduler_program.as_ref(),
            &self.vae,
        )
    }
}
