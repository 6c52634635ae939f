//! One vLLM server as the engine drives it: its route, its state (ready
//! with a weight version, swapping, down), its requests in flight, the
//! weight-swap steps, and the watchers that mark it down. Its process side
//! is its [`Lifecycle`].

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use asyncrl_config::PauseMode;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::api::{self, Api, NewVersion, Route, VllmError};
use super::lifecycle::{Exit, Lifecycle};

/// How often an idle server's `/health` is polled.
const HEALTH_EVERY: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, PartialEq)]
pub(super) enum ServerState {
    /// Serving the weights of `version` (-1: the folder it started with,
    /// before the first swap).
    Ready {
        version: i32,
    },
    /// A weight swap is in progress: new requests wait.
    Swapping,
    Down {
        reason: String,
    },
}

/// The newest weights: what a recovering server reloads.
#[derive(Debug, Clone)]
pub(super) struct Target {
    pub(super) version: i32,
    pub(super) dir: PathBuf,
}

pub(super) struct Server {
    pub(super) api: Api,
    pub(super) route: Route,
    pub(super) model_id: String,
    pub(super) state: watch::Sender<ServerState>,
    /// Bumped when a swap starts (before `/pause`).
    pub(super) epoch: AtomicU64,
    /// Cancelled when the server goes down: its requests stop waiting.
    down: Mutex<CancellationToken>,
    pub(super) in_flight: AtomicUsize,
    pub(super) lifecycle: Lifecycle,
    /// One swap or recovery at a time.
    pub(super) swap_lock: tokio::sync::Mutex<()>,
}

impl Server {
    /// A server that passed its start-up checks, serving the folder it
    /// started with.
    pub(super) fn new(api: Api, route: Route, model_id: String, lifecycle: Lifecycle) -> Self {
        Self {
            api,
            route,
            model_id,
            state: watch::Sender::new(ServerState::Ready { version: -1 }),
            epoch: AtomicU64::new(0),
            down: Mutex::new(CancellationToken::new()),
            in_flight: AtomicUsize::new(0),
            lifecycle,
            swap_lock: tokio::sync::Mutex::new(()),
        }
    }

    pub(super) fn is_down(&self) -> bool {
        matches!(*self.state.borrow(), ServerState::Down { .. })
    }

    pub(super) fn down_token(&self) -> CancellationToken {
        self.down
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Marks the server down (once) and cancels its requests.
    pub(super) fn mark_down(&self, why: String) {
        let changed = self.state.send_if_modified(|s| {
            if matches!(s, ServerState::Down { .. }) {
                false
            } else {
                *s = ServerState::Down {
                    reason: why.clone(),
                };
                true
            }
        });
        if changed {
            tracing::warn!(endpoint = %self.api.endpoint, reason = %why, "engine server down; its requests fail and their tasks go back");
            self.down_token().cancel();
        }
    }

    /// A recovered server serves again, with the weights of `version`.
    pub(super) fn mark_up(&self, version: i32) {
        *self.down.lock().unwrap_or_else(PoisonError::into_inner) = CancellationToken::new();
        self.state.send_replace(ServerState::Ready { version });
    }

    /// pause → reload from `target.dir` → set the version → reset the prefix
    /// cache → resume. Any failure leaves the server's weights unknown.
    pub(super) async fn swap(
        &self,
        mode: PauseMode,
        timeout: Duration,
        target: &Target,
    ) -> Result<(), VllmError> {
        let api = &self.api;
        self.epoch.fetch_add(1, Ordering::SeqCst);
        let pause = match mode {
            PauseMode::Abort => api::PAUSE_ABORT,
            PauseMode::Keep => api::PAUSE_KEEP,
        };
        api.post_empty(pause, timeout).await?;
        api.reload_weights(&target.dir, timeout).await?;
        let _: serde_json::Value = api
            .post(
                api::UPDATE_WEIGHT_VERSION,
                &NewVersion {
                    new_version: target.version.to_string(),
                },
                timeout,
            )
            .await?;
        api.post_empty(api::RESET_PREFIX_CACHE, timeout).await?;
        api.post_empty(api::RESUME, timeout).await?;
        Ok(())
    }

    /// Marks a launched server down when its process exits.
    pub(super) async fn watch_exit(self: Arc<Self>, exit: Exit, stop: CancellationToken) {
        tokio::select! {
            _ = stop.cancelled() => {}
            why = exit.wait() => {
                if let Some(why) = why {
                    self.mark_down(why);
                }
            }
        }
    }

    /// Polls an idle server's `/health`; two misses in a row mark it down.
    pub(super) async fn health_loop(self: Arc<Self>, stop: CancellationToken) {
        let mut misses = 0;
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(HEALTH_EVERY) => {}
            }
            if !matches!(*self.state.borrow(), ServerState::Ready { .. }) {
                misses = 0;
                continue;
            }
            if self.api.healthy(HEALTH_EVERY).await {
                misses = 0;
            } else {
                misses += 1;
                if misses >= 2 {
                    self.mark_down(format!("{}/health does not answer", self.api.endpoint));
                }
            }
        }
    }
}
