//! The worker over the in-process bus (the local mode): it waits for a
//! coordinator and a trajectory stream that appear late, and scores
//! through the Python example reward service for real.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use asyncrl_config::BusConfig;
use asyncrl_policy::from_config::decode_completion;
use asyncrl_protos::RewardStatus;
use asyncrl_rollout_worker::scripted::{
    ScriptOptions, ScriptedCoordinator, ScriptedTask, ensure_trajectory_stream, publish_weights,
    read_trajectories,
};
use asyncrl_rollout_worker::{CancellationToken, WorkerMetrics, run};
use asyncrl_tasks::BuiltinTask;
use asyncrl_telemetry::Metrics;
use asyncrl_transport::{Bus, LocalBus};
use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waits_for_a_late_coordinator_and_a_late_stream() {
    const G: u32 = 3;
    let bus: Arc<dyn Bus> = Arc::new(LocalBus::new());
    let section = model_section(16, 48);
    let config = config(BusConfig::default(), section.clone(), G, 6);
    let published = policy(&section, 42);
    publish_weights(bus.as_ref(), 0, weights(&published))
        .await
        .unwrap();
    let metrics = Metrics::new();
    let handles = WorkerMetrics::new(&metrics).unwrap();
    let shutdown = CancellationToken::new();
    let worker = tokio::spawn(run(config, bus.clone(), metrics.clone(), shutdown.clone()));

    // No coordinator yet: registration is retried.
    let register_errors = || {
        handles
            .coordinator_errors
            .get_or_create(&vec![("reason".to_owned(), "register".to_owned())])
            .get()
    };
    assert!(eventually(Duration::from_secs(30), || register_errors() >= 2).await);
    assert!(!worker.is_finished());
    let coordinator = ScriptedCoordinator::start(
        bus.clone(),
        ScriptedTask::generated(BuiltinTask::Arith, 2, 4),
        ScriptOptions {
            group_size: G,
            ..ScriptOptions::default()
        },
    )
    .await
    .unwrap();

    // No stream yet: publishes are retried, nothing is completed.
    assert!(
        eventually(Duration::from_secs(30), || handles.publish_retries.get()
            >= 2)
        .await
    );
    assert!(coordinator.log().completions.is_empty());
    ensure_trajectory_stream(bus.as_ref()).await.unwrap();

    let (done, _) = coordinator
        .wait_for(Duration::from_secs(30), |l| l.completed_leases().len() == 2)
        .await;
    assert!(done);
    shutdown.cancel();
    let summary = worker.await.unwrap().unwrap();
    assert_eq!(summary.tasks_completed, 2);
    let received = read_trajectories(bus.as_ref(), "late", 2 * G as usize, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(received.len(), 2 * G as usize);
    for r in &received {
        let t = &r.trajectory;
        let lp = recompute(&published, &t.prompt_token_ids, &t.completion_token_ids);
        assert!(max_abs_diff(&lp, &t.behaviour_logprobs) <= 1e-4);
        assert!(t.policy_versions.iter().all(|&v| v == 0));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn external_reward_service_scores_and_failures_are_published_as_failed() {
    const G: u32 = 3;
    let server = RewardServer::start();
    let tasks = vec![
        ScriptedTask {
            task_id: "custom-1".into(),
            dataset: "custom".into(),
            prompt: "2+2=".into(),
            answer: "4".into(),
        },
        ScriptedTask {
            task_id: "custom-2".into(),
            dataset: "custom".into(),
            prompt: "3+3=".into(),
            answer: "FAIL".into(),
        },
    ];
    let mut rig = Rig::local(
        model_section(8, 32),
        6,
        tasks,
        ScriptOptions {
            group_size: G,
            ..ScriptOptions::default()
        },
    )
    .await;
    let reward = &mut rig.config.worker.reward;
    reward.endpoint = Some(format!("http://127.0.0.1:{}", server.port));
    reward.timeout = Duration::from_secs(2);
    reward.attempts = 2;
    reward.backoff = Duration::from_millis(20);
    rig.config.validate().unwrap();
    let published = rig.policy(42);
    rig.publish(0, &published).await;
    let Rig {
        bus,
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
    let (done, log) = coordinator
        .wait_for(Duration::from_secs(60), |l| l.completed_leases().len() == 2)
        .await;
    assert!(
        done,
        "a failed reward must not stop the task from completing: {log:#?}"
    );
    shutdown.cancel();
    let summary = worker.await.unwrap().unwrap();
    let received = read_trajectories(bus.as_ref(), "ext", 2 * G as usize, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(received.len(), 2 * G as usize);
    let eos = published.eos_token_ids();
    let mut per_task: HashMap<String, usize> = HashMap::new();
    for r in &received {
        let t = &r.trajectory;
        *per_task.entry(t.task_id.clone()).or_default() += 1;
        if t.task_id == "custom-2" {
            assert_eq!(t.reward_status, RewardStatus::Failed as i32);
            assert!(t.reward.is_nan(), "never a silent 0");
        } else {
            let ids: Vec<i64> = t
                .completion_token_ids
                .iter()
                .map(|&x| i64::from(x))
                .collect();
            let text = decode_completion(&published, &ids, &eos).unwrap();
            assert_eq!(t.reward_status, RewardStatus::Ok as i32);
            assert_eq!(t.reward, if text.trim() == "4" { 1.0 } else { 0.0 });
            assert!(t.timings.as_ref().unwrap().reward_ms < 2000);
        }
    }
    assert_eq!(per_task.len(), 2);
    assert_eq!(summary.reward_failures, u64::from(G));
    let m = WorkerMetrics::new(&metrics).unwrap();
    assert_eq!(m.reward_failures.get(), u64::from(G));
}

/// The `Cpus_allowed_list` of this process's thread whose name starts with
/// `prefix` (Linux `/proc`), once it exists.
#[cfg(target_os = "linux")]
fn thread_cpus(prefix: &str) -> Option<String> {
    for entry in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
        if comm.trim_end().starts_with(prefix) {
            let status = std::fs::read_to_string(entry.path().join("status")).ok()?;
            return status
                .lines()
                .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                .map(|v| v.trim().to_owned());
        }
    }
    None
}

#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_model_thread_runs_on_the_cores_of_worker_cpu_affinity() {
    let bus: Arc<dyn Bus> = Arc::new(LocalBus::new());
    let mut config = config(BusConfig::default(), model_section(4, 32), 2, 2);
    // The last core this process may use: the model thread gets only it,
    // the runtime's threads keep the whole set.
    let allowed = asyncrl_policy::affinity::current_thread_cores().expect("affinity");
    let core = *allowed.last().expect("a core");
    config.worker.cpu_affinity = vec![core];
    let shutdown = CancellationToken::new();
    let worker = tokio::spawn(run(config, bus, Metrics::new(), shutdown.clone()));
    let mut pinned = None;
    assert!(
        eventually(Duration::from_secs(30), || {
            pinned = thread_cpus("asyncrl-worker");
            pinned.is_some()
        })
        .await,
        "the worker's model thread never started"
    );
    assert_eq!(pinned.as_deref(), Some(core.to_string().as_str()));
    if allowed.len() > 1 {
        assert_ne!(
            asyncrl_policy::affinity::current_thread_cores(),
            Some(vec![core]),
            "only the model thread is pinned"
        );
    }
    shutdown.cancel();
    worker.await.expect("join").expect("worker");
}
