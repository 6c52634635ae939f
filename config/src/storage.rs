//! `[bus.storage]`: how much NATS (JetStream) may hold, per store.
//!
//! ```toml
//! [bus.storage]
//! trajectories = "release"               # or "keep" (an audit log, see below)
//! trajectories_max_bytes = 1073741824    # backlog cap: publishes wait beyond it
//! trajectories_max_age = "24h"           # only with "keep"
//! dead_letters_max_bytes = 268435456     # oldest dead letters go first
//! dead_letters_max_age = "168h"
//! kv_max_bytes = 67108864                # the control bucket (history 1)
//! object_store_max_bytes = 0             # 0: bounded by count only
//! report_every = "15s"                   # asyncrl_nats_store_* gauges
//! ```
//!
//! Nothing here can lose a trajectory: the trajectory stream refuses new
//! messages when full (the workers back off and retry, with the same
//! message id), it never discards one the buffer has not stored.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{ConfigError, check_range};

/// What the `TRAJECTORIES` stream keeps.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum TrajectoryRetention {
    /// A message is removed once the buffer has stored it durably and acked
    /// it (a work-queue stream): the stream holds only the backlog the
    /// buffer has not yet stored, at most about (η+1)·B·G trajectories.
    #[default]
    Release,
    /// Every message is kept for `trajectories_max_age` after it was
    /// published, as an audit log next to the buffer's segments. The stream
    /// then grows with the run until messages age out; when it reaches
    /// `trajectories_max_bytes`, publishes wait until old ones expire.
    Keep,
}

impl TrajectoryRetention {
    pub fn as_str(self) -> &'static str {
        match self {
            TrajectoryRetention::Release => "release",
            TrajectoryRetention::Keep => "keep",
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct StorageConfig {
    pub trajectories: TrajectoryRetention,
    /// Bytes the trajectory stream may hold. Beyond it, a publish is refused
    /// (`StreamFull`) and the worker retries with backoff; nothing is dropped.
    pub trajectories_max_bytes: u64,
    /// With `trajectories = "keep"`: how long a message is kept (0: until
    /// the stream is full, after which publishes wait forever).
    #[serde(with = "humantime_serde")]
    pub trajectories_max_age: Duration,
    /// Bytes of the dead-letter stream; when full, the oldest dead letters
    /// are removed (each was counted in `asyncrl_buffer_dead_letters_total`
    /// when it arrived).
    pub dead_letters_max_bytes: u64,
    /// Dead letters older than this are removed.
    #[serde(with = "humantime_serde")]
    pub dead_letters_max_age: Duration,
    /// Bytes of each key-value bucket (the control bucket keeps one
    /// revision per key).
    pub kv_max_bytes: u64,
    /// Bytes of each object-store bucket (the weights, the buffer's large
    /// batches); 0 leaves them bounded by count only: the learner keeps
    /// `learner.keep_weight_versions` versions and the buffer deletes a
    /// batch object once a later step is asked for.
    pub object_store_max_bytes: u64,
    /// How often the buffer reads the size of every store for the
    /// `asyncrl_nats_store_*` gauges.
    #[serde(with = "humantime_serde")]
    pub report_every: Duration,
}

const MIB: u64 = 1024 * 1024;

impl Default for StorageConfig {
    fn default() -> Self {
        Self {
            trajectories: TrajectoryRetention::Release,
            trajectories_max_bytes: 1024 * MIB,
            trajectories_max_age: Duration::from_secs(24 * 3600),
            dead_letters_max_bytes: 256 * MIB,
            dead_letters_max_age: Duration::from_secs(7 * 24 * 3600),
            kv_max_bytes: 64 * MIB,
            object_store_max_bytes: 0,
            report_every: Duration::from_secs(15),
        }
    }
}

impl StorageConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        // JetStream needs room for at least one message of max_payload.
        check_range(
            "bus.storage.trajectories_max_bytes",
            self.trajectories_max_bytes,
            MIB,
            1 << 50,
        )?;
        check_range(
            "bus.storage.dead_letters_max_bytes",
            self.dead_letters_max_bytes,
            MIB,
            1 << 50,
        )?;
        check_range("bus.storage.kv_max_bytes", self.kv_max_bytes, MIB, 1 << 50)?;
        if self.object_store_max_bytes != 0 && self.object_store_max_bytes < 16 * MIB {
            return Err(ConfigError::invalid(
                "bus.storage.object_store_max_bytes",
                format!(
                    "= {} is below 16 MiB (one model's weights must fit; 0 bounds by count only)",
                    self.object_store_max_bytes
                ),
            ));
        }
        if self.dead_letters_max_age.is_zero() {
            return Err(ConfigError::invalid(
                "bus.storage.dead_letters_max_age",
                "must be longer than 0s",
            ));
        }
        if self.report_every < Duration::from_millis(100) {
            return Err(ConfigError::invalid(
                "bus.storage.report_every",
                "must be at least 100ms",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Config;

    fn load(text: &str) -> Result<Config, ConfigError> {
        Config::parse(text, None)
    }

    #[test]
    fn defaults_release_the_stream_and_bound_every_store() {
        let c = StorageConfig::default();
        assert_eq!(c.trajectories, TrajectoryRetention::Release);
        assert!(c.trajectories_max_bytes > 0 && c.dead_letters_max_bytes > 0 && c.kv_max_bytes > 0);
        c.validate().unwrap();
    }

    #[test]
    fn parses_and_names_bad_keys() {
        let c = load(
            "[bus]\nurl = \"nats://x:4222\"\n[bus.storage]\ntrajectories = \"keep\"\ntrajectories_max_age = \"2h\"\nobject_store_max_bytes = 1073741824\n",
        )
        .unwrap();
        assert_eq!(c.bus.storage.trajectories, TrajectoryRetention::Keep);
        assert_eq!(
            c.bus.storage.trajectories_max_age,
            Duration::from_secs(7200)
        );
        assert_eq!(c.bus.storage.object_store_max_bytes, 1 << 30);

        for (text, key) in [
            ("trajectories = \"forever\"", "trajectories"),
            (
                "trajectories_max_bytes = 10",
                "bus.storage.trajectories_max_bytes",
            ),
            (
                "dead_letters_max_bytes = 0",
                "bus.storage.dead_letters_max_bytes",
            ),
            ("kv_max_bytes = 5", "bus.storage.kv_max_bytes"),
            (
                "object_store_max_bytes = 1000",
                "bus.storage.object_store_max_bytes",
            ),
            (
                "dead_letters_max_age = \"0s\"",
                "bus.storage.dead_letters_max_age",
            ),
            ("report_every = \"1ms\"", "bus.storage.report_every"),
            ("max_everything = 1", "max_everything"),
        ] {
            let err = load(&format!("[bus.storage]\n{text}\n"))
                .unwrap_err()
                .to_string();
            assert!(err.contains(key), "{text}: {err}");
        }
    }
}
