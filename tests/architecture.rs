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
            "-e",
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
