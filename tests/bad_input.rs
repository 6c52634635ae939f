//! Bad input through the binary, as a user meets it: a config with a wrong
//! key, an out-of-range η, a missing task file, an unreachable NATS server,
//! a role without a NATS bus. Each gives exactly one stderr line, starting
//! with `error:` and naming the problem, a non-zero exit, and no panic or
//! backtrace (even with RUST_BACKTRACE=1).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use asyncrl_harness::configs;
use asyncrl_learner::outputs::{METRICS_CSV, read_metrics};
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

/// A valid config for `bus` and the task file `tasks`, with `staleness`
/// keys set in `[staleness]` as TOML values: they may be unknown or out of
/// range, which only the text of a file can hold (a `Config` is valid).
fn write_config(
    dir: &Path,
    name: &str,
    bus: &str,
    staleness: &[(&str, i64)],
    tasks: &Path,
) -> PathBuf {
    let mut config = configs::tiny_run(dir.join("out"), bus, tasks);
    config.run.name = "bad-input".into();
    config.run.max_steps = 1;
    config.staleness.groups_per_step = 1;
    config.staleness.group_size = 2;
    config.bus.connect_timeout = Duration::from_secs(1);
    config.model.max_new_tokens = 2;
    config.model.max_seq_len = 16;
    let path = dir.join(name);
    if staleness.is_empty() {
        return configs::write(&config, path);
    }
    let mut table: toml::Table = config
        .to_toml()
        .expect("a config as TOML")
        .parse()
        .expect("TOML");
    let section = table
        .get_mut("staleness")
        .and_then(toml::Value::as_table_mut)
        .expect("[staleness]");
    for (key, value) in staleness {
        section.insert((*key).to_owned(), toml::Value::Integer(*value));
    }
    std::fs::write(&path, table.to_string()).expect("write a config");
    path
}

fn tasks_file(dir: &Path) -> PathBuf {
    configs::write_arith(dir.join("tasks.jsonl"), 8, 20, 1)
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
    let config = write_config(dir.path(), "typo.toml", "local", &[("etaa", 2)], &tasks);
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
    let config = write_config(dir.path(), "eta.toml", "local", &[("eta", 1000)], &tasks);
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
    let config = write_config(dir.path(), "local.toml", "local", &[], &missing);
    let args = ["train", config.to_str().expect("utf-8 path")];
    let out = asyncrl(&args);
    assert_one_error_line(&args, &out, &[missing_name]);
    // The coordinator as its own process, against a real server.
    let nats = NatsServer::start().expect("start nats-server (run scripts/setup)");
    let config = write_config(dir.path(), "nats.toml", &nats.url(), &[], &missing);
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
    let config = write_config(dir.path(), "unreachable.toml", &url, &[], &tasks);
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
    let config = write_config(dir.path(), "local.toml", "local", &[], &tasks);
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
    let config = write_config(dir.path(), "local.toml", "local", &[], &tasks);
    let config = config.to_str().expect("utf-8 path");
    let first = ["train", config];
    let out = asyncrl(&first);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let steps = |dir: &Path| {
        read_metrics(&dir.join("out").join(METRICS_CSV))
            .expect("metrics")
            .len()
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

/// `config`'s TOML with `[learner]` keys replaced by `learner` and
/// `[learner.torch]` keys by `torch` (values a `Config` may not hold).
fn with_learner_keys(
    config: &Path,
    learner: &[(&str, toml::Value)],
    torch: &[(&str, toml::Value)],
) {
    let mut table: toml::Table = std::fs::read_to_string(config)
        .expect("read a config")
        .parse()
        .expect("TOML");
    let section = table
        .entry("learner")
        .or_insert_with(|| toml::Value::Table(toml::Table::new()))
        .as_table_mut()
        .expect("[learner]");
    for (key, value) in learner {
        section.insert((*key).to_owned(), value.clone());
    }
    let sub = section
        .entry("torch")
        .or_insert_with(|| toml::Value::Table(toml::Table::new()))
        .as_table_mut()
        .expect("[learner.torch]");
    for (key, value) in torch {
        sub.insert((*key).to_owned(), value.clone());
    }
    std::fs::write(config, table.to_string()).expect("write a config");
}

/// A config file name, its `[learner]` and `[learner.torch]` keys, and
/// what the error line must name.
type Case = (
    &'static str,
    Vec<(&'static str, toml::Value)>,
    Vec<(&'static str, toml::Value)>,
    Vec<String>,
);

#[test]
fn the_torch_engine_names_an_unknown_engine_a_world_size_and_a_model_folder_it_cannot_load() {
    let dir = tempdir();
    let tasks = tasks_file(dir.path());
    let nats = NatsServer::start().expect("start nats-server (run scripts/setup)");
    // A folder transformers cannot load (the learner alone: a vLLM worker
    // would never look at it).
    let model = dir.path().join("not-a-model");
    std::fs::create_dir_all(&model).expect("mkdir");
    std::fs::write(
        model.join("config.json"),
        r#"{"model_type": "no-such-architecture"}"#,
    )
    .expect("write config.json");
    let torch = toml::Value::String("torch".into());
    let cases: Vec<Case> = vec![
        (
            "unknown.toml",
            vec![("trainer", toml::Value::String("megatron".into()))],
            vec![],
            vec!["learner.trainer".into(), "megatron".into()],
        ),
        (
            "world.toml",
            vec![("trainer", torch.clone())],
            // 1 group × 2 rows cannot be shared by 4 ranks.
            vec![("world_size", toml::Value::Integer(4))],
            vec!["learner.torch.world_size".into()],
        ),
        (
            "folder.toml",
            vec![("trainer", torch)],
            vec![],
            vec!["model.path".into(), model.display().to_string()],
        ),
    ];
    for (name, learner, torch, names) in cases {
        let config = write_config(dir.path(), name, &nats.url(), &[], &tasks);
        with_learner_keys(&config, &learner, &torch);
        let mut text: toml::Table = std::fs::read_to_string(&config)
            .expect("read")
            .parse()
            .expect("TOML");
        text["model"].as_table_mut().expect("[model]").insert(
            "path".into(),
            toml::Value::String(model.display().to_string()),
        );
        std::fs::write(&config, text.to_string()).expect("write");
        let config = config.to_str().expect("utf-8 path");
        let args = ["learner", "--config", config];
        let out = asyncrl(&args);
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        assert_one_error_line(&args, &out, &names);
    }
}

/// A config's `[learner]` and `[learner.torch]` keys, the flags of
/// `asyncrl trainer-node`, and what its error line must name.
type NodeCase = (
    &'static str,
    Vec<(&'static str, toml::Value)>,
    Vec<(&'static str, toml::Value)>,
    &'static [&'static str],
    &'static [&'static str],
);

#[test]
fn a_trainer_node_names_the_key_or_flag_that_leaves_it_nothing_to_join() {
    let dir = tempdir();
    let tasks = tasks_file(dir.path());
    let torch = toml::Value::String("torch".into());
    let two_nodes = vec![
        ("world_size", toml::Value::Integer(2)),
        ("nodes", toml::Value::Integer(2)),
        ("rendezvous", toml::Value::String("127.0.0.1:29500".into())),
    ];
    let cases: Vec<NodeCase> = vec![
        (
            "builtin.toml",
            vec![],
            two_nodes.clone(),
            &["--node-rank", "1"],
            &["learner.trainer", "builtin"],
        ),
        (
            "one-node.toml",
            vec![("trainer", torch.clone())],
            vec![],
            &["--node-rank", "1"],
            &["learner.torch.nodes"],
        ),
        (
            "rank.toml",
            vec![("trainer", torch.clone())],
            two_nodes.clone(),
            &["--node-rank", "2"],
            &["--node-rank 2", "1 to 1"],
        ),
        (
            "index.toml",
            vec![("trainer", torch)],
            two_nodes,
            &[],
            &["JOB_COMPLETION_INDEX"],
        ),
    ];
    for (name, learner, torch, flags, names) in cases {
        let config = write_config(dir.path(), name, "nats://127.0.0.1:4222", &[], &tasks);
        with_learner_keys(&config, &learner, &torch);
        let mut text: toml::Table = std::fs::read_to_string(&config)
            .expect("read")
            .parse()
            .expect("TOML");
        text["model"]
            .as_table_mut()
            .expect("[model]")
            .insert("path".into(), toml::Value::String("model".into()));
        std::fs::write(&config, text.to_string()).expect("write");
        let config = config.to_str().expect("utf-8 path");
        let mut args = vec!["trainer-node", "--config", config];
        args.extend_from_slice(flags);
        let out = asyncrl(&args);
        assert_one_error_line(&args, &out, names);
    }
}

/// A model folder whose chat template runs away (a loop without end, a
/// string doubled 40 times, one that runs away only on some prompts):
/// `--check-config` and `train` stop with one line naming the template
/// file and the limit, instead of hanging or taking the machine's memory.
#[test]
fn a_runaway_chat_template_is_one_error_naming_the_file_and_the_limit() {
    let dir = tempdir();
    let model = dir.path().join("model");
    asyncrl_policy::Policy::builtin_tiny(
        &asyncrl_policy::TinyModelSpec {
            hidden_size: 16,
            num_hidden_layers: 1,
            num_attention_heads: 2,
            num_key_value_heads: 1,
            intermediate_size: 32,
            ..Default::default()
        },
        1,
        asyncrl_policy::DeviceOptions::cpu(),
    )
    .unwrap()
    .save_pretrained(&model, None)
    .unwrap();
    let tasks = tasks_file(dir.path());
    let mut config = configs::tiny_run(dir.path().join("out"), "local", &tasks);
    config.model.path = Some(model.clone());
    config.coordinator.datasets[0].apply_chat_template = true;
    let cfg = configs::write(&config, dir.path().join("asyncrl.toml"));
    let cfg = cfg.to_str().unwrap();
    let end = "{% for m in messages %}{{ m.content }}{% endfor %}";
    for (template, limit) in [
        (
            format!(
                "{{% for a in range(100000) %}}{{% for b in range(100000) %}}{{% endfor %}}{{% endfor %}}{end}"
            ),
            "fuel limit",
        ),
        (
            format!(
                "{{% set ns = namespace(s='x') %}}{{% for i in range(40) %}}{{% set ns.s = ns.s ~ ns.s %}}{{% endfor %}}{{{{ ns.s|length }}}}{end}"
            ),
            "size limit",
        ),
        (
            // Only prompts with a `7` run away: found when the data set is
            // measured at load.
            format!(
                "{{% if '7' in messages[-1].content %}}{{% for a in range(100000) %}}{{% for b in range(100000) %}}{{% endfor %}}{{% endfor %}}{{% endif %}}{end}"
            ),
            "fuel limit",
        ),
    ] {
        std::fs::write(model.join("chat_template.jinja"), template).unwrap();
        for args in [vec!["train", cfg, "--check-config"], vec!["train", cfg]] {
            let out = asyncrl(&args);
            assert_one_error_line(&args, &out, &["chat_template.jinja", limit]);
        }
    }
}
