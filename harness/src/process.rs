//! Role processes: where the `asyncrl` binary is, and how a role is started
//! as a child that dies with its parent.

use std::fs::File;
use std::os::fd::AsRawFd as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use anyhow::Context as _;

/// The environment variable that names the `asyncrl` binary to run roles
/// with; without it, the `asyncrl` beside the running executable.
pub const ASYNCRL_BIN_ENV: &str = "ASYNCRL_BIN";

/// The environment variable that names the `asyncrl-bench` binary; without
/// it, the `asyncrl-bench` beside the running executable.
pub const ASYNCRL_BENCH_BIN_ENV: &str = "ASYNCRL_BENCH_BIN";

/// Where the binary `name` of this workspace is: `$env` when set, else
/// beside the running executable (`target/<profile>/NAME` for the
/// `asyncrl-bench` binary and, one folder up, for test binaries in
/// `target/<profile>/deps/`).
pub fn locate(name: &str, env: &str) -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os(env) {
        let path = PathBuf::from(path);
        anyhow::ensure!(path.is_file(), "{env}={} is not a file", path.display());
        return Ok(path);
    }
    let exe = std::env::current_exe().context("cannot find the running executable")?;
    let mut tried = Vec::new();
    for dir in exe.ancestors().skip(1).take(2) {
        let candidate = dir.join(name);
        if candidate.is_file() {
            return Ok(candidate);
        }
        tried.push(candidate);
    }
    anyhow::bail!(
        "cannot find the {name} binary (tried {}): build the workspace's binaries (`cargo build --workspace --bins`, or `--release`) or set {env}",
        tried
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// The `asyncrl-bench` binary (for tests that run a bench end to end).
pub fn bench_bin() -> anyhow::Result<PathBuf> {
    locate("asyncrl-bench", ASYNCRL_BENCH_BIN_ENV)
}

/// The `asyncrl` binary, held open: roles are started from the file this
/// process found first, even after a rebuild has replaced the file at its
/// path (a restart mid-run must not start other code, or fail).
pub fn asyncrl_bin() -> anyhow::Result<PathBuf> {
    static OPEN: OnceLock<File> = OnceLock::new();
    if let Some(file) = OPEN.get() {
        return Ok(fd_path(file));
    }
    let path = locate("asyncrl", ASYNCRL_BIN_ENV)?;
    let file = File::open(&path).with_context(|| format!("cannot open {}", path.display()))?;
    Ok(fd_path(OPEN.get_or_init(|| file)))
}

fn fd_path(file: &File) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()))
}

/// `bin <role> --config <config>`, stdout and stderr into `log`, killed when
/// the parent dies (an interrupted bench or test leaves no process behind).
pub fn role_command(bin: &Path, role: &str, config: &Path, log: File) -> anyhow::Result<Command> {
    let err = log.try_clone().context("cannot clone a log handle")?;
    let mut cmd = Command::new(bin);
    cmd.arg(role)
        .arg("--config")
        .arg(config)
        .env("NO_COLOR", "1")
        .env("RUST_BACKTRACE", "1")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(err);
    // SAFETY: prctl is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    Ok(cmd)
}
