//! The rollout worker.

pub mod reward;
