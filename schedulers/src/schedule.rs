//! Host-side schedule math shared by the schedulers: betas, `alphas_cumprod`, timestep spacing.
//!
//! diffusers computes these with torch in f32 and numpy in f64; the helpers below repeat
//! those precisions step by step (noted at each function) so timesteps match exactly and
//! coefficients match to the last bit or two. Per-step coefficients are then formed in f64.

use crate::config::{BetaSchedule, SchedulerConfig, TimestepSpacing};
use crate::error::{Result, SchedulerError};
use crate::ops::{alpha_add_noise, check_add_noise};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

/// `torch.linspace(start, end, steps, dtype=float32)` on the CPU: the step is rounded to
/// f32, then each value is `start + step * i` (first half) or `end - step * (steps - 1 - i)`
/// (second half), rounded once to f32.
pub(crate) fn torch_linspace_f32(start: f64, end: f64, steps: usize) -> Vec<f32> {
    let (s, e) = (start as f32, end as f32);
    if steps == 1 {
        return vec![s];
    }
    let step = ((e - s) / (steps - 1) as f32) as f64;
    let half = steps / 2;
    (0..steps)
        .map(|i| {
            if i < half {
                (s as f64 + step * i as f64) as f32
            } else {
                (e as f64 - step * (steps - 1 - i) as f64) as f32
            }
        })
        .collect()
}

/// `numpy.linspace(start, stop, num)` in f64: `i * step + start`, the last value exactly `stop`.
pub(crate) fn numpy_linspace(start: f64, stop: f64, num: usize) -> Vec<f64> {
    if num == 1 {
        return vec![start];
    }
    let step = (stop - start) / (num - 1) as f64;
    let mut y: Vec<f64> = (0..num).map(|i| i as f64 * step + start).collect();
    y[num - 1] = stop;
    y
}

/// `numpy.arange(start, stop, step)` for floats: numpy fills `start + i * delta` with
/// `delta = (start + step) - start`, and the length is `ceil((stop - start) / step)`.
pub(crate) fn numpy_arange(start: f64, stop: f64, step: f64) -> Vec<f64> {
    let len = ((stop - start) / step).ceil().max(0.0) as usize;
    let delta = (start + step) - start;
    (0..len)
        .map(|i| match i {
            0 => start,
            1 => start + step,
            _ => start + i as f64 * delta,
        })
        .collect()
}

/// `numpy.interp(x, arange(len(fp)), fp)`: linear interpolation on the integer grid,
/// clamped at both ends, with numpy's `slope * (x - xp[j]) + fp[j]` formula.
pub(crate) fn numpy_interp(x: f64, fp: &[f32]) -> f64 {
    let last = fp.len() - 1;
    if x.is_nan() {
        return x;
    }
    if x <= 0.0 {
        return fp[0] as f64;
    }
    if x >= last as f64 {
        return fp[last] as f64;
    }
    let j = x.floor() as usize;
    if x == j as f64 {
        return fp[j] as f64;
    }
    let slope = fp[j + 1] as f64 - fp[j] as f64;
    slope * (x - j as f64) + fp[j] as f64
}

/// diffusers' `betas_for_alpha_bar` with the cosine `alpha_bar` (the `squaredcos_cap_v2` schedule).
fn betas_for_alpha_bar(n: usize) -> Vec<f32> {
    let alpha_bar = |t: f64| {
        ((t + 0.008) / 1.008 * std::f64::consts::PI / 2.0)
            .cos()
            .powi(2)
    };
    (0..n)
        .map(|i| {
            let t1 = i as f64 / n as f64;
            let t2 = (i + 1) as f64 / n as f64;
            (1.0 - alpha_bar(t2) / alpha_bar(t1)).min(0.999) as f32
        })
        .collect()
}

/// diffusers' `rescale_zero_terminal_snr`, in torch's f32 arithmetic.
fn rescale_zero_terminal_snr(betas: &[f32]) -> Vec<f32> {
    let alphas_cumprod = cumprod(betas);
    let mut sqrt_ab: Vec<f32> = alphas_cumprod.iter().map(|a| a.sqrt()).collect();
    let s0 = sqrt_ab[0];
    let s_t = sqrt_ab[sqrt_ab.len() - 1];
    let scale = s0 / (s0 - s_t);
    for v in &mut sqrt_ab {
        *v = (*v - s_t) * scale;
    }
    let ab: Vec<f32> = sqrt_ab.iter().map(|v| v * v).collect();
    let mut out = Vec::with_capacity(ab.len());
    out.push(1.0 - ab[0]);
    for w in ab.windows(2) {
        out.push(1.0 - w[1] / w[0]);
    }
    out
}

/// `torch.cumprod(1 - betas)` on the CPU: f32 alphas, accumulated in f64, stored as f32.
fn cumprod(betas: &[f32]) -> Vec<f32> {
    let mut acc = 1.0f64;
    betas
        .iter()
        .map(|b| {
            acc *= (1.0f32 - b) as f64;
            acc as f32
        })
        .collect()
}

/// The training noise schedule: betas and `alphas_cumprod`, as f32 like diffusers' tensors.
#[derive(Clone, Debug)]
pub(crate) struct NoiseSchedule {
    pub alphas_cumprod: Vec<f32>,
}

impl NoiseSchedule {
    /// Betas from the config (`trained_betas` or the named schedule), optionally rescaled to
    /// zero terminal SNR, and their cumulative alpha products.
    pub fn new(cfg: &SchedulerConfig, class: &'static str, rescale_zero_snr: bool) -> Result<Self> {
        let n = cfg.num_train_timesteps;
        let max = crate::config::MAX_TRAIN_TIMESTEPS;
        if !(2..=max).contains(&n) {
            return Err(SchedulerError::Unsupported {
                class,
                message: format!("num_train_timesteps must be between 2 and {max}, got {n}"),
            });
        }
        let (beta_start, beta_end) = match class {
            "HeunDiscreteScheduler"
            | "KDPM2DiscreteScheduler"
            | "KDPM2AncestralDiscreteScheduler"
            | "LCMScheduler"
            | "TCDScheduler" => (0.00085, 0.012),
            _ => (0.0001, 0.02),
        };
        let beta_start = cfg.beta_start.unwrap_or(beta_start);
        let beta_end = cfg.beta_end.unwrap_or(beta_end);
        let mut betas = match &cfg.trained_betas {
            Some(b) if b.len() != n => {
                return Err(SchedulerError::Unsupported {
                    class,
                    message: format!(
                        "trained_betas has {} values but num_train_timesteps is {n}",
                        b.len()
                    ),
                })
            }
            Some(b) => b.iter().map(|&v| v as f32).collect(),
            None => match cfg.beta_schedule.unwrap_or(match class {
                "LCMScheduler" | "TCDScheduler" => BetaSchedule::ScaledLinear,
                _ => BetaSchedule::Linear,
            }) {
                BetaSchedule::Linear => torch_linspace_f32(beta_start, beta_end, n),
                BetaSchedule::ScaledLinear => {
                    torch_linspace_f32(beta_start.sqrt(), beta_end.sqrt(), n)
                        .into_iter()
                        .map(|b| b * b)
                        .collect()
                }
                BetaSchedule::SquaredcosCapV2 => betas_for_alpha_bar(n),
            },
        };
        if rescale_zero_snr {
            betas = rescale_zero_terminal_snr(&betas);
        }
        Ok(Self {
            alphas_cumprod: cumprod(&betas),
        })
    }

    pub fn len(&self) -> usize {
        self.alphas_cumprod.len()
    }

    /// `alphas_cumprod[t]` as f64, or an error naming the timestep when it is out of range.
    pub fn alpha_at(&self, class: &'static str, t: i64) -> Result<f64> {
        usize::try_from(t)
            .ok()
            .and_then(|i| self.alphas_cumprod.get(i))
            .map(|&a| a as f64)
            .ok_or_else(|| SchedulerError::BadTimestep {
                class,
                timestep: t as f64,
                reason: format!("is outside the training range 0..{}", self.len()),
            })
    }

    /// `add_noise` of the schedulers indexed by whole timesteps (DDIM, DDPM, PNDM, LCM, TCD):
    /// `sqrt(a_t) original + sqrt(1 - a_t) noise` per batch item.
    pub(crate) fn add_noise_at<B: Backend>(
        &self,
        class: &'static str,
        original: Tensor<B, 4>,
        noise: Tensor<B, 4>,
        timesteps: &[f64],
    ) -> Result<Tensor<B, 4>> {
        check_add_noise(class, &original, &noise, timesteps)?;
        let alphas = timesteps
            .iter()
            .map(|&t| self.alpha_at(class, integer_timestep(class, t)?))
            .collect::<Result<Vec<_>>>()?;
        Ok(alpha_add_noise(original, noise, &alphas))
    }

    /// The training sigmas `sqrt((1 - a) / a)`, in torch's f32 arithmetic (ascending in t).
    pub fn train_sigmas(&self) -> Vec<f32> {
        self.alphas_cumprod
            .iter()
            .map(|&a| ((1.0 - a) / a).sqrt())
            .collect()
    }

    /// `ln` of the training sigmas in f32 (numpy's `np.log` of an f32 array), ascending in t.
    pub fn log_train_sigmas(&self) -> Vec<f32> {
        self.train_sigmas()
            .iter()
            .map(|&s| (s as f64).ln() as f32)
            .collect()
    }
}

/// Checks `1 <= num_inference_steps <= num_train_timesteps`.
pub(crate) fn check_steps(class: &'static str, n: usize, num_train: usize) -> Result<()> {
    if n == 0 || n > num_train {
        return Err(SchedulerError::InvalidSteps {
            class,
            got: n,
            reason: format!("it must be between 1 and num_train_timesteps ({num_train})"),
        });
    }
    Ok(())
}

/// The integer inference timesteps of DDIM (and, reversed, PNDM), highest first.
/// [`integer_timesteps`] for schedulers that index `alphas_cumprod` by timestep (DDIM, DDPM):
/// a `steps_offset` that pushes the first timestep past the training range is an error.
pub(crate) fn checked_integer_timesteps(
    class: &'static str,
    spacing: TimestepSpacing,
    num_train: usize,
    n: usize,
    steps_offset: usize,
) -> Result<Vec<i64>> {
    let ts = integer_timesteps(spacing, num_train, n, steps_offset);
    check_first_timestep(class, &ts, num_train, n, steps_offset)?;
    Ok(ts)
}

/// A `steps_offset` that pushes the first (highest) timestep of `ts` past the training range
/// is an error.
fn check_first_timestep(
    class: &'static str,
    ts: &[i64],
    num_train: usize,
    n: usize,
    steps_offset: usize,
) -> Result<()> {
    if let Some(&top) = ts.iter().max() {
        if top >= num_train as i64 {
            return Err(SchedulerError::InvalidSteps {
                class,
                got: n,
                reason: format!(
                    "with steps_offset {steps_offset} the first timestep {top} is past num_train_timesteps ({num_train})"
                ),
            });
        }
    }
    Ok(())
}

/// [`multistep_timesteps`] checked (DPM-Solver, DEIS, UniPC): `last_timestep` (cut by
/// DPM-Solver's `lambda_min_clipped`) must leave `n` training timesteps, and a `steps_offset`
/// must not push the first timestep past the training range.
pub(crate) fn checked_multistep_timesteps(
    class: &'static str,
    spacing: TimestepSpacing,
    num_train: usize,
    last_timestep: usize,
    n: usize,
    steps_offset: usize,
) -> Result<Vec<i64>> {
    if last_timestep < n {
        return Err(SchedulerError::InvalidSteps {
            class,
            got: n,
            reason: format!("lambda_min_clipped leaves only {last_timestep} training timesteps"),
        });
    }
    let ts = multistep_timesteps(spacing, num_train, last_timestep, n, steps_offset);
    check_first_timestep(class, &ts, num_train, n, steps_offset)?;
    Ok(ts)
}

pub(crate) fn integer_timesteps(
    spacing: TimestepSpacing,
    num_train: usize,
    n: usize,
    steps_offset: usize,
) -> Vec<i64> {
    match spacing {
        TimestepSpacing::Linspace => numpy_linspace(0.0, (num_train - 1) as f64, n)
            .iter()
            .rev()
            .map(|t| t.round_ties_even() as i64)
            .collect(),
        TimestepSpacing::Leading => {
            let ratio = (num_train / n) as i64;
            (0..n as i64)
                .rev()
                .map(|i| i * ratio + steps_offset as i64)
                .collect()
        }
        TimestepSpacing::Trailing => {
            numpy_arange(num_train as f64, 0.0, -(num_train as f64 / n as f64))
                .iter()
                .map(|t| t.round_ties_even() as i64 - 1)
                .collect()
        }
    }
}

/// The integer inference timesteps of the multistep solvers (DPM-Solver, UniPC), highest
/// first: `n + 1` points from `last_timestep` down to 0 with the last (0) dropped.
/// `last_timestep` is `num_train_timesteps` unless DPM-Solver's `lambda_min_clipped` cuts it.
pub(crate) fn multistep_timesteps(
    spacing: TimestepSpacing,
    num_train: usize,
    last_timestep: usize,
    n: usize,
    steps_offset: usize,
) -> Vec<i64> {
    match spacing {
        TimestepSpacing::Linspace => {
            let mut ts: Vec<i64> = numpy_linspace(0.0, last_timestep as f64 - 1.0, n + 1)
                .iter()
                .rev()
                .map(|t| t.round_ties_even() as i64)
                .collect();
            ts.pop();
            ts
        }
        TimestepSpacing::Leading => {
            let ratio = (last_timestep / (n + 1)) as i64;
            (1..=n as i64)
                .rev()
                .map(|i| i * ratio + steps_offset as i64)
                .collect()
        }
        TimestepSpacing::Trailing => {
            numpy_arange(last_timestep as f64, 0.0, -(num_train as f64 / n as f64))
                .iter()
                .map(|t| t.round_ties_even() as i64 - 1)
                .collect()
        }
    }
}

/// The float inference timesteps of the Euler schedulers (f32 like diffusers), highest first.
pub(crate) fn float_timesteps(
    spacing: TimestepSpacing,
    num_train: usize,
    n: usize,
    steps_offset: usize,
) -> Vec<f32> {
    match spacing {
        TimestepSpacing::Linspace => numpy_linspace(0.0, (num_train - 1) as f64, n)
            .iter()
            .rev()
            .map(|&t| t as f32)
            .collect(),
        _ => integer_timesteps(spacing, num_train, n, steps_offset)
            .iter()
            .map(|&t| t as f32)
            .collect(),
    }
}

/// A timestep given as f64 that must be a whole number (DDIM, PNDM).
pub(crate) fn integer_timestep(class: &'static str, t: f64) -> Result<i64> {
    if t.fract() != 0.0 || !t.is_finite() {
        return Err(SchedulerError::BadTimestep {
            class,
            timestep: t,
            reason: "is not a whole number; pass a value from timesteps()".into(),
        });
    }
    Ok(t as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// diffusers' `alphas_cumprod` for every golden case, reproduced from the config: bit
    /// for bit, except after zero-SNR rescaling, where torch's vectorised f32 kernels round
    /// differently from scalar f32 (see the tolerance below).
    #[test]
    fn alphas_cumprod_match_diffusers() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/golden/");
        let meta: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(format!("{dir}schedulers.json")).unwrap(),
        )
        .unwrap();
        let bytes = std::fs::read(format!("{dir}schedulers.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (name, case) in meta["cases"].as_object().unwrap() {
            let Ok(theirs) = st.tensor(&format!("{name}.alphas_cumprod")) else {
                continue; // flow matching has no betas
            };
            let cfg = SchedulerConfig::from_json_str(&case["config"].to_string(), name).unwrap();
            let class = case["class"]
                .as_str()
                .unwrap()
                .parse::<crate::SchedulerKind>()
                .unwrap()
                .class_name();
            let rescale = cfg.rescale_betas_zero_snr && class != "PNDMScheduler";
            let mut ours = NoiseSchedule::new(&cfg, class, rescale)
                .unwrap()
                .alphas_cumprod;
            if rescale && (class.starts_with("Euler") || class.starts_with("DPM")) {
                *ours.last_mut().unwrap() = 2f32.powi(-24);
            }
            let theirs: Vec<f32> = theirs
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            assert_eq!(ours.len(), theirs.len(), "{name}");
            let ulps = ours
                .iter()
                .zip(&theirs)
                .map(|(a, b)| (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs())
                .max()
                .unwrap();
            // Zero-SNR rescaling subtracts nearly equal square roots near t = T, so an ulp of
            // torch's kernels there is tens of ulps of the result, and which ulp depends on
            // the CPU build: golden data from torch's AVX2 kernels were within 4 ulps of
            // ours, from its AVX-512 kernels (the current data) within 45.
            let allowed = if rescale { 64 } else { 0 };
            assert!(
                ulps <= allowed,
                "{name}: alphas_cumprod up to {ulps} ulps from diffusers'"
            );
        }
    }

    #[test]
    fn numpy_helpers_follow_numpy() {
        // np.arange(1000, 0, -1000 / 3) and np.linspace(0, 999, 4)
        assert_eq!(numpy_arange(1000.0, 0.0, -1000.0 / 3.0).len(), 3);
        assert_eq!(
            numpy_linspace(0.0, 999.0, 4),
            vec![0.0, 333.0, 666.0, 999.0]
        );
        assert_eq!(numpy_interp(2.5, &[0.0, 1.0, 2.0, 4.0]), 3.0);
        assert_eq!(numpy_interp(7.0, &[0.0, 1.0]), 1.0);
        // np.round rounds half to even: trailing spacing with 16 steps has 937.5 -> 938, minus 1.
        let ts = integer_timesteps(TimestepSpacing::Trailing, 1000, 16, 0);
        assert_eq!(&ts[..3], &[999, 937, 874]);
    }
}
