//! What every endpoint turns its JSON into: an [`ImageRequest`] checked against the server's
//! [`Limits`] and the loaded model ([`ModelInfo`]), before anything is queued. The two APIs
//! differ in field names only; the checks and their messages are these.

use axum::http::StatusCode;
use oxidiff::schedulers::SchedulerConfig;

use crate::error::ApiError;

/// The most characters a prompt (or negative prompt) may have; CLIP reads 77 tokens and T5 a
/// few hundred, so this only keeps absurd bodies out of the tokenizer.
pub const MAX_PROMPT_CHARS: usize = 20_000;

/// What the server accepts, set by its flags.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Images per denoiser call (`--max-batch`).
    pub max_batch: usize,
    /// Requests waiting for the worker before new ones get 429 (`--max-queue`).
    pub max_queue: usize,
    /// Images one request may ask for (`n`, `batch_size * n_iter`).
    pub max_images_per_request: usize,
    /// Pixels of one image (`--max-pixels`).
    pub max_pixels: u64,
    /// Denoising steps of one request (`--max-steps`).
    pub max_steps: usize,
    /// Bytes of a request body (`--max-body-bytes`).
    pub max_body_bytes: usize,
    /// Time a client has to send its request body (`--read-timeout`).
    pub read_timeout: std::time::Duration,
    /// How long the worker waits for more requests of the same shape before it starts a batch
    /// that is not full (`--batch-window-ms`).
    pub batch_window: std::time::Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_batch: 4,
            max_queue: 64,
            max_images_per_request: 16,
            max_pixels: oxidiff::cli::usage::DEFAULT_MAX_PIXELS,
            max_steps: 150,
            max_body_bytes: 64 * 1024,
            read_timeout: std::time::Duration::from_secs(10),
            batch_window: std::time::Duration::from_millis(20),
        }
    }
}

/// What the loaded pipeline is, for the checks and the listing endpoints.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// The model as PNGs record it (a Hub id, or a folder's name).
    pub name: String,
    /// A1111's `Model hash` of it (empty when it could not be hashed).
    pub hash: String,
    /// `model_index.json`'s `_class_name`.
    pub class: String,
    /// Width = height when a request gives no size.
    pub default_size: usize,
    /// Sides must divide by this.
    pub size_multiple: usize,
    pub default_steps: usize,
    pub default_guidance: f64,
    /// The sampler of requests that name none (`--scheduler`, else the checkpoint's).
    pub default_sampler: Option<String>,
    /// The checkpoint's scheduler config: each request's sampler is switched from it.
    pub scheduler_config: SchedulerConfig,
    /// The device and mode, for `/healthz`.
    pub device: String,
    pub dtype: String,
}

impl ModelInfo {
    /// The config of `sampler` (`None`: the default), or a 400 naming the known samplers.
    pub fn sampler_config(&self, sampler: Option<&str>) -> Result<SchedulerConfig, ApiError> {
        match sampler.or(self.default_sampler.as_deref()) {
            None => Ok(self.scheduler_config.clone()),
            Some(name) => self
                .scheduler_config
                .switched_to_named(name)
                .map_err(|e| ApiError::invalid("sampler", e.to_string())),
        }
    }
}

/// One request, checked: `count` images with seeds `seed`, `seed + 1`, ...
#[derive(Debug, Clone, PartialEq)]
pub struct ImageRequest {
    pub prompt: String,
    pub negative_prompt: String,
    pub width: usize,
    pub height: usize,
    pub steps: usize,
    pub guidance_scale: f64,
    pub seed: u64,
    pub count: usize,
    /// The sampler as the client named it, else the server's `--scheduler` (`None`: the
    /// checkpoint's).
    pub sampler: Option<String>,
}

/// Requests with equal keys run in one denoiser call: the same image size, steps, sampler and
/// guidance, and negative prompts given or not (SDXL zeroes an absent one, so the two cannot
/// share a call).
#[derive(Debug, Clone, PartialEq)]
pub struct BatchKey {
    pub width: usize,
    pub height: usize,
    pub steps: usize,
    pub guidance_scale: f64,
    pub sampler: Option<String>,
    pub negative_given: bool,
}

impl ImageRequest {
    pub fn batch_key(&self) -> BatchKey {
        BatchKey {
            width: self.width,
            height: self.height,
            steps: self.steps,
            guidance_scale: self.guidance_scale,
            sampler: self.sampler.clone(),
            negative_given: !self.negative_prompt.is_empty(),
        }
    }
}

/// The fields of a request before the checks, in the server's own names; each API fills it
/// from its JSON. `param` names are the API's, for the messages.
#[derive(Debug, Clone, Default)]
pub struct Draft<'a> {
    pub prompt: String,
    pub negative_prompt: String,
    pub size: Option<(usize, usize)>,
    pub steps: Option<u64>,
    pub guidance_scale: Option<f64>,
    /// `None` or a negative seed (A1111's -1): drawn at random.
    pub seed: Option<i64>,
    pub count: u64,
    pub sampler: Option<String>,
    pub names: FieldNames<'a>,
}

/// How an API calls the fields the checks report.
#[derive(Debug, Clone, Copy)]
pub struct FieldNames<'a> {
    pub size: &'a str,
    pub steps: &'a str,
    pub guidance: &'a str,
    pub count: &'a str,
    pub sampler: &'a str,
}

impl Default for FieldNames<'_> {
    fn default() -> Self {
        Self {
            size: "size",
            steps: "steps",
            guidance: "guidance_scale",
            count: "n",
            sampler: "sampler",
        }
    }
}

impl Draft<'_> {
    /// The checked request, or a 400 naming the field and the fix.
    pub fn check(self, model: &ModelInfo, limits: &Limits) -> Result<ImageRequest, ApiError> {
        let names = self.names;
        for (field, text) in [
            ("prompt", &self.prompt),
            ("negative_prompt", &self.negative_prompt),
        ] {
            if text.chars().count() > MAX_PROMPT_CHARS {
                return Err(ApiError::invalid(
                    field,
                    format!("{field} is longer than {MAX_PROMPT_CHARS} characters"),
                ));
            }
        }
        let max = limits.max_images_per_request;
        if self.count == 0 || self.count > max as u64 {
            return Err(ApiError::invalid(
                names.count,
                format!(
                    "ask for 1 to {max} images ({} was {})",
                    names.count, self.count
                ),
            ));
        }
        let (width, height) = self
            .size
            .unwrap_or((model.default_size, model.default_size));
        check_size(names.size, width, height, model.size_multiple, limits)?;
        let steps = self.steps.unwrap_or(model.default_steps as u64);
        if steps == 0 || steps > limits.max_steps as u64 {
            return Err(ApiError::invalid(
                names.steps,
                format!(
                    "give {} 1 to {} steps (it was {steps})",
                    names.steps, limits.max_steps
                ),
            ));
        }
        let guidance_scale = self.guidance_scale.unwrap_or(model.default_guidance);
        if !guidance_scale.is_finite() || !(0.0..=100.0).contains(&guidance_scale) {
            return Err(ApiError::invalid(
                names.guidance,
                format!(
                    "give {} a number from 0 to 100 (it was {guidance_scale})",
                    names.guidance
                ),
            ));
        }
        let sampler = self
            .sampler
            .map(|s| s.trim().to_string())
            .or_else(|| model.default_sampler.clone());
        model.sampler_config(sampler.as_deref()).map_err(|e| {
            ApiError::invalid(names.sampler, format!("{}: {}", names.sampler, e.message))
        })?;
        let count = self.count as usize;
        let seed = match self.seed {
            Some(seed) if seed >= 0 => seed as u64,
            _ => oxidiff::cli::random_seed(),
        };
        if seed.checked_add(count as u64).is_none() {
            return Err(ApiError::invalid(
                "seed",
                format!("seed {seed} + {count} images overflows 64 bits: give a smaller seed"),
            ));
        }
        Ok(ImageRequest {
            prompt: self.prompt,
            negative_prompt: self.negative_prompt,
            width,
            height,
            steps: steps as usize,
            guidance_scale,
            seed,
            count,
            sampler,
        })
    }
}

/// Each side a positive multiple of `multiple`, and at most `limits.max_pixels` in all.
fn check_size(
    field: &str,
    width: usize,
    height: usize,
    multiple: usize,
    limits: &Limits,
) -> Result<(), ApiError> {
    if width == 0
        || height == 0
        || !width.is_multiple_of(multiple)
        || !height.is_multiple_of(multiple)
    {
        return Err(ApiError::invalid(
            field,
            format!(
                "{field} {width}x{height}: width and height must be positive multiples of \
                 {multiple}, for example {}x{}",
                (width.max(multiple) / multiple) * multiple,
                (height.max(multiple) / multiple) * multiple
            ),
        ));
    }
    if oxidiff::cli::usage::pixels_within(width, height, limits.max_pixels).is_none() {
        return Err(ApiError::invalid(
            field,
            format!(
                "{field} {width}x{height} is more than the {} pixels this server allows per \
                 image (its --max-pixels)",
                limits.max_pixels
            ),
        ));
    }
    Ok(())
}

/// `"WxH"` (OpenAI's `size`), or a 400.
pub fn parse_size(text: &str) -> Result<(usize, usize), ApiError> {
    let bad = || {
        ApiError::invalid(
            "size",
            format!("size must look like \"512x512\" (it was {text:?})"),
        )
    };
    let (w, h) = text.split_once('x').ok_or_else(bad)?;
    Ok((
        w.trim().parse().map_err(|_| bad())?,
        h.trim().parse().map_err(|_| bad())?,
    ))
}

/// 503 while the server drains for shutdown.
pub fn shutting_down() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "the server is shutting down: send the request to another replica",
    )
}
