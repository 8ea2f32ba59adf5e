//! The server's errors: [`ServerError`] when it cannot start or stops, and [`ApiError`], the one
//! error an endpoint answers with: an HTTP status and a message that names the field and the
//! fix, as JSON in the OpenAI shape (`{"error": {"message", "type", "param"}}`), which A1111
//! clients show as well.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use oxidiff::pipelines::PipelineError;

/// A request the server does not run, or a run that failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// The request field at fault, where there is one.
    pub param: Option<String>,
}

impl ApiError {
    /// 400: a field the server cannot run.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: Some(param.into()),
        }
    }

    /// Any status, no field.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            param: None,
        }
    }

    /// OpenAI's `type` for the status.
    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "param": self.param,
                "code": self.status.as_u16(),
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

/// Why the server did not start, or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("loading {model}: {source}")]
    Load {
        model: String,
        #[source]
        source: Box<PipelineError>,
    },
    #[error("--scheduler: {0}")]
    Scheduler(String),
    #[error("warming up a batch of {images}: {source}")]
    WarmUp {
        images: usize,
        #[source]
        source: Box<PipelineError>,
    },
    #[error("listening on {addr}: {source} (is another server on the port? pass --port)")]
    Bind {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("the worker thread stopped: {0}")]
    Worker(String),
}
