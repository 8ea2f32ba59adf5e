//! Pipeline errors: each says what was wrong and what to do.

use std::path::PathBuf;

use oxidiff_models::ModelError;
use oxidiff_schedulers::SchedulerError;

#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Scheduler(#[from] SchedulerError),
    #[error("model `{spec}` not found: {hint}")]
    ModelNotFound { spec: String, hint: String },
    #[error(
        "{dir} has no `{component}` folder; a diffusers pipeline folder has \
         model_index.json plus one folder per component it lists (for Stable Diffusion \
         text_encoder/, tokenizer/, unet/, vae/ and scheduler/; SDXL also text_encoder_2/ and \
         tokenizer_2/)"
    )]
    MissingComponent { dir: PathBuf, component: String },
    #[error("{path}: pipeline class `{class}` is not supported ({supported})")]
    UnsupportedPipeline {
        path: PathBuf,
        class: String,
        supported: String,
    },
    #[error("{path}: pipeline class `{class}` cannot do {task}; {task} takes {supported}")]
    CannotEdit {
        path: PathBuf,
        class: String,
        task: &'static str,
        supported: String,
    },
    #[error(transparent)]
    Parallel(#[from] oxidiff_parallel::ParallelError),
    #[error("compiled mode: {0}")]
    Compile(String),
    #[error("invalid input: {0}")]
    InvalidInput(String),
    #[error("interrupted after {done} of {total} steps; nothing was written")]
    Cancelled { done: usize, total: usize },
    #[error(
        "the device failed: {0}; the run stopped and its tensors were freed (files already \
         written are untouched)"
    )]
    Device(String),
    #[error("NaN or Inf in {stage}: {hint}")]
    NonFinite { stage: String, hint: String },
    #[error("{path}: {reason}")]
    SingleFile { path: PathBuf, reason: String },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T, E = PipelineError> = std::result::Result<T, E>;
