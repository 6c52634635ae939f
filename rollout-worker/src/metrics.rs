//! The worker's metrics (`asyncrl_worker_*`).
//!
//! Registered with [`Metrics::get_or_register`], so several workers in one
//! process (the local mode) share one set, and a test can get the same
//! handles by calling [`WorkerMetrics::new`] on the registry it gave the
//! worker.

use asyncrl_telemetry::Metrics;
use asyncrl_telemetry::TelemetryError;
use asyncrl_telemetry::prometheus_client::metrics::counter::Counter;
use asyncrl_telemetry::prometheus_client::metrics::family::Family;
use asyncrl_telemetry::prometheus_client::metrics::gauge::Gauge;
use asyncrl_telemetry::prometheus_client::metrics::histogram::{
    Histogram, exponential_buckets, linear_buckets,
};
use std::sync::atomic::AtomicU64;

/// Label set `reason="..."`.
pub type ReasonLabels = Vec<(String, String)>;

/// Handles to the worker's metrics.
#[derive(Clone, Debug)]
pub struct WorkerMetrics {
    /// Tokens sampled by the model thread (rate() = tokens/s).
    pub tokens_generated: Counter,
    /// Prompt positions the engine took from another sequence's KV cache
    /// instead of computing them (prompt sharing).
    pub prompt_tokens_shared: Counter,
    /// Tokens/s over the last sampling interval.
    pub tokens_per_second: Gauge<f64, AtomicU64>,
    /// Sequences submitted and not finished generating.
    pub sequences_in_flight: Gauge,
    /// Sequences in the decode batch (the rest wait for a slot).
    pub batch_occupancy: Gauge,
    /// Tasks held (generating, scoring or publishing).
    pub tasks_in_flight: Gauge,
    /// Lease grant to CompleteTask accepted.
    pub task_latency_seconds: Histogram,
    pub tasks_completed: Counter,
    /// Tasks handed back to the coordinator (drain, failures), by reason.
    pub tasks_returned: Family<ReasonLabels, Counter>,
    /// Leases the coordinator revoked while the worker held them.
    pub tasks_revoked: Counter,
    /// CompleteTask answered "not accepted" (the lease had expired).
    pub completions_refused: Counter,
    /// Sequences dropped before they finished (revocation, drain deadline, a
    /// failed sibling).
    pub sequences_cancelled: Counter,
    pub trajectories_published: Counter,
    /// Published trajectories by why their completion ended (`stop`,
    /// `length`, `stop_string`, and an episode's `max_turns`,
    /// `episode_length`, `tool_call_unreadable`).
    pub completions_finished: Family<ReasonLabels, Counter>,
    /// Multi-turn episodes by how they ended: a finish reason, or
    /// `environment_failed` (the task goes back), `cancelled`, `failed`.
    pub episodes_finished: Family<ReasonLabels, Counter>,
    /// Model replies per finished episode.
    pub episode_turns: Histogram,
    /// Durable publishes retried after a transient error.
    pub publish_retries: Counter,
    /// The weight version in use.
    pub policy_version: Gauge,
    /// The newest version fetched and verified (swapped in next).
    pub weights_fetched_version: Gauge,
    /// The newest version announced by the learner.
    pub weights_announced_version: Gauge,
    pub weight_swaps: Counter,
    /// Announcement (`published_at_unix_ms`) to the weights in use.
    pub weight_swap_latency_seconds: Histogram,
    /// Failed weight fetches or loads, by reason (checksum, timeout,
    /// not_found, transport, format, load).
    pub weight_fetch_failures: Family<ReasonLabels, Counter>,
    pub reward_latency_seconds: Histogram,
    /// Completions whose reward could not be computed (marked FAILED).
    pub reward_failures: Counter,
    /// At publish: announced version minus the oldest version of the
    /// trajectory's tokens.
    pub version_lag: Histogram,
    /// Failed coordinator requests, by subject.
    pub coordinator_errors: Family<ReasonLabels, Counter>,
    /// Failed engine calls (external engines), by reason (unreachable,
    /// status, malformed, contract, swap).
    pub engine_errors: Family<ReasonLabels, Counter>,
    /// Engine servers restarted or re-attached after going down.
    pub engine_recoveries: Counter,
    /// Engine servers ready to generate now.
    pub engine_servers_ready: Gauge,
    /// Generation requests resubmitted (prompt + partial tokens) after a
    /// weight swap aborted them.
    pub engine_resubmissions: Counter,
}

pub(crate) fn reason(value: &str) -> ReasonLabels {
    vec![("reason".to_owned(), value.to_owned())]
}

impl WorkerMetrics {
    /// Registers (or finds) the worker's metrics in `m`.
    pub fn new(m: &Metrics) -> Result<Self, TelemetryError> {
        let seconds = || Histogram::new(exponential_buckets(0.001, 2.0, 20));
        Ok(Self {
            tokens_generated: m.get_or_register(
                "worker_tokens_generated",
                "Tokens sampled by the worker's model",
                Counter::default,
            )?,
            prompt_tokens_shared: m.get_or_register(
                "worker_prompt_tokens_shared",
                "Prompt positions taken from another sequence's KV cache instead of computed",
                Counter::default,
            )?,
            tokens_per_second: m.get_or_register(
                "worker_tokens_per_second",
                "Tokens sampled per second over the last metrics interval",
                Gauge::<f64, AtomicU64>::default,
            )?,
            sequences_in_flight: m.get_or_register(
                "worker_sequences_in_flight",
                "Sequences submitted to the model and not finished",
                Gauge::default,
            )?,
            batch_occupancy: m.get_or_register(
                "worker_batch_occupancy",
                "Sequences in the continuous decode batch",
                Gauge::default,
            )?,
            tasks_in_flight: m.get_or_register(
                "worker_tasks_in_flight",
                "Tasks held by the worker",
                Gauge::default,
            )?,
            task_latency_seconds: m.get_or_register(
                "worker_task_latency_seconds",
                "Lease grant to accepted completion of a task",
                seconds,
            )?,
            tasks_completed: m.get_or_register(
                "worker_tasks_completed",
                "Tasks completed (all G trajectories acked, CompleteTask accepted)",
                Counter::default,
            )?,
            tasks_returned: m.get_or_register(
                "worker_tasks_returned",
                "Tasks returned to the coordinator unfinished",
                Family::<ReasonLabels, Counter>::default,
            )?,
            tasks_revoked: m.get_or_register(
                "worker_tasks_revoked",
                "Leases revoked by the coordinator while held",
                Counter::default,
            )?,
            completions_refused: m.get_or_register(
                "worker_completions_refused",
                "CompleteTask requests the coordinator refused",
                Counter::default,
            )?,
            sequences_cancelled: m.get_or_register(
                "worker_sequences_cancelled",
                "Sequences cancelled before they finished",
                Counter::default,
            )?,
            trajectories_published: m.get_or_register(
                "worker_trajectories_published",
                "Trajectories acked by the trajectory stream",
                Counter::default,
            )?,
            completions_finished: m.get_or_register(
                "worker_completions_finished",
                "Published completions by why they ended (reason: stop, length, stop_string)",
                Family::<ReasonLabels, Counter>::default,
            )?,
            episodes_finished: m.get_or_register(
                "worker_episodes_finished",
                "Multi-turn episodes by how they ended (a finish reason, environment_failed, cancelled, failed)",
                Family::default,
            )?,
            episode_turns: m.get_or_register(
                "worker_episode_turns",
                "Model replies per finished multi-turn episode",
                || Histogram::new(linear_buckets(1.0, 1.0, 16)),
            )?,
            publish_retries: m.get_or_register(
                "worker_publish_retries",
                "Trajectory publishes retried after a transient error",
                Counter::default,
            )?,
            policy_version: m.get_or_register(
                "worker_policy_version",
                "Policy version of the weights in use",
                Gauge::default,
            )?,
            weights_fetched_version: m.get_or_register(
                "worker_weights_fetched_version",
                "Newest weight version fetched and verified",
                Gauge::default,
            )?,
            weights_announced_version: m.get_or_register(
                "worker_weights_announced_version",
                "Newest weight version announced by the learner",
                Gauge::default,
            )?,
            weight_swaps: m.get_or_register(
                "worker_weight_swaps",
                "Weight swaps",
                Counter::default,
            )?,
            weight_swap_latency_seconds: m.get_or_register(
                "worker_weight_swap_latency_seconds",
                "Weight announcement to the new weights in use",
                seconds,
            )?,
            weight_fetch_failures: m.get_or_register(
                "worker_weight_fetch_failures",
                "Failed weight fetches or loads (old weights kept)",
                Family::<ReasonLabels, Counter>::default,
            )?,
            reward_latency_seconds: m.get_or_register(
                "worker_reward_latency_seconds",
                "Time to score one completion",
                seconds,
            )?,
            reward_failures: m.get_or_register(
                "worker_reward_failures",
                "Completions whose reward failed (published as REWARD_STATUS_FAILED)",
                Counter::default,
            )?,
            version_lag: m.get_or_register(
                "worker_version_lag",
                "Announced version minus the oldest token version, at publish",
                || Histogram::new(linear_buckets(0.0, 1.0, 17)),
            )?,
            coordinator_errors: m.get_or_register(
                "worker_coordinator_errors",
                "Failed requests to the coordinator, by request",
                Family::<ReasonLabels, Counter>::default,
            )?,
            engine_errors: m.get_or_register(
                "worker_engine_errors",
                "Failed calls to the inference engine, by reason",
                Family::<ReasonLabels, Counter>::default,
            )?,
            engine_recoveries: m.get_or_register(
                "worker_engine_recoveries",
                "Engine servers restarted or re-attached after going down",
                Counter::default,
            )?,
            engine_servers_ready: m.get_or_register(
                "worker_engine_servers_ready",
                "Engine servers ready to generate",
                Gauge::default,
            )?,
            engine_resubmissions: m.get_or_register(
                "worker_engine_resubmissions",
                "Generation requests resubmitted after a weight swap aborted them",
                Counter::default,
            )?,
        })
    }

    /// Total of a reason-labelled counter family over every reason.
    pub fn family_total(family: &Family<ReasonLabels, Counter>, reasons: &[&str]) -> u64 {
        reasons
            .iter()
            .map(|r| family.get_or_create(&reason(r)).get())
            .sum()
    }
}

/// Reasons of [`WorkerMetrics::weight_fetch_failures`].
pub const WEIGHT_FAILURE_REASONS: &[&str] = &[
    "checksum",
    "timeout",
    "not_found",
    "transport",
    "format",
    "load",
];
