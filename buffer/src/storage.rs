//! What NATS holds for the run: the buffer reads the size of every
//! JetStream store (the trajectory and dead-letter streams, the KV buckets,
//! the object stores) every `bus.storage.report_every` and exports it as
//! `asyncrl_nats_store_{bytes,messages,max_bytes}{store}`. The alert
//! `AsyncrlNatsStoreNearLimit` fires when a store passes 80 % of its limit.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use asyncrl_telemetry::Metrics;
use asyncrl_telemetry::prometheus_client::metrics::family::Family;
use asyncrl_telemetry::prometheus_client::metrics::gauge::Gauge;
use asyncrl_transport::{Bus, StoreUsage};
use tokio_util::sync::CancellationToken;

use crate::BufferError;

type Labels = Vec<(String, String)>;

/// Above this share of its byte limit a store is reported as nearly full.
pub const NEAR_LIMIT: f64 = 0.8;

/// The store gauges and the loop that keeps them current.
#[derive(Clone)]
pub struct StorageReporter {
    bytes: Family<Labels, Gauge>,
    messages: Family<Labels, Gauge>,
    max_bytes: Family<Labels, Gauge>,
    every: Duration,
}

impl StorageReporter {
    pub fn register(m: &Metrics, every: Duration) -> Result<Self, BufferError> {
        Ok(Self {
            bytes: m.get_or_register(
                "nats_store_bytes",
                "Bytes held by each JetStream store of the run (streams, KV buckets, object stores)",
                Family::<Labels, Gauge>::default,
            )?,
            messages: m.get_or_register(
                "nats_store_messages",
                "Messages held by each JetStream store of the run",
                Family::<Labels, Gauge>::default,
            )?,
            max_bytes: m.get_or_register(
                "nats_store_max_bytes",
                "Byte limit of each JetStream store (absent: no limit of its own)",
                Family::<Labels, Gauge>::default,
            )?,
            every,
        })
    }

    /// Sets the gauges from one reading; returns the stores above
    /// [`NEAR_LIMIT`] of their limit.
    pub fn record(&self, usage: &[StoreUsage]) -> Vec<String> {
        let mut near = Vec::new();
        for u in usage {
            let labels = vec![("store".to_owned(), u.name.clone())];
            self.bytes.get_or_create(&labels).set(clamp(u.bytes));
            self.messages.get_or_create(&labels).set(clamp(u.messages));
            if let Some(max) = u.max_bytes {
                self.max_bytes.get_or_create(&labels).set(clamp(max));
                if max > 0 && u.bytes as f64 >= NEAR_LIMIT * max as f64 {
                    near.push(u.name.clone());
                }
            }
        }
        near
    }

    /// Reads the stores every `every` until `stop`; a failed reading (NATS
    /// down) is logged at debug and retried at the next tick.
    pub async fn run(self, bus: Arc<dyn Bus>, stop: CancellationToken) {
        let mut warned: HashSet<String> = HashSet::new();
        let mut tick = tokio::time::interval(self.every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            let usage = match bus.storage().await {
                Ok(u) => u,
                Err(e) => {
                    tracing::debug!(error = %e, "cannot read the JetStream store sizes; retrying");
                    continue;
                }
            };
            let near: HashSet<String> = self.record(&usage).into_iter().collect();
            for name in near.difference(&warned) {
                if let Some(u) = usage.iter().find(|u| &u.name == name) {
                    tracing::warn!(
                        store = %u.name,
                        bytes = u.bytes,
                        max_bytes = u.max_bytes,
                        "a JetStream store is above 80% of its limit (bus.storage)"
                    );
                }
            }
            warned = near;
        }
    }
}

fn clamp(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(name: &str, bytes: u64, max: Option<u64>) -> StoreUsage {
        StoreUsage {
            name: name.into(),
            messages: bytes / 10,
            bytes,
            max_bytes: max,
        }
    }

    #[test]
    fn gauges_follow_each_store_and_near_full_ones_are_named() {
        let m = Metrics::new();
        let r = StorageReporter::register(&m, Duration::from_secs(1)).unwrap();
        let near = r.record(&[
            store("STREAM_A", 900, Some(1000)),
            store("STREAM_B", 100, Some(1000)),
            store("OBJ_WEIGHTS", 5000, None),
        ]);
        assert_eq!(near, vec!["STREAM_A".to_owned()]);
        let text = m.encode_prometheus_text().unwrap();
        for line in [
            "asyncrl_nats_store_bytes{store=\"STREAM_A\"} 900",
            "asyncrl_nats_store_max_bytes{store=\"STREAM_A\"} 1000",
            "asyncrl_nats_store_messages{store=\"STREAM_B\"} 10",
            "asyncrl_nats_store_bytes{store=\"OBJ_WEIGHTS\"} 5000",
        ] {
            assert!(text.contains(line), "{line} in\n{text}");
        }
        assert!(!text.contains("asyncrl_nats_store_max_bytes{store=\"OBJ_WEIGHTS\"}"));
    }
}
