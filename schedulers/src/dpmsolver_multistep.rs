//! `DPMSolverMultistepScheduler`: DPM-Solver++ (Lu et al. 2022), multistep, orders 1 to 3;
//! A1111's "DPM++ 2M" (and "DPM++ 2M Karras" with `use_karras_sigmas`, "DPM++ 2M SDE"
//! with `algorithm_type: sde-dpmsolver++`).
//!
//! Each step converts the model output to a predicted clean sample `x0` and keeps the last
//! `solver_order` of them; the update is an exponential integrator in log-SNR `lambda`
//! over those, a linear combination `prev = a x + sum_k w_k x0_k (+ c z)` whose
//! coefficients come from the sigma table on the host.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::config::{
    AlgorithmType, BetaSchedule, FinalSigmasType, PredictionType, SchedulerConfig, SolverType,
    TimestepSpacing,
};
use crate::error::{Result, SchedulerError};
use crate::noise::NoiseSource;
use crate::ops::{check_add_noise, dynamic_threshold, lincomb, scale_per_item};
use crate::schedule::{check_steps, checked_multistep_timesteps, numpy_interp, NoiseSchedule};
use crate::sigma_steps::SigmaSteps;
use crate::sigmas::{check_one_sigma_kind, special_sigma_timesteps};
use crate::{Scheduler, SchedulerKind};

const CLASS: &str = "DPMSolverMultistepScheduler";

/// diffusers' `DPMSolverMultistepScheduler` with the data-prediction algorithms
/// (`dpmsolver++`, `sde-dpmsolver++`).
pub struct DpmSolverMultistepScheduler<B: Backend> {
    schedule: NoiseSchedule,
    num_train_timesteps: usize,
    solver_order: usize,
    prediction_type: PredictionType,
    sde: bool,
    solver_type: SolverType,
    lower_order_final: bool,
    euler_at_final: bool,
    use_karras_sigmas: bool,
    use_exponential_sigmas: bool,
    use_beta_sigmas: bool,
    /// `squaredcos_cap_v2` keeps Karras timesteps fractional; other schedules round them.
    round_special_timesteps: bool,
    sigma_min: Option<f64>,
    sigma_max: Option<f64>,
    final_sigmas_type: FinalSigmasType,
    lambda_min_clipped: f64,
    timestep_spacing: TimestepSpacing,
    steps_offset: usize,
    thresholding: bool,
    dynamic_thresholding_ratio: f64,
    sample_max_value: f64,
    steps: SigmaSteps,
    /// The predicted clean samples of the last steps, oldest first (at most `solver_order`).
    model_outputs: Vec<Tensor<B, 4>>,
    lower_order_nums: usize,
}

fn unsupported<T>(message: impl Into<String>) -> Result<T> {
    Err(SchedulerError::Unsupported {
        class: CLASS,
        message: message.into(),
    })
}

/// `alpha_t = 1 / sqrt(sigma^2 + 1)` and `sigma_t = sigma alpha_t` of the VP process whose
/// Karras sigma is `sigma`.
/// `add_noise` of the variance-preserving multistep solvers (DPM-Solver, UniPC):
/// `alpha_t * original + sigma_t * noise` at each item's timestep.
pub(crate) fn vp_add_noise<B: Backend>(
    class: &'static str,
    steps: &SigmaSteps,
    original: Tensor<B, 4>,
    noise: Tensor<B, 4>,
    timesteps: &[f64],
) -> Result<Tensor<B, 4>> {
    check_add_noise(class, &original, &noise, timesteps)?;
    let sigmas = steps.sigmas_for_add_noise(timesteps)?;
    let (alphas, sigma_ts): (Vec<f64>, Vec<f64>) =
        sigmas.iter().map(|&s| vp_alpha_sigma(s)).unzip();
    Ok(scale_per_item(original, &alphas) + scale_per_item(noise, &sigma_ts))
}

pub(crate) fn vp_alpha_sigma(sigma: f64) -> (f64, f64) {
    let alpha = 1.0 / (sigma * sigma + 1.0).sqrt();
    (alpha, sigma * alpha)
}

/// The log-SNR `lambda = ln(alpha_t) - ln(sigma_t)`; `+inf` at sigma 0.
pub(crate) fn vp_lambda(sigma: f64) -> f64 {
    let (alpha, sigma_t) = vp_alpha_sigma(sigma);
    alpha.ln() - sigma_t.ln()
}

/// The coefficients `(a, b)` of `x0 = a sample + b model_output` at `sigma`.
pub(crate) fn x0_coefficients(prediction: PredictionType, sigma: f64) -> (f64, f64) {
    let (alpha_t, sigma_t) = vp_alpha_sigma(sigma);
    match prediction {
        PredictionType::Epsilon => (1.0 / alpha_t, -sigma_t / alpha_t),
        PredictionType::VPrediction => (alpha_t, -sigma_t),
        PredictionType::Sample => (0.0, 1.0),
    }
}

/// diffusers' `convert_model_output` to `x0` (DPM-Solver, DEIS, UniPC): `a sample + b
/// model_output` by [`x0_coefficients`], then dynamically thresholded when `thresholding`
/// is `Some((dynamic_thresholding_ratio, sample_max_value))`.
pub(crate) fn vp_x0<B: Backend>(
    prediction: PredictionType,
    sigma: f64,
    model_output: Tensor<B, 4>,
    sample: Tensor<B, 4>,
    thresholding: Option<(f64, f64)>,
) -> Tensor<B, 4> {
    let (a, b) = x0_coefficients(prediction, sigma);
    let x0 = lincomb((model_output, b), [(sample, a)]);
    match thresholding {
        Some((ratio, max)) => dynamic_threshold(x0, ratio, max),
        None => x0,
    }
}

/// diffusers' `searchsorted(flip(lambda_t), lambda_min_clipped)` (DPM-Solver multistep and
/// singlestep): how many training timesteps, from the noisy end, have a log-SNR below the clip.
pub(crate) fn lambda_clipped_count(schedule: &NoiseSchedule, lambda_min_clipped: f64) -> usize {
    if lambda_min_clipped == f64::NEG_INFINITY {
        return 0;
    }
    // lambda_t = ln(sqrt(a)) - ln(sqrt(1 - a)) in f32, as diffusers' tensors.
    schedule
        .alphas_cumprod
        .iter()
        .filter(|&&a| {
            let l = (a.sqrt() as f64).ln() as f32 - ((1.0 - a).sqrt() as f64).ln() as f32;
            (l as f64) < lambda_min_clipped
        })
        .count()
}

impl<B: Backend> DpmSolverMultistepScheduler<B> {
    pub fn new(cfg: &SchedulerConfig) -> Result<Self> {
        let sde = match cfg.algorithm_type.unwrap_or(AlgorithmType::DpmSolverPlusPlus) {
            AlgorithmType::DpmSolverPlusPlus | AlgorithmType::Deis => false,
            AlgorithmType::SdeDpmSolverPlusPlus => true,
            AlgorithmType::DpmSolver | AlgorithmType::SdeDpmSolver => {
                return unsupported(
                    "algorithm_type `dpmsolver` and `sde-dpmsolver` (deprecated in diffusers) are not supported; use `dpmsolver++` or `sde-dpmsolver++`",
                )
            }
        };
        let solver_type = match cfg.solver_type.unwrap_or(SolverType::Midpoint) {
            SolverType::Heun => SolverType::Heun,
            _ => SolverType::Midpoint,
        };
        if !(1..=3).contains(&cfg.solver_order) {
            return unsupported(format!(
                "solver_order must be 1, 2 or 3, got {}",
                cfg.solver_order
            ));
        }
        if cfg.use_lu_lambdas || cfg.use_flow_sigmas {
            return unsupported(
                "use_lu_lambdas and use_flow_sigmas are not supported; use use_karras_sigmas, use_exponential_sigmas or use_beta_sigmas",
            );
        }
        check_one_sigma_kind(cfg, CLASS)?;
        if cfg.variance_type.is_some() {
            return unsupported(
                "variance_type `learned`/`learned_range` (6-channel model outputs) is not supported",
            );
        }
        if cfg.thresholding && !(0.0..=1.0).contains(&cfg.dynamic_thresholding_ratio) {
            return unsupported(format!(
                "dynamic_thresholding_ratio must be in [0, 1], got {}",
                cfg.dynamic_thresholding_ratio
            ));
        }
        let mut schedule = NoiseSchedule::new(cfg, CLASS, cfg.rescale_betas_zero_snr)?;
        if cfg.rescale_betas_zero_snr {
            let last = schedule.alphas_cumprod.len() - 1;
            schedule.alphas_cumprod[last] = 2f32.powi(-24);
        }
        Ok(Self {
            schedule,
            num_train_timesteps: cfg.num_train_timesteps,
            solver_order: cfg.solver_order,
            prediction_type: cfg.prediction_type,
            sde,
            solver_type,
            lower_order_final: cfg.lower_order_final.unwrap_or(true),
            euler_at_final: cfg.euler_at_final,
            use_karras_sigmas: cfg.use_karras_sigmas,
            use_exponential_sigmas: cfg.use_exponential_sigmas,
            use_beta_sigmas: cfg.use_beta_sigmas,
            round_special_timesteps: cfg.beta_schedule != Some(BetaSchedule::SquaredcosCapV2)
                || cfg.trained_betas.is_some(),
            sigma_min: cfg.sigma_min,
            sigma_max: cfg.sigma_max,
            final_sigmas_type: cfg.final_sigmas_type,
            lambda_min_clipped: cfg.lambda_min_clipped.unwrap_or(f64::NEG_INFINITY),
            timestep_spacing: cfg
                .timestep_spacing
                .unwrap_or(SchedulerKind::DpmSolverMultistep.default_timestep_spacing()),
            steps_offset: cfg.steps_offset,
            thresholding: cfg.thresholding,
            dynamic_thresholding_ratio: cfg.dynamic_thresholding_ratio,
            sample_max_value: cfg.sample_max_value,
            steps: SigmaSteps {
                class: CLASS,
                ..Default::default()
            },
            model_outputs: Vec::new(),
            lower_order_nums: 0,
        })
    }

    /// diffusers' `searchsorted(flip(lambda_t), lambda_min_clipped)`: how many training
    /// timesteps (from the noisy end) have a log-SNR below the clip.
    fn clipped_count(&self) -> usize {
        lambda_clipped_count(&self.schedule, self.lambda_min_clipped)
    }

    /// The coefficients `(a, [w_0, w_1, w_2], c)` of
    /// `prev = a x + w_0 x0_newest + w_1 x0_previous + w_2 x0_before + c z` for a step of
    /// `order` from `sigmas[i]` to `sigmas[i + 1]` (diffusers' `*_order_update`, with
    /// `D0`, `D1`, `D2` expanded into the stored predictions).
    fn update_coefficients(&self, i: usize, order: usize) -> (f64, [f64; 3], f64) {
        let s = &self.steps.sigmas;
        let (alpha_t, sigma_t) = vp_alpha_sigma(s[i + 1]);
        let (_, sigma_s0) = vp_alpha_sigma(s[i]);
        let lambda_t = vp_lambda(s[i + 1]);
        let lambda_s0 = vp_lambda(s[i]);
        let h = lambda_t - lambda_s0;
        // The ODE (`dpmsolver++`) and SDE (`sde-dpmsolver++`) forms: the sample's weight,
        // the weights of D0, of D1 (midpoint, and heun and third order) and of D2, and the
        // noise's weight. At sigma_t = 0, h = inf: exp(-h) = 0, and only the first order
        // (whose weights stay finite) is used there.
        let (a, c0, c1_mid, c1_heun, c2, cz) = if self.sde {
            let one_minus = -(-2.0 * h).exp_m1(); // 1 - exp(-2h)
            (
                sigma_t / sigma_s0 * (-h).exp(),
                alpha_t * one_minus,
                0.5 * alpha_t * one_minus,
                alpha_t * (one_minus / (-2.0 * h) + 1.0),
                alpha_t * ((one_minus - 2.0 * h) / (2.0 * h).powi(2) - 0.5),
                sigma_t * one_minus.sqrt(),
            )
        } else {
            let em1 = (-h).exp_m1(); // exp(-h) - 1
            (
                sigma_t / sigma_s0,
                -alpha_t * em1,
                -0.5 * alpha_t * em1,
                alpha_t * (em1 / h + 1.0),
                -alpha_t * ((em1 + h) / (h * h) - 0.5),
                0.0,
            )
        };
        let w = match order {
            1 => [c0, 0.0, 0.0],
            2 => {
                let h_0 = lambda_s0 - vp_lambda(s[i - 1]);
                let r0 = h_0 / h;
                let c1 = match self.solver_type {
                    SolverType::Heun => c1_heun,
                    _ => c1_mid,
                };
                // D1 = (m0 - m1) / r0
                [c0 + c1 / r0, -c1 / r0, 0.0]
            }
            _ => {
                let lambda_s1 = vp_lambda(s[i - 1]);
                let h_0 = lambda_s0 - lambda_s1;
                let h_1 = lambda_s1 - vp_lambda(s[i - 2]);
                let (r0, r1) = (h_0 / h, h_1 / h);
                // D1_0 = (m0 - m1) / r0, D1_1 = (m1 - m2) / r1,
                // D1 = D1_0 + r0 / (r0 + r1) (D1_0 - D1_1), D2 = (D1_0 - D1_1) / (r0 + r1).
                let k = r0 / (r0 + r1);
                let (d1_0, d1_1) = (
                    c1_heun * (1.0 + k) + c2 / (r0 + r1),
                    -(c1_heun * k + c2 / (r0 + r1)),
                );
                [c0 + d1_0 / r0, -d1_0 / r0 + d1_1 / r1, -d1_1 / r1]
            }
        };
        (a, w, cz)
    }
}

impl<B: Backend> Scheduler<B> for DpmSolverMultistepScheduler<B> {
    fn kind(&self) -> SchedulerKind {
        SchedulerKind::DpmSolverMultistep
    }

    fn set_timesteps(&mut self, n: usize) -> Result<()> {
        check_steps(CLASS, n, self.num_train_timesteps)?;
        let last_timestep = self.num_train_timesteps - self.clipped_count();
        let ints = checked_multistep_timesteps(
            CLASS,
            self.timestep_spacing,
            self.num_train_timesteps,
            last_timestep,
            n,
            self.steps_offset,
        )?;
        let train = self.schedule.train_sigmas();
        let (timesteps, sigmas): (Vec<f64>, Vec<f64>) =
            if self.use_karras_sigmas || self.use_exponential_sigmas || self.use_beta_sigmas {
                // diffusers rounds Karras timesteps (except for the cosine schedule) but
                // not exponential ones.
                special_sigma_timesteps(
                    &self.schedule.log_train_sigmas(),
                    self.use_karras_sigmas,
                    self.use_beta_sigmas,
                    self.round_special_timesteps,
                    (
                        self.sigma_min.unwrap_or(train[0] as f64),
                        self.sigma_max.unwrap_or(train[train.len() - 1] as f64),
                    ),
                    n,
                )
            } else {
                let sigmas = ints
                    .iter()
                    .map(|&t| numpy_interp(t as f64, &train))
                    .collect();
                (ints.iter().map(|&t| t as f64).collect(), sigmas)
            };
        // diffusers stores timesteps as int64: fractional ones are truncated.
        let timesteps: Vec<f32> = timesteps.iter().map(|&t| t.trunc() as f32).collect();
        let last = match self.final_sigmas_type {
            FinalSigmasType::Zero => 0.0,
            FinalSigmasType::SigmaMin => train[0],
        };
        let mut sigmas: Vec<f32> = sigmas.iter().map(|&s| s as f32).collect();
        sigmas.push(last);
        self.steps
            .set(timesteps, sigmas, self.timestep_spacing, true);
        self.model_outputs.clear();
        self.lower_order_nums = 0;
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
        let i = self.steps.index("step", timestep)?;
        let n = self.steps.timesteps.len();
        let short = self.lower_order_final && n < 15;
        let lower_order_final = i == n - 1
            && (self.euler_at_final || short || self.final_sigmas_type == FinalSigmasType::Zero);
        let lower_order_second = i + 2 == n && short;

        let x0 = vp_x0(
            self.prediction_type,
            self.steps.sigmas[i],
            model_output.clone(),
            sample.clone(),
            self.thresholding
                .then_some((self.dynamic_thresholding_ratio, self.sample_max_value)),
        );
        if self.model_outputs.len() == self.solver_order {
            self.model_outputs.remove(0);
        }
        self.model_outputs.push(x0);
        let z = if self.sde {
            Some(noise.randn(model_output.dims(), &model_output.device())?)
        } else {
            None
        };

        let order = if self.solver_order == 1 || self.lower_order_nums < 1 || lower_order_final {
            1
        } else if self.solver_order == 2 || self.lower_order_nums < 2 || lower_order_second {
            2
        } else {
            3
        };
        let (a, w, cz) = self.update_coefficients(i, order);
        let history = self.model_outputs.iter().rev().take(order).cloned().zip(w);
        let prev = lincomb((sample, a), history.chain(z.map(|z| (z, cz))));
        if self.lower_order_nums < self.solver_order {
            self.lower_order_nums += 1;
        }
        self.steps.step_index = Some(i + 1);
        Ok(prev)
    }

    fn add_noise(
        &self,
        original: Tensor<B, 4>,
        noise: Tensor<B, 4>,
        timesteps: &[f64],
    ) -> Result<Tensor<B, 4>> {
        vp_add_noise(CLASS, &self.steps, original, noise, timesteps)
    }

    fn sigmas(&self) -> Option<&[f64]> {
        self.steps.initialized.then_some(&self.steps.sigmas[..])
    }

    fn set_begin_index(&mut self, begin_index: usize) {
        self.steps.begin_index = Some(begin_index);
    }
}
