//! `asyncrl-buffer CONFIG`: the replay buffer as its own process.
//!
//! The same code as `asyncrl buffer`, without the libtorch-linked binary:
//! connects to the bus named by `[bus]`, serves `/metrics`, `/healthz` and
//! `/readyz` on `[telemetry].listen`, and runs until SIGTERM or SIGINT.
//! The crash tests start it, kill it with SIGKILL mid-ingest and start it
//! again on the same data directory.

use std::path::PathBuf;
use std::process::ExitCode;

use asyncrl_buffer::{Buffer, CancellationToken};
use asyncrl_config::Config;
use asyncrl_telemetry::{Health, Metrics};

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    let (Some(path), None) = (args.next(), args.next()) else {
        eprintln!("usage: asyncrl-buffer CONFIG.toml");
        return ExitCode::from(2);
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(PathBuf::from(path))) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(path: PathBuf) -> Result<(), String> {
    let config = Config::load(&path).map_err(|e| e.to_string())?;
    asyncrl_telemetry::init_tracing(&config.telemetry).map_err(|e| e.to_string())?;
    let metrics = Metrics::new();
    let transport_metrics = asyncrl_transport::TransportMetrics::new();
    metrics.with_registry(|r| transport_metrics.register(r));
    let bus = asyncrl_transport::connect(&config.bus, transport_metrics)
        .await
        .map_err(|e| e.to_string())?;
    let health = Health::new();
    let shutdown = CancellationToken::new();
    let telemetry = asyncrl_telemetry::serve_from_config(
        &config.telemetry,
        metrics.clone(),
        health.clone(),
        shutdown.clone().cancelled_owned(),
    )
    .await
    .map_err(|e| e.to_string())?;
    if let Some(server) = &telemetry {
        tracing::info!(addr = %server.local_addr(), "telemetry listening");
    }
    let buffer = Buffer::open(&config, bus, &metrics)
        .await
        .map_err(|e| e.to_string())?
        .with_health(health);
    let stop = shutdown.clone();
    tokio::spawn(async move {
        let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate());
        match term {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
        tracing::info!("shutting down");
        stop.cancel();
    });
    let result = buffer.run(shutdown.clone()).await;
    shutdown.cancel();
    if let Some(server) = telemetry {
        let _ = server.join().await;
    }
    result.map_err(|e| e.to_string())
}
