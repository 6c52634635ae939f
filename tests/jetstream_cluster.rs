//! The roles as separate processes over a three-node JetStream cluster
//! with every stream, KV bucket and object store at R3 (`bus.replicas` =
//! 3): mid-run the leader of the `TRAJECTORIES` stream is killed with
//! SIGKILL. The cluster elects another leader, the roles reconnect to the
//! surviving servers (every role has the seed list of all three), the run
//! reaches its step target, and the invariants of
//! `asyncrl_harness::cluster::Cluster::check_invariants` hold: every
//! published trajectory was trained exactly once or is accounted for,
//! nothing acked was lost. The same again on a cluster secured as
//! production runs it: TLS with client certificates on the client and
//! route ports, route credentials, and each role with its own user of the
//! shipped permissions (`asyncrl_harness::secure`).

use std::time::{Duration, Instant};

use asyncrl_harness::cluster::{Cluster, Expect, NatsSetup, Spec};
use asyncrl_harness::secure::SecureNats;
use asyncrl_protos::subjects::TRAJECTORY_STREAM;

const STEP_WAIT: Duration = Duration::from_secs(90);
const ELECTION_WAIT: Duration = Duration::from_secs(30);

#[test]
fn killing_the_trajectory_stream_leader_of_a_three_node_cluster_loses_nothing() {
    kill_the_leader_mid_run(NatsSetup {
        cluster_nodes: 3,
        ..NatsSetup::default()
    });
}

#[test]
fn a_cluster_with_tls_route_auth_and_role_credentials_loses_nothing_when_its_leader_dies() {
    let pki = tempfile::tempdir().expect("a temp dir");
    let secure = SecureNats::new(pki.path(), &std::process::id().to_string())
        .expect("a test PKI and passwords");
    let mut c = kill_the_leader_mid_run(secure.setup(3).expect("the secured setup"));
    assert!(
        c.bus_url().split(',').all(|u| u.starts_with("tls://")),
        "{}",
        c.bus_url()
    );
    // Every role ran as its own user, and the server refused none of them
    // anything its user lacks (a reply refused by `allow_responses` after a
    // reconnect to another node is not that: the requester asks again).
    for role in ["coordinator", "buffer", "learner", "worker-1", "worker-2"] {
        let log = c.log(role);
        let refused: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("NATS refused") && !l.contains("reply_refused"))
            .collect();
        assert!(refused.is_empty(), "{role}: {refused:#?}");
    }
}

/// Runs 24 steps over a three-node cluster, killing the leader of
/// TRAJECTORIES mid-run and bringing it back; checks that nothing was lost.
fn kill_the_leader_mid_run(setup: NatsSetup) -> Cluster {
    let max_steps = 24;
    let mut c = Cluster::start_with(
        Spec {
            max_steps,
            ..Spec::default()
        },
        setup,
    );
    assert_eq!(c.bus_url().split(',').count(), 3, "{}", c.bus_url());
    c.wait_step(4, STEP_WAIT);

    // Every store the roles created is replicated on all three servers.
    let replicas = c.nats.stream_replicas();
    for store in [TRAJECTORY_STREAM, "KV_asyncrl_control", "OBJ_WEIGHTS"] {
        assert!(replicas.contains_key(store), "no {store}: {replicas:?}");
    }
    assert!(
        replicas.values().all(|&r| r == 3),
        "a store below R3: {replicas:?}"
    );
    c.wait(
        "TRAJECTORIES to be current on every node",
        ELECTION_WAIT,
        |c| c.nats.stream_peers(TRAJECTORY_STREAM) == [0, 1, 2],
    );

    let leader = c
        .nats
        .wait_stream_leader(TRAJECTORY_STREAM, ELECTION_WAIT)
        .expect("a leader of TRAJECTORIES");
    let meta = c.nats.meta_leader();
    let step = c.steps_done();
    let killed = Instant::now();
    c.nats.kill9(leader);
    let next = c
        .nats
        .wait_stream_leader(TRAJECTORY_STREAM, ELECTION_WAIT)
        .expect("a new leader of TRAJECTORIES");
    let reelected = killed.elapsed();
    assert_ne!(next, leader);
    eprintln!(
        "killed n{leader} (leader of {TRAJECTORY_STREAM}; meta leader {meta:?}) at step {step}; \
         n{next} leads after {reelected:?}"
    );

    // The run goes on over the two survivors ...
    c.wait_step(step + 4, STEP_WAIT);
    eprintln!(
        "step {} reached {:?} after the kill",
        step + 4,
        killed.elapsed()
    );
    // ... and the killed server rejoins and catches up.
    let restarted = Instant::now();
    c.nats.restart(leader).expect("restart the killed server");
    c.wait("the restarted server to rejoin", ELECTION_WAIT, |c| {
        c.nats.stream_peers(TRAJECTORY_STREAM) == [0, 1, 2]
    });
    eprintln!(
        "n{leader} restarted and current again after {:?}",
        restarted.elapsed()
    );

    let report = c.finish(&Expect::default());
    assert_eq!(report.steps, max_steps);
    assert_eq!(report.retrained_steps, 0);
    eprintln!("{report:?}");
    c
}
