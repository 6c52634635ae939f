//! The life of a lease after its grant: completion (checked against the
//! lease, the task, the worker and the group size), expiry, returns, dead
//! workers and heartbeats, and the memory of recent completions and ended
//! leases that lets a refusal say why.

use super::{CompleteRefusal, Completed, Completion, EXPIRED_MEMORY, Ended, Scheduler};

impl Scheduler {
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
        if let Some(kind) = self.dropped_early.remove(&seq) {
            // Remembered without counting, as dropped: a retry is answered
            // as done, and the report delivered again changes nothing.
            self.remember_completed(Completed::new(seq, lease.task, lease.worker.clone(), true));
            let requeued = kind.reissues() && !self.quarantined.contains(&lease.task.index);
            if requeued {
                self.queue.push_front(lease.task);
            }
            return Ok(Completion::DroppedBefore {
                lease,
                kind,
                requeued,
            });
        }
        self.accepted += 1;
        self.completed_total += 1;
        self.remember_completed(Completed::new(seq, lease.task, lease.worker.clone(), false));
        Ok(Completion::Accepted { lease })
    }

    pub(super) fn remember_completed(&mut self, c: Completed) {
        if self.params.completed_memory == 0 {
            return;
        }
        let k = self.completed_counter;
        self.completed_counter += 1;
        self.completed_seqs.insert(c.seq, k);
        self.completed.insert(k, c);
        self.trim_completed();
    }

    pub(super) fn trim_completed(&mut self) {
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
    /// oldest lease first. With `failed`, each is a failed attempt of its
    /// task, and a task that failed `max_task_attempts` times is
    /// quarantined instead.
    fn end_leases(
        &mut self,
        mut seqs: Vec<u64>,
        now_ms: i64,
        reason: &'static str,
        failed: bool,
    ) -> Vec<Ended> {
        seqs.sort_unstable();
        let mut ended = Vec::with_capacity(seqs.len());
        for seq in seqs {
            if let Some(lease) = self.leases.remove(&seq) {
                self.dropped_early.remove(&seq);
                self.remember_ended(seq, now_ms, reason);
                let quarantined = failed && self.task_failed(lease.task);
                ended.push(Ended {
                    lease_id: self.lease_id(seq),
                    lease,
                    quarantined,
                });
            }
        }
        // A task quarantined now, or before this attempt ended, is not
        // issued again.
        for e in ended.iter().rev() {
            if !self.quarantined.contains(&e.lease.task.index) {
                self.queue.push_front(e.lease.task);
            }
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
        let ended = self.end_leases(due, now_ms, "expired", false);
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
        let ended = self.end_leases(seqs, now_ms, "expired (worker dead)", false);
        self.expired_total += ended.len() as u64;
        ended
    }

    /// A worker hands back leases (draining, or it could not do them);
    /// returns those that were its own. `task_failed`: the worker says the
    /// tasks themselves failed (a prompt it cannot render or fit, an
    /// episode its environment failed), which counts toward quarantine.
    pub fn return_leases(
        &mut self,
        worker: &str,
        lease_ids: &[String],
        now_ms: i64,
        task_failed: bool,
    ) -> Vec<Ended> {
        let seqs: Vec<u64> = lease_ids
            .iter()
            .filter_map(|id| self.parse_lease(id))
            .filter(|s| self.leases.get(s).is_some_and(|l| &*l.worker == worker))
            .collect();
        self.end_leases(seqs, now_ms, "was returned", task_failed)
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
}
