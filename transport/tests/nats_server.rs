//! Behaviour that only a real NATS server has: crashes and restarts,
//! reconnects, authentication, slow consumers, payload limits.

use std::time::{Duration, Instant};

use asyncrl_config::BusConfig;
use asyncrl_testkit::NatsServer;
use asyncrl_transport::{Bus, ConsumerSpec, NatsBus, StreamSpec, TransportError, TransportMetrics};
use bytes::Bytes;
use futures::StreamExt;

async fn connect(url: String, metrics: TransportMetrics) -> NatsBus {
    NatsBus::connect(&BusConfig::nats(url), metrics)
        .await
        .expect("connect")
}

/// Retries an operation while the client reconnects after a server restart.
async fn eventually<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, TransportError>>,
{
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match f().await {
            Ok(v) => return v,
            Err(e) if Instant::now() < deadline => {
                eprintln!("{what}: retrying after {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("{what}: still failing after 30 s: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_stream_survives_server_kill_and_restart() {
    let mut server = NatsServer::start().unwrap();
    let metrics = TransportMetrics::new();
    let bus = connect(server.url(), metrics.clone()).await;
    bus.ensure_stream(&StreamSpec::new("SURVIVE", &["survive.>"]))
        .await
        .unwrap();
    for i in 0..50 {
        let ack = bus
            .publish_durable("survive.t", &format!("id-{i}"), Bytes::from(format!("{i}")))
            .await
            .unwrap();
        assert!(!ack.duplicate);
    }
    let spec = ConsumerSpec::new("survivor");
    let consumer = bus.consumer("SURVIVE", &spec).await.unwrap();
    let first = consumer.fetch(20, Duration::from_secs(2)).await.unwrap();
    assert_eq!(first.len(), 20);
    for d in &first {
        d.ack().await.unwrap();
    }

    server.kill();
    server.restart().unwrap();

    // The same client reconnects on its own; the data and the consumer's
    // position survived the crash.
    let len = eventually("stream_len", || bus.stream_len("SURVIVE")).await;
    assert_eq!(len, 50);
    let consumer = eventually("consumer", || bus.consumer("SURVIVE", &spec)).await;
    // Poll until all 30 arrive: right after a restart JetStream may still be
    // recovering, and an empty fetch is not the end of the stream. The
    // server writes the consumer's ack state asynchronously, so acks sent
    // just before a kill -9 may be lost and those messages come again
    // (at-least-once): nothing is lost, and nothing unknown arrives.
    let want: std::collections::BTreeSet<u32> = (20..50).collect();
    let mut rest = std::collections::BTreeSet::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !want.is_subset(&rest) && Instant::now() < deadline {
        let got = eventually("fetch", || consumer.fetch(30, Duration::from_secs(1))).await;
        for d in got {
            d.ack().await.unwrap();
            let i: u32 = String::from_utf8(d.payload.to_vec())
                .unwrap()
                .parse()
                .unwrap();
            assert!(i < 50, "an unknown message {i}");
            rest.insert(i);
        }
    }
    assert!(want.is_subset(&rest), "lost: {:?}", want.difference(&rest));
    // A republished id from before the crash is still a duplicate.
    let ack = eventually("republish", || {
        bus.publish_durable("survive.t", "id-3", Bytes::from_static(b"again"))
    })
    .await;
    assert!(ack.duplicate);
    assert!(
        metrics.event_count("disconnected") >= 1,
        "the disconnect must be counted"
    );
}

/// A pull request that was out when the server died is never answered; the
/// fetch still returns (empty, or a transient error) instead of waiting
/// forever, and the consumer fetches again after the restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fetch_in_flight_when_the_server_dies_returns() {
    let mut server = NatsServer::start().unwrap();
    let mut config = BusConfig::nats(server.url());
    config.request_timeout = Duration::from_secs(1);
    let bus = NatsBus::connect(&config, TransportMetrics::new())
        .await
        .unwrap();
    bus.ensure_stream(&StreamSpec::new("INFLIGHT", &["inflight.>"]))
        .await
        .unwrap();
    let consumer = bus
        .consumer("INFLIGHT", &ConsumerSpec::new("waiting"))
        .await
        .unwrap();
    let consumer = std::sync::Arc::new(consumer);
    // A frozen server takes the pull request and never answers it; then it
    // dies, and the restarted one knows nothing of the request.
    let pid = server.pid().expect("the server runs").to_string();
    let frozen = std::process::Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .unwrap();
    assert!(frozen.success());
    let fetching = {
        let consumer = consumer.clone();
        tokio::spawn(async move { consumer.fetch(10, Duration::ZERO).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.kill();
    server.restart().unwrap();
    let r = tokio::time::timeout(Duration::from_secs(20), fetching)
        .await
        .expect("the fetch returned")
        .unwrap();
    assert!(
        r.as_ref()
            .map_or_else(|e| e.is_transient(), |d| d.is_empty()),
        "{r:?}"
    );
    eventually("publish", || {
        bus.publish_durable("inflight.x", "one", Bytes::from_static(b"1"))
    })
    .await;
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while got.is_empty() && Instant::now() < deadline {
        if let Ok(d) = consumer.fetch(10, Duration::from_millis(500)).await {
            got = d;
        }
    }
    assert_eq!(got.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_work_again_after_server_restart() {
    let mut server = NatsServer::start().unwrap();
    let bus = connect(server.url(), TransportMetrics::new()).await;
    let mut requests = bus.serve("svc.ping", None).await.unwrap();
    tokio::spawn(async move {
        while let Some(r) = requests.next().await {
            r.respond(Bytes::from_static(b"pong")).await.unwrap();
        }
    });
    bus.flush().await.unwrap();
    assert_eq!(
        bus.request("svc.ping", Bytes::new(), Duration::from_secs(2))
            .await
            .unwrap(),
        "pong"
    );
    server.kill();
    let err = bus
        .request("svc.ping", Bytes::new(), Duration::from_millis(300))
        .await
        .unwrap_err();
    assert!(err.is_transient(), "{err:?}");
    server.restart().unwrap();
    let reply = eventually("ping", || {
        bus.request("svc.ping", Bytes::new(), Duration::from_secs(1))
    })
    .await;
    assert_eq!(reply, "pong");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bus_says_since_when_it_has_been_connected() {
    let mut server = NatsServer::start().unwrap();
    let bus = connect(server.url(), TransportMetrics::new()).await;
    let first = bus.connected_since_unix_ms().expect("connected");
    assert!(first > 0);
    server.kill();
    let deadline = Instant::now() + Duration::from_secs(20);
    while bus.connected_since_unix_ms().is_some() {
        assert!(Instant::now() < deadline, "the loss was never noticed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server.restart().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let again = loop {
        if let Some(t) = bus.connected_since_unix_ms() {
            break t;
        }
        assert!(Instant::now() < deadline, "never reconnected");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(again > first, "the reconnect starts a new period");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_server_is_a_clear_error() {
    let port = asyncrl_testkit::free_port().unwrap();
    let mut config = BusConfig::nats(format!("nats://127.0.0.1:{port}"));
    config.connect_timeout = Duration::from_secs(1);
    let start = Instant::now();
    let err = NatsBus::connect(&config, TransportMetrics::new())
        .await
        .err()
        .unwrap();
    assert!(start.elapsed() < Duration::from_secs(10));
    let msg = err.to_string();
    assert!(matches!(err, TransportError::Connect { .. }), "{err:?}");
    assert!(
        msg.contains(&format!("127.0.0.1:{port}")),
        "error should name the URL: {msg}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_auth_is_required_and_accepted() {
    let server = NatsServer::start_with_args(&["--auth", "s3cret-token"]).unwrap();
    let mut config = BusConfig::nats(server.url());
    config.connect_timeout = Duration::from_secs(1);
    let err = NatsBus::connect(&config, TransportMetrics::new())
        .await
        .err()
        .unwrap();
    assert!(matches!(err, TransportError::Connect { .. }), "{err:?}");

    config.token = Some("s3cret-token".into());
    let bus = NatsBus::connect(&config, TransportMetrics::new())
        .await
        .unwrap();
    bus.ensure_stream(&StreamSpec::new("AUTH", &["auth.>"]))
        .await
        .unwrap();

    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "s3cret-token\n").unwrap();
    config.token = None;
    config.token_file = Some(token_file);
    NatsBus::connect(&config, TransportMetrics::new())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_password_auth() {
    let server = NatsServer::start_with_args(&["--user", "rl", "--pass", "pw"]).unwrap();
    let mut config = BusConfig::nats(server.url());
    config.connect_timeout = Duration::from_secs(1);
    config.user = Some("rl".into());
    config.password = Some("wrong".into());
    assert!(
        NatsBus::connect(&config, TransportMetrics::new())
            .await
            .is_err()
    );
    config.password = Some("pw".into());
    NatsBus::connect(&config, TransportMetrics::new())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_consumer_is_counted_not_silent() {
    let server = NatsServer::start().unwrap();
    let metrics = TransportMetrics::new();
    let mut config = BusConfig::nats(server.url());
    config.subscription_capacity = 4;
    let bus = NatsBus::connect(&config, metrics.clone()).await.unwrap();
    let _never_read = bus.subscribe("flood").await.unwrap();
    bus.flush().await.unwrap();
    for _ in 0..2_000 {
        bus.publish("flood", Bytes::from_static(b"x"))
            .await
            .unwrap();
    }
    bus.flush().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while metrics.event_count("slow_consumer") == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        metrics.event_count("slow_consumer") > 0,
        "slow consumer event was not counted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_durable_publish_is_refused_with_sizes() {
    let server = NatsServer::start().unwrap();
    let bus = connect(server.url(), TransportMetrics::new()).await;
    bus.ensure_stream(&StreamSpec::new("BIG", &["big.>"]))
        .await
        .unwrap();
    let err = bus
        .publish_durable("big.x", "huge", Bytes::from(vec![0u8; 2 * 1024 * 1024]))
        .await
        .unwrap_err();
    match err {
        TransportError::PayloadTooLarge { size, max } => {
            assert_eq!(size, 2 * 1024 * 1024);
            assert_eq!(max, 1024 * 1024);
        }
        other => panic!("expected PayloadTooLarge, got {other:?}"),
    }
}
