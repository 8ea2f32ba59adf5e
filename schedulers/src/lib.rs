//! Diffusion schedulers, ported from diffusers with its numerics.
//!
//! Used by `pipelines/` only. Each scheduler lives in its own file and keeps diffusers'
//! split: host math (timesteps, sigmas, per-step coefficients, in f64 from diffusers' f32
//! tables) apart from tensor math, which is only scalar multiplications and additions on
//! burn `Tensor`s and so runs on any backend, including inside a compiled step.
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

mod config;
mod ddim;
mod error;
mod euler;
mod euler_ancestral;
mod noise;
mod ops;
mod pndm;
mod schedule;

pub use config::{
    BetaSchedule, FinalSigmasType, InterpolationType, PredictionType, SchedulerConfig,
    TimestepSpacing, TimestepType,
};
pub use ddim::DdimScheduler;
pub use error::{Result, SchedulerError};
pub use euler::EulerDiscreteScheduler;
pub use euler_ancestral::EulerAncestralDiscreteScheduler;
pub use noise::{NoNoise, NoiseSource, RecordedNoise, TorchCpuGenerator};
pub use pndm::PndmScheduler;

/// The scheduler interface the pipelines drive, as in diffusers' denoising loop.
pub trait Scheduler<B: Backend>: Send {
    /// Which algorithm this is.
    fn kind(&self) -> SchedulerKind;

    /// Computes the inference schedule; must precede `step`. Resets all step state.
    fn set_timesteps(&mut self, num_inference_steps: usize) -> Result<()>;

    /// The timesteps the denoiser receives, in loop order (diffusers' `scheduler.timesteps`);
    /// empty before `set_timesteps`. PNDM's PRK warm-up repeats timesteps.
    fn timesteps(&self) -> &[f64];

    /// The standard deviation of the initial noise: latents are `randn * init_noise_sigma`.
    fn init_noise_sigma(&self) -> f64;

    /// Denoiser evaluations per step (1 for all schedulers here, as in diffusers).
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
}

impl SchedulerKind {
    pub const ALL: [SchedulerKind; 4] = [
        SchedulerKind::Pndm,
        SchedulerKind::Ddim,
        SchedulerKind::EulerDiscrete,
        SchedulerKind::EulerAncestralDiscrete,
    ];

    /// The diffusers class name (`_class_name`).
    pub fn class_name(self) -> &'static str {
        match self {
            SchedulerKind::Pndm => "PNDMScheduler",
            SchedulerKind::Ddim => "DDIMScheduler",
            SchedulerKind::EulerDiscrete => "EulerDiscreteScheduler",
            SchedulerKind::EulerAncestralDiscrete => "EulerAncestralDiscreteScheduler",
        }
    }

    /// Names accepted by `from_str` besides the class name (case, spaces and dashes ignored);
    /// the A1111 names are "PLMS", "DDIM", "Euler" and "Euler a".
    pub fn aliases(self) -> &'static [&'static str] {
        match self {
            SchedulerKind::Pndm => &["pndm", "plms"],
            SchedulerKind::Ddim => &["ddim"],
            SchedulerKind::EulerDiscrete => &["euler", "euler_discrete"],
            SchedulerKind::EulerAncestralDiscrete => {
                &["euler_a", "euler_ancestral", "euler_ancestral_discrete"]
            }
        }
    }

    /// The class's default `timestep_spacing`.
    pub(crate) fn default_timestep_spacing(self) -> TimestepSpacing {
        match self {
            SchedulerKind::Pndm | SchedulerKind::Ddim => TimestepSpacing::Leading,
            SchedulerKind::EulerDiscrete | SchedulerKind::EulerAncestralDiscrete => {
                TimestepSpacing::Linspace
            }
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
        Self::ALL
            .into_iter()
            .find(|k| norm(k.class_name()) == wanted || k.aliases().iter().any(|a| *a == wanted))
            .ok_or_else(|| SchedulerError::UnknownScheduler {
                name: name.to_string(),
                known: Self::known_names(),
            })
    }
}

impl fmt::Display for SchedulerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.class_name())
    }
}
