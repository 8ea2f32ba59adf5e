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
        "{path} is not a valid weights header ({reason}): it holds a safetensors header as JSON \
         (each tensor's dtype, shape and data_offsets), as tools/kernels/make_weight_headers.py \
         writes it"
    )]
    WeightsHeader { path: PathBuf, reason: String },
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
    #[error(
        "{path} is a pickle checkpoint ({kind}); oxidiff refuses to load pickles because \
         unpickling can execute arbitrary code. Download the .safetensors version of the model, \
         or convert this file once in a Python you trust: `python -c \"import torch, \
         safetensors.torch as st; sd = torch.load('in.ckpt', map_location='cpu', \
         weights_only=True); sd = sd.get('state_dict', sd); st.save_file({{k: v.contiguous() \
         for k, v in sd.items() if isinstance(v, torch.Tensor)}}, 'out.safetensors')\"`"
    )]
    Pickle { path: PathBuf, kind: String },
    #[error(
        "{path}: not a Stable Diffusion 1.x, 2.x or SDXL base checkpoint in the original \
         (LDM/A1111) layout: {reason}; looked for {looked_for}; the file's first keys are \
         {found}"
    )]
    UnknownArchitecture {
        path: PathBuf,
        reason: String,
        looked_for: String,
        found: String,
    },
    #[error(
        "{path}: not an SD 1.x/2.x or SDXL ControlNet file oxidiff reads: {reason}; looked for \
         {looked_for}; the file's first keys are {found}"
    )]
    NotAControlNet {
        path: PathBuf,
        reason: String,
        looked_for: String,
        found: String,
    },
    #[error("{path} is not a usable GGUF file: {reason}")]
    Gguf { path: PathBuf, reason: String },
    #[error("LoRA {path}: {reason}")]
    Lora { path: PathBuf, reason: String },
    #[error("IP-Adapter {path}: {reason}")]
    IpAdapter { path: PathBuf, reason: String },
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;
