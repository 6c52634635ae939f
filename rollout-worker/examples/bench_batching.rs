//! Continuous vs static batching of the rollout worker on the long-tailed
//! `reverse` task: `cargo run --release -p asyncrl-rollout-worker --example
//! bench_batching [-- TASKS [ROUNDS]]`.

use asyncrl_rollout_worker::bench::{BatchingBenchOptions, run_batching_bench};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mut opts = BatchingBenchOptions::default();
    if let Some(tasks) = args.next() {
        opts.tasks = tasks.parse()?;
    }
    if let Some(rounds) = args.next() {
        opts.rounds = rounds.parse()?;
    }
    let report = run_batching_bench(opts).await?;
    print!("{report}");
    Ok(())
}
