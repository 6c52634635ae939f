//! The roles over TLS: a CA, a server certificate for 127.0.0.1/localhost
//! and a client certificate, generated here (rcgen); nats-server with a
//! `tls {}` block that verifies clients (mutual TLS); every role connects to
//! `tls://127.0.0.1:PORT` with `bus.tls` (CA, client certificate and key),
//! and the run's invariants hold. A client that does not trust the CA, or
//! has no client certificate, is refused with an error that says so.

use std::time::Duration;

use asyncrl_config::{BusConfig, TlsConfig};
use asyncrl_harness::cluster::{Cluster, Expect, NatsSetup, Spec};
use asyncrl_harness::secure::{Pki, make_pki};
use asyncrl_testkit::{NatsServer, ServerConfig};
use asyncrl_transport::{NatsBus, TransportError, TransportMetrics};

/// nats-server that speaks TLS only and verifies client certificates.
fn tls_server(pki: &Pki) -> ServerConfig {
    ServerConfig::new(format!("tls {{\n{}\n}}\n", pki.verifying_tls_block()))
}

#[test]
fn the_roles_run_end_to_end_over_mutual_tls() {
    let dir = tempfile::tempdir().unwrap();
    let pki = make_pki(dir.path(), "asyncrl test CA").unwrap();
    let mut cluster = Cluster::start_with(
        Spec {
            max_steps: 6,
            ..Spec::default()
        },
        NatsSetup {
            server: Some(tls_server(&pki)),
            tls: true,
            bus_tls: Some(TlsConfig {
                ca_file: Some(pki.ca.clone()),
                cert_file: Some(pki.client_cert.clone()),
                key_file: Some(pki.client_key.clone()),
                ..TlsConfig::default()
            }),
            observer_ca: Some(pki.ca.clone()),
            observer_cert: Some((pki.client_cert.clone(), pki.client_key.clone())),
            ..NatsSetup::default()
        },
    );
    assert!(cluster.bus_url().starts_with("tls://127.0.0.1:"));
    let report = cluster.finish(&Expect::default());
    assert_eq!(report.steps, 6);
    assert!(report.trained_trajectories > 0, "{report:?}");
}

async fn connect(config: &BusConfig) -> Result<NatsBus, TransportError> {
    NatsBus::connect(config, TransportMetrics::new()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_do_not_trust_the_ca_or_bring_no_certificate_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let pki = make_pki(dir.path(), "asyncrl test CA").unwrap();
    let other = tempfile::tempdir().unwrap();
    let stranger = make_pki(other.path(), "some other CA").unwrap();
    let server = NatsServer::start_with_config(&tls_server(&pki)).expect("start nats-server");
    let url = format!("tls://127.0.0.1:{}", server.port());
    let base = BusConfig {
        connect_timeout: Duration::from_secs(2),
        ..BusConfig::nats(url.clone())
    };

    // The full client settings connect.
    let good = TlsConfig {
        required: true,
        ca_file: Some(pki.ca.clone()),
        cert_file: Some(pki.client_cert.clone()),
        key_file: Some(pki.client_key.clone()),
    };
    let bus = connect(&BusConfig {
        tls: Some(good.clone()),
        ..base.clone()
    })
    .await
    .expect("a client with the CA and a client certificate connects");
    asyncrl_transport::Bus::flush(&bus).await.unwrap();

    // Without the CA (the system roots only, or another CA), the server's
    // certificate is not trusted: an error naming the URL and the cause.
    for (what, tls) in [
        ("no CA", None),
        (
            "another CA",
            Some(TlsConfig {
                ca_file: Some(stranger.ca.clone()),
                cert_file: Some(stranger.client_cert.clone()),
                key_file: Some(stranger.client_key.clone()),
                ..good.clone()
            }),
        ),
    ] {
        let err = connect(&BusConfig {
            tls,
            ..base.clone()
        })
        .await
        .err()
        .unwrap_or_else(|| panic!("{what}: connected to a server it cannot trust"));
        let message = format!("{:#}", anyhow::Error::from(err.clone()));
        eprintln!("{what}: {message}");
        assert!(
            matches!(err, TransportError::Connect { .. }),
            "{what}: {err:?}"
        );
        assert!(message.contains(&url), "{what}: {message}");
        assert!(
            message.to_lowercase().contains("certificate"),
            "{what}: the error does not say the certificate is the problem: {message}"
        );
    }

    // With the CA but no client certificate, the server refuses the client.
    let err = connect(&BusConfig {
        tls: Some(TlsConfig {
            cert_file: None,
            key_file: None,
            ..good
        }),
        ..base
    })
    .await
    .err()
    .expect("a client without a certificate is refused under verify: true");
    assert!(matches!(err, TransportError::Connect { .. }), "{err:?}");
}
