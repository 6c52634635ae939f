//! Stand-ins for the other roles, for tests and benches: a scripted
//! coordinator that serves the worker's request/reply subjects from a fixed
//! task list and records every request, a weight publisher that writes an
//! object and announces it like the learner does, and a reader of the
//! trajectory stream. Not a coordinator: no admission control, no lease
//! expiry.

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use asyncrl_config::BusConfig;
use asyncrl_protos::subjects::{
    TASKS_ACQUIRE, TASKS_COMPLETE, TASKS_RETURN, TRAJECTORY_STREAM, WORKERS_HEARTBEAT,
    WORKERS_REGISTER, worker_subject_pattern,
};
use asyncrl_protos::v1::{
    AcquireTasks, AcquireTasksReply, CompleteTask, CompleteTaskReply, HeartbeatReply,
    RegisterWorker, RegisterWorkerReply, ReturnTasks, ReturnTasksReply, WorkerHeartbeat,
};
use asyncrl_protos::{
    ContractError, Message, Task, Trajectory, WeightAnnouncement, decode_trajectory,
};
use asyncrl_transport::{Bus, ConsumerSpec, TransportError};
use bytes::Bytes;
use futures::StreamExt;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

/// One prompt the scripted coordinator hands out.
#[derive(Debug, Clone, PartialEq)]
pub struct ScriptedTask {
    pub task_id: String,
    pub dataset: String,
    pub prompt: String,
    pub answer: String,
}

impl ScriptedTask {
    /// Tasks from a built-in generator.
    pub fn generated(task: asyncrl_tasks::BuiltinTask, n: usize, seed: u64) -> Vec<Self> {
        asyncrl_tasks::generate(task, n, seed)
            .into_iter()
            .map(|item| ScriptedTask {
                task_id: item.id.clone(),
                dataset: task.name().to_owned(),
                prompt: item.prompt_text().to_owned(),
                answer: item.answer.clone(),
            })
            .collect()
    }
}

/// Behaviour of the scripted coordinator.
#[derive(Debug, Clone)]
pub struct ScriptOptions {
    pub group_size: u32,
    /// Stamped on every granted task.
    pub admission_version: i32,
    /// Most tasks granted per acquire.
    pub max_per_acquire: u32,
    /// Sent with an empty grant.
    pub retry_after_ms: u32,
    /// Sent in the registration reply.
    pub heartbeat_interval_ms: u32,
    /// Returned tasks go back to the front of the queue (as a real
    /// coordinator re-issues them).
    pub requeue_returned: bool,
}

impl Default for ScriptOptions {
    fn default() -> Self {
        Self {
            group_size: 4,
            admission_version: 0,
            max_per_acquire: 64,
            retry_after_ms: 20,
            heartbeat_interval_ms: 1000,
            requeue_returned: false,
        }
    }
}

/// A CompleteTask as the coordinator saw it.
#[derive(Debug, Clone)]
pub struct SeenCompletion {
    pub request: CompleteTask,
    /// Messages in `TRAJECTORIES` when the request arrived.
    pub stream_len: u64,
    pub accepted: bool,
    pub at: Instant,
}

/// Everything the scripted coordinator was asked.
#[derive(Debug, Clone, Default)]
pub struct ScriptLog {
    pub registrations: Vec<RegisterWorker>,
    pub heartbeats: Vec<(Instant, WorkerHeartbeat)>,
    pub acquires: Vec<(Instant, AcquireTasks)>,
    /// Every task granted, in order, with when.
    pub granted: Vec<(Instant, Task)>,
    pub completions: Vec<SeenCompletion>,
    pub returns: Vec<ReturnTasks>,
    /// Leases sent back as revoked in a heartbeat reply.
    pub revoked: Vec<String>,
}

impl ScriptLog {
    pub fn completed_leases(&self) -> HashSet<String> {
        self.completions
            .iter()
            .filter(|c| c.accepted)
            .map(|c| c.request.lease_id.clone())
            .collect()
    }

    pub fn returned_leases(&self) -> HashSet<String> {
        self.returns
            .iter()
            .flat_map(|r| r.lease_ids.iter().cloned())
            .collect()
    }

    pub fn granted_leases(&self) -> HashSet<String> {
        self.granted
            .iter()
            .map(|(_, t)| t.lease_id.clone())
            .collect()
    }
}

struct Inner {
    options: ScriptOptions,
    queue: VecDeque<ScriptedTask>,
    next_lease: u64,
    to_revoke: HashSet<String>,
    log: ScriptLog,
}

/// Serves `asyncrl.workers.*` and `asyncrl.tasks.*` from a task list.
pub struct ScriptedCoordinator {
    inner: Arc<Mutex<Inner>>,
    changed: Arc<Notify>,
    servers: Vec<JoinHandle<()>>,
}

impl Drop for ScriptedCoordinator {
    fn drop(&mut self) {
        for s in &self.servers {
            s.abort();
        }
    }
}

fn lock(inner: &Mutex<Inner>) -> std::sync::MutexGuard<'_, Inner> {
    inner.lock().unwrap_or_else(PoisonError::into_inner)
}

impl ScriptedCoordinator {
    pub async fn start(
        bus: Arc<dyn Bus>,
        tasks: Vec<ScriptedTask>,
        options: ScriptOptions,
    ) -> Result<Self, TransportError> {
        let inner = Arc::new(Mutex::new(Inner {
            options,
            queue: tasks.into(),
            next_lease: 0,
            to_revoke: HashSet::new(),
            log: ScriptLog::default(),
        }));
        let changed = Arc::new(Notify::new());
        let mut servers = Vec::new();
        for subject in [
            WORKERS_REGISTER,
            WORKERS_HEARTBEAT,
            TASKS_ACQUIRE,
            TASKS_COMPLETE,
            TASKS_RETURN,
        ] {
            // The worker's own subjects (`<subject>.<worker id>`), and the
            // bare one, as the coordinator serves them.
            for pattern in [subject.to_owned(), worker_subject_pattern(subject)] {
                let mut requests = bus.serve(&pattern, None).await?;
                let (inner, changed, bus) = (inner.clone(), changed.clone(), bus.clone());
                servers.push(tokio::spawn(async move {
                    while let Some(req) = requests.next().await {
                        let reply = handle(&inner, bus.as_ref(), subject, &req.payload).await;
                        changed.notify_waiters();
                        let _ = req.respond(reply).await;
                    }
                }));
            }
        }
        bus.flush().await?;
        Ok(Self {
            inner,
            changed,
            servers,
        })
    }

    /// A copy of what was asked so far.
    pub fn log(&self) -> ScriptLog {
        lock(&self.inner).log.clone()
    }

    /// Tasks not handed out yet.
    pub fn remaining(&self) -> usize {
        lock(&self.inner).queue.len()
    }

    /// Adds tasks to hand out.
    pub fn push_tasks(&self, tasks: Vec<ScriptedTask>) {
        lock(&self.inner).queue.extend(tasks);
    }

    /// The admission version stamped on tasks granted from now on.
    pub fn set_admission_version(&self, v: i32) {
        lock(&self.inner).options.admission_version = v;
    }

    /// Revokes a lease: the next heartbeat that lists it gets it back as
    /// revoked, and its completion is refused.
    pub fn revoke(&self, lease_id: &str) {
        lock(&self.inner).to_revoke.insert(lease_id.to_owned());
    }

    /// Waits until `pred` holds for the log (checked after every request),
    /// or `timeout`; returns the log either way, and whether it held.
    pub async fn wait_for(
        &self,
        timeout: Duration,
        pred: impl Fn(&ScriptLog) -> bool,
    ) -> (bool, ScriptLog) {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.changed.notified();
            let log = self.log();
            if pred(&log) {
                return (true, log);
            }
            tokio::select! {
                _ = notified => {}
                _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                _ = tokio::time::sleep_until(deadline) => return (pred(&self.log()), self.log()),
            }
        }
    }
}

async fn handle(inner: &Mutex<Inner>, bus: &dyn Bus, subject: &str, payload: &[u8]) -> Bytes {
    let now = Instant::now();
    let encoded = match subject {
        WORKERS_REGISTER => {
            let req = RegisterWorker::decode(payload).unwrap_or_default();
            let mut s = lock(inner);
            let interval = s.options.heartbeat_interval_ms;
            s.log.registrations.push(req);
            RegisterWorkerReply {
                accepted: true,
                reason: String::new(),
                heartbeat_interval_ms: interval,
            }
            .encode_to_vec()
        }
        WORKERS_HEARTBEAT => {
            let req = WorkerHeartbeat::decode(payload).unwrap_or_default();
            let mut s = lock(inner);
            let revoked: Vec<String> = req
                .lease_ids
                .iter()
                .filter(|l| s.to_revoke.contains(*l))
                .cloned()
                .collect();
            s.log.revoked.extend(revoked.iter().cloned());
            s.log.heartbeats.push((now, req));
            HeartbeatReply {
                revoked_lease_ids: revoked,
            }
            .encode_to_vec()
        }
        TASKS_ACQUIRE => {
            let req = AcquireTasks::decode(payload).unwrap_or_default();
            let mut s = lock(inner);
            let n = req.free_slots.min(s.options.max_per_acquire) as usize;
            let mut tasks = Vec::new();
            while tasks.len() < n {
                let Some(t) = s.queue.pop_front() else { break };
                s.next_lease += 1;
                let task = Task {
                    task_id: t.task_id,
                    lease_id: format!("lease-{}", s.next_lease),
                    prompt: t.prompt,
                    messages: Vec::new(),
                    verifier: String::new(),
                    answer: t.answer,
                    dataset: t.dataset,
                    group_size: s.options.group_size,
                    lease_deadline_unix_ms: asyncrl_common::unix_ms() + 600_000,
                    admission_version: s.options.admission_version,
                    epoch: 0,
                };
                s.log.granted.push((now, task.clone()));
                tasks.push(task);
            }
            s.log.acquires.push((now, req));
            let empty = tasks.is_empty();
            AcquireTasksReply {
                tasks,
                reason: if empty {
                    "no tasks left".into()
                } else {
                    String::new()
                },
                retry_after_ms: if empty { s.options.retry_after_ms } else { 0 },
            }
            .encode_to_vec()
        }
        TASKS_COMPLETE => {
            let req = CompleteTask::decode(payload).unwrap_or_default();
            let stream_len = bus.stream_len(TRAJECTORY_STREAM).await.unwrap_or(0);
            let mut s = lock(inner);
            let known = s
                .log
                .granted
                .iter()
                .any(|(_, t)| t.lease_id == req.lease_id);
            let accepted = known && !s.to_revoke.contains(&req.lease_id);
            s.log.completions.push(SeenCompletion {
                request: req,
                stream_len,
                accepted,
                at: now,
            });
            CompleteTaskReply {
                accepted,
                reason: if accepted {
                    String::new()
                } else {
                    "unknown or revoked lease".into()
                },
            }
            .encode_to_vec()
        }
        TASKS_RETURN => {
            let req = ReturnTasks::decode(payload).unwrap_or_default();
            let returned = req.lease_ids.len() as u32;
            let mut s = lock(inner);
            if s.options.requeue_returned {
                let again: Vec<ScriptedTask> = s
                    .log
                    .granted
                    .iter()
                    .filter(|(_, t)| req.lease_ids.contains(&t.lease_id))
                    .map(|(_, t)| ScriptedTask {
                        task_id: t.task_id.clone(),
                        dataset: t.dataset.clone(),
                        prompt: t.prompt.clone(),
                        answer: t.answer.clone(),
                    })
                    .collect();
                for t in again.into_iter().rev() {
                    s.queue.push_front(t);
                }
            }
            s.log.returns.push(req);
            ReturnTasksReply { returned }.encode_to_vec()
        }
        _ => Vec::new(),
    };
    Bytes::from(encoded)
}

/// Creates the trajectory stream (the buffer's job in a real deployment)
/// with the spec the buffer uses under `bus.storage.trajectories = "keep"`:
/// the tests read what the worker published with consumers of their own,
/// more than one per stream, which a releasing (work-queue) stream refuses.
pub async fn ensure_trajectory_stream(bus: &dyn Bus) -> Result<(), TransportError> {
    let mut config = BusConfig::default();
    config.storage.trajectories = asyncrl_config::TrajectoryRetention::Keep;
    let spec = asyncrl_control::streams::trajectory_stream_spec(&config);
    bus.ensure_stream(&spec).await
}

pub use asyncrl_control::weights::AnnounceError;

/// Publishes `weights` as version `version` (trained step = version), the
/// way the learner does.
pub async fn publish_weights(
    bus: &dyn Bus,
    version: i32,
    weights: Bytes,
) -> Result<WeightAnnouncement, AnnounceError> {
    let (store, kv) = asyncrl_control::weights::open(bus).await?;
    asyncrl_control::weights::publish(
        store.as_ref(),
        kv.as_ref(),
        version,
        version.max(0) as u64,
        weights,
        &asyncrl_control::weights::Fence::default(),
    )
    .await
}

/// Writes an announcement as is (to script broken ones).
pub async fn announce(bus: &dyn Bus, ann: &WeightAnnouncement) -> Result<(), TransportError> {
    let kv = bus.kv(asyncrl_protos::subjects::CONTROL_BUCKET).await?;
    kv.put(
        asyncrl_protos::subjects::POLICY_VERSION_KEY,
        Bytes::from(asyncrl_protos::Message::encode_to_vec(ann)),
    )
    .await?;
    Ok(())
}

/// A trajectory read back from the stream.
#[derive(Debug, Clone)]
pub struct Received {
    pub msg_id: Option<String>,
    pub stream_sequence: u64,
    pub subject: String,
    pub trajectory: Trajectory,
}

/// Reads the trajectory stream with a durable consumer `durable` until
/// `want` messages arrived or `timeout` passed; every message must decode
/// and pass [`Trajectory::validate`] (the buffer's check).
pub async fn read_trajectories(
    bus: &dyn Bus,
    durable: &str,
    want: usize,
    timeout: Duration,
) -> Result<Vec<Received>, ReadError> {
    let consumer = bus
        .consumer(TRAJECTORY_STREAM, &ConsumerSpec::new(durable))
        .await?;
    let deadline = Instant::now() + timeout;
    let mut out = Vec::new();
    while out.len() < want && Instant::now() < deadline {
        let batch = consumer
            .fetch(want - out.len(), Duration::from_millis(200))
            .await?;
        for d in batch {
            let trajectory = decode_trajectory(&d.payload).map_err(|e| ReadError::Invalid {
                sequence: d.stream_sequence,
                error: e,
            })?;
            d.ack().await?;
            out.push(Received {
                msg_id: d.msg_id.clone(),
                stream_sequence: d.stream_sequence,
                subject: d.subject.clone(),
                trajectory,
            });
        }
    }
    Ok(out)
}

#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error("message {sequence} of the trajectory stream is invalid: {error}")]
    Invalid { sequence: u64, error: ContractError },
}
