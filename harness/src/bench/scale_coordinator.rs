//! The coordinator's cost curve: the coordinator as its own process (this
//! binary's `coordinator` command) over a private nats-server per worker
//! count, and W scripted workers in this process. Each worker does what
//! `rollout-worker/src/worker.rs` does, minus generation: registers,
//! heartbeats every `heartbeat_interval` (the coordinator's answer) with the
//! leases it holds, and keeps `slots` tasks: acquire → hold for the task
//! time → complete → acquire again (after `retry_after_ms` when refused).

use std::collections::HashSet;
use std::path::Path;
use std::process::Child;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use asyncrl_config::{BusConfig, Config};
use asyncrl_protos::Message;
use asyncrl_protos::subjects::{
    TASKS_ACQUIRE, TASKS_COMPLETE, WORKERS_HEARTBEAT, WORKERS_REGISTER,
};
use asyncrl_protos::v1::{
    AcquireTasks, AcquireTasksReply, CompleteTask, CompleteTaskReply, HeartbeatReply,
    RegisterWorker, RegisterWorkerReply, WorkerHeartbeat,
};
use asyncrl_transport::{Bus, NatsBus, TransportMetrics};
use bytes::Bytes;
use tokio_util::sync::CancellationToken;

use super::curves::{Chart, Curve, process_cpu_seconds};
use super::stats::percentile;

pub(crate) struct Options {
    pub workers: Vec<usize>,
    pub warmup: Duration,
    pub window: Duration,
    pub task_time: Duration,
    pub slots: usize,
    pub heartbeat: Duration,
    pub connections: usize,
}

const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// What the simulated workers saw; counted only while `measuring`.
#[derive(Default)]
struct Seen {
    measuring: AtomicBool,
    /// Acquire → grant round trips (seconds) that granted a task.
    grant_latency: Mutex<Vec<f64>>,
    acquires: AtomicU64,
    refused: AtomicU64,
    completes: AtomicU64,
    heartbeats: AtomicU64,
    errors: AtomicU64,
}

impl Seen {
    fn count(&self, c: &AtomicU64) {
        if self.measuring.load(Ordering::Relaxed) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }
}

async fn call<R: Message + Default>(
    bus: &NatsBus,
    subject: &str,
    req: &impl Message,
) -> anyhow::Result<R> {
    let reply = bus
        .request(subject, Bytes::from(req.encode_to_vec()), REQUEST_TIMEOUT)
        .await
        .with_context(|| format!("request on {subject}"))?;
    R::decode(reply.as_ref()).with_context(|| format!("decode the reply on {subject}"))
}

struct Sim {
    bus: Arc<NatsBus>,
    id: String,
    slots: usize,
    task_time: Duration,
    held: Mutex<HashSet<String>>,
    seen: Arc<Seen>,
}

impl Sim {
    fn held(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers (retrying while the coordinator is not there yet); the
    /// heartbeat interval it answers.
    async fn register(&self) -> anyhow::Result<Duration> {
        let req = RegisterWorker {
            worker_id: self.id.clone(),
            capacity: self.slots as u32,
            policy_version: 0,
            hostname: "scale-bench".into(),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match call::<RegisterWorkerReply>(&self.bus, WORKERS_REGISTER, &req).await {
                Ok(r) if r.accepted => {
                    return Ok(Duration::from_millis(u64::from(
                        r.heartbeat_interval_ms.max(100),
                    )));
                }
                Ok(r) => anyhow::bail!("worker {} refused: {}", self.id, r.reason),
                Err(e) if Instant::now() > deadline => return Err(e),
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    async fn heartbeats(&self, every: Duration) {
        let mut ticker = tokio::time::interval(every);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            let lease_ids: Vec<String> = self.held().iter().cloned().collect();
            let req = WorkerHeartbeat {
                worker_id: self.id.clone(),
                policy_version: 0,
                sequences_in_flight: lease_ids.len() as u32,
                lease_ids,
                tokens_per_second: 1000.0,
                draining: false,
                weight_swap_latency_ms: 0.0,
            };
            match call::<HeartbeatReply>(&self.bus, WORKERS_HEARTBEAT, &req).await {
                Ok(_) => self.seen.count(&self.seen.heartbeats),
                Err(_) => self.seen.count(&self.seen.errors),
            }
        }
    }

    /// One slot: acquire, hold, complete, forever.
    async fn slot(&self) {
        let req = AcquireTasks {
            worker_id: self.id.clone(),
            free_slots: 1,
        };
        loop {
            let t0 = Instant::now();
            let reply = call::<AcquireTasksReply>(&self.bus, TASKS_ACQUIRE, &req).await;
            let latency = t0.elapsed().as_secs_f64();
            self.seen.count(&self.seen.acquires);
            let reply = match reply {
                Ok(r) => r,
                Err(_) => {
                    self.seen.count(&self.seen.errors);
                    tokio::time::sleep(Duration::from_millis(250)).await;
                    continue;
                }
            };
            let Some(task) = reply.tasks.into_iter().next() else {
                self.seen.count(&self.seen.refused);
                let ms = u64::from(reply.retry_after_ms.max(50));
                tokio::time::sleep(Duration::from_millis(ms)).await;
                continue;
            };
            if self.seen.measuring.load(Ordering::Relaxed) {
                self.seen
                    .grant_latency
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(latency);
            }
            self.held().insert(task.lease_id.clone());
            let hold = self.task_time.mul_f64(rand::random_range(0.5..1.5));
            tokio::time::sleep(hold).await;
            let done = CompleteTask {
                worker_id: self.id.clone(),
                task_id: task.task_id,
                lease_id: task.lease_id.clone(),
                num_trajectories: task.group_size,
            };
            match call::<CompleteTaskReply>(&self.bus, TASKS_COMPLETE, &done).await {
                Ok(_) => self.seen.count(&self.seen.completes),
                Err(_) => self.seen.count(&self.seen.errors),
            }
            self.held().remove(&task.lease_id);
        }
    }

    async fn run(self: Arc<Self>, every: Duration) -> anyhow::Result<()> {
        // Workers do not start in lockstep.
        tokio::time::sleep(every.mul_f64(rand::random_range(0.0..1.0))).await;
        let every = self.register().await?;
        let slots = futures::future::join_all((0..self.slots).map(|_| self.slot()));
        tokio::join!(self.heartbeats(every), slots);
        Ok(())
    }
}

/// The coordinator's config: a large batch (B = 4096, G = 8) and η = 64,
/// so that admission never holds the simulated workers back, and
/// heartbeats every `heartbeat` (at least 100 ms).
fn coordinator_config(url: &str, run_dir: &Path, tasks: &Path, heartbeat: Duration) -> Config {
    let hb = heartbeat.max(Duration::from_millis(100));
    let mut c = Config::isolated(run_dir, url);
    c.run.name = "scale".into();
    c.staleness.eta = 64;
    c.staleness.groups_per_step = 4096;
    c.staleness.group_size = 8;
    c.telemetry.listen = "127.0.0.1:0".into();
    c.telemetry.log_filter = "warn".into();
    c.coordinator.datasets = vec![crate::configs::arith(tasks)];
    c.coordinator.heartbeat_interval = hb;
    c.coordinator.lease_timeout = (hb * 30).max(Duration::from_secs(60));
    c.coordinator.dead_after = hb * 5;
    c
}

/// The coordinator process; killed on drop.
struct CoordinatorProcess(Child);

impl CoordinatorProcess {
    fn start(bin: &Path, config: &Path, log: &Path) -> anyhow::Result<Self> {
        let out = std::fs::File::create(log)
            .with_context(|| format!("cannot create {}", log.display()))?;
        let child = crate::process::role_command(bin, "coordinator", config, out)?
            .spawn()
            .with_context(|| format!("cannot start {} coordinator", bin.display()))?;
        Ok(Self(child))
    }

    fn pid(&self) -> String {
        self.0.id().to_string()
    }
}

impl Drop for CoordinatorProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One row: workers, coordinator CPU s/s, grant p50 ms, p99 ms, grants/s,
/// requests/s, refused/s, errors, nats-server CPU s/s, bench CPU s/s.
async fn point(
    bin: &Path,
    dir: &Path,
    tasks: &Path,
    w: usize,
    o: &Options,
) -> anyhow::Result<Vec<f64>> {
    let nats = asyncrl_testkit::NatsServer::start().context("start a nats-server")?;
    let url = nats.url();
    let run_dir = dir.join(format!("run-{w}"));
    std::fs::create_dir_all(&run_dir)
        .with_context(|| format!("cannot create {}", run_dir.display()))?;
    let config = dir.join(format!("coordinator-{w}.toml"));
    coordinator_config(&url, &run_dir, tasks, o.heartbeat)
        .write(&config)
        .context("cannot write the coordinator's config")?;
    let log = dir.join(format!("coordinator-{w}.log"));
    let coordinator = CoordinatorProcess::start(bin, &config, &log)?;

    let mut buses = Vec::new();
    for _ in 0..o.connections.min(w).max(1) {
        let bus = NatsBus::connect(&BusConfig::nats(url.clone()), TransportMetrics::new())
            .await
            .context("connect to NATS")?;
        buses.push(Arc::new(bus));
    }
    let seen = Arc::new(Seen::default());
    let stop = CancellationToken::new();
    let mut workers = tokio::task::JoinSet::new();
    for i in 0..w {
        let sim = Arc::new(Sim {
            bus: buses[i % buses.len()].clone(),
            id: format!("sim-{i}"),
            slots: o.slots,
            task_time: o.task_time,
            held: Mutex::new(HashSet::new()),
            seen: seen.clone(),
        });
        let stop = stop.clone();
        let every = o.heartbeat;
        workers.spawn(async move { stop.run_until_cancelled(sim.run(every)).await });
    }
    let wait = async {
        tokio::time::sleep(o.heartbeat + o.warmup).await;
        let pid = coordinator.pid();
        let nats_pid = nats
            .pid()
            .context("the nats-server is not running")?
            .to_string();
        let cpu = |p: &str| process_cpu_seconds(p);
        let (c0, n0, s0, t0) = (cpu(&pid)?, cpu(&nats_pid)?, cpu("self")?, Instant::now());
        seen.measuring.store(true, Ordering::SeqCst);
        tokio::time::sleep(o.window).await;
        seen.measuring.store(false, Ordering::SeqCst);
        let (c1, n1, s1) = (cpu(&pid)?, cpu(&nats_pid)?, cpu("self")?);
        let wall = t0.elapsed().as_secs_f64();
        anyhow::Ok(((c1 - c0) / wall, (n1 - n0) / wall, (s1 - s0) / wall, wall))
    };
    // A worker that fails (registration refused) ends the point.
    let measured = tokio::select! {
        r = wait => r,
        Some(r) = workers.join_next() => match r {
            Ok(Some(Err(e))) => Err(e),
            other => Err(anyhow::anyhow!("a simulated worker ended: {other:?}")),
        },
    };
    stop.cancel();
    workers.abort_all();
    while workers.join_next().await.is_some() {}
    drop(coordinator);
    let (coord_cpu, nats_cpu, self_cpu, wall) = measured.with_context(|| {
        let tail = std::fs::read_to_string(&log).unwrap_or_default();
        let tail: String = tail.lines().rev().take(20).collect::<Vec<_>>().join("\n");
        format!("{w} workers (coordinator log, last lines reversed):\n{tail}")
    })?;
    let mut lat = std::mem::take(
        &mut *seen
            .grant_latency
            .lock()
            .unwrap_or_else(PoisonError::into_inner),
    );
    let grants = lat.len() as f64;
    let n = |c: &AtomicU64| c.load(Ordering::SeqCst) as f64;
    let requests = n(&seen.acquires) + n(&seen.completes) + n(&seen.heartbeats);
    anyhow::ensure!(grants > 0.0, "{w} workers: no task granted in the window");
    Ok(vec![
        w as f64,
        coord_cpu,
        percentile(&mut lat, 50.0) * 1e3,
        percentile(&mut lat, 99.0) * 1e3,
        grants / wall,
        requests / wall,
        n(&seen.refused) / wall,
        n(&seen.errors),
        nats_cpu,
        self_cpu,
    ])
}

pub(crate) fn measure(rt: &tokio::runtime::Runtime, o: &Options) -> anyhow::Result<Curve> {
    let bin = crate::process::asyncrl_bin()?;
    let dir = tempfile::Builder::new()
        .prefix("asyncrl-scale-coordinator-")
        .tempdir()
        .context("create a temporary directory")?;
    let tasks = dir.path().join("tasks.jsonl");
    asyncrl_coordinator::dataset::write_arith_file(&tasks, 20_000)
        .context("write the task file")?;
    let mut rows = Vec::new();
    for &w in &o.workers {
        let row = rt.block_on(point(&bin, dir.path(), &tasks, w.max(1), o))?;
        eprintln!(
            "scale: {w} workers: coordinator {:.3} CPU-s/s, grant p50 {:.2} ms p99 {:.2} ms, {:.0} requests/s",
            row[1], row[2], row[3], row[5]
        );
        rows.push(row);
    }
    let per_worker_rate =
        o.slots as f64 * 2.0 / o.task_time.as_secs_f64() + 1.0 / o.heartbeat.as_secs_f64();
    let notes = format!(
        "The real coordinator as its own process (`asyncrl coordinator`, every grant persisted \
         to the KV bucket before its reply) over a private nats-server started per worker count; \
         W scripted workers in the bench process over {} shared NATS connections, each \
         registering, heart-beating every {:?} with its held leases, and keeping {} tasks \
         (acquire → hold {:?} ± 50 % → complete): about {:.2} requests/s per worker. \
         {:?} warm-up, then a {:?} window: CPU from `/proc/<pid>/stat` (CPU-seconds per wall \
         second; 1.0 = one core), grant latency = acquire → reply with a task, seen by the \
         worker (so it includes the bench process's own scheduling on a shared machine).\n",
        o.connections, o.heartbeat, o.slots, o.task_time, per_worker_rate, o.warmup, o.window
    );
    let headline = rows
        .last()
        .map(|r| {
            format!(
                "**At {} simulated workers**: grant latency p50 {:.2} ms, p99 {:.2} ms; \
                 coordinator CPU {:.3} CPU-s/s ({:.1} % of one core) at {:.0} requests/s \
                 ({:.0} grants/s).\n",
                r[0],
                r[2],
                r[3],
                r[1],
                r[1] * 100.0,
                r[5],
                r[4]
            )
        })
        .unwrap_or_default();
    Ok(Curve {
        name: "coordinator",
        title: "Coordinator: CPU and grant latency vs simulated workers".into(),
        x_label: "workers",
        header: vec![
            "workers",
            "coordinator_cpu_s_per_s",
            "grant_p50_ms",
            "grant_p99_ms",
            "grants_per_s",
            "requests_per_s",
            "refused_per_s",
            "errors",
            "nats_cpu_s_per_s",
            "bench_cpu_s_per_s",
        ],
        rows,
        x_col: 0,
        charts: vec![
            Chart {
                suffix: "cpu",
                y_label: "CPU-seconds per second",
                columns: vec![1],
            },
            Chart {
                suffix: "grant_latency",
                y_label: "ms",
                columns: vec![2, 3],
            },
        ],
        notes,
        headline,
    })
}
