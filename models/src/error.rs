//! Errors of model loading and execution. Each names the file or key and says what to do.

use std::path::PathBuf;

/// Everything that can go wrong while building a model from a checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{path} is not a valid safetensors file ({reason}); it may be truncated or corrupt: \
         download it again"
    )]
    Safetensors { path: PathBuf, reason: String },
    #[error(
        "{path} links to {target}, outside the model folder {model}; oxidiff reads weights only \
         from inside the model folder (or its Hub cache blobs): copy the file into the folder if \
         you trust it"
    )]
    OutsideModel {
        path: PathBuf,
        target: PathBuf,
        model: PathBuf,
    },
    #[error("no weights found in {dir}: expected {expected}")]
    NoWeights { dir: PathBuf, expected: String },
    #[error(
        "weight `{key}` is missing from {files}; the checkpoint does not match the model config \
         (wrong component folder or config?)"
    )]
    MissingKey { key: String, files: String },
    #[error("weight `{key}` in {path} has shape {found:?}, but the config expects {expected:?}")]
    ShapeMismatch {
        key: String,
        path: PathBuf,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("weight `{key}` in {path} has dtype {dtype}, which oxidiff cannot load (use F32, F16 or BF16)")]
    UnsupportedDtype {
        key: String,
        path: PathBuf,
        dtype: String,
    },
    #[error("invalid config {path}: {reason}")]
    Config { path: PathBuf, reason: String },
    #[error("unsupported model configuration in {path}: {reason}")]
    Unsupported { path: PathBuf, reason: String },
    #[error("tokenizer in {path}: {reason}")]
    Tokenizer { path: PathBuf, reason: String },
    #[error("invalid input: {0}")]
    Input(String),
    #[error("LoRA {path}: {reason}")]
    Lora { path: PathBuf, reason: String },
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;
