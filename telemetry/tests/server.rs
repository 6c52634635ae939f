//! The telemetry server over real TCP: /metrics, /healthz, /readyz.

use std::net::SocketAddr;
use std::time::Duration;

use asyncrl_config::TelemetryConfig;
use asyncrl_telemetry::prometheus_client::metrics::counter::Counter;
use asyncrl_telemetry::prometheus_client::metrics::family::Family;
use asyncrl_telemetry::{Health, Metrics, serve, serve_from_config};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// One HTTP/1.1 GET over a raw socket: (status, headers, body).
async fn get(addr: SocketAddr, path: &str, accept: Option<&str>) -> (u16, String, String) {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let accept = accept
        .map(|a| format!("Accept: {a}\r\n"))
        .unwrap_or_default();
    let request =
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n{accept}Connection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut raw))
        .await
        .expect("response within 10s")
        .expect("read");
    let raw = String::from_utf8(raw).expect("utf-8 response");
    let (head, body) = raw.split_once("\r\n\r\n").expect("header/body separator");
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status code");
    (status, head.to_owned(), body.to_owned())
}

#[tokio::test]
async fn metrics_health_and_readiness_over_http() {
    let metrics = Metrics::new();
    let health = Health::new();
    let requests = metrics
        .register(
            "test_requests",
            "Requests seen by the test",
            Counter::<u64>::default(),
        )
        .unwrap();
    let by_kind = metrics
        .register(
            "test_events",
            "Events by kind",
            Family::<Vec<(String, String)>, Counter>::default(),
        )
        .unwrap();
    requests.inc_by(5);
    by_kind
        .get_or_create(&vec![("kind".to_owned(), "drop".to_owned())])
        .inc();
    metrics
        .register_info(
            "build",
            "Build facts",
            vec![("version".into(), "0.1.0".into())],
        )
        .unwrap();

    let server = serve(
        "127.0.0.1:0".parse().unwrap(),
        metrics.clone(),
        health.clone(),
        std::future::pending(),
    )
    .await
    .unwrap();
    let addr = server.local_addr();
    assert_ne!(addr.port(), 0, "port 0 is replaced by the bound port");

    // Default: Prometheus text 0.0.4.
    let (status, head, body) = get(addr, "/metrics", None).await;
    assert_eq!(status, 200, "{head}\n{body}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    assert!(
        body.contains("# TYPE asyncrl_test_requests_total counter\n"),
        "{body}"
    );
    assert!(body.contains("\nasyncrl_test_requests_total 5\n"), "{body}");
    assert!(
        body.contains("asyncrl_test_events_total{kind=\"drop\"} 1\n"),
        "{body}"
    );
    assert!(
        body.contains("asyncrl_build_info{version=\"0.1.0\"} 1\n"),
        "{body}"
    );
    assert!(!body.contains("# EOF"), "{body}");

    // What Prometheus asks for: OpenMetrics.
    let (status, head, body) = get(
        addr,
        "/metrics",
        Some("application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"),
    )
    .await;
    assert_eq!(status, 200);
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/openmetrics-text; version=1.0.0"),
        "{head}"
    );
    assert!(
        body.contains("# TYPE asyncrl_test_requests counter\n"),
        "{body}"
    );
    assert!(body.ends_with("# EOF\n"), "{body}");

    // A metric registered after start shows up on the next scrape.
    requests.inc();
    let (_, _, body) = get(addr, "/metrics", None).await;
    assert!(body.contains("\nasyncrl_test_requests_total 6\n"), "{body}");

    let (status, _, body) = get(addr, "/healthz", None).await;
    assert_eq!((status, body.as_str()), (200, "ok\n"));

    // Not ready until every declared condition is.
    let (status, _, body) = get(addr, "/readyz", None).await;
    assert_eq!(status, 503, "{body}");
    health.set_not_ready("bus", "connecting");
    health.set_ready("started");
    let (status, _, body) = get(addr, "/readyz", None).await;
    assert_eq!(status, 503);
    assert!(body.contains("bus: connecting"), "{body}");
    health.set_ready("bus");
    let (status, _, body) = get(addr, "/readyz", None).await;
    assert_eq!((status, body.as_str()), (200, "ready\n"));

    let (status, _, _) = get(addr, "/nope", None).await;
    assert_eq!(status, 404);

    server.shutdown().await.unwrap();
    assert!(
        TcpStream::connect(addr).await.is_err(),
        "the port is closed after shutdown"
    );
}

#[tokio::test]
async fn shutdown_future_stops_the_server_and_config_can_disable_it() {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let config = TelemetryConfig {
        listen: "127.0.0.1:0".into(),
        ..TelemetryConfig::default()
    };
    let server = serve_from_config(&config, Metrics::new(), Health::new(), async {
        let _ = rx.await;
    })
    .await
    .unwrap()
    .expect("enabled");
    let addr = server.local_addr();
    assert_eq!(get(addr, "/healthz", None).await.0, 200);
    tx.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(10), server.join())
        .await
        .expect("stops within 10s")
        .unwrap();

    let disabled = TelemetryConfig {
        listen: String::new(),
        ..TelemetryConfig::default()
    };
    let none = serve_from_config(
        &disabled,
        Metrics::new(),
        Health::new(),
        std::future::pending(),
    )
    .await
    .unwrap();
    assert!(none.is_none());
}

#[tokio::test]
async fn bind_error_names_the_address() {
    let first = serve(
        "127.0.0.1:0".parse().unwrap(),
        Metrics::new(),
        Health::new(),
        std::future::pending(),
    )
    .await
    .unwrap();
    let err = serve(
        first.local_addr(),
        Metrics::new(),
        Health::new(),
        std::future::pending(),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(err.contains(&first.local_addr().to_string()), "{err}");
    first.shutdown().await.unwrap();
}
