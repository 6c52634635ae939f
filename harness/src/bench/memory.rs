//! `asyncrl-bench memory`: whether a real model size fits, measured on this
//! machine. A model of Qwen2.5-0.5B's exact shape (its `config.json`
//! written here, weights random: nothing is downloaded) generates
//! `completions` × `completion_tokens` tokens with the built-in engine's
//! decode batch, then the learner trains one step on those completions with
//! its AdamW state, micro-batched by `learner.max_tokens_per_microbatch`.
//!
//! Each phase reports its wall time and the process's peak resident memory
//! during the phase (Linux `VmHWM`, reset between phases by writing `5` to
//! `/proc/self/clear_refs`), next to the resident memory before it: the
//! figures a user sizes a machine by. The learner's first step (which
//! allocates the gradients and AdamW's moments) is measured apart; then one
//! step per micro-batch budget given, all from the same steady state, the
//! first budget being the baseline of the ratios. A budget of 0 (no split)
//! at this size needs more than a 24 GiB machine has: the kernel's OOM
//! killer ends the bench there.

use std::fmt;
use std::time::Instant;

use anyhow::Context as _;
use asyncrl_learner::objective::ObjectiveConfig;
use asyncrl_learner::trainer::{StepSettings, Trainer, TrainerOptions};
use asyncrl_policy::{
    DecodeBatchOptions, DeviceOptions, ModelConfig, Policy, SamplingParams, SequenceRequest,
};
use asyncrl_protos::v1::{FinishReason, RewardStatus, Timings, Trajectory};

/// The `config.json` of Qwen2.5-0.5B(-Instruct), as published.
pub fn qwen2_5_0_5b_config() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": true,
        "vocab_size": 151936,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "hidden_act": "silu",
        "use_sliding_window": false,
        "torch_dtype": "bfloat16",
    })
}

#[derive(Debug, Clone)]
pub struct MemoryBenchOptions {
    pub completions: usize,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Learner micro-batch budgets (tokens) to measure, in order; 0 = no
    /// split.
    pub microbatch_tokens: Vec<usize>,
    pub threads: i32,
    /// Skip the generation phase (the learner trains on random tokens).
    pub skip_worker: bool,
    pub seed: u64,
}

impl Default for MemoryBenchOptions {
    fn default() -> Self {
        Self {
            completions: 8,
            prompt_tokens: 64,
            completion_tokens: 512,
            microbatch_tokens: vec![2304, 1152, 576],
            threads: 2,
            skip_worker: false,
            seed: 0,
        }
    }
}

/// One measured phase.
#[derive(Debug, Clone)]
pub struct Phase {
    pub name: String,
    pub seconds: f64,
    /// Resident memory when the phase started (MiB).
    pub rss_before_mib: f64,
    /// Peak resident memory during the phase (MiB).
    pub peak_mib: f64,
    pub note: String,
}

#[derive(Debug, Clone)]
pub struct MemoryBenchReport {
    pub opts: MemoryBenchOptions,
    pub parameters: i64,
    pub phases: Vec<Phase>,
}

/// `VmRSS` and `VmHWM` of this process, in MiB.
fn rss() -> anyhow::Result<(f64, f64)> {
    let status = std::fs::read_to_string("/proc/self/status")
        .context("read /proc/self/status (the memory bench needs Linux)")?;
    let field = |name: &str| -> anyhow::Result<f64> {
        let line = status
            .lines()
            .find(|l| l.starts_with(name))
            .with_context(|| format!("/proc/self/status has no {name}"))?;
        let kb: f64 = line
            .split_whitespace()
            .nth(1)
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("cannot read {line:?}"))?;
        Ok(kb / 1024.0)
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}

/// Resets the peak (`VmHWM`) to the current resident memory.
fn reset_peak() -> anyhow::Result<()> {
    std::fs::write("/proc/self/clear_refs", "5")
        .context("reset the peak resident memory (/proc/self/clear_refs)")
}

fn measure<T>(
    name: &str,
    phases: &mut Vec<Phase>,
    f: impl FnOnce() -> anyhow::Result<(T, String)>,
) -> anyhow::Result<T> {
    reset_peak()?;
    let (before, _) = rss()?;
    let start = Instant::now();
    let (out, note) = f()?;
    let seconds = start.elapsed().as_secs_f64();
    let (_, peak) = rss()?;
    eprintln!("{name}: {seconds:.1} s, peak {peak:.0} MiB ({note})");
    phases.push(Phase {
        name: name.to_owned(),
        seconds,
        rss_before_mib: before,
        peak_mib: peak,
        note,
    });
    Ok(out)
}

pub fn run_memory_bench(opts: MemoryBenchOptions) -> anyhow::Result<MemoryBenchReport> {
    tch::set_num_threads(opts.threads);
    let mut phases = Vec::new();
    let cfg = ModelConfig::from_json(&qwen2_5_0_5b_config())?;
    let policy = measure("model (random init, fp32)", &mut phases, || {
        let p = Policy::random_init(cfg, opts.seed, 0.02, DeviceOptions::cpu())?;
        let note = format!("{} parameters", p.num_parameters());
        Ok((p, note))
    })?;
    let parameters = policy.num_parameters();

    // Prompts of random token ids (below the special tokens).
    let mut rng = asyncrl_tasks::SplitMix64::new(opts.seed ^ 0x5eed);
    let prompts: Vec<Vec<i64>> = (0..opts.completions)
        .map(|_| {
            (0..opts.prompt_tokens)
                .map(|_| rng.below(151_000) as i64)
                .collect()
        })
        .collect();
    let sequences: Vec<(Vec<i64>, Vec<i64>, Vec<f32>)> = if opts.skip_worker {
        prompts
            .into_iter()
            .map(|p| {
                let c: Vec<i64> = (0..opts.completion_tokens)
                    .map(|_| rng.below(151_000) as i64)
                    .collect();
                let lp = vec![-12.0f32; c.len()];
                (p, c, lp)
            })
            .collect()
    } else {
        measure("worker: built-in engine generation", &mut phases, || {
            let params = SamplingParams {
                temperature: 1.0,
                top_p: 1.0,
                top_k: 0,
                max_new_tokens: opts.completion_tokens,
                // No stop token: every completion is full length.
                stop_token_ids: Vec::new(),
                seed: Some(opts.seed),
            };
            let requests = prompts
                .iter()
                .map(|p| SequenceRequest {
                    prompt: p.clone(),
                    params: params.clone(),
                })
                .collect();
            let out = asyncrl_policy::generate(
                &policy,
                requests,
                DecodeBatchOptions {
                    max_slots: opts.completions,
                    max_seq_len: opts.prompt_tokens + opts.completion_tokens,
                },
            )?;
            let tokens: usize = out.iter().map(|o| o.tokens.len()).sum();
            let seqs = out
                .into_iter()
                .map(|o| (o.prompt, o.tokens, o.logprobs))
                .collect();
            Ok((
                seqs,
                format!(
                    "{} completions, {tokens} tokens, {} slots",
                    opts.completions, opts.completions
                ),
            ))
        })?
    };

    // One group of all completions, rewards alternating so that the
    // advantages are not all zero.
    let trajectories: Vec<Trajectory> = sequences
        .iter()
        .enumerate()
        .map(|(i, (p, c, lp))| Trajectory {
            uuid: format!("00000000-0000-4000-8000-{i:012}"),
            task_id: "memory-0".into(),
            group_id: "memory-group".into(),
            prompt_token_ids: p.iter().map(|&t| t as i32).collect(),
            completion_token_ids: c.iter().map(|&t| t as i32).collect(),
            behaviour_logprobs: lp.clone(),
            policy_versions: vec![0; c.len()],
            reward: (i % 2) as f32,
            reward_status: RewardStatus::Ok as i32,
            finish_reason: FinishReason::Length as i32,
            worker_id: "bench".into(),
            timings: Some(Timings::default()),
            group_size: sequences.len() as u32,
            index_in_group: i as u32,
            admission_version: 0,
        })
        .collect();
    let batch = asyncrl_protos::arrow_schema::to_record_batch(&trajectories)?;
    let total_tokens = opts.completions * (opts.prompt_tokens + opts.completion_tokens);
    let mut trainer = Trainer::new(
        policy,
        TrainerOptions {
            proximal: asyncrl_learner::objective::ProximalMode::Recompute,
            ..Default::default()
        },
    );
    let settings = StepSettings {
        objective: ObjectiveConfig::default(),
        learning_rate: 1e-6,
    };
    // The first step allocates the gradients and AdamW's moments (they stay
    // for the run): measured apart, so that every budget after it is
    // measured from the same steady state.
    let first = opts.microbatch_tokens.first().copied().unwrap_or(0);
    trainer.set_max_tokens_per_microbatch(first);
    measure(
        "learner: first step (allocates gradients and AdamW state)",
        &mut phases,
        || {
            let stats = trainer.train_step(std::slice::from_ref(&batch), &settings)?;
            Ok((
                (),
                format!("micro-batches of ≤ {first} tokens: {}", stats.microbatches),
            ))
        },
    )?;
    for &budget in &opts.microbatch_tokens {
        trainer.set_max_tokens_per_microbatch(budget);
        let name = if budget == 0 {
            "learner: one step, no micro-batches".to_owned()
        } else {
            format!("learner: one step, micro-batches of ≤ {budget} tokens")
        };
        measure(&name, &mut phases, || {
            let stats = trainer.train_step(std::slice::from_ref(&batch), &settings)?;
            Ok((
                (),
                format!(
                    "{total_tokens} tokens ({} trained) in {} micro-batches",
                    stats.tokens, stats.microbatches
                ),
            ))
        })?;
    }
    Ok(MemoryBenchReport {
        opts,
        parameters,
        phases,
    })
}

impl fmt::Display for MemoryBenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let o = &self.opts;
        writeln!(
            f,
            "memory bench: Qwen2.5-0.5B shape ({} parameters, fp32, random weights), {} completions × ({} prompt + {} completion) tokens, {} threads",
            self.parameters, o.completions, o.prompt_tokens, o.completion_tokens, o.threads
        )?;
        writeln!(
            f,
            "| phase | seconds | RSS before (MiB) | peak RSS (MiB) | note |"
        )?;
        writeln!(f, "|---|---:|---:|---:|---|")?;
        for p in &self.phases {
            writeln!(
                f,
                "| {} | {:.1} | {:.0} | {:.0} | {} |",
                p.name, p.seconds, p.rss_before_mib, p.peak_mib, p.note
            )?;
        }
        let learner: Vec<&Phase> = self
            .phases
            .iter()
            .filter(|p| p.name.starts_with("learner: one step"))
            .collect();
        if let Some((base, rest)) = learner.split_first() {
            for p in rest {
                writeln!(
                    f,
                    "peak ratio `{}` / `{}`: {:.2}",
                    p.name,
                    base.name,
                    p.peak_mib / base.peak_mib
                )?;
            }
        }
        Ok(())
    }
}
