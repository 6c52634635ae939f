//! What every role process does around its role: logs, the one metrics
//! registry, `/metrics` `/healthz` `/readyz`, SIGTERM/SIGINT → shutdown, and
//! the connection to the bus.

use std::sync::Arc;

use anyhow::Context as _;
use asyncrl_config::{BusKind, Config};
use asyncrl_telemetry::{Health, Metrics};
use asyncrl_transport::{Bus, TransportMetrics};
use tokio_util::sync::CancellationToken;

/// The per-process pieces a role runs with.
pub struct Process {
    pub metrics: Metrics,
    pub health: Health,
    pub shutdown: CancellationToken,
    pub telemetry_addr: Option<std::net::SocketAddr>,
    /// Kept alive for the life of the process.
    _server: Option<asyncrl_telemetry::TelemetryServer>,
}

/// Starts the telemetry server and the signal handler of a process.
pub async fn start(config: &Config, role: &str) -> anyhow::Result<Process> {
    let metrics = Metrics::new();
    metrics.register_info(
        "build",
        "What this process is",
        vec![
            ("role".into(), role.into()),
            ("version".into(), env!("CARGO_PKG_VERSION").into()),
        ],
    )?;
    let health = Health::new();
    // SIGTERM/SIGINT cancel it: the role drains and the telemetry server stops.
    let shutdown = asyncrl_common::process::shutdown_on_signals(role)
        .context("cannot listen for SIGTERM/SIGINT")?;
    let server = match config.telemetry.listen_addr()? {
        Some(addr) => {
            let stop = shutdown.clone();
            let server =
                asyncrl_telemetry::serve(addr, metrics.clone(), health.clone(), async move {
                    stop.cancelled().await
                })
                .await
                .with_context(|| format!("cannot serve telemetry on {addr} (telemetry.listen)"))?;
            tracing::info!(role, addr = %server.local_addr(), "serving /metrics /healthz /readyz");
            Some(server)
        }
        None => None,
    };
    let telemetry_addr = server.as_ref().map(|s| s.local_addr());
    Ok(Process {
        metrics,
        health,
        shutdown,
        telemetry_addr,
        _server: server,
    })
}

/// What connects to the bus: one role process (`coordinator`, `buffer`,
/// `learner`, `worker`), with the credentials of its `[bus.roles.<role>]`
/// table, or every role in one process (`asyncrl train`), with the base
/// `[bus]` credentials.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BusUser {
    Role(&'static str),
    AllRoles,
}

/// Connects to the configured bus as `user`, registering its metrics.
pub async fn connect(
    config: &Config,
    metrics: &Metrics,
    user: BusUser,
) -> anyhow::Result<Arc<dyn Bus>> {
    let tm = TransportMetrics::new();
    metrics.with_registry(|r| tm.register(r));
    let bus = match user {
        BusUser::Role(role) => config.bus.for_role(role),
        BusUser::AllRoles => config.bus.clone(),
    };
    Ok(asyncrl_transport::connect(&bus, tm).await?)
}

/// A role process needs a server to meet the other roles on.
pub fn require_nats(config: &Config, role: &str) -> anyhow::Result<()> {
    if config.bus.kind() == BusKind::Local {
        anyhow::bail!(
            "`asyncrl {role}` runs one role and needs a NATS bus: set bus.url = \"nats://host:port\" or pass --bus (or run every role in one process with `asyncrl train`)"
        );
    }
    Ok(())
}
