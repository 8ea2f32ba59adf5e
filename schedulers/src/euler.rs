//! `EulerDiscreteScheduler`: Euler's method on the probability-flow ODE in sigma space
//! (k-diffusion's `sample_euler`), with optional Karras or exponential sigmas.
//!
//! Also home of [`SigmaSteps`], the sigma table and step counter that the Euler ancestral
//! scheduler shares.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::config::{
    FinalSigmasType, InterpolationType, PredictionType, SchedulerConfig, TimestepSpacing,
    TimestepType,
};
use crate::error::{Result, SchedulerError};
use crate::noise::NoiseSource;
use crate::ops::{check_add_noise, scale_per_item, scaled};
use crate::schedule::{
    check_steps, exponential_or_beta_sigmas, float_timesteps, karras_sigmas, numpy_interp,
    sigma_to_t, torch_linspace_f32, NoiseSchedule,
};
use crate::{Scheduler, SchedulerKind};

const CLASS: &str = "EulerDiscreteScheduler";

/// Timesteps, sigmas and the step position of a sigma-based scheduler (diffusers'
/// `timesteps`, `sigmas`, `_step_index`, `_begin_index`). Values are f32 like diffusers'
/// tensors, stored as f64.
#[derive(Clone, Debug, Default)]
pub(crate) struct SigmaSteps {
    pub class: &'static str,
    pub timesteps: Vec<f64>,
    /// One more than `timesteps`: the last is the sigma the final step lands on.
    pub sigmas: Vec<f64>,
    pub init_noise_sigma: f64,
    pub initialized: bool,
    pub step_index: Option<usize>,
    pub begin_index: Option<usize>,
}

impl SigmaSteps {
    /// Installs a new schedule; `init_noise_sigma` is `max(sigma)` for linspace and trailing
    /// spacing and `sqrt(max(sigma)^2 + 1)` for leading, in f32 like diffusers.
    pub fn set(
        &mut self,
        timesteps: Vec<f32>,
        sigmas: Vec<f32>,
        spacing: TimestepSpacing,
        initialized: bool,
    ) {
        let max = sigmas.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        self.init_noise_sigma = match spacing {
            TimestepSpacing::Leading => (max * max + 1.0).sqrt() as f64,
            _ => max as f64,
        };
        self.timesteps = timesteps.into_iter().map(f64::from).collect();
        self.sigmas = sigmas.into_iter().map(f64::from).collect();
        self.initialized = initialized;
        self.step_index = None;
        self.begin_index = None;
    }

    /// diffusers' `index_for_timestep`: the first position of `t` in the schedule, or the
    /// second when it occurs twice (so img2img that starts mid-schedule skips no sigma).
    fn index_for_timestep(&self, t: f64) -> Result<usize> {
        let mut hits = self
            .timesteps
            .iter()
            .enumerate()
            .filter(|(_, &s)| s == t)
            .map(|(i, _)| i);
        let first = hits.next();
        let second = hits.next();
        second.or(first).ok_or_else(|| SchedulerError::BadTimestep {
            class: self.class,
            timestep: t,
            reason: "is not in the schedule; pass a value from timesteps()".into(),
        })
    }

    /// [`index`](Self::index), also checked against the number of timesteps: the
    /// two-evaluation schedulers (KDPM2, KDPM2 ancestral) list each sigma twice.
    pub(crate) fn index_within_timesteps(&self, op: &'static str, t: f64) -> Result<usize> {
        let i = self.index(op, t)?;
        if i >= self.timesteps.len() {
            return Err(SchedulerError::ScheduleExhausted {
                class: self.class,
                steps: self.timesteps.len(),
            });
        }
        Ok(i)
    }

    /// The step index in force for `t`: the running index, else `begin_index`, else looked up.
    pub fn index(&self, op: &'static str, t: f64) -> Result<usize> {
        if !self.initialized {
            return Err(SchedulerError::NotInitialized {
                class: self.class,
                op,
            });
        }
        let i = match (self.step_index, self.begin_index) {
            (Some(i), _) | (None, Some(i)) => i,
            (None, None) => self.index_for_timestep(t)?,
        };
        if i + 1 >= self.sigmas.len() {
            return Err(SchedulerError::ScheduleExhausted {
                class: self.class,
                steps: self.timesteps.len(),
            });
        }
        Ok(i)
    }

    /// `sample / sqrt(sigma^2 + 1)`, the denominator in f32 like diffusers.
    pub fn scale_model_input<B: Backend>(
        &self,
        sample: Tensor<B, 4>,
        t: f64,
    ) -> Result<Tensor<B, 4>> {
        let sigma = self.sigmas[self.index("scale_model_input", t)?] as f32;
        Ok(sample.div_scalar((sigma * sigma + 1.0).sqrt()))
    }

    /// `original + noise * sigma(t)`, with diffusers' choice of step index.
    pub fn add_noise<B: Backend>(
        &self,
        original: Tensor<B, 4>,
        noise: Tensor<B, 4>,
        timesteps: &[f64],
    ) -> Result<Tensor<B, 4>> {
        check_add_noise(self.class, &original, &noise, timesteps)?;
        let sigmas = self.sigmas_for_add_noise(timesteps)?;
        Ok(original + scale_per_item(noise, &sigmas))
    }

    /// The sigma `add_noise` uses for each timestep: looked up by value before the first
    /// step, else the current step's (or `begin_index`'s), as diffusers does.
    pub fn sigmas_for_add_noise(&self, timesteps: &[f64]) -> Result<Vec<f64>> {
        if !self.initialized {
            return Err(SchedulerError::NotInitialized {
                class: self.class,
                op: "add_noise",
            });
        }
        timesteps
            .iter()
            .map(|&t| {
                let i = match (self.begin_index, self.step_index) {
                    (None, _) => self.index_for_timestep(t)?,
                    (Some(_), Some(i)) | (Some(i), None) => i,
                };
                Ok(self.sigmas[i.min(self.sigmas.len() - 1)])
            })
            .collect()
    }
}

/// The coefficients `(a, b)` of k-diffusion's derivative `d = (x - x0) / sigma = a x + b
/// model_output`, with `x0` as the prediction type defines it.
pub(crate) fn derivative_coefficients(prediction: PredictionType, sigma: f64) -> (f64, f64) {
    match prediction {
        // x0 = x - sigma * eps
        PredictionType::Epsilon => (0.0, 1.0),
        // x0 = -sigma / sqrt(sigma^2 + 1) v + x / (sigma^2 + 1)
        PredictionType::VPrediction => {
            let s2 = sigma * sigma + 1.0;
            (sigma / s2, 1.0 / s2.sqrt())
        }
        // x0 = model_output
        PredictionType::Sample => (1.0 / sigma, -1.0 / sigma),
    }
}

/// The linear-combination coefficients of an Euler step `prev = a x + b model_output`, from
/// `sigma` and `dt = sigma_next - sigma` (k-diffusion's `x + d * dt`, `d = (x - x0) / sigma`).
pub(crate) fn euler_coefficients(prediction: PredictionType, sigma: f64, dt: f64) -> (f64, f64) {
    let (a, b) = derivative_coefficients(prediction, sigma);
    (1.0 + dt * a, dt * b)
}

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
        crate::schedule::check_sigma_options(cfg, CLASS, true)?;
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
