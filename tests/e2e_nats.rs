//! The roles as separate processes over a real nats-server: coordinator,
//! buffer, learner and two rollout workers train for a fixed number of
//! steps, and the invariants of `asyncrl_harness::cluster::Cluster::check_invariants` hold.

use std::time::Duration;

use asyncrl_config::{TrainerEngineName, WeightTransportName};
use asyncrl_harness::cluster::{Cluster, Expect, Spec};
use asyncrl_learner::outputs::{EVAL_CSV, read_eval};
use asyncrl_protos::subjects::WEIGHTS_FORMAT_FOLDER;

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

/// A run whose weights go through a shared folder (`shared_path`), not the
/// object store: every announcement names a complete folder with its
/// files' checksums, the workers sample with the versions they load from
/// it, old folders are pruned, and the invariants hold. With the torch
/// engine the learner is also killed once: the restarted one adopts the
/// newest published folder or retrains from its checkpoint.
fn shared_weights_run(trainer: TrainerEngineName, kill_learner: bool) {
    let mut c = Cluster::start(Spec {
        max_steps: 16,
        checkpoint_every: 3,
        eval_every: if kill_learner { 0 } else { 5 },
        trainer,
        weight_transport: WeightTransportName::SharedPath,
        ..Spec::default()
    });
    let root = c.shared_weights_dir();
    if kill_learner {
        c.wait_step(5, Duration::from_secs(180));
        c.kill9("learner");
        c.start_role("learner");
    }
    let report = c.finish(&Expect {
        learner_restarts: u64::from(kill_learner),
    });
    assert_eq!(report.steps, 16);
    let announcements = c.announcements();
    assert!(!announcements.is_empty());
    for a in &announcements {
        assert_eq!(a.format, WEIGHTS_FORMAT_FOLDER, "{a:?}");
        assert!(a.folder.starts_with(root.to_str().unwrap()), "{a:?}");
        assert!(
            !a.files.is_empty() && a.files.iter().all(|f| f.sha256.len() == 64),
            "{a:?}"
        );
        assert!(a.object_name.is_empty(), "no object: {a:?}");
    }
    // The workers loaded what the folders held: late trajectories were
    // sampled with late versions.
    let newest_sampled = c
        .stream()
        .iter()
        .flat_map(|t| t.policy_versions.iter().copied())
        .max()
        .unwrap_or(0);
    assert!(
        newest_sampled >= 8,
        "sampled with versions up to {newest_sampled}"
    );
    // Old folders are pruned (keep_weight_versions), none is left half-written.
    let mut folders: Vec<String> = std::fs::read_dir(&root)
        .expect("the shared folder")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    folders.sort();
    let keep = asyncrl_config::LearnerConfig::default().keep_weight_versions;
    assert!(folders.len() <= keep, "{folders:?}");
    assert_eq!(
        folders.last(),
        Some(&asyncrl_protos::subjects::weights_folder_name(16))
    );
    assert!(
        folders
            .iter()
            .all(|f| asyncrl_protos::subjects::weights_folder_version(f).is_some()),
        "{folders:?}"
    );
    if !kill_learner {
        let eval = read_eval(&c.out.join(EVAL_CSV)).expect("eval.csv");
        let versions: Vec<i32> = eval.iter().map(|r| r.version).collect();
        assert_eq!(versions, [0, 5, 10, 15, 16], "{eval:?}");
    }
}

#[test]
fn the_builtin_engine_publishes_through_a_shared_folder() {
    shared_weights_run(TrainerEngineName::Builtin, false);
}

#[test]
fn the_torch_engine_publishes_through_a_shared_folder_across_a_learner_kill() {
    shared_weights_run(TrainerEngineName::Torch, true);
}
