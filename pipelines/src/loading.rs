//! What every pipeline does the same way: reading `model_index.json`, finding component
//! folders, building the scheduler, checking a request and drawing the initial latents.

use std::path::{Path, PathBuf};

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use oxidiff_models::config::load_json;
use oxidiff_schedulers::{scheduler_from_config, NoiseSource, Scheduler, SchedulerConfig};
use serde::Deserialize;

use crate::error::{PipelineError, Result};
use crate::stable_diffusion::{GenerateRequest, LoadOptions};

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
    let (w, h) = (
        req.width.unwrap_or(default.0),
        req.height.unwrap_or(default.1),
    );
    let f = factor;
    if w == 0 || h == 0 || w % f != 0 || h % f != 0 {
        return Err(PipelineError::InvalidInput(format!(
            "width and height must be positive multiples of {f}, got {w}x{h}; try {}x{}",
            (w.max(f) / f) * f,
            (h.max(f) / f) * f
        )));
    }
    Ok((w, h))
}

/// One negative prompt per prompt: none means the empty string, one is repeated.
pub fn negatives_for<B: Backend>(req: &GenerateRequest<B>) -> Vec<String> {
    match req.negative_prompts.len() {
        0 => vec![String::new(); req.prompts.len()],
        1 => vec![req.negative_prompts[0].clone(); req.prompts.len()],
        _ => req.negative_prompts.clone(),
    }
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

/// Classifier-free guidance on a `[2 * batch, ...]` prediction ordered [unconditional, text].
pub fn guide<B: Backend>(prediction: Tensor<B, 4>, batch: usize, scale: f64) -> Tensor<B, 4> {
    let uncond = prediction.clone().narrow(0, 0, batch);
    let text = prediction.narrow(0, batch, batch);
    uncond.clone() + (text - uncond).mul_scalar(scale)
}

/// The weight dtype a pipeline casts its components to after loading ([`LoadOptions::dtype`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cast(pub Option<burn::tensor::FloatDType>);

impl Cast {
    /// `module` with its float weights in the dtype (unchanged for `None`).
    pub fn apply<B: Backend, M: oxidiff_models::ToDType<B>>(self, module: M) -> M {
        match self.0 {
            Some(dtype) => module.to_dtype(dtype),
            None => module,
        }
    }
}
