//! A local vLLM server process the worker starts (`worker.engine.launch`),
//! watches and restarts. It runs in its own process group so that killing
//! it also ends the engine-core processes vLLM starts.

use std::collections::VecDeque;
use std::process::Stdio;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;
use tokio::sync::watch;

/// How many of the process's last output lines are kept for error messages.
const TAIL_LINES: usize = 20;

/// One launched server (restartable).
pub struct Launcher {
    command: Vec<String>,
    endpoint: String,
    state: Mutex<Option<Running>>,
    tail: Arc<Mutex<VecDeque<String>>>,
}

struct Running {
    pid: i32,
    /// `Some(description)` once the process has exited.
    exited: watch::Receiver<Option<String>>,
}

impl Launcher {
    pub fn new(command: Vec<String>, endpoint: &str) -> Self {
        Self {
            command,
            endpoint: endpoint.to_owned(),
            state: Mutex::new(None),
            tail: Arc::new(Mutex::new(VecDeque::new())),
        }
    }

    /// Starts the command; returns a receiver that says when it exits.
    pub fn start(&self) -> std::io::Result<watch::Receiver<Option<String>>> {
        let (program, args) = self
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
        self.tail().clear();
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
            let tail = self.tail.clone();
            let endpoint = self.endpoint.clone();
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
        tracing::info!(pid, command = ?self.command, endpoint = %self.endpoint, "engine process started");
        *self.state.lock().unwrap_or_else(PoisonError::into_inner) = Some(Running {
            pid,
            exited: rx.clone(),
        });
        Ok(rx)
    }

    /// The process's last output lines, joined with " | ".
    pub fn last_lines(&self) -> String {
        self.tail().iter().cloned().collect::<Vec<_>>().join(" | ")
    }

    fn tail(&self) -> std::sync::MutexGuard<'_, VecDeque<String>> {
        self.tail.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Ends the process group: SIGTERM, then SIGKILL after `grace`.
    pub async fn stop(&self, grace: Duration) {
        let running = self
            .state
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
        tracing::info!(pid = running.pid, endpoint = %self.endpoint, "engine process stopped");
    }
}

fn signal_group(pgid: i32, signal: i32) {
    // SAFETY: killpg only sends a signal; the group is the one our child
    // leads (process_group(0)), so nothing else is hit.
    let rc = unsafe { libc::killpg(pgid, signal) };
    if rc != 0 {
        tracing::debug!(pgid, signal, error = %std::io::Error::last_os_error(), "killpg failed (already gone?)");
    }
}
