//! The built-in engine: the tch policy on the worker's own model thread,
//! continuous batching with weight swaps between decoding steps (see
//! [`asyncrl_policy::DecodeBatch`]).

use std::sync::Arc;

use anyhow::Context;
use async_trait::async_trait;
use asyncrl_config::Config;
use asyncrl_policy::from_config::{load_policy, sampling_params};
use asyncrl_policy::{
    DecodeBatchOptions, EngineOptions, ModelHandle, SequenceOutput, SequenceRequest,
};
use bytes::Bytes;
use tokio::sync::watch;

use super::{Built, Engine, EngineCounters, EngineError, Readiness};

/// The policy on its own thread, as an [`Engine`].
pub struct BuiltinEngine {
    model: ModelHandle,
    readiness: watch::Sender<Readiness>,
}

impl BuiltinEngine {
    pub fn new(model: ModelHandle) -> Self {
        Self {
            model,
            readiness: watch::Sender::new(Readiness::Ready),
        }
    }

    pub fn model(&self) -> &ModelHandle {
        &self.model
    }
}

/// Builds the model of `[model]` on its own thread (pinned to
/// `worker.cpu_affinity`) with `max_sequences` slots.
pub(crate) async fn build(config: &Config, max_sequences: usize) -> anyhow::Result<Built> {
    let section = config.model.clone();
    let seed = config.run.seed;
    let opts = EngineOptions {
        batch: DecodeBatchOptions {
            max_slots: max_sequences,
            max_seq_len: section.max_seq_len,
        },
        share_prompts: config.worker.share_prompts,
        thread_name: "asyncrl-worker-model".into(),
    };
    let cores = config.worker.cpu_affinity.clone();
    let load_section = section.clone();
    let model = ModelHandle::spawn(opts, move || {
        // Before libtorch starts its threads: they inherit the mask.
        if let Err(e) = asyncrl_policy::pin_current_thread(&cores) {
            tracing::warn!(cores = ?cores, error = %e, "cannot pin the model thread");
        }
        load_policy(&load_section, seed)
    })
    .await
    .context("cannot start the built-in model (`[model]`)")?;
    from_model(model, &section).await
}

/// Wraps a running model thread (tests, benches, a shared model).
pub(crate) async fn from_model(
    model: ModelHandle,
    section: &asyncrl_config::ModelConfig,
) -> anyhow::Result<Built> {
    let section = section.clone();
    let (text, params) = model
        .with_policy(move |p| (p.text(), sampling_params(&section, p)))
        .await
        .context("the built-in model thread stopped")?;
    let text = text.context("the built-in model has no tokenizer")?;
    Ok(Built {
        engine: Arc::new(BuiltinEngine::new(model)),
        text,
        params,
    })
}

#[async_trait]
impl Engine for BuiltinEngine {
    fn kind(&self) -> &'static str {
        "builtin"
    }

    async fn generate(&self, request: SequenceRequest) -> Result<SequenceOutput, EngineError> {
        Ok(self.model.generate(request).await?)
    }

    async fn load_weights(&self, bytes: Bytes, version: i32) -> Result<(), EngineError> {
        Ok(self.model.load_weights(bytes, version).await?)
    }

    fn version(&self) -> i32 {
        self.model.version()
    }

    fn counters(&self) -> EngineCounters {
        let s = self.model.stats();
        EngineCounters {
            in_flight: s.in_flight,
            tokens_generated: s.tokens_generated,
            prompt_tokens_shared: s.positions_shared,
        }
    }

    fn max_slots(&self) -> usize {
        self.model.batch_options().max_slots
    }

    fn max_seq_len(&self) -> usize {
        self.model.batch_options().max_seq_len
    }

    fn readiness(&self) -> watch::Receiver<Readiness> {
        self.readiness.subscribe()
    }

    async fn shutdown(&self) {}
}
