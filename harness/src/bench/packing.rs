//! `asyncrl-bench packing`: learner tokens/s with sequence packing against
//! padding, on the main job's length mix and on a long-tailed one, in one
//! run.
//!
//! Each mix is a batch of real rows: the task's prompts, rendered and
//! tokenized as the worker does, and as completion the prompt's reference
//! answer plus the end token (what a policy that has learnt the task
//! writes) in even rows, the next prompt's answer in odd ones, in groups
//! of G with rewards that vary inside each group.
//!
//! - `arith` (the main job, `examples/arith.toml`): every a ± b with
//!   operands below 20, B = 16 groups × G = 8 (128 rows of 6–11 tokens);
//! - `reverse` (long-tailed, the speedup bench's task): B = 8 × G = 8;
//! - `arith-idle`: `arith` with the rows of `--idle-groups` groups all
//!   scored 0, so their advantages are 0 (a group without signal).
//!
//! Per mix, every layout takes whole learner steps (`Trainer::train_step`
//! with the learner's default options otherwise: forward, loss, backward,
//! clip, AdamW) on one libtorch thread: padded (every row padded to the
//! longest), packed with each `--lane-tokens` minimum lane width (0:
//! lanes as wide as the longest row), and packed with each group's
//! common prefix laid out once (`learner.share_prefixes`); on a mix with
//! groups without signal, also with their rows forward-only
//! (`learner.forward_only_zero_advantage`; every other layout trains
//! them). Layouts alternate within each round,
//! so machine noise hits each alike; a layout's step time is the median of
//! its timed steps over all rounds. Throughput is the batch's trained
//! (completion) tokens per second, and the ratio is against padded.

use std::fmt::Write as _;
use std::time::Instant;

use anyhow::Context as _;
use asyncrl_config::Config;
use asyncrl_learner::batch::{Lanes, assemble};
use asyncrl_learner::objective::ObjectiveConfig;
use asyncrl_learner::service::trainer_options;
use asyncrl_learner::trainer::{StepSettings, Trainer};
use asyncrl_policy::{DeviceOptions, ModelText, Policy, TinyModelSpec};
use asyncrl_protos::arrow_schema::to_record_batch;
use asyncrl_protos::v1::{FinishReason, RewardStatus, Timings, Trajectory};
use asyncrl_tasks::{BuiltinTask, TaskItem};
use clap::Args;

use super::stats::median;

#[derive(Debug, Args)]
pub struct PackingArgs {
    /// Timed steps per layout and round.
    #[arg(long, default_value_t = 10)]
    iterations: usize,
    /// Untimed steps per layout and round first.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Rounds (layouts alternate within each).
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Packed layouts to measure: minimum lane widths (0: the longest row).
    #[arg(long, value_delimiter = ',', default_value = "0,32,64,128")]
    lane_tokens: Vec<i64>,
    /// Seed of the weights and of the long-tailed data.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Groups of the `arith-idle` mix (of 16) whose rows all score 0.
    #[arg(long, default_value_t = 4)]
    idle_groups: usize,
}

/// One length mix: its rows as record-batch rows.
struct Mix {
    name: &'static str,
    what: String,
    trajectories: Vec<Trajectory>,
    /// Whether some groups have no signal (every reward alike).
    idle: bool,
}

/// G rows per item: the prompt as the worker tokenizes it and the
/// reference answer plus the end token as the completion. The rows of the
/// first `idle` items all score 0 (no signal); the others alternate 0, 1.
fn rows_of(
    items: &[TaskItem],
    g: u32,
    idle: usize,
    text: &ModelText,
) -> anyhow::Result<Vec<Trajectory>> {
    let eos = *text
        .eos_token_ids()
        .first()
        .context("the model has no end token")?;
    let mut out = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let rendered = text.render(&item.prompt).context("render a prompt")?;
        let prompt = text
            .tokenizer()
            .encode(&rendered, true)
            .context("tokenize a prompt")?;
        let answer = |text_of: &str| -> anyhow::Result<Vec<i64>> {
            let mut c = text
                .tokenizer()
                .encode(text_of, false)
                .context("tokenize an answer")?;
            c.push(eos);
            Ok(c)
        };
        let right = answer(&item.answer)?;
        // Odd rows answer with the next item's answer (a wrong one), so the
        // rows of a group share their prompt but not their completions.
        let wrong = answer(&items[(i + 1) % items.len()].answer)?;
        let ids = |v: &[i64]| v.iter().map(|x| *x as i32).collect::<Vec<i32>>();
        for k in 0..g {
            let completion = if k % 2 == 0 { &right } else { &wrong };
            let n = completion.len();
            out.push(Trajectory {
                uuid: format!("00000000-0000-4000-8000-{:012x}", (i << 8) + k as usize),
                task_id: item.id.clone(),
                group_id: format!("g{i}"),
                prompt_token_ids: ids(&prompt),
                completion_token_ids: ids(completion),
                behaviour_logprobs: vec![-1.0; n],
                policy_versions: vec![0; n],
                reward: if i < idle { 0.0 } else { (k % 2) as f32 },
                reward_status: RewardStatus::Ok as i32,
                finish_reason: FinishReason::Stop as i32,
                worker_id: "bench".into(),
                timings: Some(Timings::default()),
                group_size: g,
                index_in_group: k,
                admission_version: 0,
                turns: Vec::new(),
            });
        }
    }
    Ok(out)
}

fn mixes(seed: u64, idle_groups: usize, text: &ModelText) -> anyhow::Result<Vec<Mix>> {
    // The main job's 16 prompts per step, drawn across all 800 problems.
    let all = asyncrl_tasks::arith_all(20);
    let arith: Vec<TaskItem> = (0..16).map(|k| all[k * 50 + 7].clone()).collect();
    let reverse = asyncrl_tasks::generate(BuiltinTask::Reverse, 8, seed);
    let mut out = vec![
        Mix {
            name: "arith",
            what: "the main job: a ± b below 20, B = 16 × G = 8".into(),
            trajectories: rows_of(&arith, 8, 0, text)?,
            idle: false,
        },
        Mix {
            name: "reverse",
            what: "long-tailed: the reverse task, B = 8 × G = 8".into(),
            trajectories: rows_of(&reverse, 8, 0, text)?,
            idle: false,
        },
    ];
    if idle_groups > 0 {
        out.push(Mix {
            name: "arith-idle",
            what: format!(
                "the main job with {} of 16 groups without signal",
                idle_groups.min(16)
            ),
            trajectories: rows_of(&arith, 8, idle_groups, text)?,
            idle: true,
        });
    }
    Ok(out)
}

/// One layout: the lanes, and whether zero-advantage rows are
/// forward-only.
#[derive(Debug, Clone, Copy)]
struct Layout {
    lanes: Lanes,
    forward_only: bool,
}

/// One layout's measurement on one mix.
struct Measured {
    layout: Layout,
    positions: i64,
    forward_only_rows: usize,
    step_s: f64,
}

fn label(layout: Layout) -> String {
    let lanes = match layout.lanes {
        Lanes::Padded => "padded".into(),
        Lanes::Packed { min_width: 0 } => "packed, lanes = longest row".into(),
        Lanes::Packed { min_width } => format!("packed, lanes ≥ {min_width}"),
        Lanes::Shared { .. } => "packed, shared prefixes".into(),
    };
    if layout.forward_only {
        format!("{lanes}, zero-advantage rows forward-only")
    } else {
        lanes
    }
}

pub fn run(args: &PackingArgs) -> anyhow::Result<String> {
    anyhow::ensure!(args.iterations > 0, "--iterations must be at least 1");
    anyhow::ensure!(args.rounds > 0, "--rounds must be at least 1");
    anyhow::ensure!(
        args.lane_tokens.iter().all(|w| *w >= 0),
        "--lane-tokens are minimum lane widths: 0 or more"
    );
    tch::set_num_threads(1);
    let text = ModelText::builtin();
    let spec = TinyModelSpec::default();
    let mut lanes = vec![Lanes::Padded];
    lanes.extend(
        args.lane_tokens
            .iter()
            .map(|w| Lanes::Packed { min_width: *w }),
    );
    let shared = Lanes::Shared {
        min_width: 0,
        max_width: i64::MAX,
    };
    lanes.push(shared);
    let settings = StepSettings {
        objective: ObjectiveConfig::default(),
        learning_rate: 1e-6,
    };
    let mut report = String::new();
    writeln!(
        report,
        "# Learner tokens/s: packing and prefix sharing against padding\n\n\
         Built-in tiny model (`[model.tiny]` defaults), one libtorch thread, whole \
         `Trainer::train_step`s; {} round(s) of {} timed steps per layout after {} untimed, \
         layouts alternating; step time = median over the rounds.\n",
        args.rounds, args.iterations, args.warmup
    )?;
    for mix in mixes(args.seed, args.idle_groups, &text)? {
        let mut layouts: Vec<Layout> = lanes
            .iter()
            .map(|l| Layout {
                lanes: *l,
                forward_only: false,
            })
            .collect();
        if mix.idle {
            layouts.push(Layout {
                lanes: shared,
                forward_only: true,
            });
        }
        let rb = to_record_batch(&mix.trajectories).context("build the batch")?;
        let host = assemble(std::slice::from_ref(&rb), 0, Default::default())
            .context("assemble the batch")?;
        let real: i64 = host.lengths.iter().sum();
        let mut trainers = layouts
            .iter()
            .map(|layout| {
                let policy = Policy::builtin_tiny(&spec, args.seed, DeviceOptions::cpu())?;
                let mut opts = trainer_options(&Config::default());
                opts.lanes = layout.lanes;
                opts.forward_only_zero_advantage = layout.forward_only;
                Ok(Trainer::new(policy, opts))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let mut times: Vec<Vec<f64>> = vec![Vec::new(); layouts.len()];
        let mut positions = vec![0i64; layouts.len()];
        let mut forward_only = vec![0usize; layouts.len()];
        for _ in 0..args.rounds {
            for (k, trainer) in trainers.iter_mut().enumerate() {
                for i in 0..args.warmup + args.iterations {
                    let t0 = Instant::now();
                    let stats = trainer.train_step(std::slice::from_ref(&rb), &settings)?;
                    if i >= args.warmup {
                        times[k].push(t0.elapsed().as_secs_f64());
                    }
                    positions[k] = stats.padded_tokens;
                    forward_only[k] = stats.forward_only_rows;
                }
            }
        }
        let measured: Vec<Measured> = layouts
            .iter()
            .zip(times.iter_mut())
            .zip(positions.iter().zip(&forward_only))
            .map(|((layout, t), (p, f))| Measured {
                layout: *layout,
                positions: *p,
                forward_only_rows: *f,
                step_s: median(std::mem::take(t)),
            })
            .collect();
        let base = measured[0].step_s;
        writeln!(
            report,
            "## {} ({})\n\n{} rows, {} trained tokens, {} real tokens (prompt + completion), \
             longest row {}.\n\n\
             | layout | positions computed | rows forward-only | s/step (median) | trained tokens/s | vs padded |\n\
             |---|---|---|---|---|---|",
            mix.name,
            mix.what,
            host.lengths.len(),
            host.tokens,
            real,
            host.longest()
        )?;
        for m in &measured {
            writeln!(
                report,
                "| {} | {} | {} | {:.4} | {:.0} | {:.2}× |",
                label(m.layout),
                m.positions,
                m.forward_only_rows,
                m.step_s,
                host.tokens as f64 / m.step_s,
                base / m.step_s
            )?;
        }
        writeln!(report)?;
    }
    Ok(report)
}
