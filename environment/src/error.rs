//! Why an environment call failed.

use std::time::Duration;

/// Why one `reset`, `step` or `close` failed. Callers branch on the kind:
/// [`EnvError::is_transient`] ones are worth retrying (the HTTP client
/// already did, `retries` times), the others are not.
///
/// `env` is the environment's name (its base URL for
/// [`crate::HttpEnvironment`]), `call` one of `reset`, `step`, `close`,
/// `health`. Each message is one line.
#[derive(Debug, thiserror::Error)]
pub enum EnvError {
    /// No complete reply within the call timeout.
    #[error("environment {env} {call}: no reply within {after:?}")]
    Timeout {
        env: String,
        call: &'static str,
        after: Duration,
    },
    /// The connection failed: refused, reset, or closed in the middle of
    /// the reply.
    #[error("environment {env} {call}: connection failed: {}", error_chain(source))]
    Connection {
        env: String,
        call: &'static str,
        #[source]
        source: reqwest::Error,
    },
    /// An HTTP error status that may pass (5xx, 408, 429).
    #[error("environment {env} {call}: HTTP {status}: {body_excerpt}")]
    Status {
        env: String,
        call: &'static str,
        status: u16,
        body_excerpt: String,
    },
    /// A reply that breaks the protocol: not JSON, the wrong shape, a
    /// non-finite reward, a message with an unknown role.
    #[error("environment {env} {call}: malformed reply: {reason}")]
    Malformed {
        env: String,
        call: &'static str,
        reason: String,
    },
    /// The environment refused the request (HTTP 4xx with an error, or an
    /// in-process environment's equivalent): an unknown episode, a step out
    /// of order, a task it cannot run. Repeating it would not help.
    #[error("environment {env} {call} refused: {reason}")]
    Refused {
        env: String,
        call: &'static str,
        reason: String,
    },
}

impl EnvError {
    /// The metric label of the kind: `timeout`, `connection`, `status`,
    /// `malformed`, `refused`.
    pub fn kind(&self) -> &'static str {
        match self {
            EnvError::Timeout { .. } => "timeout",
            EnvError::Connection { .. } => "connection",
            EnvError::Status { .. } => "status",
            EnvError::Malformed { .. } => "malformed",
            EnvError::Refused { .. } => "refused",
        }
    }

    /// Whether the same request may succeed later (timeout, connection,
    /// 5xx/408/429).
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            EnvError::Timeout { .. } | EnvError::Connection { .. } | EnvError::Status { .. }
        )
    }

    /// The call that failed: `reset`, `step`, `close` or `health`.
    pub fn call(&self) -> &'static str {
        match self {
            EnvError::Timeout { call, .. }
            | EnvError::Connection { call, .. }
            | EnvError::Status { call, .. }
            | EnvError::Malformed { call, .. }
            | EnvError::Refused { call, .. } => call,
        }
    }
}

/// Why an environment client could not be built.
#[derive(Debug, thiserror::Error)]
pub enum EnvSetupError {
    #[error("environment URL {url:?}: {reason}")]
    Url { url: String, reason: String },
    #[error("environment {url}: cannot build the HTTP client: {source}")]
    Client {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("environment metrics: {0}")]
    Metrics(#[from] asyncrl_telemetry::TelemetryError),
}

/// An error and its sources on one line, each distinct message once
/// (reqwest's own message only says which request failed; the cause, such
/// as "Connection refused", is in its sources).
pub(crate) fn error_chain(error: &dyn std::error::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut next: Option<&dyn std::error::Error> = Some(error);
    while let Some(e) = next {
        let text = one_line(&e.to_string(), usize::MAX);
        if !text.is_empty() && !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        next = e.source();
    }
    parts.join(": ")
}

/// `text` on one line (control characters as spaces), at most `max`
/// characters, `...` marking a cut.
pub(crate) fn one_line(text: &str, max: usize) -> String {
    let mut out: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(max)
        .collect();
    if text.chars().count() > max {
        out.push_str("...");
    }
    out.trim().to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_replaces_newlines_and_cuts() {
        assert_eq!(one_line("a\nb\r\nc", 100), "a b  c");
        assert_eq!(one_line("abcdef", 3), "abc...");
    }

    #[test]
    fn kinds_and_transience() {
        let refused = EnvError::Refused {
            env: "e".into(),
            call: "step",
            reason: "r".into(),
        };
        assert_eq!(refused.kind(), "refused");
        assert!(!refused.is_transient());
        assert_eq!(refused.call(), "step");
        let status = EnvError::Status {
            env: "e".into(),
            call: "reset",
            status: 503,
            body_excerpt: String::new(),
        };
        assert_eq!(status.kind(), "status");
        assert!(status.is_transient());
    }
}
