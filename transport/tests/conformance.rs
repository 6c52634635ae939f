//! The transport conformance suite: every check runs against the in-process
//! bus and against a real nats-server, through the same `Bus` interface.

use std::sync::Arc;
use std::time::{Duration, Instant};

use asyncrl_config::BusConfig;
use asyncrl_testkit::NatsServer;
use asyncrl_transport::{
    Bus, ConsumerSpec, DeliverFrom, Discard, LocalBus, NatsBus, Retention, StreamSpec,
    TransportError, TransportMetrics, sha256_hex,
};
use bytes::Bytes;
use futures::StreamExt;

/// A bus under test, and the server behind it (if any), kept alive.
struct Env {
    bus: Arc<dyn Bus>,
    _server: Option<NatsServer>,
}

async fn local() -> Env {
    Env {
        bus: Arc::new(LocalBus::new()),
        _server: None,
    }
}

async fn nats() -> Env {
    let server = NatsServer::start().expect("start nats-server");
    let bus = NatsBus::connect(&BusConfig::nats(server.url()), TransportMetrics::new())
        .await
        .expect("connect");
    Env {
        bus: Arc::new(bus),
        _server: Some(server),
    }
}

macro_rules! conformance {
    ($($name:ident),* $(,)?) => {
        mod local_bus {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::local().await).await
                }
            )*
        }
        mod nats_bus {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::nats().await).await
                }
            )*
        }
    };
}

conformance!(
    request_reply_round_trip,
    request_without_responder_fails_within_timeout,
    request_to_silent_responder_times_out,
    queue_group_spreads_requests,
    publish_subscribe_with_wildcards,
    republished_id_is_stored_once,
    unacked_message_is_redelivered_after_ack_wait,
    nak_redelivers,
    durable_consumer_resumes_after_rebind,
    fetch_waits_for_the_first_message,
    consumer_filters_by_subject,
    publish_to_unknown_subject_is_an_error,
    kv_watch_yields_current_value_then_updates,
    kv_compare_and_set,
    kv_wildcard_watch_and_keys,
    object_of_200_mb_round_trips_with_same_sha256,
    missing_object_is_not_found,
    work_queue_releases_a_message_once_acked,
    full_stream_refuses_or_discards_by_its_policy,
    deleted_objects_leave_nothing_behind,
);

fn stream_spec(name: &str, subject: &str) -> StreamSpec {
    let mut spec = StreamSpec::new(name, &[subject]);
    spec.duplicate_window = Duration::from_secs(60);
    spec
}

async fn request_reply_round_trip(env: Env) {
    let mut requests = env.bus.serve("svc.echo", None).await.unwrap();
    tokio::spawn(async move {
        while let Some(req) = requests.next().await {
            let mut reply = b"echo:".to_vec();
            reply.extend_from_slice(&req.payload);
            req.respond(Bytes::from(reply)).await.unwrap();
        }
    });
    env.bus.flush().await.unwrap();
    for i in 0..20 {
        let reply = env
            .bus
            .request(
                "svc.echo",
                Bytes::from(format!("{i}")),
                Duration::from_secs(5),
            )
            .await
            .unwrap();
        assert_eq!(reply, Bytes::from(format!("echo:{i}")));
    }
}

async fn request_without_responder_fails_within_timeout(env: Env) {
    let timeout = Duration::from_secs(3);
    let start = Instant::now();
    let err = env
        .bus
        .request("svc.nobody", Bytes::from_static(b"x"), timeout)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            TransportError::NoResponders { .. } | TransportError::Timeout { .. }
        ),
        "unexpected error {err:?}"
    );
    assert!(
        start.elapsed() <= timeout + Duration::from_millis(500),
        "took {:?}",
        start.elapsed()
    );
    assert!(
        matches!(err, TransportError::NoResponders { .. }),
        "no responders should be reported as such: {err:?}"
    );
}

async fn request_to_silent_responder_times_out(env: Env) {
    let mut requests = env.bus.serve("svc.silent", None).await.unwrap();
    let held = tokio::spawn(async move {
        // Hold requests without answering.
        let mut held = Vec::new();
        while let Some(r) = requests.next().await {
            held.push(r);
        }
    });
    env.bus.flush().await.unwrap();
    let timeout = Duration::from_millis(500);
    let start = Instant::now();
    let err = env
        .bus
        .request("svc.silent", Bytes::new(), timeout)
        .await
        .unwrap_err();
    assert!(matches!(err, TransportError::Timeout { .. }), "{err:?}");
    assert!(start.elapsed() >= timeout);
    held.abort();
}

async fn queue_group_spreads_requests(env: Env) {
    for id in ["a", "b"] {
        let mut requests = env.bus.serve("svc.pool", Some("pool")).await.unwrap();
        tokio::spawn(async move {
            while let Some(req) = requests.next().await {
                req.respond(Bytes::from(id)).await.unwrap();
            }
        });
    }
    env.bus.flush().await.unwrap();
    let mut seen = std::collections::HashMap::new();
    for _ in 0..40 {
        let r = env
            .bus
            .request("svc.pool", Bytes::new(), Duration::from_secs(5))
            .await
            .unwrap();
        *seen.entry(r).or_insert(0) += 1;
    }
    // Each request is answered exactly once, by one member of the group.
    assert_eq!(seen.values().sum::<i32>(), 40);
    assert_eq!(seen.len(), 2, "both members should serve: {seen:?}");
}

async fn publish_subscribe_with_wildcards(env: Env) {
    let mut all = env.bus.subscribe("events.>").await.unwrap();
    let mut one = env.bus.subscribe("events.*.done").await.unwrap();
    env.bus.flush().await.unwrap();
    env.bus
        .publish("events.a.done", Bytes::from_static(b"1"))
        .await
        .unwrap();
    env.bus
        .publish("events.b.started", Bytes::from_static(b"2"))
        .await
        .unwrap();
    env.bus.flush().await.unwrap();
    let t = Duration::from_secs(5);
    let m1 = tokio::time::timeout(t, all.next()).await.unwrap().unwrap();
    let m2 = tokio::time::timeout(t, all.next()).await.unwrap().unwrap();
    assert_eq!(
        (m1.subject.as_str(), m2.subject.as_str()),
        ("events.a.done", "events.b.started")
    );
    let d = tokio::time::timeout(t, one.next()).await.unwrap().unwrap();
    assert_eq!(d.payload, Bytes::from_static(b"1"));
    assert!(
        tokio::time::timeout(Duration::from_millis(200), one.next())
            .await
            .is_err()
    );
}

async fn republished_id_is_stored_once(env: Env) {
    env.bus
        .ensure_stream(&stream_spec("DEDUPE", "dedupe.>"))
        .await
        .unwrap();
    let a = env
        .bus
        .publish_durable("dedupe.x", "id-1", Bytes::from_static(b"first"))
        .await
        .unwrap();
    let b = env
        .bus
        .publish_durable("dedupe.x", "id-1", Bytes::from_static(b"second"))
        .await
        .unwrap();
    let c = env
        .bus
        .publish_durable("dedupe.y", "id-2", Bytes::from_static(b"other"))
        .await
        .unwrap();
    assert!(!a.duplicate && b.duplicate && !c.duplicate);
    assert_eq!(a.sequence, b.sequence);
    assert_eq!(c.sequence, a.sequence + 1);
    assert_eq!(env.bus.stream_len("DEDUPE").await.unwrap(), 2);
    let consumer = env
        .bus
        .consumer("DEDUPE", &ConsumerSpec::new("reader"))
        .await
        .unwrap();
    let got = consumer.fetch(10, Duration::from_secs(2)).await.unwrap();
    let payloads: Vec<_> = got.iter().map(|d| d.payload.clone()).collect();
    assert_eq!(
        payloads,
        vec![Bytes::from_static(b"first"), Bytes::from_static(b"other")]
    );
    assert_eq!(got[0].msg_id.as_deref(), Some("id-1"));
}

async fn unacked_message_is_redelivered_after_ack_wait(env: Env) {
    env.bus
        .ensure_stream(&stream_spec("REDELIVER", "redeliver.>"))
        .await
        .unwrap();
    env.bus
        .publish_durable("redeliver.a", "m1", Bytes::from_static(b"payload"))
        .await
        .unwrap();
    let mut spec = ConsumerSpec::new("slow");
    spec.ack_wait = Duration::from_secs(1);
    let consumer = env.bus.consumer("REDELIVER", &spec).await.unwrap();
    let first = consumer.fetch(1, Duration::from_secs(2)).await.unwrap();
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].delivered, 1);
    // Not acked: nothing new before the ack wait ...
    let none = consumer.fetch(1, Duration::from_millis(300)).await.unwrap();
    assert!(none.is_empty(), "redelivered before the ack wait: {none:?}");
    // ... then the same message again.
    let again = consumer.fetch(1, Duration::from_secs(5)).await.unwrap();
    assert_eq!(again.len(), 1, "not redelivered after the ack wait");
    assert_eq!(again[0].stream_sequence, first[0].stream_sequence);
    assert_eq!(again[0].delivered, 2);
    again[0].ack().await.unwrap();
    let after_ack = consumer
        .fetch(1, Duration::from_millis(1800))
        .await
        .unwrap();
    assert!(
        after_ack.is_empty(),
        "acked message came back: {after_ack:?}"
    );
}

async fn nak_redelivers(env: Env) {
    env.bus
        .ensure_stream(&stream_spec("NAK", "nak.>"))
        .await
        .unwrap();
    env.bus
        .publish_durable("nak.a", "m1", Bytes::from_static(b"x"))
        .await
        .unwrap();
    let mut spec = ConsumerSpec::new("nakker");
    spec.ack_wait = Duration::from_secs(30);
    let consumer = env.bus.consumer("NAK", &spec).await.unwrap();
    let first = consumer.fetch(1, Duration::from_secs(2)).await.unwrap();
    first[0].nak(Duration::ZERO).await.unwrap();
    let again = consumer.fetch(1, Duration::from_secs(5)).await.unwrap();
    assert_eq!(
        again.len(),
        1,
        "nak did not redeliver well before the 30 s ack wait"
    );
    assert_eq!(again[0].delivered, 2);
}

async fn durable_consumer_resumes_after_rebind(env: Env) {
    env.bus
        .ensure_stream(&stream_spec("RESUME", "resume.>"))
        .await
        .unwrap();
    for i in 0..5 {
        env.bus
            .publish_durable("resume.a", &format!("m{i}"), Bytes::from(format!("{i}")))
            .await
            .unwrap();
    }
    let spec = ConsumerSpec::new("resumer");
    {
        let consumer = env.bus.consumer("RESUME", &spec).await.unwrap();
        let got = consumer.fetch(3, Duration::from_secs(2)).await.unwrap();
        assert_eq!(got.len(), 3);
        for d in &got {
            d.ack().await.unwrap();
        }
    }
    env.bus.flush().await.unwrap();
    let consumer = env.bus.consumer("RESUME", &spec).await.unwrap();
    let rest = consumer.fetch(10, Duration::from_secs(2)).await.unwrap();
    let payloads: Vec<_> = rest.iter().map(|d| d.payload.clone()).collect();
    assert_eq!(
        payloads,
        vec![Bytes::from_static(b"3"), Bytes::from_static(b"4")]
    );
    // A consumer that starts from new messages sees none of the old ones.
    let mut fresh = ConsumerSpec::new("fresh");
    fresh.deliver_from = DeliverFrom::New;
    let fresh = env.bus.consumer("RESUME", &fresh).await.unwrap();
    assert!(
        fresh
            .fetch(10, Duration::from_millis(300))
            .await
            .unwrap()
            .is_empty()
    );
    env.bus
        .publish_durable("resume.a", "m5", Bytes::from_static(b"5"))
        .await
        .unwrap();
    let got = fresh.fetch(10, Duration::from_secs(2)).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].payload, Bytes::from_static(b"5"));
}

async fn fetch_waits_for_the_first_message(env: Env) {
    env.bus
        .ensure_stream(&stream_spec("WAIT", "wait.>"))
        .await
        .unwrap();
    let consumer = env
        .bus
        .consumer("WAIT", &ConsumerSpec::new("waiter"))
        .await
        .unwrap();
    let bus = env.bus.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        bus.publish_durable("wait.a", "late", Bytes::from_static(b"late"))
            .await
            .unwrap();
    });
    let got = consumer.fetch(10, Duration::from_secs(10)).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].payload, Bytes::from_static(b"late"));
}

async fn consumer_filters_by_subject(env: Env) {
    env.bus
        .ensure_stream(&stream_spec("FILTER", "filter.>"))
        .await
        .unwrap();
    env.bus
        .publish_durable("filter.a", "1", Bytes::from_static(b"a"))
        .await
        .unwrap();
    env.bus
        .publish_durable("filter.b", "2", Bytes::from_static(b"b"))
        .await
        .unwrap();
    let mut spec = ConsumerSpec::new("only-b");
    spec.filter_subject = Some("filter.b".into());
    let consumer = env.bus.consumer("FILTER", &spec).await.unwrap();
    let got = consumer.fetch(10, Duration::from_secs(2)).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].subject, "filter.b");
}

async fn publish_to_unknown_subject_is_an_error(env: Env) {
    let err = env
        .bus
        .publish_durable("nostream.here", "x", Bytes::new())
        .await
        .unwrap_err();
    assert!(
        matches!(err, TransportError::NoStreamForSubject { .. }),
        "{err:?}"
    );
    let err = env.bus.stream_len("NOPE").await.unwrap_err();
    assert!(matches!(err, TransportError::NoStream { .. }), "{err:?}");
    let err = env
        .bus
        .consumer("NOPE", &ConsumerSpec::new("c"))
        .await
        .err()
        .unwrap();
    assert!(matches!(err, TransportError::NoStream { .. }), "{err:?}");
}

async fn kv_watch_yields_current_value_then_updates(env: Env) {
    let kv = env.bus.kv("control").await.unwrap();
    kv.put("policy.version", Bytes::from_static(b"1"))
        .await
        .unwrap();
    let mut watch = kv.watch("policy.version").await.unwrap();
    let t = Duration::from_secs(5);
    let first = tokio::time::timeout(t, watch.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(
        first.value,
        Some(Bytes::from_static(b"1")),
        "watch must yield the current value first"
    );
    kv.put("policy.version", Bytes::from_static(b"2"))
        .await
        .unwrap();
    let second = tokio::time::timeout(t, watch.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(second.value, Some(Bytes::from_static(b"2")));
    assert!(second.revision > first.revision);
    kv.delete("policy.version").await.unwrap();
    let third = tokio::time::timeout(t, watch.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(third.value, None);
    assert_eq!(kv.get("policy.version").await.unwrap(), None);
    // The same bucket is seen through a second handle.
    let again = env.bus.kv("control").await.unwrap();
    again.put("other", Bytes::from_static(b"x")).await.unwrap();
    assert_eq!(
        kv.get("other").await.unwrap().unwrap().value,
        Bytes::from_static(b"x")
    );
}

async fn kv_compare_and_set(env: Env) {
    let kv = env.bus.kv("cas").await.unwrap();
    let r1 = kv.create("state", Bytes::from_static(b"a")).await.unwrap();
    let err = kv
        .create("state", Bytes::from_static(b"b"))
        .await
        .unwrap_err();
    assert!(matches!(err, TransportError::KeyExists { .. }), "{err:?}");
    let r2 = kv
        .update("state", Bytes::from_static(b"c"), r1)
        .await
        .unwrap();
    let err = kv
        .update("state", Bytes::from_static(b"d"), r1)
        .await
        .unwrap_err();
    assert!(
        matches!(err, TransportError::RevisionMismatch { .. }),
        "{err:?}"
    );
    let e = kv.get("state").await.unwrap().unwrap();
    assert_eq!((e.value, e.revision), (Bytes::from_static(b"c"), r2));
    let err = kv.put("bad key", Bytes::new()).await.unwrap_err();
    assert!(matches!(err, TransportError::InvalidName { .. }), "{err:?}");
}

async fn kv_wildcard_watch_and_keys(env: Env) {
    let kv = env.bus.kv("workers").await.unwrap();
    kv.put("worker.a", Bytes::from_static(b"1")).await.unwrap();
    kv.put("worker.b", Bytes::from_static(b"2")).await.unwrap();
    kv.put("other", Bytes::from_static(b"3")).await.unwrap();
    let mut watch = kv.watch("worker.*").await.unwrap();
    let t = Duration::from_secs(5);
    let mut seen = Vec::new();
    for _ in 0..2 {
        let e = tokio::time::timeout(t, watch.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        seen.push(e.key);
    }
    seen.sort();
    assert_eq!(seen, vec!["worker.a", "worker.b"]);
    kv.put("worker.c", Bytes::from_static(b"4")).await.unwrap();
    let e = tokio::time::timeout(t, watch.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(e.key, "worker.c");
    let mut keys = kv.keys().await.unwrap();
    keys.sort();
    assert_eq!(keys, vec!["other", "worker.a", "worker.b", "worker.c"]);
}

/// Cheap deterministic pseudo-random bytes (xorshift), so that a chunking bug
/// cannot hide behind a repeating pattern.
fn pseudo_random(len: usize) -> Vec<u8> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

async fn object_of_200_mb_round_trips_with_same_sha256(env: Env) {
    let store = env.bus.object_store("BLOBS").await.unwrap();
    let data = Bytes::from(pseudo_random(200 * 1024 * 1024));
    let sha = sha256_hex(&data);
    let info = store.put("weights-v1", data.clone()).await.unwrap();
    assert_eq!(info.size, data.len() as u64);
    assert_eq!(info.sha256, sha);
    assert!(
        info.chunks > 1000,
        "a 200 MB object is stored in chunks, got {}",
        info.chunks
    );
    drop(data);
    let back = store.get_expecting("weights-v1", &sha).await.unwrap();
    assert_eq!(back.len(), 200 * 1024 * 1024);
    assert_eq!(sha256_hex(&back), sha);
    drop(back);
    let err = store
        .get_expecting("weights-v1", &"0".repeat(64))
        .await
        .unwrap_err();
    assert!(
        matches!(err, TransportError::ChecksumMismatch { .. }),
        "{err:?}"
    );
    assert_eq!(store.info("weights-v1").await.unwrap().unwrap().sha256, sha);
    store
        .put("small", Bytes::from_static(b"tiny"))
        .await
        .unwrap();
    let mut names: Vec<_> = store
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.name)
        .collect();
    names.sort();
    assert_eq!(names, vec!["small", "weights-v1"]);
    store.delete("weights-v1").await.unwrap();
    assert_eq!(store.info("weights-v1").await.unwrap(), None);
}

async fn missing_object_is_not_found(env: Env) {
    let store = env.bus.object_store("EMPTY").await.unwrap();
    let err = store.get("nothing").await.unwrap_err();
    assert!(
        matches!(err, TransportError::ObjectNotFound { .. }),
        "{err:?}"
    );
    let err = store.delete("nothing").await.unwrap_err();
    assert!(
        matches!(err, TransportError::ObjectNotFound { .. }),
        "{err:?}"
    );
}

/// Messages, bytes and byte limit of one store, as `Bus::storage` says.
async fn usage(bus: &dyn Bus, name: &str) -> (u64, u64, Option<u64>) {
    let all = bus.storage().await.unwrap();
    let u = all
        .iter()
        .find(|u| u.name == name)
        .unwrap_or_else(|| panic!("no store {name} in {all:?}"));
    (u.messages, u.bytes, u.max_bytes)
}

async fn work_queue_releases_a_message_once_acked(env: Env) {
    let mut spec = stream_spec("WORK", "work.>");
    spec.retention = Retention::WorkQueue;
    spec.max_bytes = Some(1 << 20);
    spec.discard = Discard::New;
    env.bus.ensure_stream(&spec).await.unwrap();
    for i in 0..4 {
        let ack = env
            .bus
            .publish_durable("work.a", &format!("w{i}"), Bytes::from(vec![7u8; 100]))
            .await
            .unwrap();
        assert!(!ack.duplicate);
    }
    let (messages, bytes, max) = usage(env.bus.as_ref(), "WORK").await;
    assert_eq!((messages, max), (4, Some(1 << 20)));
    assert!(bytes >= 400, "{bytes}");
    let mut cspec = ConsumerSpec::new("only");
    cspec.ack_wait = Duration::from_secs(1);
    let consumer = env.bus.consumer("WORK", &cspec).await.unwrap();
    // A work queue hands each message to one consumer: a second one on the
    // same subjects is refused; the first binds again.
    assert!(
        env.bus
            .consumer("WORK", &ConsumerSpec::new("another"))
            .await
            .is_err()
    );
    env.bus.consumer("WORK", &cspec).await.unwrap();
    let got = consumer.fetch(10, Duration::from_secs(2)).await.unwrap();
    assert_eq!(got.len(), 4);
    // Delivered but not acked: still held (a crash now redelivers them).
    assert_eq!(env.bus.stream_len("WORK").await.unwrap(), 4);
    let mut got = got.into_iter();
    for d in got.by_ref().take(3) {
        d.ack().await.unwrap();
    }
    let held = |bus: Arc<dyn Bus>, n: u64| async move {
        asyncrl_testkit::eventually(
            "the stream to let go of acked messages",
            Duration::from_secs(10),
            || {
                let bus = bus.clone();
                async move { (bus.stream_len("WORK").await.unwrap() == n).then_some(()) }
            },
        )
        .await
    };
    held(env.bus.clone(), 1).await;
    // The one not acked comes back after the ack wait and is released on its ack.
    drop(got);
    let again = consumer.fetch(10, Duration::from_secs(5)).await.unwrap();
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].msg_id.as_deref(), Some("w3"));
    again.into_iter().next().unwrap().ack().await.unwrap();
    held(env.bus.clone(), 0).await;
    // A released message's id is still in the duplicate window: a
    // republished copy is not stored again.
    let dup = env
        .bus
        .publish_durable("work.a", "w1", Bytes::from(vec![7u8; 100]))
        .await
        .unwrap();
    assert!(dup.duplicate);
    assert_eq!(env.bus.stream_len("WORK").await.unwrap(), 0);
    assert!(
        consumer
            .fetch(10, Duration::from_millis(200))
            .await
            .unwrap()
            .is_empty()
    );
}

async fn full_stream_refuses_or_discards_by_its_policy(env: Env) {
    let payload = Bytes::from(vec![1u8; 300 * 1024]);
    let mut refuse = stream_spec("REFUSE", "refuse.>");
    refuse.retention = Retention::WorkQueue;
    refuse.max_bytes = Some(1 << 20);
    refuse.discard = Discard::New;
    env.bus.ensure_stream(&refuse).await.unwrap();
    let mut stored = 0;
    let err = loop {
        match env
            .bus
            .publish_durable("refuse.a", &format!("r{stored}"), payload.clone())
            .await
        {
            Ok(_) => stored += 1,
            Err(e) => break e,
        }
        assert!(
            stored < 10,
            "a 1 MiB stream took {stored} messages of 300 KiB"
        );
    };
    assert_eq!(stored, 3, "three fit in 1 MiB");
    assert!(
        matches!(err, TransportError::StreamFull { .. }) && err.is_transient(),
        "{err:?}"
    );
    assert!(err.to_string().contains("refuse.a"), "{err}");
    // Room again once the consumer has taken and acked one: the same
    // message (same id) now goes in.
    let consumer = env
        .bus
        .consumer("REFUSE", &ConsumerSpec::new("drain"))
        .await
        .unwrap();
    let first = consumer.fetch(1, Duration::from_secs(2)).await.unwrap();
    first.into_iter().next().unwrap().ack().await.unwrap();
    asyncrl_testkit::eventually("room in the stream", Duration::from_secs(10), || {
        let bus = env.bus.clone();
        let payload = payload.clone();
        async move {
            bus.publish_durable("refuse.a", "r3", payload)
                .await
                .ok()
                .filter(|a| !a.duplicate)
        }
    })
    .await;

    let mut roll = stream_spec("ROLL", "roll.>");
    roll.max_bytes = Some(1 << 20);
    roll.discard = Discard::Old;
    env.bus.ensure_stream(&roll).await.unwrap();
    for i in 0..6 {
        env.bus
            .publish_durable("roll.a", &format!("o{i}"), payload.clone())
            .await
            .unwrap();
    }
    let (messages, bytes, _) = usage(env.bus.as_ref(), "ROLL").await;
    assert_eq!(messages, 3, "the oldest were discarded to make room");
    assert!(bytes <= 1 << 20, "{bytes}");
    let reader = env
        .bus
        .consumer("ROLL", &ConsumerSpec::new("reader"))
        .await
        .unwrap();
    let ids: Vec<_> = reader
        .fetch(10, Duration::from_secs(2))
        .await
        .unwrap()
        .iter()
        .map(|d| d.msg_id.clone().unwrap_or_default())
        .collect();
    assert_eq!(ids, ["o3", "o4", "o5"]);
}

/// A run puts and deletes one weights object per version: what is deleted
/// must not stay behind (no per-name tombstone), or the store grows with
/// the number of versions however few are kept.
async fn deleted_objects_leave_nothing_behind(env: Env) {
    let store = env.bus.object_store("CHURN").await.unwrap();
    let data = Bytes::from(vec![3u8; 200 * 1024]);
    for v in 0..40 {
        store
            .put(&format!("obj-v{v:08}.bin"), data.clone())
            .await
            .unwrap();
        if v >= 2 {
            store
                .delete(&format!("obj-v{:08}.bin", v - 2))
                .await
                .unwrap();
        }
    }
    let names: Vec<String> = store
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.name)
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
    assert!(store.info("obj-v00000000.bin").await.unwrap().is_none());
    assert!(matches!(
        store.get("obj-v00000000.bin").await,
        Err(TransportError::ObjectNotFound { .. })
    ));
    // Two objects of two chunks... plus their two metadata messages: nothing
    // of the 38 deleted ones.
    let (messages, bytes, _) = usage(env.bus.as_ref(), "OBJ_CHURN").await;
    assert!(bytes < 3 * 200 * 1024, "{bytes} bytes held for two objects");
    assert!(
        messages <= 2 * 4,
        "{messages} messages held for two objects"
    );
    // A deleted name can be used again.
    store.put("obj-v00000000.bin", data.clone()).await.unwrap();
    assert_eq!(store.get("obj-v00000000.bin").await.unwrap(), data);
}
