//! A refused acquire waits for the coordinator's `retry_after`, unless new
//! weights arrive first: with η = 0 every step's tasks are refused until the
//! learner's next version, and waiting out `retry_after` after the swap
//! would sit on the critical path of every synchronous step. The same for
//! the coordinator's hint that capacity came back without a new version
//! (`TASKS_AVAILABLE`: a group dropped for no reward signal, whose refill
//! would otherwise wait out `retry_after` at η = 0).

mod common;

use std::time::Duration;

use asyncrl_protos::subjects::TASKS_AVAILABLE;
use asyncrl_rollout_worker::scripted::{ScriptOptions, ScriptedTask};
use asyncrl_tasks::BuiltinTask;
use bytes::Bytes;
use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_weight_swap_ends_the_wait_after_a_refused_acquire() {
    const G: u32 = 2;
    // Nothing to grant yet, and a refusal asks for a retry in ten minutes.
    let rig = Rig::nats(
        model_section(8, 48),
        4,
        Vec::new(),
        ScriptOptions {
            group_size: G,
            admission_version: 2,
            retry_after_ms: 600_000,
            ..ScriptOptions::default()
        },
    )
    .await;
    let (p1, p2) = (rig.policy(1), rig.policy(2));
    rig.publish(1, &p1).await;
    let coordinator = &rig.coordinator;
    let RunningWorker {
        handles,
        shutdown,
        task: worker,
    } = start_worker_at(rig.config.clone(), &rig.bus, 1).await;
    let (refused, log) = coordinator
        .wait_for(Duration::from_secs(30), |l| !l.acquires.is_empty())
        .await;
    assert!(refused, "{log:#?}");
    let acquires_before = coordinator.log().acquires.len();
    coordinator.push_tasks(ScriptedTask::generated(BuiltinTask::Arith, 1, 3));

    // The learner's next version: the worker swaps and asks again at once.
    rig.publish(2, &p2).await;
    let (done, log) = coordinator
        .wait_for(Duration::from_secs(60), |l| l.completed_leases().len() == 1)
        .await;
    assert!(
        done,
        "the worker still waits out retry_after after the swap: {log:#?}"
    );
    assert!(log.acquires.len() > acquires_before);
    assert_eq!(handles.policy_version.get(), 2);
    shutdown.cancel();
    worker.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tasks_available_hint_ends_the_wait_after_a_refused_acquire() {
    const G: u32 = 2;
    // Nothing to grant yet, and a refusal asks for a retry in ten minutes.
    let rig = Rig::nats(
        model_section(8, 48),
        4,
        Vec::new(),
        ScriptOptions {
            group_size: G,
            admission_version: 1,
            retry_after_ms: 600_000,
            ..ScriptOptions::default()
        },
    )
    .await;
    let p1 = rig.policy(1);
    rig.publish(1, &p1).await;
    let coordinator = &rig.coordinator;
    let RunningWorker {
        handles,
        shutdown,
        task: worker,
    } = start_worker_at(rig.config.clone(), &rig.bus, 1).await;
    // The refusal's reply came after the worker's subscription reached the
    // server (one connection, in order): the hint below is delivered.
    let (refused, log) = coordinator
        .wait_for(Duration::from_secs(30), |l| !l.acquires.is_empty())
        .await;
    assert!(refused, "{log:#?}");
    let acquires_before = coordinator.log().acquires.len();
    coordinator.push_tasks(ScriptedTask::generated(BuiltinTask::Arith, 1, 3));

    // Capacity came back at the same version: the worker asks again at once.
    rig.bus
        .publish(TASKS_AVAILABLE, Bytes::new())
        .await
        .unwrap();
    rig.bus.flush().await.unwrap();
    let (done, log) = coordinator
        .wait_for(Duration::from_secs(60), |l| l.completed_leases().len() == 1)
        .await;
    assert!(
        done,
        "the worker still waits out retry_after after the hint: {log:#?}"
    );
    assert!(log.acquires.len() > acquires_before);
    assert_eq!(handles.policy_version.get(), 1, "no weight swap woke it");
    shutdown.cancel();
    worker.await.unwrap().unwrap();
}
