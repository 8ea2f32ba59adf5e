//! The sigma schedules shared by the k-diffusion, DPM-Solver, DEIS, UniPC and flow-matching
//! schedulers: Karras, exponential and beta sigmas, the map from a sigma back to its training
//! timestep, and the checks of the options that pick them.
//!
//! Host math in f64 over [`crate::schedule`]'s numpy and torch helpers, like the rest of the
//! schedule; nothing here touches a tensor.

use crate::config::{SchedulerConfig, TimestepSpacing};
use crate::error::{Result, SchedulerError};
use crate::schedule::{float_timesteps, numpy_interp, numpy_linspace, NoiseSchedule};

/// Karras et al. (2022) sigmas: `rho = 7` interpolation from sigma_max down to sigma_min.
pub(crate) fn karras_sigmas(sigma_min: f64, sigma_max: f64, n: usize) -> Vec<f64> {
    let rho = 7.0;
    let min_inv = sigma_min.powf(1.0 / rho);
    let max_inv = sigma_max.powf(1.0 / rho);
    numpy_linspace(0.0, 1.0, n)
        .iter()
        .map(|r| (max_inv + r * (min_inv - max_inv)).powf(rho))
        .collect()
}

/// Sigmas evenly spaced in log space from sigma_max down to sigma_min.
pub(crate) fn exponential_sigmas(sigma_min: f64, sigma_max: f64, n: usize) -> Vec<f64> {
    numpy_linspace(sigma_max.ln(), sigma_min.ln(), n)
        .iter()
        .map(|l| l.exp())
        .collect()
}

/// Exponential sigmas, or beta sigmas when `beta`: diffusers treats the two alike (timesteps
/// mapped back from the sigmas, not rounded).
pub(crate) fn exponential_or_beta_sigmas(
    beta: bool,
    sigma_min: f64,
    sigma_max: f64,
    n: usize,
) -> Vec<f64> {
    if beta {
        beta_sigmas(sigma_min, sigma_max, n)
    } else {
        exponential_sigmas(sigma_min, sigma_max, n)
    }
}

/// Beta sigmas ("Beta Sampling is All You Need", Lee et al. 2024), diffusers'
/// `_convert_to_beta` with alpha = beta = 0.6: `sigma_min + ppf(1 - r) (sigma_max - sigma_min)`
/// for `r = linspace(0, 1, n)`, `ppf` the inverse CDF of the Beta(0.6, 0.6) distribution
/// (scipy's `beta.ppf`; here by bisection on the regularized incomplete beta function, to
/// within a few f64 ulps).
pub(crate) fn beta_sigmas(sigma_min: f64, sigma_max: f64, n: usize) -> Vec<f64> {
    numpy_linspace(0.0, 1.0, n)
        .iter()
        .map(|r| sigma_min + beta_ppf(1.0 - r, 0.6, 0.6) * (sigma_max - sigma_min))
        .collect()
}

/// `ln Gamma(x)` for `x > 0`: the Lanczos approximation (g = 7, 9 terms), relative error
/// near 1e-15.
fn ln_gamma(x: f64) -> f64 {
    const G: f64 = 7.0;
    const C: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        // Reflection: Gamma(x) Gamma(1 - x) = pi / sin(pi x).
        let pi = std::f64::consts::PI;
        return (pi / (pi * x).sin()).ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let t = x + G + 0.5;
    let sum = C[1..]
        .iter()
        .enumerate()
        .fold(C[0], |acc, (i, c)| acc + c / (x + i as f64 + 1.0));
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + sum.ln()
}

/// The regularized incomplete beta function `I_x(a, b)`, by its continued fraction
/// (modified Lentz), on the side of `x` where it converges fast.
fn incomplete_beta(x: f64, a: f64, b: f64) -> f64 {
    if x <= 0.0 {
        return 0.0;
    }
    if x >= 1.0 {
        return 1.0;
    }
    if x > (a + 1.0) / (a + b + 2.0) {
        return 1.0 - incomplete_beta(1.0 - x, b, a);
    }
    let ln_front = a * x.ln() + b * (1.0 - x).ln() + ln_gamma(a + b) - ln_gamma(a) - ln_gamma(b);
    let tiny = 1e-300;
    let (mut c, mut d) = (1.0, 1.0 - (a + b) * x / (a + 1.0));
    if d.abs() < tiny {
        d = tiny;
    }
    d = 1.0 / d;
    let mut f = d;
    for m in 1..=300 {
        let m = m as f64;
        // The even term d_{2m}, then the odd term d_{2m+1}.
        for num in [
            m * (b - m) * x / ((a + 2.0 * m - 1.0) * (a + 2.0 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2.0 * m) * (a + 2.0 * m + 1.0)),
        ] {
            d = 1.0 + num * d;
            if d.abs() < tiny {
                d = tiny;
            }
            c = 1.0 + num / c;
            if c.abs() < tiny {
                c = tiny;
            }
            d = 1.0 / d;
            f *= c * d;
        }
        if (c * d - 1.0).abs() < 1e-16 {
            break;
        }
    }
    ln_front.exp() * f / a
}

/// The inverse of [`incomplete_beta`] in `x`: bisection to the last bit.
fn beta_ppf(q: f64, a: f64, b: f64) -> f64 {
    if q <= 0.0 {
        return 0.0;
    }
    if q >= 1.0 {
        return 1.0;
    }
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if mid <= lo || mid >= hi {
            break;
        }
        if incomplete_beta(mid, a, b) < q {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

/// diffusers' `_sigma_to_t`: the fractional training timestep whose log-sigma, interpolated
/// linearly between neighbours, equals `ln(sigma)`.
pub(crate) fn sigma_to_t(sigma: f64, log_sigmas: &[f32]) -> f64 {
    let log_sigma = sigma.max(1e-10).ln();
    // argmax of cumsum(log_sigmas <= log_sigma): the first index reaching the full count.
    let (mut count, mut best, mut low) = (0usize, 0usize, 0usize);
    for (i, &ls) in log_sigmas.iter().enumerate() {
        if log_sigma - ls as f64 >= 0.0 {
            count += 1;
        }
        if count > best {
            best = count;
            low = i;
        }
    }
    let low = low.min(log_sigmas.len() - 2);
    let (lo, hi) = (log_sigmas[low], log_sigmas[low + 1]);
    // numpy: f32 - f64 -> f64, but f32 - f32 stays f32.
    let w = ((lo as f64 - log_sigma) / (lo - hi) as f64).clamp(0.0, 1.0);
    (1.0 - w) * low as f64 + w * (low + 1) as f64
}

/// At most one of `use_karras_sigmas`, `use_exponential_sigmas` and `use_beta_sigmas`, as
/// every diffusers scheduler with these options demands.
pub(crate) fn check_one_sigma_kind(cfg: &SchedulerConfig, class: &'static str) -> Result<()> {
    let special = [
        cfg.use_karras_sigmas,
        cfg.use_exponential_sigmas,
        cfg.use_beta_sigmas,
    ];
    if special.iter().filter(|&&b| b).count() > 1 {
        return Err(SchedulerError::Unsupported {
            class,
            message: "only one of use_karras_sigmas, use_exponential_sigmas, use_beta_sigmas \
                      can be set"
                .into(),
        });
    }
    Ok(())
}

/// The sigma options of the Euler family (Euler, Heun, LMS): at most one of Karras,
/// exponential and beta sigmas may be set, and `zero_snr_ok` says whether the class takes
/// `rescale_betas_zero_snr`.
pub(crate) fn check_sigma_options(
    cfg: &SchedulerConfig,
    class: &'static str,
    zero_snr_ok: bool,
) -> Result<()> {
    let unsupported = |message: &str| {
        Err(SchedulerError::Unsupported {
            class,
            message: message.into(),
        })
    };
    check_one_sigma_kind(cfg, class)?;
    if cfg.rescale_betas_zero_snr && !zero_snr_ok {
        return unsupported("rescale_betas_zero_snr is not an option of this scheduler");
    }
    Ok(())
}

/// The Karras (or exponential, or beta) sigmas from `sigma_min` to `sigma_max` of the
/// multistep solvers, highest first, and their timesteps mapped back through the training
/// log-sigmas, Karras ones rounded when `round_karras`, all truncated as diffusers' int64 cast.
pub(crate) fn special_sigma_timesteps(
    log_sigmas: &[f32],
    karras: bool,
    beta: bool,
    round_karras: bool,
    (sigma_min, sigma_max): (f64, f64),
    n: usize,
) -> (Vec<f64>, Vec<f64>) {
    let sigmas = if karras {
        karras_sigmas(sigma_min, sigma_max, n)
    } else {
        exponential_or_beta_sigmas(beta, sigma_min, sigma_max, n)
    };
    let timesteps = sigmas
        .iter()
        .map(|&s| {
            let t = sigma_to_t(s, log_sigmas);
            if karras && round_karras {
                t.round_ties_even().trunc()
            } else {
                t.trunc()
            }
        })
        .collect();
    (timesteps, sigmas)
}

/// The timesteps and sigmas of the k-diffusion schedulers without `sigma_min`/`sigma_max`
/// options (Heun, LMS): spaced timesteps, their interpolated training sigmas, or Karras /
/// exponential / beta sigmas between the schedule's own ends with timesteps mapped back from
/// them. `exponential_or_beta`: `Some(false)` exponential, `Some(true)` beta.
pub(crate) fn k_sigma_schedule(
    schedule: &NoiseSchedule,
    spacing: TimestepSpacing,
    num_train: usize,
    n: usize,
    steps_offset: usize,
    karras: bool,
    exponential_or_beta: Option<bool>,
) -> (Vec<f32>, Vec<f64>) {
    let mut timesteps = float_timesteps(spacing, num_train, n, steps_offset);
    let train = schedule.train_sigmas();
    let mut sigmas: Vec<f64> = timesteps
        .iter()
        .map(|&t| numpy_interp(t as f64, &train))
        .collect();
    if (karras || exponential_or_beta.is_some()) && !sigmas.is_empty() {
        let (sigma_min, sigma_max) = (sigmas[sigmas.len() - 1], sigmas[0]);
        sigmas = match exponential_or_beta {
            _ if karras => karras_sigmas(sigma_min, sigma_max, n),
            Some(beta) => exponential_or_beta_sigmas(beta, sigma_min, sigma_max, n),
            None => unreachable!(),
        };
        let log_sigmas = schedule.log_train_sigmas();
        timesteps = sigmas
            .iter()
            .map(|&s| sigma_to_t(s, &log_sigmas) as f32)
            .collect();
    }
    (timesteps, sigmas)
}
