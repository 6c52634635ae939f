//! Tool calls read back out of a model's text, per template family, in the
//! formats vLLM's tool parsers read:
//!
//! - [`ToolCallFormat::Hermes`] (Qwen2.5, Qwen3; vLLM's `hermes` parser):
//!   each call is `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.
//!   The content is the text before the first `<tool_call>`, as vLLM returns
//!   it (text between or after the calls is dropped, as there).
//! - [`ToolCallFormat::Llama3Json`] (Llama-3.1/3.2; vLLM's `llama3_json`):
//!   the reply is one or more JSON objects `{"name": ..., "parameters":
//!   {...}}` (or `"arguments"`) separated by `;`, optionally after
//!   `<|python_tag|>`. As vLLM's streaming parser does, a reply is a call
//!   only when it starts (after whitespace) with `<|python_tag|>` or `{`;
//!   the content of a reply with calls is empty (vLLM: none).
//!
//! Unlike vLLM, which hands an unreadable call back as plain content, a call
//! that is there but cannot be read (invalid JSON, no name, arguments that
//! are not an object, an unclosed `<tool_call>`, text after Llama's calls)
//! is a [`ToolParseError`], so that a caller can tell a malformed call from
//! an answer. The JSON is read by serde_json. Calls get the ids `call_0`,
//! `call_1`, ... in order.

use serde_json::Value;

use crate::chat::ToolCall;

/// How a model family writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolCallFormat {
    /// `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>` (Qwen2.5,
    /// Qwen3, Hermes).
    Hermes,
    /// `{"name": ..., "parameters": ...}` JSON, `;`-separated (Llama-3.1 and
    /// 3.2).
    Llama3Json,
}

/// Opens a Hermes call.
pub const TOOL_CALL_START: &str = "<tool_call>";
/// Closes a Hermes call.
pub const TOOL_CALL_END: &str = "</tool_call>";
/// Llama-3's token before a tool call.
pub const PYTHON_TAG: &str = "<|python_tag|>";

impl ToolCallFormat {
    /// The format a chat template asks the model for: Hermes when it writes
    /// `<tool_call>` (Qwen2.5, Qwen3), Llama-3 JSON when it writes calls as
    /// `"parameters": ` JSON in Llama-3 headers (Llama-3.1, 3.2); `None`
    /// otherwise (e.g. Llama-3, which has no tools).
    pub fn detect(template_source: &str) -> Option<Self> {
        if template_source.contains(TOOL_CALL_START) {
            Some(Self::Hermes)
        } else if template_source.contains("<|start_header_id|>")
            && template_source.contains("\"parameters\": ")
        {
            Some(Self::Llama3Json)
        } else {
            None
        }
    }
}

/// A model reply split into its text and its tool calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedReply {
    /// The text outside the calls, as vLLM returns it (see the module doc).
    pub content: String,
    pub tool_calls: Vec<ToolCall>,
}

/// A tool call that is in the text but cannot be read; `index` counts the
/// calls from 0.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ToolParseError {
    #[error("tool call {index}: `<tool_call>` is never closed by `</tool_call>`")]
    Unclosed { index: usize },
    #[error("tool call {index}: invalid JSON: {message}")]
    InvalidJson { index: usize, message: String },
    #[error("tool call {index}: expected a JSON object, found {found}")]
    NotAnObject { index: usize, found: &'static str },
    #[error("tool call {index}: no \"name\" string")]
    MissingName { index: usize },
    #[error("tool call {index}: no {expected}")]
    MissingArguments {
        index: usize,
        expected: &'static str,
    },
    #[error("tool call {index}: the arguments are {found}, not a JSON object")]
    ArgumentsNotAnObject { index: usize, found: &'static str },
    #[error("tool call {index}: unexpected text after it: {text:?}")]
    TrailingText { index: usize, text: String },
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The first line of serde_json's error, for a one-line message.
fn json_error(index: usize, e: &serde_json::Error) -> ToolParseError {
    ToolParseError::InvalidJson {
        index,
        message: e.to_string().lines().next().unwrap_or_default().to_owned(),
    }
}

/// A call out of one parsed JSON object: `name`, and the arguments under
/// the first of `argument_keys` present.
fn call_of(
    index: usize,
    value: Value,
    argument_keys: &[&'static str],
    expected: &'static str,
) -> Result<ToolCall, ToolParseError> {
    let Value::Object(mut obj) = value else {
        return Err(ToolParseError::NotAnObject {
            index,
            found: kind(&value),
        });
    };
    let name = match obj.remove("name") {
        Some(Value::String(name)) if !name.is_empty() => name,
        _ => return Err(ToolParseError::MissingName { index }),
    };
    let arguments = argument_keys
        .iter()
        .find_map(|key| obj.remove(*key))
        .ok_or(ToolParseError::MissingArguments { index, expected })?;
    if !arguments.is_object() {
        return Err(ToolParseError::ArgumentsNotAnObject {
            index,
            found: kind(&arguments),
        });
    }
    Ok(ToolCall::function(name, arguments).with_id(format!("call_{index}")))
}

/// The tool calls of `text`, a model reply, in `format`. A reply without a
/// call is `Ok` with no calls and the whole text as content.
pub fn parse_tool_calls(format: ToolCallFormat, text: &str) -> Result<ParsedReply, ToolParseError> {
    match format {
        ToolCallFormat::Hermes => parse_hermes(text),
        ToolCallFormat::Llama3Json => parse_llama3_json(text),
    }
}

fn parse_hermes(text: &str) -> Result<ParsedReply, ToolParseError> {
    let Some(first) = text.find(TOOL_CALL_START) else {
        return Ok(ParsedReply {
            content: text.to_owned(),
            tool_calls: Vec::new(),
        });
    };
    let mut tool_calls = Vec::new();
    let mut rest = &text[first..];
    while let Some(start) = rest.find(TOOL_CALL_START) {
        let index = tool_calls.len();
        let body_start = start + TOOL_CALL_START.len();
        let body_len = rest[body_start..]
            .find(TOOL_CALL_END)
            .ok_or(ToolParseError::Unclosed { index })?;
        let body = &rest[body_start..body_start + body_len];
        let value: Value = serde_json::from_str(body.trim()).map_err(|e| json_error(index, &e))?;
        tool_calls.push(call_of(index, value, &["arguments"], "\"arguments\"")?);
        rest = &rest[body_start + body_len + TOOL_CALL_END.len()..];
    }
    Ok(ParsedReply {
        content: text[..first].to_owned(),
        tool_calls,
    })
}

fn parse_llama3_json(text: &str) -> Result<ParsedReply, ToolParseError> {
    let trimmed = text.trim_start();
    let body = match trimmed.strip_prefix(PYTHON_TAG) {
        Some(after) => after.trim_start(),
        None if trimmed.starts_with('{') => trimmed,
        None => {
            return Ok(ParsedReply {
                content: text.to_owned(),
                tool_calls: Vec::new(),
            });
        }
    };
    let mut tool_calls = Vec::new();
    let mut rest = body;
    loop {
        let index = tool_calls.len();
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let value = match values.next() {
            Some(Ok(value)) => value,
            Some(Err(e)) => return Err(json_error(index, &e)),
            None => {
                return Err(ToolParseError::InvalidJson {
                    index,
                    message: "no JSON object".into(),
                });
            }
        };
        let end = values.byte_offset();
        tool_calls.push(call_of(
            index,
            value,
            &["arguments", "parameters"],
            "\"parameters\" (or \"arguments\")",
        )?);
        let after = rest[end..].trim_start();
        if after.is_empty() {
            break;
        }
        match after.strip_prefix(';') {
            Some(next) if !next.trim().is_empty() => rest = next.trim_start(),
            // A separator at the end: nothing more to read.
            Some(_) => break,
            None => {
                return Err(ToolParseError::TrailingText {
                    index,
                    text: after.chars().take(40).collect(),
                });
            }
        }
    }
    Ok(ParsedReply {
        content: String::new(),
        tool_calls,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::{ChatTemplate, Message, SpecialTokens};
    use serde_json::json;

    fn call(name: &str, id: usize, arguments: Value) -> ToolCall {
        ToolCall::function(name, arguments).with_id(format!("call_{id}"))
    }

    #[test]
    fn detects_the_format_of_the_fixture_templates() {
        let fixture = |name: &str| {
            let path = format!("{}/tests/fixtures/chat/{name}", env!("CARGO_MANIFEST_DIR"));
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
        };
        for (file, want) in [
            ("qwen2_5_instruct.jinja", Some(ToolCallFormat::Hermes)),
            ("qwen3.jinja", Some(ToolCallFormat::Hermes)),
            ("llama3_1_instruct.jinja", Some(ToolCallFormat::Llama3Json)),
            ("llama3_2_instruct.jinja", Some(ToolCallFormat::Llama3Json)),
            ("llama3_instruct.jinja", None),
        ] {
            assert_eq!(ToolCallFormat::detect(&fixture(file)), want, "{file}");
        }
        assert_eq!(ToolCallFormat::detect("{{ messages }}"), None);
    }

    #[test]
    fn hermes_reads_qwen_replies() {
        // What Qwen2.5 / Qwen3 write: text, then the calls, one per block.
        let text = "I'll check both cities.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"東京\"}}\n</tool_call>";
        let reply = parse_tool_calls(ToolCallFormat::Hermes, text).unwrap();
        assert_eq!(reply.content, "I'll check both cities.\n");
        assert_eq!(
            reply.tool_calls,
            vec![
                call(
                    "get_weather",
                    0,
                    json!({"city": "Paris", "unit": "celsius"})
                ),
                call("get_weather", 1, json!({"city": "東京"})),
            ]
        );
        // A call alone, without surrounding newlines; no arguments.
        let reply = parse_tool_calls(
            ToolCallFormat::Hermes,
            "<tool_call>{\"name\": \"now\", \"arguments\": {}}</tool_call>",
        )
        .unwrap();
        assert_eq!(reply.content, "");
        assert_eq!(reply.tool_calls, vec![call("now", 0, json!({}))]);
        // No call: the whole text, even with JSON or a closing tag in it.
        for text in [
            "The answer is 42.",
            "{\"name\": \"x\"}",
            "a </tool_call> b",
            "",
        ] {
            let reply = parse_tool_calls(ToolCallFormat::Hermes, text).unwrap();
            assert_eq!(reply.content, text);
            assert!(reply.tool_calls.is_empty());
        }
    }

    #[test]
    fn hermes_refuses_calls_it_cannot_read() {
        for (text, want) in [
            (
                "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}\n</tool_call>",
                "tool call 0: invalid JSON: EOF while parsing an object",
            ),
            (
                "<tool_call>\n{\"arguments\": {}}\n</tool_call>",
                "tool call 0: no \"name\" string",
            ),
            (
                "<tool_call>\n{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}\n</tool_call>",
                "tool call 0: the arguments are a string, not a JSON object",
            ),
            (
                "<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
                "tool call 0: no \"arguments\"",
            ),
            (
                "<tool_call>\n[1, 2]\n</tool_call>",
                "tool call 0: expected a JSON object, found an array",
            ),
            (
                "ok\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"g\", \"arguments\": {\"x\": ",
                "tool call 1: `<tool_call>` is never closed by `</tool_call>`",
            ),
        ] {
            let err = parse_tool_calls(ToolCallFormat::Hermes, text).unwrap_err();
            let message = err.to_string();
            assert!(message.starts_with(want), "{text:?}: {message}");
            assert!(!message.contains('\n'), "one line: {message:?}");
        }
        assert_eq!(
            parse_tool_calls(ToolCallFormat::Hermes, "<tool_call>{}").unwrap_err(),
            ToolParseError::Unclosed { index: 0 }
        );
    }

    #[test]
    fn llama3_json_reads_llama_replies() {
        // Llama-3.1/3.2 with tools in the user message answer with bare JSON
        // and "parameters"; with <|python_tag|>, or with "arguments".
        let reply = parse_tool_calls(
            ToolCallFormat::Llama3Json,
            "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\", \"days\": 3}}",
        )
        .unwrap();
        assert_eq!(reply.content, "");
        assert_eq!(
            reply.tool_calls,
            vec![call("get_weather", 0, json!({"city": "Paris", "days": 3}))]
        );
        let reply = parse_tool_calls(
            ToolCallFormat::Llama3Json,
            "<|python_tag|>{\"name\": \"a\", \"arguments\": {\"x\": [1, {\"y\": null}]}}; {\"name\": \"b\", \"parameters\": {}}\n",
        )
        .unwrap();
        assert_eq!(
            reply.tool_calls,
            vec![
                call("a", 0, json!({"x": [1, {"y": null}]})),
                call("b", 1, json!({})),
            ]
        );
        for text in [
            "The weather in Paris is sunny.",
            "Sets like {1, 2} are fine in prose.",
            "",
        ] {
            let reply = parse_tool_calls(ToolCallFormat::Llama3Json, text).unwrap();
            assert_eq!(reply.content, text);
            assert!(reply.tool_calls.is_empty());
        }
    }

    #[test]
    fn llama3_json_refuses_calls_it_cannot_read() {
        for (text, want) in [
            (
                "{\"name\": \"f\", \"parameters\": {\"a\": 1}",
                "tool call 0: invalid JSON: EOF while parsing an object",
            ),
            (
                "{\"parameters\": {\"a\": 1}}",
                "tool call 0: no \"name\" string",
            ),
            (
                "{\"name\": \"f\", \"parameters\": [1]}",
                "tool call 0: the arguments are an array, not a JSON object",
            ),
            (
                "{\"name\": \"f\"}",
                "tool call 0: no \"parameters\" (or \"arguments\")",
            ),
            (
                "{\"name\": \"f\", \"parameters\": {}} and then some text",
                "tool call 0: unexpected text after it: \"and then some text\"",
            ),
            (
                "<|python_tag|>{\"name\": \"f\", \"parameters\": {}}; {\"name\": 3, \"parameters\": {}}",
                "tool call 1: no \"name\" string",
            ),
            (
                "<|python_tag|>",
                "tool call 0: invalid JSON: no JSON object",
            ),
        ] {
            let err = parse_tool_calls(ToolCallFormat::Llama3Json, text).unwrap_err();
            let message = err.to_string();
            assert!(message.starts_with(want), "{text:?}: {message}");
            assert!(!message.contains('\n'), "one line: {message:?}");
        }
    }

    /// The assistant turn of `[user, assistant]` rendered by `source`: the
    /// text after the last `header`, up to `end`, without Qwen3's (empty)
    /// think block.
    fn assistant_part(source: &str, header: &str, end: &str, assistant: &Message) -> String {
        let template = ChatTemplate::new(source, SpecialTokens::default()).unwrap();
        let messages = [
            Message::new("user", "Weather in Paris and Oslo?"),
            assistant.clone(),
        ];
        let text = template.render(&messages, false).unwrap();
        let start = text.rfind(header).expect("the assistant header") + header.len();
        let turn = &text[start..];
        let turn = &turn[..turn.find(end).expect("the end of the turn")];
        match turn.find("</think>\n\n") {
            Some(i) => turn[i + "</think>\n\n".len()..].to_owned(),
            None => turn.to_owned(),
        }
    }

    #[test]
    fn rendered_calls_parse_back_to_the_same_calls() {
        let read = |name: &str| {
            std::fs::read_to_string(format!(
                "{}/tests/fixtures/chat/{name}",
                env!("CARGO_MANIFEST_DIR")
            ))
            .unwrap()
        };
        let paris = call(
            "get_weather",
            0,
            json!({"city": "Paris", "unit": "celsius", "days": 2}),
        );
        let oslo = call(
            "get_weather",
            1,
            json!({"city": "Oslo", "detail": {"wind": true, "hours": [6, 12.5]}}),
        );
        for (file, header, end, calls) in [
            (
                "qwen2_5_instruct.jinja",
                "<|im_start|>assistant",
                "<|im_end|>",
                vec![paris.clone(), oslo.clone()],
            ),
            (
                "qwen3.jinja",
                "<|im_start|>assistant\n",
                "<|im_end|>",
                vec![paris.clone(), oslo.clone()],
            ),
            // Llama-3.1 takes one call per message.
            (
                "llama3_1_instruct.jinja",
                "<|start_header_id|>assistant<|end_header_id|>\n\n",
                "<|eot_id|>",
                vec![oslo.clone()],
            ),
            (
                "llama3_2_instruct.jinja",
                "<|start_header_id|>assistant<|end_header_id|>\n\n",
                "<|eot_id|>",
                vec![paris.clone()],
            ),
        ] {
            let source = read(file);
            let format = ToolCallFormat::detect(&source).expect("a format");
            // The ids the parser gives, so that whole calls compare.
            let want: Vec<ToolCall> = calls
                .iter()
                .enumerate()
                .map(|(i, c)| c.clone().with_id(format!("call_{i}")))
                .collect();
            let assistant = Message::assistant_with_tool_calls(
                "",
                calls.iter().map(|c| c.clone().with_id("ignored")).collect(),
            );
            let turn = assistant_part(&source, header, end, &assistant);
            let reply =
                parse_tool_calls(format, &turn).unwrap_or_else(|e| panic!("{file}: {turn:?}: {e}"));
            assert_eq!(reply.tool_calls, want, "{file}: {turn:?}");
            assert_eq!(reply.content.trim(), "", "{file}: {turn:?}");
        }
        // With content before the calls (Hermes keeps it).
        let source = read("qwen2_5_instruct.jinja");
        let assistant = Message::assistant_with_tool_calls("Let me look.", vec![paris.clone()]);
        let turn = assistant_part(&source, "<|im_start|>assistant", "<|im_end|>", &assistant);
        let reply = parse_tool_calls(ToolCallFormat::Hermes, &turn).unwrap();
        assert_eq!(reply.content, "\nLet me look.\n");
        assert_eq!(reply.tool_calls, vec![paris]);
    }
}
