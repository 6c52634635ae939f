//! The rollout worker: continuous generation with the current policy,
//! interruptible weight swaps, rewards, leases and graceful drain.
//!
//! [`run`] (or [`Worker`] for more control) runs one worker over any
//! [`Bus`](asyncrl_transport::Bus), in-process for the local mode or as
//! `asyncrl worker`:
//!
//! 1. It builds the policy of `[model]` on its own thread
//!    ([`asyncrl_policy::ModelHandle`], continuous batching with
//!    `worker.max_sequences` slots), then waits for the learner's first
//!    weight announcement (`policy.version` in the KV bucket
//!    `asyncrl_control`) and loads those weights: it never generates with
//!    weights nobody announced.
//! 2. It registers with the coordinator and heartbeats the leases it holds;
//!    a lease the coordinator revokes has its sequences cancelled.
//! 3. It acquires tasks as slots free up (continuous batching: a finished
//!    sequence frees its slot and the next task's sequences take it, the
//!    worker never waits for the slowest sequence of a batch). Each task's
//!    G completions run concurrently; each is decoded, scored (built-in
//!    verifier or an external `RewardService`, see [`reward`]) and published
//!    as one [`Trajectory`](asyncrl_protos::Trajectory) to the stream
//!    `TRAJECTORIES` (message id = the trajectory's uuid), token-exact:
//!    the sampled ids, their log-probs under the weights that sampled them
//!    (`log_softmax(logits / τ)`), and each token's policy version. Once all
//!    G publishes are acked the task is reported complete.
//! 4. New weights announced meanwhile are fetched, checked against the
//!    announced sha256 and swapped in at the next decoding-step boundary;
//!    sequences in flight continue with their KV cache recomputed and their
//!    later tokens carry the new version. A failed fetch keeps the old
//!    weights and is retried with backoff.
//! 5. On shutdown (SIGTERM) it stops acquiring, lets the sequences in flight
//!    finish within `worker.drain_grace_period`, publishes them, returns the
//!    unfinished tasks to the coordinator and returns a [`WorkerSummary`].
//!
//! [`scripted`] holds a scripted coordinator and a weight publisher for
//! tests and benches; [`bench`] compares continuous with static batching.

mod client;
pub mod engine;
mod episode;
pub mod error;
pub mod metrics;
pub mod reward;
#[cfg(feature = "testsuite")]
pub mod scripted;
mod settings;
mod state;
mod task;
mod weights;
mod worker;

pub use error::WorkerError;
pub use metrics::WorkerMetrics;
pub use settings::pin_worker_id;
pub use state::CompletionLengths;
/// The fetch every worker of this process shares (see `weights`).
pub use weights::fetch as fetch_weights;
pub use worker::{HEALTH_CONDITION, Worker, WorkerSummary, run};

/// Re-exported: the shutdown token [`run`] takes.
pub use tokio_util::sync::CancellationToken;

/// A shutdown token cancelled by the first SIGTERM or SIGINT (what
/// `asyncrl worker` passes to [`run`]: Kubernetes scale-down sends SIGTERM
/// and the worker drains). Must be called inside a tokio runtime.
pub fn shutdown_on_signals() -> std::io::Result<CancellationToken> {
    asyncrl_common::process::shutdown_on_signals("worker")
}
