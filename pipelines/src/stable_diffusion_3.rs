//! `StableDiffusion3Pipeline`: text to image with SD3 and SD3.5, step for step as diffusers'
//! `pipeline_stable_diffusion_3.py`.
//!
//! Three text encoders: CLIP-L (`text_encoder`) and CLIP-G (`text_encoder_2`), both with
//! projection, give their penultimate hidden states (concatenated on the feature axis and
//! zero-padded to T5's width) and their pooled projections (concatenated); T5
//! (`text_encoder_3`, optional as in diffusers: zeros of the same shape when the checkpoint
//! leaves it out) gives `max_sequence_length` more tokens, appended to the sequence. The
//! flow-matching scheduler loop with classifier-free guidance batched in one transformer call;
//! the 16-channel VAE decode after undoing `scaling_factor` and `shift_factor`.

use std::path::{Path, PathBuf};

use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use oxidiff_backend_tpu::spmd::{Layout, SpmdPlacement};
use oxidiff_backend_tpu::Oxi;
use oxidiff_models::config::load_json;
use oxidiff_models::{
    AutoencoderKL, AutoencoderKLConfig, ClipTextModel, ClipTextOutput, ClipTokenizer,
    SD3Transformer2DConfig, SD3Transformer2DModel, T5EncoderModel, T5Tokenizer, ToDevice,
};
use oxidiff_parallel::ParallelConfig;
use oxidiff_schedulers::{
    calculate_shift, scheduler_from_config, NoiseSource, Scheduler, SchedulerConfig,
    TimestepOptions, TorchCpuGenerator,
};

use crate::compiled::{CompileStats, CompiledCall, ComponentStats, SchedulerProgram, WarmStart};
use crate::denoise::{
    check_request, decode_latents, guide, initial_latents, negatives_for, per_prompt,
    with_guidance, DenoisingLoop, GenerateRequest, PipelineDefaults, PipelineOutput, StepInfo,
};
use crate::error::{PipelineError, Result};
use crate::loading::LoadOptions;
use crate::memory::{component_memory, ComponentMemory, PlaceName};
use crate::offload::Offload;
use crate::stable_diffusion_3_controlnet::Sd3Control;
use crate::truncation::{warn_if_clip_cut, warn_if_t5_cut};

/// The pipeline class this type loads (`_class_name` in `model_index.json`).
pub const SD3_CLASS: &str = "StableDiffusion3Pipeline";

/// diffusers' limit on `max_sequence_length` (T5's trained length).
pub const SD3_MAX_SEQUENCE_LENGTH: usize = 512;

/// One SD3 request: the common settings plus SD3's own.
#[derive(Debug, Clone)]
pub struct Sd3Request<B: Backend> {
    /// Prompts, negative prompts, steps, guidance, size, seed, latents, output. `Default`
    /// gives diffusers' SD3 defaults: 28 steps, guidance 7.0, the empty negative prompt.
    pub common: GenerateRequest<B>,
    /// Prompts for CLIP-G (`prompt_2`) and T5 (`prompt_3`); empty: the prompts.
    pub prompts_2: Vec<String>,
    pub prompts_3: Vec<String>,
    /// `negative_prompt_2` and `negative_prompt_3`; empty: the negative prompts.
    pub negative_prompts_2: Vec<String>,
    pub negative_prompts_3: Vec<String>,
    /// T5 tokens per prompt (at most 512); longer prompts are cut with a warning.
    pub max_sequence_length: usize,
    /// Skip-layer guidance (SD3.5 Medium's recommended `[7, 8, 9]`; empty: off): at steps `i`
    /// with `start * steps < i < stop * steps`, a third transformer call on the prompt with
    /// these blocks left out adds `scale * (text - skipped)` to the guided prediction.
    pub skip_guidance_layers: Vec<usize>,
    /// diffusers' `skip_layer_guidance_scale`, `_start` and `_stop` (2.8, 0.01, 0.2).
    pub skip_layer_guidance_scale: f64,
    pub skip_layer_guidance_start: f64,
    pub skip_layer_guidance_stop: f64,
}

impl<B: Backend> Default for Sd3Request<B> {
    fn default() -> Self {
        Self {
            common: PipelineDefaults::STABLE_DIFFUSION_3.request(),
            prompts_2: Vec::new(),
            prompts_3: Vec::new(),
            negative_prompts_2: Vec::new(),
            negative_prompts_3: Vec::new(),
            max_sequence_length: 256,
            skip_guidance_layers: Vec::new(),
            skip_layer_guidance_scale: 2.8,
            skip_layer_guidance_start: 0.01,
            skip_layer_guidance_stop: 0.2,
        }
    }
}

/// Prompt embeddings for the transformer: `[n, 77 + max_sequence_length, joint_attention_dim]`
/// and pooled `[n, pooled_projection_dim]`.
#[derive(Debug, Clone)]
pub struct Sd3PromptEmbeds<B: Backend> {
    pub prompt_embeds: Tensor<B, 3>,
    pub pooled_prompt_embeds: Tensor<B, 2>,
}

/// Stable Diffusion 3 / 3.5 text-to-image.
pub struct StableDiffusion3Pipeline<B: Backend> {
    pub tokenizer: ClipTokenizer,
    pub tokenizer_2: ClipTokenizer,
    pub text_encoder: ClipTextModel<B>,
    pub text_encoder_2: ClipTextModel<B>,
    /// T5 and its tokenizer; `None` when `model_index.json` leaves them out.
    pub text_encoder_3: Option<T5EncoderModel<B>>,
    pub tokenizer_3: Option<T5Tokenizer>,
    pub transformer: SD3Transformer2DModel<B>,
    pub vae: AutoencoderKL<B>,
    pub scheduler_config: SchedulerConfig,
    pub scheduler: Box<dyn Scheduler<B>>,
    pub vae_scale_factor: usize,
    /// The transformer's `sample_size`, for the default image size.
    pub sample_size: usize,
    /// The transformer's device, where the loop runs.
    pub device: B::Device,
    pub source: PathBuf,
    /// The compiled transformer call, when [`compile`](StableDiffusion3Pipeline::compile) was
    /// called.
    pub compiled: Option<CompiledCall<B, Sd3StepInputs<B>>>,
    /// Compiled mode's scheduler step, when the pipeline was compiled.
    pub scheduler_program: Option<SchedulerProgram<B>>,
    /// What is handed back between requests ([`Offload::TextEncoders`]: the text encoders,
    /// after each request's prompts are encoded).
    pub offload: Offload,
}

/// What `model_index.json` says about one component: a `[library, class]` pair, or
/// `[null, null]` for a component the checkpoint leaves out.
fn listed(index: &serde_json::Value, name: &str) -> Option<bool> {
    let entry = index.get(name)?;
    Some(match entry.as_array() {
        Some(pair) => pair.iter().any(|v| !v.is_null()),
        None => !entry.is_null(),
    })
}

impl<B: Backend> StableDiffusion3Pipeline<B> {
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
            component_memory("text_encoder_2", &self.text_encoder_2, None, place),
        ];
        if let Some(encoder) = &self.text_encoder_3 {
            all.push(component_memory("text_encoder_3", encoder, None, place));
        }
        let quantized = Some(&self.transformer.quantized);
        all.push(component_memory(
            "transformer",
            &self.transformer,
            quantized,
            place,
        ));
        all.push(component_memory("vae", &self.vae, None, place));
        all
    }

    /// Loads a diffusers-format folder, or a Hub id from the local cache.
    pub fn from_pretrained(spec: &str, options: &LoadOptions, device: &B::Device) -> Result<Self> {
        let dir = crate::hub::resolve_model(spec, options.variant.as_deref())?;
        Self::from_dir(&dir, options, device)
    }

    /// Fuses a LoRA file (diffusers/PEFT: `transformer.<module>.lora_A.weight`,
    /// `text_encoder.…`, `text_encoder_2.…`) into the transformer and the two CLIP text
    /// encoders at `scale`, as diffusers' `load_lora_weights(path)` +
    /// `fuse_lora(lora_scale=scale)`: `W += scale * alpha / rank * up @ down` (T5 takes no
    /// LoRA, as in diffusers). Call it once per LoRA, before
    /// [`compile`](StableDiffusion3Pipeline::compile); keys that fit no layer are an error
    /// naming them, and the pipeline is left unchanged.
    pub fn load_lora(
        &mut self,
        path: impl AsRef<Path>,
        scale: f32,
    ) -> Result<crate::lora::LoraReport> {
        use oxidiff_models::lora::LoraComponent;
        crate::lora::fuse_into(
            path.as_ref(),
            scale,
            crate::lora::Denoiser::transformer(&mut self.transformer),
            &mut [
                (LoraComponent::TextEncoder, &mut self.text_encoder),
                (LoraComponent::TextEncoder2, &mut self.text_encoder_2),
            ],
            "SD3 pipeline",
            self.compiled.is_some(),
        )
    }

    /// Loads a diffusers-format `StableDiffusion3Pipeline` folder. `text_encoder_3` and
    /// `tokenizer_3` may be `[null, null]` in `model_index.json` (diffusers'
    /// `text_encoder_3=None`); every other component is required.
    pub fn from_dir(dir: &Path, options: &LoadOptions, device: &B::Device) -> Result<Self> {
        options.refuse_transformer_file("Stable Diffusion 3")?;
        crate::loading::check_pipeline_class(dir, &[SD3_CLASS])?;
        let index_path = dir.join("model_index.json");
        let index: serde_json::Value = load_json(&index_path)?;
        let required = |name: &str| -> Result<PathBuf> {
            if listed(&index, name) == Some(false) {
                return Err(PipelineError::InvalidInput(format!(
                    "{}: `{name}` is null, but StableDiffusion3Pipeline needs it (only \
                     text_encoder_3 and tokenizer_3 may be left out)",
                    index_path.display()
                )));
            }
            crate::loading::component(dir, name)
        };
        // Every folder is checked before any weight is read.
        let dirs = [
            "tokenizer",
            "tokenizer_2",
            "text_encoder",
            "text_encoder_2",
            "transformer",
            "vae",
            "scheduler",
        ]
        .map(required);
        let [tok_dir, tok2_dir, te_dir, te2_dir, tr_dir, vae_dir, _] = dirs;
        let (tok_dir, tok2_dir, te_dir, te2_dir) = (tok_dir?, tok2_dir?, te_dir?, te2_dir?);
        let (tr_dir, vae_dir) = (tr_dir?, vae_dir?);
        let t5_dirs = match (
            listed(&index, "text_encoder_3"),
            listed(&index, "tokenizer_3"),
        ) {
            (Some(false), Some(false)) => None,
            (Some(false), _) | (_, Some(false)) => {
                return Err(PipelineError::InvalidInput(format!(
                    "{}: one of text_encoder_3 and tokenizer_3 is null but not the other; \
                     leave out both (no T5) or neither",
                    index_path.display()
                )))
            }
            _ => Some((
                crate::loading::component(dir, "text_encoder_3")?,
                crate::loading::component(dir, "tokenizer_3")?,
            )),
        };

        let variant = options.variant.as_deref();
        let dtype = options.weights_dtype();
        let tokenizer = ClipTokenizer::from_dir(&tok_dir)?;
        let tokenizer_2 = ClipTokenizer::from_dir(&tok2_dir)?;
        let text_encoder = ClipTextModel::from_dir_in(&te_dir, true, variant, dtype, device)?;
        let text_encoder_2 = ClipTextModel::from_dir_in(&te2_dir, true, variant, dtype, device)?;
        let (text_encoder_3, tokenizer_3) = match t5_dirs {
            Some((te3_dir, tok3_dir)) => (
                Some(T5EncoderModel::from_dir_in(
                    &te3_dir, variant, dtype, device,
                )?),
                Some(T5Tokenizer::from_dir(&tok3_dir)?),
            ),
            None => (None, None),
        };
        let tr_config = SD3Transformer2DConfig::from_file(&tr_dir.join("config.json"))?;
        let transformer = SD3Transformer2DModel::from_dir_in(&tr_dir, variant, dtype, device)?;
        let vae_config = AutoencoderKLConfig::from_file(&vae_dir.join("config.json"))?;
        if vae_config.latent_channels != tr_config.in_channels {
            return Err(PipelineError::InvalidInput(format!(
                "{}: the VAE has {} latent channels but the transformer takes {}; the two do \
                 not belong together",
                vae_dir.join("config.json").display(),
                vae_config.latent_channels,
                tr_config.in_channels
            )));
        }
        let vae = AutoencoderKL::from_dir_in(&vae_dir, variant, dtype, device)?;
        let (scheduler_config, scheduler) = crate::loading::load_scheduler(dir, options)?;
        let cast = crate::loading::Cast(options.dtype);
        Ok(Self {
            tokenizer,
            tokenizer_2,
            text_encoder: cast.apply(text_encoder),
            text_encoder_2: cast.apply(text_encoder_2),
            text_encoder_3: text_encoder_3.map(|t5| cast.apply(t5)),
            tokenizer_3,
            transformer: cast.apply(transformer),
            vae: cast.apply(vae),
            scheduler_config,
            scheduler,
            vae_scale_factor: vae_config.scale_factor(),
            sample_size: tr_config.sample_size,
            device: device.clone(),
            source: dir.to_path_buf(),
            compiled: None,
            scheduler_program: None,
            offload: Offload::default(),
        })
    }

    /// The default image size: `sample_size` times the VAE factor (1024 for SD3 Medium).
    pub fn default_size(&self) -> usize {
        self.sample_size * self.vae_scale_factor
    }

    /// diffusers' `__call__` defaults (steps, guidance) of this pipeline; `.request()` gives a
    /// request with them.
    pub fn defaults(&self) -> PipelineDefaults {
        PipelineDefaults::STABLE_DIFFUSION_3
    }

    /// A request with diffusers' defaults ([`Sd3Request::default`]).
    pub fn default_request(&self) -> Sd3Request<B> {
        Sd3Request::default()
    }

    /// Swaps the scheduler, keeping the checkpoint's config where it applies.
    pub fn set_scheduler(&mut self, name: &str) -> Result<()> {
        let config = self.scheduler_config.switched_to_named(name)?;
        self.scheduler = scheduler_from_config(&config)?;
        self.scheduler_config = config;
        Ok(())
    }

    /// The device the VAE runs on.
    pub fn vae_device(&self) -> B::Device {
        self.vae.decoder.conv_in.weight.device()
    }

    /// Places the text encoders, the transformer and the VAE on their devices.
    #[must_use]
    pub fn to_components(
        mut self,
        text_encoders: &B::Device,
        transformer: &B::Device,
        vae: &B::Device,
    ) -> Self {
        self.text_encoder = self.text_encoder.to(text_encoders);
        self.text_encoder_2 = self.text_encoder_2.to(text_encoders);
        self.text_encoder_3 = self.text_encoder_3.map(|t5| t5.to(text_encoders));
        self.transformer = self.transformer.to(transformer);
        self.vae = self.vae.to(vae);
        self.device = transformer.clone();
        // A compiled step holds the transformer of its device: compile again after moving.
        self.compiled = None;
        self.scheduler_program = None;
        // The VAE's and text encoders' programs too (they hold the weights they were built for).
        self.vae.clear_programs();
        self.text_encoder.layers_program.clear();
        self.text_encoder_2.layers_program.clear();
        if let Some(t5) = &mut self.text_encoder_3 {
            t5.blocks_program.clear();
        }
        self
    }

    /// diffusers' `encode_prompt` for one side (positive or negative): `prompts` through
    /// CLIP-L, `prompts_2` through CLIP-G (penultimate hidden states concatenated, padded with
    /// zeros to `joint_attention_dim`; pooled projections concatenated), `prompts_3` through T5
    /// (`max_sequence_length` tokens, no mask; zeros without T5), the T5 tokens appended after
    /// CLIP's 77. Each row is repeated `images_per_prompt` times.
    pub fn encode_prompts(
        &self,
        prompts: &[String],
        prompts_2: &[String],
        prompts_3: &[String],
        images_per_prompt: usize,
        max_sequence_length: usize,
    ) -> Result<Sd3PromptEmbeds<B>> {
        let n = prompts.len();
        if prompts_2.len() != n || prompts_3.len() != n {
            return Err(PipelineError::InvalidInput(format!(
                "{n} prompts, {} for the second text encoder and {} for the third: give one \
                 per prompt",
                prompts_2.len(),
                prompts_3.len()
            )));
        }
        if !(1..=SD3_MAX_SEQUENCE_LENGTH).contains(&max_sequence_length) {
            return Err(PipelineError::InvalidInput(format!(
                "max_sequence_length must be in 1..={SD3_MAX_SEQUENCE_LENGTH}, got \
                 {max_sequence_length}"
            )));
        }
        let clip_ids = |tokenizer: &ClipTokenizer, texts: &[String]| -> Result<Vec<Vec<u32>>> {
            let mut rows = Vec::with_capacity(texts.len() * images_per_prompt);
            for text in texts {
                let encoded = tokenizer.encode(text)?;
                warn_if_clip_cut(tokenizer, &encoded);
                rows.extend(std::iter::repeat_n(encoded.ids, images_per_prompt));
            }
            Ok(rows)
        };
        let penultimate = |out: &ClipTextOutput<B>, which: &str| -> Result<Tensor<B, 3>> {
            let layers = out.hidden_states.len();
            if layers < 2 {
                return Err(PipelineError::InvalidInput(format!(
                    "{which} has {layers} layer(s); SD3 takes the penultimate layer's output, \
                     so it needs at least 2"
                )));
            }
            Ok(out.hidden_states[layers - 2].clone())
        };
        let pooled = |out: &ClipTextOutput<B>, which: &str| -> Result<Tensor<B, 2>> {
            out.text_embeds.clone().ok_or_else(|| {
                PipelineError::InvalidInput(format!(
                    "{which} has no text_projection; SD3 needs CLIPTextModelWithProjection"
                ))
            })
        };
        let out_1 = self
            .text_encoder
            .forward(&clip_ids(&self.tokenizer, prompts)?, true)?;
        let out_2 = self
            .text_encoder_2
            .forward(&clip_ids(&self.tokenizer_2, prompts_2)?, true)?;
        let device = self.device.clone();
        let clip = Tensor::cat(
            vec![
                penultimate(&out_1, "text_encoder")?.to_device(&device),
                penultimate(&out_2, "text_encoder_2")?.to_device(&device),
            ],
            2,
        );
        let pooled = Tensor::cat(
            vec![
                pooled(&out_1, "text_encoder")?.to_device(&device),
                pooled(&out_2, "text_encoder_2")?.to_device(&device),
            ],
            1,
        );

        let width = self.transformer.joint_attention_dim;
        let rows = n * images_per_prompt;
        let clip_dtype = burn::tensor::FloatDType::from(clip.dtype());
        let t5 = match (&self.text_encoder_3, &self.tokenizer_3) {
            (Some(t5), Some(tokenizer)) => {
                let mut ids = Vec::with_capacity(rows);
                for text in prompts_3 {
                    let encoded = tokenizer.encode(text, max_sequence_length)?;
                    warn_if_t5_cut(tokenizer, text, max_sequence_length, encoded.truncated())?;
                    ids.extend(std::iter::repeat_n(encoded.ids, images_per_prompt));
                }
                t5.forward(&ids, None)?.to_device(&device)
            }
            // In the encoders' dtype, as diffusers' zeros (burn refuses mixed-dtype concats).
            _ => {
                Tensor::<B, 3>::zeros([rows, max_sequence_length, width], &device).cast(clip_dtype)
            }
        };
        let t5_width = t5.dims()[2];
        // diffusers' `F.pad(clip, (0, t5_width - clip_width))`: zeros, or a cut if negative.
        let [_, clip_seq, clip_width] = clip.dims();
        let clip = if clip_width >= t5_width {
            clip.narrow(2, 0, t5_width)
        } else {
            Tensor::cat(
                vec![
                    clip,
                    Tensor::<B, 3>::zeros([rows, clip_seq, t5_width - clip_width], &device)
                        .cast(clip_dtype),
                ],
                2,
            )
        };
        Ok(Sd3PromptEmbeds {
            prompt_embeds: Tensor::cat(vec![clip, t5], 1),
            pooled_prompt_embeds: pooled,
        })
    }

    /// Generates with the default generator seeded by `req.common.seed`.
    pub fn generate(&mut self, req: &Sd3Request<B>) -> Result<PipelineOutput<B>> {
        let mut generator = TorchCpuGenerator::new(req.common.seed);
        self.generate_with(req, &mut generator, |_| {})
    }

    /// Generates with the given noise source and a callback after every step.
    pub fn generate_with(
        &mut self,
        req: &Sd3Request<B>,
        noise: &mut dyn NoiseSource<B>,
        callback: impl FnMut(StepInfo<'_, B>),
    ) -> Result<PipelineOutput<B>> {
        self.generate_controlled(req, None, noise, callback)
    }

    /// [`generate_with`](Self::generate_with), with SD3 ControlNets steering each step (the
    /// SD3 ControlNet pipeline).
    pub(crate) fn generate_controlled(
        &mut self,
        req: &Sd3Request<B>,
        control: Option<Sd3Control<'_, B>>,
        noise: &mut dyn NoiseSource<B>,
        mut callback: impl FnMut(StepInfo<'_, B>),
    ) -> Result<PipelineOutput<B>> {
        let common = &req.common;
        if control.is_some() && !req.skip_guidance_layers.is_empty() {
            return Err(PipelineError::InvalidInput(
                "skip-layer guidance is not part of the SD3 ControlNet pipeline (as in \
                 diffusers): leave skip_guidance_layers empty"
                    .into(),
            ));
        }
        let default = self.default_size();
        let p = self.transformer.patch_size;
        crate::ip_adapter::refuse_image_prompt(common, "SD3")?;
        let (width, height) = check_request(common, (default, default), self.vae_scale_factor * p)?;
        let n = common.prompts.len();
        let prompts_2 = per_prompt(&req.prompts_2, &common.prompts, n, "second prompts")?;
        let prompts_3 = per_prompt(&req.prompts_3, &common.prompts, n, "third prompts")?;
        let images_per_prompt = common.num_images_per_prompt;
        let batch = n * images_per_prompt;
        let max_len = req.max_sequence_length;
        let cfg = common.does_guidance();

        self.transformer
            .check_skip_layers(&req.skip_guidance_layers)?;
        let positive = self.encode_prompts(
            &common.prompts,
            &prompts_2,
            &prompts_3,
            images_per_prompt,
            max_len,
        )?;
        // Skip-layer guidance runs on the prompt alone (diffusers' `original_prompt_embeds`).
        let skip_layer_guidance = (cfg && !req.skip_guidance_layers.is_empty()).then(|| {
            (
                positive.prompt_embeds.clone(),
                positive.pooled_prompt_embeds.clone(),
            )
        });
        let (context, pooled) = if cfg {
            let negatives = negatives_for(common)?;
            let negatives_2 = per_prompt(
                &req.negative_prompts_2,
                &negatives,
                n,
                "second negative prompts",
            )?;
            let negatives_3 = per_prompt(
                &req.negative_prompts_3,
                &negatives,
                n,
                "third negative prompts",
            )?;
            let negative = self.encode_prompts(
                &negatives,
                &negatives_2,
                &negatives_3,
                images_per_prompt,
                max_len,
            )?;
            (
                Tensor::cat(vec![negative.prompt_embeds, positive.prompt_embeds], 0),
                Tensor::cat(
                    vec![negative.pooled_prompt_embeds, positive.pooled_prompt_embeds],
                    0,
                ),
            )
        } else {
            (positive.prompt_embeds, positive.pooled_prompt_embeds)
        };
        self.offload.after_encoding(&self.text_encoder);
        self.offload.after_encoding(&self.text_encoder_2);
        if let Some(t5) = &self.text_encoder_3 {
            self.offload.after_encoding(t5);
        }
        let model_batch = context.dims()[0];

        let f = self.vae_scale_factor;
        let shape = [batch, self.transformer.in_channels, height / f, width / f];
        if self.scheduler_config.use_dynamic_shifting {
            let image_seq_len = (shape[2] / p) * (shape[3] / p);
            let options = TimestepOptions {
                mu: Some(calculate_shift(image_seq_len, &self.scheduler_config)),
                ..Default::default()
            };
            self.scheduler
                .set_timesteps_with(common.num_inference_steps, &options)?;
        } else {
            self.scheduler.set_timesteps(common.num_inference_steps)?;
        }
        self.scheduler.set_eta(common.eta);
        let latents = initial_latents(
            common,
            shape,
            (width, height),
            noise,
            self.scheduler.init_noise_sigma(),
            &self.device,
        )?;

        let timesteps = self.scheduler.timesteps().to_vec();
        let steps = timesteps.len() as f64;
        let control = control
            .map(|c| {
                c.prepare(
                    &self.vae,
                    (width, height),
                    batch,
                    cfg,
                    &pooled,
                    timesteps.len(),
                    &self.device,
                )
            })
            .transpose()?;
        let (transformer, compiled) = (&self.transformer, &self.compiled);
        // The transformer on the whole (guidance-doubled) batch at step `i`, compiled or eager.
        let predict = |i: usize, x: Tensor<B, 4>, timestep: Tensor<B, 1>| -> Result<Tensor<B, 4>> {
            // One timestep per row of the (guidance-doubled) batch.
            let timestep = timestep.expand([model_batch]);
            if let Some(control) = &control {
                return control.predict(transformer, i, x, timestep, &context, &pooled);
            }
            match compiled {
                Some(denoiser) => {
                    transformer.check_inputs(
                        x.dims(),
                        model_batch,
                        context.dims(),
                        pooled.dims(),
                    )?;
                    denoiser.call((x, timestep, context.clone(), pooled.clone()))
                }
                None => Ok(transformer.forward(x, timestep, context.clone(), pooled.clone())?),
            }
        };
        let mut step = 0usize;
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
            |model_input, timestep, _| {
                let index = step;
                let i = step as f64;
                step += 1;
                let skipping = skip_layer_guidance.as_ref().filter(|_| {
                    i > steps * req.skip_layer_guidance_start
                        && i < steps * req.skip_layer_guidance_stop
                });
                let Some((prompt_embeds, pooled_prompt_embeds)) = skipping else {
                    return with_guidance(model_input, common.guidance_scale, |x| {
                        predict(index, x, timestep.clone())
                    });
                };
                let prediction = predict(
                    index,
                    Tensor::cat(vec![model_input.clone(), model_input.clone()], 0),
                    timestep.clone(),
                )?;
                let text = prediction.clone().narrow(0, batch, batch);
                let guided = guide(prediction, batch, common.guidance_scale);
                // Eager even in compiled mode: a different program, run only on a few steps.
                let skipped = transformer.forward_skipping(
                    model_input,
                    timestep.expand([batch]),
                    prompt_embeds.clone(),
                    pooled_prompt_embeds.clone(),
                    &req.skip_guidance_layers,
                )?;
                Ok(guided + (text - skipped).mul_scalar(req.skip_layer_guidance_scale))
            },
            &mut callback,
        )?;

        let images = decode_latents(&self.vae, &latents, common.output)?;
        Ok(PipelineOutput { latents, images })
    }
}

impl<B: Backend> ToDevice<B> for StableDiffusion3Pipeline<B> {
    /// Moves every component to `device`.
    fn to(self, device: &B::Device) -> Self {
        self.to_components(device, device, device)
    }
}

/// The compiled transformer call's inputs: latents, timesteps, prompt embeddings, pooled
/// embeddings.
pub type Sd3StepInputs<B> = (Tensor<B, 4>, Tensor<B, 1>, Tensor<B, 3>, Tensor<B, 2>);

impl StableDiffusion3Pipeline<Oxi> {
    /// Compiled mode: from the next generation on, each transformer call (both halves of
    /// classifier-free guidance, batched) is one XLA program, traced on first use and cached
    /// by input shapes. Timesteps and the prompt embeddings are runtime inputs, so a new
    /// prompt, seed, guidance scale or step count reuses the program; a new size, batch or
    /// `max_sequence_length` compiles once more. Needs the transformer on a PJRT device. The
    /// text encoders' layers, the VAE and the scheduler step are programs too
    /// ([`SchedulerProgram`]: one per step structure, scalars as arguments).
    pub fn compile(&mut self) -> Result<()> {
        self.compile_on(None)
    }

    /// [`StableDiffusionPipeline::enable_parallelism`](crate::StableDiffusionPipeline::enable_parallelism)
    /// for the transformer: its joint blocks split over `tp_degree` devices, the batch (both
    /// guidance halves) over `dp_degree`.
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
        crate::compiled::compile_clip(&mut self.text_encoder_2, "text_encoder_2");
        if let Some(t5) = &mut self.text_encoder_3 {
            crate::compiled::compile_t5(t5, "text_encoder_3");
        }
        let transformer = self.transformer.clone();
        let warm = WarmStart::of("transformer", &transformer, self.transformer.device());
        let step = move |(latents, t, context, pooled): Sd3StepInputs<Oxi>| {
            transformer.forward_checked(latents, t, context, pooled)
        };
        // Every input batch-major: split by batch where it divides, else whole.
        let layouts = vec![Layout::BatchSplit(0); 4];
        self.compiled = Some(CompiledCall::warm_started(
            "sd3_transformer",
            step,
            placement,
            layouts,
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
            &[
                ("text_encoder", &self.text_encoder),
                ("text_encoder_2", &self.text_encoder_2),
            ],
            self.text_encoder_3
                .as_ref()
                .map(|t5| ("text_encoder_3", t5)),
            "transformer",
            self.compile_stats(),
            self.scheduler_program.as_ref(),
            &self.vae,
        )
    }
}
