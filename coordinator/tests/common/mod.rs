//! Helpers shared by the coordinator's integration tests: a config for a
//! small run, a scripted worker and a scripted learner talking to the
//! coordinator over the bus exactly as the real ones do.
//!
//! Waits are measured in tokio time, so that under
//! `#[tokio::test(start_paused = true)]` they follow the paused clock (and
//! do not depend on how busy the machine is); over a real nats-server they
//! are real time.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use asyncrl_common::{SharedClock, SystemClock};
use asyncrl_config::{BusConfig, Config, DatasetConfig};
use asyncrl_protos::subjects::{
    CONTROL_BUCKET, POLICY_VERSION_KEY, TASKS_ACQUIRE, TASKS_COMPLETE, TASKS_RETURN,
    WORKERS_HEARTBEAT, WORKERS_REGISTER,
};
use asyncrl_protos::v1::{
    AcquireTasks, AcquireTasksReply, CompleteTask, CompleteTaskReply, HeartbeatReply,
    LearnerStatus, RegisterWorker, RegisterWorkerReply, ReturnTasks, ReturnTasksReply, Task,
    WeightAnnouncement, WorkerHeartbeat,
};
use asyncrl_transport::{Bus, NatsBus, TransportMetrics};
use bytes::Bytes;
use prost::Message;
use tokio::time::Instant;

pub const TIMEOUT: Duration = Duration::from_secs(5);

/// Writes `n` arithmetic tasks and returns the path.
pub fn write_tasks(dir: &Path, n: usize) -> PathBuf {
    let path = dir.join("arith.jsonl");
    asyncrl_coordinator::dataset::write_arith_file(&path, n).expect("write tasks");
    path
}

/// A config for a small run in `dir`.
pub fn config(dir: &Path, tasks: &Path, b: u32, eta: u32) -> Config {
    let mut c = Config::default();
    c.run.output_dir = dir.to_owned();
    c.staleness.groups_per_step = b;
    c.staleness.eta = eta;
    c.staleness.group_size = 2;
    c.coordinator.datasets = vec![DatasetConfig::jsonl("arith", tasks.to_owned())];
    c.coordinator.admin_listen = String::new();
    c.coordinator.heartbeat_interval = Duration::from_millis(100);
    c.coordinator.lease_timeout = Duration::from_secs(30);
    c.coordinator.dead_after = Duration::from_secs(30);
    c.coordinator.retry_after = Duration::from_millis(50);
    c.coordinator.journal_path = Some(dir.join("journal.jsonl"));
    c
}

pub async fn nats_bus(url: &str) -> Arc<dyn Bus> {
    Arc::new(
        NatsBus::connect(&BusConfig::nats(url), TransportMetrics::new())
            .await
            .expect("connect to nats"),
    )
}

/// A scripted rollout worker.
pub struct Worker {
    pub bus: Arc<dyn Bus>,
    pub id: String,
}

impl Worker {
    pub fn new(bus: &Arc<dyn Bus>, id: &str) -> Self {
        Self {
            bus: bus.clone(),
            id: id.to_owned(),
        }
    }

    async fn call<Req: Message, Rep: Message + Default>(&self, subject: &str, req: Req) -> Rep {
        let bytes = self
            .bus
            .request(subject, Bytes::from(req.encode_to_vec()), TIMEOUT)
            .await
            .unwrap_or_else(|e| panic!("{subject}: {e}"));
        Rep::decode(bytes.as_ref()).expect("decode reply")
    }

    /// Like `call`, but retries while nobody serves the subject yet (a
    /// coordinator that is still starting).
    pub async fn register(&self, capacity: u32) -> RegisterWorkerReply {
        let req = RegisterWorker {
            worker_id: self.id.clone(),
            capacity,
            policy_version: 0,
            hostname: "test-host".into(),
        };
        let start = Instant::now();
        loop {
            match self
                .bus
                .request(WORKERS_REGISTER, Bytes::from(req.encode_to_vec()), TIMEOUT)
                .await
            {
                Ok(b) => return RegisterWorkerReply::decode(b.as_ref()).expect("decode"),
                Err(e) if start.elapsed() < Duration::from_secs(15) && e.is_transient() => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!("register: {e}"),
            }
        }
    }

    pub async fn acquire(&self, free_slots: u32) -> AcquireTasksReply {
        self.call(
            TASKS_ACQUIRE,
            AcquireTasks {
                worker_id: self.id.clone(),
                free_slots,
            },
        )
        .await
    }

    pub async fn complete(&self, task: &Task) -> CompleteTaskReply {
        self.complete_ids(&task.task_id, &task.lease_id, task.group_size)
            .await
    }

    pub async fn complete_ids(&self, task_id: &str, lease_id: &str, n: u32) -> CompleteTaskReply {
        self.call(
            TASKS_COMPLETE,
            CompleteTask {
                worker_id: self.id.clone(),
                task_id: task_id.to_owned(),
                lease_id: lease_id.to_owned(),
                num_trajectories: n,
            },
        )
        .await
    }

    pub async fn heartbeat(&self, leases: &[&Task], draining: bool) -> HeartbeatReply {
        self.call(
            WORKERS_HEARTBEAT,
            WorkerHeartbeat {
                worker_id: self.id.clone(),
                policy_version: 0,
                lease_ids: leases.iter().map(|t| t.lease_id.clone()).collect(),
                sequences_in_flight: 0,
                tokens_per_second: 100.0,
                draining,
                weight_swap_latency_ms: 0.0,
            },
        )
        .await
    }

    pub async fn return_tasks(&self, tasks: &[&Task]) -> ReturnTasksReply {
        self.call(
            TASKS_RETURN,
            ReturnTasks {
                worker_id: self.id.clone(),
                lease_ids: tasks.iter().map(|t| t.lease_id.clone()).collect(),
                reason: "draining".into(),
                task_failed: false,
            },
        )
        .await
    }

    /// Returns tasks the worker could not do (they failed).
    pub async fn return_failed(&self, tasks: &[&Task], why: &str) -> ReturnTasksReply {
        self.call(
            TASKS_RETURN,
            ReturnTasks {
                worker_id: self.id.clone(),
                lease_ids: tasks.iter().map(|t| t.lease_id.clone()).collect(),
                reason: why.into(),
                task_failed: true,
            },
        )
        .await
    }
}

/// A scripted learner: announces versions and its session in the KV bucket,
/// stamped by its clock.
pub struct Learner {
    pub kv: Arc<dyn asyncrl_transport::KvBucket>,
    pub clock: SharedClock,
}

impl Learner {
    /// A learner on the system clock.
    pub async fn new(bus: &Arc<dyn Bus>) -> Self {
        Self::with_clock(bus, SystemClock::shared()).await
    }

    /// A learner whose announcements carry `clock`'s time (the coordinator's
    /// clock in tests on paused time).
    pub async fn with_clock(bus: &Arc<dyn Bus>, clock: SharedClock) -> Self {
        Self {
            kv: bus.kv(CONTROL_BUCKET).await.expect("kv"),
            clock,
        }
    }

    pub async fn announce(&self, version: i32) {
        let a = WeightAnnouncement {
            version,
            object_name: asyncrl_protos::subjects::weights_object_name(version),
            sha256: String::new(),
            byte_size: 0,
            format: "safetensors".into(),
            published_at_unix_ms: self.clock.now_unix_ms(),
            step: version.max(0) as u64,
            ..Default::default()
        };
        self.kv
            .put(POLICY_VERSION_KEY, Bytes::from(a.encode_to_vec()))
            .await
            .expect("announce");
    }

    pub async fn session(&self, id: &str, start_version: i32) {
        let s = LearnerStatus {
            session_id: id.into(),
            started_at_unix_ms: self.clock.now_unix_ms(),
            start_version,
            step: start_version.max(0) as u64,
            step_train_seconds: 0.0,
            step_wait_seconds: 0.0,
        };
        self.kv
            .put(
                asyncrl_protos::subjects::LEARNER_STATUS_KEY,
                Bytes::from(s.encode_to_vec()),
            )
            .await
            .expect("learner status");
    }
}
