//! Bounded NATS storage: the roles as processes over a real nats-server,
//! with the product's default `bus.storage.trajectories = "release"`. The
//! trajectory stream lets go of each message once the buffer has stored and
//! acked it, so what it holds, in messages and on disk, is bounded by what
//! the coordinator admits ((η+1)·B·G trajectories), not by how long the run
//! has been going; and the buffer reports every store's size and limit.
//! (The other stores are bounded by their `bus.storage` limits; that their
//! disk levels off over a long run is shown by `asyncrl-bench chaos`.)

use std::path::Path;
use std::time::Duration;

use asyncrl_common::dir_bytes;
use asyncrl_config::TrajectoryRetention;
use asyncrl_harness::cluster::{Cluster, Expect, Spec};
use asyncrl_protos::subjects::{
    CONTROL_BUCKET, DEAD_LETTER_STREAM, TRAJECTORY_STREAM, WEIGHTS_BUCKET,
};

#[derive(Debug, Clone, Copy)]
struct Sample {
    step: u64,
    messages: u64,
    /// Bytes of the whole JetStream store, and of the trajectory stream's
    /// own directory.
    disk: u64,
    stream_disk: u64,
}

/// The streams' directories in the server's store (testkit passes
/// `<store>/jetstream` as `-sd`, under which JetStream keeps its own
/// `jetstream/`; `$G` is the default account).
fn streams_dir(store: &Path) -> std::path::PathBuf {
    store.join("jetstream/jetstream/$G/streams")
}

#[test]
fn the_trajectory_stream_does_not_grow_with_trained_steps() {
    let spec = Spec {
        max_steps: 40,
        stream: TrajectoryRetention::Release,
        ..Spec::default()
    };
    let per_step = u64::from(spec.groups_per_step * spec.group_size);
    let admitted = u64::from(spec.eta + 1) * per_step;
    let max_steps = spec.max_steps;
    let mut c = Cluster::start(spec);
    let mut samples: Vec<Sample> = Vec::new();
    let mut last_step = u64::MAX;
    c.wait(
        "the learner to train every step",
        Duration::from_secs(240),
        |c| {
            let step = c.steps_done();
            if step != last_step
                && let Some((messages, _, _)) = c.stream_state()
            {
                last_step = step;
                let store = c.nats.nodes()[0].store_dir();
                samples.push(Sample {
                    step,
                    messages,
                    disk: dir_bytes(store),
                    stream_disk: dir_bytes(&streams_dir(store).join(TRAJECTORY_STREAM)),
                });
            }
            step >= max_steps
        },
    );
    eprintln!(
        "samples (step, messages in TRAJECTORIES, its directory, the whole JetStream store):"
    );
    for s in &samples {
        eprintln!(
            "  {:>3} {:>4} {:>9} {:>9}",
            s.step, s.messages, s.stream_disk, s.disk
        );
    }
    if let Ok(streams) = std::fs::read_dir(streams_dir(c.nats.nodes()[0].store_dir())) {
        for e in streams.flatten() {
            eprintln!(
                "  store {:?}: {} bytes",
                e.file_name(),
                dir_bytes(&e.path())
            );
        }
    }
    assert!(samples.len() >= 10, "too few samples: {samples:?}");

    // The stream holds only what the buffer has not stored yet: never more
    // than the coordinator admits, however many steps have been trained.
    let most = samples.iter().map(|s| s.messages).max().unwrap_or(0);
    assert!(
        most <= admitted,
        "the stream held {most} messages; the coordinator admits at most (η+1)·B·G = {admitted}"
    );
    // On disk too: the stream's directory holds only the backlog (JetStream
    // frees a work queue's blocks as messages are acked; when exactly it
    // reclaims the space is its own business, so only the bound is checked).
    let most_disk = samples.iter().map(|s| s.stream_disk).max().unwrap_or(0);
    assert!(
        most_disk <= admitted * 2048 + 16 * 1024,
        "the TRAJECTORIES directory reached {most_disk} bytes for at most {admitted} messages"
    );

    // The buffer exports the size and the limit of every store.
    let metrics = c.metrics("buffer").expect("the buffer's /metrics");
    let limit = metrics
        .get(&format!(
            "asyncrl_nats_store_max_bytes{{store=\"{TRAJECTORY_STREAM}\"}}"
        ))
        .expect("asyncrl_nats_store_max_bytes of TRAJECTORIES");
    assert_eq!(
        limit,
        asyncrl_config::StorageConfig::default().trajectories_max_bytes as f64
    );
    for store in [
        DEAD_LETTER_STREAM.to_owned(),
        format!("KV_{CONTROL_BUCKET}"),
        format!("OBJ_{WEIGHTS_BUCKET}"),
    ] {
        assert!(
            metrics
                .get(&format!("asyncrl_nats_store_bytes{{store=\"{store}\"}}"))
                .is_some(),
            "no asyncrl_nats_store_bytes for {store}"
        );
    }

    let report = c.finish(&Expect::default());
    // Far more passed through the stream than it ever held.
    assert!(
        report.stream_trajectories as u64 >= 10 * admitted,
        "{} trajectories stored, bound {admitted}",
        report.stream_trajectories
    );
}

/// Releasing what the buffer acked keeps at-least-once delivery: a buffer
/// killed with SIGKILL mid-run finds, on restart, every trajectory it had
/// not acked still in the stream (the backlog the workers built while it
/// was down), and the run's invariants hold against its segments.
#[test]
fn a_releasing_stream_keeps_what_a_killed_buffer_had_not_acked() {
    let mut c = Cluster::start(Spec {
        max_steps: 16,
        stream: TrajectoryRetention::Release,
        ..Spec::default()
    });
    c.wait_step(4, Duration::from_secs(60));
    c.kill9("buffer");
    c.wait(
        "the admitted tasks to finish while the buffer is down",
        Duration::from_secs(60),
        |c| {
            c.status()
                .is_some_and(|s| s.running_groups == 0 && s.capacity_left <= 0)
        },
    );
    let (backlog, _, _) = c.stream_state().expect("stream state");
    assert!(
        backlog > 0,
        "the workers published nothing while the buffer was down"
    );
    c.start_role("buffer");
    let report = c.finish(&Expect::default());
    assert_eq!(report.steps, 16);
    assert_eq!(report.stored_copies, 0);
}
