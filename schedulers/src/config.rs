//! `scheduler_config.json`: diffusers' scheduler settings, with diffusers' defaults.
//!
//! One struct serves every scheduler class, as diffusers' `from_config` lets one config
//! build any compatible class. Fields whose default differs between classes are `Option`s;
//! each scheduler resolves them with its own class's default.

use std::path::Path;

use serde::{Deserialize, Deserializer, Serialize};

use crate::error::{Result, SchedulerError};
use crate::SchedulerKind;

/// How betas are spread over the training timesteps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum BetaSchedule {
    /// `linspace(beta_start, beta_end)`.
    #[default]
    Linear,
    /// `linspace(sqrt(beta_start), sqrt(beta_end))^2` (Stable Diffusion).
    ScaledLinear,
    /// The cosine schedule of improved DDPM, capped at 0.999.
    #[serde(rename = "squaredcos_cap_v2")]
    SquaredcosCapV2,
}

/// What the denoiser predicts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum PredictionType {
    /// The added noise.
    #[default]
    Epsilon,
    /// The velocity `sqrt(alpha) * noise - sqrt(1 - alpha) * x0` (SD 2.x 768).
    VPrediction,
    /// The clean sample itself (diffusers also spells it `original_sample`).
    #[serde(alias = "original_sample")]
    Sample,
}

/// How inference timesteps are picked from the training timesteps
/// (table 2 of "Common Diffusion Noise Schedules and Sample Steps are Flawed").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TimestepSpacing {
    Linspace,
    Leading,
    Trailing,
}

/// How Euler interpolates sigmas between training timesteps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum InterpolationType {
    #[default]
    Linear,
    LogLinear,
}

/// Whether Euler hands the UNet discrete timesteps or `0.25 * ln(sigma)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum TimestepType {
    #[default]
    Discrete,
    Continuous,
}

/// The sigma Euler ends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum FinalSigmasType {
    #[default]
    Zero,
    SigmaMin,
}

/// The multistep solvers' algorithm: DPM-Solver in data (`++`) or noise prediction, ODE or SDE.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AlgorithmType {
    #[serde(rename = "dpmsolver")]
    DpmSolver,
    #[serde(rename = "dpmsolver++")]
    DpmSolverPlusPlus,
    #[serde(rename = "sde-dpmsolver")]
    SdeDpmSolver,
    #[serde(rename = "sde-dpmsolver++")]
    SdeDpmSolverPlusPlus,
    /// DEIS; diffusers' DPM-Solver treats it as `dpmsolver++`.
    #[serde(rename = "deis")]
    Deis,
}

/// The second-order update of the multistep solvers: DPM-Solver's `midpoint`/`heun`, UniPC's
/// `bh1`/`bh2` (DEIS' `logrho`). DPM-Solver reads the UniPC and DEIS values as `midpoint`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SolverType {
    Midpoint,
    Heun,
    Logrho,
    Bh1,
    Bh2,
}

/// How flow-matching schedulers shift sigmas by `mu` (`use_dynamic_shifting`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum TimeShiftType {
    /// `e^mu / (e^mu + 1/s - 1)` (Flux, SD3).
    #[default]
    Exponential,
    /// `mu / (mu + 1/s - 1)`.
    Linear,
}

/// DDPM's posterior variance (and whether the model predicts it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VarianceType {
    FixedSmall,
    FixedSmallLog,
    FixedLarge,
    FixedLargeLog,
    Learned,
    LearnedRange,
}

/// The contents of diffusers' `scheduler_config.json`. Unknown fields are ignored.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SchedulerConfig {
    /// The diffusers class, e.g. `PNDMScheduler`.
    #[serde(rename = "_class_name")]
    pub class_name: Option<String>,
    pub num_train_timesteps: usize,
    /// Default 0.0001 (0.00085 for Heun, KDPM2, LCM and TCD, whose defaults are Stable Diffusion's).
    pub beta_start: Option<f64>,
    /// Default 0.02 (0.012 for Heun, KDPM2, LCM and TCD).
    pub beta_end: Option<f64>,
    /// Default `linear` (`scaled_linear` for LCM and TCD).
    pub beta_schedule: Option<BetaSchedule>,
    /// Betas given explicitly; they replace `beta_start`/`beta_end`/`beta_schedule`.
    pub trained_betas: Option<Vec<f64>>,
    pub prediction_type: PredictionType,
    /// Default: `leading` for PNDM and DDIM, `linspace` for the Euler schedulers.
    pub timestep_spacing: Option<TimestepSpacing>,
    pub steps_offset: usize,
    /// PNDM and DDIM: the "previous" alpha of the last step is 1 (else `alphas_cumprod[0]`).
    /// Default: false for PNDM, true for DDIM.
    pub set_alpha_to_one: Option<bool>,
    /// PNDM: skip the Runge-Kutta warm-up (plain PLMS). Default false.
    pub skip_prk_steps: Option<bool>,
    /// DDIM: clip the predicted clean sample to `±clip_sample_range`. Default true.
    pub clip_sample: Option<bool>,
    pub clip_sample_range: f64,
    /// DDIM: dynamic thresholding of the predicted clean sample (Imagen).
    #[serde(deserialize_with = "null_as_default")]
    pub thresholding: bool,
    pub dynamic_thresholding_ratio: f64,
    pub sample_max_value: f64,
    /// Rescale betas to zero terminal SNR (DDIM, Euler, Euler ancestral).
    #[serde(deserialize_with = "null_as_default")]
    pub rescale_betas_zero_snr: bool,
    pub interpolation_type: InterpolationType,
    #[serde(deserialize_with = "null_as_default")]
    pub use_karras_sigmas: bool,
    #[serde(deserialize_with = "null_as_default")]
    pub use_exponential_sigmas: bool,
    #[serde(deserialize_with = "null_as_default")]
    pub use_beta_sigmas: bool,
    pub sigma_min: Option<f64>,
    pub sigma_max: Option<f64>,
    pub timestep_type: TimestepType,
    pub final_sigmas_type: FinalSigmasType,
    /// Multistep solvers (DPM-Solver, UniPC): the highest order used. Default 2.
    pub solver_order: usize,
    /// DPM-Solver's algorithm. Default `dpmsolver++`.
    pub algorithm_type: Option<AlgorithmType>,
    /// Default: `midpoint` for DPM-Solver, `bh2` for UniPC.
    pub solver_type: Option<SolverType>,
    /// Multistep solvers: lower the order over the last steps of short (< 15) schedules.
    /// Default true.
    pub lower_order_final: Option<bool>,
    /// DPM-Solver: a first-order last step whatever the schedule length.
    #[serde(deserialize_with = "null_as_default")]
    pub euler_at_final: bool,
    /// DPM-Solver: lambda (log-SNR) steps of Lu et al. (not supported here).
    #[serde(deserialize_with = "null_as_default")]
    pub use_lu_lambdas: bool,
    /// Flow-matching sigmas (not supported here).
    #[serde(deserialize_with = "null_as_default")]
    pub use_flow_sigmas: bool,
    /// DPM-Solver: timesteps whose log-SNR is below this are cut off. `None` (and `null`, and
    /// `-Infinity`) means no clipping.
    pub lambda_min_clipped: Option<f64>,
    /// DDPM's variance (default `fixed_small`); DPM-Solver only accepts it unset.
    pub variance_type: Option<VarianceType>,
    /// UniPC: model outputs converted to the clean sample (else to the noise). Default true.
    pub predict_x0: Option<bool>,
    /// UniPC: the steps whose corrector is skipped.
    #[serde(deserialize_with = "null_as_default")]
    pub disable_corrector: Vec<usize>,
    /// Consistency models: the data's standard deviation (EDM's `sigma_data`). Default 0.5.
    pub sigma_data: Option<f64>,
    /// Consistency models: the scale of the noise added between steps. Default 1.
    pub s_noise: Option<f64>,
    /// Consistency models: the Karras schedule's exponent. Default 7.
    pub rho: Option<f64>,
    /// Consistency models: clip the clean estimate to `[-1, 1]`. Default true.
    pub clip_denoised: Option<bool>,
    /// Flow matching: the static sigma shift `shift s / (1 + (shift - 1) s)`. Default 1.
    pub shift: Option<f64>,
    /// Flow matching: shift by a resolution-dependent `mu` passed to `set_timesteps_with`
    /// (Flux) instead of `shift`.
    #[serde(deserialize_with = "null_as_default")]
    pub use_dynamic_shifting: bool,
    /// Flow matching: `mu` at `base_image_seq_len` tokens (default 0.5); see `calculate_shift`.
    pub base_shift: Option<f64>,
    /// Flow matching: `mu` at `max_image_seq_len` tokens (default 1.15).
    pub max_shift: Option<f64>,
    /// Default 256.
    pub base_image_seq_len: Option<usize>,
    /// Default 4096.
    pub max_image_seq_len: Option<usize>,
    /// Flow matching: sigmas `1 - s` (the schedule runs from 0 up to 1).
    #[serde(deserialize_with = "null_as_default")]
    pub invert_sigmas: bool,
    /// Flow matching: stretch the shifted schedule so that it ends at this sigma (LTX-Video).
    pub shift_terminal: Option<f64>,
    pub time_shift_type: TimeShiftType,
    /// Flow matching: each step re-noises the predicted clean sample with fresh noise.
    #[serde(deserialize_with = "null_as_default")]
    pub stochastic_sampling: bool,
    /// LCM and TCD: the length of the distillation schedule the inference timesteps are
    /// picked from. Default 50.
    pub original_inference_steps: Option<usize>,
    /// LCM: the timestep scale of the consistency boundary condition. Default 10.
    pub timestep_scaling: Option<f64>,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            class_name: None,
            num_train_timesteps: 1000,
            beta_start: None,
            beta_end: None,
            beta_schedule: None,
            trained_betas: None,
            prediction_type: PredictionType::Epsilon,
            timestep_spacing: None,
            steps_offset: 0,
            set_alpha_to_one: None,
            skip_prk_steps: None,
            clip_sample: None,
            clip_sample_range: 1.0,
            thresholding: false,
            dynamic_thresholding_ratio: 0.995,
            sample_max_value: 1.0,
            rescale_betas_zero_snr: false,
            interpolation_type: InterpolationType::Linear,
            use_karras_sigmas: false,
            use_exponential_sigmas: false,
            use_beta_sigmas: false,
            sigma_min: None,
            sigma_max: None,
            timestep_type: TimestepType::Discrete,
            final_sigmas_type: FinalSigmasType::Zero,
            solver_order: 2,
            algorithm_type: None,
            solver_type: None,
            lower_order_final: None,
            euler_at_final: false,
            use_lu_lambdas: false,
            use_flow_sigmas: false,
            lambda_min_clipped: None,
            variance_type: None,
            predict_x0: None,
            disable_corrector: Vec::new(),
            sigma_data: None,
            s_noise: None,
            rho: None,
            clip_denoised: None,
            shift: None,
            use_dynamic_shifting: false,
            base_shift: None,
            max_shift: None,
            base_image_seq_len: None,
            max_image_seq_len: None,
            invert_sigmas: false,
            shift_terminal: None,
            time_shift_type: TimeShiftType::Exponential,
            stochastic_sampling: false,
            original_inference_steps: None,
            timestep_scaling: None,
        }
    }
}

/// `null` in the JSON means the default (diffusers writes `"use_karras_sigmas": null`).
fn null_as_default<'de, D, T>(d: D) -> std::result::Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// The most training timesteps a config may give: every table a scheduler builds has this many
/// entries, so a huge value would allocate gigabytes before any step (diffusers' schedules use
/// 1000; consistency models 40).
pub const MAX_TRAIN_TIMESTEPS: usize = 100_000;

impl SchedulerConfig {
    /// Reads `scheduler_config.json`; errors name the file and the offending field.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| SchedulerError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json_str(&text, &path.display().to_string())
    }

    /// Parses a config from JSON text; `origin` (a file name) is quoted in errors.
    pub fn from_json_str(text: &str, origin: &str) -> Result<Self> {
        // Python's json writes `-Infinity` (DPM-Solver's `lambda_min_clipped`), which is not
        // JSON; such values are read as `null`, i.e. the default.
        let value: serde_json::Value = serde_json::from_str(text)
            .or_else(|e| serde_json::from_str(&non_finite_as_null(text)).map_err(|_| e))
            .map_err(|e| SchedulerError::Json {
                origin: origin.to_string(),
                message: e.to_string(),
            })?;
        if !value.is_object() {
            return Err(SchedulerError::Json {
                origin: origin.to_string(),
                message: format!("found {}", json_kind(&value)),
            });
        }
        let config: Self =
            serde_path_to_error::deserialize(value).map_err(|e| SchedulerError::Field {
                origin: origin.to_string(),
                field: e.path().to_string(),
                message: e.into_inner().to_string(),
            })?;
        if config.num_train_timesteps > MAX_TRAIN_TIMESTEPS {
            return Err(SchedulerError::Field {
                origin: origin.to_string(),
                field: "num_train_timesteps".into(),
                message: format!(
                    "{} is more than any trained model uses (at most {MAX_TRAIN_TIMESTEPS} is \
                     accepted; diffusers' schedules use 1000): the config is corrupt",
                    config.num_train_timesteps
                ),
            });
        }
        Ok(config)
    }

    /// The scheduler class named by `_class_name`.
    pub fn kind(&self) -> Result<SchedulerKind> {
        match &self.class_name {
            Some(name) => name.parse(),
            None => Err(SchedulerError::UnknownScheduler {
                name: "<no _class_name in the config>".into(),
                known: SchedulerKind::known_names(),
            }),
        }
    }

    /// diffusers' `Target.from_config(source.config)`: the same betas and settings, another class.
    ///
    /// Only the fields set in the file carry over; diffusers marks the source class's
    /// defaults (`_use_default_values`) and drops them, so the target class's defaults apply
    /// (SD 1.5's PNDM config gives Euler `linspace` spacing, not PNDM's `leading`). That is
    /// why class-dependent fields are `Option`s here.
    pub fn switched_to(&self, target: SchedulerKind) -> SchedulerConfig {
        SchedulerConfig {
            class_name: Some(target.class_name().to_string()),
            ..self.clone()
        }
    }

    /// [`switched_to`](Self::switched_to) by name (`--scheduler`): a class or alias that
    /// `SchedulerKind` parses, optionally followed by A1111's option words: " Karras" sets
    /// `use_karras_sigmas` ("DPM++ 2M Karras"), " SDE" picks `sde-dpmsolver++`
    /// ("DPM++ 2M SDE Karras").
    pub fn switched_to_named(&self, name: &str) -> Result<SchedulerConfig> {
        let mut base = name.trim().to_string();
        let mut karras = false;
        let mut sde = false;
        loop {
            // A whole name first ("DPM++ SDE" is a class, not DPM++ with an SDE option), and
            // names diffusers maps to classes not implemented here.
            match base.parse::<SchedulerKind>() {
                Ok(_) => break,
                Err(e @ SchedulerError::NotImplemented { .. }) => return Err(e),
                Err(_) => {}
            }
            let lower = base.to_ascii_lowercase();
            if let Some(rest) = ["_karras", " karras", "-karras"]
                .iter()
                .find_map(|s| lower.strip_suffix(s))
            {
                karras = true;
                base.truncate(rest.len());
            } else if let Some(rest) = ["_sde", " sde", "-sde"]
                .iter()
                .find_map(|s| lower.strip_suffix(s))
            {
                sde = true;
                base.truncate(rest.len());
            } else {
                break;
            }
        }
        let kind: SchedulerKind = base.parse().map_err(|_| SchedulerError::UnknownScheduler {
            name: name.to_string(),
            known: format!(
                "{} (optionally followed by \"Karras\" or \"SDE\")",
                SchedulerKind::known_names()
            ),
        })?;
        let mut cfg = self.switched_to(kind);
        if karras && !kind.has_karras_sigmas() {
            return Err(SchedulerError::Unsupported {
                class: kind.class_name(),
                message: format!("`{name}`: this scheduler has no Karras sigmas"),
            });
        }
        if karras {
            cfg.use_karras_sigmas = true;
            cfg.use_exponential_sigmas = false;
            cfg.use_beta_sigmas = false;
        }
        if sde {
            if kind != SchedulerKind::DpmSolverMultistep {
                return Err(SchedulerError::Unsupported {
                    class: kind.class_name(),
                    message: format!("`{name}`: only DPM++ has an SDE variant"),
                });
            }
            cfg.algorithm_type = Some(AlgorithmType::SdeDpmSolverPlusPlus);
        }
        Ok(cfg)
    }
}

/// `text` with Python's bare `NaN`, `Infinity` and `-Infinity` (outside strings) made `null`.
fn non_finite_as_null(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    let mut in_string = false;
    while let Some(c) = rest.chars().next() {
        if in_string {
            if c == '\\' {
                let escaped: String = rest.chars().take(2).collect();
                out.push_str(&escaped);
                rest = &rest[escaped.len()..];
                continue;
            }
            in_string = c != '"';
        } else if c == '"' {
            in_string = true;
        } else if let Some(word) = ["-Infinity", "Infinity", "NaN"]
            .into_iter()
            .find(|w| rest.starts_with(w))
        {
            out.push_str("null");
            rest = &rest[word.len()..];
            continue;
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    out
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}
