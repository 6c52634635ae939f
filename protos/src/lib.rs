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

pub use validate::{ContractError, decode_trajectory, model_token_count, model_token_mask};

/// Generated protobuf types and gRPC client/server code (package `asyncrl.v1`).
pub mod v1 {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("asyncrl.v1");
}

pub use v1::{
    FinishReason, GroupDropReason, RewardStatus, Task, Timings, Trajectory, Turn,
    WeightAnnouncement,
};

impl FinishReason {
    /// The short label of the reason, as the Arrow `finish_reason` column,
    /// metrics (`reason="stop"`) and logs show it.
    pub fn label(self) -> &'static str {
        match self {
            FinishReason::Unspecified => "unspecified",
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Aborted => "aborted",
            FinishReason::StopString => "stop_string",
            FinishReason::MaxTurns => "max_turns",
            FinishReason::EpisodeLength => "episode_length",
            FinishReason::ToolCallUnreadable => "tool_call_unreadable",
        }
    }

    /// The reason whose [`FinishReason::label`] is `label`.
    pub fn from_label(label: &str) -> Option<Self> {
        (0..)
            .map_while(|code| FinishReason::try_from(code).ok())
            .find(|r| r.label() == label)
    }
}

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
            GroupDropReason::Quarantined => "quarantined",
            GroupDropReason::NoSignal => "no_signal",
        }
    }

    /// A group never trained on that the buffer gave up on: never served
    /// and older than v − η (stale), or refused by the learner
    /// (quarantined). Its task was not trained, so the coordinator returns
    /// its capacity and issues it again.
    pub fn reissues_task(self) -> bool {
        matches!(self, GroupDropReason::Stale | GroupDropReason::Quarantined)
    }

    /// A group never trained on whose capacity the coordinator returns:
    /// those that reissue their task, and a group dropped for carrying no
    /// signal (dynamic sampling), whose task is done for its epoch and not
    /// issued again.
    pub fn frees_capacity(self) -> bool {
        self.reissues_task() || self == GroupDropReason::NoSignal
    }
}

pub use prost;
/// Re-exported so that callers encode and decode with the same prost version.
pub use prost::Message;
