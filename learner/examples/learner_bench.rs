//! Prints the learner bench (see `asyncrl_learner::bench`).
//!
//! `cargo run --release -p asyncrl-learner --example learner_bench -- [ROWS [SEQ_LEN [ITERATIONS [THREADS]]]]`
//! (defaults 64 32 20 1).

use asyncrl_learner::bench::{LearnerBenchOptions, run_learner_bench};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut opts = LearnerBenchOptions::default();
    let num = |i: usize| -> Option<i64> {
        args.get(i).map(|s| {
            s.parse()
                .unwrap_or_else(|_| panic!("argument {} ({s}) is not an integer", i + 1))
        })
    };
    if let Some(v) = num(0) {
        opts.rows = v;
    }
    if let Some(v) = num(1) {
        opts.seq_len = v;
    }
    if let Some(v) = num(2) {
        opts.iterations = v as usize;
    }
    if let Some(v) = num(3) {
        opts.threads = v as i32;
    }
    match run_learner_bench(opts) {
        Ok(report) => println!("{report}"),
        Err(e) => {
            eprintln!("learner bench failed: {e}");
            std::process::exit(1);
        }
    }
}
