//! asyncrl's test and bench harness (`publish = false`; never a dependency
//! of the production binary, `tests/architecture.rs` checks it):
//!
//! - [`bench`]: every bench of the project, behind the `asyncrl-bench`
//!   binary; each prints its figures beside a baseline measured in the same
//!   run;
//! - [`cluster`]: role processes of the `asyncrl` binary over a real
//!   nats-server, with faults (kill -9, SIGTERM, SIGSTOP, restarts), used by
//!   the cross-process tests;
//! - [`configs`]: the typed configs tests and benches run with;
//! - [`invariants`]: the one set of invariant checks of a run (exactly
//!   once, staleness ≤ η, versions in order, contiguous steps), read from
//!   `trained.jsonl`;
//! - [`process`]: where the `asyncrl` binary is, and a role as a child
//!   process that dies with its parent.

pub mod bench;
pub mod cluster;
pub mod configs;
pub mod invariants;
pub mod process;
pub mod secure;

pub use process::asyncrl_bin;
