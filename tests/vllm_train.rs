//! `asyncrl train` with the rollout worker generating through a real vLLM
//! CPU server (launched by the worker from `.venv-vllm`), against the same
//! run with the built-in engine, from the same warm start: both learn
//! `arith` and end at the same reward (within seed noise); the vLLM server
//! is killed with SIGKILL mid-run and the run still completes, with no
//! trajectory trained twice and every token's log-prob matching the
//! learner's.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use asyncrl_config::{
    Config, EngineConfig, EvalConfig, ProximalName, TrainerEngineName, WeightTransportName,
};
use asyncrl_harness::configs;
use asyncrl_harness::invariants::{TrainedCheck, check_trained_file};
use asyncrl_learner::outputs::{EVAL_CSV, METRICS_CSV, TRAINED_JSONL, read_eval, read_metrics};

const STEPS: usize = 400;

fn asyncrl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_asyncrl"))
        .args(args)
        .output()
        .expect("run asyncrl")
}

fn succeeded(what: &str, out: &Output) {
    assert!(
        out.status.success(),
        "{what} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// examples/arith.toml with its paths in `dir`, its ports free, STEPS
/// steps and no held-out evaluation, generating with `engine` (none: the
/// built-in engine); returns the file it is written to.
fn config(dir: &Path, name: &str, engine: Option<EngineConfig>) -> PathBuf {
    let mut c = Config::load(&root().join("examples/arith.toml")).expect("examples/arith.toml");
    c.run.max_steps = STEPS as u64;
    c.run.name = name.into();
    c.run.output_dir = dir.join(name);
    c.telemetry.listen = "127.0.0.1:0".into();
    c.coordinator.admin_listen = "127.0.0.1:0".into();
    c.model.path = Some(dir.join("warm"));
    c.coordinator.datasets = vec![configs::arith(&dir.join("arith.jsonl"))];
    c.eval = EvalConfig::default();
    if let Some(engine) = engine {
        c.worker.engine = engine;
    }
    configs::write(&c, dir.join(format!("{name}.toml")))
}

/// A vLLM server the worker launches from `.venv-vllm` on `port`, serving
/// the warm start; it writes its pid to `pid_file`.
fn vllm_engine(dir: &Path, port: u16, pid_file: &Path) -> EngineConfig {
    vllm_engine_for(
        &dir.join("warm"),
        &dir.join("engine-weights"),
        port,
        pid_file,
    )
}

/// A vLLM server the worker launches from `.venv-vllm` on `port`, serving
/// `model`, its weights swapped through `weights_dir`.
fn vllm_engine_for(model: &Path, weights_dir: &Path, port: u16, pid_file: &Path) -> EngineConfig {
    configs::launched_vllm(model, weights_dir, port, Some(pid_file))
}

/// `arith` data in `dir/arith.jsonl` (`data_args` after the task and seed),
/// the run's config `dir/<name>.toml`, and the warm start of its model in
/// `dir/warm` (`warm_args` after the output); returns the config.
fn warm_start(dir: &Path, name: &str, data_args: &[&str], warm_args: &[&str]) -> PathBuf {
    let data = dir.join("arith.jsonl");
    let mut args = vec!["data", "generate", "--task", "arith", "--seed", "1"];
    args.extend_from_slice(data_args);
    args.extend(["--out", data.to_str().unwrap()]);
    succeeded("data generate", &asyncrl(&args));
    let config = config(dir, name, None);
    let warm = dir.join("warm");
    let mut args = vec![
        "warmstart",
        config.to_str().unwrap(),
        "--out",
        warm.to_str().unwrap(),
    ];
    args.extend_from_slice(warm_args);
    succeeded("warmstart", &asyncrl(&args));
    config
}

struct Run {
    rewards: Vec<f64>,
    gap_max: f64,
    lag_max: f64,
    trained: TrainedCheck,
}

fn read_run(out: &Path) -> Run {
    let rows = read_metrics(&out.join(METRICS_CSV)).expect("learner_metrics.csv");
    Run {
        rewards: rows.iter().map(|r| r.reward_mean).collect(),
        gap_max: rows
            .iter()
            .map(|r| r.logprob_gap_max)
            .filter(|g| g.is_finite())
            .fold(0.0, f64::max),
        lag_max: rows.iter().map(|r| r.version_lag_max).fold(0.0, f64::max),
        // examples/arith.toml: η = 4, B·G = 16 · 8.
        trained: check_trained_file(&out.join(TRAINED_JSONL), 4, 16 * 8),
    }
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

fn steps_done(out: &Path) -> usize {
    read_metrics(&out.join(METRICS_CSV)).map_or(0, |rows| rows.len())
}

#[test]
fn train_with_vllm_learns_like_the_builtin_engine_and_survives_a_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let builtin = warm_start(
        d,
        "builtin",
        &["--n", "20000", "--max-operand", "20"],
        &["--steps", "600"],
    );
    succeeded(
        "train (built-in)",
        &asyncrl(&["train", builtin.to_str().unwrap()]),
    );

    let port = asyncrl_testkit::free_port().unwrap();
    let pid_file = d.join("vllm.pid");
    let vllm = config(d, "vllm", Some(vllm_engine(d, port, &pid_file)));
    let mut child = Command::new(env!("CARGO_BIN_EXE_asyncrl"))
        .args(["train", vllm.to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // SIGKILL the vLLM server a quarter into the run.
    let started = Instant::now();
    while steps_done(&d.join("vllm")) < STEPS / 4 {
        assert!(
            started.elapsed() < Duration::from_secs(900),
            "the vLLM run did not reach step {}",
            STEPS / 4
        );
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the vLLM run ended early: {status}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let pid: i32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // SAFETY: kills the vLLM server this run's worker launched.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let out = child.wait_with_output().unwrap();
    succeeded("train (vLLM)", &out);
    let restarted: i32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_ne!(pid, restarted, "the worker did not restart the vLLM server");

    let b = read_run(&d.join("builtin"));
    let v = read_run(&d.join("vllm"));
    for (name, run) in [("built-in", &b), ("vLLM", &v)] {
        assert_eq!(run.rewards.len(), STEPS, "{name}");
        assert_eq!(run.trained.max_step, STEPS as u64, "{name}");
        // No trajectory trained twice, none staler than η, versions in order.
        let violations = run.trained.violations();
        assert!(violations.is_empty(), "{name}: {violations:#?}");
        assert!(run.lag_max <= 4.0, "{name}: a token older than eta");
    }
    // The learner's recompute matches what vLLM sampled with.
    assert!(
        v.gap_max < 1e-3,
        "engine/trainer log-prob gap {}",
        v.gap_max
    );
    let first = |r: &Run| mean(&r.rewards[..100]);
    let last = |r: &Run| mean(&r.rewards[STEPS - 100..]);
    eprintln!(
        "reward first/last 100 steps: built-in {:.3} -> {:.3}, vLLM {:.3} -> {:.3}; vLLM gap max {:.2e}",
        first(&b),
        last(&b),
        first(&v),
        last(&v),
        v.gap_max
    );
    for (name, run) in [("built-in", &b), ("vLLM", &v)] {
        assert!(
            last(run) > first(run) + 0.01,
            "{name} did not learn: {:.3} -> {:.3}",
            first(run),
            last(run)
        );
    }
    assert!(
        (last(&v) - last(&b)).abs() < 0.04,
        "the engines end apart: built-in {:.3}, vLLM {:.3}",
        last(&b),
        last(&v)
    );
}

#[test]
fn engine_bench_reports_throughput_overhead_and_swap_ratios() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    warm_start(
        d,
        "bench",
        &["--n", "200"],
        &["--steps", "2", "--eval", "4"],
    );
    let warm = d.join("warm");
    let port = asyncrl_testkit::free_port().unwrap().to_string();
    let bench = asyncrl_harness::process::bench_bin().expect("the asyncrl-bench binary");
    let out = Command::new(bench)
        .args([
            "engine",
            "--model",
            warm.to_str().unwrap(),
            "--vllm-python",
            root().join(".venv-vllm/bin/python").to_str().unwrap(),
            "--requests",
            "32",
            "--max-new-tokens",
            "8",
            "--concurrency",
            "8",
            "--swaps",
            "2",
            "--port",
            &port,
        ])
        .output()
        .expect("run asyncrl-bench");
    succeeded("asyncrl-bench engine", &out);
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!("{report}");
    let number_after = |label: &str| -> f64 {
        let rest = &report[report
            .find(label)
            .unwrap_or_else(|| panic!("no {label:?} in {report}"))
            + label.len()..];
        rest.trim_start()
            .split(|c: char| !(c.is_ascii_digit() || c == '.'))
            .next()
            .unwrap()
            .parse()
            .unwrap_or_else(|e| panic!("{label}: {e} in {report}"))
    };
    assert!(number_after("ratio vLLM / built-in tokens/s:") > 0.0);
    assert!(number_after("worker CPU around vLLM:") > 0.0);
    let swap = number_after("median");
    assert!(swap > 0.0);
    assert!(report.contains("raw reload_weights: median"), "{report}");
    // Both engines generated: tokens/s lines for each.
    assert_eq!(report.matches("tokens/s\n").count(), 2, "{report}");
    // The bench stopped the server it launched.
    assert!(std::net::TcpStream::connect(("127.0.0.1", port.parse::<u16>().unwrap())).is_err());
}

/// An architecture the built-in model does not run, end to end: a tiny
/// random Hugging Face model of it (`asyncrl_trainer.tiny`, the built-in
/// model's character tokenizer) trained by the torch engine while vLLM
/// generates, with each weight transport. η = 0, so every step trains
/// tokens sampled by the version it starts from and the learner's
/// recompute (transformers, under that version) covers every one of them;
/// weight decay makes every version differ, so a vLLM that missed a reload
/// would show in the gap. Each run's gap must stay within 1e-4.
fn architecture_round_trip(arch: &str) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data = d.join("arith.jsonl");
    succeeded(
        "data generate",
        &asyncrl(&[
            "data",
            "generate",
            "--task",
            "arith",
            "--seed",
            "1",
            "--n",
            "2000",
            "--max-operand",
            "20",
            "--out",
            data.to_str().unwrap(),
        ]),
    );
    let tokenizer = d.join("tokenizer-source");
    let section = Config::load(&root().join("examples/arith.toml"))
        .unwrap()
        .model;
    let builtin = asyncrl_config::ModelConfig {
        path: None,
        ..section
    };
    asyncrl_policy::from_config::load_policy(&builtin, 0)
        .and_then(|p| p.save_pretrained(&tokenizer, None))
        .expect("the built-in tiny model as a folder");
    let model = d.join(arch);
    let python = root().join(".venv/bin/python");
    succeeded(
        "asyncrl_trainer.tiny",
        &Command::new(&python)
            .args([
                "-m",
                "asyncrl_trainer.tiny",
                "--arch",
                arch,
                "--tokenizer-from",
            ])
            .arg(&tokenizer)
            .arg("--out")
            .arg(&model)
            .output()
            .unwrap(),
    );
    for transport in [
        WeightTransportName::ObjectStore,
        WeightTransportName::SharedPath,
    ] {
        let name = format!("{arch}-{transport:?}");
        let out = d.join(&name);
        let port = asyncrl_testkit::free_port().unwrap();
        let mut c = Config::load(&root().join("examples/arith.toml")).unwrap();
        c.run.max_steps = 4;
        c.run.name = name.clone();
        c.run.output_dir = out.clone();
        c.telemetry.listen = "127.0.0.1:0".into();
        c.coordinator.admin_listen = "127.0.0.1:0".into();
        c.coordinator.datasets = vec![configs::arith(&data)];
        c.coordinator.initial_knobs.learning_rate = 1e-2;
        // Held-out evaluation of versions 0, 2 and 4: `auto` evaluates an
        // architecture the built-in model does not run through a torch
        // engine process of the evaluator's own.
        c.eval = EvalConfig {
            every_steps: 2,
            dataset: Some(configs::arith(&data)),
            problems: 8,
            ..EvalConfig::default()
        };
        c.model.path = Some(model.clone());
        c.staleness.eta = 0;
        c.staleness.groups_per_step = 4;
        c.staleness.group_size = 4;
        c.learner.trainer = TrainerEngineName::Torch;
        c.learner.torch.python = python.clone();
        c.learner.proximal = ProximalName::Recompute;
        c.learner.weight_decay = 1.0;
        c.learner.weight_transport = transport;
        c.learner.shared_weights_dir = Some(out.join("shared"));
        c.worker.engine = vllm_engine_for(
            &model,
            &out.join("engine-weights"),
            port,
            &d.join("vllm.pid"),
        );
        let config = configs::write(&c, d.join(format!("{name}.toml")));
        succeeded(&name, &asyncrl(&["train", config.to_str().unwrap()]));
        let rows = read_metrics(&out.join(METRICS_CSV)).expect("learner_metrics.csv");
        assert_eq!(rows.len(), 4, "{name}");
        for r in &rows {
            assert!(
                r.logprob_gap_tokens > 0,
                "{name}: step {} compared no token",
                r.step
            );
            assert!(
                r.logprob_gap_max <= 1e-4,
                "{name}: step {}: vLLM's log-probs differ from the trainer's by {}",
                r.step,
                r.logprob_gap_max
            );
        }
        // Under shared_path vLLM reloaded the announced folders in place:
        // the worker wrote no copy of a version (these heads are untied).
        let copies: Vec<PathBuf> = std::fs::read_dir(out.join("engine-weights"))
            .into_iter()
            .flatten()
            .flatten()
            .flat_map(|worker| {
                std::fs::read_dir(worker.path())
                    .into_iter()
                    .flatten()
                    .flatten()
            })
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with('v'))
            })
            .collect();
        assert_eq!(
            copies.is_empty(),
            transport == WeightTransportName::SharedPath,
            "{name}: version copies in the engine's weights_dir: {copies:?}"
        );
        let eval = read_eval(&out.join(EVAL_CSV)).expect("eval.csv");
        let versions: Vec<i32> = eval.iter().map(|r| r.version).collect();
        assert_eq!(versions, [0, 2, 4], "{name}: {eval:?}");
        for r in &eval {
            assert_eq!(r.scores.problems, 8, "{name}");
            assert!(
                r.scores.greedy.is_some_and(|g| (0.0..=1.0).contains(&g)),
                "{name}: {r:?}"
            );
        }
        let published = out
            .join("shared")
            .join(asyncrl_protos::subjects::weights_folder_name(4));
        assert_eq!(
            published.join("sha256.json").is_file(),
            transport == WeightTransportName::SharedPath,
            "{name}: {}",
            published.display()
        );
    }
}

#[test]
fn qwen3_trains_with_the_torch_engine_and_stays_token_exact_in_vllm() {
    architecture_round_trip("qwen3");
}

#[test]
fn gemma3_trains_with_the_torch_engine_and_stays_token_exact_in_vllm() {
    architecture_round_trip("gemma3_text");
}

#[test]
fn llama_trains_with_the_torch_engine_and_stays_token_exact_in_vllm() {
    architecture_round_trip("llama");
}
