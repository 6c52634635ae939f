//! A real SIGTERM to the process drains the worker through
//! [`shutdown_on_signals`]: nothing granted is lost, the unfinished tasks
//! go back to the coordinator, and `run` returns.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use asyncrl_rollout_worker::scripted::{ScriptOptions, ScriptedTask};
use asyncrl_rollout_worker::shutdown_on_signals;
use asyncrl_tasks::BuiltinTask;
use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_the_worker() {
    const G: u32 = 2;
    let mut rig = Rig::local(
        model_section(120, 160),
        4,
        ScriptedTask::generated(BuiltinTask::Reverse, 40, 5),
        ScriptOptions {
            group_size: G,
            ..ScriptOptions::default()
        },
    )
    .await;
    rig.config.worker.drain_grace_period = Duration::from_millis(300);
    rig.publish(0, &rig.policy(9)).await;
    let coordinator = &rig.coordinator;
    let shutdown = shutdown_on_signals().unwrap();
    let ThrottledWorker {
        model,
        throttle,
        task: worker,
        ..
    } = rig
        .start_throttled(Duration::from_millis(5), &shutdown)
        .await;
    assert!(
        eventually(Duration::from_secs(60), || {
            let s = model.stats();
            s.tokens_generated >= 20 && s.in_flight >= 1
        })
        .await
    );
    // SAFETY: kill(2) on our own pid; tokio's handler (installed above)
    // turns SIGTERM into the shutdown token instead of ending the process.
    let rc = unsafe { libc::kill(libc::getpid(), libc::SIGTERM) };
    assert_eq!(rc, 0);
    let summary = tokio::time::timeout(Duration::from_secs(30), worker)
        .await
        .expect("the worker drains and returns after SIGTERM")
        .unwrap()
        .unwrap();
    assert!(shutdown.is_cancelled());
    throttle.stop().await;
    let log = coordinator.log();
    let (completed, returned) = (log.completed_leases(), log.returned_leases());
    assert!(completed.is_disjoint(&returned));
    assert_eq!(
        completed.union(&returned).cloned().collect::<HashSet<_>>(),
        log.granted_leases()
    );
    assert!(summary.drained_cleanly);
    assert_eq!(
        summary.tasks_completed + summary.tasks_returned,
        summary.tasks_started
    );
}
