//! Hostile payloads on every worker request subject of the coordinator
//! (tasks.acquire/complete/return, workers.register/heartbeat): random
//! bytes, truncated valid messages, valid messages with absurd fields. Each
//! gets a reply of its subject's type (with a reason where the reply has a
//! field for one), each refusal is counted in
//! `asyncrl_coordinator_bad_requests_total{subject,reason}`, no refused
//! request touches the worker registry, and a real worker is served
//! afterwards. Over the in-process bus (many cases) and a real nats-server
//! (fewer). Every test counts the inputs it tried.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use asyncrl_common::SystemClock;
use asyncrl_coordinator::Coordinator;
use asyncrl_protos::subjects::{
    TASKS_ACQUIRE, TASKS_COMPLETE, TASKS_RETURN, WORKERS_HEARTBEAT, WORKERS_REGISTER,
};
use asyncrl_protos::v1::{
    AcquireTasks, AcquireTasksReply, CompleteTask, CompleteTaskReply, HeartbeatReply,
    RegisterWorker, RegisterWorkerReply, ReturnTasks, ReturnTasksReply, WorkerHeartbeat,
};
use asyncrl_telemetry::{Health, Metrics};
use asyncrl_testkit::NatsServer;
use asyncrl_transport::{Bus, LocalBus};
use bytes::Bytes;
use common::{Worker, config, nats_bus, write_tasks};
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestRunner};
use prost::Message;
use tokio_util::sync::CancellationToken;

const SUBJECTS: [&str; 5] = [
    TASKS_ACQUIRE,
    TASKS_COMPLETE,
    TASKS_RETURN,
    WORKERS_REGISTER,
    WORKERS_HEARTBEAT,
];

/// The coordinator's rule for a worker id.
fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

/// Whether the coordinator must refuse `payload` on `subject` (and count
/// it), by the contract: it does not decode, its worker id is no id, or a
/// heartbeat's rate is no rate.
fn must_refuse(subject: &str, payload: &[u8]) -> bool {
    match subject {
        TASKS_ACQUIRE => AcquireTasks::decode(payload).map_or(true, |m| !valid_id(&m.worker_id)),
        TASKS_COMPLETE => CompleteTask::decode(payload).map_or(true, |m| !valid_id(&m.worker_id)),
        TASKS_RETURN => ReturnTasks::decode(payload).map_or(true, |m| !valid_id(&m.worker_id)),
        WORKERS_REGISTER => {
            RegisterWorker::decode(payload).map_or(true, |m| !valid_id(&m.worker_id))
        }
        WORKERS_HEARTBEAT => WorkerHeartbeat::decode(payload).map_or(true, |m| {
            let rate = m.tokens_per_second;
            let swap = m.weight_swap_latency_ms;
            let ok = valid_id(&m.worker_id)
                && rate.is_finite()
                && rate >= 0.0
                && swap.is_finite()
                && swap >= 0.0;
            !ok
        }),
        other => panic!("{other}"),
    }
}

/// Checks the reply is of the subject's type, with a reason where refused
/// and the reply has one.
fn check_reply(subject: &str, refused: bool, reply: &[u8]) {
    match subject {
        TASKS_ACQUIRE => {
            let r = AcquireTasksReply::decode(reply).expect("an AcquireTasksReply");
            if refused {
                assert!(r.tasks.is_empty() && !r.reason.is_empty(), "{r:?}");
            }
        }
        TASKS_COMPLETE => {
            let r = CompleteTaskReply::decode(reply).expect("a CompleteTaskReply");
            if refused {
                assert!(!r.accepted && !r.reason.is_empty(), "{r:?}");
            }
        }
        TASKS_RETURN => {
            let r = ReturnTasksReply::decode(reply).expect("a ReturnTasksReply");
            if refused {
                assert_eq!(r.returned, 0);
            }
        }
        WORKERS_REGISTER => {
            let r = RegisterWorkerReply::decode(reply).expect("a RegisterWorkerReply");
            if refused {
                assert!(!r.accepted && !r.reason.is_empty(), "{r:?}");
            }
        }
        WORKERS_HEARTBEAT => {
            let r = HeartbeatReply::decode(reply).expect("a HeartbeatReply");
            if refused {
                assert!(r.revoked_lease_ids.is_empty(), "{r:?}");
            }
        }
        other => panic!("{other}"),
    }
}

/// A valid request of each subject (worker `w-valid`).
fn valid(subject: &str) -> Vec<u8> {
    let id = "w-valid".to_owned();
    match subject {
        TASKS_ACQUIRE => AcquireTasks {
            worker_id: id,
            free_slots: 1,
        }
        .encode_to_vec(),
        TASKS_COMPLETE => CompleteTask {
            worker_id: id,
            task_id: "arith-1@0".into(),
            lease_id: "00000000-0000-0000-0000-000000000001".into(),
            num_trajectories: 2,
        }
        .encode_to_vec(),
        TASKS_RETURN => ReturnTasks {
            worker_id: id,
            lease_ids: vec!["l1".into(), "l2".into()],
            reason: "test".into(),
            task_failed: true,
        }
        .encode_to_vec(),
        WORKERS_REGISTER => RegisterWorker {
            worker_id: id,
            capacity: 4,
            policy_version: 0,
            hostname: "host".into(),
        }
        .encode_to_vec(),
        WORKERS_HEARTBEAT => WorkerHeartbeat {
            worker_id: id,
            policy_version: 0,
            lease_ids: vec!["l1".into()],
            sequences_in_flight: 1,
            tokens_per_second: 10.0,
            draining: false,
            weight_swap_latency_ms: 5.0,
        }
        .encode_to_vec(),
        other => panic!("{other}"),
    }
}

/// Valid messages with absurd field values: ids that are no ids, extreme
/// numbers, NaN/inf rates, huge lists.
fn absurd(subject: &str) -> Vec<Vec<u8>> {
    let ids = [
        String::new(),
        "x".repeat(129),
        "x".repeat(100_000),
        "w valid".into(),
        "w/../x".into(),
        "wörker".into(),
        "w\0".into(),
        "*".into(),
        ">".into(),
    ];
    let mut out = Vec::new();
    for id in &ids {
        let id = id.clone();
        out.push(match subject {
            TASKS_ACQUIRE => AcquireTasks {
                worker_id: id,
                free_slots: u32::MAX,
            }
            .encode_to_vec(),
            TASKS_COMPLETE => CompleteTask {
                worker_id: id,
                task_id: "\u{0}".repeat(300),
                lease_id: String::new(),
                num_trajectories: u32::MAX,
            }
            .encode_to_vec(),
            TASKS_RETURN => ReturnTasks {
                worker_id: id,
                lease_ids: vec![String::new(); 10_000],
                reason: "x".repeat(10_000),
                task_failed: true,
            }
            .encode_to_vec(),
            WORKERS_REGISTER => RegisterWorker {
                worker_id: id,
                capacity: u32::MAX,
                policy_version: i32::MIN,
                hostname: "h".repeat(10_000),
            }
            .encode_to_vec(),
            WORKERS_HEARTBEAT => WorkerHeartbeat {
                worker_id: id,
                policy_version: i32::MAX,
                lease_ids: vec!["l".into(); 10_000],
                sequences_in_flight: u32::MAX,
                tokens_per_second: f64::MAX,
                draining: true,
                weight_swap_latency_ms: f64::MAX,
            }
            .encode_to_vec(),
            other => panic!("{other}"),
        });
    }
    if subject == WORKERS_HEARTBEAT {
        for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -1.0] {
            out.push(
                WorkerHeartbeat {
                    worker_id: "w-rate".into(),
                    tokens_per_second: bad,
                    ..Default::default()
                }
                .encode_to_vec(),
            );
            out.push(
                WorkerHeartbeat {
                    worker_id: "w-swap".into(),
                    weight_swap_latency_ms: bad,
                    ..Default::default()
                }
                .encode_to_vec(),
            );
        }
    }
    out
}

struct Tally {
    tried: BTreeMap<&'static str, u64>,
    refused: BTreeMap<&'static str, u64>,
}

async fn send(bus: &Arc<dyn Bus>, subject: &'static str, payload: Vec<u8>, tally: &mut Tally) {
    let refused = must_refuse(subject, &payload);
    let reply = bus
        .request(subject, Bytes::from(payload), common::TIMEOUT)
        .await
        .unwrap_or_else(|e| panic!("{subject}: no reply: {e}"));
    check_reply(subject, refused, &reply);
    *tally.tried.entry(subject).or_insert(0) += 1;
    if refused {
        *tally.refused.entry(subject).or_insert(0) += 1;
    }
}

/// `asyncrl_coordinator_bad_requests_total` per subject.
fn counted(metrics: &Metrics) -> BTreeMap<String, u64> {
    let text = metrics.encode_prometheus_text().unwrap();
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("asyncrl_coordinator_bad_requests_total{") else {
            continue;
        };
        let subject = rest
            .split("subject=\"")
            .nth(1)
            .and_then(|s| s.split('"').next())
            .unwrap()
            .to_owned();
        let value: u64 = rest.rsplit(' ').next().unwrap().parse().unwrap();
        *out.entry(subject).or_insert(0) += value;
    }
    out
}

/// Sends `random` random payloads per subject plus every prefix of a valid
/// message and the absurd ones, then checks counts, the registry and that a
/// real worker is served.
async fn exercise(bus: Arc<dyn Bus>, random: u32) -> u64 {
    let dir = tempfile::tempdir().unwrap();
    let tasks = write_tasks(dir.path(), 64);
    let metrics = Metrics::new();
    let coordinator = Coordinator::start_with_clock(
        config(dir.path(), &tasks, 4, 4),
        bus.clone(),
        metrics.clone(),
        Health::new(),
        &CancellationToken::new(),
        SystemClock::shared(),
    )
    .await
    .expect("start coordinator");
    // Served before the flood: a real worker registered.
    let worker = Worker::new(&bus, "w-real");
    assert!(worker.register(4).await.accepted);

    let mut tally = Tally {
        tried: BTreeMap::new(),
        refused: BTreeMap::new(),
    };
    for subject in SUBJECTS {
        let good = valid(subject);
        for cut in 0..good.len() {
            send(&bus, subject, good[..cut].to_vec(), &mut tally).await;
        }
        for payload in absurd(subject) {
            send(&bus, subject, payload, &mut tally).await;
        }
        let payloads = std::cell::RefCell::new(Vec::new());
        TestRunner::new(ProptestConfig {
            cases: random,
            failure_persistence: None,
            ..ProptestConfig::default()
        })
        .run(&proptest::collection::vec(any::<u8>(), 0..256), |bytes| {
            payloads.borrow_mut().push(bytes);
            Ok(())
        })
        .unwrap();
        let payloads = payloads.into_inner();
        assert_eq!(payloads.len(), random as usize);
        for payload in payloads {
            send(&bus, subject, payload, &mut tally).await;
        }
    }

    // Every refusal counted under its subject, nothing else.
    let got = counted(&metrics);
    let want: BTreeMap<String, u64> = tally
        .refused
        .iter()
        .map(|(s, n)| ((*s).to_owned(), *n))
        .collect();
    assert_eq!(got, want);
    for subject in SUBJECTS {
        assert!(
            tally.refused.get(subject).copied().unwrap_or(0) > 0,
            "{subject}"
        );
    }

    // No refused request made a worker: every worker id the registry holds
    // is a valid one (random bytes may form a valid request, whose worker is
    // then real).
    let workers = coordinator.workers().await.unwrap().workers;
    assert!(workers.iter().any(|w| w.worker_id == "w-real"));
    for w in &workers {
        assert!(valid_id(&w.worker_id), "a ghost worker {:?}", w.worker_id);
        assert!(w.tokens_per_second.is_finite(), "{w:?}");
    }

    // Still serving: the real worker acquires and completes a task.
    let reply = worker.acquire(1).await;
    assert_eq!(reply.tasks.len(), 1, "{reply:?}");
    let done = worker.complete(&reply.tasks[0]).await;
    assert!(done.accepted, "{done:?}");
    let status = coordinator.status().await.unwrap();
    assert!(
        status.running_groups + status.accepted_groups >= 1,
        "{status:?}"
    );

    let tried: u64 = tally.tried.values().sum();
    let refused: u64 = tally.refused.values().sum();
    println!(
        "coordinator requests tried: {tried} ({refused} refused), per subject {:?}",
        tally.tried
    );
    tried
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_requests_over_the_local_bus() {
    let tried = exercise(Arc::new(LocalBus::new()), 1000).await;
    assert!(tried >= 5 * 1000, "tried {tried}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_requests_over_nats() {
    let server = NatsServer::start().expect("start nats-server (run scripts/setup)");
    let tried = exercise(nats_bus(&server.url()).await, 100).await;
    assert!(tried >= 5 * 100, "tried {tried}");
}
