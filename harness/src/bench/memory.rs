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
    /// After the built-in trainer, the torch engine at each of these world
    /// sizes trains the same batch (two steps, the first budget), each rank
    /// measured as its own process.
    pub torch_world_sizes: Vec<usize>,
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
            torch_world_sizes: Vec::new(),
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
    /// The torch engine's phases, per world size.
    pub torch: Vec<TorchPhase>,
}

/// A phase of the torch engine: the bench process (the learner's side) and
/// every rank, each a process of its own.
#[derive(Debug, Clone)]
pub struct TorchPhase {
    pub world_size: usize,
    pub name: String,
    pub seconds: f64,
    pub learner_peak_mib: f64,
    /// Peak resident memory of each rank during the phase (MiB).
    pub rank_peaks_mib: Vec<f64>,
}

/// `VmHWM` of process `pid` in MiB.
fn peak_of(pid: u32) -> anyhow::Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("read /proc/{pid}/status"))?;
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<f64>().ok())
        .map(|kb| kb / 1024.0)
        .with_context(|| format!("/proc/{pid}/status has no VmHWM"))
}

/// The torch engine's rank processes (children of its torchrun).
fn torch_ranks() -> Vec<u32> {
    crate::process::descendants(std::process::id())
        .into_iter()
        .filter(|(_, cmd)| {
            cmd.contains("asyncrl_trainer.server") && !cmd.contains("torch.distributed.run")
        })
        .map(|(pid, _)| pid)
        .collect()
}

fn measure_torch(
    world_size: usize,
    name: &str,
    phases: &mut Vec<TorchPhase>,
    f: impl FnOnce() -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    reset_peak()?;
    for pid in torch_ranks() {
        std::fs::write(format!("/proc/{pid}/clear_refs"), "5")
            .with_context(|| format!("reset the peak of rank process {pid}"))?;
    }
    let start = Instant::now();
    f()?;
    let seconds = start.elapsed().as_secs_f64();
    let (_, learner_peak_mib) = rss()?;
    let rank_peaks_mib = torch_ranks()
        .into_iter()
        .map(peak_of)
        .collect::<anyhow::Result<Vec<_>>>()?;
    eprintln!(
        "torch world size {world_size}, {name}: {seconds:.1} s, learner {learner_peak_mib:.0} MiB, ranks {rank_peaks_mib:?} MiB"
    );
    phases.push(TorchPhase {
        world_size,
        name: name.to_owned(),
        seconds,
        learner_peak_mib,
        rank_peaks_mib,
    });
    Ok(())
}

/// The torch engine at `world_size` on the model folder `model`: start
/// (rank 0 loads the model, every rank shards it and takes its shards from rank 0), a first step (allocates
/// gradients and AdamW state), a second step.
fn run_torch(
    model: &std::path::Path,
    world_size: usize,
    budget: usize,
    batch: &arrow::array::RecordBatch,
    phases: &mut Vec<TorchPhase>,
) -> anyhow::Result<()> {
    use asyncrl_config::{Config, ProximalName, TrainerEngineName};
    use asyncrl_learner::engine::TrainerEngine as _;
    let work = tempfile::tempdir().context("a temp dir")?;
    let mut config = Config::isolated(work.path().join("out"), "local");
    config.model.path = Some(model.to_owned());
    config.learner.trainer = TrainerEngineName::Torch;
    config.learner.torch.world_size = world_size;
    config.learner.proximal = ProximalName::Recompute;
    config.learner.max_tokens_per_microbatch = budget;
    config.coordinator.initial_knobs.learning_rate = 1e-6;
    let opts = asyncrl_learner::service::trainer_options(&config);
    let mut engine = None;
    measure_torch(
        world_size,
        "start: rank 0 loads the model, the ranks shard it",
        phases,
        || {
            engine = Some(asyncrl_learner::torch_engine::TorchEngine::start(
                &config,
                opts,
                &work.path().join("checkpoints"),
            )?);
            Ok(())
        },
    )?;
    let mut engine = engine.context("the engine did not start")?;
    let settings = StepSettings {
        objective: ObjectiveConfig::default(),
        learning_rate: 1e-6,
    };
    for name in ["first step (allocates gradients and AdamW state)", "step"] {
        measure_torch(world_size, name, phases, || {
            engine.train_step(std::slice::from_ref(batch), &settings)?;
            Ok(())
        })?;
    }
    Ok(())
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
            turns: Vec::new(),
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
    let mut torch = Vec::new();
    if !opts.torch_world_sizes.is_empty() {
        let dir = tempfile::tempdir().context("a temp dir")?;
        let model = dir.path().join("model");
        trainer
            .policy()
            .save_pretrained(&model, None)
            .context("write the model folder the torch engine loads")?;
        // The built-in trainer's weights, gradients and moments go before
        // the torch engine's processes start.
        drop(trainer);
        // SAFETY: malloc_trim only returns free heap pages to the kernel.
        unsafe {
            libc::malloc_trim(0);
        }
        for &world in &opts.torch_world_sizes {
            run_torch(&model, world, first, &batch, &mut torch)
                .with_context(|| format!("the torch engine at world size {world}"))?;
        }
    }
    Ok(MemoryBenchReport {
        opts,
        parameters,
        phases,
        torch,
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
        if !self.torch.is_empty() {
            writeln!(
                f,
                "\ntorch engine (fp32, FSDP2 over gloo), micro-batches of ≤ {} tokens:",
                o.microbatch_tokens.first().copied().unwrap_or(0)
            )?;
            writeln!(
                f,
                "| world size | phase | seconds | learner process peak (MiB) | peak per rank (MiB) |"
            )?;
            writeln!(f, "|---:|---|---:|---:|---|")?;
            for p in &self.torch {
                let ranks: Vec<String> =
                    p.rank_peaks_mib.iter().map(|m| format!("{m:.0}")).collect();
                writeln!(
                    f,
                    "| {} | {} | {:.1} | {:.0} | {} |",
                    p.world_size,
                    p.name,
                    p.seconds,
                    p.learner_peak_mib,
                    ranks.join(", ")
                )?;
            }
            // The baseline: the built-in trainer's step at the same budget.
            if let Some(base) = learner.first() {
                for p in self.torch.iter().filter(|p| p.name == "step") {
                    let worst = p.rank_peaks_mib.iter().copied().fold(0.0, f64::max);
                    writeln!(
                        f,
                        "peak ratio torch rank (world size {}) / built-in learner step: {:.2}",
                        p.world_size,
                        worst / base.peak_mib
                    )?;
                }
            }
        }
        Ok(())
    }
}
