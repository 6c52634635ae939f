//! The workers as the coordinator knows them ([`Fleet`]): the registry of
//! who registered and was heard from, the capacity model's estimates and its
//! recommendation, the worker list of the admin API and the per-worker
//! metrics.

use asyncrl_protos::v1::{ListWorkersReply, WorkerInfo};

use super::settings::Settings;
use crate::capacity::{CapacityEstimator, WorkerView, recommended_workers};
use crate::metrics::{CoordinatorMetrics, StateLabel, WorkerLabel};
use crate::registry::Registry;
use crate::scheduler::Scheduler;

pub(super) struct Fleet {
    pub(super) registry: Registry,
    pub(super) estimator: CapacityEstimator,
    /// The capacity model's last recommendation (None until it has its
    /// inputs).
    recommended: Option<f64>,
    metrics: CoordinatorMetrics,
}

impl Fleet {
    pub(super) fn new(metrics: CoordinatorMetrics) -> Self {
        Self {
            registry: Registry::new(),
            estimator: CapacityEstimator::new(),
            recommended: None,
            metrics,
        }
    }

    /// The capacity model's recommendation (None until it has its inputs).
    pub(super) fn recommended(&self) -> Option<f64> {
        self.recommended
    }

    /// The workers judged dead by their silence at `now` (heard nothing for
    /// `dead_after_ms`, counting only the time since `hearing_since_ms`).
    pub(super) fn sweep(
        &mut self,
        now: i64,
        dead_after_ms: i64,
        hearing_since_ms: i64,
    ) -> Vec<String> {
        self.registry
            .sweep(now, dead_after_ms, hearing_since_ms)
            .died
    }

    /// The worker list of the admin API, with the leases each holds.
    pub(super) fn workers(&self, sched: &Scheduler) -> ListWorkersReply {
        let mut leases: std::collections::HashMap<&str, u32> = std::collections::HashMap::new();
        for l in sched.leases() {
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

    pub(super) fn update_capacity_model(&mut self, settings: &Settings) {
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
            settings.groups_per_step,
            settings.group_size,
            settings.max_recommended_workers,
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

    /// The gauges per worker (a labelled series each) and of the workers
    /// per state.
    pub(super) fn update_metrics(&self, now: i64) {
        let m = &self.metrics;
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
    }
}
