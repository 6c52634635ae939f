//! The `torch` trainer engine, seen from the learner: a PyTorch process
//! group (`trainer/`, `asyncrl_trainer.server`) started with `torchrun` and
//! driven over `asyncrl.v1.TrainerEngine` on a Unix socket.
//!
//! - The group runs in its own process group, and every process in it dies
//!   with its parent (`PR_SET_PDEATHSIG`): a learner killed with SIGKILL
//!   leaves no trainer behind, and dropping the engine shuts it down (kills
//!   it if it does not leave).
//! - The learner keeps what makes a step reproducible and exactly-once: it
//!   checks and assembles the batch ([`crate::batch`]), shuffles the rows
//!   with its own seeded RNG, and records step, version and RNG state in
//!   every checkpoint beside the engine's sharded (DCP) state.
//! - Calls have no deadline (a step at 7B takes what it takes); a dead group
//!   closes the socket, so a call fails at once with the group's exit
//!   status and its last error line, and the role fails rather than hangs.

use std::collections::VecDeque;
use std::io::{BufRead as _, BufReader};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arrow::array::RecordBatch;
use asyncrl_config::{Config, MixedPrecisionName};
use asyncrl_protos::arrow_schema::trainer_rows;
use asyncrl_protos::v1::trainer_engine_client::TrainerEngineClient;
use asyncrl_protos::v1::{
    self as pb, DescribeRequest, EngineInfo, ExportWeightsRequest, GeneratePrompt, GenerateRequest,
    LoadCheckpointRequest, LoadWeightsRequest, SaveCheckpointRequest, ShutdownRequest,
    StepObjective, TrainStepRequest,
};
use asyncrl_tasks::SplitMix64;
use serde::{Deserialize, Serialize};
use tch::Kind;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::batch::{BatchLimits, Lanes, TrainBatch, assemble};
use crate::checkpoint;
use crate::engine::TrainerEngine;
use crate::objective::{
    ClipMode, ImportanceCorrection, KlEstimator, LogprobGap, LossAggregation, ObjectiveStats,
};
use crate::trainer::{
    StepSettings, StepStats, TrainError, TrainerOptions, record_batch_facts, scheduled_lr,
    shuffled_order,
};

/// The engine's checkpoint step file (`asyncrl_trainer.checkpoint.STEP_FILE`):
/// written last, so a folder without it is incomplete.
pub const STEP_FILE: &str = "asyncrl_step.json";

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The engine ran the call and refused its input (nothing was applied).
    #[error("the torch trainer engine refused {call}: {message}")]
    Refused { call: &'static str, message: String },
    /// The connection broke and the group had not exited 30 s later; its
    /// last output lines say what it was doing.
    #[error("the torch trainer engine failed in {call} (its last lines: {detail})")]
    Rpc {
        call: &'static str,
        detail: String,
        #[source]
        source: tonic::Status,
    },
    #[error("the torch trainer engine exited ({status}): {detail}")]
    Exited { status: String, detail: String },
    #[error("the torch trainer engine did not serve within {0:?} (learner.torch.start_timeout)")]
    StartTimeout(Duration),
    #[error("torch trainer engine: {what}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("torch trainer engine: {0}")]
    Protocol(String),
}

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> EngineError {
    let what = what.into();
    move |source| EngineError::Io { what, source }
}

/// What the learner writes beside the engine's shards in a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct LearnerMeta {
    format: u32,
    engine: String,
    step: u64,
    version: i32,
    rng_state: u64,
    created_at_unix_ms: i64,
}

/// The last lines the group wrote to stderr (for errors), forwarded to the
/// learner's log as they come.
#[derive(Clone, Default)]
struct Tail(Arc<Mutex<VecDeque<String>>>);

impl Tail {
    const LINES: usize = 40;

    fn push(&self, line: String) {
        if let Ok(mut t) = self.0.lock() {
            if t.len() == Self::LINES {
                t.pop_front();
            }
            t.push_back(line);
        }
    }

    /// The group's own error line (`error: model.path: ...`) if it printed
    /// one, else its last lines.
    fn detail(&self) -> String {
        let lines: Vec<String> = self
            .0
            .lock()
            .map(|t| t.iter().cloned().collect())
            .unwrap_or_default();
        if let Some(e) = lines.iter().find(|l| l.starts_with("error: ")) {
            return e.trim_start_matches("error: ").to_owned();
        }
        let last: Vec<&str> = lines
            .iter()
            .rev()
            .take(6)
            .rev()
            .map(String::as_str)
            .collect();
        if last.is_empty() {
            "it printed nothing".to_owned()
        } else {
            last.join(" | ")
        }
    }
}

/// The torchrun command of node `node_rank` of the group (`learner.torch`):
/// the learner runs node 0 (which serves `socket`); `asyncrl trainer-node`
/// runs the others with the same config, so every node starts the same
/// server with the same arguments (the server checks that they agree).
pub fn group_command(
    config: &Config,
    opts: &TrainerOptions,
    model: &Path,
    socket: &Path,
    node_rank: usize,
) -> Command {
    let t = &config.learner.torch;
    let per_node = (t.world_size / t.nodes.max(1)).max(1);
    let mut cmd = Command::new(&t.python);
    cmd.args(["-m", "torch.distributed.run"]);
    match (&t.rendezvous, t.nodes) {
        (Some(endpoint), nodes) if nodes > 1 => {
            let (host, port) = endpoint.rsplit_once(':').unwrap_or((endpoint, "29500"));
            cmd.arg(format!("--nnodes={nodes}"))
                .arg(format!("--node-rank={node_rank}"))
                .arg(format!("--master-addr={host}"))
                .arg(format!("--master-port={port}"));
        }
        _ => {
            cmd.arg("--standalone");
        }
    }
    cmd.arg(format!("--nproc-per-node={per_node}"))
        .args(["-m", "asyncrl_trainer.server", "--model"])
        .arg(model)
        .arg("--socket")
        .arg(socket)
        .arg(format!("--temperature={}", opts.temperature))
        .arg(format!("--proximal={}", config.learner.proximal.as_str()))
        .arg(format!(
            "--max-tokens-per-microbatch={}",
            opts.max_tokens_per_microbatch
        ))
        .args(match opts.lanes {
            // The engine packs; prefix sharing is the built-in trainer's.
            Lanes::Packed { min_width } | Lanes::Shared { min_width, .. } => {
                vec![
                    "--packing".to_owned(),
                    format!("--packing-lane-tokens={min_width}"),
                ]
            }
            Lanes::Padded => vec!["--no-packing".to_owned()],
        })
        .arg(format!(
            "--learning-rate={}",
            config.coordinator.initial_knobs.learning_rate
        ))
        .arg(format!("--grad-clip={}", opts.grad_clip))
        .arg(format!("--weight-decay={}", opts.adamw.weight_decay))
        .arg(format!("--beta1={}", opts.adamw.beta1))
        .arg(format!("--beta2={}", opts.adamw.beta2))
        .arg(format!("--adam-eps={}", opts.adamw.eps))
        .arg(format!(
            "--mixed-precision={}",
            match t.mixed_precision {
                MixedPrecisionName::Auto => "auto",
                MixedPrecisionName::None => "none",
                MixedPrecisionName::Bf16 => "bf16",
            }
        ))
        .arg(format!("--seed={}", config.run.seed));
    if t.activation_checkpointing {
        cmd.arg("--activation-checkpointing");
    }
    if t.cpu_offload {
        cmd.arg("--cpu-offload");
    }
    if config.learner.kl_coef > 0.0 {
        cmd.arg("--kl-reference");
    }
    if std::env::var_os("OMP_NUM_THREADS").is_none() {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        cmd.env("OMP_NUM_THREADS", (cores / per_node).max(1).to_string());
    }
    cmd
}

/// `asyncrl trainer-node`: runs node `node_rank` (1 ≤ rank < `nodes`) of
/// the torch engine's group and waits for it. The learner runs node 0 and
/// serves the rendezvous; this node's ranks join it, train every step the
/// learner's rank 0 broadcasts and exit when the learner shuts the group
/// down (0) or the group breaks (non-zero: restart the whole gang). They
/// die with this process, even by SIGKILL.
pub fn run_node(config: &Config, node_rank: usize) -> anyhow::Result<std::process::ExitStatus> {
    use anyhow::Context as _;
    let t = &config.learner.torch;
    if config.learner.trainer != asyncrl_config::TrainerEngineName::Torch {
        anyhow::bail!(
            "learner.trainer is {:?}: a trainer node runs only for the torch engine",
            config.learner.trainer.as_str()
        );
    }
    if t.nodes < 2 {
        anyhow::bail!(
            "learner.torch.nodes is {}: the learner runs the whole group, there is no other node",
            t.nodes
        );
    }
    if node_rank == 0 || node_rank >= t.nodes {
        anyhow::bail!(
            "--node-rank {node_rank}: a trainer node is 1 to {} (the learner is node 0)",
            t.nodes - 1
        );
    }
    let model =
        config.model.path.as_deref().context(
            "model.path: the torch engine trains a Hugging Face model folder; none is set",
        )?;
    let opts = crate::service::trainer_options(config);
    // Only node 0 serves: the socket is an argument every node passes alike.
    let socket = std::env::temp_dir().join("asyncrl-trainer-node.sock");
    let mut cmd = group_command(config, &opts, model, &socket, node_rank);
    // SAFETY: between fork and exec only async-signal-safe calls (prctl).
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    tracing::info!(
        node_rank,
        nodes = t.nodes,
        rendezvous = t.rendezvous.as_deref().unwrap_or(""),
        "starting the trainer node"
    );
    let mut child = cmd
        .stdin(Stdio::null())
        .spawn()
        .with_context(|| format!("cannot run {} (learner.torch.python)", t.python.display()))?;
    child
        .wait()
        .context("waiting for the trainer node's torchrun")
}

pub struct TorchEngine {
    rt: tokio::runtime::Runtime,
    client: TrainerEngineClient<Channel>,
    child: Child,
    tail: Tail,
    socket: PathBuf,
    /// Scratch folder of exports and adopted weights.
    work: PathBuf,
    info: EngineInfo,
    opts: TrainerOptions,
    step: u64,
    version: i32,
    rng: SplitMix64,
}

impl TorchEngine {
    /// Starts the group, waits until it serves, and resumes the newest
    /// complete checkpoint of this engine under `ckpt_dir`.
    pub fn start(
        config: &Config,
        opts: TrainerOptions,
        ckpt_dir: &Path,
    ) -> Result<Self, TrainError> {
        let mut engine = Self::launch(config, opts, ckpt_dir.join(".torch-engine"))?;
        engine.resume(ckpt_dir)?;
        Ok(engine)
    }

    /// A one-process engine (one rank, on the first device; no sharding
    /// options) that only generates: the learner's `[eval]` for models the
    /// built-in one does not run. `work` is its scratch folder.
    pub fn start_evaluator(config: &Config, work: PathBuf) -> Result<Self, TrainError> {
        let mut config = config.clone();
        let t = &mut config.learner.torch;
        t.world_size = 1;
        t.nodes = 1;
        t.rendezvous = None;
        t.activation_checkpointing = false;
        t.cpu_offload = false;
        let opts = crate::service::trainer_options(&config);
        Self::launch(&config, opts, work)
    }

    /// Parameters of the model the group loaded.
    pub fn parameters(&self) -> u64 {
        self.info.parameters
    }

    /// Completions of `prompts` (see `asyncrl.v1.TrainerEngine/Generate`),
    /// in order; `seeds[i]` seeds prompt `i`'s sampling.
    pub fn generate(
        &mut self,
        prompts: &[Vec<i64>],
        seeds: &[u64],
        max_new_tokens: usize,
        temperature: f64,
        stop_token_ids: &[i64],
    ) -> Result<Vec<Vec<i64>>, TrainError> {
        let request = GenerateRequest {
            prompts: prompts
                .iter()
                .zip(seeds.iter().chain(std::iter::repeat(&0)))
                .map(|(p, s)| GeneratePrompt {
                    tokens: p.clone(),
                    seed: *s,
                })
                .collect(),
            max_new_tokens: u32::try_from(max_new_tokens).unwrap_or(u32::MAX),
            temperature,
            stop_token_ids: stop_token_ids.to_vec(),
        };
        let reply = self.call_idempotent("Generate", |mut c| {
            let request = request.clone();
            async move { c.generate(request).await }
        })?;
        if reply.completions.len() != prompts.len() {
            return Err(EngineError::Protocol(format!(
                "Generate answered {} completions for {} prompts",
                reply.completions.len(),
                prompts.len()
            ))
            .into());
        }
        Ok(reply.completions.into_iter().map(|c| c.tokens).collect())
    }

    fn launch(config: &Config, opts: TrainerOptions, work: PathBuf) -> Result<Self, TrainError> {
        let t = &config.learner.torch;
        let Some(model) = &config.model.path else {
            return Err(EngineError::Protocol(
                "model.path: the torch engine trains a Hugging Face model folder; none is set"
                    .into(),
            )
            .into());
        };
        let socket = std::env::temp_dir().join(format!(
            "asyncrl-trainer-{}-{}.sock",
            std::process::id(),
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        ));
        if work.exists() {
            std::fs::remove_dir_all(&work)
                .map_err(io_err(format!("cannot clear {}", work.display())))?;
        }
        std::fs::create_dir_all(&work)
            .map_err(io_err(format!("cannot create {}", work.display())))?;
        let mut cmd = group_command(config, &opts, model, &socket, 0);
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // SAFETY: between fork and exec only async-signal-safe calls
        // (setpgid, prctl, getppid).
        unsafe {
            cmd.pre_exec(|| {
                // Its own process group (the drop kills the whole group), and
                // death with the learner, even by SIGKILL.
                libc::setpgid(0, 0);
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = cmd.spawn().map_err(io_err(format!(
            "cannot run {} (learner.torch.python)",
            t.python.display()
        )))?;
        let tail = Tail::default();
        for stream in [
            child
                .stdout
                .take()
                .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
            child
                .stderr
                .take()
                .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
        ]
        .into_iter()
        .flatten()
        {
            let tail = tail.clone();
            std::thread::Builder::new()
                .name("asyncrl-torch-log".into())
                .spawn(move || {
                    for line in BufReader::new(stream).lines().map_while(Result::ok) {
                        tracing::info!(target: "asyncrl::torch_engine", "{line}");
                        tail.push(line);
                    }
                })
                .map_err(io_err("cannot start the engine's log thread"))?;
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(io_err("cannot build the engine client's runtime"))?;
        let started = Instant::now();
        let (client, info) = loop {
            if let Some(status) = child.try_wait().map_err(io_err("cannot poll the engine"))? {
                let _ = std::fs::remove_file(&socket);
                // The reader threads hold the last lines; give them a moment.
                std::thread::sleep(Duration::from_millis(200));
                return Err(EngineError::Exited {
                    status: status.to_string(),
                    detail: tail.detail(),
                }
                .into());
            }
            if started.elapsed() > t.start_timeout {
                kill_group(&mut child);
                return Err(EngineError::StartTimeout(t.start_timeout).into());
            }
            if socket.exists()
                && let Ok(ready) = rt.block_on(connect_and_describe(&socket))
            {
                break ready;
            }
            std::thread::sleep(Duration::from_millis(250));
        };
        if info.world_size as usize != t.world_size {
            kill_group(&mut child);
            return Err(EngineError::Protocol(format!(
                "{} ranks serve, learner.torch.world_size is {}",
                info.world_size, t.world_size
            ))
            .into());
        }
        tracing::info!(
            model_type = %info.model_type,
            world_size = info.world_size,
            parameters = info.parameters,
            device = %info.device,
            seconds = started.elapsed().as_secs_f64(),
            "torch trainer engine serving"
        );
        Ok(Self {
            rt,
            client,
            child,
            tail,
            socket,
            work,
            info,
            rng: SplitMix64::new(opts.seed ^ 0x5EED_1EA2_0000_0001),
            opts,
            step: 0,
            version: 0,
        })
    }

    fn resume(&mut self, root: &Path) -> Result<(), TrainError> {
        // Checkpoint writes a kill cut off (`.step-NNNNNNNN.tmp`, never
        // renamed into place) are garbage.
        if let Ok(entries) = std::fs::read_dir(root) {
            for e in entries.filter_map(Result::ok) {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with(".step-") && name.ends_with(".tmp") {
                    tracing::info!(folder = %e.path().display(), "removing a checkpoint write that was cut off");
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        for (_, dir) in checkpoint::step_dirs(root)? {
            if !dir.join(STEP_FILE).is_file() {
                continue;
            }
            let path = dir.to_string_lossy().into_owned();
            let reply = match self.call("LoadCheckpoint", |mut c| async move {
                c.load_checkpoint(LoadCheckpointRequest { path }).await
            }) {
                Ok(r) => r,
                Err(EngineError::Refused { message, .. }) => {
                    tracing::warn!(checkpoint = %dir.display(), reason = %message, "skipping a checkpoint the engine cannot load");
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            let meta: LearnerMeta =
                serde_json::from_str(&reply.learner_meta_json).map_err(|e| {
                    checkpoint::CheckpointError::Invalid {
                        path: dir.clone(),
                        reason: format!("its learner record does not parse: {e}"),
                    }
                })?;
            self.step = meta.step;
            self.version = meta.version;
            self.rng = SplitMix64::new(meta.rng_state);
            tracing::info!(checkpoint = %dir.display(), step = meta.step, version = meta.version, "resumed from checkpoint");
            return Ok(());
        }
        Ok(())
    }

    /// Runs a call that may run twice with the same effect (it reads, or
    /// replaces state wholesale: LoadWeights, Generate): a call that fails
    /// in transport (`Unavailable`, `Unknown`) while the group still runs
    /// is sent once more on a new connection. An HTTP/2 connection that
    /// sat idle can fail the first call after it, as the evaluator's does
    /// between two evaluated versions when training is slow (seen as
    /// "failed in LoadWeights" for one version under load); the channel
    /// reconnects for the next call.
    fn call_idempotent<R, F, Fut>(&mut self, name: &'static str, f: F) -> Result<R, EngineError>
    where
        F: Fn(TrainerEngineClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<R>, tonic::Status>>,
    {
        match self.rt.block_on(f(self.client.clone())) {
            Ok(r) => Ok(r.into_inner()),
            Err(s)
                if matches!(s.code(), tonic::Code::Unavailable | tonic::Code::Unknown)
                    && matches!(self.child.try_wait(), Ok(None)) =>
            {
                tracing::warn!(call = name, status = %s, "a trainer engine call failed in transport; sending it again");
                self.call(name, f)
            }
            Err(s) => Err(self.failed(name, s)),
        }
    }

    /// Runs one call; a failure of a group that has exited reports how.
    fn call<R, F, Fut>(&mut self, name: &'static str, f: F) -> Result<R, EngineError>
    where
        F: FnOnce(TrainerEngineClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<R>, tonic::Status>>,
    {
        match self.rt.block_on(f(self.client.clone())) {
            Ok(r) => Ok(r.into_inner()),
            Err(s) => Err(self.failed(name, s)),
        }
    }

    /// What a failed call means: a refusal, the group's exit, or the call's
    /// own failure.
    fn failed(&mut self, name: &'static str, status: tonic::Status) -> EngineError {
        if status.code() == tonic::Code::InvalidArgument {
            return EngineError::Refused {
                call: name,
                message: status.message().to_owned(),
            };
        }
        // A closed socket: wait for the group's exit status (torchrun
        // notices a dead rank within seconds, then stops the rest).
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                std::thread::sleep(Duration::from_millis(100));
                return EngineError::Exited {
                    status: status.to_string(),
                    detail: self.tail.detail(),
                };
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        EngineError::Rpc {
            call: name,
            detail: self.tail.detail(),
            source: status,
        }
    }

    fn export(&mut self, path: &Path, max_shard_bytes: u64) -> Result<Vec<String>, EngineError> {
        let p = path.to_string_lossy().into_owned();
        let reply = self.call("ExportWeights", |mut c| async move {
            c.export_weights(ExportWeightsRequest {
                path: p,
                max_shard_bytes,
            })
            .await
        })?;
        Ok(reply.files)
    }

    fn rows_ipc(host: &TrainBatch) -> Result<Vec<u8>, TrainError> {
        let [n, l] = host.input_ids.size()[..] else {
            return Err(EngineError::Protocol("input_ids is not [N, L]".into()).into());
        };
        let t = host.mask.size()[1];
        let ids = Vec::<i64>::try_from(host.input_ids.to_kind(Kind::Int64).reshape([-1]))?;
        let gather = Vec::<i64>::try_from(host.gather_index.to_kind(Kind::Int64).reshape([-1]))?;
        let behaviour = Vec::<f32>::try_from(host.behaviour.to_kind(Kind::Float).reshape([-1]))?;
        let versions = Vec::<i32>::try_from(host.versions.to_kind(Kind::Int).reshape([-1]))?;
        let advantages = Vec::<f32>::try_from(host.advantages.to_kind(Kind::Float).reshape([-1]))?;
        let mask = Vec::<bool>::try_from(host.mask.to_kind(Kind::Bool).reshape([-1]))?;
        let (l, t) = (l as usize, t as usize);
        let rows: Vec<trainer_rows::Row<'_>> = (0..n as usize)
            .map(|i| {
                let len = (host.lengths[i] as usize).min(l);
                let tok = i * t..(i + 1) * t;
                trainer_rows::Row {
                    input_ids: &ids[i * l..i * l + len],
                    gather_index: &gather[tok.clone()],
                    behaviour: &behaviour[tok.clone()],
                    versions: &versions[tok.clone()],
                    advantages: &advantages[tok.clone()],
                    mask: &mask[tok],
                }
            })
            .collect();
        trainer_rows::encode(&rows).map_err(|e| {
            EngineError::Protocol(format!("cannot encode the batch's rows: {e}")).into()
        })
    }
}

async fn connect_and_describe(
    socket: &Path,
) -> Result<(TrainerEngineClient<Channel>, EngineInfo), Box<dyn std::error::Error + Send + Sync>> {
    let path = socket.to_owned();
    // The URI is unused: the connector dials the socket.
    let channel = Endpoint::try_from("http://[::1]:1")?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(path).await?,
                ))
            }
        }))
        .await?;
    let mut client = TrainerEngineClient::new(channel)
        .max_decoding_message_size(usize::MAX)
        .max_encoding_message_size(usize::MAX);
    let mut req = tonic::Request::new(DescribeRequest {});
    req.set_timeout(Duration::from_secs(10));
    let info = client.describe(req).await?.into_inner();
    Ok((client, info))
}

fn kill_group(child: &mut Child) {
    if let Ok(pid) = i32::try_from(child.id()) {
        // SAFETY: signals the process group the child leads (setpgid above).
        unsafe {
            libc::killpg(pid, libc::SIGKILL);
        }
    }
    let _ = child.kill();
    let _ = child.wait();
}

fn objective(knobs: &StepSettings) -> StepObjective {
    let o = &knobs.objective;
    StepObjective {
        eps_low: o.eps_low,
        eps_high: o.eps_high,
        clip_mode: match o.clip_mode {
            ClipMode::Ppo => pb::ClipMode::Ppo,
            ClipMode::Adaptive => pb::ClipMode::Adaptive,
            ClipMode::M2po => pb::ClipMode::M2po,
            ClipMode::Gspo => pb::ClipMode::Gspo,
        } as i32,
        importance_weight_cap: o.importance_weight_cap,
        adaptive_quantile: o.adaptive_quantile,
        adaptive_temperature: o.adaptive_temperature,
        m2po_threshold: o.m2po_threshold,
        aggregation: match o.aggregation {
            LossAggregation::Token => pb::step_objective::Aggregation::Token,
            LossAggregation::Sequence => pb::step_objective::Aggregation::Sequence,
        } as i32,
        importance_correction: match o.importance_correction {
            ImportanceCorrection::Mask => pb::ImportanceCorrection::Mask,
            ImportanceCorrection::Truncate => pb::ImportanceCorrection::Truncate,
            ImportanceCorrection::Icepop => pb::ImportanceCorrection::Icepop,
        } as i32,
        importance_weight_floor: o.importance_weight_floor,
        kl_coef: o.kl_coef,
        kl_estimator: match o.kl_estimator {
            KlEstimator::K1 => pb::step_objective::KlEstimator::K1,
            KlEstimator::K3 => pb::step_objective::KlEstimator::K3,
        } as i32,
        dual_clip: o.dual_clip,
    }
}

impl TrainerEngine for TorchEngine {
    fn name(&self) -> &'static str {
        asyncrl_config::TrainerEngineName::Torch.as_str()
    }

    fn step(&self) -> u64 {
        self.step
    }

    fn version(&self) -> i32 {
        self.version
    }

    fn batch_limits(&self) -> BatchLimits {
        BatchLimits {
            vocab_size: self.info.vocab_size,
            max_seq_len: usize::try_from(self.info.max_position_embeddings).unwrap_or(0),
            max_version: self.version,
        }
    }

    fn train_step(
        &mut self,
        batches: &[RecordBatch],
        knobs: &StepSettings,
    ) -> Result<StepStats, TrainError> {
        let start = Instant::now();
        crate::batch::check(batches, &self.batch_limits())?;
        let host = assemble(batches, 0, self.opts.advantage_norm)?;
        let n = host.input_ids.size()[0];
        let order = shuffled_order(&mut self.rng, n);
        let lr = scheduled_lr(&self.opts, knobs.learning_rate, self.step + 1);
        let request = TrainStepRequest {
            step: self.step + 1,
            learner_version: self.version,
            batch_arrow_ipc: Self::rows_ipc(&host)?.into(),
            order: order.iter().map(|&i| i as u32).collect(),
            minibatches: u32::try_from(self.opts.minibatches).unwrap_or(u32::MAX),
            objective: Some(objective(knobs)),
            learning_rate: lr,
        };
        let reply = self.call(
            "TrainStep",
            |mut c| async move { c.train_step(request).await },
        )?;
        let version_before = self.version;
        self.step += 1;
        self.version += 1;
        let gap = reply.logprob_gap.unwrap_or_default();
        let mut stats = StepStats {
            step: self.step,
            version: self.version,
            loss: reply.loss,
            objective: ObjectiveStats {
                tokens: reply.tokens as i64,
                clip_low_fraction: reply.clip_low_fraction,
                clip_high_fraction: reply.clip_high_fraction,
                weight_masked_fraction: reply.weight_masked_fraction,
                m2po_masked_fraction: reply.m2po_masked_fraction,
                dual_clip_fraction: reply.dual_clip_fraction,
                approx_kl: reply.approx_kl,
                mean_importance_weight: reply.mean_importance_weight,
                mean_version_lag: reply.mean_version_lag,
                max_version_lag: f64::from(reply.max_version_lag),
                kl_ref: reply.kl_ref,
            },
            entropy: reply.entropy,
            grad_norm: reply.grad_norm,
            learning_rate: lr,
            microbatches: reply.microbatches as usize,
            logprob_gap: LogprobGap {
                tokens: gap.tokens as i64,
                mean_abs: gap.mean_abs,
                max_abs: gap.max_abs,
                kl: gap.kl,
            },
            ..Default::default()
        };
        let lanes = self.opts.lanes.within(self.opts.max_tokens_per_microbatch);
        record_batch_facts(&mut stats, &host, version_before, lanes);
        stats.compute_seconds = start.elapsed().as_secs_f64();
        Ok(stats)
    }

    fn weights_bytes(&mut self) -> Result<Vec<u8>, TrainError> {
        let dir = self.work.join(format!(
            "export-{}-{}",
            self.version,
            uuid::Uuid::new_v4().simple()
        ));
        // One file: the object store's publication format.
        let files = self.export(&dir, u64::MAX >> 1)?;
        let result = (|| {
            let [file] = &files[..] else {
                return Err(EngineError::Protocol(format!(
                    "an export for the object store wrote {} files, not one",
                    files.len()
                )));
            };
            let path = dir.join(file);
            let bytes =
                std::fs::read(&path).map_err(io_err(format!("cannot read {}", path.display())))?;
            let sums_path = dir.join("sha256.json");
            let sums: std::collections::BTreeMap<String, String> = serde_json::from_slice(
                &std::fs::read(&sums_path)
                    .map_err(io_err(format!("cannot read {}", sums_path.display())))?,
            )
            .map_err(|e| {
                EngineError::Protocol(format!("{} does not parse: {e}", sums_path.display()))
            })?;
            let got = asyncrl_common::sha256_hex(&bytes);
            if sums.get(file) != Some(&got) {
                return Err(EngineError::Protocol(format!(
                    "{} does not match its recorded sha256",
                    path.display()
                )));
            }
            Ok(bytes)
        })();
        let _ = std::fs::remove_dir_all(&dir);
        Ok(result?)
    }

    fn adopt_published(&mut self, bytes: &[u8], version: i32) -> Result<(), TrainError> {
        let dir = self.work.join(format!("adopt-{version}"));
        std::fs::create_dir_all(&dir)
            .map_err(io_err(format!("cannot create {}", dir.display())))?;
        let file = dir.join("model.safetensors");
        std::fs::write(&file, bytes).map_err(io_err(format!("cannot write {}", file.display())))?;
        let path = dir.to_string_lossy().into_owned();
        let loaded = self.call_idempotent("LoadWeights", |mut c| {
            let path = path.clone();
            async move { c.load_weights(LoadWeightsRequest { path }).await }
        });
        let _ = std::fs::remove_dir_all(&dir);
        loaded?;
        self.version = version;
        self.step = u64::try_from(version).unwrap_or(0);
        Ok(())
    }

    fn export_folder(&mut self, dest: &Path) -> Result<(), TrainError> {
        if dest.exists() {
            // The same version exported before a crash: replace it.
            std::fs::remove_dir_all(dest)
                .map_err(io_err(format!("cannot replace {}", dest.display())))?;
        }
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent)
                .map_err(io_err(format!("cannot create {}", parent.display())))?;
        }
        // The engine's default shard size (5 GB): large models are sharded.
        self.export(dest, 0)?;
        Ok(())
    }

    fn adopt_folder(
        &mut self,
        dir: &Path,
        _files: &[(String, bytes::Bytes)],
        version: i32,
    ) -> Result<(), TrainError> {
        let path = dir.to_string_lossy().into_owned();
        self.call_idempotent("LoadWeights", |mut c| {
            let path = path.clone();
            async move { c.load_weights(LoadWeightsRequest { path }).await }
        })?;
        self.version = version;
        self.step = u64::try_from(version).unwrap_or(0);
        Ok(())
    }

    fn write_checkpoint(&mut self, root: &Path) -> Result<PathBuf, TrainError> {
        let dest = root.join(format!("step-{:08}", self.step));
        if dest.exists() {
            // A checkpoint of the same step (written before a crash): replace it.
            std::fs::remove_dir_all(&dest)
                .map_err(io_err(format!("cannot replace {}", dest.display())))?;
        }
        std::fs::create_dir_all(root)
            .map_err(io_err(format!("cannot create {}", root.display())))?;
        let meta = LearnerMeta {
            format: 1,
            engine: self.name().to_owned(),
            step: self.step,
            version: self.version,
            rng_state: self.rng.state(),
            created_at_unix_ms: asyncrl_common::unix_ms(),
        };
        let request = SaveCheckpointRequest {
            path: dest.to_string_lossy().into_owned(),
            learner_meta_json: serde_json::to_string(&meta).map_err(|e| {
                EngineError::Protocol(format!("cannot encode the checkpoint record: {e}"))
            })?,
        };
        self.call("SaveCheckpoint", |mut c| async move {
            c.save_checkpoint(request).await
        })?;
        Ok(dest)
    }
}

impl Drop for TorchEngine {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let mut client = self.client.clone();
            let _ = self.rt.block_on(async move {
                let mut req = tonic::Request::new(ShutdownRequest {});
                req.set_timeout(Duration::from_secs(10));
                client.shutdown(req).await
            });
            let deadline = Instant::now() + Duration::from_secs(15);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = self.child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        kill_group(&mut self.child);
        let _ = std::fs::remove_file(&self.socket);
        let _ = std::fs::remove_dir_all(&self.work);
    }
}
