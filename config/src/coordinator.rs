//! `[coordinator]`: settings of the coordinator (owned by the coordinator's crate; fields are
//! added as the coordinator grows).

use serde::Deserialize;

use crate::ConfigError;

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CoordinatorConfig {}

impl CoordinatorConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        Ok(())
    }
}
