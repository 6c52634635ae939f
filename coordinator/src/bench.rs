//! `asyncrl bench coordinator`: acquire → grant round trips per second
//! through NATS against the coordinator (which persists every grant to the
//! KV bucket before it replies), next to a raw async-nats request/reply echo
//! on the same server in the same run. Rounds alternate between the two
//! sides so that machine noise hits both; the best round of each counts.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use asyncrl_config::{BusConfig, Config, DatasetConfig};
use asyncrl_protos::subjects::{TASKS_ACQUIRE, TASKS_COMPLETE, WORKERS_REGISTER};
use asyncrl_protos::v1::{
    AcquireTasks, AcquireTasksReply, CompleteTask, CompleteTaskReply, RegisterWorker, Task,
};
use asyncrl_telemetry::{Health, Metrics};
use asyncrl_transport::{Bus, NatsBus, TransportMetrics};
use bytes::Bytes;
use futures::StreamExt;
use prost::Message;
use tokio_util::sync::CancellationToken;

use crate::{Coordinator, CoordinatorError};

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
            "{:<16} {:>16} {:>18} {:>16}",
            "mode", "raw echo rt/s", "coordinator rt/s", "coordinator/raw"
        )?;
        for r in &self.rows {
            writeln!(
                f,
                "{:<16} {:>16.0} {:>18.0} {:>16.3}",
                r.mode,
                r.raw_per_s,
                r.coordinator_per_s,
                r.ratio()
            )?;
        }
        Ok(())
    }
}

fn bench_err(what: &str, e: impl fmt::Display) -> CoordinatorError {
    CoordinatorError::Join(format!("bench: {what}: {e}"))
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

async fn raw_round(
    client: &async_nats::Client,
    subject: &str,
    n: usize,
    concurrency: usize,
) -> Result<Duration, CoordinatorError> {
    let payload = Bytes::from(
        AcquireTasks {
            worker_id: "bench-worker".into(),
            free_slots: 1,
        }
        .encode_to_vec(),
    );
    let start = Instant::now();
    let results: Vec<Result<async_nats::Message, async_nats::RequestError>> =
        futures::stream::iter(0..n)
            .map(|_| {
                let client = client.clone();
                let payload = payload.clone();
                let subject = subject.to_owned();
                async move { client.request(subject, payload).await }
            })
            .buffer_unordered(concurrency)
            .collect()
            .await;
    for r in results {
        r.map_err(|e| bench_err("raw request", e))?;
    }
    Ok(start.elapsed())
}

async fn coordinator_round(
    bus: &NatsBus,
    worker: &str,
    n: usize,
    concurrency: usize,
) -> Result<(Duration, Vec<Task>), CoordinatorError> {
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
        let reply = AcquireTasksReply::decode(r.map_err(|e| bench_err("acquire", e))?.as_ref())
            .map_err(|e| bench_err("decode grant", e))?;
        if reply.tasks.len() != 1 {
            return Err(bench_err(
                "acquire",
                format!("expected one task, got: {}", reply.reason),
            ));
        }
        tasks.extend(reply.tasks);
    }
    Ok((elapsed, tasks))
}

/// Completes the round's tasks (not timed) so that leases do not pile up.
async fn complete_all(
    bus: &NatsBus,
    worker: &str,
    tasks: Vec<Task>,
) -> Result<(), CoordinatorError> {
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
        let reply = CompleteTaskReply::decode(r.map_err(|e| bench_err("complete", e))?.as_ref())
            .map_err(|e| bench_err("decode completion", e))?;
        if !reply.accepted {
            return Err(bench_err("complete", reply.reason));
        }
    }
    Ok(())
}

/// Runs the benchmark and returns the figures.
pub async fn run_acquire_bench(
    opts: AcquireBenchOptions,
) -> Result<AcquireBenchReport, CoordinatorError> {
    let mut own_server = None;
    let url = match &opts.nats_url {
        Some(url) => url.clone(),
        None => {
            let server = asyncrl_testkit::NatsServer::start()
                .map_err(|e| bench_err("start nats-server", e))?;
            let url = server.url();
            own_server = Some(server);
            url
        }
    };
    let dir = tempfile_dir().await?;
    let tasks_path = dir.join("bench-tasks.jsonl");
    let n_tasks = 10_000;
    tokio::task::spawn_blocking({
        let p = tasks_path.clone();
        move || crate::dataset::write_arith_file(&p, n_tasks)
    })
    .await
    .map_err(|e| bench_err("write tasks", e))?
    .map_err(|e| bench_err("write tasks", e))?;

    let connect = || async {
        NatsBus::connect(&BusConfig::nats(url.clone()), TransportMetrics::new())
            .await
            .map_err(|e| CoordinatorError::transport("connect to NATS", e))
    };
    let server_bus: Arc<dyn Bus> = Arc::new(connect().await?);
    let client_bus = connect().await?;
    // Remove what an earlier run on this server left.
    let kv = server_bus
        .kv(asyncrl_protos::subjects::CONTROL_BUCKET)
        .await
        .map_err(|e| CoordinatorError::transport("open the KV bucket", e))?;
    for key in [crate::STATE_KEY, crate::knobs::KNOBS_KEY] {
        let _ = kv.delete(key).await;
    }

    let mut config = Config {
        bus: BusConfig::nats(url.clone()),
        ..Config::default()
    };
    config.staleness.eta = 64;
    config.staleness.groups_per_step = 4096;
    config.staleness.group_size = 8;
    config.coordinator.datasets = vec![DatasetConfig {
        name: "arith".into(),
        path: tasks_path,
    }];
    config.coordinator.admin_listen = String::new();
    config.coordinator.lease_timeout = Duration::from_secs(600);
    config.coordinator.max_tasks_per_acquire = 1;
    config.coordinator.journal_path = Some(dir.join("journal.jsonl"));
    config.run.output_dir = dir.clone();
    let shutdown = CancellationToken::new();
    let coordinator =
        Coordinator::start(config, server_bus, Metrics::new(), Health::new(), &shutdown).await?;

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
            Err(e) => return Err(CoordinatorError::transport("register the bench worker", e)),
        }
    }

    // The raw echo: a responder on one connection, requests from another.
    let raw_server = async_nats::connect(url.clone())
        .await
        .map_err(|e| bench_err("connect", e))?;
    let raw_client = async_nats::connect(url.clone())
        .await
        .map_err(|e| bench_err("connect", e))?;
    let echo_subject = format!("asyncrl.bench.echo.{}", std::process::id());
    let mut sub = raw_server
        .subscribe(echo_subject.clone())
        .await
        .map_err(|e| bench_err("subscribe", e))?;
    raw_server
        .flush()
        .await
        .map_err(|e| bench_err("flush", e))?;
    let grant = grant_sized_payload();
    let echo = tokio::spawn({
        let raw_server = raw_server.clone();
        async move {
            while let Some(m) = sub.next().await {
                if let Some(reply) = m.reply
                    && raw_server.publish(reply, grant.clone()).await.is_err()
                {
                    break;
                }
            }
        }
    });

    // Wait until the echo's subscription is in place on the server.
    let mut attempts = 0;
    while let Err(e) = raw_client
        .request(echo_subject.clone(), Bytes::from_static(b"warm-up"))
        .await
    {
        attempts += 1;
        if attempts > 100 {
            return Err(bench_err("raw echo warm-up", e));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let mut rows = Vec::new();
    let result: Result<(), CoordinatorError> = async {
        for concurrency in [1usize, opts.concurrency.max(1)] {
            let mode = if concurrency == 1 {
                "sequential".to_owned()
            } else {
                format!("concurrent x{concurrency}")
            };
            let (mut best_raw, mut best_ours) = (Duration::MAX, Duration::MAX);
            for _ in 0..opts.rounds.max(1) {
                best_raw = best_raw.min(
                    raw_round(&raw_client, &echo_subject, opts.round_trips, concurrency).await?,
                );
                let (d, tasks) =
                    coordinator_round(&client_bus, &worker, opts.round_trips, concurrency).await?;
                best_ours = best_ours.min(d);
                complete_all(&client_bus, &worker, tasks).await?;
            }
            let rate = |d: Duration| opts.round_trips as f64 / d.as_secs_f64();
            rows.push(AcquireBenchRow {
                mode,
                raw_per_s: rate(best_raw),
                coordinator_per_s: rate(best_ours),
            });
        }
        Ok(())
    }
    .await;
    echo.abort();
    coordinator.shutdown();
    let joined = coordinator.join().await;
    let _ = tokio::fs::remove_dir_all(&dir).await;
    result?;
    joined?;
    let server = match own_server {
        Some(_) => format!("private nats-server at {url}"),
        None => format!("nats-server at {url}"),
    };
    Ok(AcquireBenchReport {
        options: opts,
        server,
        rows,
    })
}

async fn tempfile_dir() -> Result<std::path::PathBuf, CoordinatorError> {
    let dir = std::env::temp_dir().join(format!(
        "asyncrl-coordinator-bench-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    tokio::fs::create_dir_all(&dir)
        .await
        .map_err(|e| bench_err("create a temporary directory", e))?;
    Ok(dir)
}
