//! `[model]`: settings of the model (owned by the model's crate; fields are
//! added as the model grows).

use serde::Deserialize;

use crate::ConfigError;

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {}

impl ModelConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        Ok(())
    }
}
