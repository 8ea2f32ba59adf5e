//! `EulerDiscreteScheduler`: Euler's method on the probability-flow ODE in sigma space
//! (k-diffusion's `sample_euler`), with optional Karras or exponential sigmas.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::config::{
    FinalSigmasType, InterpolationType, PredictionType, SchedulerConfig, TimestepSpacing,
    TimestepType,
};
use crate::error::Result;
use crate::noise::NoiseSource;
use crate::ops::scaled;
use crate::schedule::{
    check_steps, float_timesteps, numpy_interp, torch_linspace_f32, NoiseSchedule,
};
use crate::sigma_steps::{euler_coefficients, SigmaSteps};
use crate::sigmas::{exponential_or_beta_sigmas, karras_sigmas, sigma_to_t};
use crate::{Scheduler, SchedulerKind};

const CLASS: &str = "EulerDiscreteScheduler";

/// diffusers' `EulerDiscreteScheduler` (with `s_churn = 0`, as its pipelines call it).
pub struct EulerDiscreteScheduler {
    schedule: NoiseSchedule,
    num_train_timesteps: usize,
    prediction_type: PredictionType,
    timestep_spacing: TimestepSpacing,
    steps_offset: usize,
    interpolation_type: InterpolationType,
    use_karras_sigmas: bool,
    use_exponential_sigmas: bool,
    use_beta_sigmas: bool,
    sigma_min: Option<f64>,
    sigma_max: Option<f64>,
    timestep_type: TimestepType,
    final_sigmas_type: FinalSigmasType,
    steps: SigmaSteps,
}

impl EulerDiscreteScheduler {
    pub fn new(cfg: &SchedulerConfig) -> Result<Self> {
        crate::sigmas::check_sigma_options(cfg, CLASS, true)?;
        let mut schedule = NoiseSchedule::new(cfg, CLASS, cfg.rescale_betas_zero_snr)?;
        if cfg.rescale_betas_zero_snr {
            // diffusers keeps the last sigma finite: alpha_T = 2^-24, so sigma_max = 4096.
            let last = schedule.alphas_cumprod.len() - 1;
            schedule.alphas_cumprod[last] = 2f32.powi(-24);
        }
        let mut this = Self {
            schedule,
            num_train_timesteps: cfg.num_train_timesteps,
            prediction_type: cfg.prediction_type,
            timestep_spacing: cfg
                .timestep_spacing
                .unwrap_or(SchedulerKind::EulerDiscrete.default_timestep_spacing()),
            steps_offset: cfg.steps_offset,
            interpolation_type: cfg.interpolation_type,
            use_karras_sigmas: cfg.use_karras_sigmas,
            use_exponential_sigmas: cfg.use_exponential_sigmas,
            use_beta_sigmas: cfg.use_beta_sigmas,
            sigma_min: cfg.sigma_min,
            sigma_max: cfg.sigma_max,
            timestep_type: cfg.timestep_type,
            final_sigmas_type: cfg.final_sigmas_type,
            steps: SigmaSteps {
                class: CLASS,
                ..Default::default()
            },
        };
        // Before set_timesteps diffusers holds all training sigmas; only init_noise_sigma
        // is meaningful then.
        let mut sigmas = this.schedule.train_sigmas();
        sigmas.reverse();
        sigmas.push(0.0);
        this.steps
            .set(Vec::new(), sigmas, this.timestep_spacing, false);
        Ok(this)
    }

    /// The Karras or exponential sigmas for `n` steps between the config's (or the
    /// schedule's) sigma_min and sigma_max.
    fn special_sigmas(&self, in_sigmas: &[f64], n: usize) -> Vec<f64> {
        let sigma_min = self.sigma_min.unwrap_or(in_sigmas[in_sigmas.len() - 1]);
        let sigma_max = self.sigma_max.unwrap_or(in_sigmas[0]);
        if self.use_karras_sigmas {
            karras_sigmas(sigma_min, sigma_max, n)
        } else {
            exponential_or_beta_sigmas(self.use_beta_sigmas, sigma_min, sigma_max, n)
        }
    }
}

impl<B: Backend> Scheduler<B> for EulerDiscreteScheduler {
    fn kind(&self) -> SchedulerKind {
        SchedulerKind::EulerDiscrete
    }

    fn set_timesteps(&mut self, n: usize) -> Result<()> {
        check_steps(CLASS, n, self.num_train_timesteps)?;
        let mut timesteps = float_timesteps(
            self.timestep_spacing,
            self.num_train_timesteps,
            n,
            self.steps_offset,
        );
        let train = self.schedule.train_sigmas();
        let mut sigmas: Vec<f64> = match self.interpolation_type {
            InterpolationType::Linear => timesteps
                .iter()
                .map(|&t| numpy_interp(t as f64, &train))
                .collect(),
            // torch.linspace(ln sigma_max, ln sigma_min, n + 1).exp() in f32.
            InterpolationType::LogLinear => torch_linspace_f32(
                (train[train.len() - 1] as f64).ln() as f32 as f64,
                (train[0] as f64).ln() as f32 as f64,
                n + 1,
            )
            .iter()
            .map(|&l| (l as f64).exp() as f32 as f64)
            .collect(),
        };
        if self.use_karras_sigmas || self.use_exponential_sigmas || self.use_beta_sigmas {
            sigmas = self.special_sigmas(&sigmas, n);
            let log_sigmas = self.schedule.log_train_sigmas();
            timesteps = sigmas
                .iter()
                .map(|&s| sigma_to_t(s, &log_sigmas) as f32)
                .collect();
        }
        let last = match self.final_sigmas_type {
            FinalSigmasType::Zero => 0.0,
            FinalSigmasType::SigmaMin => train[0],
        };
        let mut sigmas: Vec<f32> = sigmas.iter().map(|&s| s as f32).collect();
        sigmas.push(last);
        if self.timestep_type == TimestepType::Continuous
            && self.prediction_type == PredictionType::VPrediction
        {
            timesteps = sigmas[..sigmas.len() - 1]
                .iter()
                .map(|&s| 0.25 * ((s as f64).ln() as f32))
                .collect();
        }
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
        _noise: &mut dyn NoiseSource<B>,
    ) -> Result<Tensor<B, 4>> {
        let i = self.steps.index("step", timestep)?;
        let sigma = self.steps.sigmas[i];
        // dt = sigmas[i + 1] - sigma is an f32 subtraction in diffusers.
        let dt = (self.steps.sigmas[i + 1] as f32 - sigma as f32) as f64;
        let (a, b) = euler_coefficients(self.prediction_type, sigma, dt);
        self.steps.step_index = Some(i + 1);
        Ok(scaled(sample, a) + model_output.mul_scalar(b))
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
