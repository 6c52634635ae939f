//! One vLLM server's life, owned by [`Lifecycle`]: started and waited for
//! until `/health` answers, restarted after it went down, stopped at
//! shutdown.
//!
//! - **Launched** (`worker.engine.launch` set): the worker starts the
//!   command in its own process group, so that stopping it (SIGTERM, then
//!   SIGKILL after a grace period) also ends the engine-core processes vLLM
//!   starts; a restart stops it and starts it again. Its last output lines
//!   go into the error messages.
//! - **Attached** (`worker.engine.launch` empty): someone else runs the
//!   server; starting or restarting it only waits for `/health`, and
//!   stopping it does nothing.
//!
//! This module knows nothing of the engine: the engine asks it for a ready
//! server and, for a launched one, gets an [`Exit`] that says when the
//! process ended.

use std::collections::VecDeque;
use std::process::Stdio;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;
use tokio::sync::watch;

use super::api::Api;

/// How many of the process's last output lines are kept for error messages.
const TAIL_LINES: usize = 20;

/// The last output lines of a launched process.
type Tail = Arc<Mutex<VecDeque<String>>>;

/// One server's lifecycle: launch or attach, readiness, restart, shutdown.
pub(super) struct Lifecycle {
    api: Api,
    ready_timeout: Duration,
    /// `None`: attached to a server someone else runs.
    launch: Option<Launch>,
}

/// The process of a launched server (restartable).
struct Launch {
    command: Vec<String>,
    running: Mutex<Option<Running>>,
    tail: Tail,
}

struct Running {
    /// The process's id, which is also its process group's.
    pid: i32,
    /// `Some(description)` once the process has exited.
    exited: watch::Receiver<Option<String>>,
}

/// The end of one start of a launched process.
pub(super) struct Exit {
    exited: watch::Receiver<Option<String>>,
    tail: Tail,
}

impl Exit {
    /// Resolves when the process exits, with why and its last lines; `None`
    /// when its exit can no longer be observed (the runtime is stopping).
    pub(super) async fn wait(mut self) -> Option<String> {
        let status = self
            .exited
            .wait_for(Option::is_some)
            .await
            .ok()?
            .clone()
            .unwrap_or_default();
        Some(format!(
            "the engine process exited ({status}); last lines: {}",
            last_lines(&self.tail)
        ))
    }
}

impl Lifecycle {
    /// Launches `launch` for `api`'s endpoint, or attaches to it when
    /// `launch` is empty; `ready_timeout` bounds every wait for `/health`.
    pub(super) fn new(api: Api, launch: &[String], ready_timeout: Duration) -> Self {
        let launch = (!launch.is_empty()).then(|| Launch {
            command: launch.to_vec(),
            running: Mutex::new(None),
            tail: Arc::new(Mutex::new(VecDeque::new())),
        });
        Self {
            api,
            ready_timeout,
            launch,
        }
    }

    /// Whether the worker runs the server's process.
    pub(super) fn launched(&self) -> bool {
        self.launch.is_some()
    }

    /// Starts the server (launched) and waits until it answers `/health`.
    pub(super) async fn start(&self) -> anyhow::Result<Option<Exit>> {
        let mut exit = match &self.launch {
            Some(l) => Some(self.spawn(l).map_err(|e| {
                anyhow::Error::new(e).context(format!(
                    "`worker.engine.launch`: cannot start {:?}",
                    l.command
                ))
            })?),
            None => None,
        };
        self.wait_ready(exit.as_mut())
            .await
            .map_err(anyhow::Error::msg)?;
        Ok(exit)
    }

    /// Brings a server that went down back until it answers `/health`: a
    /// launched one is stopped and started again, an attached one waited
    /// for.
    pub(super) async fn restart(&self) -> Result<Option<Exit>, String> {
        let mut exit = match &self.launch {
            Some(l) => {
                self.stop(Duration::from_secs(10)).await;
                Some(
                    self.spawn(l)
                        .map_err(|e| format!("cannot restart the engine process: {e}"))?,
                )
            }
            None => None,
        };
        self.wait_ready(exit.as_mut()).await?;
        Ok(exit)
    }

    /// Ends a launched server's process group: SIGTERM, then SIGKILL after
    /// `grace`. Nothing for an attached server.
    pub(super) async fn stop(&self, grace: Duration) {
        let Some(l) = &self.launch else {
            return;
        };
        let running = l
            .running
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let Some(mut running) = running else {
            return;
        };
        if running.exited.borrow().is_some() || running.pid <= 0 {
            return;
        }
        signal_group(running.pid, libc::SIGTERM);
        let exited = tokio::time::timeout(grace, running.exited.wait_for(Option::is_some))
            .await
            .is_ok();
        if !exited {
            signal_group(running.pid, libc::SIGKILL);
            let _ = tokio::time::timeout(grace, running.exited.wait_for(Option::is_some)).await;
        }
        tracing::info!(pid = running.pid, endpoint = %self.api.endpoint, "engine process stopped");
    }

    /// Waits until `/health` answers, the launched process exits, or the
    /// ready timeout.
    async fn wait_ready(&self, mut exit: Option<&mut Exit>) -> Result<(), String> {
        let api = &self.api;
        let deadline = tokio::time::Instant::now() + self.ready_timeout;
        loop {
            if api.healthy(Duration::from_secs(5)).await {
                return Ok(());
            }
            if let Some(exit) = exit.as_deref_mut()
                && let Some(status) = exit.exited.borrow().clone()
            {
                return Err(format!(
                    "`worker.engine.launch`: the engine process for {} exited ({status}) before it answered /health; its last lines: {}",
                    api.endpoint,
                    last_lines(&exit.tail)
                ));
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(format!(
                    "`worker.engine.endpoints`: no vLLM server answered {}/health within {:?} (worker.engine.ready_timeout)",
                    api.endpoint, self.ready_timeout
                ));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Starts the launch command in a process group of its own.
    fn spawn(&self, l: &Launch) -> std::io::Result<Exit> {
        let (program, args) = l
            .command
            .split_first()
            .ok_or_else(|| std::io::Error::other("worker.engine.launch is empty"))?;
        let mut child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true)
            .spawn()?;
        let pid = child.id().map_or(-1, |p| p as i32);
        l.tail
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        for stream in [
            child
                .stdout
                .take()
                .map(|s| Box::new(s) as Box<dyn tokio::io::AsyncRead + Send + Unpin>),
            child
                .stderr
                .take()
                .map(|s| Box::new(s) as Box<dyn tokio::io::AsyncRead + Send + Unpin>),
        ]
        .into_iter()
        .flatten()
        {
            let tail = l.tail.clone();
            let endpoint = self.api.endpoint.clone();
            tokio::spawn(async move {
                let mut lines = BufReader::new(stream).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    tracing::debug!(target: "asyncrl::engine", endpoint = %endpoint, "{line}");
                    let mut t = tail.lock().unwrap_or_else(PoisonError::into_inner);
                    if t.len() == TAIL_LINES {
                        t.pop_front();
                    }
                    t.push_back(line);
                }
            });
        }
        let (tx, rx) = watch::channel(None);
        tokio::spawn(async move {
            let what = match child.wait().await {
                Ok(status) => status.to_string(),
                Err(e) => format!("cannot wait for it: {e}"),
            };
            let _ = tx.send(Some(what));
        });
        tracing::info!(pid, command = ?l.command, endpoint = %self.api.endpoint, "engine process started");
        *l.running.lock().unwrap_or_else(PoisonError::into_inner) = Some(Running {
            pid,
            exited: rx.clone(),
        });
        Ok(Exit {
            exited: rx,
            tail: l.tail.clone(),
        })
    }
}

/// A process's last output lines, joined with " | ".
fn last_lines(tail: &Mutex<VecDeque<String>>) -> String {
    tail.lock()
        .unwrap_or_else(PoisonError::into_inner)
        .iter()
        .cloned()
        .collect::<Vec<_>>()
        .join(" | ")
}

fn signal_group(pgid: i32, signal: i32) {
    // SAFETY: killpg only sends a signal; the group is the one our child
    // leads (process_group(0)), so nothing else is hit.
    let rc = unsafe { libc::killpg(pgid, signal) };
    if rc != 0 {
        tracing::debug!(pgid, signal, error = %std::io::Error::last_os_error(), "killpg failed (already gone?)");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An endpoint nothing listens on.
    fn nowhere() -> Api {
        let port = asyncrl_testkit::free_port().expect("free port");
        Api::new(&format!("http://127.0.0.1:{port}"), reqwest::Client::new())
    }

    fn sh(script: &str) -> Vec<String> {
        ["sh", "-c", script].map(str::to_owned).to_vec()
    }

    #[tokio::test]
    async fn a_launched_server_that_exits_before_health_fails_with_its_last_lines() {
        let l = Lifecycle::new(
            nowhere(),
            &sh("echo loading; echo 'no GPU found' >&2; exit 3"),
            Duration::from_secs(60),
        );
        assert!(l.launched());
        let err = format!("{:#}", l.start().await.err().expect("an error"));
        assert!(err.contains("`worker.engine.launch`"), "{err}");
        assert!(err.contains("exit status: 3"), "{err}");
        assert!(err.contains("no GPU found"), "{err}");
        let err = l.restart().await.err().expect("an error");
        assert!(err.contains("exit status: 3"), "{err}");
    }

    #[tokio::test]
    async fn an_unknown_launch_command_is_one_error() {
        let l = Lifecycle::new(
            nowhere(),
            &["/nonexistent/vllm".to_owned()],
            Duration::from_secs(60),
        );
        let err = format!("{:#}", l.start().await.err().expect("an error"));
        assert!(
            err.contains("`worker.engine.launch`: cannot start [\"/nonexistent/vllm\"]"),
            "{err}"
        );
        let err = l.restart().await.err().expect("an error");
        assert!(err.contains("cannot restart the engine process"), "{err}");
    }

    #[tokio::test]
    async fn an_attached_server_is_waited_for_until_the_ready_timeout() {
        let l = Lifecycle::new(nowhere(), &[], Duration::from_millis(600));
        assert!(!l.launched());
        let started = tokio::time::Instant::now();
        let err = format!("{:#}", l.start().await.err().expect("an error"));
        assert!(started.elapsed() >= Duration::from_millis(600));
        assert!(
            err.contains("`worker.engine.endpoints`: no vLLM server answered"),
            "{err}"
        );
        // Stopping an attached server does nothing (and does not wait).
        l.stop(Duration::from_secs(10)).await;
    }

    /// Whether `pid` is gone (or a zombie that only waits to be reaped).
    #[cfg(target_os = "linux")]
    fn gone(pid: i32) -> bool {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => true,
            Ok(stat) => stat
                .rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        }
    }

    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn stop_ends_the_whole_process_group_and_an_exit_is_reported() {
        // The launched shell starts a child of its own (as vLLM starts its
        // engine core) and never answers /health.
        let l = Lifecycle::new(
            nowhere(),
            &sh("sleep 600 & echo \"child $!\"; wait"),
            Duration::from_millis(1500),
        );
        let err = format!("{:#}", l.start().await.err().expect("an error"));
        assert!(err.contains("no vLLM server answered"), "{err}");
        let launch = l.launch.as_ref().expect("launched");
        let child: i32 = last_lines(&launch.tail)
            .strip_prefix("child ")
            .and_then(|pid| pid.trim().parse().ok())
            .expect("the child's pid");
        let (shell, exited) = {
            let running = launch.running.lock().unwrap();
            let running = running.as_ref().expect("running");
            (running.pid, running.exited.clone())
        };
        assert!(!gone(shell) && !gone(child));
        let exit = Exit {
            exited,
            tail: launch.tail.clone(),
        };
        l.stop(Duration::from_secs(10)).await;
        let why = tokio::time::timeout(Duration::from_secs(10), exit.wait())
            .await
            .expect("the exit is reported")
            .expect("an exit");
        assert!(why.starts_with("the engine process exited ("), "{why}");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !(gone(shell) && gone(child)) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the process group outlived stop"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
