//! `from_single_file`: Stable Diffusion 1.x/2.x and SDXL pipelines (text to image, image to
//! image, inpainting with 9-channel inpainting checkpoints, the SDXL refiner) from one
//! `.safetensors` in the original LDM / A1111 layout, as diffusers' `from_single_file`.
//!
//! The weights come from the file through [`SingleFile`]'s renaming views, so the models load
//! exactly as from a diffusers folder. Configs come from, in order: the `config` folder given
//! (diffusers' `config=`), the default diffusers repository of the detected architecture when it
//! is in the Hub cache (what diffusers fetches), or oxidiff's built-in configs of the released
//! models with every size that the tensors show read from them. A single file has no tokenizer:
//! it comes from the `tokenizer` folder given, else the config folder or the cached repository.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::tensor::backend::Backend;
use oxidiff_models::config::{load_json, PerBlock};
use oxidiff_models::{
    AutoencoderKL, AutoencoderKLConfig, ClipTextConfig, ClipTextModel, ClipTokenizer, SingleFile,
    SingleFileArch, UNet2DConditionConfig, UNet2DConditionModel, VarBuilder, Weights,
};
use oxidiff_schedulers::{scheduler_from_config, PredictionType, SchedulerConfig};
use serde::Deserialize;

use crate::error::{PipelineError, Result};
use crate::loading::LoadOptions;
use crate::offload::Offload;
use crate::stable_diffusion::StableDiffusionPipeline;
use crate::stable_diffusion_img2img::StableDiffusionImg2ImgPipeline;
use crate::stable_diffusion_inpaint::StableDiffusionInpaintPipeline;
use crate::stable_diffusion_xl::StableDiffusionXLPipeline;
use crate::stable_diffusion_xl_img2img::StableDiffusionXLImg2ImgPipeline;
use crate::stable_diffusion_xl_inpaint::StableDiffusionXLInpaintPipeline;

/// How a single-file checkpoint is loaded.
#[derive(Debug, Clone, Default)]
pub struct SingleFileOptions {
    /// The scheduler override and the weights' `dtype` (cast after loading), as for folders
    /// (`variant` does not apply to one file).
    pub load: LoadOptions,
    /// A diffusers pipeline folder whose component configs, scheduler config and tokenizers
    /// are used (diffusers' `config=`); needed for checkpoints whose sizes differ from the
    /// released models' in ways the tensors do not show (group-norm groups, head counts).
    pub config: Option<PathBuf>,
    /// Where the tokenizers are: a pipeline folder with `tokenizer/` (and for SDXL
    /// `tokenizer_2/`), or for SD 1.x/2.x a tokenizer folder itself.
    pub tokenizer: Option<PathBuf>,
    /// What an SD 2.x checkpoint predicts, when the file cannot tell (diffusers' legacy
    /// `prediction_type`); default v, as diffusers decides (epsilon only for SD 2 base's
    /// `global_step` 875000).
    pub prediction_type: Option<PredictionType>,
}

/// Whether `path` names a single-file checkpoint rather than a folder or a Hub id: an existing
/// file, or a name ending like one (`.safetensors`, or a pickle's `.ckpt`/`.pt`/`.pth`/`.bin`).
pub fn is_single_file(path: &Path) -> bool {
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    !path.is_dir()
        && (path.is_file()
            || matches!(
                ext.as_deref(),
                Some("safetensors" | "ckpt" | "pt" | "pth" | "bin")
            ))
}

/// The diffusers pipeline class a single file is made for, as diffusers' default repository
/// of its model type names it: `StableDiffusionPipeline`, `StableDiffusionXLPipeline`, for
/// inpainting checkpoints `StableDiffusionInpaintPipeline` / `StableDiffusionXLInpaintPipeline`,
/// for the SDXL refiner `StableDiffusionXLImg2ImgPipeline`.
pub fn single_file_pipeline_class(path: &Path) -> Result<&'static str> {
    let file = SingleFile::open(path)?;
    Ok(match (file.arch, file.inpainting) {
        (SingleFileArch::SdxlRefiner, _) => "StableDiffusionXLImg2ImgPipeline",
        (SingleFileArch::SdxlBase, true) => "StableDiffusionXLInpaintPipeline",
        (SingleFileArch::SdxlBase, false) => crate::stable_diffusion_xl::SDXL_CLASS,
        (_, true) => "StableDiffusionInpaintPipeline",
        (_, false) => "StableDiffusionPipeline",
    })
}

/// What both pipelines resolve the same way.
struct Sources {
    file: SingleFile,
    /// The folder configs come from, if any.
    config: Option<PathBuf>,
    predicts_v: bool,
    /// The dtype weights are read into.
    dtype: burn::tensor::FloatDType,
}

impl Sources {
    fn open(path: &Path, options: &SingleFileOptions) -> Result<Self> {
        let file = SingleFile::open(path)?;
        let config = match &options.config {
            Some(dir) => {
                if !dir.is_dir() {
                    return Err(PipelineError::ModelNotFound {
                        spec: dir.display().to_string(),
                        hint: "the `config` of a single-file checkpoint must be a diffusers \
                               pipeline folder (with unet/, vae/, text_encoder/, scheduler/ \
                               and tokenizer/)"
                            .into(),
                    });
                }
                Some(dir.clone())
            }
            None => default_repo(&file),
        };
        let predicts_v = match options.prediction_type {
            Some(p) => p == PredictionType::VPrediction,
            None => file.predicts_v(),
        };
        Ok(Self {
            file,
            config,
            predicts_v,
            dtype: options.load.weights_dtype(),
        })
    }

    fn config_file(&self, component: &str, name: &str) -> Option<PathBuf> {
        self.config
            .as_ref()
            .map(|dir| dir.join(component).join(name))
    }

    fn unet_config(&self) -> Result<(UNet2DConditionConfig, PathBuf)> {
        Ok(match self.config_file("unet", "config.json") {
            Some(path) => (UNet2DConditionConfig::from_file(&path)?, path),
            None => (
                self.file.unet_config(self.predicts_v)?,
                self.file.path.clone(),
            ),
        })
    }

    fn vae_config(&self) -> Result<(AutoencoderKLConfig, PathBuf)> {
        Ok(match self.config_file("vae", "config.json") {
            Some(path) => (AutoencoderKLConfig::from_file(&path)?, path),
            None => (
                self.file.vae_config(self.predicts_v)?,
                self.file.path.clone(),
            ),
        })
    }

    fn text_config(&self, component: &str) -> Result<ClipTextConfig> {
        match self.config_file(component, "config.json") {
            Some(path) => Ok(ClipTextConfig::from_file(&path)?),
            None if component == "text_encoder_2" => Ok(self.file.text_encoder_2_config()?),
            None => Ok(self.file.text_encoder_config()?),
        }
    }

    /// The config folder's scheduler, else the released model's (SD 1.5: PNDM, SD 2.1: DDIM
    /// with v or epsilon, SDXL: Euler); an explicit `prediction_type` wins, then
    /// `options.load.scheduler` is switched to with the betas kept.
    fn scheduler<B: Backend>(
        &self,
        options: &SingleFileOptions,
    ) -> Result<(SchedulerConfig, Box<dyn oxidiff_schedulers::Scheduler<B>>)> {
        let mut config = match self.config_file("scheduler", "scheduler_config.json") {
            Some(path) => SchedulerConfig::from_file(&path)?,
            None => SchedulerConfig::from_json_str(
                &default_scheduler(self.file.arch, self.predicts_v),
                "the built-in scheduler config",
            )?,
        };
        if let Some(p) = options.prediction_type {
            config.prediction_type = p;
        }
        if let Some(name) = &options.load.scheduler {
            config = config.switched_to_named(name)?;
        }
        let scheduler = scheduler_from_config(&config)?;
        Ok((config, scheduler))
    }

    /// The tokenizer folder `name` (`tokenizer`, `tokenizer_2`), or an error saying where to
    /// get one.
    fn tokenizer(&self, options: &SingleFileOptions, name: &str) -> Result<ClipTokenizer> {
        let mut tried = Vec::new();
        if let Some(dir) = &options.tokenizer {
            let sub = dir.join(name);
            if sub.is_dir() {
                return Ok(ClipTokenizer::from_dir(&sub)?);
            }
            // A tokenizer folder itself serves SD 1.x/2.x's one tokenizer.
            if name == "tokenizer" && dir.join("vocab.json").is_file() {
                return Ok(ClipTokenizer::from_dir(dir)?);
            }
            tried.push(sub);
        }
        if let Some(config) = &self.config {
            let sub = config.join(name);
            if sub.is_dir() {
                return Ok(ClipTokenizer::from_dir(&sub)?);
            }
            tried.push(sub);
        }
        let repo = self.file.default_repo();
        let looked = if tried.is_empty() {
            String::new()
        } else {
            format!(
                " (looked in {})",
                tried
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        };
        Err(PipelineError::SingleFile {
            path: self.file.path.clone(),
            reason: format!(
                "a single-file checkpoint carries no tokenizer and none was found{looked}: pass \
                 a folder holding `{name}/` as the tokenizer (or config) folder, for this {} \
                 checkpoint for example a diffusers copy of `{repo}`, which is also used when it \
                 is in the Hub cache ({})",
                describe(&self.file),
                crate::hub::hub_cache_dir().display()
            ),
        })
    }

    /// Builds a model from a renamed view; afterwards every renamed tensor must have been
    /// used, so a config that does not match the file is an error, not silently dropped
    /// weights.
    fn load<B: Backend, M>(
        &self,
        weights: Weights,
        component: &str,
        device: &B::Device,
        build: impl FnOnce(VarBuilder<B>) -> oxidiff_models::Result<M>,
    ) -> Result<M> {
        let weights = Arc::new(weights);
        let vb = VarBuilder::new(weights.clone(), device).with_dtype(self.dtype);
        let model = build(vb).map_err(|e| {
            match (&self.config, e) {
                // The built-in config did not fit: say where it came from and what to do.
                (
                    None,
                    e @ (oxidiff_models::ModelError::Config { .. }
                    | oxidiff_models::ModelError::ShapeMismatch { .. }
                    | oxidiff_models::ModelError::MissingKey { .. }),
                ) => PipelineError::SingleFile {
                    path: self.file.path.clone(),
                    reason: format!(
                        "the {component} does not fit the built-in config of the released {} \
                         model (sizes read from the tensors, the rest as released): {e}; pass \
                         the matching diffusers folder as `config`",
                        describe(&self.file)
                    ),
                },
                (_, e) => e.into(),
            }
        })?;
        if let Some((count, names)) = weights.unused_summary() {
            return Err(PipelineError::SingleFile {
                path: self.file.path.clone(),
                reason: format!(
                    "the {component} built from its config does not use {count} of the file's \
                     {component} tensors (diffusers names: {names}); the config does not match \
                     the checkpoint: pass the matching diffusers folder as `config`",
                ),
            });
        }
        Ok(model)
    }

    /// Warns about tensors of the file that no component took (diffusers drops them silently).
    fn warn_unmapped(&self, text_layers: usize, text_2_layers: usize) -> Result<()> {
        let unmapped = self.file.unmapped_keys(text_layers, text_2_layers)?;
        if !unmapped.is_empty() {
            tracing::warn!(
                "{}: {} tensor(s) belong to no component and are ignored: {}",
                self.file.path.display(),
                unmapped.len(),
                unmapped
                    .iter()
                    .take(8)
                    .map(|k| format!("`{k}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        Ok(())
    }

    /// SDXL's `model_index.json` flags `(force_zeros_for_empty_prompt,
    /// requires_aesthetics_score)` from the config folder (diffusers' class defaults `true`
    /// and `false` where it leaves them out), else the released model's: the base
    /// `(true, false)`, the refiner `(false, true)`.
    fn sdxl_flags(&self) -> Result<(bool, bool)> {
        #[derive(Deserialize)]
        struct Index {
            force_zeros_for_empty_prompt: Option<bool>,
            requires_aesthetics_score: Option<bool>,
        }
        let released = self.file.arch != SingleFileArch::SdxlRefiner;
        let released = (released, !released);
        match self.config.as_ref().map(|d| d.join("model_index.json")) {
            Some(path) if path.is_file() => {
                let index = load_json::<Index>(&path)?;
                Ok((
                    index.force_zeros_for_empty_prompt.unwrap_or(true),
                    index.requires_aesthetics_score.unwrap_or(false),
                ))
            }
            _ => Ok(released),
        }
    }
}

fn arch_name(arch: SingleFileArch) -> &'static str {
    match arch {
        SingleFileArch::Sd1 => "SD 1.x",
        SingleFileArch::Sd2 => "SD 2.x",
        SingleFileArch::SdxlBase => "SDXL base",
        SingleFileArch::SdxlRefiner => "SDXL refiner",
    }
}

/// The checkpoint's kind in words (`SD 1.x inpainting`).
fn describe(file: &SingleFile) -> String {
    if file.inpainting {
        format!("{} inpainting", arch_name(file.arch))
    } else {
        arch_name(file.arch).to_string()
    }
}

/// The diffusers repository of the file's model type in the Hub cache, used for configs and
/// tokenizers as diffusers does (never downloaded here).
fn default_repo(file: &SingleFile) -> Option<PathBuf> {
    crate::hub::cached_snapshot(&crate::hub::hub_cache_dir(), file.default_repo(), "main")
}

/// The released models' `scheduler_config.json` (SD 1.5, SD 2.1 / 2 base, SDXL base).
fn default_scheduler(arch: SingleFileArch, predicts_v: bool) -> String {
    let common = r#""beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
        "num_train_timesteps": 1000, "set_alpha_to_one": false, "skip_prk_steps": true,
        "steps_offset": 1, "clip_sample": false, "timestep_spacing": "leading""#;
    match arch {
        SingleFileArch::Sd1 => {
            format!(r#"{{"_class_name": "PNDMScheduler", "prediction_type": "epsilon", {common}}}"#)
        }
        SingleFileArch::Sd2 => {
            let p = if predicts_v {
                "v_prediction"
            } else {
                "epsilon"
            };
            format!(r#"{{"_class_name": "DDIMScheduler", "prediction_type": "{p}", {common}}}"#)
        }
        SingleFileArch::SdxlBase | SingleFileArch::SdxlRefiner => format!(
            r#"{{"_class_name": "EulerDiscreteScheduler", "prediction_type": "epsilon",
                "interpolation_type": "linear", "use_karras_sigmas": false, {common}}}"#
        ),
    }
}

fn sample_size(config: &UNet2DConditionConfig, default: usize) -> usize {
    match &config.sample_size {
        Some(PerBlock::One(s)) => *s,
        Some(PerBlock::Each(v)) => v.first().copied().unwrap_or(default),
        None => default,
    }
}

impl<B: Backend> StableDiffusionPipeline<B> {
    /// Loads an SD 1.x/2.x single-file checkpoint (`.safetensors` in the LDM / A1111 layout),
    /// as diffusers' `StableDiffusionPipeline.from_single_file`; pickles are refused.
    pub fn from_single_file(
        path: &Path,
        options: &SingleFileOptions,
        device: &B::Device,
    ) -> Result<Self> {
        let src = Sources::open(path, options)?;
        if src.file.arch.is_sdxl() {
            return Err(PipelineError::UnsupportedPipeline {
                path: path.to_path_buf(),
                class: format!("an {} checkpoint", describe(&src.file)),
                supported: "SD 1.x/2.x here: load SDXL with \
                            StableDiffusionXLPipeline::from_single_file"
                    .into(),
            });
        }
        let tokenizer = src.tokenizer(options, "tokenizer")?;
        let te_config = src.text_config("text_encoder")?;
        let (unet_config, unet_path) = src.unet_config()?;
        if unet_config.addition_embed_type.is_some() {
            return Err(PipelineError::UnsupportedPipeline {
                path: unet_path,
                class: "an SDXL UNet config".into(),
                supported: "SD 1.x/2.x UNet configs for an SD 1.x/2.x checkpoint".into(),
            });
        }
        let (vae_config, vae_path) = src.vae_config()?;
        let (scheduler_config, scheduler) = src.scheduler::<B>(options)?;
        let layers = te_config.num_hidden_layers;
        let text_encoder = src.load(
            src.file.text_encoder_weights(layers)?,
            "text encoder",
            device,
            |vb| ClipTextModel::load(&te_config, false, vb),
        )?;
        let unet = src.load(src.file.unet_weights()?, "UNet", device, |vb| {
            UNet2DConditionModel::load(&unet_config, &unet_path, vb)
        })?;
        let vae = src.load(src.file.vae_weights()?, "VAE", device, |vb| {
            AutoencoderKL::load(&vae_config, &vae_path, vb)
        })?;
        src.warn_unmapped(layers, 0)?;
        let cast = crate::loading::Cast(options.load.dtype);
        Ok(Self {
            tokenizer,
            text_encoder: cast.apply(text_encoder),
            unet: cast.apply(unet),
            vae: cast.apply(vae),
            scheduler_config,
            scheduler,
            vae_scale_factor: vae_config.scale_factor(),
            sample_size: sample_size(&unet_config, 64),
            device: device.clone(),
            source: path.to_path_buf(),
            compiled: None,
            scheduler_program: None,
            offload: Offload::default(),
            ip_adapter: None,
        })
    }
}

impl<B: Backend> StableDiffusionXLPipeline<B> {
    /// Loads an SDXL single-file checkpoint (`.safetensors` in the LDM / A1111 layout): the
    /// base (also its inpainting variant) or the refiner, which has no first text encoder, as
    /// diffusers' `StableDiffusionXLPipeline.from_single_file`; pickles are refused.
    pub fn from_single_file(
        path: &Path,
        options: &SingleFileOptions,
        device: &B::Device,
    ) -> Result<Self> {
        let src = Sources::open(path, options)?;
        if !src.file.arch.is_sdxl() {
            return Err(PipelineError::UnsupportedPipeline {
                path: path.to_path_buf(),
                class: format!("an {} checkpoint", describe(&src.file)),
                supported: "SDXL base and refiner here: load SD 1.x/2.x with \
                            StableDiffusionPipeline::from_single_file"
                    .into(),
            });
        }
        let first = if src.file.arch == SingleFileArch::SdxlRefiner {
            None
        } else {
            Some((
                src.tokenizer(options, "tokenizer")?,
                src.text_config("text_encoder")?,
            ))
        };
        let tokenizer_2 = src.tokenizer(options, "tokenizer_2")?;
        let te2_config = src.text_config("text_encoder_2")?;
        let (unet_config, unet_path) = src.unet_config()?;
        let (Some(addition_time_embed_dim), Some(add_embedding_dim)) = (
            unet_config.addition_time_embed_dim,
            unet_config.projection_class_embeddings_input_dim,
        ) else {
            return Err(PipelineError::UnsupportedPipeline {
                path: unet_path,
                class: "a UNet config without `addition_embed_type: text_time`".into(),
                supported: "SDXL UNet configs for an SDXL checkpoint".into(),
            });
        };
        let (force_zeros_for_empty_prompt, requires_aesthetics_score) = src.sdxl_flags()?;
        let time_ids = if requires_aesthetics_score { 5 } else { 6 };
        if add_embedding_dim != te2_config.projection_dim + time_ids * addition_time_embed_dim {
            return Err(PipelineError::SingleFile {
                path: path.to_path_buf(),
                reason: format!(
                    "the UNet's `projection_class_embeddings_input_dim` {add_embedding_dim} is \
                     not text_encoder_2's `projection_dim` {} plus {time_ids} time ids of \
                     `addition_time_embed_dim` {addition_time_embed_dim} (an {} checkpoint, \
                     `requires_aesthetics_score` {requires_aesthetics_score}): pass the \
                     matching diffusers folder as `config`",
                    te2_config.projection_dim,
                    describe(&src.file),
                ),
            });
        }
        let (vae_config, vae_path) = src.vae_config()?;
        let (scheduler_config, scheduler) = src.scheduler::<B>(options)?;
        let (tokenizer, text_encoder, te_layers) = match first {
            Some((tokenizer, te_config)) => {
                let layers = te_config.num_hidden_layers;
                let text_encoder = src.load(
                    src.file.text_encoder_weights(layers)?,
                    "text encoder",
                    device,
                    |vb| ClipTextModel::load(&te_config, false, vb),
                )?;
                (Some(tokenizer), Some(text_encoder), layers)
            }
            None => (None, None, 0),
        };
        let text_encoder_2 = src.load(
            src.file
                .text_encoder_2_weights(te2_config.num_hidden_layers)?,
            "second text encoder",
            device,
            |vb| ClipTextModel::load(&te2_config, true, vb),
        )?;
        let unet = src.load(src.file.unet_weights()?, "UNet", device, |vb| {
            UNet2DConditionModel::load(&unet_config, &unet_path, vb)
        })?;
        let vae = src.load(src.file.vae_weights()?, "VAE", device, |vb| {
            AutoencoderKL::load(&vae_config, &vae_path, vb)
        })?;
        src.warn_unmapped(te_layers, te2_config.num_hidden_layers)?;
        let cast = crate::loading::Cast(options.load.dtype);
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
            sample_size: sample_size(&unet_config, 128),
            projection_dim: te2_config.projection_dim,
            addition_time_embed_dim,
            add_embedding_dim,
            force_zeros_for_empty_prompt,
            requires_aesthetics_score,
            device: device.clone(),
            source: path.to_path_buf(),
            compiled: None,
            scheduler_program: None,
            offload: Offload::default(),
            ip_adapter: None,
        })
    }
}

impl<B: Backend> StableDiffusionImg2ImgPipeline<B> {
    /// Loads an SD 1.x/2.x single file for image to image (diffusers'
    /// `StableDiffusionImg2ImgPipeline.from_single_file`).
    pub fn from_single_file(
        path: &Path,
        options: &SingleFileOptions,
        device: &B::Device,
    ) -> Result<Self> {
        StableDiffusionPipeline::from_single_file(path, options, device).map(Self::from)
    }
}

impl<B: Backend> StableDiffusionInpaintPipeline<B> {
    /// Loads an SD 1.x/2.x single file for inpainting (diffusers'
    /// `StableDiffusionInpaintPipeline.from_single_file`): an inpainting checkpoint (its UNet
    /// takes 9 channels) or an ordinary one (the masked-latent method).
    pub fn from_single_file(
        path: &Path,
        options: &SingleFileOptions,
        device: &B::Device,
    ) -> Result<Self> {
        StableDiffusionPipeline::from_single_file(path, options, device).map(Self::from)
    }
}

impl<B: Backend> StableDiffusionXLImg2ImgPipeline<B> {
    /// Loads an SDXL single file, the base or the refiner, for image to image (diffusers'
    /// `StableDiffusionXLImg2ImgPipeline.from_single_file`).
    pub fn from_single_file(
        path: &Path,
        options: &SingleFileOptions,
        device: &B::Device,
    ) -> Result<Self> {
        StableDiffusionXLPipeline::from_single_file(path, options, device).map(Self::from)
    }
}

impl<B: Backend> StableDiffusionXLInpaintPipeline<B> {
    /// Loads an SDXL single file for inpainting (diffusers'
    /// `StableDiffusionXLInpaintPipeline.from_single_file`): an inpainting checkpoint (9
    /// channels) or the base (the masked-latent method).
    pub fn from_single_file(
        path: &Path,
        options: &SingleFileOptions,
        device: &B::Device,
    ) -> Result<Self> {
        StableDiffusionXLPipeline::from_single_file(path, options, device).map(Self::from)
    }
}
