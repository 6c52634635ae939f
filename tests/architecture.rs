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
    /// package name → whether it has a library target
    is_lib: BTreeMap<String, bool>,
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
    let mut is_lib = BTreeMap::new();
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
        let lib = p["targets"].as_array().expect("targets").iter().any(|t| {
            t["kind"]
                .as_array()
                .is_some_and(|k| k.iter().any(|k| k == "lib"))
        });
        direct.insert(name.clone(), deps);
        is_lib.insert(name, lib);
    }
    Graph { direct, is_lib }
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
    // nothing else knows that the bus is NATS.
    assert_eq!(graph().users_of("async-nats"), set(&["asyncrl-transport"]));
}

#[test]
fn clap_lives_in_the_binary() {
    assert_eq!(graph().users_of("clap"), set(&["asyncrl"]));
}

#[test]
fn test_helpers_are_no_library_dependency() {
    // testkit (a real nats-server per test) and the test doubles are dev
    // dependencies; only the binary's benches start a private nats-server.
    let g = graph();
    for package in g.users_of("asyncrl-testkit") {
        assert!(
            !g.is_lib[package] || package == "asyncrl",
            "library crate {package} depends on asyncrl-testkit outside [dev-dependencies]"
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
            "asyncrl",
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
