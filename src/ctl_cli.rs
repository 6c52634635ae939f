//! The command line of `asyncrl ctl` (clap lives in the binary; the client
//! itself is `asyncrl_coordinator::ctl`).

use std::path::PathBuf;

use asyncrl_coordinator::ctl::{CtlArgs, CtlCommand};
use clap::{Args, Subcommand};

#[derive(Debug, Args)]
pub(crate) struct CtlCliArgs {
    /// The TOML config file (admin endpoint and token).
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Admin API endpoint, e.g. http://127.0.0.1:7461 (default: from
    /// coordinator.admin_listen of the config; https when it has admin TLS).
    #[arg(long)]
    endpoint: Option<String>,
    /// Bearer token for mutating calls (default: coordinator.admin_token or
    /// admin_token_file of the config).
    #[arg(long)]
    token: Option<String>,
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// CA certificate (PEM) to verify a TLS admin API with.
    #[arg(long)]
    ca_file: Option<PathBuf>,
    /// Name to check the server certificate against.
    #[arg(long)]
    domain: Option<String>,
    /// Who asks, for the journal (default: $USER@host).
    #[arg(long)]
    who: Option<String>,
    /// Give up on the call after this many seconds.
    #[arg(long, default_value_t = 10.0)]
    timeout_s: f64,
    #[command(subcommand)]
    command: CtlCliCommand,
}

#[derive(Debug, Clone, PartialEq, Subcommand)]
enum CtlCliCommand {
    /// Version, admission, capacity and the worker registry.
    Status,
    /// The worker registry.
    Workers,
    /// The knobs in effect and the changes scheduled.
    Knobs,
    /// Change knobs: `set eta=2 lr=1e-6 [--at-step N]`.
    Set {
        /// name=value pairs: eta, eps_low, eps_high, clip_mode (ppo, adaptive,
        /// m2po, gspo), adaptive_quantile, adaptive_temperature,
        /// importance_weight_cap, importance_correction (mask, truncate,
        /// icepop), importance_weight_floor, dual_clip (0: off; else at least 1),
        /// learning_rate (lr), paused.
        #[arg(required = true)]
        assignments: Vec<String>,
        /// The learner step from which the change applies (default: the next
        /// step boundary). Refused if that step has already started.
        #[arg(long)]
        at_step: Option<u64>,
    },
    /// Stop admitting tasks (workers finish what they have).
    Pause,
    /// Admit tasks again.
    Resume,
    /// Ask the learner for a checkpoint at the next step boundary.
    Checkpoint,
}

impl CtlCliArgs {
    /// The client's request.
    pub(crate) fn request(&self) -> CtlArgs {
        let command = match self.command.clone() {
            CtlCliCommand::Status => CtlCommand::Status,
            CtlCliCommand::Workers => CtlCommand::Workers,
            CtlCliCommand::Knobs => CtlCommand::Knobs,
            CtlCliCommand::Set {
                assignments,
                at_step,
            } => CtlCommand::Set {
                assignments,
                at_step,
            },
            CtlCliCommand::Pause => CtlCommand::Pause,
            CtlCliCommand::Resume => CtlCommand::Resume,
            CtlCliCommand::Checkpoint => CtlCommand::Checkpoint,
        };
        CtlArgs {
            endpoint: self.endpoint.clone(),
            token: self.token.clone(),
            token_file: self.token_file.clone(),
            ca_file: self.ca_file.clone(),
            domain: self.domain.clone(),
            who: self.who.clone(),
            timeout_s: self.timeout_s,
            command,
        }
    }
}
