//! Every asyncrl TOML under deploy/ is a valid config (unknown keys and
//! out-of-range values are errors), and the files the manifests mount are
//! the ones checked.

use std::path::{Path, PathBuf};

use asyncrl_config::Config;
use asyncrl_deploy_checks::repo_root;

fn tomls(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() && p.file_name().is_some_and(|n| n != "target") {
            tomls(&p, out);
        } else if p.extension().is_some_and(|x| x == "toml")
            && p.file_name().is_some_and(|n| n != "Cargo.toml")
        {
            out.push(p);
        }
    }
}

#[test]
fn every_deploy_config_parses() {
    let mut files = Vec::new();
    tomls(&repo_root().join("deploy"), &mut files);
    files.sort();
    let names: Vec<String> = files
        .iter()
        .map(|f| f.strip_prefix(repo_root()).unwrap().display().to_string())
        .collect();
    assert_eq!(
        names,
        [
            "deploy/k8s/base/asyncrl.toml",
            "deploy/k8s/components/gpu/asyncrl.toml",
            "deploy/k8s/components/torch-gang/asyncrl.toml",
            "deploy/k8s/components/vllm-sidecar/asyncrl.toml"
        ],
        "the configs the deployment ships"
    );
    for f in &files {
        let c = Config::load(f).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            c.bus.url.starts_with("tls://") && c.bus.tls.as_ref().is_some_and(|t| t.required),
            "{}: a deployment runs over NATS with TLS required",
            f.display()
        );
    }
}

#[test]
fn a_typo_in_a_deploy_config_is_caught() {
    let base = std::fs::read_to_string(repo_root().join("deploy/k8s/base/asyncrl.toml")).unwrap();
    let typo = base.replace("drain_grace_period", "drain_grace_periode");
    let err = Config::parse(&typo, None).unwrap_err().to_string();
    assert!(err.contains("worker.drain_grace_periode"), "{err}");
}
