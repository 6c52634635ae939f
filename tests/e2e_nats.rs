//! The roles as separate processes over a real nats-server: coordinator,
//! buffer, learner and two rollout workers train for a fixed number of
//! steps, and the invariants of `asyncrl_harness::cluster::Cluster::check_invariants` hold.

use std::time::Duration;

use asyncrl_harness::cluster::{Cluster, Expect, Spec};
use asyncrl_learner::outputs::{EVAL_CSV, read_eval};

#[test]
fn a_multi_process_run_trains_every_trajectory_once_within_eta() {
    let mut cluster = Cluster::start(Spec {
        max_steps: 20,
        eval_every: 5,
        ..Spec::default()
    });
    // The learner's held-out evaluation reaches Prometheus while it runs.
    cluster.wait_metric(
        "learner",
        "asyncrl_eval_evaluations_total",
        Duration::from_secs(60),
        |v| v >= 1.0,
    );
    let m = cluster.metrics("learner").expect("learner metrics");
    assert_eq!(m.sum("asyncrl_eval_problems"), 16.0);
    let accuracy = m.sum("asyncrl_eval_greedy_accuracy");
    assert!((0.0..=1.0).contains(&accuracy), "{accuracy}");
    let report = cluster.finish(&Expect::default());
    assert_eq!(report.steps, 20);
    // ... and eval.csv has a row for the start and every 5th version.
    let eval = read_eval(&cluster.out.join(EVAL_CSV)).expect("eval.csv");
    let versions: Vec<i32> = eval.iter().map(|r| r.version).collect();
    assert_eq!(versions, [0, 5, 10, 15, 20], "{eval:?}");
    assert_eq!(report.retrained_steps, 0);
    // Every trajectory in the stream that was never trained is accounted
    // for: without faults there are no partial attempts, and a second
    // complete attempt of a task exists only where the buffer dropped the
    // first as stale. Stale drops themselves are not asserted away: a group
    // that completes late can be overtaken by younger ones and be older
    // than η when served (dropped, counted, the task issued again). Tokens
    // older than their task's admission version, which made stale drops
    // routine, are an invariant violation (check_invariants).
    assert_eq!(report.partial_attempts, 0, "no fault, no partial attempt");
    assert_eq!(
        report.superseded_attempts as u64, report.coordinator.stale_dropped_total,
        "second attempts only after stale drops"
    );
    assert_eq!(
        report.tasks_waiting,
        (2 + 1) * 4,
        "(η + 1)·B complete tasks wait at the end"
    );
}
