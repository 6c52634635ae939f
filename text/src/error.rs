//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong with a model's text side.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// A file of a model folder could not be read or written.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A JSON file of a model folder is not valid.
    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// A field of a model folder's JSON file is missing or has the wrong type.
    #[error("{path}: `{key}`: {message}")]
    Field {
        path: PathBuf,
        key: String,
        message: String,
    },
    /// An input the tokenizer cannot take (e.g. an id out of range).
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The tokenizers library could not load the tokenizer or failed on an
    /// input.
    #[error("tokenizer: {what}: {source}")]
    TokenizerLib {
        what: String,
        #[source]
        source: tokenizers::Error,
    },
    /// Messages were given but the model has no chat template.
    #[error(
        "the prompt is a list of messages but the model {model} has no chat template (neither `chat_template` in tokenizer_config.json nor chat_template.jinja); give the prompt as text, or use a model with a template"
    )]
    NoChatTemplate { model: String },
    /// The chat template does not compile or failed on a message list.
    #[error("chat template {template}: {what}: {source}")]
    Template {
        /// Where the template comes from (its file).
        template: String,
        what: String,
        #[source]
        source: minijinja::Error,
    },
    /// The chat template went past one of the limits every render runs
    /// under ([`crate::limits`]): a loop that does not end, a recursion
    /// without end, a string or output too large.
    #[error("chat template {template}: exceeds the {limit}: {source}")]
    TemplateLimit {
        /// Where the template comes from (its file).
        template: String,
        limit: crate::limits::TemplateLimit,
        #[source]
        source: minijinja::Error,
    },
    /// A prompt or completion the model cannot take.
    #[error("{0}")]
    Invalid(String),
}

impl TextError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}

/// The crate's result type.
pub type Result<T, E = TextError> = std::result::Result<T, E>;
