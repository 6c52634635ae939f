//! The coordinator as its own small process (no libtorch): reads a config
//! file, connects to the bus it names, serves until SIGINT/SIGTERM. The
//! `asyncrl coordinator` subcommand does the same; this binary exists so that
//! the crash tests can kill a coordinator with -9 without building the whole
//! `asyncrl` binary.
//!
//! Usage: asyncrl-coordinator-standalone --config FILE

use std::process::ExitCode;

use asyncrl_config::Config;
use asyncrl_telemetry::Metrics;
use asyncrl_transport::TransportMetrics;
use tokio_util::sync::CancellationToken;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = match args.as_slice() {
        [flag, path] if flag == "--config" || flag == "-c" => path.clone(),
        _ => {
            eprintln!("usage: asyncrl-coordinator-standalone --config FILE");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(&path)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(path: &str) -> Result<(), Box<dyn std::error::Error>> {
    let config = Config::load(std::path::Path::new(path))?;
    asyncrl_telemetry::init_tracing(&config.telemetry)?;
    let metrics = Metrics::new();
    let transport_metrics = TransportMetrics::new();
    metrics.with_registry(|r| transport_metrics.register(r));
    let bus = asyncrl_transport::connect(&config.bus, transport_metrics).await?;
    let shutdown = CancellationToken::new();
    let signal = shutdown.clone();
    tokio::spawn(async move {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(t) => t,
                Err(e) => {
                    tracing::error!(error = %e, "cannot listen for SIGTERM");
                    return;
                }
            };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        signal.cancel();
    });
    asyncrl_coordinator::run(config, bus, metrics, shutdown).await?;
    Ok(())
}
