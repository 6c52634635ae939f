//! The environment client's metrics (`asyncrl_env_*`).
//!
//! Registered with [`Metrics::get_or_register`], so several clients in one
//! process share one set, and a test or the worker gets the same handles by
//! calling [`EnvMetrics::new`] on the same registry.

use asyncrl_telemetry::Metrics;
use asyncrl_telemetry::TelemetryError;
use asyncrl_telemetry::prometheus_client::metrics::counter::Counter;
use asyncrl_telemetry::prometheus_client::metrics::family::Family;
use asyncrl_telemetry::prometheus_client::metrics::histogram::{Histogram, exponential_buckets};

/// Label pairs (`call="step"`, `outcome="ok"`).
pub type Labels = Vec<(String, String)>;

/// A histogram family whose histograms are made by a plain function.
pub type LabelledHistogram = Family<Labels, Histogram, fn() -> Histogram>;

/// Handles to the environment metrics. Every HTTP attempt counts once: a
/// step answered 500 and then 200 adds `outcome="status"` and
/// `outcome="ok"` to `env_calls_total` and one to `env_retries_total`.
#[derive(Clone, Debug)]
pub struct EnvMetrics {
    /// `asyncrl_env_calls_total{call="reset|step|close", outcome="ok|timeout|connection|status|malformed|refused"}`.
    pub calls: Family<Labels, Counter>,
    /// `asyncrl_env_call_seconds{call}`: the time of each attempt.
    pub call_seconds: LabelledHistogram,
    /// `asyncrl_env_retries_total{call}`: attempts after the first.
    pub retries: Family<Labels, Counter>,
}

fn call_seconds_histogram() -> Histogram {
    // 1 ms to about 9 minutes.
    Histogram::new(exponential_buckets(0.001, 2.0, 20))
}

fn call_label(call: &str) -> Labels {
    vec![("call".to_owned(), call.to_owned())]
}

fn call_outcome_labels(call: &str, outcome: &str) -> Labels {
    vec![
        ("call".to_owned(), call.to_owned()),
        ("outcome".to_owned(), outcome.to_owned()),
    ]
}

impl EnvMetrics {
    /// Registers (or finds) the environment metrics in `m`.
    pub fn new(m: &Metrics) -> Result<Self, TelemetryError> {
        Ok(Self {
            calls: m.get_or_register(
                "env_calls",
                "Environment calls (each attempt) by call and outcome",
                Family::<Labels, Counter>::default,
            )?,
            call_seconds: m.get_or_register(
                "env_call_seconds",
                "Time of one environment call attempt, by call",
                || LabelledHistogram::new_with_constructor(call_seconds_histogram),
            )?,
            retries: m.get_or_register(
                "env_retries",
                "Environment call attempts after the first (transient failures), by call",
                Family::<Labels, Counter>::default,
            )?,
        })
    }

    /// Counts one attempt of `call` that ended in `outcome` (`ok` or an
    /// [`crate::EnvError::kind`]) after `seconds`.
    pub fn record(&self, call: &str, outcome: &str, seconds: f64) {
        self.calls
            .get_or_create(&call_outcome_labels(call, outcome))
            .inc();
        self.call_seconds
            .get_or_create(&call_label(call))
            .observe(seconds);
    }

    /// Counts one retry of `call`.
    pub fn retried(&self, call: &str) {
        self.retries.get_or_create(&call_label(call)).inc();
    }

    /// Attempts of `call` that ended in `outcome` so far.
    pub fn call_count(&self, call: &str, outcome: &str) -> u64 {
        self.calls
            .get_or_create(&call_outcome_labels(call, outcome))
            .get()
    }

    /// Retries of `call` so far.
    pub fn retry_count(&self, call: &str) -> u64 {
        self.retries.get_or_create(&call_label(call)).get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_between_instances_and_encoded_with_the_prefix() {
        let m = Metrics::new();
        let a = EnvMetrics::new(&m).unwrap();
        let b = EnvMetrics::new(&m).unwrap();
        a.record("step", "ok", 0.01);
        a.record("step", "timeout", 0.5);
        b.retried("step");
        assert_eq!(b.call_count("step", "ok"), 1);
        assert_eq!(b.call_count("step", "timeout"), 1);
        assert_eq!(a.retry_count("step"), 1);
        let text = m.encode_prometheus_text().unwrap();
        assert!(
            text.contains(r#"asyncrl_env_calls_total{call="step",outcome="ok"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"asyncrl_env_retries_total{call="step"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"asyncrl_env_call_seconds_count{call="step"} 2"#),
            "{text}"
        );
    }
}
