//! `[learner]`: settings of the learner (owned by the learner's crate; fields are
//! added as the learner grows).

use serde::Deserialize;

use crate::ConfigError;

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LearnerConfig {}

impl LearnerConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        Ok(())
    }
}
