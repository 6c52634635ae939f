//! The learner bench runs end to end at tiny sizes: both our side and the
//! PyTorch eager side (a subprocess of the project venv's Python) produce a
//! positive throughput. No timing is asserted.

use asyncrl_learner::bench::{LearnerBenchOptions, run_learner_bench};

#[test]
fn bench_runs_both_sides() {
    let opts = LearnerBenchOptions {
        rows: 4,
        seq_len: 8,
        iterations: 2,
        warmup: 1,
        ..LearnerBenchOptions::default()
    };
    let report = run_learner_bench(opts).expect("learner bench");
    assert!(report.ours.tokens_per_s > 0.0, "{report}");
    assert!(report.pytorch.tokens_per_s > 0.0, "{report}");
    assert!(
        report.ratio().is_finite() && report.ratio() > 0.0,
        "{report}"
    );
    // The same model on both sides.
    assert_eq!(report.params, report.torch_params, "{report}");
    let text = report.to_string();
    assert!(text.contains("tokens/s"), "{text}");
    assert!(text.contains("ratio ours/pytorch"), "{text}");
    assert!(text.contains("4x8"), "{text}");
}
