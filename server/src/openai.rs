//! OpenAI's images API: `POST /v1/images/generations` (with `stream: true` as server-sent
//! events: progress, then one `image_generation.completed` per image) and `GET /v1/models`.
//! Beyond OpenAI's fields it takes `seed`, `steps`, `guidance_scale`, `negative_prompt` and
//! `scheduler`; `model`, `quality`, `style` and `user` are accepted and ignored.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine;
use serde::Deserialize;

use crate::error::ApiError;
use crate::http::{read_json, App};
use crate::queue::{JobEvent, JobHandle};
use crate::request::{parse_size, Draft, FieldNames};

/// The request body.
#[derive(Debug, Deserialize)]
pub struct GenerationsRequest {
    pub prompt: String,
    #[serde(default)]
    pub n: Option<u64>,
    /// `"WxH"`, or `"auto"` / absent for the model's default size.
    #[serde(default)]
    pub size: Option<String>,
    /// Only `b64_json`: nothing is stored, so there is no URL to give.
    #[serde(default)]
    pub response_format: Option<String>,
    #[serde(default)]
    pub seed: Option<i64>,
    #[serde(default)]
    pub steps: Option<u64>,
    #[serde(default)]
    pub guidance_scale: Option<f64>,
    #[serde(default)]
    pub negative_prompt: Option<String>,
    #[serde(default)]
    pub scheduler: Option<String>,
    /// Server-sent events instead of one JSON answer.
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub model: Option<serde_json::Value>,
}

impl GenerationsRequest {
    fn draft(self) -> Result<(Draft<'static>, bool), ApiError> {
        match self.response_format.as_deref() {
            None | Some("b64_json") => {}
            Some(other) => {
                return Err(ApiError::invalid(
                    "response_format",
                    format!(
                        "response_format {other:?} is not served: use \"b64_json\" (the server \
                         stores no images, so it has no URLs to give)"
                    ),
                ))
            }
        }
        let size = match self.size.as_deref() {
            None | Some("auto") => None,
            Some(text) => Some(parse_size(text)?),
        };
        Ok((
            Draft {
                prompt: self.prompt,
                negative_prompt: self.negative_prompt.unwrap_or_default(),
                size,
                steps: self.steps,
                guidance_scale: self.guidance_scale,
                seed: self.seed,
                count: self.n.unwrap_or(1),
                sampler: self.scheduler,
                names: FieldNames {
                    sampler: "scheduler",
                    ..FieldNames::default()
                },
            },
            self.stream,
        ))
    }
}

fn unix_time() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// `POST /v1/images/generations`.
pub async fn generations(State(app): State<Arc<App>>, body: Body) -> Response {
    let result = async {
        let request: GenerationsRequest = read_json(body, &app.limits).await?;
        let (draft, stream) = request.draft()?;
        let request = draft.check(&app.info, &app.limits)?;
        let handle = app.queue.submit(request)?;
        if stream {
            return Ok(events(handle).into_response());
        }
        let mut handle = handle;
        let images = handle.images().await?;
        let data: Vec<_> = images
            .iter()
            .map(|image| serde_json::json!({ "b64_json": b64(&image.png), "seed": image.seed }))
            .collect();
        Ok::<_, ApiError>(
            Json(serde_json::json!({ "created": unix_time(), "data": data })).into_response(),
        )
    }
    .await;
    app.answer("/v1/images/generations", result)
}

/// The job's events as SSE; the stream ends after the last image or the failure, and
/// dropping it (the client went away) cancels the job.
fn events(handle: JobHandle) -> Sse<impl futures_util::Stream<Item = Result<Event, Infallible>>> {
    let stream = futures_util::stream::unfold(Some(handle), |handle| async move {
        let mut handle = handle?;
        let event = handle.next().await?;
        let (event, rest) = match event {
            JobEvent::Step {
                step,
                steps,
                progress,
            } => (
                Event::default()
                    .event("image_generation.progress")
                    .json_data(serde_json::json!({
                        "type": "image_generation.progress",
                        "step": step,
                        "steps": steps,
                        "progress": progress,
                    })),
                Some(handle),
            ),
            JobEvent::Image(image) => (
                Event::default()
                    .event("image_generation.completed")
                    .json_data(serde_json::json!({
                        "type": "image_generation.completed",
                        "index": image.index,
                        "seed": image.seed,
                        "b64_json": b64(&image.png),
                        "created_at": unix_time(),
                    })),
                Some(handle),
            ),
            JobEvent::Failed(e) => (Event::default().event("error").json_data(e.body()), None),
        };
        // json_data only fails on values serde_json cannot write; these are plain JSON.
        let event = event.unwrap_or_else(|_| Event::default().event("error"));
        Some((Ok(event), rest))
    });
    Sse::new(stream).keep_alive(KeepAlive::default())
}

/// `GET /v1/models`: the one model this server runs.
pub async fn models(State(app): State<Arc<App>>) -> Response {
    let body = serde_json::json!({
        "object": "list",
        "data": [{
            "id": app.info.name,
            "object": "model",
            "created": 0,
            "owned_by": "oxidiff",
        }],
    });
    app.answer("/v1/models", Ok(Json(body).into_response()))
}
