//! `TCDScheduler`: strategic stochastic sampling of trajectory consistency distillation
//! (TCD, TCD-LoRA).
//!
//! Each step predicts the clean sample and noise, moves them to an intermediate timestep
//! `s = floor((1 - gamma) t_prev)`, and, for `gamma > 0` and all but the last step,
//! re-noises from `s` up to `t_prev`. `gamma` is diffusers' `eta` argument of `step`
//! (default 0.3; [`Scheduler::set_eta`] sets it, and the SD pipeline passes its `eta` as
//! diffusers' does). Timesteps are picked as LCM's.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::config::{PredictionType, SchedulerConfig};
use crate::error::{Result, SchedulerError};
use crate::lcm::{distilled_timesteps, x0_eps_coefficients, DistilledSteps};
use crate::noise::NoiseSource;
use crate::ops::lincomb;
use crate::schedule::{integer_timestep, NoiseSchedule};
use crate::{Scheduler, SchedulerKind};

const CLASS: &str = "TCDScheduler";

/// diffusers' `TCDScheduler`.
pub struct TcdScheduler {
    schedule: NoiseSchedule,
    num_train_timesteps: usize,
    original_inference_steps: usize,
    prediction_type: PredictionType,
    /// `gamma` in the paper, `eta` in diffusers.
    eta: f64,
    steps: DistilledSteps,
}

impl TcdScheduler {
    pub fn new(cfg: &SchedulerConfig) -> Result<Self> {
        Ok(Self {
            schedule: NoiseSchedule::new(cfg, CLASS, cfg.rescale_betas_zero_snr)?,
            num_train_timesteps: cfg.num_train_timesteps,
            original_inference_steps: cfg.original_inference_steps.unwrap_or(50),
            prediction_type: cfg.prediction_type,
            eta: 0.3,
            steps: DistilledSteps::default(),
        })
    }
}

impl<B: Backend> Scheduler<B> for TcdScheduler {
    fn kind(&self) -> SchedulerKind {
        SchedulerKind::Tcd
    }

    fn set_timesteps(&mut self, n: usize) -> Result<()> {
        let ts = distilled_timesteps(
            CLASS,
            self.num_train_timesteps,
            self.original_inference_steps,
            n,
        )?;
        self.steps.set(ts);
        Ok(())
    }

    fn timesteps(&self) -> &[f64] {
        &self.steps.timesteps
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
        if !(0.0..=1.0).contains(&self.eta) {
            return Err(SchedulerError::Unsupported {
                class: CLASS,
                message: format!("eta (gamma) must be in [0, 1], got {}", self.eta),
            });
        }
        let i = self.steps.index(CLASS, "step", timestep)?;
        let t = integer_timestep(CLASS, timestep)?;
        let last = i + 1 == self.steps.timesteps.len();
        let prev_t = if last {
            0
        } else {
            self.steps.timesteps[i + 1] as i64
        };
        // floor((1 - eta) * prev_t) on an int tensor: an f32 product in torch.
        let s = ((1.0 - self.eta) as f32 * prev_t as f32).floor() as i64;
        let a_t = self.schedule.alpha_at(CLASS, t)?;
        let a_prev = self.schedule.alpha_at(CLASS, prev_t)?;
        let a_s = self.schedule.alpha_at(CLASS, s)?;
        let b_s = (1.0 - a_s as f32) as f64;
        let [(xa, xb), (ea, eb)] = x0_eps_coefficients(self.prediction_type, a_t);
        let x0 = lincomb((sample.clone(), xa), [(model_output.clone(), xb)]);
        let eps = lincomb((sample, ea), [(model_output.clone(), eb)]);
        let noised = lincomb((x0, a_s.sqrt()), [(eps, b_s.sqrt())]);
        let prev = if self.eta > 0.0 && !last {
            let z = noise.randn(model_output.dims(), &model_output.device())?;
            let ratio = (a_prev as f32 / a_s as f32) as f64;
            let keep = (1.0 - ratio as f32) as f64;
            lincomb((noised, ratio.sqrt()), [(z, keep.sqrt())])
        } else {
            noised
        };
        self.steps.step_index = Some(i + 1);
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

    fn set_begin_index(&mut self, begin_index: usize) {
        self.steps.begin_index = Some(begin_index);
    }

    fn set_eta(&mut self, eta: f64) {
        self.eta = eta;
    }
}
