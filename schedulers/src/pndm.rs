//! `PNDMScheduler`: pseudo numerical methods (PLMS), Stable Diffusion 1.x's default.
//!
//! With `skip_prk_steps` (all SD configs) it is plain PLMS: a second-order start, then up to
//! fourth-order linear multistep on the stored model outputs. Without it, twelve
//! Runge-Kutta (PRK) evaluations over the last four timesteps come first.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::config::{PredictionType, SchedulerConfig, TimestepSpacing};
use crate::error::{Result, SchedulerError};
use crate::noise::NoiseSource;
use crate::schedule::{check_steps, integer_timestep, integer_timesteps, NoiseSchedule};
use crate::{Scheduler, SchedulerKind};

const CLASS: &str = "PNDMScheduler";

/// diffusers' `PNDMScheduler`.
pub struct PndmScheduler<B: Backend> {
    schedule: NoiseSchedule,
    final_alpha_cumprod: f64,
    num_train_timesteps: usize,
    prediction_type: PredictionType,
    timestep_spacing: TimestepSpacing,
    steps_offset: usize,
    skip_prk_steps: bool,
    num_inference_steps: Option<usize>,
    prk_timesteps: Vec<i64>,
    timesteps: Vec<f64>,
    /// Step state: the number of `step` calls so far, the stored model outputs (at most four),
    /// the PRK running sum and the sample a multi-evaluation step started from.
    counter: usize,
    ets: Vec<Tensor<B, 4>>,
    cur_model_output: Option<Tensor<B, 4>>,
    cur_sample: Option<Tensor<B, 4>>,
}

impl<B: Backend> PndmScheduler<B> {
    pub fn new(cfg: &SchedulerConfig) -> Result<Self> {
        if cfg.prediction_type == PredictionType::Sample {
            return Err(SchedulerError::Unsupported {
                class: CLASS,
                message: "prediction_type `sample` is not supported; use epsilon or v_prediction"
                    .into(),
            });
        }
        let schedule = NoiseSchedule::new(cfg, CLASS, false)?;
        let final_alpha_cumprod = if cfg.set_alpha_to_one.unwrap_or(false) {
            1.0
        } else {
            schedule.alphas_cumprod[0] as f64
        };
        Ok(Self {
            schedule,
            final_alpha_cumprod,
            num_train_timesteps: cfg.num_train_timesteps,
            prediction_type: cfg.prediction_type,
            timestep_spacing: cfg
                .timestep_spacing
                .unwrap_or(SchedulerKind::Pndm.default_timestep_spacing()),
            steps_offset: cfg.steps_offset,
            skip_prk_steps: cfg.skip_prk_steps.unwrap_or(false),
            num_inference_steps: None,
            prk_timesteps: Vec::new(),
            timesteps: Vec::new(),
            counter: 0,
            ets: Vec::new(),
            cur_model_output: None,
            cur_sample: None,
        })
    }

    /// `x_{t-δ}` from `x_t` by formula (9) of the PNDM paper.
    fn prev_sample(
        &self,
        sample: Tensor<B, 4>,
        timestep: i64,
        prev_timestep: i64,
        model_output: Tensor<B, 4>,
    ) -> Result<Tensor<B, 4>> {
        let a_t = self.schedule.alpha_at(CLASS, timestep)?;
        let a_prev = if prev_timestep >= 0 {
            self.schedule.alpha_at(CLASS, prev_timestep)?
        } else {
            self.final_alpha_cumprod
        };
        let (b_t, b_prev) = (1.0 - a_t, 1.0 - a_prev);
        let sample_coeff = (a_prev / a_t).sqrt();
        let denom = a_t * b_prev.sqrt() + (a_t * b_t * a_prev).sqrt();
        let c = (a_prev - a_t) / denom;
        // prev = sample_coeff * x - c * eps; with v-prediction eps = sqrt(a) v + sqrt(b) x.
        Ok(match self.prediction_type {
            PredictionType::VPrediction => {
                sample.mul_scalar(sample_coeff - c * b_t.sqrt())
                    - model_output.mul_scalar(c * a_t.sqrt())
            }
            _ => sample.mul_scalar(sample_coeff) - model_output.mul_scalar(c),
        })
    }

    fn step_prk(
        &mut self,
        model_output: Tensor<B, 4>,
        timestep: i64,
        sample: Tensor<B, 4>,
        n: usize,
    ) -> Result<Tensor<B, 4>> {
        let half = (self.num_train_timesteps / n / 2) as i64;
        let prev_timestep = timestep - if self.counter % 2 == 1 { 0 } else { half };
        let timestep = self.prk_timesteps[self.counter / 4 * 4];
        let model_output = match self.counter % 4 {
            0 => {
                self.cur_model_output = Some(model_output.clone().mul_scalar(1.0 / 6.0));
                self.ets.push(model_output.clone());
                self.cur_sample = Some(sample.clone());
                model_output
            }
            1 | 2 => {
                let third = model_output.clone().mul_scalar(1.0 / 3.0);
                self.cur_model_output = Some(match self.cur_model_output.take() {
                    Some(acc) => acc + third,
                    None => third,
                });
                model_output
            }
            _ => {
                let sixth = model_output.mul_scalar(1.0 / 6.0);
                match self.cur_model_output.take() {
                    Some(acc) => acc + sixth,
                    None => sixth,
                }
            }
        };
        let cur_sample = self.cur_sample.clone().unwrap_or(sample);
        let prev = self.prev_sample(cur_sample, timestep, prev_timestep, model_output)?;
        self.counter += 1;
        Ok(prev)
    }

    fn step_plms(
        &mut self,
        model_output: Tensor<B, 4>,
        timestep: i64,
        sample: Tensor<B, 4>,
        n: usize,
    ) -> Result<Tensor<B, 4>> {
        if !self.skip_prk_steps && self.ets.len() < 3 {
            return Err(SchedulerError::Unsupported {
                class: CLASS,
                message: "PLMS steps need the 12 PRK warm-up steps first".into(),
            });
        }
        let ratio = (self.num_train_timesteps / n) as i64;
        let (mut timestep, mut prev_timestep) = (timestep, timestep - ratio);
        if self.counter != 1 {
            if self.ets.len() > 3 {
                self.ets.drain(..self.ets.len() - 3);
            }
            self.ets.push(model_output.clone());
        } else {
            prev_timestep = timestep;
            timestep += ratio;
        }
        let e = &self.ets;
        let k = e.len();
        let (sample, model_output) = match (k, self.counter) {
            (1, 0) => {
                self.cur_sample = Some(sample.clone());
                (sample, model_output)
            }
            (1, 1) => {
                let start = self.cur_sample.take().unwrap_or(sample);
                (start, (model_output + e[0].clone()).mul_scalar(0.5))
            }
            (2, _) => (
                sample,
                e[1].clone().mul_scalar(1.5) - e[0].clone().mul_scalar(0.5),
            ),
            (3, _) => (
                sample,
                e[2].clone().mul_scalar(23.0 / 12.0) - e[1].clone().mul_scalar(16.0 / 12.0)
                    + e[0].clone().mul_scalar(5.0 / 12.0),
            ),
            _ => (
                sample,
                e[k - 1].clone().mul_scalar(55.0 / 24.0) - e[k - 2].clone().mul_scalar(59.0 / 24.0)
                    + e[k - 3].clone().mul_scalar(37.0 / 24.0)
                    - e[k - 4].clone().mul_scalar(9.0 / 24.0),
            ),
        };
        let prev = self.prev_sample(sample, timestep, prev_timestep, model_output)?;
        self.counter += 1;
        Ok(prev)
    }
}

impl<B: Backend> Scheduler<B> for PndmScheduler<B> {
    fn kind(&self) -> SchedulerKind {
        SchedulerKind::Pndm
    }

    fn set_timesteps(&mut self, n: usize) -> Result<()> {
        check_steps(CLASS, n, self.num_train_timesteps)?;
        if !self.skip_prk_steps && n < 4 {
            return Err(SchedulerError::InvalidSteps {
                class: CLASS,
                got: n,
                reason: "the PRK warm-up (skip_prk_steps = false) needs at least 4 steps".into(),
            });
        }
        // diffusers' `_timesteps`, lowest first.
        let mut base = integer_timesteps(
            self.timestep_spacing,
            self.num_train_timesteps,
            n,
            self.steps_offset,
        );
        base.reverse();
        let len = base.len();
        let (prk, plms): (Vec<i64>, Vec<i64>) = if self.skip_prk_steps {
            // concat(_t[:-1], _t[-2:-1], _t[-1:]) reversed: the second timestep is taken twice.
            let mut plms = base[..len - 1].to_vec();
            plms.extend_from_slice(&base[len.saturating_sub(2)..len - 1]);
            plms.push(base[len - 1]);
            plms.reverse();
            (Vec::new(), plms)
        } else {
            // The last four timesteps, each with its half-step: t, t + h; the 12 RK
            // evaluations walk these pairs from the top (t+h twice per Runge-Kutta step).
            let half = (self.num_train_timesteps / n / 2) as i64;
            let pairs: Vec<i64> = base[len - 4..]
                .iter()
                .flat_map(|&t| [t, t + half])
                .collect();
            let doubled: Vec<i64> = pairs[..7].iter().flat_map(|&t| [t, t]).collect();
            let mut prk = doubled[1..13].to_vec();
            prk.reverse();
            let mut plms = base[..len - 3].to_vec();
            plms.reverse();
            (prk, plms)
        };
        self.timesteps = prk.iter().chain(&plms).map(|&t| t as f64).collect();
        self.prk_timesteps = prk;
        self.num_inference_steps = Some(n);
        self.counter = 0;
        self.ets.clear();
        self.cur_model_output = None;
        self.cur_sample = None;
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
        _noise: &mut dyn NoiseSource<B>,
    ) -> Result<Tensor<B, 4>> {
        let n = self
            .num_inference_steps
            .ok_or(SchedulerError::NotInitialized {
                class: CLASS,
                op: "step",
            })?;
        if self.counter >= self.timesteps.len() {
            return Err(SchedulerError::ScheduleExhausted {
                class: CLASS,
                steps: self.timesteps.len(),
            });
        }
        let t = integer_timestep(CLASS, timestep)?;
        if self.counter < self.prk_timesteps.len() && !self.skip_prk_steps {
            self.step_prk(model_output, t, sample, n)
        } else {
            self.step_plms(model_output, t, sample, n)
        }
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
