//! Every route of the server, and which handler answers it: the OpenAI and A1111 endpoints
//! behind the API key check, the page and the health check open.

use std::sync::Arc;

use axum::middleware;
use axum::routing::{get, post};
use axum::Router;

use crate::http::{healthz, index, metrics, not_found, require_key, App};
use crate::{a1111, openai};

/// Every route.
pub fn router(app: Arc<App>) -> Router {
    let api = Router::new()
        .route("/v1/images/generations", post(openai::generations))
        .route("/v1/models", get(openai::models))
        .route("/sdapi/v1/txt2img", post(a1111::txt2img))
        .route("/sdapi/v1/samplers", get(a1111::samplers))
        .route("/sdapi/v1/sd-models", get(a1111::sd_models))
        .route("/sdapi/v1/progress", get(a1111::progress))
        .route("/sdapi/v1/interrupt", post(a1111::interrupt))
        .route("/metrics", get(metrics))
        .route_layer(middleware::from_fn_with_state(app.clone(), require_key));
    Router::new()
        .route("/", get(index))
        .route("/healthz", get(healthz))
        .merge(api)
        .fallback(not_found)
        .with_state(app)
}
