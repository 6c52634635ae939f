//! One vLLM server's life, owned by [`Lifecycle`]: started and waited for
//! until `/health` answers, restarted after it went down, stopped at
//! shutdown.
//!
//! - **Launched** (`worker.engine.launch` set): the worker starts the
//!   command in its own process group and remembers the group. Stopping it
//!   (SIGTERM to the group, then SIGKILL after a grace period) ends every
//!   process of the group, the engine-core and worker processes vLLM
//!   starts included, also when the main process has already exited (a
//!   kill -9, the OOM killer): the group lives as long as any member does.
//!   A restart stops the old group first and then starts the command again.
//!   Its last output lines go into the error messages.
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
    /// The process's id, which is also its process group's (the group
    /// outlives the process while any of its children lives).
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

    /// Ends a launched server's whole process group: SIGTERM, then SIGKILL
    /// after `grace`, whether or not its main process still runs. Nothing
    /// for an attached server.
    pub(super) async fn stop(&self, grace: Duration) {
        let Some(l) = &self.launch else {
            return;
        };
        let running = l
            .running
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let Some(running) = running else {
            return;
        };
        let leader_exited = running.exited.borrow().is_some();
        let ended = end_group(running.pid, grace).await;
        if ended {
            tracing::info!(pgid = running.pid, leader_exited, endpoint = %self.api.endpoint, "engine process group ended");
        } else {
            tracing::error!(pgid = running.pid, leader_exited, endpoint = %self.api.endpoint, members = ?group_members(running.pid), "engine process group still runs after SIGKILL");
        }
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

impl Drop for Launch {
    /// A lifecycle dropped without [`Lifecycle::stop`] (the runtime going
    /// away) still ends its group.
    fn drop(&mut self) {
        let running = self
            .running
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(running) = running
            && !group_members(running.pid).is_empty()
        {
            signal_group(running.pid, libc::SIGKILL);
        }
    }
}

/// Ends process group `pgid`: SIGTERM, then SIGKILL when a member is left
/// after `grace`. Whether no member is left (zombies that only wait to be
/// reaped do not count).
async fn end_group(pgid: i32, grace: Duration) -> bool {
    if pgid <= 0 || group_members(pgid).is_empty() {
        return true;
    }
    signal_group(pgid, libc::SIGTERM);
    if group_gone(pgid, grace).await {
        return true;
    }
    signal_group(pgid, libc::SIGKILL);
    group_gone(pgid, grace).await
}

/// Waits up to `limit` until group `pgid` has no member left.
async fn group_gone(pgid: i32, limit: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if group_members(pgid).is_empty() {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The live (not zombie) processes of group `pgid`, from `/proc`.
#[cfg(target_os = "linux")]
pub fn group_members(pgid: i32) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return probe_group(pgid);
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            // `pid (comm) state ppid pgrp ...`; comm may hold spaces and ')'.
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| {
                    let (_, rest) = stat.rsplit_once(')')?;
                    let mut fields = rest.split_whitespace();
                    let state = fields.next()?;
                    let pgrp: i32 = fields.nth(1)?.parse().ok()?;
                    Some(pgrp == pgid && state != "Z" && state != "X")
                })
                .unwrap_or(false)
        })
        .collect()
}

/// The live processes of group `pgid`, as far as a signal 0 tells.
#[cfg(not(target_os = "linux"))]
pub fn group_members(pgid: i32) -> Vec<i32> {
    probe_group(pgid)
}

/// `[pgid]` when a signal 0 reaches group `pgid` (zombies included).
fn probe_group(pgid: i32) -> Vec<i32> {
    // SAFETY: signal 0 only checks that the group exists.
    let rc = unsafe { libc::killpg(pgid, 0) };
    if rc == 0 { vec![pgid] } else { Vec::new() }
}

fn signal_group(pgid: i32, signal: i32) {
    // SAFETY: killpg only sends a signal; the group is the one our child
    // leads (process_group(0)), and it is only signalled while a member
    // lives, so its id cannot have been reused.
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

    #[cfg(target_os = "linux")]
    /// The pid the launched shell printed as `child PID`.
    fn child_of(l: &Lifecycle) -> i32 {
        let launch = l.launch.as_ref().expect("launched");
        last_lines(&launch.tail)
            .rsplit("child ")
            .next()
            .and_then(|pid| pid.split_whitespace().next()?.parse().ok())
            .expect("the child's pid")
    }

    #[cfg(target_os = "linux")]
    /// The running leader's pid (its group's id) and its exit.
    fn leader(l: &Lifecycle) -> (i32, Exit) {
        let launch = l.launch.as_ref().expect("launched");
        let running = launch.running.lock().unwrap();
        let running = running.as_ref().expect("running");
        (
            running.pid,
            Exit {
                exited: running.exited.clone(),
                tail: launch.tail.clone(),
            },
        )
    }

    #[cfg(target_os = "linux")]
    /// Kills only the leader of `l`'s group (as kill -9 or the OOM killer
    /// do) and waits until its exit is reported; its child lives on.
    async fn kill_leader(l: &Lifecycle) -> (i32, i32) {
        let child = child_of(l);
        let (pgid, exit) = leader(l);
        assert!(
            group_members(pgid).contains(&child),
            "the child is in the group"
        );
        // SAFETY: kill(2) on the shell this test launched.
        assert_eq!(unsafe { libc::kill(pgid, libc::SIGKILL) }, 0);
        tokio::time::timeout(Duration::from_secs(10), exit.wait())
            .await
            .expect("the leader's exit is reported")
            .expect("an exit");
        assert!(
            !gone(child),
            "the child outlived its leader (the case under test)"
        );
        assert!(group_members(pgid).contains(&child));
        assert!(!group_members(pgid).contains(&pgid), "the leader is gone");
        (pgid, child)
    }

    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_group_whose_leader_was_killed_is_ended_by_restart_and_by_stop() {
        // A child that ignores SIGTERM, so that the SIGKILL step is needed.
        let l = Lifecycle::new(
            nowhere(),
            &sh("sh -c 'trap \"\" TERM; while :; do sleep 1; done' & echo \"child $!\"; wait"),
            Duration::from_millis(1500),
        );
        let _ = l.start().await.err().expect("never healthy");
        let (first, first_child) = kill_leader(&l).await;
        // The restart ends the old group before it starts the command anew.
        let err = l.restart().await.err().expect("never healthy");
        assert!(err.contains("no vLLM server answered"), "{err}");
        assert!(
            asyncrl_testkit::wait_until(Duration::from_secs(5), || group_members(first).is_empty())
                .await,
            "the old group outlived the restart: {:?}",
            group_members(first)
        );
        assert!(gone(first_child));
        let (second, second_child) = kill_leader(&l).await;
        assert_ne!(first, second);
        l.stop(Duration::from_millis(500)).await;
        assert!(
            asyncrl_testkit::wait_until(Duration::from_secs(5), || group_members(second)
                .is_empty())
            .await,
            "the group outlived stop: {:?}",
            group_members(second)
        );
        assert!(gone(second_child));
    }
}
