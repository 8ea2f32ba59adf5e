//! `CMStochasticIterativeScheduler`: multistep sampling of a consistency model (Song et al.
//! 2023, "Consistency Models", algorithm 1).
//!
//! The denoiser is the raw network `F(c_in x, t)`; this scheduler applies the consistency
//! parameterisation around it: `scale_model_input` gives `c_in x = x / sqrt(sigma^2 +
//! sigma_data^2)`, and `step` forms the clean estimate `c_skip x + c_out F` with the
//! boundary-condition scalings (`sigma - sigma_min` in place of `sigma`), clips it to
//! `[-1, 1]`, and noises it back up to the next sigma (`sqrt(sigma_next^2 - sigma_min^2)`).
//! The network's timestep is `t = 250 ln(sigma)`. Sigmas follow Karras' schedule over
//! `num_train_timesteps` (diffusers' default 40) discretisation points.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::config::SchedulerConfig;
use crate::error::{Result, SchedulerError};
use crate::noise::NoiseSource;
use crate::sigma_steps::SigmaSteps;
use crate::{Scheduler, SchedulerKind};

const CLASS: &str = "CMStochasticIterativeScheduler";

/// diffusers' `CMStochasticIterativeScheduler`.
///
/// Its config fields: `num_train_timesteps` (diffusers' class default is 40 where
/// [`SchedulerConfig`]'s is 1000, so a config for this class must give it; diffusers'
/// `save_pretrained` always writes it), `sigma_min` (0.002), `sigma_max` (80), `sigma_data`
/// (0.5), `s_noise` (1), `rho` (7), `clip_denoised` (true).
pub struct CmStochasticIterativeScheduler {
    num_train_timesteps: usize,
    sigma_min: f64,
    sigma_max: f64,
    sigma_data: f64,
    s_noise: f64,
    rho: f64,
    clip_denoised: bool,
    steps: SigmaSteps,
}

impl CmStochasticIterativeScheduler {
    pub fn new(cfg: &SchedulerConfig) -> Result<Self> {
        let sched = Self {
            num_train_timesteps: cfg.num_train_timesteps,
            sigma_min: cfg.sigma_min.unwrap_or(0.002),
            sigma_max: cfg.sigma_max.unwrap_or(80.0),
            sigma_data: cfg.sigma_data.unwrap_or(0.5),
            s_noise: cfg.s_noise.unwrap_or(1.0),
            rho: cfg.rho.unwrap_or(7.0),
            clip_denoised: cfg.clip_denoised.unwrap_or(true),
            steps: SigmaSteps {
                class: CLASS,
                ..Default::default()
            },
        };
        let valid = sched.sigma_min > 0.0
            && sched.sigma_max > sched.sigma_min
            && sched.sigma_data > 0.0
            && sched.rho > 0.0
            && sched.num_train_timesteps >= 2;
        if !valid {
            return Err(SchedulerError::Unsupported {
                class: CLASS,
                message: format!(
                    "needs 0 < sigma_min < sigma_max, sigma_data > 0, rho > 0 and \
                     num_train_timesteps >= 2; got sigma_min {}, sigma_max {}, sigma_data {}, \
                     rho {}, num_train_timesteps {}",
                    sched.sigma_min,
                    sched.sigma_max,
                    sched.sigma_data,
                    sched.rho,
                    sched.num_train_timesteps
                ),
            });
        }
        Ok(sched)
    }

    /// diffusers' `set_timesteps(timesteps=[...])`: an explicit schedule of discretisation
    /// points, strictly decreasing and below `num_train_timesteps` (e.g. `[22, 0]` for the
    /// two-step ImageNet-64 consistency models).
    pub fn set_custom_timesteps(&mut self, timesteps: &[usize]) -> Result<()> {
        let bad = |timestep: usize, reason: String| SchedulerError::BadTimestep {
            class: CLASS,
            timestep: timestep as f64,
            reason,
        };
        if timesteps.is_empty() {
            return Err(SchedulerError::InvalidSteps {
                class: CLASS,
                got: 0,
                reason: "give at least one timestep".into(),
            });
        }
        if let Some(w) = timesteps.windows(2).find(|w| w[1] >= w[0]) {
            return Err(bad(
                w[1],
                "follows a smaller or equal one; custom timesteps must be strictly decreasing"
                    .into(),
            ));
        }
        if timesteps[0] >= self.num_train_timesteps {
            return Err(bad(
                timesteps[0],
                format!(
                    "must be below num_train_timesteps = {}",
                    self.num_train_timesteps
                ),
            ));
        }
        self.install(timesteps);
        Ok(())
    }

    /// Karras sigmas at the discretisation points `points` (decreasing), the network
    /// timesteps `250 ln(sigma)` from the f64 sigmas, and the sigmas rounded to f32 with
    /// `sigma_min` appended, as diffusers stores them.
    fn install(&mut self, points: &[usize]) {
        let last = (self.num_train_timesteps - 1) as f64;
        let min_inv_rho = self.sigma_min.powf(1.0 / self.rho);
        let max_inv_rho = self.sigma_max.powf(1.0 / self.rho);
        // As diffusers: the decreasing points, reversed, make an increasing ramp in [0, 1],
        // whose Karras sigmas decrease from sigma_max (point 0) towards sigma_min.
        let ramp: Vec<f64> = points.iter().rev().map(|&p| p as f64 / last).collect();
        let sigmas: Vec<f64> = ramp
            .iter()
            .map(|r| (max_inv_rho + r * (min_inv_rho - max_inv_rho)).powf(self.rho))
            .collect();
        self.steps.timesteps = sigmas.iter().map(|&s| sigma_to_t(s)).collect();
        self.steps.sigmas = sigmas
            .iter()
            .chain(std::iter::once(&self.sigma_min))
            .map(|&s| s as f32 as f64)
            .collect();
        self.steps.init_noise_sigma = self.sigma_max;
        self.steps.initialized = true;
        self.steps.step_index = None;
        self.steps.begin_index = None;
    }

    /// The consistency parameterisation's `(c_skip, c_out)` at `sigma` with the boundary
    /// condition (diffusers' `get_scalings_for_boundary_condition`): `c_skip = 1, c_out = 0`
    /// at `sigma_min`.
    pub fn scalings_for_boundary_condition(&self, sigma: f64) -> (f64, f64) {
        let (d2, shifted) = (self.sigma_data * self.sigma_data, sigma - self.sigma_min);
        let c_skip = d2 / (shifted * shifted + d2);
        let c_out = shifted * self.sigma_data / (sigma * sigma + d2).sqrt();
        (c_skip, c_out)
    }

    /// The network input scaling `c_in = 1 / sqrt(sigma^2 + sigma_data^2)`.
    pub fn c_in(&self, sigma: f64) -> f64 {
        1.0 / (sigma * sigma + self.sigma_data * self.sigma_data).sqrt()
    }
}

/// diffusers' `sigma_to_t`: the network's timestep `1000 * 0.25 * ln(sigma + 1e-44)`.
pub fn sigma_to_t(sigma: f64) -> f64 {
    1000.0 * 0.25 * (sigma + 1e-44).ln()
}

impl<B: Backend> Scheduler<B> for CmStochasticIterativeScheduler {
    fn kind(&self) -> SchedulerKind {
        SchedulerKind::CmStochasticIterative
    }

    fn set_timesteps(&mut self, n: usize) -> Result<()> {
        if n == 0 || n > self.num_train_timesteps {
            return Err(SchedulerError::InvalidSteps {
                class: CLASS,
                got: n,
                reason: format!(
                    "must be between 1 and num_train_timesteps = {}",
                    self.num_train_timesteps
                ),
            });
        }
        let ratio = self.num_train_timesteps / n;
        let points: Vec<usize> = (0..n).rev().map(|i| i * ratio).collect();
        self.install(&points);
        Ok(())
    }

    fn timesteps(&self) -> &[f64] {
        &self.steps.timesteps
    }

    fn init_noise_sigma(&self) -> f64 {
        self.sigma_max
    }

    fn scale_model_input(&self, sample: Tensor<B, 4>, timestep: f64) -> Result<Tensor<B, 4>> {
        let sigma = self.steps.sigmas[self.steps.index("scale_model_input", timestep)?];
        // diffusers: sample / (sigma**2 + sigma_data**2) ** 0.5 on an f32 0-d sigma.
        let sigma = sigma as f32;
        let data = self.sigma_data as f32;
        Ok(sample.div_scalar((sigma * sigma + data * data).sqrt()))
    }

    fn step(
        &mut self,
        model_output: Tensor<B, 4>,
        timestep: f64,
        sample: Tensor<B, 4>,
        noise: &mut dyn NoiseSource<B>,
    ) -> Result<Tensor<B, 4>> {
        if model_output.dims() != sample.dims() {
            return Err(SchedulerError::Shape {
                class: CLASS,
                op: "step",
                message: format!(
                    "model output shape {:?} differs from sample shape {:?}",
                    model_output.dims(),
                    sample.dims()
                ),
            });
        }
        let i = self.steps.index("step", timestep)?;
        let sigma = self.steps.sigmas[i];
        // diffusers: the next sigma, or the last one past the training schedule's end.
        let last = self.steps.sigmas.last().copied().unwrap_or(sigma);
        let sigma_next = if i + 1 < self.num_train_timesteps {
            self.steps.sigmas.get(i + 1).copied().unwrap_or(last)
        } else {
            last
        };
        let (c_skip, c_out) = self.scalings_for_boundary_condition(sigma);
        let mut denoised = model_output.clone().mul_scalar(c_out) + sample.mul_scalar(c_skip);
        if self.clip_denoised {
            denoised = denoised.clamp(-1.0, 1.0);
        }
        self.steps.step_index = Some(i + 1);
        // diffusers draws noise only for multistep schedules, on every step (the last one,
        // which lands on sigma_min and scales it by 0, included).
        if self.steps.timesteps.len() < 2 {
            return Ok(denoised);
        }
        let z = noise.randn(model_output.dims(), &model_output.device())?;
        let sigma_hat = sigma_next.clamp(self.sigma_min, self.sigma_max) as f32;
        // In f32 like diffusers' 0-d tensors: at sigma_min this is f32 rounding, not 0.
        let var = sigma_hat * sigma_hat - (self.sigma_min * self.sigma_min) as f32;
        let std = self.s_noise * f64::from(var.max(0.0).sqrt());
        Ok(if std == 0.0 {
            denoised
        } else {
            denoised + z.mul_scalar(std)
        })
    }

    fn add_noise(
        &self,
        original: Tensor<B, 4>,
        noise: Tensor<B, 4>,
        timesteps: &[f64],
    ) -> Result<Tensor<B, 4>> {
        self.steps.add_noise(original, noise, timesteps)
    }

    fn sigmas(&self) -> Option<&[f64]> {
        self.steps.initialized.then_some(&self.steps.sigmas[..])
    }

    fn set_begin_index(&mut self, begin_index: usize) {
        self.steps.begin_index = Some(begin_index);
    }
}
