//! `DDPMScheduler`: ancestral sampling of denoising diffusion probabilistic models.
//!
//! Each step predicts the clean sample `x0` (optionally clipped or thresholded), takes the
//! mean of the posterior `q(x_prev | x_t, x0)` and adds fresh noise with the posterior's
//! (or the forward process') standard deviation. The previous timestep is the next one in
//! the schedule, so any spacing works.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::config::{PredictionType, SchedulerConfig, TimestepSpacing, VarianceType};
use crate::error::{Result, SchedulerError};
use crate::noise::NoiseSource;
use crate::ops::threshold_or_clip;
use crate::schedule::{check_steps, checked_integer_timesteps, integer_timestep, NoiseSchedule};
use crate::{Scheduler, SchedulerKind};

const CLASS: &str = "DDPMScheduler";

/// diffusers' `DDPMScheduler` with a fixed variance (`fixed_small`, `fixed_small_log`,
/// `fixed_large`).
pub struct DdpmScheduler {
    schedule: NoiseSchedule,
    num_train_timesteps: usize,
    prediction_type: PredictionType,
    variance_type: VarianceType,
    timestep_spacing: TimestepSpacing,
    steps_offset: usize,
    clip_sample: bool,
    clip_sample_range: f64,
    thresholding: bool,
    dynamic_thresholding_ratio: f64,
    sample_max_value: f64,
    timesteps: Vec<f64>,
    initialized: bool,
}

impl DdpmScheduler {
    pub fn new(cfg: &SchedulerConfig) -> Result<Self> {
        let variance_type = cfg.variance_type.unwrap_or(VarianceType::FixedSmall);
        if !matches!(
            variance_type,
            VarianceType::FixedSmall | VarianceType::FixedSmallLog | VarianceType::FixedLarge
        ) {
            return Err(SchedulerError::Unsupported {
                class: CLASS,
                message: format!(
                    "variance_type {variance_type:?} is not supported (learned variances need a 2x-channel model output; diffusers' fixed_large_log takes the square root of a log); use fixed_small, fixed_small_log or fixed_large"
                ),
            });
        }
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
            schedule: NoiseSchedule::new(cfg, CLASS, cfg.rescale_betas_zero_snr)?,
            num_train_timesteps: cfg.num_train_timesteps,
            prediction_type: cfg.prediction_type,
            variance_type,
            timestep_spacing: cfg
                .timestep_spacing
                .unwrap_or(SchedulerKind::Ddpm.default_timestep_spacing()),
            steps_offset: cfg.steps_offset,
            clip_sample: cfg.clip_sample.unwrap_or(true),
            clip_sample_range: cfg.clip_sample_range,
            thresholding: cfg.thresholding,
            dynamic_thresholding_ratio: cfg.dynamic_thresholding_ratio,
            sample_max_value: cfg.sample_max_value,
            timesteps: Vec::new(),
            initialized: false,
        })
    }

    /// The timestep after `t` in the schedule, or -1 after the last one.
    fn previous_timestep(&self, t: f64) -> Result<i64> {
        let i = self.timesteps.iter().position(|&s| s == t).ok_or_else(|| {
            SchedulerError::BadTimestep {
                class: CLASS,
                timestep: t,
                reason: "is not in the schedule; pass a value from timesteps()".into(),
            }
        })?;
        Ok(self.timesteps.get(i + 1).map_or(-1, |&p| p as i64))
    }
}

impl<B: Backend> Scheduler<B> for DdpmScheduler {
    fn kind(&self) -> SchedulerKind {
        SchedulerKind::Ddpm
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
        self.initialized = true;
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
        if !self.initialized {
            return Err(SchedulerError::NotInitialized {
                class: CLASS,
                op: "step",
            });
        }
        let t = integer_timestep(CLASS, timestep)?;
        let prev_t = self.previous_timestep(timestep)?;
        let a_t = self.schedule.alpha_at(CLASS, t)?;
        let a_prev = if prev_t >= 0 {
            self.schedule.alpha_at(CLASS, prev_t)?
        } else {
            1.0
        };
        let (b_t, b_prev) = (1.0 - a_t, 1.0 - a_prev);
        let current_alpha = a_t / a_prev;
        let current_beta = 1.0 - current_alpha;

        let (sa, sb) = (a_t.sqrt(), b_t.sqrt());
        let x0 = ddpm_x0(
            self.prediction_type,
            sa,
            sb,
            model_output.clone(),
            sample.clone(),
        );
        let x0 = threshold_or_clip(
            x0,
            self.thresholding
                .then_some((self.dynamic_thresholding_ratio, self.sample_max_value)),
            self.clip_sample.then_some(self.clip_sample_range),
        );
        let x0_coeff = a_prev.sqrt() * current_beta / b_t;
        let sample_coeff = current_alpha.sqrt() * b_prev / b_t;
        let mean = x0.mul_scalar(x0_coeff) + sample.mul_scalar(sample_coeff);
        if t == 0 {
            return Ok(mean);
        }
        // The posterior variance, floored at 1e-20 as diffusers does.
        let std = match self.variance_type {
            VarianceType::FixedLarge => current_beta.sqrt(),
            _ => (b_prev / b_t * current_beta).max(1e-20).sqrt(),
        };
        let z = noise.randn(model_output.dims(), &model_output.device())?;
        Ok(mean + z.mul_scalar(std))
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
}

/// The predicted `x0` of DDPM and DDIM from the model output, for `sqrt(alpha_prod_t) = sa`
/// and `sqrt(1 - alpha_prod_t) = sb`.
pub(crate) fn ddpm_x0<B: Backend>(
    prediction: PredictionType,
    sa: f64,
    sb: f64,
    model_output: Tensor<B, 4>,
    sample: Tensor<B, 4>,
) -> Tensor<B, 4> {
    match prediction {
        PredictionType::Epsilon => sample.mul_scalar(1.0 / sa) - model_output.mul_scalar(sb / sa),
        PredictionType::Sample => model_output,
        PredictionType::VPrediction => sample.mul_scalar(sa) - model_output.mul_scalar(sb),
    }
}
