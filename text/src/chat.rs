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
//! writes them. `tests/chat_parity.rs` checks all this against transformers
//! on the templates of Qwen2.5 and Llama-3.x.

use serde::{Deserialize, Serialize};

use crate::error::{Result, TextError};

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// The roles a message may have.
pub const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
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
    /// message, each with a known role, and not all empty.
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
                if m.iter().all(|msg| msg.content.is_empty()) {
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

/// A compiled chat template.
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    special: SpecialTokens,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("special", &self.special)
            .finish_non_exhaustive()
    }
}

impl Clone for ChatTemplate {
    fn clone(&self) -> Self {
        Self {
            env: self.env.clone(),
            special: self.special.clone(),
        }
    }
}

const NAME: &str = "chat_template";

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
    /// Compiles a template's Jinja source.
    pub fn new(source: &str, special: SpecialTokens) -> Result<Self> {
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(crate::jinja_py::unknown_method);
        env.add_filter("tojson", crate::jinja_py::tojson);
        env.add_filter("trim", crate::jinja_py::trim);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(NAME, source.to_owned())
            .map_err(|source| TextError::Template {
                what: "cannot compile".into(),
                source,
            })?;
        Ok(Self { env, special })
    }

    /// The text of `messages`, ending with the assistant's generation prompt
    /// when `add_generation_prompt`. An empty list is an error, as in
    /// transformers.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        if messages.is_empty() {
            return Err(TextError::Invalid(
                "cannot apply the chat template to an empty conversation: give at least one message"
                    .into(),
            ));
        }
        let template = self
            .env
            .get_template(NAME)
            .map_err(|source| TextError::Template {
                what: "missing".into(),
                source,
            })?;
        // Unset special tokens stay undefined (they render as ""), as in
        // transformers, which passes only the tokens the tokenizer has.
        let s = &self.special;
        let mut ctx = std::collections::BTreeMap::<&str, minijinja::Value>::new();
        ctx.insert("messages", minijinja::Value::from_serialize(messages));
        ctx.insert(
            "add_generation_prompt",
            minijinja::Value::from(add_generation_prompt),
        );
        ctx.insert("tools", minijinja::Value::from(()));
        ctx.insert("documents", minijinja::Value::from(()));
        for (name, value) in s.named() {
            ctx.insert(name, minijinja::Value::from(value));
        }
        template.render(ctx).map_err(|source| TextError::Template {
            what: "cannot render the messages".into(),
            source,
        })
    }
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
}
