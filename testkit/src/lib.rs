//! Test and bench helpers.
//!
//! [`NatsServer`] starts a real `nats-server` with JetStream on a free port and
//! a temporary store directory, and can kill it (`SIGKILL`) and restart it on
//! the same port and store, so that tests can check what survives a crash.
//! [`NatsServer::start_with_config`] runs it with a config file (users and
//! permissions, TLS) and the files that config includes.

use std::io::{BufRead, BufReader, Read};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum TestkitError {
    #[error(
        "nats-server binary not found (looked at $ASYNCRL_NATS_SERVER, {venv} and $PATH); run scripts/setup"
    )]
    NoBinary { venv: String },
    #[error("io error: {0}")]
    Io(#[from] std::io::Error),
    #[error("nats-server on port {port} did not become ready within {timeout:?}: {log}")]
    NotReady {
        port: u16,
        timeout: Duration,
        log: String,
    },
}

/// Root of the workspace this crate was built in.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_owned)
        .unwrap_or_default()
}

/// Finds the nats-server binary: `$ASYNCRL_NATS_SERVER`, then the project's
/// venv (`.venv/bin/nats-server`, installed by scripts/setup), then `$PATH`.
pub fn nats_server_binary() -> Result<PathBuf, TestkitError> {
    if let Some(p) = std::env::var_os("ASYNCRL_NATS_SERVER") {
        return Ok(PathBuf::from(p));
    }
    let venv = workspace_root().join(".venv/bin/nats-server");
    if venv.is_file() {
        return Ok(venv);
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let candidate = dir.join("nats-server");
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    Err(TestkitError::NoBinary {
        venv: venv.display().to_string(),
    })
}

/// A port that was free a moment ago.
pub fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A nats-server configuration for [`NatsServer::start_with_config`].
#[derive(Debug, Clone, Default)]
pub struct ServerConfig {
    /// The config file's text. The port, the JetStream store and the
    /// listen address come from the command line (they win over the file;
    /// a `store_dir` in the file is an error of nats-server's).
    pub text: String,
    /// Files written next to the config file (`include`d files,
    /// certificates), by file name.
    pub files: Vec<(String, Vec<u8>)>,
    /// Environment variables of the server process (`$VAR` in the config).
    pub env: Vec<(String, String)>,
}

impl ServerConfig {
    pub fn new(text: impl Into<String>) -> Self {
        Self {
            text: text.into(),
            ..Self::default()
        }
    }

    /// Places a file next to the config file.
    pub fn file(mut self, name: impl Into<String>, contents: impl Into<Vec<u8>>) -> Self {
        self.files.push((name.into(), contents.into()));
        self
    }

    /// Sets an environment variable of the server process.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }
}

/// A real nats-server with JetStream, owned by a test. Killed on drop.
pub struct NatsServer {
    bin: PathBuf,
    port: u16,
    store: tempfile::TempDir,
    log_path: PathBuf,
    extra_args: Vec<String>,
    env: Vec<(String, String)>,
    child: Option<Child>,
}

impl NatsServer {
    /// Starts a server on a free port with a fresh store directory.
    pub fn start() -> Result<Self, TestkitError> {
        Self::start_with_args(&[])
    }

    /// Starts a server with extra command-line arguments (e.g. `--auth TOKEN`).
    pub fn start_with_args(extra: &[&str]) -> Result<Self, TestkitError> {
        let store = tempfile::Builder::new().prefix("asyncrl-nats-").tempdir()?;
        let log_path = store.path().join("nats-server.log");
        let mut server = Self {
            bin: nats_server_binary()?,
            port: free_port()?,
            store,
            log_path,
            extra_args: extra.iter().map(|s| s.to_string()).collect(),
            env: Vec::new(),
            child: None,
        };
        server.spawn()?;
        Ok(server)
    }

    /// Starts a server with a config file (written, with `config.files`,
    /// to `<store>/conf/`), on a free port with a fresh store directory.
    /// Restarts keep the config.
    pub fn start_with_config(config: &ServerConfig) -> Result<Self, TestkitError> {
        let store = tempfile::Builder::new().prefix("asyncrl-nats-").tempdir()?;
        let conf_dir = store.path().join("conf");
        std::fs::create_dir_all(&conf_dir)?;
        for (name, contents) in &config.files {
            std::fs::write(conf_dir.join(name), contents)?;
        }
        let conf = conf_dir.join("nats.conf");
        std::fs::write(&conf, &config.text)?;
        let log_path = store.path().join("nats-server.log");
        let mut server = Self {
            bin: nats_server_binary()?,
            port: free_port()?,
            store,
            log_path,
            extra_args: vec!["-c".into(), conf.display().to_string()],
            env: config.env.clone(),
            child: None,
        };
        server.spawn()?;
        Ok(server)
    }

    fn spawn(&mut self) -> Result<(), TestkitError> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)?;
        let mut cmd = Command::new(&self.bin);
        cmd.args([
            "-a",
            "127.0.0.1",
            "-p",
            &self.port.to_string(),
            "-js",
            "-sd",
        ])
        .arg(self.store.path().join("jetstream"))
        .args(&self.extra_args)
        .envs(self.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log);
        // SAFETY: prctl is async-signal-safe; it makes the server die with the
        // test process, so a crashed test leaves no server behind.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        self.child = Some(cmd.spawn()?);
        self.wait_ready(Duration::from_secs(30))
    }

    /// Waits until the server accepts connections and says JetStream is on.
    fn wait_ready(&mut self, timeout: Duration) -> Result<(), TestkitError> {
        let start = Instant::now();
        while start.elapsed() < timeout {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                return Err(TestkitError::NotReady {
                    port: self.port,
                    timeout,
                    log: format!("exited with {status}: {}", self.log_tail()),
                });
            }
            if let Ok(stream) = TcpStream::connect(("127.0.0.1", self.port)) {
                stream.set_read_timeout(Some(Duration::from_secs(2)))?;
                let mut line = String::new();
                if BufReader::new(stream).read_line(&mut line).is_ok()
                    && line.contains("\"jetstream\":true")
                {
                    return Ok(());
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(TestkitError::NotReady {
            port: self.port,
            timeout,
            log: self.log_tail(),
        })
    }

    fn log_tail(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = std::fs::File::open(&self.log_path) {
            let _ = f.read_to_string(&mut s);
        }
        let start = s.len().saturating_sub(2000);
        s[s.floor_char_boundary(start)..].to_owned()
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The JetStream store directory (survives kill/restart).
    pub fn store_dir(&self) -> &Path {
        self.store.path()
    }

    /// The process id of the running server (None while it is down).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }

    /// Kills the server with SIGKILL, as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops the server with SIGTERM (a clean shutdown) and waits for it.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: plain kill(2) on our own child's pid.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port with the same store.
    pub fn restart(&mut self) -> Result<(), TestkitError> {
        self.kill();
        self.spawn()
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Polls `f` until it returns `Some`, and returns that; panics naming `what`
/// after `timeout`. Time is tokio's, so a test on paused time waits in
/// virtual time.
pub async fn eventually<T, F, Fut>(what: &str, timeout: std::time::Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(POLL).await;
    }
}

/// Polls `f` until it holds (true) or `timeout` passes (false).
pub async fn wait_until(timeout: std::time::Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    while tokio::time::Instant::now() < deadline {
        if f() {
            return true;
        }
        tokio::time::sleep(POLL).await;
    }
    f()
}

/// How often [`eventually`] and [`wait_until`] look.
const POLL: std::time::Duration = std::time::Duration::from_millis(5);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_file_with_its_includes_and_environment_is_used_across_restarts() {
        let config = ServerConfig::new("include auth.conf\n")
            .file("auth.conf", "authorization { token: $TESTKIT_TOKEN }\n")
            .env("TESTKIT_TOKEN", "t0ken");
        let mut s = NatsServer::start_with_config(&config).unwrap();
        let info = |port: u16| {
            let stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
            let mut line = String::new();
            BufReader::new(stream).read_line(&mut line).unwrap();
            line
        };
        assert!(info(s.port()).contains("\"auth_required\":true"));
        s.restart().unwrap();
        assert!(info(s.port()).contains("\"auth_required\":true"));
    }

    #[test]
    fn starts_kills_and_restarts_on_the_same_port() {
        let mut s = NatsServer::start().unwrap();
        let port = s.port();
        assert!(s.is_running());
        s.kill();
        assert!(!s.is_running());
        assert!(TcpStream::connect(("127.0.0.1", port)).is_err());
        s.restart().unwrap();
        assert_eq!(s.port(), port);
        assert!(TcpStream::connect(("127.0.0.1", port)).is_ok());
    }
}
