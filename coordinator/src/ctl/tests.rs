use super::*;
use asyncrl_protos::v1::WorkerInfo;

#[test]
fn tables_align_columns() {
    let t = table(
        &["NAME", "N"],
        &[
            vec!["a".into(), "1".into()],
            vec!["long name".into(), "100".into()],
        ],
    );
    assert_eq!(t, "NAME         N\na            1\nlong name  100\n");
}

#[test]
fn status_shows_admission_and_workers() {
    let s = StatusReply {
        policy_version: 3,
        eta: 1,
        groups_per_step: 4,
        accepted_groups: 14,
        running_groups: 2,
        capacity_left: 4,
        live_workers: 1,
        dataset_size: 100,
        cursor: 16,
        ..Default::default()
    };
    let w = ListWorkersReply {
        workers: vec![WorkerInfo {
            worker_id: "w-1".into(),
            hostname: "gpu-0".into(),
            capacity: 16,
            policy_version: 3,
            leases: 2,
            last_heartbeat_unix_ms: 9_000,
            alive: true,
            draining: false,
            tokens_per_second: 1234.4,
        }],
    };
    let text = format_status(&s, &w, 10_500);
    assert!(
        text.contains("capacity left         4 of (eta + v + 1) * B = 20"),
        "{text}"
    );
    assert!(
        text.contains("epoch 0, cursor 16/100, 0 re-queued"),
        "{text}"
    );
    assert!(text.contains("not measured yet"), "{text}");
    let last = text.lines().last().unwrap();
    assert!(
        last.starts_with("w-1")
            && last.contains("gpu-0")
            && last.contains("alive")
            && last.contains("1.5s")
            && last.ends_with("1234"),
        "{text}"
    );
}

#[test]
fn resolves_the_endpoint_from_the_config() {
    let mut c = Config::default();
    c.coordinator.admin_listen = "0.0.0.0:9000".into();
    let args = CtlArgs::new(CtlCommand::Status);
    assert_eq!(
        resolve_endpoint(&c, &args).unwrap(),
        ("http://127.0.0.1:9000".into(), false)
    );
    c.coordinator.admin_tls = Some(asyncrl_config::AdminTlsConfig {
        ca_file: Some("ca.pem".into()),
        ..Default::default()
    });
    assert_eq!(
        resolve_endpoint(&c, &args).unwrap().0,
        "https://127.0.0.1:9000"
    );
    c.coordinator.admin_listen.clear();
    assert!(matches!(
        resolve_endpoint(&c, &args),
        Err(CtlError::NoEndpoint)
    ));
}
