//! Leases against a real nats-server: a SIGTERM drain publishes every
//! finished sequence and returns the unfinished tasks (nothing lost, nothing
//! half-reported); a revoked lease has its sequences cancelled and is never
//! completed.

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use asyncrl_rollout_worker::CancellationToken;
use asyncrl_rollout_worker::scripted::{ScriptOptions, ScriptedTask, read_trajectories};
use asyncrl_tasks::BuiltinTask;
use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drain_publishes_the_finished_and_returns_the_unfinished() {
    const G: u32 = 2;
    // Long completions on a slowed-down model: something is always in flight.
    let mut rig = Rig::nats(
        model_section(120, 160),
        4,
        ScriptedTask::generated(BuiltinTask::Reverse, 40, 5),
        ScriptOptions {
            group_size: G,
            heartbeat_interval_ms: 50,
            ..ScriptOptions::default()
        },
    )
    .await;
    let grace = Duration::from_millis(400);
    rig.config.worker.drain_grace_period = grace;
    rig.publish(0, &rig.policy(9)).await;
    let Rig {
        bus, coordinator, ..
    } = &rig;
    let shutdown = CancellationToken::new();
    let ThrottledWorker {
        model,
        throttle,
        handles,
        task: worker,
    } = rig
        .start_throttled(Duration::from_millis(2), &shutdown)
        .await;

    // Run until a few trajectories are out, then freeze the model between
    // two steps and send the "SIGTERM".
    loop {
        assert!(
            eventually(Duration::from_secs(60), || {
                let s = model.stats();
                s.sequences_finished >= 3 && s.in_flight >= 1
            })
            .await,
            "nothing finished"
        );
        throttle.freeze().await;
        if model.stats().in_flight >= 1 {
            break;
        }
        throttle.thaw();
    }
    let sigterm = Instant::now();
    let acquires_before = coordinator.log().acquires.len();
    shutdown.cancel();
    // The sequences in flight cannot finish while the model is frozen; once
    // the grace period ran out the worker cancels them, then the model may
    // run again (finished completions are still decoded and published,
    // cancelled ones are gone). Waiting for the cancellation, not for a
    // time, keeps this right on a loaded machine.
    assert!(
        eventually(Duration::from_secs(60), || handles
            .sequences_cancelled
            .get()
            >= 1)
        .await,
        "the drain did not cancel the sequences in flight after the grace period"
    );
    throttle.thaw();
    let summary = tokio::time::timeout(Duration::from_secs(20), worker)
        .await
        .expect("the worker exits after the drain")
        .unwrap()
        .unwrap();
    let elapsed = sigterm.elapsed();
    throttle.stop().await;
    let log = coordinator.log();

    // Every granted task was either completed or returned, never both.
    let granted = log.granted_leases();
    let completed = log.completed_leases();
    let returned = log.returned_leases();
    assert!(!returned.is_empty(), "the unfinished task is returned");
    assert!(completed.is_disjoint(&returned));
    assert_eq!(
        completed.union(&returned).cloned().collect::<HashSet<_>>(),
        granted,
        "a task was lost"
    );
    assert_eq!(
        summary
            .returned_lease_ids
            .iter()
            .cloned()
            .collect::<HashSet<_>>(),
        returned
    );
    assert!(summary.drained_cleanly);
    assert!(summary.sequences_cancelled >= 1);
    assert!(elapsed < grace + Duration::from_secs(5), "{elapsed:?}");
    // Nothing acquired after the SIGTERM (an acquire the worker sent just
    // before it may still arrive after it: at most one, and what it got was
    // returned, as the checks above show); heartbeats said "draining".
    let late = log.acquires.len() - acquires_before;
    assert!(
        late <= 1,
        "{late} acquires after the SIGTERM: {:?}",
        &log.acquires[acquires_before..]
    );
    assert!(log.heartbeats.iter().any(|(_, h)| h.draining));
    // Every sequence that finished was published, and nothing else.
    let finished = model.stats().sequences_finished;
    let stored = bus
        .stream_len(asyncrl_protos::subjects::TRAJECTORY_STREAM)
        .await
        .unwrap();
    assert_eq!(
        stored, finished,
        "finished sequences = published trajectories"
    );
    assert_eq!(summary.trajectories_published, finished);
    let received = read_trajectories(
        bus.as_ref(),
        "drain",
        finished as usize,
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    assert_eq!(received.len() as u64, finished);
    let groups = by_group(&received);
    for lease in &completed {
        assert_eq!(groups.get(lease).map(Vec::len), Some(G as usize), "{lease}");
    }
    // Returned tasks: the finished completions were published, the group is
    // short (the buffer drops it when another attempt completes).
    for lease in &returned {
        assert!(
            groups.get(lease).map_or(0, Vec::len) < G as usize,
            "{lease}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_lease_is_cancelled_and_never_completed() {
    const G: u32 = 2;
    let rig = Rig::nats(
        model_section(100, 140),
        4,
        ScriptedTask::generated(BuiltinTask::Reverse, 3, 8),
        ScriptOptions {
            group_size: G,
            heartbeat_interval_ms: 50,
            max_per_acquire: 1,
            ..ScriptOptions::default()
        },
    )
    .await;
    rig.publish(0, &rig.policy(9)).await;
    let Rig {
        bus, coordinator, ..
    } = &rig;
    let shutdown = CancellationToken::new();
    let ThrottledWorker {
        model,
        throttle,
        handles,
        task: worker,
    } = rig
        .start_throttled(Duration::from_millis(2), &shutdown)
        .await;

    assert!(
        eventually(Duration::from_secs(30), || model.stats().tokens_generated
            >= 8)
        .await,
        "generation did not start"
    );
    throttle.freeze().await;
    // Pick a lease still generating: once every sequence that finished
    // before the freeze is in the stream, a lease with fewer than G
    // trajectories there still has a sequence to generate. (Waiting for the
    // stream, not for a time, keeps this right on a loaded machine.)
    let finished = model.stats().sequences_finished;
    asyncrl_testkit::eventually(
        "the finished sequences published",
        Duration::from_secs(30),
        || async {
            let stored = bus
                .stream_len(asyncrl_protos::subjects::TRAJECTORY_STREAM)
                .await
                .ok()?;
            (stored >= finished).then_some(())
        },
    )
    .await;
    let published = read_trajectories(
        bus.as_ref(),
        "before-revoke",
        finished as usize,
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    let groups = by_group(&published);
    let victim = coordinator
        .log()
        .granted
        .iter()
        .map(|(_, t)| t.lease_id.clone())
        .find(|l| groups.get(l).map_or(0, Vec::len) < G as usize)
        .expect("a lease still generating");
    coordinator.revoke(&victim);
    let (seen, _) = coordinator
        .wait_for(Duration::from_secs(5), |l| l.revoked.contains(&victim))
        .await;
    assert!(seen, "the next heartbeat listed the lease");
    assert!(
        eventually(Duration::from_secs(5), || handles.tasks_revoked.get() == 1
            && handles.sequences_cancelled.get() >= 1)
        .await,
        "the worker cancels the revoked lease's sequences"
    );
    throttle.thaw();

    // The other tasks still complete.
    let others: HashSet<String> = (1..=3)
        .map(|i| format!("lease-{i}"))
        .filter(|l| l != &victim)
        .collect();
    let (done, log) = coordinator
        .wait_for(Duration::from_secs(60), |l| {
            l.granted.len() == 3 && others.is_subset(&l.completed_leases())
        })
        .await;
    assert!(done, "{log:#?}");
    shutdown.cancel();
    let summary = worker.await.unwrap().unwrap();
    throttle.stop().await;

    assert!(
        log.completions.iter().all(|c| c.request.lease_id != victim),
        "a revoked lease is never reported complete"
    );
    assert!(!log.returned_leases().contains(&victim), "nor returned");
    assert_eq!(summary.tasks_revoked, 1);
    assert_eq!(summary.tasks_completed, 2);
    assert!(
        eventually(Duration::from_secs(5), || model.stats().in_flight == 0).await,
        "the cancelled sequences left the batch"
    );
    let stored = bus
        .stream_len(asyncrl_protos::subjects::TRAJECTORY_STREAM)
        .await
        .unwrap();
    let received = read_trajectories(
        bus.as_ref(),
        "revoke",
        stored as usize,
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    let groups = by_group(&received);
    assert!(groups.get(&victim).map_or(0, Vec::len) < G as usize);
}
