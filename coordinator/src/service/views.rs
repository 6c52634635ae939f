//! What the actor shows: the status and worker list of the admin API, the
//! knobs in effect, the capacity model's recommendation and the metrics.

use asyncrl_protos::v1::{GetKnobsReply, ListWorkersReply, StatusReply, WorkerInfo};

use super::actor::Actor;
use crate::capacity::{WorkerView, recommended_workers};
use crate::knobs;
use crate::metrics::{KnobLabel, StateLabel, WorkerLabel};

/// The admission knobs in effect: the staleness bound η and whether
/// admission is paused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Admission {
    pub(super) eta: u32,
    pub(super) paused: bool,
}

impl Actor {
    /// The admission knobs in effect for the current step.
    pub(super) fn admission(&self) -> Admission {
        let k = knobs::effective(&self.schedule, self.current_step());
        Admission {
            eta: k.eta.unwrap_or(0),
            paused: k.paused.unwrap_or(false),
        }
    }

    pub(super) fn current_step(&self) -> u64 {
        self.sched.version().max(0) as u64 + 1
    }

    pub(super) fn status(&self) -> StatusReply {
        let Admission { eta, paused } = self.admission();
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

    /// The knobs in effect and the changes still to come.
    pub(super) fn knobs_view(&self) -> GetKnobsReply {
        let current = self.current_step();
        GetKnobsReply {
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
        }
    }

    pub(super) fn workers(&self) -> ListWorkersReply {
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

    pub(super) fn update_capacity_model(&mut self) {
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

    /// The gauges of the scheduler's counts: after every batch of events.
    pub(super) fn update_metrics(&self) {
        let m = &self.metrics;
        let eta = self.admission().eta;
        m.policy_version.set(i64::from(self.sched.version()));
        m.capacity_left.set(self.sched.capacity(eta));
        m.accepted_groups.set(self.sched.accepted() as i64);
        m.running_groups.set(self.sched.running() as i64);
        m.requeued_tasks.set(self.sched.queue_len() as i64);
        m.epoch.set(self.sched.epoch() as i64);
    }

    /// The gauges per worker and per knob (a labelled series each): at
    /// start, on every tick and after the events that change them other
    /// than heartbeats, not per request.
    pub(super) fn update_labelled_metrics(&self) {
        let m = &self.metrics;
        let now = self.clock.now_unix_ms();
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
