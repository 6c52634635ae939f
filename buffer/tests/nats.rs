//! The buffer in this process against a real nats-server: dedupe, dead
//! letters, staleness, repeated steps across restarts, the object-store
//! hand-over of large batches, and the in-process bus.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;

use asyncrl_buffer::decode_batch;
use asyncrl_buffer::segment::{list_segments, read_segment};
use asyncrl_buffer::segment_dir;
use asyncrl_protos::arrow_schema::trajectory_schema;
use asyncrl_protos::subjects::{
    BUFFER_GROUP_DROPPED, CONTROL_BUCKET, DEAD_LETTER_PAYLOAD_MAX, DEAD_LETTER_STREAM,
    EPOCHS_CLOSED_KEY, trajectory_subject, wire_task_id,
};
use asyncrl_protos::v1::{BatchRequest, DeadLetter, EpochsClosed, GroupDropped, RefusedGroup};
use asyncrl_protos::{GroupDropReason, Message, Trajectory};
use asyncrl_testkit::NatsServer;
use asyncrl_transport::{Bus, ConsumerSpec, LocalBus};

use asyncrl_buffer::testing::{traj, traj_of};
use common::*;

const WAIT: Duration = Duration::from_secs(15);

fn groups(first: u32, n: u32, g: u32, version: i32, tokens: usize) -> Vec<Trajectory> {
    (first * g..(first + n) * g)
        .map(|i| traj(i, g, version, tokens))
        .collect()
}

fn rows_on_disk(config: &asyncrl_config::Config) -> usize {
    let dir = segment_dir(&config.buffer.data_dir_in(&config.run.output_dir));
    list_segments(&dir)
        .unwrap()
        .into_iter()
        .map(|id| {
            read_segment(&dir, id, &trajectory_schema())
                .unwrap()
                .batches
                .iter()
                .map(|b| b.num_rows())
                .sum::<usize>()
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_publishes_are_stored_once() {
    let server = NatsServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = config(&server.url(), dir.path());
    let bus = nats(&server.url()).await;
    let buffer = Running::start(&config, bus.clone()).await;
    let trajs = groups(0, 8, 4, 0, 32);
    publish(bus.as_ref(), &trajs).await;
    // The same messages again: the server's dedupe window drops these...
    publish(bus.as_ref(), &trajs).await;
    // ...and these (new message ids, as after the window) reach the buffer.
    for t in &trajs {
        publish_as(bus.as_ref(), t, &format!("again-{}", t.uuid)).await;
    }
    eventually("ingest and dedupe", WAIT, || {
        buffer.metric("buffer_duplicates_total") >= 32.0
    })
    .await;
    assert_eq!(buffer.metric("buffer_ingested_trajectories_total"), 32.0);
    assert_eq!(buffer.metric("buffer_duplicates_total"), 32.0);
    assert_eq!(rows_on_disk(&config), 32, "each trajectory stored once");
    assert_eq!(buffer.handle.stats().ready_groups, 8);
    let (reply, got) = ask(bus.as_ref(), 1, 0, 2, 8, 0).await.unwrap();
    assert_eq!(reply.num_groups, 8);
    assert_eq!(got.len(), 32);
    assert_eq!(uuids(&got), uuids(&trajs));
    assert_eq!(groups_of(&got).len(), 8);
    buffer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_messages_are_dead_lettered_and_ingest_goes_on() {
    let server = NatsServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = config(&server.url(), dir.path());
    let bus = nats(&server.url()).await;
    let buffer = Running::start(&config, bus.clone()).await;
    let mut dlq = bus.subscribe(BUFFER_GROUP_DROPPED).await.unwrap();
    // Garbage, a contract violation, a group violation, then good groups.
    let garbage = Bytes::from_static(&[0xff, 0xfe, 0x00, 0x13, 0x37]);
    bus.publish_durable(&trajectory_subject("junk"), "junk-1", garbage.clone())
        .await
        .unwrap();
    let mut bad_logprob = traj_of("t-bad", "g-bad", 1, 0, 2, 0, 8);
    bad_logprob.behaviour_logprobs[3] = 0.5;
    publish(bus.as_ref(), &[bad_logprob.clone()]).await;
    let first = traj_of("t-x", "g-x", 2, 0, 2, 0, 8);
    let same_index = traj_of("t-x", "g-x", 3, 0, 2, 0, 8);
    publish(bus.as_ref(), &[first, same_index.clone()]).await;
    let good = groups(10, 3, 2, 0, 8);
    publish(bus.as_ref(), &good).await;
    eventually("three dead letters and the good groups", WAIT, || {
        buffer.handle.stats().ready_groups >= 3
            && metric_sum(&buffer, "buffer_dead_lettered_total") >= 3.0
    })
    .await;
    assert_eq!(metric_sum(&buffer, "buffer_dead_lettered_total"), 3.0);
    let consumer = bus
        .consumer(DEAD_LETTER_STREAM, &ConsumerSpec::new("test-dlq"))
        .await
        .unwrap();
    let letters = consumer.fetch(10, Duration::from_secs(2)).await.unwrap();
    assert_eq!(letters.len(), 3, "{letters:?}");
    let letters: Vec<DeadLetter> = letters
        .iter()
        .map(|d| DeadLetter::decode(d.payload.clone()).unwrap())
        .collect();
    let by_subject = |s: &str| letters.iter().find(|l| l.subject == s).unwrap();
    let junk = by_subject(&trajectory_subject("junk"));
    assert_eq!(junk.payload, garbage.to_vec(), "original bytes kept");
    assert!(junk.reason.contains("does not decode"), "{}", junk.reason);
    assert_eq!(junk.msg_id, "junk-1");
    let bad = by_subject(&trajectory_subject("t-bad"));
    assert!(bad.reason.contains("behaviour_logprobs"), "{}", bad.reason);
    assert_eq!(bad.payload, bad_logprob.encode_to_vec());
    let dup = by_subject(&trajectory_subject("t-x"));
    assert!(dup.reason.contains("index_in_group 0"), "{}", dup.reason);
    assert_eq!(dup.payload, same_index.encode_to_vec());
    // Everything was acked: nothing is redelivered after the ack wait.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert_eq!(metric_sum(&buffer, "buffer_dead_lettered_total"), 3.0);
    assert_eq!(buffer.metric("buffer_ingested_trajectories_total"), 7.0);
    let (_, got) = ask(bus.as_ref(), 1, 0, 2, 3, 0).await.unwrap();
    assert_eq!(uuids(&got), uuids(&good));
    assert!(
        tokio::time::timeout(Duration::from_millis(100), dlq.next())
            .await
            .is_err(),
        "no group was dropped"
    );
    buffer.shutdown().await;
}

fn metric_sum(b: &Running, name: &str) -> f64 {
    let text = b.metrics.encode_prometheus_text().unwrap();
    text.lines()
        .filter(|l| l.starts_with(&format!("asyncrl_{name}{{")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The group ids of the next `n` drop reports, each a stale drop (of
/// `trajectories`, when known).
async fn stale_reports(
    reports: &mut (impl futures::Stream<Item = asyncrl_transport::Message> + Unpin),
    n: usize,
    trajectories: Option<u32>,
) -> HashSet<String> {
    let mut groups = HashSet::new();
    for _ in 0..n {
        let msg = tokio::time::timeout(WAIT, reports.next())
            .await
            .unwrap()
            .unwrap();
        let d = GroupDropped::decode(msg.payload).unwrap();
        assert_eq!(d.kind(), asyncrl_protos::GroupDropReason::Stale);
        if let Some(t) = trajectories {
            assert_eq!(d.trajectories, t);
        }
        groups.insert(d.group_id);
    }
    groups
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_group_is_never_served() {
    let server = NatsServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = config(&server.url(), dir.path());
    let bus = nats(&server.url()).await;
    let buffer = Running::start(&config, bus.clone()).await;
    let mut dropped = bus.subscribe(BUFFER_GROUP_DROPPED).await.unwrap();
    let old = groups(0, 2, 2, 1, 16); // tokens of version 1, admitted first
    let mut mixed = groups(2, 1, 2, 5, 16); // one token of version 2
    mixed[1].policy_versions[0] = 2;
    mixed[1].admission_version = 2;
    mixed[0].admission_version = 2;
    let fresh = groups(3, 2, 2, 4, 16);
    publish(bus.as_ref(), &old).await;
    publish(bus.as_ref(), &mixed).await;
    publish(bus.as_ref(), &fresh).await;
    eventually("5 ready groups", WAIT, || {
        buffer.handle.stats().ready_groups == 5
    })
    .await;
    // v = 5, η = 2: nothing older than version 3 may be trained.
    let (reply, got) = ask(bus.as_ref(), 1, 5, 2, 2, 0).await.unwrap();
    assert_eq!(reply.num_groups, 2);
    assert_eq!(reply.stale_dropped, 3);
    assert_eq!(uuids(&got), uuids(&fresh));
    assert!(
        got.iter()
            .all(|t| t.policy_versions.iter().all(|v| *v >= 3))
    );
    assert_eq!(buffer.metric("stale_dropped_total"), 3.0);
    let reported = stale_reports(&mut dropped, 3, Some(2)).await;
    assert_eq!(
        reported,
        HashSet::from(["lease-0".into(), "lease-1".into(), "lease-2".into()])
    );
    // The stale groups are gone for good: not ready, not served later.
    let (reply, _) = ask(bus.as_ref(), 2, 6, 2, 1, 0).await.unwrap();
    assert_eq!((reply.num_groups, reply.ready_groups), (0, 0));
    // Served token staleness: 16 tokens per trajectory, 4 trajectories, lag 1.
    let text = buffer.metrics.encode_prometheus_text().unwrap();
    assert!(
        text.contains("asyncrl_buffer_served_token_staleness_count 64"),
        "{text}"
    );
    buffer.shutdown().await;
    // A restarted buffer reports the stale drops of still-open tasks again
    // (a report may have died with the process before it was stored); the
    // coordinator applies each once.
    let buffer = Running::start(&config, bus.clone()).await;
    // (What a group held is not known again after a restart.)
    let again = stale_reports(&mut dropped, 3, None).await;
    assert_eq!(again, reported);
    buffer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_step_gets_the_same_groups_across_a_restart() {
    let server = NatsServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(&server.url(), dir.path());
    // Small inline limit: batches go through the object store.
    config.buffer.inline_reply_max_bytes = 4096;
    config.buffer.segment_max_bytes = 64 * 1024;
    // Compact the served log after every record: the restart reads a snapshot.
    config.buffer.state_log_compact_bytes = 1;
    let bus = nats(&server.url()).await;
    let buffer = Running::start(&config, bus.clone()).await;
    // One group (4 × ~6 KB) per segment frame: segments of 3 groups each.
    let trajs = groups(0, 12, 4, 0, 512);
    for (i, group) in trajs.chunks(4).enumerate() {
        publish(bus.as_ref(), group).await;
        eventually("the group ready", WAIT, || {
            buffer.handle.stats().ready_groups == i + 1
        })
        .await;
    }
    let (r1, step1) = ask(bus.as_ref(), 1, 0, 4, 4, 0).await.unwrap();
    assert!(!r1.object_name.is_empty(), "batch handed over as an object");
    assert!(!r1.replayed);
    let (r1b, again) = ask(bus.as_ref(), 1, 0, 4, 4, 0).await.unwrap();
    assert!(r1b.replayed);
    assert_eq!(uuids(&again), uuids(&step1));
    let (_, step2) = ask(bus.as_ref(), 2, 1, 4, 4, 0).await.unwrap();
    // Step 1 (groups 0-3) is trained: the first segment held only those.
    assert!(buffer.metric("buffer_segments_deleted_total") >= 1.0);
    buffer.shutdown().await;
    // A crash mid-append leaves half a frame at the end of the newest segment.
    let seg_dir = segment_dir(&config.buffer.data_dir_in(&config.run.output_dir));
    let last = *list_segments(&seg_dir).unwrap().last().unwrap();
    let path = asyncrl_buffer::segment::segment_path(&seg_dir, last);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes.extend_from_slice(&[0x40, 0, 0, 0, 1, 2, 3, 4, 5, 6]);
    std::fs::write(&path, bytes).unwrap();

    // A new buffer on the same data: step 2 is repeated identically, step 1
    // is trained and refused, step 3 gets the rest, nothing twice.
    let buffer = Running::start(&config, bus.clone()).await;
    assert_eq!(buffer.recovered.torn_tails, 1);
    assert_eq!(buffer.recovered.log_records, 2, "a snapshot and step 2");
    // Groups 4-11 are all on disk; some of the trained groups 0-3 are gone.
    let on_disk = buffer.recovered.trajectories;
    assert!((32..48).contains(&on_disk), "{on_disk}");
    assert_eq!(buffer.handle.stats().ready_groups, 4);
    let (r2, again2) = ask(bus.as_ref(), 2, 1, 4, 4, 0).await.unwrap();
    assert!(r2.replayed);
    assert_eq!(groups_of(&again2), groups_of(&step2));
    assert_eq!(again2, step2, "the same trajectories in the same order");
    let err = ask(bus.as_ref(), 1, 0, 4, 4, 0).await.unwrap_err();
    assert!(err.contains("already trained"), "{err}");
    assert_eq!(buffer.metric("buffer_batches_refused_total"), 1.0);
    let (_, step3) = ask(bus.as_ref(), 3, 2, 4, 4, 0).await.unwrap();
    let mut all: Vec<String> = step1.iter().map(|t| t.uuid.clone()).collect();
    all.extend(step2.iter().map(|t| t.uuid.clone()));
    all.extend(step3.iter().map(|t| t.uuid.clone()));
    let distinct: HashSet<String> = all.iter().cloned().collect();
    assert_eq!(all.len(), 48);
    assert_eq!(distinct, uuids(&trajs));
    // Step 2 (groups 4-7) is trained: more segments held only trained groups.
    assert!(buffer.metric("buffer_segments_deleted_total") >= 1.0);
    buffer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waits_for_groups_to_become_ready() {
    let server = NatsServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = config(&server.url(), dir.path());
    let bus = nats(&server.url()).await;
    let buffer = Running::start(&config, bus.clone()).await;
    let trajs = groups(0, 2, 2, 0, 8);
    let learner = {
        let bus = bus.clone();
        tokio::spawn(async move { ask(bus.as_ref(), 1, 0, 1, 2, 10_000).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    publish(bus.as_ref(), &trajs).await;
    let (reply, got) = learner.await.unwrap().unwrap();
    assert_eq!(reply.num_groups, 2);
    assert_eq!(uuids(&got), uuids(&trajs));
    // Without enough groups and without waiting: how many are ready.
    let (reply, _) = ask(bus.as_ref(), 2, 1, 1, 5, 0).await.unwrap();
    assert_eq!((reply.num_groups, reply.ready_groups), (0, 0));
    buffer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_process_bus_runs_the_same_buffer() {
    let dir = tempfile::tempdir().unwrap();
    let config = config("local", dir.path());
    let bus: Arc<dyn Bus> = Arc::new(LocalBus::new());
    let buffer = Running::start(&config, bus.clone()).await;
    let trajs = groups(0, 4, 2, 3, 8);
    publish(bus.as_ref(), &trajs).await;
    publish(bus.as_ref(), &trajs[..2]).await;
    eventually("4 ready groups", WAIT, || {
        buffer.handle.stats().ready_groups == 4
    })
    .await;
    let (_, got) = ask(bus.as_ref(), 1, 3, 0, 4, 0).await.unwrap();
    assert_eq!(uuids(&got), uuids(&trajs));
    assert_eq!(buffer.metric("buffer_ingested_trajectories_total"), 8.0);
    buffer.shutdown().await;
}

/// The learner refuses a group it was served (a row it cannot train on,
/// a non-finite loss): the buffer dead-letters the group with its reason
/// and reference, reports it quarantined (the coordinator issues the task
/// again), serves the step anew from other groups, and a restarted buffer
/// agrees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_the_learner_refuses_is_quarantined_and_the_step_is_served_anew() {
    let server = NatsServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = config(&server.url(), dir.path());
    let bus = nats(&server.url()).await;
    let buffer = Running::start(&config, bus.clone()).await;
    let mut drops = bus.subscribe(BUFFER_GROUP_DROPPED).await.unwrap();
    let all = groups(0, 4, 2, 0, 8);
    publish(bus.as_ref(), &all).await;
    eventually("four ready groups", WAIT, || {
        buffer.handle.stats().ready_groups >= 4
    })
    .await;
    let request = |refused: Vec<RefusedGroup>| BatchRequest {
        learner_version: 0,
        num_groups: 2,
        eta: 2,
        step: 1,
        wait_ms: 0,
        refused,
        ..Default::default()
    };
    let (_, first) = ask_request(bus.as_ref(), request(Vec::new()))
        .await
        .unwrap();
    let first_groups = groups_of(&first);
    assert_eq!(first_groups.len(), 2);
    let bad = first_groups[1].clone();
    let refused = vec![RefusedGroup {
        group_id: bad.clone(),
        reason:
            "row 3: `completion_token_ids` holds token id 1000000, outside the vocabulary [0, 98)"
                .into(),
    }];
    let (reply, again) = ask_request(bus.as_ref(), request(refused.clone()))
        .await
        .unwrap();
    assert!(!reply.replayed);
    let again_groups = groups_of(&again);
    assert_eq!(again_groups.len(), 2);
    assert!(!again_groups.contains(&bad), "{again_groups:?}");
    assert!(again_groups.contains(&first_groups[0]), "{again_groups:?}");
    // Reported quarantined, for the coordinator to issue the task again.
    let msg = tokio::time::timeout(WAIT, drops.next())
        .await
        .unwrap()
        .unwrap();
    let dropped = GroupDropped::decode(msg.payload).unwrap();
    assert_eq!(dropped.group_id, bad);
    assert_eq!(dropped.kind(), GroupDropReason::Quarantined);
    // The dead letter names the group, its task, the step and the reason,
    // and holds the group's rows.
    let consumer = bus
        .consumer(DEAD_LETTER_STREAM, &ConsumerSpec::new("test-dlq"))
        .await
        .unwrap();
    let letters = consumer.fetch(10, Duration::from_secs(2)).await.unwrap();
    assert_eq!(letters.len(), 1, "{letters:?}");
    let letter = DeadLetter::decode(letters[0].payload.clone()).unwrap();
    assert_eq!((letter.group_id.as_str(), letter.step), (bad.as_str(), 1));
    let task = &all.iter().find(|t| t.group_id == bad).unwrap().task_id;
    assert_eq!(&letter.task_id, task);
    assert!(
        letter.reason.contains("outside the vocabulary"),
        "{}",
        letter.reason
    );
    assert!(!letter.truncated);
    let rows: usize = decode_batch(&letter.payload)
        .unwrap()
        .iter()
        .map(|b| b.num_rows())
        .sum();
    assert_eq!(rows, 2);
    assert_eq!(
        metric_sum(&buffer, "buffer_dead_lettered_total"),
        1.0,
        "counted once"
    );
    // The same refusal again (a retried request) changes nothing: the step
    // replays its new groups.
    let (reply, retried) = ask_request(bus.as_ref(), request(refused)).await.unwrap();
    assert!(reply.replayed);
    assert_eq!(groups_of(&retried), again_groups);
    // A restarted buffer serves the same, and never the refused group.
    buffer.shutdown().await;
    let buffer = Running::start(&config, bus.clone()).await;
    let (reply, after) = ask_request(bus.as_ref(), request(Vec::new()))
        .await
        .unwrap();
    assert!(reply.replayed);
    assert_eq!(groups_of(&after), again_groups);
    let (_, next) = ask(bus.as_ref(), 2, 1, 2, 1, 0).await.unwrap();
    assert!(!groups_of(&next).contains(&bad));
    buffer.shutdown().await;
}

/// A malformed message near the server's payload limit: its dead letter
/// carries the first bytes and the size, so it fits, and the message is
/// acked (not redelivered forever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_message_near_the_payload_limit_is_dead_lettered_truncated() {
    let server = NatsServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = config(&server.url(), dir.path());
    let bus = nats(&server.url()).await;
    let buffer = Running::start(&config, bus.clone()).await;
    // 1 MiB is the server's max_payload; leave room for the headers.
    let size = 1024 * 1024 - 1024;
    let junk = Bytes::from(vec![0xffu8; size]);
    bus.publish_durable(&trajectory_subject("junk"), "junk-big", junk)
        .await
        .unwrap();
    publish(bus.as_ref(), &groups(0, 1, 2, 0, 8)).await;
    eventually("the dead letter and the good group", WAIT, || {
        buffer.handle.stats().ready_groups >= 1
            && metric_sum(&buffer, "buffer_dead_lettered_total") >= 1.0
    })
    .await;
    let consumer = bus
        .consumer(DEAD_LETTER_STREAM, &ConsumerSpec::new("test-dlq"))
        .await
        .unwrap();
    let letters = consumer.fetch(10, Duration::from_secs(2)).await.unwrap();
    assert_eq!(letters.len(), 1, "{letters:?}");
    let letter = DeadLetter::decode(letters[0].payload.clone()).unwrap();
    assert!(letter.truncated);
    assert_eq!(letter.payload_size, size as u64);
    assert_eq!(letter.payload.len(), DEAD_LETTER_PAYLOAD_MAX);
    assert_eq!(letter.msg_id, "junk-big");
    buffer.shutdown().await;
}

/// The four groups of epoch `epoch` of tasks `q-0` … `q-3`, attempt
/// `lease-<epoch>-<i>`.
fn epoch_groups(epoch: u64, lease: &str) -> Vec<Trajectory> {
    (0..4u32)
        .flat_map(|i| {
            let task = wire_task_id(&format!("q-{i}"), epoch);
            let group = format!("{lease}-{epoch}-{i}");
            let first = (epoch as u32) * 1000 + i * 10;
            (0..4u32).map(move |k| traj_of(&task, &group, first + k, k, 4, 0, 64))
        })
        .collect()
}

/// A buffer remembers the tasks it trained so that no late or repeated
/// copy is trained again; over a long run that memory would grow without
/// end. Once the coordinator publishes that an epoch is closed, the buffer
/// forgets the trained tasks of it whose rows are deleted, drops a late
/// copy of one without storing it, and keeps both across a restart (the
/// closed epoch is in its snapshot).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_epochs_bound_the_tasks_the_buffer_remembers() {
    let server = NatsServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(&server.url(), dir.path());
    config.buffer.state_log_compact_bytes = 1;
    let bus = nats(&server.url()).await;
    let kv = bus.kv(CONTROL_BUCKET).await.unwrap();
    let buffer = Running::start(&config, bus.clone()).await;
    publish(bus.as_ref(), &epoch_groups(0, "lease")).await;
    eventually("epoch 0 ready", WAIT, || {
        buffer.handle.stats().ready_groups == 4
    })
    .await;
    ask(bus.as_ref(), 1, 0, 4, 4, 0).await.unwrap();
    // A restart starts a new segment: epoch 1's rows are apart.
    buffer.shutdown().await;
    let buffer = Running::start(&config, bus.clone()).await;
    publish(bus.as_ref(), &epoch_groups(1, "lease")).await;
    eventually("epoch 1 ready", WAIT, || {
        buffer.handle.stats().ready_groups == 4
    })
    .await;
    // Step 2 served: step 1 is trained, epoch 0 consumed and its segments
    // deleted.
    ask(bus.as_ref(), 2, 1, 4, 4, 0).await.unwrap();
    assert!(buffer.metric("buffer_segments_deleted_total") >= 1.0);
    assert_eq!(buffer.handle.stats().completed_tasks, 8);
    assert_eq!(buffer.handle.stats().closed_epoch, None);

    // The coordinator closes epoch 0: its four tasks are forgotten.
    kv.put(
        EPOCHS_CLOSED_KEY,
        Bytes::from(EpochsClosed { through: 0 }.encode_to_vec()),
    )
    .await
    .unwrap();
    eventually("epoch 0 forgotten", WAIT, || {
        let s = buffer.handle.stats();
        s.closed_epoch == Some(0) && s.completed_tasks == 4
    })
    .await;
    assert_eq!(buffer.metric("buffer_remembered_tasks"), 4.0);
    assert_eq!(buffer.metric("buffer_closed_epoch"), 0.0);
    // A late attempt of an epoch-0 task (a worker that was taken for dead)
    // is dropped without being stored or served.
    let stored = buffer.metric("buffer_ingested_trajectories_total");
    publish(bus.as_ref(), &epoch_groups(0, "late")[..4]).await;
    eventually("the late copy dropped", WAIT, || {
        buffer.metric("buffer_superseded_trajectories_total") == 4.0
    })
    .await;
    assert_eq!(buffer.metric("buffer_ingested_trajectories_total"), stored);
    let s = buffer.handle.stats();
    assert_eq!((s.ready_groups, s.collecting_groups), (0, 0));
    // Epoch 2's groups and step 3: a compaction writes the closed epoch.
    publish(bus.as_ref(), &epoch_groups(2, "lease")).await;
    eventually("epoch 2 ready", WAIT, || {
        buffer.handle.stats().ready_groups == 4
    })
    .await;
    ask(bus.as_ref(), 3, 2, 4, 4, 0).await.unwrap();
    buffer.shutdown().await;

    // Restarted with the key gone: the snapshot alone says epoch 0 is
    // closed, and a late copy of another epoch-0 task is dropped.
    kv.delete(EPOCHS_CLOSED_KEY).await.unwrap();
    let buffer = Running::start(&config, bus.clone()).await;
    assert_eq!(buffer.handle.stats().closed_epoch, Some(0));
    publish(bus.as_ref(), &epoch_groups(0, "later")[4..8]).await;
    eventually("the late copy dropped after the restart", WAIT, || {
        buffer.metric("buffer_superseded_trajectories_total") == 4.0
    })
    .await;
    let s = buffer.handle.stats();
    assert_eq!((s.ready_groups, s.collecting_groups), (0, 0));
    buffer.shutdown().await;
}

/// `asyncrl_buffer_groups_dropped_total{reason="no_signal"}`.
fn no_signal_dropped(b: &Running) -> f64 {
    let text = b.metrics.encode_prometheus_text().unwrap();
    text.lines()
        .filter(|l| l.starts_with("asyncrl_buffer_groups_dropped_total{reason=\"no_signal\"}"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Dynamic sampling over a real nats-server: the groups whose rewards do
/// not spread are reported dropped (`no_signal`) once and never served;
/// the others are served exactly once, the same to a learner that was
/// killed and asks for its step again, and the same after a buffer restart,
/// which neither serves a dropped group nor reports it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamic_sampling_never_serves_a_group_without_signal() {
    let server = NatsServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(&server.url(), dir.path());
    config.buffer.min_reward_spread = 0.5;
    config.validate().unwrap();
    let bus = nats(&server.url()).await;
    let buffer = Running::start(&config, bus.clone()).await;
    let mut reports = bus.subscribe(BUFFER_GROUP_DROPPED).await.unwrap();
    // Groups 0, 2, 4 all scored 1.0; groups 1, 3, 5 scored 0 and 1.
    let mut all = groups(0, 6, 2, 0, 16);
    for t in all
        .iter_mut()
        .filter(|t| t.task_id.ends_with(['0', '2', '4']))
    {
        t.reward = 1.0;
    }
    let (flat, mixed): (Vec<Trajectory>, Vec<Trajectory>) = all
        .iter()
        .cloned()
        .partition(|t| t.task_id.ends_with(['0', '2', '4']));
    publish(bus.as_ref(), &all).await;
    eventually("6 complete groups", WAIT, || {
        buffer.metric("buffer_groups_completed_total") == 6.0
    })
    .await;
    // Step 1: the flat groups are dropped before anything is served.
    let (_, step1) = ask(bus.as_ref(), 1, 0, 2, 2, 0).await.unwrap();
    assert_eq!(groups_of(&step1).len(), 2);
    let mut dropped = HashSet::new();
    for _ in 0..3 {
        let msg = tokio::time::timeout(WAIT, reports.next())
            .await
            .unwrap()
            .unwrap();
        let d = GroupDropped::decode(msg.payload).unwrap();
        assert_eq!(d.kind(), GroupDropReason::NoSignal);
        assert_eq!(d.trajectories, 2);
        dropped.insert(d.group_id);
    }
    assert_eq!(
        dropped,
        HashSet::from(["lease-0".into(), "lease-2".into(), "lease-4".into()])
    );
    assert_eq!(no_signal_dropped(&buffer), 3.0);
    assert_eq!(buffer.metric("buffer_no_signal_fraction"), 0.5);
    // The learner is killed after step 1 was served and asks again: the
    // same groups, then the rest.
    let (again, step1_again) = ask(bus.as_ref(), 1, 0, 2, 2, 0).await.unwrap();
    assert!(again.replayed);
    assert_eq!(step1_again, step1);
    let (_, step2) = ask(bus.as_ref(), 2, 1, 2, 1, 0).await.unwrap();
    // Copies of the flat groups' trajectories (new message ids, as after
    // the dedupe window) are duplicates, not groups to serve.
    for t in &flat {
        publish_as(bus.as_ref(), t, &format!("again-{}", t.uuid)).await;
    }
    eventually("the copies seen", WAIT, || {
        buffer.metric("buffer_duplicates_total") == 6.0
    })
    .await;
    buffer.shutdown().await;
    // A restarted buffer: step 2 is repeated identically, nothing more is
    // ready, and no drop is reported again.
    let buffer = Running::start(&config, bus.clone()).await;
    let (r2, step2_again) = ask(bus.as_ref(), 2, 1, 2, 1, 0).await.unwrap();
    assert!(r2.replayed);
    assert_eq!(step2_again, step2);
    let (r3, _) = ask(bus.as_ref(), 3, 2, 2, 1, 0).await.unwrap();
    assert_eq!((r3.num_groups, r3.ready_groups), (0, 0));
    assert_eq!(no_signal_dropped(&buffer), 0.0, "not reported again");
    let mut served: Vec<String> = step1.iter().map(|t| t.uuid.clone()).collect();
    served.extend(step2.iter().map(|t| t.uuid.clone()));
    assert_eq!(served.len(), 6, "each served once");
    assert_eq!(
        served.into_iter().collect::<HashSet<_>>(),
        uuids(&mixed),
        "only the groups with signal"
    );
    buffer.shutdown().await;
}
