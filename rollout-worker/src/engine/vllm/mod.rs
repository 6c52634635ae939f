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
//!   (temp name, then rename), or, under the `shared_path` transport, the
//!   announced folder is reloaded in place once its files match the
//!   announcement (no copy; a tied head still goes through a copy, below),
//!   and every server goes through pause → reload
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
mod checks;
mod folders;
mod lifecycle;
mod reply;
mod server;

use std::path::PathBuf;
use std::sync::atomic::{AtomicI32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::Context;
use async_trait::async_trait;
use asyncrl_config::{Config, PauseMode};
use asyncrl_policy::from_config::sampling_params_with_stops;
use asyncrl_policy::{FinishReason, ModelText, SamplingParams, SequenceOutput, SequenceRequest};
use bytes::Bytes;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

pub use api::VllmError;
use api::{Api, CompletionsRequest, GenerateRequest, GenerationReply, Route};
use checks::probe;
use folders::{prune_version_dirs, write_version_dir};
use lifecycle::Lifecycle;
/// The live (not zombie) processes of a process group (a launched
/// server's, in tests of its lifecycle).
pub use lifecycle::group_members;
use reply::{read_choice, sampling, span_versions};
use server::{Server, ServerState, Target};

use super::{Engine, EngineCounters, EngineError, Readiness};
use crate::metrics::{WorkerMetrics, reason};

/// A request is resubmitted at most this often (weight swaps that abort it).
const MAX_RESUBMISSIONS: usize = 64;

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
    let tied_head = text.tie_word_embeddings();
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
        let lifecycle = Lifecycle::new(api.clone(), &e.launch, settings.ready_timeout);
        let started = async {
            let exit = lifecycle.start().await?;
            let checked = probe(
                &api,
                e.api,
                e.pause_mode,
                &text,
                model.max_seq_len,
                settings.control_timeout,
            )
            .await?;
            anyhow::Ok((checked, exit))
        }
        .await;
        let ((route, model_id), exit) = match started {
            Ok(x) => x,
            Err(err) => {
                lifecycle.stop(Duration::from_secs(5)).await;
                for s in &servers {
                    s.lifecycle.stop(Duration::from_secs(10)).await;
                }
                return Err(err);
            }
        };
        tracing::info!(endpoint = %api.endpoint, route = ?route, model = %model_id, launched = lifecycle.launched(), "vLLM server ready");
        let server = Arc::new(Server::new(api, route, model_id, lifecycle));
        if let Some(exit) = exit {
            tokio::spawn(server.clone().watch_exit(exit, stop.clone()));
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
        tokio::spawn(engine.clone().recover_loop(server.clone()));
        tokio::spawn(server.clone().health_loop(engine.stop.clone()));
    }
    Ok((engine, text, params))
}

impl VllmEngine {
    /// Makes `target` the weights every server serves: each ready server
    /// swaps to it (a down one reloads it when it recovers).
    async fn swap_to(&self, target: Target) -> Result<(), EngineError> {
        let version = target.version;
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
            match server
                .swap(
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

    /// Times `reload_weights` of the newest version's folder on the first
    /// server, alone (no pause, no version, no cache reset): the baseline
    /// of `asyncrl-bench engine`'s swap figure.
    pub async fn time_raw_reload(&self) -> Result<Duration, VllmError> {
        let target = self.target().ok_or_else(|| VllmError::Down {
            endpoint: String::new(),
            reason: "no weights loaded yet".into(),
        })?;
        let server = &self.servers[0];
        let _guard = server.swap_lock.lock().await;
        let started = std::time::Instant::now();
        server
            .api
            .reload_weights(&target.dir, self.settings.control_timeout)
            .await?;
        Ok(started.elapsed())
    }

    fn target(&self) -> Option<Target> {
        self.target
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Brings a server that went down back: restart it (launched) or wait
    /// for it (attached), then reload the newest weights before it serves
    /// again.
    async fn recover_loop(self: Arc<Self>, server: Arc<Server>) {
        let mut state = server.state.subscribe();
        let mut backoff =
            asyncrl_common::Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
        loop {
            let down = tokio::select! {
                _ = self.stop.cancelled() => return,
                r = state.wait_for(|s| matches!(s, ServerState::Down { .. })) => r.is_ok(),
            };
            if !down {
                return;
            }
            self.update_readiness();
            let _guard = server.swap_lock.lock().await;
            let attempt = async {
                if let Some(exit) = server.lifecycle.restart().await? {
                    tokio::spawn(server.clone().watch_exit(exit, self.stop.clone()));
                }
                let version = match self.target() {
                    Some(t) => {
                        server
                            .swap(self.settings.pause_mode, self.settings.control_timeout, &t)
                            .await
                            .map_err(|e| e.to_string())?;
                        t.version
                    }
                    None => -1,
                };
                Ok::<i32, String>(version)
            };
            let result = tokio::select! {
                _ = self.stop.cancelled() => return,
                r = attempt => r,
            };
            match result {
                Ok(version) => {
                    backoff.reset();
                    server.mark_up(version);
                    self.metrics.engine_recoveries.inc();
                    tracing::info!(endpoint = %server.api.endpoint, version, "engine server recovered");
                    self.update_readiness();
                }
                Err(e) => {
                    self.metrics
                        .engine_errors
                        .get_or_create(&reason("recovery"))
                        .inc();
                    tracing::warn!(endpoint = %server.api.endpoint, error = %e, "engine server not recovered yet; retrying");
                    let delay = backoff.next_delay();
                    tokio::select! {
                        _ = self.stop.cancelled() => return,
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

    fn update_readiness(&self) {
        let ready = self.servers.iter().filter(|s| !s.is_down()).count();
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
            .filter(|s| !s.is_down())
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
                    route: server.route.path(),
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
        self.swap_to(Target { version, dir }).await
    }

    /// A model with a tied head needs `lm_head.weight` added to what it
    /// reloads ([`folders::with_tied_head`]), so it loads from bytes.
    fn loads_folders(&self) -> bool {
        !self.settings.tied_head
    }

    async fn load_weights_folder(
        &self,
        dir: &std::path::Path,
        version: i32,
    ) -> Result<(), EngineError> {
        self.swap_to(Target {
            version,
            dir: dir.to_owned(),
        })
        .await
    }

    fn version(&self) -> i32 {
        self.version.load(Ordering::SeqCst)
    }

    fn counters(&self) -> EngineCounters {
        EngineCounters {
            in_flight: self.in_flight.load(Ordering::Relaxed),
            tokens_generated: self.tokens.load(Ordering::Relaxed),
            prompt_tokens_shared: 0,
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
            s.lifecycle.stop(Duration::from_secs(10)).await;
        }
    }
}
