//! The HTTP routes of a vLLM server (0.32) that the worker drives, and the
//! JSON they exchange. Every call has a timeout; every failure names the
//! endpoint and the route.

use std::time::Duration;

use serde::{Deserialize, Serialize, de::DeserializeOwned};

/// Why one call to a vLLM server failed.
#[derive(Debug, thiserror::Error)]
pub enum VllmError {
    /// No answer: connection refused or reset, timeout.
    #[error("{endpoint}{route}: no answer: {source}")]
    Unreachable {
        endpoint: String,
        route: &'static str,
        #[source]
        source: reqwest::Error,
    },
    /// An HTTP error status.
    #[error("{endpoint}{route}: HTTP {status}: {body}")]
    Status {
        endpoint: String,
        route: &'static str,
        status: u16,
        body: String,
    },
    /// A reply that is not the JSON the route returns.
    #[error("{endpoint}{route}: malformed reply ({source}): {snippet}")]
    Malformed {
        endpoint: String,
        route: &'static str,
        #[source]
        source: serde_json::Error,
        snippet: String,
    },
    /// A reply that parses but breaks the contract (missing log-probs,
    /// version spans that do not cover the tokens, ...).
    #[error("{endpoint}{route}: {reason}")]
    Contract {
        endpoint: String,
        route: &'static str,
        reason: String,
    },
    /// The server is down or restarting.
    #[error("{endpoint}: {reason}")]
    Down { endpoint: String, reason: String },
    /// The server does not match the config (start-up checks); `setting`
    /// names the config key to change.
    #[error("`{setting}`: {reason}")]
    Mismatch {
        setting: &'static str,
        reason: String,
    },
    /// Writing the weights folder failed.
    #[error("cannot write the weights folder {path}: {source}")]
    Io {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl VllmError {
    /// Whether the server gave no answer at all (it is down).
    pub fn is_unreachable(&self) -> bool {
        matches!(self, VllmError::Unreachable { .. } | VllmError::Down { .. })
    }
}

pub const HEALTH: &str = "/health";
pub const OPENAPI: &str = "/openapi.json";
pub const SERVER_INFO: &str = "/server_info?config_format=json";
pub const MODELS: &str = "/v1/models";
pub const TOKENIZE: &str = "/tokenize";
pub const GENERATE: &str = "/inference/v1/generate";
pub const COMPLETIONS: &str = "/v1/completions";
pub const PAUSE_ABORT: &str = "/pause?mode=abort";
pub const PAUSE_KEEP: &str = "/pause?mode=keep";
pub const RESUME: &str = "/resume";
pub const COLLECTIVE_RPC: &str = "/collective_rpc";
pub const UPDATE_WEIGHT_VERSION: &str = "/update_weight_version";
pub const RESET_PREFIX_CACHE: &str = "/reset_prefix_cache";

/// Which generation route a server is driven through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// [`GENERATE`]: token ids in and out, with per-token weight versions.
    Generate,
    /// [`COMPLETIONS`] with a token-id prompt.
    Completions,
}

impl Route {
    pub fn path(self) -> &'static str {
        match self {
            Route::Generate => GENERATE,
            Route::Completions => COMPLETIONS,
        }
    }
}

/// The dev-mode routes a weight swap needs (`VLLM_SERVER_DEV_MODE=1`).
pub const SWAP_ROUTES: &[&str] = &[
    "/pause",
    "/resume",
    COLLECTIVE_RPC,
    UPDATE_WEIGHT_VERSION,
    RESET_PREFIX_CACHE,
];

/// One server's HTTP client.
#[derive(Clone)]
pub struct Api {
    pub endpoint: String,
    http: reqwest::Client,
}

impl Api {
    pub fn new(endpoint: &str, http: reqwest::Client) -> Self {
        Self {
            endpoint: endpoint.trim_end_matches('/').to_owned(),
            http,
        }
    }

    /// GET `route`, parsed as `T`.
    pub async fn get<T: DeserializeOwned>(
        &self,
        route: &'static str,
        timeout: Duration,
    ) -> Result<T, VllmError> {
        let req = self.http.get(format!("{}{route}", self.endpoint));
        self.send(route, req, timeout).await
    }

    /// POST `body` as JSON to `route`, parsed as `T`.
    pub async fn post<B: Serialize + ?Sized, T: DeserializeOwned>(
        &self,
        route: &'static str,
        body: &B,
        timeout: Duration,
    ) -> Result<T, VllmError> {
        let req = self
            .http
            .post(format!("{}{route}", self.endpoint))
            .json(body);
        self.send(route, req, timeout).await
    }

    /// `collective_rpc reload_weights` of the checkpoint folder `dir`.
    pub async fn reload_weights(
        &self,
        dir: &std::path::Path,
        timeout: Duration,
    ) -> Result<(), VllmError> {
        let dir = dir.to_string_lossy();
        let _: serde_json::Value = self
            .post(
                COLLECTIVE_RPC,
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
        Ok(())
    }

    /// POST without a body; the reply is not read beyond its status.
    pub async fn post_empty(
        &self,
        route: &'static str,
        timeout: Duration,
    ) -> Result<(), VllmError> {
        let req = self.http.post(format!("{}{route}", self.endpoint));
        // Control routes answer with JSON, an empty body or plain text:
        // the status is what counts.
        self.send_text(route, req, timeout).await.map(drop)
    }

    /// Whether `/health` answers 200.
    pub async fn healthy(&self, timeout: Duration) -> bool {
        let url = format!("{}{HEALTH}", self.endpoint);
        matches!(
            self.http.get(url).timeout(timeout).send().await,
            Ok(r) if r.status().is_success()
        )
    }

    async fn send<T: DeserializeOwned>(
        &self,
        route: &'static str,
        req: reqwest::RequestBuilder,
        timeout: Duration,
    ) -> Result<T, VllmError> {
        let text = self.send_text(route, req, timeout).await?;
        serde_json::from_str(&text).map_err(|source| VllmError::Malformed {
            endpoint: self.endpoint.clone(),
            route,
            source,
            snippet: snippet(&text),
        })
    }

    async fn send_text(
        &self,
        route: &'static str,
        req: reqwest::RequestBuilder,
        timeout: Duration,
    ) -> Result<String, VllmError> {
        let unreachable = |source| VllmError::Unreachable {
            endpoint: self.endpoint.clone(),
            route,
            source,
        };
        let resp = req.timeout(timeout).send().await.map_err(unreachable)?;
        let status = resp.status();
        let text = resp.text().await.map_err(unreachable)?;
        if !status.is_success() {
            return Err(VllmError::Status {
                endpoint: self.endpoint.clone(),
                route,
                status: status.as_u16(),
                body: snippet(&text),
            });
        }
        Ok(text)
    }
}

/// The first 300 characters of a reply, on one line.
fn snippet(text: &str) -> String {
    let one_line: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(300)
        .collect();
    if text.chars().count() > 300 {
        format!("{one_line}...")
    } else {
        one_line
    }
}

/// `/openapi.json`: only the route names.
#[derive(Debug, Deserialize)]
pub struct OpenApi {
    pub paths: serde_json::Map<String, serde_json::Value>,
}

/// `/server_info?config_format=json`: the parts the worker checks.
#[derive(Debug, Deserialize)]
pub struct ServerInfo {
    pub vllm_config: VllmConfigInfo,
}

#[derive(Debug, Deserialize)]
pub struct VllmConfigInfo {
    pub model_config: ModelConfigInfo,
}

#[derive(Debug, Deserialize)]
pub struct ModelConfigInfo {
    pub logprobs_mode: String,
    pub max_model_len: u64,
    #[serde(default)]
    pub dtype: Option<String>,
}

/// `/v1/models`.
#[derive(Debug, Deserialize)]
pub struct Models {
    pub data: Vec<ModelCard>,
}

#[derive(Debug, Deserialize)]
pub struct ModelCard {
    pub id: String,
}

/// `/tokenize` request and reply.
#[derive(Debug, Serialize)]
pub struct TokenizeRequest<'a> {
    pub model: &'a str,
    pub prompt: &'a str,
    pub add_special_tokens: bool,
}

#[derive(Debug, Deserialize)]
pub struct Tokenized {
    pub tokens: Vec<i64>,
}

/// The sampling parameters both generation routes take.
#[derive(Debug, Clone, Serialize)]
pub struct Sampling {
    pub max_tokens: usize,
    pub temperature: f64,
    pub top_p: f64,
    /// The sampled token's own log-prob only.
    pub logprobs: u32,
    pub stop_token_ids: Vec<i64>,
    /// Stop only at `stop_token_ids` (the model's EOS is among them).
    pub ignore_eos: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
}

/// `/inference/v1/generate` request.
#[derive(Debug, Serialize)]
pub struct GenerateRequest<'a> {
    pub token_ids: &'a [i64],
    pub sampling_params: &'a Sampling,
}

/// `/v1/completions` request with a token-id prompt.
#[derive(Debug, Serialize)]
pub struct CompletionsRequest<'a> {
    pub model: &'a str,
    pub prompt: &'a [i64],
    #[serde(flatten)]
    pub sampling: &'a Sampling,
    pub return_token_ids: bool,
}

/// Both routes' replies: the parts the worker reads.
#[derive(Debug, Deserialize)]
pub struct GenerationReply {
    pub choices: Vec<Choice>,
}

#[derive(Debug, Deserialize)]
pub struct Choice {
    #[serde(default)]
    pub finish_reason: Option<String>,
    #[serde(default)]
    pub token_ids: Option<Vec<i64>>,
    #[serde(default)]
    pub logprobs: Option<Logprobs>,
    /// `/inference/v1/generate` only: which weight version sampled which
    /// output tokens.
    #[serde(default)]
    pub weight_versions: Option<Vec<VersionSpan>>,
}

/// `/inference/v1/generate` gives `content: [{token_id, logprob}]`;
/// `/v1/completions` gives `token_logprobs: [..]`.
#[derive(Debug, Deserialize)]
pub struct Logprobs {
    #[serde(default)]
    pub content: Option<Vec<TokenLogprob>>,
    #[serde(default)]
    pub token_logprobs: Option<Vec<Option<f64>>>,
}

#[derive(Debug, Deserialize)]
pub struct TokenLogprob {
    pub logprob: f64,
}

#[derive(Debug, Clone, Deserialize)]
pub struct VersionSpan {
    pub version: Option<String>,
    pub start: usize,
    pub end: usize,
}

/// `/collective_rpc` request for `reload_weights`.
#[derive(Debug, Serialize)]
pub struct ReloadRequest<'a> {
    pub method: &'static str,
    pub kwargs: ReloadKwargs<'a>,
}

#[derive(Debug, Serialize)]
pub struct ReloadKwargs<'a> {
    pub weights_path: &'a str,
    pub is_checkpoint_format: bool,
}

/// `/update_weight_version` request.
#[derive(Debug, Serialize)]
pub struct NewVersion {
    pub new_version: String,
}
