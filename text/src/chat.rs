//! Prompts as chat messages, rendered with the model's own chat template.
//!
//! The template is the Jinja text of the model folder
//! (`chat_template.jinja`, else `chat_template` in `tokenizer_config.json`),
//! rendered by minijinja the way transformers' `apply_chat_template` renders
//! it: `trim_blocks` and `lstrip_blocks` on, Python string methods
//! (`.strip()`, `.startswith()`...) through minijinja-contrib's `pycompat`,
//! `raise_exception` and `strftime_now` defined, transformers' `tojson`
//! (Python's `json.dumps`, no HTML escaping) and Python's whitespace for
//! `trim` and `.strip()`, the tokenizer's special tokens (`bos_token`,
//! `eos_token`, ...) in the context, and an empty message list refused. The
//! rendered text is tokenized without adding special tokens: the template
//! writes them.
//!
//! Tools: a [`Message`] carries what the tool-aware templates read
//! (`tool_calls`, `tool_call_id`, `name`, `reasoning_content`), and
//! [`ChatTemplate::render_with_tools`] passes tool definitions as
//! `tools=...` does. Each message reaches the template as transformers
//! passes it: a dict with only the fields it has (`tool_calls` only when
//! there are calls, so `'tool_calls' in message` and `message.tool_calls is
//! defined` read as in Python), `reasoning_content` also under `thinking`
//! (transformers 5), JSON objects (tool definitions, arguments) as dicts in
//! the order of their `serde_json::Map`. `tools` is `None` when none are
//! given, as in transformers; other template keyword arguments (Qwen3's
//! `enable_thinking`, Llama's `date_string`, `builtin_tools`) are not passed.
//!
//! `tests/chat_parity.rs` checks all this against transformers on the
//! templates of Qwen2.5, Qwen3 and Llama-3.x, tool definitions, tool calls,
//! tool results and reasoning included. [`crate::tool_calls`] reads tool
//! calls back out of a model's reply.

use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

use crate::error::{Result, TextError};

/// One chat message, with the fields of an OpenAI / transformers chat
/// message that the tool-aware templates read. A template sees only the
/// fields a message has (see [`ChatTemplate::render_with_tools`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Message {
    pub role: String,
    pub content: String,
    /// The calls of an assistant message (absent when empty).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// The call a tool message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// The tool a tool message comes from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The reasoning of an assistant message (Qwen3 writes it in a
    /// `<think>` block).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

/// One tool call of an assistant message, as OpenAI and vLLM chat messages
/// carry it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolCall {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Always `"function"`.
    #[serde(rename = "type", default = "function_type")]
    pub r#type: String,
    pub function: FunctionCall,
}

/// The function a [`ToolCall`] calls.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments as a JSON object (templates write them with `tojson`
    /// or iterate them); a JSON string is passed on as a string.
    pub arguments: Json,
}

fn function_type() -> String {
    "function".to_owned()
}

impl ToolCall {
    /// A call of `name` with `arguments` (a JSON object), without an id.
    pub fn function(name: impl Into<String>, arguments: Json) -> Self {
        Self {
            id: None,
            r#type: function_type(),
            function: FunctionCall {
                name: name.into(),
                arguments,
            },
        }
    }

    /// The same call with the id `id`.
    pub fn with_id(mut self, id: impl Into<String>) -> Self {
        self.id = Some(id.into());
        self
    }
}

/// The roles a message may have.
pub const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
            reasoning_content: None,
        }
    }

    /// An assistant message with `content` (often empty) and `tool_calls`.
    pub fn assistant_with_tool_calls(
        content: impl Into<String>,
        tool_calls: Vec<ToolCall>,
    ) -> Self {
        Self {
            tool_calls,
            ..Self::new("assistant", content)
        }
    }

    /// A tool message: the result `content` of the call `tool_call_id`
    /// (when known) of the tool `name` (when known).
    pub fn tool_result(
        content: impl Into<String>,
        tool_call_id: Option<String>,
        name: Option<String>,
    ) -> Self {
        Self {
            tool_call_id,
            name,
            ..Self::new("tool", content)
        }
    }

    /// The same message with `reasoning_content`.
    pub fn with_reasoning(mut self, reasoning_content: impl Into<String>) -> Self {
        self.reasoning_content = Some(reasoning_content.into());
        self
    }

    /// Whether the message says nothing: empty content and no tool calls.
    pub fn is_empty(&self) -> bool {
        self.content.is_empty() && self.tool_calls.is_empty()
    }
}

/// A prompt: plain text (tokenized with the tokenizer's special tokens and
/// the model's BOS) or a list of messages (rendered with the chat template,
/// with the generation prompt).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Messages(Vec<Message>),
}

impl Prompt {
    /// Checks what every prompt must hold: non-empty text, or at least one
    /// message, each with a known role, and not all empty (an assistant
    /// message with tool calls and no content is not empty).
    pub fn validate(&self) -> Result<(), String> {
        match self {
            Prompt::Text(t) if t.is_empty() => Err("the prompt is empty".into()),
            Prompt::Text(_) => Ok(()),
            Prompt::Messages(m) if m.is_empty() => Err("the message list is empty".into()),
            Prompt::Messages(m) => {
                for (i, msg) in m.iter().enumerate() {
                    if !ROLES.contains(&msg.role.as_str()) {
                        return Err(format!(
                            "message {i}: role {:?} is not one of {}",
                            msg.role,
                            ROLES.join(", ")
                        ));
                    }
                }
                if m.iter().all(Message::is_empty) {
                    return Err("every message is empty".into());
                }
                Ok(())
            }
        }
    }
}

/// The special tokens a template may refer to (`bos_token`, ...), as text:
/// the named special tokens transformers passes to a chat template.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub unk_token: Option<String>,
    pub sep_token: Option<String>,
    pub pad_token: Option<String>,
    pub cls_token: Option<String>,
    pub mask_token: Option<String>,
}

impl SpecialTokens {
    /// The names of the tokens, as the template sees them, in
    /// transformers' order.
    pub const NAMES: [&str; 7] = [
        "bos_token",
        "eos_token",
        "unk_token",
        "sep_token",
        "pad_token",
        "cls_token",
        "mask_token",
    ];

    /// Each token with its name (those the tokenizer has).
    pub fn named(&self) -> impl Iterator<Item = (&'static str, &str)> {
        Self::NAMES
            .into_iter()
            .zip([
                &self.bos_token,
                &self.eos_token,
                &self.unk_token,
                &self.sep_token,
                &self.pad_token,
                &self.cls_token,
                &self.mask_token,
            ])
            .filter_map(|(name, value)| Some((name, value.as_deref()?)))
    }

    /// Sets the token called `name` (one of [`Self::NAMES`]); other names
    /// are ignored.
    pub fn set(&mut self, name: &str, value: Option<String>) {
        let slot = match name {
            "bos_token" => &mut self.bos_token,
            "eos_token" => &mut self.eos_token,
            "unk_token" => &mut self.unk_token,
            "sep_token" => &mut self.sep_token,
            "pad_token" => &mut self.pad_token,
            "cls_token" => &mut self.cls_token,
            "mask_token" => &mut self.mask_token,
            _ => return,
        };
        *slot = value;
    }
}

/// A chat template, checked to compile. Every render runs under the
/// limits of [`crate::limits`]; going past one is a
/// [`TextError::TemplateLimit`] naming the template's file.
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    special: SpecialTokens,
    source: String,
    /// Where the template comes from (its file), for errors.
    origin: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .field("special", &self.special)
            .finish_non_exhaustive()
    }
}

impl Clone for ChatTemplate {
    fn clone(&self) -> Self {
        Self {
            env: self.env.clone(),
            special: self.special.clone(),
            source: self.source.clone(),
            origin: self.origin.clone(),
        }
    }
}

fn raise_exception(message: String) -> std::result::Result<String, minijinja::Error> {
    Err(minijinja::Error::new(
        minijinja::ErrorKind::InvalidOperation,
        message,
    ))
}

fn strftime_now(format: String) -> std::result::Result<String, minijinja::Error> {
    use std::fmt::Write;
    let mut out = String::new();
    write!(out, "{}", chrono::Local::now().format(&format)).map_err(|_| {
        minijinja::Error::new(
            minijinja::ErrorKind::InvalidOperation,
            format!("strftime_now: invalid format {format:?}"),
        )
    })?;
    Ok(out)
}

impl ChatTemplate {
    /// Compiles a template's Jinja source (errors call it "chat template").
    pub fn new(source: &str, special: SpecialTokens) -> Result<Self> {
        Self::from_file("chat template", source, special)
    }

    /// Compiles the Jinja source of a template that comes from `origin` (a
    /// file, named in errors).
    pub fn from_file(
        origin: impl Into<String>,
        source: &str,
        special: SpecialTokens,
    ) -> Result<Self> {
        let origin = origin.into();
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(crate::jinja_py::unknown_method);
        env.add_filter("tojson", crate::jinja_py::tojson);
        env.add_filter("trim", crate::jinja_py::trim);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        crate::limits::install(&mut env);
        if let Err(source) = crate::limits::compile(&origin, source) {
            return Err(TextError::Template {
                template: origin,
                what: "cannot compile".into(),
                source,
            });
        }
        Ok(Self {
            env,
            special,
            source: source.to_owned(),
            origin,
        })
    }

    /// Where the template comes from (its file).
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// Renders a short conversation (one user message, with the generation
    /// prompt) and fails only when that goes past a limit: what a model
    /// folder's template does without end is found when the model loads,
    /// not at the first prompt. Other errors (a template that wants another
    /// conversation) are left to the real prompts.
    pub fn check_limits(&self) -> Result<()> {
        match self.render(&[Message::new("user", "Hello")], true) {
            Err(e @ TextError::TemplateLimit { .. }) => Err(e),
            _ => Ok(()),
        }
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The text of `messages`, ending with the assistant's generation prompt
    /// when `add_generation_prompt`, without tools. An empty list is an
    /// error, as in transformers.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// The text of `messages` with the tool definitions `tools` (JSON
    /// schemas `{"type": "function", "function": {"name", "description",
    /// "parameters"}}`), as transformers' `apply_chat_template(messages,
    /// tools=tools, add_generation_prompt=...)` renders it: the template's
    /// `tools` is the list, or `None` without tools (as in transformers,
    /// where `tools is defined` holds either way); each message is a dict
    /// with only the fields it has (`tool_calls` only when not empty), and
    /// with `reasoning_content` also as `thinking`, first, as transformers
    /// 5 aliases it. An empty list is an error, as in transformers.
    pub fn render_with_tools(
        &self,
        messages: &[Message],
        tools: Option<&[Json]>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.render_counting(messages, tools, add_generation_prompt)
            .map(|(text, _)| text)
    }

    /// [`Self::render_with_tools`], and the fuel (minijinja instructions)
    /// the render took, which [`crate::limits::MAX_FUEL`] bounds.
    pub fn render_counting(
        &self,
        messages: &[Message],
        tools: Option<&[Json]>,
        add_generation_prompt: bool,
    ) -> Result<(String, u64)> {
        if messages.is_empty() {
            return Err(TextError::Invalid(
                "cannot apply the chat template to an empty conversation: give at least one message"
                    .into(),
            ));
        }
        let compiled = crate::limits::compile(&self.origin, &self.source).map_err(|source| {
            TextError::Template {
                template: self.origin.clone(),
                what: "cannot compile".into(),
                source,
            }
        })?;
        // Unset special tokens stay undefined (they render as ""), as in
        // transformers, which passes only the tokens the tokenizer has.
        let s = &self.special;
        let mut ctx = std::collections::BTreeMap::<&str, minijinja::Value>::new();
        ctx.insert(
            "messages",
            minijinja::Value::from(messages.iter().map(message_value).collect::<Vec<_>>()),
        );
        ctx.insert(
            "add_generation_prompt",
            minijinja::Value::from(add_generation_prompt),
        );
        ctx.insert(
            "tools",
            match tools {
                Some(tools) => minijinja::Value::from(
                    tools
                        .iter()
                        .map(crate::jinja_py::json_value)
                        .collect::<Vec<_>>(),
                ),
                None => minijinja::Value::from(()),
            },
        );
        ctx.insert("documents", minijinja::Value::from(()));
        for (name, value) in s.named() {
            ctx.insert(name, minijinja::Value::from(value));
        }
        crate::limits::render(&self.env, &compiled, minijinja::Value::from(ctx)).map_err(|source| {
            match crate::limits::exceeded(&source) {
                Some(limit) => TextError::TemplateLimit {
                    template: self.origin.clone(),
                    limit,
                    source,
                },
                None => TextError::Template {
                    template: self.origin.clone(),
                    what: "cannot render the messages".into(),
                    source,
                },
            }
        })
    }
}

/// A message as transformers hands it to a template: a dict of the fields
/// it has, in the order of [`Message`]'s fields (`role`, `content`,
/// `tool_calls`, `tool_call_id`, `name`, `reasoning_content`), with the
/// reasoning also under `thinking`, in front (transformers 5's
/// `_alias_reasoning_fields`).
fn message_value(m: &Message) -> minijinja::Value {
    use minijinja::Value;
    let mut fields: Vec<(String, Value)> = Vec::with_capacity(6);
    if let Some(r) = &m.reasoning_content {
        fields.push(("thinking".into(), Value::from(r.as_str())));
    }
    fields.push(("role".into(), Value::from(m.role.as_str())));
    fields.push(("content".into(), Value::from(m.content.as_str())));
    if !m.tool_calls.is_empty() {
        let calls = m.tool_calls.iter().map(tool_call_value).collect::<Vec<_>>();
        fields.push(("tool_calls".into(), Value::from(calls)));
    }
    for (key, value) in [
        ("tool_call_id", &m.tool_call_id),
        ("name", &m.name),
        ("reasoning_content", &m.reasoning_content),
    ] {
        if let Some(v) = value {
            fields.push((key.into(), Value::from(v.as_str())));
        }
    }
    Value::from_object(crate::jinja_py::Dict(fields))
}

/// A tool call as a dict: `id` (when set), `type`, `function` (`name`,
/// `arguments`).
fn tool_call_value(call: &ToolCall) -> minijinja::Value {
    use minijinja::Value;
    let mut fields: Vec<(String, Value)> = Vec::with_capacity(3);
    if let Some(id) = &call.id {
        fields.push(("id".into(), Value::from(id.as_str())));
    }
    fields.push(("type".into(), Value::from(call.r#type.as_str())));
    let function = crate::jinja_py::Dict(vec![
        ("name".into(), Value::from(call.function.name.as_str())),
        (
            "arguments".into(),
            crate::jinja_py::json_value(&call.function.arguments),
        ),
    ]);
    fields.push(("function".into(), Value::from_object(function)));
    Value::from_object(crate::jinja_py::Dict(fields))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens() -> SpecialTokens {
        SpecialTokens {
            bos_token: Some("<s>".into()),
            eos_token: Some("</s>".into()),
            ..Default::default()
        }
    }

    #[test]
    fn renders_with_trimmed_blocks_and_python_methods() {
        let t = ChatTemplate::new(
            "{{ bos_token }}\n{% for m in messages %}\n[{{ m.role }}] {{ m.content.strip() }}\n{% endfor %}\n{% if add_generation_prompt %}[assistant]{% endif %}",
            tokens(),
        )
        .unwrap();
        let text = t.render(&[Message::new("user", "  hi  ")], true).unwrap();
        assert_eq!(text, "<s>\n[user] hi\n[assistant]");
        assert_eq!(
            t.render(&[Message::new("user", "hi")], false).unwrap(),
            "<s>\n[user] hi\n"
        );
    }

    #[test]
    fn raise_exception_is_a_clear_error() {
        let t = ChatTemplate::new(
            "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}ok",
            tokens(),
        )
        .unwrap();
        let err = t
            .render(&[Message::new("assistant", "x")], true)
            .unwrap_err()
            .to_string();
        assert!(err.contains("Conversation must start with user"), "{err}");
        assert!(ChatTemplate::new("{% for %}", tokens()).is_err());
        let t = ChatTemplate::new("{{ bos_token }}", tokens()).unwrap();
        let err = t.render(&[], true).unwrap_err().to_string();
        assert!(err.contains("empty conversation"), "{err}");
    }

    #[test]
    fn special_tokens_and_tojson_are_transformers_ones() {
        let mut special = tokens();
        special.set("mask_token", Some("<mask>".into()));
        special.set("bogus", Some("x".into()));
        let t = ChatTemplate::new(
            "{{ bos_token }}|{{ mask_token }}|{{ pad_token is defined }}|{{ messages[0].content | tojson }}|{{ messages[0] | tojson }}",
            special,
        )
        .unwrap();
        let text = t
            .render(&[Message::new("user", "<a & 'b'>")], true)
            .unwrap();
        assert_eq!(
            text,
            r#"<s>|<mask>|False|"<a & 'b'>"|{"role": "user", "content": "<a & 'b'>"}"#
        );
    }

    #[test]
    fn prompts_validate() {
        assert!(Prompt::Text(String::new()).validate().is_err());
        assert!(Prompt::Messages(vec![]).validate().is_err());
        let bad = Prompt::Messages(vec![Message::new("robot", "x")]);
        assert!(bad.validate().unwrap_err().contains("robot"));
        assert!(
            Prompt::Messages(vec![Message::new("user", "")])
                .validate()
                .is_err()
        );
        assert!(
            Prompt::Messages(vec![Message::new("system", ""), Message::new("user", "q")])
                .validate()
                .is_ok()
        );
        let parsed: Prompt = serde_json::from_str(r#"[{"role":"user","content":"q"}]"#).unwrap();
        assert_eq!(parsed, Prompt::Messages(vec![Message::new("user", "q")]));
        let parsed: Prompt = serde_json::from_str(r#""q""#).unwrap();
        assert_eq!(parsed, Prompt::Text("q".into()));
    }

    #[test]
    fn messages_reach_the_template_with_only_their_fields() {
        let t = ChatTemplate::new(
            "{% for m in messages %}{{ m | tojson }}|{{ 'tool_calls' in m }}|{{ m.name is defined }}\n{% endfor %}{{ tools | tojson }}",
            tokens(),
        )
        .unwrap();
        let call = ToolCall::function("f", serde_json::json!({"a": 1, "b": [true, null, 2.5]}))
            .with_id("c1");
        let messages = [
            Message::new("user", "q"),
            Message::assistant_with_tool_calls("", vec![call]).with_reasoning("hmm"),
            Message::tool_result("42", Some("c1".into()), Some("f".into())),
        ];
        let text = t.render(&messages, false).unwrap();
        assert_eq!(
            text,
            concat!(
                r#"{"role": "user", "content": "q"}|False|False"#,
                "\n",
                r#"{"thinking": "hmm", "role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1, "b": [true, null, 2.5]}}}], "reasoning_content": "hmm"}|True|False"#,
                "\n",
                r#"{"role": "tool", "content": "42", "tool_call_id": "c1", "name": "f"}|False|True"#,
                "\n",
                "null"
            )
        );
        let tools = [serde_json::json!({"type": "function", "function": {"name": "f"}})];
        let text = t
            .render_with_tools(&messages[..1], Some(&tools), true)
            .unwrap();
        assert!(
            text.ends_with(r#"[{"function": {"name": "f"}, "type": "function"}]"#),
            "{text}"
        );
    }

    #[test]
    fn messages_serialize_with_only_their_fields() {
        let m = Message::assistant_with_tool_calls(
            "",
            vec![ToolCall::function("f", serde_json::json!({"x": 1}))],
        );
        let json = serde_json::to_string(&m).unwrap();
        assert_eq!(
            json,
            r#"{"role":"assistant","content":"","tool_calls":[{"type":"function","function":{"name":"f","arguments":{"x":1}}}]}"#
        );
        assert_eq!(serde_json::from_str::<Message>(&json).unwrap(), m);
        assert_eq!(
            serde_json::to_string(&Message::new("user", "q")).unwrap(),
            r#"{"role":"user","content":"q"}"#
        );
        // `type` defaults to "function"; unknown fields are refused.
        let m: Message = serde_json::from_str(
            r#"{"role":"assistant","content":"","tool_calls":[{"id":"a","function":{"name":"f","arguments":{}}}]}"#,
        )
        .unwrap();
        assert_eq!(m.tool_calls[0].r#type, "function");
        assert!(serde_json::from_str::<Message>(r#"{"role":"user","content":"q","x":1}"#).is_err());
        // An assistant message with only tool calls is a valid prompt.
        assert!(Prompt::Messages(vec![m]).validate().is_ok());
    }
}
