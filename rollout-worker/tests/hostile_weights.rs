//! Hostile weights at the worker's boundary: wrong shapes, wrong dtypes,
//! missing and extra tensors, truncated safetensors, random bytes, a
//! sha256 that is not the announced one. The model refuses every payload
//! before copying any tensor (its weights and version stay as they were);
//! a running worker counts each in
//! `asyncrl_worker_weight_fetch_failures_total{reason}`, keeps generating
//! with its old version (log-probs of the old weights), never stops, and
//! loads the next valid version. Every test counts the inputs it tried.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use asyncrl_rollout_worker::WorkerMetrics;
use asyncrl_rollout_worker::metrics::WEIGHT_FAILURE_REASONS;
use asyncrl_rollout_worker::scripted::{ScriptOptions, ScriptedTask, read_trajectories};
use asyncrl_tasks::BuiltinTask;
use asyncrl_transport::sha256_hex;
use bytes::Bytes;
use common::*;
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestRunner};

/// A safetensors file: (name, dtype, shape, data) per tensor.
fn safetensors(tensors: &[(String, String, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, dtype, shape, bytes) in tensors {
        let start = data.len();
        data.extend_from_slice(bytes);
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let mut h = serde_json::to_vec(&serde_json::Value::Object(header)).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend(data);
    out
}

/// The tensors of a valid payload: (name, dtype, shape, data).
fn tensors_of(bytes: &[u8]) -> Vec<(String, String, Vec<usize>, Vec<u8>)> {
    let st = safetensors::SafeTensors::deserialize(bytes).unwrap();
    let mut out: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            (
                name,
                format!("{:?}", view.dtype()),
                view.shape().to_vec(),
                view.data().to_vec(),
            )
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// One way to spoil a valid payload.
#[derive(Debug, Clone)]
enum Spoil {
    /// Tensor `i`'s shape with one dimension grown or shrunk (data to match).
    Shape(usize, bool),
    /// Tensor `i` stored as another dtype (data to match).
    Dtype(usize, &'static str),
    Missing(usize),
    Extra,
    /// Cut at this fraction of the bytes.
    Truncated(f64),
    /// Bytes flipped in the header.
    Header(usize),
    Random(Vec<u8>),
}

fn spoil(good: &[u8], how: &Spoil) -> Vec<u8> {
    let mut t = tensors_of(good);
    let n = t.len();
    match how {
        Spoil::Shape(i, grow) => {
            let (_, _, shape, data) = &mut t[i % n];
            let per_row = data.len() / shape[0].max(1);
            if *grow {
                shape[0] += 1;
                data.extend(vec![0u8; per_row]);
            } else if shape[0] > 1 {
                shape[0] -= 1;
                data.truncate(data.len() - per_row);
            } else {
                shape.push(2);
                let copy = data.clone();
                data.extend(copy);
            }
            safetensors(&t)
        }
        Spoil::Dtype(i, dtype) => {
            let (_, d, shape, data) = &mut t[i % n];
            let elems: usize = shape.iter().product();
            let width = match *dtype {
                "F64" | "I64" => 8,
                "I32" | "U32" => 4,
                "I16" | "F16" | "BF16" => 2,
                _ => 1,
            };
            // Float dtypes (F64, F32, F16, BF16) are accepted; these are not.
            *d = (*dtype).to_owned();
            *data = vec![0u8; elems * width];
            safetensors(&t)
        }
        Spoil::Missing(i) => {
            t.remove(i % n);
            safetensors(&t)
        }
        Spoil::Extra => {
            t.push((
                "model.layers.99.extra.weight".into(),
                "F32".into(),
                vec![2],
                vec![0; 8],
            ));
            safetensors(&t)
        }
        Spoil::Truncated(f) => {
            good[..((good.len() as f64 * f) as usize).min(good.len() - 1)].to_vec()
        }
        Spoil::Header(at) => {
            let mut b = good.to_vec();
            let header_len = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
            let at = 8 + at % header_len;
            b[at] = b[at].wrapping_add(1 + (at % 7) as u8);
            b
        }
        Spoil::Random(bytes) => bytes.clone(),
    }
}

fn spoils() -> impl Strategy<Value = Spoil> {
    prop_oneof![
        (any::<usize>(), any::<bool>()).prop_map(|(i, g)| Spoil::Shape(i, g)),
        (
            any::<usize>(),
            proptest::sample::select(vec!["I64", "I32", "U8", "I8", "BOOL", "U32", "I16"])
        )
            .prop_map(|(i, d)| Spoil::Dtype(i, d)),
        any::<usize>().prop_map(Spoil::Missing),
        Just(Spoil::Extra),
        (0.0f64..1.0).prop_map(Spoil::Truncated),
        any::<usize>().prop_map(Spoil::Header),
        proptest::collection::vec(any::<u8>(), 0..4096).prop_map(Spoil::Random),
    ]
}

/// Header flips may land in a key's padding and leave a valid file; every
/// other spoil must be refused.
fn must_refuse(how: &Spoil) -> bool {
    !matches!(how, Spoil::Header(_))
}

#[test]
fn the_model_refuses_hostile_payloads_and_keeps_its_weights() {
    let section = model_section(8, 48);
    let mut p = policy(&section, 100);
    p.set_version(5);
    let good = weights(&p).to_vec();
    let spoiled = std::cell::RefCell::new(Vec::new());
    TestRunner::new(ProptestConfig {
        cases: 200,
        failure_persistence: None,
        ..ProptestConfig::default()
    })
    .run(&spoils(), |how| {
        spoiled.borrow_mut().push(how);
        Ok(())
    })
    .unwrap();
    let spoiled = spoiled.into_inner();
    let mut by_kind: BTreeMap<String, usize> = BTreeMap::new();
    let mut refused = 0usize;
    for how in &spoiled {
        let bytes = spoil(&good, how);
        let r = p.load_weights_from_bytes(&bytes, 6);
        let kind = format!("{how:?}")
            .split(['(', ' '])
            .next()
            .unwrap()
            .to_owned();
        *by_kind.entry(kind).or_insert(0) += 1;
        if must_refuse(how) {
            assert!(r.is_err(), "{how:?} was loaded");
        }
        if r.is_err() {
            refused += 1;
            // Nothing was copied: same weights, same version.
            assert_eq!(p.version(), 5, "{how:?}");
            assert_eq!(weights(&p).to_vec(), good, "{how:?} changed the weights");
        } else {
            // A header flip that left a valid file: restore the state.
            p.load_weights_from_bytes(&good, 5).unwrap();
        }
    }
    println!(
        "hostile payloads tried: {} ({refused} refused), by kind {by_kind:?}",
        spoiled.len()
    );
    assert_eq!(spoiled.len(), 200);
    assert!(by_kind.len() >= 6, "{by_kind:?}");
    // The model still loads valid weights afterwards.
    p.load_weights_from_bytes(&good, 7).unwrap();
    assert_eq!(p.version(), 7);
}

/// A running worker (real nats-server) on version 5 gets announcements of
/// hostile payloads: each counted, version 5 kept and generating, the
/// worker never stops, and a valid version after them is loaded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_keeps_its_weights_through_hostile_versions() {
    const G: u32 = 2;
    let rig = Rig::nats(
        model_section(8, 48),
        4,
        Vec::new(),
        ScriptOptions {
            group_size: G,
            ..ScriptOptions::default()
        },
    )
    .await;
    let Rig {
        bus, coordinator, ..
    } = &rig;
    let p5 = rig.policy(100);
    let good = weights(&p5).to_vec();
    rig.publish(5, &p5).await;
    let RunningWorker {
        handles,
        shutdown,
        task: worker,
    } = start_worker_at(rig.config.clone(), bus, 5).await;

    let hostile = [
        Spoil::Shape(0, true),
        Spoil::Shape(3, false),
        Spoil::Dtype(1, "I64"),
        Spoil::Dtype(2, "U8"),
        Spoil::Missing(0),
        Spoil::Extra,
        Spoil::Truncated(0.5),
        Spoil::Truncated(0.0),
        Spoil::Random(vec![0xab; 1000]),
        Spoil::Random(Vec::new()),
    ];
    let mut version = 5;
    for how in &hostile {
        version += 1;
        let bytes = Bytes::from(spoil(&good, how));
        let before = failures(&handles.weight_fetch_failures, "load");
        let sha256 = sha256_hex(&bytes);
        store_and_announce(bus, version, bytes, sha256).await;
        assert!(
            eventually(Duration::from_secs(20), || failures(
                &handles.weight_fetch_failures,
                "load"
            ) > before)
            .await,
            "{how:?} (version {version}) counted as a load failure"
        );
        assert_eq!(handles.policy_version.get(), 5, "{how:?}: old weights kept");
        assert!(!worker.is_finished(), "{how:?} stopped the worker");
    }
    // Valid bytes under a sha256 that is not theirs.
    version += 1;
    store_and_announce(
        bus,
        version,
        Bytes::from(good.clone()),
        sha256_hex(b"not these bytes"),
    )
    .await;
    assert!(
        eventually(Duration::from_secs(20), || failures(
            &handles.weight_fetch_failures,
            "checksum"
        ) >= 1)
        .await,
        "the checksum mismatch is counted"
    );
    assert_eq!(handles.policy_version.get(), 5);
    let tried = hostile.len() + 1;

    // Generation goes on with version 5: its log-probs are version 5's.
    coordinator.push_tasks(ScriptedTask::generated(BuiltinTask::Arith, 1, 1));
    let (done, _) = coordinator
        .wait_for(Duration::from_secs(60), |l| l.completed_leases().len() == 1)
        .await;
    assert!(done, "the worker generates with its old weights");
    let got = read_trajectories(
        bus.as_ref(),
        "hostile-weights",
        G as usize,
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    assert_eq!(got.len(), G as usize);
    for r in &got {
        let t = &r.trajectory;
        assert!(
            t.policy_versions.iter().all(|&v| v == 5),
            "{:?}",
            t.policy_versions
        );
        let lp = recompute(&p5, &t.prompt_token_ids, &t.completion_token_ids);
        assert!(max_abs_diff(&lp, &t.behaviour_logprobs) <= 1e-4);
    }

    // A valid version after them is loaded.
    version += 1;
    let p_next = rig.policy(300);
    rig.publish(version, &p_next).await;
    assert!(
        eventually(Duration::from_secs(20), || handles.policy_version.get()
            == i64::from(version))
        .await,
        "version {version} loaded after the hostile ones"
    );
    shutdown.cancel();
    let summary = worker.await.unwrap().unwrap();
    assert_eq!(summary.weight_swaps, 2, "5 and {version}; no hostile one");
    let total = WorkerMetrics::family_total(&handles.weight_fetch_failures, WEIGHT_FAILURE_REASONS);
    assert!(total >= tried as u64, "{total} of {tried}");
    println!("hostile versions announced to a running worker: {tried}; failures counted: {total}");
}
