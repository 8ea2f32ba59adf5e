//! Diffusion schedulers, ported from diffusers with its numerics.
//!
//! Used by `pipelines/` only. Each scheduler lives in its own file and keeps diffusers'
//! split: host math (timesteps, sigmas, per-step coefficients, in f64 from diffusers' f32
//! tables) apart from tensor math, which is only scalar multiplications and additions on
//! burn `Tensor`s and so runs on any backend, including inside a compiled step.
//!
//! Implemented (diffusers classes): PNDM, DDIM, DDPM, Euler, Euler ancestral, Heun, LMS,
//! KDPM2, KDPM2 ancestral, DPM-Solver++ multistep and singlestep, UniPC, DEIS, LCM, TCD, and the flow-matching
//! Euler and Heun schedulers of SD3 and Flux. Flow-matching schedulers have no input scaling
//! (identity), unit initial noise, and timesteps `sigma * num_train_timesteps`; Flux and SD3
//! pipelines pass `mu` and custom sigmas through [`Scheduler::set_timesteps_with`]:
//!
//! ```text
//! let n = 28;
//! let sigmas = (0..n).map(|i| 1.0 - i as f64 * (1.0 - 1.0 / n as f64) / (n - 1) as f64);
//! let options = TimestepOptions {
//!     sigmas: Some(sigmas.collect()),              // np.linspace(1, 1/n, n)
//!     mu: Some(calculate_shift(image_seq_len, &cfg)), // (h/16) * (w/16) tokens for Flux
//!     ..Default::default()
//! };
//! sched.set_timesteps_with(n, &options)?;
//! ```
//!
//! UniPC with a zero final sigma and `bh1` (or `predict_x0 = false`) is refused: diffusers
//! 0.42.1 gives NaN/inf on its last step there; `final_sigmas_type = "sigma_min"` works.
//!
//! ```text
//! let cfg = SchedulerConfig::from_file("scheduler/scheduler_config.json")?;
//! let cfg = cfg.switched_to("euler_a".parse()?);   // optional: --scheduler
//! let mut sched = scheduler_from_config::<B>(&cfg)?;
//! sched.set_timesteps(30)?;
//! let mut latents = noise * sched.init_noise_sigma();
//! for &t in sched.timesteps().to_vec().iter() {
//!     let x = sched.scale_model_input(latents.clone(), t)?;
//!     let eps = unet(x, t);
//!     latents = sched.step(eps, t, latents, &mut rng)?;
//! }
//! ```

use std::fmt;
use std::str::FromStr;

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

mod cm_stochastic_iterative;
mod config;
mod ddim;
mod ddpm;
mod deis_multistep;
mod dpmsolver_multistep;
mod dpmsolver_singlestep;
mod error;
mod euler;
mod euler_ancestral;
mod flow_match_euler;
mod flow_match_heun;
mod heun_discrete;
mod k_dpm_2_ancestral_discrete;
mod k_dpm_2_discrete;
mod lcm;
mod lms_discrete;
mod noise;
mod ops;
mod pndm;
mod schedule;
mod sigma_steps;
mod sigmas;
mod tcd;
mod unipc_multistep;

pub use cm_stochastic_iterative::{sigma_to_t as cm_sigma_to_t, CmStochasticIterativeScheduler};
pub use config::{
    AlgorithmType, BetaSchedule, FinalSigmasType, InterpolationType, PredictionType,
    SchedulerConfig, SolverType, TimeShiftType, TimestepSpacing, TimestepType, VarianceType,
};
pub use ddim::DdimScheduler;
pub use ddpm::DdpmScheduler;
pub use deis_multistep::DeisMultistepScheduler;
pub use dpmsolver_multistep::DpmSolverMultistepScheduler;
pub use dpmsolver_singlestep::DpmSolverSinglestepScheduler;
pub use error::{Result, SchedulerError};
pub use euler::EulerDiscreteScheduler;
pub use euler_ancestral::EulerAncestralDiscreteScheduler;
pub use flow_match_euler::{calculate_shift, FlowMatchEulerDiscreteScheduler};
pub use flow_match_heun::FlowMatchHeunDiscreteScheduler;
pub use heun_discrete::HeunDiscreteScheduler;
pub use k_dpm_2_ancestral_discrete::KDpm2AncestralDiscreteScheduler;
pub use k_dpm_2_discrete::KDpm2DiscreteScheduler;
pub use lcm::LcmScheduler;
pub use lms_discrete::LmsDiscreteScheduler;
pub use noise::{NoNoise, NoiseSource, RecordedNoise, TorchCpuGenerator, TorchCpuGenerators};
pub use pndm::PndmScheduler;
pub use tcd::TcdScheduler;
pub use unipc_multistep::UniPcMultistepScheduler;

/// The scheduler interface the pipelines drive, as in diffusers' denoising loop.
pub trait Scheduler<B: Backend>: Send {
    /// Which algorithm this is.
    fn kind(&self) -> SchedulerKind;

    /// Computes the inference schedule; must precede `step`. Resets all step state.
    fn set_timesteps(&mut self, num_inference_steps: usize) -> Result<()>;

    /// The timesteps the denoiser receives, in loop order (diffusers' `scheduler.timesteps`);
    /// empty before `set_timesteps`. PNDM's PRK warm-up and Heun's second stage repeat
    /// timesteps.
    fn timesteps(&self) -> &[f64];

    /// The standard deviation of the initial noise: latents are `randn * init_noise_sigma`.
    fn init_noise_sigma(&self) -> f64;

    /// Denoiser evaluations per step, diffusers' `scheduler.order`: 2 for Heun, 1 for the
    /// others. `timesteps()` already lists every evaluation, so a pipeline loops over it
    /// once either way; `order` only tells how many entries make one step (progress bars).
    fn order(&self) -> usize {
        1
    }

    /// Scales the denoiser input for `timestep` (Euler: `sample / sqrt(sigma^2 + 1)`; others: identity).
    fn scale_model_input(&self, sample: Tensor<B, 4>, timestep: f64) -> Result<Tensor<B, 4>>;

    /// One denoising step from `timestep`; returns the previous (less noisy) sample.
    /// Stochastic schedulers draw their noise from `noise`.
    fn step(
        &mut self,
        model_output: Tensor<B, 4>,
        timestep: f64,
        sample: Tensor<B, 4>,
        noise: &mut dyn NoiseSource<B>,
    ) -> Result<Tensor<B, 4>>;

    /// The forward process: `original` noised to each batch item's timestep (img2img, inpainting).
    /// `timesteps` has one entry per batch item, or one for the whole batch.
    fn add_noise(
        &self,
        original: Tensor<B, 4>,
        noise: Tensor<B, 4>,
        timesteps: &[f64],
    ) -> Result<Tensor<B, 4>>;

    /// The sigmas of sigma-based schedulers (one more than the timesteps); `None` otherwise.
    fn sigmas(&self) -> Option<&[f64]> {
        None
    }

    /// Starts the schedule at step `begin_index` (img2img); diffusers' `set_begin_index`.
    /// Schedulers that look timesteps up by value ignore it.
    fn set_begin_index(&mut self, _begin_index: usize) {}

    /// DDIM's `eta` (0: deterministic DDIM, 1: DDPM-like). Ignored by schedulers without one,
    /// as diffusers' pipelines only pass `eta` to schedulers whose `step` accepts it.
    fn set_eta(&mut self, _eta: f64) {}

    /// `set_timesteps` with diffusers' keyword arguments (`sigmas=`, `mu=`), as the Flux and
    /// SD3 pipelines call it. With default options this is `set_timesteps(n)`; a scheduler
    /// that takes none of the options given (diffusers' `retrieve_timesteps` checks
    /// `set_timesteps`' signature the same way) returns [`SchedulerError::Unsupported`].
    /// `FlowMatchEulerDiscreteScheduler` takes both.
    fn set_timesteps_with(
        &mut self,
        num_inference_steps: usize,
        options: &TimestepOptions,
    ) -> Result<()> {
        if *options != TimestepOptions::default() {
            return Err(SchedulerError::Unsupported {
                class: self.kind().class_name(),
                message: format!(
                    "set_timesteps takes no {}; only FlowMatchEulerDiscreteScheduler takes custom sigmas, timesteps and mu",
                    options.given()
                ),
            });
        }
        self.set_timesteps(num_inference_steps)
    }
}

/// The optional arguments of [`Scheduler::set_timesteps_with`].
///
/// Flux: `sigmas = linspace(1, 1/n, n)` and `mu = calculate_shift(image_seq_len, ..)`
/// (see [`calculate_shift`]); SD3 3.5 with `use_dynamic_shifting`: only `mu`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TimestepOptions {
    /// Custom sigmas, one per step, noisiest first, before shifting (diffusers' `sigmas=`);
    /// `num_inference_steps` must equal their count.
    pub sigmas: Option<Vec<f64>>,
    /// The resolution-dependent shift of `use_dynamic_shifting` (diffusers' `mu=`); required
    /// exactly when the config sets `use_dynamic_shifting`.
    pub mu: Option<f64>,
    /// Custom timesteps, one per step (diffusers' `timesteps=`), used as given; without
    /// `sigmas`, the sigmas are `timesteps / num_train_timesteps`, then shifted.
    pub timesteps: Option<Vec<f64>>,
}

impl TimestepOptions {
    /// The names of the options that are set, for error messages.
    fn given(&self) -> String {
        let mut names = Vec::new();
        if self.sigmas.is_some() {
            names.push("sigmas");
        }
        if self.mu.is_some() {
            names.push("mu");
        }
        if self.timesteps.is_some() {
            names.push("timesteps");
        }
        names.join(" or ")
    }
}

/// Builds the scheduler named by the config's `_class_name`.
pub fn scheduler_from_config<B: Backend>(cfg: &SchedulerConfig) -> Result<Box<dyn Scheduler<B>>> {
    Ok(match cfg.kind()? {
        SchedulerKind::Pndm => Box::new(PndmScheduler::new(cfg)?),
        SchedulerKind::Ddim => Box::new(DdimScheduler::new(cfg)?),
        SchedulerKind::EulerDiscrete => Box::new(EulerDiscreteScheduler::new(cfg)?),
        SchedulerKind::EulerAncestralDiscrete => {
            Box::new(EulerAncestralDiscreteScheduler::new(cfg)?)
        }
        SchedulerKind::DpmSolverMultistep => Box::new(DpmSolverMultistepScheduler::new(cfg)?),
        SchedulerKind::Ddpm => Box::new(DdpmScheduler::new(cfg)?),
        SchedulerKind::LmsDiscrete => Box::new(LmsDiscreteScheduler::new(cfg)?),
        SchedulerKind::HeunDiscrete => Box::new(HeunDiscreteScheduler::new(cfg)?),
        SchedulerKind::UniPcMultistep => Box::new(UniPcMultistepScheduler::new(cfg)?),
        SchedulerKind::CmStochasticIterative => Box::new(CmStochasticIterativeScheduler::new(cfg)?),
        SchedulerKind::FlowMatchEulerDiscrete => {
            Box::new(FlowMatchEulerDiscreteScheduler::new(cfg)?)
        }
        SchedulerKind::FlowMatchHeunDiscrete => Box::new(FlowMatchHeunDiscreteScheduler::new(cfg)?),
        SchedulerKind::KDpm2Discrete => Box::new(KDpm2DiscreteScheduler::new(cfg)?),
        SchedulerKind::KDpm2AncestralDiscrete => {
            Box::new(KDpm2AncestralDiscreteScheduler::new(cfg)?)
        }
        SchedulerKind::Lcm => Box::new(LcmScheduler::new(cfg)?),
        SchedulerKind::Tcd => Box::new(TcdScheduler::new(cfg)?),
        SchedulerKind::DpmSolverSinglestep => Box::new(DpmSolverSinglestepScheduler::new(cfg)?),
        SchedulerKind::DeisMultistep => Box::new(DeisMultistepScheduler::new(cfg)?),
    })
}

/// The scheduler algorithms this crate implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SchedulerKind {
    /// `PNDMScheduler` (PLMS, with the Runge-Kutta warm-up unless `skip_prk_steps`).
    Pndm,
    /// `DDIMScheduler`.
    Ddim,
    /// `EulerDiscreteScheduler`.
    EulerDiscrete,
    /// `EulerAncestralDiscreteScheduler`.
    EulerAncestralDiscrete,
    /// `DPMSolverMultistepScheduler` (DPM-Solver++ 2M; Karras and SDE are config options).
    DpmSolverMultistep,
    /// `DDPMScheduler` (ancestral DDPM sampling).
    Ddpm,
    /// `LMSDiscreteScheduler` (k-diffusion's linear multistep, order 4).
    LmsDiscrete,
    /// `HeunDiscreteScheduler` (Heun's second-order method, two evaluations per step).
    HeunDiscrete,
    /// `UniPCMultistepScheduler` (UniPC predictor-corrector, bh2 by default).
    UniPcMultistep,
    /// `CMStochasticIterativeScheduler` (consistency-model multistep sampling).
    CmStochasticIterative,
    /// `FlowMatchEulerDiscreteScheduler` (rectified flow: SD3, Flux).
    FlowMatchEulerDiscrete,
    /// `FlowMatchHeunDiscreteScheduler` (rectified flow, Heun's method).
    FlowMatchHeunDiscrete,
    /// `KDPM2DiscreteScheduler` (DPM-Solver-2, two evaluations per step; A1111's "DPM2").
    KDpm2Discrete,
    /// `KDPM2AncestralDiscreteScheduler` (A1111's "DPM2 a").
    KDpm2AncestralDiscrete,
    /// `LCMScheduler` (latent consistency models, LCM-LoRA).
    Lcm,
    /// `TCDScheduler` (trajectory consistency distillation; `eta` is its gamma).
    Tcd,
    /// `DPMSolverSinglestepScheduler` (singlestep DPM-Solver++; diffusers' "DPM++ SDE").
    DpmSolverSinglestep,
    /// `DEISMultistepScheduler` (log-rho DEIS, orders 1-3).
    DeisMultistep,
}

impl SchedulerKind {
    pub const ALL: [SchedulerKind; 18] = [
        SchedulerKind::Pndm,
        SchedulerKind::Ddim,
        SchedulerKind::EulerDiscrete,
        SchedulerKind::EulerAncestralDiscrete,
        SchedulerKind::DpmSolverMultistep,
        SchedulerKind::Ddpm,
        SchedulerKind::LmsDiscrete,
        SchedulerKind::HeunDiscrete,
        SchedulerKind::UniPcMultistep,
        SchedulerKind::CmStochasticIterative,
        SchedulerKind::FlowMatchEulerDiscrete,
        SchedulerKind::FlowMatchHeunDiscrete,
        SchedulerKind::KDpm2Discrete,
        SchedulerKind::KDpm2AncestralDiscrete,
        SchedulerKind::Lcm,
        SchedulerKind::Tcd,
        SchedulerKind::DpmSolverSinglestep,
        SchedulerKind::DeisMultistep,
    ];

    /// The diffusers class name (`_class_name`).
    pub fn class_name(self) -> &'static str {
        match self {
            SchedulerKind::Pndm => "PNDMScheduler",
            SchedulerKind::Ddim => "DDIMScheduler",
            SchedulerKind::EulerDiscrete => "EulerDiscreteScheduler",
            SchedulerKind::EulerAncestralDiscrete => "EulerAncestralDiscreteScheduler",
            SchedulerKind::DpmSolverMultistep => "DPMSolverMultistepScheduler",
            SchedulerKind::Ddpm => "DDPMScheduler",
            SchedulerKind::LmsDiscrete => "LMSDiscreteScheduler",
            SchedulerKind::HeunDiscrete => "HeunDiscreteScheduler",
            SchedulerKind::UniPcMultistep => "UniPCMultistepScheduler",
            SchedulerKind::CmStochasticIterative => "CMStochasticIterativeScheduler",
            SchedulerKind::FlowMatchEulerDiscrete => "FlowMatchEulerDiscreteScheduler",
            SchedulerKind::FlowMatchHeunDiscrete => "FlowMatchHeunDiscreteScheduler",
            SchedulerKind::KDpm2Discrete => "KDPM2DiscreteScheduler",
            SchedulerKind::KDpm2AncestralDiscrete => "KDPM2AncestralDiscreteScheduler",
            SchedulerKind::Lcm => "LCMScheduler",
            SchedulerKind::Tcd => "TCDScheduler",
            SchedulerKind::DpmSolverSinglestep => "DPMSolverSinglestepScheduler",
            SchedulerKind::DeisMultistep => "DEISMultistepScheduler",
        }
    }

    /// Names accepted by `from_str` besides the class name (case, spaces and dashes ignored);
    /// the A1111 names are "PLMS", "DDIM", "Euler", "Euler a", "DPM++ 2M", "DDPM", "LMS",
    /// "Heun", "DPM2", "DPM2 a", "DPM++ SDE" (DPMSolverSinglestepScheduler, as diffusers' table
    /// maps it), "UniPC", "DEIS", "LCM" and "TCD". A1111 names
    /// that are a class plus options ("DPM++ 2M Karras", "DPM2 a Karras") are read by
    /// [`SchedulerConfig::switched_to_named`].
    pub fn aliases(self) -> &'static [&'static str] {
        match self {
            SchedulerKind::Pndm => &["pndm", "plms"],
            SchedulerKind::Ddim => &["ddim"],
            SchedulerKind::EulerDiscrete => &["euler", "euler_discrete"],
            SchedulerKind::EulerAncestralDiscrete => {
                &["euler_a", "euler_ancestral", "euler_ancestral_discrete"]
            }
            SchedulerKind::DpmSolverMultistep => &[
                "dpm++_2m",
                "dpmpp_2m",
                "dpm_solver_multistep",
                "dpmsolver_multistep",
                "dpmsolver++",
            ],
            SchedulerKind::Ddpm => &["ddpm"],
            SchedulerKind::LmsDiscrete => &["lms", "k_lms", "lms_discrete"],
            SchedulerKind::HeunDiscrete => &["heun", "k_heun", "heun_discrete"],
            SchedulerKind::UniPcMultistep => &["unipc", "uni_pc", "unipc_multistep"],
            SchedulerKind::CmStochasticIterative => {
                &["cm", "consistency", "cm_stochastic_iterative"]
            }
            SchedulerKind::FlowMatchEulerDiscrete => &[
                "flow_match_euler",
                "flow_match_euler_discrete",
                "flow_euler",
            ],
            SchedulerKind::FlowMatchHeunDiscrete => {
                &["flow_match_heun", "flow_match_heun_discrete", "flow_heun"]
            }
            SchedulerKind::KDpm2Discrete => &["dpm2", "k_dpm_2", "kdpm2", "kdpm2_discrete"],
            SchedulerKind::KDpm2AncestralDiscrete => &[
                "dpm2_a",
                "k_dpm_2_a",
                "kdpm2_a",
                "kdpm2_ancestral",
                "kdpm2_ancestral_discrete",
            ],
            SchedulerKind::Lcm => &["lcm"],
            SchedulerKind::Tcd => &["tcd"],
            SchedulerKind::DpmSolverSinglestep => &[
                "dpm++_sde",
                "dpmpp_sde",
                "dpm_solver_singlestep",
                "dpmsolver_singlestep",
            ],
            SchedulerKind::DeisMultistep => &["deis", "deis_multistep"],
        }
    }

    /// Whether the class reads `use_karras_sigmas`.
    pub fn has_karras_sigmas(self) -> bool {
        matches!(
            self,
            SchedulerKind::EulerDiscrete
                | SchedulerKind::DpmSolverMultistep
                | SchedulerKind::LmsDiscrete
                | SchedulerKind::HeunDiscrete
                | SchedulerKind::UniPcMultistep
                | SchedulerKind::FlowMatchEulerDiscrete
                | SchedulerKind::KDpm2Discrete
                | SchedulerKind::KDpm2AncestralDiscrete
                | SchedulerKind::DpmSolverSinglestep
                | SchedulerKind::DeisMultistep
        )
    }

    /// Whether this is a flow-matching scheduler (velocity-predicting models: SD3, Flux):
    /// timesteps are `sigma * num_train_timesteps`, no input scaling, unit initial noise, any
    /// step count (no training grid to stay within).
    pub fn is_flow_matching(self) -> bool {
        matches!(
            self,
            SchedulerKind::FlowMatchEulerDiscrete | SchedulerKind::FlowMatchHeunDiscrete
        )
    }

    /// The class's default `timestep_spacing`.
    pub(crate) fn default_timestep_spacing(self) -> TimestepSpacing {
        match self {
            SchedulerKind::Pndm
            | SchedulerKind::Ddim
            | SchedulerKind::Ddpm
            | SchedulerKind::Lcm
            | SchedulerKind::Tcd => TimestepSpacing::Leading,
            SchedulerKind::EulerDiscrete
            | SchedulerKind::EulerAncestralDiscrete
            | SchedulerKind::DpmSolverMultistep
            | SchedulerKind::LmsDiscrete
            | SchedulerKind::HeunDiscrete
            | SchedulerKind::UniPcMultistep
            | SchedulerKind::FlowMatchEulerDiscrete
            | SchedulerKind::FlowMatchHeunDiscrete
            | SchedulerKind::KDpm2Discrete
            | SchedulerKind::KDpm2AncestralDiscrete
            | SchedulerKind::DpmSolverSinglestep
            | SchedulerKind::DeisMultistep
            | SchedulerKind::CmStochasticIterative => TimestepSpacing::Linspace,
        }
    }

    /// Every accepted name, for error messages and `--help`.
    pub fn known_names() -> String {
        Self::ALL
            .iter()
            .flat_map(|k| std::iter::once(k.class_name()).chain(k.aliases().iter().copied()))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl FromStr for SchedulerKind {
    type Err = SchedulerError;

    fn from_str(name: &str) -> Result<Self> {
        let norm = |s: &str| s.trim().to_ascii_lowercase().replace([' ', '-'], "_");
        let wanted = norm(name);
        if let Some(kind) = Self::ALL
            .into_iter()
            .find(|k| norm(k.class_name()) == wanted || k.aliases().iter().any(|a| *a == wanted))
        {
            return Ok(kind);
        }
        match not_implemented(&wanted) {
            Some(reason) => Err(SchedulerError::NotImplemented {
                name: name.to_string(),
                reason: reason.to_string(),
            }),
            None => Err(SchedulerError::UnknownScheduler {
                name: name.to_string(),
                known: Self::known_names(),
            }),
        }
    }
}

/// Names (normalised as in `from_str`) that diffusers' A1111 table or class list has but
/// this crate does not implement, with what to say about them.
fn not_implemented(wanted: &str) -> Option<&'static str> {
    Some(match wanted {
        "dpm++_2s_a" | "dpmpp_2s_a" => {
            "A1111's \"DPM++ 2S a\" has no diffusers equivalent (its docs: \"very similar to DPMSolverSinglestepScheduler\", which is \"DPM++ SDE\" here)"
        }
        "dpm_adaptive" | "dpm_fast" => "this A1111 sampler has no diffusers equivalent",
        "dpmsolversdescheduler" => {
            "DPMSolverSDEScheduler (torchsde Brownian-tree noise) is not implemented in oxidiff"
        }
        _ => return None,
    })
}

impl fmt::Display for SchedulerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.class_name())
    }
}
