//! The Python example reward service (examples/reward_service/server.py),
//! run for real and called through the worker's reward client.

mod common;

use std::time::Duration;

use asyncrl_rollout_worker::reward::{RewardOutcome, RewardServiceConfig, ScoreInput, Scorer};
use common::RewardServer;

fn input(completion: &str, answer: &str) -> ScoreInput {
    ScoreInput {
        trajectory_uuid: "7c9e6679-7425-40de-944b-e07fc1f90ae7".into(),
        task_id: "t-1".into(),
        dataset: "custom".into(),
        verifier: "service".into(),
        prompt: "2+2=".into(),
        completion: completion.into(),
        completion_token_ids: vec![4, 5],
        answer: answer.into(),
    }
}

fn config(port: u16) -> RewardServiceConfig {
    RewardServiceConfig {
        endpoint: format!("http://127.0.0.1:{port}"),
        timeout: Duration::from_millis(1500),
        attempts: 2,
        backoff: Duration::from_millis(50),
        concurrency: 4,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_reward_service_scores_retries_and_fails_loudly() {
    let server = RewardServer::start();
    let scorer = Scorer::external(config(server.port)).unwrap();
    let Scorer::External(ext) = &scorer else {
        unreachable!()
    };
    let counters = ext.counters.clone();

    assert_eq!(scorer.score(&input(" 4 ", "4")).await.reward(), Some(1.0));
    assert_eq!(scorer.score(&input("5", "4")).await.reward(), Some(0.0));

    // Concurrent calls through the bounded client.
    let many: Vec<_> = (0..16)
        .map(|i| {
            let scorer = scorer.clone();
            tokio::spawn(async move { scorer.score(&input(&i.to_string(), "7")).await.reward() })
        })
        .collect();
    for (i, h) in many.into_iter().enumerate() {
        assert_eq!(h.await.unwrap(), Some(if i == 7 { 1.0 } else { 0.0 }));
    }

    // A service error is retried, then the completion is marked failed.
    let out = scorer.score(&input("x", "FAIL")).await;
    match &out {
        RewardOutcome::Failed {
            reason, attempts, ..
        } => {
            assert_eq!(*attempts, 2);
            assert!(reason.contains("asked to fail"), "{reason}");
        }
        other => panic!("expected a failure, got {other:?}"),
    }
    // A call that outlives the timeout fails too, within attempts × timeout.
    let out = scorer.score(&input("x", "SLOW")).await;
    assert!(matches!(out, RewardOutcome::Failed { .. }), "{out:?}");
    assert!(
        out.latency() < Duration::from_secs(10),
        "{:?}",
        out.latency()
    );
    let failures = counters.failures.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(failures, 2);
    assert!(counters.retries.load(std::sync::atomic::Ordering::Relaxed) >= 2);

    // With the service gone, scoring fails (never a silent 0).
    let port = server.port;
    drop(server);
    let scorer = Scorer::external(config(port)).unwrap();
    let out = scorer.score(&input("4", "4")).await;
    assert!(matches!(out, RewardOutcome::Failed { .. }), "{out:?}");
    assert_eq!(out.reward(), None);
}
