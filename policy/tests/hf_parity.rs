//! Parity with Hugging Face transformers, a reference nobody here wrote.
//!
//! `tests/python/hf_reference.py` (run with the project venv's Python, which
//! gets `transformers==TRANSFORMERS_PIN` installed if it lacks it) trains a
//! small BPE tokenizer, builds tiny random Qwen2 and Llama models, saves them
//! with `save_pretrained` (one sharded) and writes their logits for fixed
//! token ids. This test loads those folders with this crate and compares
//! logits (max abs difference <= 1e-4, float32) and tokenizations; then it
//! saves models with this crate, has transformers open them, and compares
//! logits again.
//!
//! The Python interpreter is `$ASYNCRL_PYTHON` or `<workspace>/.venv/bin/python`.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use asyncrl_policy::{DeviceOptions, Policy, PolicyTokenizer, TinyModelSpec};
use common::max_abs_diff;
use serde_json::{Value, json};
use tch::Tensor;

/// The transformers release the parity test runs against (works with
/// torch 2.11).
const TRANSFORMERS_PIN: &str = "5.24.0";
const TOL: f64 = 1e-4;

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the crate is in the workspace")
        .to_owned()
}

fn python() -> PathBuf {
    match std::env::var_os("ASYNCRL_PYTHON") {
        Some(p) => PathBuf::from(p),
        None => workspace_root().join(".venv/bin/python"),
    }
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/hf_reference.py")
}

fn run(cmd: &mut Command) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Installs the pinned transformers into the venv unless it is there.
fn ensure_transformers(py: &Path) {
    assert!(
        py.is_file(),
        "{} not found: run scripts/setup (or set ASYNCRL_PYTHON to a Python with torch)",
        py.display()
    );
    let check = Command::new(py)
        .args([
            "-c",
            &format!(
                "import sys, transformers; sys.exit(0 if transformers.__version__ == '{TRANSFORMERS_PIN}' else 3)"
            ),
        ])
        .output()
        .expect("run python");
    if !check.status.success() {
        eprintln!(
            "installing transformers=={TRANSFORMERS_PIN} into {}",
            py.display()
        );
        run(Command::new(py).args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--progress-bar",
            "off",
            &format!("transformers=={TRANSFORMERS_PIN}"),
        ]));
    }
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn ids_of(v: &Value) -> Vec<Vec<i64>> {
    v.as_array()
        .expect("list of lists")
        .iter()
        .map(|row| {
            row.as_array()
                .expect("list")
                .iter()
                .map(|x| x.as_i64().expect("int"))
                .collect()
        })
        .collect()
}

fn tensor_3d(v: &Value) -> Tensor {
    let rows = v.as_array().expect("[B][T][V]");
    let b = rows.len() as i64;
    let t = rows[0].as_array().expect("[T][V]").len() as i64;
    let flat: Vec<f32> = rows
        .iter()
        .flat_map(|r| r.as_array().expect("[T][V]").iter())
        .flat_map(|p| p.as_array().expect("[V]").iter())
        .map(|x| x.as_f64().expect("float") as f32)
        .collect();
    let vocab = flat.len() as i64 / (b * t);
    Tensor::from_slice(&flat).reshape([b, t, vocab])
}

fn ids_tensor(ids: &[Vec<i64>]) -> Tensor {
    let b = ids.len() as i64;
    let flat: Vec<i64> = ids.iter().flatten().copied().collect();
    Tensor::from_slice(&flat).reshape([b, flat.len() as i64 / b])
}

fn our_logits(policy: &Policy, ids: &[Vec<i64>]) -> Tensor {
    tch::no_grad(|| policy.forward(&ids_tensor(ids), None)).expect("forward")
}

/// Has transformers open `dir` and compute logits for `ids` (and encode
/// `strings` with its AutoTokenizer).
fn transformers_logits(
    py: &Path,
    work: &Path,
    dir: &Path,
    ids: &[Vec<i64>],
    strings: &[&str],
) -> Value {
    let req = work.join("request.json");
    let out = work.join("response.json");
    let body = json!({"dir": dir, "input_ids": ids, "strings": strings});
    std::fs::write(&req, body.to_string()).expect("write request");
    run(Command::new(py)
        .arg(script())
        .arg("logits")
        .arg(&req)
        .arg(&out));
    read_json(&out)
}

#[test]
fn matches_transformers_and_round_trips_through_it() {
    let py = python();
    ensure_transformers(&py);
    let work = tempfile::tempdir().expect("tempdir");
    let refs = work.path().join("refs");
    std::fs::create_dir_all(&refs).expect("mkdir");
    run(Command::new(&py).arg(script()).arg("generate").arg(&refs));
    let reference = read_json(&refs.join("reference.json"));
    eprintln!(
        "reference from transformers {}",
        reference["transformers_version"]
    );

    // 1. Our forward on transformers' folders equals transformers' logits.
    let models = reference["models"].as_object().expect("models");
    assert_eq!(models.len(), 3);
    let mut loaded = Vec::new();
    for (name, m) in models {
        let dir = refs.join(name);
        let policy = Policy::from_pretrained(&dir, DeviceOptions::cpu())
            .unwrap_or_else(|e| panic!("loading {name}: {e}"));
        let ids = ids_of(&m["input_ids"]);
        let want = tensor_3d(&m["logits"]);
        let got = our_logits(&policy, &ids);
        let d = max_abs_diff(&got, &want);
        let scale = want.abs().max().double_value(&[]);
        eprintln!("{name}: max |logit diff| = {d:.3e} (max |logit| {scale:.2})");
        assert!(d <= TOL, "{name}: max abs logit difference {d} > {TOL}");
        loaded.push((name.clone(), policy, ids));
    }
    assert!(
        refs.join("qwen2_sharded/model.safetensors.index.json")
            .is_file(),
        "the Qwen2 reference must be sharded"
    );

    // 2. The tokenizer encodes and decodes like transformers'.
    let tok =
        PolicyTokenizer::from_file(&refs.join("qwen2_sharded/tokenizer.json")).expect("tokenizer");
    let t = &reference["tokenizer"];
    let strings: Vec<&str> = t["strings"]
        .as_array()
        .expect("strings")
        .iter()
        .map(|s| s.as_str().expect("str"))
        .collect();
    let with_special = ids_of(&t["ids_with_special"]);
    let plain = ids_of(&t["ids"]);
    for (i, s) in strings.iter().enumerate() {
        assert_eq!(
            tok.encode(s, true).expect("encode"),
            with_special[i],
            "{s:?} with special tokens"
        );
        assert_eq!(tok.encode(s, false).expect("encode"), plain[i], "{s:?}");
        assert_eq!(
            tok.decode(&plain[i], false).expect("decode"),
            t["decoded"][i].as_str().expect("str"),
            "{s:?} decoded"
        );
    }

    // 3. Our save_pretrained opens in transformers with the same logits:
    //    a loaded Qwen2 (single file), a loaded Llama (sharded by us), and
    //    the built-in tiny model with its char-level tokenizer.
    let rt = work.path().join("roundtrip");
    for (name, policy, ids) in &loaded {
        let dir = rt.join(name);
        let shard = name.starts_with("llama_untied").then_some(30_000);
        policy.save_pretrained(&dir, shard).expect("save");
        if shard.is_some() {
            assert!(dir.join("model.safetensors.index.json").is_file());
        }
        let out = transformers_logits(&py, work.path(), &dir, ids, &[]);
        let d = max_abs_diff(&our_logits(policy, ids), &tensor_3d(&out["logits"]));
        eprintln!(
            "{name} saved by us, opened by transformers ({}): {d:.3e}",
            out["class"]
        );
        assert!(d <= TOL, "{name} round trip: {d}");
    }
    let tiny = Policy::builtin_tiny(
        &TinyModelSpec {
            hidden_size: 64,
            num_hidden_layers: 2,
            intermediate_size: 160,
            init_std: 0.1,
            ..TinyModelSpec::default()
        },
        5,
        DeviceOptions::cpu(),
    )
    .expect("tiny");
    let dir = rt.join("tiny");
    tiny.save_pretrained(&dir, None).expect("save tiny");
    let tok = tiny.tokenizer().expect("tokenizer");
    let texts = ["37+58=95", "sort: 3 1 2\nreverse: [a, b]", "Hello, World!"];
    let ids: Vec<Vec<i64>> =
        vec![[vec![1], tok.encode("12*12=144", false).expect("encode")].concat()];
    let out = transformers_logits(&py, work.path(), &dir, &ids, &texts);
    let d = max_abs_diff(&our_logits(&tiny, &ids), &tensor_3d(&out["logits"]));
    eprintln!("built-in tiny saved by us, opened by transformers: {d:.3e}");
    assert!(d <= TOL, "tiny round trip: {d}");
    let encoded = ids_of(&out["encoded"]);
    for (i, s) in texts.iter().enumerate() {
        assert_eq!(encoded[i], tok.encode(s, false).expect("encode"), "{s:?}");
        assert_eq!(out["decoded"][i].as_str(), Some(*s));
    }
}
