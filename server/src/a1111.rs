//! The AUTOMATIC1111 web UI's API, the part clients of it use to make images:
//! `POST /sdapi/v1/txt2img` (base64 PNGs, each with the `parameters` text A1111 writes, and the
//! `info` JSON), `GET /sdapi/v1/samplers`, `GET /sdapi/v1/sd-models`,
//! `GET /sdapi/v1/progress` and `POST /sdapi/v1/interrupt`. Fields A1111 has and oxidiff does
//! not run (hires fix, restore faces, scripts) are accepted and ignored.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine;
use oxidiff::pipelines::metadata::a1111_sampler_name;
use oxidiff::schedulers::SchedulerKind;
use serde::Deserialize;

use crate::error::ApiError;
use crate::http::{read_object, App};
use crate::request::{Draft, FieldNames};

/// The request body (A1111's `StableDiffusionTxt2ImgProcessingAPI`, the fields that apply).
#[derive(Debug, Deserialize)]
pub struct Txt2ImgRequest {
    #[serde(default)]
    pub prompt: String,
    #[serde(default)]
    pub negative_prompt: String,
    #[serde(default)]
    pub steps: Option<u64>,
    #[serde(default)]
    pub cfg_scale: Option<f64>,
    #[serde(default)]
    pub width: Option<usize>,
    #[serde(default)]
    pub height: Option<usize>,
    /// -1 (A1111's default) or absent: random.
    #[serde(default)]
    pub seed: Option<i64>,
    #[serde(default)]
    pub sampler_name: Option<String>,
    /// A1111's older name of `sampler_name`.
    #[serde(default)]
    pub sampler_index: Option<String>,
    /// A1111 1.9's schedule type: "Automatic" or "Karras".
    #[serde(default)]
    pub scheduler: Option<String>,
    #[serde(default)]
    pub batch_size: Option<u64>,
    #[serde(default)]
    pub n_iter: Option<u64>,
}

impl Txt2ImgRequest {
    fn draft(self, default_size: usize) -> Result<Draft<'static>, ApiError> {
        let batch_size = self.batch_size.unwrap_or(1);
        let n_iter = self.n_iter.unwrap_or(1);
        let count = batch_size.checked_mul(n_iter).ok_or_else(|| {
            ApiError::invalid("batch_size", "batch_size * n_iter overflows".to_string())
        })?;
        let mut sampler = self.sampler_name.or(self.sampler_index);
        match self.scheduler.as_deref().map(str::trim) {
            None | Some("") => {}
            Some(s) if s.eq_ignore_ascii_case("automatic") => {}
            Some(s) if s.eq_ignore_ascii_case("karras") => {
                let name = sampler.as_deref().unwrap_or("Euler");
                sampler = Some(format!("{name} Karras"));
            }
            Some(other) => {
                return Err(ApiError::invalid(
                    "scheduler",
                    format!(
                        "scheduler {other:?} is not implemented: use \"Automatic\" or \"Karras\""
                    ),
                ))
            }
        }
        let size = match (self.width, self.height) {
            (None, None) => None,
            (w, h) => Some((w.unwrap_or(default_size), h.unwrap_or(default_size))),
        };
        Ok(Draft {
            prompt: self.prompt,
            negative_prompt: self.negative_prompt,
            size,
            steps: self.steps,
            guidance_scale: self.cfg_scale,
            seed: self.seed,
            count,
            sampler,
            names: FieldNames {
                size: "width/height",
                steps: "steps",
                guidance: "cfg_scale",
                count: "batch_size * n_iter",
                sampler: "sampler_name",
            },
        })
    }
}

/// `POST /sdapi/v1/txt2img`.
pub async fn txt2img(State(app): State<Arc<App>>, body: Body) -> Response {
    let result = async {
        let raw = read_object(body, &app.limits).await?;
        let request: Txt2ImgRequest = crate::http::from_value(raw.clone())?;
        let (batch_size, n_iter) = (request.batch_size.unwrap_or(1), request.n_iter.unwrap_or(1));
        let request = request
            .draft(app.info.default_size)?
            .check(&app.info, &app.limits)?;
        let mut handle = app.queue.submit(request.clone())?;
        let images = handle.images().await?;
        let engine = base64::engine::general_purpose::STANDARD;
        let sampler = images
            .first()
            .and_then(|i| sampler_of(&i.parameters))
            .unwrap_or_default();
        let info = serde_json::json!({
            "prompt": request.prompt,
            "all_prompts": vec![&request.prompt; images.len()],
            "negative_prompt": request.negative_prompt,
            "all_negative_prompts": vec![&request.negative_prompt; images.len()],
            "seed": request.seed,
            "all_seeds": images.iter().map(|i| i.seed).collect::<Vec<_>>(),
            "subseed": -1,
            "all_subseeds": vec![-1; images.len()],
            "width": request.width,
            "height": request.height,
            "sampler_name": sampler,
            "cfg_scale": request.guidance_scale,
            "steps": request.steps,
            "batch_size": batch_size,
            "n_iter": n_iter,
            "sd_model_name": app.info.name,
            "infotexts": images.iter().map(|i| i.parameters.clone()).collect::<Vec<_>>(),
            "index_of_first_image": 0,
        });
        let mut parameters = raw;
        if let Some(object) = parameters.as_object_mut() {
            object.insert("seed".into(), request.seed.into());
            object.insert("steps".into(), request.steps.into());
            object.insert("cfg_scale".into(), request.guidance_scale.into());
            object.insert("width".into(), request.width.into());
            object.insert("height".into(), request.height.into());
            object.insert("sampler_name".into(), sampler.into());
        }
        Ok::<_, ApiError>(
            Json(serde_json::json!({
                "images": images.iter().map(|i| engine.encode(&i.png)).collect::<Vec<_>>(),
                "parameters": parameters,
                "info": info.to_string(),
            }))
            .into_response(),
        )
    }
    .await;
    app.answer("/sdapi/v1/txt2img", result)
}

/// The `Sampler:` value of a PNG's parameters text.
fn sampler_of(parameters: &str) -> Option<String> {
    let last = parameters.lines().last()?;
    last.split(", ")
        .find_map(|pair| pair.strip_prefix("Sampler: "))
        .map(str::to_string)
}

/// `GET /sdapi/v1/samplers`: the schedulers that can run the loaded model (flow-matching ones
/// for SD3 and Flux, the others for the rest), by A1111 name where it has one.
pub async fn samplers(State(app): State<Arc<App>>) -> Response {
    let flow = app
        .info
        .scheduler_config
        .kind()
        .map(|k| k.is_flow_matching())
        .unwrap_or(false);
    let list: Vec<_> = SchedulerKind::ALL
        .iter()
        .filter(|k| k.is_flow_matching() == flow)
        .filter(|k| {
            app.info
                .scheduler_config
                .switched_to_named(k.class_name())
                .is_ok()
        })
        .map(|&k| {
            let name = a1111_sampler_name(k).unwrap_or(k.class_name());
            let mut aliases = vec![k.class_name()];
            aliases.extend(k.aliases().iter().copied().filter(|a| *a != name));
            aliases.retain(|a| *a != name);
            serde_json::json!({ "name": name, "aliases": aliases, "options": {} })
        })
        .collect();
    app.answer("/sdapi/v1/samplers", Ok(Json(list).into_response()))
}

/// `GET /sdapi/v1/sd-models`: the one model loaded (by name; no path of this machine).
pub async fn sd_models(State(app): State<Arc<App>>) -> Response {
    let body = serde_json::json!([{
        "title": app.info.name,
        "model_name": app.info.name,
        "hash": (!app.info.hash.is_empty()).then_some(&app.info.hash),
        "sha256": null,
        "filename": app.info.name,
        "config": null,
    }]);
    app.answer("/sdapi/v1/sd-models", Ok(Json(body).into_response()))
}

/// `GET /sdapi/v1/progress`: the running batch's progress and the queue.
pub async fn progress(State(app): State<Arc<App>>) -> Response {
    let snapshot = app.status.snapshot();
    let (fraction, eta, step, steps) = match snapshot {
        Some(s) if s.steps > 0 => {
            let fraction = s.step as f64 / s.steps as f64;
            let eta = if s.step > 0 {
                s.elapsed.as_secs_f64() / fraction * (1.0 - fraction)
            } else {
                0.0
            };
            (fraction, eta, s.step, s.steps)
        }
        _ => (0.0, 0.0, 0, 0),
    };
    let body = serde_json::json!({
        "progress": fraction,
        "eta_relative": eta,
        "state": {
            "skipped": false,
            "interrupted": false,
            "job": if snapshot.is_some() { "txt2img" } else { "" },
            "job_count": app.queue.depth() + usize::from(snapshot.is_some()),
            "job_timestamp": "0",
            "job_no": 0,
            "sampling_step": step,
            "sampling_steps": steps,
        },
        "current_image": null,
        "textinfo": null,
    });
    app.answer("/sdapi/v1/progress", Ok(Json(body).into_response()))
}

/// `POST /sdapi/v1/interrupt`: the running batch stops after its current step; its requests
/// get a 503 saying so.
pub async fn interrupt(State(app): State<Arc<App>>) -> Response {
    let interrupted = app.status.interrupt();
    app.answer(
        "/sdapi/v1/interrupt",
        Ok(Json(serde_json::json!({ "interrupted": interrupted })).into_response()),
    )
}
