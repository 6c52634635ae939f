//! The coordinator process: one task (the actor) owns the state and handles
//! every event in order — worker requests from NATS, learner announcements,
//! knob and learner-status updates from the KV bucket, dropped-group reports,
//! admin commands and a timer. Events are taken in batches; a batch that
//! changed the persisted state is written to the KV bucket once (group
//! commit) before any reply that depends on it is sent, so a reply never
//! promises something a restarted coordinator would not know.

use std::sync::Arc;
use std::time::{Duration, Instant};

use asyncrl_config::Config;
use asyncrl_protos::subjects::{
    BUFFER_GROUP_DROPPED, POLICY_VERSION_KEY, TASKS_ACQUIRE, TASKS_COMPLETE, TASKS_RETURN,
    WORKERS_HEARTBEAT, WORKERS_REGISTER,
};
use asyncrl_protos::v1::{
    AcquireTasks, AcquireTasksReply, CompleteTask, CompleteTaskReply, ControlReply,
    CoordinatorState, GetKnobsReply, GroupDropped, HeartbeatReply, KnobChange, KnobSchedule, Knobs,
    LearnerStatus, ListWorkersReply, RegisterWorker, RegisterWorkerReply, ReturnTasks,
    ReturnTasksReply, SetKnobsReply, SetKnobsRequest, StatusReply, Task, WeightAnnouncement,
    WorkerHeartbeat, WorkerInfo,
};
use asyncrl_telemetry::Health;
use asyncrl_transport::{Bus, KvBucket, Request, TransportError};
use bytes::Bytes;
use futures::StreamExt;
use prost::Message;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::capacity::{CapacityEstimator, WorkerView, recommended_workers};
use crate::dataset::{TaskSet, valid_task_id};
use crate::journal::{Journal, entry, now_unix_ms};
use crate::knobs::{self, Decision, KNOBS_KEY};
use crate::metrics::{CoordinatorMetrics, KnobLabel, OutcomeLabel, StateLabel, WorkerLabel};
use crate::registry::Registry;
use crate::scheduler::{Completion, Scheduler, SchedulerParams, VersionChange};
use crate::{CoordinatorError, LEARNER_STATUS_KEY, QUEUE_GROUP, STATE_KEY};

/// How many unconfirmed state writes are remembered (each one a state the
/// coordinator may find stored as its own after a lost reply).
const MAX_UNCONFIRMED_WRITES: usize = 16;

/// Events the actor handles.
pub(crate) enum Event {
    Request {
        kind: RequestKind,
        req: Request,
    },
    Version(WeightAnnouncement),
    Knobs {
        schedule: KnobSchedule,
        revision: u64,
    },
    LearnerStatus(LearnerStatus),
    GroupDropped(GroupDropped),
    Admin(AdminCommand),
    /// The periodic check of lease deadlines and heartbeats, stamped when
    /// the ticker sent it.
    Tick(tokio::time::Instant),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RequestKind {
    Acquire,
    Complete,
    Return,
    Register,
    Heartbeat,
}

impl RequestKind {
    fn subject(self) -> &'static str {
        match self {
            RequestKind::Acquire => TASKS_ACQUIRE,
            RequestKind::Complete => TASKS_COMPLETE,
            RequestKind::Return => TASKS_RETURN,
            RequestKind::Register => WORKERS_REGISTER,
            RequestKind::Heartbeat => WORKERS_HEARTBEAT,
        }
    }
}

/// Why an admin request was refused before it was considered.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Unauthorized(pub String);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ControlAction {
    Pause,
    Resume,
    Checkpoint,
}

impl ControlAction {
    fn name(self) -> &'static str {
        match self {
            ControlAction::Pause => "pause",
            ControlAction::Resume => "resume",
            ControlAction::Checkpoint => "checkpoint",
        }
    }
}

pub(crate) enum AdminCommand {
    Status(oneshot::Sender<StatusReply>),
    Workers(oneshot::Sender<ListWorkersReply>),
    GetKnobs(oneshot::Sender<GetKnobsReply>),
    SetKnobs {
        req: SetKnobsRequest,
        peer: Option<String>,
        auth: Result<(), Unauthorized>,
        reply: oneshot::Sender<Result<SetKnobsReply, Unauthorized>>,
    },
    Control {
        action: ControlAction,
        who: String,
        peer: Option<String>,
        auth: Result<(), Unauthorized>,
        reply: oneshot::Sender<Result<ControlReply, Unauthorized>>,
    },
}

/// Timing and sizing, from the config.
#[derive(Debug, Clone)]
struct Settings {
    groups_per_step: u32,
    group_size: u32,
    lease_timeout_ms: i64,
    heartbeat_interval_ms: u32,
    dead_after_ms: i64,
    retry_after_ms: u32,
    max_per_acquire: u32,
    max_recommended_workers: u32,
}

/// A pending "applied" journal entry: request seq, step, and what seals it.
#[derive(Debug, Clone, Copy, PartialEq)]
struct PendingApply {
    seq: u64,
    step: u64,
    admission_only: bool,
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Everything the actor needs, prepared by `Coordinator::start`.
pub(crate) struct Actor {
    settings: Settings,
    tasks: Arc<TaskSet>,
    sched: Scheduler,
    registry: Registry,
    estimator: CapacityEstimator,
    schedule: KnobSchedule,
    schedule_rev: u64,
    kv: Arc<dyn KvBucket>,
    /// Asked whether the coordinator can hear the workers at all.
    bus: Arc<dyn Bus>,
    state_rev: Option<u64>,
    /// State writes since the last confirmed one whose outcome is unknown
    /// (the request timed out: it may have landed), and the current one.
    unconfirmed: Vec<Bytes>,
    persist_failed: bool,
    journal: Journal,
    pending_applied: Vec<PendingApply>,
    metrics: CoordinatorMetrics,
    health: Health,
    recommended: Option<f64>,
}

impl Actor {
    /// Loads the task set, the persisted state and the knobs.
    pub(crate) async fn prepare(
        config: &Config,
        bus: &Arc<dyn Bus>,
        metrics: CoordinatorMetrics,
        health: Health,
    ) -> Result<Self, CoordinatorError> {
        let c = &config.coordinator;
        let datasets = c.datasets.clone();
        let tasks = tokio::task::spawn_blocking(move || TaskSet::load(&datasets))
            .await
            .map_err(|e| CoordinatorError::Join(e.to_string()))??;
        let tasks = Arc::new(tasks);
        let settings = Settings {
            groups_per_step: config.staleness.groups_per_step,
            group_size: config.staleness.group_size,
            lease_timeout_ms: millis(c.lease_timeout),
            heartbeat_interval_ms: u32::try_from(c.heartbeat_interval.as_millis())
                .unwrap_or(u32::MAX),
            dead_after_ms: millis(c.dead_after),
            retry_after_ms: u32::try_from(c.retry_after.as_millis()).unwrap_or(u32::MAX),
            max_per_acquire: c.max_tasks_per_acquire,
            max_recommended_workers: c.max_recommended_workers,
        };
        let params = SchedulerParams {
            groups_per_step: settings.groups_per_step,
            group_size: settings.group_size,
            lease_timeout_ms: settings.lease_timeout_ms,
            completed_memory: c.completed_memory,
        };
        let kv = bus
            .kv(asyncrl_protos::subjects::CONTROL_BUCKET)
            .await
            .map_err(|e| CoordinatorError::transport("open the KV bucket asyncrl_control", e))?;
        let now = now_unix_ms();
        let (sched, state_rev) = match kv
            .get(STATE_KEY)
            .await
            .map_err(|e| CoordinatorError::transport("read coordinator.state", e))?
        {
            Some(entry) => {
                let state = CoordinatorState::decode(entry.value.as_ref())
                    .map_err(|e| CoordinatorError::StateDecode(e.to_string()))?;
                let s = Scheduler::from_proto(
                    params,
                    &state,
                    tasks.len() as u64,
                    tasks.fingerprint(),
                    now,
                )?;
                tracing::info!(
                    epoch = s.epoch(),
                    cursor = s.cursor(),
                    leases = s.running(),
                    requeued = s.queue_len(),
                    accepted = s.accepted(),
                    version = s.version(),
                    "coordinator state restored; restored leases get a fresh deadline"
                );
                (s, Some(entry.revision))
            }
            None => {
                let prefix = format!("{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff);
                tracing::info!(tasks = tasks.len(), lease_prefix = %prefix, "new coordinator state");
                (
                    Scheduler::new(params, tasks.len() as u64, tasks.fingerprint(), &prefix),
                    None,
                )
            }
        };
        let (schedule, schedule_rev) = load_or_create_schedule(kv.as_ref(), config).await?;
        let journal_path = c
            .journal_path
            .clone()
            .unwrap_or_else(|| config.run.output_dir.join("coordinator-journal.jsonl"));
        let journal = Journal::open(&journal_path).await?;
        let version = sched.version().max(0) as u64;
        let pending_applied = schedule
            .changes
            .iter()
            .filter(|ch| !journal.was_applied(ch.journal_seq) && ch.journal_seq > 0)
            .map(|ch| PendingApply {
                seq: ch.journal_seq,
                step: ch.from_step,
                admission_only: ch.knobs.as_ref().is_some_and(knobs::is_admission_only),
            })
            .filter(|p| p.step > version)
            .collect();
        Ok(Self {
            settings,
            tasks,
            sched,
            registry: Registry::new(),
            estimator: CapacityEstimator::new(),
            schedule,
            schedule_rev,
            kv,
            bus: bus.clone(),
            state_rev,
            unconfirmed: Vec::new(),
            persist_failed: false,
            journal,
            pending_applied,
            metrics,
            health,
            recommended: None,
        })
    }

    pub(crate) fn tick_interval(&self) -> Duration {
        let shortest = self
            .settings
            .lease_timeout_ms
            .min(self.settings.dead_after_ms)
            .min(i64::from(self.settings.heartbeat_interval_ms));
        Duration::from_millis((shortest / 4).clamp(20, 500) as u64)
    }

    /// The actor loop: ends on shutdown (after a last write of the state) or
    /// on a fatal error.
    pub(crate) async fn run(
        mut self,
        mut rx: mpsc::Receiver<Event>,
        shutdown: CancellationToken,
    ) -> Result<(), CoordinatorError> {
        let mut batch = Vec::with_capacity(256);
        self.update_metrics();
        loop {
            let n = tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                n = rx.recv_many(&mut batch, 256) => n,
            };
            if n == 0 {
                break;
            }
            let mut dirty = false;
            let mut deferred: Vec<(Request, Bytes, Option<Bytes>)> = Vec::new();
            let mut immediate: Vec<(Request, Bytes)> = Vec::new();
            for ev in batch.drain(..) {
                self.handle(ev, &mut dirty, &mut deferred, &mut immediate)
                    .await?;
            }
            if dirty || self.persist_failed {
                match self.persist().await {
                    Ok(()) => {
                        if self.persist_failed {
                            tracing::info!("coordinator state written again");
                            self.health.set_ready("coordinator");
                        }
                        self.persist_failed = false;
                        immediate.extend(deferred.into_iter().map(|(r, ok, _)| (r, ok)));
                    }
                    Err(PersistError::Fatal(e)) => {
                        self.health
                            .set_not_ready("coordinator", format!("stopped: {e}"));
                        for (r, _, err) in deferred {
                            if let Some(err) = err {
                                let _ = r.respond(err).await;
                            }
                        }
                        return Err(e);
                    }
                    Err(PersistError::Transient(e)) => {
                        tracing::warn!(error = %e, "cannot write the coordinator state; refusing requests that change it until it can");
                        self.health
                            .set_not_ready("coordinator", format!("cannot persist state: {e}"));
                        self.persist_failed = true;
                        // A request without an "unavailable" answer gets none:
                        // its requester times out and retries.
                        immediate.extend(
                            deferred
                                .into_iter()
                                .filter_map(|(r, _, err)| err.map(|e| (r, e))),
                        );
                    }
                }
            } else {
                immediate.extend(deferred.into_iter().map(|(r, ok, _)| (r, ok)));
            }
            futures::future::join_all(immediate.into_iter().map(|(r, payload)| async move {
                if let Err(e) = r.respond(payload).await {
                    tracing::debug!(error = %e, "could not send a reply");
                }
            }))
            .await;
            self.update_metrics();
        }
        if (self.persist_failed || self.state_rev.is_none())
            && let Err(e) = self.persist().await
        {
            tracing::warn!(error = ?e, "could not write the coordinator state at shutdown");
        }
        self.health.clear("coordinator");
        Ok(())
    }

    async fn handle(
        &mut self,
        ev: Event,
        dirty: &mut bool,
        deferred: &mut Vec<(Request, Bytes, Option<Bytes>)>,
        immediate: &mut Vec<(Request, Bytes)>,
    ) -> Result<(), CoordinatorError> {
        let now = now_unix_ms();
        match ev {
            Event::Request { kind, req } => {
                let (reply, changed, unavailable) = self.handle_request(kind, &req.payload, now);
                if changed {
                    *dirty = true;
                    deferred.push((req, reply, unavailable));
                } else {
                    immediate.push((req, reply));
                }
            }
            Event::Version(a) => {
                self.estimator
                    .on_announcement(a.version, a.published_at_unix_ms);
                let change = self.sched.on_version(a.version);
                *dirty |= self.on_version_change(change);
                self.check_applied().await;
            }
            Event::LearnerStatus(s) => {
                self.estimator.on_train_seconds(s.step_train_seconds);
                let before = (
                    self.sched.learner_session().to_owned(),
                    self.sched.version(),
                    self.sched.accepted(),
                );
                let change = self
                    .sched
                    .on_learner_session(&s.session_id, s.start_version);
                self.on_version_change(change);
                // A first session is adopted without a reset, and is
                // persisted all the same.
                *dirty |= before
                    != (
                        self.sched.learner_session().to_owned(),
                        self.sched.version(),
                        self.sched.accepted(),
                    );
            }
            Event::Knobs { schedule, revision } => {
                if revision > self.schedule_rev {
                    self.schedule = schedule;
                    self.schedule_rev = revision;
                    self.check_applied().await;
                }
            }
            Event::GroupDropped(g) => {
                CoordinatorMetrics::reason(&self.metrics.groups_dropped, g.kind().label());
                let stale = g.kind().is_stale();
                *dirty |= stale;
                let requeued = self.sched.on_group_dropped(&g.group_id, stale);
                // `asyncrl_stale_dropped_total` is shared with a buffer in the
                // same process (which counts before it reports): raise it to
                // the reported total, never count a drop twice.
                let (reported, counted) = (
                    self.sched.stale_dropped_total,
                    self.metrics.stale_dropped.get(),
                );
                if reported > counted {
                    self.metrics.stale_dropped.inc_by(reported - counted);
                }
                match requeued {
                    Some(task) => tracing::info!(
                        task_id = %g.task_id, group_id = %g.group_id, index = task.index, epoch = task.epoch,
                        "the buffer dropped a stale group; its capacity is returned and the task is issued again"
                    ),
                    None if stale => tracing::warn!(
                        task_id = %g.task_id, group_id = %g.group_id,
                        "the buffer dropped a stale group the coordinator does not remember (coordinator.completed_memory); counted only"
                    ),
                    None => {
                        tracing::debug!(task_id = %g.task_id, group_id = %g.group_id, reason = g.kind().label(), "group dropped")
                    }
                }
            }
            Event::Admin(cmd) => self.handle_admin(cmd).await,
            Event::Tick(sent) => {
                // A tick that waited in the queue behind a blocked actor
                // (a state write stalled by the server) would judge workers
                // by a silence it caused itself: the heartbeats that came
                // meanwhile are queued behind it. The next punctual tick
                // judges instead.
                let waited = sent.elapsed();
                if waited > (2 * self.tick_interval()).max(Duration::from_secs(1)) {
                    tracing::debug!(
                        waited_ms = waited.as_millis() as u64,
                        "late tick: no lease expiry or heartbeat sweep"
                    );
                    return Ok(());
                }
                let expired = self.sched.expire_due(now);
                for e in &expired {
                    tracing::info!(lease_id = %e.lease_id, worker = %e.lease.worker, index = e.lease.task.index, "lease expired; task re-queued at the front");
                }
                self.metrics.tasks_expired.inc_by(expired.len() as u64);
                *dirty |= !expired.is_empty();
                // While the coordinator itself is cut off it hears no one:
                // nobody is judged dead by that silence.
                let died = match self.bus.connected_since_unix_ms() {
                    Some(since) => {
                        self.registry
                            .sweep(now, self.settings.dead_after_ms, since)
                            .died
                    }
                    None => Vec::new(),
                };
                for w in died {
                    let ended = self.sched.expire_worker(&w, now);
                    tracing::warn!(worker = %w, leases = ended.len(), "worker missed its heartbeats: marked dead, its leases expire");
                    self.metrics.tasks_expired.inc_by(ended.len() as u64);
                    *dirty |= !ended.is_empty();
                }
                self.update_capacity_model();
            }
        }
        Ok(())
    }

    fn on_version_change(&mut self, change: VersionChange) -> bool {
        match change {
            VersionChange::Unchanged => false,
            VersionChange::Advanced { from, to } => {
                tracing::debug!(from, to, "learner version advanced");
                true
            }
            VersionChange::LearnerRestart {
                version,
                accepted_before,
                reset,
            } => {
                self.metrics.learner_restarts.inc();
                if reset {
                    tracing::warn!(
                        version,
                        accepted_before,
                        accepted = self.sched.accepted(),
                        "learner restart below the known version: accepted reset to v * B"
                    );
                } else {
                    tracing::info!(
                        version,
                        accepted = self.sched.accepted(),
                        "learner restart: versions carry on, accepted groups are still in the buffer"
                    );
                }
                true
            }
        }
    }

    fn eta_and_paused(&self) -> (u32, bool) {
        let k = knobs::effective(&self.schedule, self.current_step());
        (k.eta.unwrap_or(0), k.paused.unwrap_or(false))
    }

    fn current_step(&self) -> u64 {
        self.sched.version().max(0) as u64 + 1
    }

    /// Returns (reply, whether the persisted state changed, the reply to
    /// send instead if it cannot be persisted; None: no reply, so that the
    /// requester times out and retries).
    fn handle_request(
        &mut self,
        kind: RequestKind,
        payload: &[u8],
        now: i64,
    ) -> (Bytes, bool, Option<Bytes>) {
        let enc = |m: &dyn EncodeDyn| Bytes::from(m.encode_dyn());
        match kind {
            RequestKind::Register => {
                let reply = match RegisterWorker::decode(payload) {
                    Err(e) => RegisterWorkerReply {
                        accepted: false,
                        reason: format!("malformed RegisterWorker: {e}"),
                        heartbeat_interval_ms: self.settings.heartbeat_interval_ms,
                    },
                    Ok(r) if !valid_task_id(&r.worker_id) => RegisterWorkerReply {
                        accepted: false,
                        reason: format!(
                            "worker_id {:?} must be 1-128 characters of [A-Za-z0-9_-]",
                            r.worker_id
                        ),
                        heartbeat_interval_ms: self.settings.heartbeat_interval_ms,
                    },
                    Ok(r) => {
                        self.registry.register(
                            &r.worker_id,
                            &r.hostname,
                            r.capacity,
                            r.policy_version,
                            now,
                        );
                        tracing::info!(worker = %r.worker_id, hostname = %r.hostname, capacity = r.capacity, version = r.policy_version, "worker registered");
                        RegisterWorkerReply {
                            accepted: true,
                            reason: String::new(),
                            heartbeat_interval_ms: self.settings.heartbeat_interval_ms,
                        }
                    }
                };
                let b = enc(&reply);
                (b, false, None)
            }
            RequestKind::Heartbeat => {
                let reply = match WorkerHeartbeat::decode(payload) {
                    Err(e) => {
                        tracing::warn!(error = %e, "malformed heartbeat");
                        HeartbeatReply::default()
                    }
                    Ok(h) => {
                        let w = self.registry.touch(&h.worker_id, now);
                        w.policy_version = h.policy_version;
                        w.tokens_per_second = h.tokens_per_second;
                        w.draining = h.draining;
                        self.estimator.on_heartbeat(
                            &h.worker_id,
                            h.policy_version,
                            h.weight_swap_latency_ms,
                            now,
                        );
                        HeartbeatReply {
                            revoked_lease_ids: self.sched.heartbeat(
                                &h.worker_id,
                                &h.lease_ids,
                                now,
                            ),
                        }
                    }
                };
                let b = enc(&reply);
                (b, false, None)
            }
            RequestKind::Acquire => {
                let retry = self.settings.retry_after_ms;
                let deny = |reason: String| AcquireTasksReply {
                    tasks: Vec::new(),
                    reason,
                    retry_after_ms: retry,
                };
                let a = match AcquireTasks::decode(payload) {
                    Ok(a) => a,
                    Err(e) => {
                        let b = enc(&deny(format!("malformed AcquireTasks: {e}")));
                        return (b, false, None);
                    }
                };
                let (reply, label) = self.acquire(&a, now);
                if let Some(label) = label {
                    CoordinatorMetrics::reason(&self.metrics.acquire_denied, label);
                }
                let granted = !reply.tasks.is_empty();
                let unavailable = enc(&deny(
                    "the coordinator cannot write its state to the KV bucket; retry".into(),
                ));
                (enc(&reply), granted, Some(unavailable))
            }
            RequestKind::Complete => {
                let c = match CompleteTask::decode(payload) {
                    Ok(c) => c,
                    Err(e) => {
                        let b = enc(&CompleteTaskReply {
                            accepted: false,
                            reason: format!("malformed CompleteTask: {e}"),
                        });
                        return (b, false, None);
                    }
                };
                self.registry.touch(&c.worker_id, now);
                let index = crate::dataset::split_wire_task_id(&c.task_id)
                    .and_then(|(id, _)| self.tasks.index_of(id))
                    .map(|i| i as u64);
                match self
                    .sched
                    .complete(&c.worker_id, &c.lease_id, index, c.num_trajectories)
                {
                    Ok(Completion::Accepted { lease }) => {
                        self.metrics.tasks_completed.inc();
                        let secs = (now - lease.granted_at_ms).max(0) as f64 / 1000.0;
                        self.estimator.on_completion(&c.worker_id, secs);
                        tracing::debug!(worker = %c.worker_id, task_id = %c.task_id, lease_id = %c.lease_id, seconds = secs, "task complete");
                        let ok = enc(&CompleteTaskReply {
                            accepted: true,
                            reason: String::new(),
                        });
                        (ok, true, None)
                    }
                    Ok(Completion::AlreadyCompleted) => {
                        let b = enc(&CompleteTaskReply {
                            accepted: true,
                            reason: "already completed (a retry)".into(),
                        });
                        (b, false, None)
                    }
                    Err(refusal) => {
                        CoordinatorMetrics::reason(
                            &self.metrics.completions_refused,
                            refusal.label(),
                        );
                        tracing::info!(worker = %c.worker_id, task_id = %c.task_id, lease_id = %c.lease_id, reason = %refusal, "completion refused");
                        let b = enc(&CompleteTaskReply {
                            accepted: false,
                            reason: refusal.to_string(),
                        });
                        (b, false, None)
                    }
                }
            }
            RequestKind::Return => {
                let r = match ReturnTasks::decode(payload) {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::warn!(error = %e, "malformed ReturnTasks");
                        let b = enc(&ReturnTasksReply { returned: 0 });
                        return (b, false, None);
                    }
                };
                self.registry.touch(&r.worker_id, now);
                let ended = self.sched.return_leases(&r.worker_id, &r.lease_ids, now);
                self.metrics.tasks_returned.inc_by(ended.len() as u64);
                tracing::info!(worker = %r.worker_id, returned = ended.len(), asked = r.lease_ids.len(), reason = %r.reason, "tasks returned");
                let ok = enc(&ReturnTasksReply {
                    returned: ended.len() as u32,
                });
                (ok, !ended.is_empty(), None)
            }
        }
    }

    fn acquire(&mut self, a: &AcquireTasks, now: i64) -> (AcquireTasksReply, Option<&'static str>) {
        let retry = self.settings.retry_after_ms;
        let deny = |reason: String, label: &'static str| {
            (
                AcquireTasksReply {
                    tasks: Vec::new(),
                    reason,
                    retry_after_ms: retry,
                },
                Some(label),
            )
        };
        if !valid_task_id(&a.worker_id) {
            return deny(
                format!(
                    "worker_id {:?} must be 1-128 characters of [A-Za-z0-9_-]",
                    a.worker_id
                ),
                "bad_request",
            );
        }
        let worker = self.registry.touch(&a.worker_id, now);
        if worker.draining {
            return deny("the worker is draining".into(), "draining");
        }
        let (eta, paused) = self.eta_and_paused();
        if paused {
            return deny("admission is paused (asyncrl ctl resume)".into(), "paused");
        }
        let n = a.free_slots.min(self.settings.max_per_acquire);
        if n == 0 {
            return deny("no free slots".into(), "no_slots");
        }
        let grants = self.sched.acquire(&a.worker_id, n, eta, now);
        if grants.is_empty() {
            let b = u64::from(self.settings.groups_per_step);
            let v = self.sched.version().max(0) as u64;
            return deny(
                format!(
                    "staleness bound reached: accepted {} + running {} >= (eta {eta} + v {v} + 1) * B {b} = {}; waiting for the learner",
                    self.sched.accepted(),
                    self.sched.running(),
                    (u64::from(eta) + v + 1) * b
                ),
                "staleness_bound",
            );
        }
        self.metrics.tasks_admitted.inc_by(grants.len() as u64);
        let tasks = grants
            .into_iter()
            .filter_map(|g| {
                let item = self.tasks.get(g.task.index as usize)?;
                Some(Task {
                    task_id: crate::dataset::wire_task_id(&item.task_id, g.task.epoch),
                    lease_id: g.lease_id,
                    prompt: item.prompt.clone(),
                    answer: item.answer.clone(),
                    dataset: item.dataset.clone(),
                    group_size: self.settings.group_size,
                    lease_deadline_unix_ms: g.deadline_ms,
                    admission_version: g.admission_version,
                    epoch: g.task.epoch,
                })
            })
            .collect();
        (
            AcquireTasksReply {
                tasks,
                reason: String::new(),
                retry_after_ms: 0,
            },
            None,
        )
    }

    // ------------------------------------------------------------ persistence

    async fn persist(&mut self) -> Result<(), PersistError> {
        let bytes = Bytes::from(self.sched.to_proto().encode_to_vec());
        self.metrics.state_bytes.set(bytes.len() as i64);
        let started = Instant::now();
        let mut retried = false;
        if self.unconfirmed.last() != Some(&bytes) {
            self.unconfirmed.push(bytes.clone());
        }
        if self.unconfirmed.len() > MAX_UNCONFIRMED_WRITES {
            self.unconfirmed.remove(0);
        }
        loop {
            let result = match self.state_rev {
                None => self.kv.create(STATE_KEY, bytes.clone()).await,
                Some(rev) => self.kv.update(STATE_KEY, bytes.clone(), rev).await,
            };
            match result {
                Ok(rev) => {
                    self.state_rev = Some(rev);
                    self.unconfirmed.clear();
                    self.metrics
                        .state_persist_seconds
                        .observe(started.elapsed().as_secs_f64());
                    return Ok(());
                }
                Err(TransportError::RevisionMismatch { .. } | TransportError::KeyExists { .. })
                    if !retried =>
                {
                    // Our own earlier write may have landed although its
                    // reply was lost (also one of an earlier persist, of a
                    // state that has changed since): then the stored value
                    // is ours.
                    retried = true;
                    let stored = self.kv.get(STATE_KEY).await.map_err(|e| {
                        PersistError::Transient(CoordinatorError::transport(
                            "read coordinator.state",
                            e,
                        ))
                    })?;
                    match stored {
                        Some(e) if self.unconfirmed.contains(&e.value) => {
                            self.state_rev = Some(e.revision);
                        }
                        Some(e) => {
                            return Err(PersistError::Fatal(
                                CoordinatorError::AnotherCoordinator {
                                    revision: e.revision,
                                },
                            ));
                        }
                        None => self.state_rev = None,
                    }
                }
                Err(TransportError::RevisionMismatch { .. } | TransportError::KeyExists { .. }) => {
                    return Err(PersistError::Fatal(CoordinatorError::AnotherCoordinator {
                        revision: self.state_rev.unwrap_or(0),
                    }));
                }
                Err(e) => {
                    return Err(PersistError::Transient(CoordinatorError::transport(
                        "write coordinator.state",
                        e,
                    )));
                }
            }
        }
    }

    // ------------------------------------------------------------ knobs

    /// Journals "applied" for changes whose step has come.
    async fn check_applied(&mut self) {
        let sealed = self.schedule.sealed_through_step;
        let current = self.current_step();
        let (due, rest): (Vec<PendingApply>, Vec<PendingApply>) =
            self.pending_applied.drain(..).partition(|p| {
                if p.admission_only {
                    current >= p.step
                } else {
                    sealed >= p.step
                }
            });
        self.pending_applied = rest;
        for p in due {
            let mut e = entry("coordinator", "applied", "applied");
            e.ref_seq = Some(p.seq);
            e.effective_step = Some(p.step);
            e.reason = Some(if p.admission_only {
                format!("in effect for grants from learner step {}", p.step)
            } else {
                format!("sealed by the learner for step {}", p.step)
            });
            match self.journal.append(e).await {
                Ok(_) => tracing::info!(request = p.seq, step = p.step, "knob change applied"),
                Err(err) => tracing::error!(error = %err, "cannot journal an applied knob change"),
            }
        }
    }

    async fn journal_outcome(&mut self, mut e: crate::journal::JournalEntry) -> u64 {
        self.metrics
            .knob_requests
            .get_or_create(&OutcomeLabel {
                outcome: e.outcome.clone(),
            })
            .inc();
        e.unix_ms = now_unix_ms();
        match self.journal.append(e).await {
            Ok(seq) => seq,
            Err(err) => {
                tracing::error!(error = %err, "cannot append to the knob journal");
                0
            }
        }
    }

    /// Writes a modified schedule with compare-and-set; `edit` returns the
    /// step the change lands at, or a refusal. Retries on concurrent writes
    /// (the learner sealing a step).
    async fn edit_schedule(
        &mut self,
        mut edit: impl FnMut(&mut KnobSchedule, i32) -> Decision,
    ) -> Result<Decision, String> {
        for _ in 0..16 {
            let entry = match self.kv.get(KNOBS_KEY).await {
                Ok(Some(e)) => e,
                Ok(None) => return Err("the knob schedule is missing from the KV bucket".into()),
                Err(e) => return Err(format!("cannot read the knob schedule: {e}")),
            };
            let mut s = knobs::decode_schedule(&entry.value).map_err(|e| e.to_string())?;
            let decision = edit(&mut s, self.sched.version());
            if let Decision::Refused(_) = decision {
                self.schedule = s;
                self.schedule_rev = self.schedule_rev.max(entry.revision);
                return Ok(decision);
            }
            knobs::compact(&mut s, self.sched.version().max(0) as u64);
            match self
                .kv
                .update(KNOBS_KEY, knobs::encode_schedule(&s), entry.revision)
                .await
            {
                Ok(rev) => {
                    self.schedule = s;
                    self.schedule_rev = rev;
                    return Ok(decision);
                }
                Err(TransportError::RevisionMismatch { .. }) => continue,
                Err(e) => return Err(format!("cannot store the knob schedule: {e}")),
            }
        }
        Err("the knob schedule kept changing under compare-and-set".into())
    }

    async fn set_knobs(
        &mut self,
        action: &str,
        knobs_req: Knobs,
        apply_at_step: u64,
        who: &str,
        peer: Option<String>,
        auth: Result<(), Unauthorized>,
    ) -> Result<(bool, u64, String, u64), Unauthorized> {
        let mut e = entry(who, action, "refused");
        e.peer = peer;
        e.request = serde_json::json!({
            "knobs": knobs::knob_rows(&knobs_req).into_iter().collect::<std::collections::BTreeMap<_, _>>(),
            "apply_at_step": apply_at_step,
        });
        if let Err(Unauthorized(reason)) = auth {
            e.reason = Some(reason.clone());
            self.journal_outcome(e).await;
            tracing::warn!(who, action, reason = %reason, "admin request refused");
            return Err(Unauthorized(reason));
        }
        if let Err(err) = knobs::validate(&knobs_req) {
            let reason = err.to_string();
            e.reason = Some(reason.clone());
            let seq = self.journal_outcome(e).await;
            return Ok((false, 0, reason, seq));
        }
        let seq = self.journal.next_seq();
        let admission_only = knobs::is_admission_only(&knobs_req);
        let change = KnobChange {
            from_step: 0,
            knobs: Some(knobs_req),
            journal_seq: seq,
            requested_by: who.to_owned(),
        };
        let result = self
            .edit_schedule(|s, v| {
                let d = knobs::decide(s, v, apply_at_step, admission_only);
                if let Decision::At(n) = d {
                    knobs::insert_change(
                        s,
                        KnobChange {
                            from_step: n,
                            ..change.clone()
                        },
                    );
                }
                d
            })
            .await;
        let (accepted, step, reason) = match result {
            Ok(Decision::At(n)) => (true, n, String::new()),
            Ok(Decision::Refused(r)) => (false, 0, r),
            Err(r) => (false, 0, r),
        };
        e.outcome = if accepted { "accepted" } else { "refused" }.into();
        e.effective_step = accepted.then_some(step);
        e.reason = (!reason.is_empty()).then(|| reason.clone());
        let seq = self.journal_outcome(e).await;
        if accepted {
            tracing::info!(who, action, step, seq, knobs = ?knobs::knob_rows(&knobs_req), "knob change accepted");
            self.pending_applied.push(PendingApply {
                seq,
                step,
                admission_only,
            });
            self.check_applied().await;
        } else {
            tracing::info!(who, action, reason = %reason, "knob change refused");
        }
        Ok((accepted, step, reason, seq))
    }

    async fn checkpoint(
        &mut self,
        who: &str,
        peer: Option<String>,
        auth: Result<(), Unauthorized>,
    ) -> Result<ControlReply, Unauthorized> {
        let mut e = entry(who, "checkpoint", "refused");
        e.peer = peer;
        if let Err(Unauthorized(reason)) = auth {
            e.reason = Some(reason.clone());
            self.journal_outcome(e).await;
            return Err(Unauthorized(reason));
        }
        let result = self
            .edit_schedule(|s, v| {
                let d = knobs::decide(s, v, 0, false);
                if let Decision::At(n) = d
                    && !s.checkpoint_steps.contains(&n)
                {
                    s.checkpoint_steps.push(n);
                    s.checkpoint_steps.sort_unstable();
                }
                d
            })
            .await;
        let (accepted, step, reason) = match result {
            Ok(Decision::At(n)) => (true, n, String::new()),
            Ok(Decision::Refused(r)) | Err(r) => (false, 0, r),
        };
        e.outcome = if accepted { "accepted" } else { "refused" }.into();
        e.effective_step = accepted.then_some(step);
        e.reason = (!reason.is_empty()).then(|| reason.clone());
        let seq = self.journal_outcome(e).await;
        if accepted {
            self.pending_applied.push(PendingApply {
                seq,
                step,
                admission_only: false,
            });
            self.check_applied().await;
        }
        Ok(ControlReply {
            accepted,
            effective_step: step,
            reason,
            journal_seq: seq,
        })
    }

    async fn handle_admin(&mut self, cmd: AdminCommand) {
        match cmd {
            AdminCommand::Status(reply) => {
                let _ = reply.send(self.status());
            }
            AdminCommand::Workers(reply) => {
                let _ = reply.send(self.workers());
            }
            AdminCommand::GetKnobs(reply) => {
                let current = self.current_step();
                let _ = reply.send(GetKnobsReply {
                    knobs: Some(knobs::effective(&self.schedule, current)),
                    pending: self
                        .schedule
                        .changes
                        .iter()
                        .filter(|c| c.from_step > current)
                        .cloned()
                        .collect(),
                    current_step: current,
                    sealed_through_step: self.schedule.sealed_through_step,
                });
            }
            AdminCommand::SetKnobs {
                req,
                peer,
                auth,
                reply,
            } => {
                let who = if req.requested_by.is_empty() {
                    "anonymous".to_owned()
                } else {
                    req.requested_by.clone()
                };
                let r = self
                    .set_knobs(
                        "set_knobs",
                        req.knobs.unwrap_or_default(),
                        req.apply_at_step,
                        &who,
                        peer,
                        auth,
                    )
                    .await
                    .map(
                        |(accepted, effective_step, reason, journal_seq)| SetKnobsReply {
                            accepted,
                            effective_step,
                            reason,
                            journal_seq,
                        },
                    );
                let _ = reply.send(r);
            }
            AdminCommand::Control {
                action,
                who,
                peer,
                auth,
                reply,
            } => {
                let who = if who.is_empty() {
                    "anonymous".to_owned()
                } else {
                    who
                };
                let r = match action {
                    ControlAction::Checkpoint => self.checkpoint(&who, peer, auth).await,
                    ControlAction::Pause | ControlAction::Resume => self
                        .set_knobs(
                            action.name(),
                            Knobs {
                                paused: Some(action == ControlAction::Pause),
                                ..Default::default()
                            },
                            0,
                            &who,
                            peer,
                            auth,
                        )
                        .await
                        .map(
                            |(accepted, effective_step, reason, journal_seq)| ControlReply {
                                accepted,
                                effective_step,
                                reason,
                                journal_seq,
                            },
                        ),
                };
                let _ = reply.send(r);
            }
        }
    }

    // ------------------------------------------------------------ views

    fn status(&self) -> StatusReply {
        let (eta, paused) = self.eta_and_paused();
        StatusReply {
            policy_version: self.sched.version(),
            learner_step: self.sched.version().max(0) as u64,
            eta,
            groups_per_step: self.settings.groups_per_step,
            accepted_groups: self.sched.accepted(),
            running_groups: self.sched.running(),
            capacity_left: self.sched.capacity(eta),
            paused,
            live_workers: self.registry.alive_count() as u32,
            rollout_workers_recommended: self.recommended.unwrap_or(0.0),
            epoch: self.sched.epoch(),
            stale_dropped_total: self.sched.stale_dropped_total,
            cursor: self.sched.cursor(),
            dataset_size: self.sched.dataset_len(),
            requeued_tasks: self.sched.queue_len() as u64,
            sealed_through_step: self.schedule.sealed_through_step,
            dead_workers: self.registry.dead_count() as u32,
        }
    }

    fn workers(&self) -> ListWorkersReply {
        let mut leases: std::collections::HashMap<&str, u32> = std::collections::HashMap::new();
        for l in self.sched.leases() {
            *leases.entry(&l.worker).or_default() += 1;
        }
        ListWorkersReply {
            workers: self
                .registry
                .iter()
                .map(|w| WorkerInfo {
                    worker_id: w.worker_id.clone(),
                    hostname: w.hostname.clone(),
                    capacity: w.capacity,
                    policy_version: w.policy_version,
                    leases: leases.get(w.worker_id.as_str()).copied().unwrap_or(0),
                    last_heartbeat_unix_ms: w.last_heard_ms,
                    alive: w.alive,
                    draining: w.draining,
                    tokens_per_second: w.tokens_per_second,
                })
                .collect(),
        }
    }

    fn update_capacity_model(&mut self) {
        let views: Vec<WorkerView<'_>> = self
            .registry
            .iter()
            .map(|w| WorkerView {
                worker_id: &w.worker_id,
                capacity: w.capacity,
                alive: w.alive,
            })
            .collect();
        let inputs = self.estimator.inputs(
            views.into_iter(),
            self.settings.groups_per_step,
            self.settings.group_size,
            self.settings.max_recommended_workers,
        );
        self.recommended = recommended_workers(&inputs);
        let m = &self.metrics;
        // Until the model has its inputs, recommend what is there (at least 1).
        let fallback = self.registry.alive_count().max(1) as f64;
        m.rollout_workers_recommended
            .set(self.recommended.unwrap_or(fallback));
        m.worker_groups_per_second
            .set(if inputs.worker_groups_per_second.is_finite() {
                inputs.worker_groups_per_second
            } else {
                0.0
            });
        m.learner_step_seconds
            .set(if inputs.step_seconds.is_finite() {
                inputs.step_seconds
            } else {
                0.0
            });
        m.weight_dissemination_seconds
            .set(inputs.dissemination_seconds);
    }

    fn update_metrics(&self) {
        let m = &self.metrics;
        let (eta, _) = self.eta_and_paused();
        m.policy_version.set(i64::from(self.sched.version()));
        m.capacity_left.set(self.sched.capacity(eta));
        m.accepted_groups.set(self.sched.accepted() as i64);
        m.running_groups.set(self.sched.running() as i64);
        m.requeued_tasks.set(self.sched.queue_len() as i64);
        m.epoch.set(self.sched.epoch() as i64);
        let now = now_unix_ms();
        let (mut alive, mut dead, mut draining) = (0, 0, 0);
        for w in self.registry.iter() {
            m.worker_heartbeat_age
                .get_or_create(&WorkerLabel {
                    worker: w.worker_id.clone(),
                })
                .set((now - w.last_heard_ms).max(0) as f64 / 1000.0);
            match (w.alive, w.draining) {
                (false, _) => dead += 1,
                (true, true) => draining += 1,
                (true, false) => alive += 1,
            }
        }
        for (state, n) in [("alive", alive), ("dead", dead), ("draining", draining)] {
            m.workers
                .get_or_create(&StateLabel {
                    state: state.into(),
                })
                .set(n);
        }
        for (name, v) in knobs::knob_values(&knobs::effective(&self.schedule, self.current_step()))
        {
            m.knob
                .get_or_create(&KnobLabel { knob: name.into() })
                .set(v);
        }
    }
}

enum PersistError {
    Fatal(CoordinatorError),
    Transient(CoordinatorError),
}

impl std::fmt::Debug for PersistError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PersistError::Fatal(e) | PersistError::Transient(e) => write!(f, "{e}"),
        }
    }
}

/// Object-safe encoding of the reply messages.
trait EncodeDyn {
    fn encode_dyn(&self) -> Vec<u8>;
}

impl<M: Message> EncodeDyn for M {
    fn encode_dyn(&self) -> Vec<u8> {
        self.encode_to_vec()
    }
}

async fn load_or_create_schedule(
    kv: &dyn KvBucket,
    config: &Config,
) -> Result<(KnobSchedule, u64), CoordinatorError> {
    for _ in 0..4 {
        if let Some(e) = kv
            .get(KNOBS_KEY)
            .await
            .map_err(|e| CoordinatorError::transport("read the knob schedule", e))?
        {
            return Ok((knobs::decode_schedule(&e.value)?, e.revision));
        }
        let s = knobs::new_schedule(knobs::initial_knobs(config));
        match kv.create(KNOBS_KEY, knobs::encode_schedule(&s)).await {
            Ok(rev) => return Ok((s, rev)),
            Err(TransportError::KeyExists { .. }) => continue,
            Err(e) => return Err(CoordinatorError::transport("create the knob schedule", e)),
        }
    }
    Err(CoordinatorError::transport(
        "create the knob schedule",
        TransportError::KeyExists {
            key: KNOBS_KEY.into(),
        },
    ))
}

// ---------------------------------------------------------------- inputs

/// Forwards requests of one subject to the actor.
pub(crate) async fn spawn_request_forwarders(
    bus: &Arc<dyn Bus>,
    tx: &mpsc::Sender<Event>,
    shutdown: &CancellationToken,
) -> Result<Vec<tokio::task::JoinHandle<()>>, CoordinatorError> {
    let mut handles = Vec::new();
    for kind in [
        RequestKind::Register,
        RequestKind::Heartbeat,
        RequestKind::Acquire,
        RequestKind::Complete,
        RequestKind::Return,
    ] {
        let mut stream = bus
            .serve(kind.subject(), Some(QUEUE_GROUP))
            .await
            .map_err(|e| CoordinatorError::transport(kind.subject(), e))?;
        let tx = tx.clone();
        let shutdown = shutdown.clone();
        handles.push(tokio::spawn(async move {
            loop {
                let req = tokio::select! {
                    _ = shutdown.cancelled() => break,
                    r = stream.next() => r,
                };
                let Some(req) = req else {
                    tracing::warn!(subject = kind.subject(), "request subscription ended");
                    break;
                };
                if tx.send(Event::Request { kind, req }).await.is_err() {
                    break;
                }
            }
        }));
    }
    Ok(handles)
}

/// Watches a KV key for as long as the coordinator runs, re-watching after
/// an error or an end of the stream (a NATS reconnect).
pub(crate) fn spawn_watch(
    kv: Arc<dyn KvBucket>,
    key: &'static str,
    tx: mpsc::Sender<Event>,
    shutdown: CancellationToken,
    map: fn(Bytes, u64) -> Option<Event>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut backoff = Duration::from_millis(100);
        loop {
            let stream = tokio::select! {
                _ = shutdown.cancelled() => return,
                s = kv.watch(key) => s,
            };
            match stream {
                Ok(mut stream) => loop {
                    let ev = tokio::select! {
                        _ = shutdown.cancelled() => return,
                        ev = stream.next() => ev,
                    };
                    match ev {
                        Some(Ok(ev)) => {
                            backoff = Duration::from_millis(100);
                            let Some(value) = ev.value else { continue };
                            if let Some(event) = map(value, ev.revision)
                                && tx.send(event).await.is_err()
                            {
                                return;
                            }
                        }
                        Some(Err(e)) => {
                            tracing::warn!(key, error = %e, "KV watch failed; watching again");
                            break;
                        }
                        None => {
                            tracing::debug!(key, "KV watch ended; watching again");
                            break;
                        }
                    }
                },
                Err(e) => tracing::warn!(key, error = %e, "cannot watch KV key; retrying"),
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    })
}

pub(crate) fn map_version(value: Bytes, _rev: u64) -> Option<Event> {
    match WeightAnnouncement::decode(value.as_ref()) {
        Ok(a) => Some(Event::Version(a)),
        Err(e) => {
            tracing::warn!(key = POLICY_VERSION_KEY, error = %e, "policy.version does not decode as WeightAnnouncement");
            None
        }
    }
}

pub(crate) fn map_knobs(value: Bytes, revision: u64) -> Option<Event> {
    match knobs::decode_schedule(&value) {
        Ok(schedule) => Some(Event::Knobs { schedule, revision }),
        Err(e) => {
            tracing::warn!(key = KNOBS_KEY, error = %e, "the knob schedule does not decode");
            None
        }
    }
}

pub(crate) fn map_learner_status(value: Bytes, _rev: u64) -> Option<Event> {
    match LearnerStatus::decode(value.as_ref()) {
        Ok(s) => Some(Event::LearnerStatus(s)),
        Err(e) => {
            tracing::warn!(key = LEARNER_STATUS_KEY, error = %e, "learner.status does not decode");
            None
        }
    }
}

/// Forwards the buffer's dropped-group reports.
pub(crate) fn spawn_group_dropped(
    bus: Arc<dyn Bus>,
    tx: mpsc::Sender<Event>,
    shutdown: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let sub = tokio::select! {
                _ = shutdown.cancelled() => return,
                s = bus.subscribe(BUFFER_GROUP_DROPPED) => s,
            };
            match sub {
                Ok(mut sub) => loop {
                    let m = tokio::select! {
                        _ = shutdown.cancelled() => return,
                        m = sub.next() => m,
                    };
                    let Some(m) = m else { break };
                    match GroupDropped::decode(m.payload.as_ref()) {
                        Ok(g) => {
                            if tx.send(Event::GroupDropped(g)).await.is_err() {
                                return;
                            }
                        }
                        Err(e) => tracing::warn!(error = %e, "malformed GroupDropped"),
                    }
                },
                Err(e) => {
                    tracing::warn!(error = %e, "cannot subscribe to dropped-group reports; retrying")
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            }
        }
    })
}

/// Sends a tick to the actor periodically.
pub(crate) fn spawn_ticker(
    every: Duration,
    tx: mpsc::Sender<Event>,
    shutdown: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut interval = tokio::time::interval(every);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = interval.tick() => {}
            }
            if tx
                .send(Event::Tick(tokio::time::Instant::now()))
                .await
                .is_err()
            {
                return;
            }
        }
    })
}
