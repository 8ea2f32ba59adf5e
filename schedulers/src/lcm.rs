//! `LCMScheduler`: multistep sampling of latent consistency models (LCM, LCM-LoRA).
//!
//! Each step maps the sample straight to a clean estimate through the consistency
//! parameterisation `c_skip x + c_out x0`, then (except on the last step) noises it afresh
//! to the next timestep. Timesteps are a subset of the distillation schedule of
//! `original_inference_steps` (default 50) timesteps `k - 1, 2k - 1, ..`.
//!
//! Also home of that timestep selection, which `TCDScheduler` shares.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::config::{PredictionType, SchedulerConfig};
use crate::error::{Result, SchedulerError};
use crate::noise::NoiseSource;
use crate::ops::{lincomb, threshold_or_clip};
use crate::schedule::{integer_timestep, NoiseSchedule};
use crate::{Scheduler, SchedulerKind};

const CLASS: &str = "LCMScheduler";

/// diffusers' LCM/TCD `set_timesteps` (no custom timesteps, strength 1): `n` timesteps
/// evenly indexed into the reversed distillation schedule `[k - 1, 2k - 1, .., orig k - 1]`,
/// `k = num_train / orig`.
pub(crate) fn distilled_timesteps(
    class: &'static str,
    num_train: usize,
    original_steps: usize,
    n: usize,
) -> Result<Vec<f64>> {
    let invalid = |reason: String| SchedulerError::InvalidSteps {
        class,
        got: n,
        reason,
    };
    if original_steps == 0 || original_steps > num_train {
        return Err(SchedulerError::Unsupported {
            class,
            message: format!(
                "original_inference_steps must be between 1 and num_train_timesteps ({num_train}), got {original_steps}"
            ),
        });
    }
    if n == 0 || n > original_steps {
        return Err(invalid(format!(
            "it must be between 1 and original_inference_steps ({original_steps}): the schedule is a subset of the distillation schedule"
        )));
    }
    let k = (num_train / original_steps) as i64;
    let origin: Vec<i64> = (1..=original_steps as i64)
        .rev()
        .map(|i| i * k - 1)
        .collect();
    // np.floor(np.linspace(0, len, n, endpoint=False)): i * (len / n).
    let step = origin.len() as f64 / n as f64;
    Ok((0..n)
        .map(|i| origin[(i as f64 * step).floor() as usize] as f64)
        .collect())
}

/// The step position shared by LCM and TCD: the running index, else `begin_index`, else the
/// timestep's position in the schedule.
#[derive(Clone, Debug, Default)]
pub(crate) struct DistilledSteps {
    pub timesteps: Vec<f64>,
    pub step_index: Option<usize>,
    pub begin_index: Option<usize>,
}

impl DistilledSteps {
    pub fn set(&mut self, timesteps: Vec<f64>) {
        self.timesteps = timesteps;
        self.step_index = None;
        self.begin_index = None;
    }

    pub fn index(&self, class: &'static str, op: &'static str, t: f64) -> Result<usize> {
        if self.timesteps.is_empty() {
            return Err(SchedulerError::NotInitialized { class, op });
        }
        let i = match (self.step_index, self.begin_index) {
            (Some(i), _) | (None, Some(i)) => i,
            (None, None) => self.timesteps.iter().position(|&s| s == t).ok_or_else(|| {
                SchedulerError::BadTimestep {
                    class,
                    timestep: t,
                    reason: "is not in the schedule; pass a value from timesteps()".into(),
                }
            })?,
        };
        if i >= self.timesteps.len() {
            return Err(SchedulerError::ScheduleExhausted {
                class,
                steps: self.timesteps.len(),
            });
        }
        Ok(i)
    }
}

/// diffusers' `LCMScheduler`.
pub struct LcmScheduler {
    schedule: NoiseSchedule,
    num_train_timesteps: usize,
    original_inference_steps: usize,
    prediction_type: PredictionType,
    timestep_scaling: f64,
    clip_sample: bool,
    clip_sample_range: f64,
    thresholding: bool,
    dynamic_thresholding_ratio: f64,
    sample_max_value: f64,
    steps: DistilledSteps,
}

impl LcmScheduler {
    pub fn new(cfg: &SchedulerConfig) -> Result<Self> {
        let schedule = NoiseSchedule::new(cfg, CLASS, cfg.rescale_betas_zero_snr)?;
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
            schedule,
            num_train_timesteps: cfg.num_train_timesteps,
            original_inference_steps: cfg.original_inference_steps.unwrap_or(50),
            prediction_type: cfg.prediction_type,
            timestep_scaling: cfg.timestep_scaling.unwrap_or(10.0),
            clip_sample: cfg.clip_sample.unwrap_or(false),
            clip_sample_range: cfg.clip_sample_range,
            thresholding: cfg.thresholding,
            dynamic_thresholding_ratio: cfg.dynamic_thresholding_ratio,
            sample_max_value: cfg.sample_max_value,
            steps: DistilledSteps::default(),
        })
    }

    /// diffusers' `get_scalings_for_boundary_condition_discrete` (sigma_data = 0.5), in f32
    /// as diffusers computes it from the timestep tensor.
    fn scalings(&self, t: i64) -> (f64, f64) {
        let st = t as f32 * self.timestep_scaling as f32;
        let d = st * st + 0.25;
        ((0.25 / d) as f64, (st / d.sqrt()) as f64)
    }
}

/// `(x0, eps)` coefficient pairs of the DDPM parameterisation: `x0 = a x + b m`,
/// `eps = c x + d m`, for `alpha_prod_t = a_t`.
pub(crate) fn x0_eps_coefficients(prediction: PredictionType, a_t: f64) -> [(f64, f64); 2] {
    let (sa, sb) = (a_t.sqrt(), ((1.0 - a_t as f32) as f64).sqrt());
    match prediction {
        PredictionType::Epsilon => [(1.0 / sa, -sb / sa), (0.0, 1.0)],
        PredictionType::Sample => [(0.0, 1.0), (1.0 / sb, -sa / sb)],
        PredictionType::VPrediction => [(sa, -sb), (sb, sa)],
    }
}

impl<B: Backend> Scheduler<B> for LcmScheduler {
    fn kind(&self) -> SchedulerKind {
        SchedulerKind::Lcm
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
        let i = self.steps.index(CLASS, "step", timestep)?;
        let t = integer_timestep(CLASS, timestep)?;
        let last = i + 1 == self.steps.timesteps.len();
        let prev_t = if last {
            t
        } else {
            self.steps.timesteps[i + 1] as i64
        };
        let a_t = self.schedule.alpha_at(CLASS, t)?;
        let a_prev = self.schedule.alpha_at(CLASS, prev_t)?;
        let [(xa, xb), _] = x0_eps_coefficients(self.prediction_type, a_t);
        let (c_skip, c_out) = self.scalings(t);
        let x0 = lincomb((sample.clone(), xa), [(model_output.clone(), xb)]);
        let x0 = threshold_or_clip(
            x0,
            self.thresholding
                .then_some((self.dynamic_thresholding_ratio, self.sample_max_value)),
            self.clip_sample.then_some(self.clip_sample_range),
        );
        let denoised = lincomb((x0, c_out), [(sample, c_skip)]);
        let prev = if last {
            denoised
        } else {
            let z = noise.randn(model_output.dims(), &model_output.device())?;
            let b_prev = (1.0 - a_prev as f32) as f64;
            lincomb((denoised, a_prev.sqrt()), [(z, b_prev.sqrt())])
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
}
