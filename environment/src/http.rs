//! The HTTP client of an environment server (see the crate's `PROTOCOL`).

use std::time::Duration;

use async_trait::async_trait;
use serde::Deserialize;
use tokio::time::Instant;

use crate::error::one_line;
use crate::{
    Action, EnvError, EnvMessage, EnvMetrics, EnvSetupError, EnvTask, Environment, Observation,
    ROLES, StepResult,
};

/// The largest reply body read; a larger one is malformed.
pub const MAX_REPLY_BYTES: usize = 16 << 20;

/// Characters of a reply body quoted in an error.
const EXCERPT_CHARS: usize = 300;

/// Settings of an [`HttpEnvironment`].
#[derive(Debug, Clone, PartialEq)]
pub struct HttpEnvSettings {
    /// The server's base URL, `http://host:port` (a path prefix is kept:
    /// `http://host:port/env` calls `http://host:port/env/reset`).
    pub url: String,
    /// The bound on each attempt: connecting, sending and reading the whole
    /// reply.
    pub call_timeout: Duration,
    /// Attempts after the first on a transient failure (timeout,
    /// connection, 5xx, 408, 429); 0: none.
    pub retries: u32,
    /// The delay before the first retry and the most any retry waits; the
    /// delay doubles from one retry to the next.
    pub backoff: (Duration, Duration),
}

impl HttpEnvSettings {
    /// `url` with a 30 s call timeout, 2 retries and a backoff from 100 ms
    /// to 2 s.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            call_timeout: Duration::from_secs(30),
            retries: 2,
            backoff: (Duration::from_millis(100), Duration::from_secs(2)),
        }
    }
}

/// An environment behind an HTTP server that speaks the crate's protocol.
/// Cheap to clone (the connection pool and the metrics are shared).
#[derive(Clone, Debug)]
pub struct HttpEnvironment {
    /// The base URL without a trailing `/`.
    base: String,
    settings: HttpEnvSettings,
    http: reqwest::Client,
    metrics: EnvMetrics,
}

/// The body of a `reset` or `step` reply.
#[derive(Deserialize)]
struct WireReply {
    observation: Observation,
    #[serde(default)]
    reward: Option<f64>,
    done: bool,
}

/// The body of a 4xx reply, when it is the protocol's.
#[derive(Deserialize)]
struct WireError {
    error: String,
}

impl HttpEnvironment {
    /// A client of the server at `settings.url`, counting into `metrics`
    /// ([`EnvMetrics`]). Nothing is sent until the first call.
    pub fn new(
        settings: HttpEnvSettings,
        metrics: &asyncrl_telemetry::Metrics,
    ) -> Result<Self, EnvSetupError> {
        let bad = |reason: &str| EnvSetupError::Url {
            url: settings.url.clone(),
            reason: reason.to_owned(),
        };
        let parsed = reqwest::Url::parse(&settings.url).map_err(|e| bad(&e.to_string()))?;
        if parsed.scheme() != "http" {
            return Err(bad(
                "only http:// is supported (the client is built without TLS)",
            ));
        }
        if parsed.query().is_some() || parsed.fragment().is_some() {
            return Err(bad("must not have a query or a fragment"));
        }
        if settings.call_timeout.is_zero() {
            return Err(bad("call_timeout must be above zero"));
        }
        let base = settings.url.trim_end_matches('/').to_owned();
        let http = reqwest::Client::builder()
            .build()
            .map_err(|source| EnvSetupError::Client {
                url: base.clone(),
                source,
            })?;
        Ok(Self {
            base,
            settings,
            http,
            metrics: EnvMetrics::new(metrics)?,
        })
    }

    /// The metric handles this client counts into.
    pub fn metrics(&self) -> &EnvMetrics {
        &self.metrics
    }

    /// `GET /health` once, bounded by the call timeout: `Ok` on a 2xx.
    /// Not counted in the metrics (it is polled while a server starts).
    pub async fn health(&self) -> Result<(), EnvError> {
        let request = self.http.get(format!("{}/health", self.base));
        self.exchange("health", request).await.map(|_| ())
    }

    /// Sends `body` to `{base}/{call}`, retrying transient failures with
    /// the same body, and parses the reply.
    async fn post_with_retries(
        &self,
        call: &'static str,
        body: &serde_json::Value,
        episode_id: &str,
        step: u32,
    ) -> Result<StepResult, EnvError> {
        let url = format!("{}/{call}", self.base);
        let (min, max) = self.settings.backoff;
        let mut backoff = asyncrl_common::Backoff::new(min, max);
        let attempts = self.settings.retries.saturating_add(1);
        let mut attempt = 1;
        loop {
            let started = Instant::now();
            let result = match self.exchange(call, self.http.post(&url).json(body)).await {
                Ok(bytes) => self.parse_reply(call, &bytes),
                Err(e) => Err(e),
            };
            let outcome = match &result {
                Ok(_) => "ok",
                Err(e) => e.kind(),
            };
            self.metrics
                .record(call, outcome, started.elapsed().as_secs_f64());
            match result {
                Ok(reply) => {
                    tracing::debug!(env = %self.base, call, episode_id, step, attempt, done = reply.done, "environment call");
                    return Ok(reply);
                }
                Err(e) if e.is_transient() && attempt < attempts => {
                    let delay = backoff.next_delay();
                    tracing::warn!(
                        env = %self.base, call, episode_id, step, attempt, attempts,
                        retry_in = ?delay, error = %e,
                        "environment call failed, retrying"
                    );
                    self.metrics.retried(call);
                    tokio::time::sleep(delay).await;
                    attempt += 1;
                }
                Err(e) => {
                    tracing::warn!(
                        env = %self.base, call, episode_id, step, attempt, attempts,
                        kind = e.kind(), error = %e,
                        "environment call failed"
                    );
                    return Err(e);
                }
            }
        }
    }

    /// One attempt: sends `request` and reads the whole reply within the
    /// call timeout. Returns the body of a 2xx reply; a 4xx (but 408 and
    /// 429) is [`EnvError::Refused`], any other status [`EnvError::Status`].
    async fn exchange(
        &self,
        call: &'static str,
        request: reqwest::RequestBuilder,
    ) -> Result<Vec<u8>, EnvError> {
        let timeout = self.settings.call_timeout;
        let attempt = async {
            let connection = |source| EnvError::Connection {
                env: self.base.clone(),
                call,
                source,
            };
            let mut response = request.send().await.map_err(connection)?;
            let status = response.status();
            let mut body = Vec::new();
            while let Some(chunk) = response.chunk().await.map_err(connection)? {
                if body.len() + chunk.len() > MAX_REPLY_BYTES {
                    return Err(EnvError::Malformed {
                        env: self.base.clone(),
                        call,
                        reason: format!("reply larger than {MAX_REPLY_BYTES} bytes"),
                    });
                }
                body.extend_from_slice(&chunk);
            }
            Ok((status, body))
        };
        let (status, body) =
            tokio::time::timeout(timeout, attempt)
                .await
                .map_err(|_| EnvError::Timeout {
                    env: self.base.clone(),
                    call,
                    after: timeout,
                })??;
        if status.is_success() {
            return Ok(body);
        }
        let text = String::from_utf8_lossy(&body);
        let excerpt = match one_line(&text, EXCERPT_CHARS) {
            e if e.is_empty() => "(empty body)".to_owned(),
            e => e,
        };
        let code = status.as_u16();
        if status.is_client_error() && code != 408 && code != 429 {
            let reason = match serde_json::from_str::<WireError>(&text) {
                Ok(e) => format!("HTTP {code}: {}", one_line(&e.error, EXCERPT_CHARS)),
                Err(_) => format!("HTTP {code}: {excerpt}"),
            };
            return Err(EnvError::Refused {
                env: self.base.clone(),
                call,
                reason,
            });
        }
        Err(EnvError::Status {
            env: self.base.clone(),
            call,
            status: code,
            body_excerpt: excerpt,
        })
    }

    /// Parses and checks a `reset`/`step` reply.
    fn parse_reply(&self, call: &'static str, body: &[u8]) -> Result<StepResult, EnvError> {
        let malformed = |reason: String| EnvError::Malformed {
            env: self.base.clone(),
            call,
            reason,
        };
        let reply: WireReply = serde_json::from_slice(body).map_err(|e| {
            let what = if e.is_data() {
                "wrong shape"
            } else {
                "not JSON"
            };
            malformed(format!(
                "{what} ({e}): {}",
                one_line(&String::from_utf8_lossy(body), EXCERPT_CHARS)
            ))
        })?;
        let reward = match reply.reward {
            None => None,
            Some(r) if r.is_finite() && r.abs() <= f64::from(f32::MAX) => Some(r as f32),
            Some(r) => return Err(malformed(format!("reward {r} is not a finite f32"))),
        };
        if let Some(EnvMessage { role, .. }) = reply
            .observation
            .messages
            .iter()
            .find(|m| !ROLES.contains(&m.role.as_str()))
        {
            return Err(malformed(format!(
                "a message has the unknown role {role:?} (known: {})",
                ROLES.join(", ")
            )));
        }
        Ok(StepResult {
            observation: reply.observation,
            reward,
            done: reply.done,
        })
    }
}

#[async_trait]
impl Environment for HttpEnvironment {
    async fn reset(&self, episode_id: &str, task: &EnvTask) -> Result<StepResult, EnvError> {
        let body = serde_json::json!({ "episode_id": episode_id, "task": task });
        self.post_with_retries("reset", &body, episode_id, 0).await
    }

    async fn step(
        &self,
        episode_id: &str,
        step: u32,
        action: &Action,
    ) -> Result<StepResult, EnvError> {
        let body = serde_json::json!({ "episode_id": episode_id, "step": step, "action": action });
        self.post_with_retries("step", &body, episode_id, step)
            .await
    }

    /// One attempt, bounded by the call timeout; a failure is logged and
    /// counted, not returned (the server also forgets idle episodes).
    async fn close(&self, episode_id: &str) {
        let started = Instant::now();
        let request = self
            .http
            .post(format!("{}/close", self.base))
            .json(&serde_json::json!({ "episode_id": episode_id }));
        let result = self.exchange("close", request).await;
        let outcome = match &result {
            Ok(_) => "ok",
            Err(e) => e.kind(),
        };
        self.metrics
            .record("close", outcome, started.elapsed().as_secs_f64());
        if let Err(e) = result {
            tracing::warn!(env = %self.base, episode_id, kind = e.kind(), error = %e, "environment close failed");
        }
    }

    fn name(&self) -> &str {
        &self.base
    }
}
