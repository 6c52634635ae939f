//! The composition root of asyncrl as a library: what each subcommand of
//! the `asyncrl` binary does, so that `src/main.rs` is the command-line
//! front end and nothing else, and the harness (`asyncrl-harness`) drives
//! the same code.
//!
//! - [`roles`]: what every role process does around its role (telemetry,
//!   signals, the bus connection) and [`roles::run_role`];
//! - [`train`]: every role in one process (`asyncrl train`), its progress,
//!   summary and plots;
//! - [`check`]: `asyncrl train --check-config`;
//! - [`eval`]: `asyncrl eval` of a model folder or checkpoint;
//! - [`commands`]: the other subcommands (one role, warm start, data sets,
//!   buffer export, version).
//!
//! Built without the `torch` feature, it links no libtorch and holds only
//! what the control-plane image runs (coordinator, buffer, ctl, data).

pub mod check;
pub mod commands;
#[cfg(feature = "torch")]
pub mod eval;
#[cfg(feature = "torch")]
pub mod plot;
pub mod roles;
#[cfg(feature = "torch")]
pub mod train;

pub use roles::{block_on, load, runtime};

/// The error of a subcommand that needs the tensor roles in a binary built
/// without them.
#[cfg(not(feature = "torch"))]
pub fn no_torch(command: &str) -> anyhow::Result<()> {
    anyhow::bail!(
        "`asyncrl {command}` needs libtorch, and this binary was built without the `torch` feature (the CPU-only control-plane image); use the full image"
    )
}
