//! The HTTP side below the routes ([`crate::routes`]): the API key check, request bodies read with a size limit and a
//! deadline, and the small endpoints (`/`, `/healthz`, `/metrics`). Handlers never run the
//! model: they check the request, queue it and wait for the worker.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{Html, IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use serde::de::DeserializeOwned;
use sha2::{Digest, Sha256};

use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::queue::JobQueue;
use crate::request::{Limits, ModelInfo};
use crate::worker::Status;

/// What every handler shares.
pub struct App {
    pub queue: Arc<JobQueue>,
    pub metrics: Arc<Metrics>,
    pub status: Arc<Status>,
    pub info: ModelInfo,
    pub limits: Limits,
    /// SHA-256 of the API key, when one is required.
    pub key: Option<ApiKey>,
}

impl App {
    /// `result` as the response, counted in the metrics under `endpoint`.
    pub fn answer(&self, endpoint: &str, result: Result<Response, ApiError>) -> Response {
        let response = result.unwrap_or_else(IntoResponse::into_response);
        self.metrics.request(endpoint, response.status().as_u16());
        response
    }
}

/// An API key, kept as its SHA-256 so that comparing takes the same time whatever the key or
/// the guess (and leaks neither's length).
#[derive(Clone)]
pub struct ApiKey([u8; 32]);

impl ApiKey {
    pub fn new(key: &str) -> Self {
        Self(Sha256::digest(key.as_bytes()).into())
    }

    /// Whether `given` is the key, in constant time.
    pub fn matches(&self, given: &str) -> bool {
        let digest: [u8; 32] = Sha256::digest(given.as_bytes()).into();
        digest
            .iter()
            .zip(self.0.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

/// The request body as a JSON object: 413 past the size limit, 408 when the client does not
/// send it in time, 400 for malformed JSON or another value than an object.
pub async fn read_object(body: Body, limits: &Limits) -> Result<serde_json::Value, ApiError> {
    let limit = limits.max_body_bytes;
    let read = async {
        let mut bytes = Vec::new();
        let mut stream = body.into_data_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| {
                ApiError::new(StatusCode::BAD_REQUEST, format!("reading the body: {e}"))
            })?;
            if bytes.len() + chunk.len() > limit {
                return Err(ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!("the request body is larger than {limit} bytes"),
                ));
            }
            bytes.extend_from_slice(&chunk);
        }
        Ok(bytes)
    };
    let bytes = tokio::time::timeout(limits.read_timeout, read)
        .await
        .map_err(|_| {
            ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "the request body did not arrive within {} s",
                    limits.read_timeout.as_secs_f64()
                ),
            )
        })??;
    let value: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, format!("malformed JSON body: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "the body must be a JSON object of request fields",
        ));
    }
    Ok(value)
}

/// The request body as `T` ([`read_object`], then 400 naming the field of a wrong type).
pub async fn read_json<T: DeserializeOwned>(body: Body, limits: &Limits) -> Result<T, ApiError> {
    from_value(read_object(body, limits).await?)
}

/// A JSON value already read, as `T` (400 naming the field).
pub fn from_value<T: DeserializeOwned>(value: serde_json::Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                format!("bad request body: {inner}"),
            )
        } else {
            ApiError::invalid(path.clone(), format!("field `{path}`: {inner}"))
        }
    })
}

/// 401 unless the request carries `Authorization: Bearer <key>` (when a key is set).
pub(crate) async fn require_key(
    State(app): State<Arc<App>>,
    request: Request,
    next: Next,
) -> Response {
    if let Some(key) = &app.key {
        let given = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        if !key.matches(given.trim()) {
            let error = ApiError::new(
                StatusCode::UNAUTHORIZED,
                "send the server's API key as `Authorization: Bearer <key>`",
            );
            return app.answer(request.uri().path(), Err(error));
        }
    }
    next.run(request).await
}

const INDEX: &str = include_str!("../static/index.html");

pub(crate) async fn index() -> Html<&'static str> {
    Html(INDEX)
}

pub(crate) async fn healthz(State(app): State<Arc<App>>) -> Response {
    let body = serde_json::json!({
        "status": "ok",
        "model": app.info.name,
        "pipeline": app.info.class,
        "device": app.info.device,
        "dtype": app.info.dtype,
        "queue_depth": app.queue.depth(),
    });
    Json(body).into_response()
}

pub(crate) async fn metrics(State(app): State<Arc<App>>) -> Response {
    let text = app.metrics.render(app.queue.depth());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

pub(crate) async fn not_found(request: Request) -> Response {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!(
            "no endpoint {} {}: see GET / for the page, /v1/images/generations and \
             /sdapi/v1/txt2img for the APIs",
            request.method(),
            request.uri().path()
        ),
    )
    .into_response()
}
