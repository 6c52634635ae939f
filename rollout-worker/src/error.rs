//! The worker's error type.

use asyncrl_policy::PolicyError;
use asyncrl_telemetry::TelemetryError;
use asyncrl_transport::TransportError;

use crate::reward::RewardError;

/// Why the worker could not start or had to stop. Transient trouble (a
/// coordinator that does not answer yet, a weight fetch that fails, a
/// publish that times out) is retried inside the worker and never ends up
/// here.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("invalid worker settings: `{key}` {reason}")]
    Settings { key: String, reason: String },
    #[error("the policy model failed: {0}")]
    Model(#[from] PolicyError),
    #[error("cannot register the worker's metrics: {0}")]
    Metrics(#[from] TelemetryError),
    #[error("reward service: {0}")]
    Reward(#[from] RewardError),
    #[error("bus: {0}")]
    Transport(#[from] TransportError),
    #[error("the coordinator refused to register worker {worker_id}: {reason}")]
    Rejected { worker_id: String, reason: String },
    #[error("a worker task failed: {0}")]
    Join(#[from] tokio::task::JoinError),
    /// The engine could not be started or does not match the config (the
    /// message names the setting).
    #[error(transparent)]
    Engine(anyhow::Error),
    /// `[environment]` could not be set up (the message names the key).
    #[error("environment: {0:#}")]
    Environment(anyhow::Error),
    /// The worker had to stop (its engine is gone, or its first weights do
    /// not fit the engine).
    #[error("the worker stopped: {0}")]
    Stopped(String),
}
