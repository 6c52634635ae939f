//! `asyncrl-bench transport`: JetStream publish-with-ack throughput through
//! our `Bus` against async-nats used directly (`asyncrl_transport::raw`), same server,
//! same message size, same run. Each side publishes with a message id and
//! waits for the stream's ack, once one at a time and once with many
//! publishes in flight; rounds alternate between the two sides so that
//! machine noise hits both.

use std::fmt;
use std::time::Duration;

use anyhow::Result;
use asyncrl_transport::raw::{RawNats, timed_burst};
use asyncrl_transport::{Bus, NatsBus, StreamSpec, TransportMetrics};
use bytes::Bytes;

#[derive(Debug, Clone)]
pub struct PublishBenchOptions {
    /// NATS server to use; `None` starts a private nats-server (testkit).
    pub nats_url: Option<String>,
    /// Messages per measurement.
    pub messages: usize,
    pub message_bytes: usize,
    /// Publishes in flight for the pipelined measurement.
    pub in_flight: usize,
    /// Alternating rounds per side; the best round counts.
    pub rounds: usize,
}

impl Default for PublishBenchOptions {
    fn default() -> Self {
        Self {
            nats_url: None,
            messages: 2_000,
            message_bytes: 16 * 1024,
            in_flight: 64,
            rounds: 3,
        }
    }
}

#[derive(Debug, Clone)]
pub struct PublishBenchRow {
    pub mode: String,
    pub raw_msgs_per_s: f64,
    pub ours_msgs_per_s: f64,
}

impl PublishBenchRow {
    /// ours / raw: 1.0 means the abstraction costs nothing.
    pub fn ratio(&self) -> f64 {
        self.ours_msgs_per_s / self.raw_msgs_per_s
    }
}

#[derive(Debug, Clone)]
pub struct PublishBenchReport {
    pub options: PublishBenchOptions,
    pub server: String,
    pub rows: Vec<PublishBenchRow>,
}

impl fmt::Display for PublishBenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let o = &self.options;
        writeln!(
            f,
            "JetStream publish-with-ack, {} messages of {} B, best of {} alternating rounds ({})",
            o.messages, o.message_bytes, o.rounds, self.server
        )?;
        writeln!(
            f,
            "{:<16} {:>14} {:>14} {:>12} {:>12}",
            "mode", "raw msg/s", "ours msg/s", "ours MiB/s", "ours/raw"
        )?;
        for r in &self.rows {
            let mib = r.ours_msgs_per_s * o.message_bytes as f64 / (1024.0 * 1024.0);
            writeln!(
                f,
                "{:<16} {:>14.0} {:>14.0} {:>12.1} {:>12.3}",
                r.mode,
                r.raw_msgs_per_s,
                r.ours_msgs_per_s,
                mib,
                r.ratio()
            )?;
        }
        Ok(())
    }
}

async fn ours(
    bus: &NatsBus,
    subject: &str,
    payload: &Bytes,
    n: usize,
    in_flight: usize,
    tag: &str,
) -> Result<Duration> {
    Ok(timed_burst(n, in_flight, |i| {
        let id = format!("{tag}-{i}");
        let payload = payload.clone();
        async move { bus.publish_durable(subject, &id, payload).await }
    })
    .await?)
}

/// Runs the benchmark and returns the figures.
pub async fn run_publish_bench(opts: PublishBenchOptions) -> Result<PublishBenchReport> {
    let nats = super::BenchServer::at_or_start(opts.nats_url.as_deref())?;
    let url = nats.url.clone();
    let bus = NatsBus::connect(
        &asyncrl_config::BusConfig::nats(url.clone()),
        TransportMetrics::new(),
    )
    .await?;
    let raw_nats = RawNats::connect(&url).await?;
    let payload = Bytes::from(vec![0xA5u8; opts.message_bytes]);
    let run_id = std::process::id();
    let mut rows = Vec::new();
    for (mode, in_flight) in [("sequential", 1usize), ("pipelined", opts.in_flight.max(1))] {
        let mode = if in_flight == 1 {
            mode.to_owned()
        } else {
            format!("{mode} x{in_flight}")
        };
        let (mut best_raw, mut best_ours) = (Duration::MAX, Duration::MAX);
        for round in 0..opts.rounds.max(1) {
            for side in ["raw", "ours"] {
                let stream = format!("BENCH_{}_{}", side.to_uppercase(), run_id);
                let subject = format!("bench.{side}.{run_id}");
                let mut spec = StreamSpec::new(&stream, &[&subject]);
                spec.duplicate_window = Duration::from_secs(30);
                bus.ensure_stream(&spec).await?;
                let tag = format!("{mode}-{round}-{side}");
                let elapsed = if side == "raw" {
                    raw_nats
                        .publish_with_ack(&subject, &payload, opts.messages, in_flight, &tag)
                        .await?
                } else {
                    ours(&bus, &subject, &payload, opts.messages, in_flight, &tag).await?
                };
                let best = if side == "raw" {
                    &mut best_raw
                } else {
                    &mut best_ours
                };
                *best = (*best).min(elapsed);
                bus.delete_stream(&stream).await?;
            }
        }
        let rate = |d: Duration| opts.messages as f64 / d.as_secs_f64();
        rows.push(PublishBenchRow {
            mode,
            raw_msgs_per_s: rate(best_raw),
            ours_msgs_per_s: rate(best_ours),
        });
    }
    let server = nats.describe();
    Ok(PublishBenchReport {
        options: opts,
        server,
        rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_publish_bench_measures_both_sides() {
        let report = run_publish_bench(PublishBenchOptions {
            nats_url: None,
            messages: 40,
            message_bytes: 512,
            in_flight: 8,
            rounds: 1,
        })
        .await
        .expect("bench");
        assert_eq!(report.rows.len(), 2);
        for r in &report.rows {
            assert!(r.raw_msgs_per_s > 0.0 && r.ours_msgs_per_s > 0.0, "{r:?}");
            assert!(r.ratio().is_finite(), "{r:?}");
        }
        let text = report.to_string();
        assert!(
            text.contains("ours/raw") && text.contains("pipelined x8"),
            "{text}"
        );
    }
}
