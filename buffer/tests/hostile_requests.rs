//! Hostile payloads on the buffer's request subject (`asyncrl.buffer.batch`):
//! random bytes, every prefix of a valid request, and valid requests with
//! absurd fields (step 0, no groups, negative or extreme versions, extreme
//! η and group counts). Each gets a `BatchReply`; a refused one carries an
//! error and is counted in `asyncrl_buffer_batches_refused_total`; none is
//! served anything; the buffer then serves the learner's valid request.
//! Over the in-process bus (many cases) and a real nats-server (fewer).
//! Every test counts the inputs it tried.

mod common;

use std::sync::Arc;
use std::time::Duration;

use asyncrl_buffer::testing::traj;
use asyncrl_protos::Message;
use asyncrl_protos::subjects::BUFFER_BATCH;
use asyncrl_protos::v1::{BatchReply, BatchRequest};
use asyncrl_testkit::NatsServer;
use asyncrl_transport::{Bus, LocalBus};
use bytes::Bytes;
use common::{Running, ask, config, eventually, nats, publish, uuids};
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestRunner};

/// Whether the buffer must refuse `payload` (with no groups ever served):
/// it does not decode, or it asks for step 0, for no groups, or at a
/// negative learner version.
fn must_refuse(payload: &[u8]) -> bool {
    BatchRequest::decode(payload).map_or(true, |r| {
        r.step == 0 || r.num_groups == 0 || r.learner_version < 0
    })
}

fn absurd() -> Vec<BatchRequest> {
    let base = BatchRequest {
        learner_version: 0,
        num_groups: 1,
        eta: 1,
        zstd: false,
        step: 1,
        wait_ms: 0,
        ..Default::default()
    };
    let mut out = Vec::new();
    for version in [i32::MIN, -1] {
        out.push(BatchRequest {
            learner_version: version,
            ..base.clone()
        });
    }
    for step in [0, 1, u64::MAX] {
        for num_groups in [0, 1, u32::MAX] {
            for eta in [0, u32::MAX] {
                out.push(BatchRequest {
                    step,
                    num_groups,
                    eta,
                    learner_version: i32::MAX,
                    zstd: true,
                    ..base.clone()
                });
            }
        }
    }
    out
}

async fn exercise(bus: Arc<dyn Bus>, url: &str, random: u32) -> usize {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(url, dir.path());
    // A request the buffer cannot serve yet is held at most this long.
    cfg.buffer.max_request_wait = Duration::from_millis(20);
    let running = Running::start(&cfg, bus.clone()).await;

    let good = BatchRequest {
        learner_version: 0,
        num_groups: 1,
        eta: 1,
        zstd: false,
        step: 1,
        wait_ms: 0,
        ..Default::default()
    }
    .encode_to_vec();
    let mut payloads: Vec<Vec<u8>> = (0..good.len()).map(|cut| good[..cut].to_vec()).collect();
    payloads.extend(absurd().iter().map(Message::encode_to_vec));
    let random_payloads = std::cell::RefCell::new(Vec::new());
    TestRunner::new(ProptestConfig {
        cases: random,
        failure_persistence: None,
        ..ProptestConfig::default()
    })
    .run(&proptest::collection::vec(any::<u8>(), 0..128), |bytes| {
        random_payloads.borrow_mut().push(bytes);
        Ok(())
    })
    .unwrap();
    let random_payloads = random_payloads.into_inner();
    assert_eq!(random_payloads.len(), random as usize);
    payloads.extend(random_payloads);

    let mut refused = 0u64;
    for payload in &payloads {
        let must = must_refuse(payload);
        let bytes = bus
            .request(
                BUFFER_BATCH,
                Bytes::from(payload.clone()),
                Duration::from_secs(10),
            )
            .await
            .unwrap_or_else(|e| panic!("no reply to {payload:?}: {e}"));
        let reply = BatchReply::decode(bytes.as_ref()).expect("a BatchReply");
        // Nothing is held, so nothing is served.
        assert_eq!(reply.num_groups, 0, "{reply:?}");
        assert!(reply.arrow_ipc.is_empty() && reply.object_name.is_empty());
        if must {
            assert!(!reply.error.is_empty(), "{payload:?} was not refused");
            refused += 1;
        }
    }
    assert!(refused > 0);
    assert_eq!(
        running.metric("buffer_batches_refused_total") as u64,
        refused,
        "every refusal counted"
    );

    // Still serving: one group arrives, the learner's request gets it.
    let trajs: Vec<_> = (0..2).map(|i| traj(i, 2, 0, 8)).collect();
    publish(bus.as_ref(), &trajs).await;
    // Requests wait at most 20 ms here: ask once the group is held (on a
    // loaded machine ingest may take longer than that).
    eventually("the group is ready", Duration::from_secs(10), || {
        running.handle.stats().ready_groups == 1
    })
    .await;
    let (reply, got) = ask(bus.as_ref(), 1, 0, 1, 1, 10_000)
        .await
        .expect("the valid request after the hostile ones");
    assert_eq!(reply.num_groups, 1);
    assert_eq!(uuids(&got), uuids(&trajs));
    println!(
        "buffer requests tried: {} ({refused} refused; {random} random)",
        payloads.len()
    );
    running.shutdown().await;
    payloads.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_batch_requests_over_the_local_bus() {
    let tried = exercise(Arc::new(LocalBus::new()), "local", 1000).await;
    assert!(tried > 1000, "tried {tried}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_batch_requests_over_nats() {
    let server = NatsServer::start().expect("start nats-server (run scripts/setup)");
    let url = server.url();
    let tried = exercise(nats(&url).await, &url, 100).await;
    assert!(tried > 100, "tried {tried}");
}
