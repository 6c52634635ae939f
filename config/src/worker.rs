//! `[worker]`: settings of the rollout worker (owned by the worker's crate).
//!
//! ```toml
//! [worker]
//! id = "worker-a"                 # default: <hostname>-<pid>
//! max_sequences = 16              # sequences decoded together (continuous batch slots)
//! max_tasks_in_flight = 0         # tasks held at once; 0 = ceil(max_sequences / G) + 2
//! batching = "continuous"         # or "static" (the baseline: wait for the whole batch)
//! heartbeat_interval = "2s"       # the coordinator's interval wins when it asks for a shorter one
//! acquire_backoff_min = "50ms"    # retry delay after a failed acquire, doubling...
//! acquire_backoff_max = "2s"      # ...up to this
//! drain_grace_period = "30s"      # SIGTERM: time to finish the sequences in flight
//! weight_fetch_timeout = "60s"    # one fetch of a weight object
//! weight_retry_backoff_min = "500ms"
//! weight_retry_backoff_max = "30s"
//! metrics_interval = "1s"         # how often engine counters are sampled into metrics
//! cpu_affinity = []               # pin the model thread to these cores (empty: no pinning)
//!
//! [worker.reward]                 # leave out for the built-in verifiers
//! endpoint = "http://127.0.0.1:50061"   # an external RewardService (gRPC)
//! timeout = "5s"
//! attempts = 3
//! backoff = "100ms"
//! concurrency = 16
//! ```

use std::time::Duration;

use serde::Deserialize;

use crate::{ConfigError, check_range};

/// How the worker fills its decode batch.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum BatchingMode {
    /// A finished sequence frees its slot at once and the worker starts new
    /// work in it (acquiring tasks as slots free up).
    #[default]
    Continuous,
    /// The baseline: acquire a batch of tasks, wait until every sequence of
    /// the batch has finished, then acquire the next batch.
    Static,
}

/// `[worker.reward]`: the external reward service; built-in verifiers when
/// `endpoint` is unset.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerRewardConfig {
    /// `http://host:port` of a gRPC `RewardService`; unset = the built-in
    /// verifiers of the built-in tasks.
    pub endpoint: Option<String>,
    /// Timeout of one call.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// Attempts per completion (1 = no retry); then the reward is marked failed.
    pub attempts: u32,
    /// Delay before the first retry; doubles each retry.
    #[serde(with = "humantime_serde")]
    pub backoff: Duration,
    /// Calls in flight at once.
    pub concurrency: usize,
}

impl Default for WorkerRewardConfig {
    fn default() -> Self {
        Self {
            endpoint: None,
            timeout: Duration::from_secs(5),
            attempts: 3,
            backoff: Duration::from_millis(100),
            concurrency: 16,
        }
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerConfig {
    /// The worker's id at the coordinator (`[A-Za-z0-9_-]`, 1-128
    /// characters); default `<hostname>-<pid>`.
    pub id: Option<String>,
    /// Sequences decoded together: the slots of the continuous batch.
    pub max_sequences: usize,
    /// Most tasks held at once (generating, scoring or publishing);
    /// 0 = `ceil(max_sequences / staleness.group_size) + 2`.
    pub max_tasks_in_flight: usize,
    pub batching: BatchingMode,
    /// Heartbeat period (the coordinator's, when it asks for a shorter one).
    #[serde(with = "humantime_serde")]
    pub heartbeat_interval: Duration,
    /// Delay before retrying a failed acquire (doubles up to the max); a
    /// coordinator that says when to retry is followed instead.
    #[serde(with = "humantime_serde")]
    pub acquire_backoff_min: Duration,
    #[serde(with = "humantime_serde")]
    pub acquire_backoff_max: Duration,
    /// On SIGTERM: how long the sequences in flight may take to finish
    /// before the worker returns their tasks to the coordinator.
    #[serde(with = "humantime_serde")]
    pub drain_grace_period: Duration,
    /// Timeout of one fetch of a weight object.
    #[serde(with = "humantime_serde")]
    pub weight_fetch_timeout: Duration,
    /// Delay before retrying a failed weight fetch (doubles up to the max).
    #[serde(with = "humantime_serde")]
    pub weight_retry_backoff_min: Duration,
    #[serde(with = "humantime_serde")]
    pub weight_retry_backoff_max: Duration,
    /// How often the model thread's counters are sampled into metrics.
    #[serde(with = "humantime_serde")]
    pub metrics_interval: Duration,
    /// Pin the model thread (and the libtorch threads it starts) to these
    /// CPU cores (empty: no pinning); with `learner.cpu_affinity` it keeps
    /// a one-machine run's learner and worker on cores of their own.
    pub cpu_affinity: Vec<usize>,
    pub reward: WorkerRewardConfig,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            id: None,
            max_sequences: 16,
            max_tasks_in_flight: 0,
            batching: BatchingMode::Continuous,
            heartbeat_interval: Duration::from_secs(2),
            acquire_backoff_min: Duration::from_millis(50),
            acquire_backoff_max: Duration::from_secs(2),
            drain_grace_period: Duration::from_secs(30),
            weight_fetch_timeout: Duration::from_secs(60),
            weight_retry_backoff_min: Duration::from_millis(500),
            weight_retry_backoff_max: Duration::from_secs(30),
            metrics_interval: Duration::from_secs(1),
            cpu_affinity: Vec::new(),
            reward: WorkerRewardConfig::default(),
        }
    }
}

/// Whether `id` is a worker id the coordinator accepts.
pub fn valid_worker_id(id: &str) -> bool {
    (1..=128).contains(&id.len())
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

impl WorkerConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(id) = &self.id
            && !valid_worker_id(id)
        {
            return Err(ConfigError::invalid(
                "worker.id",
                format!("= {id:?} must be 1-128 characters of [A-Za-z0-9_-]"),
            ));
        }
        check_range("worker.max_sequences", self.max_sequences, 1, 4096)?;
        crate::check_cores("worker.cpu_affinity", &self.cpu_affinity)?;
        check_range(
            "worker.max_tasks_in_flight",
            self.max_tasks_in_flight,
            0,
            4096,
        )?;
        for (key, d) in [
            ("worker.heartbeat_interval", self.heartbeat_interval),
            ("worker.acquire_backoff_min", self.acquire_backoff_min),
            ("worker.acquire_backoff_max", self.acquire_backoff_max),
            ("worker.weight_fetch_timeout", self.weight_fetch_timeout),
            (
                "worker.weight_retry_backoff_min",
                self.weight_retry_backoff_min,
            ),
            (
                "worker.weight_retry_backoff_max",
                self.weight_retry_backoff_max,
            ),
            ("worker.metrics_interval", self.metrics_interval),
            ("worker.reward.timeout", self.reward.timeout),
        ] {
            if d.is_zero() {
                return Err(ConfigError::invalid(key, "must be longer than 0s"));
            }
        }
        if self.acquire_backoff_max < self.acquire_backoff_min {
            return Err(ConfigError::invalid(
                "worker.acquire_backoff_max",
                format!(
                    "= {:?} is shorter than worker.acquire_backoff_min ({:?})",
                    self.acquire_backoff_max, self.acquire_backoff_min
                ),
            ));
        }
        if self.weight_retry_backoff_max < self.weight_retry_backoff_min {
            return Err(ConfigError::invalid(
                "worker.weight_retry_backoff_max",
                format!(
                    "= {:?} is shorter than worker.weight_retry_backoff_min ({:?})",
                    self.weight_retry_backoff_max, self.weight_retry_backoff_min
                ),
            ));
        }
        if let Some(endpoint) = &self.reward.endpoint {
            let ok = ["http://", "https://"].iter().any(|s| {
                endpoint
                    .strip_prefix(s)
                    .is_some_and(|rest| !rest.trim().is_empty())
            });
            if !ok {
                return Err(ConfigError::invalid(
                    "worker.reward.endpoint",
                    format!("= {endpoint:?} is not an http://host:port URL"),
                ));
            }
        }
        check_range("worker.reward.attempts", self.reward.attempts, 1, 100)?;
        check_range(
            "worker.reward.concurrency",
            self.reward.concurrency,
            1,
            4096,
        )?;
        Ok(())
    }
}
