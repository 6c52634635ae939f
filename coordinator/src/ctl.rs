//! `asyncrl ctl`: the command-line client of the admin API, with readable
//! tables. [`ctl`] returns the text to print; a refused request is an
//! [`CtlError::Refused`] (the binary exits non-zero).

use std::path::PathBuf;
use std::time::Duration;

use asyncrl_config::Config;
use asyncrl_protos::v1::coordinator_admin_client::CoordinatorAdminClient;
use asyncrl_protos::v1::{
    CheckpointRequest, ControlReply, GetKnobsReply, GetKnobsRequest, Knobs, ListWorkersReply,
    ListWorkersRequest, PauseRequest, ResumeRequest, SetKnobsRequest, StatusReply, StatusRequest,
};
use tonic::metadata::MetadataValue;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

use crate::knobs::{self, KnobError};

/// What `asyncrl ctl` was asked (the binary fills it from its command line).
#[derive(Debug, Clone)]
pub struct CtlArgs {
    /// Admin API endpoint (default: from coordinator.admin_listen of the
    /// config; https when it has admin TLS).
    pub endpoint: Option<String>,
    /// Bearer token for mutating calls (default: coordinator.admin_token or
    /// admin_token_file of the config).
    pub token: Option<String>,
    pub token_file: Option<PathBuf>,
    /// CA certificate (PEM) to verify a TLS admin API with.
    pub ca_file: Option<PathBuf>,
    /// Name to check the server certificate against.
    pub domain: Option<String>,
    /// Who asks, for the journal (default: $USER@host).
    pub who: Option<String>,
    /// Give up on the call after this many seconds.
    pub timeout_s: f64,
    pub command: CtlCommand,
}

/// The admin call to make.
#[derive(Debug, Clone, PartialEq)]
pub enum CtlCommand {
    /// Version, admission, capacity and the worker registry.
    Status,
    /// The worker registry.
    Workers,
    /// The knobs in effect and the changes scheduled.
    Knobs,
    /// Change knobs (`name=value` pairs), from `at_step` (default: the next
    /// step boundary).
    Set {
        assignments: Vec<String>,
        at_step: Option<u64>,
    },
    /// Stop admitting tasks.
    Pause,
    /// Admit tasks again.
    Resume,
    /// Ask the learner for a checkpoint at the next step boundary.
    Checkpoint,
}

impl CtlArgs {
    pub fn new(command: CtlCommand) -> Self {
        Self {
            endpoint: None,
            token: None,
            token_file: None,
            ca_file: None,
            domain: None,
            who: None,
            timeout_s: 10.0,
            command,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CtlError {
    #[error("no admin endpoint: pass --endpoint or set coordinator.admin_listen")]
    NoEndpoint,
    #[error("invalid admin endpoint {endpoint:?}: {source}")]
    Endpoint {
        endpoint: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("cannot reach the coordinator at {endpoint}: {}", error_chain(source))]
    Connect {
        endpoint: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("{call} failed: {message} ({code:?})")]
    Rpc {
        call: &'static str,
        code: tonic::Code,
        message: String,
    },
    #[error("refused: {0}")]
    Refused(String),
    #[error("no admin token: pass --token/--token-file or set coordinator.admin_token(_file)")]
    NoToken,
    #[error("cannot read {what} {path}: {reason}")]
    File {
        what: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error(transparent)]
    Knob(#[from] KnobError),
}

fn rpc(call: &'static str) -> impl Fn(tonic::Status) -> CtlError {
    move |s| CtlError::Rpc {
        call,
        code: s.code(),
        message: s.message().to_owned(),
    }
}

async fn who(args: &CtlArgs) -> String {
    if let Some(w) = &args.who {
        return w.clone();
    }
    let user = std::env::var("USER").unwrap_or_else(|_| "unknown".into());
    let host = match std::env::var("HOSTNAME") {
        Ok(h) => h,
        Err(_) => tokio::fs::read_to_string("/etc/hostname")
            .await
            .unwrap_or_default(),
    };
    let host = host.trim();
    if host.is_empty() {
        user
    } else {
        format!("{user}@{host}")
    }
}

fn resolve_endpoint(config: &Config, args: &CtlArgs) -> Result<(String, bool), CtlError> {
    if let Some(e) = &args.endpoint {
        return Ok((e.clone(), e.starts_with("https://")));
    }
    let addr = config
        .coordinator
        .admin_addr()
        .map_err(|e| CtlError::Endpoint {
            endpoint: config.coordinator.admin_listen.clone(),
            source: Box::new(e),
        })?
        .ok_or(CtlError::NoEndpoint)?;
    let host = if addr.ip().is_unspecified() {
        "127.0.0.1".to_owned()
    } else {
        addr.ip().to_string()
    };
    let tls = config
        .coordinator
        .admin_tls
        .as_ref()
        .is_some_and(|t| t.cert_file.is_some() || t.ca_file.is_some());
    let scheme = if tls { "https" } else { "http" };
    Ok((format!("{scheme}://{host}:{}", addr.port()), tls))
}

async fn read_file(what: &'static str, path: &PathBuf) -> Result<Vec<u8>, CtlError> {
    tokio::fs::read(path).await.map_err(|e| CtlError::File {
        what,
        path: path.clone(),
        reason: e.to_string(),
    })
}

async fn token(config: &Config, args: &CtlArgs) -> Result<String, CtlError> {
    if let Some(t) = &args.token {
        return Ok(t.clone());
    }
    let file = args
        .token_file
        .as_ref()
        .or(config.coordinator.admin_token_file.as_ref());
    if let Some(path) = file {
        let t = String::from_utf8_lossy(&read_file("token file", path).await?)
            .trim()
            .to_owned();
        return if t.is_empty() {
            Err(CtlError::NoToken)
        } else {
            Ok(t)
        };
    }
    config
        .coordinator
        .admin_token
        .clone()
        .ok_or(CtlError::NoToken)
}

async fn connect(
    config: &Config,
    args: &CtlArgs,
) -> Result<CoordinatorAdminClient<Channel>, CtlError> {
    let (endpoint, tls) = resolve_endpoint(config, args)?;
    let bad = |e: tonic::transport::Error| CtlError::Endpoint {
        endpoint: endpoint.clone(),
        source: Box::new(e),
    };
    let timeout = Duration::from_secs_f64(args.timeout_s.clamp(0.1, 3600.0));
    let mut ep = Endpoint::from_shared(endpoint.clone())
        .map_err(|e| CtlError::Endpoint {
            endpoint: endpoint.clone(),
            source: Box::new(e),
        })?
        .connect_timeout(timeout)
        .timeout(timeout);
    if tls {
        let mut cfg = ClientTlsConfig::new();
        let admin_tls = config.coordinator.admin_tls.as_ref();
        let ca = args
            .ca_file
            .as_ref()
            .or(admin_tls.and_then(|t| t.ca_file.as_ref()));
        if let Some(ca) = ca {
            cfg = cfg.ca_certificate(Certificate::from_pem(read_file("CA file", ca).await?));
        }
        if let Some(d) = args
            .domain
            .as_ref()
            .or(admin_tls.and_then(|t| t.domain.as_ref()))
        {
            cfg = cfg.domain_name(d.clone());
        }
        ep = ep.tls_config(cfg).map_err(bad)?;
    }
    let channel = ep.connect().await.map_err(|source| CtlError::Connect {
        endpoint: endpoint.clone(),
        source,
    })?;
    Ok(CoordinatorAdminClient::new(channel))
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut parts = vec![e.to_string()];
    let mut cur = e.source();
    while let Some(s) = cur {
        let t = s.to_string();
        if !parts.iter().any(|p| p.contains(&t)) {
            parts.push(t);
        }
        cur = s.source();
    }
    parts.join(": ")
}

fn authed<T>(msg: T, token: &str) -> Result<tonic::Request<T>, CtlError> {
    let mut req = tonic::Request::new(msg);
    let value: MetadataValue<_> = format!("Bearer {token}").parse().map_err(|_| {
        CtlError::Refused("the token holds characters a header cannot carry".into())
    })?;
    req.metadata_mut().insert("authorization", value);
    Ok(req)
}

/// Runs one `asyncrl ctl` command against the admin API and returns what to
/// print.
pub async fn ctl(config: &Config, args: &CtlArgs) -> Result<String, CtlError> {
    // Parse what can be parsed before connecting.
    let mut change = Knobs::default();
    if let CtlCommand::Set { assignments, .. } = &args.command {
        for a in assignments {
            knobs::parse_assignment(a, &mut change)?;
        }
        knobs::validate(&change)?;
    }
    let mutating = !matches!(
        args.command,
        CtlCommand::Status | CtlCommand::Workers | CtlCommand::Knobs
    );
    let token = if mutating {
        Some(token(config, args).await?)
    } else {
        None
    };
    let mut client = connect(config, args).await?;
    let who = who(args).await;
    match &args.command {
        CtlCommand::Status => {
            let status = client
                .status(StatusRequest {})
                .await
                .map_err(rpc("Status"))?
                .into_inner();
            let workers = client
                .list_workers(ListWorkersRequest {})
                .await
                .map_err(rpc("ListWorkers"))?
                .into_inner();
            Ok(format_status(&status, &workers, now_ms()))
        }
        CtlCommand::Workers => {
            let workers = client
                .list_workers(ListWorkersRequest {})
                .await
                .map_err(rpc("ListWorkers"))?
                .into_inner();
            Ok(format_workers(&workers, now_ms()))
        }
        CtlCommand::Knobs => {
            let k = client
                .get_knobs(GetKnobsRequest {})
                .await
                .map_err(rpc("GetKnobs"))?
                .into_inner();
            Ok(format_knobs(&k))
        }
        CtlCommand::Set { at_step, .. } => {
            let token = token.unwrap_or_default();
            let reply = client
                .set_knobs(authed(
                    SetKnobsRequest {
                        knobs: Some(change),
                        apply_at_step: at_step.unwrap_or(0),
                        requested_by: who,
                    },
                    &token,
                )?)
                .await
                .map_err(rpc("SetKnobs"))?
                .into_inner();
            if !reply.accepted {
                return Err(CtlError::Refused(format!(
                    "{} (journal #{})",
                    reply.reason, reply.journal_seq
                )));
            }
            let rows: Vec<String> = knobs::knob_rows(&change)
                .into_iter()
                .map(|(n, v)| format!("{n}={v}"))
                .collect();
            Ok(format!(
                "accepted: {} from learner step {} (journal #{})\n",
                rows.join(" "),
                reply.effective_step,
                reply.journal_seq
            ))
        }
        CtlCommand::Pause | CtlCommand::Resume | CtlCommand::Checkpoint => {
            let token = token.unwrap_or_default();
            let (name, reply): (&str, ControlReply) = match args.command {
                CtlCommand::Pause => (
                    "pause",
                    client
                        .pause(authed(PauseRequest { requested_by: who }, &token)?)
                        .await
                        .map_err(rpc("Pause"))?
                        .into_inner(),
                ),
                CtlCommand::Resume => (
                    "resume",
                    client
                        .resume(authed(ResumeRequest { requested_by: who }, &token)?)
                        .await
                        .map_err(rpc("Resume"))?
                        .into_inner(),
                ),
                _ => (
                    "checkpoint",
                    client
                        .checkpoint(authed(CheckpointRequest { requested_by: who }, &token)?)
                        .await
                        .map_err(rpc("Checkpoint"))?
                        .into_inner(),
                ),
            };
            if !reply.accepted {
                return Err(CtlError::Refused(format!(
                    "{} (journal #{})",
                    reply.reason, reply.journal_seq
                )));
            }
            let what = match name {
                "checkpoint" => format!(
                    "the learner checkpoints before step {}",
                    reply.effective_step
                ),
                _ => format!(
                    "{name} in effect from learner step {}",
                    reply.effective_step
                ),
            };
            Ok(format!(
                "accepted: {what} (journal #{})\n",
                reply.journal_seq
            ))
        }
    }
}

fn now_ms() -> i64 {
    crate::journal::now_unix_ms()
}

/// A plain text table: a header row and left-aligned columns (right-aligned
/// when every cell of the column is a number).
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let n = header.len();
    let mut width: Vec<usize> = header.iter().map(|h| h.len()).collect();
    let mut numeric = vec![true; n];
    for r in rows {
        for (i, c) in r.iter().enumerate().take(n) {
            width[i] = width[i].max(c.chars().count());
            numeric[i] &= c.parse::<f64>().is_ok()
                || c.ends_with('s') && c.trim_end_matches('s').parse::<f64>().is_ok();
        }
    }
    let mut out = String::new();
    let line = |cells: Vec<&str>, out: &mut String| {
        let parts: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(i, c)| {
                if numeric[i] && !rows.is_empty() {
                    format!("{c:>w$}", w = width[i])
                } else {
                    format!("{c:<w$}", w = width[i])
                }
            })
            .collect();
        out.push_str(parts.join("  ").trim_end());
        out.push('\n');
    };
    line(header.to_vec(), &mut out);
    for r in rows {
        line(r.iter().map(String::as_str).collect(), &mut out);
    }
    out
}

pub fn format_workers(w: &ListWorkersReply, now_ms: i64) -> String {
    if w.workers.is_empty() {
        return "no workers registered\n".into();
    }
    let rows: Vec<Vec<String>> = w
        .workers
        .iter()
        .map(|w| {
            vec![
                w.worker_id.clone(),
                if w.hostname.is_empty() {
                    "-".into()
                } else {
                    w.hostname.clone()
                },
                match (w.alive, w.draining) {
                    (false, _) => "dead".into(),
                    (true, true) => "draining".into(),
                    (true, false) => "alive".into(),
                },
                w.capacity.to_string(),
                w.policy_version.to_string(),
                w.leases.to_string(),
                format!(
                    "{:.1}s",
                    (now_ms - w.last_heartbeat_unix_ms).max(0) as f64 / 1000.0
                ),
                format!("{:.0}", w.tokens_per_second),
            ]
        })
        .collect();
    table(
        &[
            "WORKER",
            "HOST",
            "STATE",
            "CAPACITY",
            "VERSION",
            "LEASES",
            "LAST SEEN",
            "TOKENS/S",
        ],
        &rows,
    )
}

pub fn format_status(s: &StatusReply, w: &ListWorkersReply, now_ms: i64) -> String {
    let bound =
        (u64::from(s.eta) + s.policy_version.max(0) as u64 + 1) * u64::from(s.groups_per_step);
    let rows = vec![
        vec!["policy version".into(), s.policy_version.to_string()],
        vec![
            "learner step sealed".into(),
            s.sealed_through_step.to_string(),
        ],
        vec!["eta".into(), s.eta.to_string()],
        vec!["groups per step (B)".into(), s.groups_per_step.to_string()],
        vec!["accepted groups".into(), s.accepted_groups.to_string()],
        vec!["running groups".into(), s.running_groups.to_string()],
        vec![
            "capacity left".into(),
            format!("{} of (eta + v + 1) * B = {bound}", s.capacity_left),
        ],
        vec![
            "admission".into(),
            if s.paused {
                "paused".into()
            } else {
                "open".into()
            },
        ],
        vec![
            "tasks".into(),
            format!(
                "epoch {}, cursor {}/{}, {} re-queued",
                s.epoch, s.cursor, s.dataset_size, s.requeued_tasks
            ),
        ],
        vec![
            "workers".into(),
            format!(
                "{} alive, {} dead, {} recommended",
                s.live_workers,
                s.dead_workers,
                if s.rollout_workers_recommended > 0.0 {
                    format!("{:.0}", s.rollout_workers_recommended)
                } else {
                    "- (not measured yet)".into()
                }
            ),
        ],
        vec![
            "stale groups dropped".into(),
            s.stale_dropped_total.to_string(),
        ],
    ];
    let mut out = String::new();
    for r in &rows {
        out.push_str(&format!("{:<22}{}\n", r[0], r[1]));
    }
    out.push('\n');
    out.push_str(&format_workers(w, now_ms));
    out
}

pub fn format_knobs(k: &GetKnobsReply) -> String {
    let mut out = format!(
        "knobs in effect at learner step {} (sealed through step {})\n",
        k.current_step, k.sealed_through_step
    );
    let rows: Vec<Vec<String>> = knobs::knob_rows(&k.knobs.unwrap_or_default())
        .into_iter()
        .map(|(n, v)| vec![n.to_owned(), v])
        .collect();
    out.push_str(&table(&["KNOB", "VALUE"], &rows));
    if !k.pending.is_empty() {
        out.push_str("\nscheduled changes\n");
        let rows: Vec<Vec<String>> = k
            .pending
            .iter()
            .map(|c| {
                let changes: Vec<String> = knobs::knob_rows(&c.knobs.unwrap_or_default())
                    .into_iter()
                    .map(|(n, v)| format!("{n}={v}"))
                    .collect();
                vec![
                    c.from_step.to_string(),
                    changes.join(" "),
                    c.requested_by.clone(),
                    c.journal_seq.to_string(),
                ]
            })
            .collect();
        out.push_str(&table(&["FROM STEP", "CHANGE", "BY", "JOURNAL"], &rows));
    }
    out
}

#[cfg(test)]
mod tests;
