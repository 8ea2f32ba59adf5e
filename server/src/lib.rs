//! `oxidiff-server`: one loaded (optionally compiled) pipeline serving many clients over HTTP,
//! with the OpenAI images API ([`openai`]), the A1111 API ([`a1111`]) and a web page at `/`.
//!
//! Where it sits in the house: above `oxidiff`'s pipelines, beside the `txt2img` binary, whose
//! images it reproduces bit for bit (the same [`AutoPipeline`](oxidiff::pipelines::AutoPipeline),
//! the same PNG text). Requests are checked ([`request`]) and queued ([`queue`]); one worker
//! thread ([`worker`]) owns the pipeline and runs requests of one shape together, up to
//! `max_batch` images per denoiser call, each image from its own seed's generator. The async
//! runtime only parses, waits and answers ([`routes`], [`http`]); [`metrics`] counts for
//! `/metrics`.

pub mod a1111;
pub mod error;
pub mod http;
pub mod metrics;
pub mod openai;
pub mod queue;
pub mod request;
pub mod routes;
pub mod worker;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

pub use error::{ApiError, ServerError};
pub use request::{Limits, ModelInfo};
pub use worker::WorkerConfig;

/// Everything the server is started with.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub worker: WorkerConfig,
    pub limits: Limits,
    pub addr: SocketAddr,
    /// Requests must carry `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
}

/// Loads the model, serves until `shutdown` resolves, then refuses new requests (503), finishes
/// the queued ones and returns. `on_listening` is told the bound address (port 0 picks one).
pub async fn run(
    config: ServerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
    on_listening: impl FnOnce(SocketAddr),
) -> Result<(), ServerError> {
    let queue = Arc::new(queue::JobQueue::new(config.limits.max_queue));
    let metrics = Arc::new(metrics::Metrics::default());
    let status = Arc::new(worker::Status::default());
    let (info, worker) = {
        let (worker, limits) = (config.worker.clone(), config.limits.clone());
        let (queue, metrics, status) = (queue.clone(), metrics.clone(), status.clone());
        tokio::task::spawn_blocking(move || worker::spawn(worker, limits, queue, metrics, status))
            .await
            .map_err(|e| ServerError::Worker(e.to_string()))??
    };
    let listener = tokio::net::TcpListener::bind(config.addr)
        .await
        .map_err(|source| ServerError::Bind {
            addr: config.addr,
            source,
        })?;
    on_listening(listener.local_addr()?);
    let app = Arc::new(http::App {
        queue: queue.clone(),
        metrics,
        status,
        info,
        limits: config.limits,
        key: config.api_key.as_deref().map(http::ApiKey::new),
    });
    let closing = queue.clone();
    axum::serve(listener, routes::router(app))
        .with_graceful_shutdown(async move {
            shutdown.await;
            tracing::info!("shutting down: finishing the queued requests");
            closing.close();
        })
        .await?;
    queue.close();
    tokio::task::spawn_blocking(move || worker.join())
        .await
        .map_err(|e| ServerError::Worker(e.to_string()))?
        .map_err(|_| ServerError::Worker("it panicked".into()))?;
    Ok(())
}
