//! `scripts/run` installs what its config needs: the vLLM venv (about 6 GB)
//! only for a config whose `[worker.engine] kind` is `"vllm"`, so that a
//! fresh clone's main job never creates `.venv-vllm`.

use std::path::Path;
use std::process::Command;

/// Runs `script` in bash after sourcing scripts/setup (which finds what
/// `scripts/test` installed); returns stdout and stderr.
fn with_setup(script: &str) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "set -euo pipefail; source scripts/setup >/dev/null 2>&1; {script}"
        ))
        .current_dir(root)
        .output()
        .expect("run bash");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{script}: {text}");
    text
}

#[test]
fn the_main_job_does_not_install_the_vllm_venv() {
    let dir = tempfile::tempdir().expect("temp dir");
    let venv = dir.path().join("venv-vllm");
    // What scripts/run does with its config, the vLLM venv pointed away.
    let text = with_setup(&format!(
        "ASYNCRL_VLLM_VENV='{}'; asyncrl_setup_for_config examples/arith.toml",
        venv.display()
    ));
    assert!(text.contains("the vLLM venv is not needed"), "{text}");
    assert!(!venv.exists(), "the vLLM venv was created: {text}");
    let run = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/run"))
        .expect("scripts/run");
    assert!(
        run.contains("asyncrl_setup_for_config \"$config\""),
        "scripts/run installs by its config"
    );
}

#[test]
fn the_engine_a_config_names_is_read_from_its_toml() {
    let text = with_setup(
        "_setup_config_engine examples/arith.toml; _setup_config_engine examples/arith-vllm.toml",
    );
    assert_eq!(text.lines().collect::<Vec<_>>(), ["builtin", "vllm"]);
}
