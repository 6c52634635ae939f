//! A multi-turn run read from outside: `asyncrl train` on the built-in
//! `hidden_sum` task (episodes in the built-in environment, weights
//! published as Hugging Face folders through `shared_path`), then
//! `asyncrl buffer export` to Parquet, read by a Python client that knows
//! only the contract (docs/contracts.md, "Multi-turn episodes"): pyarrow for
//! the file, transformers for the tokenizer, the chat template and the
//! published weights. For every trajectory it checks that
//!
//! - the turns cover the completion and the log-probs and versions are one
//!   per model token: the environment's tokens carry none;
//! - the token ids are the chat template's rendering of the episode's
//!   messages (the task's prompt, each reply as the model wrote it, the
//!   environment's answer to each by the game's rules), tokenized;
//! - every model token's log-prob equals a recompute with the weights of
//!   the version that sampled it (≤ 1e-4).
//!
//! With the built-in engine and with a real vLLM CPU server (token ids in,
//! `/inference/v1/generate`).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use asyncrl_config::{Config, EngineConfig, EnvironmentConfig, EvalConfig, WeightTransportName};
use asyncrl_harness::configs;

fn asyncrl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_asyncrl"))
        .args(args)
        .output()
        .expect("run asyncrl")
}

fn succeeded(what: &str, out: &Output) -> String {
    assert!(
        out.status.success(),
        "{what} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// examples/hidden-sum.toml shrunk to a short run in `dir`: its data, the
/// warm start in `dir/warm`, no tool latency, every published version kept
/// as a folder, generating with `engine` (none: the built-in engine).
fn config(dir: &Path, engine: Option<EngineConfig>) -> PathBuf {
    let mut c =
        Config::load(&root().join("examples/hidden-sum.toml")).expect("examples/hidden-sum.toml");
    c.run.max_steps = 6;
    c.run.name = "episodes".into();
    c.run.output_dir = dir.join("run");
    c.staleness.eta = 2;
    c.staleness.groups_per_step = 4;
    c.staleness.group_size = 4;
    c.telemetry.listen = "127.0.0.1:0".into();
    c.coordinator.admin_listen = "127.0.0.1:0".into();
    c.model.path = Some(dir.join("warm"));
    let mut data = c.coordinator.datasets[0].clone();
    data.path = dir.join("hidden-sum.jsonl");
    c.coordinator.datasets = vec![data];
    c.environment = Some(EnvironmentConfig {
        tool_latency: std::time::Duration::ZERO,
        ..c.environment.clone().expect("[environment]")
    });
    c.learner.weight_transport = WeightTransportName::SharedPath;
    c.learner.shared_weights_dir = Some(dir.join("weights"));
    c.learner.keep_weight_versions = 64;
    // Weight decay: every version's weights differ from the last.
    c.learner.weight_decay = 0.1;
    c.eval = EvalConfig::default();
    if let Some(engine) = engine {
        c.worker.engine = engine;
    }
    configs::write(&c, dir.join("episodes.toml"))
}

/// The contract-only client: prints one JSON object of what it found.
const CLIENT: &str = r#"
import json, sys
import pyarrow.parquet as pq
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

# tasks: the data set's rows by wire task id; folders: the published
# weights' folder by version (both written by the test from the contract).
export, tasks, folders, warm, temperature = sys.argv[1:6]
temperature = float(temperature)
tasks = json.load(open(tasks))
folders = {int(v): f for v, f in json.load(open(folders)).items()}
tok = AutoTokenizer.from_pretrained(warm)
rows = pq.read_table(export).to_pylist()

models = {}
def model(version):
    if version not in models:
        folder = folders.get(version)
        if folder is None:
            assert version == 0, "no folder for version %d" % version
            folder = warm
        m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        models[version] = m.eval()
    return models[version]

report = {"rows": len(rows), "multi_turn": 0, "turns_max": 0, "context_tokens": 0,
          "model_tokens": 0, "gap_max": 0.0, "versions": [], "problems": []}
versions = set()
for r in rows:
    prompt, completion = r["prompt_token_ids"], r["completion_token_ids"]
    ctx, mod = r["turn_context_tokens"] or [], r["turn_model_tokens"] or []
    lp, ver = r["behaviour_logprobs"], r["policy_versions"]
    where = r["uuid"]
    if len(ctx) != len(mod) or not mod:
        report["problems"].append("%s: %d context and %d model turn lengths" % (where, len(ctx), len(mod)))
        continue
    if ctx[0] != 0 or sum(ctx) + sum(mod) != len(completion):
        report["problems"].append("%s: turns %s/%s do not cover %d completion tokens" % (where, ctx, mod, len(completion)))
        continue
    if len(lp) != sum(mod) or len(ver) != sum(mod):
        report["problems"].append("%s: %d log-probs, %d versions for %d model tokens" % (where, len(lp), len(ver), sum(mod)))
        continue
    report["multi_turn"] += len(mod) > 1
    report["turns_max"] = max(report["turns_max"], len(mod))
    report["context_tokens"] += sum(ctx)
    report["model_tokens"] += sum(mod)
    # The messages by the game's rules: the reply `x?` is answered `x=<x>`.
    task = tasks[r["task_id"]]
    a = int(task["prompt"][: -len("+x=")])
    x = int(task["answer"]) - a
    messages = [{"role": "user", "content": task["prompt"]}]
    pos, spans = 0, []
    for c, m in zip(ctx, mod):
        pos += c
        spans.append((pos, m))
        ids = completion[pos : pos + m]
        if ids and ids[-1] in (tok.eos_token_id,):
            ids = ids[:-1]
        reply = tok.decode(ids, skip_special_tokens=False)
        messages.append({"role": "assistant", "content": reply})
        pos += m
        if len(messages) // 2 < len(mod):
            messages.append({"role": "tool", "content": "x=%d" % x})
    rendered = tok.apply_chat_template(messages, tokenize=False)
    want = tok(rendered, add_special_tokens=False)["input_ids"]
    got = list(prompt) + list(completion)
    # An episode that did not end on a stop token (a limit) ends before the
    # template's end of the last reply.
    if got != want[: len(got)] or (len(want) - len(got)) > 1:
        report["problems"].append("%s: tokens %s, template %s (%r)" % (where, got, want, rendered))
        continue
    # Recompute each model token's log-prob under its version.
    ids = torch.tensor([got])
    k = 0
    for start, m in spans:
        for j in range(m):
            at = len(prompt) + start + j
            v = ver[k]
            versions.add(v)
            with torch.no_grad():
                logits = model(v)(ids[:, :at]).logits[0, -1].float()
            want_lp = torch.log_softmax(logits / temperature, -1)[got[at]].item()
            gap = abs(want_lp - lp[k])
            report["gap_max"] = max(report["gap_max"], gap)
            if gap > 1e-4:
                report["problems"].append("%s: token %d of version %d: log-prob %.6f, recomputed %.6f" % (where, at, v, lp[k], want_lp))
            k += 1
report["versions"] = sorted(versions)
print(json.dumps(report))
"#;

fn venv_python() -> PathBuf {
    let python = root().join(".venv/bin/python");
    assert!(
        python.is_file(),
        "{} is missing: run scripts/setup",
        python.display()
    );
    python
}

/// Runs the multi-turn job with `engine`, exports it and reads it back with
/// the client; returns the client's report.
fn read_back(dir: &Path, engine: Option<EngineConfig>) -> serde_json::Value {
    let data = dir.join("hidden-sum.jsonl");
    succeeded(
        "data generate",
        &asyncrl(&[
            "data",
            "generate",
            "--task",
            "hidden_sum",
            "--n",
            "400",
            "--seed",
            "3",
            "--max-operand",
            "20",
            "--out",
            data.to_str().unwrap(),
        ]),
    );
    let config = config(dir, None);
    let warm = dir.join("warm");
    succeeded(
        "warmstart",
        &asyncrl(&[
            "warmstart",
            config.to_str().unwrap(),
            "--out",
            warm.to_str().unwrap(),
            "--steps",
            "150",
            "--eval",
            "16",
        ]),
    );
    let config = match engine {
        None => config,
        Some(e) => self::config(dir, Some(e)),
    };
    succeeded("train", &asyncrl(&["train", config.to_str().unwrap()]));
    let export = dir.join("export.parquet");
    succeeded(
        "export",
        &asyncrl(&[
            "buffer",
            "export",
            "--config",
            config.to_str().unwrap(),
            "--out",
            export.to_str().unwrap(),
        ]),
    );
    // The contract's names, for the client: each data set row under its
    // wire task ids (the run's epochs), each published folder's version.
    let mut tasks = serde_json::Map::new();
    for line in std::fs::read_to_string(&data).unwrap().lines() {
        let row: serde_json::Value = serde_json::from_str(line).unwrap();
        let id = row["id"].as_str().unwrap().to_owned();
        for epoch in 0..4 {
            tasks.insert(
                asyncrl_protos::subjects::wire_task_id(&id, epoch),
                row.clone(),
            );
        }
    }
    let mut folders = serde_json::Map::new();
    for entry in std::fs::read_dir(dir.join("weights")).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(v) = asyncrl_protos::subjects::weights_folder_version(&name) {
            folders.insert(v.to_string(), entry.path().to_string_lossy().into());
        }
    }
    let tasks_file = dir.join("tasks.json");
    let folders_file = dir.join("folders.json");
    std::fs::write(&tasks_file, serde_json::Value::Object(tasks).to_string()).unwrap();
    std::fs::write(
        &folders_file,
        serde_json::Value::Object(folders).to_string(),
    )
    .unwrap();
    let out = Command::new(venv_python())
        .args([
            "-c",
            CLIENT,
            export.to_str().unwrap(),
            tasks_file.to_str().unwrap(),
            folders_file.to_str().unwrap(),
            warm.to_str().unwrap(),
            "1.0",
        ])
        .output()
        .expect("run the client");
    let stdout = succeeded("the contract client", &out);
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

fn check(report: &serde_json::Value) {
    eprintln!("the contract client's report: {report}");
    let n = |k: &str| {
        report[k]
            .as_u64()
            .unwrap_or_else(|| panic!("{k}: {report}"))
    };
    assert!(
        report["problems"].as_array().is_some_and(Vec::is_empty),
        "{report:#}"
    );
    // 6 steps of 4 groups of 4, at least, were exported.
    assert!(n("rows") >= 96, "{report}");
    // The warm start asks before it answers: most episodes have 2 turns.
    assert!(n("multi_turn") * 2 >= n("rows"), "{report}");
    assert!(n("context_tokens") > 0 && n("model_tokens") > 0, "{report}");
    assert!(report["gap_max"].as_f64().unwrap() <= 1e-4, "{report}");
    // Trajectories sampled with several versions were read and checked.
    assert!(
        report["versions"].as_array().is_some_and(|v| v.len() >= 3),
        "{report}"
    );
}

#[test]
fn a_multi_turn_run_read_through_the_export_is_token_exact_and_masked_builtin_engine() {
    let dir = tempfile::tempdir().unwrap();
    let report = read_back(dir.path(), None);
    check(&report);
}

#[test]
fn a_multi_turn_run_read_through_the_export_is_token_exact_and_masked_vllm_engine() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let python = root().join(".venv-vllm/bin/python");
    assert!(
        python.is_file(),
        "{} is missing: scripts/setup --vllm installs it",
        python.display()
    );
    let port = asyncrl_testkit::free_port().unwrap();
    let engine = configs::launched_vllm(&d.join("warm"), &d.join("engine-weights"), port, None);
    let report = read_back(d, Some(engine));
    check(&report);
}
