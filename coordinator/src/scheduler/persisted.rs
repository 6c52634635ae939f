//! The scheduler's persisted form (`coordinator.state` in the KV bucket):
//! written with the workers interned, read back with the checks that the
//! state belongs to this data set and format.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

use asyncrl_protos::v1::{
    CompletedLease, CoordinatorState, PersistedLease, TaskRef as TaskRefProto,
};

use super::{Completed, Lease, STATE_FORMAT, Scheduler, SchedulerParams, StateError, TaskRef};

impl Scheduler {
    /// The persisted form.
    pub fn to_proto(&self) -> CoordinatorState {
        // Workers share one id each (`Scheduler::worker_id`): interned by
        // pointer, by name only the first time a pointer is seen.
        let mut workers: Vec<String> = Vec::new();
        let mut by_ptr: HashMap<usize, u32, BuildHasherDefault<PtrHasher>> = HashMap::default();
        let mut by_name: HashMap<Arc<str>, u32> = HashMap::new();
        let mut intern = |w: &Arc<str>, workers: &mut Vec<String>| -> u32 {
            let ptr = Arc::as_ptr(w) as *const u8 as usize;
            *by_ptr.entry(ptr).or_insert_with(|| {
                *by_name.entry(w.clone()).or_insert_with(|| {
                    workers.push(w.to_string());
                    (workers.len() - 1) as u32
                })
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
        let mut s = Scheduler::new(params, dataset_len, fingerprint, &state.lease_prefix);
        let workers: Vec<Arc<str>> = state.workers.iter().map(|w| s.worker_id(w)).collect();
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

/// Hashes a pointer (already well spread) with one multiplication.
#[derive(Default)]
struct PtrHasher(u64);

impl Hasher for PtrHasher {
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
    }

    fn write_usize(&mut self, n: usize) {
        self.0 = (n as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}
