//! A cluster of `asyncrl` role processes over a real nats-server, for the
//! cross-process tests: configs in a temp dir, one child process per role
//! (stdout/stderr to a log file per role), kill -9 / SIGTERM / SIGSTOP /
//! restart of single roles, and [`Cluster::finish`], which lets a run end,
//! stops every role and checks the invariants every test shares
//! ([`Cluster::check_invariants`]).
//!
//! The role logs, the nats-server log and the learner's `trained.jsonl` are
//! printed when a test fails (the cluster is dropped while panicking).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use asyncrl_learner::outputs::{TRAINED_JSONL, TrainedStep, read_trained};
use asyncrl_protos::v1::coordinator_admin_client::CoordinatorAdminClient;
use asyncrl_protos::v1::{ListWorkersRequest, StatusReply, StatusRequest, WorkerInfo};
use asyncrl_protos::{Message as _, Trajectory, WeightAnnouncement};
use asyncrl_testkit::{ClusterSecurity, NatsCluster, NatsServer, ServerConfig};

use asyncrl_config::{
    Config, RoleAuth, TinyModelConfig, TlsConfig, TrainerEngineName, TrajectoryRetention,
    WeightTransportName,
};

use crate::configs;
use crate::invariants::check_trained_file;
use crate::process::RoleProcess;
use futures::StreamExt as _;

/// The `asyncrl` binary under test (see [`crate::process::asyncrl_bin`]).
pub fn asyncrl_bin() -> PathBuf {
    crate::process::asyncrl_bin().expect("the asyncrl binary (cargo build -p asyncrl)")
}

/// One cluster at a time per test binary: the machines these run on have two
/// cores, and the tests time leases and heartbeats.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// What a test run looks like.
#[derive(Debug, Clone)]
pub struct Spec {
    pub max_steps: u64,
    pub eta: u32,
    pub groups_per_step: u32,
    pub group_size: u32,
    pub workers: usize,
    /// Items in the task file (more than a run admits: no epoch wraps).
    pub tasks: usize,
    pub lease_timeout: Duration,
    pub heartbeat_interval: Duration,
    pub dead_after: Duration,
    pub drain_grace_period: Duration,
    pub checkpoint_every: u64,
    pub max_new_tokens: usize,
    pub max_seq_len: usize,
    pub max_sequences: usize,
    /// `[model.tiny]`.
    pub tiny: TinyModelConfig,
    /// `bus.reconnect_max_delay` of every role.
    pub reconnect_max_delay: Duration,
    /// `eval.every_steps` (0: no held-out evaluation); the learner then
    /// evaluates the first 16 problems of the task file.
    pub eval_every: u64,
    /// `bus.storage.trajectories`: `Keep` (the default here) keeps every
    /// published trajectory in the stream, and the invariant check audits
    /// the buffer against it; `Release` (the product's default) lets the
    /// stream drop each once the buffer has stored it, and the check audits
    /// the buffer's own segments.
    pub stream: TrajectoryRetention,
    /// `learner.trainer`. With `Torch`, the tiny model is written as a
    /// Hugging Face folder that every role loads (`model.path`): the torch
    /// engine trains a model folder.
    pub trainer: TrainerEngineName,
    /// `learner.weight_transport`; `SharedPath` puts the version folders in
    /// the cluster's `weights/` folder (`Cluster::shared_weights_dir`).
    pub weight_transport: WeightTransportName,
    /// `learner.torch.nodes` (a torch engine of one rank per node): the
    /// learner runs node 0 and serves the rendezvous on a free loopback
    /// port; each other node is a role `trainer-node-K`, started as an
    /// Indexed Job's pod would be (`JOB_COMPLETION_INDEX` = K − 1).
    pub trainer_nodes: usize,
}

impl Default for Spec {
    fn default() -> Self {
        Self {
            max_steps: 16,
            eta: 2,
            groups_per_step: 4,
            group_size: 4,
            workers: 2,
            tasks: 400,
            lease_timeout: Duration::from_secs(6),
            heartbeat_interval: Duration::from_millis(250),
            dead_after: Duration::from_secs(3),
            drain_grace_period: Duration::from_secs(5),
            checkpoint_every: 1,
            max_new_tokens: 24,
            max_seq_len: 32,
            max_sequences: 16,
            tiny: configs::tiny_model(),
            reconnect_max_delay: Duration::from_millis(500),
            eval_every: 0,
            stream: TrajectoryRetention::Keep,
            trainer: TrainerEngineName::Builtin,
            weight_transport: WeightTransportName::ObjectStore,
            trainer_nodes: 1,
        }
    }
}

/// The cluster's NATS server and how the roles and the test reach it
/// (`Cluster::start_with`): per-role credentials, TLS.
#[derive(Debug, Clone, Default)]
pub struct NatsSetup {
    /// The server's config file (None: a plain server without auth).
    pub server: Option<ServerConfig>,
    /// A JetStream cluster of this many servers (`NatsCluster`) instead of
    /// one server (0 or 1); the roles get the seed list of all of them and
    /// `bus.replicas` = this. Each node gets `server` as its client side.
    pub cluster_nodes: usize,
    /// Roles connect to `tls://127.0.0.1:PORT` instead of `nats://`.
    pub tls: bool,
    /// Every role's `bus.tls`.
    pub bus_tls: Option<TlsConfig>,
    /// Every role's `bus.roles` (per-role credentials).
    pub bus_roles: BTreeMap<String, RoleAuth>,
    /// The user and password of the test's own connections (the stream
    /// audit, the `policy.version` watch).
    pub observer: Option<(String, String)>,
    /// The CA the test's own connections verify the server with.
    pub observer_ca: Option<PathBuf>,
    /// Their client certificate and key (a server that verifies clients).
    pub observer_cert: Option<(PathBuf, PathBuf)>,
    /// A cluster's route credentials (see [`ClusterSecurity`]).
    pub route_auth: Option<(String, String)>,
    /// The body of a cluster's route `tls {}` block.
    pub route_tls: Option<String>,
}

impl NatsSetup {
    /// Starts the servers: a JetStream cluster of `cluster_nodes` (routes
    /// secured as `route_auth` and `route_tls` say), or one server.
    pub fn start(&self) -> Result<NatsCluster, asyncrl_testkit::TestkitError> {
        if self.cluster_nodes > 1 {
            NatsCluster::start_with(
                self.cluster_nodes,
                &ClusterSecurity {
                    client: self.server.clone().unwrap_or_default(),
                    route_auth: self.route_auth.clone(),
                    route_tls: self.route_tls.clone(),
                },
            )
        } else {
            match &self.server {
                Some(config) => NatsServer::start_with_config(config),
                None => NatsServer::start(),
            }
            .map(NatsCluster::of_one)
        }
    }

    /// The `bus.url` of `nats` for these settings: a seed list of every
    /// node, `tls://` when TLS is on.
    pub fn bus_url(&self, nats: &NatsCluster) -> String {
        if self.tls {
            nats.nodes()
                .iter()
                .map(|n| format!("tls://127.0.0.1:{}", n.port()))
                .collect::<Vec<_>>()
                .join(",")
        } else {
            nats.urls()
        }
    }

    /// A connection of the test itself (not a role's).
    pub async fn observe(&self, url: &str) -> anyhow::Result<async_nats::Client> {
        let mut opts = match &self.observer {
            Some((user, password)) => {
                async_nats::ConnectOptions::with_user_and_password(user.clone(), password.clone())
            }
            None => async_nats::ConnectOptions::new(),
        };
        if let Some(ca) = &self.observer_ca {
            opts = opts.require_tls(true).add_root_certificates(ca.clone());
        }
        if let Some((cert, key)) = &self.observer_cert {
            opts = opts.add_client_certificate(cert.clone(), key.clone());
        }
        // A seed list (a cluster's `bus.url`): every server of it.
        let servers = url
            .split(',')
            .map(|s| s.trim().parse::<async_nats::ServerAddr>())
            .collect::<Result<Vec<_>, _>>()
            .with_context(|| format!("the server list {url}"))?;
        opts.connect(servers)
            .await
            .with_context(|| format!("cannot connect to {url}"))
    }
}

/// What [`Cluster::finish`] allows beyond a fault-free run.
#[derive(Debug, Clone, Default)]
pub struct Expect {
    /// Learner processes that were killed and started again.
    pub learner_restarts: u64,
}

/// The numbers [`Cluster::check_invariants`] found, printed by every test.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub steps: u64,
    pub trained_trajectories: usize,
    pub stream_trajectories: usize,
    pub stream_groups: usize,
    pub tasks_started: usize,
    pub tasks_trained: usize,
    /// Complete, never trained: waiting in the buffer when the run ended.
    pub tasks_waiting: usize,
    /// Tasks whose complete groups the buffer holds at the end (every
    /// waiting task is one of them: the loss invariant).
    pub tasks_held: usize,
    /// Attempts that never completed (a killed or draining worker's).
    pub partial_attempts: usize,
    /// Complete attempts of a task another attempt of which was kept.
    pub superseded_attempts: usize,
    /// Steps `trained.jsonl` holds twice (retrained after a learner crash).
    pub retrained_steps: usize,
    pub announcements: usize,
    pub max_lag: i32,
    /// Extra stored copies of never-trained trajectories (redeliveries).
    pub stored_copies: usize,
    pub coordinator: StatusReply,
}

pub struct Cluster {
    pub spec: Spec,
    pub dir: tempfile::TempDir,
    /// The NATS server (node 0 of a one-node "cluster"), or the servers of
    /// a JetStream cluster (`NatsSetup::cluster_nodes`).
    pub nats: NatsCluster,
    pub setup: NatsSetup,
    pub out: PathBuf,
    pub tasks_file: PathBuf,
    /// The model folder every role loads (a torch-engine run).
    pub model_dir: Option<PathBuf>,
    /// Where the torch engine's node 0 serves the rendezvous.
    rendezvous_port: u16,
    roles: Vec<RoleProcess>,
    rt: tokio::runtime::Runtime,
    /// Every `policy.version` announcement seen, in order.
    announcements: Arc<Mutex<Vec<WeightAnnouncement>>>,
    watcher: Option<tokio::task::JoinHandle<()>>,
    started: Instant,
    _serial: MutexGuard<'static, ()>,
}

impl Cluster {
    /// Starts nats-server, writes the task file and one config per role, and
    /// starts the coordinator, the buffer, the learner and the workers.
    pub fn start(spec: Spec) -> Self {
        Self::start_with(spec, NatsSetup::default())
    }

    /// [`Cluster::start`] with a NATS server and bus settings of the test's.
    pub fn start_with(spec: Spec, setup: NatsSetup) -> Self {
        let serial = ONE_AT_A_TIME
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let dir = tempfile::Builder::new()
            .prefix("asyncrl-e2e-")
            .tempdir()
            .expect("create a temp dir");
        let nats = setup
            .start()
            .expect("start nats-server (run scripts/setup)");
        let out = dir.path().join("out");
        let tasks_file = configs::write_arith(dir.path().join("tasks.jsonl"), spec.tasks, 20, 7);
        let model_dir = (spec.trainer == TrainerEngineName::Torch).then(|| {
            let dir = dir.path().join("model");
            let mut section = configs::cluster_role(&out, "local", &tasks_file).model;
            section.tiny = spec.tiny.clone();
            asyncrl_policy::from_config::load_policy(&section, 3)
                .and_then(|p| p.save_pretrained(&dir, None))
                .expect("write the tiny model as a Hugging Face folder");
            dir
        });
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("start a tokio runtime");
        let mut cluster = Self {
            spec,
            dir,
            nats,
            setup,
            out,
            tasks_file,
            model_dir,
            rendezvous_port: asyncrl_testkit::free_port().expect("a free port for the rendezvous"),
            roles: Vec::new(),
            rt,
            announcements: Arc::default(),
            watcher: None,
            started: Instant::now(),
            _serial: serial,
        };
        cluster.add_role("coordinator", "coordinator", None);
        cluster.add_role("buffer", "buffer", None);
        cluster.add_role("learner", "learner", None);
        for k in 1..cluster.spec.trainer_nodes {
            let name = format!("trainer-node-{k}");
            cluster.add_role(&name, "trainer-node", None);
            cluster.role(&name).env = vec![("JOB_COMPLETION_INDEX".into(), (k - 1).to_string())];
        }
        for i in 1..=cluster.spec.workers {
            let name = format!("worker-{i}");
            cluster.add_role(&name, "worker", Some(&name));
        }
        cluster.watch_versions();
        let names: Vec<String> = cluster.roles.iter().map(|r| r.name.clone()).collect();
        for name in names {
            cluster.start_role(&name);
        }
        cluster
    }

    /// The config of a role (only `worker.id` differs). Every server
    /// listens on port 0; the ports are read back from the role's log.
    fn config(&self, worker_id: Option<&str>) -> Config {
        let s = &self.spec;
        let mut c = configs::cluster_role(&self.out, &self.bus_url(), &self.tasks_file);
        c.run.name = "e2e".into();
        c.run.max_steps = s.max_steps;
        c.staleness.eta = s.eta;
        c.staleness.groups_per_step = s.groups_per_step;
        c.staleness.group_size = s.group_size;
        c.bus.reconnect_max_delay = s.reconnect_max_delay;
        // Every stream, bucket and object store on every server.
        c.bus.replicas = self.nats.len();
        c.bus.storage.trajectories = s.stream;
        c.bus.storage.report_every = Duration::from_millis(500);
        c.bus.tls = self.setup.bus_tls.clone();
        c.bus.roles = self.setup.bus_roles.clone();
        c.model.max_new_tokens = s.max_new_tokens;
        c.model.max_seq_len = s.max_seq_len;
        c.model.tiny = s.tiny.clone();
        c.coordinator.lease_timeout = s.lease_timeout;
        c.coordinator.heartbeat_interval = s.heartbeat_interval;
        c.coordinator.dead_after = s.dead_after;
        c.learner.checkpoint_every = s.checkpoint_every;
        c.learner.trainer = s.trainer;
        if s.trainer_nodes > 1 {
            c.learner.torch.world_size = s.trainer_nodes;
            c.learner.torch.nodes = s.trainer_nodes;
            c.learner.torch.rendezvous = Some(format!("127.0.0.1:{}", self.rendezvous_port));
        }
        c.learner.weight_transport = s.weight_transport;
        c.learner.shared_weights_dir = (s.weight_transport == WeightTransportName::SharedPath)
            .then(|| self.shared_weights_dir());
        c.model.path = self.model_dir.clone();
        c.worker.id = worker_id.map(str::to_owned);
        c.worker.max_sequences = s.max_sequences;
        c.worker.heartbeat_interval = s.heartbeat_interval;
        c.worker.drain_grace_period = s.drain_grace_period;
        if s.eval_every > 0 {
            c.eval.every_steps = s.eval_every;
            c.eval.problems = 16;
            c.eval.dataset = Some(configs::arith(&self.tasks_file));
        }
        c
    }

    /// The `bus.url` of the roles (and of the test's own connections).
    pub fn bus_url(&self) -> String {
        self.setup.bus_url(&self.nats)
    }

    fn add_role(&mut self, name: &str, role: &str, worker_id: Option<&str>) {
        let config = self.dir.path().join(format!("{name}.toml"));
        configs::write(&self.config(worker_id), &config);
        let log = self.dir.path().join(format!("{name}.log"));
        self.roles.push(RoleProcess::new(name, role, config, log));
    }

    fn role(&mut self, name: &str) -> &mut RoleProcess {
        self.roles
            .iter_mut()
            .find(|r| r.name == name)
            .unwrap_or_else(|| panic!("no role {name}"))
    }

    /// The config file a role runs with.
    pub fn config_of(&mut self, name: &str) -> PathBuf {
        self.role(name).config.clone()
    }

    /// Starts (or restarts) a role; its output is appended to its log.
    pub fn start_role(&mut self, name: &str) {
        let elapsed = self.started.elapsed().as_secs_f64();
        let bin = asyncrl_bin();
        self.role(name)
            .start(&bin, elapsed)
            .unwrap_or_else(|e| panic!("start {name}: {e:#}"));
    }

    fn signal(&mut self, name: &str, sig: i32) {
        let role = self.role(name);
        assert!(role.is_running(), "{name} is not running");
        assert!(role.signal(sig), "kill -{sig} {name} failed");
    }

    /// The root of the version folders under the `shared_path` transport.
    pub fn shared_weights_dir(&self) -> PathBuf {
        self.dir.path().join("weights")
    }

    /// The processes of the learner's torch engine that run the model (the
    /// ranks, not torchrun): descendants of the learner process.
    pub fn trainer_ranks(&mut self) -> Vec<u32> {
        self.trainer_ranks_of("learner")
    }

    /// The torch engine ranks a role (`learner`, `trainer-node-K`) runs.
    pub fn trainer_ranks_of(&mut self, name: &str) -> Vec<u32> {
        let Some(pid) = self.role(name).pid() else {
            return Vec::new();
        };
        crate::process::descendants(pid)
            .into_iter()
            .filter(|(_, cmd)| {
                cmd.contains("asyncrl_trainer.server") && !cmd.contains("torch.distributed.run")
            })
            .map(|(pid, _)| pid)
            .collect()
    }

    /// kill -9, and reap the process.
    pub fn kill9(&mut self, name: &str) {
        let elapsed = self.started.elapsed().as_secs_f64();
        let role = self.role(name);
        role.kill9()
            .unwrap_or_else(|| panic!("{name} is not running"));
        role.note(&format!("killed with SIGKILL at t={elapsed:.1}s"));
    }

    pub fn sigterm(&mut self, name: &str) {
        let elapsed = self.started.elapsed().as_secs_f64();
        self.signal(name, libc::SIGTERM);
        self.role(name)
            .note(&format!("sent SIGTERM at t={elapsed:.1}s"));
    }

    /// Freezes a role (SIGSTOP): it keeps its connections and leases but
    /// does nothing.
    pub fn freeze(&mut self, name: &str) {
        self.signal(name, libc::SIGSTOP);
    }

    pub fn thaw(&mut self, name: &str) {
        self.signal(name, libc::SIGCONT);
    }

    /// Waits for a role to exit and returns its status.
    pub fn wait_exit(&mut self, name: &str, timeout: Duration) -> ExitStatus {
        let start = Instant::now();
        loop {
            let role = self.role(name);
            if let Some(status) = role.exited {
                return status;
            }
            assert!(role.is_running(), "{name} was never started");
            if let Some(status) = role.poll() {
                return status;
            }
            if start.elapsed() > timeout {
                panic!("{name} did not exit within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Panics if a role exited that was not meant to (every role but a
    /// learner that finished with exit code 0).
    pub fn check_alive(&mut self) {
        for role in &mut self.roles {
            if let Some(status) = role.poll()
                && !(role.name == "learner" && status.success())
            {
                panic!("{} exited unexpectedly with {status}", role.name);
            }
        }
    }

    /// Polls `cond` every 50 ms until it holds, failing at once if a role
    /// dies, or after `timeout`.
    pub fn wait(&mut self, what: &str, timeout: Duration, mut cond: impl FnMut(&mut Self) -> bool) {
        let start = Instant::now();
        loop {
            self.check_alive();
            if cond(self) {
                return;
            }
            if start.elapsed() > timeout {
                panic!("timed out after {timeout:?} waiting for {what}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The names of the worker roles.
    pub fn workers(&self) -> Vec<String> {
        self.roles
            .iter()
            .filter(|r| r.name.starts_with("worker-"))
            .map(|r| r.name.clone())
            .collect()
    }

    /// The port a role's current incarnation logged for a server (the line
    /// holding `needle` and `addr=127.0.0.1:PORT`).
    fn logged_port(&self, name: &str, needle: &str) -> Option<u16> {
        let role = self.roles.iter().find(|r| r.name == name)?;
        role.current_log()
            .lines()
            .filter(|l| l.contains(needle))
            .filter_map(|l| {
                let rest = &l[l.find("addr=127.0.0.1:")? + "addr=127.0.0.1:".len()..];
                let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
                digits.parse().ok()
            })
            .next_back()
    }

    /// A role's `/metrics`, parsed (None while it does not answer).
    pub fn metrics(&mut self, name: &str) -> Option<Metrics> {
        let port = self.logged_port(name, "serving /metrics")?;
        http_get(port, "/metrics").ok().map(|t| Metrics::parse(&t))
    }

    /// `http://127.0.0.1:PORT` of the coordinator's admin API.
    fn admin_url(&self) -> Option<String> {
        self.logged_port("coordinator", "admin API listening")
            .map(|p| format!("http://127.0.0.1:{p}"))
    }

    /// Polls a role's metric until `cond` holds; returns its value.
    pub fn wait_metric(
        &mut self,
        name: &str,
        metric: &str,
        timeout: Duration,
        cond: impl Fn(f64) -> bool,
    ) -> f64 {
        let mut value = None;
        self.wait(&format!("{metric} of {name}"), timeout, |c| {
            value = c.metrics(name).map(|m| m.sum(metric));
            value.is_some_and(&cond)
        });
        value.unwrap_or_default()
    }

    /// The coordinator's status over its admin API.
    pub fn status(&self) -> Option<StatusReply> {
        let url = self.admin_url()?;
        self.rt.block_on(async move {
            let fut = async {
                let mut client = CoordinatorAdminClient::connect(url).await.ok()?;
                client
                    .status(StatusRequest {})
                    .await
                    .ok()
                    .map(|r| r.into_inner())
            };
            tokio::time::timeout(Duration::from_secs(5), fut)
                .await
                .ok()
                .flatten()
        })
    }

    /// The coordinator's worker registry over its admin API.
    pub fn registry(&self) -> Option<Vec<WorkerInfo>> {
        let url = self.admin_url()?;
        self.rt.block_on(async move {
            let fut = async {
                let mut client = CoordinatorAdminClient::connect(url).await.ok()?;
                client
                    .list_workers(ListWorkersRequest {})
                    .await
                    .ok()
                    .map(|r| r.into_inner().workers)
            };
            tokio::time::timeout(Duration::from_secs(5), fut)
                .await
                .ok()
                .flatten()
        })
    }

    /// The learner's `trained.jsonl`, every whole line in order (the
    /// learner may be writing the last one right now).
    pub fn trained_lines(&self) -> Vec<TrainedStep> {
        let path = self.out.join(TRAINED_JSONL);
        if !path.exists() {
            return Vec::new();
        }
        read_trained(&path).unwrap_or_else(|e| panic!("{}: {e:#}", path.display()))
    }

    /// The highest step in `trained.jsonl` (0 before the first).
    pub fn steps_done(&self) -> u64 {
        self.trained_lines()
            .iter()
            .map(|s| s.step)
            .max()
            .unwrap_or(0)
    }

    pub fn wait_step(&mut self, step: u64, timeout: Duration) {
        self.wait(&format!("learner step {step}"), timeout, |c| {
            c.steps_done() >= step
        });
    }

    /// Freezes the workers one after the other until one is frozen while the
    /// coordinator shows it holding leases; returns its name and lease count
    /// (it stays frozen).
    pub fn freeze_a_worker_holding_leases(&mut self, timeout: Duration) -> (String, u32) {
        let start = Instant::now();
        let workers = self.workers();
        for attempt in 0.. {
            let name = workers[attempt % workers.len()].clone();
            self.freeze(&name);
            // The registry may still be settling a grant; look twice.
            for _ in 0..2 {
                let leases = self
                    .registry()
                    .unwrap_or_default()
                    .into_iter()
                    .find(|w| w.worker_id == name)
                    .map(|w| w.leases)
                    .unwrap_or(0);
                if leases > 0 {
                    return (name, leases);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            self.thaw(&name);
            if start.elapsed() > timeout {
                panic!("no worker held a lease while frozen within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(30 + (attempt as u64 % 7) * 10));
        }
        unreachable!()
    }

    /// Watches `policy.version` from the start to the end of the test (a
    /// watch reopened whenever it ends: server restarts).
    fn watch_versions(&mut self) {
        let url = self.bus_url();
        let setup = self.setup.clone();
        let seen = self.announcements.clone();
        self.watcher = Some(self.rt.spawn(async move {
            loop {
                if let Err(e) = watch_once(&setup, &url, &seen).await
                    && !format!("{e:#}").contains("not found")
                {
                    tracing_note(&format!("policy.version watch: {e:#}; reopening"));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }));
    }

    pub fn announcements(&self) -> Vec<WeightAnnouncement> {
        self.announcements
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Every message of the `TRAJECTORIES` stream, decoded, in stream order.
    pub fn stream(&self) -> Vec<Trajectory> {
        let url = self.bus_url();
        self.rt.block_on(async move {
            let client = self
                .setup
                .observe(&url)
                .await
                .unwrap_or_else(|e| panic!("{e:#}"));
            let js = async_nats::jetstream::new(client);
            let mut stream = js
                .get_stream(asyncrl_protos::subjects::TRAJECTORY_STREAM)
                .await
                .expect("the TRAJECTORIES stream exists");
            let state = stream.info().await.expect("stream info").state.clone();
            let mut out = Vec::with_capacity(state.messages as usize);
            for seq in state.first_sequence..=state.last_sequence {
                match stream.get_raw_message(seq).await {
                    Ok(m) => out.push(
                        asyncrl_protos::decode_trajectory(&m.payload)
                            .unwrap_or_else(|e| panic!("stream message {seq}: {e}")),
                    ),
                    Err(e) => panic!("stream message {seq} of {state:?}: {e}"),
                }
            }
            out
        })
    }

    /// Messages in `TRAJECTORIES` and the buffer's consumer: (messages,
    /// pending, ack pending).
    pub fn stream_state(&self) -> Option<(u64, u64, usize)> {
        let url = self.bus_url();
        self.rt.block_on(async move {
            let client = self.setup.observe(&url).await.ok()?;
            let js = async_nats::jetstream::new(client);
            let mut stream = js
                .get_stream(asyncrl_protos::subjects::TRAJECTORY_STREAM)
                .await
                .ok()?;
            let messages = stream.info().await.ok()?.state.messages;
            let mut consumer: async_nats::jetstream::consumer::PullConsumer = stream
                .get_consumer(&asyncrl_config::BufferConfig::default().consumer_name)
                .await
                .ok()?;
            let info = consumer.info().await.ok()?;
            Some((messages, info.num_pending, info.num_ack_pending))
        })
    }

    /// Drop reports the coordinator has not applied yet (messages left in
    /// the GROUP_DROPS work queue); None when it cannot be read.
    pub fn drop_reports_left(&self) -> Option<u64> {
        let url = self.bus_url();
        self.rt.block_on(async move {
            let client = self.setup.observe(&url).await.ok()?;
            let js = async_nats::jetstream::new(client);
            let mut stream = js
                .get_stream(asyncrl_protos::subjects::GROUP_DROP_STREAM)
                .await
                .ok()?;
            Some(stream.info().await.ok()?.state.messages)
        })
    }

    /// The trajectories in the buffer's segments, in the order stored.
    pub fn stored(&self) -> Vec<Trajectory> {
        let dir = asyncrl_buffer::segment_dir(&self.out.join("buffer"));
        let schema = asyncrl_protos::arrow_schema::trajectory_schema();
        let mut out = Vec::new();
        for id in asyncrl_buffer::segment::list_segments(&dir).expect("list the buffer segments") {
            let scan = asyncrl_buffer::segment::read_segment(&dir, id, &schema)
                .unwrap_or_else(|e| panic!("read buffer segment {id}: {e}"));
            for batch in &scan.batches {
                out.extend(
                    asyncrl_protos::arrow_schema::from_record_batch(batch)
                        .unwrap_or_else(|e| panic!("segment {id}: {e}")),
                );
            }
        }
        out
    }

    /// Lets the run end: the learner exits 0 after `run.max_steps`; the
    /// coordinator goes quiet (nothing running or queued, the capacity of
    /// the final version used up); the buffer has consumed the whole stream.
    /// Then SIGTERM stops every other role (each exits 0) and the
    /// invariants are checked.
    pub fn finish(&mut self, expect: &Expect) -> Report {
        self.wait(
            "the learner to finish run.max_steps",
            Duration::from_secs(120),
            |c| c.role("learner").exited.is_some(),
        );
        let max_steps = i64::try_from(self.spec.max_steps).expect("max_steps");
        let mut last = None;
        let mut polls = 0u32;
        self.wait(
            "the run to settle (nothing running or queued, capacity used up, stream consumed, every drop report applied)",
            Duration::from_secs(60),
            |c| {
                let status = c.status();
                let settled = status.as_ref().is_some_and(|s| {
                    i64::from(s.policy_version) == max_steps
                        && s.running_groups == 0
                        && s.requeued_tasks == 0
                        && s.capacity_left <= 0
                }) && c
                    .stream_state()
                    .is_some_and(|(_, pending, ack)| pending == 0 && ack == 0)
                    && c.drop_reports_left() == Some(0);
                if status.is_some() {
                    last = status;
                }
                polls += 1;
                if !settled && polls.is_multiple_of(40) {
                    eprintln!("[cluster] settling: {last:?}");
                }
                settled
            },
        );
        let coordinator = self.status().expect("coordinator status");
        let alive: Vec<String> = self
            .roles
            .iter()
            .filter(|r| r.is_running())
            .map(|r| r.name.clone())
            .collect();
        // Trainer nodes leave with the learner's group, by themselves.
        for name in alive.iter().filter(|n| n.starts_with("trainer-node")) {
            let status = self.wait_exit(name, Duration::from_secs(60));
            assert!(
                status.success(),
                "{name} exited with {status} after the learner finished"
            );
        }
        // Workers first (they drain), then buffer and coordinator.
        let mut order: Vec<String> = alive
            .iter()
            .filter(|n| !n.starts_with("trainer-node"))
            .cloned()
            .collect();
        order.sort_by_key(|n| match n.as_str() {
            "coordinator" => 2,
            "buffer" => 1,
            _ => 0,
        });
        for name in &order {
            self.sigterm(name);
            let status = self.wait_exit(name, Duration::from_secs(30));
            assert!(
                status.success(),
                "{name} exited with {status} after SIGTERM"
            );
        }
        self.check_invariants(expect, coordinator)
    }

    /// The invariants of a run (see the module docs of the test files):
    /// every trained trajectory was published and trained exactly once, in
    /// complete groups of B per step; every task was trained at most once
    /// and every started task has a complete attempt; versions never went
    /// backwards; nothing trained was staler than η; the buffer stored every
    /// published trajectory.
    pub fn check_invariants(&self, expect: &Expect, coordinator: StatusReply) -> Report {
        let spec = &self.spec;
        let (b, g, eta) = (
            spec.groups_per_step as usize,
            spec.group_size as usize,
            spec.eta as i32,
        );
        let mut report = Report {
            coordinator,
            ..Default::default()
        };

        // The stream: every published trajectory, by uuid. A stream that
        // releases what the buffer stored is empty once the run has
        // settled: then the buffer's segments are the record.
        let stream = if spec.stream == TrajectoryRetention::Keep {
            self.stream()
        } else {
            let (messages, pending, ack_pending) = self
                .stream_state()
                .expect("the TRAJECTORIES stream and its consumer");
            assert_eq!(
                (messages, pending, ack_pending),
                (0, 0, 0),
                "a releasing stream still holds messages after the buffer consumed everything"
            );
            self.stored()
        };
        report.stream_trajectories = stream.len();
        let mut by_uuid: HashMap<&str, &Trajectory> = HashMap::new();
        for t in &stream {
            if let Some(prev) = by_uuid.insert(&t.uuid, t) {
                assert_eq!(
                    prev, t,
                    "uuid {} is in the stream twice with different contents",
                    t.uuid
                );
            }
        }
        // No token is older than its task's admission version: the staleness
        // bound counts from it (a worker waits for the weights of the
        // admission version before sampling).
        for t in &stream {
            assert!(
                t.oldest_version() >= t.admission_version,
                "trajectory {} of task {} ({}) has a token of version {} below its admission version {}",
                t.uuid,
                t.task_id,
                t.worker_id,
                t.oldest_version(),
                t.admission_version
            );
        }
        // Attempts (groups) per task, in stream order of completion.
        let mut groups: BTreeMap<&str, Vec<&Trajectory>> = BTreeMap::new();
        for t in by_uuid.values() {
            groups.entry(&t.group_id).or_default().push(t);
        }
        report.stream_groups = groups.len();
        let mut completed_at: HashMap<&str, usize> = HashMap::new();
        let mut count: HashMap<&str, BTreeSet<u32>> = HashMap::new();
        for (pos, t) in stream.iter().enumerate() {
            let members = count.entry(&t.group_id).or_default();
            members.insert(t.index_in_group);
            if members.len() == g {
                completed_at.entry(&t.group_id).or_insert(pos);
            }
        }
        for (group, members) in &groups {
            let first = members[0];
            assert!(
                members.len() <= g,
                "group {group} has {} trajectories (G = {g})",
                members.len()
            );
            for m in members {
                assert_eq!(m.task_id, first.task_id, "group {group} spans two tasks");
                assert_eq!(m.group_size as usize, g, "group {group}: group_size");
            }
        }
        let mut attempts: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (group, members) in &groups {
            attempts.entry(&members[0].task_id).or_default().push(group);
        }
        report.tasks_started = attempts.len();

        // trained.jsonl: the run's invariants (crate::invariants), then each
        // step's trajectories against the stream. The last line of a step
        // counts; a retrained one lists the same trajectories.
        let check = check_trained_file(&self.out.join(TRAINED_JSONL), spec.eta, b * g);
        let violations = check.violations();
        assert!(violations.is_empty(), "trained.jsonl: {violations:#?}");
        assert_eq!(
            check.max_step, spec.max_steps,
            "trained.jsonl must hold every step 1..=max_steps"
        );
        report.retrained_steps = check.retrained;
        let steps: BTreeMap<u64, TrainedStep> = self
            .trained_lines()
            .into_iter()
            .map(|s| (s.step, s))
            .collect();
        report.steps = steps.len() as u64;

        let mut trained_in: HashMap<&str, u64> = HashMap::new();
        let mut trained_groups: HashMap<&str, u64> = HashMap::new();
        let mut trained_tasks: HashMap<&str, &str> = HashMap::new();
        for (step, s) in &steps {
            let mut step_groups: BTreeMap<&str, usize> = BTreeMap::new();
            let mut min_version = i32::MAX;
            for uuid in &s.trajectories {
                let t = by_uuid.get(uuid.as_str()).unwrap_or_else(|| {
                    panic!("step {step} trained {uuid}, which is not in the stream")
                });
                if let Some(other) = trained_in.insert(uuid, *step) {
                    panic!("trajectory {uuid} was trained in steps {other} and {step}");
                }
                *step_groups.entry(&t.group_id).or_default() += 1;
                min_version = min_version.min(t.oldest_version());
                let lag = s.trained_at_version - t.oldest_version();
                report.max_lag = report.max_lag.max(lag);
                assert!(
                    lag <= eta,
                    "step {step} trained {uuid} with a token of version {} at version {} (η = {eta})",
                    t.oldest_version(),
                    s.trained_at_version
                );
            }
            assert_eq!(
                s.min_token_version, min_version,
                "step {step}: the learner's min_token_version disagrees with the stream"
            );
            assert!(
                s.max_version_lag <= f64::from(eta),
                "step {step}: max_version_lag {} > η",
                s.max_version_lag
            );
            assert_eq!(step_groups.len(), b, "step {step}: groups {step_groups:?}");
            for (group, n) in step_groups {
                assert_eq!(n, g, "step {step} trained {n} of group {group} (G = {g})");
                assert_eq!(
                    groups[group].len(),
                    g,
                    "step {step}: group {group} incomplete"
                );
                if let Some(other) = trained_groups.insert(group, *step) {
                    panic!("group {group} was trained in steps {other} and {step}");
                }
                let task = groups[group][0].task_id.as_str();
                if let Some(other) = trained_tasks.insert(task, group) {
                    panic!("task {task} was trained twice (groups {other} and {group})");
                }
            }
        }
        report.trained_trajectories = trained_in.len();
        report.tasks_trained = trained_tasks.len();

        // The loss invariant: a task that completed and was never trained
        // is still held by the buffer (complete, ready or served at a step
        // not trained yet). A task whose attempt was dropped and never
        // issued again, or whose new attempt was dropped too, is lost.
        let buffer_config = self
            .roles
            .iter()
            .find(|r| r.name == "buffer")
            .map(|r| {
                asyncrl_config::Config::load(&r.config)
                    .unwrap_or_else(|e| panic!("the buffer's config: {e}"))
                    .buffer
            })
            .unwrap_or_default();
        let held = asyncrl_buffer::held_tasks(&self.out.join("buffer"), &buffer_config)
            .unwrap_or_else(|e| panic!("read what the buffer holds: {e}"));
        report.tasks_held = held.len();
        // Every started task has a complete attempt (nothing was lost); the
        // one trained is the first to complete unless the buffer dropped the
        // earlier one as stale.
        let mut waiting = 0usize;
        let mut not_first = 0usize;
        for (task, task_groups) in &attempts {
            let mut complete: Vec<&str> = task_groups
                .iter()
                .copied()
                .filter(|gid| groups[gid].len() == g)
                .collect();
            complete.sort_by_key(|gid| completed_at[gid]);
            report.partial_attempts += task_groups.len() - complete.len();
            assert!(
                !complete.is_empty(),
                "task {task} was started ({} attempts: {task_groups:?}) but has no complete group: lost",
                task_groups.len()
            );
            match trained_tasks.get(task) {
                Some(trained) => {
                    report.superseded_attempts += complete.len() - 1;
                    if complete[0] != *trained {
                        not_first += 1;
                    }
                }
                None => {
                    waiting += 1;
                    report.superseded_attempts += complete.len() - 1;
                    assert!(
                        held.contains(*task),
                        "task {task} completed ({} complete attempts: {complete:?}) but is neither trained nor held by the buffer: lost",
                        complete.len()
                    );
                }
            }
        }
        report.tasks_waiting = waiting;
        let stale = report.coordinator.stale_dropped_total as usize;
        assert!(
            not_first <= stale,
            "{not_first} tasks were trained from a later attempt than the first complete one, with {stale} stale drops"
        );
        // The coordinator admitted no more than (η + v + 1)·B per learner
        // session: what was not trained waits in the buffer.
        let bound = (spec.eta as usize + 1) * b * (1 + expect.learner_restarts as usize);
        assert!(
            waiting <= bound,
            "{waiting} complete tasks were never trained (bound (η+1)·B per learner session = {bound})"
        );
        if expect.learner_restarts == 0 {
            assert_eq!(
                report.coordinator.accepted_groups as usize,
                report.tasks_trained + waiting,
                "the coordinator's accepted count disagrees with the complete tasks in the stream"
            );
        }

        // The coordinator started tasks in data set order without skipping.
        let taskset = asyncrl_coordinator::TaskSet::load(
            &[asyncrl_config::DatasetConfig::jsonl(
                "arith",
                self.tasks_file.clone(),
            )],
            None,
        )
        .expect("load the task file");
        let mut positions: Vec<usize> = attempts
            .keys()
            .map(|task| {
                let (item, epoch) = asyncrl_protos::subjects::split_wire_task_id(task)
                    .unwrap_or_else(|| panic!("task id {task} has no epoch"));
                let index = taskset
                    .index_of(item)
                    .unwrap_or_else(|| panic!("task {task} is not in the data set"));
                epoch as usize * taskset.len() + index
            })
            .collect();
        positions.sort_unstable();
        assert_eq!(
            positions,
            (0..positions.len()).collect::<Vec<_>>(),
            "the tasks started are not a prefix of the data set (a task was skipped)"
        );

        // policy.version as the workers saw it: never backwards, and at the
        // end the last step's version.
        let announcements = self.announcements();
        report.announcements = announcements.len();
        for pair in announcements.windows(2) {
            assert!(
                pair[1].version >= pair[0].version,
                "policy.version went backwards: {} -> {}",
                pair[0].version,
                pair[1].version
            );
        }
        for a in &announcements {
            assert_eq!(
                a.version as u64, a.step,
                "announcement of version {} says step {}",
                a.version, a.step
            );
        }
        assert_eq!(
            announcements.last().map(|a| a.version),
            Some(spec.max_steps as i32),
            "the last announced version"
        );

        // The buffer stored every published trajectory; a trained one
        // exactly once (a redelivery after a lost ack is recognised). A copy
        // of a trajectory of an attempt that was never trained may be stored
        // again (it is dropped as superseded either way).
        let stored = self.stored();
        let mut stored_ids: HashMap<&str, usize> = HashMap::new();
        for t in &stored {
            *stored_ids.entry(&t.uuid).or_default() += 1;
        }
        let missing: Vec<_> = by_uuid
            .keys()
            .filter(|u| !stored_ids.contains_key(*u))
            .collect();
        assert!(
            missing.is_empty(),
            "the buffer lost {} published trajectories: {missing:?}",
            missing.len()
        );
        let unknown: Vec<_> = stored_ids
            .keys()
            .filter(|u| !by_uuid.contains_key(*u))
            .collect();
        assert!(
            unknown.is_empty(),
            "the buffer stored trajectories not in the stream: {unknown:?}"
        );
        let twice: Vec<_> = stored_ids
            .iter()
            .filter(|(u, n)| **n > 1 && trained_in.contains_key(*u))
            .collect();
        assert!(
            twice.is_empty(),
            "the buffer stored trained trajectories twice: {twice:?}"
        );
        report.stored_copies = stored.len() - stored_ids.len();
        eprintln!("{report:#?}");
        report
    }

    /// The text of a role's log, every incarnation.
    pub fn log(&mut self, name: &str) -> String {
        self.role(name).log_text()
    }

    /// The log of a role's current (or last) incarnation.
    pub fn current_log(&mut self, name: &str) -> String {
        self.role(name).current_log()
    }

    /// The coordinator's counter `name` (0 while it does not answer).
    pub fn coordinator_counter(&mut self, name: &str) -> f64 {
        self.metrics("coordinator")
            .map(|m| m.sum(name))
            .unwrap_or_default()
    }

    /// What the running roles say about themselves (a failed test).
    fn dump_state(&mut self) {
        eprintln!(
            "\n======== cluster state ({}) ========",
            self.dir.path().display()
        );
        eprintln!("coordinator status: {:?}", self.status());
        eprintln!("worker registry: {:?}", self.registry());
        eprintln!(
            "stream (messages, pending, ack pending): {:?}",
            self.stream_state()
        );
        let names: Vec<String> = self.roles.iter().map(|r| r.name.clone()).collect();
        for name in names {
            if let Some(m) = self.metrics(&name) {
                let picked: Vec<String> =
                    m.0.iter()
                        .filter(|(k, _)| {
                            [
                                "denied",
                                "in_flight",
                                "ready_groups",
                                "capacity",
                                "policy_version",
                                "outstanding",
                                "acquire",
                            ]
                            .iter()
                            .any(|w| k.contains(w))
                        })
                        .map(|(k, v)| format!("{k} {v}"))
                        .collect();
                eprintln!("{name} metrics: {}", picked.join(", "));
            }
        }
    }

    fn dump_logs(&self) {
        eprintln!("======== cluster logs ========");
        for r in &self.roles {
            let text = std::fs::read_to_string(&r.log).unwrap_or_default();
            eprintln!("-------- {} ({}) --------", r.name, r.log.display());
            eprintln!("{}", tail(&text, 80));
        }
        for (i, node) in self.nats.nodes().iter().enumerate() {
            let nats_log = node.store_dir().join("nats-server.log");
            let text = std::fs::read_to_string(&nats_log).unwrap_or_default();
            eprintln!("-------- nats-server {i} --------\n{}", tail(&text, 30));
        }
        let trained = std::fs::read_to_string(self.out.join("trained.jsonl")).unwrap_or_default();
        let short: Vec<String> = trained
            .lines()
            .map(|l| l.chars().take(160).collect())
            .collect();
        eprintln!("-------- trained.jsonl --------\n{}", short.join("\n"));
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Some(w) = self.watcher.take() {
            w.abort();
        }
        let failed = std::thread::panicking();
        if failed {
            self.dump_state();
        }
        for r in &mut self.roles {
            // A frozen process dies of SIGKILL too.
            r.kill9();
        }
        if failed {
            self.dump_logs();
            if std::env::var_os("ASYNCRL_KEEP_TEST_DIR").is_some() {
                let path = self.dir.path().to_owned();
                eprintln!("keeping {}", path.display());
                std::mem::forget(std::mem::replace(
                    &mut self.dir,
                    tempfile::tempdir().expect("temp dir"),
                ));
            }
        }
    }
}

async fn watch_once(
    setup: &NatsSetup,
    url: &str,
    seen: &Arc<Mutex<Vec<WeightAnnouncement>>>,
) -> anyhow::Result<()> {
    let client = setup.observe(url).await?;
    let js = async_nats::jetstream::new(client);
    let kv = js
        .get_key_value(asyncrl_protos::subjects::CONTROL_BUCKET)
        .await
        .context("open the control bucket")?;
    let mut watch = kv
        .watch_with_history(asyncrl_protos::subjects::POLICY_VERSION_KEY)
        .await
        .context("watch policy.version")?;
    while let Some(entry) = watch.next().await {
        let entry = entry.context("the watch of policy.version")?;
        if entry.operation != async_nats::jetstream::kv::Operation::Put {
            continue;
        }
        let a =
            WeightAnnouncement::decode(entry.value.as_ref()).context("decode policy.version")?;
        let mut seen = seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // A reopened watch delivers the current value again.
        if seen.last() != Some(&a) {
            seen.push(a);
        }
    }
    anyhow::bail!("the watch ended")
}

fn tracing_note(msg: &str) {
    eprintln!("[cluster] {msg}");
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// A minimal HTTP/1.0 GET against 127.0.0.1 (testkit's).
pub use asyncrl_testkit::http_get;

/// Prometheus text exposition, as (series, value).
#[derive(Debug, Clone, Default)]
pub struct Metrics(pub Vec<(String, f64)>);

impl Metrics {
    pub fn parse(text: &str) -> Self {
        Self(
            text.lines()
                .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
                .filter_map(|l| {
                    let (series, value) = l.rsplit_once(' ')?;
                    Some((series.to_owned(), value.parse().ok()?))
                })
                .collect(),
        )
    }

    /// The sum over every label set of the metric `name`.
    pub fn sum(&self, name: &str) -> f64 {
        self.0
            .iter()
            .filter(|(series, _)| series.split('{').next() == Some(name))
            .map(|(_, v)| v)
            .sum()
    }

    /// The value of the series with exactly this text (`name{a="b"}`).
    pub fn get(&self, series: &str) -> Option<f64> {
        self.0.iter().find(|(s, _)| s == series).map(|(_, v)| *v)
    }
}

/// Rows of a CSV the benches write (no quoting: their fields never hold
/// commas) as maps from column name to field.
pub fn csv_rows(path: &Path) -> Vec<HashMap<String, String>> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut lines = text.lines();
    let header: Vec<String> = lines
        .next()
        .expect("a header")
        .split(',')
        .map(str::to_owned)
        .collect();
    lines
        .map(|l| {
            header
                .iter()
                .cloned()
                .zip(l.split(',').map(str::to_owned))
                .collect()
        })
        .collect()
}
