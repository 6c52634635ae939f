//! Observability shared by every asyncrl role.
//!
//! - [`Metrics`]: the process's one Prometheus registry (prefix `asyncrl_`),
//!   a cheap cloneable handle that crates register their metrics into.
//! - [`Health`]: named readiness conditions that a role sets and clears.
//! - [`serve`]: the HTTP server with `/metrics`, `/healthz` and `/readyz`.
//! - [`init_tracing`]: text or JSON logs with a filter from the config,
//!   overridden by `RUST_LOG`.

mod exposition;
mod health;
mod logging;
mod metrics;
mod server;

pub use exposition::{
    OPENMETRICS_CONTENT_TYPE, PROMETHEUS_TEXT_CONTENT_TYPE, openmetrics_to_prometheus_text,
};
pub use health::{Health, Readiness};
pub use logging::init_tracing;
pub use metrics::{METRIC_PREFIX, Metrics};
pub use server::{TelemetryServer, serve, serve_from_config};

/// Re-exported so that crates register metrics of the same prometheus-client
/// version without naming it in their own Cargo.toml.
pub use prometheus_client;

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("metric `{name}` is already registered")]
    DuplicateMetric { name: String },
    #[error("metric `{name}` is registered with another type than requested")]
    MetricTypeMismatch { name: String },
    #[error("invalid metric name `{name}`: {reason}")]
    InvalidMetricName { name: String, reason: &'static str },
    #[error("cannot encode metrics: {0}")]
    Encode(#[from] std::fmt::Error),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("telemetry server failed: {0}")]
    Serve(std::io::Error),
    #[error("telemetry server task failed: {0}")]
    Join(#[from] tokio::task::JoinError),
    #[error(transparent)]
    Config(#[from] asyncrl_config::ConfigError),
    #[error("invalid log filter {source_name} = {filter:?}: {message}")]
    LogFilter {
        /// Where the filter came from: `RUST_LOG` or `telemetry.log_filter`.
        source_name: &'static str,
        filter: String,
        message: String,
    },
    #[error("cannot install the tracing subscriber: {0}")]
    TracingInit(String),
}
