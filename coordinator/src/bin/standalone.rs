//! The coordinator as its own small process (no libtorch): reads a config
//! file, connects to the bus it names, serves until SIGINT/SIGTERM. The
//! `asyncrl coordinator` subcommand does the same; this binary exists so that
//! the crash tests can kill a coordinator with -9 without building the whole
//! `asyncrl` binary.
//!
//! Usage: asyncrl-coordinator-standalone --config FILE

use std::process::ExitCode;

use anyhow::Context as _;
use asyncrl_config::Config;
use asyncrl_telemetry::Metrics;
use asyncrl_transport::TransportMetrics;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = match args.as_slice() {
        [flag, path] if flag == "--config" || flag == "-c" => path.clone(),
        _ => {
            eprintln!("usage: asyncrl-coordinator-standalone --config FILE");
            return ExitCode::from(2);
        }
    };
    asyncrl_common::process::main(|| run(path))
}

async fn run(path: String) -> anyhow::Result<()> {
    let config = Config::load(std::path::Path::new(&path))?;
    asyncrl_telemetry::init_tracing(&config.telemetry)?;
    let metrics = Metrics::new();
    let transport_metrics = TransportMetrics::new();
    metrics.with_registry(|r| transport_metrics.register(r));
    let bus = asyncrl_transport::connect(&config.bus, transport_metrics).await?;
    let shutdown = asyncrl_common::process::shutdown_on_signals("coordinator")
        .context("cannot listen for SIGTERM/SIGINT")?;
    asyncrl_coordinator::run(config, bus, metrics, shutdown).await?;
    Ok(())
}
