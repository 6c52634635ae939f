//! `[buffer]`: settings of the buffer (owned by the buffer's crate; fields are
//! added as the buffer grows).

use serde::Deserialize;

use crate::ConfigError;

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct BufferConfig {}

impl BufferConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        Ok(())
    }
}
