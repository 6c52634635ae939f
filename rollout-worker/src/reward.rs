//! Rewards: the built-in verifiers of the built-in tasks, or an external
//! gRPC `RewardService` (anything that speaks `protos/reward.proto`).
//!
//! An external call has a timeout and runs under a concurrency bound; a
//! failed or timed-out call is retried with backoff, and after the last
//! attempt the completion is marked reward-failed: counted, logged, and
//! never silently scored 0.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use asyncrl_protos::v1::reward_service_client::RewardServiceClient;
use asyncrl_protos::v1::{ScoreReply, ScoreRequest};
use asyncrl_tasks::Verdict;
use tokio::sync::Semaphore;
use tonic::transport::{Channel, Endpoint};

/// What the scorer needs to know about one completion.
#[derive(Debug, Clone)]
pub struct ScoreInput {
    pub trajectory_uuid: String,
    pub task_id: String,
    pub dataset: String,
    /// The built-in verifier's name, or `service`.
    pub verifier: String,
    /// The prompt's text (message prompts: rendered with the chat template).
    pub prompt: String,
    pub completion: String,
    pub completion_token_ids: Vec<i32>,
    pub answer: String,
}

/// The reward of one completion, or why there is none.
#[derive(Debug, Clone, PartialEq)]
pub enum RewardOutcome {
    Scored {
        reward: f32,
        latency: Duration,
    },
    Failed {
        reason: String,
        attempts: u32,
        latency: Duration,
    },
}

impl RewardOutcome {
    pub fn reward(&self) -> Option<f32> {
        match self {
            RewardOutcome::Scored { reward, .. } => Some(*reward),
            RewardOutcome::Failed { .. } => None,
        }
    }

    pub fn latency(&self) -> Duration {
        match self {
            RewardOutcome::Scored { latency, .. } | RewardOutcome::Failed { latency, .. } => {
                *latency
            }
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RewardError {
    #[error("invalid reward service endpoint {endpoint:?}: {reason}")]
    Endpoint { endpoint: String, reason: String },
}

/// Settings of the external reward client.
#[derive(Debug, Clone, PartialEq)]
pub struct RewardServiceConfig {
    /// `http://host:port` of the RewardService.
    pub endpoint: String,
    /// Per-call timeout.
    pub timeout: Duration,
    /// Attempts per completion (1 = no retry).
    pub attempts: u32,
    /// Delay before the first retry; doubles each retry.
    pub backoff: Duration,
    /// Calls in flight at once, per worker.
    pub concurrency: usize,
}

impl Default for RewardServiceConfig {
    fn default() -> Self {
        Self {
            endpoint: "http://127.0.0.1:50061".into(),
            timeout: Duration::from_secs(5),
            attempts: 3,
            backoff: Duration::from_millis(100),
            concurrency: 16,
        }
    }
}

/// Counters the worker exports as metrics.
#[derive(Debug, Default)]
pub struct RewardCounters {
    pub calls: AtomicU64,
    pub retries: AtomicU64,
    pub failures: AtomicU64,
}

/// Scores completions with a built-in verifier or an external service.
#[derive(Clone)]
pub enum Scorer {
    Builtin,
    External(Box<ExternalScorer>),
}

#[derive(Clone)]
pub struct ExternalScorer {
    client: RewardServiceClient<Channel>,
    config: RewardServiceConfig,
    permits: Arc<Semaphore>,
    pub counters: Arc<RewardCounters>,
}

impl Scorer {
    /// An external scorer. The connection is made lazily, so a reward service
    /// that starts after the worker is fine.
    pub fn external(config: RewardServiceConfig) -> Result<Self, RewardError> {
        let bad = |reason: String| RewardError::Endpoint {
            endpoint: config.endpoint.clone(),
            reason,
        };
        let endpoint =
            Endpoint::from_shared(config.endpoint.clone()).map_err(|e| bad(e.to_string()))?;
        let channel = endpoint
            .timeout(config.timeout)
            .connect_timeout(config.timeout)
            .connect_lazy();
        Ok(Scorer::External(Box::new(ExternalScorer {
            client: RewardServiceClient::new(channel),
            permits: Arc::new(Semaphore::new(config.concurrency.max(1))),
            config,
            counters: Arc::new(RewardCounters::default()),
        })))
    }

    /// A task whose verifier is built in (`arith`, `reverse`, `math`) is
    /// scored here; any other (`service`) by the reward service, or marked
    /// failed when there is none.
    pub async fn score(&self, input: &ScoreInput) -> RewardOutcome {
        let start = Instant::now();
        match asyncrl_tasks::score(&input.verifier, &input.completion, &input.answer) {
            Verdict::Reward(reward) => RewardOutcome::Scored {
                reward,
                latency: start.elapsed(),
            },
            Verdict::NoVerifier => match self {
                Scorer::External(ext) => ext.score(input, start).await,
                Scorer::Builtin => RewardOutcome::Failed {
                    reason: format!(
                        "data set {:?} has verifier {:?}, which is no built-in one; configure a reward service (worker.reward.endpoint)",
                        input.dataset, input.verifier
                    ),
                    attempts: 0,
                    latency: start.elapsed(),
                },
            },
        }
    }
}

impl ExternalScorer {
    async fn score(&self, input: &ScoreInput, start: Instant) -> RewardOutcome {
        let request = ScoreRequest {
            trajectory_uuid: input.trajectory_uuid.clone(),
            task_id: input.task_id.clone(),
            dataset: input.dataset.clone(),
            prompt: input.prompt.clone(),
            completion: input.completion.clone(),
            completion_token_ids: input.completion_token_ids.clone(),
            answer: input.answer.clone(),
        };
        let attempts = self.config.attempts.max(1);
        let first = self.config.backoff;
        let mut backoff = asyncrl_common::Backoff::new(first, first.saturating_mul(1 << 16));
        let mut last_error = String::new();
        for attempt in 1..=attempts {
            if attempt > 1 {
                self.counters.retries.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(backoff.next_delay()).await;
            }
            self.counters.calls.fetch_add(1, Ordering::Relaxed);
            match self.call(request.clone()).await {
                Ok(reply) if reply.reward.is_finite() => {
                    return RewardOutcome::Scored {
                        reward: reply.reward,
                        latency: start.elapsed(),
                    };
                }
                Ok(reply) => {
                    last_error = format!("service returned a non-finite reward {}", reply.reward)
                }
                Err(e) => last_error = e,
            }
            tracing::warn!(
                trajectory = %input.trajectory_uuid,
                attempt,
                attempts,
                error = %last_error,
                "reward service call failed"
            );
        }
        self.counters.failures.fetch_add(1, Ordering::Relaxed);
        RewardOutcome::Failed {
            reason: last_error,
            attempts,
            latency: start.elapsed(),
        }
    }

    async fn call(&self, request: ScoreRequest) -> Result<ScoreReply, String> {
        let _permit = self.permits.acquire().await.map_err(|e| e.to_string())?;
        let mut client = self.client.clone();
        match tokio::time::timeout(self.config.timeout, client.score(request)).await {
            Ok(Ok(reply)) => Ok(reply.into_inner()),
            Ok(Err(status)) => Err(format!("{}: {}", status.code(), status.message())),
            Err(_) => Err(format!("timed out after {:?}", self.config.timeout)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(dataset: &str, completion: &str, answer: &str) -> ScoreInput {
        ScoreInput {
            trajectory_uuid: "u".into(),
            task_id: "t".into(),
            dataset: dataset.into(),
            verifier: dataset.into(),
            prompt: "p".into(),
            completion: completion.into(),
            completion_token_ids: vec![],
            answer: answer.into(),
        }
    }

    #[tokio::test]
    async fn builtin_scores_and_refuses_unknown_data_sets() {
        let s = Scorer::Builtin;
        assert_eq!(
            s.score(&input("arith", "95", "95")).await.reward(),
            Some(1.0)
        );
        assert_eq!(
            s.score(&input("arith", "9", "95")).await.reward(),
            Some(0.0)
        );
        let out = s.score(&input("poetry", "x", "y")).await;
        assert!(matches!(out, RewardOutcome::Failed { .. }), "{out:?}");
    }

    #[test]
    fn bad_endpoint_is_named() {
        let config = RewardServiceConfig {
            endpoint: "not a url".into(),
            ..Default::default()
        };
        let err = Scorer::external(config).err().unwrap().to_string();
        assert!(err.contains("not a url"), "{err}");
    }
}
