//! The wire contract of asyncrl.
//!
//! Everything that crosses a process boundary is defined here and nowhere
//! else: the protobuf messages and gRPC services (compiled from `proto/` at
//! build time), the NATS subjects and bucket names, and the Arrow schema of a
//! stored trajectory.
//!
//! Architecture invariant: no other crate defines a wire format.

pub mod arrow_schema;
pub mod subjects;
mod validate;

pub use validate::{ContractError, decode_trajectory};

/// Generated protobuf types and gRPC client/server code (package `asyncrl.v1`).
pub mod v1 {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("asyncrl.v1");
}

pub use v1::{
    FinishReason, GroupDropReason, RewardStatus, Task, Timings, Trajectory, WeightAnnouncement,
};

impl GroupDropReason {
    /// The short label of the reason, as metrics (`reason="stale"`) and logs
    /// show it.
    pub fn label(self) -> &'static str {
        match self {
            GroupDropReason::Unspecified => "unspecified",
            GroupDropReason::Superseded => "superseded",
            GroupDropReason::DuplicateAttempt => "duplicate_attempt",
            GroupDropReason::Stale => "stale",
            GroupDropReason::Expired => "expired",
        }
    }

    /// A group never served that became older than v − η: its task was not
    /// trained, so the coordinator returns its capacity and issues it again.
    pub fn is_stale(self) -> bool {
        self == GroupDropReason::Stale
    }
}

pub use prost;
/// Re-exported so that callers encode and decode with the same prost version.
pub use prost::Message;
