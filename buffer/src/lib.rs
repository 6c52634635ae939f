//! The staleness-aware replay buffer.
//!
//! Trajectories come in over a durable JetStream pull consumer on
//! `TRAJECTORIES`; each message is decoded and checked against the contract
//! (a malformed one goes to `TRAJECTORIES_DLQ` with the reason, is counted
//! and acked), deduplicated by uuid, appended to the on-disk segment and to
//! in-memory Arrow record batches, and acked only after the segment write is
//! durable. Groups complete at G trajectories of one `group_id`; the first
//! complete attempt of a task is kept, later ones are dropped and reported.
//! The learner asks for B groups for step s at version v over request/reply
//! (`asyncrl.buffer.batch`) and gets an Arrow IPC stream; a group with a
//! token older than v − η is never served. What was served for which step is
//! logged durably before the reply, so a repeated request gets the same
//! groups and nothing is served twice, also across restarts. See
//! `buffer/README.md` for the full design, including the segment format and
//! fsync decisions.
//!
//! Entry points: [`run`] (or [`Buffer::open`] + [`Buffer::run`]) to run the
//! buffer in-process or as its own process; [`export`] for `asyncrl buffer
//! export`.

pub mod core;
mod export;
mod metrics;
mod reply;
pub mod segment;
mod service;
pub mod statelog;
mod storage;
#[doc(hidden)]
#[cfg(any(test, feature = "testsuite"))]
pub mod testing;

use std::path::{Path, PathBuf};

pub use crate::core::Stats;
pub use export::{ExportArgs, ExportFormat, ExportSummary, export};
pub use metrics::{BufferMetrics, LagHistogram};
pub use reply::{MAX_SLICES, batch_parts, decode_batch, encode_batch, encode_parts};
pub use service::{
    Buffer, BufferHandle, DISK_HEALTH_CONDITION, HEALTH_CONDITION, Recovered,
    dead_letter_stream_spec, held_tasks, run, trajectory_stream_spec,
};

/// Re-exported so that callers create the shutdown token of [`run`] with the
/// same tokio-util version.
pub use tokio_util::sync::CancellationToken;

#[derive(Debug, thiserror::Error)]
pub enum BufferError {
    #[error("cannot {op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("segment {} is unreadable: {reason}", path.display())]
    Segment { path: PathBuf, reason: String },
    #[error("served log: {0}")]
    StateLog(&'static str),
    #[error("cannot encode a served-log record: {0}")]
    StateLogEncode(#[source] serde_json::Error),
    #[error("arrow: {0}")]
    Arrow(#[from] arrow::error::ArrowError),
    /// A batch that does not decode; the message also covers a panic of the
    /// Arrow decoder, which has no error value.
    #[error("the batch does not decode: {0}")]
    BatchDecode(String),
    #[error("parquet: {0}")]
    Parquet(#[from] parquet::errors::ParquetError),
    #[error(transparent)]
    Transport(#[from] asyncrl_transport::TransportError),
    #[error(transparent)]
    Telemetry(#[from] asyncrl_telemetry::TelemetryError),
    #[error(transparent)]
    Contract(#[from] asyncrl_protos::ContractError),
    #[error("background task failed: {0}")]
    Join(#[from] tokio::task::JoinError),
    #[error("{0} was lost by an earlier failure")]
    Lost(&'static str),
    #[error("invalid export: {0}")]
    Export(String),
}

impl BufferError {
    pub(crate) fn io(op: &'static str, path: &Path, source: std::io::Error) -> Self {
        BufferError::Io {
            op,
            path: path.to_owned(),
            source,
        }
    }
}

/// Directory of the segments under the buffer's data directory.
pub fn segment_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("segments")
}
