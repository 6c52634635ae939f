//! `asyncrl-bench` as a user runs it: every bench is a subcommand in its
//! help, and a bench given bad input stops with one line naming it. (Also
//! what makes `cargo test --workspace` build the binary that the root
//! package's bench tests run.)

use std::process::{Command, Output};

use asyncrl_harness::bench::BenchCommand;
use clap::Subcommand as _;

fn bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_asyncrl-bench"))
        .args(args)
        .env("NO_COLOR", "1")
        .env_remove("RUST_LOG")
        .output()
        .expect("run asyncrl-bench")
}

#[test]
fn every_bench_is_a_subcommand_in_the_help() {
    let out = bench(&["--help"]);
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    let names: Vec<String> = BenchCommand::augment_subcommands(clap::Command::new("asyncrl-bench"))
        .get_subcommands()
        .map(|c| c.get_name().to_owned())
        .collect();
    assert!(names.len() >= 10, "{names:?}");
    for name in &names {
        assert!(
            help.lines()
                .any(|l| l.trim_start().starts_with(name.as_str())),
            "{name} is not in the help:\n{help}"
        );
    }
}

#[test]
fn a_bench_with_a_missing_config_stops_with_one_line_naming_it() {
    let dir = tempfile::tempdir().expect("temp dir");
    let missing = dir.path().join("no-such-config.toml");
    let out = bench(&["sync-step", missing.to_str().expect("utf-8")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
    assert!(stderr.contains("no-such-config.toml"), "{stderr}");
}
