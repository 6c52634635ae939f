//! `[run]` and `[staleness]`: what a training run is and the staleness bound
//! every role agrees on.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::{ConfigError, check_range};

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    /// Name of the run (used in output paths and metrics labels).
    pub name: String,
    /// Where a run writes its outputs: metrics CSV, checkpoints, journal,
    /// buffer segments (each role may override its own directory).
    pub output_dir: PathBuf,
    /// Seed of every random choice a role makes.
    pub seed: u64,
    /// Learner steps to train for (0: until stopped).
    pub max_steps: u64,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            name: "asyncrl".into(),
            output_dir: PathBuf::from("runs/asyncrl"),
            seed: 0,
            max_steps: 0,
        }
    }
}

impl RunConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.name.is_empty()
            || !self
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return Err(ConfigError::invalid(
                "run.name",
                format!("= {:?} must be non-empty [A-Za-z0-9._-]", self.name),
            ));
        }
        Ok(())
    }
}

/// The bounded-staleness contract (DESIGN.md, "Bounded staleness").
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct StalenessConfig {
    /// η: no trained token is more than η policy versions old. 0 = synchronous.
    pub eta: u32,
    /// B: GRPO groups consumed per learner step.
    pub groups_per_step: u32,
    /// G: completions per task (GRPO group size).
    pub group_size: u32,
}

impl Default for StalenessConfig {
    fn default() -> Self {
        Self {
            eta: 4,
            groups_per_step: 8,
            group_size: 8,
        }
    }
}

impl StalenessConfig {
    pub const MAX_ETA: u32 = 64;

    pub fn validate(&self) -> Result<(), ConfigError> {
        check_range("staleness.eta", self.eta, 0, Self::MAX_ETA)?;
        check_range("staleness.groups_per_step", self.groups_per_step, 1, 4096)?;
        check_range("staleness.group_size", self.group_size, 1, 1024)?;
        Ok(())
    }
}
