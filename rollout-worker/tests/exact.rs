//! A worker against a real nats-server, a scripted coordinator and a
//! scripted weight publisher: every trajectory is token-exact (ids,
//! log-probs recomputed under the published weights, versions), the group
//! bookkeeping is right, and each task is reported complete only after its
//! G trajectories were stored by the stream.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use asyncrl_policy::from_config::decode_completion;
use asyncrl_protos::subjects::trajectory_subject;
use asyncrl_protos::{FinishReason, RewardStatus};
use asyncrl_rollout_worker::scripted::{ScriptOptions, ScriptedTask, read_trajectories};
use asyncrl_rollout_worker::{CancellationToken, WorkerMetrics, run};
use asyncrl_tasks::{BuiltinTask, Verdict};
use asyncrl_telemetry::Metrics;
use common::*;

const G: u32 = 4;
const TASKS: usize = 6;
const VERSION: i32 = 5;
const ADMISSION: i32 = 4;
const MAX_NEW: usize = 24;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trajectories_are_token_exact_and_complete_after_their_publishes() {
    let tasks = ScriptedTask::generated(BuiltinTask::Arith, TASKS, 1);
    let rig = Rig::nats(
        model_section(MAX_NEW, 64),
        8,
        tasks.clone(),
        ScriptOptions {
            group_size: G,
            admission_version: ADMISSION,
            max_per_acquire: 2,
            heartbeat_interval_ms: 10,
            ..ScriptOptions::default()
        },
    )
    .await;
    let Rig {
        bus,
        section,
        config,
        coordinator,
        ..
    } = &rig;
    let metrics = Metrics::new();
    let shutdown = CancellationToken::new();
    let worker = tokio::spawn(run(
        config.clone(),
        bus.clone(),
        metrics.clone(),
        shutdown.clone(),
    ));

    // No weights announced yet: the worker neither registers nor generates.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let log = coordinator.log();
    assert!(
        log.registrations.is_empty() && log.acquires.is_empty(),
        "the worker must wait for the first weights: {log:?}"
    );

    // The learner's weights of version 5 (not the worker's own initial ones).
    let published = rig.policy(1234);
    rig.publish(VERSION, &published).await;

    let (done, log) = coordinator
        .wait_for(Duration::from_secs(120), |l| {
            l.completed_leases().len() == TASKS
        })
        .await;
    assert!(done, "not every task completed: {log:#?}");
    shutdown.cancel();
    let summary = worker.await.unwrap().unwrap();

    let received = read_trajectories(
        bus.as_ref(),
        "exact",
        TASKS * G as usize,
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    assert_eq!(received.len(), TASKS * G as usize);

    let registration = &log.registrations[0];
    assert_eq!(registration.worker_id, "worker-test");
    assert_eq!(
        registration.policy_version, VERSION,
        "registers with the loaded version"
    );
    assert_eq!(registration.capacity, 8);

    let tasks_by_id: HashMap<_, _> = tasks.iter().map(|t| (t.task_id.clone(), t)).collect();
    let lease_task: HashMap<_, _> = log
        .granted
        .iter()
        .map(|(_, t)| (t.lease_id.clone(), t.task_id.clone()))
        .collect();
    let initial = asyncrl_policy::from_config::load_policy(section, config.run.seed).unwrap();
    let eos = published.eos_token_ids();
    let mut uuids = BTreeSet::new();
    let mut differs_from_initial = false;
    for r in &received {
        let t = &r.trajectory;
        // Identity and bookkeeping.
        assert_eq!(r.msg_id.as_deref(), Some(t.uuid.as_str()), "msg id = uuid");
        let uuid = uuid::Uuid::parse_str(&t.uuid).unwrap();
        assert_eq!(uuid.get_version_num(), 4, "uuid v4");
        assert!(uuids.insert(t.uuid.clone()), "duplicate uuid");
        assert_eq!(r.subject, trajectory_subject(&t.task_id));
        assert_eq!(
            lease_task.get(&t.group_id),
            Some(&t.task_id),
            "group_id = lease id"
        );
        assert_eq!(t.group_size, G);
        assert_eq!(t.admission_version, ADMISSION);
        assert_eq!(t.worker_id, "worker-test");
        let task = tasks_by_id[&t.task_id];
        // Token-exact: the prompt as the shared convention encodes it...
        assert_eq!(t.prompt_token_ids, prompt_ids(&published, &task.prompt));
        // ...every token at the announced version...
        assert!(
            t.policy_versions.iter().all(|&v| v == VERSION),
            "{:?}",
            t.policy_versions
        );
        // ...with the log-prob the published weights give it.
        let lp = recompute(&published, &t.prompt_token_ids, &t.completion_token_ids);
        let d = max_abs_diff(&lp, &t.behaviour_logprobs);
        assert!(
            d <= 1e-4,
            "log-probs differ by {d}: {:?} vs {lp:?}",
            t.behaviour_logprobs
        );
        if !t.completion_token_ids.is_empty() {
            let lp0 = recompute(&initial, &t.prompt_token_ids, &t.completion_token_ids);
            differs_from_initial |= max_abs_diff(&lp0, &t.behaviour_logprobs) > 1e-2;
        }
        // Finish reason and reward.
        let completion: Vec<i64> = t
            .completion_token_ids
            .iter()
            .map(|&x| i64::from(x))
            .collect();
        let last_is_eos = completion.last().is_some_and(|x| eos.contains(x));
        if last_is_eos {
            assert_eq!(t.finish_reason, FinishReason::Stop as i32);
        } else {
            assert_eq!(t.finish_reason, FinishReason::Length as i32);
            assert_eq!(completion.len(), MAX_NEW);
        }
        let text = decode_completion(&published, &completion, &eos).unwrap();
        let Verdict::Reward(expected) = asyncrl_tasks::score("arith", &text, &task.answer) else {
            panic!("arith has a verifier")
        };
        assert_eq!(t.reward_status, RewardStatus::Ok as i32);
        assert_eq!(t.reward, expected);
        let timings = t.timings.as_ref().unwrap();
        assert!(timings.finished_at_unix_ms >= timings.started_at_unix_ms);
        assert_eq!(timings.weight_swaps, 0);
    }
    assert!(
        differs_from_initial,
        "the worker's own initial weights would give other log-probs (the check can fail)"
    );

    // Groups: G trajectories, indices 0..G, stored before CompleteTask.
    let groups = by_group(&received);
    assert_eq!(groups.len(), TASKS);
    for (lease, members) in &groups {
        let idx: BTreeSet<u32> = members
            .iter()
            .map(|m| m.trajectory.index_in_group)
            .collect();
        assert_eq!(idx, (0..G).collect(), "{lease}");
        let completions: Vec<_> = log
            .completions
            .iter()
            .filter(|c| &c.request.lease_id == lease)
            .collect();
        assert_eq!(completions.len(), 1, "{lease} completed once");
        assert_eq!(completions[0].request.num_trajectories, G);
        let last_seq = members.iter().map(|m| m.stream_sequence).max().unwrap();
        assert!(
            completions[0].stream_len >= last_seq,
            "{lease}: CompleteTask arrived when the stream held {} messages, but its last trajectory is #{last_seq}",
            completions[0].stream_len
        );
    }

    // Heartbeats listed the held leases.
    assert!(
        log.heartbeats.iter().any(|(_, h)| !h.lease_ids.is_empty()),
        "no heartbeat listed a lease"
    );
    assert!(
        log.heartbeats
            .iter()
            .all(|(_, h)| h.policy_version == VERSION)
    );

    assert_eq!(summary.tasks_completed, TASKS as u64);
    assert_eq!(summary.trajectories_published, (TASKS * G as usize) as u64);
    assert_eq!(summary.final_version, Some(VERSION));
    assert_eq!(summary.weight_swaps, 1);
    assert!(summary.drained_cleanly);
    assert!(summary.tokens_generated > 0);

    let m = WorkerMetrics::new(&metrics).unwrap();
    assert_eq!(m.trajectories_published.get(), (TASKS * G as usize) as u64);
    assert_eq!(m.tasks_completed.get(), TASKS as u64);
    assert_eq!(m.policy_version.get(), i64::from(VERSION));
    assert_eq!(m.tokens_generated.get(), summary.tokens_generated);
    let text = metrics.encode_prometheus_text().unwrap();
    for name in [
        "asyncrl_worker_tokens_generated_total",
        "asyncrl_worker_sequences_in_flight",
        "asyncrl_worker_task_latency_seconds_count",
        "asyncrl_worker_weight_swap_latency_seconds_count",
        "asyncrl_worker_reward_latency_seconds_count",
        "asyncrl_worker_version_lag_count",
    ] {
        assert!(text.contains(name), "{name} missing from /metrics:\n{text}");
    }
}
