//! The vLLM engine: one or more vLLM servers driven over HTTP.
//!
//! - **Token in, token out.** Prompts go as token ids, completions come back
//!   as token ids with their processed (post-temperature) log-probs; text is
//!   never re-tokenized. `/inference/v1/generate` is used when the server
//!   has it (it also gives per-token weight-version spans), else
//!   `/v1/completions` with a token-id prompt.
//! - **Start-up checks.** Each server must answer `/health` within
//!   `worker.engine.ready_timeout`, have the dev-mode swap routes, return
//!   `processed_logprobs`, allow `model.max_seq_len` tokens and tokenize like
//!   `model.path`'s tokenizer; otherwise the worker refuses to start with one
//!   line naming the setting.
//! - **Weights.** Each version is written to `weights_dir/<worker>/v<N>/`
//!   (temp name, then rename) and every server goes through pause → reload
//!   → set version → reset prefix cache → resume. A step that fails leaves
//!   the server's weights unknown: it is marked down (its requests fail, so
//!   their tasks go back to the coordinator), restarted when the worker
//!   launched it, and reloaded with the newest version before it serves
//!   again. It never generates with mixed or unknown weights.
//! - **Tied LM heads.** vLLM ties `lm_head` to `embed_tokens` when it loads
//!   a model, but `reload_weights` copies tensors by name: a checkpoint
//!   without `lm_head.weight` leaves the head of the old weights in place
//!   (measured: log-probs matched neither version). For a model with
//!   `tie_word_embeddings` the worker writes `lm_head.weight` (a copy of
//!   the embedding) into every version folder.
//! - **Versions.** With version spans each token carries the version that
//!   sampled it. Without them (the completions route) a reply is only kept
//!   when no swap overlapped it, or when the swap aborted it (then every
//!   token came from the version it was sent under); anything else is
//!   resubmitted.

mod api;
mod launch;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::Context;
use async_trait::async_trait;
use asyncrl_config::{Config, EngineApi, PauseMode};
use asyncrl_policy::from_config::sampling_params_with_stops;
use asyncrl_policy::{FinishReason, ModelText, SamplingParams, SequenceOutput, SequenceRequest};
use bytes::Bytes;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

pub use api::VllmError;
use api::{
    Api, Choice, CompletionsRequest, GenerateRequest, GenerationReply, Models, NewVersion, OpenApi,
    ReloadKwargs, ReloadRequest, Sampling, ServerInfo, TokenizeRequest, Tokenized,
};
use launch::Launcher;

use super::{Engine, EngineCounters, EngineError, Readiness};
use crate::metrics::{WorkerMetrics, reason};

/// The text the start-up check tokenizes on both sides.
const TOKENIZER_PROBE: &str = "12+7=19 hello, world";
/// How often an idle server's `/health` is polled.
const HEALTH_EVERY: Duration = Duration::from_secs(2);
/// A request is resubmitted at most this often (weight swaps that abort it).
const MAX_RESUBMISSIONS: usize = 64;

/// Which generation route a server is driven through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Generate,
    Completions,
}

#[derive(Debug, Clone, PartialEq)]
enum ServerState {
    /// Serving the weights of `version` (-1: the folder it started with,
    /// before the first swap).
    Ready {
        version: i32,
    },
    /// A weight swap is in progress: new requests wait.
    Swapping,
    Down {
        reason: String,
    },
}

struct Server {
    api: Api,
    route: Route,
    model_id: String,
    state: watch::Sender<ServerState>,
    /// Bumped when a swap starts (before `/pause`).
    epoch: AtomicU64,
    /// Cancelled when the server goes down: its requests stop waiting.
    down: Mutex<CancellationToken>,
    in_flight: AtomicUsize,
    launcher: Option<Launcher>,
    /// One swap or recovery at a time.
    swap_lock: tokio::sync::Mutex<()>,
}

impl Server {
    fn down_token(&self) -> CancellationToken {
        self.down
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Marks the server down (once) and cancels its requests.
    fn mark_down(&self, why: String) {
        let changed = self.state.send_if_modified(|s| {
            if matches!(s, ServerState::Down { .. }) {
                false
            } else {
                *s = ServerState::Down {
                    reason: why.clone(),
                };
                true
            }
        });
        if changed {
            tracing::warn!(endpoint = %self.api.endpoint, reason = %why, "engine server down; its requests fail and their tasks go back");
            self.down_token().cancel();
        }
    }
}

/// The newest weights: what a recovering server reloads.
#[derive(Debug, Clone)]
struct Target {
    version: i32,
    dir: PathBuf,
}

struct Settings {
    /// The model ties its LM head to its embedding (see the module docs).
    tied_head: bool,
    pause_mode: PauseMode,
    ready_timeout: Duration,
    request_timeout: Duration,
    control_timeout: Duration,
    weights_dir: PathBuf,
    max_slots: usize,
    max_seq_len: usize,
}

/// vLLM servers as an [`Engine`].
pub struct VllmEngine {
    servers: Vec<Arc<Server>>,
    settings: Arc<Settings>,
    metrics: WorkerMetrics,
    target: Mutex<Option<Target>>,
    version: AtomicI32,
    tokens: AtomicU64,
    in_flight: AtomicUsize,
    readiness: watch::Sender<Readiness>,
    next: AtomicUsize,
    stop: CancellationToken,
}

/// Starts (or attaches to) the servers of `[worker.engine]`, checks them
/// against `[model]`, and starts their watchers.
pub async fn build(
    config: &Config,
    max_sequences: usize,
    worker_id: &str,
    metrics: WorkerMetrics,
) -> anyhow::Result<(Arc<VllmEngine>, ModelText, SamplingParams)> {
    let e = &config.worker.engine;
    let model = &config.model;
    let dir = model.path.as_deref().ok_or_else(|| {
        anyhow::anyhow!(
            "`model.path` is not set: worker.engine.kind = \"vllm\" needs the Hugging Face folder the engine serves (its tokenizer tokenizes the prompts)"
        )
    })?;
    let text = ModelText::from_dir(dir).with_context(|| {
        format!(
            "`model.path` = {}: cannot read the model's tokenizer",
            dir.display()
        )
    })?;
    if model.top_p < 1.0 {
        anyhow::bail!(
            "`model.top_p` = {}: vLLM's processed log-probs are renormalized over the top-p nucleus, the learner's are over the whole vocabulary; set model.top_p = 1 with worker.engine.kind = \"vllm\"",
            model.top_p
        );
    }
    let params = sampling_params_with_stops(model, text.eos_token_ids().to_vec());
    let tied_head = asyncrl_policy::ModelConfig::from_file(&dir.join("config.json"))
        .with_context(|| format!("`model.path` = {}: cannot read config.json", dir.display()))?
        .tie_word_embeddings;
    let settings = Arc::new(Settings {
        tied_head,
        pause_mode: e.pause_mode,
        ready_timeout: e.ready_timeout,
        request_timeout: e.request_timeout,
        control_timeout: e.control_timeout,
        // Absolute: the engine resolves it, from its own working directory.
        weights_dir: std::path::absolute(e.weights_dir.join(worker_id)).with_context(|| {
            format!(
                "`worker.engine.weights_dir` = {}: cannot make it absolute",
                e.weights_dir.display()
            )
        })?,
        max_slots: max_sequences,
        max_seq_len: model.max_seq_len,
    });
    std::fs::create_dir_all(&settings.weights_dir).with_context(|| {
        format!(
            "`worker.engine.weights_dir`: cannot create {}",
            settings.weights_dir.display()
        )
    })?;
    let http = reqwest::Client::builder()
        .build()
        .context("cannot build the HTTP client")?;
    let stop = CancellationToken::new();
    let mut servers: Vec<Arc<Server>> = Vec::new();
    for endpoint in &e.endpoints {
        let api = Api::new(endpoint, http.clone());
        let launcher = (!e.launch.is_empty()).then(|| Launcher::new(e.launch.clone(), endpoint));
        let mut exited = None;
        if let Some(l) = &launcher {
            exited =
                Some(l.start().with_context(|| {
                    format!("`worker.engine.launch`: cannot start {:?}", e.launch)
                })?);
        }
        let started = async {
            wait_healthy(
                &api,
                settings.ready_timeout,
                exited.as_mut(),
                launcher.as_ref(),
            )
            .await
            .map_err(anyhow::Error::msg)?;
            probe(
                &api,
                e.api,
                e.pause_mode,
                &text,
                model.max_seq_len,
                settings.control_timeout,
            )
            .await
        }
        .await;
        let (route, model_id) = match started {
            Ok(x) => x,
            Err(err) => {
                if let Some(l) = &launcher {
                    l.stop(Duration::from_secs(5)).await;
                }
                for s in &servers {
                    stop_server(s).await;
                }
                return Err(err);
            }
        };
        tracing::info!(endpoint = %api.endpoint, route = ?route, model = %model_id, launched = launcher.is_some(), "vLLM server ready");
        let server = Arc::new(Server {
            api,
            route,
            model_id,
            state: watch::Sender::new(ServerState::Ready { version: -1 }),
            epoch: AtomicU64::new(0),
            down: Mutex::new(CancellationToken::new()),
            in_flight: AtomicUsize::new(0),
            launcher,
            swap_lock: tokio::sync::Mutex::new(()),
        });
        if let Some(rx) = exited {
            tokio::spawn(watch_exit(server.clone(), rx, stop.clone()));
        }
        servers.push(server);
    }
    metrics.engine_servers_ready.set(servers.len() as i64);
    let engine = Arc::new(VllmEngine {
        servers,
        settings,
        metrics,
        target: Mutex::new(None),
        version: AtomicI32::new(-1),
        tokens: AtomicU64::new(0),
        in_flight: AtomicUsize::new(0),
        readiness: watch::Sender::new(Readiness::Ready),
        next: AtomicUsize::new(0),
        stop,
    });
    for server in &engine.servers {
        tokio::spawn(recover_loop(engine.clone(), server.clone()));
        tokio::spawn(health_loop(server.clone(), engine.stop.clone()));
    }
    Ok((engine, text, params))
}

/// Waits until `/health` answers, the launched process exits, or `limit`.
async fn wait_healthy(
    api: &Api,
    limit: Duration,
    mut exited: Option<&mut watch::Receiver<Option<String>>>,
    launcher: Option<&Launcher>,
) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if api.healthy(Duration::from_secs(5)).await {
            return Ok(());
        }
        if let Some(rx) = exited.as_deref_mut()
            && let Some(status) = rx.borrow().clone()
        {
            let lines = launcher.map(Launcher::last_lines).unwrap_or_default();
            return Err(format!(
                "`worker.engine.launch`: the engine process for {} exited ({status}) before it answered /health; its last lines: {lines}",
                api.endpoint
            ));
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(format!(
                "`worker.engine.endpoints`: no vLLM server answered {}/health within {:?} (worker.engine.ready_timeout)",
                api.endpoint, limit
            ));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The start-up checks of one server; returns its route and model id.
async fn probe(
    api: &Api,
    want: EngineApi,
    pause_mode: PauseMode,
    text: &ModelText,
    max_seq_len: usize,
    timeout: Duration,
) -> anyhow::Result<(Route, String)> {
    let ep = &api.endpoint;
    let openapi: OpenApi = api.get(api::OPENAPI, timeout).await.with_context(|| {
        format!("`worker.engine.endpoints`: {ep} does not list its routes (is it a vLLM server?)")
    })?;
    let has = |r: &str| openapi.paths.contains_key(r);
    let missing: Vec<&str> = api::SWAP_ROUTES
        .iter()
        .copied()
        .filter(|r| !has(r))
        .collect();
    if !missing.is_empty() || !has("/server_info") {
        anyhow::bail!(
            "`worker.engine.endpoints`: {ep} lacks the weight-swap routes {missing:?} (and /server_info): start vLLM with VLLM_SERVER_DEV_MODE=1"
        );
    }
    let route = match want {
        EngineApi::Generate if !has(api::GENERATE) => anyhow::bail!(
            "`worker.engine.api` = \"generate\": {ep} has no {} (start vLLM with --enable-scale-out)",
            api::GENERATE
        ),
        EngineApi::Generate => Route::Generate,
        EngineApi::Completions => Route::Completions,
        EngineApi::Auto if has(api::GENERATE) => Route::Generate,
        EngineApi::Auto => Route::Completions,
    };
    if route == Route::Completions && pause_mode == PauseMode::Keep {
        anyhow::bail!(
            "`worker.engine.pause_mode` = \"keep\" needs per-token weight versions, and {ep} has no {} (start vLLM with --enable-scale-out, or use pause_mode = \"abort\")",
            api::GENERATE
        );
    }
    let info: ServerInfo = api
        .get(api::SERVER_INFO, timeout)
        .await
        .with_context(|| format!("`worker.engine.endpoints`: cannot read {ep}/server_info"))?;
    let mc = info.vllm_config.model_config;
    if mc.logprobs_mode != "processed_logprobs" {
        anyhow::bail!(
            "`worker.engine.endpoints`: {ep} returns {} log-probs; the learner compares post-temperature log-probs: start vLLM with --logprobs-mode processed_logprobs",
            mc.logprobs_mode
        );
    }
    if mc.max_model_len < max_seq_len as u64 {
        anyhow::bail!(
            "`model.max_seq_len` = {max_seq_len} but {ep} serves at most {} tokens (--max-model-len)",
            mc.max_model_len
        );
    }
    let models: Models = api.get(api::MODELS, timeout).await?;
    let model_id = models.data.first().map(|m| m.id.clone()).ok_or_else(|| {
        anyhow::anyhow!("`worker.engine.endpoints`: {ep}/v1/models lists no model")
    })?;
    let theirs: Tokenized = api
        .post(
            api::TOKENIZE,
            &TokenizeRequest {
                model: &model_id,
                prompt: TOKENIZER_PROBE,
                add_special_tokens: true,
            },
            timeout,
        )
        .await?;
    let ours = text
        .tokenizer()
        .encode(TOKENIZER_PROBE, true)
        .context("cannot tokenize the probe text")?;
    if theirs.tokens != ours {
        anyhow::bail!(
            "`model.path`: {ep} serves another model ({model_id}): it tokenizes {TOKENIZER_PROBE:?} as {:?}, model.path's tokenizer as {ours:?}",
            theirs.tokens
        );
    }
    tracing::debug!(endpoint = %ep, dtype = ?mc.dtype, max_model_len = mc.max_model_len, "vLLM start-up checks passed");
    Ok((route, model_id))
}

async fn stop_server(server: &Server) {
    if let Some(l) = &server.launcher {
        l.stop(Duration::from_secs(10)).await;
    }
}

/// Marks a launched server down when its process exits.
async fn watch_exit(
    server: Arc<Server>,
    mut exited: watch::Receiver<Option<String>>,
    stop: CancellationToken,
) {
    tokio::select! {
        _ = stop.cancelled() => {}
        r = exited.wait_for(Option::is_some) => {
            if let Ok(status) = r {
                let status = status.clone().unwrap_or_default();
                let lines = server.launcher.as_ref().map(Launcher::last_lines).unwrap_or_default();
                server.mark_down(format!("the engine process exited ({status}); last lines: {lines}"));
            }
        }
    }
}

/// Polls an idle server's `/health`; two misses in a row mark it down.
async fn health_loop(server: Arc<Server>, stop: CancellationToken) {
    let mut misses = 0;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(HEALTH_EVERY) => {}
        }
        if !matches!(*server.state.borrow(), ServerState::Ready { .. }) {
            misses = 0;
            continue;
        }
        if server.api.healthy(HEALTH_EVERY).await {
            misses = 0;
        } else {
            misses += 1;
            if misses >= 2 {
                server.mark_down(format!("{}/health does not answer", server.api.endpoint));
            }
        }
    }
}

/// Brings a server that went down back: restart it (launched) or wait for
/// it (attached), then reload the newest weights before it serves again.
async fn recover_loop(engine: Arc<VllmEngine>, server: Arc<Server>) {
    let mut state = server.state.subscribe();
    let mut backoff = asyncrl_common::Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
    loop {
        let down = tokio::select! {
            _ = engine.stop.cancelled() => return,
            r = state.wait_for(|s| matches!(s, ServerState::Down { .. })) => r.is_ok(),
        };
        if !down {
            return;
        }
        engine.update_readiness();
        let _guard = server.swap_lock.lock().await;
        let attempt = async {
            let mut exited = None;
            if let Some(l) = &server.launcher {
                l.stop(Duration::from_secs(10)).await;
                exited = Some(
                    l.start()
                        .map_err(|e| format!("cannot restart the engine process: {e}"))?,
                );
            }
            wait_healthy(
                &server.api,
                engine.settings.ready_timeout,
                exited.as_mut(),
                server.launcher.as_ref(),
            )
            .await?;
            if let Some(rx) = exited {
                tokio::spawn(watch_exit(server.clone(), rx, engine.stop.clone()));
            }
            let target = engine.target();
            let version = match &target {
                Some(t) => {
                    swap_steps(
                        &server,
                        engine.settings.pause_mode,
                        engine.settings.control_timeout,
                        t,
                    )
                    .await
                    .map_err(|e| e.to_string())?;
                    t.version
                }
                None => -1,
            };
            Ok::<i32, String>(version)
        };
        let result = tokio::select! {
            _ = engine.stop.cancelled() => return,
            r = attempt => r,
        };
        match result {
            Ok(version) => {
                backoff.reset();
                *server.down.lock().unwrap_or_else(PoisonError::into_inner) =
                    CancellationToken::new();
                server.state.send_replace(ServerState::Ready { version });
                engine.metrics.engine_recoveries.inc();
                tracing::info!(endpoint = %server.api.endpoint, version, "engine server recovered");
                engine.update_readiness();
            }
            Err(e) => {
                engine
                    .metrics
                    .engine_errors
                    .get_or_create(&reason("recovery"))
                    .inc();
                tracing::warn!(endpoint = %server.api.endpoint, error = %e, "engine server not recovered yet; retrying");
                let delay = backoff.next_delay();
                tokio::select! {
                    _ = engine.stop.cancelled() => return,
                    _ = tokio::time::sleep(delay) => {}
                }
                // Still down: the loop goes round again.
                server.state.send_modify(|s| {
                    if !matches!(s, ServerState::Down { .. }) {
                        *s = ServerState::Down { reason: e.clone() };
                    }
                });
            }
        }
    }
}

/// pause → reload from `target.dir` → set the version → reset the prefix
/// cache → resume. Any failure leaves the server's weights unknown.
async fn swap_steps(
    server: &Server,
    mode: PauseMode,
    timeout: Duration,
    target: &Target,
) -> Result<(), VllmError> {
    let api = &server.api;
    server.epoch.fetch_add(1, Ordering::SeqCst);
    let pause = match mode {
        PauseMode::Abort => api::PAUSE_ABORT,
        PauseMode::Keep => api::PAUSE_KEEP,
    };
    api.post_empty(pause, timeout).await?;
    let dir = target.dir.to_string_lossy();
    let _: serde_json::Value = api
        .post(
            api::COLLECTIVE_RPC,
            &ReloadRequest {
                method: "reload_weights",
                kwargs: ReloadKwargs {
                    weights_path: &dir,
                    is_checkpoint_format: true,
                },
            },
            timeout,
        )
        .await?;
    let _: serde_json::Value = api
        .post(
            api::UPDATE_WEIGHT_VERSION,
            &NewVersion {
                new_version: target.version.to_string(),
            },
            timeout,
        )
        .await?;
    api.post_empty(api::RESET_PREFIX_CACHE, timeout).await?;
    api.post_empty(api::RESUME, timeout).await?;
    Ok(())
}

impl VllmEngine {
    /// Times `reload_weights` of the newest version's folder on the first
    /// server, alone (no pause, no version, no cache reset): the baseline
    /// of `asyncrl bench engine`'s swap figure.
    pub async fn time_raw_reload(&self) -> Result<Duration, VllmError> {
        let target = self.target().ok_or_else(|| VllmError::Down {
            endpoint: String::new(),
            reason: "no weights loaded yet".into(),
        })?;
        let server = &self.servers[0];
        let _guard = server.swap_lock.lock().await;
        let dir = target.dir.to_string_lossy();
        let started = std::time::Instant::now();
        let _: serde_json::Value = server
            .api
            .post(
                api::COLLECTIVE_RPC,
                &ReloadRequest {
                    method: "reload_weights",
                    kwargs: ReloadKwargs {
                        weights_path: &dir,
                        is_checkpoint_format: true,
                    },
                },
                self.settings.control_timeout,
            )
            .await?;
        Ok(started.elapsed())
    }

    fn target(&self) -> Option<Target> {
        self.target
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn update_readiness(&self) {
        let ready = self
            .servers
            .iter()
            .filter(|s| !matches!(*s.state.borrow(), ServerState::Down { .. }))
            .count();
        self.metrics.engine_servers_ready.set(ready as i64);
        let r = if ready > 0 {
            Readiness::Ready
        } else {
            let why = self
                .servers
                .iter()
                .find_map(|s| match &*s.state.borrow() {
                    ServerState::Down { reason } => Some(reason.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            Readiness::NotReady(format!("no engine server is up: {why}"))
        };
        self.readiness.send_if_modified(|cur| {
            if *cur == r {
                false
            } else {
                *cur = r;
                true
            }
        });
    }

    /// The server with the fewest requests in flight among those up.
    fn pick(&self) -> Result<Arc<Server>, EngineError> {
        let n = self.servers.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        (0..n)
            .map(|i| &self.servers[(start + i) % n])
            .filter(|s| !matches!(*s.state.borrow(), ServerState::Down { .. }))
            .min_by_key(|s| s.in_flight.load(Ordering::Relaxed))
            .cloned()
            .ok_or_else(|| {
                EngineError::Unavailable(VllmError::Down {
                    endpoint: self
                        .servers
                        .iter()
                        .map(|s| s.api.endpoint.clone())
                        .collect::<Vec<_>>()
                        .join(","),
                    reason: "every engine server is down".into(),
                })
            })
    }

    fn count_error(&self, e: &VllmError) {
        let label = match e {
            VllmError::Unreachable { .. } | VllmError::Down { .. } => "unreachable",
            VllmError::Status { .. } => "status",
            VllmError::Malformed { .. } => "malformed",
            VllmError::Contract { .. } => "contract",
            VllmError::Mismatch { .. } => "mismatch",
            VllmError::Io { .. } => "io",
        };
        self.metrics
            .engine_errors
            .get_or_create(&reason(label))
            .inc();
    }

    /// Generates on `server` until the completion ends, resubmitting prompt
    /// + partial tokens when a weight swap aborts the request.
    async fn generate_on(
        &self,
        server: &Server,
        request: &SequenceRequest,
    ) -> Result<SequenceOutput, EngineError> {
        let params = &request.params;
        let prompt_len = request.prompt.len();
        let budget = params
            .max_new_tokens
            .min(self.settings.max_seq_len.saturating_sub(prompt_len));
        let limited_by_seq_len = budget < params.max_new_tokens;
        let mut out = SequenceOutput {
            id: 0,
            prompt: request.prompt.clone(),
            tokens: Vec::new(),
            logprobs: Vec::new(),
            versions: Vec::new(),
            finish_reason: FinishReason::MaxNewTokens,
            recomputations: 0,
        };
        let mut ids = request.prompt.clone();
        for _ in 0..MAX_RESUBMISSIONS {
            let remaining = budget - out.tokens.len();
            if remaining == 0 {
                out.finish_reason = if limited_by_seq_len {
                    FinishReason::MaxSeqLen
                } else {
                    FinishReason::MaxNewTokens
                };
                return Ok(out);
            }
            // Wait while the server swaps; fail when it is down.
            let mut state = server.state.subscribe();
            let version = loop {
                let s = state.borrow_and_update().clone();
                match s {
                    ServerState::Ready { version } => break version,
                    ServerState::Down { reason } => {
                        return Err(EngineError::Unavailable(VllmError::Down {
                            endpoint: server.api.endpoint.clone(),
                            reason,
                        }));
                    }
                    ServerState::Swapping => {
                        if state.changed().await.is_err() {
                            return Err(EngineError::Unavailable(VllmError::Down {
                                endpoint: server.api.endpoint.clone(),
                                reason: "the engine stopped".into(),
                            }));
                        }
                    }
                }
            };
            let epoch = server.epoch.load(Ordering::SeqCst);
            let down = server.down_token();
            let sampling = sampling(params, remaining);
            let call = async {
                match server.route {
                    Route::Generate => {
                        server
                            .api
                            .post::<_, GenerationReply>(
                                api::GENERATE,
                                &GenerateRequest {
                                    token_ids: &ids,
                                    sampling_params: &sampling,
                                },
                                self.settings.request_timeout,
                            )
                            .await
                    }
                    Route::Completions => {
                        server
                            .api
                            .post::<_, GenerationReply>(
                                api::COMPLETIONS,
                                &CompletionsRequest {
                                    model: &server.model_id,
                                    prompt: &ids,
                                    sampling: &sampling,
                                    return_token_ids: true,
                                },
                                self.settings.request_timeout,
                            )
                            .await
                    }
                }
            };
            let reply = tokio::select! {
                r = call => r,
                _ = down.cancelled() => Err(VllmError::Down {
                    endpoint: server.api.endpoint.clone(),
                    reason: "went down while generating".into(),
                }),
            };
            let route_name = match server.route {
                Route::Generate => api::GENERATE,
                Route::Completions => api::COMPLETIONS,
            };
            let reply = match reply {
                Ok(r) => r,
                Err(e) => {
                    self.count_error(&e);
                    if e.is_unreachable() {
                        server.mark_down(e.to_string());
                        self.update_readiness();
                        return Err(EngineError::Unavailable(e));
                    }
                    return Err(EngineError::Invalid(e));
                }
            };
            let contract = |reason: String| {
                let e = VllmError::Contract {
                    endpoint: server.api.endpoint.clone(),
                    route: route_name,
                    reason,
                };
                self.count_error(&e);
                EngineError::Invalid(e)
            };
            let Some(choice) = reply.choices.into_iter().next() else {
                return Err(contract("the reply has no choices".into()));
            };
            let part = read_choice(choice, remaining).map_err(contract)?;
            let versions = match server.route {
                Route::Generate => {
                    span_versions(&part.spans, part.tokens.len(), version).map_err(contract)?
                }
                Route::Completions => {
                    let now = server.epoch.load(Ordering::SeqCst);
                    let aborted_by_this_swap =
                        part.finish.as_deref() == Some("abort") && now == epoch + 1;
                    if now != epoch && !aborted_by_this_swap {
                        // A swap overlapped the request: which weights
                        // sampled it is unknown. Generate it again.
                        self.metrics.engine_resubmissions.inc();
                        continue;
                    }
                    vec![version; part.tokens.len()]
                }
            };
            self.tokens
                .fetch_add(part.tokens.len() as u64, Ordering::Relaxed);
            ids.extend_from_slice(&part.tokens);
            out.tokens.extend_from_slice(&part.tokens);
            out.logprobs.extend_from_slice(&part.logprobs);
            out.versions.extend_from_slice(&versions);
            match part.finish.as_deref() {
                Some("stop") => {
                    out.finish_reason = FinishReason::Stop;
                    return Ok(out);
                }
                Some("length") => {
                    out.finish_reason = if limited_by_seq_len {
                        FinishReason::MaxSeqLen
                    } else {
                        FinishReason::MaxNewTokens
                    };
                    return Ok(out);
                }
                Some("abort") => {
                    // A weight swap paused the server: go on from here.
                    out.recomputations += 1;
                    self.metrics.engine_resubmissions.inc();
                }
                other => {
                    return Err(contract(format!("unknown finish_reason {other:?}")));
                }
            }
        }
        Err(contract_error(
            server,
            format!("the request was aborted {MAX_RESUBMISSIONS} times in a row"),
        ))
    }
}

fn contract_error(server: &Server, reason: String) -> EngineError {
    EngineError::Invalid(VllmError::Contract {
        endpoint: server.api.endpoint.clone(),
        route: "",
        reason,
    })
}

/// The sampling parameters of one request with `max_tokens` left.
fn sampling(params: &SamplingParams, max_tokens: usize) -> Sampling {
    Sampling {
        max_tokens,
        temperature: params.temperature,
        top_p: params.top_p,
        logprobs: 0,
        stop_token_ids: params.stop_token_ids.clone(),
        ignore_eos: true,
        seed: params.seed,
    }
}

/// One reply's tokens, log-probs, finish reason and version spans.
struct Part {
    tokens: Vec<i64>,
    logprobs: Vec<f32>,
    finish: Option<String>,
    spans: Option<Vec<api::VersionSpan>>,
}

fn read_choice(choice: Choice, max_tokens: usize) -> Result<Part, String> {
    let tokens = choice
        .token_ids
        .ok_or("the reply has no token_ids (is return_token_ids supported?)")?;
    if tokens.len() > max_tokens {
        return Err(format!(
            "{} tokens returned, at most {max_tokens} asked for",
            tokens.len()
        ));
    }
    let lp = choice.logprobs.ok_or("the reply has no logprobs")?;
    let logprobs: Vec<f32> = match (lp.content, lp.token_logprobs) {
        (Some(content), _) => content.iter().map(|t| t.logprob as f32).collect(),
        (None, Some(list)) => list
            .iter()
            .map(|x| x.map(|v| v as f32).ok_or("a token has no log-prob"))
            .collect::<Result<_, _>>()?,
        (None, None) => return Err("the reply's logprobs hold no per-token values".into()),
    };
    if logprobs.len() != tokens.len() {
        return Err(format!(
            "{} log-probs for {} tokens",
            logprobs.len(),
            tokens.len()
        ));
    }
    if let Some(bad) = logprobs
        .iter()
        .find(|l| !(l.is_finite() || **l == f32::NEG_INFINITY) || **l > 1e-3)
    {
        return Err(format!("log-prob {bad} is not a log-probability"));
    }
    Ok(Part {
        tokens,
        logprobs,
        finish: choice.finish_reason,
        spans: choice.weight_versions,
    })
}

/// Per-token versions from the engine's spans. They must cover the tokens
/// exactly, in order, and never be older than `submitted` (the version the
/// server held when the request was sent).
fn span_versions(
    spans: &Option<Vec<api::VersionSpan>>,
    n: usize,
    submitted: i32,
) -> Result<Vec<i32>, String> {
    if n == 0 {
        return Ok(Vec::new());
    }
    let spans = spans.as_ref().ok_or("the reply has no weight_versions")?;
    let mut versions = Vec::with_capacity(n);
    for s in spans {
        if s.start != versions.len() || s.end < s.start || s.end > n {
            return Err(format!(
                "weight_versions span {}..{} does not continue at token {} of {n}",
                s.start,
                s.end,
                versions.len()
            ));
        }
        let v: i32 = s
            .version
            .as_deref()
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("weight version {:?} is not one this worker set", s.version))?;
        if v < submitted {
            return Err(format!(
                "tokens {}..{} carry version {v}, older than the {submitted} in use when the request was sent",
                s.start, s.end
            ));
        }
        if versions.last().is_some_and(|&last| v < last) {
            return Err(format!(
                "weight versions go backwards ({v} after {})",
                versions.last().unwrap_or(&v)
            ));
        }
        versions.extend(std::iter::repeat_n(v, s.end - s.start));
    }
    if versions.len() != n {
        return Err(format!(
            "weight_versions cover {} of {n} tokens",
            versions.len()
        ));
    }
    Ok(versions)
}

/// Writes `bytes` as `dir/v<version>/model.safetensors` (temp folder, then
/// rename) and removes older version folders.
fn write_version_dir(
    root: &Path,
    version: i32,
    bytes: &[u8],
    tied_head: bool,
) -> Result<PathBuf, VllmError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| VllmError::Io { path, source }
    };
    let final_dir = root.join(format!("v{version}"));
    if final_dir.join("model.safetensors").is_file() {
        return Ok(final_dir);
    }
    let tmp = root.join(format!(".v{version}.tmp-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
    }
    std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    let file = tmp.join("model.safetensors");
    let with_head;
    let bytes = if tied_head {
        with_head = with_tied_head(bytes).map_err(|e| VllmError::Io {
            path: file.clone(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
        })?;
        with_head.as_deref().unwrap_or(bytes)
    } else {
        bytes
    };
    std::fs::write(&file, bytes).map_err(io(&file))?;
    if final_dir.exists() {
        std::fs::remove_dir_all(&final_dir).map_err(io(&final_dir))?;
    }
    std::fs::rename(&tmp, &final_dir).map_err(io(&final_dir))?;
    Ok(final_dir)
}

/// The checkpoint with `lm_head.weight` = `model.embed_tokens.weight`
/// added, or None when it has its head already (or no embedding).
fn with_tied_head(bytes: &[u8]) -> Result<Option<Vec<u8>>, safetensors::SafeTensorError> {
    let st = safetensors::SafeTensors::deserialize(bytes)?;
    let names = st.names();
    if names.contains(&"lm_head.weight") {
        return Ok(None);
    }
    let Ok(embed) = st.tensor("model.embed_tokens.weight") else {
        return Ok(None);
    };
    let mut tensors: Vec<(String, safetensors::tensor::TensorView<'_>)> = st.tensors();
    tensors.push(("lm_head.weight".to_owned(), embed));
    safetensors::serialize(tensors, None).map(Some)
}

/// Removes every version folder (and stale temp folder) but `keep`.
fn prune_version_dirs(root: &Path, keep: &Path) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if path == keep || !(name.starts_with('v') || name.starts_with(".v")) {
            continue;
        }
        if let Err(e) = std::fs::remove_dir_all(&path) {
            tracing::warn!(path = %path.display(), error = %e, "cannot remove an old weights folder");
        }
    }
}

#[async_trait]
impl Engine for VllmEngine {
    fn kind(&self) -> &'static str {
        "vllm"
    }

    async fn generate(&self, request: SequenceRequest) -> Result<SequenceOutput, EngineError> {
        if request.prompt.is_empty() {
            return Err(EngineError::Invalid(VllmError::Contract {
                endpoint: String::new(),
                route: "",
                reason: "empty prompt".into(),
            }));
        }
        let server = self.pick()?;
        server.in_flight.fetch_add(1, Ordering::Relaxed);
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        let r = self.generate_on(&server, &request).await;
        server.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        r
    }

    async fn load_weights(&self, bytes: Bytes, version: i32) -> Result<(), EngineError> {
        let root = self.settings.weights_dir.clone();
        let tied = self.settings.tied_head;
        let dir =
            tokio::task::spawn_blocking(move || write_version_dir(&root, version, &bytes, tied))
                .await
                .map_err(|e| {
                    EngineError::Unavailable(VllmError::Io {
                        path: self.settings.weights_dir.clone(),
                        source: std::io::Error::other(e),
                    })
                })?
                .map_err(EngineError::Unavailable)?;
        let target = Target { version, dir };
        *self.target.lock().unwrap_or_else(PoisonError::into_inner) = Some(target.clone());
        let mut loaded = 0;
        let mut first_error = None;
        for server in &self.servers {
            let _guard = server.swap_lock.lock().await;
            match server.state.borrow().clone() {
                ServerState::Down { reason } => {
                    // Its recovery reloads the target.
                    first_error.get_or_insert(EngineError::Unavailable(VllmError::Down {
                        endpoint: server.api.endpoint.clone(),
                        reason,
                    }));
                    continue;
                }
                ServerState::Ready { version: v } if v == version => {
                    loaded += 1;
                    continue;
                }
                _ => {}
            }
            server.state.send_replace(ServerState::Swapping);
            let started = std::time::Instant::now();
            match swap_steps(
                server,
                self.settings.pause_mode,
                self.settings.control_timeout,
                &target,
            )
            .await
            {
                Ok(()) => {
                    server.state.send_replace(ServerState::Ready { version });
                    loaded += 1;
                    tracing::debug!(endpoint = %server.api.endpoint, version, swap_ms = started.elapsed().as_millis() as u64, "engine weights swapped");
                }
                Err(e) => {
                    self.count_error(&e);
                    self.metrics
                        .engine_errors
                        .get_or_create(&reason("swap"))
                        .inc();
                    let rejected = matches!(e, VllmError::Status { .. });
                    server.mark_down(format!("weight swap to version {version} failed: {e}"));
                    first_error.get_or_insert(if rejected {
                        EngineError::Rejected(e)
                    } else {
                        EngineError::Unavailable(e)
                    });
                }
            }
        }
        self.update_readiness();
        if loaded > 0 {
            self.version.fetch_max(version, Ordering::SeqCst);
            let root = self.settings.weights_dir.clone();
            let keep = target.dir.clone();
            tokio::task::spawn_blocking(move || prune_version_dirs(&root, &keep));
            return Ok(());
        }
        Err(first_error.unwrap_or_else(|| {
            EngineError::Unavailable(VllmError::Down {
                endpoint: String::new(),
                reason: "no engine server".into(),
            })
        }))
    }

    fn version(&self) -> i32 {
        self.version.load(Ordering::SeqCst)
    }

    fn counters(&self) -> EngineCounters {
        EngineCounters {
            in_flight: self.in_flight.load(Ordering::Relaxed),
            tokens_generated: self.tokens.load(Ordering::Relaxed),
        }
    }

    fn max_slots(&self) -> usize {
        self.settings.max_slots
    }

    fn max_seq_len(&self) -> usize {
        self.settings.max_seq_len
    }

    fn readiness(&self) -> watch::Receiver<Readiness> {
        self.readiness.subscribe()
    }

    async fn shutdown(&self) {
        self.stop.cancel();
        for s in &self.servers {
            stop_server(s).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(v: &str, start: usize, end: usize) -> api::VersionSpan {
        api::VersionSpan {
            version: Some(v.into()),
            start,
            end,
        }
    }

    #[test]
    fn version_spans_must_cover_the_tokens_in_order() {
        assert_eq!(
            span_versions(&Some(vec![span("3", 0, 2), span("4", 2, 3)]), 3, 3).unwrap(),
            vec![3, 3, 4]
        );
        for (spans, why) in [
            (None, "no weight_versions"),
            (Some(vec![span("3", 0, 2)]), "cover 2 of 3"),
            (Some(vec![span("3", 1, 3)]), "does not continue"),
            (Some(vec![span("2", 0, 3)]), "older than"),
            (Some(vec![span("4", 0, 1), span("3", 1, 3)]), "backwards"),
            (Some(vec![span("default", 0, 3)]), "not one this worker set"),
            (Some(vec![span("3", 0, 4)]), "does not continue"),
        ] {
            let err = span_versions(&spans, 3, 3).unwrap_err();
            assert!(err.contains(why), "{err} should say {why}");
        }
        assert!(span_versions(&None, 0, 3).unwrap().is_empty());
    }

    #[test]
    fn tied_heads_are_written_out() {
        let embed: Vec<u8> = (0..24u8).collect();
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2, 3], &embed)
                .unwrap();
        let bytes = safetensors::serialize(vec![("model.embed_tokens.weight", view.clone())], None)
            .unwrap();
        let with = with_tied_head(&bytes).unwrap().unwrap();
        let st = safetensors::SafeTensors::deserialize(&with).unwrap();
        assert_eq!(st.tensor("lm_head.weight").unwrap().data(), &embed[..]);
        assert_eq!(
            st.tensor("model.embed_tokens.weight").unwrap().data(),
            &embed[..]
        );
        // A checkpoint with its own head stays as it is.
        assert!(with_tied_head(&with).unwrap().is_none());
        let root = tempfile::tempdir().unwrap();
        let dir = write_version_dir(root.path(), 3, &bytes, true).unwrap();
        let written = std::fs::read(dir.join("model.safetensors")).unwrap();
        assert_eq!(written, with);
    }

    #[test]
    fn version_folders_are_written_whole_and_old_ones_pruned() {
        let root = tempfile::tempdir().unwrap();
        let a = write_version_dir(root.path(), 1, b"one", false).unwrap();
        let b = write_version_dir(root.path(), 2, b"two", false).unwrap();
        assert_eq!(std::fs::read(b.join("model.safetensors")).unwrap(), b"two");
        std::fs::create_dir_all(root.path().join(".v3.tmp-1")).unwrap();
        std::fs::write(root.path().join("unrelated.txt"), b"x").unwrap();
        prune_version_dirs(root.path(), &b);
        assert!(!a.exists());
        assert!(b.exists());
        assert!(!root.path().join(".v3.tmp-1").exists());
        assert!(root.path().join("unrelated.txt").exists());
    }
}
