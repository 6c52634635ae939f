//! `asyncrl-bench scale` through the binary at a size CI can afford: every
//! curve is measured end to end (a coordinator process and scripted workers,
//! the buffer's core, the learner's step) and written as CSV, PNG and a
//! summary naming the fitted growth. The figures themselves are measured on
//! the reference machine (docs/results/scale/), not asserted here.
#![cfg(feature = "torch")]

use std::process::Command;

use asyncrl_harness::cluster::csv_rows;

/// The `asyncrl-bench` binary beside the test binaries.
fn bench_bin() -> std::path::PathBuf {
    asyncrl_harness::process::bench_bin().expect("the asyncrl-bench binary")
}

#[test]
fn scale_bench_writes_every_curve_with_its_fit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("scale");
    let out_arg = out.to_str().expect("utf-8");
    let args = [
        "scale",
        "--workers",
        "1,4",
        "--warmup",
        "1s",
        "--window",
        "2s",
        "--task-time",
        "200ms",
        "--heartbeat",
        "500ms",
        "--trajectories",
        "2000,4000,8000",
        "--serves",
        "2",
        "--batch-tokens",
        "128,256",
        "--seq-tokens",
        "32",
        "--iterations",
        "1",
        "--out",
        out_arg,
    ];
    let output = Command::new(bench_bin())
        .args(args)
        .env("NO_COLOR", "1")
        .env_remove("RUST_LOG")
        .output()
        .expect("run asyncrl-bench");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "asyncrl-bench {args:?} failed\nstderr: {}\nstdout: {stdout}",
        String::from_utf8_lossy(&output.stderr)
    );

    let coordinator = csv_rows(&out.join("coordinator.csv"));
    let workers: Vec<&str> = coordinator.iter().map(|r| r["workers"].as_str()).collect();
    assert_eq!(workers, ["1", "4"]);
    for r in &coordinator {
        let cpu: f64 = r["coordinator_cpu_s_per_s"].parse().expect("cpu");
        let p50: f64 = r["grant_p50_ms"].parse().expect("p50");
        let p99: f64 = r["grant_p99_ms"].parse().expect("p99");
        let grants: f64 = r["grants_per_s"].parse().expect("grants");
        assert!(cpu > 0.0 && grants > 0.0, "{r:?}");
        assert!(p50 > 0.0 && p99 >= p50, "{r:?}");
    }
    let buffer = csv_rows(&out.join("buffer.csv"));
    assert_eq!(buffer.len(), 3);
    for r in &buffer {
        let resident: f64 = r["resident_trajectories"].parse().expect("resident");
        let arrow: f64 = r["arrow_bytes_per_token"].parse().expect("arrow bytes");
        let serve: f64 = r["serve_ms"].parse().expect("serve");
        assert!(resident >= 2000.0 && arrow > 0.0 && serve > 0.0, "{r:?}");
    }
    let learner = csv_rows(&out.join("learner.csv"));
    assert_eq!(learner.len(), 2);
    for png in [
        "coordinator_cpu.png",
        "coordinator_grant_latency.png",
        "buffer_memory.png",
        "buffer_serve.png",
        "learner_step.png",
    ] {
        let bytes = std::fs::read(out.join(png)).expect(png);
        assert!(bytes.starts_with(b"\x89PNG"), "{png} is a PNG");
    }
    let md = std::fs::read_to_string(out.join("scale.md")).expect("scale.md");
    for needle in [
        "At 4 simulated workers",
        "| grant_p99_ms | **",
        "| serve_ms | **",
        "| step_s | **",
    ] {
        assert!(md.contains(needle), "scale.md lacks {needle:?}:\n{md}");
    }
    assert!(stdout.contains("Cost curves"), "{stdout}");
}
