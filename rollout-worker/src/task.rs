//! One task (one lease): generate its G completions concurrently through
//! the continuous batch, score each, publish one trajectory per completion
//! as soon as it is scored, and report the task complete once every publish
//! was acknowledged.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use asyncrl_policy::{FinishReason as SeqFinish, SequenceOutput, SequenceRequest};
use asyncrl_protos::subjects::{TASKS_COMPLETE, trajectory_subject, worker_subject};
use asyncrl_protos::v1::{CompleteTask, CompleteTaskReply};
use asyncrl_protos::{
    ContractError, FinishReason, Message, RewardStatus, Task, Timings, Trajectory,
};
use asyncrl_text::Prompt;
use asyncrl_transport::TransportError;
use bytes::Bytes;
use futures::StreamExt;
use futures::future::Either;
use futures::stream::FuturesUnordered;
use tokio_util::sync::CancellationToken;

use crate::client::{Backoff, call};
use crate::engine::EngineError;
use crate::metrics::reason;
use crate::reward::{RewardOutcome, ScoreInput};
use crate::state::{SeqGuard, Shared, bump};

/// How a task ended.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum TaskEnd {
    /// Every trajectory acked and CompleteTask accepted.
    Completed,
    /// Every trajectory acked, but the coordinator refused the completion
    /// (the lease had expired) or could not be told.
    NotAccepted(String),
    /// The coordinator revoked the lease; nothing more was published.
    Revoked,
    /// Not every completion was published (drain deadline, a failure): the
    /// task goes back to the coordinator.
    Unfinished(String),
    /// The task itself cannot be done (its prompt cannot be rendered,
    /// encoded or fit in the context, a trajectory of it breaks the
    /// contract): it goes back to the coordinator as failed, which counts
    /// toward its quarantine (`coordinator.max_task_attempts`). Environment
    /// failures are not counted: an outage must not quarantine the data
    /// set.
    Failed(String),
}

/// Tokens that stop a task's work.
#[derive(Clone)]
pub(crate) struct Stops {
    /// The lease's token: revocation, or a failed sibling completion.
    pub abort: CancellationToken,
    /// Drain deadline: unfinished generation is cancelled (finished
    /// completions still publish).
    pub generation: CancellationToken,
    /// After the drain deadline plus a margin: publishing gives up too.
    pub hard: CancellationToken,
}

/// Why one completion was not published.
#[derive(Debug)]
pub(crate) enum CompletionError {
    /// Revoked, or a sibling failed.
    Aborted,
    /// The drain deadline passed.
    Stopped,
    Generation(EngineError),
    Publish(TransportError),
    Invalid(ContractError),
    /// The environment failed, or the episode could not be continued (a
    /// template that rewrites earlier turns): not the model's doing.
    Episode(String),
}

impl CompletionError {
    fn describe(&self) -> String {
        match self {
            CompletionError::Aborted => "aborted".into(),
            CompletionError::Stopped => "drain deadline passed before it finished".into(),
            CompletionError::Generation(e) => format!("generation failed: {e}"),
            CompletionError::Publish(e) => format!("publish failed: {e}"),
            CompletionError::Invalid(e) => format!("invalid trajectory: {e}"),
            CompletionError::Episode(why) => format!("episode failed: {why}"),
        }
    }
}

/// Runs one task to its end. `guards` hold the task's G sequences in the
/// worker's capacity count until each stops generating.
pub(crate) async fn run_task(
    shared: Arc<Shared>,
    task: Task,
    granted_at: Instant,
    mut guards: Vec<SeqGuard>,
    stops: Stops,
) -> TaskEnd {
    let lease_id = task.lease_id.clone();
    let end = run_task_inner(&shared, &task, granted_at, &mut guards, &stops).await;
    drop(guards);
    let revoked = {
        let mut leases = shared.leases();
        let entry = leases.remove(&lease_id);
        entry.is_some_and(|e| e.revoked.load(Ordering::SeqCst))
    };
    shared.slot_freed.notify_one();
    // A revocation that arrives after the completion was accepted (or
    // refused) does not change what happened.
    let end = match end {
        TaskEnd::Unfinished(_) | TaskEnd::Failed(_) if revoked => TaskEnd::Revoked,
        end => end,
    };
    match &end {
        TaskEnd::Completed => {
            shared.metrics.tasks_completed.inc();
            bump(&shared.counters.tasks_completed);
            shared
                .metrics
                .task_latency_seconds
                .observe(granted_at.elapsed().as_secs_f64());
            tracing::debug!(task_id = %task.task_id, lease_id = %lease_id, seconds = granted_at.elapsed().as_secs_f64(), "task complete");
        }
        TaskEnd::NotAccepted(why) => {
            tracing::warn!(task_id = %task.task_id, lease_id = %lease_id, reason = %why, "task published but its completion was not accepted");
        }
        TaskEnd::Revoked => {
            tracing::info!(task_id = %task.task_id, lease_id = %lease_id, "task revoked");
        }
        TaskEnd::Unfinished(why) => {
            tracing::info!(task_id = %task.task_id, lease_id = %lease_id, reason = %why, "task unfinished");
        }
        TaskEnd::Failed(why) => {
            tracing::warn!(task_id = %task.task_id, lease_id = %lease_id, reason = %why, "task failed; returned as failed");
        }
    }
    end
}

async fn run_task_inner(
    shared: &Arc<Shared>,
    task: &Task,
    granted_at: Instant,
    guards: &mut Vec<SeqGuard>,
    stops: &Stops,
) -> TaskEnd {
    let g = guards.len();
    // Tokens sampled for a task carry at least its admission version.
    let limit = shared.settings.weight_fetch_timeout;
    let ready = tokio::select! {
        () = shared.weights_at_least(task.admission_version, limit) => true,
        _ = stops.abort.cancelled() => false,
        _ = stops.generation.cancelled() => false,
    };
    if !ready {
        return TaskEnd::Unfinished(
            "stopped while waiting for the weights of its admission version".into(),
        );
    }
    // Rendered once per task (single-turn): the token ids to generate from,
    // and the text a reward service is sent. An episode renders its own.
    let single_turn = match &shared.episodes {
        Some(_) => None,
        None => match single_turn_request(shared, task) {
            Ok(both) => Some(both),
            Err(why) => return TaskEnd::Failed(why),
        },
    };
    let mut completions: FuturesUnordered<_> = guards
        .drain(..)
        .enumerate()
        .map(|(index, guard)| match &single_turn {
            None => Either::Left(crate::episode::run_episode(
                shared,
                task,
                index as u32,
                g as u32,
                guard,
                stops,
            )),
            Some((request, prompt_text)) => Either::Right(run_completion(
                shared,
                task,
                index as u32,
                g as u32,
                request.clone(),
                prompt_text,
                guard,
                stops,
            )),
        })
        .collect();
    let mut published = 0usize;
    let mut first_error: Option<String> = None;
    let mut invalid = false;
    while let Some(result) = completions.next().await {
        match result {
            Ok(()) => published += 1,
            Err(e) => {
                if !matches!(e, CompletionError::Aborted | CompletionError::Stopped) {
                    tracing::warn!(task_id = %task.task_id, lease_id = %task.lease_id, error = %e.describe(), "completion failed; abandoning the task");
                    if let CompletionError::Generation(EngineError::Gone) = &e {
                        shared.set_fatal("the model thread stopped".into());
                    }
                    // The task cannot be completed without it: stop the rest.
                    stops.abort.cancel();
                }
                if first_error.is_none()
                    || matches!(
                        e,
                        CompletionError::Generation(_)
                            | CompletionError::Publish(_)
                            | CompletionError::Invalid(_)
                            | CompletionError::Episode(_)
                    )
                {
                    first_error = Some(e.describe());
                }
                invalid |= matches!(e, CompletionError::Invalid(_));
            }
        }
    }
    if published < g {
        let why = format!(
            "{published} of {g} completions published; {}",
            first_error.unwrap_or_default()
        );
        return if invalid {
            TaskEnd::Failed(why)
        } else {
            TaskEnd::Unfinished(why)
        };
    }
    if stops.abort.is_cancelled() {
        return TaskEnd::Unfinished("aborted".into());
    }
    complete(shared, task, g as u32, granted_at, stops).await
}

/// A single-turn task's request (rendered once per task: the token ids to
/// generate from) and the prompt's text (what a reward service is sent).
fn single_turn_request(shared: &Shared, task: &Task) -> Result<(SequenceRequest, String), String> {
    let task_prompt = prompt_of(task);
    let (prompt_text, prompt) = match shared
        .text
        .render(&task_prompt)
        .and_then(|text| Ok((text, shared.text.encode(&task_prompt)?)))
    {
        Ok(both) => both,
        Err(e) => {
            return Err(format!("cannot encode the prompt: {e}"));
        }
    };
    let max_seq_len = shared.engine.max_seq_len();
    if prompt.len() >= max_seq_len {
        return Err(format!(
            "the prompt has {} tokens; model.max_seq_len = {max_seq_len} leaves no room for a completion",
            prompt.len()
        ));
    }
    let mut params = shared.params.clone();
    if shared.lengths == crate::state::CompletionLengths::ReferenceAnswer {
        let n = shared
            .text
            .tokenizer()
            .encode(&task.answer, false)
            .map_or(0, |ids| ids.len());
        params.max_new_tokens = n + 1;
        params.stop_token_ids.clear();
    }
    Ok((SequenceRequest { prompt, params }, prompt_text))
}

/// Reports the task complete (retrying transient errors, bounded by the
/// hard stop and a handful of attempts).
async fn complete(
    shared: &Arc<Shared>,
    task: &Task,
    num_trajectories: u32,
    _granted_at: Instant,
    stops: &Stops,
) -> TaskEnd {
    let req = CompleteTask {
        worker_id: shared.settings.worker_id.clone(),
        task_id: task.task_id.clone(),
        lease_id: task.lease_id.clone(),
        num_trajectories,
    };
    let (min, max) = shared.settings.acquire_backoff;
    let mut backoff = Backoff::new(min, max);
    let timeout = shared.settings.request_timeout;
    let mut last = String::new();
    for attempt in 1..=8u32 {
        if stops.abort.is_cancelled() {
            return TaskEnd::Revoked;
        }
        let r = call::<CompleteTaskReply>(
            shared.bus.as_ref(),
            &worker_subject(TASKS_COMPLETE, &shared.settings.worker_id),
            &req,
            timeout,
        )
        .await;
        match r {
            Ok(reply) if reply.accepted => return TaskEnd::Completed,
            Ok(reply) => {
                shared.metrics.completions_refused.inc();
                bump(&shared.counters.completions_refused);
                return TaskEnd::NotAccepted(format!("refused: {}", reply.reason));
            }
            Err(e) => {
                shared
                    .metrics
                    .coordinator_errors
                    .get_or_create(&reason("complete"))
                    .inc();
                tracing::warn!(task_id = %task.task_id, lease_id = %task.lease_id, attempt, error = %e, "CompleteTask failed; retrying");
                last = e.to_string();
            }
        }
        tokio::select! {
            _ = stops.hard.cancelled() => break,
            _ = stops.abort.cancelled() => return TaskEnd::Revoked,
            _ = tokio::time::sleep(backoff.next_delay()) => {}
        }
    }
    bump(&shared.counters.completions_failed);
    TaskEnd::NotAccepted(format!("the coordinator could not be told: {last}"))
}

/// The prompt of a task: its text, or its chat messages.
pub(crate) fn prompt_of(task: &Task) -> Prompt {
    if task.messages.is_empty() {
        Prompt::Text(task.prompt.clone())
    } else {
        Prompt::Messages(
            task.messages
                .iter()
                .map(|m| asyncrl_text::Message::new(m.role.clone(), m.content.clone()))
                .collect(),
        )
    }
}

/// The verifier of a task (by its data set's name for a coordinator that
/// does not name one).
pub(crate) fn verifier_of(task: &Task) -> &str {
    if task.verifier.is_empty() {
        &task.dataset
    } else {
        &task.verifier
    }
}

/// Ends a completion at its first stop string: the tokens up to the one
/// that completed it stay exactly as sampled (with their log-probs and
/// versions); the rest are dropped. Generation itself ran on to a stop
/// token or the length limit.
pub(crate) fn cut_at_stop_string(shared: &Shared, mut out: SequenceOutput) -> SequenceOutput {
    if shared.stop_strings.is_empty() {
        return out;
    }
    match shared
        .text
        .stop_string_end(&out.tokens, &shared.stop_strings)
    {
        Ok(Some(n)) => {
            out.tokens.truncate(n);
            out.logprobs.truncate(n);
            out.versions.truncate(n);
            out.finish_reason = SeqFinish::StopString;
        }
        Ok(None) => {}
        Err(e) => {
            tracing::warn!(error = %e, "cannot decode a completion to look for stop strings");
        }
    }
    out
}

fn finish_reason(r: SeqFinish) -> FinishReason {
    match r {
        SeqFinish::Stop => FinishReason::Stop,
        SeqFinish::MaxNewTokens | SeqFinish::MaxSeqLen => FinishReason::Length,
        SeqFinish::Cancelled => FinishReason::Aborted,
        SeqFinish::StopString => FinishReason::StopString,
    }
}

/// Token ids as the contract holds them (`int32`); an id beyond it is an
/// error naming `field`.
pub(crate) fn to_i32(field: &'static str, ids: &[i64]) -> Result<Vec<i32>, ContractError> {
    ids.iter()
        .map(|&t| {
            i32::try_from(t).map_err(|_| ContractError::Field {
                field,
                reason: format!("token id {t} does not fit in int32"),
            })
        })
        .collect()
}

/// The trajectory of one finished completion, token-exact.
#[allow(clippy::too_many_arguments)]
pub(crate) fn build_trajectory(
    uuid: String,
    task: &Task,
    index: u32,
    group_size: u32,
    worker_id: &str,
    out: &SequenceOutput,
    reward: &RewardOutcome,
    timings: Timings,
) -> Result<Trajectory, ContractError> {
    let (reward_value, status) = match reward {
        RewardOutcome::Scored { reward, .. } => (*reward, RewardStatus::Ok),
        RewardOutcome::Failed { .. } => (f32::NAN, RewardStatus::Failed),
    };
    let t = Trajectory {
        prompt_token_ids: to_i32("prompt_token_ids", &out.prompt)?,
        completion_token_ids: to_i32("completion_token_ids", &out.tokens)?,
        behaviour_logprobs: out.logprobs.clone(),
        policy_versions: out.versions.clone(),
        reward: reward_value,
        reward_status: status as i32,
        finish_reason: finish_reason(out.finish_reason) as i32,
        ..trajectory_of(uuid, task, index, group_size, worker_id, timings)
    };
    t.validate()?;
    Ok(t)
}

/// A trajectory's identity and bookkeeping (its tokens, reward and finish
/// reason left empty): what every trajectory of `task` shares.
pub(crate) fn trajectory_of(
    uuid: String,
    task: &Task,
    index: u32,
    group_size: u32,
    worker_id: &str,
    timings: Timings,
) -> Trajectory {
    Trajectory {
        uuid,
        task_id: task.task_id.clone(),
        group_id: task.lease_id.clone(),
        worker_id: worker_id.to_owned(),
        timings: Some(timings),
        group_size,
        index_in_group: index,
        admission_version: task.admission_version,
        ..Trajectory::default()
    }
}

pub(crate) fn clamp_ms(d: Duration) -> u32 {
    u32::try_from(d.as_millis()).unwrap_or(u32::MAX)
}

#[allow(clippy::too_many_arguments)]
async fn run_completion(
    shared: &Arc<Shared>,
    task: &Task,
    index: u32,
    group_size: u32,
    request: SequenceRequest,
    prompt_text: &str,
    guard: SeqGuard,
    stops: &Stops,
) -> Result<(), CompletionError> {
    let started_ms = shared.clock.now_unix_ms();
    let started = Instant::now();
    // Generation. A finished sequence wins over a stop that arrives at the
    // same moment (it is published, not thrown away).
    let generated = tokio::select! {
        biased;
        r = shared.engine.generate(request) => r.map_err(CompletionError::Generation),
        _ = stops.abort.cancelled() => Err(CompletionError::Aborted),
        _ = stops.generation.cancelled() => Err(CompletionError::Stopped),
    };
    drop(guard);
    let out = match generated {
        Ok(out) => out,
        Err(e) => {
            if matches!(e, CompletionError::Aborted | CompletionError::Stopped) {
                shared.metrics.sequences_cancelled.inc();
                bump(&shared.counters.sequences_cancelled);
            }
            return Err(e);
        }
    };
    let generation_ms = clamp_ms(started.elapsed());
    let finished_ms = shared.clock.now_unix_ms();
    let out = cut_at_stop_string(shared, out);

    // Score.
    let decoded = shared
        .text
        .decode_completion(&out.tokens, &shared.params.stop_token_ids)
        .map(|text| asyncrl_text::text_before_stop_string(text, &shared.stop_strings));
    let uuid = uuid::Uuid::new_v4().to_string();
    let reward = match decoded {
        Ok(completion) => {
            let input = ScoreInput {
                trajectory_uuid: uuid.clone(),
                task_id: task.task_id.clone(),
                dataset: task.dataset.clone(),
                verifier: verifier_of(task).to_owned(),
                prompt: prompt_text.to_owned(),
                completion,
                completion_token_ids: out.tokens.iter().map(|&t| t as i32).collect(),
                answer: task.answer.clone(),
            };
            tokio::select! {
                r = shared.scorer.score(&input) => r,
                _ = stops.abort.cancelled() => return Err(CompletionError::Aborted),
                _ = stops.hard.cancelled() => return Err(CompletionError::Stopped),
            }
        }
        Err(e) => RewardOutcome::Failed {
            reason: format!("cannot decode the completion: {e}"),
            attempts: 0,
            latency: Duration::ZERO,
        },
    };
    shared
        .metrics
        .reward_latency_seconds
        .observe(reward.latency().as_secs_f64());
    if let RewardOutcome::Failed { reason: why, .. } = &reward {
        shared.metrics.reward_failures.inc();
        bump(&shared.counters.reward_failures);
        tracing::warn!(task_id = %task.task_id, trajectory = %uuid, reason = %why, "reward failed; the trajectory is marked REWARD_STATUS_FAILED");
    }
    let reward_ms = clamp_ms(reward.latency());
    let timings = Timings {
        started_at_unix_ms: started_ms,
        finished_at_unix_ms: finished_ms,
        generation_ms,
        reward_ms,
        weight_swaps: out.recomputations,
    };
    let trajectory = build_trajectory(
        uuid,
        task,
        index,
        group_size,
        &shared.settings.worker_id,
        &out,
        &reward,
        timings,
    )
    .map_err(CompletionError::Invalid)?;

    publish(shared, task, &trajectory, generation_ms, reward_ms, stops).await
}

/// Publishes one trajectory, retrying transient errors (dedupe by uuid
/// makes retries safe), and counts it.
pub(crate) async fn publish(
    shared: &Arc<Shared>,
    task: &Task,
    trajectory: &Trajectory,
    generation_ms: u32,
    reward_ms: u32,
    stops: &Stops,
) -> Result<(), CompletionError> {
    // Publish, retrying transient errors (dedupe by uuid makes retries safe).
    let subject = trajectory_subject(&task.task_id);
    let payload = Bytes::from(trajectory.encode_to_vec());
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
    loop {
        let r = tokio::select! {
            r = shared.bus.publish_durable(&subject, &trajectory.uuid, payload.clone()) => r,
            _ = stops.abort.cancelled() => return Err(CompletionError::Aborted),
            _ = stops.hard.cancelled() => return Err(CompletionError::Stopped),
        };
        match r {
            Ok(ack) => {
                tracing::debug!(
                    trajectory = %trajectory.uuid,
                    sequence = ack.sequence,
                    duplicate = ack.duplicate,
                    generation_ms,
                    reward_ms,
                    "trajectory published"
                );
                break;
            }
            Err(e) if retryable(&e) => {
                shared.metrics.publish_retries.inc();
                tracing::warn!(task_id = %task.task_id, trajectory = %trajectory.uuid, error = %e, "publish failed; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(backoff.next_delay()) => {}
                    _ = stops.abort.cancelled() => return Err(CompletionError::Aborted),
                    _ = stops.hard.cancelled() => return Err(CompletionError::Stopped),
                }
            }
            Err(e) => return Err(CompletionError::Publish(e)),
        }
    }
    shared.metrics.trajectories_published.inc();
    shared
        .metrics
        .completions_finished
        .get_or_create(&reason(
            FinishReason::try_from(trajectory.finish_reason).map_or("other", FinishReason::label),
        ))
        .inc();
    bump(&shared.counters.trajectories_published);
    let announced = shared.announced_version.load(Ordering::Relaxed);
    let lag = (announced - trajectory.oldest_version()).max(0);
    shared.metrics.version_lag.observe(f64::from(lag));
    Ok(())
}

/// Publish errors worth retrying: transient ones, and a stream that does not
/// exist yet (the buffer creates it).
fn retryable(e: &TransportError) -> bool {
    e.is_transient()
        || matches!(
            e,
            TransportError::NoStream { .. } | TransportError::NoStreamForSubject { .. }
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task() -> Task {
        Task {
            task_id: "arith-000001".into(),
            lease_id: "lease-9".into(),
            prompt: "1+1=".into(),
            answer: "2".into(),
            dataset: "arith".into(),
            verifier: String::new(),
            messages: Vec::new(),
            group_size: 4,
            lease_deadline_unix_ms: 0,
            admission_version: 3,
            epoch: 0,
        }
    }

    #[test]
    fn prompts_verifiers_and_stop_string_text() {
        let mut t = task();
        assert_eq!(prompt_of(&t), Prompt::Text("1+1=".into()));
        assert_eq!(verifier_of(&t), "arith", "an older coordinator names none");
        t.verifier = "math".into();
        assert_eq!(verifier_of(&t), "math");
        t.prompt.clear();
        t.messages = vec![asyncrl_protos::v1::ChatMessage {
            role: "user".into(),
            content: "1+1=".into(),
        }];
        assert_eq!(
            prompt_of(&t),
            Prompt::Messages(vec![asyncrl_text::Message::new("user", "1+1=")])
        );
    }

    fn output(reason: SeqFinish) -> SequenceOutput {
        SequenceOutput {
            id: 0,
            prompt: vec![1, 5, 6],
            tokens: vec![7, 2],
            logprobs: vec![-0.5, -0.25],
            versions: vec![3, 4],
            finish_reason: reason,
            recomputations: 1,
        }
    }

    #[test]
    fn trajectories_carry_exactly_what_was_sampled() {
        let uuid = uuid::Uuid::new_v4().to_string();
        let reward = RewardOutcome::Scored {
            reward: 1.0,
            latency: Duration::ZERO,
        };
        let t = build_trajectory(
            uuid.clone(),
            &task(),
            2,
            4,
            "w",
            &output(SeqFinish::Stop),
            &reward,
            Timings::default(),
        )
        .unwrap();
        assert_eq!(t.uuid, uuid);
        assert_eq!(t.group_id, "lease-9");
        assert_eq!(t.prompt_token_ids, vec![1, 5, 6]);
        assert_eq!(t.completion_token_ids, vec![7, 2]);
        assert_eq!(t.behaviour_logprobs, vec![-0.5, -0.25]);
        assert_eq!(t.policy_versions, vec![3, 4]);
        assert_eq!(t.admission_version, 3);
        assert_eq!((t.index_in_group, t.group_size), (2, 4));
        assert_eq!(t.finish_reason, FinishReason::Stop as i32);
        assert_eq!(t.reward_status, RewardStatus::Ok as i32);

        let failed = RewardOutcome::Failed {
            reason: "x".into(),
            attempts: 3,
            latency: Duration::ZERO,
        };
        let t = build_trajectory(
            uuid::Uuid::new_v4().to_string(),
            &task(),
            0,
            4,
            "w",
            &output(SeqFinish::MaxSeqLen),
            &failed,
            Timings::default(),
        )
        .unwrap();
        assert_eq!(t.reward_status, RewardStatus::Failed as i32);
        assert!(t.reward.is_nan(), "a failed reward is never a silent 0");
        assert_eq!(t.finish_reason, FinishReason::Length as i32);
    }

    #[test]
    fn broken_outputs_are_refused_before_publishing() {
        let mut out = output(SeqFinish::Stop);
        out.versions = vec![4, 3];
        let reward = RewardOutcome::Scored {
            reward: 0.0,
            latency: Duration::ZERO,
        };
        let err = build_trajectory(
            uuid::Uuid::new_v4().to_string(),
            &task(),
            0,
            4,
            "w",
            &out,
            &reward,
            Timings::default(),
        )
        .unwrap_err();
        assert!(
            matches!(
                err,
                ContractError::Field {
                    field: "policy_versions",
                    ..
                }
            ),
            "{err}"
        );
        let mut out = output(SeqFinish::Stop);
        out.tokens[0] = i64::from(i32::MAX) + 1;
        assert!(
            build_trajectory(
                uuid::Uuid::new_v4().to_string(),
                &task(),
                0,
                4,
                "w",
                &out,
                &reward,
                Timings::default(),
            )
            .is_err()
        );
    }
}
