//! `PixArtAlphaPipeline` and `PixArtSigmaPipeline`: text to image with PixArt, step for step as
//! diffusers' `pipeline_pixart_alpha.py` and `pipeline_pixart_sigma.py`.
//!
//! Prompt -> lower case -> T5 tokenizer (padded to `max_sequence_length`, with the mask) -> T5
//! encoder; latents from the generator (or the caller); resolution binning to a trained size;
//! the scheduler loop with classifier-free guidance batched in one transformer call, the caption
//! mask and (1024px Alpha models) the micro-conditions; learned sigma dropped; the VAE decode,
//! resized back to the requested size when binned.
//!
//! The two diffusers classes differ only in defaults (120 or 300 tokens, the bins of a 2048px
//! model, micro-conditions only for Alpha), so one type serves both, told apart by
//! [`PixArtVariant`].

use std::sync::Arc;

use oxidiff_backend_tpu::spmd::{Layout, SpmdPlacement};
use oxidiff_parallel::ParallelConfig;
use std::path::{Path, PathBuf};

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use oxidiff_backend_tpu::Oxi;
use oxidiff_models::embeddings::MicroConditions;
use oxidiff_models::{
    AutoencoderKL, AutoencoderKLConfig, PixArtTransformer2DConfig, PixArtTransformer2DModel,
    T5EncoderModel, T5Tokenizer, ToDevice,
};
use oxidiff_schedulers::{NoiseSource, Scheduler, SchedulerConfig, TorchCpuGenerator};

use crate::compiled::{CompileStats, CompiledCall, ComponentStats, SchedulerProgram, WarmStart};
use crate::denoise::{
    check_image_pixels, check_request, decode_to_tensor, initial_latents, negatives_for,
    with_guidance, DenoisingLoop, GenerateRequest, OutputType, PipelineDefaults, PipelineOutput,
    StepInfo,
};
use crate::error::{PipelineError, Result};
use crate::image::{postprocess, resize_and_crop};
use crate::loading::{check_pipeline_class, component, load_scheduler, LoadOptions};
use crate::memory::{component_memory, ComponentMemory, PlaceName};
use crate::offload::Offload;
use crate::pixart_bins::{
    classify_height_width_bin, ASPECT_RATIO_1024_BIN, ASPECT_RATIO_2048_BIN, ASPECT_RATIO_256_BIN,
    ASPECT_RATIO_512_BIN,
};
use crate::truncation::warn_if_t5_cut;

/// The pipeline classes this type loads (`_class_name` in `model_index.json`).
pub const PIXART_CLASSES: [&str; 2] = ["PixArtAlphaPipeline", "PixArtSigmaPipeline"];

/// Which of diffusers' two PixArt pipelines a folder is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PixArtVariant {
    Alpha,
    Sigma,
}

impl PixArtVariant {
    /// From `model_index.json`'s `_class_name`.
    pub fn from_class(class: &str) -> Option<Self> {
        match class {
            "PixArtAlphaPipeline" => Some(Self::Alpha),
            "PixArtSigmaPipeline" => Some(Self::Sigma),
            _ => None,
        }
    }

    /// diffusers' default `max_sequence_length`: 120 tokens for Alpha, 300 for Sigma.
    pub fn default_max_sequence_length(self) -> usize {
        match self {
            Self::Alpha => 120,
            Self::Sigma => 300,
        }
    }

    /// The aspect-ratio bins for a transformer `sample_size`, or `None` where diffusers has
    /// none (it then refuses binning).
    pub fn bins(self, sample_size: usize) -> Option<&'static [(f64, usize, usize)]> {
        Some(match (self, sample_size) {
            (Self::Sigma, 256) => &ASPECT_RATIO_2048_BIN,
            (_, 128) => &ASPECT_RATIO_1024_BIN,
            (_, 64) => &ASPECT_RATIO_512_BIN,
            (_, 32) => &ASPECT_RATIO_256_BIN,
            _ => return None,
        })
    }
}

/// One PixArt request: the common settings plus PixArt's own.
#[derive(Debug, Clone)]
pub struct PixArtRequest<B: Backend> {
    /// Prompts, negative prompts, steps, guidance, size, seed, latents, output. `Default` gives
    /// diffusers' PixArt defaults: 20 steps, guidance 4.5, the empty negative prompt.
    pub common: GenerateRequest<B>,
    /// Tokens per prompt, `None` for the variant's default (120 Alpha, 300 Sigma); longer
    /// prompts are cut with a warning.
    pub max_sequence_length: Option<usize>,
    /// Map the size to the nearest trained aspect ratio, then resize the image back (diffusers'
    /// `use_resolution_binning`, on by default).
    pub resolution_binning: bool,
}

impl<B: Backend> Default for PixArtRequest<B> {
    fn default() -> Self {
        Self {
            common: PipelineDefaults::PIXART_ALPHA.request(),
            max_sequence_length: None,
            resolution_binning: true,
        }
    }
}

/// Encoded prompts: T5 hidden states `[n, seq, dim]` and their 0/1 masks.
pub struct PromptEmbeds<B: Backend> {
    pub embeds: Tensor<B, 3>,
    pub mask: Vec<Vec<u32>>,
}

/// PixArt-Alpha and PixArt-Sigma text-to-image.
pub struct PixArtPipeline<B: Backend> {
    pub variant: PixArtVariant,
    pub tokenizer: T5Tokenizer,
    pub text_encoder: T5EncoderModel<B>,
    pub transformer: PixArtTransformer2DModel<B>,
    pub vae: AutoencoderKL<B>,
    pub scheduler_config: SchedulerConfig,
    pub scheduler: Box<dyn Scheduler<B>>,
    pub vae_scale_factor: usize,
    /// The transformer's native latent size (`sample_size`), for the default size and bins.
    pub sample_size: usize,
    /// Where latents live and the denoising loop runs: the transformer's device.
    pub device: B::Device,
    pub source: PathBuf,
    /// The compiled transformer call, when [`compile`](PixArtPipeline::compile) was called.
    pub compiled: Option<PixArtCompiled<B>>,
    /// Compiled mode's scheduler step, when the pipeline was compiled.
    pub scheduler_program: Option<SchedulerProgram<B>>,
    /// What is handed back between requests ([`Offload::TextEncoders`]: the text encoders,
    /// after each request's prompts are encoded).
    pub offload: Offload,
}

/// diffusers' name for the Alpha pipeline: the same type.
pub type PixArtAlphaPipeline<B> = PixArtPipeline<B>;
/// diffusers' name for the Sigma pipeline: the same type.
pub type PixArtSigmaPipeline<B> = PixArtPipeline<B>;

impl<B: Backend> PixArtPipeline<B> {
    /// The denoiser's device mesh and weight shards, after `enable_parallelism`.
    pub fn spmd_placement(
        &self,
    ) -> Option<&std::sync::Arc<oxidiff_backend_tpu::spmd::SpmdPlacement>> {
        match self.compiled.as_ref()? {
            PixArtCompiled::Plain(f) => f.spmd_placement(),
            PixArtCompiled::Conditioned(f) => f.spmd_placement(),
        }
    }

    /// What each component's weights hold and where (`place` names a device): `txt2img
    /// --json`'s `memory`.
    pub fn memory(&self, place: PlaceName<'_, B::Device>) -> Vec<ComponentMemory> {
        vec![
            component_memory("text_encoder", &self.text_encoder, None, place),
            component_memory("transformer", &self.transformer, None, place),
            component_memory("vae", &self.vae, None, place),
        ]
    }

    /// Loads a diffusers-format folder, or a Hub id from the local cache.
    pub fn from_pretrained(spec: &str, options: &LoadOptions, device: &B::Device) -> Result<Self> {
        let dir = crate::hub::resolve_model(spec, options.variant.as_deref())?;
        Self::from_dir(&dir, options, device)
    }

    /// Fuses a diffusers/PEFT LoRA file (`transformer.<module>.lora_A.weight` /
    /// `lora_B.weight`) into the transformer at `scale`: `W += scale * alpha / rank * up @
    /// down`, what peft computes for it (diffusers has no LoRA loader for PixArt; T5 takes
    /// none). Call it once per LoRA, before [`compile`](PixArtPipeline::compile); keys that fit
    /// no layer are an error naming them, and the pipeline is left unchanged.
    pub fn load_lora(
        &mut self,
        path: impl AsRef<Path>,
        scale: f32,
    ) -> Result<crate::lora::LoraReport> {
        crate::lora::fuse_into(
            path.as_ref(),
            scale,
            crate::lora::Denoiser::transformer(&mut self.transformer),
            &mut [],
            "PixArt pipeline",
            self.compiled.is_some(),
        )
    }

    /// Loads a diffusers-format `PixArtAlphaPipeline` or `PixArtSigmaPipeline` folder.
    pub fn from_dir(dir: &Path, options: &LoadOptions, device: &B::Device) -> Result<Self> {
        options.refuse_transformer_file("PixArt")?;
        let class = check_pipeline_class(dir, &PIXART_CLASSES)?;
        let variant = PixArtVariant::from_class(&class).unwrap_or(PixArtVariant::Alpha);
        let weights_variant = options.variant.as_deref();
        let dtype = options.weights_dtype();
        let tokenizer = T5Tokenizer::from_dir(&component(dir, "tokenizer")?)?;
        let text_encoder = T5EncoderModel::from_dir_in(
            &component(dir, "text_encoder")?,
            weights_variant,
            dtype,
            device,
        )?;
        let transformer_dir = component(dir, "transformer")?;
        let transformer_config =
            PixArtTransformer2DConfig::from_file(&transformer_dir.join("config.json"))?;
        let transformer = PixArtTransformer2DModel::from_dir_in(
            &transformer_dir,
            weights_variant,
            dtype,
            device,
        )?;
        let vae_dir = component(dir, "vae")?;
        let vae_config = AutoencoderKLConfig::from_file(&vae_dir.join("config.json"))?;
        let vae = AutoencoderKL::from_dir_in(&vae_dir, weights_variant, dtype, device)?;
        let (scheduler_config, scheduler) = load_scheduler(dir, options)?;
        let cast = crate::loading::Cast(options.dtype);
        Ok(Self {
            variant,
            tokenizer,
            text_encoder: cast.apply(text_encoder),
            transformer: cast.apply(transformer),
            vae: cast.apply(vae),
            scheduler_config,
            scheduler,
            vae_scale_factor: vae_config.scale_factor(),
            sample_size: transformer_config.sample_size,
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

    /// Places each component on its own device (e.g. T5 on the CPU, the transformer and VAE
    /// on an accelerator).
    #[must_use]
    pub fn to_components(
        mut self,
        text_encoder: &B::Device,
        transformer: &B::Device,
        vae: &B::Device,
    ) -> Self {
        self.text_encoder = self.text_encoder.to(text_encoder);
        self.transformer = self.transformer.to(transformer);
        self.vae = self.vae.to(vae);
        self.device = transformer.clone();
        // A compiled step holds the transformer of its device: compile again after moving.
        self.compiled = None;
        self.scheduler_program = None;
        // The VAE's and text encoders' programs too (they hold the weights they were built for).
        self.vae.clear_programs();
        self.text_encoder.blocks_program.clear();
        self
    }

    /// The default image size: `sample_size` times the VAE factor (1024 for PixArt-XL-2-1024).
    pub fn default_size(&self) -> usize {
        self.sample_size * self.vae_scale_factor
    }

    /// diffusers' `__call__` defaults (steps, guidance, T5 length) of this variant.
    pub fn defaults(&self) -> PipelineDefaults {
        match self.variant {
            PixArtVariant::Alpha => PipelineDefaults::PIXART_ALPHA,
            PixArtVariant::Sigma => PipelineDefaults::PIXART_SIGMA,
        }
    }

    /// A request with this variant's diffusers defaults (its T5 length is `None`: the
    /// variant's own).
    pub fn default_request(&self) -> PixArtRequest<B> {
        PixArtRequest {
            common: self.defaults().request(),
            ..Default::default()
        }
    }

    /// Encodes prompts as diffusers does without caption cleaning (`text.lower().strip()`):
    /// `[n * images_per_prompt, max_sequence_length, dim]` and the masks.
    pub fn encode_prompts(
        &self,
        prompts: &[String],
        images_per_prompt: usize,
        max_sequence_length: usize,
    ) -> Result<PromptEmbeds<B>> {
        let mut ids = Vec::with_capacity(prompts.len() * images_per_prompt);
        let mut mask = Vec::with_capacity(ids.capacity());
        for prompt in prompts {
            let text = prompt.to_lowercase();
            let encoded = self.tokenizer.encode(text.trim(), max_sequence_length)?;
            warn_if_t5_cut(
                &self.tokenizer,
                text.trim(),
                max_sequence_length,
                encoded.truncated(),
            )?;
            for _ in 0..images_per_prompt {
                ids.push(encoded.ids.clone());
                mask.push(encoded.attention_mask.clone());
            }
        }
        let embeds = self.text_encoder.forward(&ids, Some(&mask))?;
        Ok(PromptEmbeds { embeds, mask })
    }

    /// The size the latents are made at: the request's (or default) size, binned when asked.
    /// Returns `(requested (w, h), generated (w, h))`.
    pub fn sizes(&self, req: &PixArtRequest<B>) -> Result<((usize, usize), (usize, usize))> {
        let default = self.default_size();
        let common = &req.common;
        let requested = (
            common.width.unwrap_or(default),
            common.height.unwrap_or(default),
        );
        // Latents are cut into patches: the size must divide by VAE factor times patch size.
        let factor = self.vae_scale_factor * self.transformer.patch_size;
        crate::ip_adapter::refuse_image_prompt(common, "PixArt")?;
        if !req.resolution_binning {
            let size = check_request(common, (default, default), factor)?;
            return Ok((size, size));
        }
        let bins = self.variant.bins(self.sample_size).ok_or_else(|| {
            PipelineError::InvalidInput(format!(
                "resolution binning has no aspect-ratio bins for a transformer with sample_size \
                 {} (diffusers has them for 32, 64, 128 and, for Sigma, 256); turn binning off",
                self.sample_size
            ))
        })?;
        // The output is resized back to the requested size: bounded like any image.
        check_image_pixels(requested.0, requested.1)?;
        if requested.0 == 0 || requested.1 == 0 {
            return Err(PipelineError::InvalidInput(format!(
                "width and height must be positive, got {}x{}",
                requested.0, requested.1
            )));
        }
        let (h, w) = classify_height_width_bin(requested.1, requested.0, bins);
        let binned = GenerateRequest {
            width: Some(w),
            height: Some(h),
            ..common.clone()
        };
        let size = check_request(&binned, (w, h), factor)?;
        Ok((requested, size))
    }

    /// Generates with the default generator seeded by `req.common.seed`.
    pub fn generate(&mut self, req: &PixArtRequest<B>) -> Result<PipelineOutput<B>> {
        let mut generator = TorchCpuGenerator::new(req.common.seed);
        self.generate_with(req, &mut generator, |_| {})
    }

    /// Generates with the given noise source and a callback after every step.
    pub fn generate_with(
        &mut self,
        req: &PixArtRequest<B>,
        noise: &mut dyn NoiseSource<B>,
        mut callback: impl FnMut(StepInfo<'_, B>),
    ) -> Result<PipelineOutput<B>> {
        let common = &req.common;
        let (requested, (width, height)) = self.sizes(req)?;
        let max_len = req
            .max_sequence_length
            .unwrap_or_else(|| self.variant.default_max_sequence_length());
        if max_len == 0 {
            return Err(PipelineError::InvalidInput(
                "max_sequence_length must be at least 1".into(),
            ));
        }
        let batch = common.prompts.len() * common.num_images_per_prompt;
        let cfg = common.does_guidance();

        let prompt = self.encode_prompts(&common.prompts, common.num_images_per_prompt, max_len)?;
        let (caption, mask) = if cfg {
            let negative = self.encode_prompts(
                &negatives_for(common)?,
                common.num_images_per_prompt,
                max_len,
            )?;
            let mut mask = negative.mask;
            mask.extend(prompt.mask);
            (Tensor::cat(vec![negative.embeds, prompt.embeds], 0), mask)
        } else {
            (prompt.embeds, prompt.mask)
        };
        self.offload.after_encoding(&self.text_encoder);
        let caption = caption.to_device(&self.device);
        let caption_bias = PixArtTransformer2DModel::<B>::caption_mask_bias(&mask, &self.device);
        let model_batch = mask.len();

        self.scheduler.set_timesteps(common.num_inference_steps)?;
        self.scheduler.set_eta(common.eta);
        let f = self.vae_scale_factor;
        let channels = self.transformer.in_channels;
        let shape = [batch, channels, height / f, width / f];
        let latents = initial_latents(
            common,
            shape,
            (width, height),
            noise,
            self.scheduler.init_noise_sigma(),
            &self.device,
        )?;

        // Micro-conditions: the 1024px Alpha models, as diffusers passes them.
        let conditions =
            (self.variant == PixArtVariant::Alpha && self.sample_size == 128).then(|| {
                let row = |values: Vec<f32>, n: usize| {
                    let per = values.len();
                    let all: Vec<f32> = (0..n).flat_map(|_| values.clone()).collect();
                    Tensor::<B, 2>::from_data(TensorData::new(all, [n, per]), &self.device)
                };
                MicroConditions {
                    resolution: row(vec![height as f32, width as f32], model_batch),
                    aspect_ratio: row(vec![(height as f64 / width as f64) as f32], model_batch),
                }
            });

        let timesteps = self.scheduler.timesteps().to_vec();
        let (transformer, compiled) = (&self.transformer, &self.compiled);
        // Learned sigma: the second half of the output channels is the variance, dropped
        // (before guidance, which is the same per channel).
        let learned_sigma = transformer.out_channels / 2 == channels;
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
                with_guidance(model_input, common.guidance_scale, |model_input| {
                    // One timestep per row of the (guidance-doubled) batch.
                    let timestep = timestep.expand([model_batch]);
                    let prediction = match compiled {
                        Some(denoiser) => {
                            transformer.check_inputs(
                                model_input.dims(),
                                model_batch,
                                caption.dims(),
                                conditions.is_some(),
                            )?;
                            denoiser.call(
                                model_input,
                                timestep,
                                caption.clone(),
                                caption_bias.clone(),
                                conditions.as_ref(),
                            )?
                        }
                        None => transformer.forward(
                            model_input,
                            timestep,
                            caption.clone(),
                            Some(caption_bias.clone()),
                            conditions.as_ref(),
                        )?,
                    };
                    Ok(if learned_sigma {
                        prediction.narrow(1, 0, channels)
                    } else {
                        prediction
                    })
                })
            },
            &mut callback,
        )?;

        let images = match common.output {
            OutputType::Latents => None,
            OutputType::Images => {
                let decoded = decode_to_tensor(&self.vae, &latents)?;
                let decoded = if req.resolution_binning {
                    resize_and_crop(decoded, requested.0, requested.1)?
                } else {
                    decoded
                };
                Some(postprocess(decoded)?)
            }
        };
        Ok(PipelineOutput { latents, images })
    }
}

impl<B: Backend> ToDevice<B> for PixArtPipeline<B> {
    /// Moves every component to `device`.
    fn to(self, device: &B::Device) -> Self {
        self.to_components(device, device, device)
    }
}

/// The compiled transformer call's inputs: latents, timesteps, caption, caption bias.
pub type PixArtInputs<B> = (Tensor<B, 4>, Tensor<B, 1>, Tensor<B, 3>, Tensor<B, 4>);
/// The same plus the micro-conditions (resolution, aspect ratio).
pub type PixArtConditionedInputs<B> = (
    Tensor<B, 4>,
    Tensor<B, 1>,
    Tensor<B, 3>,
    Tensor<B, 4>,
    Tensor<B, 2>,
    Tensor<B, 2>,
);

/// The compiled transformer call: two input signatures, as a 1024px Alpha transformer takes
/// micro-conditions and the others do not.
pub enum PixArtCompiled<B: Backend> {
    Plain(CompiledCall<B, PixArtInputs<B>>),
    Conditioned(CompiledCall<B, PixArtConditionedInputs<B>>),
}

impl<B: Backend> PixArtCompiled<B> {
    /// The call with the inputs its signature takes.
    pub fn call(
        &self,
        latents: Tensor<B, 4>,
        timestep: Tensor<B, 1>,
        caption: Tensor<B, 3>,
        caption_bias: Tensor<B, 4>,
        conditions: Option<&MicroConditions<B>>,
    ) -> Result<Tensor<B, 4>> {
        match self {
            Self::Plain(f) => f.call((latents, timestep, caption, caption_bias)),
            Self::Conditioned(f) => {
                let c = conditions.ok_or_else(|| {
                    PipelineError::Compile(
                        "this transformer was compiled with micro-conditions; pass them".into(),
                    )
                })?;
                f.call((
                    latents,
                    timestep,
                    caption,
                    caption_bias,
                    c.resolution.clone(),
                    c.aspect_ratio.clone(),
                ))
            }
        }
    }

    /// What was compiled so far.
    pub fn compile_stats(&self) -> CompileStats {
        match self {
            Self::Plain(f) => f.compile_stats(),
            Self::Conditioned(f) => f.compile_stats(),
        }
    }
}

impl PixArtPipeline<Oxi> {
    /// Compiled mode: from the next generation on, each transformer call (both halves of
    /// classifier-free guidance, batched) is one XLA program, traced on first use and cached
    /// by input shapes. Timesteps, caption, mask and micro-conditions are runtime inputs, so a
    /// new prompt, seed, guidance scale or step count reuses the program; a new size, batch or
    /// `max_sequence_length` compiles once more. Needs the transformer on a PJRT device. T5's
    /// blocks, the VAE and the scheduler step are programs too ([`SchedulerProgram`]: one per
    /// step structure, scalars as arguments).
    pub fn compile(&mut self) -> Result<()> {
        self.compile_on(None)
    }

    /// [`StableDiffusionPipeline::enable_parallelism`](crate::StableDiffusionPipeline::enable_parallelism)
    /// for the transformer: its blocks split over `tp_degree` devices, the batch over
    /// `dp_degree`.
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
        crate::compiled::compile_t5(&mut self.text_encoder, "text_encoder");
        let transformer = self.transformer.clone();
        let warm = WarmStart::of("transformer", &transformer, self.transformer.device());
        // Every input batch-major: split by batch where it divides, else whole.
        let name = "pixart_transformer";
        self.compiled = Some(if transformer.uses_micro_conditions() {
            let step = move |(latents, t, caption, bias, resolution, aspect_ratio): PixArtConditionedInputs<Oxi>| {
                let conditions = MicroConditions {
                    resolution,
                    aspect_ratio,
                };
                transformer.forward_checked(latents, t, caption, Some(bias), Some(&conditions))
            };
            let layouts = vec![Layout::BatchSplit(0); 6];
            PixArtCompiled::Conditioned(CompiledCall::warm_started(
                name, step, placement, layouts, warm,
            ))
        } else {
            let step = move |(latents, t, caption, bias): PixArtInputs<Oxi>| {
                transformer.forward_checked(latents, t, caption, Some(bias), None)
            };
            let layouts = vec![Layout::BatchSplit(0); 4];
            PixArtCompiled::Plain(CompiledCall::warm_started(
                name, step, placement, layouts, warm,
            ))
        });
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
            &[],
            Some(("text_encoder", &self.text_encoder)),
            "transformer",
            self.compile_stats(),
            self.scheduler_program.as_ref(),
            &self.vae,
        )
    }
}
