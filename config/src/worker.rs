//! `[worker]`: settings of the rollout worker (owned by the worker's crate).
//!
//! ```toml
//! [worker]
//! id = "worker-a"                 # default: <hostname>-<pid>
//! max_sequences = 16              # sequences decoded together (continuous batch slots)
//! share_prompts = true            # built-in engine: a group's prompt is computed once, its KV copied
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
//!
//! [worker.engine]                 # what generates; leave out for the built-in engine
//! kind = "vllm"                   # "builtin" (default: the tch model in the worker) or "vllm"
//! endpoints = ["http://127.0.0.1:8000"]  # vLLM servers (dev-mode routes: loopback / pod only)
//! launch = []                     # a command that starts the one local server; empty = attach
//! weights_dir = "/tmp/asyncrl-engine-weights"  # per-version folders the engine reloads from
//! pause_mode = "abort"            # on a weight swap: "abort" (resubmit prompt + partial tokens) or "keep"
//! api = "auto"                    # "generate" (/inference/v1/generate), "completions", or probe
//! ready_timeout = "600s"          # start-up (and restart) until the server answers /health
//! request_timeout = "600s"        # one generation request
//! control_timeout = "120s"        # one control call (pause, reload, resume, ...)
//! ```

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{ConfigError, check_range};

/// How the worker fills its decode batch.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
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
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
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

/// Which engine generates the worker's completions.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum EngineKind {
    /// The tch model on the worker's own model thread.
    #[default]
    Builtin,
    /// One or more vLLM servers, driven over HTTP (token ids in, token ids
    /// and processed log-probs out).
    Vllm,
}

/// How in-flight requests are treated while the engine swaps weights.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum PauseMode {
    /// Requests in flight end with their partial tokens; the worker
    /// resubmits prompt + partial tokens with the remaining budget once the
    /// new weights are in (every token is sampled from fresh KV).
    #[default]
    Abort,
    /// Requests are frozen and continue on the new weights (their KV cache
    /// from the old weights is kept); needs the engine's version spans.
    Keep,
}

/// Which generation route of the engine the worker uses.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum EngineApi {
    /// `/inference/v1/generate` when the server has it, else `/v1/completions`.
    #[default]
    Auto,
    /// `/inference/v1/generate` (token ids, processed log-probs, weight
    /// version spans); an error when the server lacks it.
    Generate,
    /// `/v1/completions` with a token-id prompt (no version spans).
    Completions,
}

/// `[worker.engine]`: the inference engine the worker generates with.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EngineConfig {
    pub kind: EngineKind,
    /// Base URLs (`http://host:port`) of the engine servers.
    pub endpoints: Vec<String>,
    /// Command (program and arguments) that starts a local server for the
    /// one endpoint; the worker runs it, waits for readiness, and restarts
    /// it when it dies. Empty: attach to a server that runs already.
    pub launch: Vec<String>,
    /// Where the worker writes each version's weights for the engine to
    /// reload (`v<version>/model.safetensors`); the engine must see the same
    /// path (a shared emptyDir in the sidecar layout).
    pub weights_dir: std::path::PathBuf,
    pub pause_mode: PauseMode,
    pub api: EngineApi,
    /// How long to wait for `/health` at start-up and after a restart.
    #[serde(with = "humantime_serde")]
    pub ready_timeout: Duration,
    /// Timeout of one generation request.
    #[serde(with = "humantime_serde")]
    pub request_timeout: Duration,
    /// Timeout of one control call (pause, reload, resume, probes).
    #[serde(with = "humantime_serde")]
    pub control_timeout: Duration,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            kind: EngineKind::Builtin,
            endpoints: Vec::new(),
            launch: Vec::new(),
            weights_dir: std::env::temp_dir().join("asyncrl-engine-weights"),
            pause_mode: PauseMode::Abort,
            api: EngineApi::Auto,
            ready_timeout: Duration::from_secs(600),
            request_timeout: Duration::from_secs(600),
            control_timeout: Duration::from_secs(120),
        }
    }
}

impl EngineConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        for (key, d) in [
            ("worker.engine.ready_timeout", self.ready_timeout),
            ("worker.engine.request_timeout", self.request_timeout),
            ("worker.engine.control_timeout", self.control_timeout),
        ] {
            if d.is_zero() {
                return Err(ConfigError::invalid(key, "must be longer than 0s"));
            }
        }
        match self.kind {
            EngineKind::Builtin => {
                if !self.endpoints.is_empty() || !self.launch.is_empty() {
                    return Err(ConfigError::invalid(
                        "worker.engine.kind",
                        "= \"builtin\" takes no endpoints or launch command (set kind = \"vllm\")",
                    ));
                }
            }
            EngineKind::Vllm => {
                if self.endpoints.is_empty() {
                    return Err(ConfigError::invalid(
                        "worker.engine.endpoints",
                        "is empty: kind = \"vllm\" needs at least one http://host:port",
                    ));
                }
                for e in &self.endpoints {
                    if !valid_http_url(e) {
                        return Err(ConfigError::invalid(
                            "worker.engine.endpoints",
                            format!("{e:?} is not an http://host:port URL"),
                        ));
                    }
                }
                if !self.launch.is_empty() && self.endpoints.len() != 1 {
                    return Err(ConfigError::invalid(
                        "worker.engine.launch",
                        format!(
                            "starts one server but worker.engine.endpoints has {}",
                            self.endpoints.len()
                        ),
                    ));
                }
                if self.launch.first().is_some_and(|p| p.trim().is_empty()) {
                    return Err(ConfigError::invalid(
                        "worker.engine.launch",
                        "has an empty program name",
                    ));
                }
                if self.weights_dir.as_os_str().is_empty() {
                    return Err(ConfigError::invalid(
                        "worker.engine.weights_dir",
                        "is empty",
                    ));
                }
                if self.pause_mode == PauseMode::Keep && self.api == EngineApi::Completions {
                    return Err(ConfigError::invalid(
                        "worker.engine.pause_mode",
                        "= \"keep\" needs per-token weight versions, which api = \"completions\" does not give (use \"abort\" or api = \"generate\")",
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Whether `s` is `http://` or `https://` followed by a host.
fn valid_http_url(s: &str) -> bool {
    ["http://", "https://"].iter().any(|p| {
        s.strip_prefix(p)
            .is_some_and(|rest| !rest.trim().is_empty())
    })
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerConfig {
    /// The worker's id at the coordinator (`[A-Za-z0-9_-]`, 1-128
    /// characters); default `<hostname>-<pid>`.
    pub id: Option<String>,
    /// Sequences decoded together: the slots of the continuous batch.
    pub max_sequences: usize,
    /// The built-in engine's prompt sharing: sequences with one prompt (a
    /// group's completions) compute its keys and values once and copy them
    /// (`asyncrl_policy::DecodeBatch::share_prompts`); vLLM has its own
    /// prefix cache.
    pub share_prompts: bool,
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
    pub engine: EngineConfig,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            id: None,
            max_sequences: 16,
            share_prompts: true,
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
            engine: EngineConfig::default(),
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
        if let Some(endpoint) = &self.reward.endpoint
            && !valid_http_url(endpoint)
        {
            return Err(ConfigError::invalid(
                "worker.reward.endpoint",
                format!("= {endpoint:?} is not an http://host:port URL"),
            ));
        }
        check_range("worker.reward.attempts", self.reward.attempts, 1, 100)?;
        check_range(
            "worker.reward.concurrency",
            self.reward.concurrency,
            1,
            4096,
        )?;
        self.engine.validate()
    }
}
