//! The asyncrl configuration: one TOML file, validated on load.
//!
//! Unknown keys are rejected (serde `deny_unknown_fields`) and every
//! out-of-range value is reported with its full key (`coordinator.eta`), so
//! that a typo never silently falls back to a default.

mod buffer;
mod bus;
mod coordinator;
mod environment;
mod eval;
mod learner;
mod model;
mod run;
mod storage;
mod telemetry;
mod worker;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use buffer::{
    BufferConfig, DEFAULT_REUSE_MAX, FsyncPolicy, RetentionPolicy, SamplingPolicy,
    SegmentCompression,
};
pub use bus::{BUS_ROLES, BusConfig, BusKind, RoleAuth, Secret, TlsConfig};
pub use coordinator::{
    AdminTlsConfig, BUILTIN_VERIFIERS, ClipModeName, CoordinatorConfig, DatasetConfig,
    DatasetFormat, ImportanceCorrectionName, InitialKnobs, KnobRange, LongPrompts, UnknownClipMode,
    UnknownImportanceCorrection, knob_ranges,
};
pub use environment::{BUILTIN_ENV_PREFIX, BUILTIN_ENVS, EnvironmentConfig, EnvironmentKind};
pub use eval::{EvalConfig, EvalEngineName, MAX_EVAL_SAMPLES};
pub use learner::{
    AdvantageNormName, KlEstimatorName, LearnerConfig, LossAggregationName, MixedPrecisionName,
    ProximalName, TorchEngineConfig, TrainerEngineName, WeightTransportName,
};
pub use model::{DeviceName, ModelConfig, TinyModelConfig, WeightDtypeName};
pub use run::{RunConfig, StalenessConfig};
pub use storage::{StorageConfig, TrajectoryRetention};
pub use telemetry::{LogFormat, TelemetryConfig};
pub use worker::{
    BatchingMode, EngineApi, EngineConfig, EngineKind, PauseMode, WorkerConfig, WorkerRewardConfig,
    valid_worker_id,
};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid config{}: {message}", origin.as_ref().map(|p| format!(" {}", p.display())).unwrap_or_default())]
    Parse {
        origin: Option<PathBuf>,
        message: String,
    },
    #[error("invalid config: `{key}` {reason}")]
    Invalid { key: String, reason: String },
    #[error("cannot write the config as TOML: {0}")]
    Serialize(#[from] toml::ser::Error),
    #[error("cannot write config file {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl ConfigError {
    pub(crate) fn invalid(key: impl Into<String>, reason: impl Into<String>) -> Self {
        ConfigError::Invalid {
            key: key.into(),
            reason: reason.into(),
        }
    }
}

/// The whole configuration of a run. Every section has defaults, so an empty
/// file is a valid config for a local run.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub run: RunConfig,
    pub staleness: StalenessConfig,
    pub bus: BusConfig,
    pub telemetry: TelemetryConfig,
    pub model: ModelConfig,
    pub coordinator: CoordinatorConfig,
    pub buffer: BufferConfig,
    pub learner: LearnerConfig,
    pub worker: WorkerConfig,
    pub eval: EvalConfig,
    /// Multi-turn episodes with an environment; absent: single-turn.
    pub environment: Option<EnvironmentConfig>,
}

impl Config {
    /// The default config of a run that writes to `output_dir`, talks over
    /// the bus at `bus_url` (`local` or `nats://host:port`), and opens no
    /// listening port (no metrics endpoint, no admin API), so that several
    /// runs (tests, benches) can share one machine. The shape every test
    /// and bench config starts from.
    pub fn isolated(output_dir: impl Into<PathBuf>, bus_url: impl Into<String>) -> Self {
        let mut config = Self::default();
        config.run.output_dir = output_dir.into();
        config.bus.url = bus_url.into();
        config.telemetry.listen = String::new();
        config.coordinator.admin_listen = String::new();
        config
    }

    /// Reads and validates a config file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text, Some(path))
    }

    /// Parses and validates config text; `origin` names the file in errors.
    pub fn parse(text: &str, origin: Option<&Path>) -> Result<Self, ConfigError> {
        let parse_err = |message: String| ConfigError::Parse {
            origin: origin.map(Path::to_owned),
            message,
        };
        let de = toml::Deserializer::parse(text).map_err(|e| parse_err(one_line(&e)))?;
        let config: Config = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            let inner = one_line(e.inner());
            // The path names the table for an unknown key, the key itself otherwise.
            parse_err(if path == "." {
                inner
            } else {
                format!("`{path}`: {inner}")
            })
        })?;
        config.validate()?;
        Ok(config)
    }

    /// The config as TOML text that [`Config::parse`] reads back into an
    /// equal `Config`. Unset optional keys are left out; secrets (the bus
    /// password and token, the admin token) are written as they are, so the
    /// text must not be logged. Does not validate (see [`Config::write`]).
    pub fn to_toml(&self) -> Result<String, ConfigError> {
        Ok(toml::to_string(self)?)
    }

    /// Validates the config and writes it to `path` as TOML (the file a
    /// role process is started with). An invalid config is refused here,
    /// naming its key, rather than by the process that loads the file.
    pub fn write(&self, path: &Path) -> Result<(), ConfigError> {
        self.validate()?;
        let text = self.to_toml()?;
        std::fs::write(path, text).map_err(|source| ConfigError::Write {
            path: path.to_owned(),
            source,
        })
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        self.run.validate()?;
        self.staleness.validate()?;
        self.bus.validate()?;
        self.telemetry.validate()?;
        self.model.validate()?;
        self.coordinator.validate()?;
        self.buffer.validate()?;
        self.learner.validate()?;
        self.worker.validate()?;
        self.eval.validate()?;
        if let Some(env) = &self.environment {
            env.validate(self.model.max_seq_len)?;
        }
        self.check_torch_engine()
    }

    /// The `torch` engine trains a model folder, and shares every
    /// mini-batch's rows evenly over its ranks: `groups_per_step × group_size` rows, cut into
    /// `learner.minibatches` equal mini-batches, each a multiple of
    /// `learner.torch.world_size`.
    fn check_torch_engine(&self) -> Result<(), ConfigError> {
        if self.eval.enabled()
            && self.eval.engine == EvalEngineName::Torch
            && self.model.path.is_none()
        {
            return Err(ConfigError::invalid(
                "model.path",
                "eval.engine = \"torch\" evaluates a Hugging Face model folder: set model.path",
            ));
        }
        if self.learner.trainer != TrainerEngineName::Torch {
            return Ok(());
        }
        if self.model.path.is_none() {
            return Err(ConfigError::invalid(
                "model.path",
                "the torch trainer engine (learner.trainer = \"torch\") trains a Hugging Face model folder: set model.path",
            ));
        }
        let rows = self.staleness.groups_per_step as usize * self.staleness.group_size as usize;
        let (k, world) = (self.learner.minibatches, self.learner.torch.world_size);
        if !rows.is_multiple_of(k) || !(rows / k).is_multiple_of(world) {
            return Err(ConfigError::invalid(
                "learner.torch.world_size",
                format!(
                    "{world} ranks cannot share the batch evenly: {rows} rows (staleness.groups_per_step × staleness.group_size) in {k} mini-batches (learner.minibatches)"
                ),
            ));
        }
        Ok(())
    }
}

/// toml's errors span several lines with a source excerpt; a CLI wants one
/// line that names the key and the problem.
fn one_line(e: &toml::de::Error) -> String {
    e.message().trim().replace('\n', " ")
}

/// Checks that `value` lies in `[lo, hi]`, naming `key` otherwise. NaN lies
/// in no range (written so that an unordered value fails the check).
pub fn check_range<T: PartialOrd + std::fmt::Display>(
    key: &str,
    value: T,
    lo: T,
    hi: T,
) -> Result<(), ConfigError> {
    if !(value >= lo && value <= hi) {
        return Err(ConfigError::invalid(
            key,
            format!("= {value} is out of range [{lo}, {hi}]"),
        ));
    }
    Ok(())
}

/// Checks that no core in `cores` is beyond what an affinity mask holds.
pub fn check_cores(key: &str, cores: &[usize]) -> Result<(), ConfigError> {
    if let Some(cpu) = cores.iter().find(|c| **c >= 1024) {
        return Err(ConfigError::invalid(
            key,
            format!("core {cpu} is out of range [0, 1023]"),
        ));
    }
    Ok(())
}

/// The data-driven config tests of every section go through [`test_check::check`].
#[cfg(test)]
pub(crate) mod test_check {
    use super::Config;

    /// One case: config text, and either Ok or a fragment the error must contain.
    pub(crate) fn check(text: &str, expect_err: Option<&str>) {
        match (Config::parse(text, None), expect_err) {
            (Ok(_), None) => {}
            (Err(e), Some(want)) => {
                let got = e.to_string();
                assert!(got.contains(want), "error `{got}` should mention `{want}`");
                assert!(!got.contains('\n'), "error should be one line: {got:?}");
            }
            (got, want) => panic!("config {text:?}: expected {want:?}, got {got:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::test_check::check;
    use super::*;

    #[test]
    fn config_table() {
        check("", None);
        check("[bus]\nurl = \"local\"", None);
        check(
            "[bus]\nurl = \"nats://127.0.0.1:4222\"\ntoken = \"s3cret\"",
            None,
        );
        check("[bus]\nurl = \"nats://a:4222,nats://b:4222\"", None);
        check("[bus]\nurl = \"http://x\"", Some("bus.url"));
        check("[bus]\nurl = \"\"", Some("bus.url"));
        check("[bus]\nurll = \"local\"", Some("`bus.urll`: unknown field"));
        check("[bogus]\nx = 1", Some("`bogus`: unknown field"));
        check(
            "[bus]\nrequest_timeout = \"0s\"",
            Some("bus.request_timeout"),
        );
        check("[bus]\nrequest_timeout = \"ten\"", Some("request_timeout"));
        check(
            "[bus]\nsubscription_capacity = 0",
            Some("bus.subscription_capacity"),
        );
        check(
            "[bus]\nurl = \"nats://h:1\"\ntoken = \"a\"\nuser = \"u\"\npassword = \"p\"",
            Some("bus"),
        );
        check(
            "[bus]\nuser = \"u\"\nurl = \"nats://h:1\"",
            Some("bus.password"),
        );
        check(
            "[bus]\nurl = \"nats://h:1\"\n[bus.tls]\ncert_file = \"c.pem\"",
            Some("bus.tls.key_file"),
        );
        check(
            "[telemetry]\nlisten = \"not an addr\"",
            Some("telemetry.listen"),
        );
        check("[telemetry]\nlog_format = \"xml\"", Some("log_format"));
        check(
            "[telemetry]\nlog_format = \"json\"\nlisten = \"127.0.0.1:0\"",
            None,
        );
        check(
            "[worker]\nid = \"w-1\"\nmax_sequences = 8\nbatching = \"static\"\ndrain_grace_period = \"500ms\"\n[worker.reward]\nendpoint = \"http://127.0.0.1:50061\"",
            None,
        );
        check("[worker]\nid = \"a b\"", Some("worker.id"));
        check("[worker]\ncpu_affinity = [1]", None);
        check(
            "[worker]\ncpu_affinity = [4096]",
            Some("`worker.cpu_affinity` core 4096 is out of range"),
        );
        check("[worker]\ncpu_affinity = [-1]", Some("cpu_affinity"));
        check("[learner]\ncpu_affinity = [0, 1]", None);
        check(
            "[learner]\ncpu_affinity = [1024]",
            Some("`learner.cpu_affinity` core 1024 is out of range"),
        );
        check("[worker]\nid = \"\"", Some("worker.id"));
        check("[worker]\nmax_sequences = 0", Some("worker.max_sequences"));
        check(
            "[worker]\nmax_tasks_in_flight = 5000",
            Some("worker.max_tasks_in_flight"),
        );
        check("[worker]\nbatching = \"dynamic\"", Some("batching"));
        check(
            "[worker]\nheartbeat_interval = \"0s\"",
            Some("worker.heartbeat_interval"),
        );
        check(
            "[worker]\nacquire_backoff_min = \"3s\"\nacquire_backoff_max = \"1s\"",
            Some("worker.acquire_backoff_max"),
        );
        check(
            "[worker]\nweight_fetch_timeout = \"0s\"",
            Some("worker.weight_fetch_timeout"),
        );
        check(
            "[worker]\nweight_retry_backoff_min = \"1m\"\nweight_retry_backoff_max = \"1s\"",
            Some("worker.weight_retry_backoff_max"),
        );
        check("[worker]\nslots = 4", Some("`worker.slots`: unknown field"));
        check(
            "[worker.reward]\nendpoint = \"grpc://x\"",
            Some("worker.reward.endpoint"),
        );
        check(
            "[worker.reward]\nendpoint = \"http://\"",
            Some("worker.reward.endpoint"),
        );
        check(
            "[worker.reward]\nattempts = 0",
            Some("worker.reward.attempts"),
        );
        check(
            "[worker.reward]\nconcurrency = 0",
            Some("worker.reward.concurrency"),
        );
        check(
            "[worker.reward]\ntimeout = \"0s\"",
            Some("worker.reward.timeout"),
        );
    }

    #[test]
    fn engine_section() {
        check("[worker.engine]\nkind = \"builtin\"", None);
        check(
            "[worker.engine]\nkind = \"vllm\"\nendpoints = [\"http://127.0.0.1:8000\"]\nlaunch = [\"python\", \"-m\", \"vllm.entrypoints.openai.api_server\"]\npause_mode = \"keep\"\napi = \"generate\"",
            None,
        );
        check(
            "[worker.engine]\nkind = \"sglang\"",
            Some("unknown variant `sglang`"),
        );
        check(
            "[worker.engine]\nkind = \"vllm\"",
            Some("worker.engine.endpoints"),
        );
        check(
            "[worker.engine]\nkind = \"vllm\"\nendpoints = [\"127.0.0.1:8000\"]",
            Some("worker.engine.endpoints"),
        );
        check(
            "[worker.engine]\nendpoints = [\"http://127.0.0.1:8000\"]",
            Some("worker.engine.kind"),
        );
        check(
            "[worker.engine]\nkind = \"vllm\"\nendpoints = [\"http://a:1\", \"http://b:1\"]\nlaunch = [\"vllm\"]",
            Some("worker.engine.launch"),
        );
        check(
            "[worker.engine]\nkind = \"vllm\"\nendpoints = [\"http://a:1\"]\napi = \"completions\"\npause_mode = \"keep\"",
            Some("worker.engine.pause_mode"),
        );
        check(
            "[worker.engine]\nkind = \"vllm\"\nendpoints = [\"http://a:1\"]\nready_timeout = \"0s\"",
            Some("worker.engine.ready_timeout"),
        );
    }

    #[test]
    fn missing_file_names_the_path() {
        let err = Config::load(Path::new("/nonexistent/asyncrl.toml")).unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/asyncrl.toml"),
            "{err}"
        );
    }

    #[test]
    fn load_reads_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, "[bus]\nurl = \"nats://127.0.0.1:4999\"\n").unwrap();
        let c = Config::load(&path).unwrap();
        assert_eq!(c.bus.kind(), BusKind::Nats);
        std::fs::write(&path, "[bus]\nurl = 5\n").unwrap();
        let err = Config::load(&path).unwrap_err().to_string();
        assert!(err.contains("c.toml") && err.contains("url"), "{err}");
    }
}
