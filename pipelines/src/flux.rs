//! `FluxPipeline`: text to image with Flux.1 (dev and schnell), step for step as diffusers'
//! `pipeline_flux.py`.
//!
//! Prompt -> CLIP (pooled output) and T5 (hidden states, `max_sequence_length` tokens, no
//! mask); latents `[batch, 16, h/8, w/8]` from the generator (or the caller), packed into 2x2
//! patches for the transformer and unpacked from its output; image ids (0, row, column) and
//! zero text ids give the rotary embedding; sigmas `linspace(1, 1/n, n)` shifted by `mu` from
//! the image sequence length (FlowMatchEulerDiscrete with dynamic shifting); the guidance scale
//! enters as the dev transformer's guidance embedding (schnell has none and ignores it); with a
//! negative prompt and `true_cfg_scale > 1`, true classifier-free guidance runs the
//! transformer a second time on the negative prompt, as diffusers does. The VAE decodes
//! `latents / scaling_factor + shift_factor`.
//!
//! The denoising loop keeps the latents unpacked (the scheduler's update is element-wise, so
//! this is the same computation), which is also the shape of diffusers' random draw.

use std::path::{Path, PathBuf};

use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use oxidiff_backend_tpu::spmd::{Layout, SpmdPlacement};
use oxidiff_backend_tpu::Oxi;
use oxidiff_models::embeddings::RotaryEmbedding;
use oxidiff_models::{
    AutoencoderKL, ClipTextModel, ClipTokenizer, FluxTransformer2DModel, T5EncoderModel,
    T5Tokenizer, ToDevice,
};
use oxidiff_parallel::ParallelConfig;
use oxidiff_schedulers::{
    calculate_shift, NoiseSource, Scheduler, SchedulerConfig, TimestepOptions, TorchCpuGenerator,
};

use crate::compiled::{CompileStats, CompiledCall, ComponentStats, SchedulerProgram, WarmStart};
use crate::denoise::{
    check_request, decode_latents, initial_latents, negatives_for, per_prompt, DenoisingLoop,
    GenerateRequest, PipelineDefaults, PipelineOutput, StepInfo,
};
use crate::error::{PipelineError, Result};
use crate::flux_controlnet::FluxControl;
use crate::loading::{check_pipeline_class, component, load_scheduler, LoadOptions};
use crate::memory::{component_memory, ComponentMemory, PlaceName};
use crate::offload::Offload;
use crate::truncation::{warn_if_clip_cut, warn_if_t5_cut};

/// The pipeline class this type loads (`_class_name` in `model_index.json`).
pub const FLUX_CLASSES: [&str; 1] = ["FluxPipeline"];

/// diffusers' limit on `max_sequence_length` (T5 tokens) for Flux.
pub const FLUX_MAX_SEQUENCE_LENGTH: usize = 512;

/// One Flux request: the common settings plus Flux's own.
#[derive(Debug, Clone)]
pub struct FluxRequest<B: Backend> {
    /// Prompts (for CLIP, and for T5 unless `prompts_2` is given), negative prompts (used only
    /// with `true_cfg_scale`), steps, guidance (the dev model's guidance embedding; schnell
    /// ignores it), size (default 1024x1024), seed, latents (unpacked `[batch, 16, h/8, w/8]`,
    /// the shape diffusers draws before packing), output. `Default` gives diffusers' defaults:
    /// 28 steps, guidance 3.5.
    pub common: GenerateRequest<B>,
    /// T5 prompts (diffusers' `prompt_2`); empty means the prompts.
    pub prompts_2: Vec<String>,
    /// T5 negative prompts (`negative_prompt_2`); empty means the negative prompts.
    pub negative_prompts_2: Vec<String>,
    /// T5 tokens per prompt (diffusers' default 512, at most 512); longer prompts are cut with
    /// a warning.
    pub max_sequence_length: usize,
    /// True classifier-free guidance: with negative prompts and a scale above 1, each step runs
    /// the transformer on the negative prompts too and takes
    /// `negative + true_cfg_scale * (positive - negative)`.
    pub true_cfg_scale: f64,
}

impl<B: Backend> Default for FluxRequest<B> {
    fn default() -> Self {
        Self {
            common: PipelineDefaults::FLUX.request(),
            prompts_2: Vec::new(),
            negative_prompts_2: Vec::new(),
            max_sequence_length: FLUX_MAX_SEQUENCE_LENGTH,
            true_cfg_scale: 1.0,
        }
    }
}

/// Encoded prompts: T5 hidden states `[n, max_sequence_length, dim]` and the pooled CLIP
/// embedding `[n, clip_dim]`.
#[derive(Debug, Clone)]
pub struct FluxPromptEmbeds<B: Backend> {
    pub prompt_embeds: Tensor<B, 3>,
    pub pooled_prompt_embeds: Tensor<B, 2>,
}

/// diffusers' `_pack_latents`: `[b, c, h, w]` to `[b, (h/2) * (w/2), c * 4]`, each token a 2x2
/// patch (channel-major within the token).
pub fn pack_latents<B: Backend>(latents: Tensor<B, 4>) -> Tensor<B, 3> {
    let [b, c, h, w] = latents.dims();
    let x: Tensor<B, 6> = latents.reshape([b, c, h / 2, 2, w / 2, 2]);
    x.permute([0, 2, 4, 1, 3, 5])
        .reshape([b, (h / 2) * (w / 2), c * 4])
}

/// diffusers' `_unpack_latents`: `[b, (h/2) * (w/2), c * 4]` back to `[b, c, h, w]`.
pub fn unpack_latents<B: Backend>(
    packed: Tensor<B, 3>,
    height: usize,
    width: usize,
) -> Tensor<B, 4> {
    let [b, _, channels] = packed.dims();
    let c = channels / 4;
    let x: Tensor<B, 6> = packed.reshape([b, height / 2, width / 2, c, 2, 2]);
    x.permute([0, 3, 1, 4, 2, 5]).reshape([b, c, height, width])
}

/// diffusers' `_prepare_latent_image_ids`: `(0, row, column)` for each packed token, row-major.
pub fn latent_image_ids(rows: usize, columns: usize) -> Vec<Vec<f32>> {
    (0..rows)
        .flat_map(|r| (0..columns).map(move |c| vec![0.0, r as f32, c as f32]))
        .collect()
}

/// numpy's `linspace(1, 1/n, n)`, the sigmas the pipeline gives the scheduler.
pub fn default_sigmas(n: usize) -> Vec<f64> {
    let stop = 1.0 / n as f64;
    if n <= 1 {
        return vec![1.0; n];
    }
    let step = (stop - 1.0) / (n - 1) as f64;
    let mut sigmas: Vec<f64> = (0..n).map(|i| 1.0 + i as f64 * step).collect();
    sigmas[n - 1] = stop;
    sigmas
}

/// The transformer's velocity for unpacked latents, as one step of diffusers' loop calls it:
/// latents packed, `timestep / 1000` and the guidance scale (dev) per row, the output
/// unpacked. `timestep` and `guidance` are `[1]` runtime tensors, so in compiled mode a new
/// step or guidance scale does not recompile. The eager loop and the compiled step both run
/// this function.
pub fn flux_velocity<B: Backend>(
    transformer: &FluxTransformer2DModel<B>,
    latents: Tensor<B, 4>,
    timestep: Tensor<B, 1>,
    guidance: Tensor<B, 1>,
    text: &FluxPromptEmbeds<B>,
    rope: &RotaryEmbedding<B>,
) -> Tensor<B, 4> {
    let [b, _, h, w] = latents.dims();
    let timestep = timestep.div_scalar(1000.0).expand([b]);
    let guidance = transformer.guidance_embeds().then(|| guidance.expand([b]));
    let out = transformer.forward_checked(
        pack_latents(latents),
        text.prompt_embeds.clone(),
        text.pooled_prompt_embeds.clone(),
        timestep,
        guidance,
        rope,
    );
    unpack_latents(out, h, w)
}

/// Flux.1 text-to-image (dev with guidance embedding, schnell without).
pub struct FluxPipeline<B: Backend> {
    pub tokenizer: ClipTokenizer,
    pub text_encoder: ClipTextModel<B>,
    pub tokenizer_2: T5Tokenizer,
    pub text_encoder_2: T5EncoderModel<B>,
    pub transformer: FluxTransformer2DModel<B>,
    pub vae: AutoencoderKL<B>,
    pub scheduler_config: SchedulerConfig,
    pub scheduler: Box<dyn Scheduler<B>>,
    pub vae_scale_factor: usize,
    /// Where latents live and the denoising loop runs: the transformer's device.
    pub device: B::Device,
    pub source: PathBuf,
    /// The compiled transformer call, when [`compile`](FluxPipeline::compile) was called.
    pub compiled: Option<CompiledCall<B, FluxStepInputs<B>>>,
    /// Compiled mode's scheduler step, when the pipeline was compiled.
    pub scheduler_program: Option<SchedulerProgram<B>>,
    /// What is handed back between requests ([`Offload::TextEncoders`]: the text encoders,
    /// after each request's prompts are encoded).
    pub offload: Offload,
}

impl<B: Backend> FluxPipeline<B> {
    /// The denoiser's device mesh and weight shards, after `enable_parallelism`.
    pub fn spmd_placement(
        &self,
    ) -> Option<&std::sync::Arc<oxidiff_backend_tpu::spmd::SpmdPlacement>> {
        self.compiled.as_ref()?.spmd_placement()
    }

    /// What each component's weights hold and where (`place` names a device): `txt2img
    /// --json`'s `memory`.
    pub fn memory(&self, place: PlaceName<'_, B::Device>) -> Vec<ComponentMemory> {
        let quantized = Some(&self.transformer.quantized);
        vec![
            component_memory("text_encoder", &self.text_encoder, None, place),
            component_memory("text_encoder_2", &self.text_encoder_2, None, place),
            component_memory("transformer", &self.transformer, quantized, place),
            component_memory("vae", &self.vae, None, place),
        ]
    }

    /// Loads a diffusers-format folder, or a Hub id from the local cache.
    pub fn from_pretrained(spec: &str, options: &LoadOptions, device: &B::Device) -> Result<Self> {
        let dir = crate::hub::resolve_model(spec, options.variant.as_deref())?;
        Self::from_dir(&dir, options, device)
    }

    /// Fuses a LoRA file into the transformer and the CLIP text encoder at `scale`, as
    /// diffusers' `load_lora_weights(path)` + `fuse_lora(lora_scale=scale,
    /// components=["transformer", "text_encoder"])`: `W += scale * alpha / rank * up @ down`.
    /// Reads diffusers/PEFT files (`transformer.<module>.lora_A.weight`, `text_encoder.…`) and
    /// kohya/sd-scripts Flux files (`lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight`,
    /// `lora_te1_…`), whose fused projections are split as diffusers splits them. Call it once
    /// per LoRA, before [`compile`](FluxPipeline::compile); keys that fit no layer are an error
    /// naming them, and the pipeline is left unchanged.
    pub fn load_lora(
        &mut self,
        path: impl AsRef<Path>,
        scale: f32,
    ) -> Result<crate::lora::LoraReport> {
        crate::lora::fuse_into(
            path.as_ref(),
            scale,
            crate::lora::Denoiser::transformer(&mut self.transformer),
            &mut [(
                oxidiff_models::lora::LoraComponent::TextEncoder,
                &mut self.text_encoder,
            )],
            "Flux pipeline",
            self.compiled.is_some(),
        )
    }

    /// Loads a diffusers-format `FluxPipeline` folder. Every component is required, as in
    /// diffusers (only the IP-Adapter image encoder is optional there, and unsupported here).
    pub fn from_dir(dir: &Path, options: &LoadOptions, device: &B::Device) -> Result<Self> {
        check_pipeline_class(dir, &FLUX_CLASSES)?;
        let variant = options.variant.as_deref();
        let dtype = options.weights_dtype();
        let tokenizer = ClipTokenizer::from_dir(&component(dir, "tokenizer")?)?;
        let text_encoder = ClipTextModel::from_dir_in(
            &component(dir, "text_encoder")?,
            false,
            variant,
            dtype,
            device,
        )?;
        let tokenizer_2 = T5Tokenizer::from_dir(&component(dir, "tokenizer_2")?)?;
        let text_encoder_2 = T5EncoderModel::from_dir_in(
            &component(dir, "text_encoder_2")?,
            variant,
            dtype,
            device,
        )?;
        let transformer_dir = component(dir, "transformer")?;
        let transformer = match &options.transformer {
            Some(file) => {
                FluxTransformer2DModel::from_gguf_in(file, &transformer_dir, dtype, device)?
            }
            None => FluxTransformer2DModel::from_dir_in(&transformer_dir, variant, dtype, device)?,
        };
        let clip_dim = text_encoder.token_embedding.weight.dims()[1];
        let t5_dim = text_encoder_2.shared.weight.dims()[1];
        if clip_dim != transformer.pooled_projection_dim
            || t5_dim != transformer.joint_attention_dim
        {
            return Err(PipelineError::InvalidInput(format!(
                "{}: the transformer takes pooled CLIP embeddings of {} and T5 states of {} \
                 (pooled_projection_dim, joint_attention_dim), but text_encoder has width \
                 {clip_dim} and text_encoder_2 {t5_dim}: the components do not belong together",
                transformer_dir.join("config.json").display(),
                transformer.pooled_projection_dim,
                transformer.joint_attention_dim
            )));
        }
        let vae_dir = component(dir, "vae")?;
        let vae_config =
            oxidiff_models::AutoencoderKLConfig::from_file(&vae_dir.join("config.json"))?;
        let vae = AutoencoderKL::from_dir_in(&vae_dir, variant, dtype, device)?;
        let (scheduler_config, scheduler) = load_scheduler(dir, options)?;
        let cast = crate::loading::Cast(options.dtype);
        Ok(Self {
            tokenizer,
            text_encoder: cast.apply(text_encoder),
            tokenizer_2,
            text_encoder_2: cast.apply(text_encoder_2),
            transformer: cast.apply(transformer),
            vae: cast.apply(vae),
            scheduler_config,
            scheduler,
            vae_scale_factor: vae_config.scale_factor(),
            device: device.clone(),
            source: dir.to_path_buf(),
            compiled: None,
            scheduler_program: None,
            offload: Offload::default(),
        })
    }

    /// The device the VAE runs on.
    pub fn vae_device(&self) -> B::Device {
        self.vae.decoder.conv_in.weight.device()
    }

    /// Places the text encoders, the transformer and the VAE each on their own device.
    #[must_use]
    pub fn to_components(
        mut self,
        text_encoders: &B::Device,
        transformer: &B::Device,
        vae: &B::Device,
    ) -> Self {
        self.text_encoder = self.text_encoder.to(text_encoders);
        self.text_encoder_2 = self.text_encoder_2.to(text_encoders);
        self.transformer = self.transformer.to(transformer);
        self.vae = self.vae.to(vae);
        self.device = transformer.clone();
        // A compiled step holds the transformer of its device: compile again after moving.
        self.compiled = None;
        self.scheduler_program = None;
        // The VAE's and text encoders' programs too (they hold the weights they were built for).
        self.vae.clear_programs();
        self.text_encoder.layers_program.clear();
        self.text_encoder_2.blocks_program.clear();
        self
    }

    /// The default image size, diffusers' `default_sample_size` 128 times the VAE factor.
    pub fn default_size(&self) -> usize {
        128 * self.vae_scale_factor
    }

    /// diffusers' `__call__` defaults (steps, guidance) of this pipeline; `.request()` gives a
    /// request with them.
    pub fn defaults(&self) -> PipelineDefaults {
        PipelineDefaults::FLUX
    }

    /// A request with diffusers' defaults ([`FluxRequest::default`]).
    pub fn default_request(&self) -> FluxRequest<B> {
        FluxRequest::default()
    }

    /// Whether the transformer embeds the guidance scale (dev), as opposed to schnell.
    pub fn guidance_embeds(&self) -> bool {
        self.transformer.guidance_embeds()
    }

    /// diffusers' `encode_prompt`: pooled CLIP embeddings of `prompts` and T5 hidden states of
    /// `prompts_2` (the same prompts when empty), each repeated `images_per_prompt` times.
    pub fn encode_prompts(
        &self,
        prompts: &[String],
        prompts_2: &[String],
        images_per_prompt: usize,
        max_sequence_length: usize,
    ) -> Result<FluxPromptEmbeds<B>> {
        let prompts_2 = if prompts_2.is_empty() {
            prompts
        } else {
            prompts_2
        };
        if prompts_2.len() != prompts.len() {
            return Err(PipelineError::InvalidInput(format!(
                "{} T5 prompts (prompt_2) for {} prompts: give one per prompt, or none",
                prompts_2.len(),
                prompts.len()
            )));
        }
        let mut clip_rows = Vec::with_capacity(prompts.len() * images_per_prompt);
        let mut t5_rows = Vec::with_capacity(clip_rows.capacity());
        for (prompt, prompt_2) in prompts.iter().zip(prompts_2) {
            let clip = self.tokenizer.encode(prompt)?;
            warn_if_clip_cut(&self.tokenizer, &clip);
            let t5 = self.tokenizer_2.encode(prompt_2, max_sequence_length)?;
            warn_if_t5_cut(
                &self.tokenizer_2,
                prompt_2,
                max_sequence_length,
                t5.truncated(),
            )?;
            for _ in 0..images_per_prompt {
                clip_rows.push(clip.ids.clone());
                t5_rows.push(t5.ids.clone());
            }
        }
        let pooled = self.text_encoder.forward(&clip_rows, false)?.pooler_output;
        // diffusers' Flux passes no attention mask to T5: padding tokens are attended.
        let prompt_embeds = self.text_encoder_2.forward(&t5_rows, None)?;
        Ok(FluxPromptEmbeds {
            prompt_embeds,
            pooled_prompt_embeds: pooled,
        })
    }

    /// Checks a request; returns the image size `(width, height)`.
    pub fn check(&self, req: &FluxRequest<B>) -> Result<(usize, usize)> {
        let default = self.default_size();
        // Latents are packed in 2x2 patches: sizes divide by twice the VAE factor.
        crate::ip_adapter::refuse_image_prompt(&req.common, "Flux")?;
        let size = check_request(&req.common, (default, default), 2 * self.vae_scale_factor)?;
        if req.max_sequence_length == 0 || req.max_sequence_length > FLUX_MAX_SEQUENCE_LENGTH {
            return Err(PipelineError::InvalidInput(format!(
                "max_sequence_length must be between 1 and {FLUX_MAX_SEQUENCE_LENGTH}, got {}",
                req.max_sequence_length
            )));
        }
        let n = req.negative_prompts_2.len();
        if n > 1 && n != req.common.prompts.len() {
            return Err(PipelineError::InvalidInput(format!(
                "{n} T5 negative prompts for {} prompts: give one, or one per prompt",
                req.common.prompts.len()
            )));
        }
        Ok(size)
    }

    /// Whether a request runs true classifier-free guidance (diffusers' `do_true_cfg`).
    pub fn does_true_cfg(req: &FluxRequest<B>) -> bool {
        crate::denoise::does_guidance(req.true_cfg_scale) && !req.common.negative_prompts.is_empty()
    }

    /// Generates with the default generator seeded by `req.common.seed`.
    pub fn generate(&mut self, req: &FluxRequest<B>) -> Result<PipelineOutput<B>> {
        let mut generator = TorchCpuGenerator::new(req.common.seed);
        self.generate_with(req, &mut generator, |_| {})
    }

    /// Generates with the given noise source and a callback after every step (it sees the
    /// unpacked latents; [`pack_latents`] gives diffusers' layout).
    pub fn generate_with(
        &mut self,
        req: &FluxRequest<B>,
        noise: &mut dyn NoiseSource<B>,
        callback: impl FnMut(StepInfo<'_, B>),
    ) -> Result<PipelineOutput<B>> {
        self.generate_controlled(req, None, noise, callback)
    }

    /// [`generate_with`](Self::generate_with), with Flux ControlNets steering each step (the
    /// Flux ControlNet pipeline; their control images' VAE samples are drawn from `noise`
    /// first, as diffusers draws them before the latents).
    pub(crate) fn generate_controlled(
        &mut self,
        req: &FluxRequest<B>,
        control: Option<FluxControl<'_, B>>,
        noise: &mut dyn NoiseSource<B>,
        mut callback: impl FnMut(StepInfo<'_, B>),
    ) -> Result<PipelineOutput<B>> {
        let common = &req.common;
        let (width, height) = self.check(req)?;
        if control.is_some() && Self::does_true_cfg(req) {
            return Err(PipelineError::InvalidInput(
                "true classifier-free guidance with Flux ControlNets is not implemented yet: \
                 drop the negative prompt or true_cfg_scale"
                    .into(),
            ));
        }
        let images_per_prompt = common.num_images_per_prompt;
        let max_len = req.max_sequence_length;
        let on_device = |e: FluxPromptEmbeds<B>, device: &B::Device| FluxPromptEmbeds {
            prompt_embeds: e.prompt_embeds.to_device(device),
            pooled_prompt_embeds: e.pooled_prompt_embeds.to_device(device),
        };
        let text =
            self.encode_prompts(&common.prompts, &req.prompts_2, images_per_prompt, max_len)?;
        let text = on_device(text, &self.device);
        let negative = if Self::does_true_cfg(req) {
            let negatives = negatives_for(common)?;
            let negatives_2 = per_prompt(
                &req.negative_prompts_2,
                &negatives,
                negatives.len(),
                "T5 negative prompts",
            )?;
            let embeds =
                self.encode_prompts(&negatives, &negatives_2, images_per_prompt, max_len)?;
            Some(on_device(embeds, &self.device))
        } else {
            None
        };
        self.offload.after_encoding(&self.text_encoder);
        self.offload.after_encoding(&self.text_encoder_2);

        let f = self.vae_scale_factor;
        let (h, w) = (2 * (height / (2 * f)), 2 * (width / (2 * f)));
        let batch = common.prompts.len() * images_per_prompt;
        let channels = self.transformer.in_channels / 4;
        let control = control
            .map(|c| c.prepare(&self.vae, (width, height), batch, noise, &self.device))
            .transpose()?;
        let latents = initial_latents(
            common,
            [batch, channels, h, w],
            (width, height),
            noise,
            1.0,
            &self.device,
        )?;
        let image_seq_len = (h / 2) * (w / 2);
        let options = TimestepOptions {
            sigmas: Some(default_sigmas(common.num_inference_steps)),
            mu: Some(calculate_shift(image_seq_len, &self.scheduler_config)),
            timesteps: None,
        };
        self.scheduler
            .set_timesteps_with(common.num_inference_steps, &options)?;
        let img_ids = latent_image_ids(h / 2, w / 2);
        let txt_ids = vec![vec![0.0; 3]; text.prompt_embeds.dims()[1]];
        let rope = self
            .transformer
            .rotary_embedding(&txt_ids, &img_ids, &self.device);

        let timesteps = self.scheduler.timesteps().to_vec();
        let (transformer, compiled) = (&self.transformer, &self.compiled);
        let steps = timesteps.len();
        let velocity = |i: usize,
                        latents: Tensor<B, 4>,
                        timestep: Tensor<B, 1>,
                        guidance: Tensor<B, 1>,
                        text: &FluxPromptEmbeds<B>|
         -> Result<Tensor<B, 4>> {
            let [b, _, lh, lw] = latents.dims();
            transformer.check_inputs(
                [b, (lh / 2) * (lw / 2), channels * 4],
                text.prompt_embeds.dims(),
                text.pooled_prompt_embeds.dims(),
                b,
                transformer.guidance_embeds().then_some(b),
                rope.cos.dims()[0],
            )?;
            if let Some(control) = &control {
                let step = (i, steps);
                return control.velocity(
                    transformer,
                    step,
                    latents,
                    timestep,
                    guidance,
                    text,
                    &rope,
                );
            }
            match compiled {
                Some(denoiser) => denoiser.call((
                    latents,
                    timestep,
                    guidance,
                    text.prompt_embeds.clone(),
                    text.pooled_prompt_embeds.clone(),
                    (rope.cos.clone(), rope.sin.clone()),
                )),
                None => Ok(flux_velocity(
                    transformer,
                    latents,
                    timestep,
                    guidance,
                    text,
                    &rope,
                )),
            }
        };
        let mut step = 0;
        let latents = DenoisingLoop {
            scheduler: &mut *self.scheduler,
            timesteps: &timesteps,
            latents,
            req: common,
            device: &self.device,
            noise,
            step_program: self.scheduler_program.as_ref(),
        }
        .run(
            |latents, timestep, guidance| {
                let i = step;
                step += 1;
                let positive = velocity(
                    i,
                    latents.clone(),
                    timestep.clone(),
                    guidance.clone(),
                    &text,
                )?;
                match &negative {
                    Some(negative) => {
                        let negative = velocity(i, latents, timestep, guidance, negative)?;
                        Ok(negative.clone() + (positive - negative).mul_scalar(req.true_cfg_scale))
                    }
                    None => Ok(positive),
                }
            },
            &mut callback,
        )?;

        let images = decode_latents(&self.vae, &latents, common.output)?;
        Ok(PipelineOutput { latents, images })
    }
}

impl<B: Backend> ToDevice<B> for FluxPipeline<B> {
    /// Moves every component to `device`.
    fn to(self, device: &B::Device) -> Self {
        self.to_components(device, device, device)
    }
}

/// The compiled transformer call's inputs: latents, timestep, guidance, T5 states, pooled
/// CLIP, rotary (cos, sin).
pub type FluxStepInputs<B> = (
    Tensor<B, 4>,
    Tensor<B, 1>,
    Tensor<B, 1>,
    Tensor<B, 3>,
    Tensor<B, 2>,
    (Tensor<B, 2>, Tensor<B, 2>),
);

impl FluxPipeline<Oxi> {
    /// Compiled mode: from the next generation on, each transformer call (packing, the
    /// transformer, unpacking) is one XLA program, traced on first use and cached by input
    /// shapes. Timestep, guidance scale, prompt embeddings and rotary tables are runtime
    /// inputs, so a new prompt, seed, guidance scale or step count reuses the program (and
    /// true CFG's negative call runs the same one); a new size, batch or `max_sequence_length`
    /// compiles once more. Needs the transformer on a PJRT device. The text encoders' layers,
    /// the VAE and the scheduler step are programs too ([`SchedulerProgram`]: one per step
    /// structure, scalars as arguments).
    pub fn compile(&mut self) -> Result<()> {
        self.compile_on(None)
    }

    /// [`StableDiffusionPipeline::enable_parallelism`](crate::StableDiffusionPipeline::enable_parallelism)
    /// for the transformer: its double and single blocks split over `tp_degree` devices, the
    /// batch over `dp_degree`.
    pub fn enable_parallelism(&mut self, config: impl Into<ParallelConfig>) -> Result<()> {
        let device = self.transformer.device();
        let placement =
            crate::parallel::enable_parallelism(&mut self.transformer, &device, config.into())?;
        self.compile_on(Some(placement))
    }

    fn compile_on(&mut self, placement: Option<Arc<SpmdPlacement>>) -> Result<()> {
        self.scheduler_program = Some(SchedulerProgram::new());
        crate::parallel::require_pjrt("transformer", &self.transformer.device())?;
        crate::compiled::compile_vae(&mut self.vae);
        crate::compiled::compile_clip(&mut self.text_encoder, "text_encoder");
        crate::compiled::compile_t5(&mut self.text_encoder_2, "text_encoder_2");
        let transformer = self.transformer.clone();
        let warm = WarmStart::of("transformer", &transformer, self.transformer.device());
        let step =
            move |(latents, t, g, prompt_embeds, pooled, (cos, sin)): FluxStepInputs<Oxi>| {
                let text = FluxPromptEmbeds {
                    prompt_embeds,
                    pooled_prompt_embeds: pooled,
                };
                flux_velocity(
                    &transformer,
                    latents,
                    t,
                    g,
                    &text,
                    &RotaryEmbedding { cos, sin },
                )
            };
        // Latents, timestep, guidance and text split by batch where it divides; the rotary
        // tables (one per position, not per image) whole on every device.
        let mut inputs = vec![Layout::BatchSplit(0); 5];
        inputs.extend([Layout::Replicated, Layout::Replicated]);
        self.compiled = Some(CompiledCall::warm_started(
            "flux_transformer",
            step,
            placement,
            inputs,
            warm,
        ));
        Ok(())
    }

    /// Compiled mode's counts (`None` when eager).
    pub fn compile_stats(&self) -> Option<CompileStats> {
        self.compiled.as_ref().map(|c| c.compile_stats())
    }

    /// Compiled mode's counts per component: the text encoders', the transformer's (as
    /// [`compile_stats`](Self::compile_stats)), the VAE encoder's and decoder's.
    pub fn component_stats(&self) -> Vec<ComponentStats> {
        crate::compiled::component_stats(
            &[("text_encoder", &self.text_encoder)],
            Some(("text_encoder_2", &self.text_encoder_2)),
            "transformer",
            self.compile_stats(),
            self.scheduler_program.as_ref(),
            &self.vae,
        )
    }
}
