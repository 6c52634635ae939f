//! `[buffer]`: settings of the replay buffer (owned by the buffer's crate).
//!
//! ```toml
//! [buffer]
//! data_dir = "runs/asyncrl/buffer"   # default: <run.output_dir>/buffer
//! segment_max_bytes = 67108864       # rotate the on-disk segment at this size
//! segment_compression = "none"       # or "zstd" (Arrow IPC buffer compression)
//! fsync = "always"                   # or "never" (see buffer/README.md)
//! sampling = "fifo"                  # or "reuse" (with reuse_max) or "fresh_first"
//! retention = "delete"               # or "keep"
//! serve_zstd = false                 # compress every batch, even if not asked to
//! min_reward_spread = 0.0            # dynamic sampling: drop groups whose rewards
//!                                    # span less than this (0: off)
//! ```

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{ConfigError, check_range};

/// How the learner's batches are drawn from the ready groups.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum SamplingPolicy {
    /// Each group once, oldest admission first (the staleness guarantee of
    /// the admission rule holds exactly).
    #[default]
    Fifo,
    /// Each group up to `reuse_max` times while it is within η, in random
    /// reshuffling order (every pass over the pool is a fresh permutation; a
    /// group never appears twice in one batch).
    Reuse,
    /// Each group once, newest first.
    FreshFirst,
}

/// When a segment write is made durable before its messages are acked.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum FsyncPolicy {
    /// `fdatasync` after every written batch of messages, before they are
    /// acked: an acked trajectory survives a power loss or kernel crash.
    #[default]
    Always,
    /// Write to the page cache only: an acked trajectory survives a crash of
    /// the buffer process, but not of the machine.
    Never,
}

/// What happens to a segment once every group in it has been consumed.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum RetentionPolicy {
    /// Delete it.
    #[default]
    Delete,
    /// Keep every segment (for `asyncrl buffer export` of the whole run).
    Keep,
}

/// Compression of the Arrow IPC buffers in the on-disk segments.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum SegmentCompression {
    #[default]
    None,
    Zstd,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct BufferConfig {
    /// Directory of the segments and the served log. Default:
    /// `<run.output_dir>/buffer`.
    pub data_dir: Option<PathBuf>,
    /// A segment file is closed and a new one started past this size (bytes).
    pub segment_max_bytes: u64,
    pub segment_compression: SegmentCompression,
    pub fsync: FsyncPolicy,
    pub sampling: SamplingPolicy,
    /// K of `sampling = "reuse"`: how often a group may be served. Only
    /// allowed with `reuse` (default 2 there).
    pub reuse_max: Option<u32>,
    pub retention: RetentionPolicy,
    /// Compress every learner batch with zstd, whether or not the request asks.
    pub serve_zstd: bool,
    /// Batches larger than this (encoded bytes) are handed over through the
    /// object store `batch_object_bucket` instead of inline in the reply (the
    /// default stays below NATS' default 1 MiB max_payload).
    pub inline_reply_max_bytes: u64,
    pub batch_object_bucket: String,
    /// Name of the durable JetStream consumer on the trajectory stream.
    pub consumer_name: String,
    /// Messages taken per fetch; they are written to the segment with one
    /// write (and one fsync) and then acked together.
    pub ingest_batch: usize,
    /// How long one fetch waits for the first message.
    #[serde(with = "humantime_serde")]
    pub fetch_wait: Duration,
    /// An un-acked message is redelivered after this long.
    #[serde(with = "humantime_serde")]
    pub ack_wait: Duration,
    /// At most this many delivered, un-acked messages.
    pub max_ack_pending: usize,
    /// Longest time a batch request may wait for enough ready groups.
    #[serde(with = "humantime_serde")]
    pub max_request_wait: Duration,
    /// The served log is compacted into a snapshot past this size (bytes).
    pub state_log_compact_bytes: u64,
    /// Dynamic sampling (DAPO): a complete group whose members all have a
    /// reward and whose rewards span less than this (`max − min <
    /// min_reward_spread`) carries no signal and is dropped before it is
    /// served (`no_signal`). 0 (the default): off. A group with a member
    /// whose reward could not be computed is never dropped for this.
    pub min_reward_spread: f64,
}

impl Default for BufferConfig {
    fn default() -> Self {
        Self {
            data_dir: None,
            segment_max_bytes: 64 * 1024 * 1024,
            segment_compression: SegmentCompression::None,
            fsync: FsyncPolicy::Always,
            sampling: SamplingPolicy::Fifo,
            reuse_max: None,
            retention: RetentionPolicy::Delete,
            serve_zstd: false,
            inline_reply_max_bytes: 768 * 1024,
            batch_object_bucket: "BUFFER_BATCHES".into(),
            consumer_name: "asyncrl-buffer".into(),
            ingest_batch: 256,
            fetch_wait: Duration::from_millis(200),
            ack_wait: Duration::from_secs(30),
            max_ack_pending: 8192,
            max_request_wait: Duration::from_secs(30),
            state_log_compact_bytes: 64 * 1024 * 1024,
            min_reward_spread: 0.0,
        }
    }
}

/// Default K of `sampling = "reuse"`.
pub const DEFAULT_REUSE_MAX: u32 = 2;

fn is_nats_name(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

impl BufferConfig {
    /// The data directory: `data_dir`, or `<output_dir>/buffer`.
    pub fn data_dir_in(&self, output_dir: &Path) -> PathBuf {
        self.data_dir
            .clone()
            .unwrap_or_else(|| output_dir.join("buffer"))
    }

    /// K: how often one group may be served (1 unless `sampling = "reuse"`).
    pub fn max_serves(&self) -> u32 {
        match self.sampling {
            SamplingPolicy::Reuse => self.reuse_max.unwrap_or(DEFAULT_REUSE_MAX),
            SamplingPolicy::Fifo | SamplingPolicy::FreshFirst => 1,
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(dir) = &self.data_dir
            && dir.as_os_str().is_empty()
        {
            return Err(ConfigError::invalid(
                "buffer.data_dir",
                "is empty (leave it out for <run.output_dir>/buffer)",
            ));
        }
        check_range(
            "buffer.segment_max_bytes",
            self.segment_max_bytes,
            64 * 1024,
            1 << 40,
        )?;
        match (self.sampling, self.reuse_max) {
            (SamplingPolicy::Reuse, Some(k)) => check_range("buffer.reuse_max", k, 1, 64)?,
            (SamplingPolicy::Reuse, None) | (_, None) => {}
            (_, Some(_)) => {
                return Err(ConfigError::invalid(
                    "buffer.reuse_max",
                    "applies only with buffer.sampling = \"reuse\"",
                ));
            }
        }
        check_range(
            "buffer.inline_reply_max_bytes",
            self.inline_reply_max_bytes,
            1024,
            64 * 1024 * 1024,
        )?;
        if !is_nats_name(&self.batch_object_bucket) {
            return Err(ConfigError::invalid(
                "buffer.batch_object_bucket",
                format!(
                    "= {:?} must be non-empty [A-Za-z0-9_-]",
                    self.batch_object_bucket
                ),
            ));
        }
        if !is_nats_name(&self.consumer_name) {
            return Err(ConfigError::invalid(
                "buffer.consumer_name",
                format!("= {:?} must be non-empty [A-Za-z0-9_-]", self.consumer_name),
            ));
        }
        check_range("buffer.ingest_batch", self.ingest_batch, 1, 10_000)?;
        check_range(
            "buffer.max_ack_pending",
            self.max_ack_pending,
            self.ingest_batch,
            1_000_000,
        )?;
        if self.ack_wait < Duration::from_secs(1) {
            return Err(ConfigError::invalid(
                "buffer.ack_wait",
                format!("= {:?} is below 1s", self.ack_wait),
            ));
        }
        if self.fetch_wait.is_zero() || self.fetch_wait * 2 > self.ack_wait {
            return Err(ConfigError::invalid(
                "buffer.fetch_wait",
                format!(
                    "= {:?} must be above 0 and at most half of buffer.ack_wait ({:?})",
                    self.fetch_wait, self.ack_wait
                ),
            ));
        }
        if self.max_request_wait > Duration::from_secs(600) {
            return Err(ConfigError::invalid(
                "buffer.max_request_wait",
                format!("= {:?} is above 10m", self.max_request_wait),
            ));
        }
        check_range(
            "buffer.state_log_compact_bytes",
            self.state_log_compact_bytes,
            4096,
            1 << 40,
        )?;
        if !self.min_reward_spread.is_finite() || self.min_reward_spread < 0.0 {
            return Err(ConfigError::invalid(
                "buffer.min_reward_spread",
                format!(
                    "= {} must be a finite number ≥ 0 (0: dynamic sampling off)",
                    self.min_reward_spread
                ),
            ));
        }
        Ok(())
    }

    /// Whether dynamic sampling is on (`min_reward_spread > 0`).
    pub fn dynamic_sampling(&self) -> bool {
        self.min_reward_spread > 0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_check::check;

    #[test]
    fn buffer_config_table() {
        check("[buffer]", None);
        check(
            "[buffer]\ndata_dir = \"/tmp/b\"\nsampling = \"reuse\"\nreuse_max = 4\nfsync = \"never\"\nretention = \"keep\"\nsegment_compression = \"zstd\"\nserve_zstd = true",
            None,
        );
        check("[buffer]\nsampling = \"fresh_first\"", None);
        check("[buffer]\ndata_dir = \"\"", Some("buffer.data_dir"));
        check("[buffer]\nsampling = \"lifo\"", Some("buffer.sampling"));
        check("[buffer]\nreuse_max = 3", Some("buffer.reuse_max"));
        check(
            "[buffer]\nsampling = \"reuse\"\nreuse_max = 0",
            Some("buffer.reuse_max"),
        );
        check("[buffer]\nfsync = \"sometimes\"", Some("buffer.fsync"));
        check(
            "[buffer]\nretention = \"compact\"",
            Some("buffer.retention"),
        );
        check(
            "[buffer]\nsegment_max_bytes = 10",
            Some("buffer.segment_max_bytes"),
        );
        check(
            "[buffer]\ninline_reply_max_bytes = 0",
            Some("buffer.inline_reply_max_bytes"),
        );
        check(
            "[buffer]\nconsumer_name = \"a.b\"",
            Some("buffer.consumer_name"),
        );
        check(
            "[buffer]\nbatch_object_bucket = \"\"",
            Some("buffer.batch_object_bucket"),
        );
        check("[buffer]\ningest_batch = 0", Some("buffer.ingest_batch"));
        check(
            "[buffer]\ningest_batch = 500\nmax_ack_pending = 100",
            Some("buffer.max_ack_pending"),
        );
        check("[buffer]\nack_wait = \"100ms\"", Some("buffer.ack_wait"));
        check(
            "[buffer]\nack_wait = \"2s\"\nfetch_wait = \"1500ms\"",
            Some("buffer.fetch_wait"),
        );
        check(
            "[buffer]\nmax_request_wait = \"1h\"",
            Some("buffer.max_request_wait"),
        );
        check("[buffer]\nsegment_size = 1", Some("buffer.segment_size"));
        check("[buffer]\nmin_reward_spread = 0.01", None);
        check("[buffer]\nmin_reward_spread = 0", None);
        check(
            "[buffer]\nmin_reward_spread = -0.5",
            Some("buffer.min_reward_spread"),
        );
        check(
            "[buffer]\nmin_reward_spread = nan",
            Some("buffer.min_reward_spread"),
        );
        check(
            "[buffer]\nmin_reward_spread = inf",
            Some("buffer.min_reward_spread"),
        );
        check(
            "[buffer]\nmin_reward_spread = \"wide\"",
            Some("buffer.min_reward_spread"),
        );
    }

    #[test]
    fn defaults_and_derived_values() {
        let c = BufferConfig::default();
        c.validate().unwrap();
        assert_eq!(c.max_serves(), 1);
        assert!(!c.dynamic_sampling(), "dynamic sampling is off by default");
        assert_eq!(
            c.data_dir_in(Path::new("runs/x")),
            PathBuf::from("runs/x/buffer")
        );
        let reuse = BufferConfig {
            sampling: SamplingPolicy::Reuse,
            ..Default::default()
        };
        assert_eq!(reuse.max_serves(), DEFAULT_REUSE_MAX);
        let reuse3 = BufferConfig {
            sampling: SamplingPolicy::Reuse,
            reuse_max: Some(3),
            data_dir: Some("/d".into()),
            ..Default::default()
        };
        assert_eq!(reuse3.max_serves(), 3);
        assert_eq!(reuse3.data_dir_in(Path::new("x")), PathBuf::from("/d"));
    }
}
