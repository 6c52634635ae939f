//! The scheduler's persisted form (`coordinator.state` in the KV bucket):
//! written with the workers interned, read back with the checks that the
//! state belongs to this data set and format.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint, string};

use asyncrl_protos::v1::{
    CompletedLease, CoordinatorState, PersistedLease, TaskFailures, TaskRef as TaskRefProto,
};

use super::{Completed, Lease, STATE_FORMAT, Scheduler, SchedulerParams, StateError, TaskRef};

impl Scheduler {
    /// The persisted form.
    pub fn to_proto(&self) -> CoordinatorState {
        let mut workers = Interner::default();
        let leases = self
            .leases
            .values()
            .map(|l| PersistedLease {
                seq: l.seq,
                index: l.task.index,
                epoch: l.task.epoch,
                worker: workers.index(&l.worker),
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
                worker: workers.index(&c.worker),
                dropped: c.dropped,
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
            workers: workers.names.iter().map(|w| w.to_string()).collect(),
            stale_dropped_total: self.stale_dropped_total,
            admitted_total: self.admitted_total,
            completed_total: self.completed_total,
            expired_total: self.expired_total,
            quarantined: self.quarantined.iter().copied().collect(),
            failures: self
                .failures
                .iter()
                .map(|(&index, &count)| TaskFailures { index, count })
                .collect(),
        }
    }

    /// The persisted form, encoded (what every state write costs): each
    /// lease and completion copies its fields encoded at its creation and
    /// adds its worker's index, so the message is not built first. The
    /// bytes decode to [`Scheduler::to_proto`]; within a lease the worker
    /// comes last, which protobuf allows (fields in any order).
    pub fn encode_state(&self) -> Vec<u8> {
        let mut buf = Vec::with_capacity(
            256 + 24 * (self.leases.len() + self.completed.len() + self.queue.len()),
        );
        let mut workers = Interner::default();
        put(&mut buf, 1, u64::from(STATE_FORMAT));
        put_str(&mut buf, 2, &self.lease_prefix);
        put(&mut buf, 3, self.next_seq);
        put_str(&mut buf, 4, &self.fingerprint);
        put(&mut buf, 5, self.dataset_len);
        put(&mut buf, 6, self.epoch);
        put(&mut buf, 7, self.cursor);
        for t in &self.queue {
            let len = field_len(t.index) + field_len(t.epoch);
            encode_key(8, WireType::LengthDelimited, &mut buf);
            encode_varint(len as u64, &mut buf);
            put(&mut buf, 1, t.index);
            put(&mut buf, 2, t.epoch);
        }
        for l in self.leases.values() {
            put_entry(&mut buf, 9, &l.persisted, workers.index(&l.worker));
        }
        put(&mut buf, 10, self.accepted);
        put(&mut buf, 11, i64::from(self.version) as u64);
        put_str(&mut buf, 12, &self.learner_session);
        for c in self.completed.values() {
            put_entry(&mut buf, 13, &c.persisted, workers.index(&c.worker));
        }
        for w in &workers.names {
            encode_key(14, WireType::LengthDelimited, &mut buf);
            encode_varint(w.len() as u64, &mut buf);
            buf.extend_from_slice(w.as_bytes());
        }
        put(&mut buf, 15, self.stale_dropped_total);
        put(&mut buf, 16, self.admitted_total);
        put(&mut buf, 17, self.completed_total);
        put(&mut buf, 18, self.expired_total);
        if !self.quarantined.is_empty() {
            let len: usize = self
                .quarantined
                .iter()
                .map(|i| encoded_len_varint(*i))
                .sum();
            encode_key(19, WireType::LengthDelimited, &mut buf);
            encode_varint(len as u64, &mut buf);
            for i in &self.quarantined {
                encode_varint(*i, &mut buf);
            }
        }
        for (&index, &count) in &self.failures {
            let len = field_len(index) + field_len(u64::from(count));
            encode_key(20, WireType::LengthDelimited, &mut buf);
            encode_varint(len as u64, &mut buf);
            put(&mut buf, 1, index);
            put(&mut buf, 2, u64::from(count));
        }
        buf
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
                Lease::new(
                    l.seq,
                    task(l.index, l.epoch)?,
                    worker(l.worker)?,
                    l.admission_version,
                    l.granted_at_unix_ms,
                    now_ms + s.params.lease_timeout_ms,
                ),
            );
        }
        for c in &state.completed {
            s.remember_completed(Completed::new(
                c.seq,
                task(c.index, c.epoch)?,
                worker(c.worker)?,
                c.dropped,
            ));
        }
        s.accepted = state.accepted;
        s.version = state.learner_version;
        s.learner_session = state.learner_session.clone();
        s.stale_dropped_total = state.stale_dropped_total;
        s.admitted_total = state.admitted_total;
        s.completed_total = state.completed_total;
        s.expired_total = state.expired_total;
        for &index in &state.quarantined {
            task(index, 0)?;
            s.quarantined.insert(index);
        }
        for f in &state.failures {
            task(f.index, 0)?;
            s.failures.insert(f.index, f.count);
        }
        Ok(s)
    }

    /// Whether two schedulers hold the same persisted state (deadlines and
    /// the not-persisted memory of ended leases aside).
    pub fn same_state(&self, other: &Scheduler) -> bool {
        self.to_proto() == other.to_proto()
    }
}

/// The varint fields of a lease or completion but its worker, encoded
/// (protobuf: a field left out when zero).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Fields(Box<[u8]>);

impl Fields {
    pub(super) fn new(fields: &[(u32, u64)]) -> Self {
        let mut buf = Vec::with_capacity(fields.len() * 6);
        for (tag, v) in fields {
            put(&mut buf, *tag, *v);
        }
        Self(buf.into_boxed_slice())
    }
}

/// Length of a varint field (none when zero).
fn field_len(v: u64) -> usize {
    if v == 0 { 0 } else { 1 + encoded_len_varint(v) }
}

/// Writes a varint field (none when zero).
fn put(buf: &mut Vec<u8>, tag: u32, v: u64) {
    if v != 0 {
        encode_key(tag, WireType::Varint, buf);
        encode_varint(v, buf);
    }
}

fn put_str(buf: &mut Vec<u8>, tag: u32, v: &String) {
    if !v.is_empty() {
        string::encode(tag, v, buf);
    }
}

/// Writes a lease or completion: its encoded fields, then its worker
/// (field 4).
fn put_entry(buf: &mut Vec<u8>, tag: u32, fields: &Fields, worker: u32) {
    let worker = u64::from(worker);
    encode_key(tag, WireType::LengthDelimited, buf);
    encode_varint((fields.0.len() + field_len(worker)) as u64, buf);
    buf.extend_from_slice(&fields.0);
    put(buf, 4, worker);
}

/// The workers of the persisted form, in order of first reference. Workers
/// share one id each (`Scheduler::worker_id`): interned by pointer, by name
/// only the first time a pointer is seen.
#[derive(Default)]
struct Interner<'a> {
    names: Vec<&'a str>,
    by_ptr: HashMap<usize, u32, BuildHasherDefault<PtrHasher>>,
    by_name: HashMap<&'a str, u32>,
}

impl<'a> Interner<'a> {
    fn index(&mut self, w: &'a Arc<str>) -> u32 {
        let ptr = Arc::as_ptr(w) as *const u8 as usize;
        let (names, by_name) = (&mut self.names, &mut self.by_name);
        *self.by_ptr.entry(ptr).or_insert_with(|| {
            *by_name.entry(w).or_insert_with(|| {
                names.push(w);
                (names.len() - 1) as u32
            })
        })
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
