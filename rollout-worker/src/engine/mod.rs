//! The engine boundary: what the worker asks of whatever generates its
//! completions.
//!
//! The worker keeps its job (acquire tasks, run G completions per task,
//! score, publish token-exact trajectories, complete, heartbeat, drain);
//! only generation and weight swaps go through [`Engine`]. Two engines
//! implement it:
//!
//! - [`builtin::BuiltinEngine`]: the tch model on the worker's own model
//!   thread ([`asyncrl_policy::ModelHandle`]), the default;
//! - [`vllm::VllmEngine`]: one or more vLLM servers over HTTP, token ids in
//!   and out, weights reloaded from a per-version folder.
//!
//! Every engine keeps the worker's token contract: a [`SequenceOutput`]
//! holds the sampled ids, their log-probs `log_softmax(logits / τ)` over the
//! full vocabulary under the weights that sampled them, and each token's
//! policy version (never older than the version in use when the request
//! was made). An SGLang backend would be a third implementation.

pub mod builtin;
pub mod vllm;

use std::sync::Arc;

use async_trait::async_trait;
use asyncrl_config::{Config, EngineKind};
use asyncrl_policy::{ModelText, PolicyError, SamplingParams, SequenceOutput, SequenceRequest};
use bytes::Bytes;
use tokio::sync::watch;

pub use builtin::BuiltinEngine;
pub use vllm::{VllmEngine, VllmError};

/// Counters an engine keeps (sampled into the worker's metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineCounters {
    /// Sequences being generated now.
    pub in_flight: usize,
    /// Completion tokens generated so far.
    pub tokens_generated: u64,
    /// Prompt positions taken from another sequence's KV cache instead of
    /// computed (the built-in engine's prompt sharing; vLLM reports its
    /// prefix cache in its own metrics, and 0 here).
    pub prompt_tokens_shared: u64,
}

/// Whether an engine can generate now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    Ready,
    /// Down or restarting, with the reason; generation requests fail with
    /// [`EngineError::Unavailable`] meanwhile.
    NotReady(String),
}

/// Why an engine call failed. The worker branches on the kind: a task whose
/// generation hit `Unavailable` goes back to the coordinator and the worker
/// carries on; `Gone` stops the worker; `Rejected` weights are not retried.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The built-in model thread stopped: nothing more can be generated.
    #[error("the model thread stopped")]
    Gone,
    /// The built-in model failed this request.
    #[error(transparent)]
    Model(PolicyError),
    /// The engine cannot serve now (down, restarting, unreachable); it
    /// recovers on its own.
    #[error("the engine is unavailable: {0}")]
    Unavailable(#[source] VllmError),
    /// The engine answered, but not as the contract says (malformed reply,
    /// impossible versions, an error status).
    #[error("the engine's reply was refused: {0}")]
    Invalid(#[source] VllmError),
    /// The engine refused these weights (they do not fit its model): the
    /// same bytes would fail again.
    #[error("the engine cannot load these weights: {0}")]
    Rejected(#[source] VllmError),
}

impl From<PolicyError> for EngineError {
    fn from(e: PolicyError) -> Self {
        match e {
            PolicyError::ModelThreadGone => EngineError::Gone,
            other => EngineError::Model(other),
        }
    }
}

/// What generates the worker's completions. Methods take `&self` and may be
/// called concurrently (one `generate` per sequence).
#[async_trait]
pub trait Engine: Send + Sync {
    /// `builtin` or `vllm` (logs and metrics).
    fn kind(&self) -> &'static str;
    /// Generates one completion of `request.prompt`, token-exact.
    async fn generate(&self, request: SequenceRequest) -> Result<SequenceOutput, EngineError>;
    /// Swaps in the weights of `version` (safetensors bytes, already
    /// checked against the announced sha256). Sequences in flight continue
    /// (their later tokens carry the new version) or are resubmitted.
    async fn load_weights(&self, bytes: Bytes, version: i32) -> Result<(), EngineError>;
    /// Whether it loads a `shared_path` version folder itself
    /// ([`Engine::load_weights_folder`]) rather than from bytes.
    fn loads_folders(&self) -> bool {
        false
    }
    /// Swaps in the weights of `version` from a Hugging Face folder whose
    /// files were checked against the announcement (only called when
    /// [`Engine::loads_folders`]).
    async fn load_weights_folder(
        &self,
        dir: &std::path::Path,
        version: i32,
    ) -> Result<(), EngineError> {
        let _ = version;
        Err(EngineError::Rejected(VllmError::Io {
            path: dir.to_owned(),
            source: std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                "this engine loads weights from bytes, not from a folder",
            ),
        }))
    }
    /// The version of the weights in use (-1: none loaded yet).
    fn version(&self) -> i32;
    fn counters(&self) -> EngineCounters;
    /// How many sequences it generates at once (the worker's slots).
    fn max_slots(&self) -> usize;
    /// The longest prompt + completion, in tokens.
    fn max_seq_len(&self) -> usize;
    /// Follows the engine's readiness.
    fn readiness(&self) -> watch::Receiver<Readiness>;
    /// Stops what the engine started (a launched server process).
    async fn shutdown(&self);
}

/// An engine, the text side of its model, and the sampling parameters.
pub struct Built {
    pub engine: Arc<dyn Engine>,
    pub text: ModelText,
    pub params: SamplingParams,
}

/// The engine `[worker.engine]` asks for, and the text side of `[model]`
/// (what the worker does at start; benches use it too). `metrics` is the
/// worker's set (engine errors and recoveries are counted there).
pub async fn build(
    config: &Config,
    max_sequences: usize,
    worker_id: &str,
    metrics: crate::metrics::WorkerMetrics,
) -> anyhow::Result<Built> {
    match config.worker.engine.kind {
        EngineKind::Builtin => builtin::build(config, max_sequences).await,
        EngineKind::Vllm => {
            let (engine, text, params) =
                vllm::build(config, max_sequences, worker_id, metrics).await?;
            Ok(Built {
                engine,
                text,
                params,
            })
        }
    }
}
