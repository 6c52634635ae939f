//! The chaos soak at a size CI can afford (`asyncrl-bench chaos` for a
//! minute with a fixed seed): every role runs as a process over a real
//! three-node JetStream cluster secured as production (streams at R3, TLS
//! with verified client certificates, each role its own user, routes that
//! authenticate) while roles are killed, stopped with SIGTERM, frozen and
//! thawed, and the trajectory stream's leader is killed and restarted,
//! while the learner trains. Every invariant must hold (trained exactly once, nothing lost,
//! never staler than η, versions never backwards, contiguous steps,
//! training through the fault phase, the learner killed while training,
//! flat memory and disk, clean exits), and the report must be complete.
#![cfg(feature = "torch")]

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use asyncrl_harness::cluster::csv_rows;

/// The `asyncrl-bench` binary beside the test binaries.
fn bench_bin() -> std::path::PathBuf {
    asyncrl_harness::process::bench_bin().expect("the asyncrl-bench binary")
}

fn png(path: &Path) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(bytes.starts_with(b"\x89PNG"), "{} is a PNG", path.display());
}

const INVARIANTS: [&str; 10] = [
    "trained exactly once",
    "no token older than η",
    "versions never backwards",
    "steps contiguous",
    "training through the fault phase",
    "learner killed while training",
    "nothing lost",
    "memory flat after warm-up",
    "disk flat after warm-up",
    "clean exits",
];

#[test]
fn a_minute_of_chaos_keeps_every_invariant() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("chaos");
    // A minute of training under faults (the schedule's first kill -9 is
    // the learner's). A minute is mostly warm-up (the weights store and
    // the roles' caches filling): growth is judged loosely here, and with
    // the tight defaults in the 30-minute soak (docs/results/chaos/). The
    // NATS store is three replicas whose Raft logs and snapshots swing it
    // by tens of MiB within seconds (seen: 30 to 78 MiB in one minute):
    // over a minute its slope is mostly that noise.
    let args = [
        "chaos",
        "--duration",
        "60s",
        "--seed",
        "3",
        "--fault-every",
        "6s",
        "--sample-every",
        "1s",
        "--mem-growth-mib",
        "128",
        "--disk-growth-mib",
        "96",
        "--out",
        out.to_str().expect("utf-8 path"),
    ];
    let output = Command::new(bench_bin())
        .args(args)
        .env("NO_COLOR", "1")
        .env_remove("RUST_LOG")
        .output()
        .expect("run asyncrl-bench");
    let md = std::fs::read_to_string(out.join("chaos.md")).unwrap_or_default();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "asyncrl-bench {args:?} failed\nstderr: {stderr}\nchaos.md:\n{md}\n{}",
        role_warnings(&out.join("logs"))
    );

    // Every invariant is reported, and holds.
    for name in INVARIANTS {
        let row = md
            .lines()
            .find(|l| l.starts_with(&format!("| {name} |")))
            .unwrap_or_else(|| panic!("chaos.md has no row for {name:?}:\n{md}"));
        assert!(row.contains("| PASS |"), "{row}");
    }
    assert!(!md.contains("FAIL"), "{md}");

    // Faults of every kind were injected (not skipped).
    let faults = csv_rows(&out.join("faults.csv"));
    let mut injected: BTreeMap<String, usize> = BTreeMap::new();
    for f in &faults {
        if !f["outcome"].starts_with("skipped") {
            *injected.entry(f["kind"].clone()).or_default() += 1;
        }
    }
    for kind in ["kill9", "sigterm", "sigstop", "nats_kill9"] {
        assert!(
            injected.get(kind).copied().unwrap_or(0) >= 1,
            "no {kind} fault was injected: {injected:?}\n{stderr}"
        );
    }
    // A NATS fault kills a node of the cluster.
    for f in faults.iter().filter(|f| f["kind"] == "nats_kill9") {
        assert!(f["target"].starts_with("nats-n"), "{f:?}");
    }
    assert!(
        md.contains("3-node JetStream cluster") && md.contains("TLS"),
        "the report names the cluster and its security:\n{md}"
    );

    // Samples cover the run, with memory of every role and the learner's
    // progress.
    let samples = csv_rows(&out.join("samples.csv"));
    assert!(samples.len() >= 30, "{} samples", samples.len());
    let last = samples.last().expect("a sample");
    let trained: u64 = last["learner_step"].parse().expect("a step count");
    assert!(trained >= 10, "{trained} steps trained in a minute\n{md}");
    for role in [
        "coordinator",
        "buffer",
        "learner",
        "worker-1",
        "worker-2",
        "nats-n0",
        "nats-n1",
        "nats-n2",
    ] {
        let col = format!("{role}_rss_bytes");
        assert!(
            samples
                .iter()
                .any(|s| s[&col].parse::<u64>().is_ok_and(|b| b > 0)),
            "no memory sample of {role}"
        );
    }
    png(&out.join("memory.png"));
    png(&out.join("disk.png"));
    for log in ["coordinator", "buffer", "learner", "worker-1", "worker-2"] {
        let path = out.join("logs").join(format!("{log}.log"));
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("no log of {log}: {}: {e}", path.display()));
        // Each role's user covers all it does, through every fault.
        let refused: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("NATS refused"))
            .collect();
        assert!(
            refused.iter().all(|l| l.contains("reply_refused")),
            "{log}: {refused:#?}"
        );
    }
}

/// The last warnings and errors of every role's log (the logs go with the
/// temporary directory, so a failure carries them).
fn role_warnings(logs: &std::path::Path) -> String {
    let mut out = String::new();
    let Ok(entries) = std::fs::read_dir(logs) else {
        return format!("(no logs in {})", logs.display());
    };
    let mut paths: Vec<_> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    paths.sort();
    for path in paths {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        if name.as_deref().is_some_and(|n| n.starts_with("nats")) {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("WARN") || l.contains("ERROR") || l.starts_with("Error"))
            .collect();
        out.push_str(&format!(
            "--- {} (last {} of {} warnings and errors)\n",
            path.display(),
            lines.len().min(25),
            lines.len()
        ));
        for l in &lines[lines.len().saturating_sub(25)..] {
            out.push_str(l);
            out.push('\n');
        }
    }
    out
}
