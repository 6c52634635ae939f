//! Held-out evaluation through the binary: `[eval]` in a run writes one
//! `eval.csv` row per evaluated version (the first, every N-th, the last),
//! a plot and a summary line; `asyncrl eval` on the checkpoint of a
//! version reproduces that version's row (the row names the weights it
//! scored); and bad input to `asyncrl eval` is one error line naming it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use asyncrl_harness::configs;
use asyncrl_learner::outputs::{EVAL_CSV, read_eval};

fn asyncrl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_asyncrl"))
        .args(args)
        .env("NO_COLOR", "1")
        .env("RUST_BACKTRACE", "1")
        .env_remove("RUST_LOG")
        .output()
        .expect("run asyncrl")
}

fn ok(args: &[&str]) -> String {
    let out = asyncrl(args);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "asyncrl {args:?} failed\nstdout: {stdout}\nstderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// One `error:` line on stderr naming each of `names`, exit code 1.
fn one_error_line(args: &[&str], names: &[&str]) {
    let out = asyncrl(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let context = format!("asyncrl {args:?}\nstderr: {stderr}");
    assert_eq!(out.status.code(), Some(1), "{context}");
    assert_eq!(stderr.lines().count(), 1, "one line: {context}");
    assert!(stderr.starts_with("error: "), "{context}");
    for name in names {
        assert!(stderr.contains(name), "should name {name:?}: {context}");
    }
    assert!(!stderr.contains("panicked"), "{context}");
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// Every arith problem with operands below 4 (32 problems).
fn eval_file(dir: &Path) -> PathBuf {
    configs::write_arith_all(dir.join("arith-all.jsonl"), 4)
}

/// The run's config; `model` is the warm-started model folder (none: the
/// built-in model from the seed).
fn config(dir: &Path, train: &Path, eval: &Path, model: Option<&Path>) -> PathBuf {
    let mut c = configs::tiny_run(dir.join("out"), "local", train);
    c.run.name = "eval".into();
    c.run.max_steps = 5;
    c.run.seed = 4;
    c.staleness.eta = 1;
    c.staleness.groups_per_step = 2;
    c.staleness.group_size = 4;
    c.model.path = model.map(Path::to_owned);
    c.model.max_new_tokens = 3;
    c.model.max_seq_len = 16;
    c.coordinator.initial_knobs.learning_rate = 3e-2;
    c.learner.checkpoint_every = 1;
    c.learner.keep_checkpoints = 8;
    c.eval.every_steps = 2;
    c.eval.samples = 2;
    c.eval.dataset = Some(configs::arith(eval));
    let name = if model.is_some() {
        "run.toml"
    } else {
        "warm.toml"
    };
    configs::write(&c, dir.join(name))
}

/// (version, greedy, sampled, pass@k) of each `eval.csv` row, each of 32
/// problems and k = 2.
fn eval_rows(csv: &Path) -> Vec<(i32, f64, f64, f64)> {
    read_eval(csv)
        .expect("eval.csv")
        .into_iter()
        .map(|r| {
            let s = &r.scores;
            assert_eq!(s.problems, 32, "problems: {r:?}");
            assert_eq!(s.k, 2, "k: {r:?}");
            let score = |v: Option<f64>| v.unwrap_or_else(|| panic!("a score missing: {r:?}"));
            (
                r.version,
                score(s.greedy),
                score(s.sampled),
                score(s.pass_at_k),
            )
        })
        .collect()
}

#[test]
fn a_run_evaluates_its_versions_and_asyncrl_eval_reproduces_them() {
    let dir = tempfile::tempdir().unwrap();
    let train = configs::write_arith(dir.path().join("train.jsonl"), 400, 4, 2);
    let eval = eval_file(dir.path());
    // A warm start first, so that accuracies are not all 0 and differ
    // between versions (a Hugging Face folder `asyncrl eval` also reads).
    let warm = config(dir.path(), &train, &eval, None);
    let model = dir.path().join("model");
    ok(&[
        "warmstart",
        s(&warm),
        "--out",
        s(&model),
        "--steps",
        "150",
        "--eval",
        "4",
    ]);
    // warmstart.json records what the warm start was made with (scripts/run
    // redoes one made with other settings) and how it scored.
    let record: serde_json::Value = serde_json::from_slice(
        &std::fs::read(model.join("warmstart.json")).expect("warmstart.json"),
    )
    .expect("warmstart.json is JSON");
    assert_eq!(record["steps"], 150, "{record}");
    assert_eq!(record["batch_size"], 64, "{record}");
    assert_eq!(record["learning_rate"], 3e-3, "{record}");
    assert_eq!(record["eval_items"], 4, "{record}");
    for when in ["before", "after"] {
        let greedy = record[when]["greedy"].as_f64().expect("a greedy accuracy");
        assert!((0.0..=1.0).contains(&greedy), "{record}");
    }
    let text = ok(&[
        "eval",
        s(&model),
        "--data",
        s(&eval),
        "--max-new-tokens",
        "3",
    ]);
    assert!(text.contains("32 problems: greedy accuracy"), "{text}");
    let cfg = config(dir.path(), &train, &eval, Some(&model));
    let out = ok(&["train", s(&cfg)]);
    assert!(
        out.contains("held-out evaluation (32 problems, 4 versions)"),
        "{out}"
    );

    let run = dir.path().join("out");
    let rows = eval_rows(&run.join(EVAL_CSV));
    // The start, every 2nd version, and the last (5 is not a multiple of 2).
    let versions: Vec<i32> = rows.iter().map(|r| r.0).collect();
    assert_eq!(versions, vec![0, 2, 4, 5]);
    for r in &rows {
        for v in [r.1, r.2, r.3] {
            assert!((0.0..=1.0).contains(&v), "{r:?}");
        }
        assert!(
            r.3 >= r.2 - 1e-9,
            "pass@2 is at least the sampled accuracy: {r:?}"
        );
    }
    assert!(run.join("eval_accuracy.png").is_file());

    // The weights of version 4 are its checkpoint's: evaluated apart, the
    // scores are the row's. A learning rate this high moves the weights
    // far in a step, so versions score differently and a row that scored
    // the wrong version would not match.
    let ckpts = run.join("checkpoints");
    let json = |model: &Path| -> serde_json::Value {
        let out = ok(&[
            "eval",
            s(model),
            "--config",
            s(&cfg),
            "--data",
            s(&eval),
            "--json",
        ]);
        serde_json::from_str(out.trim()).expect("one JSON line")
    };
    for (version, dir) in [(4, "step-00000004"), (2, "step-00000002")] {
        let got = json(&ckpts.join(dir));
        let row = rows.iter().find(|r| r.0 == version).unwrap();
        assert_eq!(got["version"], version);
        assert_eq!(got["problems"], 32);
        for (key, want) in [
            ("greedy_accuracy", row.1),
            ("sampled_accuracy", row.2),
            ("pass_at_k", row.3),
        ] {
            let v = got[key].as_f64().unwrap();
            assert!((v - want).abs() < 1e-6, "v{version} {key}: {v} vs {want}");
        }
    }
    // The folder of checkpoints: its newest, version 5.
    assert_eq!(json(&ckpts)["version"], 5);
    let distinct: std::collections::HashSet<String> = rows
        .iter()
        .map(|r| format!("{:.6}/{:.6}", r.1, r.2))
        .collect();
    assert!(
        distinct.len() > 1,
        "every version scored the same: {rows:?}"
    );
}

#[test]
fn bad_input_to_asyncrl_eval_is_one_line_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let eval = eval_file(dir.path());
    let missing = dir.path().join("no-such-model");
    one_error_line(
        &["eval", s(&missing), "--data", s(&eval)],
        &["no-such-model", "is not a folder"],
    );

    // A model folder: the built-in model saved as Hugging Face files.
    let model = dir.path().join("model");
    let policy = asyncrl_policy::Policy::builtin_tiny(
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
    .unwrap();
    policy.save_pretrained(&model, None).unwrap();

    let no_answers = dir.path().join("arith-questions.jsonl");
    std::fs::write(
        &no_answers,
        "{\"prompt\": \"1+1=\"}\n{\"prompt\": \"2+2=\"}\n",
    )
    .unwrap();
    one_error_line(
        &["eval", s(&model), "--data", s(&no_answers)],
        &["arith-questions.jsonl", "line 1", "`answer`", "missing"],
    );

    one_error_line(
        &[
            "eval",
            s(&model),
            "--data",
            s(&eval),
            "--max-problems",
            "10",
        ],
        &["arith-all.jsonl", "32 problems", "eval.max_problems = 10"],
    );
    one_error_line(
        &[
            "eval",
            s(&model),
            "--data",
            s(&eval),
            "--problems",
            "40",
            "--max-problems",
            "100",
        ],
        &["eval.problems = 40", "only 32"],
    );

    let unknown = dir.path().join("questions.jsonl");
    std::fs::copy(&eval, &unknown).unwrap();
    one_error_line(
        &["eval", s(&model), "--data", s(&unknown)],
        &["questions.jsonl", "--verifier"],
    );

    // A checkpoint holds weights only: without a base model it says so.
    let ckpt = dir.path().join("step-00000003");
    std::fs::create_dir(&ckpt).unwrap();
    let bytes = policy
        .weights_to_safetensors(asyncrl_policy::WeightDtype::F32)
        .unwrap();
    let mut meta = asyncrl_learner::checkpoint::CheckpointMeta {
        format: 1,
        step: 3,
        version: 3,
        optimizer_step: 3,
        rng_state: 0,
        created_at_unix_ms: 0,
        model_sha256: String::new(),
        optimizer_sha256: String::new(),
    };
    let written = asyncrl_learner::checkpoint::write(dir.path(), &mut meta, &bytes, b"").unwrap();
    assert_eq!(written, ckpt);
    one_error_line(
        &["eval", s(&ckpt), "--data", s(&eval)],
        &["step-00000003", "--base-model"],
    );
    let out = ok(&[
        "eval",
        s(&ckpt),
        "--base-model",
        s(&model),
        "--data",
        s(&eval),
        "--max-new-tokens",
        "3",
    ]);
    assert!(out.contains("(version 3): 32 problems"), "{out}");
}

/// The weights and `warmstart.json` of a 30-step warm start of `warm` (a
/// config) into `dir/name`, made with `args` added and `env` set on top of
/// an environment without any kernel settings.
fn warm_start_with(
    warm: &Path,
    dir: &Path,
    name: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> (Vec<u8>, serde_json::Value) {
    let out = dir.join(name);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_asyncrl"));
    cmd.args([
        "warmstart",
        s(warm),
        "--out",
        s(&out),
        "--steps",
        "30",
        "--eval",
        "4",
    ])
    .args(args)
    .env_remove("RUST_LOG")
    .env_remove("MKL_ENABLE_INSTRUCTIONS");
    for (name, _) in asyncrl_policy::kernels::PORTABLE {
        cmd.env_remove(name);
    }
    cmd.envs(env.iter().copied());
    let done = cmd.output().expect("run asyncrl warmstart");
    assert!(
        done.status.success(),
        "asyncrl warmstart {args:?} with {env:?} failed\nstderr: {}",
        String::from_utf8_lossy(&done.stderr)
    );
    let weights = std::fs::read(out.join("model.safetensors")).expect("the weights");
    let record =
        serde_json::from_slice(&std::fs::read(out.join("warmstart.json")).expect("warmstart.json"))
            .expect("warmstart.json is JSON");
    (weights, record)
}

/// A warm start pins libtorch to portable CPU kernels, so one command makes
/// the same weights whatever kernels the CPU offers. Other CPUs are
/// emulated by capping ATen, MKL and oneDNN at AVX2, or ATen at its
/// baseline: with `--native-kernels` those caps change the weights (so the
/// comparison can fail), by default they do not. (MKL ignores its caps on
/// an AMD CPU, so an Intel CPU's MKL path is beyond this emulation; the
/// pin relies there on MKL's promise for `MKL_CBWR=COMPATIBLE`.)
#[test]
fn a_warm_start_makes_the_same_weights_whatever_kernels_the_cpu_offers() {
    let dir = tempfile::tempdir().unwrap();
    let train = configs::write_arith(dir.path().join("train.jsonl"), 400, 4, 2);
    let eval = eval_file(dir.path());
    let warm = config(dir.path(), &train, &eval, None);
    let avx2 = [
        ("ATEN_CPU_CAPABILITY", "avx2"),
        ("MKL_ENABLE_INSTRUCTIONS", "AVX2"),
        ("ONEDNN_MAX_CPU_ISA", "AVX2"),
    ];
    let baseline_aten = [("ATEN_CPU_CAPABILITY", "default")];

    let (native_avx2, record) = warm_start_with(
        &warm,
        dir.path(),
        "native-avx2",
        &["--native-kernels"],
        &avx2,
    );
    assert_eq!(record["kernels"], "native", "{record}");
    let (native_baseline, _) = warm_start_with(
        &warm,
        dir.path(),
        "native-baseline",
        &["--native-kernels"],
        &baseline_aten,
    );
    assert_ne!(
        native_avx2, native_baseline,
        "native kernels: capping ATen's kernels should change the weights"
    );

    let (portable, record) = warm_start_with(&warm, dir.path(), "portable", &[], &[]);
    assert_eq!(record["kernels"], "portable", "{record}");
    for (name, env) in [("avx2", &avx2[..]), ("baseline", &baseline_aten[..])] {
        let (weights, _) =
            warm_start_with(&warm, dir.path(), &format!("portable-{name}"), &[], env);
        assert!(
            weights == portable,
            "portable kernels, emulating {name}: other weights"
        );
    }
}
