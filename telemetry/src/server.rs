//! The `/metrics`, `/healthz`, `/readyz` HTTP server.

use std::future::Future;
use std::net::SocketAddr;

use asyncrl_config::TelemetryConfig;
use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::exposition::{OPENMETRICS_CONTENT_TYPE, PROMETHEUS_TEXT_CONTENT_TYPE};
use crate::{Health, Metrics, Readiness, TelemetryError};

/// A running telemetry server.
///
/// It stops when the `shutdown` future given to [`serve`] completes, or on
/// [`TelemetryServer::shutdown`]. Dropping the handle leaves it running.
#[derive(Debug)]
pub struct TelemetryServer {
    local_addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), TelemetryError>>,
}

impl TelemetryServer {
    /// The bound address (with the real port when port 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops accepting, lets in-flight requests finish and waits for the end.
    pub async fn shutdown(mut self) -> Result<(), TelemetryError> {
        if let Some(stop) = self.stop.take() {
            // The server may have stopped already through its shutdown future.
            let _ = stop.send(());
        }
        self.task.await?
    }

    /// Waits until the server stops (through its shutdown future).
    pub async fn join(self) -> Result<(), TelemetryError> {
        self.task.await?
    }
}

#[derive(Clone)]
struct AppState {
    metrics: Metrics,
    health: Health,
}

/// Binds `addr` and serves `/metrics`, `/healthz` and `/readyz` in a
/// background task until `shutdown` completes. Returns once the socket is
/// bound, so the address (and port) is known to the caller.
pub async fn serve(
    addr: SocketAddr,
    metrics: Metrics,
    health: Health,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<TelemetryServer, TelemetryError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| TelemetryError::Bind { addr, source })?;
    let local_addr = listener
        .local_addr()
        .map_err(|source| TelemetryError::Bind { addr, source })?;
    let app = router(AppState { metrics, health });
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                tokio::select! {
                    () = shutdown => {}
                    _ = stop_rx => {}
                }
            })
            .await
            .map_err(TelemetryError::Serve)
    });
    tracing::info!(%local_addr, "telemetry server listening (/metrics /healthz /readyz)");
    Ok(TelemetryServer {
        local_addr,
        stop: Some(stop_tx),
        task,
    })
}

/// [`serve`] on `config.listen`; `Ok(None)` when the config disables the
/// server (`listen = ""`).
pub async fn serve_from_config(
    config: &TelemetryConfig,
    metrics: Metrics,
    health: Health,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<Option<TelemetryServer>, TelemetryError> {
    match config.listen_addr()? {
        Some(addr) => Ok(Some(serve(addr, metrics, health, shutdown).await?)),
        None => Ok(None),
    }
}

fn router(state: AppState) -> Router {
    Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(healthz_handler))
        .route("/readyz", get(readyz_handler))
        .with_state(state)
}

/// OpenMetrics when the scraper asks for it (Prometheus does), the
/// Prometheus text format 0.0.4 otherwise (curl, promtool).
async fn metrics_handler(State(state): State<AppState>, headers: HeaderMap) -> Response {
    let wants_openmetrics = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("application/openmetrics-text"));
    let (body, content_type) = if wants_openmetrics {
        (state.metrics.encode_openmetrics(), OPENMETRICS_CONTENT_TYPE)
    } else {
        (
            state.metrics.encode_prometheus_text(),
            PROMETHEUS_TEXT_CONTENT_TYPE,
        )
    };
    match body {
        Ok(body) => ([(header::CONTENT_TYPE, content_type)], body).into_response(),
        Err(e) => {
            tracing::error!(error = %e, "cannot encode metrics");
            (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")).into_response()
        }
    }
}

async fn healthz_handler() -> &'static str {
    "ok\n"
}

async fn readyz_handler(State(state): State<AppState>) -> Response {
    let readiness = state.health.readiness();
    let status = match readiness {
        Readiness::Ready => StatusCode::OK,
        Readiness::NotReady(_) => StatusCode::SERVICE_UNAVAILABLE,
    };
    (status, readiness.to_string()).into_response()
}
