//! The actor: the coordinator's state, its preparation from the persisted
//! state and the knobs, and the event loop that handles events and writes
//! the state once for every change made while the previous write was in
//! flight (pipelined group commit) before sending the replies that depend
//! on it.

use std::sync::Arc;
use std::time::Duration;

use asyncrl_common::SharedClock;
use asyncrl_config::Config;
use asyncrl_protos::v1::{CoordinatorState, KnobSchedule};
use asyncrl_telemetry::Health;
use asyncrl_transport::{Bus, KvBucket, Request};
use bytes::Bytes;
use prost::Message;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::knob_admin::{StoredSchedule, load_or_create_schedule};
use super::persist::{PersistError, StateWrite};
use super::requests::Handled;
use super::{Event, RequestKind};
use crate::capacity::CapacityEstimator;
use crate::dataset::TaskSet;
use crate::journal::Journal;
use crate::knobs;
use crate::metrics::CoordinatorMetrics;
use crate::registry::Registry;
use crate::scheduler::{Scheduler, SchedulerParams, VersionChange};
use asyncrl_protos::subjects::COORDINATOR_STATE_KEY as STATE_KEY;

use crate::CoordinatorError;

/// Timing and sizing, from the config.
#[derive(Debug, Clone)]
pub(super) struct Settings {
    pub(super) groups_per_step: u32,
    pub(super) group_size: u32,
    pub(super) lease_timeout_ms: i64,
    pub(super) heartbeat_interval_ms: u32,
    pub(super) dead_after_ms: i64,
    pub(super) retry_after_ms: u32,
    pub(super) max_per_acquire: u32,
    pub(super) max_recommended_workers: u32,
}

/// A pending "applied" journal entry: the request's journal seq (None when
/// its outcome could not be journaled), the step, and what seals it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct PendingApply {
    pub(super) seq: Option<u64>,
    pub(super) step: u64,
    pub(super) admission_only: bool,
}

/// A reply that may go out with the batch.
struct Reply {
    req: Request,
    payload: Bytes,
}

/// The reply to a request that changed the persisted state: it goes out
/// only once the batch is written.
struct DurableReply {
    req: Request,
    reply: Bytes,
    /// What to answer if the state cannot be written; None: no answer, so
    /// that the requester times out and retries.
    if_unwritten: Option<Bytes>,
}

impl DurableReply {
    /// The state is written: the reply goes out.
    fn written(self) -> Reply {
        Reply {
            req: self.req,
            payload: self.reply,
        }
    }

    /// The state is not written: the answer for that, if there is one.
    fn unwritten(self) -> Option<Reply> {
        let payload = self.if_unwritten?;
        Some(Reply {
            req: self.req,
            payload,
        })
    }
}

/// What the events of one batch left to do.
#[derive(Default)]
struct BatchOutcome {
    /// The persisted state changed: write it before the durable replies.
    dirty: bool,
    durable: Vec<DurableReply>,
    ready: Vec<Reply>,
    /// Events were taken (a failed write is retried on the next events).
    events: bool,
}

/// A state write in flight and the replies that wait for it.
struct InFlight {
    write: StateWrite,
    durable: Vec<DurableReply>,
    ready: Vec<Reply>,
}

/// The outcome of the write in flight; never resolves when there is none.
async fn written(in_flight: &mut Option<InFlight>) -> Result<u64, PersistError> {
    match in_flight {
        Some(w) => (&mut w.write.done).await,
        None => std::future::pending().await,
    }
}

/// Sends replies, all at once.
async fn send_replies(replies: Vec<Reply>) {
    if replies.is_empty() {
        return;
    }
    futures::future::join_all(replies.into_iter().map(|r| async move {
        if let Err(e) = r.req.respond(r.payload).await {
            tracing::debug!(error = %e, "could not send a reply");
        }
    }))
    .await;
}

/// The learner as the persisted state records it; a learner-status event
/// that changes it is written.
#[derive(PartialEq)]
struct LearnerMark {
    session: String,
    version: i32,
    accepted: u64,
}

impl LearnerMark {
    fn of(sched: &Scheduler) -> Self {
        Self {
            session: sched.learner_session().to_owned(),
            version: sched.version(),
            accepted: sched.accepted(),
        }
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Everything the actor needs, prepared by `Coordinator::start`.
pub(crate) struct Actor {
    pub(super) settings: Settings,
    pub(super) tasks: Arc<TaskSet>,
    pub(super) sched: Scheduler,
    pub(super) registry: Registry,
    pub(super) estimator: CapacityEstimator,
    pub(super) schedule: KnobSchedule,
    pub(super) schedule_rev: u64,
    pub(super) kv: Arc<dyn KvBucket>,
    /// Asked whether the coordinator can hear the workers at all.
    pub(super) bus: Arc<dyn Bus>,
    pub(super) state_rev: Option<u64>,
    /// State writes since the last confirmed one whose outcome is unknown
    /// (the request timed out: it may have landed), and the current one.
    pub(super) unconfirmed: Vec<Bytes>,
    pub(super) persist_failed: bool,
    pub(super) journal: Journal,
    pub(super) pending_applied: Vec<PendingApply>,
    pub(super) metrics: CoordinatorMetrics,
    pub(super) health: Health,
    pub(super) recommended: Option<f64>,
    /// The only source of wall-clock time (lease deadlines, heartbeat
    /// silence, journal times): the system clock, or paused tokio time in
    /// tests.
    pub(super) clock: SharedClock,
}

impl Actor {
    /// Loads the task set, the persisted state and the knobs.
    pub(crate) async fn prepare(
        config: &Config,
        bus: &Arc<dyn Bus>,
        metrics: CoordinatorMetrics,
        health: Health,
        clock: SharedClock,
    ) -> Result<Self, CoordinatorError> {
        let c = &config.coordinator;
        let datasets = c.datasets.clone();
        // The model's tokenizer is read only when a data set limits its
        // prompt lengths.
        let model = config.model.clone();
        let needs_text = datasets.iter().any(|d| d.max_prompt_tokens.is_some());
        let tasks = tokio::task::spawn_blocking(move || {
            let text = if needs_text {
                Some(asyncrl_tasks::model_text(&model)?)
            } else {
                None
            };
            Ok::<_, CoordinatorError>(TaskSet::load(&datasets, text.as_ref())?)
        })
        .await
        .map_err(CoordinatorError::Join)??;
        for (name, kept, skipped) in tasks.summary() {
            tracing::info!(dataset = %name, tasks = kept, skipped_long = skipped, "data set loaded");
            let label = crate::metrics::DatasetLabel {
                dataset: name.clone(),
            };
            metrics
                .dataset_tasks
                .get_or_create(&label)
                .set(i64::try_from(*kept).unwrap_or(i64::MAX));
            metrics
                .dataset_long_prompts_skipped
                .get_or_create(&label)
                .set(i64::try_from(*skipped).unwrap_or(i64::MAX));
        }
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
        let now = clock.now_unix_ms();
        let (sched, state_rev) = match kv
            .get(STATE_KEY)
            .await
            .map_err(|e| CoordinatorError::transport("read coordinator.state", e))?
        {
            Some(entry) => {
                let state = CoordinatorState::decode(entry.value.as_ref())
                    .map_err(CoordinatorError::StateDecode)?;
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
        let StoredSchedule {
            schedule,
            revision: schedule_rev,
        } = load_or_create_schedule(kv.as_ref(), config).await?;
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
                seq: Some(ch.journal_seq),
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
            clock,
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
    ///
    /// Group commit, pipelined: while one state write is in flight the actor
    /// keeps taking events; the next write, started as soon as the one in
    /// flight is acked, covers every change made meanwhile. A reply goes out
    /// only once every change made before it was handled is written: a
    /// durable reply with the write that covers its change, any other reply
    /// once no write is in flight and nothing is left unwritten.
    pub(crate) async fn run(
        mut self,
        mut rx: mpsc::Receiver<Event>,
        shutdown: CancellationToken,
    ) -> Result<(), CoordinatorError> {
        let mut batch = Vec::with_capacity(256);
        let mut pending = BatchOutcome::default();
        let mut in_flight: Option<InFlight> = None;
        let mut sendable: Vec<Reply> = Vec::new();
        self.update_metrics();
        self.update_labelled_metrics();
        loop {
            if in_flight.is_none() {
                if pending.dirty || (self.persist_failed && pending.events) {
                    let outcome = std::mem::take(&mut pending);
                    in_flight = Some(InFlight {
                        write: self.begin_write(),
                        durable: outcome.durable,
                        ready: outcome.ready,
                    });
                } else {
                    sendable.append(&mut pending.ready);
                    pending.events = false;
                }
            }
            send_replies(std::mem::take(&mut sendable)).await;
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                outcome = written(&mut in_flight) => {
                    if let Some(done) = in_flight.take() {
                        sendable = self.end_batch_write(done, outcome).await?;
                    }
                }
                n = rx.recv_many(&mut batch, 256) => {
                    if n == 0 {
                        break;
                    }
                    for ev in batch.drain(..) {
                        self.handle(ev, &mut pending).await?;
                    }
                    pending.events = true;
                }
            }
            self.update_metrics();
        }
        // What was taken is written and answered before the actor ends.
        if let Some(mut done) = in_flight.take() {
            let outcome = (&mut done.write.done).await;
            send_replies(self.end_batch_write(done, outcome).await?).await;
        }
        if pending.dirty || self.persist_failed || self.state_rev.is_none() {
            let mut write = self.begin_write();
            let outcome = (&mut write.done).await;
            let done = InFlight {
                write,
                durable: pending.durable,
                ready: pending.ready,
            };
            match self.end_batch_write(done, outcome).await {
                Ok(replies) => send_replies(replies).await,
                Err(e) => {
                    tracing::warn!(error = %e, "could not write the coordinator state at shutdown")
                }
            }
        } else {
            send_replies(pending.ready).await;
        }
        self.health.clear("coordinator");
        Ok(())
    }

    /// Applies a finished write; returns the replies that may go out now.
    /// A second coordinator stops this one (after the "unavailable"
    /// answers of the write's requests).
    async fn end_batch_write(
        &mut self,
        done: InFlight,
        outcome: Result<u64, PersistError>,
    ) -> Result<Vec<Reply>, CoordinatorError> {
        let InFlight {
            write,
            durable,
            mut ready,
        } = done;
        match self.end_write(&write, outcome) {
            Ok(()) => {
                if self.persist_failed {
                    tracing::info!("coordinator state written again");
                    self.health.set_ready("coordinator");
                }
                self.persist_failed = false;
                ready.extend(durable.into_iter().map(DurableReply::written));
            }
            Err(PersistError::Fatal(e)) => {
                self.health
                    .set_not_ready("coordinator", format!("stopped: {e}"));
                send_replies(
                    durable
                        .into_iter()
                        .filter_map(DurableReply::unwritten)
                        .collect(),
                )
                .await;
                return Err(e);
            }
            Err(PersistError::Transient(e)) => {
                tracing::warn!(error = %e, "cannot write the coordinator state; refusing requests that change it until it can");
                self.health
                    .set_not_ready("coordinator", format!("cannot persist state: {e}"));
                self.persist_failed = true;
                // A request without an "unavailable" answer gets none:
                // its requester times out and retries.
                ready.extend(durable.into_iter().filter_map(DurableReply::unwritten));
            }
        }
        Ok(ready)
    }

    async fn handle(&mut self, ev: Event, out: &mut BatchOutcome) -> Result<(), CoordinatorError> {
        let labelled = !matches!(
            ev,
            Event::Request {
                kind: RequestKind::Acquire
                    | RequestKind::Complete
                    | RequestKind::Return
                    | RequestKind::Heartbeat,
                ..
            }
        );
        self.handle_event(ev, out).await?;
        if labelled {
            self.update_labelled_metrics();
        }
        Ok(())
    }

    async fn handle_event(
        &mut self,
        ev: Event,
        out: &mut BatchOutcome,
    ) -> Result<(), CoordinatorError> {
        let dirty = &mut out.dirty;
        let now = self.clock.now_unix_ms();
        match ev {
            Event::Request { kind, req } => match self.handle_request(kind, &req.payload, now) {
                Handled::Reply(payload) => out.ready.push(Reply { req, payload }),
                Handled::Durable {
                    reply,
                    if_unwritten,
                } => {
                    *dirty = true;
                    out.durable.push(DurableReply {
                        req,
                        reply,
                        if_unwritten,
                    });
                }
            },
            Event::Version(a) => {
                self.estimator
                    .on_announcement(a.version, a.published_at_unix_ms);
                let change = self.sched.on_version(a.version);
                *dirty |= self.on_version_change(change);
                self.check_applied().await;
            }
            Event::LearnerStatus(s) => {
                self.estimator.on_train_seconds(s.step_train_seconds);
                let before = LearnerMark::of(&self.sched);
                let change = self
                    .sched
                    .on_learner_session(&s.session_id, s.start_version);
                self.on_version_change(change);
                // A first session is adopted without a reset, and is
                // persisted all the same.
                *dirty |= before != LearnerMark::of(&self.sched);
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

    pub(super) fn on_version_change(&mut self, change: VersionChange) -> bool {
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
}
