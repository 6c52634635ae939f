//! The environment boundary of multi-turn rollouts.
//!
//! An environment is a service with `reset(task) → observation` and
//! `step(action) → observation, reward, done`. [`Environment`] is that
//! interface; [`HttpEnvironment`] speaks it to a server over HTTP (the
//! reset/step interface of OpenEnv environments, extended with an episode id
//! so that one server runs many episodes at once, and a step index so that a
//! retried step is idempotent); [`builtin::HiddenSum`] is an in-process one
//! for the built-in tiny model's multi-turn task. The episode loop (turning
//! observations into tokens and actions) is the rollout worker's.
//!
//! # PROTOCOL
//!
//! An environment server speaks JSON over plain HTTP/1.1. Every request and
//! reply body is a JSON object (`Content-Type: application/json`); fields
//! not named here are ignored by both sides.
//!
//! | route | request body | reply |
//! |---|---|---|
//! | `POST {base}/reset` | `{"episode_id": str, "task": Task}` | `StepReply` |
//! | `POST {base}/step` | `{"episode_id": str, "step": int, "action": Action}` | `StepReply` |
//! | `POST {base}/close` | `{"episode_id": str}` | any JSON object, e.g. `{"closed": true}` |
//! | `GET {base}/health` | — | 200 with any body while the server serves |
//!
//! ```text
//! Task        = {"task_id": str, "dataset": str,
//!                "prompt": str | [message, ...],   // as the data set gives it
//!                "answer": str, "metadata": any}   // e.g. {"x": 12}
//! Action      = {"content": str,                   // the assistant's reply text
//!                "tool_calls": [{"id": str?, "name": str, "arguments": any}, ...]}
//! StepReply   = {"observation": Observation,
//!                "reward": number | null,          // finite; null or absent: none
//!                "done": bool}
//! Observation = {"messages": [Message, ...],       // to append; absent: []
//!                "tools": [schema, ...]}           // on reset only; absent: []
//! Message     = {"role": "system"|"user"|"assistant"|"tool", "content": str,
//!                "name": str?, "tool_call_id": str?}
//! schema      = {"type": "function", "function": {"name": str,
//!                "description": str, "parameters": JSON schema}}
//! Error       = {"error": str}                     // the body of a 4xx
//! ```
//!
//! Episodes:
//!
//! - The client chooses `episode_id` (unique per episode, e.g. a UUID).
//!   `reset` starts the episode; the server keeps its state until `close`
//!   (it may also forget idle episodes after a while).
//! - Steps are numbered from 1 and sent in order: step `n` is accepted
//!   after step `n-1` (reset is step 0). A step whose index is the last one
//!   answered is a retry: the server returns the same reply again without
//!   applying the action twice. A repeated `reset` of an episode that has
//!   not stepped, with the same task, is a retry too.
//! - After a reply with `done: true` no new step is accepted.
//! - The server answers 4xx with an `Error` body when a request is wrong:
//!   an unknown episode, a step out of order or after the end, a malformed
//!   body, a task it cannot run. Repeating it would fail again.
//! - 5xx, 408 and 429 are transient: the client retries the same request
//!   (same `episode_id`, same `step`), so the server must be idempotent as
//!   above.
//!
//! The client ([`HttpEnvironment`]) bounds each attempt by its call timeout
//! (connect, send, read the whole reply), retries timeouts, connection
//! failures and transient statuses up to `retries` times with doubling
//! backoff, and returns an [`EnvError`] whose kind says what went wrong. A
//! reply that is not JSON, has the wrong shape, a non-finite reward or a
//! message with an unknown role is [`EnvError::Malformed`] and is not
//! retried. `close` is one best-effort attempt.
//!
//! # Metrics
//!
//! [`EnvMetrics`]: `asyncrl_env_calls_total{call, outcome}` (each attempt,
//! `outcome` is `ok` or the [`EnvError::kind`]), `asyncrl_env_call_seconds{call}`
//! and `asyncrl_env_retries_total{call}`, with `call` one of `reset`, `step`,
//! `close`.
//!
//! # Example environment
//!
//! `environments/calc_env` is a server of this protocol in Python (the
//! standard library only) that plays [`builtin::HiddenSum`]'s rules:
//! `python -m asyncrl_calc_env --port 8000`.

pub mod builtin;
mod episode;
mod error;
mod http;
mod lockstep;
mod metrics;
mod types;

use async_trait::async_trait;

pub use episode::{Episode, EpisodeError, EpisodeLimits, EpisodeOutput, Next, Reply, ReplyEnd};
pub use error::{EnvError, EnvSetupError};
pub use http::{HttpEnvSettings, HttpEnvironment, MAX_REPLY_BYTES};
pub use lockstep::{EpisodeFailure, LockstepEpisode, ReplyRequest, run_lockstep};
pub use metrics::{EnvMetrics, LabelledHistogram, Labels};
pub use types::{
    Action, ActionToolCall, EnvMessage, EnvTask, Observation, ROLES, StepResult, prompt_messages,
};

/// An environment: episodes of `reset` then `step`s until `done`.
///
/// Implementations are shared by many episodes at once (`&self`), keyed by
/// the caller's `episode_id`.
#[async_trait]
pub trait Environment: Send + Sync {
    /// Starts episode `episode_id` on `task`. The reply's observation holds
    /// what to add to the prompt (often nothing) and the tools offered.
    async fn reset(&self, episode_id: &str, task: &EnvTask) -> Result<StepResult, EnvError>;

    /// Applies `action` as step `step` (1-based, in order; repeating the
    /// last index returns the same reply).
    async fn step(
        &self,
        episode_id: &str,
        step: u32,
        action: &Action,
    ) -> Result<StepResult, EnvError>;

    /// Frees the episode's state, best effort (failures are logged).
    async fn close(&self, episode_id: &str);

    /// What the environment is called in logs and errors (an HTTP one's
    /// base URL).
    fn name(&self) -> &str;
}

/// The environment of `[environment]`: a built-in one (`builtin:<name>`,
/// with `environment.tool_latency`), or the HTTP client of a reset/step
/// server (`environment.call_timeout`, `environment.retries`).
pub fn from_config(
    cfg: &asyncrl_config::EnvironmentConfig,
    metrics: &asyncrl_telemetry::Metrics,
) -> Result<std::sync::Arc<dyn Environment>, EnvSetupError> {
    match cfg.kind() {
        asyncrl_config::EnvironmentKind::Builtin(_) => {
            let mut env = builtin::HiddenSum::new();
            if !cfg.tool_latency.is_zero() {
                env = env.with_latency(builtin::LatencyModel {
                    median: cfg.tool_latency,
                    pareto_alpha: cfg.tool_latency_alpha,
                    seed: 0,
                });
            }
            Ok(std::sync::Arc::new(env))
        }
        asyncrl_config::EnvironmentKind::Http(url) => {
            let settings = HttpEnvSettings {
                call_timeout: cfg.call_timeout,
                retries: cfg.retries,
                ..HttpEnvSettings::new(url)
            };
            Ok(std::sync::Arc::new(HttpEnvironment::new(
                settings, metrics,
            )?))
        }
    }
}
