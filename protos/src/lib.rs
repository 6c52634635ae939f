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

/// Generated protobuf types and gRPC stubs (package `asyncrl.v1`).
pub mod v1 {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("asyncrl.v1");
}

pub use v1::{FinishReason, RewardStatus, Task, Timings, Trajectory, WeightAnnouncement};

/// Re-exported so that callers encode and decode with the same prost version.
pub use prost::Message;
