//! Worker requests — register, heartbeat, acquire, complete, return — turned
//! into replies, with what each did to the persisted state. A request
//! touches several of the actor's sub-states: [`WorkerRequests`] borrows
//! them for one request.

use asyncrl_protos::v1::{
    AcquireTasks, AcquireTasksReply, ChatMessage, CompleteTask, CompleteTaskReply, HeartbeatReply,
    RegisterWorker, RegisterWorkerReply, ReturnTasks, ReturnTasksReply, Task, WorkerHeartbeat,
};
use bytes::Bytes;
use prost::Message;

use super::events::RequestKind;
use super::fleet::Fleet;
use super::knob_admin::{Admission, KnobAdmin};
use super::settings::Settings;
use crate::dataset::TaskSet;
use crate::metrics::{BadRequestLabel, CoordinatorMetrics};
use crate::scheduler::{Completion, DropKind, Scheduler};
use asyncrl_tasks::{Prompt, valid_task_id};

/// Object-safe encoding of the reply messages.
trait EncodeDyn {
    fn encode_dyn(&self) -> Vec<u8>;
}

impl<M: Message> EncodeDyn for M {
    fn encode_dyn(&self) -> Vec<u8> {
        self.encode_to_vec()
    }
}

/// What handling a request did, and so when its reply may go out.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Handled {
    /// The persisted state is unchanged: the reply goes out with the batch.
    Reply(Bytes),
    /// The request changed the persisted state: its reply goes out only
    /// once the batch is written (group commit).
    Durable {
        reply: Bytes,
        /// What to answer instead if the state cannot be written; None: no
        /// answer, so that the requester times out and retries.
        if_unwritten: Option<Bytes>,
    },
}

/// What an acquire came to: tasks, or why there are none.
enum Acquired {
    Granted(Vec<Task>),
    Denied {
        reason: String,
        /// The `reason` label of `asyncrl_acquire_denied_total`.
        label: &'static str,
    },
}

/// What a worker request reads and changes: the scheduler (admission and
/// leases), the workers, the knobs in effect, borrowed from the actor.
pub(super) struct WorkerRequests<'a> {
    pub(super) settings: &'a Settings,
    pub(super) tasks: &'a TaskSet,
    pub(super) sched: &'a mut Scheduler,
    pub(super) fleet: &'a mut Fleet,
    pub(super) knobs: &'a KnobAdmin,
    pub(super) metrics: &'a CoordinatorMetrics,
    /// The server's `max_payload`: a grant reply is kept below it.
    pub(super) max_reply_bytes: Option<usize>,
}

impl WorkerRequests<'_> {
    /// Handles one worker request. `named` is the worker its subject names
    /// (`<subject>.<worker id>`, the only subjects a worker's NATS user may
    /// publish): a request whose `worker_id` is another is refused before
    /// it touches anything (docs/decisions.md, "Worker identity is the
    /// request subject").
    pub(super) fn handle(
        &mut self,
        kind: RequestKind,
        named: Option<&str>,
        payload: &[u8],
        now: i64,
    ) -> Handled {
        let enc = |m: &dyn EncodeDyn| Bytes::from(m.encode_dyn());
        if let Some(named) = named
            && let Some(claimed) = claimed_worker(kind, payload)
            && claimed != named
        {
            let reason = self.bad_request(
                kind,
                "identity",
                format!(
                    "{} is not the worker {named:?} of the request's subject: a worker acts in its own name only",
                    shown_worker_id(&claimed)
                ),
            );
            let reply = match kind {
                RequestKind::Register => enc(&RegisterWorkerReply {
                    accepted: false,
                    reason,
                    heartbeat_interval_ms: self.settings.heartbeat_interval_ms,
                }),
                RequestKind::Heartbeat => enc(&HeartbeatReply::default()),
                RequestKind::Acquire => enc(&AcquireTasksReply {
                    tasks: Vec::new(),
                    reason,
                    retry_after_ms: self.settings.retry_after_ms,
                }),
                RequestKind::Complete => enc(&CompleteTaskReply {
                    accepted: false,
                    reason,
                }),
                RequestKind::Return => enc(&ReturnTasksReply { returned: 0 }),
            };
            return Handled::Reply(reply);
        }
        match kind {
            RequestKind::Register => {
                let reply = match RegisterWorker::decode(payload) {
                    Err(e) => RegisterWorkerReply {
                        accepted: false,
                        reason: self.bad_request(
                            kind,
                            "malformed",
                            format!("malformed RegisterWorker: {e}"),
                        ),
                        heartbeat_interval_ms: self.settings.heartbeat_interval_ms,
                    },
                    Ok(r) if !valid_task_id(&r.worker_id) => RegisterWorkerReply {
                        accepted: false,
                        reason: self.bad_request(kind, "worker_id", bad_worker_id(&r.worker_id)),
                        heartbeat_interval_ms: self.settings.heartbeat_interval_ms,
                    },
                    Ok(r) => {
                        self.fleet.registry.register(
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
                Handled::Reply(enc(&reply))
            }
            RequestKind::Heartbeat => {
                // HeartbeatReply has no reason field: a refused heartbeat is
                // logged and counted, and touches no worker.
                let reply = match WorkerHeartbeat::decode(payload) {
                    Err(e) => {
                        self.bad_request(
                            kind,
                            "malformed",
                            format!("malformed WorkerHeartbeat: {e}"),
                        );
                        HeartbeatReply::default()
                    }
                    Ok(h) if !valid_task_id(&h.worker_id) => {
                        self.bad_request(kind, "worker_id", bad_worker_id(&h.worker_id));
                        HeartbeatReply::default()
                    }
                    Ok(h) if !(h.tokens_per_second.is_finite() && h.tokens_per_second >= 0.0) => {
                        self.bad_request(
                            kind,
                            "tokens_per_second",
                            format!(
                                "tokens_per_second {} of worker {} is not a rate",
                                h.tokens_per_second, h.worker_id
                            ),
                        );
                        HeartbeatReply::default()
                    }
                    Ok(h)
                        if !(h.weight_swap_latency_ms.is_finite()
                            && h.weight_swap_latency_ms >= 0.0) =>
                    {
                        self.bad_request(
                            kind,
                            "weight_swap_latency_ms",
                            format!(
                                "weight_swap_latency_ms {} of worker {} is not a duration",
                                h.weight_swap_latency_ms, h.worker_id
                            ),
                        );
                        HeartbeatReply::default()
                    }
                    Ok(h) => {
                        let w = self.fleet.registry.touch(&h.worker_id, now);
                        w.policy_version = h.policy_version;
                        w.tokens_per_second = h.tokens_per_second;
                        w.draining = h.draining;
                        self.fleet.estimator.on_heartbeat(
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
                Handled::Reply(enc(&reply))
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
                        let reason = self.bad_request(
                            kind,
                            "malformed",
                            format!("malformed AcquireTasks: {e}"),
                        );
                        return Handled::Reply(enc(&deny(reason)));
                    }
                };
                match self.acquire(&a, now) {
                    Acquired::Granted(tasks) if !tasks.is_empty() => Handled::Durable {
                        reply: enc(&AcquireTasksReply {
                            tasks,
                            reason: String::new(),
                            retry_after_ms: 0,
                        }),
                        if_unwritten: Some(enc(&deny(
                            "the coordinator cannot write its state to the KV bucket; retry".into(),
                        ))),
                    },
                    Acquired::Granted(tasks) => Handled::Reply(enc(&AcquireTasksReply {
                        tasks,
                        reason: String::new(),
                        retry_after_ms: 0,
                    })),
                    Acquired::Denied { reason, label } => {
                        CoordinatorMetrics::reason(&self.metrics.acquire_denied, label);
                        Handled::Reply(enc(&deny(reason)))
                    }
                }
            }
            RequestKind::Complete => {
                let c = match CompleteTask::decode(payload) {
                    Ok(c) => c,
                    Err(e) => {
                        let b = enc(&CompleteTaskReply {
                            accepted: false,
                            reason: self.bad_request(
                                kind,
                                "malformed",
                                format!("malformed CompleteTask: {e}"),
                            ),
                        });
                        return Handled::Reply(b);
                    }
                };
                if !valid_task_id(&c.worker_id) {
                    let b = enc(&CompleteTaskReply {
                        accepted: false,
                        reason: self.bad_request(kind, "worker_id", bad_worker_id(&c.worker_id)),
                    });
                    return Handled::Reply(b);
                }
                self.fleet.registry.touch(&c.worker_id, now);
                let index = asyncrl_protos::subjects::split_wire_task_id(&c.task_id)
                    .and_then(|(id, _)| self.tasks.index_of(id))
                    .map(|i| i as u64);
                match self
                    .sched
                    .complete(&c.worker_id, &c.lease_id, index, c.num_trajectories)
                {
                    Ok(Completion::Accepted { lease }) => {
                        self.metrics.tasks_completed.inc();
                        let secs = (now - lease.granted_at_ms).max(0) as f64 / 1000.0;
                        self.fleet.estimator.on_completion(&c.worker_id, secs);
                        tracing::debug!(worker = %c.worker_id, task_id = %c.task_id, lease_id = %c.lease_id, seconds = secs, "task complete");
                        let ok = enc(&CompleteTaskReply {
                            accepted: true,
                            reason: String::new(),
                        });
                        Handled::Durable {
                            reply: ok,
                            if_unwritten: None,
                        }
                    }
                    Ok(Completion::DroppedBefore {
                        lease,
                        kind,
                        requeued,
                    }) => {
                        let why = match kind {
                            DropKind::NoSignal => "without reward signal (dynamic sampling)",
                            DropKind::Refused => "as refused by the learner",
                            DropKind::Stale | DropKind::Ignored => "as stale",
                        };
                        let then = if requeued {
                            "the task is issued again"
                        } else {
                            "the task is not issued again"
                        };
                        tracing::info!(
                            worker = %c.worker_id, task_id = %c.task_id, lease_id = %c.lease_id, index = lease.task.index, requeued,
                            "the buffer dropped this group {why} before its completion arrived; {then}"
                        );
                        let ok = enc(&CompleteTaskReply {
                            accepted: true,
                            reason: format!("the buffer dropped the group {why}; {then}"),
                        });
                        Handled::Durable {
                            reply: ok,
                            if_unwritten: None,
                        }
                    }
                    Ok(Completion::AlreadyCompleted) => {
                        let b = enc(&CompleteTaskReply {
                            accepted: true,
                            reason: "already completed (a retry)".into(),
                        });
                        Handled::Reply(b)
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
                        Handled::Reply(b)
                    }
                }
            }
            RequestKind::Return => {
                let r = match ReturnTasks::decode(payload) {
                    Ok(r) => r,
                    Err(e) => {
                        self.bad_request(kind, "malformed", format!("malformed ReturnTasks: {e}"));
                        let b = enc(&ReturnTasksReply { returned: 0 });
                        return Handled::Reply(b);
                    }
                };
                if !valid_task_id(&r.worker_id) {
                    self.bad_request(kind, "worker_id", bad_worker_id(&r.worker_id));
                    return Handled::Reply(enc(&ReturnTasksReply { returned: 0 }));
                }
                self.fleet.registry.touch(&r.worker_id, now);
                let ended =
                    self.sched
                        .return_leases(&r.worker_id, &r.lease_ids, now, r.task_failed);
                self.metrics.tasks_returned.inc_by(ended.len() as u64);
                for e in ended.iter().filter(|e| e.quarantined) {
                    self.metrics.quarantined("returned");
                    tracing::warn!(
                        worker = %r.worker_id, index = e.lease.task.index, epoch = e.lease.task.epoch,
                        attempts = self.sched.params().max_task_attempts, reason = %r.reason,
                        "a task failed too often and is quarantined: it is not issued again (coordinator.max_task_attempts)"
                    );
                }
                tracing::info!(worker = %r.worker_id, returned = ended.len(), asked = r.lease_ids.len(), reason = %r.reason, "tasks returned");
                let ok = enc(&ReturnTasksReply {
                    returned: ended.len() as u32,
                });
                if ended.is_empty() {
                    Handled::Reply(ok)
                } else {
                    Handled::Durable {
                        reply: ok,
                        if_unwritten: None,
                    }
                }
            }
        }
    }

    /// Counts and logs a refused request; returns `message` for the reply.
    fn bad_request(&self, kind: RequestKind, reason: &str, message: String) -> String {
        self.metrics
            .bad_requests
            .get_or_create(&BadRequestLabel {
                subject: kind.subject().to_owned(),
                reason: reason.to_owned(),
            })
            .inc();
        tracing::warn!(subject = kind.subject(), reason, error = %message, "refused a bad worker request");
        message
    }

    fn acquire(&mut self, a: &AcquireTasks, now: i64) -> Acquired {
        let deny = |reason: String, label: &'static str| Acquired::Denied { reason, label };
        if !valid_task_id(&a.worker_id) {
            return deny(
                self.bad_request(
                    RequestKind::Acquire,
                    "worker_id",
                    bad_worker_id(&a.worker_id),
                ),
                "bad_request",
            );
        }
        let worker = self.fleet.registry.touch(&a.worker_id, now);
        if worker.draining {
            return deny("the worker is draining".into(), "draining");
        }
        let Admission { eta, paused } = self.knobs.admission(self.sched.version());
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
                let (prompt, messages) = match &item.prompt {
                    Prompt::Text(t) => (t.clone(), Vec::new()),
                    Prompt::Messages(m) => (
                        String::new(),
                        m.iter()
                            .map(|m| ChatMessage {
                                role: m.role.clone(),
                                content: m.content.clone(),
                            })
                            .collect(),
                    ),
                };
                Some(Task {
                    task_id: asyncrl_protos::subjects::wire_task_id(&item.id, g.task.epoch),
                    lease_id: g.lease_id,
                    prompt,
                    messages,
                    verifier: item.verifier.clone(),
                    answer: item.answer.clone(),
                    dataset: item.dataset.clone(),
                    group_size: self.settings.group_size,
                    lease_deadline_unix_ms: g.deadline_ms,
                    admission_version: g.admission_version,
                    epoch: g.task.epoch,
                })
            })
            .collect();
        Acquired::Granted(self.fit_reply(&a.worker_id, tasks, now))
    }

    /// Keeps a grant reply below the server's `max_payload`: the tasks that
    /// do not fit are handed back at once (issued again, to this or another
    /// worker), and a task that alone exceeds it is returned as failed
    /// (quarantined after `coordinator.max_task_attempts`), with an error
    /// naming it. A reply over the limit would never reach the worker, and
    /// its leases would wait for their timeout.
    fn fit_reply(&mut self, worker: &str, tasks: Vec<Task>, now: i64) -> Vec<Task> {
        let Some(max) = self.max_reply_bytes else {
            return tasks;
        };
        // Room for the reply's other fields and the message headers.
        let budget = max.saturating_sub(4096);
        let mut used = 0usize;
        let mut kept = Vec::with_capacity(tasks.len());
        let mut back: Vec<String> = Vec::new();
        let mut too_large: Vec<String> = Vec::new();
        for t in tasks {
            let size = t.encoded_len() + 8;
            if size > budget {
                tracing::error!(
                    task_id = %t.task_id, bytes = size, max_payload = max,
                    "a task does not fit in a reply within the NATS server's max_payload; it is returned as failed (shorten the prompt, or raise max_payload)"
                );
                too_large.push(t.lease_id);
            } else if used + size > budget {
                back.push(t.lease_id);
            } else {
                used += size;
                kept.push(t);
            }
        }
        if !back.is_empty() {
            tracing::debug!(
                worker,
                handed_back = back.len(),
                "a grant was cut to fit max_payload"
            );
            self.sched.return_leases(worker, &back, now, false);
        }
        if !too_large.is_empty() {
            for e in self.sched.return_leases(worker, &too_large, now, true) {
                if e.quarantined {
                    self.metrics.quarantined("too_large");
                    tracing::warn!(
                        index = e.lease.task.index,
                        "a task failed too often (it never fits a reply) and is quarantined"
                    );
                }
            }
        }
        kept
    }
}

/// The refusal of a worker id that is no id (empty, too long, odd
/// characters); a long one is cut in the message.
fn bad_worker_id(id: &str) -> String {
    format!(
        "{} must be 1-128 characters of [A-Za-z0-9_-]",
        shown_worker_id(id)
    )
}

/// `worker_id "<id>"` for a message, a long id cut.
fn shown_worker_id(id: &str) -> String {
    let shown: String = id.chars().take(64).collect();
    let cut = if shown.len() < id.len() { "..." } else { "" };
    format!("worker_id {shown:?}{cut}")
}

/// The worker id a request's payload claims (None when it does not decode:
/// the request is then refused as malformed).
fn claimed_worker(kind: RequestKind, payload: &[u8]) -> Option<String> {
    match kind {
        RequestKind::Register => RegisterWorker::decode(payload).ok().map(|m| m.worker_id),
        RequestKind::Heartbeat => WorkerHeartbeat::decode(payload).ok().map(|m| m.worker_id),
        RequestKind::Acquire => AcquireTasks::decode(payload).ok().map(|m| m.worker_id),
        RequestKind::Complete => CompleteTask::decode(payload).ok().map(|m| m.worker_id),
        RequestKind::Return => ReturnTasks::decode(payload).ok().map(|m| m.worker_id),
    }
}
