//! `HeunDiscreteScheduler`: Heun's second-order method on the probability-flow ODE in sigma
//! space (k-diffusion's `sample_heun`, Karras et al. 2022 algorithm 1); A1111's "Heun".
//!
//! Every step but the last takes two denoiser evaluations: an Euler step to the next sigma,
//! then a correction with the average of both derivatives. As in diffusers, `timesteps()`
//! lists each timestep but the first twice (`2n - 1` entries), the pipeline calls `step`
//! once per entry, and the scheduler alternates between the two stages. The last step
//! (to sigma 0) is a plain Euler step.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::config::{PredictionType, SchedulerConfig, TimestepSpacing};
use crate::error::Result;
use crate::noise::NoiseSource;
use crate::ops::lincomb;
use crate::schedule::{check_steps, NoiseSchedule};
use crate::sigma_steps::{derivative_coefficients, SigmaSteps};
use crate::sigmas::k_sigma_schedule;
use crate::{Scheduler, SchedulerKind};

const CLASS: &str = "HeunDiscreteScheduler";

/// The first stage's results, kept for the correction.
struct FirstStage<B: Backend> {
    derivative: Tensor<B, 4>,
    dt: f64,
    sample: Tensor<B, 4>,
}

/// diffusers' `HeunDiscreteScheduler`.
pub struct HeunDiscreteScheduler<B: Backend> {
    schedule: NoiseSchedule,
    num_train_timesteps: usize,
    prediction_type: PredictionType,
    timestep_spacing: TimestepSpacing,
    steps_offset: usize,
    use_karras_sigmas: bool,
    use_exponential_sigmas: bool,
    use_beta_sigmas: bool,
    clip_sample: bool,
    clip_sample_range: f64,
    steps: SigmaSteps,
    /// `Some` between the Euler stage and its correction.
    first: Option<FirstStage<B>>,
}

impl<B: Backend> HeunDiscreteScheduler<B> {
    pub fn new(cfg: &SchedulerConfig) -> Result<Self> {
        crate::sigmas::check_sigma_options(cfg, CLASS, false)?;
        let schedule = NoiseSchedule::new(cfg, CLASS, false)?;
        let timestep_spacing = cfg
            .timestep_spacing
            .unwrap_or(SchedulerKind::HeunDiscrete.default_timestep_spacing());
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
            use_karras_sigmas: cfg.use_karras_sigmas,
            use_exponential_sigmas: cfg.use_exponential_sigmas,
            use_beta_sigmas: cfg.use_beta_sigmas,
            clip_sample: cfg.clip_sample.unwrap_or(false),
            clip_sample_range: cfg.clip_sample_range,
            steps,
            first: None,
        })
    }

    /// `d = (x - x0) / sigma`, with `x0` clipped when `clip_sample` is set.
    fn derivative(&self, x: Tensor<B, 4>, model_output: Tensor<B, 4>, sigma: f64) -> Tensor<B, 4> {
        if self.clip_sample {
            let x0 = match self.prediction_type {
                PredictionType::Epsilon => lincomb((x.clone(), 1.0), [(model_output, -sigma)]),
                PredictionType::VPrediction => {
                    let s2 = sigma * sigma + 1.0;
                    lincomb((x.clone(), 1.0 / s2), [(model_output, -sigma / s2.sqrt())])
                }
                PredictionType::Sample => model_output,
            }
            .clamp(-self.clip_sample_range, self.clip_sample_range);
            return lincomb((x, 1.0 / sigma), [(x0, -1.0 / sigma)]);
        }
        let (a, b) = derivative_coefficients(self.prediction_type, sigma);
        lincomb((model_output, b), [(x, a)])
    }
}

impl<B: Backend> Scheduler<B> for HeunDiscreteScheduler<B> {
    fn kind(&self) -> SchedulerKind {
        SchedulerKind::HeunDiscrete
    }

    fn set_timesteps(&mut self, n: usize) -> Result<()> {
        check_steps(CLASS, n, self.num_train_timesteps)?;
        let (timesteps, sigmas) = k_sigma_schedule(
            &self.schedule,
            self.timestep_spacing,
            self.num_train_timesteps,
            n,
            self.steps_offset,
            self.use_karras_sigmas,
            (self.use_exponential_sigmas || self.use_beta_sigmas).then_some(self.use_beta_sigmas),
        );
        // [s0, s1, s1, .., s_{n-1}, s_{n-1}, 0] and [t0, t1, t1, .., t_{n-1}, t_{n-1}].
        let sigmas: Vec<f32> = sigmas.iter().map(|&s| s as f32).collect();
        let mut doubled_sigmas = vec![sigmas[0]];
        let mut doubled_timesteps = vec![timesteps[0]];
        for (&s, &t) in sigmas.iter().zip(&timesteps).skip(1) {
            doubled_sigmas.extend([s, s]);
            doubled_timesteps.extend([t, t]);
        }
        doubled_sigmas.push(0.0);
        self.steps.set(
            doubled_timesteps,
            doubled_sigmas,
            self.timestep_spacing,
            true,
        );
        self.first = None;
        Ok(())
    }

    fn timesteps(&self) -> &[f64] {
        &self.steps.timesteps
    }

    fn init_noise_sigma(&self) -> f64 {
        self.steps.init_noise_sigma
    }

    /// Two evaluations per step (diffusers' `order = 2`); `timesteps()` already lists both.
    fn order(&self) -> usize {
        2
    }

    fn scale_model_input(&self, sample: Tensor<B, 4>, timestep: f64) -> Result<Tensor<B, 4>> {
        self.steps.scale_model_input(sample, timestep)
    }

    fn step(
        &mut self,
        model_output: Tensor<B, 4>,
        timestep: f64,
        sample: Tensor<B, 4>,
        _noise: &mut dyn NoiseSource<B>,
    ) -> Result<Tensor<B, 4>> {
        let i = self.steps.index("step", timestep)?;
        let prev = match self.first.take() {
            None => {
                let (sigma, sigma_next) = (self.steps.sigmas[i], self.steps.sigmas[i + 1]);
                let derivative = self.derivative(sample.clone(), model_output, sigma);
                // An f32 subtraction in diffusers.
                let dt = (sigma_next as f32 - sigma as f32) as f64;
                let prev = lincomb((sample.clone(), 1.0), [(derivative.clone(), dt)]);
                self.first = Some(FirstStage {
                    derivative,
                    dt,
                    sample,
                });
                prev
            }
            Some(first) => {
                // The correction evaluates at the sigma the Euler stage reached.
                let sigma_next = self.steps.sigmas[i];
                let derivative = self.derivative(sample, model_output, sigma_next);
                let half = 0.5 * first.dt;
                lincomb(
                    (first.sample, 1.0),
                    [(first.derivative, half), (derivative, half)],
                )
            }
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
        self.steps.add_noise(original, noise, timesteps)
    }

    fn sigmas(&self) -> Option<&[f64]> {
        self.steps.initialized.then_some(&self.steps.sigmas[..])
    }

    fn set_begin_index(&mut self, begin_index: usize) {
        self.steps.begin_index = Some(begin_index);
    }
}
