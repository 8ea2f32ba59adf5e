//! `StableDiffusionXLPipeline`: SDXL text to image, step for step as diffusers'
//! `pipeline_stable_diffusion_xl.py`.
//!
//! Two CLIP encoders (`text_encoder`: penultimate hidden state; `text_encoder_2`, with
//! projection: penultimate hidden state and the pooled `text_embeds`), concatenated on the
//! feature axis (a refiner folder without the first encoder, as stabilityai's, uses
//! `text_encoder_2`'s alone); the UNet's added condition (pooled embeds and `add_time_ids` from the original
//! size, crop and target size); the scheduler loop and VAE decode shared with
//! [`StableDiffusionPipeline`](crate::StableDiffusionPipeline). No invisible watermark is applied
//! (diffusers applies one only when the `invisible-watermark` package is installed).

use std::path::{Path, PathBuf};

use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use oxidiff_backend_tpu::spmd::{Layout, SpmdPlacement};
use oxidiff_backend_tpu::Oxi;
use oxidiff_models::config::{load_json, PerBlock};
use oxidiff_models::{
    AddedCondition, AutoencoderKL, AutoencoderKLConfig, ClipTextConfig, ClipTextModel,
    ClipTokenizer, ToDevice, UNet2DConditionConfig, UNet2DConditionModel,
};
use oxidiff_parallel::ParallelConfig;
use oxidiff_schedulers::{
    scheduler_from_config, NoiseSource, Scheduler, SchedulerConfig, TorchCpuGenerator,
};
use serde::Deserialize;

use crate::compiled::{CompileStats, CompiledCall, ComponentStats, SchedulerProgram, WarmStart};
use crate::control::ControlStep;
use crate::denoise::{
    check_request, decode_latents, initial_latents, negatives_for, per_prompt, with_guidance,
    DenoisingLoop, GenerateRequest, PipelineDefaults, PipelineOutput, StepInfo,
};
use crate::error::{PipelineError, Result};
use crate::inpaint::{check_unet_input, InpaintCondition};
use crate::ip_adapter::{append_image_tokens, IpAdapter};
use crate::loading::LoadOptions;
use crate::memory::{component_memory, ComponentMemory, PlaceName};
use crate::offload::Offload;
use crate::truncation::warn_if_clip_cut;

/// The pipeline class this type loads (`_class_name` in `model_index.json`).
pub const SDXL_CLASS: &str = "StableDiffusionXLPipeline";

/// The SDXL pipeline classes whose folders load (the refiner's is the image-to-image one).
pub const SDXL_CLASSES: [&str; 3] = [
    SDXL_CLASS,
    "StableDiffusionXLImg2ImgPipeline",
    "StableDiffusionXLInpaintPipeline",
];

/// SDXL's extra request fields; `Default` is diffusers' (sizes from the output size, no crop,
/// the prompts reused for the second encoder, the whole schedule).
#[derive(Debug, Clone, Default)]
pub struct XlOptions {
    /// Prompts for `tokenizer_2`/`text_encoder_2` (diffusers' `prompt_2`); empty: the prompts.
    pub prompts_2: Vec<String>,
    /// `negative_prompt_2`; empty: the negative prompts.
    pub negative_prompts_2: Vec<String>,
    /// `(height, width)` the image is said to come from; default the output size.
    pub original_size: Option<(usize, usize)>,
    /// `(top, left)` of the crop; default `(0, 0)`.
    pub crops_coords_top_left: (usize, usize),
    /// `(height, width)`; default the output size.
    pub target_size: Option<(usize, usize)>,
    /// The negative (uncond) time ids; used only when both sizes are given, as in diffusers.
    pub negative_original_size: Option<(usize, usize)>,
    pub negative_crops_coords_top_left: (usize, usize),
    pub negative_target_size: Option<(usize, usize)>,
    /// Stop after this fraction of the schedule (in (0, 1)), leaving noisy latents for a
    /// refiner, as diffusers' `denoising_end`.
    pub denoising_end: Option<f64>,
}

/// One SDXL request: the common settings and SDXL's own. `Default` is diffusers'
/// `StableDiffusionXLPipeline.__call__` (50 steps, guidance 5.0); build on it
/// (`XlRequest { xl, ..Default::default() }`, then set `common`'s fields) or on
/// [`StableDiffusionXLPipeline::default_request`], not on [`GenerateRequest::default`],
/// which is Stable Diffusion's (guidance 7.5).
#[derive(Debug, Clone)]
pub struct XlRequest<B: Backend> {
    pub common: GenerateRequest<B>,
    pub xl: XlOptions,
}

impl<B: Backend> Default for XlRequest<B> {
    fn default() -> Self {
        Self {
            common: PipelineDefaults::STABLE_DIFFUSION_XL.request(),
            xl: XlOptions::default(),
        }
    }
}

impl<B: Backend> XlRequest<B> {
    /// `common` with SDXL's default options.
    pub fn new(common: GenerateRequest<B>) -> Self {
        Self {
            common,
            xl: XlOptions::default(),
        }
    }
}

#[derive(Debug, Deserialize)]
struct XlModelIndex {
    #[serde(rename = "_class_name")]
    class_name: String,
    /// diffusers' default is true: no negative prompt means all-zero negative embeddings.
    #[serde(default = "default_true")]
    force_zeros_for_empty_prompt: bool,
    /// The refiner's: time ids end in an aesthetic score instead of the target size.
    #[serde(default)]
    requires_aesthetics_score: bool,
    /// `[library, class]`, or `[null, null]` when the pipeline has no first text encoder (as
    /// stabilityai's refiner).
    #[serde(default)]
    text_encoder: Option<serde_json::Value>,
    /// `[null, null]` with `text_encoder` (stabilityai's refiner).
    #[serde(default)]
    tokenizer: Option<serde_json::Value>,
}

/// Whether a `model_index.json` entry is `[null, null]` (the component is absent).
fn listed_as_absent(entry: Option<&serde_json::Value>) -> bool {
    entry
        .and_then(|v| v.as_array())
        .is_some_and(|pair| pair.iter().all(|v| v.is_null()))
}

fn default_true() -> bool {
    true
}

/// Prompt embeddings for the UNet: `[n, seq, dim_1 + dim_2]` and pooled `[n, projection_dim]`.
#[derive(Debug, Clone)]
pub struct XlPromptEmbeds<B: Backend> {
    pub prompt_embeds: Tensor<B, 3>,
    pub pooled_prompt_embeds: Tensor<B, 2>,
}

/// Stable Diffusion XL text-to-image.
pub struct StableDiffusionXLPipeline<B: Backend> {
    /// `None` with `text_encoder` in a refiner folder that ships only the second encoder.
    pub tokenizer: Option<ClipTokenizer>,
    pub tokenizer_2: ClipTokenizer,
    /// `None` in a refiner folder that ships only `text_encoder_2` (stabilityai's
    /// `stable-diffusion-xl-refiner-1.0`): the prompt embeddings are then its alone.
    pub text_encoder: Option<ClipTextModel<B>>,
    pub text_encoder_2: ClipTextModel<B>,
    pub unet: UNet2DConditionModel<B>,
    pub vae: AutoencoderKL<B>,
    pub scheduler_config: SchedulerConfig,
    pub scheduler: Box<dyn Scheduler<B>>,
    pub vae_scale_factor: usize,
    pub sample_size: usize,
    /// `text_encoder_2`'s `projection_dim`, for the `add_time_ids` width check.
    pub projection_dim: usize,
    /// `addition_time_embed_dim` of the UNet.
    pub addition_time_embed_dim: usize,
    /// `projection_class_embeddings_input_dim` of the UNet.
    pub add_embedding_dim: usize,
    pub force_zeros_for_empty_prompt: bool,
    /// `model_index.json`'s `requires_aesthetics_score` (SDXL refiner): image-to-image time
    /// ids are `[original (h, w), crop (top, left), aesthetic score]`.
    pub requires_aesthetics_score: bool,
    /// The UNet's device, where the loop runs.
    pub device: B::Device,
    pub source: PathBuf,
    /// The compiled denoiser, when [`compile`](StableDiffusionXLPipeline::compile) was called.
    pub compiled: Option<CompiledCall<B, XlUNetInputs<B>>>,
    /// Compiled mode's scheduler step, when the pipeline was compiled.
    pub scheduler_program: Option<SchedulerProgram<B>>,
    /// What is handed back between requests ([`Offload::TextEncoders`]: the text encoders,
    /// after each request's prompts are encoded).
    pub offload: Offload,
    /// The attached IP-Adapter ([`load_ip_adapter`](Self::load_ip_adapter)).
    pub ip_adapter: Option<IpAdapter<B>>,
}

impl<B: Backend> StableDiffusionXLPipeline<B> {
    /// The denoiser's device mesh and weight shards, after `enable_parallelism`.
    pub fn spmd_placement(
        &self,
    ) -> Option<&std::sync::Arc<oxidiff_backend_tpu::spmd::SpmdPlacement>> {
        self.compiled.as_ref()?.spmd_placement()
    }

    /// What each component's weights hold and where (`place` names a device): `txt2img
    /// --json`'s `memory`.
    pub fn memory(&self, place: PlaceName<'_, B::Device>) -> Vec<ComponentMemory> {
        let mut all = Vec::new();
        if let Some(encoder) = &self.text_encoder {
            all.push(component_memory("text_encoder", encoder, None, place));
        }
        all.push(component_memory(
            "text_encoder_2",
            &self.text_encoder_2,
            None,
            place,
        ));
        all.push(component_memory("unet", &self.unet, None, place));
        all.push(component_memory("vae", &self.vae, None, place));
        if let Some(adapter) = &self.ip_adapter {
            all.extend(adapter.memory(place));
        }
        all
    }

    /// Loads a diffusers-format folder, or a Hub id from the local cache.
    pub fn from_pretrained(spec: &str, options: &LoadOptions, device: &B::Device) -> Result<Self> {
        let dir = crate::hub::resolve_model(spec, options.variant.as_deref())?;
        Self::from_dir(&dir, options, device)
    }

    /// Loads a diffusers-format SDXL pipeline folder.
    pub fn from_dir(dir: &Path, options: &LoadOptions, device: &B::Device) -> Result<Self> {
        options.refuse_transformer_file("SDXL")?;
        let index_path = dir.join("model_index.json");
        if !index_path.is_file() {
            return Err(PipelineError::ModelNotFound {
                spec: dir.display().to_string(),
                hint: "the folder has no model_index.json; point at the root of a diffusers \
                       pipeline folder"
                    .into(),
            });
        }
        let index: XlModelIndex = load_json(&index_path)?;
        if !SDXL_CLASSES.contains(&index.class_name.as_str()) {
            return Err(PipelineError::UnsupportedPipeline {
                path: index_path,
                class: index.class_name,
                supported: SDXL_CLASSES.join(", "),
            });
        }
        let no_text_encoder = listed_as_absent(index.text_encoder.as_ref());
        if no_text_encoder != listed_as_absent(index.tokenizer.as_ref()) {
            return Err(PipelineError::InvalidInput(format!(
                "{}: `text_encoder` and `tokenizer` must both be listed or both be \
                 `[null, null]` (a refiner that ships only text_encoder_2 has neither)",
                index_path.display()
            )));
        }
        let component = |name: &str| -> Result<PathBuf> {
            let path = dir.join(name);
            if path.is_dir() {
                Ok(path)
            } else {
                Err(PipelineError::MissingComponent {
                    dir: dir.to_path_buf(),
                    component: name.to_string(),
                })
            }
        };
        let variant = options.variant.as_deref();
        let dtype = options.weights_dtype();
        // Every folder is checked before any weight is read.
        let first = if no_text_encoder {
            None
        } else {
            Some((component("tokenizer")?, component("text_encoder")?))
        };
        let dirs = ["tokenizer_2", "text_encoder_2", "unet", "vae", "scheduler"].map(component);
        let [tok2_dir, te2_dir, unet_dir, vae_dir, sched_dir] = dirs;
        let (tok2_dir, te2_dir) = (tok2_dir?, te2_dir?);
        let (unet_dir, vae_dir, sched_dir) = (unet_dir?, vae_dir?, sched_dir?);

        let te2_config = ClipTextConfig::from_file(&te2_dir.join("config.json"))?;
        let te1_hidden = match &first {
            Some((_, te_dir)) => {
                Some(ClipTextConfig::from_file(&te_dir.join("config.json"))?.hidden_size)
            }
            None => None,
        };
        let (tokenizer, text_encoder) = match &first {
            Some((tok_dir, te_dir)) => (
                Some(ClipTokenizer::from_dir(tok_dir)?),
                Some(ClipTextModel::from_dir_in(
                    te_dir, false, variant, dtype, device,
                )?),
            ),
            None => (None, None),
        };
        let tokenizer_2 = ClipTokenizer::from_dir(&tok2_dir)?;
        let text_encoder_2 = ClipTextModel::from_dir_in(&te2_dir, true, variant, dtype, device)?;
        let unet_config_path = unet_dir.join("config.json");
        let unet_config = UNet2DConditionConfig::from_file(&unet_config_path)?;
        let (Some(addition_time_embed_dim), Some(add_embedding_dim)) = (
            unet_config.addition_time_embed_dim,
            unet_config.projection_class_embeddings_input_dim,
        ) else {
            return Err(PipelineError::UnsupportedPipeline {
                path: unet_config_path,
                class: "a UNet without `addition_embed_type: text_time`".into(),
                supported: "SDXL UNets (`addition_embed_type: text_time`)".into(),
            });
        };
        let time_ids = if index.requires_aesthetics_score {
            5
        } else {
            6
        };
        if add_embedding_dim != te2_config.projection_dim + time_ids * addition_time_embed_dim {
            let hint = if add_embedding_dim
                == te2_config.projection_dim + (11 - time_ids) * addition_time_embed_dim
            {
                "; the UNet takes the other kind of time ids: set `requires_aesthetics_score` \
                 in model_index.json to true for a refiner UNet (5 time ids), false otherwise"
            } else {
                "; the UNet and text_encoder_2 do not belong together"
            };
            return Err(PipelineError::InvalidInput(format!(
                "{}: `projection_class_embeddings_input_dim` is {add_embedding_dim}, but \
                 text_encoder_2's `projection_dim` {} plus {time_ids} time ids of \
                 `addition_time_embed_dim` {addition_time_embed_dim} make {}{hint}",
                unet_config_path.display(),
                te2_config.projection_dim,
                te2_config.projection_dim + time_ids * addition_time_embed_dim
            )));
        }
        // The context is the encoders' penultimate states side by side.
        let context_dim = te1_hidden.unwrap_or(0) + te2_config.hidden_size;
        if let PerBlock::One(cross) = unet_config.cross_attention_dim {
            if cross != context_dim {
                let encoders = match te1_hidden {
                    Some(h1) => format!(
                        "text_encoder's hidden size {h1} plus text_encoder_2's {}",
                        te2_config.hidden_size
                    ),
                    None => format!(
                        "text_encoder_2's hidden size {} (the folder has no text_encoder)",
                        te2_config.hidden_size
                    ),
                };
                return Err(PipelineError::InvalidInput(format!(
                    "{}: `cross_attention_dim` is {cross}, but {encoders} make {context_dim}: \
                     the UNet and the text encoders do not belong together",
                    unet_config_path.display()
                )));
            }
        }
        let unet = UNet2DConditionModel::from_dir_in(&unet_dir, variant, dtype, device)?;
        let vae_config = AutoencoderKLConfig::from_file(&vae_dir.join("config.json"))?;
        let vae = AutoencoderKL::from_dir_in(&vae_dir, variant, dtype, device)?;
        let mut scheduler_config =
            SchedulerConfig::from_file(sched_dir.join("scheduler_config.json"))?;
        if let Some(name) = &options.scheduler {
            scheduler_config = scheduler_config.switched_to_named(name)?;
        }
        let scheduler = scheduler_from_config(&scheduler_config)?;
        let sample_size = match &unet_config.sample_size {
            Some(PerBlock::One(s)) => *s,
            Some(PerBlock::Each(v)) => v.first().copied().unwrap_or(128),
            None => 128,
        };
        let cast = crate::loading::Cast(options.dtype);
        Ok(Self {
            tokenizer,
            tokenizer_2,
            text_encoder: text_encoder.map(|te| cast.apply(te)),
            text_encoder_2: cast.apply(text_encoder_2),
            unet: cast.apply(unet),
            vae: cast.apply(vae),
            scheduler_config,
            scheduler,
            vae_scale_factor: vae_config.scale_factor(),
            sample_size,
            projection_dim: te2_config.projection_dim,
            addition_time_embed_dim,
            add_embedding_dim,
            force_zeros_for_empty_prompt: index.force_zeros_for_empty_prompt,
            requires_aesthetics_score: index.requires_aesthetics_score,
            device: device.clone(),
            source: dir.to_path_buf(),
            compiled: None,
            scheduler_program: None,
            offload: Offload::default(),
            ip_adapter: None,
        })
    }

    /// The default image size: `sample_size` times the VAE factor (1024 for SDXL).
    pub fn default_size(&self) -> usize {
        self.sample_size * self.vae_scale_factor
    }

    /// diffusers' `__call__` defaults (steps, guidance) of this pipeline; `.request()` gives a
    /// request with them.
    pub fn defaults(&self) -> PipelineDefaults {
        PipelineDefaults::STABLE_DIFFUSION_XL
    }

    /// A request with diffusers' defaults ([`XlRequest::default`]).
    pub fn default_request(&self) -> XlRequest<B> {
        XlRequest::default()
    }

    /// Fuses a LoRA file (diffusers/PEFT or kohya/A1111 format) into the UNet and the text
    /// encoders at `scale` (a LoRA with `text_encoder` layers is an error for a folder without
    /// one), as diffusers' `load_lora_weights(path)` +
    /// `fuse_lora(lora_scale=scale)`. Call it several times for several LoRAs, before
    /// [`compile`](StableDiffusionXLPipeline::compile). Keys that fit no layer are an error
    /// naming them, and the pipeline is left unchanged.
    pub fn load_lora(
        &mut self,
        path: impl AsRef<Path>,
        scale: f32,
    ) -> Result<crate::lora::LoraReport> {
        use oxidiff_models::lora::LoraComponent;
        let compiled = self.compiled.is_some();
        match &mut self.text_encoder {
            Some(text_encoder) => crate::lora::fuse_into(
                path.as_ref(),
                scale,
                crate::lora::Denoiser::unet(&mut self.unet),
                &mut [
                    (LoraComponent::TextEncoder, text_encoder),
                    (LoraComponent::TextEncoder2, &mut self.text_encoder_2),
                ],
                "SDXL pipeline",
                compiled,
            ),
            None => crate::lora::fuse_into(
                path.as_ref(),
                scale,
                crate::lora::Denoiser::unet(&mut self.unet),
                &mut [(LoraComponent::TextEncoder2, &mut self.text_encoder_2)],
                "SDXL pipeline without a first text encoder (a refiner with only \
                 text_encoder_2)",
                compiled,
            ),
        }
    }

    /// Swaps the scheduler, keeping the checkpoint's betas config.
    pub fn set_scheduler(&mut self, name: &str) -> Result<()> {
        let config = self.scheduler_config.switched_to_named(name)?;
        self.scheduler = scheduler_from_config(&config)?;
        self.scheduler_config = config;
        Ok(())
    }

    /// Places the text encoders, the UNet and the VAE on their devices.
    #[must_use]
    pub fn to_components(
        mut self,
        text_encoders: &B::Device,
        unet: &B::Device,
        vae: &B::Device,
    ) -> Self {
        self.text_encoder = self.text_encoder.map(|te| te.to(text_encoders));
        self.text_encoder_2 = self.text_encoder_2.to(text_encoders);
        self.unet = self.unet.to(unet);
        self.ip_adapter = self.ip_adapter.map(|a| a.to_device(unet));
        self.vae = self.vae.to(vae);
        self.device = unet.clone();
        // A compiled denoiser holds the UNet of its device: compile again after moving.
        self.compiled = None;
        self.scheduler_program = None;
        // The VAE's and text encoders' programs too (they hold the weights they were built for).
        self.vae.clear_programs();
        self.text_encoder_2.layers_program.clear();
        if let Some(encoder) = &mut self.text_encoder {
            encoder.layers_program.clear();
        }
        self
    }

    /// Attaches an IP-Adapter weight file (h94 layout, safetensors) as
    /// [`load_ip_adapter`](crate::StableDiffusionPipeline::load_ip_adapter) does for SD 1.x;
    /// SDXL needs the SDXL adapter.
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

    /// The weight of the image branches (diffusers' `set_ip_adapter_scale`).
    pub fn set_ip_adapter_scale(&mut self, scale: f64) -> Result<()> {
        let compiled = self.compiled.is_some();
        crate::ip_adapter::set_scale(&mut self.ip_adapter, &mut self.unet, scale, compiled)
    }

    /// Removes the IP-Adapter (diffusers' `unload_ip_adapter`).
    pub fn unload_ip_adapter(&mut self) -> Result<()> {
        let compiled = self.compiled.is_some();
        crate::ip_adapter::detach(&mut self.ip_adapter, &mut self.unet, compiled)
    }

    /// diffusers' `encode_prompt` for one side (positive or negative): each prompt through
    /// both encoders (`prompts_2[i]` for the second), penultimate hidden states concatenated
    /// on the feature axis, the second encoder's `text_embeds` as the pooled embedding; each
    /// row repeated `images_per_prompt` times. Without a first encoder (a refiner) the
    /// context is `text_encoder_2`'s states of `prompts`, and `prompts_2` is unused, as
    /// diffusers pairs its prompt list with the encoders present.
    pub fn encode_prompts(
        &self,
        prompts: &[String],
        prompts_2: &[String],
        images_per_prompt: usize,
    ) -> Result<XlPromptEmbeds<B>> {
        if prompts.len() != prompts_2.len() {
            return Err(PipelineError::InvalidInput(format!(
                "{} prompts for the second text encoder, {} for the first: give one per prompt",
                prompts_2.len(),
                prompts.len()
            )));
        }
        let ids = |tokenizer: &ClipTokenizer, texts: &[String]| -> Result<Vec<Vec<u32>>> {
            let mut rows = Vec::with_capacity(texts.len() * images_per_prompt);
            for text in texts {
                let encoded = tokenizer.encode(text)?;
                warn_if_clip_cut(tokenizer, &encoded);
                for _ in 0..images_per_prompt {
                    rows.push(encoded.ids.clone());
                }
            }
            Ok(rows)
        };
        let penultimate = |out: &oxidiff_models::ClipTextOutput<B>, which: &str| {
            let n = out.hidden_states.len();
            if n < 2 {
                return Err(PipelineError::InvalidInput(format!(
                    "{which} has {n} layer(s); SDXL takes the penultimate layer's output, so it \
                     needs at least 2"
                )));
            }
            Ok(out.hidden_states[n - 2].clone())
        };
        let (first, prompts_2) = match (&self.tokenizer, &self.text_encoder) {
            (Some(tokenizer), Some(text_encoder)) => (
                Some(text_encoder.forward(&ids(tokenizer, prompts)?, true)?),
                prompts_2,
            ),
            _ => (None, prompts),
        };
        let out_2 = self
            .text_encoder_2
            .forward(&ids(&self.tokenizer_2, prompts_2)?, true)?;
        let h2 = penultimate(&out_2, "text_encoder_2")?;
        let pooled = out_2.text_embeds.clone().ok_or_else(|| {
            PipelineError::InvalidInput("text_encoder_2 has no text_projection".into())
        })?;
        let prompt_embeds = match first {
            Some(out_1) => {
                let h1 = penultimate(&out_1, "text_encoder")?.to_device(&h2.device());
                Tensor::cat(vec![h1, h2], 2)
            }
            None => h2,
        };
        Ok(XlPromptEmbeds {
            prompt_embeds,
            pooled_prompt_embeds: pooled,
        })
    }

    /// `add_time_ids`: `[original (h, w), crop (top, left), target (h, w)]`.
    pub(crate) fn time_ids(
        &self,
        original: (usize, usize),
        crop: (usize, usize),
        target: (usize, usize),
    ) -> Vec<f32> {
        [original.0, original.1, crop.0, crop.1, target.0, target.1]
            .iter()
            .map(|&v| v as f32)
            .collect()
    }

    /// Generates with the default generator seeded by `request.common.seed`.
    pub fn generate(&mut self, request: &XlRequest<B>) -> Result<PipelineOutput<B>> {
        let mut generator = TorchCpuGenerator::new(request.common.seed);
        self.generate_with(request, &mut generator, |_| {})
    }

    /// Generates with the given noise source and a callback after every step.
    pub fn generate_with(
        &mut self,
        request: &XlRequest<B>,
        noise: &mut dyn NoiseSource<B>,
        mut callback: impl FnMut(StepInfo<'_, B>),
    ) -> Result<PipelineOutput<B>> {
        let (req, xl) = (&request.common, &request.xl);
        let default = self.default_size();
        let (width, height) = check_request(req, (default, default), self.vae_scale_factor)?;
        self.check_options(req, xl)?;
        let (positive_ids, negative_ids) = self.time_ids_for(xl, (height, width));
        let condition = self.conditioning(req, xl, &positive_ids, &negative_ids)?;

        self.scheduler.set_timesteps(req.num_inference_steps)?;
        self.scheduler.set_eta(req.eta);
        let f = self.vae_scale_factor;
        let batch = req.prompts.len() * req.num_images_per_prompt;
        let latents = initial_latents(
            req,
            [batch, 4, height / f, width / f],
            (width, height),
            noise,
            self.scheduler.init_noise_sigma(),
            &self.device,
        )?;
        let timesteps = self.cut_at_denoising_end(self.scheduler.timesteps().to_vec(), xl);
        self.denoise_and_decode(
            &timesteps,
            latents,
            &condition,
            None,
            None,
            req,
            noise,
            &mut callback,
        )
    }

    /// Checks the SDXL options against the request: counts of second prompts and
    /// `denoising_end` in (0, 1].
    pub(crate) fn check_options(&self, req: &GenerateRequest<B>, xl: &XlOptions) -> Result<()> {
        let n = req.prompts.len();
        for (what, got) in [
            ("second prompts", xl.prompts_2.len()),
            ("second negative prompts", xl.negative_prompts_2.len()),
        ] {
            if got > 1 && got != n {
                return Err(PipelineError::InvalidInput(format!(
                    "{got} {what} for {n} prompts: give one, or one per prompt"
                )));
            }
        }
        if let Some(end) = xl.denoising_end {
            if !(end > 0.0 && end <= 1.0) {
                return Err(PipelineError::InvalidInput(format!(
                    "denoising_end must be in (0, 1], got {end}"
                )));
            }
        }
        Ok(())
    }

    /// Text-to-image `add_time_ids` (positive, negative) for an image of `size` (h, w): the
    /// negative ones differ only when both negative sizes are given, as in diffusers.
    pub(crate) fn time_ids_for(
        &self,
        xl: &XlOptions,
        size: (usize, usize),
    ) -> (Vec<f32>, Vec<f32>) {
        let positive_ids = self.time_ids(
            xl.original_size.unwrap_or(size),
            xl.crops_coords_top_left,
            xl.target_size.unwrap_or(size),
        );
        let negative_ids = match (xl.negative_original_size, xl.negative_target_size) {
            (Some(original), Some(target)) => {
                self.time_ids(original, xl.negative_crops_coords_top_left, target)
            }
            _ => positive_ids.clone(),
        };
        (positive_ids, negative_ids)
    }

    /// The UNet's conditioning for a request: the prompt embeddings (with guidance, the
    /// negative ones first: all-zero under `force_zeros_for_empty_prompt` when no negative
    /// prompt is given) and the added condition, pooled embeddings and one row of time ids per
    /// context row (`positive_ids` / `negative_ids`, of any equal width).
    pub(crate) fn conditioning(
        &self,
        req: &GenerateRequest<B>,
        xl: &XlOptions,
        positive_ids: &[f32],
        negative_ids: &[f32],
    ) -> Result<XlConditioning<B>> {
        let n = req.prompts.len();
        let images_per_prompt = req.num_images_per_prompt;
        let batch = n * images_per_prompt;
        let cfg = req.does_guidance();

        let prompts_2 = per_prompt(&xl.prompts_2, &req.prompts, n, "second prompts")?;
        let positive = self.encode_prompts(&req.prompts, &prompts_2, images_per_prompt)?;
        let zero_negative = req.negative_prompts.is_empty() && self.force_zeros_for_empty_prompt;
        let (context, pooled) = if !cfg {
            (positive.prompt_embeds, positive.pooled_prompt_embeds)
        } else if zero_negative {
            let XlPromptEmbeds {
                prompt_embeds,
                pooled_prompt_embeds,
            } = positive;
            (
                Tensor::cat(vec![prompt_embeds.zeros_like(), prompt_embeds], 0),
                Tensor::cat(
                    vec![pooled_prompt_embeds.zeros_like(), pooled_prompt_embeds],
                    0,
                ),
            )
        } else {
            let negatives = negatives_for(req)?;
            let negatives_2 = per_prompt(
                &xl.negative_prompts_2,
                &negatives,
                n,
                "second negative prompts",
            )?;
            let negative = self.encode_prompts(&negatives, &negatives_2, images_per_prompt)?;
            (
                Tensor::cat(vec![negative.prompt_embeds, positive.prompt_embeds], 0),
                Tensor::cat(
                    vec![negative.pooled_prompt_embeds, positive.pooled_prompt_embeds],
                    0,
                ),
            )
        };
        if let Some(encoder) = &self.text_encoder {
            self.offload.after_encoding(encoder);
        }
        self.offload.after_encoding(&self.text_encoder_2);

        // Rows in the order of `context`: all negatives, then all positives. (diffusers repeats
        // the [negative, positive] pair per image, which is the same whenever the two are equal
        // or there is one image.)
        let mut ids = Vec::new();
        if cfg {
            for _ in 0..batch {
                ids.extend_from_slice(negative_ids);
            }
        }
        for _ in 0..batch {
            ids.extend_from_slice(positive_ids);
        }
        let width = positive_ids.len();
        let rows = ids.len() / width.max(1);
        let time_ids = Tensor::<B, 2>::from_data(TensorData::new(ids, [rows, width]), &self.device);
        let context = append_image_tokens(
            self.ip_adapter.as_ref(),
            req.ip_adapter_image.as_ref(),
            context,
            cfg,
        )?;
        Ok(XlConditioning {
            context: context.to_device(&self.device),
            added: AddedCondition {
                text_embeds: pooled.to_device(&self.device),
                time_ids,
            },
        })
    }

    /// The timesteps before `xl.denoising_end` (all of them without one): those at or above
    /// `round(train * (1 - end))`, as diffusers' cutoff.
    pub(crate) fn cut_at_denoising_end(&self, mut timesteps: Vec<f64>, xl: &XlOptions) -> Vec<f64> {
        if let Some(end) = xl.denoising_end.filter(|&e| e < 1.0) {
            let train = self.scheduler_config.num_train_timesteps as f64;
            // Python's `round` rounds halves to even.
            let cutoff = (train - end * train).round_ties_even();
            let keep = timesteps.iter().filter(|&&t| t >= cutoff).count();
            timesteps.truncate(keep);
        }
        timesteps
    }

    /// The denoising loop over `timesteps` from `latents` (UNet compiled or eager, guidance
    /// around it), then the VAE decode; text-to-image, image-to-image and inpainting share it.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn denoise_and_decode(
        &mut self,
        timesteps: &[f64],
        latents: Tensor<B, 4>,
        condition: &XlConditioning<B>,
        inpaint: Option<&InpaintCondition<B>>,
        control: Option<&ControlStep<'_, B>>,
        req: &GenerateRequest<B>,
        noise: &mut dyn NoiseSource<B>,
        callback: &mut impl FnMut(StepInfo<'_, B>),
    ) -> Result<PipelineOutput<B>> {
        check_unet_input(&self.unet, &latents, inpaint)?;
        let (unet, compiled) = (&self.unet, &self.compiled);
        let XlConditioning { context, added } = condition;
        let mut step = 0;
        let mut blended;
        let scheduler: &mut dyn Scheduler<B> = match inpaint {
            Some(inpaint) => {
                blended = inpaint.scheduler(&mut *self.scheduler, timesteps);
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
                with_guidance(model_input, req.guidance_scale, |x| match compiled {
                    Some(denoiser) => {
                        // Checked here: inside the trace a mismatch could only panic.
                        unet.check_added_condition(x.dims()[0], Some(added))?;
                        denoiser.call((
                            x,
                            timestep,
                            context.clone(),
                            added.text_embeds.clone(),
                            added.time_ids.clone(),
                        ))
                    }
                    None => Ok(unet.forward_with_condition(
                        x,
                        timestep,
                        context.clone(),
                        Some(added),
                    )?),
                })
            },
            callback,
        )?;
        let images = decode_latents(&self.vae, &latents, req.output)?;
        Ok(PipelineOutput { latents, images })
    }
}

/// What the SDXL UNet is conditioned on besides the latents: the text context and the added
/// condition (pooled embeddings, time ids), one row per UNet batch row.
#[derive(Debug, Clone)]
pub struct XlConditioning<B: Backend> {
    pub context: Tensor<B, 3>,
    pub added: AddedCondition<B>,
}

impl<B: Backend> ToDevice<B> for StableDiffusionXLPipeline<B> {
    /// Moves every component to `device`.
    fn to(self, device: &B::Device) -> Self {
        self.to_components(device, device, device)
    }
}

/// The compiled SDXL UNet call's inputs: latents, timestep, text context, pooled text embeds,
/// time ids.
pub type XlUNetInputs<B> = (
    Tensor<B, 4>,
    Tensor<B, 1>,
    Tensor<B, 3>,
    Tensor<B, 2>,
    Tensor<B, 2>,
);

impl StableDiffusionXLPipeline<Oxi> {
    /// Compiled mode, as [`StableDiffusionPipeline::compile`](crate::StableDiffusionPipeline::compile):
    /// each UNet call (both guidance halves, with the added condition as runtime inputs) is one
    /// XLA program per input shape; the text encoders' layers, the VAE and the scheduler step
    /// ([`SchedulerProgram`]) are programs too. Needs the UNet on a PJRT device.
    pub fn compile(&mut self) -> Result<()> {
        self.compile_on(None)
    }

    /// Spreads the compiled UNet call over several devices, as
    /// [`StableDiffusionPipeline::enable_parallelism`](crate::StableDiffusionPipeline::enable_parallelism):
    /// tensor parallelism splits the UNet's transformer blocks over `tp_degree` devices, data
    /// parallelism splits the batch (both guidance halves, with their added conditions) over
    /// `dp_degree`, one `dp x tp` mesh from the UNet's device on.
    pub fn enable_parallelism(&mut self, config: impl Into<ParallelConfig>) -> Result<()> {
        crate::ip_adapter::refuse_parallel(self.ip_adapter.as_ref())?;
        let device = self.unet.conv_in.weight.device();
        let placement =
            crate::parallel::enable_parallelism(&mut self.unet, &device, config.into())?;
        self.compile_on(Some(placement))
    }

    pub(crate) fn compile_on(&mut self, placement: Option<Arc<SpmdPlacement>>) -> Result<()> {
        self.scheduler_program = Some(SchedulerProgram::new());
        crate::parallel::require_pjrt("UNet", &self.unet.conv_in.weight.device())?;
        crate::compiled::compile_vae(&mut self.vae);
        crate::compiled::compile_clip(&mut self.text_encoder_2, "text_encoder_2");
        if let Some(encoder) = &mut self.text_encoder {
            crate::compiled::compile_clip(encoder, "text_encoder");
        }
        let unet = self.unet.clone();
        let warm = WarmStart::of("unet", &unet, self.unet.conv_in.weight.device());
        let step = move |(sample, timestep, context, text_embeds, time_ids): XlUNetInputs<Oxi>| {
            let added = AddedCondition {
                text_embeds,
                time_ids,
            };
            // The shapes were checked by `check_added_condition` before the call.
            unet.forward_controlled_checked(sample, timestep, context, Some(&added), None)
        };
        // Every input batch-major: split by batch where it divides, else whole.
        let layouts = vec![Layout::BatchSplit(0); 5];
        self.compiled = Some(CompiledCall::warm_started(
            "sdxl-unet",
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

    /// Compiled mode's counts per component: the text encoders', the unet's (as
    /// [`compile_stats`](Self::compile_stats)), the VAE encoder's and decoder's.
    pub fn component_stats(&self) -> Vec<ComponentStats> {
        let mut encoders = vec![("text_encoder_2", &self.text_encoder_2)];
        if let Some(encoder) = &self.text_encoder {
            encoders.insert(0, ("text_encoder", encoder));
        }
        crate::compiled::component_stats(
            &encoders,
            None,
            "unet",
            self.compile_stats(),
            self.scheduler_program.as_ref(),
            &self.vae,
        )
    }
}
