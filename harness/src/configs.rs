//! The configs tests and benches run with, built as typed [`Config`] values
//! (never TOML text: only the config schema's own tests write that) and
//! written with [`Config::write`], which validates them first.
//!
//! - [`tiny_run`]: one CPU run of the small built-in model on an arith task
//!   file, opening no port (the in-process tests and the benches);
//! - [`cluster_role`]: a role process of a cross-process run over NATS, the
//!   shape the cluster tests and the chaos bench share; they set their own
//!   spec (steps, η, batch, timings) on it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use asyncrl_config::{
    Config, DatasetConfig, DeviceName, LogFormat, RetentionPolicy, TinyModelConfig,
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
