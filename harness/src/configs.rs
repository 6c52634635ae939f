//! The configs tests and benches run with, built as typed [`Config`] values
//! (never TOML text: only the config schema's own tests write that) and
//! written with [`Config::write`], which validates them first.
//!
//! - [`tiny_run`]: one CPU run of the small built-in model on an arith task
//!   file, opening no port (the in-process tests and the benches);
//! - [`cluster_role`]: a role process of a cross-process run over NATS, the
//!   shape the cluster tests and the chaos bench share; they set their own
//!   spec (steps, η, batch, timings) on it;
//! - [`launched_vllm`]: a worker engine that launches a vLLM CPU server from
//!   the project's `.venv-vllm`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use asyncrl_config::{
    Config, DatasetConfig, DeviceName, EngineConfig, EngineKind, LogFormat, RetentionPolicy,
    TinyModelConfig,
};

/// The small built-in model every test and bench trains (about 10k
/// parameters: one layer, hidden size 32).
pub fn tiny_model() -> TinyModelConfig {
    TinyModelConfig {
        hidden_size: 32,
        num_hidden_layers: 1,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        intermediate_size: 64,
    }
}

/// A run of the tiny model on the CPU (one libtorch thread) over the arith
/// problems of `tasks`, writing to `output_dir`, over the bus at `bus_url`
/// (`local`, or `nats://…`), with no metrics endpoint and no admin API, and
/// logs at `warn`.
pub fn tiny_run(output_dir: impl Into<PathBuf>, bus_url: &str, tasks: &Path) -> Config {
    let mut config = Config::isolated(output_dir, bus_url);
    config.telemetry.log_filter = "warn".into();
    config.model.device = DeviceName::Cpu;
    config.model.cpu_threads = 1;
    config.model.tiny = tiny_model();
    config.coordinator.datasets = vec![arith(tasks)];
    config
}

/// The arith data set in `path` (JSONL, as `asyncrl data generate` writes it).
pub fn arith(path: &Path) -> DatasetConfig {
    DatasetConfig::jsonl("arith", path)
}

/// A role of a cross-process run over NATS at `bus_url`: every server on
/// port 0 (the role logs the port it got), text logs at `info` (or
/// `ASYNCRL_TEST_LOG`, a tracing filter), timeouts short enough for a test
/// to see leases expire and workers die, a checkpoint after every step.
/// The role's `worker.id`, the run's spec and its data set are the caller's.
pub fn cluster_role(output_dir: impl Into<PathBuf>, bus_url: &str, tasks: &Path) -> Config {
    let mut c = tiny_run(output_dir, bus_url, tasks);
    c.run.seed = 3;
    c.bus.connect_timeout = Duration::from_secs(10);
    c.bus.request_timeout = Duration::from_secs(3);
    c.bus.reconnect_max_delay = Duration::from_millis(500);
    c.telemetry.listen = "127.0.0.1:0".into();
    c.telemetry.log_format = LogFormat::Text;
    c.telemetry.log_filter = std::env::var("ASYNCRL_TEST_LOG").unwrap_or_else(|_| "info".into());
    c.model.temperature = 1.0;
    c.model.max_new_tokens = 24;
    c.model.max_seq_len = 32;
    c.coordinator.admin_listen = "127.0.0.1:0".into();
    c.coordinator.lease_timeout = Duration::from_secs(6);
    c.coordinator.heartbeat_interval = Duration::from_millis(250);
    c.coordinator.dead_after = Duration::from_secs(3);
    c.coordinator.retry_after = Duration::from_millis(50);
    c.coordinator.initial_knobs.learning_rate = 1e-3;
    c.buffer.retention = RetentionPolicy::Keep;
    c.buffer.ack_wait = Duration::from_secs(2);
    c.buffer.fetch_wait = Duration::from_millis(100);
    c.learner.checkpoint_every = 1;
    c.learner.keep_checkpoints = 2;
    // A learner killed with SIGKILL leaves its lease behind: its restart
    // waits at most this long for it to lapse.
    c.learner.lease_ttl = Duration::from_secs(2);
    c.worker.max_sequences = 16;
    c.worker.heartbeat_interval = Duration::from_millis(250);
    c.worker.acquire_backoff_max = Duration::from_millis(300);
    c.worker.drain_grace_period = Duration::from_secs(5);
    c.worker.weight_fetch_timeout = Duration::from_secs(30);
    c.worker.weight_retry_backoff_max = Duration::from_secs(1);
    c
}

/// Writes `config` to `path` (validated first), panicking with the reason:
/// for tests, whose configs are theirs to get right.
pub fn write(config: &Config, path: impl Into<PathBuf>) -> PathBuf {
    let path = path.into();
    config
        .write(&path)
        .unwrap_or_else(|e| panic!("write the config {}: {e}", path.display()));
    path
}

/// Writes `n` arith problems with operands below `max_operand`, drawn from
/// `seed`, to `path` as JSONL (what `asyncrl data generate --task arith`
/// writes); returns the path.
pub fn write_arith(path: impl Into<PathBuf>, n: usize, max_operand: u64, seed: u64) -> PathBuf {
    let path = path.into();
    let items = asyncrl_tasks::generate_with(
        asyncrl_tasks::BuiltinTask::Arith,
        n,
        seed,
        asyncrl_tasks::GenerateOptions { max_operand },
    );
    asyncrl_tasks::write_jsonl(&path, &items)
        .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    path
}

/// Writes every arith problem with operands below `max_operand` (a
/// held-out set, as `asyncrl data generate --all` writes it) to `path`.
pub fn write_arith_all(path: impl Into<PathBuf>, max_operand: u64) -> PathBuf {
    let path = path.into();
    asyncrl_tasks::write_jsonl(&path, &asyncrl_tasks::arith_all(max_operand))
        .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    path
}

/// A vLLM CPU server the worker launches from `.venv-vllm` on `port`,
/// serving `model` in float32 with processed log-probs and its weights
/// swapped through `weights_dir`; it writes its pid to `pid_file` when one
/// is given.
pub fn launched_vllm(
    model: &Path,
    weights_dir: &Path,
    port: u16,
    pid_file: Option<&Path>,
) -> EngineConfig {
    let python = asyncrl_testkit::workspace_root().join(".venv-vllm/bin/python");
    let pid = pid_file.map_or(String::new(), |p| format!("echo $$ > '{}'; ", p.display()));
    let server = format!(
        "{pid}exec env VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_NO_USAGE_STATS=1 '{python}' -m vllm.entrypoints.openai.api_server --model '{model}' --dtype float32 --max-model-len 64 --logprobs-mode processed_logprobs --enable-scale-out --enforce-eager --host 127.0.0.1 --port {port}",
        python = python.display(),
        model = model.display(),
    );
    EngineConfig {
        kind: EngineKind::Vllm,
        endpoints: vec![format!("http://127.0.0.1:{port}")],
        launch: vec!["sh".into(), "-c".into(), server],
        weights_dir: weights_dir.to_owned(),
        ready_timeout: Duration::from_secs(540),
        ..EngineConfig::default()
    }
}
