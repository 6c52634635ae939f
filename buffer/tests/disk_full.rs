//! The buffer on a full disk, made real with `RLIMIT_FSIZE`: the kernel
//! refuses to grow any file of this process past the limit (`EFBIG`), the
//! same path as `ENOSPC` for the buffer. The buffer must stop acking, keep
//! what it had, say why it is unready, and take everything in once the disk
//! takes writes again, with no trajectory lost or stored twice.
//!
//! One test in this file: the limit is per process (nextest runs each test
//! binary's tests in processes of their own, `cargo test` in threads).

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use asyncrl_buffer::segment::{list_segments, read_segment, segment_path};
use asyncrl_buffer::statelog::STATE_LOG;
use asyncrl_buffer::testing::traj;
use asyncrl_buffer::{Buffer, CancellationToken, DISK_HEALTH_CONDITION, segment_dir};
use asyncrl_config::Config;
use asyncrl_protos::Trajectory;
use asyncrl_protos::arrow_schema::{from_record_batch, trajectory_schema};
use asyncrl_telemetry::{Health, Metrics, Readiness};
use asyncrl_testkit::NatsServer;

use common::*;

const WAIT: Duration = Duration::from_secs(30);

fn groups(first: u32, n: u32, g: u32, tokens: usize) -> Vec<Trajectory> {
    (first * g..(first + n) * g)
        .map(|i| traj(i, g, 0, tokens))
        .collect()
}

/// Sets the soft limit on the size of files this process writes.
fn set_file_size_limit(bytes: libc::rlim_t) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain syscalls on a local struct.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_FSIZE, &mut lim), 0);
        lim.rlim_cur = bytes.min(lim.rlim_max);
        assert_eq!(
            libc::setrlimit(libc::RLIMIT_FSIZE, &lim),
            0,
            "setrlimit: {}",
            std::io::Error::last_os_error()
        );
    }
}

fn hard_file_size_limit() -> libc::rlim_t {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: as above.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_FSIZE, &mut lim), 0);
    }
    lim.rlim_max
}

/// `asyncrl_<name>{<labels>}`, 0 when absent.
fn labelled(metrics: &Metrics, name: &str, labels: &str) -> f64 {
    let text = metrics.encode_prometheus_text().expect("encode metrics");
    let prefix = format!("asyncrl_{name}{{{labels}}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

fn disk_reason(health: &Health) -> Option<String> {
    match health.readiness() {
        Readiness::Ready => None,
        Readiness::NotReady(v) => v
            .into_iter()
            .find(|(name, _)| name == DISK_HEALTH_CONDITION)
            .map(|(_, reason)| reason),
    }
}

/// Every trajectory in the segments by uuid, with how often it is stored;
/// every segment must read back without a torn tail.
fn stored(seg_dir: &Path) -> HashMap<String, usize> {
    let mut out = HashMap::new();
    for id in list_segments(seg_dir).unwrap() {
        let scan = read_segment(seg_dir, id, &trajectory_schema()).unwrap();
        assert_eq!(scan.tail_error, None, "segment {id} is intact");
        for b in &scan.batches {
            for t in from_record_batch(b).unwrap() {
                *out.entry(t.uuid).or_default() += 1;
            }
        }
    }
    out
}

/// (messages in the stream, not yet delivered, delivered but not acked) of
/// the buffer's consumer, from the server.
async fn consumer_state(js: &async_nats::jetstream::Context, config: &Config) -> (u64, u64, usize) {
    let mut stream = js
        .get_stream(asyncrl_protos::subjects::TRAJECTORY_STREAM)
        .await
        .expect("trajectory stream");
    let messages = stream.info().await.expect("stream info").state.messages;
    let mut consumer: async_nats::jetstream::consumer::PullConsumer = stream
        .get_consumer(&config.buffer.consumer_name)
        .await
        .expect("buffer consumer");
    let info = consumer.info().await.expect("consumer info");
    (messages, info.num_pending, info.num_ack_pending)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_stops_ingest_and_loses_nothing() {
    // Started before the limit is lowered, so the server does not inherit it.
    let server = NatsServer::start().unwrap();
    // At the limit the kernel sends SIGXFSZ, which kills by default; ignored,
    // the write fails with EFBIG instead.
    // SAFETY: changes this process's disposition of one signal.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
    let hard_limit = hard_file_size_limit();
    let dir = tempfile::tempdir().unwrap();
    let config = config(&server.url(), dir.path());
    let data_dir = config.buffer.data_dir_in(&config.run.output_dir);
    let seg_dir = segment_dir(&data_dir);
    let bus = nats(&server.url()).await;
    let js = async_nats::jetstream::new(async_nats::connect(server.url()).await.unwrap());
    let metrics = Metrics::new();
    let health = Health::new();
    let buffer = Buffer::open(&config, bus.clone(), &metrics)
        .await
        .unwrap()
        .with_health(health.clone());
    let handle = buffer.handle();
    let stop = CancellationToken::new();
    let task = tokio::spawn(buffer.run(stop.clone()));

    // Before: 4 groups of 4 stored and acked; step 1 served (2 groups).
    let first = groups(0, 4, 4, 64);
    publish(bus.as_ref(), &first).await;
    eventually("the first groups are stored", WAIT, || {
        handle.stats().ready_groups == 4
    })
    .await;
    let (reply, got) = ask(bus.as_ref(), 1, 0, 4, 2, 0).await.unwrap();
    assert_eq!(reply.num_groups, 2);
    let step1 = uuids(&got);
    assert!(health.is_ready(), "{:?}", health.readiness());
    let ids = list_segments(&seg_dir).unwrap();
    let active: PathBuf = segment_path(&seg_dir, *ids.last().unwrap());
    let seg_len = std::fs::metadata(&active).unwrap().len();
    let log_path = data_dir.join(STATE_LOG);
    let log_len = std::fs::metadata(&log_path).unwrap().len();
    assert!(log_len > 0);

    // The disk fills: a file may grow 100 bytes past the active segment, less
    // than one frame, so the next append is cut off midway.
    set_file_size_limit(seg_len + 100);
    let second = groups(4, 4, 4, 64);
    publish(bus.as_ref(), &second).await;
    eventually("ingest blocked, retried with backoff", WAIT, || {
        common::metric(&metrics, "buffer_disk_write_blocked") == 1.0
            && labelled(
                &metrics,
                "buffer_disk_write_failures_total",
                "what=\"segment_append\"",
            ) >= 3.0
    })
    .await;
    let reason = disk_reason(&health).expect("unready on the disk condition");
    assert!(
        reason.contains(&active.display().to_string()) && reason.contains("os error 27"),
        "the reason names the file and the OS error (EFBIG): {reason}"
    );
    assert!(reason.contains("ingest stopped"), "{reason}");
    // Nothing of the second lot was acked or taken in...
    let (messages, not_delivered, unacked) = consumer_state(&js, &config).await;
    // (The stream may release acked messages: `bus.storage`.)
    assert!(
        messages >= 16,
        "the new ones wait in the stream: {messages}"
    );
    assert_eq!(
        not_delivered + unacked as u64,
        16,
        "none of the 16 new acked"
    );
    assert_eq!(
        common::metric(&metrics, "buffer_ingested_trajectories_total"),
        16.0
    );
    assert_eq!(handle.stats().ready_groups, 2);
    // ...and what was stored is intact: the torn frame was cut off.
    assert_eq!(std::fs::metadata(&active).unwrap().len(), seg_len);
    let before = stored(&seg_dir);
    assert_eq!(before.len(), 16);
    assert!(before.values().all(|n| *n == 1));
    assert!(first.iter().all(|t| before.contains_key(&t.uuid)));

    // Now not even the served log can grow: a batch is refused, not served
    // unlogged, and the log stays as it was.
    set_file_size_limit(1);
    let refused = ask(bus.as_ref(), 2, 0, 4, 2, 0).await.unwrap_err();
    assert!(
        refused.contains("served log") && refused.contains(STATE_LOG),
        "{refused}"
    );
    assert!(
        labelled(
            &metrics,
            "buffer_disk_write_failures_total",
            "what=\"served_log\""
        ) >= 1.0
    );
    let reason = disk_reason(&health).expect("still unready");
    assert!(reason.contains("batch requests refused"), "{reason}");
    assert_eq!(std::fs::metadata(&log_path).unwrap().len(), log_len);

    // Space returns: ingest resumes by itself, nothing lost.
    set_file_size_limit(hard_limit);
    eventually("the held batch is written and acked", WAIT, || {
        handle.stats().ready_groups == 6
    })
    .await;
    asyncrl_testkit::eventually("every message acked", WAIT, || async {
        let (_, not_delivered, unacked) = consumer_state(&js, &config).await;
        (not_delivered == 0 && unacked == 0).then_some(())
    })
    .await;
    assert_eq!(
        common::metric(&metrics, "buffer_ingested_trajectories_total"),
        32.0
    );
    let (reply, got) = ask(bus.as_ref(), 2, 0, 4, 6, 0).await.unwrap();
    assert_eq!(reply.num_groups, 6);
    assert!(!reply.replayed);
    let served = uuids(&got);
    assert!(served.is_disjoint(&step1));
    assert_eq!(
        served.len() + step1.len(),
        32,
        "every trajectory served once"
    );
    // The served log took the decision: ready again, the gauge is down.
    assert_eq!(common::metric(&metrics, "buffer_disk_write_blocked"), 0.0);
    assert!(health.is_ready(), "{:?}", health.readiness());
    let after = stored(&seg_dir);
    assert_eq!(after.len(), 32);
    assert!(
        after.values().all(|n| *n == 1),
        "each trajectory stored exactly once: {after:?}"
    );
    assert!(
        first
            .iter()
            .chain(&second)
            .all(|t| after.contains_key(&t.uuid))
    );
    stop.cancel();
    task.await.unwrap().unwrap();
}
