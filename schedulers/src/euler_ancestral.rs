//! `EulerAncestralDiscreteScheduler`: k-diffusion's `sample_euler_ancestral` ("Euler a").
//!
//! Each step takes an Euler step down to `sigma_down` and adds fresh noise of standard
//! deviation `sigma_up`, with `sigma_down^2 + sigma_up^2 = sigma_next^2`.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::config::{PredictionType, SchedulerConfig, TimestepSpacing};
use crate::error::{Result, SchedulerError};
use crate::noise::NoiseSource;
use crate::ops::scaled;
use crate::schedule::{check_steps, float_timesteps, numpy_interp, NoiseSchedule};
use crate::sigma_steps::{euler_coefficients, SigmaSteps};
use crate::{Scheduler, SchedulerKind};

const CLASS: &str = "EulerAncestralDiscreteScheduler";

/// diffusers' `EulerAncestralDiscreteScheduler`.
pub struct EulerAncestralDiscreteScheduler {
    schedule: NoiseSchedule,
    num_train_timesteps: usize,
    prediction_type: PredictionType,
    timestep_spacing: TimestepSpacing,
    steps_offset: usize,
    steps: SigmaSteps,
}

impl EulerAncestralDiscreteScheduler {
    pub fn new(cfg: &SchedulerConfig) -> Result<Self> {
        if cfg.prediction_type == PredictionType::Sample {
            return Err(SchedulerError::Unsupported {
                class: CLASS,
                message: "prediction_type `sample` is not implemented (as in diffusers); use epsilon or v_prediction".into(),
            });
        }
        let mut schedule = NoiseSchedule::new(cfg, CLASS, cfg.rescale_betas_zero_snr)?;
        if cfg.rescale_betas_zero_snr {
            let last = schedule.alphas_cumprod.len() - 1;
            schedule.alphas_cumprod[last] = 2f32.powi(-24);
        }
        let timestep_spacing = cfg
            .timestep_spacing
            .unwrap_or(SchedulerKind::EulerAncestralDiscrete.default_timestep_spacing());
        let mut steps = SigmaSteps {
            class: CLASS,
            ..Default::default()
        };
        let mut sigmas = schedule.train_sigmas();
        sigmas.reverse();
        sigmas.push(0.0);
        steps.set(Vec::new(), sigmas, timestep_spacing, false);
        Ok(Self {
            schedule,
            num_train_timesteps: cfg.num_train_timesteps,
            prediction_type: cfg.prediction_type,
            timestep_spacing,
            steps_offset: cfg.steps_offset,
            steps,
        })
    }
}

impl<B: Backend> Scheduler<B> for EulerAncestralDiscreteScheduler {
    fn kind(&self) -> SchedulerKind {
        SchedulerKind::EulerAncestralDiscrete
    }

    fn set_timesteps(&mut self, n: usize) -> Result<()> {
        check_steps(CLASS, n, self.num_train_timesteps)?;
        let timesteps = float_timesteps(
            self.timestep_spacing,
            self.num_train_timesteps,
            n,
            self.steps_offset,
        );
        let train = self.schedule.train_sigmas();
        let mut sigmas: Vec<f32> = timesteps
            .iter()
            .map(|&t| numpy_interp(t as f64, &train) as f32)
            .collect();
        sigmas.push(0.0);
        self.steps
            .set(timesteps, sigmas, self.timestep_spacing, true);
        Ok(())
    }

    fn timesteps(&self) -> &[f64] {
        &self.steps.timesteps
    }

    fn init_noise_sigma(&self) -> f64 {
        self.steps.init_noise_sigma
    }

    fn scale_model_input(&self, sample: Tensor<B, 4>, timestep: f64) -> Result<Tensor<B, 4>> {
        self.steps.scale_model_input(sample, timestep)
    }

    fn step(
        &mut self,
        model_output: Tensor<B, 4>,
        timestep: f64,
        sample: Tensor<B, 4>,
        noise: &mut dyn NoiseSource<B>,
    ) -> Result<Tensor<B, 4>> {
        let i = self.steps.index("step", timestep)?;
        let (sigma_from, sigma_to) = (self.steps.sigmas[i], self.steps.sigmas[i + 1]);
        let (from2, to2) = (sigma_from * sigma_from, sigma_to * sigma_to);
        let sigma_up = (to2 * (from2 - to2) / from2).max(0.0).sqrt();
        let sigma_down = (to2 - sigma_up * sigma_up).max(0.0).sqrt();
        let (a, b) = euler_coefficients(self.prediction_type, sigma_from, sigma_down - sigma_from);
        // diffusers draws the noise on every step, the last (sigma_up = 0) included, so the
        // generator stays in step with its own.
        let z = noise.randn(model_output.dims(), &model_output.device())?;
        self.steps.step_index = Some(i + 1);
        Ok(scaled(sample, a) + model_output.mul_scalar(b) + z.mul_scalar(sigma_up))
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
