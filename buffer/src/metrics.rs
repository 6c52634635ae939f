//! The buffer's metrics, registered in the process's one registry.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use asyncrl_telemetry::Metrics;
use asyncrl_telemetry::prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use asyncrl_telemetry::prometheus_client::metrics::counter::Counter;
use asyncrl_telemetry::prometheus_client::metrics::family::Family;
use asyncrl_telemetry::prometheus_client::metrics::gauge::Gauge;
use asyncrl_telemetry::prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use asyncrl_telemetry::prometheus_client::metrics::{MetricType, TypedMetric};

use crate::BufferError;

type Labels = Vec<(String, String)>;

/// A histogram of integer values that takes many observations of one value
/// at once: a served batch holds hundreds of thousands of tokens, observed
/// per distinct version lag rather than one by one.
#[derive(Clone, Debug)]
pub struct LagHistogram {
    /// Count per lag 0..=MAX_LAG; the last bucket also takes larger lags.
    counts: Arc<Vec<AtomicU64>>,
    sum: Arc<AtomicU64>,
}

impl LagHistogram {
    pub const MAX_LAG: usize = 16;

    fn new() -> Self {
        Self {
            counts: Arc::new((0..=Self::MAX_LAG + 1).map(|_| AtomicU64::new(0)).collect()),
            sum: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Records `n` observations of `lag` (negative lags count as 0).
    pub fn observe_n(&self, lag: i64, n: u64) {
        let lag = lag.max(0) as u64;
        let slot = (lag as usize).min(Self::MAX_LAG + 1);
        self.counts[slot].fetch_add(n, Ordering::Relaxed);
        self.sum.fetch_add(lag.saturating_mul(n), Ordering::Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    /// Observations of each lag 0..=MAX_LAG (and the overflow last).
    pub fn counts(&self) -> Vec<u64> {
        self.counts
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect()
    }
}

impl TypedMetric for LagHistogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for LagHistogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let counts = self.counts();
        let buckets: Vec<(f64, u64)> = counts
            .iter()
            .enumerate()
            .map(|(lag, n)| {
                let bound = if lag > Self::MAX_LAG {
                    f64::MAX
                } else {
                    lag as f64
                };
                (bound, *n)
            })
            .collect();
        encoder.encode_histogram::<NoLabelSet>(
            self.sum.load(Ordering::Relaxed) as f64,
            counts.iter().sum(),
            &buckets,
            None,
        )
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// Every metric the buffer exports (names get the `asyncrl_` prefix).
#[derive(Clone)]
pub struct BufferMetrics {
    pub ingested: Counter,
    pub duplicates: Counter,
    pub dead_lettered: Family<Labels, Counter>,
    pub superseded_trajectories: Counter,
    pub groups_dropped: Family<Labels, Counter>,
    /// `asyncrl_stale_dropped_total`: groups never served because they were
    /// older than `v − η`. Stays 0 while the coordinator's admission works.
    pub stale_dropped: Counter,
    /// Groups that became complete at ingest (the denominator of the
    /// fraction dynamic sampling drops).
    pub groups_completed: Counter,
    /// `asyncrl_buffer_no_signal_fraction`: groups dropped for no signal
    /// (`buffer.min_reward_spread`) per group completed, since the process
    /// started (0 while dynamic sampling is off).
    pub no_signal_fraction: Gauge<f64, AtomicU64>,
    pub ready_groups: Gauge,
    pub collecting_groups: Gauge,
    /// Completed tasks the buffer remembers (to drop late and repeated
    /// copies); bounded by the open epochs' tasks once the coordinator
    /// publishes closed epochs.
    pub remembered_tasks: Gauge,
    /// The highest data set epoch the coordinator has closed (-1: none).
    pub closed_epoch: Gauge,
    pub groups_served: Counter,
    pub batches_served: Counter,
    pub batches_replayed: Counter,
    /// Batch requests refused (a step already trained, or served before
    /// and released): a learner whose state disagrees with the buffer's.
    pub batches_refused: Counter,
    pub resident_bytes: Gauge,
    pub resident_bytes_per_token: Gauge<f64, AtomicU64>,
    pub disk_bytes: Gauge,
    pub segments_deleted: Counter,
    /// 1 while a write the buffer depends on fails (a full disk): ingest is
    /// stopped (nothing acked) or batches are refused; 0 otherwise.
    pub disk_write_blocked: Gauge,
    /// Failed disk writes by what was written (`segment_append`,
    /// `segment_fsync`, `segment_create`, `served_log`, `served_log_compact`);
    /// retries count again.
    pub disk_write_failures: Family<Labels, Counter>,
    /// Drop reports not yet stored in the `GROUP_DROPS` stream (their
    /// tasks wait for the coordinator to hear of them).
    pub drop_reports_pending: Gauge,
    /// Failed attempts to store a drop report (each is retried).
    pub drop_report_failures: Counter,
    pub served_token_staleness: LagHistogram,
    pub serve_latency: Histogram,
    pub segment_write_latency: Histogram,
}

impl BufferMetrics {
    /// Registers (or, when another buffer in this process did, shares) the
    /// buffer's metrics.
    pub fn register(m: &Metrics) -> Result<Self, BufferError> {
        Ok(Self {
            ingested: m.get_or_register(
                "buffer_ingested_trajectories",
                "Trajectories stored by the buffer (durably, before their ack)",
                Counter::default,
            )?,
            duplicates: m.get_or_register(
                "buffer_duplicates",
                "Trajectories dropped because their uuid was already held or trained on",
                Counter::default,
            )?,
            dead_lettered: m.get_or_register(
                "buffer_dead_lettered",
                "Messages sent to the dead-letter stream, by kind of problem",
                Family::<Labels, Counter>::default,
            )?,
            superseded_trajectories: m.get_or_register(
                "buffer_superseded_trajectories",
                "Trajectories dropped because another attempt of their task completed first",
                Counter::default,
            )?,
            groups_dropped: m.get_or_register(
                "buffer_groups_dropped",
                "Groups dropped, by reason (superseded, duplicate_attempt, stale, expired, quarantined, no_signal)",
                Family::<Labels, Counter>::default,
            )?,
            stale_dropped: m.get_or_register(
                "stale_dropped",
                "Groups never served because a token was older than v - eta (must stay 0 outside faults)",
                Counter::default,
            )?,
            groups_completed: m.get_or_register(
                "buffer_groups_completed",
                "Groups that became complete (all G trajectories stored) at ingest",
                Counter::default,
            )?,
            no_signal_fraction: m.get_or_register(
                "buffer_no_signal_fraction",
                "Fraction of the completed groups dropped for carrying no reward signal (dynamic sampling, buffer.min_reward_spread) since the start",
                Gauge::<f64, AtomicU64>::default,
            )?,
            ready_groups: m.get_or_register(
                "buffer_ready_groups",
                "Complete groups the buffer can serve",
                Gauge::default,
            )?,
            collecting_groups: m.get_or_register(
                "buffer_collecting_groups",
                "Groups with fewer than G trajectories so far",
                Gauge::default,
            )?,
            remembered_tasks: m.get_or_register(
                "buffer_remembered_tasks",
                "Completed tasks the buffer remembers to drop late and repeated copies of",
                Gauge::default,
            )?,
            closed_epoch: m.get_or_register(
                "buffer_closed_epoch",
                "The highest data set epoch the coordinator has closed (-1: none)",
                Gauge::default,
            )?,
            groups_served: m.get_or_register(
                "buffer_groups_served",
                "Groups served to the learner (replays not counted)",
                Counter::default,
            )?,
            batches_served: m.get_or_register(
                "buffer_batches_served",
                "Learner batches served (replays not counted)",
                Counter::default,
            )?,
            batches_replayed: m.get_or_register(
                "buffer_batches_replayed",
                "Learner batches served again for a repeated step",
                Counter::default,
            )?,
            batches_refused: m.get_or_register(
                "buffer_batches_refused",
                "Learner batch requests refused (the reply names why)",
                Counter::default,
            )?,
            resident_bytes: m.get_or_register(
                "buffer_resident_bytes",
                "Bytes of Arrow data the buffer holds in memory",
                Gauge::default,
            )?,
            resident_bytes_per_token: m.get_or_register(
                "buffer_resident_bytes_per_token",
                "Resident Arrow bytes per held token (prompt and completion)",
                Gauge::<f64, AtomicU64>::default,
            )?,
            disk_bytes: m.get_or_register(
                "buffer_disk_bytes",
                "Bytes of the buffer's segments on disk",
                Gauge::default,
            )?,
            segments_deleted: m.get_or_register(
                "buffer_segments_deleted",
                "Segments deleted by the retention policy",
                Counter::default,
            )?,
            disk_write_blocked: m.get_or_register(
                "buffer_disk_write_blocked",
                "1 while the buffer cannot write its segments or served log (ingest stopped or batches refused)",
                Gauge::default,
            )?,
            disk_write_failures: m.get_or_register(
                "buffer_disk_write_failures",
                "Failed disk writes of the buffer, by what was written",
                Family::<Labels, Counter>::default,
            )?,
            drop_reports_pending: m.get_or_register(
                "buffer_drop_reports_pending",
                "Dropped-group reports the buffer has not yet stored in the GROUP_DROPS stream",
                Gauge::default,
            )?,
            drop_report_failures: m.get_or_register(
                "buffer_drop_report_failures",
                "Failed attempts to store a dropped-group report (each is retried)",
                Counter::default,
            )?,
            served_token_staleness: m.get_or_register(
                "buffer_served_token_staleness",
                "Served tokens by version lag (learner version minus the token's policy version)",
                LagHistogram::new,
            )?,
            serve_latency: m.get_or_register(
                "buffer_serve_latency_seconds",
                "Time to answer a batch request (without waiting for groups)",
                || Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
            )?,
            segment_write_latency: m.get_or_register(
                "buffer_segment_write_seconds",
                "Time to encode, write and fsync one ingest batch to the segment",
                || Histogram::new(exponential_buckets(0.0001, 2.0, 16)),
            )?,
        })
    }

    /// Groups dropped for no signal since the start.
    pub fn no_signal_dropped(&self) -> u64 {
        self.groups_dropped
            .get_or_create(&Self::reason(
                asyncrl_protos::GroupDropReason::NoSignal.label(),
            ))
            .get()
    }

    /// Sets `asyncrl_buffer_no_signal_fraction` from the counters: no-signal
    /// drops per completed group (at most 1: a group completed before a
    /// restart may be dropped after it).
    pub fn update_no_signal_fraction(&self) {
        let completed = self.groups_completed.get();
        if completed > 0 {
            let f = self.no_signal_dropped() as f64 / completed as f64;
            self.no_signal_fraction.set(f.min(1.0));
        }
    }

    pub fn reason(value: &str) -> Labels {
        vec![("reason".to_owned(), value.to_owned())]
    }

    pub fn what(value: &str) -> Labels {
        vec![("what".to_owned(), value.to_owned())]
    }
}
