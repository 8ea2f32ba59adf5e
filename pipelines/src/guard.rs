//! Guards of a running generation: numerical faults (NaN or Inf in latents or images, caught
//! where they appear) and cancellation (Ctrl-C).
//!
//! A non-finite value spreads through every later step, so the pipeline checks after each
//! denoising step and after the VAE decode, with one reduction and one scalar read each (cheap
//! next to a UNet call), and names the step, the component and the usual fix.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::error::{PipelineError, Result};

/// Where a non-finite value was found.
#[derive(Debug, Clone, PartialEq)]
pub enum Stage {
    /// The denoiser's (UNet or transformer) prediction at a step.
    Denoiser { step: usize, timestep: f64 },
    /// The scheduler's update at a step (the prediction was finite).
    Scheduler {
        step: usize,
        timestep: f64,
        scheduler: String,
    },
    /// The VAE decoder's output (the latents were finite).
    VaeDecode,
}

impl Stage {
    /// What the user can do about a fault here.
    fn hint(&self) -> &'static str {
        match self {
            Stage::Denoiser { .. } => {
                "the model's weights may hold NaN/Inf (a damaged or badly converted \
                 checkpoint), or half-precision activations overflowed: run in f32, or lower \
                 the guidance scale"
            }
            Stage::Scheduler { .. } => {
                "the scheduler's configuration gives an unusable step (for example a zero \
                 final sigma with a solver that divides by it): try another scheduler or the \
                 checkpoint's own scheduler_config.json"
            }
            Stage::VaeDecode => {
                "the VAE overflowed; Stable Diffusion's VAE overflows in fp16: load the fp32 \
                 VAE (no fp16 variant for the vae), or a fixed fp16 VAE such as \
                 madebyollin/sdxl-vae-fp16-fix"
            }
        }
    }
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stage::Denoiser { step, timestep } => {
                write!(
                    f,
                    "the denoiser's output at step {step} (timestep {timestep})"
                )
            }
            Stage::Scheduler {
                step,
                timestep,
                scheduler,
            } => write!(
                f,
                "the {scheduler} step at step {step} (timestep {timestep})"
            ),
            Stage::VaeDecode => f.write_str("the VAE decoder's output"),
        }
    }
}

/// Whether every value of `t` is finite: the sum of a tensor with a NaN or Inf is not finite.
/// (A sum of huge finite values can overflow too, which is as unusable.)
pub fn is_finite<B: Backend, const D: usize>(t: &Tensor<B, D>) -> Result<bool> {
    let value = crate::host::read_f32(t.clone().sum())?;
    Ok(value.first().is_some_and(|v| v.is_finite()))
}

/// Fails with [`PipelineError::NonFinite`] when `t` holds NaN or Inf.
pub fn ensure_finite<B: Backend, const D: usize>(t: &Tensor<B, D>, stage: Stage) -> Result<()> {
    if is_finite(t)? {
        Ok(())
    } else {
        Err(fault(stage))
    }
}

/// After a denoising step: fails when the new `latents` are not finite, naming the denoiser when
/// its `prediction` was already broken and the scheduler otherwise. One check per step; the
/// second only runs on failure.
pub fn check_step<B: Backend>(
    latents: &Tensor<B, 4>,
    prediction: &Tensor<B, 4>,
    step: usize,
    timestep: f64,
    scheduler: &str,
) -> Result<()> {
    if is_finite(latents)? {
        return Ok(());
    }
    Err(fault(if is_finite(prediction)? {
        Stage::Scheduler {
            step,
            timestep,
            scheduler: scheduler.to_string(),
        }
    } else {
        Stage::Denoiser { step, timestep }
    }))
}

/// The error for a non-finite value found at `stage`.
pub fn fault(stage: Stage) -> PipelineError {
    PipelineError::NonFinite {
        hint: stage.hint().to_string(),
        stage: stage.to_string(),
    }
}

/// A flag another thread (a Ctrl-C handler, a UI) sets to stop a generation after its current
/// step; the pipeline then returns [`PipelineError::Cancelled`] and produces no image.
#[derive(Debug, Clone, Default)]
pub struct CancelToken(Arc<AtomicBool>);

impl CancelToken {
    pub fn new() -> Self {
        Self::default()
    }

    /// Asks the generation to stop after the step it is in.
    pub fn cancel(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }

    /// Fails with [`PipelineError::Cancelled`] once cancelled; `done` steps were completed.
    pub fn check(&self, done: usize, total: usize) -> Result<()> {
        if self.is_cancelled() {
            Err(PipelineError::Cancelled { done, total })
        } else {
            Ok(())
        }
    }
}
