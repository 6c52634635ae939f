//! Role processes: where the `asyncrl` binary is, how a role is started as
//! a child that dies with its parent, and [`RoleProcess`], one role across
//! its restarts and faults.

use std::fs::File;
use std::io::{Read as _, Seek as _, SeekFrom, Write as _};
use std::os::fd::AsRawFd as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
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

/// What a role logs once its SIGTERM handler is installed (`roles::start`);
/// before that, SIGTERM kills it like SIGKILL would.
pub const READY_LINE: &str = "serving /metrics";

/// One role of a run as a child process of the `asyncrl` binary, across
/// its incarnations: every start appends a `===== start #N of NAME at
/// t=…s =====` line and the role's output to one log file, faults are
/// signals (kill -9, SIGTERM, SIGSTOP/SIGCONT), and the process is killed
/// when this is dropped. The cluster tests and the chaos bench both run
/// their roles as these.
#[derive(Debug)]
pub struct RoleProcess {
    /// `coordinator`, `worker-2`, …
    pub name: String,
    /// The subcommand: `coordinator`, `buffer`, `learner`, `worker` or
    /// `trainer-node`.
    pub role: String,
    pub config: PathBuf,
    pub log: PathBuf,
    /// How many times it was started.
    pub starts: u32,
    /// The exit status of the last incarnation, once reaped.
    pub exited: Option<ExitStatus>,
    /// Stopped with SIGSTOP and not continued.
    pub frozen: bool,
    /// Environment variables of every incarnation beside the inherited ones.
    pub env: Vec<(String, String)>,
    child: Option<Child>,
    /// Length of the log when the current incarnation started.
    log_offset: u64,
}

impl RoleProcess {
    pub fn new(name: &str, role: &str, config: PathBuf, log: PathBuf) -> Self {
        Self {
            name: name.to_owned(),
            role: role.to_owned(),
            config,
            log,
            starts: 0,
            exited: None,
            frozen: false,
            env: Vec::new(),
            child: None,
            log_offset: 0,
        }
    }

    /// Starts a new incarnation of the role from `bin`; `t` (seconds since
    /// the run started) goes into the log's start line.
    pub fn start(&mut self, bin: &Path, t: f64) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.child.is_none(),
            "{} is still running; kill it first",
            self.name
        );
        self.starts += 1;
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("cannot open {}", self.log.display()))?;
        writeln!(
            log,
            "===== start #{} of {} at t={t:.1}s =====",
            self.starts, self.name
        )
        .with_context(|| format!("cannot write {}", self.log.display()))?;
        self.log_offset = log.metadata().map(|m| m.len()).unwrap_or(0);
        let child = role_command(bin, &self.role, &self.config, log)?
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .spawn()
            .with_context(|| format!("cannot start {}", self.name))?;
        self.child = Some(child);
        self.exited = None;
        self.frozen = false;
        Ok(())
    }

    /// Whether an incarnation is running (started and not reaped).
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Sends `sig` to the running incarnation; false if there is none or
    /// kill(2) failed.
    pub fn signal(&mut self, sig: i32) -> bool {
        let Some(pid) = self.pid() else {
            return false;
        };
        // SAFETY: kill(2) on our own child, which we have not reaped.
        let sent = unsafe { libc::kill(pid as i32, sig) == 0 };
        if sent && sig == libc::SIGSTOP {
            self.frozen = true;
        } else if sent && sig == libc::SIGCONT {
            self.frozen = false;
        }
        sent
    }

    /// kill -9 and reap (a frozen process dies of it too).
    pub fn kill9(&mut self) -> Option<ExitStatus> {
        let mut child = self.child.take()?;
        let _ = child.kill();
        let status = child.wait().ok();
        self.exited = status;
        self.frozen = false;
        status
    }

    /// Reaps the process if it has exited.
    pub fn poll(&mut self) -> Option<ExitStatus> {
        let child = self.child.as_mut()?;
        match child.try_wait() {
            Ok(Some(status)) => {
                self.child = None;
                self.exited = Some(status);
                self.frozen = false;
                Some(status)
            }
            _ => None,
        }
    }

    /// Appends `===== msg =====` to the log (a fault, as the run saw it).
    pub fn note(&self, msg: &str) {
        if let Ok(mut f) = std::fs::OpenOptions::new().append(true).open(&self.log) {
            let _ = writeln!(f, "===== {msg} =====");
        }
    }

    /// The whole log, every incarnation.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The log of the current (or last) incarnation.
    pub fn current_log(&self) -> String {
        let Ok(mut f) = File::open(&self.log) else {
            return String::new();
        };
        let mut text = String::new();
        match f
            .seek(SeekFrom::Start(self.log_offset))
            .and_then(|_| f.read_to_string(&mut text))
        {
            Ok(_) => text,
            Err(_) => String::new(),
        }
    }

    /// Whether the current incarnation has installed its SIGTERM handler
    /// ([`READY_LINE`] in its log).
    pub fn handles_sigterm(&self) -> bool {
        self.current_log().contains(READY_LINE)
    }
}

/// Every live descendant of `pid` with its command line (from /proc).
pub fn descendants(pid: u32) -> Vec<(u32, String)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    // (pid, parent pid, command line) of every process.
    let all: Vec<(u32, u32, String)> = entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|p| {
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).ok()?;
            // The fields after the command name (which may hold spaces).
            let rest = &stat[stat.rfind(')')? + 2..];
            let ppid = rest.split(' ').nth(1)?.parse().ok()?;
            let cmd = std::fs::read(format!("/proc/{p}/cmdline"))
                .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
                .unwrap_or_default();
            Some((p, ppid, cmd))
        })
        .collect();
    let mut out = Vec::new();
    let mut frontier = vec![pid];
    while let Some(parent) = frontier.pop() {
        for (p, ppid, cmd) in &all {
            if *ppid == parent {
                out.push((*p, cmd.clone()));
                frontier.push(*p);
            }
        }
    }
    out
}

impl Drop for RoleProcess {
    fn drop(&mut self) {
        self.kill9();
    }
}
