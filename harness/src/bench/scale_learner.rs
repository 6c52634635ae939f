//! The learner's cost curve: one real `Trainer::train_step` (the learner's
//! defaults: `trainer_options` of the default config) of the built-in model
//! on one CPU thread, on Arrow batches of growing token count.

use std::time::Instant;

use anyhow::Context as _;
use asyncrl_buffer::testing::traj_of;
use asyncrl_config::Config;
use asyncrl_learner::objective::ObjectiveConfig;
use asyncrl_learner::service::trainer_options;
use asyncrl_learner::trainer::{StepSettings, Trainer};
use asyncrl_policy::{DeviceOptions, Policy, TinyModelSpec};
use asyncrl_protos::Trajectory;
use asyncrl_protos::arrow_schema::to_record_batch;

use super::curves::{Chart, Curve};
use super::stats::percentile;

pub(crate) struct Options {
    pub batch_tokens: Vec<usize>,
    /// Tokens per sequence, 16 of them prompt.
    pub seq_tokens: usize,
    pub iterations: usize,
}

const PROMPT_TOKENS: usize = 16;
const GROUP: usize = 8;

/// `rows` sequences in groups of up to 8, token ids folded into `vocab`.
fn batch(rows: usize, completion: usize, vocab: i32) -> Vec<Trajectory> {
    let g = rows.min(GROUP) as u32;
    (0..rows)
        .map(|k| {
            let group = k as u32 / g;
            let mut t = traj_of(
                &format!("t{group}"),
                &format!("g{group}"),
                k as u32,
                k as u32 % g,
                g,
                0,
                completion,
            );
            for id in t
                .prompt_token_ids
                .iter_mut()
                .chain(t.completion_token_ids.iter_mut())
            {
                *id %= vocab;
            }
            t
        })
        .collect()
}

pub(crate) fn measure(o: &Options) -> anyhow::Result<Curve> {
    tch::set_num_threads(1);
    let spec = TinyModelSpec::default();
    let policy = Policy::builtin_tiny(&spec, 0, DeviceOptions::cpu())?;
    let vocab = i32::try_from(policy.config().vocab_size).context("vocabulary size")?;
    let params = policy.num_parameters();
    let mut trainer = Trainer::new(policy, trainer_options(&Config::default()));
    let settings = StepSettings {
        objective: ObjectiveConfig::default(),
        learning_rate: 1e-6,
    };
    let completion = o.seq_tokens - PROMPT_TOKENS;
    let mut rows = Vec::new();
    let mut first = true;
    for &tokens in &o.batch_tokens {
        let n = (tokens / o.seq_tokens).max(1);
        let n = n.div_ceil(n.min(GROUP)) * n.min(GROUP);
        let rb = to_record_batch(&batch(n, completion, vocab)).context("build a batch")?;
        // One untimed step (the first also allocates gradients and AdamW's
        // moments).
        let warm = if first { 2 } else { 1 };
        first = false;
        for _ in 0..warm {
            trainer.train_step(std::slice::from_ref(&rb), &settings)?;
        }
        let mut times = Vec::new();
        for _ in 0..o.iterations {
            let t0 = Instant::now();
            trainer.train_step(std::slice::from_ref(&rb), &settings)?;
            times.push(t0.elapsed().as_secs_f64());
        }
        let step_s = percentile(&mut times, 50.0);
        let batch_tokens = (n * o.seq_tokens) as f64;
        eprintln!("scale: learner step on {batch_tokens} tokens: {step_s:.3} s");
        rows.push(vec![batch_tokens, n as f64, step_s, batch_tokens / step_s]);
    }
    let notes = format!(
        "One `Trainer::train_step` (the learner's default options and objective: forward, \
         loss, backward, grad clip, AdamW) of the built-in model ({params} parameters, float32) \
         on one CPU thread; sequences of {} tokens ({PROMPT_TOKENS} prompt), groups of \
         {GROUP}; the median of {} timed steps after an untimed one per size.\n",
        o.seq_tokens, o.iterations
    );
    Ok(Curve {
        name: "learner",
        title: "Learner: step time vs batch tokens (built-in model, 1 thread)".into(),
        x_label: "batch tokens",
        header: vec!["batch_tokens", "sequences", "step_s", "tokens_per_s"],
        rows,
        x_col: 0,
        charts: vec![Chart {
            suffix: "step",
            y_label: "seconds per step",
            columns: vec![2],
        }],
        notes,
        headline: String::new(),
    })
}
