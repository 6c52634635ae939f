//! Architecture invariant: the wire contract has one owner. Every subject,
//! stream, bucket, KV key, queue group, object name and the wire task-id
//! format is a constant or function of `asyncrl_protos::subjects`; no other
//! Rust file of the workspace spells one out as a literal. This test reads
//! every `.rs` file outside `protos/` and fails naming the file, the line
//! and the constant to use instead.

use std::path::{Path, PathBuf};

use asyncrl_protos::subjects::*;

/// Exact string literals (with their quotes) that belong to the contract.
fn exact_literals() -> Vec<(&'static str, &'static str)> {
    vec![
        (TRAJECTORY_STREAM, "TRAJECTORY_STREAM"),
        (DEAD_LETTER_STREAM, "DEAD_LETTER_STREAM"),
        (DEAD_LETTER_SUBJECT, "DEAD_LETTER_SUBJECT"),
        (TASKS_ACQUIRE, "TASKS_ACQUIRE"),
        (TASKS_COMPLETE, "TASKS_COMPLETE"),
        (TASKS_RETURN, "TASKS_RETURN"),
        (TASKS_AVAILABLE, "TASKS_AVAILABLE"),
        (WORKERS_REGISTER, "WORKERS_REGISTER"),
        (WORKERS_HEARTBEAT, "WORKERS_HEARTBEAT"),
        (BUFFER_BATCH, "BUFFER_BATCH"),
        (BUFFER_GROUP_DROPPED, "BUFFER_GROUP_DROPPED"),
        (CONTROL_BUCKET, "CONTROL_BUCKET"),
        (POLICY_VERSION_KEY, "POLICY_VERSION_KEY"),
        (WEIGHTS_BUCKET, "WEIGHTS_BUCKET"),
        (COORDINATOR_STATE_KEY, "COORDINATOR_STATE_KEY"),
        (LEARNER_STATUS_KEY, "LEARNER_STATUS_KEY"),
        (KNOBS_KEY, "KNOBS_KEY"),
        (EPOCHS_CLOSED_KEY, "EPOCHS_CLOSED_KEY"),
        (COORDINATOR_QUEUE_GROUP, "COORDINATOR_QUEUE_GROUP"),
        (BUFFER_QUEUE_GROUP, "BUFFER_QUEUE_GROUP"),
    ]
}

/// Fragments that only a hand-built contract string contains.
fn fragments() -> Vec<(String, &'static str)> {
    vec![
        // A trajectory subject built by hand: use trajectory_subject().
        (
            format!("\"{TRAJECTORY_SUBJECT_PREFIX}."),
            "trajectory_subject() / TRAJECTORIES",
        ),
        // A weights object name built or parsed by hand.
        (
            "\"policy-v".to_owned(),
            "weights_object_name() / weights_object_version()",
        ),
        // The wire task id built or split by hand.
        ("-e{".to_owned(), "wire_task_id()"),
        ("\"-e\"".to_owned(), "split_wire_task_id()"),
    ]
}

/// Places where the same text means something else, each with its reason.
const ALLOWED: &[(&str, &str, &str)] = &[
    (
        "config/src/buffer.rs",
        "\"asyncrl-buffer\"",
        "the default name of the buffer's durable consumer, a setting",
    ),
    (
        "coordinator/src/service",
        "\"knobs\"",
        "a field of the admin journal's JSON, not the KV key",
    ),
    (
        "coordinator/tests/admin.rs",
        "\"knobs\"",
        "reads the admin journal's JSON field",
    ),
    (
        "tests/architecture.rs",
        "\"asyncrl-coordinator\"",
        "the name of the coordinator's Cargo package",
    ),
    (
        "tests/architecture.rs",
        "\"asyncrl-buffer\"",
        "the name of the buffer's Cargo package",
    ),
    (
        "transport/tests/conformance.rs",
        "\"policy.version\"",
        "transport's conformance suite uses it as an arbitrary key name",
    ),
];

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("protos/ has a parent")
        .to_path_buf()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if path.is_dir() {
            if name.starts_with('.') || name == "target" || name == "node_modules" {
                continue;
            }
            rust_files(&path, out);
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
}

/// The contract literals in one file's text, as `path:line: literal (use …)`.
fn offences_in(rel_path: &str, text: &str) -> Vec<String> {
    let exact: Vec<(String, &str)> = exact_literals()
        .into_iter()
        .map(|(v, name)| (format!("\"{v}\""), name))
        .collect();
    let fragments = fragments();
    let mut offences = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("//") {
            continue;
        }
        let needles = exact
            .iter()
            .map(|(lit, name)| (lit.as_str(), *name))
            .chain(fragments.iter().map(|(f, name)| (f.as_str(), *name)));
        for (needle, name) in needles {
            if !line.contains(needle) {
                continue;
            }
            let allowed = ALLOWED
                .iter()
                .any(|(path, lit, _)| rel_path.starts_with(path) && *lit == needle);
            if !allowed {
                offences.push(format!(
                    "{rel_path}:{}: {needle} (use asyncrl_protos::subjects::{name})",
                    n + 1
                ));
            }
        }
    }
    offences
}

#[test]
fn contract_literals_live_in_protos_alone() {
    let root = workspace_root();
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    assert!(
        files.len() > 50,
        "found only {} .rs files under {}",
        files.len(),
        root.display()
    );
    let mut offences = Vec::new();
    for file in &files {
        let rel = file.strip_prefix(&root).unwrap_or(file);
        let rel = rel.to_string_lossy().replace('\\', "/");
        if rel.starts_with("protos/") {
            continue;
        }
        let text = std::fs::read_to_string(file)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", file.display()));
        offences.extend(offences_in(&rel, &text));
    }
    assert!(
        offences.is_empty(),
        "contract literals outside protos/:\n{}",
        offences.join("\n")
    );
}

#[test]
fn the_scan_finds_hand_written_contract_strings() {
    let text = [
        "let a = kv.get(\"policy.version\").await;",
        "// kv.get(\"policy.version\") in a comment is fine",
        "let id = format!(\"{item}-e{epoch}\");",
        "let s = \"trajectories.t1\";",
        "tracing::warn!(\"policy.version does not decode\");",
        "let key = \"knobs\";",
    ]
    .join("\n");
    let found = offences_in("learner/src/x.rs", &text);
    assert_eq!(found.len(), 4, "{found:#?}");
    assert!(found[0].starts_with("learner/src/x.rs:1:"), "{found:#?}");
    assert!(found[0].contains("POLICY_VERSION_KEY"), "{found:#?}");
    assert!(found[1].contains("wire_task_id"), "{found:#?}");
    assert!(found[2].contains("trajectory_subject"), "{found:#?}");
    assert!(found[3].contains("KNOBS_KEY"), "{found:#?}");
    // The same literal where it is allowed, with its reason.
    assert!(offences_in("coordinator/tests/admin.rs", "x[\"knobs\"]").is_empty());
}
