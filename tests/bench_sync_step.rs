//! `asyncrl-bench sync-step` through the binary on a tiny job: both variants
//! run to the end, every counted step is cut into its phases from the
//! roles' own events (the bench fails if the events it reads are gone or
//! renamed), and the phases account for the step. The figures themselves
//! are measured on the reference machine (docs/results/sync-step/).
#![cfg(feature = "torch")]

use std::process::Command;

use asyncrl_harness::cluster::csv_rows;
use asyncrl_harness::configs;

/// The `asyncrl-bench` binary beside the test binaries.
fn bench_bin() -> std::path::PathBuf {
    asyncrl_harness::process::bench_bin().expect("the asyncrl-bench binary")
}

fn run(args: &[&str]) {
    let out = Command::new(bench_bin())
        .args(args)
        .env("NO_COLOR", "1")
        .env_remove("RUST_LOG")
        .output()
        .expect("run asyncrl-bench");
    assert!(
        out.status.success(),
        "asyncrl-bench {args:?} failed\nstderr: {}\nstdout: {}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn sync_step_bench_cuts_every_counted_step_into_its_phases() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = configs::write_arith(dir.path().join("arith.jsonl"), 200, 20, 0);
    let mut config = configs::tiny_run(dir.path().join("run"), "local", &data);
    config.staleness.eta = 4;
    config.staleness.groups_per_step = 2;
    config.staleness.group_size = 4;
    config.model.max_new_tokens = 4;
    config.model.max_seq_len = 16;
    // The bench cuts steps from the roles' `info` events.
    config.telemetry.log_filter = "info".into();
    let config = configs::write(&config, dir.path().join("job.toml"));
    let out = dir.path().join("sync-step");
    run(&[
        "sync-step",
        config.to_str().expect("utf-8"),
        "--steps",
        "8",
        "--warmup",
        "2",
        "--rounds",
        "1",
        "--out",
        out.to_str().expect("utf-8"),
    ]);
    let rows = csv_rows(&out.join("sync-step.csv"));
    for variant in ["pinned", "both-cores"] {
        let steps: Vec<_> = rows.iter().filter(|r| r["variant"] == variant).collect();
        // Steps 3..=8 can be cut (each needs the previous step's batch and
        // version).
        assert!(steps.len() >= 4, "{variant}: {} steps cut", steps.len());
        for r in steps {
            let f = |k: &str| -> f64 { r[k].parse().unwrap_or_else(|_| panic!("{k}: {}", r[k])) };
            let phases = f("generation_s")
                + f("train_s")
                + f("weights_s")
                + f("admission_s")
                + f("trajectories_to_batch_s")
                + f("learner_other_s");
            assert!(
                f("total_s") > 0.0 && f("generation_s") > 0.0 && f("train_s") > 0.0,
                "{r:?}"
            );
            // The phases partition the step, unless the learner's own
            // figures overran its segment (learner other is then clamped
            // at 0 and the sum exceeds it).
            if f("learner_other_s") > 0.0 {
                assert!((phases - f("total_s")).abs() < 1e-4, "{r:?}");
            } else {
                assert!(phases >= f("total_s") - 1e-4, "{r:?}");
            }
        }
    }
    let md = std::fs::read_to_string(out.join("sync-step.md")).expect("sync-step.md");
    assert!(
        md.contains("neither generating, scoring nor training"),
        "{md}"
    );
}
