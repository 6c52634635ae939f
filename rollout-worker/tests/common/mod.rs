//! Helpers shared by the worker's integration tests.
#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use asyncrl_config::{BusConfig, Config, DeviceName, ModelConfig};
use asyncrl_policy::from_config::{encode_prompt, tiny_spec};
use asyncrl_policy::{
    DecodeBatchOptions, DeviceOptions, EngineOptions, ModelHandle, Policy, WeightDtype,
    sequence_logprobs,
};
use asyncrl_protos::WeightAnnouncement;
use asyncrl_protos::subjects::{WEIGHTS_BUCKET, weights_object_name};
use asyncrl_rollout_worker::scripted::{
    Received, ScriptOptions, ScriptedCoordinator, ScriptedTask, announce, ensure_trajectory_stream,
    publish_weights,
};
use asyncrl_telemetry::prometheus_client::metrics::counter::Counter;
use asyncrl_telemetry::prometheus_client::metrics::family::Family;
use asyncrl_testkit::NatsServer;
use asyncrl_transport::{Bus, LocalBus, NatsBus, TransportMetrics};
use bytes::Bytes;
use tokio::task::JoinHandle;

pub const TEMPERATURE: f64 = 0.7;

pub mod vllm;

/// A tiny model: fast on two CPU cores.
pub fn model_section(max_new_tokens: usize, max_seq_len: usize) -> ModelConfig {
    let mut m = ModelConfig {
        device: DeviceName::Cpu,
        temperature: TEMPERATURE,
        top_p: 0.9,
        max_new_tokens,
        max_seq_len,
        cpu_threads: 1,
        ..ModelConfig::default()
    };
    m.tiny.hidden_size = 32;
    m.tiny.num_hidden_layers = 2;
    m.tiny.num_attention_heads = 2;
    m.tiny.num_key_value_heads = 1;
    m.tiny.intermediate_size = 64;
    m
}

pub fn config(bus: BusConfig, model: ModelConfig, group_size: u32, slots: usize) -> Config {
    let mut c = Config {
        bus,
        model,
        ..Config::default()
    };
    c.bus.request_timeout = Duration::from_secs(2);
    c.run.seed = 11;
    c.staleness.group_size = group_size;
    c.worker.id = Some("worker-test".into());
    c.worker.max_sequences = slots;
    c.worker.heartbeat_interval = Duration::from_millis(100);
    c.worker.acquire_backoff_min = Duration::from_millis(10);
    c.worker.acquire_backoff_max = Duration::from_millis(100);
    c.worker.weight_retry_backoff_min = Duration::from_millis(50);
    c.worker.weight_retry_backoff_max = Duration::from_millis(200);
    c.worker.weight_fetch_timeout = Duration::from_secs(5);
    c.worker.metrics_interval = Duration::from_millis(100);
    c.validate().expect("valid test config");
    c
}

/// A policy of the config's architecture with its own weights (`init_std`
/// large enough that different weights give clearly different log-probs).
pub fn policy(section: &ModelConfig, seed: u64) -> Policy {
    tch::set_num_threads(1);
    let spec = asyncrl_policy::TinyModelSpec {
        init_std: 0.3,
        ..tiny_spec(section)
    };
    Policy::builtin_tiny(&spec, seed, DeviceOptions::cpu()).expect("policy")
}

pub fn weights(p: &Policy) -> Bytes {
    Bytes::from(p.weights_to_safetensors(WeightDtype::F32).expect("weights"))
}

/// The worker's model thread, built from the config like the worker does
/// (so the initial, unannounced weights are the config seed's).
pub async fn spawn_model(config: &Config) -> ModelHandle {
    let section = config.model.clone();
    let seed = config.run.seed;
    ModelHandle::spawn(
        EngineOptions {
            batch: DecodeBatchOptions {
                max_slots: config.worker.max_sequences,
                max_seq_len: section.max_seq_len,
            },
            ..EngineOptions::default()
        },
        move || asyncrl_policy::from_config::load_policy(&section, seed),
    )
    .await
    .expect("model thread")
}

pub struct Nats {
    pub server: NatsServer,
    pub bus: Arc<dyn Bus>,
    pub config: BusConfig,
}

pub async fn nats() -> Nats {
    let server = NatsServer::start().expect("nats-server");
    let config = BusConfig::nats(server.url());
    let bus: Arc<dyn Bus> = Arc::new(
        NatsBus::connect(&config, TransportMetrics::new())
            .await
            .expect("connect"),
    );
    Nats {
        server,
        bus,
        config,
    }
}

/// What most worker tests start from: a bus, `[model]`, the worker's
/// config, the trajectory stream, and a scripted coordinator. The worker
/// itself is the test's to start (tests start it in different ways), so
/// `config` may still be changed.
pub struct Rig {
    /// The nats-server behind `bus` (`None` on the in-process bus); it
    /// stops when the rig is dropped.
    pub nats: Option<Nats>,
    pub bus: Arc<dyn Bus>,
    pub section: ModelConfig,
    /// [`config`] for `section`, groups of the coordinator's `group_size`
    /// and the given slots.
    pub config: Config,
    pub coordinator: ScriptedCoordinator,
}

impl Rig {
    /// On a real nats-server.
    pub async fn nats(
        section: ModelConfig,
        slots: usize,
        tasks: Vec<ScriptedTask>,
        options: ScriptOptions,
    ) -> Self {
        let nats = nats().await;
        let (bus, bus_config) = (nats.bus.clone(), nats.config.clone());
        Self::start(Some(nats), bus, bus_config, section, slots, tasks, options).await
    }

    /// On the in-process bus (the local mode).
    pub async fn local(
        section: ModelConfig,
        slots: usize,
        tasks: Vec<ScriptedTask>,
        options: ScriptOptions,
    ) -> Self {
        let bus: Arc<dyn Bus> = Arc::new(LocalBus::new());
        Self::start(
            None,
            bus,
            BusConfig::default(),
            section,
            slots,
            tasks,
            options,
        )
        .await
    }

    async fn start(
        nats: Option<Nats>,
        bus: Arc<dyn Bus>,
        bus_config: BusConfig,
        section: ModelConfig,
        slots: usize,
        tasks: Vec<ScriptedTask>,
        options: ScriptOptions,
    ) -> Self {
        let config = config(bus_config, section.clone(), options.group_size, slots);
        let coordinator = coordinator(&bus, tasks, options).await;
        Self {
            nats,
            bus,
            section,
            config,
            coordinator,
        }
    }

    /// A policy of the rig's architecture ([`policy`]).
    pub fn policy(&self, seed: u64) -> Policy {
        policy(&self.section, seed)
    }

    /// Publishes `p`'s weights as `version`, as the learner does.
    pub async fn publish(&self, version: i32, p: &Policy) {
        publish_weights(self.bus.as_ref(), version, weights(p))
            .await
            .expect("publish weights");
    }
}

/// A worker on its own task whose model thread the test holds, slowed down
/// by a [`Throttle`] so that the test can freeze it and act while
/// sequences are in flight.
pub struct ThrottledWorker {
    pub model: ModelHandle,
    pub throttle: Throttle,
    pub handles: asyncrl_rollout_worker::WorkerMetrics,
    pub task: JoinHandle<
        Result<asyncrl_rollout_worker::WorkerSummary, asyncrl_rollout_worker::WorkerError>,
    >,
}

impl Rig {
    /// Starts a worker on the rig's config and bus with a model thread of
    /// its own ([`spawn_model`]) that sleeps `per_step` before each step;
    /// `shutdown` stops the worker.
    pub async fn start_throttled(
        &self,
        per_step: Duration,
        shutdown: &asyncrl_rollout_worker::CancellationToken,
    ) -> ThrottledWorker {
        let model = spawn_model(&self.config).await;
        let throttle = Throttle::start(model.clone(), per_step);
        let metrics = asyncrl_telemetry::Metrics::new();
        let handles = asyncrl_rollout_worker::WorkerMetrics::new(&metrics).expect("metrics");
        let task = tokio::spawn(
            asyncrl_rollout_worker::Worker::new(self.config.clone(), self.bus.clone(), metrics)
                .with_model(model.clone())
                .run(shutdown.clone()),
        );
        ThrottledWorker {
            model,
            throttle,
            handles,
            task,
        }
    }
}

/// Creates the trajectory stream and starts a scripted coordinator handing
/// out `tasks`.
pub async fn coordinator(
    bus: &Arc<dyn Bus>,
    tasks: Vec<ScriptedTask>,
    options: ScriptOptions,
) -> ScriptedCoordinator {
    ensure_trajectory_stream(bus.as_ref())
        .await
        .expect("trajectory stream");
    ScriptedCoordinator::start(bus.clone(), tasks, options)
        .await
        .expect("scripted coordinator")
}

/// Stores `bytes` as the weights object of `version` and announces it with
/// `sha256` (tests of the worker's checks pass one that is not theirs).
pub async fn store_and_announce(
    bus: &Arc<dyn Bus>,
    version: i32,
    bytes: Bytes,
    sha256: String,
) -> WeightAnnouncement {
    let store = bus
        .object_store(WEIGHTS_BUCKET)
        .await
        .expect("weights bucket");
    let info = store
        .put(&weights_object_name(version), bytes)
        .await
        .expect("store the weights object");
    let ann = WeightAnnouncement {
        version,
        object_name: weights_object_name(version),
        sha256,
        byte_size: info.size,
        format: "safetensors".into(),
        published_at_unix_ms: 1,
        step: version as u64,
        ..Default::default()
    };
    announce(bus.as_ref(), &ann).await.expect("announce");
    ann
}

/// The count of one `reason` of a failure counter family.
pub fn failures(family: &Family<Vec<(String, String)>, Counter>, reason: &str) -> u64 {
    family
        .get_or_create(&vec![("reason".to_owned(), reason.to_owned())])
        .get()
}

/// Log-probs of `completion` after `prompt` under `p`, recomputed in one
/// forward pass.
pub fn recompute(p: &Policy, prompt: &[i32], completion: &[i32]) -> Vec<f32> {
    let seq: Vec<i64> = prompt
        .iter()
        .chain(completion)
        .map(|&t| i64::from(t))
        .collect();
    let lp = sequence_logprobs(p, &[seq], TEMPERATURE).expect("logprobs");
    lp[0][prompt.len() - 1..].to_vec()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

pub fn prompt_ids(p: &Policy, text: &str) -> Vec<i32> {
    encode_prompt(p, text)
        .expect("encode")
        .into_iter()
        .map(|t| t as i32)
        .collect()
}

/// Slows the model thread down (a sleep between decoding steps) and can
/// freeze it between two steps, so that tests can act while sequences are
/// in flight.
pub struct Throttle {
    paused: Arc<AtomicBool>,
    frozen: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    task: JoinHandle<()>,
}

impl Throttle {
    pub fn start(model: ModelHandle, per_step: Duration) -> Self {
        let paused = Arc::new(AtomicBool::new(false));
        let frozen = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let (p, f, s) = (paused.clone(), frozen.clone(), stop.clone());
        let task = tokio::spawn(async move {
            while !s.load(Ordering::SeqCst) {
                let (p, f) = (p.clone(), f.clone());
                let r = model
                    .with_policy(move |_| {
                        std::thread::sleep(per_step);
                        while p.load(Ordering::SeqCst) {
                            f.store(true, Ordering::SeqCst);
                            std::thread::sleep(Duration::from_millis(1));
                        }
                        f.store(false, Ordering::SeqCst);
                    })
                    .await;
                if r.is_err() {
                    return;
                }
            }
        });
        Self {
            paused,
            frozen,
            stop,
            task,
        }
    }

    /// Freezes the model thread before its next step; returns once frozen.
    pub async fn freeze(&self) {
        self.paused.store(true, Ordering::SeqCst);
        while !self.frozen.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    pub fn thaw(&self) {
        self.paused.store(false, Ordering::SeqCst);
    }

    pub async fn stop(self) {
        self.thaw();
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.task.await;
    }
}

/// Every received trajectory, by group.
pub fn by_group(received: &[Received]) -> std::collections::BTreeMap<String, Vec<Received>> {
    let mut m = std::collections::BTreeMap::<String, Vec<Received>>::new();
    for r in received {
        m.entry(r.trajectory.group_id.clone())
            .or_default()
            .push(r.clone());
    }
    m
}

/// Polls `f` until it returns true or `timeout` passes.
pub use asyncrl_testkit::wait_until as eventually;

/// The Python example reward service (examples/reward_service/server.py),
/// killed on drop.
pub struct RewardServer {
    child: std::process::Child,
    pub port: u16,
}

impl Drop for RewardServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl RewardServer {
    pub fn start() -> Self {
        use std::io::BufRead;
        let root = asyncrl_testkit::workspace_root();
        let python = root.join(".venv/bin/python");
        assert!(
            python.exists(),
            "{} missing: run scripts/setup",
            python.display()
        );
        let port = asyncrl_testkit::free_port().unwrap();
        let mut child = std::process::Command::new(&python)
            .arg(root.join("examples/reward_service/server.py"))
            .args(["--port", &port.to_string()])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .expect("start the reward service");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(
            line.contains("listening"),
            "reward service did not start: {line:?}"
        );
        Self { child, port }
    }
}

/// A worker running on its own task (built from `[model]`, as the binary
/// runs it), with its metric handles and the token that stops it.
pub struct RunningWorker {
    pub handles: asyncrl_rollout_worker::WorkerMetrics,
    pub shutdown: asyncrl_rollout_worker::CancellationToken,
    pub task: JoinHandle<
        Result<asyncrl_rollout_worker::WorkerSummary, asyncrl_rollout_worker::WorkerError>,
    >,
}

/// Starts a worker on `config` and waits until it has loaded the weights
/// of `version`.
pub async fn start_worker_at(config: Config, bus: &Arc<dyn Bus>, version: i64) -> RunningWorker {
    let metrics = asyncrl_telemetry::Metrics::new();
    let handles = asyncrl_rollout_worker::WorkerMetrics::new(&metrics).unwrap();
    let shutdown = asyncrl_rollout_worker::CancellationToken::new();
    let task = tokio::spawn(asyncrl_rollout_worker::run(
        config,
        bus.clone(),
        metrics,
        shutdown.clone(),
    ));
    assert!(
        eventually(Duration::from_secs(30), || handles.policy_version.get()
            == version)
        .await,
        "version {version} not loaded"
    );
    RunningWorker {
        handles,
        shutdown,
        task,
    }
}
