//! `DEISMultistepScheduler`: diffusion exponential integrator sampling (Zhang & Chen 2022),
//! the log-rho multistep variant, orders 1 to 3.
//!
//! Model outputs are converted to noise predictions; each step integrates the
//! exponential-integrator ODE in `rho = sigma_t / alpha_t` with a polynomial through the
//! last `order` noise predictions, whose integrals (the `ind_fn` of diffusers) give the host
//! coefficients. Schedules end on the smallest training sigma (never 0).

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::config::{AlgorithmType, PredictionType, SchedulerConfig, TimestepSpacing};
use crate::dpmsolver_multistep::{vp_add_noise, vp_alpha_sigma, vp_lambda, vp_x0};
use crate::error::{Result, SchedulerError};
use crate::noise::NoiseSource;
use crate::ops::lincomb;
use crate::schedule::{check_steps, checked_multistep_timesteps, numpy_interp, NoiseSchedule};
use crate::sigma_steps::SigmaSteps;
use crate::sigmas::{check_one_sigma_kind, special_sigma_timesteps};
use crate::{Scheduler, SchedulerKind};

const CLASS: &str = "DEISMultistepScheduler";

fn unsupported<T>(message: impl Into<String>) -> Result<T> {
    Err(SchedulerError::Unsupported {
        class: CLASS,
        message: message.into(),
    })
}

/// The second-order integral of diffusers' `multistep_deis_second_order_update`.
fn ind2(t: f64, b: f64, c: f64) -> f64 {
    t * (-c.ln() + t.ln() - 1.0) / (b.ln() - c.ln())
}

/// The third-order integral of diffusers' `multistep_deis_third_order_update`.
fn ind3(t: f64, b: f64, c: f64, d: f64) -> f64 {
    let (lt, lc, ld) = (t.ln(), c.ln(), d.ln());
    let numerator = t * (lc * (ld - lt + 1.0) - ld * lt + ld + lt * lt - 2.0 * lt + 2.0);
    numerator / ((b.ln() - lc) * (b.ln() - ld))
}

/// diffusers' `DEISMultistepScheduler` (`algorithm_type: deis`, `solver_type: logrho`).
pub struct DeisMultistepScheduler<B: Backend> {
    schedule: NoiseSchedule,
    num_train_timesteps: usize,
    solver_order: usize,
    prediction_type: PredictionType,
    lower_order_final: bool,
    use_karras_sigmas: bool,
    use_exponential_sigmas: bool,
    use_beta_sigmas: bool,
    timestep_spacing: TimestepSpacing,
    steps_offset: usize,
    thresholding: bool,
    dynamic_thresholding_ratio: f64,
    sample_max_value: f64,
    steps: SigmaSteps,
    /// The noise predictions of the last steps, oldest first (at most `solver_order`).
    model_outputs: Vec<Tensor<B, 4>>,
    lower_order_nums: usize,
}

impl<B: Backend> DeisMultistepScheduler<B> {
    pub fn new(cfg: &SchedulerConfig) -> Result<Self> {
        // diffusers reads `dpmsolver` and `dpmsolver++` as `deis`, any solver type as logrho.
        match cfg.algorithm_type.unwrap_or(AlgorithmType::Deis) {
            AlgorithmType::Deis | AlgorithmType::DpmSolver | AlgorithmType::DpmSolverPlusPlus => {}
            other => {
                let name = serde_json::to_string(&other).unwrap_or_default();
                return unsupported(format!(
                    "algorithm_type {name} is not implemented for DEIS (as in diffusers); set algorithm_type to \"deis\""
                ));
            }
        }
        if !(1..=3).contains(&cfg.solver_order) {
            return unsupported(format!(
                "solver_order must be 1, 2 or 3, got {}",
                cfg.solver_order
            ));
        }
        if cfg.use_flow_sigmas || cfg.use_dynamic_shifting {
            return unsupported("use_flow_sigmas and use_dynamic_shifting are not supported");
        }
        check_one_sigma_kind(cfg, CLASS)?;
        if cfg.thresholding && !(0.0..=1.0).contains(&cfg.dynamic_thresholding_ratio) {
            return unsupported(format!(
                "dynamic_thresholding_ratio must be in [0, 1], got {}",
                cfg.dynamic_thresholding_ratio
            ));
        }
        Ok(Self {
            schedule: NoiseSchedule::new(cfg, CLASS, false)?,
            num_train_timesteps: cfg.num_train_timesteps,
            solver_order: cfg.solver_order,
            prediction_type: cfg.prediction_type,
            lower_order_final: cfg.lower_order_final.unwrap_or(true),
            use_karras_sigmas: cfg.use_karras_sigmas,
            use_exponential_sigmas: cfg.use_exponential_sigmas,
            use_beta_sigmas: cfg.use_beta_sigmas,
            timestep_spacing: cfg
                .timestep_spacing
                .unwrap_or(SchedulerKind::DeisMultistep.default_timestep_spacing()),
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

    /// `(a, [w_newest, w_previous, w_before])` of `prev = a x + sum w_k eps_k` for a step of
    /// `order` from `sigmas[i]` to `sigmas[i + 1]`.
    fn update_coefficients(&self, i: usize, order: usize) -> (f64, [f64; 3]) {
        let s = &self.steps.sigmas;
        let (alpha_t, sigma_t) = vp_alpha_sigma(s[i + 1]);
        let (alpha_s0, sigma_s0) = vp_alpha_sigma(s[i]);
        let a = alpha_t / alpha_s0;
        match order {
            1 => {
                let h = vp_lambda(s[i + 1]) - vp_lambda(s[i]);
                (a, [-sigma_t * h.exp_m1(), 0.0, 0.0])
            }
            2 => {
                let (alpha_s1, sigma_s1) = vp_alpha_sigma(s[i - 1]);
                let (rt, r0, r1) = (sigma_t / alpha_t, sigma_s0 / alpha_s0, sigma_s1 / alpha_s1);
                let c1 = ind2(rt, r0, r1) - ind2(r0, r0, r1);
                let c2 = ind2(rt, r1, r0) - ind2(r0, r1, r0);
                (a, [alpha_t * c1, alpha_t * c2, 0.0])
            }
            _ => {
                let (alpha_s1, sigma_s1) = vp_alpha_sigma(s[i - 1]);
                let (alpha_s2, sigma_s2) = vp_alpha_sigma(s[i - 2]);
                let (rt, r0) = (sigma_t / alpha_t, sigma_s0 / alpha_s0);
                let (r1, r2) = (sigma_s1 / alpha_s1, sigma_s2 / alpha_s2);
                let c1 = ind3(rt, r0, r1, r2) - ind3(r0, r0, r1, r2);
                let c2 = ind3(rt, r1, r2, r0) - ind3(r0, r1, r2, r0);
                let c3 = ind3(rt, r2, r0, r1) - ind3(r0, r2, r0, r1);
                (a, [alpha_t * c1, alpha_t * c2, alpha_t * c3])
            }
        }
    }
}

impl<B: Backend> Scheduler<B> for DeisMultistepScheduler<B> {
    fn kind(&self) -> SchedulerKind {
        SchedulerKind::DeisMultistep
    }

    fn set_timesteps(&mut self, n: usize) -> Result<()> {
        check_steps(CLASS, n, self.num_train_timesteps)?;
        let ints = checked_multistep_timesteps(
            CLASS,
            self.timestep_spacing,
            self.num_train_timesteps,
            self.num_train_timesteps,
            n,
            self.steps_offset,
        )?;
        let train = self.schedule.train_sigmas();
        let special = self.use_karras_sigmas || self.use_exponential_sigmas || self.use_beta_sigmas;
        let (timesteps, sigmas): (Vec<f64>, Vec<f32>) = if special {
            let (timesteps, sigmas) = special_sigma_timesteps(
                &self.schedule.log_train_sigmas(),
                self.use_karras_sigmas,
                self.use_beta_sigmas,
                true,
                (train[0] as f64, train[train.len() - 1] as f64),
                n,
            );
            // The last sigma is repeated (a final step of length zero).
            let mut sigmas: Vec<f32> = sigmas.iter().map(|&s| s as f32).collect();
            sigmas.push(sigmas[sigmas.len() - 1]);
            (timesteps, sigmas)
        } else {
            let ts: Vec<f64> = ints.iter().map(|&t| t as f64).collect();
            let mut sigmas: Vec<f32> = ts.iter().map(|&t| numpy_interp(t, &train) as f32).collect();
            sigmas.push(train[0]);
            (ts, sigmas)
        };
        self.steps
            .set(Vec::new(), sigmas, TimestepSpacing::Linspace, true);
        self.steps.timesteps = timesteps;
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
        _noise: &mut dyn NoiseSource<B>,
    ) -> Result<Tensor<B, 4>> {
        let i = self.steps.index("step", timestep)?;
        let n = self.steps.timesteps.len();
        let short = self.lower_order_final && n < 15;
        let lower_order_final = i == n - 1 && short;
        let lower_order_second = i + 2 == n && short;

        // x0 as the prediction type defines it (thresholded), then eps = (x - alpha x0) / sigma.
        let sigma = self.steps.sigmas[i];
        let x0 = vp_x0(
            self.prediction_type,
            sigma,
            model_output,
            sample.clone(),
            self.thresholding
                .then_some((self.dynamic_thresholding_ratio, self.sample_max_value)),
        );
        let (alpha_t, sigma_t) = vp_alpha_sigma(sigma);
        let eps = lincomb((sample.clone(), 1.0 / sigma_t), [(x0, -alpha_t / sigma_t)]);
        if self.model_outputs.len() == self.solver_order {
            self.model_outputs.remove(0);
        }
        self.model_outputs.push(eps);

        let order = if self.solver_order == 1 || self.lower_order_nums < 1 || lower_order_final {
            1
        } else if self.solver_order == 2 || self.lower_order_nums < 2 || lower_order_second {
            2
        } else {
            3
        };
        let (a, w) = self.update_coefficients(i, order);
        let history = self.model_outputs.iter().rev().take(order).cloned().zip(w);
        let prev = lincomb((sample, a), history);
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
