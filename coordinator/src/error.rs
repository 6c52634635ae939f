//! The coordinator's error: what stops it, each kind with its cause.

use std::net::SocketAddr;
use std::path::PathBuf;

use asyncrl_tasks::TaskError;
use asyncrl_telemetry::TelemetryError;
use asyncrl_transport::TransportError;

use crate::journal::JournalError;
use crate::knobs::KnobError;
use crate::scheduler::StateError;

#[derive(Debug, thiserror::Error)]
pub enum CoordinatorError {
    #[error(transparent)]
    Dataset(#[from] TaskError),
    #[error("cannot read the model's tokenizer to measure prompts: {0}")]
    Text(#[from] asyncrl_text::TextError),
    #[error("cannot {what}: {source}")]
    Transport {
        what: String,
        source: TransportError,
    },
    #[error(transparent)]
    State(#[from] StateError),
    #[error("the persisted coordinator state (KV key coordinator.state) does not decode: {0}")]
    StateDecode(#[source] prost::DecodeError),
    #[error(
        "another coordinator wrote coordinator.state (revision {revision}); only one coordinator may run per run and bucket. Stopping"
    )]
    AnotherCoordinator { revision: u64 },
    #[error(transparent)]
    Journal(#[from] JournalError),
    #[error(transparent)]
    Knobs(#[from] KnobError),
    #[error("cannot register the coordinator's metrics: {0}")]
    Telemetry(#[from] TelemetryError),
    #[error("cannot listen for the admin API on {addr}: {source}")]
    AdminBind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("admin TLS: cannot read {path}: {source}")]
    AdminTlsFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("admin TLS: {0}")]
    AdminTls(#[source] tonic::transport::Error),
    #[error("cannot read the admin token file {path}: {source}")]
    AdminTokenFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the admin token file {0} is empty")]
    AdminTokenEmpty(PathBuf),
    #[error(transparent)]
    Config(#[from] asyncrl_config::ConfigError),
    #[error("the coordinator has stopped")]
    Stopped,
    #[error("a coordinator task failed: {0}")]
    Join(#[source] tokio::task::JoinError),
}

impl CoordinatorError {
    pub(crate) fn transport(what: impl Into<String>, source: TransportError) -> Self {
        CoordinatorError::Transport {
            what: what.into(),
            source,
        }
    }
}
