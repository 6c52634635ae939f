//! A server's life: readiness at start, the start-up checks, its process,
//! health, recovery, and the weight-swap steps.

use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use anyhow::Context;
use asyncrl_config::{EngineApi, PauseMode};
use asyncrl_policy::ModelText;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::api::{
    self, Api, Models, NewVersion, OpenApi, ServerInfo, TokenizeRequest, Tokenized, VllmError,
};
use super::launch::Launcher;
use super::{HEALTH_EVERY, Route, Server, ServerState, TOKENIZER_PROBE, Target, VllmEngine};
use crate::metrics::reason;

/// Waits until `/health` answers, the launched process exits, or `limit`.
pub(super) async fn wait_healthy(
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

pub(super) async fn stop_server(server: &Server) {
    if let Some(l) = &server.launcher {
        l.stop(Duration::from_secs(10)).await;
    }
}

/// Marks a launched server down when its process exits.
pub(super) async fn watch_exit(
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
pub(super) async fn health_loop(server: Arc<Server>, stop: CancellationToken) {
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
pub(super) async fn recover_loop(engine: Arc<VllmEngine>, server: Arc<Server>) {
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
pub(super) async fn swap_steps(
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
    api.reload_weights(&target.dir, timeout).await?;
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
