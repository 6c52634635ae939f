//! Continuous vs static batching of the rollout worker on the long-tailed
//! `reverse` task:
//!
//! ```text
//! cargo run --release -p asyncrl-rollout-worker --example bench_batching -- \
//!     [--tasks 64] [--rounds 2] [--group-size 8] [--slots 16] [--threads 0] \
//!     [--hidden 128] [--layers 4] [--natural-lengths]
//! ```

use asyncrl_rollout_worker::CompletionLengths;
use asyncrl_rollout_worker::bench::{BatchingBenchOptions, run_batching_bench};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut opts = BatchingBenchOptions::default();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--natural-lengths" {
            opts.lengths = CompletionLengths::Model;
            continue;
        }
        let value = args.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--tasks" => opts.tasks = value.parse()?,
            "--rounds" => opts.rounds = value.parse()?,
            "--group-size" => opts.group_size = value.parse()?,
            "--slots" => opts.max_sequences = value.parse()?,
            "--threads" => opts.model.cpu_threads = value.parse()?,
            "--hidden" => opts.model.tiny.hidden_size = value.parse()?,
            "--layers" => opts.model.tiny.num_hidden_layers = value.parse()?,
            other => return Err(format!("unknown flag {other}").into()),
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let report = runtime.block_on(run_batching_bench(opts))?;
    print!("{report}");
    Ok(())
}
