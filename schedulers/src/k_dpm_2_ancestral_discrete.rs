//! `KDPM2AncestralDiscreteScheduler`: k-diffusion's `sample_dpm_2_ancestral` (A1111's
//! "DPM2 a").
//!
//! Like `KDPM2DiscreteScheduler`, two evaluations per step, but the step lands on
//! `sigma_down` and adds fresh noise of standard deviation `sigma_up`
//! (`sigma_down^2 + sigma_up^2 = sigma_next^2`, as Euler ancestral); the midpoint is
//! between `sigma` and `sigma_down`. The noise is drawn in the second stage of each step but
//! the last (a plain Euler step to sigma 0).

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::config::SchedulerConfig;
use crate::error::Result;
use crate::k_dpm_2_discrete::{doubled, log_midpoint, scale_by_sigma, Kdpm2Options};
use crate::noise::NoiseSource;
use crate::ops::lincomb;
use crate::schedule::{check_steps, NoiseSchedule};
use crate::sigma_steps::SigmaSteps;
use crate::{Scheduler, SchedulerKind};

const CLASS: &str = "KDPM2AncestralDiscreteScheduler";

/// diffusers' `KDPM2AncestralDiscreteScheduler`.
pub struct KDpm2AncestralDiscreteScheduler<B: Backend> {
    schedule: NoiseSchedule,
    options: Kdpm2Options,
    steps: SigmaSteps,
    /// Doubled like `steps.sigmas` (2n + 2 entries).
    sigmas_interpol: Vec<f64>,
    sigmas_up: Vec<f64>,
    sigmas_down: Vec<f64>,
    first: Option<Tensor<B, 4>>,
}

impl<B: Backend> KDpm2AncestralDiscreteScheduler<B> {
    pub fn new(cfg: &SchedulerConfig) -> Result<Self> {
        let options = Kdpm2Options::new(cfg, CLASS, SchedulerKind::KDpm2AncestralDiscrete)?;
        let schedule = NoiseSchedule::new(cfg, CLASS, false)?;
        let mut steps = SigmaSteps {
            class: CLASS,
            ..Default::default()
        };
        let mut sigmas = schedule.train_sigmas();
        sigmas.reverse();
        sigmas.push(0.0);
        steps.set(Vec::new(), sigmas, options.timestep_spacing, false);
        Ok(Self {
            schedule,
            options,
            steps,
            sigmas_interpol: Vec::new(),
            sigmas_up: Vec::new(),
            sigmas_down: Vec::new(),
            first: None,
        })
    }

    fn index(&self, op: &'static str, t: f64) -> Result<usize> {
        self.steps.index_within_timesteps(op, t)
    }
}

impl<B: Backend> Scheduler<B> for KDpm2AncestralDiscreteScheduler<B> {
    fn kind(&self) -> SchedulerKind {
        SchedulerKind::KDpm2AncestralDiscrete
    }

    fn set_timesteps(&mut self, n: usize) -> Result<()> {
        check_steps(CLASS, n, self.options.num_train_timesteps)?;
        let (timesteps, sigmas) = self.options.base_schedule(&self.schedule, n);
        let len = sigmas.len();
        // All in f32 as diffusers' tensors; the last entries are 0 by construction.
        let mut up = vec![0.0f32; len];
        let mut down = vec![0.0f32; len];
        let mut interpol = vec![0.0f32; len];
        for k in 0..len - 1 {
            let (s2, n2) = (sigmas[k] * sigmas[k], sigmas[k + 1] * sigmas[k + 1]);
            up[k] = (n2 * (s2 - n2) / s2).sqrt();
            down[k] = (n2 - up[k] * up[k]).sqrt();
        }
        // exp(lerp(ln s, ln sigma_down, 1/2)); diffusers zeroes the last two.
        for k in 0..len.saturating_sub(2) {
            interpol[k] = log_midpoint(sigmas[k], down[k]);
        }
        let all = self.options.interleaved_timesteps(
            &timesteps,
            &interpol,
            &self.schedule.log_train_sigmas(),
        );
        let wide = |x: &[f32]| doubled(x).into_iter().map(f64::from).collect::<Vec<_>>();
        self.sigmas_interpol = wide(&interpol);
        self.sigmas_up = wide(&up);
        self.sigmas_down = wide(&down);
        self.steps.set(
            Vec::new(),
            doubled(&sigmas),
            self.options.timestep_spacing,
            true,
        );
        self.steps.timesteps = all;
        self.first = None;
        Ok(())
    }

    fn timesteps(&self) -> &[f64] {
        &self.steps.timesteps
    }

    fn init_noise_sigma(&self) -> f64 {
        self.steps.init_noise_sigma
    }

    fn order(&self) -> usize {
        2
    }

    fn scale_model_input(&self, sample: Tensor<B, 4>, timestep: f64) -> Result<Tensor<B, 4>> {
        let i = self.index("scale_model_input", timestep)?;
        let sigma = match self.first {
            None => self.steps.sigmas[i],
            Some(_) => self.sigmas_interpol[i - 1],
        };
        Ok(scale_by_sigma(sample, sigma))
    }

    fn step(
        &mut self,
        model_output: Tensor<B, 4>,
        timestep: f64,
        sample: Tensor<B, 4>,
        noise: &mut dyn NoiseSource<B>,
    ) -> Result<Tensor<B, 4>> {
        let i = self.index("step", timestep)?;
        let o = &self.options;
        let prev = match self.first.take() {
            None => {
                let sigma = self.steps.sigmas[i];
                let sigma_mid = self.sigmas_interpol[i];
                let d = o.derivative(sample.clone(), model_output, sigma, sigma);
                let dt = (sigma_mid as f32 - sigma as f32) as f64;
                self.first = Some(sample.clone());
                lincomb((sample, 1.0), [(d, dt)])
            }
            Some(start) => {
                let sigma = self.steps.sigmas[i - 1];
                let sigma_mid = self.sigmas_interpol[i - 1];
                let (up, down) = (self.sigmas_up[i - 1], self.sigmas_down[i - 1]);
                let d = o.derivative(sample, model_output.clone(), sigma_mid, sigma_mid);
                let dt = (down as f32 - sigma as f32) as f64;
                let z = noise.randn(model_output.dims(), &model_output.device())?;
                lincomb((start, 1.0), [(d, dt)]) + z.mul_scalar(up)
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
