//! `[bus]`: which transport the roles talk over, and how to reach NATS.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::ConfigError;
use crate::storage::StorageConfig;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BusKind {
    /// Every role in one process over the in-process bus.
    Local,
    /// NATS with JetStream.
    Nats,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct BusConfig {
    /// `local` for the in-process bus, or one or more comma-separated
    /// `nats://host:port` (or `tls://`) server URLs.
    pub url: String,
    /// User/password authentication (the password inline, or read from a
    /// file).
    pub user: Option<String>,
    pub password: Option<Secret>,
    pub password_file: Option<PathBuf>,
    /// Token authentication (inline, or read from a file).
    pub token: Option<Secret>,
    pub token_file: Option<PathBuf>,
    /// A NATS credentials file (JWT + nkey seed).
    pub credentials_file: Option<PathBuf>,
    pub tls: Option<TlsConfig>,
    /// Credentials of each role process (`[bus.roles.worker]`, ...): a role
    /// process connects with its own table's instead of the ones above.
    /// `asyncrl train` (every role in one process) uses the ones above.
    pub roles: BTreeMap<String, RoleAuth>,
    /// The inbox prefix of the connection with the base credentials above
    /// (`asyncrl train` over NATS); unset: the client's `_INBOX`. A role
    /// process uses its own (`[bus.roles.<role>] inbox_prefix`, by default
    /// `_INBOX.asyncrl.<role>`, and `_INBOX.asyncrl.worker.<worker id>` for
    /// a worker): its NATS user may then subscribe to its own replies only.
    pub inbox_prefix: Option<String>,
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
    /// The process only opens the KV buckets and object stores it uses,
    /// waiting for their owners to create them, and never creates one (a
    /// worker: its NATS user may create none). Not a setting: the role
    /// process sets it.
    #[serde(skip)]
    pub open_stores_only: bool,
}

/// A password or token from the config: never printed (`Debug` shows
/// `<redacted>`), read with [`Secret::expose`].
#[derive(Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The secret itself, for the one place that sends it to the server.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl From<&str> for Secret {
    fn from(value: &str) -> Self {
        Self(value.to_owned())
    }
}

impl From<String> for Secret {
    fn from(value: String) -> Self {
        Self(value)
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// The roles that may have their own credentials (`[bus.roles.<role>]`).
pub const BUS_ROLES: [&str; 4] = ["coordinator", "buffer", "learner", "worker"];

/// The credentials of one role process (`[bus.roles.<role>]`): one of
/// user + password (or password_file), token (or token_file) and
/// credentials_file, and optionally its own TLS settings (a client
/// certificate), which replace `[bus.tls]` for this role.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RoleAuth {
    pub user: Option<String>,
    pub password: Option<Secret>,
    pub password_file: Option<PathBuf>,
    pub token: Option<Secret>,
    pub token_file: Option<PathBuf>,
    pub credentials_file: Option<PathBuf>,
    pub tls: Option<TlsConfig>,
    /// The subject prefix of this role's inboxes, where its replies arrive
    /// (a subject without wildcards). Unset: `_INBOX.asyncrl.<role>`, and
    /// `_INBOX.asyncrl.worker.<worker id>` for a worker, the prefixes the
    /// shipped permissions (deploy/k8s/base/nats-auth.conf) allow.
    pub inbox_prefix: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
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
            password_file: None,
            token: None,
            token_file: None,
            credentials_file: None,
            tls: None,
            roles: BTreeMap::new(),
            inbox_prefix: None,
            connect_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(5),
            reconnect_max_delay: Duration::from_secs(5),
            subscription_capacity: 65_536,
            duplicate_window: Duration::from_secs(600),
            replicas: 1,
            storage: StorageConfig::default(),
            open_stores_only: false,
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

    /// The bus config a `role` process connects with: the auth method (and
    /// the TLS settings, when it has its own) of `[bus.roles.<role>]` in
    /// place of the base ones; the base config when the role has no table.
    /// Its inbox prefix is its table's `inbox_prefix`, never the base one
    /// (roles do not share an inbox); None leaves the default to the caller,
    /// who knows the role's identity.
    pub fn for_role(&self, role: &str) -> BusConfig {
        let mut config = self.clone();
        config.inbox_prefix = self.roles.get(role).and_then(|r| r.inbox_prefix.clone());
        if let Some(r) = self.roles.get(role) {
            config.user = r.user.clone();
            config.password = r.password.clone();
            config.password_file = r.password_file.clone();
            config.token = r.token.clone();
            config.token_file = r.token_file.clone();
            config.credentials_file = r.credentials_file.clone();
            if r.tls.is_some() {
                config.tls = r.tls.clone();
            }
        }
        config
    }

    fn auth(&self) -> Auth<'_> {
        Auth {
            user: self.user.is_some(),
            password: self.password.is_some(),
            password_file: self.password_file.is_some(),
            token: self.token.is_some(),
            token_file: self.token_file.is_some(),
            credentials_file: self.credentials_file.is_some(),
            tls: self.tls.as_ref(),
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
        validate_auth("bus", &self.auth())?;
        if let Some(prefix) = &self.inbox_prefix {
            validate_inbox_prefix("bus.inbox_prefix", prefix)?;
        }
        for (name, role) in &self.roles {
            let prefix = format!("bus.roles.{name}");
            if !BUS_ROLES.contains(&name.as_str()) {
                return Err(ConfigError::invalid(
                    prefix,
                    format!("is not a role (one of {})", BUS_ROLES.join(", ")),
                ));
            }
            let auth = role.auth();
            if !auth.has_method() && role.tls.is_none() {
                return Err(ConfigError::invalid(
                    prefix,
                    "sets no credentials (one of user/password, token/token_file, credentials_file, or tls)",
                ));
            }
            validate_auth(&prefix, &auth)?;
            if let Some(inbox) = &role.inbox_prefix {
                validate_inbox_prefix(&format!("{prefix}.inbox_prefix"), inbox)?;
            }
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

impl RoleAuth {
    fn auth(&self) -> Auth<'_> {
        Auth {
            user: self.user.is_some(),
            password: self.password.is_some(),
            password_file: self.password_file.is_some(),
            token: self.token.is_some(),
            token_file: self.token_file.is_some(),
            credentials_file: self.credentials_file.is_some(),
            tls: self.tls.as_ref(),
        }
    }
}

/// Which auth settings a table sets (`[bus]` or `[bus.roles.<role>]`).
struct Auth<'a> {
    user: bool,
    password: bool,
    password_file: bool,
    token: bool,
    token_file: bool,
    credentials_file: bool,
    tls: Option<&'a TlsConfig>,
}

impl Auth<'_> {
    fn has_method(&self) -> bool {
        self.user
            || self.password
            || self.password_file
            || self.token
            || self.token_file
            || self.credentials_file
    }
}

/// An inbox prefix is a subject without wildcards: dot-separated tokens of
/// printable ASCII, none empty.
fn validate_inbox_prefix(key: &str, prefix: &str) -> Result<(), ConfigError> {
    let ok = prefix.split('.').all(|t| {
        !t.is_empty()
            && t.bytes()
                .all(|b| b.is_ascii_graphic() && b != b'*' && b != b'>')
    });
    if !ok {
        return Err(ConfigError::invalid(
            key,
            format!(
                "= {prefix:?} is not a subject prefix (dot-separated tokens, no spaces or wildcards)"
            ),
        ));
    }
    Ok(())
}

/// One auth method per table, each complete; `prefix` names the table.
fn validate_auth(prefix: &str, a: &Auth<'_>) -> Result<(), ConfigError> {
    let key = |k: &str| format!("{prefix}.{k}");
    let methods = [
        a.user || a.password || a.password_file,
        a.token || a.token_file,
        a.credentials_file,
    ];
    if methods.iter().filter(|m| **m).count() > 1 {
        return Err(ConfigError::invalid(
            prefix,
            "sets more than one of user/password, token/token_file and credentials_file",
        ));
    }
    if a.password && a.password_file {
        return Err(ConfigError::invalid(
            key("password_file"),
            format!("cannot be set together with {}", key("password")),
        ));
    }
    if a.user != (a.password || a.password_file) {
        let missing = if a.user { key("password") } else { key("user") };
        return Err(ConfigError::invalid(
            missing,
            "is required when the other of user/password (or password_file) is set",
        ));
    }
    if a.token && a.token_file {
        return Err(ConfigError::invalid(
            key("token_file"),
            format!("cannot be set together with {}", key("token")),
        ));
    }
    if let Some(tls) = a.tls
        && tls.cert_file.is_some() != tls.key_file.is_some()
    {
        let missing = if tls.cert_file.is_some() {
            key("tls.key_file")
        } else {
            key("tls.cert_file")
        };
        return Err(ConfigError::invalid(
            missing,
            "is required for mutual TLS when the other is set",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Config;
    use crate::test_check::check;

    const NATS: &str = "[bus]\nurl = \"nats://n:4222\"\n";

    #[test]
    fn auth_methods_of_the_base_table() {
        check(&format!("{NATS}user = \"u\"\npassword = \"p\""), None);
        check(
            &format!("{NATS}user = \"u\"\npassword_file = \"/s/pw\""),
            None,
        );
        check(&format!("{NATS}user = \"u\""), Some("bus.password"));
        check(
            &format!("{NATS}password_file = \"/s/pw\""),
            Some("bus.user"),
        );
        check(
            &format!("{NATS}user = \"u\"\npassword = \"p\"\npassword_file = \"/s/pw\""),
            Some("bus.password_file"),
        );
        check(
            &format!("{NATS}token = \"t\"\ntoken_file = \"/s/t\""),
            Some("bus.token_file"),
        );
        check(
            &format!("{NATS}token = \"t\"\ncredentials_file = \"/s/c\""),
            Some("more than one"),
        );
    }

    #[test]
    fn role_tables_take_one_method_each_and_name_their_key() {
        check(
            &format!(
                "{NATS}token_file = \"/s/t\"\n\
                 [bus.roles.worker]\nuser = \"worker\"\npassword_file = \"/s/worker\"\n\
                 [bus.roles.learner]\ncredentials_file = \"/s/learner.creds\"\n\
                 [bus.roles.buffer]\ntoken = \"b\"\n\
                 [bus.roles.coordinator]\ntls = {{ cert_file = \"/c\", key_file = \"/k\" }}"
            ),
            None,
        );
        check(
            &format!("{NATS}[bus.roles.workers]\nuser = \"w\"\npassword = \"p\""),
            Some("`bus.roles.workers` is not a role"),
        );
        check(
            &format!("{NATS}[bus.roles.worker]\nuser = \"w\"\ntoken = \"t\""),
            Some("`bus.roles.worker` sets more than one"),
        );
        check(
            &format!("{NATS}[bus.roles.learner]\nuser = \"l\""),
            Some("bus.roles.learner.password"),
        );
        check(
            &format!("{NATS}[bus.roles.buffer]\ntoken = \"t\"\ntoken_file = \"/t\""),
            Some("bus.roles.buffer.token_file"),
        );
        check(
            &format!("{NATS}[bus.roles.coordinator]"),
            Some("`bus.roles.coordinator` sets no credentials"),
        );
        check(
            &format!("{NATS}[bus.roles.worker]\ntls = {{ cert_file = \"/c\" }}"),
            Some("bus.roles.worker.tls.key_file"),
        );
        check(
            &format!("{NATS}[bus.roles.worker]\npasword = \"p\""),
            Some("pasword"),
        );
    }

    #[test]
    fn a_role_connects_with_its_own_table_and_others_with_the_base() {
        let config = Config::parse(
            &format!(
                "{NATS}token = \"base\"\ntls = {{ ca_file = \"/ca.pem\" }}\n\
                 [bus.roles.worker]\nuser = \"worker\"\npassword = \"w\"\n\
                 [bus.roles.learner]\ntoken_file = \"/s/learner\"\n\
                 tls = {{ ca_file = \"/ca.pem\", cert_file = \"/l.pem\", key_file = \"/l.key\" }}"
            ),
            None,
        )
        .unwrap();
        let worker = config.bus.for_role("worker");
        assert_eq!(worker.user.as_deref(), Some("worker"));
        assert_eq!(worker.password, Some(Secret::new("w")));
        assert_eq!(worker.token, None, "the base token is not the worker's");
        assert_eq!(
            worker.tls, config.bus.tls,
            "no TLS table of its own: the base one"
        );
        let learner = config.bus.for_role("learner");
        assert_eq!(learner.token, None);
        assert_eq!(learner.token_file, Some(PathBuf::from("/s/learner")));
        assert_eq!(
            learner.tls.and_then(|t| t.cert_file),
            Some(PathBuf::from("/l.pem"))
        );
        let buffer = config.bus.for_role("buffer");
        assert_eq!(buffer.token, Some(Secret::new("base")));
        assert_eq!(buffer.user, None);
    }

    #[test]
    fn inbox_prefixes_are_the_roles_own_and_subjects() {
        let config = Config::parse(
            &format!(
                "{NATS}token = \"base\"\ninbox_prefix = \"_INBOX.all\"\n\
                 [bus.roles.worker]\nuser = \"worker\"\npassword = \"w\"\n\
                 inbox_prefix = \"_INBOX.w\"\n\
                 [bus.roles.learner]\ntoken = \"l\""
            ),
            None,
        )
        .unwrap();
        assert_eq!(config.bus.inbox_prefix.as_deref(), Some("_INBOX.all"));
        assert_eq!(
            config.bus.for_role("worker").inbox_prefix.as_deref(),
            Some("_INBOX.w")
        );
        // Not the base one: the caller derives the role's default.
        assert_eq!(config.bus.for_role("learner").inbox_prefix, None);
        assert_eq!(config.bus.for_role("buffer").inbox_prefix, None);
        check(
            &format!("{NATS}inbox_prefix = \"_INBOX.>\""),
            Some("bus.inbox_prefix"),
        );
        check(
            &format!("{NATS}[bus.roles.worker]\ntoken = \"t\"\ninbox_prefix = \"_INBOX..w\""),
            Some("bus.roles.worker.inbox_prefix"),
        );
        check(
            &format!("{NATS}[bus.roles.worker]\ntoken = \"t\"\ninbox_prefix = \"a b\""),
            Some("bus.roles.worker.inbox_prefix"),
        );
    }

    #[test]
    fn secrets_are_not_printed() {
        let config = Config::parse(
            &format!(
                "{NATS}token = \"tok-123\"\n[bus.roles.worker]\nuser = \"w\"\npassword = \"pw-456\""
            ),
            None,
        )
        .unwrap();
        let printed = format!("{config:?}");
        assert!(!printed.contains("tok-123"), "{printed}");
        assert!(!printed.contains("pw-456"), "{printed}");
        assert!(printed.contains("<redacted>"));
    }
}
