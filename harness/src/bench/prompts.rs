//! `asyncrl-bench prompt-sharing`: generated tokens/s of the built-in
//! decode batch with prompt sharing against without, in one run.
//!
//! The main job's workloads, on its prompts (every a ± b below 20, rendered
//! and tokenized as the worker does) and its decode batch (64 slots, at
//! most 4 new tokens):
//!
//! - `rollout`: groups of G = 8 completions of one prompt at T = 1, each
//!   group's sequences queued together, slots refilled as sequences end,
//!   and a weight swap every `--swap-every` decoding steps (the worker swaps
//!   in each new version mid-decode, which makes every sequence in flight
//!   recompute its cache);
//! - `evaluation`: what the evaluator generates, per problem one greedy
//!   completion and `--samples` at T = 1, no swap.
//!
//! Both settings run each workload on one model (one libtorch thread), in
//! rounds that alternate the two; a setting's time is its best round.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context as _;
use asyncrl_config::{DeviceName, ModelConfig};
use asyncrl_policy::from_config::load_policy;
use asyncrl_policy::{DecodeBatch, DecodeBatchOptions, Policy, SamplingParams, SequenceRequest};
use clap::Args;

#[derive(Debug, Args)]
pub struct PromptSharingArgs {
    /// A model folder (the main job's warm start, whose completions end
    /// where a trained policy's do); default: the built-in tiny model with
    /// random weights, whose completions run to `--max-new-tokens`.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Prompts (groups) in the rollout workload.
    #[arg(long, default_value_t = 128)]
    groups: usize,
    /// Completions per prompt in the rollout workload (G).
    #[arg(long, default_value_t = 8)]
    group_size: usize,
    /// Problems in the evaluation workload.
    #[arg(long, default_value_t = 200)]
    problems: usize,
    /// Sampled completions per problem in the evaluation workload (besides
    /// the greedy one).
    #[arg(long, default_value_t = 8)]
    samples: usize,
    /// Slots of the decode batch.
    #[arg(long, default_value_t = 64)]
    slots: usize,
    #[arg(long, default_value_t = 4)]
    max_new_tokens: usize,
    /// Decoding steps between two weight swaps in the rollout workload (0:
    /// none).
    #[arg(long, default_value_t = 8)]
    swap_every: usize,
    /// Rounds (the settings alternate within each; the best counts).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

/// What one run of a workload did.
#[derive(Debug, Clone, Copy, Default)]
struct Measured {
    seconds: f64,
    tokens: usize,
    computed: usize,
    shared: usize,
    steps: usize,
}

/// Runs `requests` in order through a fresh batch, refilling slots as
/// sequences end; marks the weights changed every `swap_every` steps.
fn run_once(
    policy: &mut Policy,
    requests: &[SequenceRequest],
    slots: usize,
    swap_every: usize,
    share: bool,
) -> anyhow::Result<Measured> {
    let longest = requests.iter().map(|r| r.prompt.len()).max().unwrap_or(1);
    let max_new = requests
        .iter()
        .map(|r| r.params.max_new_tokens)
        .max()
        .unwrap_or(1);
    let mut batch = DecodeBatch::new(
        policy,
        DecodeBatchOptions {
            max_slots: slots,
            max_seq_len: longest + max_new + 1,
        },
    )?;
    batch.share_prompts(share);
    let mut queue: VecDeque<SequenceRequest> = requests.iter().cloned().collect();
    let mut m = Measured::default();
    let start = Instant::now();
    tch::no_grad(|| -> anyhow::Result<()> {
        while !(queue.is_empty() && batch.is_empty()) {
            while batch.free_slots() > 0 {
                let Some(r) = queue.pop_front() else { break };
                batch.add(r)?;
            }
            let out = batch.step(policy)?;
            m.steps += 1;
            m.tokens += out.sampled.len();
            m.computed += out.positions_computed;
            m.shared += out.positions_shared;
            if swap_every > 0 && m.steps.is_multiple_of(swap_every) {
                policy.mark_weights_changed();
            }
        }
        Ok(())
    })?;
    m.seconds = start.elapsed().as_secs_f64();
    Ok(m)
}

fn params(temperature: f64, max_new_tokens: usize, seed: u64, eos: &[i64]) -> SamplingParams {
    SamplingParams {
        temperature,
        top_p: 1.0,
        top_k: 0,
        max_new_tokens,
        stop_token_ids: eos.to_vec(),
        seed: Some(seed),
    }
}

pub fn run(args: &PromptSharingArgs) -> anyhow::Result<String> {
    anyhow::ensure!(args.rounds > 0, "--rounds must be at least 1");
    anyhow::ensure!(args.slots > 0, "--slots must be at least 1");
    anyhow::ensure!(
        args.max_new_tokens > 0,
        "--max-new-tokens must be at least 1"
    );
    tch::set_num_threads(1);
    let model = ModelConfig {
        path: args.model.clone(),
        device: DeviceName::Cpu,
        cpu_threads: 1,
        ..ModelConfig::default()
    };
    let mut policy = load_policy(&model, args.seed).context("load the model")?;
    let text = policy.text().context("the model's text")?;
    let eos = policy.eos_token_ids();
    let all = asyncrl_tasks::arith_all(20);
    let prompts: Vec<Vec<i64>> = all
        .iter()
        .map(|item| {
            let rendered = text.render(&item.prompt)?;
            Ok(text.tokenizer().encode(&rendered, true)?)
        })
        .collect::<anyhow::Result<_>>()
        .context("tokenize the arith prompts")?;
    // Spread over all 800 problems, as the coordinator's shuffled epochs are.
    let pick = |k: usize, n: usize| &prompts[(k * prompts.len() / n.max(1)) % prompts.len()];
    let mut rollout = Vec::with_capacity(args.groups * args.group_size);
    for g in 0..args.groups {
        for j in 0..args.group_size {
            let seed = (g * args.group_size + j) as u64;
            rollout.push(SequenceRequest {
                prompt: pick(g, args.groups).clone(),
                params: params(1.0, args.max_new_tokens, seed, &eos),
            });
        }
    }
    let mut evaluation = Vec::with_capacity(args.problems * (args.samples + 1));
    for p in 0..args.problems {
        evaluation.push(SequenceRequest {
            prompt: pick(p, args.problems).clone(),
            params: params(0.0, args.max_new_tokens, p as u64, &eos),
        });
    }
    for p in 0..args.problems {
        for j in 0..args.samples {
            evaluation.push(SequenceRequest {
                prompt: pick(p, args.problems).clone(),
                params: params(
                    1.0,
                    args.max_new_tokens,
                    (p * args.samples + j) as u64,
                    &eos,
                ),
            });
        }
    }
    let workloads = [
        (
            "rollout",
            format!(
                "{} groups × G = {}, T = 1, a weight swap every {} decoding steps",
                args.groups, args.group_size, args.swap_every
            ),
            rollout,
            args.swap_every,
        ),
        (
            "evaluation",
            format!(
                "{} problems × (1 greedy + {} sampled), no swap",
                args.problems, args.samples
            ),
            evaluation,
            0,
        ),
    ];
    let mut report = String::new();
    writeln!(
        report,
        "# Generated tokens/s: prompt sharing in the decode batch\n\n\
         Model: {}; one libtorch thread; {} slots, at most {} new tokens; the arith \
         prompts ({}–{} tokens); {} round(s), the settings alternating; best round. \
         Load average before: {}.\n",
        args.model
            .as_ref()
            .map_or("the built-in tiny model, random weights".into(), |p| p
                .display()
                .to_string()),
        args.slots,
        args.max_new_tokens,
        prompts.iter().map(Vec::len).min().unwrap_or(0),
        prompts.iter().map(Vec::len).max().unwrap_or(0),
        args.rounds,
        super::load_average()
    )?;
    for (name, what, requests, swap_every) in workloads {
        let mut best = [None::<Measured>; 2];
        for _ in 0..args.rounds {
            for (k, share) in [false, true].into_iter().enumerate() {
                let m = run_once(&mut policy, &requests, args.slots, swap_every, share)
                    .with_context(|| format!("{name} workload"))?;
                if best[k].is_none_or(|b| m.seconds < b.seconds) {
                    best[k] = Some(m);
                }
            }
        }
        let [Some(off), Some(on)] = best else {
            anyhow::bail!("no round ran");
        };
        writeln!(
            report,
            "## {name} ({what})\n\n{} sequences.\n\n\
             | prompt sharing | tokens | decoding steps | positions computed | positions copied | s | tokens/s | vs off |\n\
             |---|---|---|---|---|---|---|---|",
            requests.len()
        )?;
        for (label, m) in [("off", off), ("on", on)] {
            writeln!(
                report,
                "| {label} | {} | {} | {} | {} | {:.3} | {:.0} | {:.2}× |",
                m.tokens,
                m.steps,
                m.computed,
                m.shared,
                m.seconds,
                m.tokens as f64 / m.seconds,
                off.seconds / m.seconds
            )?;
        }
        writeln!(report)?;
    }
    Ok(report)
}
