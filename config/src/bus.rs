//! `[bus]`: which transport the roles talk over, and how to reach NATS.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::ConfigError;
use crate::storage::StorageConfig;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BusKind {
    /// Every role in one process over the in-process bus.
    Local,
    /// NATS with JetStream.
    Nats,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct BusConfig {
    /// `local` for the in-process bus, or one or more comma-separated
    /// `nats://host:port` (or `tls://`) server URLs.
    pub url: String,
    /// User/password authentication.
    pub user: Option<String>,
    pub password: Option<String>,
    /// Token authentication (inline, or read from a file).
    pub token: Option<String>,
    pub token_file: Option<PathBuf>,
    /// A NATS credentials file (JWT + nkey seed).
    pub credentials_file: Option<PathBuf>,
    pub tls: Option<TlsConfig>,
    /// How long the first connection may take before the role gives up.
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// Default timeout of a request/reply call.
    #[serde(with = "humantime_serde")]
    pub request_timeout: Duration,
    /// Upper bound of the reconnect backoff after a lost connection.
    #[serde(with = "humantime_serde")]
    pub reconnect_max_delay: Duration,
    /// Messages a subscription may hold before the client reports a slow consumer.
    pub subscription_capacity: usize,
    /// Window in which a republished message id is dropped as a duplicate.
    #[serde(with = "humantime_serde")]
    pub duplicate_window: Duration,
    /// JetStream replicas of the streams, KV buckets and object stores.
    pub replicas: usize,
    /// How much each JetStream store may hold (`[bus.storage]`).
    pub storage: StorageConfig,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TlsConfig {
    /// Require TLS even if the URL says `nats://`.
    pub required: bool,
    /// CA bundle to verify the server with.
    pub ca_file: Option<PathBuf>,
    /// Client certificate and key for mutual TLS.
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
}

impl Default for BusConfig {
    fn default() -> Self {
        Self {
            url: "local".into(),
            user: None,
            password: None,
            token: None,
            token_file: None,
            credentials_file: None,
            tls: None,
            connect_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(5),
            reconnect_max_delay: Duration::from_secs(5),
            subscription_capacity: 65_536,
            duplicate_window: Duration::from_secs(600),
            replicas: 1,
            storage: StorageConfig::default(),
        }
    }
}

impl BusConfig {
    pub fn kind(&self) -> BusKind {
        if self.url == "local" {
            BusKind::Local
        } else {
            BusKind::Nats
        }
    }

    /// The bus config of a NATS server at `url`, all else default.
    pub fn nats(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            ..Self::default()
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.url.trim().is_empty() {
            return Err(ConfigError::invalid(
                "bus.url",
                "is empty (use \"local\" or nats://host:port)",
            ));
        }
        if self.kind() == BusKind::Nats {
            for server in self.url.split(',') {
                let server = server.trim();
                let ok = ["nats://", "tls://", "ws://", "wss://"]
                    .iter()
                    .any(|s| server.starts_with(s))
                    && server
                        .split("://")
                        .nth(1)
                        .is_some_and(|rest| !rest.is_empty());
                if !ok {
                    return Err(ConfigError::invalid(
                        "bus.url",
                        format!("= {server:?} is neither \"local\" nor a nats://host:port URL"),
                    ));
                }
            }
        }
        let methods = [
            self.user.is_some() || self.password.is_some(),
            self.token.is_some() || self.token_file.is_some(),
            self.credentials_file.is_some(),
        ];
        if methods.iter().filter(|m| **m).count() > 1 {
            return Err(ConfigError::invalid(
                "bus",
                "sets more than one of user/password, token/token_file and credentials_file",
            ));
        }
        if self.user.is_some() != self.password.is_some() {
            let missing = if self.user.is_some() {
                "bus.password"
            } else {
                "bus.user"
            };
            return Err(ConfigError::invalid(
                missing,
                "is required when the other of user/password is set",
            ));
        }
        if self.token.is_some() && self.token_file.is_some() {
            return Err(ConfigError::invalid(
                "bus.token_file",
                "cannot be set together with bus.token",
            ));
        }
        if let Some(tls) = &self.tls
            && tls.cert_file.is_some() != tls.key_file.is_some()
        {
            let missing = if tls.cert_file.is_some() {
                "bus.tls.key_file"
            } else {
                "bus.tls.cert_file"
            };
            return Err(ConfigError::invalid(
                missing,
                "is required for mutual TLS when the other is set",
            ));
        }
        for (key, d) in [
            ("bus.connect_timeout", self.connect_timeout),
            ("bus.request_timeout", self.request_timeout),
            ("bus.reconnect_max_delay", self.reconnect_max_delay),
            ("bus.duplicate_window", self.duplicate_window),
        ] {
            if d.is_zero() {
                return Err(ConfigError::invalid(key, "must be longer than 0s"));
            }
        }
        crate::check_range(
            "bus.subscription_capacity",
            self.subscription_capacity,
            1,
            1 << 24,
        )?;
        crate::check_range("bus.replicas", self.replicas, 1, 5)?;
        self.storage.validate()?;
        Ok(())
    }
}
