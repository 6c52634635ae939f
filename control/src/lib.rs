//! The control plane shared by the roles, on top of the contract (`protos`)
//! and the bus (`transport`):
//!
//! - [`knobs`]: the knob schedule in KV, its validation, and the learner's
//!   seal of each step;
//! - [`weights`]: publishing a version's weights (object + `policy.version`
//!   announcement) and fetching the announced ones, sha256-checked;
//! - [`streams`]: the full JetStream specs of the contract's streams;
//! - [`lease`]: the run's learner lease (one learner seals and announces;
//!   a second refuses to start, a frozen one is fenced);
//! - [`kv`]: one compare-and-set edit of a KV key and one reconnecting
//!   watch, which every read-modify-write and every follower of a key use.
//!
//! The coordinator, the learner and the rollout worker depend on this crate;
//! none of them depends on another role's crate.

pub mod knobs;
pub mod kv;
pub mod lease;
pub mod streams;
pub mod weights;

pub use knobs::{KnobError, StepKnobs, seal_step};
