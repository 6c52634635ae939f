//! `asyncrl-buffer CONFIG`: the replay buffer as its own process.
//!
//! The same code as `asyncrl buffer`, without the libtorch-linked binary:
//! connects to the bus named by `[bus]`, serves `/metrics`, `/healthz` and
//! `/readyz` on `[telemetry].listen`, and runs until SIGTERM or SIGINT.
//! The crash tests start it, kill it with SIGKILL mid-ingest and start it
//! again on the same data directory.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use asyncrl_buffer::Buffer;
use asyncrl_config::Config;
use asyncrl_telemetry::{Health, Metrics};

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    let (Some(path), None) = (args.next(), args.next()) else {
        eprintln!("usage: asyncrl-buffer CONFIG.toml");
        return ExitCode::from(2);
    };
    asyncrl_common::process::main(|| run(PathBuf::from(path)))
}

async fn run(path: PathBuf) -> anyhow::Result<()> {
    let config = Config::load(&path)?;
    asyncrl_telemetry::init_tracing(&config.telemetry)?;
    let metrics = Metrics::new();
    let transport_metrics = asyncrl_transport::TransportMetrics::new();
    metrics.with_registry(|r| transport_metrics.register(r));
    let bus = asyncrl_transport::connect(&config.bus, transport_metrics).await?;
    let health = Health::new();
    let shutdown = asyncrl_common::process::shutdown_on_signals("buffer")
        .context("cannot listen for SIGTERM/SIGINT")?;
    let telemetry = asyncrl_telemetry::serve_from_config(
        &config.telemetry,
        metrics.clone(),
        health.clone(),
        shutdown.clone().cancelled_owned(),
    )
    .await?;
    if let Some(server) = &telemetry {
        tracing::info!(addr = %server.local_addr(), "telemetry listening");
    }
    let buffer = Buffer::open(&config, bus, &metrics)
        .await?
        .with_health(health);
    let result = buffer.run(shutdown.clone()).await;
    shutdown.cancel();
    if let Some(server) = telemetry {
        let _ = server.join().await;
    }
    Ok(result?)
}
