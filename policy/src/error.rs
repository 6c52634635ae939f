//! The crate's error type.

use std::path::PathBuf;

use asyncrl_text::TextError;

/// Everything that can go wrong in the policy crate.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// A configuration value is missing, has the wrong type or an unsupported
    /// value; `key` names it as it appears in `config.json`.
    #[error("model config: `{key}`: {message}")]
    Config { key: String, message: String },
    /// `model_type` is neither `llama` nor `qwen2`.
    #[error(
        "model config: `model_type` = {0:?} is not supported (this crate implements \"llama\" and \"qwen2\")"
    )]
    UnsupportedModelType(String),
    /// `rope_scaling` / `rope_parameters` asks for a RoPE variant this crate
    /// does not implement.
    #[error("model config: rope type {0:?} is not supported (supported: default, linear, llama3)")]
    UnsupportedRopeScaling(String),
    /// The safetensors data is malformed or does not match the model.
    #[error("weights: {0}")]
    Weights(String),
    /// The safetensors library refused the data.
    #[error("weights: {what}: {source}")]
    Safetensors {
        what: String,
        #[source]
        source: safetensors::SafeTensorError,
    },
    /// A file of the model folder could not be read or written
    /// ([`TextError::Io`]) or is not valid JSON ([`TextError::Json`]), or
    /// the tokenizer or the chat template failed: the error of the text
    /// crate, which is also the one home of those two file errors.
    #[error(transparent)]
    Text(#[from] TextError),
    /// A request was invalid (empty prompt, prompt too long, no free slot...).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// libtorch reported an error.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    /// A decoding step failed; the sequences in flight were ended.
    #[error("decoding step failed: {0}")]
    StepFailed(String),
    /// The model thread has stopped (it panicked or was shut down).
    #[error("the model thread is not running")]
    ModelThreadGone,
    /// The model thread caught a panic while serving a request.
    #[error("the model thread panicked: {0}")]
    Panic(String),
}

impl PolicyError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Text(TextError::Io {
            path: path.into(),
            source,
        })
    }

    pub(crate) fn json(path: impl Into<PathBuf>, source: serde_json::Error) -> Self {
        Self::Text(TextError::Json {
            path: path.into(),
            source,
        })
    }

    pub(crate) fn config(key: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Config {
            key: key.into(),
            message: message.into(),
        }
    }
}

/// The crate's result type.
pub type Result<T, E = PolicyError> = std::result::Result<T, E>;
