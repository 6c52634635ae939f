//! The worker's settings, resolved from the config once at start.

use std::time::Duration;

use asyncrl_config::{BatchingMode, Config, ModelConfig, valid_worker_id};

use crate::error::WorkerError;
use crate::reward::{RewardServiceConfig, Scorer};

/// Everything the worker reads from the config, with defaults resolved.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub worker_id: String,
    pub hostname: String,
    pub max_sequences: usize,
    pub max_tasks_in_flight: usize,
    pub batching: BatchingMode,
    /// `staleness.group_size`: how many sequences a task is expected to
    /// bring (the task itself says how many it does).
    pub group_size_hint: usize,
    pub heartbeat_interval: Duration,
    pub acquire_backoff: (Duration, Duration),
    pub drain_grace_period: Duration,
    pub weight_fetch_timeout: Duration,
    pub weight_backoff: (Duration, Duration),
    pub metrics_interval: Duration,
    pub request_timeout: Duration,
    pub model: ModelConfig,
}

impl Settings {
    pub fn from_config(config: &Config) -> Result<Self, WorkerError> {
        let w = &config.worker;
        let hostname = hostname();
        let worker_id = match &w.id {
            Some(id) => id.clone(),
            None => default_worker_id(&hostname, std::process::id()),
        };
        if !valid_worker_id(&worker_id) {
            return Err(WorkerError::Settings {
                key: "worker.id".into(),
                reason: format!("= {worker_id:?} must be 1-128 characters of [A-Za-z0-9_-]"),
            });
        }
        let group_size_hint = (config.staleness.group_size as usize).max(1);
        let max_tasks_in_flight = if w.max_tasks_in_flight == 0 {
            w.max_sequences.div_ceil(group_size_hint) + 2
        } else {
            w.max_tasks_in_flight
        };
        Ok(Self {
            worker_id,
            hostname,
            max_sequences: w.max_sequences.max(1),
            max_tasks_in_flight,
            batching: w.batching,
            group_size_hint,
            heartbeat_interval: w.heartbeat_interval,
            acquire_backoff: (w.acquire_backoff_min, w.acquire_backoff_max),
            drain_grace_period: w.drain_grace_period,
            weight_fetch_timeout: w.weight_fetch_timeout,
            weight_backoff: (w.weight_retry_backoff_min, w.weight_retry_backoff_max),
            metrics_interval: w.metrics_interval,
            request_timeout: config.bus.request_timeout,
            model: config.model.clone(),
        })
    }
}

/// The scorer `[worker.reward]` asks for.
pub(crate) fn scorer(config: &Config) -> Result<Scorer, WorkerError> {
    let r = &config.worker.reward;
    match &r.endpoint {
        None => Ok(Scorer::Builtin),
        Some(endpoint) => Ok(Scorer::external(RewardServiceConfig {
            endpoint: endpoint.clone(),
            timeout: r.timeout,
            attempts: r.attempts,
            backoff: r.backoff,
            concurrency: r.concurrency,
        })?),
    }
}

/// Sets `worker.id` to the id this process goes by when the config names
/// none (`<hostname>-<pid>`, the same [`Settings::from_config`] takes), so
/// that the bus connection, made before the worker starts, uses the inbox
/// prefix of that id (`_INBOX.asyncrl.worker.<id>`).
pub fn pin_worker_id(config: &mut Config) {
    if config.worker.id.is_none() {
        config.worker.id = Some(default_worker_id(&hostname(), std::process::id()));
    }
}

/// The machine's host name (`/proc/sys/kernel/hostname`, then `$HOSTNAME`).
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok().filter(|s| !s.is_empty()))
        .unwrap_or_else(|| "worker".to_owned())
}

/// `<hostname>-<pid>`, with characters the coordinator does not accept in
/// an id replaced by `-` (host names may hold dots).
pub(crate) fn default_worker_id(hostname: &str, pid: u32) -> String {
    let host: String = hostname
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '-'
            }
        })
        .take(100)
        .collect();
    let host = if host.is_empty() {
        "worker".into()
    } else {
        host
    };
    format!("{host}-{pid}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_ids_are_valid() {
        assert_eq!(
            default_worker_id("node-1.example.com", 42),
            "node-1-example-com-42"
        );
        assert_eq!(default_worker_id("", 7), "worker-7");
        let long = "h".repeat(300);
        assert!(valid_worker_id(&default_worker_id(&long, u32::MAX)));
    }

    #[test]
    fn auto_task_cap_follows_slots_and_group_size() {
        let mut c = Config::default();
        c.worker.max_sequences = 16;
        c.staleness.group_size = 8;
        assert_eq!(Settings::from_config(&c).unwrap().max_tasks_in_flight, 4);
        c.worker.max_tasks_in_flight = 9;
        assert_eq!(Settings::from_config(&c).unwrap().max_tasks_in_flight, 9);
        c.worker.id = Some("bad id".into());
        assert!(Settings::from_config(&c).is_err());
    }
}
