//! The architecture invariants about dependencies, checked on the real
//! dependency graph (`cargo metadata`), so that a new `use` of the wrong
//! crate fails here instead of going unnoticed. docs/ARCHITECTURE.md names
//! each check.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use serde_json::Value;

/// Each workspace package's direct dependencies, by kind.
struct Graph {
    /// package name → (dependency name, kind: "normal" | "dev" | "build")
    direct: BTreeMap<String, Vec<(String, String)>>,
    /// package name → whether it may be published (`publish = false`: no)
    publish: BTreeMap<String, bool>,
}

fn graph() -> Graph {
    let out = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: Value = serde_json::from_slice(&out.stdout).expect("cargo metadata JSON");
    let mut direct = BTreeMap::new();
    let mut publish = BTreeMap::new();
    for p in meta["packages"].as_array().expect("packages") {
        let name = p["name"].as_str().expect("name").to_owned();
        let deps = p["dependencies"]
            .as_array()
            .expect("dependencies")
            .iter()
            .map(|d| {
                let kind = d["kind"].as_str().unwrap_or("normal").to_owned();
                (d["name"].as_str().expect("dep name").to_owned(), kind)
            })
            .collect();
        // `publish = false` is an empty list of registries.
        let publishable = p["publish"].as_array().is_none_or(|r| !r.is_empty());
        direct.insert(name.clone(), deps);
        publish.insert(name, publishable);
    }
    Graph { direct, publish }
}

impl Graph {
    fn normal_deps(&self, package: &str) -> BTreeSet<&str> {
        self.direct[package]
            .iter()
            .filter(|(_, kind)| kind == "normal")
            .map(|(d, _)| d.as_str())
            .collect()
    }

    /// Workspace packages reachable from `package` through normal
    /// dependencies (itself excluded).
    fn normal_closure(&self, package: &str) -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut todo = vec![package.to_owned()];
        while let Some(p) = todo.pop() {
            let Some(deps) = self.direct.get(&p) else {
                continue;
            };
            for (d, kind) in deps {
                if kind == "normal" && self.direct.contains_key(d) && seen.insert(d.clone()) {
                    todo.push(d.clone());
                }
            }
        }
        seen
    }

    /// Packages (in the workspace) whose direct normal dependencies include
    /// `dep`.
    fn users_of(&self, dep: &str) -> BTreeSet<&str> {
        self.direct
            .keys()
            .filter(|p| self.normal_deps(p).contains(dep))
            .map(String::as_str)
            .collect()
    }
}

fn set<'a>(items: &[&'a str]) -> BTreeSet<&'a str> {
    items.iter().copied().collect()
}

#[test]
fn only_transport_links_the_nats_client() {
    // Architecture invariant: roles talk only through asyncrl_transport::Bus;
    // nothing else knows that the bus is NATS. The harness (tests and
    // benches, never shipped) audits the server from outside.
    assert_eq!(
        graph().users_of("async-nats"),
        set(&["asyncrl-transport", "asyncrl-harness"])
    );
}

#[test]
fn clap_lives_in_the_front_ends() {
    // The two binaries' command lines: `asyncrl` and `asyncrl-bench`.
    assert_eq!(
        graph().users_of("clap"),
        set(&["asyncrl", "asyncrl-harness"])
    );
}

#[test]
fn test_helpers_are_no_library_dependency() {
    // testkit (a real nats-server per test) is a dependency of the harness
    // only (publish = false), and a dev-dependency elsewhere.
    let g = graph();
    assert_eq!(g.users_of("asyncrl-testkit"), set(&["asyncrl-harness"]));
    assert_eq!(g.users_of("asyncrl-harness"), BTreeSet::new());
    assert!(
        !g.publish["asyncrl-harness"],
        "the harness is never published"
    );
}

#[test]
fn production_binary_links_no_test_code() {
    // Architecture invariant: the `asyncrl` binary (and so the release
    // image) links neither testkit, the harness, nor any crate's
    // `testsuite` feature (the test doubles). Read from the resolved
    // graph, features included, as `cargo tree -p asyncrl -e normal`
    // shows it.
    let out = Command::new(env!("CARGO"))
        .args([
            "tree",
            "-p",
            "asyncrl",
            "--edges",
            "normal",
            "--prefix",
            "none",
            "--format",
            "{p} [{f}]",
            "--offline",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo tree");
    assert!(
        out.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tree = String::from_utf8_lossy(&out.stdout);
    assert!(
        tree.lines().any(|l| l.starts_with("asyncrl-coordinator ")),
        "cargo tree lists the binary's crates:\n{tree}"
    );
    for line in tree.lines() {
        for test_code in ["asyncrl-testkit ", "asyncrl-harness "] {
            assert!(
                !line.starts_with(test_code),
                "the production binary links {test_code}: {line}"
            );
        }
        assert!(
            !line.contains("testsuite"),
            "the production binary enables a testsuite feature: {line}"
        );
    }
}

#[test]
fn only_the_model_crates_link_libtorch() {
    // Architecture invariant: only learner/, rollout-worker/ and policy/
    // (and the binary built with `torch`) link libtorch; the coordinator and
    // the buffer build and run without it.
    let g = graph();
    let users: BTreeSet<&str> = g
        .users_of("tch")
        .union(&g.users_of("torch-sys"))
        .copied()
        .collect();
    assert_eq!(
        users,
        set(&[
            "asyncrl-harness",
            "asyncrl-learner",
            "asyncrl-policy",
            "asyncrl-rollout-worker"
        ])
    );
    for role in [
        "asyncrl-coordinator",
        "asyncrl-buffer",
        "asyncrl-control",
        "asyncrl-transport",
    ] {
        let reach = g.normal_closure(role);
        for torch in [
            "asyncrl-policy",
            "asyncrl-learner",
            "asyncrl-rollout-worker",
        ] {
            assert!(
                !reach.contains(torch),
                "{role} reaches {torch}, which links libtorch"
            );
        }
    }
}

#[test]
fn no_role_depends_on_another_role() {
    // The learner, the worker, the buffer and the coordinator share the
    // contract (protos) and the control plane (control), never each other.
    let g = graph();
    let roles = [
        "asyncrl-coordinator",
        "asyncrl-learner",
        "asyncrl-rollout-worker",
        "asyncrl-buffer",
    ];
    for role in roles {
        let reach = g.normal_closure(role);
        for other in roles.iter().filter(|r| **r != role) {
            assert!(!reach.contains(*other), "{role} depends on {other}");
        }
    }
}

#[test]
fn one_crate_tokenizes_and_renders_chat_templates() {
    // Architecture invariant: prompts become token ids only through
    // asyncrl_text::ModelText, so every role tokenizes them alike.
    let g = graph();
    assert_eq!(g.users_of("tokenizers"), set(&["asyncrl-text"]));
    assert_eq!(g.users_of("minijinja"), set(&["asyncrl-text"]));
}

/// The config tables (`[run]`, `[bus.tls]`, `[[coordinator.datasets]]`, …)
/// that a line of Rust opens as TOML text: a header at the start of a line
/// of a raw string, or after `"` or `\n` in a string, with a line end next.
fn toml_tables_written(line: &str) -> Vec<String> {
    const SECTIONS: [&str; 10] = [
        "run",
        "staleness",
        "bus",
        "telemetry",
        "model",
        "coordinator",
        "buffer",
        "learner",
        "worker",
        "eval",
    ];
    let trimmed = line.trim_start();
    if trimmed.starts_with("//") {
        return Vec::new();
    }
    let mut found = Vec::new();
    for (at, _) in trimmed.match_indices('[') {
        let before = &trimmed[..at];
        // `[[`: the table was looked at from its first bracket.
        let opens = before.is_empty() || before.ends_with('"') || before.ends_with("\\n");
        if before.ends_with('[') || !opens {
            continue;
        }
        let rest = trimmed[at..].trim_start_matches('[');
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || *c == '_' || *c == '.')
            .collect();
        let after = rest[name.len()..].trim_start_matches(']');
        let first = name.split('.').next().unwrap_or_default();
        if SECTIONS.contains(&first)
            && rest[name.len()..].starts_with(']')
            && (after.is_empty() || after.starts_with("\\n"))
        {
            found.push(format!("[{name}]"));
        }
    }
    found
}

#[test]
fn tests_and_benches_build_configs_as_values() {
    // Architecture invariant: tests and benches build a config as a
    // `Config` value (asyncrl_harness::configs) and write it with
    // `Config::write`, which validates it; only the config schema's own
    // tests (the config crate, and the binary's one-line config errors in
    // tests/cli.rs) write config TOML by hand.
    let exempt = ["tests/cli.rs"];
    let out = Command::new("git")
        .args(["ls-files", "*.rs"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run git ls-files");
    assert!(out.status.success(), "git ls-files failed");
    let files = String::from_utf8(out.stdout).expect("utf-8 paths");
    let mut offenders = Vec::new();
    for file in files.lines() {
        if file.starts_with("config/") || exempt.contains(&file) {
            continue;
        }
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        for (n, line) in text.lines().enumerate() {
            for table in toml_tables_written(line) {
                offenders.push(format!("{file}:{}: {table}", n + 1));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "config TOML written as text (build a Config value instead): {offenders:#?}"
    );
}

#[test]
fn config_tables_in_text_are_recognised() {
    let tables = |l: &str| toml_tables_written(l);
    assert_eq!(tables("[run]"), ["[run]"]);
    assert_eq!(tables("    [bus.tls]"), ["[bus.tls]"]);
    assert_eq!(
        tables(r#"r#"[[coordinator.datasets]]"#),
        ["[coordinator.datasets]"]
    );
    // Put together, so that this file does not hold the line it checks.
    let written = format!(
        r#"std::fs::write(&p, "{}\nurl = \"x\"\n{}\nhidden_size = 4");"#,
        "[bus]", "[model.tiny]"
    );
    assert_eq!(tables(&written), ["[bus]", "[model.tiny]"]);
    assert!(tables(r#".expect("[staleness]");"#).is_empty());
    assert!(tables(r#"contains("[eval] dataset")"#).is_empty());
    assert!(tables("/// the `[model]` defaults").is_empty());
    assert!(tables("#[derive(Debug)]").is_empty());
    assert!(tables("let v = [run];").is_empty());
}
