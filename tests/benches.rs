//! The sync-vs-async benches through the binary, at a size CI can afford:
//! they run to the end, write the report they promise (CSV, PNG, markdown)
//! and the staleness in it never exceeds η. The figures themselves are
//! measured on the reference machine (docs/results/), not asserted here.
#![cfg(feature = "torch")]

use std::path::Path;
use std::process::{Command, Output};

use asyncrl_harness::cluster::csv_rows;
use asyncrl_harness::configs;
use asyncrl_learner::outputs::{METRICS_CSV, read_metrics};

/// The `asyncrl-bench` binary beside the test binaries.
fn bench_bin() -> std::path::PathBuf {
    asyncrl_harness::process::bench_bin().expect("the asyncrl-bench binary")
}

fn asyncrl(args: &[&str]) -> Output {
    Command::new(bench_bin())
        .args(args)
        .env("NO_COLOR", "1")
        .env_remove("RUST_LOG")
        .output()
        .expect("run asyncrl-bench")
}

fn succeeded(args: &[&str], out: &Output) {
    assert!(
        out.status.success(),
        "asyncrl-bench {args:?} failed\nstderr: {}\nstdout: {}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
}

fn num(row: &std::collections::HashMap<String, String>, key: &str) -> f64 {
    row.get(key)
        .unwrap_or_else(|| panic!("no column {key}"))
        .parse()
        .unwrap_or_else(|_| panic!("{key} is not a number"))
}

fn non_empty_png(path: &Path) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(bytes.starts_with(b"\x89PNG"), "{} is a PNG", path.display());
}

#[test]
fn speedup_bench_reports_both_modes_and_the_bound() {
    let cores = asyncrl_policy::affinity::current_thread_cores().unwrap_or_default();
    assert!(
        cores.len() >= 2,
        "the speedup bench needs two cores; this process may use {cores:?}"
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("speedup");
    let (learner, worker) = (cores[0].to_string(), cores[1].to_string());
    let args = [
        "speedup",
        "--steps",
        "5",
        "--warmup",
        "1",
        "--rounds",
        "1",
        "--eta",
        "2",
        "--groups-per-step",
        "2",
        "--group-size",
        "4",
        "--max-sequences",
        "16",
        "--learner-cores",
        &learner,
        "--worker-cores",
        &worker,
        "--out",
        out.to_str().expect("utf-8"),
    ];
    let output = asyncrl(&args);
    succeeded(&args, &output);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("measured speedup"), "{stdout}");
    assert!(stdout.contains("pipelining bound"), "{stdout}");

    let rows = csv_rows(&out.join("speedup.csv"));
    assert_eq!(rows.len(), 2, "one sync and one async run");
    let (sync, async_) = (&rows[0], &rows[1]);
    assert_eq!(sync["mode"], "sync");
    assert_eq!(async_["mode"], "async");
    for r in &rows {
        assert!(num(r, "seconds_per_step") > 0.0);
        assert!(num(r, "compute_seconds") > 0.0);
        assert!(num(r, "padded_tokens_per_step") >= num(r, "tokens_per_step"));
    }
    assert_eq!(num(sync, "version_lag_max"), 0.0, "η = 0 trains fresh data");
    assert!(num(async_, "version_lag_max") <= 2.0, "never staler than η");
    // In the synchronous run the learner waits for every batch.
    assert!(num(sync, "wait_seconds") > 0.0);
    let md = std::fs::read_to_string(out.join("speedup.md")).expect("table");
    assert!(md.contains("| **measured speedup** |"), "{md}");
    non_empty_png(&out.join("speedup.png"));
    for run in ["eta0-round0", "eta2-round0"] {
        let steps = read_metrics(&out.join("runs").join(run).join(METRICS_CSV))
            .unwrap_or_else(|e| panic!("{run}: {e:#}"));
        assert_eq!(steps.len(), 5, "{run} trained its 5 steps");
        // The built-in engine is token-exact: where the learner compares its
        // log-probs with the behaviour ones (tokens of its own version), they
        // agree to 1e-4.
        for s in &steps {
            if s.logprob_gap_tokens > 0 {
                assert!(s.logprob_gap_max <= 1e-4, "{run}: {s:?}");
                assert!(s.logprob_kl.abs() <= 1e-6, "{run}: {s:?}");
            }
        }
        if run == "eta0-round0" {
            // η = 0 trains only tokens of the learner's own version: every
            // step compares.
            assert!(steps.iter().all(|s| s.logprob_gap_tokens > 0), "{steps:?}");
        }
    }
}

#[test]
fn staleness_bench_writes_curves_and_a_report_per_setting() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = configs::write_arith(dir.path().join("arith.jsonl"), 200, 20, 0);
    let held_out = configs::write_arith_all(dir.path().join("arith-all.jsonl"), 4);
    let mut base = configs::tiny_run(dir.path().join("run"), "local", &data);
    base.staleness.groups_per_step = 2;
    base.staleness.group_size = 4;
    base.model.max_new_tokens = 4;
    base.model.max_seq_len = 16;
    base.eval.dataset = Some(configs::arith(&held_out));
    let config = configs::write(&base, dir.path().join("bench.toml"));
    let out = dir.path().join("staleness");
    let args = [
        "staleness",
        config.to_str().expect("utf-8"),
        "--etas",
        "0,2",
        "--objectives",
        "naive,adaptive",
        "--seeds",
        "0",
        "--steps",
        "4",
        "--eval-every",
        "2",
        "--target",
        "0.0",
        "--out",
        out.to_str().expect("utf-8"),
    ];
    let output = asyncrl(&args);
    succeeded(&args, &output);
    let rows = csv_rows(&out.join("staleness.csv"));
    assert_eq!(rows.len(), 4 * 4, "four settings × 4 steps");
    for r in &rows {
        let eta = num(r, "eta");
        assert!(num(r, "version_lag_max") <= eta, "{r:?}");
        assert!((0.0..=1.0).contains(&num(r, "reward_mean")), "{r:?}");
        assert!(
            ["naive", "adaptive"].contains(&r["objective"].as_str()),
            "{r:?}"
        );
    }
    // Each run is evaluated at versions 0, 2 and 4 on all 32 problems.
    let evals = csv_rows(&out.join("staleness_eval.csv"));
    assert_eq!(evals.len(), 4 * 3, "four settings × 3 evaluations");
    let steps: Vec<f64> = evals.iter().map(|r| num(r, "step")).collect();
    assert_eq!(&steps[..3], &[0.0, 2.0, 4.0]);
    for r in &evals {
        assert!((0.0..=1.0).contains(&num(r, "greedy_accuracy")), "{r:?}");
        assert_eq!(num(r, "trained_samples"), num(r, "step") * 8.0, "{r:?}");
    }
    let table = std::fs::read_to_string(out.join("staleness.md")).expect("report");
    for line in [
        "| 0 | naive |",
        "| 2 | naive |",
        "| 0 | adaptive |",
        "| 2 | adaptive |",
    ] {
        assert!(table.contains(line), "{line}: {table}");
    }
    assert!(table.contains("Cost of staleness"), "{table}");
    // A target of 0 is reached at the first evaluation by every run.
    assert!(table.contains("ratio sync / async"), "{table}");
    non_empty_png(&out.join("accuracy_vs_samples.png"));
    non_empty_png(&out.join("accuracy_vs_wallclock.png"));

    // The report again from the same runs, for a target nobody reaches.
    let mut again = args.to_vec();
    let t = again.iter().position(|a| *a == "0.0").expect("target");
    again[t] = "1.5";
    again.push("--report-only");
    succeeded(&again, &asyncrl(&again));
    let table = std::fs::read_to_string(out.join("staleness.md")).expect("report");
    assert!(table.contains("not reached"), "{table}");
    assert!(table.contains("not measurable"), "{table}");
    assert_eq!(
        csv_rows(&out.join("staleness_eval.csv")).len(),
        4 * 3,
        "same runs"
    );

    // Without held-out problems the bench refuses to start.
    base.eval.dataset = None;
    let bare = configs::write(&base, dir.path().join("bare.toml"));
    let args = ["staleness", bare.to_str().expect("utf-8"), "--steps", "1"];
    let output = asyncrl(&args);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("[eval] dataset"), "{stderr}");
}

#[test]
fn gpu_bench_runs_both_engines_on_the_same_weights_at_toy_shapes_on_the_cpu() {
    // `scripts/gpu-check` runs this bench on a GPU at real shapes; here the
    // same code at toy shapes keeps it working, and checks what it reports.
    let dir = tempfile::tempdir().unwrap();
    let python = std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.venv/bin/python"));
    let python = if python.is_file() {
        python.display().to_string()
    } else {
        "python3".into()
    };
    let work = dir.path().join("work").display().to_string();
    let args = [
        "gpu",
        "--device",
        "cpu",
        "--shapes",
        "tiny-qwen2,tiny-qwen3",
        "--qwen3-layers",
        "4",
        "--rows",
        "4",
        "--prompt-tokens",
        "6",
        "--completion-tokens",
        "10",
        "--steps",
        "2",
        "--python",
        &python,
        "--work",
        &work,
    ];
    let out = asyncrl(&args);
    succeeded(&args, &out);
    let stdout = String::from_utf8_lossy(&out.stdout);
    // | shape | engine | parameters | layers | step | first step | peak | tokens/s | loss |
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .filter(|l| l.starts_with("| tiny-"))
        .map(|l| l.trim_matches('|').split('|').map(str::trim).collect())
        .collect();
    let engines: Vec<(&str, &str)> = rows.iter().map(|r| (r[0], r[1])).collect();
    assert_eq!(
        engines,
        [
            ("tiny-qwen2", "builtin"),
            ("tiny-qwen2", "torch"),
            ("tiny-qwen2", "torch+ac"),
            ("tiny-qwen3", "torch"),
            ("tiny-qwen3", "torch+ac"),
            ("tiny-qwen3", "torch, 2 layers"),
        ],
        "{stdout}"
    );
    let field = |r: &[&str], i: usize| -> f64 { r[i].parse().unwrap_or(f64::NAN) };
    for r in &rows {
        assert!(field(r, 4) > 0.0 && field(r, 7) > 0.0, "{r:?}");
        assert!(field(r, 8).is_finite(), "{r:?}");
    }
    // The same model to both engines: the same parameters, and on the
    // same batch the same first loss (fp32 on the CPU).
    assert_eq!(rows[0][2], rows[1][2], "parameters: {stdout}");
    for r in &rows[1..3] {
        assert!(
            (field(r, 8) - field(&rows[0], 8)).abs() < 1e-4,
            "{} loss {} against the built-in {}",
            r[1],
            r[8],
            rows[0][8]
        );
    }
    assert!(
        stdout.contains("tiny-qwen2: torch / builtin: step time")
            && stdout.contains("MiB per decoder layer"),
        "{stdout}"
    );
    // The model folders are removed after each shape.
    assert!(
        std::fs::read_dir(dir.path().join("work"))
            .map(|d| d
                .filter_map(Result::ok)
                .all(|e| !e.path().join("config.json").exists()))
            .unwrap_or(true)
    );
}
