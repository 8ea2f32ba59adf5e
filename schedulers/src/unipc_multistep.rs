//! `UniPCMultistepScheduler`: the unified predictor-corrector of Zhao et al. (2023);
//! A1111's "UniPC".
//!
//! Each step first corrects the sample the previous step predicted (UniC, using the new
//! model output), then predicts the next sample (UniP) from the last `order` converted model
//! outputs. Both are linear combinations whose weights come from a small linear system in
//! the log-SNR step ratios, solved on the host in f64.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::config::{
    FinalSigmasType, PredictionType, SchedulerConfig, SolverType, TimestepSpacing,
};
use crate::dpmsolver_multistep::{vp_add_noise, vp_alpha_sigma, vp_lambda, vp_x0};
use crate::error::{Result, SchedulerError};
use crate::noise::NoiseSource;
use crate::ops::lincomb;
use crate::schedule::{check_steps, checked_multistep_timesteps, numpy_interp, NoiseSchedule};
use crate::sigma_steps::SigmaSteps;
use crate::sigmas::{check_one_sigma_kind, special_sigma_timesteps};
use crate::{Scheduler, SchedulerKind};

const CLASS: &str = "UniPCMultistepScheduler";

/// diffusers' `UniPCMultistepScheduler` (without `solver_p`).
pub struct UniPcMultistepScheduler<B: Backend> {
    schedule: NoiseSchedule,
    num_train_timesteps: usize,
    solver_order: usize,
    prediction_type: PredictionType,
    predict_x0: bool,
    /// `bh1` (`B(h) = h`) or `bh2` (`B(h) = e^h - 1`).
    bh2: bool,
    lower_order_final: bool,
    disable_corrector: Vec<usize>,
    use_karras_sigmas: bool,
    use_exponential_sigmas: bool,
    use_beta_sigmas: bool,
    sigma_min: Option<f64>,
    sigma_max: Option<f64>,
    final_sigmas_type: FinalSigmasType,
    timestep_spacing: TimestepSpacing,
    steps_offset: usize,
    thresholding: bool,
    dynamic_thresholding_ratio: f64,
    sample_max_value: f64,
    steps: SigmaSteps,
    /// The converted model outputs of the last steps, oldest first (at most `solver_order`).
    model_outputs: Vec<Tensor<B, 4>>,
    /// The sample the last predictor started from, and that predictor's order.
    last_sample: Option<Tensor<B, 4>>,
    last_order: usize,
    lower_order_nums: usize,
}

fn unsupported<T>(message: impl Into<String>) -> Result<T> {
    Err(SchedulerError::Unsupported {
        class: CLASS,
        message: message.into(),
    })
}

/// Solves `a x = b` by Gaussian elimination with partial pivoting (a few unknowns).
fn solve(mut a: Vec<Vec<f64>>, mut b: Vec<f64>) -> Vec<f64> {
    let n = b.len();
    for col in 0..n {
        let pivot = (col..n)
            .max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))
            .unwrap_or(col);
        a.swap(col, pivot);
        b.swap(col, pivot);
        let (upper, lower) = a.split_at_mut(col + 1);
        let pivot_row = &upper[col];
        for (offset, row) in lower.iter_mut().enumerate() {
            let f = row[col] / pivot_row[col];
            for (x, p) in row[col..].iter_mut().zip(&pivot_row[col..]) {
                *x -= f * p;
            }
            b[col + 1 + offset] -= f * b[col];
        }
    }
    let mut x = vec![0.0; n];
    for row in (0..n).rev() {
        let s: f64 = (row + 1..n).map(|k| a[row][k] * x[k]).sum();
        x[row] = (b[row] - s) / a[row][row];
    }
    x
}

/// The shared part of UniP and UniC for one update from `sigma_s0` to `sigma_t` with
/// earlier sigmas `sigma_prev` (newest first): `(ratio, scale, h_phi_1, B_h, rks, rhs)`,
/// where `rks` are the step ratios (`r_k`, then 1) and `rhs` diffusers' `b`.
struct UniCoefficients {
    ratio: f64,
    scale: f64,
    h_phi_1: f64,
    b_h: f64,
    rks: Vec<f64>,
    rhs: Vec<f64>,
}

impl<B: Backend> UniPcMultistepScheduler<B> {
    pub fn new(cfg: &SchedulerConfig) -> Result<Self> {
        let bh2 = match cfg.solver_type.unwrap_or(SolverType::Bh2) {
            SolverType::Bh1 => false,
            // diffusers reads DPM-Solver's and DEIS' solver types as bh2.
            _ => true,
        };
        if !(1..=3).contains(&cfg.solver_order) {
            return unsupported(format!(
                "solver_order must be 1, 2 or 3, got {}",
                cfg.solver_order
            ));
        }
        if cfg.use_flow_sigmas {
            return unsupported(
                "use_flow_sigmas is not supported; use use_karras_sigmas, use_exponential_sigmas or use_beta_sigmas",
            );
        }
        check_one_sigma_kind(cfg, CLASS)?;
        let predict_x0 = cfg.predict_x0.unwrap_or(true);
        if cfg.final_sigmas_type == FinalSigmasType::Zero && !(bh2 && predict_x0) {
            // The last update goes to sigma 0, where lambda is infinite: bh1's B(h) = h and
            // the noise-prediction form's sigma_t (e^h - 1) are inf * 0. diffusers 0.42.1
            // returns NaN or inf there (or fails to solve for order 3); we refuse instead.
            return unsupported(format!(
                "{} with final_sigmas_type `zero` has no finite last step (diffusers 0.42.1 gives NaN/inf); set final_sigmas_type to `sigma_min`{}",
                if bh2 { "predict_x0 = false" } else { "solver_type bh1" },
                if bh2 { " or predict_x0 to true" } else { " or use solver_type bh2" }
            ));
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
            predict_x0,
            bh2,
            lower_order_final: cfg.lower_order_final.unwrap_or(true),
            disable_corrector: cfg.disable_corrector.clone(),
            use_karras_sigmas: cfg.use_karras_sigmas,
            use_exponential_sigmas: cfg.use_exponential_sigmas,
            use_beta_sigmas: cfg.use_beta_sigmas,
            sigma_min: cfg.sigma_min,
            sigma_max: cfg.sigma_max,
            final_sigmas_type: cfg.final_sigmas_type,
            timestep_spacing: cfg
                .timestep_spacing
                .unwrap_or(SchedulerKind::UniPcMultistep.default_timestep_spacing()),
            steps_offset: cfg.steps_offset,
            thresholding: cfg.thresholding,
            dynamic_thresholding_ratio: cfg.dynamic_thresholding_ratio,
            sample_max_value: cfg.sample_max_value,
            steps: SigmaSteps {
                class: CLASS,
                ..Default::default()
            },
            model_outputs: Vec::new(),
            last_sample: None,
            last_order: 0,
            lower_order_nums: 0,
        })
    }

    /// diffusers' `convert_model_output`: `x0` (with `predict_x0`) or the noise, as
    /// `a sample + b model_output`.
    fn convert(
        &self,
        model_output: Tensor<B, 4>,
        sample: Tensor<B, 4>,
        sigma: f64,
    ) -> Tensor<B, 4> {
        if self.predict_x0 {
            return vp_x0(
                self.prediction_type,
                sigma,
                model_output,
                sample,
                self.thresholding
                    .then_some((self.dynamic_thresholding_ratio, self.sample_max_value)),
            );
        }
        let (alpha_t, sigma_t) = vp_alpha_sigma(sigma);
        let (a, b) = match self.prediction_type {
            PredictionType::Epsilon => (0.0, 1.0),
            PredictionType::Sample => (1.0 / sigma_t, -alpha_t / sigma_t),
            PredictionType::VPrediction => (sigma_t, alpha_t),
        };
        lincomb((model_output, b), [(sample, a)])
    }

    /// The update from `sigmas[s0]` to `sigmas[t]` of `order`, the earlier points being
    /// `sigmas[s0 - 1]`, `sigmas[s0 - 2]`, ...
    fn coefficients(&self, t: usize, s0: usize, order: usize) -> UniCoefficients {
        let s = &self.steps.sigmas;
        let (alpha_t, sigma_t) = vp_alpha_sigma(s[t]);
        let (alpha_s0, sigma_s0) = vp_alpha_sigma(s[s0]);
        let lambda_s0 = vp_lambda(s[s0]);
        let h = vp_lambda(s[t]) - lambda_s0;
        let mut rks: Vec<f64> = (1..order)
            .map(|k| (vp_lambda(s[s0 - k]) - lambda_s0) / h)
            .collect();
        rks.push(1.0);
        let hh = if self.predict_x0 { -h } else { h };
        let h_phi_1 = hh.exp_m1();
        let mut h_phi_k = h_phi_1 / hh - 1.0;
        let mut factorial = 1.0;
        let b_h = if self.bh2 { hh.exp_m1() } else { hh };
        let mut rhs = Vec::with_capacity(order);
        for i in 1..=order {
            rhs.push(h_phi_k * factorial / b_h);
            factorial *= (i + 1) as f64;
            h_phi_k = h_phi_k / hh - 1.0 / factorial;
        }
        let (ratio, scale) = if self.predict_x0 {
            (sigma_t / sigma_s0, alpha_t)
        } else {
            (alpha_t / alpha_s0, sigma_t)
        };
        UniCoefficients {
            ratio,
            scale,
            h_phi_1,
            b_h,
            rks,
            rhs,
        }
    }

    /// `R` of diffusers' solve: row `i` holds `rks^i`, restricted to the first `n` rows and
    /// columns.
    fn vandermonde(rks: &[f64], n: usize) -> Vec<Vec<f64>> {
        (0..n)
            .map(|i| rks[..n].iter().map(|r| r.powi(i as i32)).collect())
            .collect()
    }

    /// UniP: the prediction from `sample` at step `i` with the stored outputs (newest is the
    /// current step's), as `(sample weight, output weights newest first)`.
    fn predictor(&self, i: usize, order: usize) -> (f64, Vec<f64>) {
        let c = self.coefficients(i + 1, i, order);
        let rhos: Vec<f64> = match order {
            1 => Vec::new(),
            2 => vec![0.5],
            _ => solve(
                Self::vandermonde(&c.rks, order - 1),
                c.rhs[..order - 1].to_vec(),
            ),
        };
        // x_t = ratio x - scale h_phi_1 m0 - scale B_h sum_k rho_k (m_k - m0) / r_k
        let k_scale = c.scale * c.b_h;
        let mut w = vec![-c.scale * c.h_phi_1];
        for (k, rho) in rhos.iter().enumerate() {
            let wk = -k_scale * rho / c.rks[k];
            w[0] -= wk;
            w.push(wk);
        }
        (c.ratio, w)
    }

    /// UniC: the correction of the sample predicted at step `i - 1` with `model_t` (this
    /// step's converted output), as `(last sample weight, model_t weight, stored output
    /// weights newest first)`.
    fn corrector(&self, i: usize, order: usize) -> (f64, f64, Vec<f64>) {
        let c = self.coefficients(i, i - 1, order);
        let rhos = match order {
            1 => vec![0.5],
            _ => solve(Self::vandermonde(&c.rks, order), c.rhs.clone()),
        };
        // x_t = ratio x - scale h_phi_1 m0
        //       - scale B_h (sum_k rho_k (m_k - m0) / r_k + rho_last (model_t - m0))
        let k_scale = c.scale * c.b_h;
        let rho_last = rhos[rhos.len() - 1];
        let mut w = vec![-c.scale * c.h_phi_1 + k_scale * rho_last];
        for (k, rho) in rhos[..rhos.len() - 1].iter().enumerate() {
            let wk = -k_scale * rho / c.rks[k];
            w[0] -= wk;
            w.push(wk);
        }
        (c.ratio, -k_scale * rho_last, w)
    }
}

impl<B: Backend> Scheduler<B> for UniPcMultistepScheduler<B> {
    fn kind(&self) -> SchedulerKind {
        SchedulerKind::UniPcMultistep
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
        let (timesteps, sigmas, sigma_min): (Vec<f64>, Vec<f64>, f64) =
            if self.use_karras_sigmas || self.use_exponential_sigmas || self.use_beta_sigmas {
                let (timesteps, sigmas) = special_sigma_timesteps(
                    &self.schedule.log_train_sigmas(),
                    self.use_karras_sigmas,
                    self.use_beta_sigmas,
                    true,
                    (
                        self.sigma_min.unwrap_or(train[0] as f64),
                        self.sigma_max.unwrap_or(train[train.len() - 1] as f64),
                    ),
                    n,
                );
                // Here sigma_min means the last of these sigmas.
                let last = sigmas[sigmas.len() - 1];
                (timesteps, sigmas, last)
            } else {
                let sigmas = ints
                    .iter()
                    .map(|&t| numpy_interp(t as f64, &train))
                    .collect();
                (
                    ints.iter().map(|&t| t as f64).collect(),
                    sigmas,
                    train[0] as f64,
                )
            };
        // diffusers stores timesteps as int64: fractional ones are truncated.
        let timesteps: Vec<f32> = timesteps.iter().map(|&t| t.trunc() as f32).collect();
        let mut sigmas: Vec<f32> = sigmas.iter().map(|&s| s as f32).collect();
        sigmas.push(match self.final_sigmas_type {
            FinalSigmasType::Zero => 0.0,
            FinalSigmasType::SigmaMin => sigma_min as f32,
        });
        self.steps
            .set(timesteps, sigmas, self.timestep_spacing, true);
        self.model_outputs.clear();
        self.last_sample = None;
        self.last_order = 0;
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
        let converted = self.convert(model_output, sample.clone(), self.steps.sigmas[i]);

        let sample = match &self.last_sample {
            Some(last) if i > 0 && !self.disable_corrector.contains(&(i - 1)) => {
                let (a, w_t, w) = self.corrector(i, self.last_order);
                let history = self.model_outputs.iter().rev().cloned().zip(w);
                lincomb((last.clone(), a), history.chain([(converted.clone(), w_t)]))
            }
            _ => sample,
        };

        if self.model_outputs.len() == self.solver_order {
            self.model_outputs.remove(0);
        }
        self.model_outputs.push(converted);
        let n = self.steps.timesteps.len();
        let order = if self.lower_order_final {
            self.solver_order.min(n - i)
        } else {
            self.solver_order
        };
        let order = order.min(self.lower_order_nums + 1);

        let (a, w) = self.predictor(i, order);
        let history = self.model_outputs.iter().rev().cloned().zip(w);
        let prev = lincomb((sample.clone(), a), history);

        self.last_sample = Some(sample);
        self.last_order = order;
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
