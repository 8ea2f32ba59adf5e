//! `DPMSolverSinglestepScheduler`: singlestep DPM-Solver++ (Lu et al. 2022), orders 1 to 3;
//! diffusers maps A1111's "DPM++ SDE" (and "DPM++ SDE Karras") to it.
//!
//! Steps come in groups of `order` (diffusers' `order_list`, e.g. 1, 2, 1, 2, ..): a group
//! starts from its first sample and each later step of the group updates that same start
//! sample with all predictions made since, so the group's last step is one higher-order
//! step over the group's interval. Coefficients come from the sigma table on the host.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::config::{AlgorithmType, FinalSigmasType, PredictionType, SchedulerConfig, SolverType};
use crate::dpmsolver_multistep::{
    lambda_clipped_count, vp_add_noise, vp_alpha_sigma, vp_lambda, vp_x0,
};
use crate::error::{Result, SchedulerError};
use crate::noise::NoiseSource;
use crate::ops::lincomb;
use crate::schedule::{check_steps, checked_multistep_timesteps, numpy_interp, NoiseSchedule};
use crate::sigma_steps::SigmaSteps;
use crate::sigmas::{check_one_sigma_kind, special_sigma_timesteps};
use crate::{Scheduler, SchedulerKind};

const CLASS: &str = "DPMSolverSinglestepScheduler";

fn unsupported<T>(message: impl Into<String>) -> Result<T> {
    Err(SchedulerError::Unsupported {
        class: CLASS,
        message: message.into(),
    })
}

/// diffusers' `get_order_list`: the order of each of `steps` steps.
fn order_list(steps: usize, order: usize, lower_order_final: bool, zero_final: bool) -> Vec<usize> {
    let repeat = |pattern: &[usize], times: usize| -> Vec<usize> {
        pattern
            .iter()
            .copied()
            .cycle()
            .take(pattern.len() * times)
            .collect()
    };
    let mut orders = match (order, lower_order_final) {
        (3, true) => match steps % 3 {
            0 => [repeat(&[1, 2, 3], steps / 3 - 1), vec![1, 2, 1]].concat(),
            1 => [repeat(&[1, 2, 3], steps / 3), vec![1]].concat(),
            _ => [repeat(&[1, 2, 3], steps / 3), vec![1, 2]].concat(),
        },
        (2, true) if steps.is_multiple_of(2) => {
            [repeat(&[1, 2], steps / 2 - 1), vec![1, 1]].concat()
        }
        (2, true) => [repeat(&[1, 2], steps / 2), vec![1]].concat(),
        (3, false) => repeat(&[1, 2, 3], steps / 3),
        (2, false) => repeat(&[1, 2], steps / 2),
        _ => vec![1; steps],
    };
    if zero_final {
        if let Some(last) = orders.last_mut() {
            *last = 1;
        }
    }
    orders
}

/// diffusers' `DPMSolverSinglestepScheduler` with the data-prediction algorithms
/// (`dpmsolver++`, `sde-dpmsolver++`).
pub struct DpmSolverSinglestepScheduler<B: Backend> {
    schedule: NoiseSchedule,
    num_train_timesteps: usize,
    solver_order: usize,
    prediction_type: PredictionType,
    sde: bool,
    heun: bool,
    /// diffusers turns this on for good (`register_to_config`) when a schedule needs it.
    lower_order_final: bool,
    use_karras_sigmas: bool,
    use_exponential_sigmas: bool,
    use_beta_sigmas: bool,
    final_sigmas_type: FinalSigmasType,
    lambda_min_clipped: f64,
    thresholding: bool,
    dynamic_thresholding_ratio: f64,
    sample_max_value: f64,
    steps: SigmaSteps,
    orders: Vec<usize>,
    /// The predicted clean samples of the current group, oldest first.
    model_outputs: Vec<Option<Tensor<B, 4>>>,
    /// The sample the current group started from.
    group_sample: Option<Tensor<B, 4>>,
}

impl<B: Backend> DpmSolverSinglestepScheduler<B> {
    pub fn new(cfg: &SchedulerConfig) -> Result<Self> {
        let sde = match cfg.algorithm_type.unwrap_or(AlgorithmType::DpmSolverPlusPlus) {
            AlgorithmType::DpmSolverPlusPlus | AlgorithmType::Deis => false,
            AlgorithmType::SdeDpmSolverPlusPlus => true,
            AlgorithmType::DpmSolver | AlgorithmType::SdeDpmSolver => {
                return unsupported(
                    "algorithm_type `dpmsolver` (noise prediction, deprecated in diffusers) is not supported; use `dpmsolver++` or `sde-dpmsolver++`",
                )
            }
        };
        // diffusers reads UniPC's and DEIS' solver types as midpoint.
        let heun = cfg.solver_type == Some(SolverType::Heun);
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
        Ok(Self {
            schedule: NoiseSchedule::new(cfg, CLASS, false)?,
            num_train_timesteps: cfg.num_train_timesteps,
            solver_order: cfg.solver_order,
            prediction_type: cfg.prediction_type,
            sde,
            heun,
            lower_order_final: cfg.lower_order_final.unwrap_or(false),
            use_karras_sigmas: cfg.use_karras_sigmas,
            use_exponential_sigmas: cfg.use_exponential_sigmas,
            use_beta_sigmas: cfg.use_beta_sigmas,
            final_sigmas_type: cfg.final_sigmas_type,
            lambda_min_clipped: cfg.lambda_min_clipped.unwrap_or(f64::NEG_INFINITY),
            thresholding: cfg.thresholding,
            dynamic_thresholding_ratio: cfg.dynamic_thresholding_ratio,
            sample_max_value: cfg.sample_max_value,
            steps: SigmaSteps {
                class: CLASS,
                ..Default::default()
            },
            orders: Vec::new(),
            model_outputs: Vec::new(),
            group_sample: None,
        })
    }

    /// The coefficients `(a, [w_newest, w_previous, w_before], c)` of
    /// `prev = a x_start + sum w_k x0_k + c z` for a step of `order` from the group's start
    /// `sigmas[i + 1 - order]` to `sigmas[i + 1]` (diffusers' `singlestep_dpm_solver_*`,
    /// with `D0`, `D1`, `D2` expanded into the predictions).
    fn update_coefficients(&self, i: usize, order: usize) -> (f64, [f64; 3], f64) {
        let s = &self.steps.sigmas;
        let (alpha_t, sigma_t) = vp_alpha_sigma(s[i + 1]);
        let start = i + 1 - order;
        let (_, sigma_start) = vp_alpha_sigma(s[start]);
        let lambda_t = vp_lambda(s[i + 1]);
        let lambda_start = vp_lambda(s[start]);
        let h = lambda_t - lambda_start;
        // Weights of the sample, D0, D1 (midpoint: 1/2 of D0's for order 2; order 3's D1_1
        // and heun's D1 share c1_h), D2, and the noise. At sigma_t = 0 only order 1 is used.
        let (a, c0, c1_mid, c1_h, c2, cz) = if self.sde {
            let om = -(-2.0 * h).exp_m1(); // 1 - exp(-2h)
            (
                sigma_t / sigma_start * (-h).exp(),
                alpha_t * om,
                0.5 * alpha_t * om,
                alpha_t * (om / (-2.0 * h) + 1.0),
                alpha_t * ((om - 2.0 * h) / (4.0 * h * h) - 0.5),
                sigma_t * om.sqrt(),
            )
        } else {
            let em1 = (-h).exp_m1(); // exp(-h) - 1
            (
                sigma_t / sigma_start,
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
                // D0 = m1, D1 = (m0 - m1) / r0.
                let r0 = (vp_lambda(s[i]) - lambda_start) / h;
                let c1 = if self.heun { c1_h } else { c1_mid };
                [c1 / r0, c0 - c1 / r0, 0.0]
            }
            _ => {
                // D0 = m2, D1_0 = (m1 - m2) / r1, D1_1 = (m0 - m2) / r0,
                // D1 = (r0 D1_0 - r1 D1_1) / (r0 - r1), D2 = 2 (D1_1 - D1_0) / (r0 - r1).
                let r0 = (vp_lambda(s[i]) - lambda_start) / h;
                let r1 = (vp_lambda(s[i - 1]) - lambda_start) / h;
                let (p, q) = if self.heun {
                    (
                        (c1_h * r0 - 2.0 * c2) / (r0 - r1),
                        (2.0 * c2 - c1_h * r1) / (r0 - r1),
                    )
                } else {
                    (0.0, c1_h)
                };
                [q / r0, p / r1, c0 - p / r1 - q / r0]
            }
        };
        (a, w, cz)
    }
}

impl<B: Backend> Scheduler<B> for DpmSolverSinglestepScheduler<B> {
    fn kind(&self) -> SchedulerKind {
        SchedulerKind::DpmSolverSinglestep
    }

    fn set_timesteps(&mut self, n: usize) -> Result<()> {
        check_steps(CLASS, n, self.num_train_timesteps)?;
        let last_timestep = self.num_train_timesteps
            - lambda_clipped_count(&self.schedule, self.lambda_min_clipped);
        // linspace(0, last - 1, n + 1).round()[::-1][:-1], whatever timestep_spacing says.
        let ints = checked_multistep_timesteps(
            CLASS,
            crate::config::TimestepSpacing::Linspace,
            self.num_train_timesteps,
            last_timestep,
            n,
            0,
        )?;
        let train = self.schedule.train_sigmas();
        let (timesteps, sigmas): (Vec<f64>, Vec<f64>) =
            if self.use_karras_sigmas || self.use_exponential_sigmas || self.use_beta_sigmas {
                special_sigma_timesteps(
                    &self.schedule.log_train_sigmas(),
                    self.use_karras_sigmas,
                    self.use_beta_sigmas,
                    true,
                    (train[0] as f64, train[train.len() - 1] as f64),
                    n,
                )
            } else {
                let ts: Vec<f64> = ints.iter().map(|&t| t as f64).collect();
                let sigmas = ts.iter().map(|&t| numpy_interp(t, &train)).collect();
                (ts, sigmas)
            };
        let zero_final = self.final_sigmas_type == FinalSigmasType::Zero;
        let mut sigmas: Vec<f32> = sigmas.iter().map(|&s| s as f32).collect();
        sigmas.push(if zero_final { 0.0 } else { train[0] });
        if !n.is_multiple_of(self.solver_order) || zero_final {
            self.lower_order_final = true;
        }
        self.orders = order_list(n, self.solver_order, self.lower_order_final, zero_final);
        self.steps.set(
            Vec::new(),
            sigmas,
            crate::config::TimestepSpacing::Linspace,
            true,
        );
        self.steps.timesteps = timesteps;
        self.model_outputs = vec![None; self.solver_order];
        self.group_sample = None;
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
        let x0 = vp_x0(
            self.prediction_type,
            self.steps.sigmas[i],
            model_output.clone(),
            sample.clone(),
            self.thresholding
                .then_some((self.dynamic_thresholding_ratio, self.sample_max_value)),
        );
        self.model_outputs.remove(0);
        self.model_outputs.push(Some(x0));
        let z = if self.sde {
            Some(noise.randn(model_output.dims(), &model_output.device())?)
        } else {
            None
        };
        let k = self.model_outputs.len();
        let mut order = self.orders.get(i).copied().unwrap_or(1);
        while order > 1 && self.model_outputs[k - order].is_none() {
            order -= 1;
        }
        if order == 1 {
            self.group_sample = Some(sample.clone());
        }
        let start = self.group_sample.clone().unwrap_or(sample);
        let (a, w, cz) = self.update_coefficients(i, order);
        let history = self
            .model_outputs
            .iter()
            .rev()
            .take(order)
            // All `order` newest entries are set: the loop above lowered the order until so.
            .filter_map(|m| m.clone())
            .zip(w);
        let prev = lincomb((start, a), history.chain(z.map(|z| (z, cz))));
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
