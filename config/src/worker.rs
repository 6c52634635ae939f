//! `[worker]`: settings of the worker (owned by the worker's crate; fields are
//! added as the worker grows).

use serde::Deserialize;

use crate::ConfigError;

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerConfig {}

impl WorkerConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        Ok(())
    }
}
