//! `asyncrl`: one binary for every role, so one container image serves all.
//!
//! Errors are printed as one line (`error: ...`, with the chain of causes
//! joined by `: `) and the process exits non-zero; no panic, no backtrace.

#[cfg(feature = "torch")]
mod bench;
#[cfg(feature = "torch")]
mod metrics_csv;
#[cfg(feature = "torch")]
mod plot;
mod roles;
#[cfg(feature = "torch")]
mod speedup;
#[cfg(feature = "torch")]
mod train;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context as _;
use asyncrl_config::Config;
use clap::{Args, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "asyncrl",
    version,
    about = "Asynchronous RL orchestration for post-training language models",
    propagate_version = true
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run every role in one process (the in-process bus unless --bus).
    Train(TrainArgs),
    /// Run the coordinator: version clock, staleness admission, task leases.
    Coordinator(RoleArgs),
    /// Run a rollout worker: generation with the current policy, rewards.
    Worker(RoleArgs),
    /// Run the replay buffer, or export what it holds.
    Buffer(BufferArgs),
    /// Run the learner.
    Learner(RoleArgs),
    /// Talk to a running coordinator's admin API.
    Ctl(CtlCliArgs),
    /// Supervised warm start of the model on the run's data set.
    Warmstart(WarmstartArgs),
    /// Data sets of the built-in tasks.
    Data {
        #[command(subcommand)]
        command: DataCommand,
    },
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        bench: BenchCommand,
    },
    /// Print the version, the linked libtorch and whether CUDA is usable.
    Version,
}

#[derive(Debug, Args)]
struct TrainArgs {
    /// The run's TOML config (see examples/arith.toml).
    config: PathBuf,
    /// Use this NATS server instead of the config's bus.url.
    #[arg(long)]
    bus: Option<String>,
    /// Rollout workers to run in the process.
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// Replace what a previous in-process run left in run.output_dir
    /// (checkpoints, buffer segments, logs); without it such a directory is
    /// refused, since the in-process bus cannot resume it.
    #[arg(long)]
    fresh: bool,
}

#[derive(Debug, Args)]
struct RoleArgs {
    /// The TOML config file.
    #[arg(long, short)]
    config: PathBuf,
    /// Use this NATS server instead of the config's bus.url.
    #[arg(long)]
    bus: Option<String>,
}

#[derive(Debug, Args)]
struct BufferArgs {
    #[command(subcommand)]
    command: Option<BufferCommand>,
    /// The TOML config file.
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// Use this NATS server instead of the config's bus.url.
    #[arg(long)]
    bus: Option<String>,
}

#[derive(Debug, Subcommand)]
enum BufferCommand {
    /// Write the stored trajectories as Parquet (pandas/polars/duckdb read it).
    Export {
        #[arg(long, short)]
        config: PathBuf,
        /// Output format (only parquet).
        #[arg(long, default_value = "parquet")]
        format: String,
        #[arg(long)]
        out: PathBuf,
        /// Only trajectories admitted at this version or later.
        #[arg(long)]
        from_version: Option<i32>,
        /// Only trajectories admitted at this version or earlier.
        #[arg(long)]
        to_version: Option<i32>,
    },
}

#[derive(Debug, Args)]
struct CtlCliArgs {
    /// The TOML config file (admin endpoint and token).
    #[arg(long, short)]
    config: Option<PathBuf>,
    #[command(flatten)]
    ctl: asyncrl_coordinator::ctl::CtlArgs,
}

#[derive(Debug, Args)]
struct WarmstartArgs {
    /// The run's TOML config: the built-in model of [model.tiny] is trained
    /// on the first [[coordinator.datasets]] entry (model.path is ignored).
    config: PathBuf,
    /// Where to write the warm-started model (a Hugging Face folder).
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value_t = 600)]
    steps: usize,
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Items held out of training to measure accuracy before and after.
    #[arg(long, default_value_t = 200)]
    eval: usize,
}

#[derive(Debug, Subcommand)]
enum DataCommand {
    /// Generate a JSONL data set of a built-in task (deterministic per seed).
    Generate {
        /// arith or reverse.
        #[arg(long)]
        task: String,
        #[arg(long, default_value_t = 10_000)]
        n: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// arith: operands are drawn below this bound.
        #[arg(long, default_value_t = 100)]
        max_operand: u64,
        #[arg(long)]
        out: PathBuf,
    },
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// JetStream publish-with-ack throughput through asyncrl's transport
    /// against async-nats used directly, as a ratio.
    Transport(TransportBenchArgs),
    /// Acquire→grant round trips through the coordinator against a raw
    /// request/reply echo, as a ratio.
    Coordinator(NatsBenchArgs),
    /// Generated tokens/s with continuous batching against static batching
    /// on the long-tailed reverse task, as a ratio.
    Worker,
    /// Reward under η × clip mode × seeds from the same start: CSV, PNG
    /// curves and a markdown table.
    Staleness(StalenessArgs),
    /// Learner forward+backward+AdamW tokens/s of the built-in model against
    /// the same model in PyTorch eager (same shapes, same threads), as a ratio.
    Learner(LearnerBenchArgs),
    /// Sync (η = 0) against async training on the long-tailed reverse task,
    /// learner and worker pinned to separate cores: the measured speedup next
    /// to the pipelining bound from the same runs.
    Speedup(SpeedupArgs),
}

#[derive(Debug, Args)]
struct SpeedupArgs {
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
struct LearnerBenchArgs {
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
struct StalenessArgs {
    /// The base config (task, model, batch sizes); η, clip mode, seed,
    /// steps and output directory are set per run.
    config: PathBuf,
    #[arg(long, value_delimiter = ',', default_value = "0,1,4,8")]
    etas: Vec<u32>,
    #[arg(long, value_delimiter = ',', default_value = "ppo,adaptive,m2po")]
    clips: Vec<String>,
    #[arg(long, value_delimiter = ',', default_value = "0,1")]
    seeds: Vec<u64>,
    /// Learner steps per run.
    #[arg(long, default_value_t = 150)]
    steps: u64,
    /// Reward whose first crossing the table reports.
    #[arg(long, default_value_t = 0.4)]
    target: f64,
    #[arg(long, default_value = "docs/results/staleness")]
    out: PathBuf,
}

#[derive(Debug, Args)]
struct TransportBenchArgs {
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
struct NatsBenchArgs {
    /// NATS server to benchmark against; default: a private nats-server.
    #[arg(long)]
    nats_url: Option<String>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")
}

/// Runs `fut` to completion on a new runtime, then gives the runtime's
/// blocking tasks (file writes, fsyncs) a bounded time to finish: a stuck
/// one must not keep the process from exiting once its work is done.
fn block_on<F: std::future::Future>(fut: F) -> anyhow::Result<F::Output> {
    let rt = runtime()?;
    let out = rt.block_on(fut);
    rt.shutdown_timeout(std::time::Duration::from_secs(10));
    Ok(out)
}

/// Loads the config, applies a `--bus` override and sets up logging.
fn load(path: &Path, bus: Option<&str>) -> anyhow::Result<Config> {
    let mut config = Config::load(path)?;
    if let Some(url) = bus {
        config.bus.url = url.to_owned();
        config.bus.validate()?;
    }
    asyncrl_telemetry::init_tracing(&config.telemetry)?;
    Ok(config)
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Version => {
            println!("asyncrl {}", env!("CARGO_PKG_VERSION"));
            #[cfg(feature = "torch")]
            println!("{}", asyncrl_learner::device_report());
            #[cfg(not(feature = "torch"))]
            println!(
                "built without the `torch` feature: no libtorch (coordinator, buffer, ctl, data)"
            );
            Ok(())
        }
        Command::Train(args) => train_command(args),
        Command::Coordinator(args) => role(args, "coordinator", |c, b, m, s| async move {
            asyncrl_coordinator::run(c, b, m, s)
                .await
                .map_err(Into::into)
        }),
        Command::Buffer(BufferArgs {
            command:
                Some(BufferCommand::Export {
                    config,
                    format,
                    out,
                    from_version,
                    to_version,
                }),
            ..
        }) => {
            if format != "parquet" {
                anyhow::bail!("--format {format:?} is not supported (only parquet)");
            }
            let config = Config::load(&config)?;
            let mut args = asyncrl_buffer::ExportArgs::from_config(&config, out);
            args.from_version = from_version;
            args.to_version = to_version;
            let summary = asyncrl_buffer::export(&args)?;
            println!("{summary}");
            Ok(())
        }
        Command::Buffer(BufferArgs {
            command: None,
            config,
            bus,
        }) => {
            let config = config.context("asyncrl buffer needs --config FILE")?;
            role(
                RoleArgs { config, bus },
                "buffer",
                |c, b, m, s| async move { asyncrl_buffer::run(c, b, m, s).await.map_err(Into::into) },
            )
        }
        Command::Learner(args) => learner_command(args),
        Command::Worker(args) => worker_command(args),
        Command::Ctl(args) => {
            let config = match &args.config {
                Some(p) => Config::load(p)?,
                None => Config::default(),
            };
            let out = block_on(asyncrl_coordinator::ctl::ctl(&config, &args.ctl))??;
            print!("{out}");
            Ok(())
        }
        Command::Warmstart(args) => warmstart(args),
        Command::Data {
            command:
                DataCommand::Generate {
                    task,
                    n,
                    seed,
                    max_operand,
                    out,
                },
        } => {
            let task = asyncrl_tasks::BuiltinTask::from_name(&task).with_context(|| {
                format!("--task {task:?} is not a built-in task (arith, reverse)")
            })?;
            let items = asyncrl_tasks::generate_with(
                task,
                n,
                seed,
                asyncrl_tasks::GenerateOptions { max_operand },
            );
            asyncrl_tasks::write_jsonl(&out, &items)?;
            println!(
                "wrote {} {} tasks to {}",
                items.len(),
                task.name(),
                out.display()
            );
            Ok(())
        }
        Command::Bench { bench } => bench_command(bench),
    }
}

#[cfg(feature = "torch")]
fn train_command(args: TrainArgs) -> anyhow::Result<()> {
    let config = load(&args.config, args.bus.as_deref())?;
    let opts = train::TrainOptions {
        workers: args.workers,
        fresh: args.fresh,
        progress: std::io::IsTerminal::is_terminal(&std::io::stderr()),
        ..Default::default()
    };
    let summary = block_on(train::train(config, opts))??;
    print!("{summary}");
    Ok(())
}

#[cfg(feature = "torch")]
fn learner_command(args: RoleArgs) -> anyhow::Result<()> {
    role(args, "learner", |c, b, m, s| async move {
        asyncrl_learner::service::run(c, b, m, s)
            .await
            .map(|_| ())
            .map_err(Into::into)
    })
}

#[cfg(feature = "torch")]
fn worker_command(args: RoleArgs) -> anyhow::Result<()> {
    role(args, "worker", |c, b, m, s| async move {
        asyncrl_rollout_worker::run(c, b, m, s)
            .await
            .map(|_| ())
            .map_err(Into::into)
    })
}

/// The error of a subcommand that needs the tensor roles in a binary built
/// without them.
#[cfg(not(feature = "torch"))]
fn no_torch(command: &str) -> anyhow::Result<()> {
    anyhow::bail!(
        "`asyncrl {command}` needs libtorch, and this binary was built without the `torch` feature (the CPU-only control-plane image); use the full image"
    )
}

#[cfg(not(feature = "torch"))]
fn train_command(_: TrainArgs) -> anyhow::Result<()> {
    no_torch("train")
}

#[cfg(not(feature = "torch"))]
fn learner_command(_: RoleArgs) -> anyhow::Result<()> {
    no_torch("learner")
}

#[cfg(not(feature = "torch"))]
fn worker_command(_: RoleArgs) -> anyhow::Result<()> {
    no_torch("worker")
}

#[cfg(not(feature = "torch"))]
fn warmstart(_: WarmstartArgs) -> anyhow::Result<()> {
    no_torch("warmstart")
}

/// Runs one role in its own process until SIGTERM/SIGINT.
fn role<F, Fut>(args: RoleArgs, name: &'static str, body: F) -> anyhow::Result<()>
where
    F: FnOnce(
        Config,
        std::sync::Arc<dyn asyncrl_transport::Bus>,
        asyncrl_telemetry::Metrics,
        tokio_util::sync::CancellationToken,
    ) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let config = load(&args.config, args.bus.as_deref())?;
    roles::require_nats(&config, name)?;
    block_on(async move {
        let process = roles::start(&config, name).await?;
        let bus = roles::connect(&config, &process.metrics).await?;
        process.health.set_ready("bus");
        tracing::info!(role = name, bus = %config.bus.url, telemetry = ?process.telemetry_addr, "started");
        let result = body(
            config,
            bus,
            process.metrics.clone(),
            process.shutdown.clone(),
        )
        .await;
        process.shutdown.cancel();
        result.with_context(|| name.to_string())
    })?
}

#[cfg(feature = "torch")]
fn warmstart(args: WarmstartArgs) -> anyhow::Result<()> {
    let config = load(&args.config, None)?;
    let opts = asyncrl_learner::sft::SftOptions {
        steps: args.steps,
        batch_size: args.batch_size,
        learning_rate: args.lr,
        seed: config.run.seed,
        temperature: asyncrl_policy::logprob_temperature(config.model.temperature),
        grad_clip: 1.0,
    };
    let report = asyncrl_learner::sft::run_warm_start(&config, &opts, args.eval, &args.out)?;
    println!(
        "warm start: {} steps in {:.0}s; accuracy on {} held-out tasks: greedy {:.3} -> {:.3}, sampled (T={}) {:.3} -> {:.3}",
        args.steps,
        report.seconds,
        args.eval,
        report.before.greedy,
        report.after.greedy,
        config.model.temperature,
        report.before.sampled,
        report.after.sampled
    );
    println!("model: {}", args.out.display());
    Ok(())
}

fn bench_command(bench: BenchCommand) -> anyhow::Result<()> {
    let rt = runtime()?;
    match bench {
        BenchCommand::Transport(args) => {
            let opts = asyncrl_transport::bench::PublishBenchOptions {
                nats_url: args.nats_url,
                messages: args.messages,
                message_bytes: args.message_bytes,
                in_flight: args.in_flight,
                rounds: args.rounds,
            };
            let report = rt
                .block_on(asyncrl_transport::bench::run_publish_bench(opts))
                .context("transport bench")?;
            print!("{report}");
        }
        BenchCommand::Coordinator(args) => {
            let opts = asyncrl_coordinator::bench::AcquireBenchOptions {
                nats_url: args.nats_url,
                ..Default::default()
            };
            let report = rt
                .block_on(asyncrl_coordinator::bench::run_acquire_bench(opts))
                .context("coordinator bench")?;
            print!("{report}");
        }
        #[cfg(feature = "torch")]
        BenchCommand::Staleness(args) => {
            let config = load(&args.config, None)?;
            let clips = args
                .clips
                .iter()
                .map(|c| bench::parse_clip(c))
                .collect::<anyhow::Result<Vec<_>>>()?;
            let spec = bench::StalenessBench {
                etas: args.etas,
                clips,
                seeds: args.seeds,
                steps: args.steps,
                target: args.target,
                out: args.out,
            };
            let report = rt.block_on(bench::staleness(config, spec))?;
            print!("{report}");
        }
        #[cfg(feature = "torch")]
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
        #[cfg(feature = "torch")]
        BenchCommand::Worker => {
            let opts = asyncrl_rollout_worker::bench::BatchingBenchOptions::default();
            let report = rt
                .block_on(asyncrl_rollout_worker::bench::run_batching_bench(opts))
                .context("worker bench")?;
            print!("{report}");
        }
        #[cfg(feature = "torch")]
        BenchCommand::Learner(args) => {
            let opts = asyncrl_learner::bench::LearnerBenchOptions {
                rows: args.rows,
                seq_len: args.seq_len,
                iterations: args.iterations,
                threads: args.threads,
                ..Default::default()
            };
            let report =
                asyncrl_learner::bench::run_learner_bench(opts).context("learner bench")?;
            print!("{report}");
        }
        #[cfg(not(feature = "torch"))]
        BenchCommand::Learner(_) => return no_torch("bench learner"),
        #[cfg(not(feature = "torch"))]
        BenchCommand::Staleness(_) => return no_torch("bench staleness"),
        #[cfg(not(feature = "torch"))]
        BenchCommand::Worker => return no_torch("bench worker"),
        #[cfg(not(feature = "torch"))]
        BenchCommand::Speedup(_) => return no_torch("bench speedup"),
    }
    Ok(())
}

/// The error and its causes on one line, joined by `: `. A cause whose text
/// the message before it already includes (errors that print their source
/// themselves) is not repeated.
fn one_line(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        let text = cause
            .to_string()
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect::<Vec<_>>()
            .join(" ");
        if parts.last().is_some_and(|prev| prev.contains(&text)) {
            continue;
        }
        parts.push(text);
    }
    parts.join(": ")
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn cli_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn errors_are_one_line() {
        let e = anyhow::anyhow!("inner\nsecond line").context("outer");
        assert_eq!(one_line(&e), "outer: inner second line");
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "gone");
        let e = anyhow::Error::new(io).context("cannot read x: gone");
        assert_eq!(one_line(&e), "cannot read x: gone");
    }
}
