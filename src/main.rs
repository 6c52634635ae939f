//! `asyncrl`: one binary for every role, so one container image serves all.
//!
//! Errors are printed as one line (`error: ...`, with the chain of causes
//! joined by `: `) and the process exits non-zero; no panic, no backtrace.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context as _;
use asyncrl_config::{BusKind, Config};
use clap::{Args, Parser, Subcommand};

/// Exit code of a subcommand whose role is not built yet (and of clap's
/// usage errors).
const EXIT_NOT_BUILT: u8 = 2;

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
    /// Run every role in one process over the in-process bus.
    Train {
        /// The run's TOML config (see examples/local.toml).
        config: PathBuf,
    },
    /// Run the coordinator: version clock, staleness admission, task leases.
    Coordinator(RoleArgs),
    /// Run a rollout worker: generation with the current policy, rewards.
    Worker(RoleArgs),
    /// Run the replay buffer.
    Buffer(RoleArgs),
    /// Run the learner.
    Learner(RoleArgs),
    /// Talk to a running coordinator's admin API.
    Ctl(RoleArgs),
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        bench: BenchCommand,
    },
    /// Print the version, the linked libtorch and whether CUDA is usable.
    Version,
}

#[derive(Debug, Args)]
struct RoleArgs {
    /// The TOML config file.
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// Arguments of the role's own subcommands.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, hide = true)]
    rest: Vec<String>,
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// JetStream publish-with-ack throughput through asyncrl's transport
    /// against async-nats used directly, as a ratio.
    Transport(TransportBenchArgs),
    /// Reward against staleness bound and clipping mode.
    Staleness(RoleArgs),
    /// Sync against async wall-clock speedup.
    Speedup(RoleArgs),
}

#[derive(Debug, Args)]
struct TransportBenchArgs {
    /// The TOML config file; a `nats://` bus.url in it is the server to use.
    #[arg(long, short)]
    config: Option<PathBuf>,
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

/// How a subcommand ended, short of an error.
enum Outcome {
    Done,
    /// The role exists in the CLI but its crate is not written yet.
    NotBuilt {
        command: &'static str,
        issue: u32,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(Outcome::Done) => ExitCode::SUCCESS,
        Ok(Outcome::NotBuilt { command, issue }) => {
            eprintln!("error: 'asyncrl {command}' is not built yet (see issue #{issue})");
            ExitCode::from(EXIT_NOT_BUILT)
        }
        Err(e) => {
            eprintln!("error: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<Outcome> {
    match cli.command {
        Command::Version => {
            print_version();
            Ok(Outcome::Done)
        }
        Command::Train { config } => {
            load_config(&config)?;
            Ok(not_built("train", 7))
        }
        Command::Coordinator(args) => role(args, "coordinator", 5),
        Command::Worker(args) => role(args, "worker", 4),
        Command::Buffer(args) => role(args, "buffer", 6),
        Command::Learner(args) => role(args, "learner", 3),
        Command::Ctl(args) => role(args, "ctl", 5),
        Command::Bench { bench } => match bench {
            BenchCommand::Transport(args) => bench_transport(args),
            BenchCommand::Staleness(args) => role(args, "bench staleness", 7),
            BenchCommand::Speedup(args) => role(args, "bench speedup", 7),
        },
    }
}

/// A role whose crate is still empty: validate its config (so a typo is
/// reported now, not once the role exists), then say it is not built.
fn role(args: RoleArgs, command: &'static str, issue: u32) -> anyhow::Result<Outcome> {
    if let Some(path) = &args.config {
        load_config(path)?;
    }
    Ok(not_built(command, issue))
}

fn not_built(command: &'static str, issue: u32) -> Outcome {
    Outcome::NotBuilt { command, issue }
}

fn load_config(path: &Path) -> anyhow::Result<Config> {
    Ok(Config::load(path)?)
}

fn print_version() {
    println!("asyncrl {}", env!("CARGO_PKG_VERSION"));
    println!("{}", asyncrl_learner::device_report());
}

fn bench_transport(args: TransportBenchArgs) -> anyhow::Result<Outcome> {
    let config = match &args.config {
        Some(path) => load_config(path)?,
        None => Config::default(),
    };
    asyncrl_telemetry::init_tracing(&config.telemetry)?;
    let nats_url = args
        .nats_url
        .clone()
        .or_else(|| (config.bus.kind() == BusKind::Nats).then(|| config.bus.url.clone()));
    let opts = asyncrl_transport::bench::PublishBenchOptions {
        nats_url,
        messages: args.messages,
        message_bytes: args.message_bytes,
        in_flight: args.in_flight,
        rounds: args.rounds,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")?;
    let report = runtime.block_on(run_transport_bench(opts))?;
    print!("{report}");
    Ok(Outcome::Done)
}

/// The one call into the transport crate's publish benchmark.
async fn run_transport_bench(
    opts: asyncrl_transport::bench::PublishBenchOptions,
) -> anyhow::Result<asyncrl_transport::bench::PublishBenchReport> {
    asyncrl_transport::bench::run_publish_bench(opts)
        .await
        .context("transport bench failed")
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
