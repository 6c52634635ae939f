//! `asyncrl`: one binary for every role, so one container image serves all.
//!
//! Errors are printed as one line (`error: ...`, with the chain of causes
//! joined by `: `) and the process exits non-zero; no panic, no backtrace.

//!
//! This file is the command line and nothing else: what each subcommand
//! does is in `asyncrl-app` (the composition root as a library); the
//! benches are the separate `asyncrl-bench` binary (`harness/`).

mod ctl_cli;
#[cfg(feature = "torch")]
mod eval_cli;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use asyncrl_app::commands;
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
    /// Run one more node of the learner's torch engine group
    /// (`learner.torch.nodes` > 1; the learner is node 0).
    TrainerNode(TrainerNodeArgs),
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
struct TrainerNodeArgs {
    /// The learner's TOML config file (the same as the learner's).
    #[arg(long, short)]
    config: PathBuf,
    /// This node's rank, 1 to `learner.torch.nodes` - 1; by default the
    /// Indexed Job's `JOB_COMPLETION_INDEX` + 1.
    #[arg(long)]
    node_rank: Option<usize>,
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
    /// Use the fastest CPU kernels this machine offers. By default the warm
    /// start pins libtorch to portable kernels, so that it makes the same
    /// weights on every x86-64 CPU (a long supervised run amplifies the
    /// last-bit differences between CPUs' kernels).
    #[arg(long)]
    native_kernels: bool,
}

#[derive(Debug, Subcommand)]
enum DataCommand {
    /// Generate a JSONL data set of a built-in task (deterministic per seed).
    Generate {
        /// arith, reverse or hidden_sum.
        #[arg(long)]
        task: String,
        #[arg(long, default_value_t = 10_000)]
        n: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// arith, hidden_sum: operands are drawn below this bound.
        #[arg(long, default_value_t = 100)]
        max_operand: u64,
        /// arith, hidden_sum: every problem once (2 × max_operand² or
        /// max_operand² of them) instead of --n random ones: a held-out set
        /// that covers the whole task.
        #[arg(long, conflicts_with_all = ["n", "seed"])]
        all: bool,
        #[arg(long)]
        out: PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    #[cfg(feature = "torch")]
    if let Command::Warmstart(a) = &cli.command
        && !a.native_kernels
    {
        // SAFETY: the process has one thread here (argument parsing
        // starts none) and has run no tensor operation.
        unsafe { commands::pin_portable_kernels() };
    }
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", asyncrl_common::process::one_line(&e));
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Version => {
            println!("{}", commands::version_report());
            Ok(())
        }
        Command::Train(a) => commands::train(
            &a.config,
            a.bus.as_deref(),
            a.workers,
            a.fresh,
            a.check_config,
        ),
        Command::Coordinator(a) => commands::coordinator(&a.config, a.bus.as_deref()),
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
        }) => commands::buffer_export(&config, &format, out, from_version, to_version),
        Command::Buffer(BufferArgs {
            command: None,
            config,
            bus,
        }) => {
            let config = config.context("asyncrl buffer needs --config FILE")?;
            commands::buffer(&config, bus.as_deref())
        }
        Command::Learner(a) => commands::learner(&a.config, a.bus.as_deref()),
        Command::TrainerNode(a) => commands::trainer_node(&a.config, a.node_rank),
        Command::Worker(a) => commands::worker(&a.config, a.bus.as_deref()),
        Command::Ctl(a) => commands::ctl(a.config.as_deref(), &a.request()),
        Command::Warmstart(a) => commands::warmstart(&commands::Warmstart {
            config: a.config,
            out: a.out,
            steps: a.steps,
            batch_size: a.batch_size,
            lr: a.lr,
            eval: a.eval,
        }),
        #[cfg(feature = "torch")]
        Command::Eval(a) => asyncrl_app::eval::eval_command(a.into()),
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
        } => commands::data_generate(&commands::DataGenerate {
            task,
            n,
            seed,
            max_operand,
            all,
            out,
        }),
    }
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
