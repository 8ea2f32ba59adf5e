//! `KDPM2DiscreteScheduler`: k-diffusion's `sample_dpm_2` (DPM-Solver-2 in sigma space,
//! A1111's "DPM2").
//!
//! Each step evaluates the denoiser twice: at sigma `s_i`, then at the log-midpoint
//! `sqrt(s_i s_{i+1})`, whose derivative carries the sample from `s_i` to `s_{i+1}`. As in
//! diffusers, `timesteps()` lists the evaluations (`2n - 1`: the midpoint timesteps
//! interleaved, none for the last step, a plain Euler step to sigma 0) and `step` alternates
//! between the two stages.
//!
//! Also home of the schedule shared with `KDPM2AncestralDiscreteScheduler`.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::config::{PredictionType, SchedulerConfig, TimestepSpacing};
use crate::error::{Result, SchedulerError};
use crate::noise::NoiseSource;
use crate::ops::lincomb;
use crate::schedule::{check_steps, float_timesteps, numpy_interp, NoiseSchedule};
use crate::sigma_steps::SigmaSteps;
use crate::sigmas::{
    beta_sigmas, check_one_sigma_kind, exponential_sigmas, karras_sigmas, sigma_to_t,
};
use crate::{Scheduler, SchedulerKind};

const CLASS: &str = "KDPM2DiscreteScheduler";

/// The config options the KDPM2 pair shares, checked.
#[derive(Clone, Debug)]
pub(crate) struct Kdpm2Options {
    pub num_train_timesteps: usize,
    pub prediction_type: PredictionType,
    pub timestep_spacing: TimestepSpacing,
    pub steps_offset: usize,
    pub use_karras_sigmas: bool,
    pub use_exponential_sigmas: bool,
    pub use_beta_sigmas: bool,
}

impl Kdpm2Options {
    pub fn new(cfg: &SchedulerConfig, class: &'static str, kind: SchedulerKind) -> Result<Self> {
        let unsupported = |message: &str| {
            Err(SchedulerError::Unsupported {
                class,
                message: message.into(),
            })
        };
        check_one_sigma_kind(cfg, class)?;
        if cfg.prediction_type == PredictionType::Sample {
            return unsupported(
                "prediction_type `sample` is not implemented (as in diffusers); use epsilon or v_prediction",
            );
        }
        Ok(Self {
            num_train_timesteps: cfg.num_train_timesteps,
            prediction_type: cfg.prediction_type,
            timestep_spacing: cfg
                .timestep_spacing
                .unwrap_or(kind.default_timestep_spacing()),
            steps_offset: cfg.steps_offset,
            use_karras_sigmas: cfg.use_karras_sigmas,
            use_exponential_sigmas: cfg.use_exponential_sigmas,
            use_beta_sigmas: cfg.use_beta_sigmas,
        })
    }

    /// The `n` step timesteps and the `n + 1` sigmas (ending in 0, f32), as diffusers'
    /// `set_timesteps` forms them before interleaving. With Karras, exponential or beta
    /// sigmas the timesteps are mapped back from the sigmas and stay f64 (Karras' rounded to
    /// whole numbers), as in diffusers.
    pub fn base_schedule(&self, schedule: &NoiseSchedule, n: usize) -> (Vec<f64>, Vec<f32>) {
        let timesteps = float_timesteps(
            self.timestep_spacing,
            self.num_train_timesteps,
            n,
            self.steps_offset,
        );
        let train = schedule.train_sigmas();
        let sigmas: Vec<f64> = timesteps
            .iter()
            .map(|&t| numpy_interp(t as f64, &train))
            .collect();
        let (timesteps, sigmas) = if self.special_sigmas() {
            let (lo, hi) = (sigmas[sigmas.len() - 1], sigmas[0]);
            let sigmas = if self.use_karras_sigmas {
                karras_sigmas(lo, hi, n)
            } else if self.use_exponential_sigmas {
                exponential_sigmas(lo, hi, n)
            } else {
                beta_sigmas(lo, hi, n)
            };
            let log_sigmas = schedule.log_train_sigmas();
            let timesteps = sigmas
                .iter()
                .map(|&s| {
                    let t = sigma_to_t(s, &log_sigmas);
                    if self.use_karras_sigmas {
                        t.round_ties_even()
                    } else {
                        t
                    }
                })
                .collect();
            (timesteps, sigmas)
        } else {
            (timesteps.iter().map(|&t| t as f64).collect(), sigmas)
        };
        let mut sigmas: Vec<f32> = sigmas.iter().map(|&s| s as f32).collect();
        sigmas.push(0.0);
        (timesteps, sigmas)
    }

    fn special_sigmas(&self) -> bool {
        self.use_karras_sigmas || self.use_exponential_sigmas || self.use_beta_sigmas
    }

    /// diffusers' interleaved timesteps of the two-evaluation schedulers:
    /// `[t_0, mid_1, t_1, mid_2, t_2, ..]`, `mid_k` the timestep of the midpoint sigma
    /// `mids[k - 1]`.
    pub(crate) fn interleaved_timesteps(
        &self,
        timesteps: &[f64],
        mids: &[f32],
        log_sigmas: &[f32],
    ) -> Vec<f64> {
        let mut all = vec![timesteps[0]];
        for (&t, &mid) in timesteps[1..].iter().zip(mids) {
            all.push(self.interpolated_timestep(mid, log_sigmas));
            all.push(t);
        }
        all
    }

    /// The timestep of a midpoint sigma, in the dtype of the step timesteps (f32 unless
    /// the sigmas are Karras/exponential/beta).
    pub fn interpolated_timestep(&self, sigma: f32, log_sigmas: &[f32]) -> f64 {
        let t = sigma_to_t_f32(sigma, log_sigmas);
        if self.special_sigmas() {
            t
        } else {
            t as f32 as f64
        }
    }

    /// The denoiser's clean-sample estimate at `sigma`.
    pub fn x0<B: Backend>(
        &self,
        x: Tensor<B, 4>,
        model_output: Tensor<B, 4>,
        sigma: f64,
    ) -> Tensor<B, 4> {
        match self.prediction_type {
            PredictionType::VPrediction => {
                let s2 = sigma * sigma + 1.0;
                lincomb((model_output, -sigma / s2.sqrt()), [(x, 1.0 / s2)])
            }
            _ => lincomb((x, 1.0), [(model_output, -sigma)]),
        }
    }

    /// diffusers' `(x - x0) / sigma`, with its f32 rounding.
    pub fn derivative<B: Backend>(
        &self,
        x: Tensor<B, 4>,
        model_output: Tensor<B, 4>,
        sigma_input: f64,
        sigma: f64,
    ) -> Tensor<B, 4> {
        let x0 = self.x0(x.clone(), model_output, sigma_input);
        (x - x0).div_scalar(sigma)
    }
}

/// diffusers' `_sigma_to_t` as KDPM2 calls it on an f32 tensor: `ln(sigma)` and the weight in
/// f32, the weighted index sum in f64 (numpy promotes f32 times int64 to f64).
fn sigma_to_t_f32(sigma: f32, log_sigmas: &[f32]) -> f64 {
    let log_sigma = sigma.max(1e-10).ln();
    let count = log_sigmas.iter().filter(|&&l| log_sigma - l >= 0.0).count();
    // argmax of cumsum(dists >= 0): the first index where the count is reached.
    let low = log_sigmas
        .iter()
        .scan(0usize, |acc, &l| {
            *acc += usize::from(log_sigma - l >= 0.0);
            Some(*acc)
        })
        .position(|c| c == count)
        .unwrap_or(0)
        .min(log_sigmas.len() - 2);
    let (lo, hi) = (log_sigmas[low], log_sigmas[low + 1]);
    let w = ((lo - log_sigma) / (lo - hi)).clamp(0.0, 1.0);
    (1.0 - w) as f64 * low as f64 + w as f64 * (low + 1) as f64
}

/// `exp(lerp(ln start, ln end, 1/2))` in f32, as torch computes it: `end - (end - start) / 2`
/// in log space.
pub(crate) fn log_midpoint(start: f32, end: f32) -> f32 {
    let (start, end) = (start.ln(), end.ln());
    (end - (end - start) * 0.5).exp()
}

/// `[x0, x1, x1, .., x_last, x_last, x_last]`: diffusers' `cat([x[:1], x[1:].repeat_interleave(2), x[-1:]])`.
pub(crate) fn doubled(x: &[f32]) -> Vec<f32> {
    let mut out = vec![x[0]];
    for &v in &x[1..] {
        out.extend([v, v]);
    }
    out.push(x[x.len() - 1]);
    out
}

/// `sample / sqrt(sigma^2 + 1)` in f32 like diffusers.
pub(crate) fn scale_by_sigma<B: Backend>(sample: Tensor<B, 4>, sigma: f64) -> Tensor<B, 4> {
    let s = sigma as f32;
    sample.div_scalar((s * s + 1.0).sqrt())
}

/// diffusers' `KDPM2DiscreteScheduler`.
pub struct KDpm2DiscreteScheduler<B: Backend> {
    schedule: NoiseSchedule,
    options: Kdpm2Options,
    /// `sigmas` (doubled, 2n + 2 entries) and the `2n - 1` timesteps.
    steps: SigmaSteps,
    /// The log-midpoint sigmas, doubled like `sigmas`.
    sigmas_interpol: Vec<f64>,
    /// The sample at the start of the step, between the two stages.
    first: Option<Tensor<B, 4>>,
}

impl<B: Backend> KDpm2DiscreteScheduler<B> {
    pub fn new(cfg: &SchedulerConfig) -> Result<Self> {
        let options = Kdpm2Options::new(cfg, CLASS, SchedulerKind::KDpm2Discrete)?;
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
            first: None,
        })
    }

    /// The step index, checked against the number of evaluations.
    fn index(&self, op: &'static str, t: f64) -> Result<usize> {
        self.steps.index_within_timesteps(op, t)
    }
}

impl<B: Backend> Scheduler<B> for KDpm2DiscreteScheduler<B> {
    fn kind(&self) -> SchedulerKind {
        SchedulerKind::KDpm2Discrete
    }

    fn set_timesteps(&mut self, n: usize) -> Result<()> {
        check_steps(CLASS, n, self.options.num_train_timesteps)?;
        let (timesteps, sigmas) = self.options.base_schedule(&self.schedule, n);
        // exp(lerp(ln s_k, ln s_{k-1}, 1/2)) in f32 (torch: end - (end - start) / 2); the
        // first entry (NaN in diffusers, never read) is 0 here, the last is 0.
        let mut interpol = vec![0.0f32; sigmas.len()];
        for k in 1..sigmas.len() {
            interpol[k] = log_midpoint(sigmas[k], sigmas[k - 1]);
        }
        let all = self.options.interleaved_timesteps(
            &timesteps,
            &interpol[1..],
            &self.schedule.log_train_sigmas(),
        );
        self.sigmas_interpol = doubled(&interpol).into_iter().map(f64::from).collect();
        self.steps.set(
            Vec::new(),
            doubled(&sigmas),
            self.options.timestep_spacing,
            true,
        );
        // Set afterwards: with Karras/exponential/beta sigmas they are f64, not f32.
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

    /// Two evaluations per step (diffusers' `order = 2`); `timesteps()` already lists both.
    fn order(&self) -> usize {
        2
    }

    /// `sample / sqrt(sigma^2 + 1)` at the stage's sigma (the midpoint's in the second).
    fn scale_model_input(&self, sample: Tensor<B, 4>, timestep: f64) -> Result<Tensor<B, 4>> {
        let i = self.index("scale_model_input", timestep)?;
        let sigma = match self.first {
            None => self.steps.sigmas[i],
            Some(_) => self.sigmas_interpol[i],
        };
        Ok(scale_by_sigma(sample, sigma))
    }

    fn step(
        &mut self,
        model_output: Tensor<B, 4>,
        timestep: f64,
        sample: Tensor<B, 4>,
        _noise: &mut dyn NoiseSource<B>,
    ) -> Result<Tensor<B, 4>> {
        let i = self.index("step", timestep)?;
        let o = &self.options;
        let prev = match self.first.take() {
            None => {
                let sigma = self.steps.sigmas[i];
                let sigma_mid = self.sigmas_interpol[i + 1];
                let d = o.derivative(sample.clone(), model_output, sigma, sigma);
                // dt is an f32 subtraction in diffusers.
                let dt = (sigma_mid as f32 - sigma as f32) as f64;
                self.first = Some(sample.clone());
                lincomb((sample, 1.0), [(d, dt)])
            }
            Some(start) => {
                let sigma = self.steps.sigmas[i - 1];
                let sigma_mid = self.sigmas_interpol[i];
                let sigma_next = self.steps.sigmas[i];
                let d = o.derivative(sample, model_output, sigma_mid, sigma_mid);
                let dt = (sigma_next as f32 - sigma as f32) as f64;
                lincomb((start, 1.0), [(d, dt)])
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
