//! Unit tests of the scheduler: admission, leases, learner restarts,
//! stale drops and the persisted state.

use super::*;

fn params(b: u32) -> SchedulerParams {
    SchedulerParams {
        groups_per_step: b,
        group_size: 4,
        lease_timeout_ms: 1_000,
        completed_memory: 64,
        max_task_attempts: 3,
    }
}

fn sched(b: u32, n: u64) -> Scheduler {
    Scheduler::new(params(b), n, "fp", "L0")
}

/// The learner trains on groups whose completions reach the coordinator
/// later (a coordinator restart in between, or just a slow reply): each
/// completion is counted once, and capacity is what the rule says.
#[test]
fn completions_that_arrive_after_the_learner_trained_are_counted_once() {
    let b = 4;
    let mut s = sched(b, 100);
    s.on_version(0);
    let grants = s.acquire("w", 100, 0, 0);
    assert_eq!(grants.len(), 4);
    // The learner consumed all four groups before any completion arrived.
    assert!(matches!(s.on_version(1), VersionChange::Advanced { .. }));
    assert_eq!(s.accepted(), 0, "pending completions are still leases");
    for g in &grants {
        s.complete("w", &g.lease_id, Some(g.task.index), 4).unwrap();
    }
    assert_eq!(s.accepted(), 4);
    assert_eq!(s.capacity(0), 4, "(η + v + 1)·B − accepted − running");
    // The same across a restart from the persisted state.
    let grants = s.acquire("w", 100, 0, 0);
    let mut r = Scheduler::from_proto(params(b), &s.to_proto(), 100, "fp", 0).unwrap();
    assert!(matches!(r.on_version(2), VersionChange::Advanced { .. }));
    for g in &grants {
        r.complete("w", &g.lease_id, Some(g.task.index), 4).unwrap();
    }
    assert_eq!(r.accepted(), 8);
    assert_eq!(r.capacity(0), 4);
    // State that was lost still cannot make capacity burst.
    let mut lost = sched(b, 100);
    lost.on_version(5);
    assert_eq!(lost.accepted(), 20);
    assert_eq!(lost.capacity(1), 8);
}

#[test]
fn eta_zero_admits_exactly_b_groups_per_version() {
    let b = 4;
    let mut s = sched(b, 100);
    for v in 0..5 {
        assert_eq!(
            s.on_version(v),
            if v == 0 {
                VersionChange::Unchanged
            } else {
                VersionChange::Advanced { from: v - 1, to: v }
            }
        );
        let grants = s.acquire("w", 100, 0, 0);
        assert_eq!(grants.len(), b as usize, "version {v}");
        assert!(grants.iter().all(|g| g.admission_version == v));
        assert!(s.acquire("w", 100, 0, 0).is_empty());
        for g in &grants {
            let c = s.complete("w", &g.lease_id, Some(g.task.index), 4).unwrap();
            assert!(matches!(c, Completion::Accepted { .. }));
        }
        // Completing frees nothing: the learner must consume first.
        assert!(s.acquire("w", 100, 0, 0).is_empty());
        assert_eq!(s.capacity(0), 0);
    }
    assert_eq!(s.accepted(), 5 * u64::from(b));
}

#[test]
fn admission_rule_counts_running_and_accepted() {
    let mut s = sched(2, 100);
    // (η + v + 1)·B = (1 + 0 + 1)·2 = 4.
    assert_eq!(s.capacity(1), 4);
    let g = s.acquire("w", 3, 1, 0);
    assert_eq!(g.len(), 3);
    assert_eq!(s.capacity(1), 1);
    assert_eq!(s.acquire("w", 3, 1, 0).len(), 1);
    assert_eq!(s.capacity(1), 0);
    // Completing moves a group from running to accepted: no new room.
    for g in &g[..2] {
        s.complete("w", &g.lease_id, Some(g.task.index), 4).unwrap();
    }
    assert_eq!((s.accepted(), s.running(), s.capacity(1)), (2, 2, 0));
    // The learner consumed B = 2 groups: B more may be admitted.
    s.on_version(1);
    assert_eq!(s.capacity(1), 2);
    assert_eq!(s.acquire("w", 5, 1, 0).len(), 2);
    // Lowering η can make the capacity negative: nothing is admitted.
    assert_eq!(s.capacity(0), -2);
    assert!(s.acquire("w", 1, 0, 0).is_empty());
}

#[test]
fn expired_lease_puts_the_task_back_at_the_front_and_refuses_its_completion() {
    let mut s = sched(8, 10);
    let g = s.acquire("w1", 3, 4, 0);
    assert_eq!(
        g.iter().map(|g| g.task.index).collect::<Vec<_>>(),
        [0, 1, 2]
    );
    // Heartbeat keeps lease 0 alive; 1 and 2 expire.
    assert!(s.heartbeat("w1", &[g[0].lease_id.clone()], 600).is_empty());
    let ended = s.expire_due(1_000);
    assert_eq!(
        ended.iter().map(|e| e.lease.task.index).collect::<Vec<_>>(),
        [1, 2]
    );
    assert_eq!(s.running(), 1);
    // The expired tasks come first, in their order, then the cursor.
    let again = s.acquire("w2", 3, 4, 1_000);
    assert_eq!(
        again.iter().map(|g| g.task.index).collect::<Vec<_>>(),
        [1, 2, 3]
    );
    assert_ne!(again[0].lease_id, g[1].lease_id);
    let err = s.complete("w1", &g[1].lease_id, Some(1), 4).unwrap_err();
    assert!(matches!(err, CompleteRefusal::Expired { .. }), "{err}");
    assert!(err.to_string().contains("expired"), "{err}");
    // The heartbeat of an expired lease revokes it.
    assert_eq!(
        s.heartbeat("w1", &[g[1].lease_id.clone()], 1_100),
        vec![g[1].lease_id.clone()]
    );
    // Lease 0 lives until its extended deadline.
    assert!(s.expire_due(1_500).is_empty());
    assert_eq!(s.expire_due(1_600).len(), 1);
}

#[test]
fn completion_checks_lease_task_worker_and_group_size() {
    let mut s = sched(8, 10);
    let g = s.acquire("w1", 1, 4, 0).remove(0);
    assert_eq!(
        s.complete("w1", "nope", Some(0), 4),
        Err(CompleteRefusal::MalformedLease)
    );
    assert_eq!(
        s.complete("w1", "L0-999", Some(0), 4),
        Err(CompleteRefusal::UnknownLease)
    );
    assert_eq!(
        s.complete("w1", &g.lease_id, Some(5), 4),
        Err(CompleteRefusal::WrongTask)
    );
    assert_eq!(
        s.complete("w1", &g.lease_id, None, 4),
        Err(CompleteRefusal::WrongTask)
    );
    assert_eq!(
        s.complete("w2", &g.lease_id, Some(0), 4),
        Err(CompleteRefusal::WrongWorker {
            holder: "w1".into()
        })
    );
    assert_eq!(
        s.complete("w1", &g.lease_id, Some(0), 3),
        Err(CompleteRefusal::WrongGroupSize { got: 3, want: 4 })
    );
    assert_eq!(s.running(), 1);
    assert!(matches!(
        s.complete("w1", &g.lease_id, Some(0), 4),
        Ok(Completion::Accepted { .. })
    ));
    // A retry is answered yes and counted once.
    assert_eq!(
        s.complete("w1", &g.lease_id, Some(0), 4),
        Ok(Completion::AlreadyCompleted)
    );
    assert_eq!(s.accepted(), 1);
}

#[test]
fn returned_and_dead_worker_leases_are_reissued_first() {
    let mut s = sched(8, 10);
    let a = s.acquire("a", 2, 4, 0);
    let b = s.acquire("b", 2, 4, 0);
    // Only its own leases can be returned.
    let r = s.return_leases(
        "a",
        &[a[1].lease_id.clone(), b[0].lease_id.clone()],
        5,
        false,
    );
    assert_eq!(r.len(), 1);
    let dead = s.expire_worker("b", 6);
    assert_eq!(dead.len(), 2);
    assert_eq!(s.running(), 1);
    let next = s.acquire("c", 4, 4, 7);
    assert_eq!(
        next.iter().map(|g| g.task.index).collect::<Vec<_>>(),
        [2, 3, 1, 4]
    );
}

#[test]
fn epochs_wrap_the_cursor() {
    let mut s = sched(64, 3);
    let g = s.acquire("w", 7, 4, 0);
    let got: Vec<(u64, u64)> = g.iter().map(|g| (g.task.epoch, g.task.index)).collect();
    assert_eq!(
        got,
        [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0)]
    );
    assert_eq!((s.epoch(), s.cursor()), (2, 1));
}

#[test]
fn learner_restart_keeps_accepted_unless_the_version_went_down() {
    let mut s = sched(4, 100);
    assert_eq!(s.on_learner_session("s1", 0), VersionChange::Unchanged);
    let g = s.acquire("w", 12, 2, 0);
    for g in &g[..10] {
        s.complete("w", &g.lease_id, Some(g.task.index), 4).unwrap();
    }
    s.on_version(2);
    assert_eq!(s.accepted(), 10);
    // Same session again: nothing happens.
    assert_eq!(s.on_learner_session("s1", 2), VersionChange::Unchanged);
    // A new session that carries on at version 2: the two accepted groups
    // it has not trained are still in the buffer, so no new capacity.
    assert_eq!(
        s.on_learner_session("s2", 2),
        VersionChange::LearnerRestart {
            version: 2,
            accepted_before: 10,
            reset: false
        }
    );
    assert_eq!(s.accepted(), 10);
    // A version that goes down is a restart from an older state: reset
    // to v · B.
    assert_eq!(
        s.on_version(1),
        VersionChange::LearnerRestart {
            version: 1,
            accepted_before: 10,
            reset: true
        }
    );
    assert_eq!(s.accepted(), 4);
    // So is a new session that starts below the known version (version
    // 2 first raised accepted to what 2 · B consumed groups imply:
    // 8 − 2 running).
    s.on_version(2);
    assert_eq!(s.accepted(), 6);
    assert_eq!(
        s.on_learner_session("s3", 1),
        VersionChange::LearnerRestart {
            version: 2,
            accepted_before: 6,
            reset: true
        }
    );
    assert_eq!(s.accepted(), 8);
    // Running leases are untouched.
    assert_eq!(s.running(), 2);
}

#[test]
fn a_fresh_state_does_not_burst_when_the_learner_is_ahead() {
    let mut s = sched(4, 100);
    s.on_version(10);
    assert_eq!(s.accepted(), 40);
    assert_eq!(s.capacity(1), 8);
}

#[test]
fn stale_drop_returns_capacity_and_reissues_the_task() {
    let mut s = sched(2, 100);
    let g = s.acquire("w", 2, 0, 0);
    for g in &g {
        s.complete("w", &g.lease_id, Some(g.task.index), 4).unwrap();
    }
    assert_eq!(s.capacity(0), 0);
    assert_eq!(
        s.on_group_dropped(&g[1].lease_id, DropKind::Ignored),
        Dropped::Ignored
    );
    assert_eq!(
        s.on_group_dropped(&g[1].lease_id, DropKind::Stale),
        Dropped::Requeued(TaskRef { index: 1, epoch: 0 })
    );
    assert_eq!(s.stale_dropped_total, 1);
    assert_eq!(s.capacity(0), 1);
    let again = s.acquire("w", 5, 0, 0);
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].task.index, 1);
    // The same report delivered again (its ack was lost): neither acted on
    // nor counted twice.
    assert_eq!(
        s.on_group_dropped(&g[1].lease_id, DropKind::Stale),
        Dropped::Unknown
    );
    assert_eq!(s.stale_dropped_total, 1);
    assert_eq!(s.queue_len(), 0, "the task is issued again once, not twice");
    // Unknown group: nothing happens.
    assert_eq!(
        s.on_group_dropped("L0-77", DropKind::Stale),
        Dropped::Unknown
    );
    assert_eq!(s.stale_dropped_total, 1);
}

#[test]
fn a_quarantined_group_returns_capacity_and_reissues_its_task_without_counting_as_stale() {
    let mut s = sched(2, 100);
    let g = s.acquire("w", 2, 0, 0);
    for g in &g {
        s.complete("w", &g.lease_id, Some(g.task.index), 4).unwrap();
    }
    assert_eq!(s.capacity(0), 0);
    assert_eq!(
        s.on_group_dropped(&g[0].lease_id, DropKind::Refused),
        Dropped::Requeued(TaskRef { index: 0, epoch: 0 })
    );
    assert_eq!(s.stale_dropped_total, 0);
    assert_eq!(s.capacity(0), 1);
    let again = s.acquire("w", 5, 0, 0);
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].task.index, 0);
}

#[test]
fn persisted_state_round_trips_and_refuses_another_dataset() {
    let mut s = sched(4, 10);
    s.on_learner_session("sess", 0);
    let g = s.acquire("w1", 6, 4, 0);
    s.complete("w1", &g[0].lease_id, Some(0), 4).unwrap();
    s.expire_worker("w1", 5);
    let g2 = s.acquire("w2", 2, 4, 6);
    s.on_version(1);
    let proto = s.to_proto();
    let back = Scheduler::from_proto(params(4), &proto, 10, "fp", 10_000).unwrap();
    assert!(back.same_state(&s));
    assert!(back.leases().all(|l| l.deadline_ms == 11_000));
    assert_eq!(back.lease(&g2[0].lease_id).unwrap().worker.as_ref(), "w2");
    let err = Scheduler::from_proto(params(4), &proto, 10, "other", 0).unwrap_err();
    assert!(
        err.to_string()
            .contains(asyncrl_protos::subjects::COORDINATOR_STATE_KEY),
        "{err}"
    );
    let err = Scheduler::from_proto(params(4), &proto, 11, "fp", 0).unwrap_err();
    assert!(matches!(err, StateError::DatasetChanged { .. }));
    let mut bad = proto.clone();
    bad.leases[0].worker = 99;
    assert!(matches!(
        Scheduler::from_proto(params(4), &bad, 10, "fp", 0),
        Err(StateError::Corrupt(_))
    ));
}

#[test]
fn completed_memory_is_bounded() {
    let mut p = params(1000);
    p.completed_memory = 3;
    let mut s = Scheduler::new(p, 100, "fp", "L0");
    let g = s.acquire("w", 10, 4, 0);
    for g in &g {
        s.complete("w", &g.lease_id, Some(g.task.index), 4).unwrap();
    }
    assert_eq!(s.to_proto().completed.len(), 3);
    // The oldest are forgotten: a retry of those is refused as unknown.
    assert_eq!(
        s.complete("w", &g[0].lease_id, Some(0), 4),
        Err(CompleteRefusal::UnknownLease)
    );
    assert_eq!(
        s.complete("w", &g[9].lease_id, Some(9), 4),
        Ok(Completion::AlreadyCompleted)
    );
}

#[test]
fn the_persisted_state_lists_each_worker_once_however_its_leases_were_granted() {
    let mut s = sched(1000, 100);
    // Many acquire calls of interleaved workers, some completed, some
    // expired: each worker is written once, and a restore gives the same
    // state back.
    let mut held = Vec::new();
    for round in 0..20 {
        for w in ["w1", "w2", "w3"] {
            held.extend(s.acquire(w, 1, 4, round).into_iter().map(|g| (w, g)));
        }
    }
    for (w, g) in held.iter().step_by(2) {
        s.complete(w, &g.lease_id, Some(g.task.index), 4).unwrap();
    }
    s.expire_worker("w3", 50);
    let proto = s.to_proto();
    let mut names = proto.workers.clone();
    names.sort();
    assert_eq!(names, ["w1", "w2", "w3"]);
    let back = Scheduler::from_proto(params(1000), &proto, 100, "fp", 0).unwrap();
    assert!(back.same_state(&s));
    // New leases of the restored state's workers are written under the
    // same entries.
    let mut back = back;
    back.acquire("w2", 1, 4, 60);
    assert_eq!(back.to_proto().workers.len(), 3);
}

#[test]
fn the_state_is_written_as_its_protobuf_message() {
    use prost::Message;

    // Everything set: queue, leases (a negative version), completions,
    // several workers, counters; and the empty state.
    let mut s = sched(1000, 50);
    let written = |s: &Scheduler| {
        let bytes = s.encode_state();
        assert_eq!(bytes.len(), s.to_proto().encoded_len());
        asyncrl_protos::v1::CoordinatorState::decode(bytes.as_slice()).unwrap()
    };
    assert_eq!(written(&s), s.to_proto());
    s.on_learner_session("sess", 0);
    let mut held = Vec::new();
    for (i, w) in ["w1", "w2", "w3", "w2"].iter().enumerate() {
        held.extend(
            s.acquire(w, 3, 4, 1_700_000_000_000 + i as i64)
                .into_iter()
                .map(|g| (*w, g)),
        );
    }
    for (w, g) in held.iter().take(4) {
        s.complete(w, &g.lease_id, Some(g.task.index), 4).unwrap();
    }
    s.expire_worker("w3", 1_700_000_000_100);
    s.on_group_dropped(&held[0].1.lease_id, DropKind::Stale);
    s.on_version(2);
    s.on_version(-1);
    s.acquire("w4", 2, 4, 1_700_000_000_200);
    let proto = s.to_proto();
    assert!(!proto.queue.is_empty() && !proto.completed.is_empty() && proto.workers.len() >= 3);
    assert!(proto.leases.iter().any(|l| l.admission_version < 0));
    assert_eq!(written(&s), proto);
    // A restored state writes the same.
    let back = Scheduler::from_proto(params(1000), &proto, 50, "fp", 0).unwrap();
    assert_eq!(written(&back), proto);
}

#[test]
fn a_task_that_fails_max_task_attempts_times_is_quarantined_and_never_issued_again() {
    // Three tasks, max_task_attempts = 3.
    let mut s = sched(4, 3);
    let mut fails = 0;
    loop {
        let g = s.acquire("w", 1, 8, 0);
        assert_eq!(g.len(), 1);
        if g[0].task.index != 1 {
            s.complete("w", &g[0].lease_id, Some(g[0].task.index), 4)
                .unwrap();
            continue;
        }
        // Task 1 cannot be done: the worker returns it as failed. It comes
        // back first (front of the queue) until its third failure.
        let ended = s.return_leases("w", std::slice::from_ref(&g[0].lease_id), 0, true);
        fails += 1;
        assert_eq!(ended.len(), 1);
        assert_eq!(ended[0].quarantined, fails == 3, "failure {fails}");
        if fails == 3 {
            break;
        }
        assert_eq!(s.queue_len(), 1);
    }
    assert_eq!(s.queue_len(), 0);
    assert!(s.quarantined().contains(&1));
    // Later epochs skip it; the others go on.
    let issued: Vec<u64> = (0..6)
        .map(|_| {
            let g = s.acquire("w", 1, 100, 0);
            s.complete("w", &g[0].lease_id, Some(g[0].task.index), 4)
                .unwrap();
            g[0].task.index
        })
        .collect();
    assert!(!issued.contains(&1), "{issued:?}");
    // A draining worker's return is no failure: nothing is quarantined.
    let g = s.acquire("w", 1, 100, 0);
    for _ in 0..5 {
        let e = s.return_leases("w", std::slice::from_ref(&g[0].lease_id), 0, false);
        assert!(e.iter().all(|e| !e.quarantined));
    }
    // The quarantine and the failure counts survive a restart.
    let back = Scheduler::from_proto(params(4), &s.to_proto(), 3, "fp", 0).unwrap();
    assert!(back.same_state(&s));
    assert!(back.quarantined().contains(&1));
    let decoded = <asyncrl_protos::v1::CoordinatorState as asyncrl_protos::Message>::decode(
        s.encode_state().as_slice(),
    )
    .unwrap();
    assert_eq!(decoded, s.to_proto());
}

#[test]
fn a_task_whose_groups_the_learner_refuses_is_quarantined_after_max_task_attempts() {
    let mut s = sched(1, 2);
    let mut last = Dropped::Ignored;
    for _ in 0..3 {
        let g = s.acquire("w", 1, 8, 0);
        assert_eq!(g[0].task.index, 0, "the refused task comes back first");
        s.complete("w", &g[0].lease_id, Some(0), 4).unwrap();
        let before = s.capacity(8);
        last = s.on_group_dropped(&g[0].lease_id, DropKind::Refused);
        assert_eq!(s.capacity(8), before + 1, "capacity returned");
    }
    assert_eq!(last, Dropped::Quarantined(TaskRef { index: 0, epoch: 0 }));
    // Every task quarantined: nothing is issued, nothing loops.
    for _ in 0..3 {
        let g = s.acquire("w", 1, 8, 0);
        assert_eq!(g[0].task.index, 1);
        s.complete("w", &g[0].lease_id, Some(1), 4).unwrap();
        s.on_group_dropped(&g[0].lease_id, DropKind::Refused);
    }
    assert_eq!(s.quarantined().len(), 2);
    assert!(s.acquire("w", 4, 8, 0).is_empty());
}

/// Found by the loss invariant: the buffer stores a group as soon as its
/// trajectories are acked, so its stale drop can be reported before the
/// worker's completion arrives. The completion then gives the task back
/// (issued again, not counted as accepted) instead of being counted and
/// the task lost.
#[test]
fn a_stale_drop_reported_before_the_completion_still_reissues_the_task() {
    let mut s = sched(2, 100);
    let g = s.acquire("w", 2, 0, 0);
    assert_eq!(
        s.on_group_dropped(&g[0].lease_id, DropKind::Stale),
        Dropped::BeforeCompletion
    );
    let done = s.complete("w", &g[0].lease_id, Some(g[0].task.index), 4);
    assert!(
        matches!(done, Ok(Completion::DroppedBefore { .. })),
        "{done:?}"
    );
    assert_eq!(s.accepted(), 0, "not counted");
    // A retry of that completion is answered as done, counted once.
    assert_eq!(
        s.complete("w", &g[0].lease_id, Some(g[0].task.index), 4),
        Ok(Completion::AlreadyCompleted)
    );
    assert_eq!(s.accepted(), 0);
    // The task comes back first; the other lease completes as usual.
    s.complete("w", &g[1].lease_id, Some(g[1].task.index), 4)
        .unwrap();
    assert_eq!(s.accepted(), 1);
    let again = s.acquire("w", 1, 0, 0);
    assert_eq!(again[0].task, g[0].task);
}

/// An epoch closes once none of its tasks is queued, leased or remembered
/// as completed: a lease that expires, a completion the buffer may still
/// drop, keep it open; the persisted state gives the same answer.
#[test]
fn an_epoch_closes_once_no_task_of_it_is_queued_leased_or_remembered() {
    let mut p = params(64);
    p.completed_memory = 2;
    let mut s = Scheduler::new(p.clone(), 2, "fp", "L0");
    assert_eq!(s.closed_epoch(), None);
    // Epoch 0's two tasks, and the first of epoch 1.
    let g = s.acquire("w", 3, 4, 0);
    assert_eq!(s.closed_epoch(), None, "epoch 0's leases are live");
    s.complete("w", &g[0].lease_id, Some(0), 4).unwrap();
    // Task 1 of epoch 0 expires: it is queued again, epoch 0 stays open.
    assert!(s.heartbeat("w", &[g[2].lease_id.clone()], 500).is_empty());
    assert_eq!(s.expire_due(1_000).len(), 1);
    assert_eq!(s.closed_epoch(), None, "epoch 0 has a queued task");
    let again = s.acquire("w", 1, 4, 1_000);
    assert_eq!(again[0].task, TaskRef { index: 1, epoch: 0 });
    s.complete("w", &again[0].lease_id, Some(1), 4).unwrap();
    assert_eq!(
        s.closed_epoch(),
        None,
        "its completions are remembered: a stale drop would issue them again"
    );
    // A stale drop of a remembered completion queues its task again.
    assert_eq!(
        s.on_group_dropped(&again[0].lease_id, DropKind::Stale),
        Dropped::Requeued(TaskRef { index: 1, epoch: 0 })
    );
    let third = s.acquire("w", 1, 4, 1_000);
    assert_eq!(third[0].task, TaskRef { index: 1, epoch: 0 });
    s.complete("w", &third[0].lease_id, Some(1), 4).unwrap();
    assert_eq!(s.closed_epoch(), None);
    // Two later completions push epoch 0's out of the memory of two.
    s.complete("w", &g[2].lease_id, Some(0), 4).unwrap();
    assert_eq!(
        s.closed_epoch(),
        None,
        "one completion of epoch 0 is remembered"
    );
    let more = s.acquire("w", 1, 4, 1_000);
    assert_eq!(more[0].task.epoch, 1);
    s.complete("w", &more[0].lease_id, Some(1), 4).unwrap();
    assert_eq!(s.closed_epoch(), Some(0));
    // Restarted from the persisted state: the same.
    let r = Scheduler::from_proto(p, &s.to_proto(), 2, "fp", 1_000).unwrap();
    assert_eq!(r.closed_epoch(), Some(0));
    // The cursor's epoch is open even with nothing of it issued yet.
    assert_eq!(s.epoch(), 2);
    assert_eq!(
        s.closed_epoch(),
        Some(0),
        "epoch 1's completions are remembered"
    );
}

#[test]
fn drop_kinds_follow_the_buffer_reasons() {
    use asyncrl_protos::GroupDropReason as R;
    assert_eq!(DropKind::of(R::Stale), DropKind::Stale);
    assert_eq!(DropKind::of(R::Quarantined), DropKind::Refused);
    assert_eq!(DropKind::of(R::NoSignal), DropKind::NoSignal);
    for r in [
        R::Unspecified,
        R::Superseded,
        R::DuplicateAttempt,
        R::Expired,
    ] {
        assert_eq!(DropKind::of(r), DropKind::Ignored);
        assert!(!r.frees_capacity());
    }
    for r in [R::Stale, R::Quarantined, R::NoSignal] {
        assert!(r.frees_capacity());
        assert_eq!(DropKind::of(r).reissues(), r.reissues_task());
    }
}

/// Dynamic sampling: a group without reward signal frees its capacity
/// once, and its task is done (not issued again, not counted as stale).
#[test]
fn a_no_signal_drop_frees_capacity_once_without_reissuing_the_task() {
    let mut s = sched(2, 100);
    let g = s.acquire("w", 2, 0, 0);
    for g in &g {
        s.complete("w", &g.lease_id, Some(g.task.index), 4).unwrap();
    }
    assert_eq!((s.accepted(), s.capacity(0)), (2, 0));
    assert_eq!(
        s.on_group_dropped(&g[1].lease_id, DropKind::NoSignal),
        Dropped::Freed(TaskRef { index: 1, epoch: 0 })
    );
    assert_eq!((s.accepted(), s.capacity(0)), (1, 1));
    assert_eq!(s.queue_len(), 0, "the task is not issued again");
    assert_eq!(s.stale_dropped_total, 0);
    // Delivered again (its ack was lost): not acted on twice.
    assert_eq!(
        s.on_group_dropped(&g[1].lease_id, DropKind::NoSignal),
        Dropped::Unknown
    );
    assert_eq!((s.accepted(), s.capacity(0)), (1, 1));
    // The freed capacity admits the next task of the data set.
    let next = s.acquire("w", 5, 0, 0);
    assert_eq!(next.len(), 1);
    assert_eq!(next[0].task, TaskRef { index: 2, epoch: 0 });
}

/// The report overtakes the completion, and is delivered again before
/// and after it, and after a coordinator restart: the capacity is freed
/// once (the completion is not counted), the task is never issued again.
#[test]
fn a_no_signal_drop_reported_before_the_completion_frees_capacity_once() {
    let mut s = sched(2, 100);
    let g = s.acquire("w", 2, 0, 0);
    for _ in 0..2 {
        assert_eq!(
            s.on_group_dropped(&g[0].lease_id, DropKind::NoSignal),
            Dropped::BeforeCompletion
        );
    }
    assert_eq!(s.capacity(0), 0, "still running");
    // A coordinator restart forgets the early drop; the report, not acked,
    // comes again.
    let mut s = Scheduler::from_proto(params(2), &s.to_proto(), 100, "fp", 0).unwrap();
    assert_eq!(
        s.on_group_dropped(&g[0].lease_id, DropKind::NoSignal),
        Dropped::BeforeCompletion
    );
    let done = s.complete("w", &g[0].lease_id, Some(g[0].task.index), 4);
    assert!(
        matches!(
            done,
            Ok(Completion::DroppedBefore {
                kind: DropKind::NoSignal,
                requeued: false,
                ..
            })
        ),
        "{done:?}"
    );
    assert_eq!((s.accepted(), s.running(), s.capacity(0)), (0, 1, 1));
    assert_eq!(s.queue_len(), 0);
    // A retry of the completion is answered as done, counted once.
    assert_eq!(
        s.complete("w", &g[0].lease_id, Some(g[0].task.index), 4),
        Ok(Completion::AlreadyCompleted)
    );
    // The report delivered again after the completion, before and after a
    // restart: nothing more.
    for _ in 0..2 {
        assert_eq!(
            s.on_group_dropped(&g[0].lease_id, DropKind::NoSignal),
            Dropped::AlreadyDropped
        );
        assert_eq!((s.accepted(), s.capacity(0)), (0, 1));
        s = Scheduler::from_proto(params(2), &s.to_proto(), 100, "fp", 0).unwrap();
    }
    // The other lease completes as usual; the freed slot admits task 2.
    s.complete("w", &g[1].lease_id, Some(g[1].task.index), 4)
        .unwrap();
    assert_eq!((s.accepted(), s.capacity(0)), (1, 1));
    let next = s.acquire("w", 5, 0, 0);
    assert_eq!(next.len(), 1);
    assert_eq!(next[0].task, TaskRef { index: 2, epoch: 0 });
    // A completion handled as dropped does not keep its epoch open.
    assert!(s.to_proto().completed.iter().any(|c| c.dropped));
}

/// A stale report that overtook its completion and is delivered again
/// after it (it stays unacked until then) issues the task once.
#[test]
fn a_stale_report_delivered_again_after_its_completion_reissues_the_task_once() {
    let mut s = sched(2, 100);
    let g = s.acquire("w", 2, 0, 0);
    assert_eq!(
        s.on_group_dropped(&g[0].lease_id, DropKind::Stale),
        Dropped::BeforeCompletion
    );
    let done = s.complete("w", &g[0].lease_id, Some(g[0].task.index), 4);
    assert!(
        matches!(
            done,
            Ok(Completion::DroppedBefore {
                kind: DropKind::Stale,
                requeued: true,
                ..
            })
        ),
        "{done:?}"
    );
    assert_eq!(
        s.on_group_dropped(&g[0].lease_id, DropKind::Stale),
        Dropped::AlreadyDropped
    );
    assert_eq!(s.queue_len(), 1, "issued again once");
    assert_eq!(s.accepted(), 0);
    assert_eq!(s.stale_dropped_total, 1);
}
