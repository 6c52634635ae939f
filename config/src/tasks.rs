//! `[tasks]`: settings of the tasks (owned by the tasks's crate; fields are
//! added as the tasks grows).

use serde::Deserialize;

use crate::ConfigError;

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TasksConfig {}

impl TasksConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        Ok(())
    }
}
