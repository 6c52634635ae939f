//! Hostile TOML at the config boundary: random text, truncated copies of
//! every shipped config, values of the wrong type, out-of-range and
//! non-finite numbers, unknown keys at every nesting level. Loading must
//! return an error (one line, naming the full dotted key where a value is
//! the problem) and never panic. Every test counts the inputs it tried and
//! asserts the count, so a generator that silently produces nothing fails.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use asyncrl_config::Config;
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestRunner};
use toml::{Table, Value};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .to_owned()
}

/// Every config the project ships: `examples/*.toml` and the deploy configs.
fn shipped_configs() -> Vec<(PathBuf, String)> {
    let root = repo_root();
    let mut paths: Vec<PathBuf> = std::fs::read_dir(root.join("examples"))
        .expect("examples/")
        .map(|e| e.expect("an examples/ entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    paths.push(root.join("deploy/k8s/base/asyncrl.toml"));
    for e in std::fs::read_dir(root.join("deploy/k8s/components")).expect("components/") {
        let p = e.expect("a components/ entry").path().join("asyncrl.toml");
        if p.exists() {
            paths.push(p);
        }
    }
    paths.sort();
    let configs: Vec<(PathBuf, String)> = paths
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p).expect("read a shipped config");
            (p, text)
        })
        .collect();
    // examples/: arith, arith-staleness, arith-vllm, gsm8k-qwen2.5, local;
    // deploy: base + gpu + vllm-sidecar.
    assert!(configs.len() >= 8, "found {} configs", configs.len());
    configs
}

/// Parses `text` with a panic guard; a panic is a test failure naming the
/// input. An error must be one line.
fn parse(text: &str) -> Result<Config, String> {
    let r = std::panic::catch_unwind(|| Config::parse(text, None))
        .unwrap_or_else(|_| panic!("Config::parse panicked on {text:?}"));
    r.map_err(|e| {
        let s = e.to_string();
        assert!(!s.contains('\n'), "error should be one line: {s:?}");
        assert!(!s.is_empty());
        s
    })
}

/// Every leaf of a TOML table: (dotted path, value). Array elements that are
/// tables are walked with `[i]` (serde_path_to_error's spelling).
fn leaves(prefix: &str, table: &Table, out: &mut Vec<(String, Value)>) {
    for (k, v) in table {
        let path = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        match v {
            Value::Table(t) => leaves(&path, t, out),
            Value::Array(items) if items.iter().all(Value::is_table) && !items.is_empty() => {
                for (i, item) in items.iter().enumerate() {
                    if let Value::Table(t) = item {
                        leaves(&format!("{path}[{i}]"), t, out);
                    }
                }
            }
            _ => out.push((path, v.clone())),
        }
    }
}

/// Every table's path ("" for the root).
fn tables(prefix: &str, table: &Table, out: &mut Vec<String>) {
    out.push(prefix.to_owned());
    for (k, v) in table {
        let path = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        match v {
            Value::Table(t) => tables(&path, t, out),
            Value::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    if let Value::Table(t) = item {
                        tables(&format!("{path}[{i}]"), t, out);
                    }
                }
            }
            _ => {}
        }
    }
}

/// The table at `path` (dotted, with `[i]` for array elements), created if
/// missing.
fn table_at<'a>(root: &'a mut Table, path: &str) -> &'a mut Table {
    let mut t = root;
    if path.is_empty() {
        return t;
    }
    for part in path.split('.') {
        let (name, index) = match part.split_once('[') {
            Some((n, rest)) => (
                n,
                Some(rest.trim_end_matches(']').parse::<usize>().unwrap()),
            ),
            None => (part, None),
        };
        let entry = t
            .entry(name.to_owned())
            .or_insert_with(|| Value::Table(Table::new()));
        t = match (entry, index) {
            (Value::Table(inner), None) => inner,
            (Value::Array(items), Some(i)) => match &mut items[i] {
                Value::Table(inner) => inner,
                other => panic!("{path}: {other:?} is not a table"),
            },
            (other, _) => panic!("{path}: {other:?} is not a table"),
        };
    }
    t
}

fn set_leaf(root: &mut Table, path: &str, value: Value) {
    let (parent, key) = path.rsplit_once('.').unwrap_or(("", path));
    table_at(root, parent).insert(key.to_owned(), value);
}

/// Values of a type other than `v`'s (none that serde would coerce: a
/// string for an integer, an integer for a string, a table for anything).
fn wrong_types(v: &Value) -> Vec<Value> {
    let table = Value::Table(Table::from_iter([("x".to_owned(), Value::Integer(1))]));
    match v {
        Value::String(_) => vec![Value::Integer(7), Value::Boolean(true), table],
        Value::Integer(_) => vec![Value::String("7".into()), Value::Boolean(true), table],
        Value::Float(_) => vec![Value::String("0.5".into()), Value::Boolean(false), table],
        Value::Boolean(_) => vec![Value::String("true".into()), Value::Integer(1), table],
        Value::Array(_) => vec![Value::String("[1]".into()), table],
        Value::Datetime(_) | Value::Table(_) => vec![Value::Integer(1)],
    }
}

/// The float knobs every config has (present or defaulted), so that NaN and
/// infinity reach each one even where the shipped configs leave it out.
const FLOAT_KEYS: &[&str] = &[
    "model.temperature",
    "model.top_p",
    "learner.m2po_threshold",
    "learner.weight_decay",
    "learner.beta1",
    "learner.beta2",
    "learner.adam_eps",
    "learner.grad_clip",
    "coordinator.initial_knobs.eps_low",
    "coordinator.initial_knobs.eps_high",
    "coordinator.initial_knobs.adaptive_quantile",
    "coordinator.initial_knobs.adaptive_temperature",
    "coordinator.initial_knobs.importance_weight_cap",
    "coordinator.initial_knobs.importance_weight_floor",
    "coordinator.initial_knobs.dual_clip",
    "learner.kl_coef",
    "coordinator.initial_knobs.learning_rate",
    "eval.temperature",
];

fn to_text(t: &Table) -> String {
    toml::to_string(t).expect("serialize a mutated config")
}

fn assert_names(err: &str, key: &str, input: &str) {
    assert!(
        err.contains(&format!("`{key}`")),
        "the error should name `{key}`: {err}\ninput:\n{input}"
    );
}

#[test]
fn every_shipped_config_loads() {
    for (path, text) in shipped_configs() {
        Config::parse(&text, Some(&path)).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
}

#[test]
fn truncated_shipped_configs_never_panic() {
    let mut tried = 0usize;
    let mut errors = 0usize;
    for (_, text) in shipped_configs() {
        // Every char boundary of the first 400 bytes (the headers and the
        // first keys), then every 3rd: cuts inside keys, strings, tables.
        let cuts =
            (0..text.len()).filter(|i| text.is_char_boundary(*i) && (*i < 400 || i % 3 == 0));
        for cut in cuts {
            tried += 1;
            if parse(&text[..cut]).is_err() {
                errors += 1;
            }
        }
    }
    println!("truncated configs tried: {tried} ({errors} refused)");
    assert!(tried > 2000, "tried {tried}");
    // Most prefixes end inside a key, a string or a table header.
    assert!(errors > tried / 4, "{errors} of {tried} refused");
}

#[test]
fn wrong_types_are_named_with_their_full_key() {
    let mut tried = 0usize;
    for (path, text) in shipped_configs() {
        let root: Table = toml::from_str(&text).expect("a shipped config is TOML");
        let mut all = Vec::new();
        leaves("", &root, &mut all);
        for (key, value) in all {
            for wrong in wrong_types(&value) {
                let mut t = root.clone();
                set_leaf(&mut t, &key, wrong.clone());
                let input = to_text(&t);
                tried += 1;
                match parse(&input) {
                    Ok(_) => panic!(
                        "{}: `{key}` = {wrong} (was {value}) was accepted",
                        path.display()
                    ),
                    Err(e) => assert_names(&e, &key, &input),
                }
            }
        }
    }
    println!("wrong-type values tried: {tried}");
    assert!(tried > 300, "tried {tried}");
}

#[test]
fn non_finite_floats_are_named_with_their_full_key() {
    let mut tried = 0usize;
    for (path, text) in shipped_configs() {
        let root: Table = toml::from_str(&text).expect("a shipped config is TOML");
        let mut keys: Vec<String> = FLOAT_KEYS.iter().map(|k| (*k).to_owned()).collect();
        let mut all = Vec::new();
        leaves("", &root, &mut all);
        keys.extend(
            all.into_iter()
                .filter(|(_, v)| v.is_float())
                .map(|(k, _)| k),
        );
        keys.sort();
        keys.dedup();
        for key in &keys {
            for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
                let mut t = root.clone();
                set_leaf(&mut t, key, Value::Float(bad));
                let input = to_text(&t);
                tried += 1;
                match parse(&input) {
                    Ok(_) => panic!("{}: `{key}` = {bad} was accepted", path.display()),
                    Err(e) => assert_names(&e, key, &input),
                }
            }
        }
    }
    println!("non-finite floats tried: {tried}");
    assert!(tried >= 8 * FLOAT_KEYS.len() * 3, "tried {tried}");
}

#[test]
fn out_of_range_numbers_never_panic_and_refusals_name_the_key() {
    let extremes: Vec<Value> = vec![
        Value::Integer(i64::MIN),
        Value::Integer(-1),
        Value::Integer(0),
        Value::Integer(i64::MAX),
        Value::Integer(1 << 40),
        Value::Float(-1.0),
        Value::Float(0.0),
        Value::Float(1e300),
        Value::Float(-1e-300),
    ];
    let mut tried = 0usize;
    let mut refused = 0usize;
    for (_, text) in shipped_configs() {
        let root: Table = toml::from_str(&text).expect("a shipped config is TOML");
        let mut all = Vec::new();
        leaves("", &root, &mut all);
        for (key, value) in all {
            if !(value.is_integer() || value.is_float()) {
                continue;
            }
            for extreme in &extremes {
                // Same type only: a type change is the wrong-type test's.
                if extreme.type_str() != value.type_str() {
                    continue;
                }
                let mut t = root.clone();
                set_leaf(&mut t, &key, extreme.clone());
                let input = to_text(&t);
                tried += 1;
                if let Err(e) = parse(&input) {
                    refused += 1;
                    // A refusal caused by this value names its key.
                    assert_names(&e, &key, &input);
                }
            }
        }
    }
    println!("out-of-range numbers tried: {tried} ({refused} refused)");
    assert!(tried > 200, "tried {tried}");
    assert!(refused > tried / 3, "{refused} of {tried} refused");
}

#[test]
fn unknown_keys_are_named_at_every_nesting_level() {
    let mut tried = 0usize;
    for (path, text) in shipped_configs() {
        let root: Table = toml::from_str(&text).expect("a shipped config is TOML");
        let mut all = Vec::new();
        tables("", &root, &mut all);
        // Sections a config may leave out are still tables serde checks.
        for t in [
            "run",
            "staleness",
            "bus",
            "telemetry",
            "model",
            "model.tiny",
            "coordinator",
            "coordinator.initial_knobs",
            "buffer",
            "learner",
            "worker",
            "worker.engine",
            "eval",
        ] {
            all.push(t.to_owned());
        }
        all.sort();
        all.dedup();
        for table in all {
            let mut t = root.clone();
            table_at(&mut t, &table).insert("zz_not_a_key".into(), Value::Integer(1));
            let input = to_text(&t);
            let key = if table.is_empty() {
                "zz_not_a_key".to_owned()
            } else {
                format!("{table}.zz_not_a_key")
            };
            tried += 1;
            match parse(&input) {
                Ok(_) => panic!("{}: unknown `{key}` was accepted", path.display()),
                Err(e) => {
                    // A struct table says "unknown field"; a map table
                    // (e.g. `bus.roles`, keyed by name) refuses the value.
                    assert!(
                        e.contains("unknown field") || e.contains("invalid type"),
                        "{e}"
                    );
                    assert_names(&e, &key, &input);
                }
            }
        }
    }
    println!("unknown keys tried: {tried}");
    assert!(tried > 100, "tried {tried}");
}

/// Random TOML: random key paths from the real key set (and made-up ones)
/// with random values of any type, and random text.
#[test]
fn random_toml_never_panics() {
    let (_, text) = shipped_configs()
        .into_iter()
        .find(|(p, _)| p.ends_with("examples/arith.toml"))
        .expect("examples/arith.toml");
    let root: Table = toml::from_str(&text).expect("TOML");
    let mut all = Vec::new();
    leaves("", &root, &mut all);
    let mut keys: Vec<String> = all.into_iter().map(|(k, _)| k).collect();
    keys.extend(FLOAT_KEYS.iter().map(|k| (*k).to_owned()));
    keys.push("bogus.key".into());
    keys.push("run.bogus".into());

    let value = prop_oneof![
        any::<i64>().prop_map(Value::Integer),
        any::<f64>().prop_map(Value::Float),
        any::<bool>().prop_map(Value::Boolean),
        ".{0,12}".prop_map(Value::String),
        proptest::collection::vec(any::<i64>().prop_map(Value::Integer), 0..3)
            .prop_map(Value::Array),
    ];
    let edits = proptest::collection::vec((0..keys.len(), value), 1..6);
    let structured = AtomicUsize::new(0);
    let mut runner = TestRunner::new(ProptestConfig {
        cases: 400,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    runner
        .run(&edits, |edits| {
            let mut t = root.clone();
            for (k, v) in edits {
                set_leaf(&mut t, &keys[k], v);
            }
            let input = to_text(&t);
            structured.fetch_add(1, Ordering::Relaxed);
            let _ = parse(&input);
            Ok(())
        })
        .unwrap();

    let raw = AtomicUsize::new(0);
    let texts = prop_oneof![
        "\\PC{0,200}",
        // TOML-ish: headers, keys, assignments, quotes, brackets.
        proptest::collection::vec(
            prop_oneof![
                Just("[".to_owned()),
                Just("]".to_owned()),
                Just("[[".to_owned()),
                Just(" = ".to_owned()),
                Just("\"".to_owned()),
                Just("'''".to_owned()),
                Just("\n".to_owned()),
                Just(".".to_owned()),
                Just("{".to_owned()),
                Just("}".to_owned()),
                Just("nan".to_owned()),
                Just("inf".to_owned()),
                Just("1e999".to_owned()),
                Just("9999999999999999999999".to_owned()),
                "[a-z_]{1,10}",
                proptest::sample::select(keys.clone()),
            ],
            0..40
        )
        .prop_map(|parts| parts.concat()),
    ];
    let mut runner = TestRunner::new(ProptestConfig {
        cases: 600,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    runner
        .run(&texts, |text| {
            raw.fetch_add(1, Ordering::Relaxed);
            let _ = parse(&text);
            Ok(())
        })
        .unwrap();
    let (structured, raw) = (structured.into_inner(), raw.into_inner());
    println!("random configs tried: {structured} structured, {raw} raw text");
    assert_eq!(structured, 400);
    assert_eq!(raw, 600);
    // The loader still loads a valid config afterwards.
    parse(&text).expect("a valid config after the hostile ones");
}
