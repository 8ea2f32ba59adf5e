//! `FlowMatchEulerDiscreteScheduler`: Euler's method on a rectified-flow ODE (SD3, Flux).
//!
//! The model predicts a velocity `v = noise - x0`; the sample at sigma `s` is
//! `s * noise + (1 - s) * x0`, so a step is `x + (s_next - s) v`. Timesteps are
//! `sigma * num_train_timesteps`; there is no input scaling and the initial noise has unit
//! variance. Sigmas are shifted towards the noisy end, statically (`shift`, SD3) or by a
//! resolution-dependent `mu` (`use_dynamic_shifting`, Flux), which pipelines pass through
//! [`Scheduler::set_timesteps_with`] together with custom sigmas.
//!
//! Also home of the flow-matching schedule shared with the flow-matching Heun scheduler.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::config::{SchedulerConfig, TimeShiftType, TimestepSpacing};
use crate::error::{Result, SchedulerError};
use crate::noise::NoiseSource;
use crate::ops::{check_add_noise, lincomb, scale_per_item};
use crate::schedule::numpy_linspace;
use crate::sigma_steps::SigmaSteps;
use crate::sigmas::{beta_sigmas, check_one_sigma_kind, exponential_sigmas, karras_sigmas};
use crate::{Scheduler, SchedulerKind, TimestepOptions};

const CLASS: &str = "FlowMatchEulerDiscreteScheduler";

/// diffusers' `calculate_shift` (Flux and SD3 pipelines): `mu` linear in the number of image
/// tokens, from `base_shift` at `base_image_seq_len` to `max_shift` at `max_image_seq_len`
/// (defaults 0.5 at 256 and 1.15 at 4096, as the pipelines' `config.get` fallbacks).
/// Flux at 1024x1024 has `(1024 / 16)^2 = 4096` tokens.
pub fn calculate_shift(image_seq_len: usize, cfg: &SchedulerConfig) -> f64 {
    let base_seq = cfg.base_image_seq_len.unwrap_or(256) as f64;
    let max_seq = cfg.max_image_seq_len.unwrap_or(4096) as f64;
    let base_shift = cfg.base_shift.unwrap_or(0.5);
    let max_shift = cfg.max_shift.unwrap_or(1.15);
    let m = (max_shift - base_shift) / (max_seq - base_seq);
    let b = base_shift - m * base_seq;
    image_seq_len as f64 * m + b
}

/// The static part of a flow-matching schedule: the training sigmas' ends (`sigma_max`,
/// `sigma_min`, f32 like diffusers' tensors) and the shift.
#[derive(Clone, Debug)]
pub(crate) struct FlowSchedule {
    pub num_train_timesteps: usize,
    pub shift: f64,
    pub sigma_max: f64,
    pub sigma_min: f64,
}

impl FlowSchedule {
    /// diffusers' `__init__`: sigmas `t / N` for `t = N..1`, shifted in f32 unless the shift
    /// is dynamic.
    pub fn new(class: &'static str, num_train: usize, shift: f64, dynamic: bool) -> Result<Self> {
        if num_train < 1 {
            return Err(SchedulerError::Unsupported {
                class,
                message: "num_train_timesteps must be at least 1".into(),
            });
        }
        if !(shift.is_finite() && shift > 0.0) {
            return Err(SchedulerError::Unsupported {
                class,
                message: format!("shift must be a positive number, got {shift}"),
            });
        }
        let n = num_train as f32;
        let ends = [num_train as f32 / n, 1.0 / n].map(|s| {
            if dynamic {
                s
            } else {
                shift as f32 * s / (1.0 + (shift - 1.0) as f32 * s)
            }
        });
        Ok(Self {
            num_train_timesteps: num_train,
            shift,
            sigma_max: ends[0] as f64,
            sigma_min: ends[1] as f64,
        })
    }

    /// The default inference sigmas before shifting: `linspace(sigma_max N, sigma_min N, n) / N`
    /// in f64 like numpy.
    pub fn base_sigmas(&self, n: usize) -> Vec<f64> {
        let nt = self.num_train_timesteps as f64;
        numpy_linspace(self.sigma_max * nt, self.sigma_min * nt, n)
            .iter()
            .map(|t| t / nt)
            .collect()
    }

    /// `shift s / (1 + (shift - 1) s)` in f64.
    pub fn shifted(&self, sigmas: &[f64]) -> Vec<f64> {
        let shift = self.shift;
        sigmas
            .iter()
            .map(|s| shift * s / (1.0 + (shift - 1.0) * s))
            .collect()
    }
}

/// diffusers' `FlowMatchEulerDiscreteScheduler` (with `s_churn = 0`, as its pipelines call it;
/// per-token timesteps are not supported).
pub struct FlowMatchEulerDiscreteScheduler {
    schedule: FlowSchedule,
    use_dynamic_shifting: bool,
    time_shift_type: TimeShiftType,
    invert_sigmas: bool,
    shift_terminal: Option<f64>,
    use_karras_sigmas: bool,
    use_exponential_sigmas: bool,
    use_beta_sigmas: bool,
    stochastic_sampling: bool,
    steps: SigmaSteps,
}

impl FlowMatchEulerDiscreteScheduler {
    pub fn new(cfg: &SchedulerConfig) -> Result<Self> {
        let unsupported = |message: String| SchedulerError::Unsupported {
            class: CLASS,
            message,
        };
        check_one_sigma_kind(cfg, CLASS)?;
        // diffusers tests `if shift_terminal:`, so 0 means unset.
        let shift_terminal = cfg.shift_terminal.filter(|&t| t != 0.0);
        if let Some(t) = shift_terminal {
            if !(t.is_finite() && t < 1.0) {
                return Err(unsupported(format!(
                    "shift_terminal must be a number below 1, got {t}"
                )));
            }
        }
        let schedule = FlowSchedule::new(
            CLASS,
            cfg.num_train_timesteps,
            cfg.shift.unwrap_or(1.0),
            cfg.use_dynamic_shifting,
        )?;
        Ok(Self {
            schedule,
            use_dynamic_shifting: cfg.use_dynamic_shifting,
            time_shift_type: cfg.time_shift_type,
            invert_sigmas: cfg.invert_sigmas,
            shift_terminal,
            use_karras_sigmas: cfg.use_karras_sigmas,
            use_exponential_sigmas: cfg.use_exponential_sigmas,
            use_beta_sigmas: cfg.use_beta_sigmas,
            stochastic_sampling: cfg.stochastic_sampling,
            steps: SigmaSteps {
                class: CLASS,
                ..Default::default()
            },
        })
    }

    /// The shifted inference sigmas (one per step), computed as diffusers does: in f64 from
    /// the default linspace, in f32 from custom sigmas (numpy keeps their f32 dtype).
    fn inference_sigmas(&self, n: usize, options: &TimestepOptions) -> Result<Vec<f32>> {
        let mu = match (self.use_dynamic_shifting, options.mu) {
            (true, None) => {
                return Err(SchedulerError::Unsupported {
                    class: CLASS,
                    message: "use_dynamic_shifting needs `mu`: pass it with set_timesteps_with (calculate_shift gives the pipelines' value)".into(),
                })
            }
            (_, mu) => mu,
        };
        if let Some(mu) = mu {
            if !mu.is_finite() {
                return Err(SchedulerError::Unsupported {
                    class: CLASS,
                    message: format!("mu must be finite, got {mu}"),
                });
            }
        }
        let nt = self.schedule.num_train_timesteps as f32;
        let custom: Option<Vec<f64>> = match (&options.sigmas, &options.timesteps) {
            (Some(s), _) => Some(s.clone()),
            // sigmas = float32(timesteps) / N, in f32.
            (None, Some(t)) => Some(t.iter().map(|&t| (t as f32 / nt) as f64).collect()),
            (None, None) => None,
        };
        if let Some(t) = &options.timesteps {
            if t.len() != n {
                return Err(SchedulerError::InvalidSteps {
                    class: CLASS,
                    got: n,
                    reason: format!(
                        "{} custom timesteps were given; pass num_inference_steps = their count",
                        t.len()
                    ),
                });
            }
        }
        let sigmas: Vec<f32> = match &custom {
            None => {
                let base = self.schedule.base_sigmas(n);
                let shifted = match mu.filter(|_| self.use_dynamic_shifting) {
                    Some(mu) => base
                        .iter()
                        .map(|&s| time_shift(self.time_shift_type, mu, s))
                        .collect(),
                    None => self.schedule.shifted(&base),
                };
                let shifted = match self.shift_terminal {
                    Some(t) => stretch_to_terminal(&shifted, t),
                    None => shifted,
                };
                self.special(&shifted, n)?
            }
            Some(custom) => {
                if custom.len() != n {
                    return Err(SchedulerError::InvalidSteps {
                        class: CLASS,
                        got: n,
                        reason: format!(
                            "{} custom sigmas were given; pass num_inference_steps = their count",
                            custom.len()
                        ),
                    });
                }
                if let Some(bad) = custom.iter().find(|s| !(s.is_finite() && **s > 0.0)) {
                    return Err(SchedulerError::Unsupported {
                        class: CLASS,
                        message: format!("custom sigmas must be positive and finite, got {bad}"),
                    });
                }
                let custom: Vec<f32> = custom.iter().map(|&s| s as f32).collect();
                let shifted: Vec<f32> = match mu.filter(|_| self.use_dynamic_shifting) {
                    Some(mu) => custom
                        .iter()
                        .map(|&s| time_shift_f32(self.time_shift_type, mu, s))
                        .collect(),
                    None => {
                        let shift = self.schedule.shift;
                        custom
                            .iter()
                            .map(|&s| shift as f32 * s / (1.0 + (shift - 1.0) as f32 * s))
                            .collect()
                    }
                };
                let shifted = match self.shift_terminal {
                    Some(t) => stretch_to_terminal_f32(&shifted, t),
                    None => shifted,
                };
                if self.use_karras_sigmas || self.use_exponential_sigmas || self.use_beta_sigmas {
                    let wide: Vec<f64> = shifted.iter().map(|&s| s as f64).collect();
                    self.special(&wide, n)?
                } else {
                    shifted
                }
            }
        };
        Ok(sigmas)
    }

    /// Karras, exponential or beta sigmas between the shifted schedule's ends.
    fn special(&self, sigmas: &[f64], n: usize) -> Result<Vec<f32>> {
        let (lo, hi) = (sigmas[sigmas.len() - 1], sigmas[0]);
        let out = if self.use_karras_sigmas {
            karras_sigmas(lo, hi, n)
        } else if self.use_exponential_sigmas {
            exponential_sigmas(lo, hi, n)
        } else if self.use_beta_sigmas {
            beta_sigmas(lo, hi, n)
        } else {
            sigmas.to_vec()
        };
        Ok(out.iter().map(|&s| s as f32).collect())
    }
}

/// diffusers' `time_shift(mu, 1, s)` in f64.
pub(crate) fn time_shift(kind: TimeShiftType, mu: f64, s: f64) -> f64 {
    match kind {
        TimeShiftType::Exponential => mu.exp() / (mu.exp() + (1.0 / s - 1.0)),
        TimeShiftType::Linear => mu / (mu + (1.0 / s - 1.0)),
    }
}

/// [`time_shift`] on an f32 value, as numpy computes it for an f32 array.
fn time_shift_f32(kind: TimeShiftType, mu: f64, s: f32) -> f32 {
    let m = match kind {
        TimeShiftType::Exponential => mu.exp() as f32,
        TimeShiftType::Linear => mu as f32,
    };
    m / (m + (1.0 / s - 1.0))
}

/// diffusers' `stretch_shift_to_terminal`: `1 - (1 - s) / k` with `k` chosen so that the
/// last sigma becomes `terminal`.
fn stretch_to_terminal(sigmas: &[f64], terminal: f64) -> Vec<f64> {
    let scale = (1.0 - sigmas[sigmas.len() - 1]) / (1.0 - terminal);
    sigmas.iter().map(|s| 1.0 - (1.0 - s) / scale).collect()
}

fn stretch_to_terminal_f32(sigmas: &[f32], terminal: f64) -> Vec<f32> {
    let scale = (1.0 - sigmas[sigmas.len() - 1]) / (1.0 - terminal) as f32;
    sigmas.iter().map(|s| 1.0 - (1.0 - s) / scale).collect()
}

/// `timesteps = sigmas * N` in f32, then the final sigma (0, or 1 when inverted) appended.
pub(crate) fn flow_steps(steps: &mut SigmaSteps, num_train: usize, sigmas: Vec<f32>, invert: bool) {
    let n = num_train as f32;
    let sigmas: Vec<f32> = if invert {
        sigmas.iter().map(|s| 1.0 - s).collect()
    } else {
        sigmas
    };
    let timesteps: Vec<f32> = sigmas.iter().map(|s| s * n).collect();
    let mut sigmas = sigmas;
    sigmas.push(if invert { 1.0 } else { 0.0 });
    steps.set(timesteps, sigmas, TimestepSpacing::Linspace, true);
}

/// diffusers' `scale_noise`, the flow-matching forward process `s noise + (1 - s) x0`.
pub(crate) fn scale_noise<B: Backend>(
    steps: &SigmaSteps,
    original: Tensor<B, 4>,
    noise: Tensor<B, 4>,
    timesteps: &[f64],
) -> Result<Tensor<B, 4>> {
    check_add_noise(steps.class, &original, &noise, timesteps)?;
    let sigmas = steps.sigmas_for_add_noise(timesteps)?;
    let keep: Vec<f64> = sigmas.iter().map(|&s| (1.0 - s as f32) as f64).collect();
    Ok(scale_per_item(noise, &sigmas) + scale_per_item(original, &keep))
}

impl<B: Backend> Scheduler<B> for FlowMatchEulerDiscreteScheduler {
    fn kind(&self) -> SchedulerKind {
        SchedulerKind::FlowMatchEulerDiscrete
    }

    /// The default schedule; with `use_dynamic_shifting` this is an error asking for `mu`.
    fn set_timesteps(&mut self, n: usize) -> Result<()> {
        Scheduler::<B>::set_timesteps_with(self, n, &TimestepOptions::default())
    }

    fn set_timesteps_with(&mut self, n: usize, options: &TimestepOptions) -> Result<()> {
        if n == 0 {
            return Err(SchedulerError::InvalidSteps {
                class: CLASS,
                got: n,
                reason: "it must be at least 1".into(),
            });
        }
        let sigmas = self.inference_sigmas(n, options)?;
        flow_steps(
            &mut self.steps,
            self.schedule.num_train_timesteps,
            sigmas,
            self.invert_sigmas,
        );
        // Custom timesteps are used as given (f32), unless the sigmas are inverted.
        if let (Some(t), false) = (&options.timesteps, self.invert_sigmas) {
            self.steps.timesteps = t.iter().map(|&t| t as f32 as f64).collect();
        }
        Ok(())
    }

    fn timesteps(&self) -> &[f64] {
        &self.steps.timesteps
    }

    /// Flow matching starts from unit-variance noise.
    fn init_noise_sigma(&self) -> f64 {
        1.0
    }

    /// The identity: flow-matching models take the sample as it is.
    fn scale_model_input(&self, sample: Tensor<B, 4>, timestep: f64) -> Result<Tensor<B, 4>> {
        self.steps.index("scale_model_input", timestep)?;
        Ok(sample)
    }

    fn step(
        &mut self,
        model_output: Tensor<B, 4>,
        timestep: f64,
        sample: Tensor<B, 4>,
        noise: &mut dyn NoiseSource<B>,
    ) -> Result<Tensor<B, 4>> {
        let i = self.steps.index("step", timestep)?;
        let (sigma, sigma_next) = (self.steps.sigmas[i], self.steps.sigmas[i + 1]);
        let prev = if self.stochastic_sampling {
            // x0 = x - s v, then x0 noised afresh to the next sigma.
            let z = noise.randn(sample.dims(), &sample.device())?;
            let keep = (1.0 - sigma_next as f32) as f64;
            lincomb(
                (sample, keep),
                [(model_output, -sigma * keep), (z, sigma_next)],
            )
        } else {
            // dt = sigma_next - sigma is an f32 subtraction in diffusers.
            let dt = (sigma_next as f32 - sigma as f32) as f64;
            lincomb((sample, 1.0), [(model_output, dt)])
        };
        self.steps.step_index = Some(i + 1);
        Ok(prev)
    }

    /// diffusers' `scale_noise` (flow matching has no `add_noise`): `s noise + (1 - s) x0`.
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
