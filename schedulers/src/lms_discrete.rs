//! `LMSDiscreteScheduler`: k-diffusion's `sample_lms`, a linear multistep method (up to
//! fourth order) on the probability-flow ODE in sigma space; A1111's "LMS".
//!
//! The step integrates the Lagrange polynomial through the last derivatives
//! `d = (x - x0) / sigma` from `sigma_i` to `sigma_{i+1}`. diffusers integrates each basis
//! polynomial numerically (`scipy.integrate.quad`, with the integrand in f32); here the
//! integral of the polynomial is computed exactly, in closed form, in f64.

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

const CLASS: &str = "LMSDiscreteScheduler";

/// The order diffusers' pipelines use (`step`'s default `order=4`).
const MAX_ORDER: usize = 4;

/// diffusers' `LMSDiscreteScheduler`.
pub struct LmsDiscreteScheduler<B: Backend> {
    schedule: NoiseSchedule,
    num_train_timesteps: usize,
    prediction_type: PredictionType,
    timestep_spacing: TimestepSpacing,
    steps_offset: usize,
    use_karras_sigmas: bool,
    use_exponential_sigmas: bool,
    use_beta_sigmas: bool,
    steps: SigmaSteps,
    /// The derivatives of the last steps, oldest first (at most `MAX_ORDER`).
    derivatives: Vec<Tensor<B, 4>>,
}

/// `∫_{sigmas[i]}^{sigmas[i+1]} L_j(tau) dtau` for the Lagrange basis polynomial `L_j` on the
/// nodes `sigmas[i], sigmas[i-1], .., sigmas[i-order+1]` that is 1 at `sigmas[i - j]`:
/// diffusers' `get_lms_coefficient(order, i, j)`, exactly. The polynomial is expanded in
/// `u = tau - sigmas[i]` (so the powers stay small) and integrated term by term.
pub(crate) fn lms_coefficient(sigmas: &[f64], order: usize, i: usize, j: usize) -> f64 {
    let a = sigmas[i];
    let h = sigmas[i + 1] - a;
    // Coefficients of prod_{k != j} (u + a - s_k), lowest power first.
    let mut poly = vec![1.0];
    let mut denom = 1.0;
    for k in (0..order).filter(|&k| k != j) {
        let c = a - sigmas[i - k];
        let mut next = vec![0.0; poly.len() + 1];
        for (m, &p) in poly.iter().enumerate() {
            next[m] += p * c;
            next[m + 1] += p;
        }
        poly = next;
        denom *= sigmas[i - j] - sigmas[i - k];
    }
    let integral: f64 = poly
        .iter()
        .enumerate()
        .map(|(m, &p)| p * h.powi(m as i32 + 1) / (m as f64 + 1.0))
        .sum();
    integral / denom
}

impl<B: Backend> LmsDiscreteScheduler<B> {
    pub fn new(cfg: &SchedulerConfig) -> Result<Self> {
        crate::sigmas::check_sigma_options(cfg, CLASS, false)?;
        let schedule = NoiseSchedule::new(cfg, CLASS, false)?;
        let timestep_spacing = cfg
            .timestep_spacing
            .unwrap_or(SchedulerKind::LmsDiscrete.default_timestep_spacing());
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
            steps,
            derivatives: Vec::new(),
        })
    }
}

impl<B: Backend> Scheduler<B> for LmsDiscreteScheduler<B> {
    fn kind(&self) -> SchedulerKind {
        SchedulerKind::LmsDiscrete
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
        let mut sigmas: Vec<f32> = sigmas.iter().map(|&s| s as f32).collect();
        sigmas.push(0.0);
        self.steps
            .set(timesteps, sigmas, self.timestep_spacing, true);
        self.derivatives.clear();
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
        _noise: &mut dyn NoiseSource<B>,
    ) -> Result<Tensor<B, 4>> {
        let i = self.steps.index("step", timestep)?;
        let sigma = self.steps.sigmas[i];
        let (a, b) = derivative_coefficients(self.prediction_type, sigma);
        let derivative = if a == 0.0 {
            model_output.mul_scalar(b)
        } else {
            lincomb((sample.clone(), a), [(model_output, b)])
        };
        if self.derivatives.len() == MAX_ORDER {
            self.derivatives.remove(0);
        }
        self.derivatives.push(derivative);
        let order = (i + 1).min(MAX_ORDER);
        let terms: Vec<(Tensor<B, 4>, f64)> = self
            .derivatives
            .iter()
            .rev()
            .take(order)
            .enumerate()
            .map(|(j, d)| (d.clone(), lms_coefficient(&self.steps.sigmas, order, i, j)))
            .collect();
        self.steps.step_index = Some(i + 1);
        Ok(lincomb((sample, 1.0), terms))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Our closed-form coefficients against diffusers' (`scipy.integrate.quad` of an f32
    /// integrand) and against the same quadrature run in f64, for every step of every LMS
    /// golden case.
    #[test]
    fn lms_coefficients_match_scipy_quad() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/golden/");
        let meta: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(format!("{dir}schedulers.json")).unwrap(),
        )
        .unwrap();
        let mut seen = 0;
        for (name, case) in meta["cases"].as_object().unwrap() {
            let Some(steps) = case["lms_coefficients"].as_array() else {
                continue;
            };
            let sigmas: Vec<f64> = case["sigmas"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
                .collect();
            let (mut worst_f32, mut worst_f64) = (0f64, 0f64);
            for (i, step) in steps.iter().enumerate() {
                let order = step["diffusers"].as_array().unwrap().len();
                let scale = (sigmas[i + 1] - sigmas[i]).abs();
                for j in 0..order {
                    let ours = lms_coefficient(&sigmas, order, i, j);
                    let f32_quad = step["diffusers"][j].as_f64().unwrap();
                    let f64_quad = step["f64"][j].as_f64().unwrap();
                    worst_f32 = worst_f32.max((ours - f32_quad).abs() / scale);
                    worst_f64 = worst_f64.max((ours - f64_quad).abs() / scale);
                }
            }
            println!("{name}: vs diffusers {worst_f32:.1e}, vs f64 quad {worst_f64:.1e} (of the step's sigma change)");
            // quad is exact for these cubics up to rounding: the f64 run agrees to rounding;
            // diffusers' integrand is evaluated in f32 (sigmas are f32 tensors).
            assert!(
                worst_f64 <= 1e-12,
                "{name}: {worst_f64:e} from the f64 quadrature"
            );
            assert!(
                worst_f32 <= 1e-5,
                "{name}: {worst_f32:e} from diffusers' coefficients"
            );
            seen += 1;
        }
        assert!(seen >= 2);
    }
}
