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
        BusUser::Role(role) => {
            let mut bus = config.bus.for_role(role);
            if bus.inbox_prefix.is_none() {
                bus.inbox_prefix = Some(default_inbox_prefix(config, role));
            }
            // A worker reads the control bucket and the weights; the
            // coordinator and the learner create them.
            bus.open_stores_only = role == "worker";
            bus
        }
        BusUser::AllRoles => config.bus.clone(),
    };
    Ok(asyncrl_transport::connect(&bus, tm).await?)
}

/// The inbox prefix of a role process whose `[bus.roles.<role>]` names
/// none: `_INBOX.asyncrl.<role>`, and for a worker
/// `_INBOX.asyncrl.worker.<worker.id>` (the worker command pins its id
/// before it connects), the prefixes deploy/k8s/base/nats-auth.conf allows.
fn default_inbox_prefix(config: &Config, role: &str) -> String {
    use asyncrl_protos::subjects::{role_inbox_prefix, worker_inbox_prefix};
    match (role, &config.worker.id) {
        ("worker", Some(id)) => worker_inbox_prefix(id),
        _ => role_inbox_prefix(role),
    }
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

/// A multi-threaded tokio runtime for one command.
pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")
}

/// Runs `fut` to completion on a new runtime, then gives the runtime's
/// blocking tasks (file writes, fsyncs) a bounded time to finish: a stuck
/// one must not keep the process from exiting once its work is done.
pub fn block_on<F: std::future::Future>(fut: F) -> anyhow::Result<F::Output> {
    let rt = runtime()?;
    let out = rt.block_on(fut);
    rt.shutdown_timeout(std::time::Duration::from_secs(10));
    Ok(out)
}

/// Loads the config, applies a `--bus` override and sets up logging.
pub fn load(path: &std::path::Path, bus: Option<&str>) -> anyhow::Result<Config> {
    let mut config = Config::load(path)?;
    if let Some(url) = bus {
        config.bus.url = url.to_owned();
        config.bus.validate()?;
    }
    asyncrl_telemetry::init_tracing(&config.telemetry)?;
    Ok(config)
}

/// Runs one role in its own process until SIGTERM/SIGINT: loads `config`
/// (with a `--bus` override), requires NATS, lets `prepare` settle what the
/// connection depends on (the worker's id), serves telemetry, connects with
/// the role's credentials, then runs `body`.
pub fn run_role<F, Fut>(
    config: &std::path::Path,
    bus: Option<&str>,
    name: &'static str,
    prepare: impl FnOnce(&mut Config),
    body: F,
) -> anyhow::Result<()>
where
    F: FnOnce(Config, Arc<dyn Bus>, Metrics, CancellationToken) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let mut config = load(config, bus)?;
    prepare(&mut config);
    require_nats(&config, name)?;
    block_on(async move {
        let process = start(&config, name).await?;
        let bus = connect(&config, &process.metrics, BusUser::Role(name)).await?;
        process.health.set_ready("bus");
        tracing::info!(role = name, bus = %config.bus.url, telemetry = ?process.telemetry_addr, "started");
        let result = body(
            config,
            bus,
            process.metrics.clone(),
            process.shutdown.clone(),
        )
        .await;
        process.shutdown.cancel();
        result.with_context(|| name.to_string())
    })?
}
