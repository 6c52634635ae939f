//! The coordinator's state machine, free of I/O and clocks: the task cursor,
//! the queue of re-issued tasks, leases, the accepted count and the
//! bounded-staleness admission rule. Time comes in as unix milliseconds.
//!
//! Admission (AReaL, arXiv 2505.24298, Eq. 3): a task is admitted only while
//!
//! ```text
//! accepted + running < (η + v + 1) · B
//! ```
//!
//! `accepted` counts completed tasks, `running` leased-but-unfinished ones,
//! `v` is the learner's version and `B` the groups it consumes per step. With
//! a learner that consumes groups in admission order, a task admitted at
//! version a is at most the `(η + a + 1)·B`-th live group, so it is trained
//! at a version ≤ a + η (see tests/admission_property.rs).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::sync::Arc;

use asyncrl_protos::v1::{
    CompletedLease, CoordinatorState, PersistedLease, TaskRef as TaskRefProto,
};

/// Persisted-state format written by this version.
pub const STATE_FORMAT: u32 = 1;

/// A task of the data set in one epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TaskRef {
    pub index: u64,
    pub epoch: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerParams {
    /// B: groups the learner consumes per step.
    pub groups_per_step: u32,
    /// G: trajectories a complete group has.
    pub group_size: u32,
    pub lease_timeout_ms: i64,
    /// How many recent completions are remembered (persisted).
    pub completed_memory: usize,
}

/// One attempt at a task.
#[derive(Debug, Clone, PartialEq)]
pub struct Lease {
    pub seq: u64,
    pub task: TaskRef,
    pub worker: Arc<str>,
    pub admission_version: i32,
    pub granted_at_ms: i64,
    pub deadline_ms: i64,
}

#[derive(Debug, Clone, PartialEq)]
struct Completed {
    seq: u64,
    task: TaskRef,
    worker: Arc<str>,
}

/// A granted lease, as the service turns it into a `Task`.
#[derive(Debug, Clone, PartialEq)]
pub struct Grant {
    pub lease_id: String,
    pub task: TaskRef,
    pub admission_version: i32,
    pub deadline_ms: i64,
}

/// Why a completion was refused.
#[derive(Debug, Clone, PartialEq)]
pub enum CompleteRefusal {
    MalformedLease,
    UnknownLease,
    Expired { at_ms: i64, reason: &'static str },
    WrongTask,
    WrongWorker { holder: String },
    WrongGroupSize { got: u32, want: u32 },
}

impl CompleteRefusal {
    /// A short label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            CompleteRefusal::MalformedLease | CompleteRefusal::UnknownLease => "unknown_lease",
            CompleteRefusal::Expired { .. } => "expired",
            CompleteRefusal::WrongTask => "wrong_task",
            CompleteRefusal::WrongWorker { .. } => "wrong_worker",
            CompleteRefusal::WrongGroupSize { .. } => "wrong_group_size",
        }
    }
}

impl fmt::Display for CompleteRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CompleteRefusal::MalformedLease => {
                write!(f, "lease id was not issued by this coordinator")
            }
            CompleteRefusal::UnknownLease => write!(
                f,
                "unknown lease (expired long ago, returned, or never granted); its trajectories are dropped by the buffer"
            ),
            CompleteRefusal::Expired { at_ms, reason } => write!(
                f,
                "lease {reason} at unix ms {at_ms} and its task was put back in the queue; its trajectories are dropped by the buffer"
            ),
            CompleteRefusal::WrongTask => write!(f, "task_id does not match the lease"),
            CompleteRefusal::WrongWorker { holder } => {
                write!(f, "lease is held by worker `{holder}`")
            }
            CompleteRefusal::WrongGroupSize { got, want } => write!(
                f,
                "a group has {want} trajectories, the completion reports {got}; the lease stays open"
            ),
        }
    }
}

/// A completion that was accepted.
#[derive(Debug, Clone, PartialEq)]
pub enum Completion {
    /// Counted now.
    Accepted { lease: Lease },
    /// A retry of a completion that was already counted (e.g. its reply was
    /// lost in a coordinator restart): answered yes, counted once.
    AlreadyCompleted,
}

/// A lease that ended without completion.
#[derive(Debug, Clone, PartialEq)]
pub struct Ended {
    pub lease_id: String,
    pub lease: Lease,
}

/// What a new learner version or session did to the accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VersionChange {
    Unchanged,
    Advanced {
        from: i32,
        to: i32,
    },
    /// The learner restarted (new session, or its version went down).
    /// When its version went down, `accepted` was reset to v · B; when the
    /// version carried on, the groups accepted before are still in the
    /// (durable) buffer and `accepted` was kept.
    LearnerRestart {
        version: i32,
        accepted_before: u64,
        reset: bool,
    },
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum StateError {
    #[error(
        "the persisted coordinator state was written for another task set (fingerprint {stored}, {stored_len} tasks; the configured files give {now}, {now_len} tasks). Restore the files, or delete the key `coordinator.state` of the KV bucket asyncrl_control to start the run's task cursor from scratch"
    )]
    DatasetChanged {
        stored: String,
        stored_len: u64,
        now: String,
        now_len: u64,
    },
    #[error(
        "the persisted coordinator state has format {found}; this coordinator reads format {STATE_FORMAT}"
    )]
    Format { found: u32 },
    #[error("the persisted coordinator state is inconsistent: {0}")]
    Corrupt(String),
}

const EXPIRED_MEMORY: usize = 4096;

/// The coordinator's state.
#[derive(Debug, Clone)]
pub struct Scheduler {
    params: SchedulerParams,
    dataset_len: u64,
    fingerprint: String,
    lease_prefix: String,
    next_seq: u64,
    epoch: u64,
    cursor: u64,
    queue: VecDeque<TaskRef>,
    leases: BTreeMap<u64, Lease>,
    accepted: u64,
    version: i32,
    learner_session: String,
    /// Recent completions by completion order, and their lease seqs.
    completed: BTreeMap<u64, Completed>,
    completed_seqs: HashMap<u64, u64>,
    completed_counter: u64,
    /// Recently ended leases (not persisted): lets a refusal say why.
    ended: VecDeque<(u64, i64, &'static str)>,
    ended_seqs: HashMap<u64, (i64, &'static str)>,
    pub stale_dropped_total: u64,
    pub admitted_total: u64,
    pub completed_total: u64,
    pub expired_total: u64,
}

impl Scheduler {
    pub fn new(
        params: SchedulerParams,
        dataset_len: u64,
        fingerprint: &str,
        lease_prefix: &str,
    ) -> Self {
        Self {
            params,
            dataset_len: dataset_len.max(1),
            fingerprint: fingerprint.to_owned(),
            lease_prefix: lease_prefix.to_owned(),
            next_seq: 1,
            epoch: 0,
            cursor: 0,
            queue: VecDeque::new(),
            leases: BTreeMap::new(),
            accepted: 0,
            version: 0,
            learner_session: String::new(),
            completed: BTreeMap::new(),
            completed_seqs: HashMap::new(),
            completed_counter: 0,
            ended: VecDeque::new(),
            ended_seqs: HashMap::new(),
            stale_dropped_total: 0,
            admitted_total: 0,
            completed_total: 0,
            expired_total: 0,
        }
    }

    pub fn params(&self) -> &SchedulerParams {
        &self.params
    }

    pub fn set_params(&mut self, params: SchedulerParams) {
        self.params = params;
        self.trim_completed();
    }

    // ------------------------------------------------------------ accessors

    pub fn accepted(&self) -> u64 {
        self.accepted
    }

    pub fn running(&self) -> u64 {
        self.leases.len() as u64
    }

    pub fn version(&self) -> i32 {
        self.version
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn cursor(&self) -> u64 {
        self.cursor
    }

    pub fn queue_len(&self) -> usize {
        self.queue.len()
    }

    pub fn dataset_len(&self) -> u64 {
        self.dataset_len
    }

    pub fn learner_session(&self) -> &str {
        &self.learner_session
    }

    pub fn leases(&self) -> impl Iterator<Item = &Lease> {
        self.leases.values()
    }

    pub fn lease(&self, lease_id: &str) -> Option<&Lease> {
        self.parse_lease(lease_id).and_then(|s| self.leases.get(&s))
    }

    pub fn lease_id(&self, seq: u64) -> String {
        format!("{}-{seq}", self.lease_prefix)
    }

    fn parse_lease(&self, lease_id: &str) -> Option<u64> {
        let (prefix, seq) = lease_id.rsplit_once('-')?;
        if prefix != self.lease_prefix {
            return None;
        }
        seq.parse().ok()
    }

    fn v(&self) -> u64 {
        self.version.max(0) as u64
    }

    /// `(η + v + 1) · B − accepted − running`: how many more tasks may be
    /// admitted now. Negative only after η was lowered.
    pub fn capacity(&self, eta: u32) -> i64 {
        let bound = (u64::from(eta) + self.v() + 1) * u64::from(self.params.groups_per_step);
        bound as i64 - self.accepted as i64 - self.running() as i64
    }

    // ------------------------------------------------------------ operations

    fn next_task(&mut self) -> TaskRef {
        if let Some(t) = self.queue.pop_front() {
            return t;
        }
        let t = TaskRef {
            index: self.cursor,
            epoch: self.epoch,
        };
        self.cursor += 1;
        if self.cursor >= self.dataset_len {
            self.cursor = 0;
            self.epoch += 1;
        }
        t
    }

    /// Admits up to `n` tasks for `worker`, as far as the staleness bound
    /// allows. Returns the grants (possibly none).
    pub fn acquire(&mut self, worker: &str, n: u32, eta: u32, now_ms: i64) -> Vec<Grant> {
        let room = self.capacity(eta).max(0) as u64;
        let k = u64::from(n).min(room);
        let worker: Arc<str> = Arc::from(worker);
        let mut grants = Vec::with_capacity(k as usize);
        for _ in 0..k {
            let task = self.next_task();
            let seq = self.next_seq;
            self.next_seq += 1;
            let lease = Lease {
                seq,
                task,
                worker: worker.clone(),
                admission_version: self.version,
                granted_at_ms: now_ms,
                deadline_ms: now_ms + self.params.lease_timeout_ms,
            };
            grants.push(Grant {
                lease_id: self.lease_id(seq),
                task,
                admission_version: self.version,
                deadline_ms: lease.deadline_ms,
            });
            self.leases.insert(seq, lease);
            self.admitted_total += 1;
        }
        grants
    }

    /// Reports a task complete. `task_index` is the index of the task id the
    /// worker named (None: an id the data set does not have).
    pub fn complete(
        &mut self,
        worker: &str,
        lease_id: &str,
        task_index: Option<u64>,
        num_trajectories: u32,
    ) -> Result<Completion, CompleteRefusal> {
        let seq = self
            .parse_lease(lease_id)
            .ok_or(CompleteRefusal::MalformedLease)?;
        let Some(lease) = self.leases.get(&seq) else {
            if let Some(c) = self
                .completed_seqs
                .get(&seq)
                .and_then(|k| self.completed.get(k))
                && &*c.worker == worker
                && Some(c.task.index) == task_index
            {
                return Ok(Completion::AlreadyCompleted);
            }
            if let Some(&(at_ms, reason)) = self.ended_seqs.get(&seq) {
                return Err(CompleteRefusal::Expired { at_ms, reason });
            }
            return Err(CompleteRefusal::UnknownLease);
        };
        if Some(lease.task.index) != task_index {
            return Err(CompleteRefusal::WrongTask);
        }
        if &*lease.worker != worker {
            return Err(CompleteRefusal::WrongWorker {
                holder: lease.worker.to_string(),
            });
        }
        if num_trajectories != self.params.group_size {
            return Err(CompleteRefusal::WrongGroupSize {
                got: num_trajectories,
                want: self.params.group_size,
            });
        }
        let lease = self
            .leases
            .remove(&seq)
            .ok_or(CompleteRefusal::UnknownLease)?;
        self.accepted += 1;
        self.completed_total += 1;
        self.remember_completed(Completed {
            seq,
            task: lease.task,
            worker: lease.worker.clone(),
        });
        Ok(Completion::Accepted { lease })
    }

    fn remember_completed(&mut self, c: Completed) {
        if self.params.completed_memory == 0 {
            return;
        }
        let k = self.completed_counter;
        self.completed_counter += 1;
        self.completed_seqs.insert(c.seq, k);
        self.completed.insert(k, c);
        self.trim_completed();
    }

    fn trim_completed(&mut self) {
        while self.completed.len() > self.params.completed_memory {
            if let Some((_, c)) = self.completed.pop_first() {
                self.completed_seqs.remove(&c.seq);
            }
        }
    }

    fn remember_ended(&mut self, seq: u64, at_ms: i64, reason: &'static str) {
        self.ended.push_back((seq, at_ms, reason));
        self.ended_seqs.insert(seq, (at_ms, reason));
        while self.ended.len() > EXPIRED_MEMORY {
            if let Some((s, ..)) = self.ended.pop_front() {
                self.ended_seqs.remove(&s);
            }
        }
    }

    /// Ends leases: their tasks go back to the front of the queue, the
    /// oldest lease first.
    fn end_leases(&mut self, mut seqs: Vec<u64>, now_ms: i64, reason: &'static str) -> Vec<Ended> {
        seqs.sort_unstable();
        let mut ended = Vec::with_capacity(seqs.len());
        for seq in seqs {
            if let Some(lease) = self.leases.remove(&seq) {
                self.remember_ended(seq, now_ms, reason);
                ended.push(Ended {
                    lease_id: self.lease_id(seq),
                    lease,
                });
            }
        }
        for e in ended.iter().rev() {
            self.queue.push_front(e.lease.task);
        }
        ended
    }

    /// Expires every lease whose deadline has passed.
    pub fn expire_due(&mut self, now_ms: i64) -> Vec<Ended> {
        let due: Vec<u64> = self
            .leases
            .values()
            .filter(|l| l.deadline_ms <= now_ms)
            .map(|l| l.seq)
            .collect();
        let ended = self.end_leases(due, now_ms, "expired");
        self.expired_total += ended.len() as u64;
        ended
    }

    /// Expires every lease of a worker (it was marked dead).
    pub fn expire_worker(&mut self, worker: &str, now_ms: i64) -> Vec<Ended> {
        let seqs: Vec<u64> = self
            .leases
            .values()
            .filter(|l| &*l.worker == worker)
            .map(|l| l.seq)
            .collect();
        let ended = self.end_leases(seqs, now_ms, "expired (worker dead)");
        self.expired_total += ended.len() as u64;
        ended
    }

    /// A draining worker hands back leases; returns those that were its own.
    pub fn return_leases(&mut self, worker: &str, lease_ids: &[String], now_ms: i64) -> Vec<Ended> {
        let seqs: Vec<u64> = lease_ids
            .iter()
            .filter_map(|id| self.parse_lease(id))
            .filter(|s| self.leases.get(s).is_some_and(|l| &*l.worker == worker))
            .collect();
        self.end_leases(seqs, now_ms, "was returned")
    }

    /// Extends the leases a worker still holds; returns the ids it listed
    /// that are no longer valid for it.
    pub fn heartbeat(&mut self, worker: &str, lease_ids: &[String], now_ms: i64) -> Vec<String> {
        let deadline = now_ms + self.params.lease_timeout_ms;
        let mut revoked = Vec::new();
        for id in lease_ids {
            match self.parse_lease(id).and_then(|s| self.leases.get_mut(&s)) {
                Some(lease) if &*lease.worker == worker => {
                    lease.deadline_ms = lease.deadline_ms.max(deadline);
                }
                _ => revoked.push(id.clone()),
            }
        }
        revoked
    }

    /// The learner announced version `v`.
    pub fn on_version(&mut self, v: i32) -> VersionChange {
        let from = self.version;
        if v == from {
            return VersionChange::Unchanged;
        }
        self.version = v;
        if v < from {
            return self.reset_accepted();
        }
        // Every group the learner consumed was accepted first or is still
        // leased (its trajectories are acked, its completion is on the way);
        // less can only mean lost state, and counting it as free capacity
        // would burst.
        self.accepted = self.accepted.max(self.consumed_floor());
        VersionChange::Advanced { from, to: v }
    }

    /// The learner reported session `session`, resumed from `start_version`.
    pub fn on_learner_session(&mut self, session: &str, start_version: i32) -> VersionChange {
        if session.is_empty() || session == self.learner_session {
            return VersionChange::Unchanged;
        }
        let first = self.learner_session.is_empty();
        self.learner_session = session.to_owned();
        // The new learner resumed where the versions were (from a checkpoint
        // plus the published weights): nothing it will train was lost.
        let carried_on = start_version >= self.version;
        if start_version > self.version {
            self.version = start_version;
        }
        if first {
            self.accepted = self.accepted.max(self.consumed_floor());
            return VersionChange::Unchanged;
        }
        if carried_on {
            let before = self.accepted;
            self.accepted = self.accepted.max(self.consumed_floor());
            return VersionChange::LearnerRestart {
                version: self.version,
                accepted_before: before,
                reset: false,
            };
        }
        self.reset_accepted()
    }

    /// The fewest accepted groups consistent with version `v`: the learner
    /// consumed v · B groups, each counted in `accepted` or still leased. A
    /// completion can reach the coordinator after the learner trained on the
    /// group (always so when the coordinator was down meanwhile); raising
    /// `accepted` to v · B then would count that completion twice when it
    /// arrives, and capacity would be lost for good (enough of it and
    /// admission stops: with η = 0, B pending completions at a coordinator
    /// restart stop the run).
    fn consumed_floor(&self) -> u64 {
        (self.v() * u64::from(self.params.groups_per_step)).saturating_sub(self.running())
    }

    fn reset_accepted(&mut self) -> VersionChange {
        let before = self.accepted;
        self.accepted = self.v() * u64::from(self.params.groups_per_step);
        VersionChange::LearnerRestart {
            version: self.version,
            accepted_before: before,
            reset: true,
        }
    }

    /// The buffer dropped a group. A stale group of a remembered completion
    /// gives its capacity back and its task is issued again (front of the
    /// queue); returns the task when that happened.
    pub fn on_group_dropped(&mut self, group_id: &str, stale: bool) -> Option<TaskRef> {
        if !stale {
            return None;
        }
        self.stale_dropped_total += 1;
        let seq = self.parse_lease(group_id)?;
        let k = self.completed_seqs.remove(&seq)?;
        let c = self.completed.remove(&k)?;
        let floor = self.consumed_floor();
        self.accepted = self.accepted.saturating_sub(1).max(floor);
        self.queue.push_front(c.task);
        Some(c.task)
    }

    // ------------------------------------------------------------ persistence

    /// The persisted form.
    pub fn to_proto(&self) -> CoordinatorState {
        let mut workers: Vec<String> = Vec::new();
        let mut index: HashMap<Arc<str>, u32> = HashMap::new();
        let mut intern = |w: &Arc<str>, workers: &mut Vec<String>| -> u32 {
            *index.entry(w.clone()).or_insert_with(|| {
                workers.push(w.to_string());
                (workers.len() - 1) as u32
            })
        };
        let leases = self
            .leases
            .values()
            .map(|l| PersistedLease {
                seq: l.seq,
                index: l.task.index,
                epoch: l.task.epoch,
                worker: intern(&l.worker, &mut workers),
                admission_version: l.admission_version,
                granted_at_unix_ms: l.granted_at_ms,
            })
            .collect();
        let completed = self
            .completed
            .values()
            .map(|c| CompletedLease {
                seq: c.seq,
                index: c.task.index,
                epoch: c.task.epoch,
                worker: intern(&c.worker, &mut workers),
            })
            .collect();
        CoordinatorState {
            format: STATE_FORMAT,
            lease_prefix: self.lease_prefix.clone(),
            next_lease_seq: self.next_seq,
            dataset_fingerprint: self.fingerprint.clone(),
            dataset_len: self.dataset_len,
            epoch: self.epoch,
            cursor: self.cursor,
            queue: self
                .queue
                .iter()
                .map(|t| TaskRefProto {
                    index: t.index,
                    epoch: t.epoch,
                })
                .collect(),
            leases,
            accepted: self.accepted,
            learner_version: self.version,
            learner_session: self.learner_session.clone(),
            completed,
            workers,
            stale_dropped_total: self.stale_dropped_total,
            admitted_total: self.admitted_total,
            completed_total: self.completed_total,
            expired_total: self.expired_total,
        }
    }

    /// Restores a persisted state. Every restored lease gets a fresh
    /// deadline (`now + lease_timeout`): its worker could not heartbeat while
    /// the coordinator was down.
    pub fn from_proto(
        params: SchedulerParams,
        state: &CoordinatorState,
        dataset_len: u64,
        fingerprint: &str,
        now_ms: i64,
    ) -> Result<Self, StateError> {
        if state.format != STATE_FORMAT {
            return Err(StateError::Format {
                found: state.format,
            });
        }
        if state.dataset_fingerprint != fingerprint || state.dataset_len != dataset_len {
            return Err(StateError::DatasetChanged {
                stored: state.dataset_fingerprint.clone(),
                stored_len: state.dataset_len,
                now: fingerprint.to_owned(),
                now_len: dataset_len,
            });
        }
        let corrupt = |what: String| StateError::Corrupt(what);
        let workers: Vec<Arc<str>> = state
            .workers
            .iter()
            .map(|w| Arc::from(w.as_str()))
            .collect();
        let worker = |i: u32| {
            workers
                .get(i as usize)
                .cloned()
                .ok_or_else(|| corrupt(format!("worker index {i} out of range")))
        };
        let task = |index: u64, epoch: u64| {
            if index >= dataset_len {
                Err(corrupt(format!(
                    "task index {index} beyond the {dataset_len} tasks"
                )))
            } else {
                Ok(TaskRef { index, epoch })
            }
        };
        let mut s = Scheduler::new(params, dataset_len, fingerprint, &state.lease_prefix);
        if state.lease_prefix.is_empty() || state.cursor >= dataset_len {
            return Err(corrupt(format!(
                "lease prefix {:?}, cursor {} of {dataset_len}",
                state.lease_prefix, state.cursor
            )));
        }
        s.next_seq = state.next_lease_seq;
        s.epoch = state.epoch;
        s.cursor = state.cursor;
        for t in &state.queue {
            s.queue.push_back(task(t.index, t.epoch)?);
        }
        for l in &state.leases {
            if l.seq >= s.next_seq {
                return Err(corrupt(format!(
                    "lease seq {} ≥ next seq {}",
                    l.seq, s.next_seq
                )));
            }
            s.leases.insert(
                l.seq,
                Lease {
                    seq: l.seq,
                    task: task(l.index, l.epoch)?,
                    worker: worker(l.worker)?,
                    admission_version: l.admission_version,
                    granted_at_ms: l.granted_at_unix_ms,
                    deadline_ms: now_ms + s.params.lease_timeout_ms,
                },
            );
        }
        for c in &state.completed {
            s.remember_completed(Completed {
                seq: c.seq,
                task: task(c.index, c.epoch)?,
                worker: worker(c.worker)?,
            });
        }
        s.accepted = state.accepted;
        s.version = state.learner_version;
        s.learner_session = state.learner_session.clone();
        s.stale_dropped_total = state.stale_dropped_total;
        s.admitted_total = state.admitted_total;
        s.completed_total = state.completed_total;
        s.expired_total = state.expired_total;
        Ok(s)
    }

    /// Whether two schedulers hold the same persisted state (deadlines and
    /// the not-persisted memory of ended leases aside).
    pub fn same_state(&self, other: &Scheduler) -> bool {
        self.to_proto() == other.to_proto()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(b: u32) -> SchedulerParams {
        SchedulerParams {
            groups_per_step: b,
            group_size: 4,
            lease_timeout_ms: 1_000,
            completed_memory: 64,
        }
    }

    fn sched(b: u32, n: u64) -> Scheduler {
        Scheduler::new(params(b), n, "fp", "L0")
    }

    /// The learner trains on groups whose completions reach the coordinator
    /// later (a coordinator restart in between, or just a slow reply): each
    /// completion is counted once, and capacity is what the rule says.
    #[test]
    fn completions_that_arrive_after_the_learner_trained_are_counted_once() {
        let b = 4;
        let mut s = sched(b, 100);
        s.on_version(0);
        let grants = s.acquire("w", 100, 0, 0);
        assert_eq!(grants.len(), 4);
        // The learner consumed all four groups before any completion arrived.
        assert!(matches!(s.on_version(1), VersionChange::Advanced { .. }));
        assert_eq!(s.accepted(), 0, "pending completions are still leases");
        for g in &grants {
            s.complete("w", &g.lease_id, Some(g.task.index), 4).unwrap();
        }
        assert_eq!(s.accepted(), 4);
        assert_eq!(s.capacity(0), 4, "(η + v + 1)·B − accepted − running");
        // The same across a restart from the persisted state.
        let grants = s.acquire("w", 100, 0, 0);
        let mut r = Scheduler::from_proto(params(b), &s.to_proto(), 100, "fp", 0).unwrap();
        assert!(matches!(r.on_version(2), VersionChange::Advanced { .. }));
        for g in &grants {
            r.complete("w", &g.lease_id, Some(g.task.index), 4).unwrap();
        }
        assert_eq!(r.accepted(), 8);
        assert_eq!(r.capacity(0), 4);
        // State that was lost still cannot make capacity burst.
        let mut lost = sched(b, 100);
        lost.on_version(5);
        assert_eq!(lost.accepted(), 20);
        assert_eq!(lost.capacity(1), 8);
    }

    #[test]
    fn eta_zero_admits_exactly_b_groups_per_version() {
        let b = 4;
        let mut s = sched(b, 100);
        for v in 0..5 {
            assert_eq!(
                s.on_version(v),
                if v == 0 {
                    VersionChange::Unchanged
                } else {
                    VersionChange::Advanced { from: v - 1, to: v }
                }
            );
            let grants = s.acquire("w", 100, 0, 0);
            assert_eq!(grants.len(), b as usize, "version {v}");
            assert!(grants.iter().all(|g| g.admission_version == v));
            assert!(s.acquire("w", 100, 0, 0).is_empty());
            for g in &grants {
                let c = s.complete("w", &g.lease_id, Some(g.task.index), 4).unwrap();
                assert!(matches!(c, Completion::Accepted { .. }));
            }
            // Completing frees nothing: the learner must consume first.
            assert!(s.acquire("w", 100, 0, 0).is_empty());
            assert_eq!(s.capacity(0), 0);
        }
        assert_eq!(s.accepted(), 5 * u64::from(b));
    }

    #[test]
    fn admission_rule_counts_running_and_accepted() {
        let mut s = sched(2, 100);
        // (η + v + 1)·B = (1 + 0 + 1)·2 = 4.
        assert_eq!(s.capacity(1), 4);
        let g = s.acquire("w", 3, 1, 0);
        assert_eq!(g.len(), 3);
        assert_eq!(s.capacity(1), 1);
        assert_eq!(s.acquire("w", 3, 1, 0).len(), 1);
        assert_eq!(s.capacity(1), 0);
        // Completing moves a group from running to accepted: no new room.
        for g in &g[..2] {
            s.complete("w", &g.lease_id, Some(g.task.index), 4).unwrap();
        }
        assert_eq!((s.accepted(), s.running(), s.capacity(1)), (2, 2, 0));
        // The learner consumed B = 2 groups: B more may be admitted.
        s.on_version(1);
        assert_eq!(s.capacity(1), 2);
        assert_eq!(s.acquire("w", 5, 1, 0).len(), 2);
        // Lowering η can make the capacity negative: nothing is admitted.
        assert_eq!(s.capacity(0), -2);
        assert!(s.acquire("w", 1, 0, 0).is_empty());
    }

    #[test]
    fn expired_lease_puts_the_task_back_at_the_front_and_refuses_its_completion() {
        let mut s = sched(8, 10);
        let g = s.acquire("w1", 3, 4, 0);
        assert_eq!(
            g.iter().map(|g| g.task.index).collect::<Vec<_>>(),
            [0, 1, 2]
        );
        // Heartbeat keeps lease 0 alive; 1 and 2 expire.
        assert!(s.heartbeat("w1", &[g[0].lease_id.clone()], 600).is_empty());
        let ended = s.expire_due(1_000);
        assert_eq!(
            ended.iter().map(|e| e.lease.task.index).collect::<Vec<_>>(),
            [1, 2]
        );
        assert_eq!(s.running(), 1);
        // The expired tasks come first, in their order, then the cursor.
        let again = s.acquire("w2", 3, 4, 1_000);
        assert_eq!(
            again.iter().map(|g| g.task.index).collect::<Vec<_>>(),
            [1, 2, 3]
        );
        assert_ne!(again[0].lease_id, g[1].lease_id);
        let err = s.complete("w1", &g[1].lease_id, Some(1), 4).unwrap_err();
        assert!(matches!(err, CompleteRefusal::Expired { .. }), "{err}");
        assert!(err.to_string().contains("expired"), "{err}");
        // The heartbeat of an expired lease revokes it.
        assert_eq!(
            s.heartbeat("w1", &[g[1].lease_id.clone()], 1_100),
            vec![g[1].lease_id.clone()]
        );
        // Lease 0 lives until its extended deadline.
        assert!(s.expire_due(1_500).is_empty());
        assert_eq!(s.expire_due(1_600).len(), 1);
    }

    #[test]
    fn completion_checks_lease_task_worker_and_group_size() {
        let mut s = sched(8, 10);
        let g = s.acquire("w1", 1, 4, 0).remove(0);
        assert_eq!(
            s.complete("w1", "nope", Some(0), 4),
            Err(CompleteRefusal::MalformedLease)
        );
        assert_eq!(
            s.complete("w1", "L0-999", Some(0), 4),
            Err(CompleteRefusal::UnknownLease)
        );
        assert_eq!(
            s.complete("w1", &g.lease_id, Some(5), 4),
            Err(CompleteRefusal::WrongTask)
        );
        assert_eq!(
            s.complete("w1", &g.lease_id, None, 4),
            Err(CompleteRefusal::WrongTask)
        );
        assert_eq!(
            s.complete("w2", &g.lease_id, Some(0), 4),
            Err(CompleteRefusal::WrongWorker {
                holder: "w1".into()
            })
        );
        assert_eq!(
            s.complete("w1", &g.lease_id, Some(0), 3),
            Err(CompleteRefusal::WrongGroupSize { got: 3, want: 4 })
        );
        assert_eq!(s.running(), 1);
        assert!(matches!(
            s.complete("w1", &g.lease_id, Some(0), 4),
            Ok(Completion::Accepted { .. })
        ));
        // A retry is answered yes and counted once.
        assert_eq!(
            s.complete("w1", &g.lease_id, Some(0), 4),
            Ok(Completion::AlreadyCompleted)
        );
        assert_eq!(s.accepted(), 1);
    }

    #[test]
    fn returned_and_dead_worker_leases_are_reissued_first() {
        let mut s = sched(8, 10);
        let a = s.acquire("a", 2, 4, 0);
        let b = s.acquire("b", 2, 4, 0);
        // Only its own leases can be returned.
        let r = s.return_leases("a", &[a[1].lease_id.clone(), b[0].lease_id.clone()], 5);
        assert_eq!(r.len(), 1);
        let dead = s.expire_worker("b", 6);
        assert_eq!(dead.len(), 2);
        assert_eq!(s.running(), 1);
        let next = s.acquire("c", 4, 4, 7);
        assert_eq!(
            next.iter().map(|g| g.task.index).collect::<Vec<_>>(),
            [2, 3, 1, 4]
        );
    }

    #[test]
    fn epochs_wrap_the_cursor() {
        let mut s = sched(64, 3);
        let g = s.acquire("w", 7, 4, 0);
        let got: Vec<(u64, u64)> = g.iter().map(|g| (g.task.epoch, g.task.index)).collect();
        assert_eq!(
            got,
            [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0)]
        );
        assert_eq!((s.epoch(), s.cursor()), (2, 1));
    }

    #[test]
    fn learner_restart_keeps_accepted_unless_the_version_went_down() {
        let mut s = sched(4, 100);
        assert_eq!(s.on_learner_session("s1", 0), VersionChange::Unchanged);
        let g = s.acquire("w", 12, 2, 0);
        for g in &g[..10] {
            s.complete("w", &g.lease_id, Some(g.task.index), 4).unwrap();
        }
        s.on_version(2);
        assert_eq!(s.accepted(), 10);
        // Same session again: nothing happens.
        assert_eq!(s.on_learner_session("s1", 2), VersionChange::Unchanged);
        // A new session that carries on at version 2: the two accepted groups
        // it has not trained are still in the buffer, so no new capacity.
        assert_eq!(
            s.on_learner_session("s2", 2),
            VersionChange::LearnerRestart {
                version: 2,
                accepted_before: 10,
                reset: false
            }
        );
        assert_eq!(s.accepted(), 10);
        // A version that goes down is a restart from an older state: reset
        // to v · B.
        assert_eq!(
            s.on_version(1),
            VersionChange::LearnerRestart {
                version: 1,
                accepted_before: 10,
                reset: true
            }
        );
        assert_eq!(s.accepted(), 4);
        // So is a new session that starts below the known version (version
        // 2 first raised accepted to what 2 · B consumed groups imply:
        // 8 − 2 running).
        s.on_version(2);
        assert_eq!(s.accepted(), 6);
        assert_eq!(
            s.on_learner_session("s3", 1),
            VersionChange::LearnerRestart {
                version: 2,
                accepted_before: 6,
                reset: true
            }
        );
        assert_eq!(s.accepted(), 8);
        // Running leases are untouched.
        assert_eq!(s.running(), 2);
    }

    #[test]
    fn a_fresh_state_does_not_burst_when_the_learner_is_ahead() {
        let mut s = sched(4, 100);
        s.on_version(10);
        assert_eq!(s.accepted(), 40);
        assert_eq!(s.capacity(1), 8);
    }

    #[test]
    fn stale_drop_returns_capacity_and_reissues_the_task() {
        let mut s = sched(2, 100);
        let g = s.acquire("w", 2, 0, 0);
        for g in &g {
            s.complete("w", &g.lease_id, Some(g.task.index), 4).unwrap();
        }
        assert_eq!(s.capacity(0), 0);
        assert_eq!(s.on_group_dropped(&g[1].lease_id, false), None);
        assert_eq!(
            s.on_group_dropped(&g[1].lease_id, true),
            Some(TaskRef { index: 1, epoch: 0 })
        );
        assert_eq!(s.stale_dropped_total, 1);
        assert_eq!(s.capacity(0), 1);
        let again = s.acquire("w", 5, 0, 0);
        assert_eq!(again.len(), 1);
        assert_eq!(again[0].task.index, 1);
        // Unknown group: counted, nothing else.
        assert_eq!(s.on_group_dropped("L0-77", true), None);
        assert_eq!(s.stale_dropped_total, 2);
    }

    #[test]
    fn persisted_state_round_trips_and_refuses_another_dataset() {
        let mut s = sched(4, 10);
        s.on_learner_session("sess", 0);
        let g = s.acquire("w1", 6, 4, 0);
        s.complete("w1", &g[0].lease_id, Some(0), 4).unwrap();
        s.expire_worker("w1", 5);
        let g2 = s.acquire("w2", 2, 4, 6);
        s.on_version(1);
        let proto = s.to_proto();
        let back = Scheduler::from_proto(params(4), &proto, 10, "fp", 10_000).unwrap();
        assert!(back.same_state(&s));
        assert!(back.leases().all(|l| l.deadline_ms == 11_000));
        assert_eq!(back.lease(&g2[0].lease_id).unwrap().worker.as_ref(), "w2");
        let err = Scheduler::from_proto(params(4), &proto, 10, "other", 0).unwrap_err();
        assert!(err.to_string().contains("coordinator.state"), "{err}");
        let err = Scheduler::from_proto(params(4), &proto, 11, "fp", 0).unwrap_err();
        assert!(matches!(err, StateError::DatasetChanged { .. }));
        let mut bad = proto.clone();
        bad.leases[0].worker = 99;
        assert!(matches!(
            Scheduler::from_proto(params(4), &bad, 10, "fp", 0),
            Err(StateError::Corrupt(_))
        ));
    }

    #[test]
    fn completed_memory_is_bounded() {
        let mut p = params(1000);
        p.completed_memory = 3;
        let mut s = Scheduler::new(p, 100, "fp", "L0");
        let g = s.acquire("w", 10, 4, 0);
        for g in &g {
            s.complete("w", &g.lease_id, Some(g.task.index), 4).unwrap();
        }
        assert_eq!(s.to_proto().completed.len(), 3);
        // The oldest are forgotten: a retry of those is refused as unknown.
        assert_eq!(
            s.complete("w", &g[0].lease_id, Some(0), 4),
            Err(CompleteRefusal::UnknownLease)
        );
        assert_eq!(
            s.complete("w", &g[9].lease_id, Some(9), 4),
            Ok(Completion::AlreadyCompleted)
        );
    }
}
