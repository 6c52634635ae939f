//! The coordinator's metrics, registered in the process registry
//! (`asyncrl_` prefix).

use std::sync::atomic::AtomicU64;

use asyncrl_telemetry::{Metrics, TelemetryError};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerLabel {
    pub worker: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    pub state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KnobLabel {
    pub knob: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DatasetLabel {
    pub dataset: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BadRequestLabel {
    pub subject: String,
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    pub outcome: String,
}

type GaugeF = Gauge<f64, AtomicU64>;

/// Handles of every coordinator metric.
#[derive(Clone, Debug)]
pub struct CoordinatorMetrics {
    pub policy_version: Gauge,
    pub capacity_left: Gauge,
    pub accepted_groups: Gauge,
    pub running_groups: Gauge,
    pub requeued_tasks: Gauge,
    pub epoch: Gauge,
    pub tasks_admitted: Counter,
    pub tasks_completed: Counter,
    pub tasks_expired: Counter,
    pub tasks_returned: Counter,
    /// Tasks quarantined after `coordinator.max_task_attempts` failed
    /// attempts, by the kind of the last one (`returned`, `refused`).
    pub tasks_quarantined: Family<ReasonLabel, Counter>,
    /// Tasks quarantined so far (persisted with the state).
    pub tasks_quarantined_now: Gauge,
    pub completions_refused: Family<ReasonLabel, Counter>,
    /// Worker requests refused before they touched any state (payload
    /// does not decode, bad worker id, impossible field), by subject.
    pub bad_requests: Family<BadRequestLabel, Counter>,
    pub acquire_denied: Family<ReasonLabel, Counter>,
    pub worker_heartbeat_age: Family<WorkerLabel, GaugeF>,
    pub workers: Family<StateLabel, Gauge>,
    pub knob: Family<KnobLabel, GaugeF>,
    pub knob_requests: Family<OutcomeLabel, Counter>,
    pub stale_dropped: Counter,
    pub groups_dropped: Family<ReasonLabel, Counter>,
    pub learner_restarts: Counter,
    pub rollout_workers_recommended: GaugeF,
    pub worker_groups_per_second: GaugeF,
    pub learner_step_seconds: GaugeF,
    pub weight_dissemination_seconds: GaugeF,
    pub state_persist_seconds: Histogram,
    pub state_bytes: Gauge,
    /// Tasks loaded per data set.
    pub dataset_tasks: Family<DatasetLabel, Gauge>,
    /// Rows left out at load time as over `max_prompt_tokens`.
    pub dataset_long_prompts_skipped: Family<DatasetLabel, Gauge>,
}

impl CoordinatorMetrics {
    pub fn register(m: &Metrics) -> Result<Self, TelemetryError> {
        Ok(Self {
            policy_version: m.register(
                "policy_version",
                "Learner policy version the coordinator admits against",
                Gauge::default(),
            )?,
            capacity_left: m.register(
                "capacity_left",
                "(eta + v + 1) * B - accepted - running: tasks that may still be admitted",
                Gauge::default(),
            )?,
            accepted_groups: m.register(
                "accepted_groups",
                "Groups completed and counted by the admission rule",
                Gauge::default(),
            )?,
            running_groups: m.register(
                "running_groups",
                "Groups leased and not finished",
                Gauge::default(),
            )?,
            requeued_tasks: m.register(
                "requeued_tasks",
                "Tasks waiting at the front of the queue (expired or returned leases)",
                Gauge::default(),
            )?,
            epoch: m.register("task_epoch", "Epoch of the task cursor", Gauge::default())?,
            tasks_admitted: m.register(
                "tasks_admitted",
                "Tasks admitted (leases granted)",
                Counter::default(),
            )?,
            tasks_completed: m.register(
                "tasks_completed",
                "Task completions accepted",
                Counter::default(),
            )?,
            tasks_expired: m.register(
                "tasks_expired",
                "Leases that expired (no heartbeat, or their worker died); the task is issued again",
                Counter::default(),
            )?,
            tasks_returned: m.register(
                "tasks_returned",
                "Leases handed back by workers (draining, or the task failed)",
                Counter::default(),
            )?,
            tasks_quarantined: m.register(
                "tasks_quarantined",
                "Tasks quarantined after coordinator.max_task_attempts failed attempts (never issued again), by the kind of the last attempt",
                Family::default(),
            )?,
            tasks_quarantined_now: m.register(
                "tasks_quarantined_current",
                "Tasks of the data set that are quarantined (never issued again)",
                Gauge::default(),
            )?,
            dataset_tasks: m.register(
                "dataset_tasks",
                "Tasks loaded per data set",
                Family::default(),
            )?,
            dataset_long_prompts_skipped: m.register(
                "dataset_long_prompts_skipped",
                "Rows of a data set left out at load time because their prompt is over max_prompt_tokens",
                Family::default(),
            )?,
            bad_requests: m.register(
                "coordinator_bad_requests",
                "Worker requests refused as malformed or invalid, by subject and reason",
                Family::default(),
            )?,
            completions_refused: m.register(
                "completions_refused",
                "Task completions refused, by reason",
                Family::default(),
            )?,
            acquire_denied: m.register(
                "acquire_denied",
                "Acquire requests that got no task, by reason",
                Family::default(),
            )?,
            worker_heartbeat_age: m.register(
                "worker_heartbeat_age_seconds",
                "Seconds since each worker was last heard from",
                Family::default(),
            )?,
            workers: m.register(
                "workers",
                "Registered workers by state (alive, dead, draining)",
                Family::default(),
            )?,
            knob: m.register(
                "knob_value",
                "Live knob values in effect for the learner's current step (clip_mode: 1 ppo, 2 adaptive, 3 m2po, 4 gspo; importance_correction: 1 mask, 2 truncate, 3 icepop)",
                Family::default(),
            )?,
            knob_requests: m.register(
                "knob_requests",
                "Control requests (knobs, pause, resume, checkpoint) by outcome",
                Family::default(),
            )?,
            // The buffer reports stale drops; in a one-process run the buffer
            // may share this counter, so take the existing one if there is one.
            stale_dropped: m.get_or_register(
                "stale_dropped",
                "Groups dropped for staleness, as the buffer reports them",
                Counter::default,
            )?,
            groups_dropped: m.register(
                "groups_dropped_reported",
                "Groups the buffer reported dropped, by reason",
                Family::default(),
            )?,
            learner_restarts: m.register(
                "learner_restarts",
                "Learner restarts seen (a new learner session, or its version going down)",
                Counter::default(),
            )?,
            rollout_workers_recommended: m.register(
                "rollout_workers_recommended",
                "Rollout workers that keep the learner busy: ceil(B / (r * (T - D)))",
                GaugeF::default(),
            )?,
            worker_groups_per_second: m.register(
                "capacity_worker_groups_per_second",
                "Capacity model input r: groups/s of one worker kept full",
                GaugeF::default(),
            )?,
            learner_step_seconds: m.register(
                "capacity_learner_step_seconds",
                "Capacity model input T: learner step time",
                GaugeF::default(),
            )?,
            weight_dissemination_seconds: m.register(
                "capacity_weight_dissemination_seconds",
                "Capacity model input D: weight announce to in-use latency",
                GaugeF::default(),
            )?,
            state_persist_seconds: m.register(
                "coordinator_state_persist_seconds",
                "Time to write the coordinator state to the KV bucket",
                Histogram::new(exponential_buckets(0.0001, 2.0, 16)),
            )?,
            state_bytes: m.register(
                "coordinator_state_bytes",
                "Size of the persisted coordinator state",
                Gauge::default(),
            )?,
        })
    }

    /// Counts a task quarantined after a failed attempt of kind `reason`.
    pub fn quarantined(&self, reason: &str) {
        Self::reason(&self.tasks_quarantined, reason);
    }

    pub fn reason(family: &Family<ReasonLabel, Counter>, reason: &str) {
        family
            .get_or_create(&ReasonLabel {
                reason: reason.to_owned(),
            })
            .inc();
    }
}
