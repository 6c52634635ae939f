//! A coordinator process killed with SIGKILL in the middle of a stream of
//! requests, and started again against the same nats-server: no finished
//! task is issued again in its epoch, every unfinished one is.

mod common;

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use asyncrl_config::{Config, DatasetConfig};
use asyncrl_protos::subjects::{TASKS_ACQUIRE, TASKS_COMPLETE};
use asyncrl_protos::v1::{AcquireTasks, AcquireTasksReply, CompleteTask, CompleteTaskReply, Task};
use asyncrl_testkit::NatsServer;
use asyncrl_transport::Bus;
use bytes::Bytes;
use common::{Learner, Worker, nats_bus, write_tasks};
use prost::Message;

const N_TASKS: usize = 40;

fn write_config(dir: &Path, url: &str, tasks: &Path) -> std::path::PathBuf {
    let mut c = Config::isolated(dir, url);
    c.telemetry.log_filter = "warn".into();
    c.staleness.eta = 1;
    c.staleness.groups_per_step = 4;
    c.staleness.group_size = 2;
    c.coordinator.lease_timeout = Duration::from_secs(1);
    c.coordinator.heartbeat_interval = Duration::from_millis(200);
    c.coordinator.dead_after = Duration::from_secs(30);
    c.coordinator.retry_after = Duration::from_millis(20);
    c.coordinator.journal_path = Some(dir.join("journal.jsonl"));
    c.coordinator.datasets = vec![DatasetConfig::jsonl("arith", tasks)];
    let path = dir.join("coordinator.toml");
    c.write(&path).expect("write the coordinator's config");
    path
}

fn spawn(config: &Path, log: &Path) -> Child {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .unwrap();
    Command::new(env!("CARGO_BIN_EXE_asyncrl-coordinator-standalone"))
        .arg("--config")
        .arg(config)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn the coordinator")
}

async fn request<R: Message + Default>(
    bus: &Arc<dyn Bus>,
    subject: &str,
    req: impl Message,
) -> Option<R> {
    let bytes = bus
        .request(
            subject,
            Bytes::from(req.encode_to_vec()),
            Duration::from_secs(2),
        )
        .await
        .ok()?;
    R::decode(bytes.as_ref()).ok()
}

/// What the first worker saw, as a real worker would record it.
#[derive(Default)]
struct Seen {
    /// Completions the coordinator acknowledged: finished.
    finished: HashSet<String>,
    /// Tasks held when the coordinator died (granted, not acknowledged).
    held: BTreeMap<String, Task>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_killed_with_sigkill_continues_where_it_stopped() {
    let server = NatsServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let tasks = write_tasks(dir.path(), N_TASKS);
    let config = write_config(dir.path(), &server.url(), &tasks);
    let log = dir.path().join("coordinator.log");
    let mut child = spawn(&config, &log);

    let bus = nats_bus(&server.url()).await;
    let learner = Learner::new(&bus).await;
    let w1 = Worker::new(&bus, "w1");
    assert!(w1.register(8).await.accepted);
    let seen = Arc::new(Mutex::new(Seen::default()));

    // Phase 1, deterministic: 8 tasks admitted at version 0 (η = 1, B = 4),
    // 5 finished, 3 held.
    let first = w1.acquire(8).await.tasks;
    assert_eq!(first.len(), 8);
    for t in &first[..5] {
        assert!(w1.complete(t).await.accepted);
        seen.lock().unwrap().finished.insert(t.task_id.clone());
    }
    for t in &first[5..] {
        seen.lock()
            .unwrap()
            .held
            .insert(t.task_id.clone(), t.clone());
    }

    // Phase 2: a stream of acquire/complete while the learner moves on; the
    // coordinator is killed in the middle of it.
    let load = {
        let bus = bus.clone();
        let seen = seen.clone();
        tokio::spawn(async move {
            let learner = Learner::new(&bus).await;
            let mut version = 0;
            loop {
                let Some(reply) = request::<AcquireTasksReply>(
                    &bus,
                    TASKS_ACQUIRE,
                    AcquireTasks {
                        worker_id: "w1".into(),
                        free_slots: 1,
                    },
                )
                .await
                else {
                    return;
                };
                if reply.tasks.is_empty() {
                    version += 1;
                    learner.announce(version).await;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                }
                for t in reply.tasks {
                    seen.lock()
                        .unwrap()
                        .held
                        .insert(t.task_id.clone(), t.clone());
                    let done = request::<CompleteTaskReply>(
                        &bus,
                        TASKS_COMPLETE,
                        CompleteTask {
                            worker_id: "w1".into(),
                            task_id: t.task_id.clone(),
                            lease_id: t.lease_id.clone(),
                            num_trajectories: t.group_size,
                        },
                    )
                    .await;
                    match done {
                        Some(r) if r.accepted => {
                            let mut s = seen.lock().unwrap();
                            s.held.remove(&t.task_id);
                            s.finished.insert(t.task_id.clone());
                        }
                        // The coordinator died with the completion in flight:
                        // the task stays held (its completion is retried).
                        _ => return,
                    }
                }
            }
        })
    };
    // Let the stream run, then kill -9 mid-flight.
    let deadline = Instant::now() + Duration::from_secs(10);
    while seen.lock().unwrap().finished.len() < 5 + 12 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    child.kill().expect("SIGKILL the coordinator");
    child.wait().unwrap();
    tokio::time::timeout(Duration::from_secs(10), load)
        .await
        .expect("the load stops once the coordinator is gone")
        .unwrap();
    let (finished_before, held) = {
        let s = seen.lock().unwrap();
        (s.finished.clone(), s.held.clone())
    };
    assert!(
        finished_before.len() >= 17,
        "{} finished",
        finished_before.len()
    );
    assert!(held.len() >= 3);

    // Restart against the same server.
    let mut child = spawn(&config, &log);
    let w2 = Worker::new(&bus, "w2");
    assert!(w2.register(8).await.accepted);

    // w1 retries the completion it may have had in flight (as a real worker
    // does); an already-counted one is acknowledged, not counted again.
    let mut finished = finished_before.clone();
    let mut unfinished: BTreeMap<String, Task> = held.clone();
    let last = held
        .values()
        .max_by_key(|t| {
            t.lease_id
                .rsplit('-')
                .next()
                .and_then(|s| s.parse::<u64>().ok())
        })
        .cloned();
    if let Some(t) = last {
        let r = w1.complete(&t).await;
        if r.accepted {
            finished.insert(t.task_id.clone());
            unfinished.remove(&t.task_id);
        }
    }

    // A second worker drains epoch 0; the held leases expire (1 s) and come
    // back. No finished task may be issued again in epoch 0.
    let mut reissued: HashSet<String> = HashSet::new();
    let mut issued_epoch0: HashSet<String> = HashSet::new();
    let status_version = |learner: &Learner| {
        let kv = learner.kv.clone();
        async move {
            kv.get(asyncrl_protos::subjects::POLICY_VERSION_KEY)
                .await
                .unwrap()
                .map(|e| {
                    asyncrl_protos::WeightAnnouncement::decode(e.value.as_ref())
                        .unwrap()
                        .version
                })
                .unwrap_or(0)
        }
    };
    let mut version = status_version(&learner).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let all_seen = (0..N_TASKS)
            .map(|i| format!("arith-{i}-e0"))
            .all(|id| finished.contains(&id) || issued_epoch0.contains(&id));
        if all_seen && unfinished.keys().all(|id| reissued.contains(id)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not every unfinished task came back: unfinished {:?}, reissued {:?}",
            unfinished.keys().collect::<Vec<_>>(),
            reissued
        );
        let reply = w2.acquire(4).await;
        if reply.tasks.is_empty() {
            if reply.reason.contains("staleness bound") {
                version += 1;
                learner.announce(version).await;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        for t in reply.tasks {
            if t.epoch == 0 {
                assert!(
                    !finished.contains(&t.task_id),
                    "finished task {} issued again in epoch 0",
                    t.task_id
                );
                assert!(
                    issued_epoch0.insert(t.task_id.clone()),
                    "task {} issued twice to w2",
                    t.task_id
                );
                if unfinished.contains_key(&t.task_id) {
                    reissued.insert(t.task_id.clone());
                }
            }
            assert!(w2.complete(&t).await.accepted);
        }
    }
    // The held leases of w1 are gone: completing them now is refused.
    for t in held
        .values()
        .filter(|t| unfinished.contains_key(&t.task_id))
    {
        let r = w1.complete(t).await;
        assert!(!r.accepted, "stale completion of {} accepted", t.task_id);
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let log_text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(!log_text.contains("panicked"), "{log_text}");
}
