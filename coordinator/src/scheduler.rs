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
//!
//! This file holds the types, admission and the learner's version clock;
//! `leases.rs` the life of a lease after its grant, `persisted.rs` the
//! persisted form.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::fmt;
use std::sync::Arc;

mod leases;
mod persisted;
#[cfg(test)]
mod tests;

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
    /// Failed attempts after which a task is quarantined (never issued
    /// again); 0: never.
    pub max_task_attempts: u32,
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
    /// Its persisted fields but the worker, encoded once (they never
    /// change): what every state write copies.
    persisted: persisted::Fields,
}

impl Lease {
    fn new(
        seq: u64,
        task: TaskRef,
        worker: Arc<str>,
        admission_version: i32,
        granted_at_ms: i64,
        deadline_ms: i64,
    ) -> Self {
        // int32 and int64 are written as their two's-complement u64.
        let persisted = persisted::Fields::new(&[
            (1, seq),
            (2, task.index),
            (3, task.epoch),
            (5, i64::from(admission_version) as u64),
            (6, granted_at_ms as u64),
        ]);
        Self {
            seq,
            task,
            worker,
            admission_version,
            granted_at_ms,
            deadline_ms,
            persisted,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
struct Completed {
    seq: u64,
    task: TaskRef,
    worker: Arc<str>,
    /// The buffer's drop of its group was acted on when the completion
    /// came (the report overtook it): remembered so that a retry of the
    /// completion is answered as done, and a report delivered again is not
    /// acted on twice.
    dropped: bool,
    /// As [`Lease::persisted`].
    persisted: persisted::Fields,
}

impl Completed {
    fn new(seq: u64, task: TaskRef, worker: Arc<str>, dropped: bool) -> Self {
        let persisted = persisted::Fields::new(&[
            (1, seq),
            (2, task.index),
            (3, task.epoch),
            (5, u64::from(dropped)),
        ]);
        Self {
            seq,
            task,
            worker,
            dropped,
            persisted,
        }
    }
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
    /// The buffer dropped the group before its completion arrived (the
    /// report overtook it): not counted as accepted. The task is issued
    /// again (`requeued`) after a stale or quarantined drop, as for one
    /// reported after the completion; not after a no-signal drop.
    DroppedBefore {
        lease: Lease,
        kind: DropKind,
        requeued: bool,
    },
}

/// What the buffer's drop of a group asks of the coordinator (from the
/// report's reason, [`DropKind::of`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropKind {
    /// Nothing: trained on, superseded, a duplicate attempt, or expired
    /// after it was trained.
    Ignored,
    /// Never served and older than v − η: its capacity is returned and its
    /// task issued again.
    Stale,
    /// Refused by the learner: its capacity is returned; a failed attempt
    /// of its task, which is issued again unless that quarantines it.
    Refused,
    /// No reward signal (dynamic sampling): its capacity is returned, and
    /// its task is done for its epoch: not issued again, not trained.
    NoSignal,
}

impl DropKind {
    pub fn of(reason: asyncrl_protos::GroupDropReason) -> Self {
        use asyncrl_protos::GroupDropReason as R;
        match reason {
            R::Stale => DropKind::Stale,
            R::Quarantined => DropKind::Refused,
            R::NoSignal => DropKind::NoSignal,
            R::Unspecified | R::Superseded | R::DuplicateAttempt | R::Expired => DropKind::Ignored,
        }
    }

    /// Its task is issued again.
    pub fn reissues(self) -> bool {
        matches!(self, DropKind::Stale | DropKind::Refused)
    }
}

/// A lease that ended without completion.
#[derive(Debug, Clone, PartialEq)]
pub struct Ended {
    pub lease_id: String,
    pub lease: Lease,
    /// Its task failed once too often and is quarantined, not issued again.
    pub quarantined: bool,
}

/// What became of a group the buffer dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dropped {
    /// Not a group the coordinator acts on (superseded, a duplicate,
    /// expired after it was trained).
    Ignored,
    /// Its completion is not remembered (`coordinator.completed_memory`):
    /// counted only.
    Unknown,
    /// Its lease is still running (the report overtook the completion):
    /// the completion will not count, and the task is issued again then
    /// (unless the drop was for no signal).
    BeforeCompletion,
    /// A report delivered again whose drop was acted on when the
    /// completion came: nothing more.
    AlreadyDropped,
    /// Its capacity is returned and its task is issued again.
    Requeued(TaskRef),
    /// Its capacity is returned; its task is done (no signal), not issued
    /// again.
    Freed(TaskRef),
    /// Its capacity is returned; the task failed once too often and is
    /// quarantined.
    Quarantined(TaskRef),
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

/// The worker-id set is pruned when it grows past twice its size after the
/// last pruning, and never below this.
const MIN_WORKER_IDS_BOUND: usize = 64;

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
    /// One shared id per worker for its leases and completions, so that
    /// writing the state interns workers by pointer; ids no lease or
    /// completion holds any more are dropped as the set grows.
    worker_ids: HashSet<Arc<str>>,
    worker_ids_bound: usize,
    pub stale_dropped_total: u64,
    pub admitted_total: u64,
    pub completed_total: u64,
    pub expired_total: u64,
    /// Tasks (data set indices) never issued again.
    quarantined: std::collections::BTreeSet<u64>,
    /// Failed attempts per task (data set index) since the cursor last
    /// issued it.
    failures: BTreeMap<u64, u32>,
    /// Leases whose group the buffer dropped (stale, refused, no signal)
    /// before their completion arrived. Not persisted: the report stays
    /// unacked until the completion has been counted, so a restarted
    /// coordinator is told again.
    dropped_early: HashMap<u64, DropKind>,
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
            worker_ids: HashSet::new(),
            worker_ids_bound: MIN_WORKER_IDS_BOUND,
            stale_dropped_total: 0,
            admitted_total: 0,
            completed_total: 0,
            expired_total: 0,
            quarantined: std::collections::BTreeSet::new(),
            failures: BTreeMap::new(),
            dropped_early: HashMap::new(),
        }
    }

    /// Tasks quarantined (data set indices).
    pub fn quarantined(&self) -> &std::collections::BTreeSet<u64> {
        &self.quarantined
    }

    /// Counts a failed attempt of `task`; true when that quarantines it
    /// (false when it was quarantined before).
    fn task_failed(&mut self, task: TaskRef) -> bool {
        if self.quarantined.contains(&task.index) {
            return false;
        }
        let max = self.params.max_task_attempts;
        let n = self.failures.entry(task.index).or_insert(0);
        *n += 1;
        if max > 0 && *n >= max {
            self.failures.remove(&task.index);
            self.quarantined.insert(task.index);
            self.queue.retain(|t| t.index != task.index);
            return true;
        }
        false
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

    /// The highest data set epoch that is closed: none of its tasks is
    /// queued, leased or among the remembered completions, and the cursor
    /// is past it. No attempt of a closed epoch is issued again, nor is a
    /// completion or drop of one acted on, so a group of it the buffer has
    /// not kept is a late copy. None while epoch 0 is open. It only rises
    /// while this state is kept: a task goes back to the queue only from a
    /// live lease or a remembered completion.
    pub fn closed_epoch(&self) -> Option<u64> {
        let open = self
            .queue
            .iter()
            .map(|t| t.epoch)
            .chain(self.leases.values().map(|l| l.task.epoch))
            .chain(
                self.completed
                    .values()
                    .filter(|c| !c.dropped)
                    .map(|c| c.task.epoch),
            )
            .fold(self.epoch, u64::min);
        open.checked_sub(1)
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

    /// The next task to issue: a re-issued one, else the cursor's (past
    /// quarantined tasks). None when every task is quarantined.
    fn next_task(&mut self) -> Option<TaskRef> {
        if let Some(t) = self.queue.pop_front() {
            return Some(t);
        }
        if self.quarantined.len() as u64 >= self.dataset_len {
            return None;
        }
        loop {
            let t = TaskRef {
                index: self.cursor,
                epoch: self.epoch,
            };
            self.cursor += 1;
            if self.cursor >= self.dataset_len {
                self.cursor = 0;
                self.epoch += 1;
            }
            if !self.quarantined.contains(&t.index) {
                // A new epoch's issue: the failures of earlier ones are
                // history (a completed attempt may still be refused, so a
                // completion does not clear them).
                self.failures.remove(&t.index);
                return Some(t);
            }
        }
    }

    /// Admits up to `n` tasks for `worker`, as far as the staleness bound
    /// allows. Returns the grants (possibly none).
    pub fn acquire(&mut self, worker: &str, n: u32, eta: u32, now_ms: i64) -> Vec<Grant> {
        let room = self.capacity(eta).max(0) as u64;
        let k = u64::from(n).min(room);
        let worker = self.worker_id(worker);
        let mut grants = Vec::with_capacity(k as usize);
        for _ in 0..k {
            let Some(task) = self.next_task() else {
                break;
            };
            let seq = self.next_seq;
            self.next_seq += 1;
            let lease = Lease::new(
                seq,
                task,
                worker.clone(),
                self.version,
                now_ms,
                now_ms + self.params.lease_timeout_ms,
            );
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

    /// The shared id of `worker`.
    fn worker_id(&mut self, worker: &str) -> Arc<str> {
        if let Some(w) = self.worker_ids.get(worker) {
            return w.clone();
        }
        if self.worker_ids.len() >= self.worker_ids_bound {
            // Held only by the set: no lease or completion refers to it.
            self.worker_ids.retain(|w| Arc::strong_count(w) > 1);
            self.worker_ids_bound = (2 * self.worker_ids.len()).max(MIN_WORKER_IDS_BOUND);
        }
        let w: Arc<str> = Arc::from(worker);
        self.worker_ids.insert(w.clone());
        w
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

    /// The buffer dropped a group. A group never trained on (`kind` not
    /// [`DropKind::Ignored`]) of a remembered completion gives its capacity
    /// back; after a stale or refused drop its task is issued again (front
    /// of the queue), after a no-signal drop it is done. A stale drop is
    /// counted in `stale_dropped_total` when it is acted on: a report
    /// delivered again (the coordinator acks one only once its effect is
    /// written) finds its completion gone, or marked dropped, and is
    /// neither acted on nor counted twice, and neither is one whose
    /// completion was forgotten (`Unknown`). A refused group is a failed
    /// attempt of its task.
    pub fn on_group_dropped(&mut self, group_id: &str, kind: DropKind) -> Dropped {
        if kind == DropKind::Ignored {
            return Dropped::Ignored;
        }
        let seq = self.parse_lease(group_id);
        if let Some(k) = seq.and_then(|seq| self.completed_seqs.get(&seq))
            && self.completed.get(k).is_some_and(|c| c.dropped)
        {
            return Dropped::AlreadyDropped;
        }
        let Some(c) = seq
            .and_then(|seq| self.completed_seqs.remove(&seq))
            .and_then(|k| self.completed.remove(&k))
        else {
            // The report can overtake the completion (the buffer stores
            // the group as soon as its trajectories are acked): the
            // completion, when it comes, is not counted and gives the task
            // back (or, for no signal, ends it) instead.
            if let Some(seq) = seq.filter(|s| self.leases.contains_key(s)) {
                if self.dropped_early.insert(seq, kind).is_none() && kind == DropKind::Stale {
                    self.stale_dropped_total += 1;
                }
                return Dropped::BeforeCompletion;
            }
            return Dropped::Unknown;
        };
        let floor = self.consumed_floor();
        self.accepted = self.accepted.saturating_sub(1).max(floor);
        match kind {
            DropKind::Stale => self.stale_dropped_total += 1,
            DropKind::Refused if self.task_failed(c.task) => {
                return Dropped::Quarantined(c.task);
            }
            DropKind::NoSignal => return Dropped::Freed(c.task),
            DropKind::Refused | DropKind::Ignored => {}
        }
        if self.quarantined.contains(&c.task.index) {
            // An attempt granted before its task was quarantined.
            return Dropped::Ignored;
        }
        self.queue.push_front(c.task);
        Dropped::Requeued(c.task)
    }
}
