//! Hostile SetKnobs through the admin gRPC API (with its token): values out
//! of range, NaN and infinities, negative numbers, clip modes that are no
//! mode, changes that set nothing, absurd steps and requesters. Each is
//! refused naming the knob (the admin API's refusal: `accepted = false`
//! with the reason, journaled, counted in
//! `asyncrl_knob_requests_total{outcome="refused"}`), the knob schedule in
//! the KV bucket is unchanged (read back), and the server then accepts a
//! valid change. Every test counts the inputs it tried.

mod common;

use std::sync::Arc;

use asyncrl_coordinator::Coordinator;
use asyncrl_coordinator::knobs::KNOBS_KEY;
use asyncrl_protos::subjects::CONTROL_BUCKET;
use asyncrl_protos::v1::coordinator_admin_client::CoordinatorAdminClient;
use asyncrl_protos::v1::{Knobs, SetKnobsReply, SetKnobsRequest};
use asyncrl_telemetry::{Health, Metrics};
use asyncrl_transport::{Bus, LocalBus};
use common::{config, write_tasks};
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestRunner};
use tokio_util::sync::CancellationToken;

const TOKEN: &str = "s3cret-token";

/// A float knob value outside `[lo, hi]`, or not finite.
fn bad_f32(lo: f32, hi: f32) -> impl Strategy<Value = f32> {
    prop_oneof![
        Just(f32::NAN),
        Just(f32::INFINITY),
        Just(f32::NEG_INFINITY),
        Just(-0.5f32),
        (hi * 1.001 + 1e-6)..f32::MAX,
        f32::MIN..(lo - lo.abs() * 1e-3 - 1e-6),
    ]
}

fn bad_f64(lo: f64, hi: f64) -> impl Strategy<Value = f64> {
    prop_oneof![
        Just(f64::NAN),
        Just(f64::INFINITY),
        Just(f64::NEG_INFINITY),
        Just(-1e-6),
        (hi * 1.001 + 1e-12)..f64::MAX,
        f64::MIN..(lo * 0.5),
    ]
}

/// A change with at least one bad knob (`names` lists the bad ones, as the
/// refusal names them); the rest are left unset.
fn hostile_knobs() -> impl Strategy<Value = (Knobs, Vec<&'static str>)> {
    let eta = (65u32..=u32::MAX).prop_map(|v| {
        (
            Knobs {
                eta: Some(v),
                ..Default::default()
            },
            "eta",
        )
    });
    let eps_low = bad_f32(0.0, 0.99).prop_map(|v| {
        (
            Knobs {
                eps_low: Some(v),
                ..Default::default()
            },
            "eps_low",
        )
    });
    let eps_high = bad_f32(0.0, 10.0).prop_map(|v| {
        (
            Knobs {
                eps_high: Some(v),
                ..Default::default()
            },
            "eps_high",
        )
    });
    let quantile = bad_f32(0.01, 0.999).prop_map(|v| {
        (
            Knobs {
                adaptive_quantile: Some(v),
                ..Default::default()
            },
            "adaptive_quantile",
        )
    });
    let temperature = bad_f32(1e-4, 100.0).prop_map(|v| {
        (
            Knobs {
                adaptive_temperature: Some(v),
                ..Default::default()
            },
            "adaptive_temperature",
        )
    });
    let cap = bad_f32(1.0, 1000.0).prop_map(|v| {
        (
            Knobs {
                importance_weight_cap: Some(v),
                ..Default::default()
            },
            "importance_weight_cap",
        )
    });
    let lr = bad_f64(1e-9, 1.0).prop_map(|v| {
        (
            Knobs {
                learning_rate: Some(v),
                ..Default::default()
            },
            "learning_rate",
        )
    });
    // 0 is UNSPECIFIED; 1..=3 the modes; anything else is no mode.
    let clip = prop_oneof![Just(0i32), 4i32..=i32::MAX, i32::MIN..0].prop_map(|v| {
        (
            Knobs {
                clip_mode: Some(v),
                ..Default::default()
            },
            "clip_mode",
        )
    });
    let one = prop_oneof![eta, eps_low, eps_high, quantile, temperature, cap, lr, clip];
    // One or two bad knobs, merged, plus maybe a valid one alongside.
    (one.clone(), proptest::option::of(one), any::<bool>()).prop_map(|((a, na), b, valid)| {
        let mut k = a;
        let mut names = vec![na];
        if let Some((b, nb)) = b {
            merge(&mut k, &b);
            names.push(nb);
        }
        if valid && k.paused.is_none() {
            k.paused = Some(false);
        }
        (k, names)
    })
}

fn merge(k: &mut Knobs, b: &Knobs) {
    k.eta = b.eta.or(k.eta);
    k.eps_low = b.eps_low.or(k.eps_low);
    k.eps_high = b.eps_high.or(k.eps_high);
    k.adaptive_quantile = b.adaptive_quantile.or(k.adaptive_quantile);
    k.adaptive_temperature = b.adaptive_temperature.or(k.adaptive_temperature);
    k.importance_weight_cap = b.importance_weight_cap.or(k.importance_weight_cap);
    k.learning_rate = b.learning_rate.or(k.learning_rate);
    k.clip_mode = b.clip_mode.or(k.clip_mode);
}

fn authed(req: SetKnobsRequest) -> tonic::Request<SetKnobsRequest> {
    let mut r = tonic::Request::new(req);
    r.metadata_mut()
        .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
    r
}

/// `asyncrl_knob_requests_total{outcome}`.
fn requests(metrics: &Metrics, outcome: &str) -> u64 {
    let text = metrics.encode_prometheus_text().unwrap();
    let prefix = format!("asyncrl_knob_requests_total{{outcome=\"{outcome}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map_or(0, |v| v.trim().parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_knob_changes_are_refused_naming_the_knob() {
    let dir = tempfile::tempdir().unwrap();
    let tasks = write_tasks(dir.path(), 16);
    let mut cfg = config(dir.path(), &tasks, 2, 2);
    cfg.coordinator.admin_listen = "127.0.0.1:0".into();
    cfg.coordinator.admin_token = Some(TOKEN.into());
    let bus: Arc<dyn Bus> = Arc::new(LocalBus::new());
    let metrics = Metrics::new();
    let c = Coordinator::start(
        cfg,
        bus.clone(),
        metrics.clone(),
        Health::new(),
        &CancellationToken::new(),
    )
    .await
    .expect("start coordinator");
    let kv = bus.kv(CONTROL_BUCKET).await.unwrap();
    let schedule = || async {
        kv.get(KNOBS_KEY)
            .await
            .unwrap()
            .expect("the knob schedule")
            .value
    };
    let before = schedule().await;
    let mut client = CoordinatorAdminClient::connect(format!("http://{}", c.admin_addr().unwrap()))
        .await
        .unwrap();

    // The generated changes, then fixed ones: nothing set, absurd steps
    // and requesters with a bad knob.
    let cases = std::cell::RefCell::new(Vec::new());
    TestRunner::new(ProptestConfig {
        cases: 300,
        failure_persistence: None,
        ..ProptestConfig::default()
    })
    .run(&hostile_knobs(), |case| {
        cases.borrow_mut().push(case);
        Ok(())
    })
    .unwrap();
    let mut cases: Vec<(Knobs, Vec<&str>, u64, String)> = cases
        .into_inner()
        .into_iter()
        .map(|(k, n)| (k, n, 0, "fuzz".to_owned()))
        .collect();
    assert_eq!(cases.len(), 300);
    for (step, who) in [
        (u64::MAX, "x".repeat(10_000)),
        (1, "\u{0}\n\"}".to_owned()),
        (0, String::new()),
    ] {
        cases.push((
            Knobs {
                eps_low: Some(f32::NAN),
                ..Default::default()
            },
            vec!["eps_low"],
            step,
            who,
        ));
    }
    cases.push((Knobs::default(), vec!["sets no knob"], 0, "empty".into()));

    let mut tried = 0u64;
    for (knobs, names, apply_at_step, who) in &cases {
        let reply: SetKnobsReply = client
            .set_knobs(authed(SetKnobsRequest {
                knobs: Some(*knobs),
                apply_at_step: *apply_at_step,
                requested_by: who.clone(),
            }))
            .await
            .unwrap_or_else(|s| panic!("{knobs:?}: {s}"))
            .into_inner();
        tried += 1;
        assert!(!reply.accepted, "{knobs:?} was accepted: {reply:?}");
        assert_eq!(reply.effective_step, 0);
        assert!(
            names
                .iter()
                .any(|n| reply.reason.contains(&format!("`{n}`")) || reply.reason.contains(n)),
            "{knobs:?}: the refusal should name one of {names:?}: {}",
            reply.reason
        );
        assert!(reply.journal_seq > 0, "journaled: {reply:?}");
    }
    println!("hostile knob changes tried: {tried}");
    assert_eq!(tried, 304);
    assert_eq!(requests(&metrics, "refused"), tried);
    assert_eq!(requests(&metrics, "accepted"), 0);
    assert_eq!(schedule().await, before, "the knob schedule is unchanged");

    // Still serving: a valid change is accepted and lands in the schedule.
    let reply = client
        .set_knobs(authed(SetKnobsRequest {
            knobs: Some(Knobs {
                eps_low: Some(0.1),
                ..Default::default()
            }),
            apply_at_step: 0,
            requested_by: "bob".into(),
        }))
        .await
        .unwrap()
        .into_inner();
    assert!(reply.accepted, "{reply:?}");
    assert_eq!(requests(&metrics, "accepted"), 1);
    assert_ne!(schedule().await, before);
}
