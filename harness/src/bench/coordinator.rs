//! `asyncrl-bench coordinator`: acquire → grant round trips per second
//! through NATS against the coordinator (which persists every grant to the
//! KV bucket before it replies), next to a raw async-nats request/reply echo
//! on the same server in the same run. Rounds alternate between the two
//! sides so that machine noise hits both; the best round of each counts.
//! With the figures, the coordinator's own account of its state writes in
//! the timed rounds (its metrics): how many grants one write covered (group
//! commit), how long a write took and how large the state was.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use asyncrl_config::{BusConfig, Config, DatasetConfig};
use asyncrl_coordinator::Coordinator;
use asyncrl_protos::Message;
use asyncrl_protos::subjects::{
    COORDINATOR_STATE_KEY, KNOBS_KEY, TASKS_ACQUIRE, TASKS_COMPLETE, WORKERS_REGISTER,
};
use asyncrl_protos::v1::{
    AcquireTasks, AcquireTasksReply, CompleteTask, CompleteTaskReply, RegisterWorker, Task,
};
use asyncrl_telemetry::{Health, Metrics};
use asyncrl_transport::raw::RawNats;
use asyncrl_transport::{Bus, NatsBus, TransportMetrics};
use bytes::Bytes;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone)]
pub struct AcquireBenchOptions {
    /// NATS server to use; `None` starts a private nats-server (testkit).
    pub nats_url: Option<String>,
    /// Acquire requests per measurement.
    pub round_trips: usize,
    /// Requesters in flight for the concurrent measurement.
    pub concurrency: usize,
    /// Alternating rounds per side; the best round counts.
    pub rounds: usize,
}

impl Default for AcquireBenchOptions {
    fn default() -> Self {
        Self {
            nats_url: None,
            round_trips: 1_000,
            concurrency: 16,
            rounds: 3,
        }
    }
}

#[derive(Debug, Clone)]
pub struct AcquireBenchRow {
    pub mode: String,
    pub raw_per_s: f64,
    pub coordinator_per_s: f64,
    /// State writes in the timed coordinator rounds, all rounds together.
    pub writes: StateWrites,
}

/// The coordinator's state writes, from its metrics
/// (`asyncrl_coordinator_state_persist_seconds`, `..._state_bytes`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StateWrites {
    pub count: f64,
    pub seconds: f64,
    /// Size of the last state written.
    pub state_bytes: f64,
}

impl StateWrites {
    fn read(metrics: &Metrics) -> Result<Self> {
        let text = metrics
            .encode_prometheus_text()
            .context("read the coordinator's metrics")?;
        let value = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        Ok(Self {
            count: value("asyncrl_coordinator_state_persist_seconds_count"),
            seconds: value("asyncrl_coordinator_state_persist_seconds_sum"),
            state_bytes: value("asyncrl_coordinator_state_bytes"),
        })
    }

    /// What was written between `before` and `self`.
    fn since(self, before: Self) -> Self {
        Self {
            count: self.count - before.count,
            seconds: self.seconds - before.seconds,
            state_bytes: self.state_bytes,
        }
    }

    fn add(&mut self, other: Self) {
        self.count += other.count;
        self.seconds += other.seconds;
        self.state_bytes = other.state_bytes;
    }
}

impl AcquireBenchRow {
    /// coordinator / raw echo.
    pub fn ratio(&self) -> f64 {
        self.coordinator_per_s / self.raw_per_s
    }
}

#[derive(Debug, Clone)]
pub struct AcquireBenchReport {
    pub options: AcquireBenchOptions,
    pub server: String,
    pub rows: Vec<AcquireBenchRow>,
}

impl fmt::Display for AcquireBenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let o = &self.options;
        writeln!(
            f,
            "acquire -> grant round trips, {} per measurement, best of {} alternating rounds ({})",
            o.round_trips, o.rounds, self.server
        )?;
        writeln!(
            f,
            "{:<16} {:>16} {:>18} {:>16} {:>16} {:>14} {:>12}",
            "mode",
            "raw echo rt/s",
            "coordinator rt/s",
            "coordinator/raw",
            "grants / write",
            "write ms",
            "state KiB"
        )?;
        let grants = (o.round_trips * o.rounds.max(1)) as f64;
        for r in &self.rows {
            let w = &r.writes;
            writeln!(
                f,
                "{:<16} {:>16.0} {:>18.0} {:>16.3} {:>16.1} {:>14.3} {:>12.1}",
                r.mode,
                r.raw_per_s,
                r.coordinator_per_s,
                r.ratio(),
                grants / w.count.max(1.0),
                1e3 * w.seconds / w.count.max(1.0),
                w.state_bytes / 1024.0
            )?;
        }
        Ok(())
    }
}

/// The size of a typical grant reply, so that the echo moves as many bytes.
fn grant_sized_payload() -> Bytes {
    let reply = AcquireTasksReply {
        tasks: vec![Task {
            task_id: "arith-1234".into(),
            lease_id: "0123456789ab-1234".into(),
            prompt: "37+58=".into(),
            answer: "95".into(),
            dataset: "arith".into(),
            verifier: "arith".into(),
            messages: Vec::new(),
            group_size: 8,
            lease_deadline_unix_ms: 1_700_000_000_000,
            admission_version: 3,
            epoch: 0,
        }],
        reason: String::new(),
        retry_after_ms: 0,
    };
    Bytes::from(reply.encode_to_vec())
}

fn acquire_payload() -> Bytes {
    Bytes::from(
        AcquireTasks {
            worker_id: "bench-worker".into(),
            free_slots: 1,
        }
        .encode_to_vec(),
    )
}

async fn coordinator_round(
    bus: &NatsBus,
    worker: &str,
    n: usize,
    concurrency: usize,
) -> Result<(Duration, Vec<Task>)> {
    let req = Bytes::from(
        AcquireTasks {
            worker_id: worker.to_owned(),
            free_slots: 1,
        }
        .encode_to_vec(),
    );
    let start = Instant::now();
    let results: Vec<Result<Bytes, asyncrl_transport::TransportError>> =
        futures::stream::iter(0..n)
            .map(|_| {
                let req = req.clone();
                async move {
                    bus.request(TASKS_ACQUIRE, req, Duration::from_secs(10))
                        .await
                }
            })
            .buffer_unordered(concurrency)
            .collect()
            .await;
    let elapsed = start.elapsed();
    let mut tasks = Vec::with_capacity(n);
    for r in results {
        let reply =
            AcquireTasksReply::decode(r.context("acquire")?.as_ref()).context("decode a grant")?;
        if reply.tasks.len() != 1 {
            bail!("acquire: expected one task, got: {}", reply.reason);
        }
        tasks.extend(reply.tasks);
    }
    Ok((elapsed, tasks))
}

/// Completes the round's tasks (not timed) so that leases do not pile up.
async fn complete_all(bus: &NatsBus, worker: &str, tasks: Vec<Task>) -> Result<()> {
    let results: Vec<Result<Bytes, asyncrl_transport::TransportError>> =
        futures::stream::iter(tasks)
            .map(|t| {
                let payload = Bytes::from(
                    CompleteTask {
                        worker_id: worker.to_owned(),
                        task_id: t.task_id,
                        lease_id: t.lease_id,
                        num_trajectories: t.group_size,
                    }
                    .encode_to_vec(),
                );
                async move {
                    bus.request(TASKS_COMPLETE, payload, Duration::from_secs(10))
                        .await
                }
            })
            .buffer_unordered(32)
            .collect()
            .await;
    for r in results {
        let reply = CompleteTaskReply::decode(r.context("complete")?.as_ref())
            .context("decode a completion reply")?;
        if !reply.accepted {
            bail!("complete: refused: {}", reply.reason);
        }
    }
    Ok(())
}

/// Runs the benchmark and returns the figures.
pub async fn run_acquire_bench(opts: AcquireBenchOptions) -> Result<AcquireBenchReport> {
    let nats = super::BenchServer::at_or_start(opts.nats_url.as_deref())?;
    let url = nats.url.clone();
    let dir = tempfile_dir().await?;
    let tasks_path = dir.join("bench-tasks.jsonl");
    let n_tasks = 10_000;
    tokio::task::spawn_blocking({
        let p = tasks_path.clone();
        move || asyncrl_coordinator::dataset::write_arith_file(&p, n_tasks)
    })
    .await
    .context("write the bench tasks")?
    .context("write the bench tasks")?;

    let connect = || async {
        NatsBus::connect(&BusConfig::nats(url.clone()), TransportMetrics::new())
            .await
            .context("connect to NATS")
    };
    let server_bus: Arc<dyn Bus> = Arc::new(connect().await?);
    let client_bus = connect().await?;
    // Remove what an earlier run on this server left.
    let kv = server_bus
        .kv(asyncrl_protos::subjects::CONTROL_BUCKET)
        .await
        .context("open the KV bucket")?;
    for key in [COORDINATOR_STATE_KEY, KNOBS_KEY] {
        let _ = kv.delete(key).await;
    }

    let mut config = Config {
        bus: BusConfig::nats(url.clone()),
        ..Config::default()
    };
    config.staleness.eta = 64;
    config.staleness.groups_per_step = 4096;
    config.staleness.group_size = 8;
    config.coordinator.datasets = vec![DatasetConfig::jsonl("arith", tasks_path)];
    config.coordinator.admin_listen = String::new();
    config.coordinator.lease_timeout = Duration::from_secs(600);
    config.coordinator.max_tasks_per_acquire = 1;
    config.coordinator.journal_path = Some(dir.join("journal.jsonl"));
    config.run.output_dir = dir.clone();
    let shutdown = CancellationToken::new();
    let metrics = Metrics::new();
    let coordinator = Coordinator::start(
        config,
        server_bus,
        metrics.clone(),
        Health::new(),
        &shutdown,
    )
    .await?;

    let worker = format!("bench-{}", std::process::id());
    let register = Bytes::from(
        RegisterWorker {
            worker_id: worker.clone(),
            capacity: 8,
            policy_version: 0,
            hostname: "bench".into(),
        }
        .encode_to_vec(),
    );
    // The subscriptions of a just-started coordinator (another connection)
    // may not have reached the server yet.
    let mut attempts = 0;
    loop {
        match client_bus
            .request(WORKERS_REGISTER, register.clone(), Duration::from_secs(10))
            .await
        {
            Ok(_) => break,
            Err(e) if e.is_transient() && attempts < 100 => {
                attempts += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => return Err(e).context("register the bench worker"),
        }
    }

    // The raw echo: a responder on one connection, requests from another.
    let raw_server = RawNats::connect(&url).await?;
    let raw_client = RawNats::connect(&url).await?;
    let echo_subject = format!("asyncrl.bench.echo.{}", std::process::id());
    let echo = raw_server
        .echo(&echo_subject, grant_sized_payload())
        .await?;
    let acquire = acquire_payload();
    // The echo's subscription (another connection) may not have reached the
    // server yet: the client's flush writes, it does not wait for the
    // server. Warm up until the path answers.
    let mut attempts = 0;
    loop {
        match raw_client
            .request_burst(&echo_subject, &acquire, 1, 1)
            .await
        {
            Ok(_) => break,
            Err(_) if attempts < 100 => {
                attempts += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => return Err(e).context("raw echo warm-up"),
        }
    }

    let mut rows = Vec::new();
    let result: Result<()> = async {
        for concurrency in [1usize, opts.concurrency.max(1)] {
            let mode = if concurrency == 1 {
                "sequential".to_owned()
            } else {
                format!("concurrent x{concurrency}")
            };
            let (mut best_raw, mut best_ours) = (Duration::MAX, Duration::MAX);
            let mut writes = StateWrites::default();
            for _ in 0..opts.rounds.max(1) {
                best_raw = best_raw.min(
                    raw_client
                        .request_burst(&echo_subject, &acquire, opts.round_trips, concurrency)
                        .await?,
                );
                let before = StateWrites::read(&metrics)?;
                let (d, tasks) =
                    coordinator_round(&client_bus, &worker, opts.round_trips, concurrency).await?;
                writes.add(StateWrites::read(&metrics)?.since(before));
                best_ours = best_ours.min(d);
                complete_all(&client_bus, &worker, tasks).await?;
            }
            let rate = |d: Duration| opts.round_trips as f64 / d.as_secs_f64();
            rows.push(AcquireBenchRow {
                mode,
                raw_per_s: rate(best_raw),
                coordinator_per_s: rate(best_ours),
                writes,
            });
        }
        Ok(())
    }
    .await;
    drop(echo);
    coordinator.shutdown();
    let joined = coordinator.join().await;
    let _ = tokio::fs::remove_dir_all(&dir).await;
    result?;
    joined?;
    let server = nats.describe();
    Ok(AcquireBenchReport {
        options: opts,
        server,
        rows,
    })
}

async fn tempfile_dir() -> Result<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!(
        "asyncrl-coordinator-bench-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    tokio::fs::create_dir_all(&dir)
        .await
        .context("create a temporary directory")?;
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_acquire_bench_measures_both_sides() {
        let report = run_acquire_bench(AcquireBenchOptions {
            nats_url: None,
            round_trips: 50,
            concurrency: 4,
            rounds: 1,
        })
        .await
        .expect("bench");
        assert_eq!(report.rows.len(), 2);
        for r in &report.rows {
            assert!(r.raw_per_s > 0.0 && r.coordinator_per_s > 0.0, "{r:?}");
            assert!(r.ratio().is_finite());
            // Every grant was written before its reply: at least one write,
            // at most one per grant.
            assert!(
                r.writes.count >= 1.0 && r.writes.count <= 50.0 && r.writes.state_bytes > 0.0,
                "{r:?}"
            );
        }
        let text = report.to_string();
        assert!(
            text.contains("coordinator/raw")
                && text.contains("concurrent x4")
                && text.contains("grants / write"),
            "{text}"
        );
    }
}
