//! [`SigmaSteps`], the sigma table and step counter of every sigma-based scheduler (the
//! Euler and k-diffusion family, DPM-Solver, DEIS, UniPC, flow matching, consistency models),
//! and the k-diffusion derivative and Euler-step coefficients several of them share.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::config::{PredictionType, TimestepSpacing};
use crate::error::{Result, SchedulerError};
use crate::ops::{check_add_noise, scale_per_item};

/// Timesteps, sigmas and the step position of a sigma-based scheduler (diffusers'
/// `timesteps`, `sigmas`, `_step_index`, `_begin_index`). Values are f32 like diffusers'
/// tensors, stored as f64.
#[derive(Clone, Debug, Default)]
pub(crate) struct SigmaSteps {
    pub class: &'static str,
    pub timesteps: Vec<f64>,
    /// One more than `timesteps`: the last is the sigma the final step lands on.
    pub sigmas: Vec<f64>,
    pub init_noise_sigma: f64,
    pub initialized: bool,
    pub step_index: Option<usize>,
    pub begin_index: Option<usize>,
}

impl SigmaSteps {
    /// Installs a new schedule; `init_noise_sigma` is `max(sigma)` for linspace and trailing
    /// spacing and `sqrt(max(sigma)^2 + 1)` for leading, in f32 like diffusers.
    pub fn set(
        &mut self,
        timesteps: Vec<f32>,
        sigmas: Vec<f32>,
        spacing: TimestepSpacing,
        initialized: bool,
    ) {
        let max = sigmas.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        self.init_noise_sigma = match spacing {
            TimestepSpacing::Leading => (max * max + 1.0).sqrt() as f64,
            _ => max as f64,
        };
        self.timesteps = timesteps.into_iter().map(f64::from).collect();
        self.sigmas = sigmas.into_iter().map(f64::from).collect();
        self.initialized = initialized;
        self.step_index = None;
        self.begin_index = None;
    }

    /// diffusers' `index_for_timestep`: the first position of `t` in the schedule, or the
    /// second when it occurs twice (so img2img that starts mid-schedule skips no sigma).
    fn index_for_timestep(&self, t: f64) -> Result<usize> {
        let mut hits = self
            .timesteps
            .iter()
            .enumerate()
            .filter(|(_, &s)| s == t)
            .map(|(i, _)| i);
        let first = hits.next();
        let second = hits.next();
        second.or(first).ok_or_else(|| SchedulerError::BadTimestep {
            class: self.class,
            timestep: t,
            reason: "is not in the schedule; pass a value from timesteps()".into(),
        })
    }

    /// [`index`](Self::index), also checked against the number of timesteps: the
    /// two-evaluation schedulers (KDPM2, KDPM2 ancestral) list each sigma twice.
    pub(crate) fn index_within_timesteps(&self, op: &'static str, t: f64) -> Result<usize> {
        let i = self.index(op, t)?;
        if i >= self.timesteps.len() {
            return Err(SchedulerError::ScheduleExhausted {
                class: self.class,
                steps: self.timesteps.len(),
            });
        }
        Ok(i)
    }

    /// The step index in force for `t`: the running index, else `begin_index`, else looked up.
    pub fn index(&self, op: &'static str, t: f64) -> Result<usize> {
        if !self.initialized {
            return Err(SchedulerError::NotInitialized {
                class: self.class,
                op,
            });
        }
        let i = match (self.step_index, self.begin_index) {
            (Some(i), _) | (None, Some(i)) => i,
            (None, None) => self.index_for_timestep(t)?,
        };
        if i + 1 >= self.sigmas.len() {
            return Err(SchedulerError::ScheduleExhausted {
                class: self.class,
                steps: self.timesteps.len(),
            });
        }
        Ok(i)
    }

    /// `sample / sqrt(sigma^2 + 1)`, the denominator in f32 like diffusers.
    pub fn scale_model_input<B: Backend>(
        &self,
        sample: Tensor<B, 4>,
        t: f64,
    ) -> Result<Tensor<B, 4>> {
        let sigma = self.sigmas[self.index("scale_model_input", t)?] as f32;
        Ok(sample.div_scalar((sigma * sigma + 1.0).sqrt()))
    }

    /// `original + noise * sigma(t)`, with diffusers' choice of step index.
    pub fn add_noise<B: Backend>(
        &self,
        original: Tensor<B, 4>,
        noise: Tensor<B, 4>,
        timesteps: &[f64],
    ) -> Result<Tensor<B, 4>> {
        check_add_noise(self.class, &original, &noise, timesteps)?;
        let sigmas = self.sigmas_for_add_noise(timesteps)?;
        Ok(original + scale_per_item(noise, &sigmas))
    }

    /// The sigma `add_noise` uses for each timestep: looked up by value before the first
    /// step, else the current step's (or `begin_index`'s), as diffusers does.
    pub fn sigmas_for_add_noise(&self, timesteps: &[f64]) -> Result<Vec<f64>> {
        if !self.initialized {
            return Err(SchedulerError::NotInitialized {
                class: self.class,
                op: "add_noise",
            });
        }
        timesteps
            .iter()
            .map(|&t| {
                let i = match (self.begin_index, self.step_index) {
                    (None, _) => self.index_for_timestep(t)?,
                    (Some(_), Some(i)) | (Some(i), None) => i,
                };
                Ok(self.sigmas[i.min(self.sigmas.len() - 1)])
            })
            .collect()
    }
}

/// The coefficients `(a, b)` of k-diffusion's derivative `d = (x - x0) / sigma = a x + b
/// model_output`, with `x0` as the prediction type defines it.
pub(crate) fn derivative_coefficients(prediction: PredictionType, sigma: f64) -> (f64, f64) {
    match prediction {
        // x0 = x - sigma * eps
        PredictionType::Epsilon => (0.0, 1.0),
        // x0 = -sigma / sqrt(sigma^2 + 1) v + x / (sigma^2 + 1)
        PredictionType::VPrediction => {
            let s2 = sigma * sigma + 1.0;
            (sigma / s2, 1.0 / s2.sqrt())
        }
        // x0 = model_output
        PredictionType::Sample => (1.0 / sigma, -1.0 / sigma),
    }
}

/// The linear-combination coefficients of an Euler step `prev = a x + b model_output`, from
/// `sigma` and `dt = sigma_next - sigma` (k-diffusion's `x + d * dt`, `d = (x - x0) / sigma`).
pub(crate) fn euler_coefficients(prediction: PredictionType, sigma: f64, dt: f64) -> (f64, f64) {
    let (a, b) = derivative_coefficients(prediction, sigma);
    (1.0 + dt * a, dt * b)
}
