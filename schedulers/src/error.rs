//! The crate's error type: every failure names the file, field, scheduler or step involved.

use std::path::PathBuf;

/// Errors from loading a scheduler config, building a scheduler or stepping it.
#[derive(Debug, thiserror::Error)]
pub enum SchedulerError {
    /// The config file could not be read.
    #[error("cannot read scheduler config {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The config is not a JSON object.
    #[error("{origin}: not a valid scheduler config (expected a JSON object): {message}")]
    Json { origin: String, message: String },
    /// A config field has the wrong type or an unknown value.
    #[error("{origin}: field `{field}`: {message}")]
    Field {
        origin: String,
        field: String,
        message: String,
    },
    /// A scheduler name (from `_class_name` or `--scheduler`) that this crate does not know.
    #[error("unknown scheduler `{name}`; known names: {known}")]
    UnknownScheduler { name: String, known: String },
    /// A config option or value the scheduler does not support.
    #[error("{class}: {message}")]
    Unsupported {
        class: &'static str,
        message: String,
    },
    /// `num_inference_steps` outside `1..=num_train_timesteps` (or too few for the algorithm).
    #[error("{class}: num_inference_steps = {got} is invalid: {reason}")]
    InvalidSteps {
        class: &'static str,
        got: usize,
        reason: String,
    },
    /// `step`, `scale_model_input` or `add_noise` called before `set_timesteps`.
    #[error("{class}: {op}() called before set_timesteps(); call set_timesteps(num_inference_steps) first")]
    NotInitialized {
        class: &'static str,
        op: &'static str,
    },
    /// A timestep that is not part of the current schedule (or not a valid training timestep).
    #[error("{class}: timestep {timestep} {reason}")]
    BadTimestep {
        class: &'static str,
        timestep: f64,
        reason: String,
    },
    /// More `step` calls than the schedule has steps.
    #[error(
        "{class}: all {steps} steps of the schedule were already taken; call set_timesteps() again"
    )]
    ScheduleExhausted { class: &'static str, steps: usize },
    /// Tensor shapes that do not fit together.
    #[error("{class}: {op}: {message}")]
    Shape {
        class: &'static str,
        op: &'static str,
        message: String,
    },
    /// A scheduler name that diffusers knows (or A1111 uses) but this crate does not implement.
    #[error("scheduler `{name}`: {reason}")]
    NotImplemented { name: String, reason: String },
    /// A noise source that cannot deliver the requested noise.
    #[error("noise source: {0}")]
    Noise(String),
}

/// The crate's result type.
pub type Result<T, E = SchedulerError> = std::result::Result<T, E>;
