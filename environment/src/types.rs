//! What crosses the environment boundary, as JSON on the wire.

use serde::{Deserialize, Serialize};

/// The roles a message of an observation may carry. Anything else in an
/// environment's reply is malformed.
pub const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

/// One task, as `reset` receives it: a row of a data set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EnvTask {
    pub task_id: String,
    pub dataset: String,
    /// The task's prompt as the data set gives it: a string, or a list of
    /// chat messages.
    pub prompt: serde_json::Value,
    /// The reference answer.
    pub answer: String,
    /// Anything else of the row the environment needs (`null` when none).
    #[serde(default)]
    pub metadata: serde_json::Value,
}

impl EnvTask {
    /// The task of a data set row with `prompt` (no metadata).
    pub fn from_prompt(
        task_id: &str,
        dataset: &str,
        prompt: &asyncrl_text::Prompt,
        answer: &str,
    ) -> Result<Self, serde_json::Error> {
        let prompt = match prompt {
            asyncrl_text::Prompt::Text(t) => serde_json::Value::String(t.clone()),
            asyncrl_text::Prompt::Messages(m) => serde_json::to_value(m)?,
        };
        Ok(Self {
            task_id: task_id.to_owned(),
            dataset: dataset.to_owned(),
            prompt,
            answer: answer.to_owned(),
            metadata: serde_json::Value::Null,
        })
    }
}

/// The messages an episode of a task starts from: the task's, or its text
/// prompt as one user message.
pub fn prompt_messages(prompt: &asyncrl_text::Prompt) -> Vec<asyncrl_text::Message> {
    match prompt {
        asyncrl_text::Prompt::Text(t) => vec![asyncrl_text::Message::new("user", t.clone())],
        asyncrl_text::Prompt::Messages(m) => m.clone(),
    }
}

/// One chat message of an observation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnvMessage {
    /// One of [`ROLES`].
    pub role: String,
    pub content: String,
    /// The tool's name, on `tool` messages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The id of the tool call a `tool` message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl EnvMessage {
    /// A message with no name and no tool call id.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            name: None,
            tool_call_id: None,
        }
    }
}

/// What the environment shows the model after a reset or a step.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Observation {
    /// Messages to append to the conversation (none: nothing to add).
    #[serde(default)]
    pub messages: Vec<EnvMessage>,
    /// JSON-schema function definitions of the tools the model may call
    /// (`{"type": "function", "function": {"name", "description",
    /// "parameters"}}`); only meaningful on reset.
    #[serde(default)]
    pub tools: Vec<serde_json::Value>,
}

/// One tool call of the assistant's reply, parsed by the caller.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ActionToolCall {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    pub name: String,
    /// The call's arguments (a JSON object as the model wrote it).
    #[serde(default)]
    pub arguments: serde_json::Value,
}

/// The assistant's reply: its text and the tool calls parsed from it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Action {
    pub content: String,
    #[serde(default)]
    pub tool_calls: Vec<ActionToolCall>,
}

impl Action {
    /// A reply of text only.
    pub fn text(content: impl Into<String>) -> Self {
        Self {
            content: content.into(),
            tool_calls: Vec::new(),
        }
    }
}

/// The reply to `reset` and `step`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepResult {
    pub observation: Observation,
    /// The step's reward; `None` (JSON `null` or absent) when the step gives
    /// none, as on reset and tool queries.
    #[serde(default)]
    pub reward: Option<f32>,
    /// Whether the episode is over (no further step is accepted).
    pub done: bool,
}
