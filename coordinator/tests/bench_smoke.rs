//! The coordinator bench runs end to end (tiny sizes): both sides measured,
//! a ratio printed.

use asyncrl_coordinator::bench::{AcquireBenchOptions, run_acquire_bench};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_acquire_bench_measures_both_sides() {
    let report = run_acquire_bench(AcquireBenchOptions {
        nats_url: None,
        round_trips: 50,
        concurrency: 4,
        rounds: 1,
    })
    .await
    .expect("bench");
    assert_eq!(report.rows.len(), 2);
    for r in &report.rows {
        assert!(r.raw_per_s > 0.0 && r.coordinator_per_s > 0.0, "{r:?}");
        assert!(r.ratio().is_finite());
    }
    let text = report.to_string();
    assert!(
        text.contains("coordinator/raw") && text.contains("concurrent x4"),
        "{text}"
    );
}
