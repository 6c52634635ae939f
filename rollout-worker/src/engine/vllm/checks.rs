//! The start-up checks of one server: it has the dev-mode swap routes and
//! the generation route `worker.engine.api` asks for, returns processed
//! log-probs, allows `model.max_seq_len` tokens and tokenizes like
//! `model.path`'s tokenizer.

use std::time::Duration;

use anyhow::Context;
use asyncrl_config::{EngineApi, PauseMode};
use asyncrl_policy::ModelText;

use super::api::{self, Api, Models, OpenApi, Route, ServerInfo, TokenizeRequest, Tokenized};

/// The text the start-up check tokenizes on both sides.
const TOKENIZER_PROBE: &str = "12+7=19 hello, world";

/// The start-up checks of one server; returns its route and model id.
pub(super) async fn probe(
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
