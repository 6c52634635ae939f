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
    let refused = RefusedWorker::start(2).await;
    // The learner's next version: the worker swaps and asks again at once.
    let p2 = refused.rig.policy(2);
    refused.rig.publish(2, &p2).await;
    refused.asks_again_and_finishes("the swap", 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tasks_available_hint_ends_the_wait_after_a_refused_acquire() {
    let refused = RefusedWorker::start(1).await;
    // Capacity came back at the same version: the worker asks again at once.
    let bus = &refused.rig.bus;
    bus.publish(TASKS_AVAILABLE, Bytes::new()).await.unwrap();
    bus.flush().await.unwrap();
    refused.asks_again_and_finishes("the hint", 1).await;
}

/// A worker at version 1 over NATS whose first acquire was refused with a
/// retry in ten minutes; a task is queued for it after the refusal.
struct RefusedWorker {
    rig: Rig,
    worker: RunningWorker,
    acquires_before: usize,
}

impl RefusedWorker {
    /// Tasks are granted stamped `admission_version`.
    async fn start(admission_version: i32) -> Self {
        let rig = Rig::nats(
            model_section(8, 48),
            4,
            Vec::new(),
            ScriptOptions {
                group_size: 2,
                admission_version,
                retry_after_ms: 600_000,
                ..ScriptOptions::default()
            },
        )
        .await;
        let p1 = rig.policy(1);
        rig.publish(1, &p1).await;
        let worker = start_worker_at(rig.config.clone(), &rig.bus, 1).await;
        // The refusal's reply came after the worker's subscriptions reached
        // the server (one connection, in order): what is published next
        // is delivered.
        let (refused, log) = rig
            .coordinator
            .wait_for(Duration::from_secs(30), |l| !l.acquires.is_empty())
            .await;
        assert!(refused, "{log:#?}");
        let acquires_before = rig.coordinator.log().acquires.len();
        rig.coordinator
            .push_tasks(ScriptedTask::generated(BuiltinTask::Arith, 1, 3));
        Self {
            rig,
            worker,
            acquires_before,
        }
    }

    /// The worker asks again (long before retry_after), finishes the task
    /// at `version`, and stops.
    async fn asks_again_and_finishes(self, woken_by: &str, version: i64) {
        let (done, log) = self
            .rig
            .coordinator
            .wait_for(Duration::from_secs(60), |l| l.completed_leases().len() == 1)
            .await;
        assert!(
            done,
            "the worker still waits out retry_after after {woken_by}: {log:#?}"
        );
        assert!(log.acquires.len() > self.acquires_before);
        assert_eq!(self.worker.handles.policy_version.get(), version);
        self.worker.shutdown.cancel();
        self.worker.task.await.unwrap().unwrap();
    }
}
