//! Multi-turn episodes (`[environment]`): one completion of a task becomes
//! an episode. The worker drives an [`asyncrl_environment::Episode`] with
//! its engine (each reply one `generate` from every token so far, so a
//! weight swap between or inside turns keeps per-token versions exact) and
//! the environment (reset, then one step per reply), and publishes the
//! episode as one trajectory with its turns. The environment's calls are
//! awaited, never blocking: other episodes generate meanwhile. While it
//! waits on a step an episode gives back its sequence slot
//! (`worker.max_sequences` counts episodes generating), so a slow tool does
//! not idle the engine; the worker's held tasks stay bounded by
//! `worker.max_tasks_in_flight`.
//!
//! A failing environment (timeout, connection, malformed reply) fails the
//! completion: the task goes back to the coordinator. A limit or a tool
//! call the parser cannot read ends the episode with its finish reason and
//! the rewards it had: the model's doing is trained on, not retried.

use std::sync::Arc;
use std::time::Instant;

use asyncrl_environment::{
    EnvTask, Environment, Episode, EpisodeLimits, EpisodeOutput, Next, Reply, ReplyEnd,
};
use asyncrl_policy::{FinishReason as SeqFinish, SequenceRequest};
use asyncrl_protos::{ContractError, RewardStatus, Task, Timings, Trajectory};

use crate::metrics::reason;
use crate::state::{SeqGuard, Shared, bump};
use crate::task::{
    CompletionError, Stops, clamp_ms, cut_at_stop_string, prompt_of, publish, to_i32, trajectory_of,
};

/// The worker's environment and the limits of its episodes.
pub(crate) struct Episodes {
    pub env: Arc<dyn Environment>,
    pub limits: EpisodeLimits,
}

/// What the environment is sent at reset: the task as the coordinator
/// issued it.
pub(crate) fn env_task(task: &Task) -> Result<EnvTask, serde_json::Error> {
    EnvTask::from_prompt(&task.task_id, &task.dataset, &prompt_of(task), &task.answer)
}

fn failed(what: impl std::fmt::Display) -> CompletionError {
    CompletionError::Episode(what.to_string())
}

/// Runs one episode of `task` and publishes it.
pub(crate) async fn run_episode(
    shared: &Arc<Shared>,
    task: &Task,
    index: u32,
    group_size: u32,
    guard: SeqGuard,
    stops: &Stops,
) -> Result<(), CompletionError> {
    let Some(episodes) = shared.episodes.as_ref() else {
        return Err(failed("the worker has no environment"));
    };
    let env = episodes.env.clone();
    let started_ms = shared.clock.now_unix_ms();
    let started = Instant::now();
    let uuid = uuid::Uuid::new_v4().to_string();
    let mut guard = Some(guard);
    let result = drive(shared, episodes, task, &uuid, stops, &mut guard).await;
    drop(guard);
    // The environment's state for this episode is freed whatever happened.
    env.close(&uuid).await;
    let (out, env_time, swaps) = match result {
        Ok(done) => done,
        Err(e) => {
            let label = match &e {
                CompletionError::Aborted | CompletionError::Stopped => {
                    shared.metrics.sequences_cancelled.inc();
                    bump(&shared.counters.sequences_cancelled);
                    "cancelled"
                }
                CompletionError::Episode(_) => "environment_failed",
                _ => "failed",
            };
            shared
                .metrics
                .episodes_finished
                .get_or_create(&reason(label))
                .inc();
            return Err(e);
        }
    };
    shared
        .metrics
        .episodes_finished
        .get_or_create(&reason(out.finish.label()))
        .inc();
    shared.metrics.episode_turns.observe(out.turns.len() as f64);
    if let Some(note) = &out.note {
        tracing::info!(task_id = %task.task_id, trajectory = %uuid, finish = out.finish.label(), reason = %note, "episode ended before the environment ended it");
    }
    let elapsed = started.elapsed();
    let timings = Timings {
        started_at_unix_ms: started_ms,
        finished_at_unix_ms: shared.clock.now_unix_ms(),
        generation_ms: clamp_ms(elapsed.saturating_sub(env_time)),
        reward_ms: clamp_ms(env_time),
        weight_swaps: swaps,
    };
    let trajectory = episode_trajectory(
        uuid,
        task,
        index,
        group_size,
        &shared.settings.worker_id,
        &out,
        timings,
    )
    .map_err(CompletionError::Invalid)?;
    publish(
        shared,
        task,
        &trajectory,
        timings.generation_ms,
        timings.reward_ms,
        stops,
    )
    .await
}

/// Runs the episode to its end: its output, the time spent waiting on the
/// environment, and the weight swaps during its replies.
async fn drive(
    shared: &Arc<Shared>,
    episodes: &Episodes,
    task: &Task,
    episode_id: &str,
    stops: &Stops,
    slot: &mut Option<SeqGuard>,
) -> Result<(EpisodeOutput, std::time::Duration, u32), CompletionError> {
    let env = episodes.env.as_ref();
    let mut env_time = std::time::Duration::ZERO;
    let t0 = Instant::now();
    let reset_task =
        env_task(task).map_err(|e| failed(format!("cannot write the task as JSON: {e}")))?;
    let reset = tokio::select! {
        r = env.reset(episode_id, &reset_task) => r,
        _ = stops.abort.cancelled() => return Err(CompletionError::Aborted),
        _ = stops.generation.cancelled() => return Err(CompletionError::Stopped),
    }
    .map_err(|e| failed(format!("environment reset: {e}")))?;
    env_time += t0.elapsed();
    let mut episode = Episode::start(
        &shared.text,
        asyncrl_environment::prompt_messages(&prompt_of(task)),
        &reset,
        episodes.limits,
        shared.params.stop_token_ids.clone(),
    )
    .map_err(failed)?;
    let mut swaps = 0u32;
    let mut next = episode.next_action().map_err(failed)?;
    loop {
        next = match next {
            Next::Done => break,
            Next::Generate {
                prompt,
                max_new_tokens,
            } => {
                let mut params = shared.params.clone();
                params.max_new_tokens = max_new_tokens;
                let request = SequenceRequest { prompt, params };
                let out = tokio::select! {
                    biased;
                    r = shared.engine.generate(request) => r.map_err(CompletionError::Generation)?,
                    _ = stops.abort.cancelled() => return Err(CompletionError::Aborted),
                    _ = stops.generation.cancelled() => return Err(CompletionError::Stopped),
                };
                let out = cut_at_stop_string(shared, out);
                swaps += out.recomputations;
                let end = match out.finish_reason {
                    SeqFinish::Stop | SeqFinish::StopString => ReplyEnd::Stop,
                    SeqFinish::MaxNewTokens | SeqFinish::MaxSeqLen => ReplyEnd::Length,
                    SeqFinish::Cancelled => return Err(CompletionError::Stopped),
                };
                episode
                    .on_reply(Reply {
                        tokens: out.tokens,
                        logprobs: out.logprobs,
                        versions: out.versions,
                        end,
                    })
                    .map_err(failed)?
            }
            Next::Step { step, action } => {
                // The slot is free while the environment works.
                *slot = None;
                let t0 = Instant::now();
                let result = tokio::select! {
                    r = env.step(episode_id, step, &action) => r,
                    _ = stops.abort.cancelled() => return Err(CompletionError::Aborted),
                    _ = stops.generation.cancelled() => return Err(CompletionError::Stopped),
                }
                .map_err(|e| failed(format!("environment step {step}: {e}")))?;
                env_time += t0.elapsed();
                let next = episode.on_step(&result).map_err(failed)?;
                if matches!(next, Next::Generate { .. }) {
                    *slot = Some(SeqGuard::new(shared));
                }
                next
            }
        };
    }
    let out = episode
        .output()
        .ok_or_else(|| failed("the episode ended without an output"))?;
    Ok((out, env_time, swaps))
}

/// The trajectory of a finished episode, token-exact.
pub(crate) fn episode_trajectory(
    uuid: String,
    task: &Task,
    index: u32,
    group_size: u32,
    worker_id: &str,
    out: &EpisodeOutput,
    timings: Timings,
) -> Result<Trajectory, ContractError> {
    let t = Trajectory {
        prompt_token_ids: to_i32("prompt_token_ids", &out.prompt)?,
        completion_token_ids: to_i32("completion_token_ids", &out.completion)?,
        behaviour_logprobs: out.logprobs.clone(),
        policy_versions: out.versions.clone(),
        reward: out.reward,
        reward_status: RewardStatus::Ok as i32,
        finish_reason: out.finish as i32,
        turns: out.turns.clone(),
        ..trajectory_of(uuid, task, index, group_size, worker_id, timings)
    };
    t.validate()?;
    Ok(t)
}

/// The worker's environment from `[environment]` (`None` without it: every
/// task single-turn). The limits: `environment.max_turns`, the reply's
/// tokens (`environment.max_turn_tokens`, default `model.max_new_tokens`),
/// the episode's (`environment.max_episode_tokens`, at most the engine's
/// context).
pub(crate) fn from_config(
    config: &asyncrl_config::Config,
    params: &asyncrl_policy::SamplingParams,
    max_seq_len: usize,
    metrics: &asyncrl_telemetry::Metrics,
) -> anyhow::Result<Option<Episodes>> {
    use anyhow::Context as _;
    let Some(cfg) = &config.environment else {
        return Ok(None);
    };
    let env = asyncrl_environment::from_config(cfg, metrics)
        .with_context(|| format!("environment.url = {:?}", cfg.url))?;
    Ok(Some(Episodes {
        env,
        limits: EpisodeLimits {
            max_turns: cfg.max_turns,
            max_turn_tokens: cfg.turn_tokens(params.max_new_tokens),
            max_episode_tokens: cfg.episode_tokens(max_seq_len),
        },
    }))
}
