//! kill -9 of the buffer process while it ingests and while it serves: after
//! each restart on the same data directory, every published trajectory is
//! served exactly once in the end, and a step served before a crash is
//! served again with the same trajectories.

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use asyncrl_buffer::segment::disk_bytes;
use asyncrl_buffer::segment_dir;
use asyncrl_buffer::testing::traj;
use asyncrl_config::Config;
use asyncrl_protos::Trajectory;
use asyncrl_testkit::NatsServer;

use common::*;

const G: u32 = 4;
const GROUPS: u32 = 120;
const B: u32 = 6;

struct Node {
    child: Child,
}

impl Node {
    fn start(config: &Path, log: &Path) -> Self {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_asyncrl-buffer"))
            .arg(config)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start asyncrl-buffer");
        Self { child }
    }

    /// SIGKILL, as a crash.
    fn kill9(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn write_config(dir: &Path, url: &str) -> PathBuf {
    let path = dir.join("buffer.toml");
    let mut c = Config::isolated(dir.join("run"), url);
    c.bus.connect_timeout = Duration::from_secs(10);
    c.telemetry.log_filter = "info".into();
    c.buffer.ingest_batch = 16;
    c.buffer.fetch_wait = Duration::from_millis(50);
    c.buffer.ack_wait = Duration::from_secs(2);
    c.buffer.segment_max_bytes = 262_144;
    c.write(&path).expect("write the buffer's config");
    path
}

/// The learner's side: asks for steps until every group was served, and
/// records what each step got (a repeated step must get the same).
struct Learner {
    served: BTreeMap<u64, Vec<String>>,
    step: u64,
}

impl Learner {
    /// Asks for the next step; `true` once a batch came back.
    async fn next(&mut self, bus: &dyn asyncrl_transport::Bus) -> bool {
        let step = self.step + 1;
        match ask(bus, step, (step - 1) as i32, 1_000, B, 500).await {
            Ok((reply, trajs)) if reply.num_groups == B => {
                assert!(!reply.replayed, "step {step} was never served before");
                groups_of(&trajs);
                self.served
                    .insert(step, trajs.iter().map(|t| t.uuid.clone()).collect());
                self.step = step;
                true
            }
            Ok(_) => false, // not enough ready yet
            Err(_) => {
                // The buffer is down or restarting.
                tokio::time::sleep(Duration::from_millis(50)).await;
                false
            }
        }
    }

    /// Repeats the last step (as a restarted learner would) and checks that
    /// it gets the same trajectories.
    async fn repeat_last(&self, bus: &dyn asyncrl_transport::Bus) {
        let step = self.step;
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            match ask(bus, step, (step - 1) as i32, 1_000, B, 0).await {
                Ok((reply, trajs)) => {
                    assert!(reply.replayed, "step {step} should be a replay");
                    let got: Vec<String> = trajs.iter().map(|t| t.uuid.clone()).collect();
                    assert_eq!(
                        &got, &self.served[&step],
                        "step {step} replayed differently"
                    );
                    return;
                }
                Err(e) => {
                    assert!(Instant::now() < deadline, "no replay of step {step}: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_during_ingest_and_serving_then_restart_serves_everything_exactly_once() {
    let server = NatsServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config_path = write_config(dir.path(), &server.url());
    let log = dir.path().join("buffer.log");
    let seg_dir = segment_dir(&dir.path().join("run/buffer"));
    let bus = nats(&server.url()).await;

    let mut node = Node::start(&config_path, &log);
    // The buffer creates the streams; wait until it serves.
    let deadline = Instant::now() + Duration::from_secs(15);
    while ask(bus.as_ref(), 1, 0, 1_000, 1, 0).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "buffer did not start: {}",
            tail(&log)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // A worker publishes 120 groups of 4 (512 tokens each), paced, in the
    // background, for the whole test.
    let trajs: Vec<Trajectory> = (0..GROUPS * G).map(|i| traj(i, G, 0, 512)).collect();
    let published = Arc::new(AtomicUsize::new(0));
    let publisher = {
        let bus = bus.clone();
        let trajs = trajs.clone();
        let published = published.clone();
        tokio::spawn(async move {
            for chunk in trajs.chunks(16) {
                publish(bus.as_ref(), chunk).await;
                published.fetch_add(chunk.len(), Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(15)).await;
            }
        })
    };

    // Crash 1: mid-ingest, once some segments are on disk and more is coming.
    let deadline = Instant::now() + Duration::from_secs(20);
    while disk_bytes(&seg_dir) < 400_000 {
        assert!(Instant::now() < deadline, "no ingest: {}", tail(&log));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        published.load(Ordering::SeqCst) < trajs.len(),
        "the crash must land while publishing goes on"
    );
    node.kill9();
    node = Node::start(&config_path, &log);

    // The learner trains a few steps; crash 2 right after a served step.
    let mut learner = Learner {
        served: BTreeMap::new(),
        step: 0,
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while learner.step < 3 {
        assert!(Instant::now() < deadline, "no batches: {}", tail(&log));
        learner.next(bus.as_ref()).await;
    }
    node.kill9();
    node = Node::start(&config_path, &log);
    learner.repeat_last(bus.as_ref()).await;

    // Crash 3: mid-ingest again, if the publisher is still going.
    if published.load(Ordering::SeqCst) < trajs.len() {
        node.kill9();
        node = Node::start(&config_path, &log);
    }
    publisher.await.unwrap();

    // Train until every group was served.
    let deadline = Instant::now() + Duration::from_secs(40);
    while learner.served.values().map(Vec::len).sum::<usize>() < trajs.len() {
        assert!(
            Instant::now() < deadline,
            "served {} of {} trajectories in {} steps: {}",
            learner.served.values().map(Vec::len).sum::<usize>(),
            trajs.len(),
            learner.step,
            tail(&log)
        );
        learner.next(bus.as_ref()).await;
    }
    learner.repeat_last(bus.as_ref()).await;

    // Exactly once: every published uuid, no uuid twice, nothing else.
    let mut count: HashMap<&str, usize> = HashMap::new();
    for uuid in learner.served.values().flatten() {
        *count.entry(uuid).or_default() += 1;
    }
    let twice: Vec<_> = count.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "served twice: {twice:?}");
    let served: HashSet<&str> = count.keys().copied().collect();
    let expected: HashSet<&str> = trajs.iter().map(|t| t.uuid.as_str()).collect();
    assert_eq!(served, expected);
    assert_eq!(learner.step, u64::from(GROUPS / B));
    // Nothing is left to serve.
    let (reply, _) = ask(
        bus.as_ref(),
        learner.step + 1,
        learner.step as i32,
        1_000,
        1,
        0,
    )
    .await
    .unwrap();
    assert_eq!((reply.num_groups, reply.ready_groups), (0, 0));
    drop(node);
    // What recovery saw at each restart (printed for the record).
    let log_text = std::fs::read_to_string(&log).unwrap_or_default();
    let restarts: Vec<&str> = log_text
        .lines()
        .filter(|l| l.contains("recovered") || l.contains("torn"))
        .collect();
    eprintln!("{}", restarts.join("\n"));
    assert!(restarts.len() >= 3, "three starts: {}", tail(&log));
}

fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let start = text.len().saturating_sub(3000);
    text[text.floor_char_boundary(start)..].to_owned()
}
