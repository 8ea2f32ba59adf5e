//! `FlowMatchHeunDiscreteScheduler`: Heun's second-order method on the rectified-flow ODE.
//!
//! As with `HeunDiscreteScheduler`, `timesteps()` lists every timestep but the first twice
//! (`2n - 1` entries) and `step` alternates between an Euler stage and its correction with
//! the average velocity; the last step (to sigma 0) is a plain Euler step. Only the static
//! `shift` of the flow-matching family is a config option here (diffusers has no dynamic
//! shifting, custom sigmas or sigma variants for this class, and ignores those fields).

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::config::SchedulerConfig;
use crate::error::{Result, SchedulerError};
use crate::flow_match_euler::{scale_noise, FlowSchedule};
use crate::noise::NoiseSource;
use crate::ops::lincomb;
use crate::sigma_steps::SigmaSteps;
use crate::{Scheduler, SchedulerKind};

const CLASS: &str = "FlowMatchHeunDiscreteScheduler";

/// The Euler stage's results, kept for the correction.
struct FirstStage<B: Backend> {
    velocity: Tensor<B, 4>,
    dt: f64,
    sample: Tensor<B, 4>,
}

/// diffusers' `FlowMatchHeunDiscreteScheduler` (with `s_churn = 0`).
pub struct FlowMatchHeunDiscreteScheduler<B: Backend> {
    schedule: FlowSchedule,
    steps: SigmaSteps,
    first: Option<FirstStage<B>>,
}

impl<B: Backend> FlowMatchHeunDiscreteScheduler<B> {
    /// Reads `num_train_timesteps` and `shift`; like diffusers' `from_config`, the other
    /// flow-matching fields (dynamic shifting, sigma variants) are ignored: this class has
    /// none of them.
    pub fn new(cfg: &SchedulerConfig) -> Result<Self> {
        Ok(Self {
            schedule: FlowSchedule::new(
                CLASS,
                cfg.num_train_timesteps,
                cfg.shift.unwrap_or(1.0),
                false,
            )?,
            steps: SigmaSteps {
                class: CLASS,
                ..Default::default()
            },
            first: None,
        })
    }
}

/// diffusers' derivative `(x - (x - s v)) / s`: the velocity `v`, with diffusers' f32
/// rounding (it is what the Heun average is formed from).
fn velocity<B: Backend>(x: Tensor<B, 4>, v: Tensor<B, 4>, sigma: f64) -> Tensor<B, 4> {
    let denoised = lincomb((x.clone(), 1.0), [(v, -sigma)]);
    (x - denoised).div_scalar(sigma)
}

impl<B: Backend> Scheduler<B> for FlowMatchHeunDiscreteScheduler<B> {
    fn kind(&self) -> SchedulerKind {
        SchedulerKind::FlowMatchHeunDiscrete
    }

    fn set_timesteps(&mut self, n: usize) -> Result<()> {
        if n == 0 {
            return Err(SchedulerError::InvalidSteps {
                class: CLASS,
                got: n,
                reason: "it must be at least 1".into(),
            });
        }
        let base = self.schedule.base_sigmas(n);
        let sigmas: Vec<f32> = self
            .schedule
            .shifted(&base)
            .iter()
            .map(|&s| s as f32)
            .collect();
        let nt = self.schedule.num_train_timesteps as f32;
        // [t0, t1, t1, .., t_{n-1}, t_{n-1}] and [s0, s1, s1, .., s_{n-1}, s_{n-1}, 0].
        let mut timesteps = vec![sigmas[0] * nt];
        let mut doubled = vec![sigmas[0]];
        for &s in &sigmas[1..] {
            timesteps.extend([s * nt, s * nt]);
            doubled.extend([s, s]);
        }
        doubled.push(0.0);
        self.steps.set(
            timesteps,
            doubled,
            crate::config::TimestepSpacing::Linspace,
            true,
        );
        self.first = None;
        Ok(())
    }

    fn timesteps(&self) -> &[f64] {
        &self.steps.timesteps
    }

    fn init_noise_sigma(&self) -> f64 {
        1.0
    }

    /// Two evaluations per step (diffusers' `order = 2`); `timesteps()` already lists both.
    fn order(&self) -> usize {
        2
    }

    /// The identity, as for every flow-matching scheduler.
    fn scale_model_input(&self, sample: Tensor<B, 4>, timestep: f64) -> Result<Tensor<B, 4>> {
        self.steps.index("scale_model_input", timestep)?;
        Ok(sample)
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
                let velocity = velocity(sample.clone(), model_output, sigma);
                // dt is an f32 subtraction in diffusers.
                let dt = (sigma_next as f32 - sigma as f32) as f64;
                let prev = lincomb((sample.clone(), 1.0), [(velocity.clone(), dt)]);
                self.first = Some(FirstStage {
                    velocity,
                    dt,
                    sample,
                });
                prev
            }
            Some(first) => {
                // The correction evaluates at the sigma the Euler stage reached.
                let v = velocity(sample, model_output, self.steps.sigmas[i]);
                let mean = (first.velocity + v).mul_scalar(0.5);
                lincomb((first.sample, 1.0), [(mean, first.dt)])
            }
        };
        self.steps.step_index = Some(i + 1);
        Ok(prev)
    }

    /// diffusers' `scale_noise`: `s noise + (1 - s) x0`.
    fn add_noise(
        &self,
        original: Tensor<B, 4>,
        noise: Tensor<B, 4>,
        timesteps: &[f64],
    ) -> Result<Tensor<B, 4>> {
        scale_noise(&self.steps, original, noise, timesteps)
    }

    fn sigmas(&self) -> Option<&[f64]> {
        self.steps.initialized.then_some(&self.steps.sigmas[..])
    }

    fn set_begin_index(&mut self, begin_index: usize) {
        self.steps.begin_index = Some(begin_index);
    }
}
