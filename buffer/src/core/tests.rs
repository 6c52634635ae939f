use asyncrl_protos::arrow_schema::{from_record_batch, to_record_batch};

use super::*;
use crate::testing::{traj, traj_of};

fn core(sampling: SamplingPolicy, k: u32) -> Core {
    let mut c = Core::new(sampling, k, 7);
    c.add_segment(1, true);
    c
}

/// Applies trajectories as one written batch to `segment`.
fn feed(c: &mut Core, trajs: &[Trajectory], segment: u64) -> Applied {
    let batch = to_record_batch(trajs).unwrap();
    let metas: Vec<RowMeta> = trajs.iter().map(|t| RowMeta::of(t).unwrap()).collect();
    c.apply(batch, &metas, segment, false)
}

/// A recovery: `records` seed a new core, `segments` are replayed into it.
fn recover(
    sampling: SamplingPolicy,
    k: u32,
    records: &[Record],
    segments: &[Vec<Trajectory>],
) -> Core {
    let mut c = core(sampling, k);
    c.seed(records);
    for t in segments {
        let batch = to_record_batch(t).unwrap();
        let metas: Vec<RowMeta> = t.iter().map(|t| RowMeta::of(t).unwrap()).collect();
        c.apply(batch, &metas, 1, true);
    }
    c
}

/// `n` complete groups of size `g`, numbered from `first`, at `version`.
fn groups(first: u32, n: u32, g: u32, version: i32) -> Vec<Trajectory> {
    (first * g..(first + n) * g)
        .map(|i| traj(i, g, version, 4))
        .collect()
}

fn ask(step: u64, version: i32, eta: u32, n: usize) -> Ask {
    Ask::next(step, version, eta, n)
}

/// plan + commit, as the server does (records are not persisted here).
fn serve(c: &mut Core, a: Ask) -> (Outcome, Vec<DroppedGroup>) {
    let plan = c.plan(a);
    let outcome = plan.outcome.clone();
    let dropped = c.commit(plan);
    (outcome, dropped)
}

fn served(outcome: &Outcome) -> Vec<String> {
    match outcome {
        Outcome::Serve(g) | Outcome::Replay(g) => g.iter().map(|s| s.to_string()).collect(),
        other => panic!("expected a batch, got {other:?}"),
    }
}

fn names(ids: &[u32]) -> Vec<String> {
    ids.iter().map(|i| format!("lease-{i}")).collect()
}

#[test]
fn groups_complete_at_g_members_and_duplicates_are_dropped() {
    let mut c = core(SamplingPolicy::Fifo, 1);
    let t = groups(0, 2, 4, 0);
    let a = feed(&mut c, &t[..3], 1);
    assert_eq!((a.stored, a.newly_ready), (3, 0));
    assert_eq!(c.stats().collecting_groups, 1);
    // The same trajectory again (a redelivery) is a duplicate.
    let a = feed(&mut c, &t[..1], 1);
    assert_eq!((a.stored, a.duplicates), (0, 1));
    let a = feed(&mut c, &t[3..], 1);
    assert_eq!((a.stored, a.newly_ready), (5, 2));
    let s = c.stats();
    assert_eq!(
        (s.ready_groups, s.collecting_groups, s.live_trajectories),
        (2, 0, 8)
    );
    assert_eq!(s.live_tokens, 8 * (16 + 4));
}

#[test]
fn group_contract_violations_are_reported_not_stored() {
    let mut c = core(SamplingPolicy::Fifo, 1);
    let ok = traj_of("t", "g", 0, 0, 3, 0, 4);
    let same_index = traj_of("t", "g", 1, 0, 3, 0, 4);
    let other_size = traj_of("t", "g", 2, 1, 4, 0, 4);
    let other_task = traj_of("u", "g", 3, 1, 3, 0, 4);
    let a = feed(&mut c, &[ok, same_index, other_size, other_task], 1);
    assert_eq!(a.stored, 1);
    let rows: Vec<usize> = a.violations.iter().map(|(r, _)| *r).collect();
    assert_eq!(rows, vec![1, 2, 3]);
    assert!(
        a.violations[0].1.contains("index_in_group 0"),
        "{:?}",
        a.violations
    );
    assert!(
        a.violations[1].1.contains("group_size"),
        "{:?}",
        a.violations
    );
    assert!(
        a.violations[2].1.contains("belongs to task"),
        "{:?}",
        a.violations
    );
    // A member beyond G of a complete group.
    let mut c = core(SamplingPolicy::Fifo, 1);
    feed(&mut c, &groups(0, 1, 2, 0), 1);
    let extra = traj_of("task-0", "lease-0", 99, 1, 2, 0, 4);
    let a = feed(&mut c, &[extra], 1);
    assert_eq!(a.violations.len(), 1);
    assert!(a.violations[0].1.contains("already complete"));
}

#[test]
fn first_complete_attempt_wins_and_others_are_dropped() {
    let mut c = core(SamplingPolicy::Fifo, 1);
    // Attempt A of task T: 1 of 2; attempt B: complete; then A's second and
    // a late attempt C, complete.
    let a0 = traj_of("T", "A", 0, 0, 2, 0, 4);
    let b = [
        traj_of("T", "B", 1, 0, 2, 0, 4),
        traj_of("T", "B", 2, 1, 2, 0, 4),
    ];
    let a1 = traj_of("T", "A", 3, 1, 2, 0, 4);
    let cc = [
        traj_of("T", "C", 4, 0, 2, 0, 4),
        traj_of("T", "C", 5, 1, 2, 0, 4),
    ];
    feed(&mut c, &[a0], 1);
    let r = feed(&mut c, &b, 1);
    assert_eq!(r.newly_ready, 1);
    assert_eq!(
        r.dropped,
        vec![DroppedGroup {
            task: "T".into(),
            group: "A".into(),
            reason: GroupDropReason::Superseded,
            trajectories: 1
        }]
    );
    let r = feed(&mut c, &[a1], 1);
    assert_eq!((r.stored, r.superseded), (0, 1));
    let r = feed(&mut c, &cc, 1);
    assert_eq!((r.stored, r.superseded), (0, 2));
    assert_eq!(r.dropped.len(), 1);
    assert_eq!(r.dropped[0].reason, GroupDropReason::DuplicateAttempt);
    let s = c.stats();
    assert_eq!((s.ready_groups, s.live_trajectories), (1, 2));
    let (out, _) = serve(&mut c, ask(1, 0, 0, 1));
    assert_eq!(served(&out), vec!["B".to_string()]);
}

#[test]
fn fifo_serves_oldest_admission_first_each_group_once() {
    let mut c = core(SamplingPolicy::Fifo, 1);
    // Admitted at versions 2, 1, 3 (completion order 0, 1, 2).
    feed(&mut c, &groups(0, 1, 2, 2), 1);
    feed(&mut c, &groups(1, 1, 2, 1), 1);
    feed(&mut c, &groups(2, 1, 2, 3), 1);
    let (out, _) = serve(&mut c, ask(1, 3, 4, 2));
    assert_eq!(served(&out), names(&[1, 0]));
    assert_eq!(
        c.plan(ask(2, 3, 4, 2)).outcome,
        Outcome::NotReady { ready: 1 }
    );
    let (out, _) = serve(&mut c, ask(2, 3, 4, 1));
    assert_eq!(served(&out), names(&[2]));
}

#[test]
fn fresh_first_serves_newest_first() {
    let mut c = core(SamplingPolicy::FreshFirst, 1);
    feed(&mut c, &groups(0, 1, 2, 1), 1);
    feed(&mut c, &groups(1, 1, 2, 3), 1);
    feed(&mut c, &groups(2, 1, 2, 2), 1);
    let (out, _) = serve(&mut c, ask(1, 3, 4, 2));
    assert_eq!(served(&out), names(&[1, 2]));
}

#[test]
fn stale_groups_are_never_served_and_are_dropped() {
    let mut c = core(SamplingPolicy::Fifo, 1);
    feed(&mut c, &groups(0, 2, 2, 1), 1); // oldest token version 1
    feed(&mut c, &groups(2, 2, 2, 4), 1);
    // v = 5, η = 2: floor 3, so the version-1 groups are stale.
    let plan = c.plan(ask(1, 5, 2, 2));
    assert_eq!(plan.drops.len(), 2);
    let recs = c.records(&plan, 0);
    assert!(matches!(
        recs[0],
        Record::Dropped {
            reason: DropReason::Stale,
            ..
        }
    ));
    let outcome = plan.outcome.clone();
    let dropped = c.commit(plan);
    assert_eq!(served(&outcome), names(&[2, 3]));
    assert_eq!(dropped.len(), 2);
    assert!(dropped.iter().all(|d| d.reason == GroupDropReason::Stale));
    // Dropped groups are released and never come back, even re-delivered.
    assert_eq!(c.stats().live_trajectories, 4);
    let again = feed(&mut c, &groups(0, 1, 2, 1), 1);
    assert_eq!((again.stored, again.duplicates), (0, 2));
    assert_eq!(
        c.plan(ask(2, 5, 2, 1)).outcome,
        Outcome::NotReady { ready: 0 }
    );
}

#[test]
fn the_attempt_issued_after_a_stale_drop_is_kept_served_and_survives_a_recovery() {
    let mut live = core(SamplingPolicy::Fifo, 1);
    let mut log: Vec<Record> = Vec::new();
    let first = groups(0, 1, 2, 1); // task-0, lease-0, version 1
    let fresh = groups(1, 1, 2, 4); // task-1
    feed(&mut live, &first, 1);
    feed(&mut live, &fresh, 1);
    // v = 5, η = 2: task-0's attempt is stale; the coordinator issues the
    // task again (lease `again`), sampled at version 5.
    let plan = live.plan(ask(1, 5, 2, 1));
    log.extend(live.records(&plan, 0));
    let dropped = live.commit(plan);
    assert_eq!(dropped.len(), 1);
    assert_eq!(dropped[0].reason, GroupDropReason::Stale);
    let again = [
        traj_of("task-0", "again", 90, 0, 2, 5, 4),
        traj_of("task-0", "again", 91, 1, 2, 5, 4),
    ];
    let a = feed(&mut live, &again, 1);
    assert_eq!((a.stored, a.newly_ready, a.superseded), (2, 1, 0), "{a:?}");
    assert!(a.dropped.is_empty(), "{:?}", a.dropped);
    // A redelivered copy of the stale attempt is a duplicate, not a rival.
    let copy = feed(&mut live, &first, 1);
    assert_eq!((copy.stored, copy.duplicates), (0, 2));
    let segments = [first.clone(), fresh.clone(), again.to_vec(), first.clone()];
    // Recovered from the log, and from a snapshot of it, the buffer holds
    // the same: the new attempt ready, the stale one gone.
    for records in [log.clone(), live.snapshot()] {
        let mut back = recover(SamplingPolicy::Fifo, 1, &records, &segments);
        assert!(back.finish_recovery().is_empty());
        let (x, y) = (live.stats(), back.stats());
        assert_eq!(
            (x.ready_groups, x.live_trajectories),
            (y.ready_groups, y.live_trajectories)
        );
        assert_eq!(
            served(&back.plan(ask(2, 5, 2, 1)).outcome),
            ["again".to_string()]
        );
    }
    let (outcome, _) = serve(&mut live, ask(2, 5, 2, 1));
    assert_eq!(served(&outcome), ["again".to_string()]);
    // Once the new attempt is trained on, the task is done: a third attempt
    // is superseded.
    let plan = live.plan(ask(3, 6, 2, 1));
    live.commit(plan);
    let third = [
        traj_of("task-0", "third", 95, 0, 2, 6, 4),
        traj_of("task-0", "third", 96, 1, 2, 6, 4),
    ];
    let t = feed(&mut live, &third, 1);
    assert_eq!((t.stored, t.superseded), (0, 2));
}

#[test]
fn a_group_with_one_old_token_is_stale() {
    let mut c = core(SamplingPolicy::Fifo, 1);
    let mut t = groups(0, 1, 2, 6);
    t[1].policy_versions[0] = 2; // one token sampled by version 2
    t[1].policy_versions[1] = 2;
    feed(&mut c, &t, 1);
    assert_eq!(
        c.plan(ask(1, 6, 3, 1)).outcome,
        Outcome::NotReady { ready: 0 }
    );
    assert_eq!(c.plan(ask(1, 6, 4, 1)).drops.len(), 0);
}

#[test]
fn a_repeated_step_gets_the_same_groups_and_nothing_twice() {
    let mut c = core(SamplingPolicy::Fifo, 1);
    feed(&mut c, &groups(0, 4, 2, 0), 1);
    let (first, _) = serve(&mut c, ask(1, 0, 2, 2));
    let (again, _) = serve(&mut c, ask(1, 0, 2, 2));
    assert_eq!(served(&first), served(&again));
    assert!(matches!(again, Outcome::Replay(_)));
    let (second, _) = serve(&mut c, ask(2, 1, 2, 2));
    assert_eq!(served(&second), names(&[2, 3]));
    // Step 1 is trained now (step 2 was asked): it is gone, not served again.
    assert!(matches!(
        c.plan(ask(1, 0, 2, 2)).outcome,
        Outcome::Refused(_)
    ));
    // Step 2 can still be repeated (the learner may restart before training it).
    assert_eq!(served(&serve(&mut c, ask(2, 1, 2, 2)).0), names(&[2, 3]));
    assert!(matches!(
        c.plan(ask(0, 0, 0, 1)).outcome,
        Outcome::Refused(_)
    ));
    assert!(matches!(
        c.plan(ask(3, 2, 2, 0)).outcome,
        Outcome::Refused(_)
    ));
}

#[test]
fn memory_is_released_when_steps_are_trained() {
    let mut c = core(SamplingPolicy::Fifo, 1);
    for i in 0..4 {
        feed(&mut c, &groups(i, 1, 2, 0), 1);
    }
    let full = c.stats().resident_bytes;
    assert!(full > 0);
    serve(&mut c, ask(1, 0, 2, 2));
    assert_eq!(
        c.stats().live_trajectories,
        8,
        "step 1 is pinned until trained"
    );
    serve(&mut c, ask(2, 1, 2, 2));
    let s = c.stats();
    assert_eq!(s.live_trajectories, 4);
    assert!(s.resident_bytes < full, "{} !< {full}", s.resident_bytes);
    // The rows that are left are still the right ones.
    let (batches, idx) = c
        .gather(&[Arc::from("lease-2"), Arc::from("lease-3")])
        .unwrap();
    let refs: Vec<&RecordBatch> = batches.iter().collect();
    let got = arrow::compute::interleave_record_batch(&refs, &idx).unwrap();
    let got = from_record_batch(&got).unwrap();
    assert_eq!(got, groups(2, 2, 2, 0));
}

#[test]
fn segments_become_deletable_only_when_everything_in_them_is_consumed() {
    let mut c = core(SamplingPolicy::Fifo, 1);
    c.add_segment(1, false);
    // Segment 1: group 0 and half of group 1; segment 2: the rest of group 1.
    let t = groups(0, 2, 2, 0);
    feed(&mut c, &t[..3], 1);
    c.add_segment(2, true);
    feed(&mut c, &t[3..], 2);
    c.add_segment(3, true);
    assert!(c.deletable_segments().is_empty());
    serve(&mut c, ask(1, 0, 2, 1)); // group 0
    serve(&mut c, ask(2, 1, 2, 1)); // group 1; step 1 trained
    assert!(
        c.deletable_segments().is_empty(),
        "group 1 (step 2) is not trained yet"
    );
    assert!(matches!(
        c.plan(ask(3, 2, 2, 1)).outcome,
        Outcome::NotReady { .. }
    ));
    // Only a served step makes the previous one trained.
    feed(&mut c, &groups(5, 1, 2, 2), 3);
    serve(&mut c, ask(3, 2, 2, 1));
    assert_eq!(c.deletable_segments(), vec![1, 2]);
    c.forget_segment(1);
    assert_eq!(c.deletable_segments(), vec![2]);
}

#[test]
fn reuse_serves_each_group_up_to_k_times_never_twice_in_a_batch() {
    let k = 3;
    let mut c = core(SamplingPolicy::Reuse, k);
    feed(&mut c, &groups(0, 5, 2, 0), 1);
    let mut counts: HashMap<String, u32> = HashMap::new();
    let mut step = 0;
    loop {
        step += 1;
        let (out, _) = serve(&mut c, ask(step, 0, 100, 2));
        let Outcome::Serve(g) = out else { break };
        let distinct: HashSet<_> = g.iter().collect();
        assert_eq!(distinct.len(), g.len(), "a group twice in one batch");
        for id in g {
            *counts.entry(id.to_string()).or_default() += 1;
        }
    }
    // 5 groups × K = 15 serves: 7 batches of 2, then 1 group left (not ready).
    assert_eq!(counts.len(), 5);
    assert!(counts.values().all(|n| *n <= k), "{counts:?}");
    assert_eq!(counts.values().sum::<u32>(), 14);
}

#[test]
fn reuse_is_random_reshuffling_every_pass_covers_the_pool() {
    let mut c = core(SamplingPolicy::Reuse, 4);
    feed(&mut c, &groups(0, 6, 2, 0), 1);
    let mut order = Vec::new();
    for step in 1..=6 {
        order.extend(served(&serve(&mut c, ask(step, 0, 100, 2)).0));
    }
    // Passes of 6: each is a permutation of all 6 groups.
    for pass in order.chunks(6) {
        let set: HashSet<_> = pass.iter().collect();
        assert_eq!(set.len(), 6, "{order:?}");
    }
    assert_ne!(order[..6], order[6..12], "two passes in the same order");
}

#[test]
fn reuse_groups_expire_after_serving_and_are_not_counted_stale() {
    let mut c = core(SamplingPolicy::Reuse, 5);
    feed(&mut c, &groups(0, 2, 2, 0), 1);
    serve(&mut c, ask(1, 0, 1, 2));
    let plan = c.plan(ask(2, 3, 1, 2));
    assert!(plan.drops.iter().all(|(_, r)| *r == DropReason::Expired));
    let dropped = c.commit(plan);
    assert_eq!(dropped.len(), 2);
    assert!(dropped.iter().all(|d| d.reason == GroupDropReason::Expired));
    // Expired groups are still held for a replay of step 1, then released.
    assert!(matches!(
        c.plan(ask(1, 0, 1, 2)).outcome,
        Outcome::Replay(_)
    ));
    feed(&mut c, &groups(5, 2, 2, 3), 1);
    serve(&mut c, ask(2, 3, 1, 2));
    assert_eq!(c.stats().live_trajectories, 4);
}

/// Recovery: a fresh core seeded with the persisted records and fed the same
/// segment batches ends in the same serving state.
#[test]
fn seed_and_replay_reach_the_same_state() {
    for sampling in [SamplingPolicy::Fifo, SamplingPolicy::Reuse] {
        let k = if sampling == SamplingPolicy::Reuse {
            2
        } else {
            1
        };
        let mut live = core(sampling, k);
        let mut log: Vec<Record> = Vec::new();
        let mut segments: Vec<Vec<Trajectory>> = Vec::new();
        let mut step = 0;
        let mut run_step = |c: &mut Core, log: &mut Vec<Record>, v: i32, eta: u32| {
            step += 1;
            let plan = c.plan(ask(step, v, eta, 2));
            log.extend(c.records(&plan, 0));
            c.commit(plan);
        };
        for (i, version) in [(0u32, 0), (3, 0), (6, 1), (9, 5)] {
            let t = groups(i, 3, 2, version);
            feed(&mut live, &t, 1);
            segments.push(t);
            run_step(&mut live, &mut log, version, 1);
        }
        // Duplicates and a superseded attempt are in the segments too.
        let late = [traj_of("task-13", "other", 77, 0, 2, 5, 4)];
        feed(&mut live, &late, 1);
        segments.push(late.to_vec());

        let mut back = recover(sampling, k, &log, &segments);
        assert!(back.finish_recovery().is_empty());
        let (a, b) = (live.stats(), back.stats());
        assert_eq!(
            (
                a.ready_groups,
                a.exhausted_groups,
                a.live_trajectories,
                a.done_through,
                a.pending_steps
            ),
            (
                b.ready_groups,
                b.exhausted_groups,
                b.live_trajectories,
                b.done_through,
                b.pending_steps
            ),
            "{sampling:?}"
        );
        // The last step replays identically on both.
        let last = ask(4, 5, 1, 2);
        assert_eq!(
            live.plan(last).outcome,
            back.plan(last).outcome,
            "{sampling:?}"
        );
        // And the next step serves the same groups (fifo) / a valid batch (reuse).
        let next = ask(5, 5, 1, 2);
        let (x, y) = (live.plan(next).outcome, back.plan(next).outcome);
        if sampling == SamplingPolicy::Fifo {
            assert_eq!(x, y);
        } else {
            assert_eq!(served(&x).len(), served(&y).len());
        }
        // A snapshot of the log reproduces the same state too.
        let mut snap = recover(sampling, k, &live.snapshot(), &segments);
        assert!(snap.finish_recovery().is_empty());
        let c = snap.stats();
        assert_eq!(
            (
                a.ready_groups,
                a.exhausted_groups,
                a.live_trajectories,
                a.done_through
            ),
            (
                c.ready_groups,
                c.exhausted_groups,
                c.live_trajectories,
                c.done_through
            ),
            "{sampling:?} snapshot"
        );
        assert_eq!(live.plan(last).outcome, snap.plan(last).outcome);
    }
}

#[test]
fn sparse_memory_batches_are_compacted() {
    let mut c = core(SamplingPolicy::Fifo, 1);
    // One batch with 10 groups of 2; serve and train 9 of them.
    feed(&mut c, &groups(0, 10, 2, 0), 1);
    let before = c.stats().resident_bytes;
    for step in 1..=9 {
        serve(&mut c, ask(step, 0, 9, 1));
    }
    serve(&mut c, ask(10, 0, 9, 1)); // trains step 9
    let s = c.stats();
    assert_eq!(s.live_trajectories, 2);
    assert!(
        s.resident_bytes * 3 < before,
        "{} vs {before}",
        s.resident_bytes
    );
    let (batches, idx) = c.gather(&[Arc::from("lease-9")]).unwrap();
    let refs: Vec<&RecordBatch> = batches.iter().collect();
    let got = arrow::compute::interleave_record_batch(&refs, &idx).unwrap();
    assert_eq!(from_record_batch(&got).unwrap(), groups(9, 1, 2, 0));
}

/// One step of a random history.
#[derive(Debug, Clone)]
enum Op {
    /// A trajectory of attempt `attempt` of task `task`.
    Traj {
        task: u8,
        attempt: u8,
        index: u8,
        size: u8,
        version: u8,
    },
    /// The same message again (a redelivery).
    Again(usize),
    /// A learner request; `advance` moves the learner one version on.
    Serve { advance: bool, n: u8, eta: u8 },
    /// The learner repeats its last step.
    Repeat,
    /// The learner refuses a group of its last step (and asks for the
    /// step again).
    Refuse(usize),
    /// The buffer restarts: a new core from the log and the segments.
    Restart,
}

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    prop_oneof![
        6 => (0u8..8, 0u8..2, 0u8..3, 2u8..4, 0u8..6).prop_map(|(task, attempt, index, size, version)| Op::Traj { task, attempt, index, size, version }),
        1 => (0usize..1000).prop_map(Op::Again),
        2 => (any::<bool>(), 1u8..4, 0u8..3).prop_map(|(advance, n, eta)| Op::Serve { advance, n, eta }),
        1 => Just(Op::Repeat),
        1 => (0usize..8).prop_map(Op::Refuse),
        1 => Just(Op::Restart),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(96))]
    /// Random ingest, duplicates, requests, repeats and restarts: no panic,
    /// and the serving invariants hold: every served group is complete and
    /// within η, a repeated step gets the same groups, and (fifo,
    /// fresh_first) no group is served for two steps.
    #[test]
    fn random_histories_keep_the_serving_invariants(
        ops in proptest::collection::vec(op(), 1..120),
        policy in 0u8..3,
        dynamic in proptest::bool::ANY,
    ) {
        // Dynamic sampling on: members' rewards are 0 or 1 at random, so
        // a flat group is never served.
        let min_spread = if dynamic { 0.5 } else { 0.0 };
        let (sampling, k) = match policy {
            0 => (SamplingPolicy::Fifo, 1),
            1 => (SamplingPolicy::FreshFirst, 1),
            _ => (SamplingPolicy::Reuse, 2),
        };
        let mut c = core(sampling, k).with_min_reward_spread(min_spread);
        let mut sent: Vec<Trajectory> = Vec::new();
        let mut written: Vec<Vec<Trajectory>> = Vec::new();
        let mut log: Vec<Record> = Vec::new();
        let mut version = 0i32;
        let mut step = 0u64;
        let mut served_steps: HashMap<u64, Vec<String>> = HashMap::new();
        let mut serves: HashMap<String, u32> = HashMap::new();
        let mut quarantined: HashSet<String> = HashSet::new();
        // The last step was served (not refused since): a repeat replays it.
        let mut repeatable = false;
        let mut n = 0u32;
        for op in ops {
            match op {
                Op::Traj { task, attempt, index, size, version: v } => {
                    n += 1;
                    let t = traj_of(
                        &format!("t{task}"),
                        &format!("t{task}-a{attempt}"),
                        n,
                        u32::from(index.min(size - 1)),
                        u32::from(size),
                        i32::from(v),
                        3,
                    );
                    sent.push(t.clone());
                    if !c.is_live(RowMeta::of(&t).unwrap().uuid) {
                        feed(&mut c, std::slice::from_ref(&t), 1);
                        written.push(vec![t]);
                    }
                }
                Op::Again(i) if !sent.is_empty() => {
                    let t = sent[i % sent.len()].clone();
                    if !c.is_live(RowMeta::of(&t).unwrap().uuid) {
                        feed(&mut c, std::slice::from_ref(&t), 1);
                        written.push(vec![t]);
                    }
                }
                Op::Again(_) => {}
                Op::Serve { advance, n, eta } => {
                    if advance { version += 1; }
                    let a = ask(step + 1, version, u32::from(eta), usize::from(n));
                    let plan = c.plan(a);
                    log.extend(c.records(&plan, 0));
                    let outcome = plan.outcome.clone();
                    c.commit(plan);
                    if let Outcome::Serve(groups) = outcome {
                        step += 1;
                        repeatable = true;
                        for g in &groups {
                            proptest::prop_assert!(!quarantined.contains(&g.to_string()), "quarantined group {} served", g);
                        }
                        let (batches, idx) = c.gather(&groups).unwrap();
                        let refs: Vec<&RecordBatch> = batches.iter().collect();
                        let trajs = from_record_batch(
                            &arrow::compute::interleave_record_batch(&refs, &idx).unwrap(),
                        ).unwrap();
                        let floor = version - i32::from(eta);
                        for t in &trajs {
                            proptest::prop_assert!(t.policy_versions.iter().all(|v| *v >= floor), "stale token served");
                        }
                        let distinct: HashSet<&String> = trajs.iter().map(|t| &t.group_id).collect();
                        proptest::prop_assert_eq!(distinct.len(), groups.len());
                        for g in &groups {
                            let members: Vec<&Trajectory> = trajs.iter().filter(|t| *t.group_id == **g).collect();
                            proptest::prop_assert_eq!(members.len() as u32, members[0].group_size, "incomplete group");
                            if dynamic {
                                let r: Vec<f32> = members.iter().map(|t| t.reward).collect();
                                let spread = r.iter().cloned().fold(f32::MIN, f32::max)
                                    - r.iter().cloned().fold(f32::MAX, f32::min);
                                proptest::prop_assert!(spread >= 0.5, "group {} without signal served", g);
                            }
                            let s = serves.entry(g.to_string()).or_default();
                            *s += 1;
                            proptest::prop_assert!(*s <= k, "group {} served {} times", g, s);
                        }
                        // One kept attempt per task.
                        let tasks: HashSet<&String> = trajs.iter().map(|t| &t.task_id).collect();
                        proptest::prop_assert_eq!(tasks.len(), groups.len());
                        served_steps.insert(step, groups.iter().map(|g| g.to_string()).collect());
                    }
                }
                Op::Refuse(i) if repeatable => {
                    let groups = served_steps[&step].clone();
                    let refused = groups[i % groups.len()].clone();
                    let refusal = c.plan_refusal(step, &[(refused.clone(), "bad".into())]);
                    let refusal = refusal.expect("a group of the last step is refusable");
                    log.push(c.refusal_record(&refusal));
                    let dropped = c.commit_refusal(refusal);
                    // The refused group is quarantined; a group of the step
                    // that expired with every serve refused is a stale drop.
                    let quarantined_now: Vec<&DroppedGroup> = dropped
                        .iter()
                        .filter(|d| d.reason == GroupDropReason::Quarantined)
                        .collect();
                    proptest::prop_assert_eq!(quarantined_now.len(), 1);
                    proptest::prop_assert_eq!(&quarantined_now[0].group, &refused);
                    proptest::prop_assert!(dropped
                        .iter()
                        .all(|d| d.reason == GroupDropReason::Quarantined || d.reason == GroupDropReason::Stale));
                    quarantined.insert(refused.clone());
                    for g in groups.iter().filter(|g| **g != refused) {
                        if let Some(s) = serves.get_mut(g) {
                            *s -= 1;
                        }
                    }
                    served_steps.remove(&step);
                    step -= 1;
                    repeatable = false;
                }
                Op::Refuse(_) => {}
                Op::Repeat if repeatable => {
                    let plan = c.plan(ask(step, version, 0, 1));
                    match plan.outcome {
                        Outcome::Replay(g) => {
                            let g: Vec<String> = g.iter().map(|s| s.to_string()).collect();
                            proptest::prop_assert_eq!(&g, &served_steps[&step]);
                        }
                        other => proptest::prop_assert!(false, "step {} not replayed: {:?}", step, other),
                    }
                }
                Op::Repeat => {}
                Op::Restart => {
                    let before = c.stats();
                    let mut back = core(sampling, k).with_min_reward_spread(min_spread);
                    back.seed(&log);
                    for t in &written {
                        let batch = to_record_batch(t).unwrap();
                        let metas: Vec<RowMeta> = t.iter().map(|t| RowMeta::of(t).unwrap()).collect();
                        back.apply(batch, &metas, 1, true);
                    }
                    proptest::prop_assert!(back.finish_recovery().is_empty());
                    let after = back.stats();
                    proptest::prop_assert_eq!(
                        (before.ready_groups, before.collecting_groups, before.exhausted_groups, before.live_trajectories, before.done_through),
                        (after.ready_groups, after.collecting_groups, after.exhausted_groups, after.live_trajectories, after.done_through)
                    );
                    c = back;
                }
            }
        }
    }

    /// The ingest path on arbitrary bytes: decode, metadata, apply. No panic.
    #[test]
    fn random_messages_through_ingest_never_panic(
        msgs in proptest::collection::vec(proptest::collection::vec(proptest::num::u8::ANY, 0..256), 1..16),
    ) {
        let mut c = core(SamplingPolicy::Fifo, 1);
        for bytes in msgs {
            if let Ok(t) = asyncrl_protos::decode_trajectory(&bytes)
                && let Some(m) = RowMeta::of(&t)
            {
                let batch = to_record_batch(std::slice::from_ref(&t)).unwrap();
                c.apply(batch, &[m], 1, false);
            }
        }
    }
}

#[test]
fn copies_of_trained_trajectories_are_known_before_they_are_stored() {
    let mut c = core(SamplingPolicy::Fifo, 1);
    let t = groups(0, 2, 2, 0);
    feed(&mut c, &t, 1);
    let meta = |t: &Trajectory| RowMeta::of(t).unwrap();
    assert!(t.iter().all(|t| c.is_known(&meta(t))), "held");
    let (outcome, _) = serve(&mut c, ask(1, 0, 4, 1));
    assert_eq!(served(&outcome), names(&[0]));
    // Step 2 asked: step 1 is trained and its group released.
    serve(&mut c, ask(2, 1, 4, 1));
    assert!(!c.is_live(meta(&t[0]).uuid));
    // A redelivered copy is known (and would be a duplicate) ...
    assert!(c.is_known(&meta(&t[0])) && c.is_known(&meta(&t[1])));
    let a = feed(&mut c, &t[..1], 1);
    assert_eq!((a.stored, a.duplicates), (0, 1));
    // ... a trajectory of another attempt of the task is not.
    let other = traj_of("task-0", "lease-9", 99, 0, 2, 0, 4);
    assert!(!c.is_known(&meta(&other)));
}

/// A late attempt of a task already trained on is dropped and reported
/// once, and leaves nothing behind: a long run sees many, and per-attempt
/// bookkeeping of tasks that are done would grow with it.
#[test]
fn a_late_attempt_of_a_trained_task_leaves_no_bookkeeping_behind() {
    let mut c = core(SamplingPolicy::Fifo, 1);
    feed(&mut c, &groups(0, 2, 2, 0), 1);
    let (outcome, _) = serve(&mut c, ask(1, 0, 4, 1));
    assert_eq!(served(&outcome), names(&[0]));
    // Step 2 served: step 1 is trained, its group consumed.
    let (outcome, _) = serve(&mut c, ask(2, 1, 4, 1));
    assert_eq!(served(&outcome), names(&[1]));
    assert_eq!(c.task_done.get("task-0").map(|d| d.consumed), Some(true));
    let late = [
        traj_of("task-0", "lease-9", 90, 0, 2, 0, 4),
        traj_of("task-0", "lease-9", 91, 1, 2, 0, 4),
    ];
    let a = feed(&mut c, &late[..1], 1);
    assert_eq!((a.stored, a.superseded), (0, 1));
    assert!(a.dropped.is_empty());
    let a = feed(&mut c, &late[1..], 1);
    assert_eq!((a.stored, a.superseded), (0, 1));
    assert_eq!(
        a.dropped,
        vec![DroppedGroup {
            task: "task-0".into(),
            group: "lease-9".into(),
            reason: GroupDropReason::DuplicateAttempt,
            trajectories: 2,
        }]
    );
    assert!(c.superseded.is_empty(), "{:?}", c.superseded);
    assert!(c.late.is_empty(), "{:?}", c.late);
}

/// A refusal, planned, recorded and committed as the server does; the
/// record is appended to `log`.
fn refuse(c: &mut Core, log: &mut Vec<Record>, step: u64, groups: &[&str]) -> Vec<DroppedGroup> {
    let refused: Vec<(String, String)> = groups
        .iter()
        .map(|g| {
            (
                g.to_string(),
                "row 0: `completion_token_ids` holds token id 1000000".into(),
            )
        })
        .collect();
    let Some(refusal) = c.plan_refusal(step, &refused) else {
        return Vec::new();
    };
    log.push(c.refusal_record(&refusal));
    c.commit_refusal(refusal)
}

/// plan + records + commit, the records appended to `log`.
fn serve_logged(c: &mut Core, log: &mut Vec<Record>, a: Ask) -> Outcome {
    let plan = c.plan(a);
    log.extend(c.records(&plan, 0));
    let outcome = plan.outcome.clone();
    c.commit(plan);
    outcome
}

#[test]
fn a_refused_group_is_quarantined_and_the_step_is_served_anew_from_other_groups() {
    let mut live = core(SamplingPolicy::Fifo, 1);
    let mut log: Vec<Record> = Vec::new();
    let all = groups(0, 4, 2, 0); // lease-0..3 of task-0..3
    feed(&mut live, &all, 1);
    let first = serve_logged(&mut live, &mut log, ask(1, 0, 2, 2));
    assert_eq!(served(&first), names(&[0, 1]));
    // The learner refuses lease-1: it is quarantined (reported, so the
    // coordinator issues task-1 again), lease-0 is servable again, and
    // step 1 is served anew: lease-0 and the next ready group.
    let dropped = refuse(&mut live, &mut log, 1, &["lease-1"]);
    assert_eq!(dropped.len(), 1, "{dropped:?}");
    assert_eq!(
        (
            dropped[0].group.as_str(),
            dropped[0].reason,
            dropped[0].trajectories
        ),
        ("lease-1", GroupDropReason::Quarantined, 2)
    );
    // A retried request carrying the same refusal changes nothing.
    assert!(refuse(&mut live, &mut log, 1, &["lease-1"]).is_empty());
    let again = serve_logged(&mut live, &mut log, ask(1, 0, 2, 2));
    assert!(matches!(again, Outcome::Serve(_)), "{again:?}");
    assert_eq!(served(&again), names(&[0, 2]));
    // The task's new attempt is kept (not dropped as a duplicate of a done
    // task), and a redelivered copy of the refused group is not stored.
    let retry = [
        traj_of("task-1", "retry", 90, 0, 2, 0, 4),
        traj_of("task-1", "retry", 91, 1, 2, 0, 4),
    ];
    let a = feed(&mut live, &retry, 1);
    assert_eq!((a.stored, a.newly_ready, a.superseded), (2, 1, 0), "{a:?}");
    let copy = feed(&mut live, &all[2..4], 1);
    assert_eq!((copy.stored, copy.duplicates), (0, 2), "{copy:?}");
    // Recovered from the log, and from a snapshot, the buffer agrees: step
    // 1 replays the new groups, and the next step gets the rest.
    let segments = [all.clone(), retry.to_vec(), all[2..4].to_vec()];
    for records in [log.clone(), live.snapshot()] {
        let mut back = recover(SamplingPolicy::Fifo, 1, &records, &segments);
        assert!(back.finish_recovery().is_empty());
        let replay = back.plan(ask(1, 0, 2, 2)).outcome;
        assert!(matches!(replay, Outcome::Replay(_)), "{replay:?}");
        assert_eq!(served(&replay), names(&[0, 2]));
        let (next, _) = serve(&mut back, ask(2, 1, 2, 2));
        assert_eq!(served(&next), ["lease-3".to_string(), "retry".to_string()]);
    }
    let (next, _) = serve(&mut live, ask(2, 1, 2, 2));
    assert_eq!(served(&next), ["lease-3".to_string(), "retry".to_string()]);
}

#[test]
fn a_prefetched_step_keeps_the_step_before_it_refusable() {
    let mut live = core(SamplingPolicy::Fifo, 1);
    let mut log: Vec<Record> = Vec::new();
    feed(&mut live, &groups(0, 6, 2, 0), 1);
    serve_logged(&mut live, &mut log, ask(1, 0, 2, 2));
    // Step 2 is asked for while step 1 trains: step 1 is not trained yet.
    let prefetch = Ask {
        trained_through: 0,
        ..ask(2, 1, 2, 2)
    };
    assert_eq!(
        served(&serve_logged(&mut live, &mut log, prefetch)),
        names(&[2, 3])
    );
    assert_eq!(live.stats().done_through, 0);
    // Step 1's loss is not finite: every group of it is refused.
    let dropped = refuse(&mut live, &mut log, 1, &["lease-0", "lease-1"]);
    assert_eq!(dropped.len(), 2);
    let anew = serve_logged(&mut live, &mut log, ask(1, 0, 2, 2));
    assert_eq!(served(&anew), names(&[4, 5]));
    // A recovery keeps both steps, and step 2 still replays its groups.
    for records in [log.clone(), live.snapshot()] {
        let mut back = recover(SamplingPolicy::Fifo, 1, &records, &[groups(0, 6, 2, 0)]);
        assert!(back.finish_recovery().is_empty());
        assert_eq!(back.stats().done_through, 0);
        assert_eq!(served(&back.plan(ask(1, 0, 2, 2)).outcome), names(&[4, 5]));
        assert_eq!(served(&back.plan(ask(2, 1, 2, 2)).outcome), names(&[2, 3]));
    }
}

#[test]
fn with_reuse_a_refused_step_gives_its_other_groups_their_serve_back() {
    let mut c = core(SamplingPolicy::Fifo, 2);
    let mut log = Vec::new();
    feed(&mut c, &groups(0, 2, 2, 0), 1);
    serve_logged(&mut c, &mut log, ask(1, 0, 4, 2));
    let (second, _) = serve(&mut c, ask(2, 1, 4, 2));
    assert_eq!(served(&second), names(&[0, 1]));
    // Refusing lease-1 at step 2 gives lease-0 its second serve back.
    refuse(&mut c, &mut log, 2, &["lease-1"]);
    assert_eq!(
        c.plan(ask(2, 1, 4, 1)).outcome,
        Outcome::Serve(vec![Arc::from("lease-0")])
    );
}

/// Found by `random_histories_keep_the_serving_invariants` (reuse): a group
/// served again at a step that is then refused, which later expires, is
/// released once its earlier step is trained. It waited for a settle that
/// never came (its last step still named the refused one), holding its
/// rows and its segment, while a restart released it.
#[test]
fn a_group_whose_later_serve_was_refused_is_released_when_it_expires() {
    let mut c = core(SamplingPolicy::Reuse, 2);
    let mut log: Vec<Record> = Vec::new();
    let mut written: Vec<Vec<Trajectory>> = Vec::new();
    let serve_logged = |c: &mut Core, log: &mut Vec<Record>, a: Ask| {
        let plan = c.plan(a);
        log.extend(c.records(&plan, 0));
        let outcome = plan.outcome.clone();
        c.commit(plan);
        served(&outcome)
    };
    let x = groups(0, 1, 2, 0);
    feed(&mut c, &x, 1);
    written.push(x);
    assert_eq!(serve_logged(&mut c, &mut log, ask(1, 0, 0, 1)), names(&[0]));
    let y = groups(1, 1, 2, 0);
    feed(&mut c, &y, 1);
    written.push(y);
    // Step 2 at version 1 serves both; then the learner refuses the new one.
    let step2 = serve_logged(&mut c, &mut log, ask(2, 1, 1, 2));
    assert_eq!(step2.len(), 2);
    let refusal = c
        .plan_refusal(2, &[("lease-1".into(), "bad".into())])
        .expect("lease-1 was served for step 2");
    log.push(c.refusal_record(&refusal));
    c.commit_refusal(refusal);
    // Step 2 again, η = 0: lease-0 (version 0) has expired; a fresh group is served.
    let z = groups(2, 1, 2, 1);
    feed(&mut c, &z, 1);
    written.push(z);
    assert_eq!(serve_logged(&mut c, &mut log, ask(2, 1, 0, 1)), names(&[2]));
    // Step 3: step 2 (and so step 1) is trained.
    serve_logged(&mut c, &mut log, ask(3, 1, 0, 1));
    assert!(
        !c.groups.contains_key("lease-0"),
        "the expired group is released"
    );
    let before = c.stats();
    let mut back = recover(SamplingPolicy::Reuse, 2, &log, &written);
    assert!(back.finish_recovery().is_empty());
    let after = back.stats();
    assert_eq!(
        (before.exhausted_groups, before.live_trajectories),
        (after.exhausted_groups, after.live_trajectories)
    );
}

/// Reuse: a group that expired while its one serve was pending, at a step
/// the learner then refuses (for another group), was never trained. It is
/// dropped as stale and its task issued again, live and after a restart;
/// it was left exhausted and never released (its task lost).
#[test]
fn an_expired_group_whose_only_serve_is_refused_is_a_stale_drop() {
    let mut c = core(SamplingPolicy::Reuse, 2);
    let mut log: Vec<Record> = Vec::new();
    let rows = groups(0, 2, 2, 2);
    feed(&mut c, &rows, 1);
    let plan = c.plan(ask(1, 2, 0, 2));
    log.extend(c.records(&plan, 0));
    c.commit(plan);
    // Version 3, η = 0: both groups have expired; nothing to serve.
    let plan = c.plan(ask(2, 3, 0, 2));
    log.extend(c.records(&plan, 0));
    assert!(
        matches!(plan.outcome, Outcome::NotReady { .. }),
        "{:?}",
        plan.outcome
    );
    c.commit(plan);
    let refusal = c
        .plan_refusal(1, &[("lease-1".into(), "bad".into())])
        .expect("lease-1 was served for step 1");
    log.push(c.refusal_record(&refusal));
    let mut dropped = c.commit_refusal(refusal);
    dropped.sort_by(|a, b| a.group.cmp(&b.group));
    let reasons: Vec<(&str, GroupDropReason)> = dropped
        .iter()
        .map(|d| (d.group.as_str(), d.reason))
        .collect();
    assert_eq!(
        reasons,
        vec![
            ("lease-0", GroupDropReason::Stale),
            ("lease-1", GroupDropReason::Quarantined)
        ]
    );
    let open = |c: &Core| -> Vec<(String, String)> {
        c.stale_drops()
            .into_iter()
            .map(|(t, g)| (t.to_string(), g.to_string()))
            .collect()
    };
    let expected = vec![
        ("task-0".to_string(), "lease-0".to_string()),
        ("task-1".to_string(), "lease-1".to_string()),
    ];
    assert_eq!(open(&c), expected);
    assert_eq!(c.stats().live_trajectories, 0);
    let mut back = recover(SamplingPolicy::Reuse, 2, &log, &[rows]);
    assert!(back.finish_recovery().is_empty());
    assert_eq!(open(&back), expected);
    assert_eq!(back.stats().live_trajectories, 0);
}

/// A group of `task` (a wire task id) whose attempt is `lease`: `g`
/// members, uuids from `first`.
fn group_of(task: &str, lease: &str, first: u32, g: u32) -> Vec<Trajectory> {
    (0..g)
        .map(|i| traj_of(task, lease, first + i, i, g, 0, 4))
        .collect()
}

/// A long run completes tasks for ever, so remembering every one would
/// grow without end. Once the coordinator closes an epoch, a consumed task
/// of it is forgotten as soon as no segment holds a row of it; a copy of it
/// arriving later is a late one, and an attempt of it still collecting is
/// released. The snapshot carries the closed epoch to a restart.
#[test]
fn a_consumed_task_of_a_closed_epoch_is_forgotten_once_its_rows_are_deleted() {
    let mut c = core(SamplingPolicy::Fifo, 1);
    let mut epoch0 = group_of("q-0-e0", "lease-0", 0, 2);
    epoch0.extend(group_of("q-1-e0", "lease-1", 10, 2));
    epoch0.extend(group_of("q-0-e1", "lease-2", 20, 2));
    // One member of an attempt whose worker died before it published the
    // other.
    epoch0.push(traj_of("q-2-e0", "lease-8", 80, 0, 2, 0, 4));
    feed(&mut c, &epoch0, 1);
    assert_eq!(served(&serve(&mut c, ask(1, 0, 4, 2)).0), names(&[0, 1]));
    assert_eq!(served(&serve(&mut c, ask(2, 1, 4, 1)).0), names(&[2]));
    assert_eq!(c.stats().completed_tasks, 3);
    let late_row =
        |task: &str, n: u32| RowMeta::of(&traj_of(task, "lease-99", 990 + n, 0, 2, 0, 4)).unwrap();
    assert!(!c.is_late(&late_row("q-5-e0", 0)), "no epoch is closed yet");

    // Epoch 0 closes: the attempt still collecting is a late copy.
    let dropped = c.close_epochs(0);
    assert_eq!(
        dropped,
        vec![DroppedGroup {
            task: "q-2-e0".into(),
            group: "lease-8".into(),
            reason: GroupDropReason::DuplicateAttempt,
            trajectories: 1,
        }]
    );
    assert_eq!(c.stats().collecting_groups, 0);
    assert_eq!(c.closed_epoch(), Some(0));
    // Segment 1 still holds rows of the closed tasks: they are remembered
    // (a restart replays those rows and must know them for consumed).
    assert_eq!(c.stats().completed_tasks, 3);
    assert!(!c.is_late(&late_row("q-0-e0", 0)));
    let a = feed(&mut c, &[traj_of("q-0-e0", "lease-98", 900, 0, 2, 0, 4)], 1);
    assert_eq!((a.stored, a.superseded), (0, 1));
    assert!(
        c.is_late(&late_row("q-2-e0", 0)),
        "a closed task held nowhere"
    );
    assert!(!c.is_late(&late_row("q-7-e1", 0)), "epoch 1 is open");

    // The next segment takes new rows; step 3 trains step 2's group, and
    // segment 1 holds nothing live any more.
    c.add_segment(2, true);
    feed(&mut c, &group_of("q-1-e1", "lease-3", 30, 2), 2);
    assert_eq!(served(&serve(&mut c, ask(3, 2, 4, 1)).0), names(&[3]));
    assert_eq!(c.deletable_segments(), vec![1]);
    c.forget_segment(1);
    // Epoch 0's consumed tasks are forgotten, epoch 1's kept.
    assert_eq!(c.stats().completed_tasks, 2);
    assert!(c.task_done.contains_key("q-0-e1") && c.task_done.contains_key("q-1-e1"));
    // A late copy of a forgotten task is late: ingest drops it unstored.
    assert!(c.is_late(&late_row("q-0-e0", 0)));
    assert!(c.is_late(&late_row("q-1-e0", 1)));
    assert!(!c.is_late(&late_row("q-0-e1", 2)));

    // The snapshot names the closed epoch and only what is remembered; a
    // restart from it judges the same.
    let snapshot = c.snapshot();
    let Record::Snapshot {
        consumed,
        closed_epoch,
        ..
    } = &snapshot[0]
    else {
        panic!("{snapshot:?}")
    };
    assert_eq!(*closed_epoch, Some(0));
    assert_eq!(
        consumed.iter().map(|g| g.task.as_str()).collect::<Vec<_>>(),
        ["q-0-e1"]
    );
    let r = recover(
        SamplingPolicy::Fifo,
        1,
        &snapshot,
        &[group_of("q-1-e1", "lease-3", 30, 2)],
    );
    assert_eq!(r.closed_epoch(), Some(0));
    assert!(r.is_late(&late_row("q-0-e0", 0)));
    assert!(!r.is_late(&late_row("q-0-e1", 0)));
    // A lower value (a coordinator whose state was reset) changes nothing.
    let mut r = r;
    assert!(r.close_epochs(0).is_empty());
    r.closed_epoch = Some(3);
    r.close_epochs(1);
    assert_eq!(r.closed_epoch(), Some(3));
}

// ------------------------------------------------------ dynamic sampling

/// A group of task `task-{n}` (lease `lease-{n}`) of size `rewards.len()`
/// at version 0 whose members have these rewards (`None`: scoring failed).
fn scored_group(n: u32, rewards: &[Option<f32>]) -> Vec<Trajectory> {
    let g = rewards.len() as u32;
    rewards
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let mut t = traj_of(
                &format!("task-{n}"),
                &format!("lease-{n}"),
                n * 100 + i as u32,
                i as u32,
                g,
                0,
                4,
            );
            match r {
                Some(r) => t.reward = *r,
                None => {
                    t.reward = f32::NAN;
                    t.reward_status = RewardStatus::Failed as i32;
                }
            }
            t
        })
        .collect()
}

fn spread_core(min_spread: f64) -> Core {
    core(SamplingPolicy::Fifo, 1).with_min_reward_spread(min_spread)
}

/// A recovery with dynamic sampling at `min_spread`.
fn recover_spread(min_spread: f64, records: &[Record], segments: &[Vec<Trajectory>]) -> Core {
    let mut c = spread_core(min_spread);
    c.seed(records);
    for t in segments {
        let batch = to_record_batch(t).unwrap();
        let metas: Vec<RowMeta> = t.iter().map(|t| RowMeta::of(t).unwrap()).collect();
        c.apply(batch, &metas, 1, true);
    }
    c
}

#[test]
fn a_complete_group_without_reward_spread_is_dropped_as_no_signal_and_never_served() {
    let mut c = spread_core(0.5);
    let flat = scored_group(0, &[Some(1.0), Some(1.0), Some(1.0)]);
    let mixed = scored_group(1, &[Some(0.0), Some(1.0), Some(1.0)]);
    feed(&mut c, &flat, 1);
    feed(&mut c, &mixed, 1);
    // Both are complete; the plan drops the flat one before it serves.
    let mut log = Vec::new();
    let plan = c.plan(ask(1, 0, 0, 2));
    assert_eq!(
        plan.drops,
        vec![(Arc::from("lease-0"), DropReason::NoSignal)]
    );
    assert_eq!(plan.outcome, Outcome::NotReady { ready: 1 });
    log.extend(c.records(&plan, 0));
    assert!(matches!(
        &log[0],
        Record::Dropped { group, reason: DropReason::NoSignal, trajectories: 3, closed, .. }
            if group.group == "lease-0" && closed.is_empty()
    ));
    let dropped = c.commit(plan);
    assert_eq!(
        dropped,
        vec![DroppedGroup {
            task: "task-0".into(),
            group: "lease-0".into(),
            reason: GroupDropReason::NoSignal,
            trajectories: 3,
        }]
    );
    // Released, and reported once: the next plan drops nothing more.
    assert_eq!(c.stats().live_trajectories, 3);
    let plan = c.plan(ask(1, 0, 0, 1));
    assert!(plan.drops.is_empty());
    assert_eq!(served(&plan.outcome), names(&[1]));
    c.commit(plan);
    assert_eq!(
        c.plan(ask(2, 0, 0, 1)).outcome,
        Outcome::NotReady { ready: 0 }
    );
    // The task is done without training: a copy of its rows is a
    // duplicate, another attempt of it is superseded.
    assert!(c.is_known(&RowMeta::of(&flat[0]).unwrap()));
    let copy = feed(&mut c, &flat, 1);
    assert_eq!((copy.stored, copy.duplicates), (0, 3));
    let other: Vec<Trajectory> = (0..3)
        .map(|i| traj_of("task-0", "again", 900 + i, i, 3, 0, 4))
        .collect();
    let o = feed(&mut c, &other, 1);
    assert_eq!((o.stored, o.superseded), (0, 3));
    assert_eq!(
        c.plan(ask(2, 0, 0, 1)).outcome,
        Outcome::NotReady { ready: 0 }
    );
}

#[test]
fn a_group_whose_rewards_span_the_minimum_or_more_is_served() {
    let mut c = spread_core(0.5);
    // max − min = 0.5 is not below 0.5.
    feed(&mut c, &scored_group(0, &[Some(0.0), Some(0.5)]), 1);
    feed(&mut c, &scored_group(1, &[Some(-1.0), Some(2.0)]), 1);
    // Just below: dropped.
    feed(&mut c, &scored_group(2, &[Some(0.0), Some(0.499)]), 1);
    let (outcome, dropped) = serve(&mut c, ask(1, 0, 0, 2));
    assert_eq!(served(&outcome), names(&[0, 1]));
    assert_eq!(dropped.len(), 1);
    assert_eq!(
        (dropped[0].group.as_str(), dropped[0].reason),
        ("lease-2", GroupDropReason::NoSignal)
    );
}

#[test]
fn a_group_with_an_unscored_member_is_kept() {
    let mut c = spread_core(0.5);
    // Two scored members agree, the third could not be scored: the spread
    // is unknown, the learner masks the unscored member.
    feed(&mut c, &scored_group(0, &[Some(1.0), None, Some(1.0)]), 1);
    feed(&mut c, &scored_group(1, &[None, None]), 1);
    let (outcome, dropped) = serve(&mut c, ask(1, 0, 0, 2));
    assert_eq!(served(&outcome), names(&[0, 1]));
    assert!(dropped.is_empty());
}

#[test]
fn dynamic_sampling_is_off_by_default() {
    let mut c = core(SamplingPolicy::Fifo, 1);
    feed(&mut c, &scored_group(0, &[Some(1.0), Some(1.0)]), 1);
    feed(&mut c, &scored_group(1, &[Some(0.0), Some(0.0)]), 1);
    let (outcome, dropped) = serve(&mut c, ask(1, 0, 0, 2));
    assert_eq!(served(&outcome), names(&[0, 1]));
    assert!(dropped.is_empty());
}

#[test]
fn a_stale_group_without_signal_is_a_stale_drop() {
    let mut c = spread_core(0.5);
    let mut old = scored_group(0, &[Some(1.0), Some(1.0)]);
    for t in &mut old {
        t.admission_version = 1;
        t.policy_versions = vec![1; t.completion_token_ids.len()];
    }
    feed(&mut c, &old, 1);
    // v = 5, η = 0: stale, so its task is issued again.
    let (_, dropped) = serve(&mut c, ask(1, 5, 0, 1));
    assert_eq!(dropped.len(), 1);
    assert_eq!(dropped[0].reason, GroupDropReason::Stale);
}

#[test]
fn a_no_signal_drop_survives_a_restart_and_is_not_reported_again() {
    let mut live = spread_core(0.5);
    let mut log: Vec<Record> = Vec::new();
    let flat = scored_group(0, &[Some(0.0), Some(0.0)]);
    let mixed = scored_group(1, &[Some(0.0), Some(1.0)]);
    let late = scored_group(2, &[Some(1.0), Some(1.0)]);
    feed(&mut live, &flat, 1);
    feed(&mut live, &mixed, 1);
    let out = serve_logged(&mut live, &mut log, ask(1, 0, 0, 1));
    assert_eq!(served(&out), names(&[1]));
    // task-2 completes flat after the drop was logged; its group is not
    // dropped yet (no plan since): a restart drops it then, once.
    feed(&mut live, &late, 1);
    let segments = [flat.clone(), mixed.clone(), late.clone(), flat.clone()];
    // From the log and from a snapshot of it; with dynamic sampling still
    // on and turned off since: the logged drop stays a drop.
    for records in [log.clone(), live.snapshot()] {
        for min_spread in [0.5, 0.0] {
            let mut back = recover_spread(min_spread, &records, &segments);
            assert!(back.finish_recovery().is_empty());
            assert!(back.is_known(&RowMeta::of(&flat[0]).unwrap()));
            let plan = back.plan(ask(2, 0, 0, 1));
            assert!(
                plan.drops.iter().all(|(id, _)| &**id != "lease-0"),
                "the logged drop is not planned again: {:?}",
                plan.drops
            );
            let outcome = plan.outcome.clone();
            let dropped = back.commit(plan);
            if min_spread > 0.0 {
                assert_eq!(
                    dropped
                        .iter()
                        .map(|d| (d.group.as_str(), d.reason))
                        .collect::<Vec<_>>(),
                    [("lease-2", GroupDropReason::NoSignal)]
                );
                assert_eq!(outcome, Outcome::NotReady { ready: 0 });
            } else {
                assert!(dropped.is_empty());
                assert_eq!(served(&outcome), names(&[2]));
            }
        }
    }
}
