//! `[telemetry]`: the metrics/health server and logging of a role.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::ConfigError;

#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// Address of the `/metrics`, `/healthz`, `/readyz` server (`host:port`;
    /// port 0 picks a free one). Empty disables the server.
    pub listen: String,
    pub log_format: LogFormat,
    /// A tracing filter, e.g. `info` or `asyncrl_transport=debug,info`.
    /// `RUST_LOG` overrides it.
    pub log_filter: String,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:9464".into(),
            log_format: LogFormat::Text,
            log_filter: "info".into(),
        }
    }
}

impl TelemetryConfig {
    /// The listen address, or None when the server is disabled.
    pub fn listen_addr(&self) -> Result<Option<SocketAddr>, ConfigError> {
        if self.listen.is_empty() {
            return Ok(None);
        }
        self.listen.parse().map(Some).map_err(|e| {
            ConfigError::invalid(
                "telemetry.listen",
                format!("= {:?} is not host:port ({e})", self.listen),
            )
        })
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        self.listen_addr()?;
        Ok(())
    }
}
