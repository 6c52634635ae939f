//! `asyncrl`: one binary for every role, so one container image serves all.
//!
//! Errors are printed as one line (`error: ...`, with the chain of causes
//! joined by `: `) and the process exits non-zero; no panic, no backtrace.

mod bench;
mod check;
mod ctl_cli;
#[cfg(feature = "torch")]
mod eval_cli;
#[cfg(feature = "torch")]
mod metrics_csv;
#[cfg(feature = "torch")]
mod plot;
mod roles;
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
    Ctl(ctl_cli::CtlCliArgs),
    /// Held-out accuracy of a model folder or a learner checkpoint.
    #[cfg(feature = "torch")]
    Eval(eval_cli::EvalArgs),
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
        bench: bench::BenchCommand,
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
    /// Check the config and its files, then exit: loads the model's
    /// tokenizer and chat template, reads every data set, renders and
    /// tokenizes every prompt, and prints the first one of each data set.
    #[arg(long)]
    check_config: bool,
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
        /// arith: every problem once (2 × max_operand² of them) instead of
        /// --n random ones: a held-out set that covers the whole task.
        #[arg(long, conflicts_with_all = ["n", "seed"])]
        all: bool,
        #[arg(long)]
        out: PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", asyncrl_common::process::one_line(&e));
            ExitCode::FAILURE
        }
    }
}

pub(crate) fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
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
pub(crate) fn load(path: &Path, bus: Option<&str>) -> anyhow::Result<Config> {
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
            let out = block_on(asyncrl_coordinator::ctl::ctl(&config, &args.request()))??;
            print!("{out}");
            Ok(())
        }
        Command::Warmstart(args) => warmstart(args),
        #[cfg(feature = "torch")]
        Command::Eval(args) => eval_cli::eval_command(args),
        Command::Data {
            command:
                DataCommand::Generate {
                    task,
                    n,
                    seed,
                    max_operand,
                    all,
                    out,
                },
        } => {
            let task = asyncrl_tasks::BuiltinTask::from_name(&task).with_context(|| {
                format!("--task {task:?} is not a built-in task (arith, reverse)")
            })?;
            let items = match (all, task) {
                (true, asyncrl_tasks::BuiltinTask::Arith) => asyncrl_tasks::arith_all(max_operand),
                (true, _) => anyhow::bail!("--all lists every problem of arith only"),
                (false, _) => asyncrl_tasks::generate_with(
                    task,
                    n,
                    seed,
                    asyncrl_tasks::GenerateOptions { max_operand },
                ),
            };
            asyncrl_tasks::write_jsonl(&out, &items)?;
            println!(
                "wrote {} {} tasks to {}",
                items.len(),
                task.name(),
                out.display()
            );
            Ok(())
        }
        Command::Bench { bench } => bench::run(bench),
    }
}

#[cfg(feature = "torch")]
fn train_command(args: TrainArgs) -> anyhow::Result<()> {
    let config = load(&args.config, args.bus.as_deref())?;
    if args.check_config {
        return check_config(&config);
    }
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
        asyncrl_learner::service::run(c, b, m, s).await.map(|_| ())
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
pub(crate) fn no_torch(command: &str) -> anyhow::Result<()> {
    anyhow::bail!(
        "`asyncrl {command}` needs libtorch, and this binary was built without the `torch` feature (the CPU-only control-plane image); use the full image"
    )
}

#[cfg(not(feature = "torch"))]
fn train_command(args: TrainArgs) -> anyhow::Result<()> {
    if args.check_config {
        return check_config(&load(&args.config, args.bus.as_deref())?);
    }
    no_torch("train")
}

/// `asyncrl train --check-config`.
fn check_config(config: &Config) -> anyhow::Result<()> {
    let report = check::check_tasks(config)?;
    print!("{report}");
    Ok(())
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
        let bus = roles::connect(&config, &process.metrics, roles::BusUser::Role(name)).await?;
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

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn cli_is_well_formed() {
        Cli::command().debug_assert();
    }
}
