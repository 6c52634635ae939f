//! The `asyncrl` binary as a user runs it: exit codes, one-line errors, and
//! that it starts without LD_LIBRARY_PATH.

use std::path::Path;
use std::process::{Command, Output};

fn asyncrl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_asyncrl"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("RUST_LOG")
        .output()
        .expect("run asyncrl")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn version_starts_without_ld_library_path_and_reports_libtorch() {
    let out = asyncrl(&["version"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    assert!(
        stdout.starts_with(&format!("asyncrl {}\n", env!("CARGO_PKG_VERSION"))),
        "{stdout}"
    );
    assert!(stdout.contains("libtorch 2."), "{stdout}");
    assert!(stdout.contains("CUDA available: "), "{stdout}");
}

#[test]
fn config_errors_are_one_line_and_name_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.toml");
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[bus]\nurl = \"http://nope\"\n").unwrap();
    let typo = dir.path().join("typo.toml");
    std::fs::write(&typo, "[telemetry]\nlisten_addr = \"127.0.0.1:0\"\n").unwrap();

    for (path, want) in [
        (&missing, "missing.toml"),
        (&bad, "bus.url"),
        (&typo, "telemetry.listen_addr"),
    ] {
        let path = path.to_str().unwrap();
        for args in [vec!["train", path], vec!["coordinator", "--config", path]] {
            let out = asyncrl(&args);
            let stderr = text(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
            assert!(stderr.starts_with("error: "), "{stderr}");
            assert!(stderr.contains(want), "{args:?}: {stderr}");
            assert_eq!(stderr.lines().count(), 1, "{stderr:?}");
            assert!(!stderr.contains("panicked"), "{stderr}");
        }
    }
}

#[test]
fn the_example_configs_are_valid() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    let mut loaded = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap().flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|x| x == "toml") {
            asyncrl_config::Config::load(&path)
                .unwrap_or_else(|e| panic!("{} does not load: {e}", path.display()));
            loaded.push(entry.file_name().to_string_lossy().into_owned());
        }
    }
    loaded.sort();
    assert_eq!(
        loaded,
        [
            "arith-staleness.toml",
            "arith-torch.toml",
            "arith-vllm.toml",
            "arith.toml",
            "gsm8k-qwen2.5.toml",
            "hidden-sum.toml",
            "local.toml"
        ]
    );
}
