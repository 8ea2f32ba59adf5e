//! `DDIMScheduler`: denoising diffusion implicit models, deterministic at `eta = 0`.
//!
//! Each step predicts the clean sample `x0` and the noise, optionally clips or dynamically
//! thresholds `x0`, and moves to the previous timestep; `eta > 0` adds fresh noise scaled by
//! `eta` times the DDPM posterior standard deviation.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::config::{PredictionType, SchedulerConfig, TimestepSpacing};
use crate::ddpm::ddpm_x0;
use crate::error::{Result, SchedulerError};
use crate::noise::NoiseSource;
use crate::ops::threshold_or_clip;
use crate::schedule::{check_steps, checked_integer_timesteps, integer_timestep, NoiseSchedule};
use crate::{Scheduler, SchedulerKind};

const CLASS: &str = "DDIMScheduler";

/// diffusers' `DDIMScheduler`; `eta` is the argument diffusers' pipelines pass to `step`.
pub struct DdimScheduler {
    schedule: NoiseSchedule,
    final_alpha_cumprod: f64,
    num_train_timesteps: usize,
    prediction_type: PredictionType,
    timestep_spacing: TimestepSpacing,
    steps_offset: usize,
    clip_sample: bool,
    clip_sample_range: f64,
    thresholding: bool,
    dynamic_thresholding_ratio: f64,
    sample_max_value: f64,
    eta: f64,
    num_inference_steps: Option<usize>,
    timesteps: Vec<f64>,
}

impl DdimScheduler {
    pub fn new(cfg: &SchedulerConfig) -> Result<Self> {
        let schedule = NoiseSchedule::new(cfg, CLASS, cfg.rescale_betas_zero_snr)?;
        let final_alpha_cumprod = if cfg.set_alpha_to_one.unwrap_or(true) {
            1.0
        } else {
            schedule.alphas_cumprod[0] as f64
        };
        if cfg.thresholding && !(0.0..=1.0).contains(&cfg.dynamic_thresholding_ratio) {
            return Err(SchedulerError::Unsupported {
                class: CLASS,
                message: format!(
                    "dynamic_thresholding_ratio must be in [0, 1], got {}",
                    cfg.dynamic_thresholding_ratio
                ),
            });
        }
        Ok(Self {
            schedule,
            final_alpha_cumprod,
            num_train_timesteps: cfg.num_train_timesteps,
            prediction_type: cfg.prediction_type,
            timestep_spacing: cfg
                .timestep_spacing
                .unwrap_or(SchedulerKind::Ddim.default_timestep_spacing()),
            steps_offset: cfg.steps_offset,
            clip_sample: cfg.clip_sample.unwrap_or(true),
            clip_sample_range: cfg.clip_sample_range,
            thresholding: cfg.thresholding,
            dynamic_thresholding_ratio: cfg.dynamic_thresholding_ratio,
            sample_max_value: cfg.sample_max_value,
            eta: 0.0,
            num_inference_steps: None,
            timesteps: Vec::new(),
        })
    }

    /// Sets `eta` (0 by default).
    pub fn with_eta(mut self, eta: f64) -> Self {
        self.eta = eta;
        self
    }
}

impl<B: Backend> Scheduler<B> for DdimScheduler {
    fn kind(&self) -> SchedulerKind {
        SchedulerKind::Ddim
    }

    fn set_timesteps(&mut self, n: usize) -> Result<()> {
        check_steps(CLASS, n, self.num_train_timesteps)?;
        let ts = checked_integer_timesteps(
            CLASS,
            self.timestep_spacing,
            self.num_train_timesteps,
            n,
            self.steps_offset,
        )?;
        self.timesteps = ts.iter().map(|&t| t as f64).collect();
        self.num_inference_steps = Some(n);
        Ok(())
    }

    fn timesteps(&self) -> &[f64] {
        &self.timesteps
    }

    fn init_noise_sigma(&self) -> f64 {
        1.0
    }

    fn scale_model_input(&self, sample: Tensor<B, 4>, _timestep: f64) -> Result<Tensor<B, 4>> {
        Ok(sample)
    }

    fn step(
        &mut self,
        model_output: Tensor<B, 4>,
        timestep: f64,
        sample: Tensor<B, 4>,
        noise: &mut dyn NoiseSource<B>,
    ) -> Result<Tensor<B, 4>> {
        let n = self
            .num_inference_steps
            .ok_or(SchedulerError::NotInitialized {
                class: CLASS,
                op: "step",
            })?;
        let t = integer_timestep(CLASS, timestep)?;
        let prev_t = t - (self.num_train_timesteps / n) as i64;
        let a_t = self.schedule.alpha_at(CLASS, t)?;
        let a_prev = if prev_t >= 0 {
            self.schedule.alpha_at(CLASS, prev_t)?
        } else {
            self.final_alpha_cumprod
        };
        let b_t = 1.0 - a_t;
        let (sa, sb) = (a_t.sqrt(), b_t.sqrt());

        let x0 = ddpm_x0(
            self.prediction_type,
            sa,
            sb,
            model_output.clone(),
            sample.clone(),
        );
        let eps = match self.prediction_type {
            PredictionType::Epsilon => model_output.clone(),
            PredictionType::Sample => {
                sample.clone().mul_scalar(1.0 / sb) - model_output.clone().mul_scalar(sa / sb)
            }
            PredictionType::VPrediction => {
                model_output.clone().mul_scalar(sa) + sample.clone().mul_scalar(sb)
            }
        };
        let x0 = threshold_or_clip(
            x0,
            self.thresholding
                .then_some((self.dynamic_thresholding_ratio, self.sample_max_value)),
            self.clip_sample.then_some(self.clip_sample_range),
        );

        let b_prev = 1.0 - a_prev;
        let variance = b_prev / b_t * (1.0 - a_t / a_prev);
        let std_dev = self.eta * variance.sqrt();
        let dir_coeff = (1.0 - a_prev - std_dev * std_dev).max(0.0).sqrt();
        let mut prev = x0.mul_scalar(a_prev.sqrt()) + eps.mul_scalar(dir_coeff);
        if self.eta > 0.0 {
            let z = noise.randn(model_output.dims(), &model_output.device())?;
            prev = prev + z.mul_scalar(std_dev);
        }
        Ok(prev)
    }

    fn add_noise(
        &self,
        original: Tensor<B, 4>,
        noise: Tensor<B, 4>,
        timesteps: &[f64],
    ) -> Result<Tensor<B, 4>> {
        self.schedule
            .add_noise_at(CLASS, original, noise, timesteps)
    }

    fn set_eta(&mut self, eta: f64) {
        self.eta = eta;
    }
}
