//! How every pipeline loads: the options, reading `model_index.json`, finding component
//! folders, building the scheduler and casting the weights.

use std::path::{Path, PathBuf};

use burn::tensor::backend::Backend;
use burn::tensor::FloatDType;
use oxidiff_models::config::load_json;
use oxidiff_schedulers::{scheduler_from_config, Scheduler, SchedulerConfig};
use serde::Deserialize;

use crate::error::{PipelineError, Result};

/// How a pipeline is loaded.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// Weight file variant, e.g. `fp16` for `diffusion_pytorch_model.fp16.safetensors`.
    pub variant: Option<String>,
    /// Replace the checkpoint's scheduler (keeping its betas config): a diffusers class name or
    /// a short/A1111 name, with A1111's option words (`ddim`, `euler_a`, `DPM++ 2M Karras`).
    pub scheduler: Option<String>,
    /// The float dtype the weights are held in (diffusers' `torch_dtype`); `None` is f32. Each
    /// tensor is read straight into it: used in place when the file stores it in that dtype,
    /// converted once otherwise. Stable Diffusion, SDXL, Flux, SD3 and PixArt compute in it and
    /// keep latents and scheduler math in f32.
    pub dtype: Option<FloatDType>,
    /// A GGUF file whose (possibly quantized) weights replace the folder's transformer, read
    /// with the folder's `transformer/config.json` (`--transformer FILE.gguf`, as diffusers
    /// users pass `from_single_file(FILE.gguf, config=DIR, subfolder="transformer",
    /// quantization_config=GGUFQuantizationConfig(...))`). Flux only, for now.
    pub transformer: Option<PathBuf>,
}

impl LoadOptions {
    /// An error unless [`transformer`](Self::transformer) is unset: `pipeline` cannot take a
    /// transformer file (yet).
    pub fn refuse_transformer_file(&self, pipeline: &str) -> Result<()> {
        match &self.transformer {
            None => Ok(()),
            Some(file) => Err(PipelineError::InvalidInput(format!(
                "a transformer file ({}) replaces the transformer of a Flux pipeline; {pipeline} \
                 cannot take one",
                file.display()
            ))),
        }
    }

    /// The dtype weights are read into: [`dtype`](Self::dtype), or f32.
    pub fn weights_dtype(&self) -> FloatDType {
        self.dtype.unwrap_or(FloatDType::F32)
    }
}

#[derive(Debug, Deserialize)]
struct ModelIndex {
    #[serde(rename = "_class_name")]
    class_name: String,
}

/// The pipeline class (`_class_name`) of a diffusers folder's `model_index.json`.
pub fn pipeline_class(dir: &Path) -> Result<String> {
    let index_path = dir.join("model_index.json");
    if !index_path.is_file() {
        return Err(PipelineError::ModelNotFound {
            spec: dir.display().to_string(),
            hint: "the folder has no model_index.json; point at the root of a diffusers \
                   pipeline folder"
                .into(),
        });
    }
    let index: ModelIndex = load_json(&index_path)?;
    Ok(index.class_name)
}

/// The `_class_name` of a component's `config.json` (a ControlNet's kind, say).
pub(crate) fn class_name(config: &Path) -> Result<String> {
    let index: ModelIndex = load_json(config)?;
    Ok(index.class_name)
}

/// Reads the class of `dir` and checks it is one of `supported`.
pub fn check_pipeline_class(dir: &Path, supported: &[&str]) -> Result<String> {
    let class = pipeline_class(dir)?;
    if !supported.contains(&class.as_str()) {
        return Err(PipelineError::UnsupportedPipeline {
            path: dir.join("model_index.json"),
            class,
            supported: supported.join(", "),
        });
    }
    Ok(class)
}

/// The folder of component `name`, or an error naming what is missing.
pub fn component(dir: &Path, name: &str) -> Result<PathBuf> {
    let path = dir.join(name);
    if path.is_dir() {
        tracing::info!(target: "oxidiff::load", component = name, "loading");
        Ok(path)
    } else {
        Err(PipelineError::MissingComponent {
            dir: dir.to_path_buf(),
            component: name.to_string(),
        })
    }
}

/// The checkpoint's scheduler (`scheduler/scheduler_config.json`), or the one `options` names
/// with the checkpoint's betas config kept.
pub fn load_scheduler<B: Backend>(
    dir: &Path,
    options: &LoadOptions,
) -> Result<(SchedulerConfig, Box<dyn Scheduler<B>>)> {
    let path = component(dir, "scheduler")?.join("scheduler_config.json");
    let mut config = SchedulerConfig::from_file(&path)?;
    if let Some(name) = &options.scheduler {
        config = config.switched_to_named(name)?;
    }
    let scheduler = scheduler_from_config(&config)?;
    Ok((config, scheduler))
}

/// The weight dtype a pipeline casts its components to after loading ([`LoadOptions::dtype`]):
/// a no-op for weights read in it, it also casts what a model computes at load in f32.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cast(pub Option<FloatDType>);

impl Cast {
    /// `module` with its float weights in the dtype (unchanged for `None`).
    pub fn apply<B: Backend, M: oxidiff_models::ToDType<B>>(self, module: M) -> M {
        match self.0 {
            Some(dtype) => module.to_dtype(dtype),
            None => module,
        }
    }
}
