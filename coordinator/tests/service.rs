//! The coordinator over the bus, as workers and the learner see it: the
//! in-process bus for most checks, a real nats-server where the transport
//! matters.
//!
//! The checks over the in-process bus run on paused tokio time with the
//! coordinator on a [`TokioClock`]: leases, heartbeats and the capacity
//! model see exactly the time the test lets pass, however busy the machine.
//! Over a real nats-server time is real and the tests wait for conditions.

mod common;

use std::sync::Arc;
use std::time::Duration;

use asyncrl_common::{SharedClock, SystemClock, TokioClock};
use asyncrl_config::Config;
use asyncrl_coordinator::Coordinator;
use asyncrl_protos::subjects::{BUFFER_GROUP_DROPPED, TASKS_AVAILABLE};
use asyncrl_protos::v1::{GroupDropReason, GroupDropped};
use asyncrl_telemetry::{Health, Metrics};
use asyncrl_testkit::NatsServer;
use asyncrl_testkit::eventually;
use asyncrl_transport::{Bus, LocalBus};
use bytes::Bytes;
use common::{Learner, Worker, config, nats_bus, write_tasks};

use prost::Message;
use tokio_util::sync::CancellationToken;

/// A coordinator on the system clock (for the tests over a nats-server).
async fn start(config: Config, bus: &Arc<dyn Bus>) -> (Coordinator, Metrics, Health) {
    start_on(config, bus, SystemClock::shared()).await
}

/// A coordinator on `clock`.
async fn start_on(
    config: Config,
    bus: &Arc<dyn Bus>,
    clock: SharedClock,
) -> (Coordinator, Metrics, Health) {
    let metrics = Metrics::new();
    let health = Health::new();
    let c = Coordinator::start_with_clock(
        config,
        bus.clone(),
        metrics.clone(),
        health.clone(),
        &CancellationToken::new(),
        clock,
    )
    .await
    .expect("start coordinator");
    (c, metrics, health)
}

/// The clock of a test on paused tokio time (a fixed start, so that runs
/// are alike).
fn paused_clock() -> SharedClock {
    TokioClock::starting_at(1_700_000_000_000).shared()
}

/// A coordinator over the in-process bus on [`paused_clock`] time.
async fn start_paused(
    config: Config,
    bus: &Arc<dyn Bus>,
) -> (Coordinator, Metrics, Health, SharedClock) {
    let clock = paused_clock();
    let (c, metrics, health) = start_on(config, bus, clock.clone()).await;
    (c, metrics, health, clock)
}

/// The next tasks-available hint (the coordinator's "capacity came back
/// without a new version"), within 5 s.
async fn next_hint(
    hints: &mut futures::stream::BoxStream<'static, asyncrl_transport::Message>,
    after: &str,
) {
    let hint = tokio::time::timeout(Duration::from_secs(5), futures::StreamExt::next(hints))
        .await
        .unwrap_or_else(|_| panic!("no tasks-available hint {after}"))
        .expect("the hint subscription ended");
    assert!(hint.payload.is_empty());
}

async fn wait_version(c: &Coordinator, v: i32) {
    eventually(&format!("version {v}"), Duration::from_secs(5), || async {
        (c.status().await.unwrap().policy_version == v).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_baseline_admits_exactly_b_groups_per_version_over_nats() {
    let server = NatsServer::start().unwrap();
    let bus = nats_bus(&server.url()).await;
    let dir = tempfile::tempdir().unwrap();
    let tasks = write_tasks(dir.path(), 100);
    let b = 3;
    let (c, _, health) = start(config(dir.path(), &tasks, b, 0), &bus).await;
    assert!(health.is_ready());
    let learner = Learner::new(&bus).await;
    let w1 = Worker::new(&bus, "w1");
    let w2 = Worker::new(&bus, "w2");
    assert!(w1.register(16).await.accepted);
    w2.register(16).await;
    let mut seen = std::collections::HashSet::new();
    for v in 0..4 {
        if v > 0 {
            learner.announce(v).await;
            wait_version(&c, v).await;
        }
        let mut granted: Vec<(&Worker, _)> = w1
            .acquire(2)
            .await
            .tasks
            .into_iter()
            .map(|t| (&w1, t))
            .collect();
        granted.extend(w2.acquire(5).await.tasks.into_iter().map(|t| (&w2, t)));
        assert_eq!(granted.len(), b as usize, "version {v}");
        let refused = w1.acquire(5).await;
        assert!(refused.tasks.is_empty());
        assert!(
            refused.reason.contains("staleness bound"),
            "{}",
            refused.reason
        );
        assert!(refused.retry_after_ms > 0);
        for (w, t) in &granted {
            assert_eq!(t.admission_version, v);
            assert_eq!(t.group_size, 2);
            assert!(
                seen.insert(t.task_id.clone()),
                "task {} issued twice",
                t.task_id
            );
            let r = w.complete(t).await;
            assert!(r.accepted, "{}", r.reason);
        }
        // Completions free nothing before the learner moves on.
        assert!(w2.acquire(5).await.tasks.is_empty());
    }
    let s = c.status().await.unwrap();
    assert_eq!(
        (s.accepted_groups, s.running_groups, s.capacity_left),
        (12, 0, 0)
    );
    c.shutdown();
    c.join().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn expired_leases_go_back_to_the_front_and_their_completion_is_refused() {
    let bus: Arc<dyn Bus> = Arc::new(LocalBus::new());
    let dir = tempfile::tempdir().unwrap();
    let tasks = write_tasks(dir.path(), 50);
    let mut cfg = config(dir.path(), &tasks, 8, 2);
    cfg.coordinator.lease_timeout = Duration::from_millis(400);
    let mut hints = bus.subscribe(TASKS_AVAILABLE).await.unwrap();
    let (c, metrics, _, clock) = start_paused(cfg, &bus).await;
    let a = Worker::new(&bus, "a");
    let b = Worker::new(&bus, "b");
    a.register(8).await;
    b.register(8).await;
    let got = a.acquire(3).await.tasks;
    assert_eq!(got.len(), 3);
    assert!(
        got.iter()
            .all(|t| t.lease_deadline_unix_ms > clock.now_unix_ms())
    );
    // Heartbeats every 100 ms (paused time) keep the first lease alive; the
    // other two expire after 400 ms.
    for _ in 0..8 {
        let r = a.heartbeat(&[&got[0]], false).await;
        assert!(r.revoked_lease_ids.is_empty());
        b.heartbeat(&[], false).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let s = c.status().await.unwrap();
    assert_eq!((s.running_groups, s.requeued_tasks), (1, 2));
    // The expiry returned capacity at the same version: refused workers are
    // told at once.
    next_hint(&mut hints, "after leases expired").await;
    // The expired tasks are issued again first, under new leases.
    let again = b.acquire(3).await.tasks;
    let ids: Vec<&str> = again.iter().map(|t| t.task_id.as_str()).collect();
    assert_eq!(ids[..2], [got[1].task_id.as_str(), got[2].task_id.as_str()]);
    assert_ne!(again[0].lease_id, got[1].lease_id);
    // The late completion of the expired attempt is refused, saying why.
    let late = a.complete(&got[1]).await;
    assert!(
        !late.accepted && late.reason.contains("expired"),
        "{}",
        late.reason
    );
    // Its heartbeat revokes it.
    let hb = a.heartbeat(&[&got[0], &got[1]], false).await;
    assert_eq!(hb.revoked_lease_ids, vec![got[1].lease_id.clone()]);
    // The live lease and the new attempts complete.
    assert!(a.complete(&got[0]).await.accepted);
    for t in &again {
        assert!(b.complete(t).await.accepted);
    }
    // A wrong group size leaves the lease open.
    let t = b.acquire(1).await.tasks.remove(0);
    let wrong = b.complete_ids(&t.task_id, &t.lease_id, 1).await;
    assert!(
        !wrong.accepted && wrong.reason.contains("a group has 2 trajectories"),
        "{}",
        wrong.reason
    );
    assert!(b.complete(&t).await.accepted);
    let text = metrics.encode_prometheus_text().unwrap();
    assert!(text.contains("asyncrl_tasks_expired_total 2"), "{text}");
    assert!(
        text.contains("asyncrl_completions_refused_total{reason=\"expired\"} 1"),
        "{text}"
    );
    c.shutdown();
    c.join().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_worker_without_heartbeats_is_marked_dead_and_its_tasks_reissued() {
    let bus: Arc<dyn Bus> = Arc::new(LocalBus::new());
    let dir = tempfile::tempdir().unwrap();
    let tasks = write_tasks(dir.path(), 50);
    let mut cfg = config(dir.path(), &tasks, 8, 2);
    cfg.coordinator.dead_after = Duration::from_millis(300);
    let mut hints = bus.subscribe(TASKS_AVAILABLE).await.unwrap();
    let (c, metrics, _, _) = start_paused(cfg, &bus).await;
    let quiet = Worker::new(&bus, "quiet");
    let chatty = Worker::new(&bus, "chatty");
    quiet.register(4).await;
    chatty.register(4).await;
    let held = quiet.acquire(2).await.tasks;
    eventually("quiet marked dead", Duration::from_secs(5), || async {
        chatty.heartbeat(&[], false).await;
        let w = c.workers().await.unwrap();
        let q = w.workers.iter().find(|w| w.worker_id == "quiet")?;
        (!q.alive).then_some(())
    })
    .await;
    // Its leases ended: capacity back at the same version.
    next_hint(&mut hints, "after a worker was marked dead").await;
    let workers = c.workers().await.unwrap().workers;
    let chatty_info = workers.iter().find(|w| w.worker_id == "chatty").unwrap();
    assert!(chatty_info.alive && chatty_info.capacity == 4 && chatty_info.hostname == "test-host");
    let s = c.status().await.unwrap();
    assert_eq!(
        (s.live_workers, s.dead_workers, s.running_groups),
        (1, 1, 0)
    );
    let reissued = chatty.acquire(2).await.tasks;
    assert_eq!(
        reissued.iter().map(|t| &t.task_id).collect::<Vec<_>>(),
        held.iter().map(|t| &t.task_id).collect::<Vec<_>>()
    );
    let text = metrics.encode_prometheus_text().unwrap();
    assert!(text.contains("asyncrl_workers{state=\"dead\"} 1"), "{text}");
    assert!(
        text.contains("asyncrl_worker_heartbeat_age_seconds{worker=\"quiet\"}"),
        "{text}"
    );
    // A heartbeat brings it back.
    quiet.heartbeat(&[], false).await;
    assert_eq!(c.status().await.unwrap().live_workers, 2);
    c.shutdown();
    c.join().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_draining_worker_returns_its_tasks_and_gets_no_more() {
    let bus: Arc<dyn Bus> = Arc::new(LocalBus::new());
    let dir = tempfile::tempdir().unwrap();
    let tasks = write_tasks(dir.path(), 50);
    let mut hints = bus.subscribe(TASKS_AVAILABLE).await.unwrap();
    let (c, _, _, _) = start_paused(config(dir.path(), &tasks, 8, 2), &bus).await;
    let a = Worker::new(&bus, "a");
    let b = Worker::new(&bus, "b");
    a.register(8).await;
    let held = a.acquire(3).await.tasks;
    assert!(a.complete(&held[0]).await.accepted);
    a.heartbeat(&[&held[1], &held[2]], true).await;
    let none = a.acquire(4).await;
    assert!(
        none.tasks.is_empty() && none.reason.contains("draining"),
        "{}",
        none.reason
    );
    // Another worker's lease cannot be returned by it.
    let other = b.acquire(1).await.tasks;
    assert!(
        futures::FutureExt::now_or_never(futures::StreamExt::next(&mut hints)).is_none(),
        "a tasks-available hint before any capacity came back"
    );
    let r = a.return_tasks(&[&held[1], &held[2], &other[0]]).await;
    assert_eq!(r.returned, 2);
    // The returned leases are capacity back at the same version.
    next_hint(&mut hints, "after tasks were returned").await;
    let again = b.acquire(2).await.tasks;
    assert_eq!(
        [&again[0].task_id, &again[1].task_id],
        [&held[1].task_id, &held[2].task_id]
    );
    let s = c.status().await.unwrap();
    assert_eq!((s.accepted_groups, s.running_groups), (1, 3));
    c.shutdown();
    c.join().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_learner_restart_keeps_accepted_unless_its_version_went_down() {
    let bus: Arc<dyn Bus> = Arc::new(LocalBus::new());
    let dir = tempfile::tempdir().unwrap();
    let tasks = write_tasks(dir.path(), 50);
    let (c, metrics, _, clock) = start_paused(config(dir.path(), &tasks, 2, 1), &bus).await;
    let learner = Learner::with_clock(&bus, clock).await;
    learner.session("first", 0).await;
    let w = Worker::new(&bus, "w");
    w.register(8).await;
    let got = w.acquire(10).await.tasks;
    assert_eq!(got.len(), 4);
    for t in &got {
        assert!(w.complete(t).await.accepted);
    }
    learner.announce(1).await;
    wait_version(&c, 1).await;
    // accepted 4 = 2 trained + 2 waiting in the buffer.
    assert_eq!(c.status().await.unwrap().capacity_left, 2);
    // The learner restarts and carries on at version 1: the 2 groups
    // waiting in the (durable) buffer are still there, so no capacity is
    // freed for them (it would only make groups that go stale).
    learner.session("second", 1).await;
    eventually("the restart seen", Duration::from_secs(5), || async {
        let text = metrics.encode_prometheus_text().unwrap();
        text.contains("asyncrl_learner_restarts_total 1")
            .then_some(())
    })
    .await;
    let s = c.status().await.unwrap();
    assert_eq!((s.accepted_groups, s.capacity_left), (4, 2));
    // A version that goes down is a restart from an older state: accepted
    // is reset to v · B.
    learner.announce(0).await;
    eventually("reset to 0", Duration::from_secs(5), || async {
        let s = c.status().await.unwrap();
        (s.policy_version == 0 && s.accepted_groups == 0).then_some(())
    })
    .await;
    c.shutdown();
    c.join().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_stale_group_drop_returns_capacity_and_reissues_the_task() {
    let bus: Arc<dyn Bus> = Arc::new(LocalBus::new());
    let dir = tempfile::tempdir().unwrap();
    let tasks = write_tasks(dir.path(), 50);
    let (c, metrics, w, got) = two_tasks_completed(dir.path(), &tasks, &bus).await;
    assert!(w.acquire(5).await.tasks.is_empty());
    let drop = |kind: GroupDropReason, t: &asyncrl_protos::v1::Task| GroupDropped {
        task_id: t.task_id.clone(),
        group_id: t.lease_id.clone(),
        kind: kind as i32,
        trajectories: 2,
    };
    report(&bus, drop(GroupDropReason::DuplicateAttempt, &got[0])).await;
    report(&bus, drop(GroupDropReason::Stale, &got[1])).await;
    eventually("stale drop seen", Duration::from_secs(5), || async {
        (c.status().await.unwrap().stale_dropped_total == 1).then_some(())
    })
    .await;
    let again = w.acquire(5).await.tasks;
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].task_id, got[1].task_id);
    let text = metrics.encode_prometheus_text().unwrap();
    assert!(text.contains("asyncrl_stale_dropped_total 1"), "{text}");
    // In one process the buffer shares the counter and counts before it
    // reports: the coordinator does not count that drop again.
    let shared = metrics
        .get_or_register(
            "stale_dropped",
            "",
            asyncrl_telemetry::prometheus_client::metrics::counter::Counter::<u64>::default,
        )
        .unwrap();
    shared.inc();
    report(&bus, drop(GroupDropReason::Stale, &again[0])).await;
    eventually("second stale drop seen", Duration::from_secs(5), || async {
        (c.status().await.unwrap().stale_dropped_total == 2).then_some(())
    })
    .await;
    assert_eq!(shared.get(), 2);
    assert!(
        text.contains("asyncrl_groups_dropped_reported_total{reason=\"duplicate_attempt\"} 1"),
        "{text}"
    );
    c.shutdown();
    c.join().await.unwrap();
}

/// A coordinator (B = 2, η = 0) over `bus`, and a worker that was granted
/// two tasks and completed both: the admission bound is reached.
async fn two_tasks_completed(
    dir: &std::path::Path,
    tasks: &std::path::Path,
    bus: &Arc<dyn Bus>,
) -> (Coordinator, Metrics, Worker, Vec<asyncrl_protos::v1::Task>) {
    let (c, metrics, _, _) = start_paused(config(dir, tasks, 2, 0), bus).await;
    let w = Worker::new(bus, "w");
    w.register(8).await;
    let got = w.acquire(5).await.tasks;
    assert_eq!(got.len(), 2);
    for t in &got {
        assert!(w.complete(t).await.accepted);
    }
    (c, metrics, w, got)
}

/// Stores a drop report in the GROUP_DROPS stream, as the buffer does.
async fn report(bus: &Arc<dyn Bus>, g: GroupDropped) {
    let id = format!("dropped.{}.{}", g.group_id, g.kind().label());
    bus.publish_durable(BUFFER_GROUP_DROPPED, &id, Bytes::from(g.encode_to_vec()))
        .await
        .unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_drop_reported_while_the_coordinator_is_down_is_applied_when_it_starts() {
    let bus: Arc<dyn Bus> = Arc::new(LocalBus::new());
    let dir = tempfile::tempdir().unwrap();
    let tasks = write_tasks(dir.path(), 50);
    let (c, _, _, got) = two_tasks_completed(dir.path(), &tasks, &bus).await;
    c.shutdown();
    c.join().await.unwrap();
    // The buffer drops a group as stale while no coordinator runs.
    let stale = GroupDropped {
        task_id: got[1].task_id.clone(),
        group_id: got[1].lease_id.clone(),
        kind: GroupDropReason::Stale as i32,
        trajectories: 2,
    };
    report(&bus, stale.clone()).await;
    let (c, _, _, _) = start_paused(config(dir.path(), &tasks, 2, 0), &bus).await;
    eventually(
        "the stored report applied",
        Duration::from_secs(5),
        || async { (c.status().await.unwrap().stale_dropped_total == 1).then_some(()) },
    )
    .await;
    let w = Worker::new(&bus, "w");
    w.register(8).await;
    let again = w.acquire(5).await.tasks;
    assert_eq!(again.len(), 1, "the dropped group's capacity came back");
    assert_eq!(again[0].task_id, got[1].task_id, "its task is issued again");
    // The same report again (a restarted buffer reports its open stale
    // drops again): neither applied nor counted twice.
    let mut repeat = stale;
    repeat.trajectories = 0;
    let id = format!("dropped.{}.stale.again", repeat.group_id);
    bus.publish_durable(
        BUFFER_GROUP_DROPPED,
        &id,
        Bytes::from(repeat.encode_to_vec()),
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let s = c.status().await.unwrap();
    assert_eq!(s.stale_dropped_total, 1);
    assert!(
        w.acquire(5).await.tasks.is_empty(),
        "no second copy of the task"
    );
    c.shutdown();
    c.join().await.unwrap();
}

/// Dynamic sampling over the bus: a group the buffer drops for no reward
/// signal gives its capacity back once (also when the report overtakes the
/// completion, is delivered again, or meets a coordinator restart), and
/// its task is not issued again: the next grant is a new task.
#[tokio::test(start_paused = true)]
async fn a_no_signal_drop_returns_capacity_without_reissuing_the_task() {
    let bus: Arc<dyn Bus> = Arc::new(LocalBus::new());
    let dir = tempfile::tempdir().unwrap();
    let tasks = write_tasks(dir.path(), 50);
    let mut hints = bus.subscribe(TASKS_AVAILABLE).await.unwrap();
    let (c, metrics, w, got) = two_tasks_completed(dir.path(), &tasks, &bus).await;
    assert!(w.acquire(5).await.tasks.is_empty());
    let no_signal = |t: &asyncrl_protos::v1::Task| GroupDropped {
        task_id: t.task_id.clone(),
        group_id: t.lease_id.clone(),
        kind: GroupDropReason::NoSignal as i32,
        trajectories: 2,
    };
    let seen = |n: u64| {
        let metrics = metrics.clone();
        async move {
            eventually(
                &format!("{n} no-signal reports"),
                Duration::from_secs(5),
                || async {
                    let text = metrics.encode_prometheus_text().unwrap();
                    text.contains(&format!(
                        "asyncrl_groups_dropped_reported_total{{reason=\"no_signal\"}} {n}"
                    ))
                    .then_some(())
                },
            )
            .await;
        }
    };
    // After the completion.
    report(&bus, no_signal(&got[1])).await;
    seen(1).await;
    let s = c.status().await.unwrap();
    assert_eq!((s.accepted_groups, s.capacity_left), (1, 1));
    // Capacity came back at the same version: the refused workers are told
    // (η = 0: otherwise each refill waits out retry_after).
    next_hint(&mut hints, "after a no-signal drop").await;
    assert_eq!(s.policy_version, 0);
    let next = w.acquire(5).await.tasks;
    assert_eq!(next.len(), 1);
    assert!(
        got.iter().all(|g| g.task_id != next[0].task_id),
        "a new task, not the dropped one again: {}",
        next[0].task_id
    );
    // The same report delivered again: not acted on twice.
    let repeat = no_signal(&got[1]);
    bus.publish_durable(
        BUFFER_GROUP_DROPPED,
        &format!("dropped.{}.no_signal.again", repeat.group_id),
        Bytes::from(repeat.encode_to_vec()),
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let s = c.status().await.unwrap();
    assert_eq!(
        (s.accepted_groups, s.running_groups, s.capacity_left),
        (1, 1, 0)
    );
    // Before the completion, across a coordinator restart: the report
    // stays unacked until the completion has been handled.
    report(&bus, no_signal(&next[0])).await;
    seen(2).await;
    c.shutdown();
    c.join().await.unwrap();
    let (c, _, _, _) = start_paused(config(dir.path(), &tasks, 2, 0), &bus).await;
    let w = Worker::new(&bus, "w");
    w.register(8).await;
    // The report comes again (unacked) before or after the completion;
    // either way the completion is not counted and the task not reissued.
    while let Some(Some(_)) = futures::FutureExt::now_or_never(futures::StreamExt::next(&mut hints))
    {
    }
    let done = w.complete(&next[0]).await;
    assert!(done.accepted, "{}", done.reason);
    tokio::time::sleep(Duration::from_secs(12)).await;
    let s = c.status().await.unwrap();
    assert_eq!(
        (s.accepted_groups, s.running_groups, s.capacity_left),
        (1, 0, 1)
    );
    // Whichever came second, the report or the completion, returned the
    // group's capacity: the refused workers are told.
    next_hint(
        &mut hints,
        "after a completion whose drop report came first",
    )
    .await;
    w.register(8).await;
    let last = w.acquire(5).await.tasks;
    assert_eq!(last.len(), 1);
    assert!(
        got.iter()
            .chain(&next)
            .all(|g| g.task_id != last[0].task_id),
        "no dropped task is issued again"
    );
    c.shutdown();
    c.join().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn malformed_requests_get_a_reason_and_bad_worker_ids_are_refused() {
    let bus: Arc<dyn Bus> = Arc::new(LocalBus::new());
    let dir = tempfile::tempdir().unwrap();
    let tasks = write_tasks(dir.path(), 5);
    let (c, _, _, _) = start_paused(config(dir.path(), &tasks, 2, 0), &bus).await;
    let reply = bus
        .request(
            asyncrl_protos::subjects::TASKS_ACQUIRE,
            Bytes::from_static(b"\xff\xff\xff"),
            common::TIMEOUT,
        )
        .await
        .unwrap();
    let reply = asyncrl_protos::v1::AcquireTasksReply::decode(reply.as_ref()).unwrap();
    assert!(
        reply.reason.contains("malformed AcquireTasks"),
        "{}",
        reply.reason
    );
    let bad = Worker::new(&bus, "has.dot");
    let r = bad.register(1).await;
    assert!(
        !r.accepted && r.reason.contains("worker_id"),
        "{}",
        r.reason
    );
    assert!(bad.acquire(1).await.tasks.is_empty());
    // Unknown task ids and leases are refused.
    let w = Worker::new(&bus, "w");
    let r = w.complete_ids("arith-0", "nope-1", 2).await;
    assert!(
        !r.accepted && r.reason.contains("not issued by this coordinator"),
        "{}",
        r.reason
    );
    c.shutdown();
    c.join().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn the_capacity_model_is_exported() {
    let bus: Arc<dyn Bus> = Arc::new(LocalBus::new());
    let dir = tempfile::tempdir().unwrap();
    let tasks = write_tasks(dir.path(), 50);
    let (c, metrics, _, clock) = start_paused(config(dir.path(), &tasks, 4, 1), &bus).await;
    let learner = Learner::with_clock(&bus, clock).await;
    let w = Worker::new(&bus, "w");
    w.register(4).await;
    // Complete leases after 100 ms, announce a version every ~200 ms (the
    // time a version takes to be seen added).
    for v in 1..=3 {
        let got = w.acquire(2).await.tasks;
        tokio::time::sleep(Duration::from_millis(100)).await;
        for t in &got {
            assert!(w.complete(t).await.accepted);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        learner.announce(v).await;
        wait_version(&c, v).await;
    }
    let s = eventually("a recommendation", Duration::from_secs(5), || async {
        let s = c.status().await.unwrap();
        (s.rollout_workers_recommended > 0.0).then_some(s)
    })
    .await;
    // r ≈ 2 slots / 0.1 s = 20 groups/s, T ≈ 0.2 s: B / (r·T) ≈ 1.
    assert!(
        (1.0..=3.0).contains(&s.rollout_workers_recommended),
        "{}",
        s.rollout_workers_recommended
    );
    let text = metrics.encode_prometheus_text().unwrap();
    for name in [
        "asyncrl_rollout_workers_recommended",
        "asyncrl_capacity_worker_groups_per_second",
        "asyncrl_capacity_learner_step_seconds",
        "asyncrl_policy_version 3",
        "asyncrl_capacity_left",
        "asyncrl_running_groups",
        "asyncrl_knob_value{knob=\"eta\"} 1",
        "asyncrl_tasks_admitted_total 6",
        "asyncrl_tasks_completed_total 6",
    ] {
        assert!(text.contains(name), "missing {name}: {text}");
    }
    c.shutdown();
    c.join().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_changed_task_set_is_refused_at_restart_with_a_clear_error() {
    let bus: Arc<dyn Bus> = Arc::new(LocalBus::new());
    let dir = tempfile::tempdir().unwrap();
    let tasks = write_tasks(dir.path(), 10);
    let (c, _, _, _) = start_paused(config(dir.path(), &tasks, 2, 0), &bus).await;
    let w = Worker::new(&bus, "w");
    w.register(1).await;
    assert_eq!(w.acquire(1).await.tasks.len(), 1);
    c.shutdown();
    c.join().await.unwrap();
    write_tasks(dir.path(), 11);
    let err = Coordinator::start(
        config(dir.path(), &tasks, 2, 0),
        bus.clone(),
        Metrics::new(),
        Health::new(),
        &CancellationToken::new(),
    )
    .await
    .err()
    .expect("a changed task set must be refused");
    let msg = err.to_string();
    assert!(
        msg.contains("another task set")
            && msg.contains(asyncrl_protos::subjects::COORDINATOR_STATE_KEY),
        "{msg}"
    );
    // A bad tasks file is an error naming the file and line.
    std::fs::write(
        &tasks,
        "{\"prompt\": \"1+1=\", \"answer\": \"2\"}\nnot json\n",
    )
    .unwrap();
    let err = Coordinator::start(
        config(dir.path(), &tasks, 2, 0),
        Arc::new(LocalBus::new()),
        Metrics::new(),
        Health::new(),
        &CancellationToken::new(),
    )
    .await
    .err()
    .expect("a bad tasks file must be refused");
    assert!(
        err.to_string()
            .contains("arith.jsonl, line 2: not valid JSON"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinator_rides_out_a_nats_server_restart() {
    let mut server = NatsServer::start().unwrap();
    let bus = nats_bus(&server.url()).await;
    let dir = tempfile::tempdir().unwrap();
    let tasks = write_tasks(dir.path(), 50);
    let (c, _, health) = start(config(dir.path(), &tasks, 2, 0), &bus).await;
    let learner = Learner::new(&bus).await;
    let w = Worker::new(&bus, "w");
    w.register(4).await;
    let first = w.acquire(4).await.tasks;
    assert_eq!(first.len(), 2);
    server.kill();
    // The outage is seen before the server comes back.
    eventually(
        "the client sees the server gone",
        Duration::from_secs(15),
        || async { bus.connected_since_unix_ms().is_none().then_some(()) },
    )
    .await;
    server.restart().unwrap();
    // Requests are served again once the clients reconnected; the state
    // written before the outage is intact.
    let done = eventually(
        "completion after the restart",
        Duration::from_secs(15),
        || async {
            let r = w.bus.request(
                asyncrl_protos::subjects::TASKS_COMPLETE,
                Bytes::from(
                    asyncrl_protos::v1::CompleteTask {
                        worker_id: "w".into(),
                        task_id: first[0].task_id.clone(),
                        lease_id: first[0].lease_id.clone(),
                        num_trajectories: 2,
                    }
                    .encode_to_vec(),
                ),
                Duration::from_secs(1),
            );
            let r = r.await.ok()?;
            let r = asyncrl_protos::v1::CompleteTaskReply::decode(r.as_ref()).ok()?;
            r.accepted.then_some(r)
        },
    )
    .await;
    assert!(done.accepted);
    assert!(w.complete(&first[1]).await.accepted);
    // The version watch is back too.
    eventually(
        "version after the restart",
        Duration::from_secs(15),
        || async {
            learner.announce(1).await;
            (c.status().await.unwrap().policy_version == 1).then_some(())
        },
    )
    .await;
    assert_eq!(w.acquire(4).await.tasks.len(), 2);
    assert!(health.is_ready(), "{health:?}");
    c.shutdown();
    c.join().await.unwrap();
}

/// A task the workers return as failed (a prompt they cannot render or
/// fit) comes back first until its `max_task_attempts`-th failure; then it
/// is quarantined (counted, never issued again) and the run goes on with
/// the others instead of spinning on it.
#[tokio::test(start_paused = true)]
async fn a_task_that_keeps_failing_is_quarantined_and_never_issued_again() {
    let bus: Arc<dyn Bus> = Arc::new(LocalBus::new());
    let dir = tempfile::tempdir().unwrap();
    let tasks = write_tasks(dir.path(), 6);
    let mut cfg = config(dir.path(), &tasks, 2, 60);
    cfg.coordinator.max_task_attempts = 3;
    let (c, metrics, _, _) = start_paused(cfg, &bus).await;
    let w = Worker::new(&bus, "w");
    w.register(8).await;
    let bad = w.acquire(1).await.tasks.remove(0);
    let mut attempts = vec![bad.clone()];
    for _ in 0..2 {
        w.return_failed(&[attempts.last().unwrap()], "the prompt does not fit")
            .await;
        let again = w.acquire(1).await.tasks.remove(0);
        assert_eq!(again.task_id, bad.task_id, "a failed task comes back first");
        attempts.push(again);
    }
    let r = w
        .return_failed(&[attempts.last().unwrap()], "the prompt does not fit")
        .await;
    assert_eq!(r.returned, 1);
    let text = metrics.encode_prometheus_text().unwrap();
    assert!(
        text.contains("asyncrl_tasks_quarantined_total{reason=\"returned\"} 1"),
        "{text}"
    );
    // Three epochs of the other five tasks: the quarantined one never again.
    for _ in 0..15 {
        let t = w.acquire(1).await.tasks.remove(0);
        let id = |t: &asyncrl_protos::v1::Task| {
            asyncrl_protos::subjects::split_wire_task_id(&t.task_id)
                .unwrap()
                .0
                .to_owned()
        };
        assert_ne!(id(&t), id(&bad), "{} was issued again", t.task_id);
        assert!(w.complete(&t).await.accepted);
    }
    let text = metrics.encode_prometheus_text().unwrap();
    assert!(
        text.contains("asyncrl_tasks_quarantined_current 1"),
        "{text}"
    );
    c.shutdown();
    c.join().await.unwrap();
}

/// Over NATS a grant reply is kept below the server's max_payload: tasks
/// with long prompts are granted only as many as fit (the rest issued
/// again), and a task that alone does not fit is returned as failed and
/// quarantined, never granted into a reply that could not be delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grant_replies_fit_the_servers_max_payload() {
    let server = NatsServer::start_with_config(&asyncrl_testkit::ServerConfig {
        text: "max_payload: 65536\n".into(),
        files: Vec::new(),
        env: Vec::new(),
    })
    .unwrap();
    let bus = nats_bus(&server.url()).await;
    let max = bus.max_payload().expect("nats reports max_payload");
    assert_eq!(max, 65536);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("long.jsonl");
    let mut lines = String::new();
    for i in 0..12 {
        // Task 0 alone is over the limit; the others fit about 4 to a reply.
        let len = if i == 0 { max + 1024 } else { max / 5 };
        let prompt = format!("{}{i}=", "1+".repeat(len / 2));
        lines.push_str(&serde_json::json!({"prompt": prompt, "answer": "1"}).to_string());
        lines.push('\n');
    }
    std::fs::write(&path, lines).unwrap();
    let mut cfg = config(dir.path(), &path, 16, 4);
    cfg.coordinator.max_task_attempts = 2;
    cfg.coordinator.datasets[0].name = "long".into();
    // Every prompt fits the model's context: only the reply is too large.
    cfg.model.max_seq_len = 1 << 17;
    let (c, metrics, _) = start(cfg, &bus).await;
    let w = Worker::new(&bus, "w");
    w.register(64).await;
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..6 {
        let got = w.acquire(64).await.tasks;
        let size: usize = got.iter().map(|t| t.encoded_len()).sum();
        assert!(size < max, "a reply of {size} bytes (max_payload {max})");
        assert!(got.len() <= 5, "{} tasks in one reply", got.len());
        for t in &got {
            assert!(t.prompt.len() < max);
            let (id, _) = asyncrl_protos::subjects::split_wire_task_id(&t.task_id).unwrap();
            seen.insert(id.to_owned());
            assert!(w.complete(t).await.accepted);
        }
    }
    assert_eq!(seen.len(), 11, "every task that fits was granted: {seen:?}");
    eventually(
        "the oversized task quarantined",
        Duration::from_secs(10),
        || {
            let text = metrics.encode_prometheus_text().unwrap();
            async move {
                text.contains("asyncrl_tasks_quarantined_total{reason=\"too_large\"} 1")
                    .then_some(())
            }
        },
    )
    .await;
    c.shutdown();
    c.join().await.unwrap();
}

/// The coordinator publishes in the KV bucket which epochs are closed (no
/// task of them queued, leased or among its remembered completions), once
/// the state that closes them is stored: the buffer forgets the trained
/// tasks of those epochs and drops late copies of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_closed_epochs_are_published_once_no_task_of_them_can_count_again() {
    use asyncrl_protos::subjects::{CONTROL_BUCKET, EPOCHS_CLOSED_KEY};
    use asyncrl_protos::v1::EpochsClosed;

    let server = NatsServer::start().unwrap();
    let bus = nats_bus(&server.url()).await;
    let dir = tempfile::tempdir().unwrap();
    let tasks = write_tasks(dir.path(), 3);
    let mut cfg = config(dir.path(), &tasks, 3, 0);
    cfg.coordinator.completed_memory = 3;
    let (c, _, _) = start(cfg, &bus).await;
    let kv = bus.kv(CONTROL_BUCKET).await.unwrap();
    let closed = || async {
        kv.get(EPOCHS_CLOSED_KEY)
            .await
            .unwrap()
            .map(|e| EpochsClosed::decode(e.value).unwrap().through)
    };
    let learner = Learner::new(&bus).await;
    let w = Worker::new(&bus, "w1");
    w.register(8).await;
    // Epoch 0, completed: its completions are remembered (a stale drop
    // would issue them again), so it is open.
    let epoch0 = w.acquire(3).await.tasks;
    assert_eq!(epoch0.len(), 3);
    for t in &epoch0 {
        assert!(w.complete(t).await.accepted);
    }
    learner.announce(1).await;
    wait_version(&c, 1).await;
    let epoch1 = w.acquire(3).await.tasks;
    assert_eq!(epoch1.len(), 3);
    assert_eq!(closed().await, None);
    // Two of epoch 1 complete: one completion of epoch 0 is remembered.
    for t in &epoch1[..2] {
        assert!(w.complete(t).await.accepted);
    }
    assert_eq!(closed().await, None);
    assert!(w.complete(&epoch1[2]).await.accepted);
    eventually(
        "epoch 0 published as closed",
        Duration::from_secs(10),
        || async { (closed().await == Some(0)).then_some(()) },
    )
    .await;
    c.shutdown();
    c.join().await.unwrap();
}
