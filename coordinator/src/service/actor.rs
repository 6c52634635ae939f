//! The actor: the coordinator's state, composed of owned sub-states (the
//! scheduler, the workers, the knob administration, the persisted state),
//! its preparation, and the event loop that handles events and writes the
//! state once for every change made while the previous write was in flight
//! (pipelined group commit) before sending the replies that depend on it.

use std::sync::Arc;
use std::time::Duration;

use asyncrl_common::SharedClock;
use asyncrl_config::Config;
use asyncrl_protos::subjects::{TASKS_AVAILABLE, subject_worker};
use asyncrl_protos::v1::StatusReply;
use asyncrl_telemetry::Health;
use asyncrl_transport::Bus;
use bytes::Bytes;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::batch::{BatchOutcome, DurableReply, InFlight, Reply, ack_later, send_replies, written};
use super::events::{AdminCommand, Event, RequestKind};
use super::fleet::Fleet;
use super::knob_admin::{Admission, KnobAdmin};
use super::persist::{PersistError, StateStore};
use super::requests::{Handled, WorkerRequests};
use super::settings::Settings;
use crate::dataset::TaskSet;
use crate::error::CoordinatorError;
use crate::metrics::CoordinatorMetrics;
use crate::scheduler::{DropKind, Dropped, Scheduler, VersionChange};

/// Admission at one moment: the policy version, the tasks that may still
/// be admitted at it, and whether admission is paused.
#[derive(Clone, Copy)]
struct Room {
    version: i32,
    capacity: i64,
    paused: bool,
}

impl Room {
    /// Whether tasks may be admitted now that could not be `before`, at the
    /// same version.
    fn came_back_since(self, before: Room) -> bool {
        self.version == before.version
            && !self.paused
            && self.capacity > 0
            && (before.paused || self.capacity > before.capacity)
    }
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

/// Everything the actor needs, prepared by `Coordinator::start`.
pub(crate) struct Actor {
    settings: Settings,
    tasks: Arc<TaskSet>,
    /// Admission and leases: the pure scheduler, whose state is persisted.
    sched: Scheduler,
    /// The workers: the registry and the capacity model.
    fleet: Fleet,
    /// The knob schedule and the journal.
    knobs: KnobAdmin,
    /// The persisted state's key in the KV bucket.
    store: StateStore,
    /// Asked whether the coordinator can hear the workers at all.
    bus: Arc<dyn Bus>,
    metrics: CoordinatorMetrics,
    health: Health,
    /// The highest closed epoch of the state last written, for the
    /// publisher of `coordinator.closed_epoch` (`spawn_epochs_closed`).
    closed_epoch: tokio::sync::watch::Sender<Option<u64>>,
    /// The only source of wall-clock time (lease deadlines, heartbeat
    /// silence, journal times): the system clock, or paused tokio time in
    /// tests.
    clock: SharedClock,
}

/// Loads the task sets (reading the model's tokenizer only when a data set
/// limits its prompt lengths) and counts them in the metrics.
async fn load_tasks(
    config: &Config,
    metrics: &CoordinatorMetrics,
) -> Result<TaskSet, CoordinatorError> {
    let datasets = config.coordinator.datasets.clone();
    let model = config.model.clone();
    // Every prompt is measured: one that leaves no room for a completion
    // in the model's context could never be answered (a worker would
    // return it for ever).
    let tasks = tokio::task::spawn_blocking(move || {
        let text = asyncrl_tasks::model_text(&model)?;
        Ok::<_, CoordinatorError>(TaskSet::load_within(
            &datasets,
            Some(&text),
            Some(model.max_seq_len),
        )?)
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
    Ok(tasks)
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
        let tasks = Arc::new(load_tasks(config, &metrics).await?);
        let settings = Settings::from_config(config);
        let kv = bus
            .kv(asyncrl_protos::subjects::CONTROL_BUCKET)
            .await
            .map_err(|e| CoordinatorError::transport("open the KV bucket asyncrl_control", e))?;
        let (store, sched) = StateStore::load(
            kv.clone(),
            settings.scheduler_params(),
            &tasks,
            clock.now_unix_ms(),
            metrics.clone(),
        )
        .await?;
        let knobs =
            KnobAdmin::load(kv, config, sched.version(), metrics.clone(), clock.clone()).await?;
        // The loaded state is the stored one.
        let closed_epoch = tokio::sync::watch::Sender::new(sched.closed_epoch());
        Ok(Self {
            closed_epoch,
            settings,
            tasks,
            sched,
            fleet: Fleet::new(metrics.clone()),
            knobs,
            store,
            bus: bus.clone(),
            metrics,
            health,
            clock,
        })
    }

    /// Publishes [`TASKS_AVAILABLE`]: a hint, so a failure is only logged
    /// (the refused workers ask again after `retry_after`).
    async fn wake_refused_workers(&self) {
        if let Err(e) = self.bus.publish(TASKS_AVAILABLE, Bytes::new()).await {
            tracing::debug!(error = %e, subject = TASKS_AVAILABLE, "cannot publish the tasks-available hint; refused workers ask again after retry_after");
        }
    }

    /// Where admission stands now.
    fn room(&self) -> Room {
        let version = self.sched.version();
        let Admission { eta, paused } = self.knobs.admission(version);
        Room {
            version,
            capacity: self.sched.capacity(eta),
            paused,
        }
    }

    /// The highest closed epoch of the stored state, as it changes.
    pub(crate) fn closed_epochs(&self) -> tokio::sync::watch::Receiver<Option<u64>> {
        self.closed_epoch.subscribe()
    }

    pub(crate) fn tick_interval(&self) -> Duration {
        self.settings.tick_interval()
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
                if pending.dirty || (self.store.failed() && pending.events) {
                    let outcome = std::mem::take(&mut pending);
                    in_flight = Some(InFlight {
                        write: self.store.begin_write(&self.sched),
                        durable: outcome.durable,
                        ready: outcome.ready,
                        acks: outcome.acks,
                    });
                } else {
                    sendable.append(&mut pending.ready);
                    pending.events = false;
                    // Nothing is unwritten: what the reports did is stored.
                    if !self.store.failed() {
                        ack_later(std::mem::take(&mut pending.acks));
                    }
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
        if pending.dirty || self.store.failed() || self.store.nothing_stored() {
            let mut write = self.store.begin_write(&self.sched);
            let outcome = (&mut write.done).await;
            let done = InFlight {
                write,
                durable: pending.durable,
                ready: pending.ready,
                acks: pending.acks,
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
            acks,
        } = done;
        // Reports whose effect is not written are not acked: each is
        // delivered again and applied then.
        match self.store.end_write(&write, outcome) {
            Ok(recovered) => {
                ack_later(acks);
                // Published only once the state that closes it is stored.
                self.closed_epoch.send_if_modified(|e| {
                    let rise = write.closed_epoch > *e;
                    if rise {
                        *e = write.closed_epoch;
                    }
                    rise
                });
                if recovered {
                    tracing::info!("coordinator state written again");
                    self.health.set_ready("coordinator");
                }
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
        let before = self.room();
        self.handle_event(ev, out).await?;
        // Capacity came back without a new version (a dropped group, an
        // expired, dead or returned lease, a completion that a drop report
        // overtook, a knob change): a worker whose acquire was refused asks
        // again now, not after retry_after (with η = 0 each refill of a
        // no-signal drop would wait it out). A new version needs no hint:
        // workers ask again when they swap in its weights.
        if self.room().came_back_since(before) {
            self.wake_refused_workers().await;
        }
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
            Event::Request { kind, req } => match self.requests().handle(
                kind,
                subject_worker(&req.subject, kind.subject()),
                &req.payload,
                now,
            ) {
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
                self.fleet
                    .estimator
                    .on_announcement(a.version, a.published_at_unix_ms);
                let change = self.sched.on_version(a.version);
                *dirty |= self.on_version_change(change);
                self.knobs.check_applied(self.sched.version()).await;
            }
            Event::LearnerStatus(s) => {
                self.fleet.estimator.on_train_seconds(s.step_train_seconds);
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
                self.knobs
                    .on_stored(schedule, revision, self.sched.version())
                    .await;
            }
            Event::GroupDropped {
                report: g,
                delivery,
            } => {
                let kind = DropKind::of(g.kind());
                *dirty |= kind != DropKind::Ignored;
                let outcome = self.sched.on_group_dropped(&g.group_id, kind);
                // A report delivered again is counted once (unless this
                // process had not counted it: its effect was lost with a
                // coordinator that stopped before writing it).
                if delivery.delivered == 1
                    || matches!(
                        outcome,
                        Dropped::Requeued(_) | Dropped::Quarantined(_) | Dropped::Freed(_)
                    )
                {
                    CoordinatorMetrics::reason(&self.metrics.groups_dropped, g.kind().label());
                }
                // The report leaves the stream once its effect is written; a
                // report that overtook its completion stays (unacked, it is
                // delivered again) until the completion has been counted, so
                // that a restart in between still issues the task again.
                if outcome != Dropped::BeforeCompletion {
                    out.acks.push(delivery);
                }
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
                match outcome {
                    Dropped::Requeued(task) => tracing::info!(
                        task_id = %g.task_id, group_id = %g.group_id, index = task.index, epoch = task.epoch, reason = g.kind().label(),
                        "the buffer dropped a group it never trained on; its capacity is returned and the task is issued again"
                    ),
                    Dropped::Quarantined(task) => {
                        self.metrics.quarantined("refused");
                        tracing::warn!(
                            task_id = %g.task_id, group_id = %g.group_id, index = task.index, epoch = task.epoch,
                            attempts = self.sched.params().max_task_attempts,
                            "a task failed too often (the learner refused its groups) and is quarantined: it is not issued again (coordinator.max_task_attempts)"
                        );
                    }
                    Dropped::Freed(task) => tracing::info!(
                        task_id = %g.task_id, group_id = %g.group_id, index = task.index, epoch = task.epoch, reason = g.kind().label(),
                        "the buffer dropped a group without reward signal (dynamic sampling); its capacity is returned, the task is done for this epoch"
                    ),
                    Dropped::BeforeCompletion => tracing::info!(
                        task_id = %g.task_id, group_id = %g.group_id, reason = g.kind().label(),
                        "the buffer dropped a group before its completion arrived; the completion will not be counted (and the task is issued again, unless the drop was for no signal)"
                    ),
                    Dropped::AlreadyDropped => tracing::debug!(
                        task_id = %g.task_id, group_id = %g.group_id, reason = g.kind().label(),
                        "a drop report delivered again; it was acted on when the completion came"
                    ),
                    Dropped::Unknown => tracing::warn!(
                        task_id = %g.task_id, group_id = %g.group_id, reason = g.kind().label(),
                        "the buffer dropped a group the coordinator does not remember (coordinator.completed_memory); counted only"
                    ),
                    Dropped::Ignored => {
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
                    Some(since) => self.fleet.sweep(now, self.settings.dead_after_ms, since),
                    None => Vec::new(),
                };
                for w in died {
                    let ended = self.sched.expire_worker(&w, now);
                    tracing::warn!(worker = %w, leases = ended.len(), "worker missed its heartbeats: marked dead, its leases expire");
                    self.metrics.tasks_expired.inc_by(ended.len() as u64);
                    *dirty |= !ended.is_empty();
                }
                self.fleet.update_capacity_model(&self.settings);
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

    /// The sub-states a worker request reads and changes.
    fn requests(&mut self) -> WorkerRequests<'_> {
        WorkerRequests {
            settings: &self.settings,
            tasks: &self.tasks,
            sched: &mut self.sched,
            fleet: &mut self.fleet,
            knobs: &self.knobs,
            metrics: &self.metrics,
            max_reply_bytes: self.bus.max_payload(),
        }
    }

    async fn handle_admin(&mut self, cmd: AdminCommand) {
        let version = self.sched.version();
        match cmd {
            AdminCommand::Status(reply) => {
                let _ = reply.send(self.status());
            }
            AdminCommand::Workers(reply) => {
                let _ = reply.send(self.fleet.workers(&self.sched));
            }
            AdminCommand::GetKnobs(reply) => {
                let _ = reply.send(self.knobs.view(version));
            }
            AdminCommand::SetKnobs {
                req,
                peer,
                auth,
                reply,
            } => {
                let r = self.knobs.set_knobs_request(req, peer, auth, version).await;
                let _ = reply.send(r);
            }
            AdminCommand::Control {
                action,
                who,
                peer,
                auth,
                reply,
            } => {
                let r = self.knobs.control(action, who, peer, auth, version).await;
                let _ = reply.send(r);
            }
        }
    }

    fn status(&self) -> StatusReply {
        let Admission { eta, paused } = self.knobs.admission(self.sched.version());
        StatusReply {
            policy_version: self.sched.version(),
            learner_step: self.sched.version().max(0) as u64,
            eta,
            groups_per_step: self.settings.groups_per_step,
            accepted_groups: self.sched.accepted(),
            running_groups: self.sched.running(),
            capacity_left: self.sched.capacity(eta),
            paused,
            live_workers: self.fleet.registry.alive_count() as u32,
            rollout_workers_recommended: self.fleet.recommended().unwrap_or(0.0),
            epoch: self.sched.epoch(),
            stale_dropped_total: self.sched.stale_dropped_total,
            cursor: self.sched.cursor(),
            dataset_size: self.sched.dataset_len(),
            requeued_tasks: self.sched.queue_len() as u64,
            sealed_through_step: self.knobs.sealed_through_step(),
            dead_workers: self.fleet.registry.dead_count() as u32,
        }
    }

    /// The gauges of the scheduler's counts: after every batch of events.
    fn update_metrics(&self) {
        let m = &self.metrics;
        let eta = self.knobs.admission(self.sched.version()).eta;
        m.policy_version.set(i64::from(self.sched.version()));
        m.capacity_left.set(self.sched.capacity(eta));
        m.tasks_quarantined_now
            .set(i64::try_from(self.sched.quarantined().len()).unwrap_or(i64::MAX));
        m.accepted_groups.set(self.sched.accepted() as i64);
        m.running_groups.set(self.sched.running() as i64);
        m.requeued_tasks.set(self.sched.queue_len() as i64);
        m.epoch.set(self.sched.epoch() as i64);
    }

    /// The gauges per worker and per knob (a labelled series each): at
    /// start, on every tick and after the events that change them other
    /// than heartbeats, not per request.
    fn update_labelled_metrics(&self) {
        self.fleet.update_metrics(self.clock.now_unix_ms());
        self.knobs.update_metrics(self.sched.version());
    }
}
