//! `cargo bench -p asyncrl-coordinator`: acquire -> grant round trips per
//! second through NATS, the coordinator against a raw async-nats echo.
//! Environment: ASYNCRL_BENCH_ROUND_TRIPS (default 1000), ASYNCRL_BENCH_ROUNDS
//! (default 3), ASYNCRL_BENCH_CONCURRENCY (default 16), ASYNCRL_NATS_URL
//! (default: a private nats-server).

use asyncrl_coordinator::bench::{AcquireBenchOptions, run_acquire_bench};

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let opts = AcquireBenchOptions {
        nats_url: std::env::var("ASYNCRL_NATS_URL").ok(),
        round_trips: env_usize("ASYNCRL_BENCH_ROUND_TRIPS", 1_000),
        concurrency: env_usize("ASYNCRL_BENCH_CONCURRENCY", 16),
        rounds: env_usize("ASYNCRL_BENCH_ROUNDS", 3),
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the tokio runtime: {e}");
            std::process::exit(1);
        }
    };
    match runtime.block_on(run_acquire_bench(opts)) {
        Ok(report) => print!("{report}"),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
