//! Fault tests: the roles as separate processes over a real nats-server,
//! one fault each in the middle of a run, and the same invariants at the end
//! as the fault-free run (`asyncrl_harness::cluster::Cluster::check_invariants`): every trained
//! trajectory was published and trained exactly once in complete groups,
//! every started task has a complete attempt and was trained at most once,
//! tasks were started in data set order without gaps, versions never went
//! backwards, nothing trained was staler than η, the buffer stored every
//! published trajectory once, and every surviving role exits 0 on SIGTERM.

use std::time::Duration;

use asyncrl_config::TrainerEngineName;
use asyncrl_harness::cluster::{Cluster, Expect, Spec};

const STEP_WAIT: Duration = Duration::from_secs(60);

fn spec() -> Spec {
    Spec {
        max_steps: 24,
        ..Spec::default()
    }
}

#[test]
fn a_worker_killed_mid_rollout_has_its_tasks_issued_again() {
    let mut c = Cluster::start(spec());
    c.wait_step(3, STEP_WAIT);
    // Frozen with leases, then killed: its tasks are mid-rollout.
    let (victim, leases) = c.freeze_a_worker_holding_leases(Duration::from_secs(30));
    let expired_before = c.coordinator_counter("asyncrl_tasks_expired_total");
    c.kill9(&victim);
    eprintln!("killed {victim} holding {leases} leases");
    // The coordinator marks it dead after coordinator.dead_after and issues
    // its tasks again.
    c.wait_metric(
        "coordinator",
        "asyncrl_tasks_expired_total",
        Duration::from_secs(30),
        |v| v >= expired_before + f64::from(leases),
    );
    let report = c.finish(&Expect::default());
    assert!(
        report.coordinator.dead_workers >= 1,
        "{:?}",
        report.coordinator
    );
}

#[test]
fn a_buffer_killed_with_sigkill_restarts_and_loses_or_duplicates_nothing() {
    let mut c = Cluster::start(spec());
    c.wait_step(4, STEP_WAIT);
    c.kill9("buffer");
    // While it is down the workers finish what was admitted: the stream
    // holds trajectories the buffer has not seen.
    c.wait(
        "the admitted tasks to finish while the buffer is down",
        STEP_WAIT,
        |c| {
            c.status()
                .is_some_and(|s| s.running_groups == 0 && s.capacity_left <= 0)
        },
    );
    c.start_role("buffer");
    let report = c.finish(&Expect::default());
    assert!(
        c.current_log("buffer")
            .contains("buffer state recovered from disk"),
        "the restarted buffer did not recover its segments"
    );
    assert_eq!(report.stored_copies, 0);
}

#[test]
fn a_learner_killed_with_sigkill_resumes_from_its_checkpoint() {
    let mut c = Cluster::start(Spec {
        // Checkpoints lag the published versions: a restart adopts the newer
        // published weights or retrains the step whose publish was cut off.
        checkpoint_every: 3,
        ..spec()
    });
    c.wait_step(5, STEP_WAIT);
    c.kill9("learner");
    let restarts = c.coordinator_counter("asyncrl_learner_restarts_total");
    c.start_role("learner");
    // The coordinator sees the new learner session (versions carry on).
    c.wait_metric(
        "coordinator",
        "asyncrl_learner_restarts_total",
        STEP_WAIT,
        |v| v > restarts,
    );
    let log = c.current_log("learner");
    assert!(
        log.contains("resumed from checkpoint"),
        "the restarted learner did not resume from a checkpoint"
    );
    // Versions continue (never backwards, every step once: the invariants).
    c.finish(&Expect {
        learner_restarts: 1,
    });
}

/// A run whose learner trains with the torch engine (a torchrun group of
/// one gloo rank) on the tiny model as a Hugging Face folder.
fn torch_spec(checkpoint_every: u64) -> Spec {
    Spec {
        trainer: TrainerEngineName::Torch,
        max_steps: 16,
        checkpoint_every,
        ..spec()
    }
}

/// The engine starts in seconds, but a loaded machine may take longer.
const TORCH_WAIT: Duration = Duration::from_secs(180);

fn alive(pid: u32) -> bool {
    // A zombie (exited, not yet reaped by its parent) is dead.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rfind(')').map(|i| s[i + 2..].starts_with('Z')))
        .is_some_and(|zombie| !zombie)
}

fn kill(pid: u32, sig: i32) {
    // SAFETY: kill(2) on a process of this test's cluster.
    unsafe {
        libc::kill(pid as i32, sig);
    }
}

/// Resumed: the restarted learner logs it (both engines use the line).
fn assert_resumed(c: &mut Cluster) {
    c.wait("the restarted learner to resume", TORCH_WAIT, |c| {
        c.current_log("learner").contains("resumed from checkpoint")
    });
}

#[test]
fn a_learner_on_the_torch_engine_killed_with_sigkill_takes_its_trainer_along_and_resumes() {
    let mut c = Cluster::start(torch_spec(3));
    c.wait_step(4, TORCH_WAIT);
    let ranks = c.trainer_ranks();
    assert!(!ranks.is_empty(), "the learner runs no torch engine rank");
    c.kill9("learner");
    // No orphaned trainer keeps the model (and on a GPU its memory).
    c.wait("the engine to die with its learner", STEP_WAIT, |_| {
        ranks.iter().all(|&p| !alive(p))
    });
    c.start_role("learner");
    assert_resumed(&mut c);
    let report = c.finish(&Expect {
        learner_restarts: 1,
    });
    assert_eq!(report.steps, 16);
}

#[test]
fn a_torch_engine_killed_mid_step_and_mid_checkpoint_fails_its_learner_which_resumes() {
    let mut c = Cluster::start(torch_spec(1));
    let ckpt = c.out.join("checkpoints");
    let writing = |dir: &std::path::Path| {
        std::fs::read_dir(dir).is_ok_and(|entries| {
            entries.filter_map(Result::ok).any(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                name.starts_with(".step-") && name.ends_with(".tmp")
            })
        })
    };
    for (fault, at_step) in [("mid-step", 3), ("mid-checkpoint", 8)] {
        c.wait_step(at_step, TORCH_WAIT);
        let rank = *c.trainer_ranks().first().expect("a torch engine rank");
        // Frozen at a moment that is (or is not) inside a checkpoint write,
        // then killed there.
        let mut caught = false;
        for _ in 0..20_000 {
            kill(rank, libc::SIGSTOP);
            if writing(&ckpt) == (fault == "mid-checkpoint") {
                caught = true;
                break;
            }
            kill(rank, libc::SIGCONT);
            std::thread::sleep(Duration::from_millis(2));
        }
        assert!(caught, "never caught the engine {fault}");
        kill(rank, libc::SIGKILL);
        // The learner fails at once, naming the engine; it does not hang.
        let status = c.wait_exit("learner", STEP_WAIT);
        assert!(!status.success(), "{fault}: the learner exited {status}");
        let log = c.current_log("learner");
        assert!(
            log.contains("torch trainer engine"),
            "{fault}: the learner's error does not name the engine: {}",
            log.lines().rev().take(5).collect::<Vec<_>>().join("\n")
        );
        c.start_role("learner");
        assert_resumed(&mut c);
    }
    // Versions continue and nothing is trained twice or lost (the invariants).
    let report = c.finish(&Expect {
        learner_restarts: 2,
    });
    assert_eq!(report.steps, 16);
}

#[test]
fn a_torch_engine_across_two_nodes_trains_and_restarts_as_a_gang_when_its_learner_is_killed() {
    // Node 0 is the learner; node 1 is `asyncrl trainer-node`, started as an
    // Indexed Job's pod (JOB_COMPLETION_INDEX = 0), meeting it at a static
    // rendezvous. The engine serves only once both nodes' ranks joined.
    let mut c = Cluster::start(Spec {
        trainer_nodes: 2,
        ..torch_spec(3)
    });
    c.wait_step(4, TORCH_WAIT);
    let node1 = c.trainer_ranks_of("trainer-node-1");
    assert_eq!(node1.len(), 1, "node 1 runs one rank");
    assert!(
        c.current_log("learner").contains("world_size=2"),
        "the learner's engine does not serve two ranks"
    );
    c.kill9("learner");
    // The other node does not wait for a learner that is gone: it fails, so
    // that the whole gang restarts.
    let status = c.wait_exit("trainer-node-1", STEP_WAIT);
    assert!(
        !status.success(),
        "node 1 exited {status} after its learner died"
    );
    c.wait("node 1's rank to die", STEP_WAIT, |_| {
        node1.iter().all(|&p| !alive(p))
    });
    c.start_role("learner");
    c.start_role("trainer-node-1");
    assert_resumed(&mut c);
    // Node 1 leaves with the learner's group, exit 0 (checked by finish).
    let report = c.finish(&Expect {
        learner_restarts: 1,
    });
    assert_eq!(report.steps, 16);
}

#[test]
fn a_coordinator_killed_with_sigkill_continues_from_its_persisted_state() {
    let mut c = Cluster::start(spec());
    c.wait_step(4, STEP_WAIT);
    let status_before = c.status().expect("coordinator status");
    c.kill9("coordinator");
    // Down until the workers have noticed.
    let errors = |c: &mut Cluster| -> f64 {
        c.workers()
            .iter()
            .filter_map(|w| c.metrics(w))
            .map(|m| m.sum("asyncrl_worker_coordinator_errors_total"))
            .sum()
    };
    let before = errors(&mut c);
    c.wait("the workers to miss the coordinator", STEP_WAIT, |c| {
        errors(c) > before
    });
    c.start_role("coordinator");
    let log = {
        c.wait(
            "the coordinator to restore its state",
            Duration::from_secs(30),
            |c| c.current_log("coordinator").contains("coordinator started"),
        );
        c.current_log("coordinator")
    };
    assert!(
        log.contains("coordinator state restored"),
        "the restarted coordinator did not restore its state"
    );
    assert!(!log.contains("new coordinator state"));
    let report = c.finish(&Expect::default());
    assert!(report.coordinator.cursor >= status_before.cursor);
}

#[test]
fn a_nats_server_restart_is_survived_and_jetstream_keeps_its_data() {
    let mut c = Cluster::start(spec());
    c.wait_step(4, STEP_WAIT);
    let (messages, _, _) = c.stream_state().expect("stream state");
    let steps = c.steps_done();
    c.nats.node(0).kill();
    let disconnected = |c: &mut Cluster| {
        ["coordinator", "buffer", "learner", "worker-1", "worker-2"]
            .iter()
            .all(|r| c.current_log(r).contains("NATS connection lost"))
    };
    c.wait(
        "every role to notice the server is gone",
        Duration::from_secs(30),
        disconnected,
    );
    c.nats.node(0).restart().expect("restart nats-server");
    let (after, _, _) = c.stream_state().expect("stream state after the restart");
    assert!(
        after >= messages,
        "the stream lost messages across the restart: {messages} -> {after}"
    );
    c.wait("training to go on", STEP_WAIT, |c| c.steps_done() > steps);
    // The coordinator heard no one while it was cut off itself: that
    // silence did not make it declare live workers dead.
    let log = c.current_log("coordinator");
    assert!(
        !log.contains("marked dead"),
        "live workers were declared dead across the restart:\n{}",
        log.lines()
            .filter(|l| l.contains("marked dead"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    c.finish(&Expect::default());
}

#[test]
fn a_worker_stopped_with_sigterm_drains_and_returns_its_tasks() {
    let mut c = Cluster::start(Spec {
        // In-flight sequences are cut off at once: held tasks are returned.
        drain_grace_period: Duration::from_millis(1),
        ..spec()
    });
    c.wait_step(3, STEP_WAIT);
    let (victim, leases) = c.freeze_a_worker_holding_leases(Duration::from_secs(30));
    let returned_before = c.coordinator_counter("asyncrl_tasks_returned_total");
    c.sigterm(&victim);
    c.thaw(&victim);
    let status = c.wait_exit(&victim, Duration::from_secs(30));
    assert!(status.success(), "{victim} exited with {status}");
    let log = c.current_log(&victim);
    let drain = log
        .lines()
        .find(|l| l.contains("drain finished"))
        .unwrap_or_else(|| panic!("{victim} logged no drain"));
    assert!(drain.contains("clean=true"), "{drain}");
    // Every task it gave back, in the drain or as a grant that arrived
    // while it was stopping: the `tasks_returned` of its summary.
    let summary = log
        .lines()
        .find(|l| l.contains("rollout worker stopped"))
        .unwrap_or_else(|| panic!("{victim} logged no summary"));
    let field = |name: &str| -> f64 {
        summary
            .split(&format!(" {name}: "))
            .nth(1)
            .and_then(|s| s.split(',').next())
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {summary:?}"))
    };
    let returned = field("tasks_returned");
    eprintln!("{victim} held {leases} leases and returned {returned} tasks");
    // Every task it started ended one way: completed (published and
    // accepted), returned, revoked, or refused by the coordinator; returned
    // also counts grants it never started. (How many were still unfinished
    // at SIGTERM depends on timing: a held task may finish in the instant
    // between the thaw and the drain, so none returned is possible.)
    let ended =
        field("tasks_completed") + returned + field("tasks_revoked") + field("completions_refused");
    assert!(
        ended >= field("tasks_started"),
        "a started task neither completed nor returned: {summary}"
    );
    // The coordinator took back exactly what the worker says it returned.
    let now = c.wait_metric(
        "coordinator",
        "asyncrl_tasks_returned_total",
        Duration::from_secs(10),
        |v| v >= returned_before + returned,
    );
    assert_eq!(now, returned_before + returned);
    let gone = c
        .registry()
        .expect("the worker registry")
        .into_iter()
        .find(|w| w.worker_id == victim)
        .map(|w| w.leases)
        .unwrap_or(0);
    assert_eq!(gone, 0, "the coordinator still counts leases of {victim}");
    c.finish(&Expect::default());
}
