//! `[environment]`: multi-turn episodes. Without this section every task is
//! one prompt and one completion; with it, every task is an episode: the
//! worker generates a reply, hands it to the environment (`reset(task)`,
//! then `step(action)` per reply) and appends the environment's messages,
//! rendered by the chat template, as tokens, until the environment ends the
//! episode or a limit does.
//!
//! ```toml
//! [environment]
//! url = "http://127.0.0.1:8711"   # an HTTP reset/step server, or "builtin:hidden_sum"
//! call_timeout = "10s"            # one reset/step call, retries not included
//! retries = 2                     # transient failures (timeout, connection, 5xx)
//! max_turns = 4                   # model replies per episode
//! max_turn_tokens = 64            # tokens per reply (default model.max_new_tokens)
//! max_episode_tokens = 2048       # prompt + completion (default model.max_seq_len)
//! ```

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::ConfigError;

/// The prefix of a built-in environment's `url`.
pub const BUILTIN_ENV_PREFIX: &str = "builtin:";
/// The built-in environments (`builtin:<name>`).
pub const BUILTIN_ENVS: [&str; 1] = ["hidden_sum"];

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EnvironmentConfig {
    /// `http://host:port` of a reset/step server (plain HTTP) (docs/contracts.md,
    /// "Environments"), or `builtin:<name>` for one of [`BUILTIN_ENVS`],
    /// run in the worker's process.
    pub url: String,
    /// The longest one reset or step call may take.
    #[serde(with = "humantime_serde")]
    pub call_timeout: Duration,
    /// Retries of a call that timed out, lost its connection or got a 5xx
    /// (a step is retried with its index, so the server can answer it once).
    pub retries: u32,
    /// Model replies per episode at most (`max_turns` finish reason).
    pub max_turns: u32,
    /// Tokens per reply at most (default `model.max_new_tokens`).
    pub max_turn_tokens: Option<usize>,
    /// Prompt + completion tokens per episode at most (default
    /// `model.max_seq_len`; `episode_length` finish reason).
    pub max_episode_tokens: Option<usize>,
    /// The built-in environment's simulated tool latency: the median of a
    /// Pareto-tailed delay before each tool answer (0: none).
    #[serde(with = "humantime_serde")]
    pub tool_latency: Duration,
    /// Its tail index α (smaller: heavier tail; > 1).
    pub tool_latency_alpha: f64,
}

impl Default for EnvironmentConfig {
    fn default() -> Self {
        Self {
            url: String::new(),
            call_timeout: Duration::from_secs(10),
            retries: 2,
            max_turns: 4,
            max_turn_tokens: None,
            max_episode_tokens: None,
            tool_latency: Duration::ZERO,
            tool_latency_alpha: 1.5,
        }
    }
}

/// Where an episode's environment runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EnvironmentKind<'a> {
    /// A built-in environment by name (one of [`BUILTIN_ENVS`]).
    Builtin(&'a str),
    /// An HTTP reset/step server.
    Http(&'a str),
}

impl EnvironmentConfig {
    pub fn kind(&self) -> EnvironmentKind<'_> {
        match self.url.strip_prefix(BUILTIN_ENV_PREFIX) {
            Some(name) => EnvironmentKind::Builtin(name),
            None => EnvironmentKind::Http(&self.url),
        }
    }

    pub(crate) fn validate(&self, max_seq_len: usize) -> Result<(), ConfigError> {
        match self.kind() {
            EnvironmentKind::Builtin(name) if !BUILTIN_ENVS.contains(&name) => {
                return Err(ConfigError::invalid(
                    "environment.url",
                    format!(
                        "names no built-in environment (`{name}`); the built-in ones: {}",
                        BUILTIN_ENVS
                            .iter()
                            .map(|n| format!("{BUILTIN_ENV_PREFIX}{n}"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                ));
            }
            EnvironmentKind::Builtin(_) => {}
            EnvironmentKind::Http(url) => {
                // The client is plain HTTP (no TLS), like the vLLM engine's.
                if !url.starts_with("http://") {
                    return Err(ConfigError::invalid(
                        "environment.url",
                        format!(
                            "{url:?} is neither http://host:port nor {BUILTIN_ENV_PREFIX}<name>"
                        ),
                    ));
                }
            }
        }
        if self.call_timeout.is_zero() {
            return Err(ConfigError::invalid(
                "environment.call_timeout",
                "must be above 0",
            ));
        }
        if self.max_turns == 0 {
            return Err(ConfigError::invalid(
                "environment.max_turns",
                "must be at least 1",
            ));
        }
        if self.max_turn_tokens == Some(0) {
            return Err(ConfigError::invalid(
                "environment.max_turn_tokens",
                "must be at least 1",
            ));
        }
        if let Some(n) = self.max_episode_tokens
            && (n < 2 || n > max_seq_len)
        {
            return Err(ConfigError::invalid(
                "environment.max_episode_tokens",
                format!("{n} must be in [2, model.max_seq_len = {max_seq_len}]"),
            ));
        }
        if !(self.tool_latency_alpha > 1.0 && self.tool_latency_alpha.is_finite()) {
            return Err(ConfigError::invalid(
                "environment.tool_latency_alpha",
                format!(
                    "{} must be a finite number above 1",
                    self.tool_latency_alpha
                ),
            ));
        }
        Ok(())
    }

    /// Tokens per reply at most.
    pub fn turn_tokens(&self, max_new_tokens: usize) -> usize {
        self.max_turn_tokens.unwrap_or(max_new_tokens)
    }

    /// Prompt + completion tokens per episode at most.
    pub fn episode_tokens(&self, max_seq_len: usize) -> usize {
        self.max_episode_tokens
            .unwrap_or(max_seq_len)
            .min(max_seq_len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(edit: impl Fn(&mut EnvironmentConfig)) -> Result<(), String> {
        let mut c = EnvironmentConfig {
            url: "builtin:hidden_sum".into(),
            ..EnvironmentConfig::default()
        };
        edit(&mut c);
        c.validate(64).map_err(|e| e.to_string())
    }

    #[test]
    fn every_bad_value_names_its_key() {
        assert_eq!(check(|_| {}), Ok(()));
        assert_eq!(check(|c| c.url = "http://127.0.0.1:8711".into()), Ok(()));
        for (edit, key) in [
            (
                Box::new(|c: &mut EnvironmentConfig| c.url = "builtin:chess".into())
                    as Box<dyn Fn(&mut EnvironmentConfig)>,
                "environment.url",
            ),
            (
                Box::new(|c| c.url = "https://env:443".into()),
                "environment.url",
            ),
            (Box::new(|c| c.url = "env:8711".into()), "environment.url"),
            (
                Box::new(|c| c.call_timeout = Duration::ZERO),
                "environment.call_timeout",
            ),
            (Box::new(|c| c.max_turns = 0), "environment.max_turns"),
            (
                Box::new(|c| c.max_turn_tokens = Some(0)),
                "environment.max_turn_tokens",
            ),
            (
                Box::new(|c| c.max_episode_tokens = Some(65)),
                "environment.max_episode_tokens",
            ),
            (
                Box::new(|c| c.tool_latency_alpha = 1.0),
                "environment.tool_latency_alpha",
            ),
        ] {
            let err = check(edit).unwrap_err();
            assert!(err.contains(&format!("`{key}`")), "{err}");
        }
    }
}
