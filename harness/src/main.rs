//! `asyncrl-bench`: every benchmark of asyncrl, one subcommand each
//! (`asyncrl-bench --help`). Role processes are started from the `asyncrl`
//! binary beside this one (or `$ASYNCRL_BIN`).

use std::process::ExitCode;

use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "asyncrl-bench",
    version,
    about = "Benchmarks of asyncrl; each prints a ratio against a baseline measured in the same run"
)]
struct Cli {
    #[command(subcommand)]
    bench: asyncrl_harness::bench::BenchCommand,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match asyncrl_harness::bench::run(cli.bench) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", asyncrl_common::process::one_line(&e));
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    use super::*;

    #[test]
    fn cli_is_well_formed() {
        Cli::command().debug_assert();
    }
}
