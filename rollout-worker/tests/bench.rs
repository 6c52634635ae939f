//! The batching bench runs end to end, and continuous batching needs fewer
//! decoding steps than static batching for the same tokens.

use asyncrl_config::BatchingMode;
use asyncrl_rollout_worker::bench::{BatchingBenchOptions, run_batching_bench};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn continuous_batching_needs_fewer_steps_for_the_same_tokens() {
    let mut opts = BatchingBenchOptions {
        tasks: 24,
        group_size: 2,
        max_sequences: 8,
        rounds: 1,
        ..BatchingBenchOptions::default()
    };
    opts.model.tiny.hidden_size = 32;
    opts.model.tiny.num_hidden_layers = 1;
    opts.model.tiny.num_attention_heads = 2;
    opts.model.tiny.num_key_value_heads = 1;
    opts.model.tiny.intermediate_size = 64;
    let report = run_batching_bench(opts).await.unwrap();
    let text = report.to_string();
    assert!(text.contains("continuous / static tokens/s"), "{text}");
    let (c, s) = (&report.continuous, &report.static_);
    assert_eq!(
        (c.mode, s.mode),
        (BatchingMode::Continuous, BatchingMode::Static)
    );
    // Every completion is as long as its reference answer plus one.
    assert_eq!(c.tokens, s.tokens, "{text}");
    assert!(c.tokens > 0);
    assert!(c.steps < s.steps, "{text}");
    assert!(c.occupancy() > s.occupancy(), "{text}");
}
