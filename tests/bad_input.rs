//! Bad input through the binary, as a user meets it: a config with a wrong
//! key, an out-of-range η, a missing task file, an unreachable NATS server,
//! a role without a NATS bus. Each gives exactly one stderr line, starting
//! with `error:` and naming the problem, a non-zero exit, and no panic or
//! backtrace (even with RUST_BACKTRACE=1).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use asyncrl_testkit::NatsServer;

fn asyncrl(args: &[&str]) -> Output {
    run(PathBuf::from(env!("CARGO_BIN_EXE_asyncrl")), args)
}

/// The bench binary, `asyncrl-bench` (the harness's front end).
fn asyncrl_bench(args: &[&str]) -> Output {
    run(
        asyncrl_harness::process::bench_bin().expect("the asyncrl-bench binary"),
        args,
    )
}

fn run(bin: PathBuf, args: &[&str]) -> Output {
    Command::new(bin)
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .env("NO_COLOR", "1")
        .env_remove("RUST_LOG")
        .output()
        .expect("run asyncrl")
}

/// Asserts the one-line error contract and that the line names every one of
/// `names`.
fn assert_one_error_line(args: &[&str], out: &Output, names: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let context = format!("asyncrl {args:?}\nstderr: {stderr}\nstdout: {stdout}");
    assert_eq!(out.status.code(), Some(1), "{context}");
    assert_eq!(stderr.lines().count(), 1, "one line: {context}");
    assert!(stderr.starts_with("error: "), "{context}");
    for name in names {
        assert!(stderr.contains(name), "should name {name:?}: {context}");
    }
    for bad in ["panicked", "backtrace", "RUST_BACKTRACE", "stack"] {
        assert!(!stderr.contains(bad), "{bad}: {context}");
    }
}

/// A valid config for `bus`, with `extra` lines appended to `[staleness]`
/// and the task file `tasks`.
fn write_config(dir: &Path, name: &str, bus: &str, staleness: &str, tasks: &Path) -> PathBuf {
    let text = format!(
        r#"
[run]
name = "bad-input"
output_dir = "{out}"
max_steps = 1

[staleness]
groups_per_step = 1
group_size = 2
{staleness}

[bus]
url = "{bus}"
connect_timeout = "1s"

[telemetry]
listen = ""
log_filter = "warn"

[model]
device = "cpu"
max_new_tokens = 2
max_seq_len = 16
cpu_threads = 1

[model.tiny]
hidden_size = 32
num_hidden_layers = 1
num_attention_heads = 2
num_key_value_heads = 1
intermediate_size = 64

[coordinator]
datasets = [{{ name = "arith", path = "{tasks}" }}]
admin_listen = ""
"#,
        out = dir.join("out").display(),
        tasks = tasks.display(),
    );
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write a config");
    path
}

fn tasks_file(dir: &Path) -> PathBuf {
    let path = dir.join("tasks.jsonl");
    let items = asyncrl_tasks::generate_with(
        asyncrl_tasks::BuiltinTask::Arith,
        8,
        1,
        asyncrl_tasks::GenerateOptions { max_operand: 20 },
    );
    asyncrl_tasks::write_jsonl(&path, &items).expect("write tasks");
    path
}

fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("asyncrl-bad-input-")
        .tempdir()
        .expect("temp dir")
}

#[test]
fn a_wrong_key_is_named() {
    let dir = tempdir();
    let tasks = tasks_file(dir.path());
    let config = write_config(dir.path(), "typo.toml", "local", "etaa = 2", &tasks);
    let config = config.to_str().expect("utf-8 path");
    for args in [
        vec!["train", config],
        vec!["coordinator", "--config", config],
        vec!["worker", "--config", config],
    ] {
        let out = asyncrl(&args);
        assert_one_error_line(&args, &out, &["staleness.etaa", "unknown field"]);
    }
}

#[test]
fn an_out_of_range_eta_is_named_with_its_range() {
    let dir = tempdir();
    let tasks = tasks_file(dir.path());
    let config = write_config(dir.path(), "eta.toml", "local", "eta = 1000", &tasks);
    let config = config.to_str().expect("utf-8 path");
    for args in [
        vec!["train", config],
        vec!["coordinator", "--config", config],
        vec!["learner", "--config", config],
    ] {
        let out = asyncrl(&args);
        assert_one_error_line(&args, &out, &["staleness.eta", "1000", "[0, 64]"]);
    }
}

#[test]
fn a_missing_task_file_is_named() {
    let dir = tempdir();
    let missing = dir.path().join("no-such-tasks.jsonl");
    let missing_name = missing.to_str().expect("utf-8 path");
    // One process, in-process bus.
    let config = write_config(dir.path(), "local.toml", "local", "", &missing);
    let args = ["train", config.to_str().expect("utf-8 path")];
    let out = asyncrl(&args);
    assert_one_error_line(&args, &out, &[missing_name]);
    // The coordinator as its own process, against a real server.
    let nats = NatsServer::start().expect("start nats-server (run scripts/setup)");
    let config = write_config(dir.path(), "nats.toml", &nats.url(), "", &missing);
    let args = [
        "coordinator",
        "--config",
        config.to_str().expect("utf-8 path"),
    ];
    let out = asyncrl(&args);
    assert_one_error_line(&args, &out, &[missing_name]);
}

#[test]
fn an_unreachable_nats_server_is_named_after_the_connect_timeout() {
    let dir = tempdir();
    let tasks = tasks_file(dir.path());
    let port = asyncrl_testkit::free_port().expect("a free port");
    let url = format!("nats://127.0.0.1:{port}");
    let config = write_config(dir.path(), "unreachable.toml", &url, "", &tasks);
    let config = config.to_str().expect("utf-8 path");
    for args in [
        vec!["coordinator", "--config", config],
        vec!["buffer", "--config", config],
        vec!["learner", "--config", config],
        vec!["worker", "--config", config],
        vec!["train", config],
    ] {
        let start = Instant::now();
        let out = asyncrl(&args);
        assert_one_error_line(&args, &out, &[&url]);
        // bus.connect_timeout = 1s: it gives up, it does not hang.
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{args:?} took {:?}",
            start.elapsed()
        );
    }
}

#[test]
fn a_role_without_a_nats_bus_says_so() {
    let dir = tempdir();
    let tasks = tasks_file(dir.path());
    let config = write_config(dir.path(), "local.toml", "local", "", &tasks);
    let config = config.to_str().expect("utf-8 path");
    for role in ["coordinator", "buffer", "learner", "worker"] {
        let args = [role, "--config", config];
        let out = asyncrl(&args);
        assert_one_error_line(&args, &out, &["needs a NATS bus", "bus.url"]);
    }
}

#[test]
fn speedup_bench_refuses_cores_it_cannot_use_before_running_anything() {
    let dir = tempdir();
    let out_dir = dir.path().join("speedup");
    let out_str = out_dir.to_str().expect("utf-8 path");
    for (cores, names) in [
        (
            ["--learner-cores", "1", "--worker-cores", "1"],
            &["core 1 is in both", "--worker-cores"][..],
        ),
        (
            ["--learner-cores", "0", "--worker-cores", "1000"],
            &["core 1000 is not available"][..],
        ),
    ] {
        let mut args = vec!["speedup", "--out", out_str];
        args.extend(cores);
        let out = asyncrl_bench(&args);
        assert_one_error_line(&args, &out, names);
        assert!(!out_dir.exists(), "nothing is written before the checks");
    }
}

#[test]
fn a_second_in_process_run_into_the_same_directory_needs_fresh() {
    let dir = tempdir();
    let tasks = tasks_file(dir.path());
    let config = write_config(dir.path(), "local.toml", "local", "", &tasks);
    let config = config.to_str().expect("utf-8 path");
    let first = ["train", config];
    let out = asyncrl(&first);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let steps = |dir: &Path| {
        std::fs::read_to_string(dir.join("out").join("learner_metrics.csv"))
            .expect("metrics")
            .lines()
            .count()
            - 1
    };
    assert_eq!(steps(dir.path()), 1);

    // Again without --fresh: refused before anything runs, naming the way out.
    let out = asyncrl(&first);
    assert_one_error_line(&first, &out, &["holds a previous run", "--fresh"]);
    assert_eq!(steps(dir.path()), 1, "nothing was touched");

    // With --fresh: a new run from step 0, not a second step on the old one.
    let again = ["train", "--fresh", config];
    let out = asyncrl(&again);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(steps(dir.path()), 1);
    assert!(String::from_utf8_lossy(&out.stdout).contains("trained 1 steps"));

    // --fresh over NATS is refused (the server's state is what resumes).
    let nats = ["train", "--fresh", "--bus", "nats://127.0.0.1:1", config];
    let out = asyncrl(&nats);
    assert_one_error_line(&nats, &out, &["--fresh", "over NATS"]);
}
