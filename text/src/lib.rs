//! The text side of a model, without its weights and without libtorch:
//!
//! - [`PolicyTokenizer`]: any Hugging Face `tokenizer.json`, and the
//!   built-in character vocabulary of the tiny model;
//! - [`ChatTemplate`]: the model's Jinja chat template, rendered with
//!   minijinja as transformers renders it;
//! - [`Prompt`]: text or a list of [`Message`]s (with their [`ToolCall`]s);
//! - [`parse_tool_calls`]: the tool calls of a model's reply, in its
//!   family's [`ToolCallFormat`];
//! - [`ModelText`]: tokenizer, BOS, stop tokens and strings, chat template of
//!   one model, and how prompts become token ids and completions become text.
//!
//! The coordinator (prompt lengths at load time), the rollout worker, the
//! learner's warm start and `asyncrl train --check-config` all go through
//! [`ModelText`], so a prompt is tokenized the same way everywhere.

pub mod chat;
pub mod error;
mod jinja_py;
pub mod limits;
pub mod model_text;
pub mod tokenizer;
pub mod tool_calls;

pub use chat::{ChatTemplate, FunctionCall, Message, Prompt, ROLES, SpecialTokens, ToolCall};
pub use error::{Result, TextError};
pub use limits::TemplateLimit;
pub use model_text::{
    BUILTIN_CHAT_TEMPLATE, ModelFacts, ModelText, TEXT_FILES, builtin_tokenizer_config,
    eos_token_ids, text_before_stop_string,
};
pub use tokenizer::{
    BUILTIN_BOS, BUILTIN_CHARS, BUILTIN_EOS, BUILTIN_PAD, BUILTIN_UNK, PolicyTokenizer,
};
pub use tool_calls::{ParsedReply, ToolCallFormat, ToolParseError, parse_tool_calls};
