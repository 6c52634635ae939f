//! `asyncrl-bench ...`: every benchmark of the project, with this one front
//! end. Each prints its figures next to a baseline measured in the same run
//! (a ratio), never a bare time.
//!
//! - `transport`: JetStream publish-with-ack through our bus against the
//!   NATS client used directly;
//! - `coordinator`: acquire → grant round trips against a raw echo;
//! - `worker`: continuous against static batching;
//! - `learner`: our training step against PyTorch eager;
//! - `packing`: learner tokens/s packed against padded;
//! - `prompt-sharing`: generated tokens/s of the built-in decode batch with
//!   prompt sharing against without;
//! - `engine`: the vLLM engine against the built-in one (tokens/s, the
//!   worker's CPU per 1,000 tokens, a weight swap against the raw reload);
//! - `staleness`: reward under η × clip mode × seeds;
//! - `speedup`: sync (η = 0) against async training;
//! - `chaos`: every role as a process under random faults, with the
//!   system's invariants checked throughout (a soak, not a ratio);
//! - `weights`: publish → in use on N workers against raw object-store
//!   put + N gets of the same bytes;
//! - `scale`: how each role's cost grows with its work (curves, fitted
//!   growth);
//! - `sync-step`: where the time of one synchronous (η = 0) step goes.
//!
//! The buffer's benches are criterion benches (`cargo bench -p
//! asyncrl-buffer`).

pub mod chaos;
mod coordinator;
mod curves;
mod engine;
pub mod gpu;
mod learner;
mod memory;
mod packing;
mod prompts;
pub mod scale;
pub mod scale_buffer;
pub mod scale_coordinator;
pub mod scale_learner;
mod speedup;
mod staleness;
mod stats;
mod sync_step;
mod transport;
mod weights;
mod worker;

use std::path::PathBuf;

use anyhow::Context as _;
use clap::{Args, Subcommand};

/// The 1, 5 and 15 minute load averages of /proc/loadavg, for reports.
pub(crate) fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|t| t.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|| "unknown".into())
}

/// The NATS server a bench measures against: the one at `--nats-url`, or a
/// private nats-server that lives as long as this value.
pub(crate) struct BenchServer {
    pub url: String,
    own: Option<asyncrl_testkit::NatsServer>,
}

impl BenchServer {
    pub fn at_or_start(url: Option<&str>) -> anyhow::Result<Self> {
        Ok(match url {
            Some(url) => Self {
                url: url.to_owned(),
                own: None,
            },
            None => {
                let server = asyncrl_testkit::NatsServer::start().context("start a nats-server")?;
                Self {
                    url: server.url(),
                    own: Some(server),
                }
            }
        })
    }

    /// What the report says about the server.
    pub fn describe(&self) -> String {
        match self.own {
            Some(_) => format!("private nats-server at {}", self.url),
            None => format!("nats-server at {}", self.url),
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// JetStream publish-with-ack throughput through asyncrl's transport
    /// against async-nats used directly, as a ratio.
    Transport(TransportBenchArgs),
    /// Acquire→grant round trips through the coordinator against a raw
    /// request/reply echo, as a ratio.
    Coordinator(NatsBenchArgs),
    /// Generated tokens/s with continuous batching against static batching
    /// on the long-tailed reverse task, as a ratio.
    Worker,
    /// Held-out accuracy under η × objective (naive, decoupled, adaptive,
    /// m2po) × seeds from the same start: CSV, PNG panels and a markdown
    /// report (cost of staleness, sync vs async time to a target).
    Staleness(StalenessArgs),
    /// Learner forward+backward+AdamW tokens/s of the built-in model against
    /// the same model in PyTorch eager (same shapes, same threads), as a ratio.
    Learner(LearnerBenchArgs),
    /// Generated tokens/s of a vLLM CPU server against the built-in engine
    /// on the same model and requests, the worker's CPU per 1,000 tokens
    /// around vLLM, and a weight swap against vLLM's raw reload.
    Engine(EngineBenchArgs),
    /// Peak resident memory of a Qwen2.5-0.5B-shaped model (random weights)
    /// generating with the built-in engine and taking one learner step,
    /// per micro-batch budget (the first is the baseline of the ratios).
    Memory(MemoryBenchArgs),
    /// Both trainer engines at real shapes (Qwen2.5-1.5B; Qwen3-8B's layers,
    /// torch only) on one batch: step time, peak memory, tokens/s, the
    /// torch engine with activation checkpointing, and both engines' loss on
    /// the same weights, as ratios against the built-in trainer
    /// (`scripts/gpu-check` runs it on a GPU).
    Gpu(GpuBenchArgs),
    /// Sync (η = 0) against async training on the long-tailed reverse task,
    /// learner and worker pinned to separate cores: the measured speedup next
    /// to the pipelining bound from the same runs.
    Speedup(SpeedupArgs),
    /// Every role as a process over a private nats-server, with kill -9,
    /// SIGTERM, SIGSTOP/SIGCONT of random roles and kill -9 of nats-server
    /// at seeded random times; checks trained-exactly-once, staleness ≤ η,
    /// versions, the step target, memory and disk, and writes a report.
    /// Clears OUT/run and OUT/logs first.
    Chaos(ChaosArgs),
    /// Time from a weight publish to the version in use on N workers, for
    /// the built-in model and a synthetic bf16 file, against raw
    /// object-store put + N gets of the same bytes in the same run.
    Weights(weights::WeightsArgs),
    /// Cost curves: coordinator CPU and grant latency vs workers, buffer
    /// memory and serve time vs resident trajectories, learner step time vs
    /// batch tokens; CSV, PNG and a markdown summary with the fitted growth.
    Scale(scale::ScaleArgs),
    /// Learner tokens/s with sequence packing against padding, on the main
    /// job's length mix and a long-tailed one, as ratios against padded.
    Packing(packing::PackingArgs),
    /// Generated tokens/s of the built-in decode batch with prompt sharing
    /// against without, on the main job's rollouts and evaluation.
    PromptSharing(prompts::PromptSharingArgs),
    /// Where the time of one synchronous (η = 0) step of a job goes:
    /// generation, scoring, training, weights, admission, trajectories →
    /// batch; one thread per role pinned against two threads on both cores.
    SyncStep(sync_step::SyncStepArgs),
}

#[derive(Debug, Args)]
pub struct ChaosArgs {
    /// How long the learner trains while faults are injected (e.g. 60s, 30m).
    #[arg(long, value_parser = chaos_duration)]
    duration: std::time::Duration,
    /// Seed of the fault schedule (and of the run).
    #[arg(long)]
    seed: u64,
    /// Rollout workers (2 or more).
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Mean gap between faults (each gap uniform in 0.5..1.5 times it).
    #[arg(long, default_value = "20s", value_parser = chaos_duration)]
    fault_every: std::time::Duration,
    /// Sampling interval of memory, disk, step and stream length.
    #[arg(long, default_value = "2s", value_parser = chaos_duration)]
    sample_every: std::time::Duration,
    /// Training has stalled (a failed invariant) when no step was trained
    /// for this long.
    #[arg(long, default_value = "60s", value_parser = chaos_duration)]
    stall_limit: std::time::Duration,
    #[arg(long, default_value_t = 2)]
    eta: u32,
    #[arg(long, default_value_t = 4)]
    groups_per_step: u32,
    #[arg(long, default_value_t = 4)]
    group_size: u32,
    /// Memory is flat when its projected growth over --duration is at most
    /// max(this many MiB, --mem-growth-frac × its median).
    #[arg(long, default_value_t = 16.0)]
    mem_growth_mib: f64,
    #[arg(long, default_value_t = 0.05)]
    mem_growth_frac: f64,
    /// A directory's disk use is flat when its projected growth over
    /// --duration is at most max(this many MiB, --disk-growth-frac × its
    /// median).
    #[arg(long, default_value_t = 1.0)]
    disk_growth_mib: f64,
    #[arg(long, default_value_t = 0.25)]
    disk_growth_frac: f64,
    /// nats-servers: 3 is a JetStream cluster with every stream at R3 (a
    /// NATS fault kills one node, the trajectory stream's leader); 1 is a
    /// single server.
    #[arg(long, default_value_t = 3)]
    nats_nodes: usize,
    /// Plain NATS: no TLS, no per-role credentials, routes that do not
    /// authenticate (the default is production's: TLS with verified client
    /// certificates, the roles' users of deploy/k8s/base/nats-auth.conf,
    /// authenticated TLS routes).
    #[arg(long)]
    plain: bool,
    #[arg(long, default_value = "runs/bench/chaos")]
    out: PathBuf,
    /// Print the fault schedule of these arguments and exit.
    #[arg(long)]
    plan_only: bool,
}

fn chaos_duration(text: &str) -> Result<std::time::Duration, String> {
    chaos::parse_duration(text)
}

#[derive(Debug, Args)]
pub struct SpeedupArgs {
    /// Learner steps per run.
    #[arg(long, default_value_t = 40)]
    steps: u64,
    /// First steps of each run not measured.
    #[arg(long, default_value_t = 5)]
    warmup: u64,
    /// η of the asynchronous runs.
    #[arg(long, default_value_t = 4)]
    eta: u32,
    /// Runs of each mode (alternating sync, async).
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// B: groups per learner step.
    #[arg(long, default_value_t = 8)]
    groups_per_step: u32,
    /// G: completions per prompt.
    #[arg(long, default_value_t = 8)]
    group_size: u32,
    /// Slots of the worker's decode batch.
    #[arg(long, default_value_t = 64)]
    max_sequences: usize,
    #[arg(long, value_delimiter = ',', default_value = "0")]
    learner_cores: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "1")]
    worker_cores: Vec<usize>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long, default_value = "docs/results/speedup")]
    out: PathBuf,
}

#[derive(Debug, Args)]
pub struct EngineBenchArgs {
    /// The model both engines serve (a Hugging Face folder; vLLM's CPU
    /// attention needs head_dim 32 or more).
    #[arg(long, default_value = "runs/warmstart-arith")]
    model: PathBuf,
    /// The python of the vLLM venv.
    #[arg(long, default_value = ".venv-vllm/bin/python")]
    vllm_python: PathBuf,
    #[arg(long, default_value_t = 512)]
    requests: usize,
    #[arg(long, default_value_t = 32)]
    max_new_tokens: usize,
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    #[arg(long, default_value_t = 5)]
    swaps: usize,
    /// Port of the vLLM server the bench launches (loopback).
    #[arg(long, default_value_t = 8012)]
    port: u16,
}

#[derive(Debug, Args)]
pub struct MemoryBenchArgs {
    #[arg(long, default_value_t = 8)]
    completions: usize,
    #[arg(long, default_value_t = 64)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 512)]
    completion_tokens: usize,
    /// Learner micro-batch budgets to measure (tokens; 0 = no split).
    #[arg(long, value_delimiter = ',', default_value = "2304,1152,576")]
    microbatch_tokens: Vec<usize>,
    #[arg(long, default_value_t = 2)]
    threads: i32,
    /// Skip generation (the learner trains on random tokens).
    #[arg(long)]
    skip_worker: bool,
    /// Then the torch trainer engine at these world sizes (e.g. `1,2`), on
    /// the same batch, each rank's peak measured.
    #[arg(long, value_delimiter = ',')]
    torch_world_sizes: Vec<usize>,
}

#[derive(Debug, Args)]
pub struct GpuBenchArgs {
    /// `cuda` or `cpu`.
    #[arg(long, default_value = "cuda")]
    device: String,
    /// qwen2.5-1.5b, qwen3-8b, tiny-qwen2, tiny-qwen3.
    #[arg(long, value_delimiter = ',', default_value = "qwen2.5-1.5b,qwen3-8b")]
    shapes: Vec<String>,
    /// Decoder layers of the qwen3-8b shape (36 in the real model, which
    /// does not fit one GPU with fp32 AdamW state).
    #[arg(long, default_value_t = 8)]
    qwen3_layers: usize,
    #[arg(long, default_value_t = 8)]
    rows: usize,
    #[arg(long, default_value_t = 256)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 768)]
    completion_tokens: usize,
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Micro-batch token budget of both engines (0: none).
    #[arg(long, default_value_t = 4096)]
    microbatch_tokens: usize,
    /// The interpreter with torch, transformers and asyncrl_trainer.
    #[arg(long, default_value = "python3")]
    python: PathBuf,
    /// Where the model folders are written (GBs per shape).
    #[arg(long, default_value = "runs/gpu-check/work")]
    work: PathBuf,
}

#[derive(Debug, Args)]
pub struct LearnerBenchArgs {
    #[arg(long, default_value_t = 64)]
    rows: i64,
    #[arg(long, default_value_t = 32)]
    seq_len: i64,
    #[arg(long, default_value_t = 20)]
    iterations: usize,
    /// Intra-op CPU threads, on both sides.
    #[arg(long, default_value_t = 1)]
    threads: i32,
}

#[derive(Debug, Args)]
pub struct StalenessArgs {
    /// The base config (task, model, batch sizes, learning rate, `[eval]`
    /// data set); η, objective, seed, steps and output directory are set
    /// per run.
    config: PathBuf,
    #[arg(long, value_delimiter = ',', default_value = "0,2,8,32")]
    etas: Vec<u32>,
    /// naive (PPO around the behaviour policy), decoupled, adaptive, m2po,
    /// gspo, tis, icepop, rloo (decoupled with leave-one-out advantages);
    /// job (the base config's objective as it is), job-dynamic (with
    /// dynamic sampling: buffer.min_reward_spread = 0.5), job-padded (with
    /// learner.packing off), job-unshared (with the built-in worker's
    /// prompt sharing off: worker.share_prompts = false),
    /// job-backward-all (zero-advantage rows take forward + backward too:
    /// learner.forward_only_zero_advantage = false), job-eval-nice0 (the
    /// evaluator at the learner's CPU priority: eval.nice = 0), job-dual-clip
    /// (job-dynamic with the dual_clip knob at 3).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "naive,decoupled,adaptive,m2po"
    )]
    objectives: Vec<String>,
    #[arg(long, value_delimiter = ',', default_value = "0,1,2")]
    seeds: Vec<u64>,
    /// Learner steps per run.
    #[arg(long, default_value_t = 200)]
    steps: u64,
    /// Held-out evaluation every this many steps.
    #[arg(long, default_value_t = 25)]
    eval_every: u64,
    /// Held-out greedy accuracy whose first crossing the table reports.
    #[arg(long, default_value_t = 0.5)]
    target: f64,
    #[arg(long, default_value = "docs/results/staleness")]
    out: PathBuf,
    /// Rewrite the report from the runs in OUT/runs (e.g. for another
    /// --target) without training.
    #[arg(long)]
    report_only: bool,
}

#[derive(Debug, Args)]
pub struct TransportBenchArgs {
    /// NATS server to benchmark against; default: start a private
    /// nats-server (from the project's .venv or PATH).
    #[arg(long)]
    nats_url: Option<String>,
    /// Messages per measurement.
    #[arg(long, default_value_t = 2_000)]
    messages: usize,
    /// Payload size of each message in bytes.
    #[arg(long, default_value_t = 16 * 1024)]
    message_bytes: usize,
    /// Publishes in flight in the pipelined measurement.
    #[arg(long, default_value_t = 64)]
    in_flight: usize,
    /// Alternating rounds per side; the best round counts.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

#[derive(Debug, Args)]
pub struct NatsBenchArgs {
    /// NATS server to benchmark against; default: a private nats-server.
    #[arg(long)]
    nats_url: Option<String>,
}

/// Runs one bench and prints its report.
pub fn run(bench: BenchCommand) -> anyhow::Result<()> {
    let rt = asyncrl_app::runtime()?;
    match bench {
        BenchCommand::Transport(args) => {
            let opts = transport::PublishBenchOptions {
                nats_url: args.nats_url,
                messages: args.messages,
                message_bytes: args.message_bytes,
                in_flight: args.in_flight,
                rounds: args.rounds,
            };
            let report = rt
                .block_on(transport::run_publish_bench(opts))
                .context("transport bench")?;
            print!("{report}");
        }
        BenchCommand::Coordinator(args) => {
            let opts = coordinator::AcquireBenchOptions {
                nats_url: args.nats_url,
                ..Default::default()
            };
            let report = rt
                .block_on(coordinator::run_acquire_bench(opts))
                .context("coordinator bench")?;
            print!("{report}");
        }
        BenchCommand::Staleness(args) => {
            let config = asyncrl_app::load(&args.config, None)?;
            let objectives = args
                .objectives
                .iter()
                .map(|o| staleness::Objective::parse(o))
                .collect::<anyhow::Result<Vec<_>>>()
                .context("--objectives")?;
            let spec = staleness::StalenessBench {
                etas: args.etas,
                objectives,
                seeds: args.seeds,
                steps: args.steps,
                eval_every: args.eval_every,
                target: args.target,
                out: args.out,
                report_only: args.report_only,
            };
            let report = rt.block_on(staleness::staleness(config, spec))?;
            print!("{report}");
        }
        BenchCommand::Speedup(args) => {
            let spec = speedup::SpeedupBench {
                steps: args.steps,
                warmup: args.warmup,
                eta: args.eta,
                rounds: args.rounds,
                groups_per_step: args.groups_per_step,
                group_size: args.group_size,
                max_sequences: args.max_sequences,
                learner_cores: args.learner_cores,
                worker_cores: args.worker_cores,
                seed: args.seed,
                out: args.out,
            };
            let report = rt.block_on(speedup::speedup(spec))?;
            print!("{report}");
        }
        BenchCommand::Worker => {
            let opts = worker::BatchingBenchOptions::default();
            let report = rt
                .block_on(worker::run_batching_bench(opts))
                .context("worker bench")?;
            print!("{report}");
        }
        BenchCommand::Learner(args) => {
            let opts = learner::LearnerBenchOptions {
                rows: args.rows,
                seq_len: args.seq_len,
                iterations: args.iterations,
                threads: args.threads,
                ..Default::default()
            };
            let report = learner::run_learner_bench(opts).context("learner bench")?;
            print!("{report}");
        }
        BenchCommand::Engine(args) => {
            let opts = engine::EngineBenchOptions {
                model: args.model,
                vllm_python: args.vllm_python,
                requests: args.requests,
                max_new_tokens: args.max_new_tokens,
                concurrency: args.concurrency,
                swaps: args.swaps,
                port: args.port,
            };
            let report = rt
                .block_on(engine::run_engine_bench(opts))
                .context("engine bench")?;
            print!("{report}");
        }
        BenchCommand::Memory(args) => {
            let opts = memory::MemoryBenchOptions {
                completions: args.completions,
                prompt_tokens: args.prompt_tokens,
                completion_tokens: args.completion_tokens,
                microbatch_tokens: args.microbatch_tokens,
                threads: args.threads,
                skip_worker: args.skip_worker,
                torch_world_sizes: args.torch_world_sizes,
                ..Default::default()
            };
            let report = memory::run_memory_bench(opts).context("memory bench")?;
            print!("{report}");
        }
        BenchCommand::Gpu(args) => {
            let opts = gpu::GpuBenchOptions {
                device: args.device,
                shapes: args.shapes,
                qwen3_layers: args.qwen3_layers,
                rows: args.rows,
                prompt_tokens: args.prompt_tokens,
                completion_tokens: args.completion_tokens,
                steps: args.steps,
                microbatch_tokens: args.microbatch_tokens,
                python: args.python,
                work: args.work,
                seed: 0,
            };
            let report = gpu::run_gpu_bench(opts).context("gpu bench")?;
            print!("{report}");
        }
        BenchCommand::Chaos(args) => {
            let spec = chaos::ChaosBench {
                stall_limit: args.stall_limit,
                duration: args.duration,
                seed: args.seed,
                workers: args.workers,
                fault_every: args.fault_every,
                sample_every: args.sample_every,
                eta: args.eta,
                groups_per_step: args.groups_per_step,
                group_size: args.group_size,
                mem_growth_mib: args.mem_growth_mib,
                mem_growth_frac: args.mem_growth_frac,
                disk_growth_mib: args.disk_growth_mib,
                disk_growth_frac: args.disk_growth_frac,
                nats_nodes: args.nats_nodes,
                secure: !args.plain,
                out: args.out,
                command: std::env::args().collect::<Vec<_>>().join(" "),
            };
            if args.plan_only {
                print!("{}", chaos::plan_text(&spec));
                return Ok(());
            }
            let report = chaos::chaos(&rt, &spec)?;
            print!("{report}");
        }
        BenchCommand::Weights(args) => {
            let report = weights::run(&rt, args).context("weights bench")?;
            print!("{report}");
        }
        BenchCommand::SyncStep(args) => {
            let report = sync_step::run(&rt, args).context("sync-step bench")?;
            print!("{report}");
        }
        BenchCommand::Packing(args) => {
            let report = packing::run(&args).context("packing bench")?;
            print!("{report}");
        }
        BenchCommand::PromptSharing(args) => {
            let report = prompts::run(&args).context("prompt-sharing bench")?;
            print!("{report}");
        }
        BenchCommand::Scale(args) => {
            let report = scale::run(&rt, args).context("scale bench")?;
            print!("{report}");
        }
    }
    Ok(())
}
