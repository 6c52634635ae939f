//! Chat templates that run away (a string doubled without end, loops in
//! loops, a macro that calls itself, an output of gigabytes) fail with an
//! error that names the template's file and the limit, when the model
//! folder loads or when a prompt is rendered; the real templates still
//! render long conversations with tools well inside the limits.

use std::path::{Path, PathBuf};

use asyncrl_text::limits::MAX_FUEL;
use asyncrl_text::{
    ChatTemplate, Message, ModelText, PolicyTokenizer, Prompt, SpecialTokens, TemplateLimit,
    TextError, ToolCall,
};
use serde_json::json;

/// A model folder with the built-in tokenizer and `files`.
fn model_dir(root: &Path, files: &[(&str, &str)]) -> PathBuf {
    let dir = root.join("model");
    std::fs::create_dir_all(&dir).unwrap();
    let tok = PolicyTokenizer::builtin();
    let config = json!({"vocab_size": tok.vocab_size(), "bos_token_id": 1, "eos_token_id": 2});
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    std::fs::write(dir.join("tokenizer.json"), tok.json()).unwrap();
    for (name, text) in files {
        std::fs::write(dir.join(name), text).unwrap();
    }
    dir
}

/// Loads a model folder whose chat_template.jinja is `template` and
/// returns the limit its loading reports, checking that the error names the
/// file.
fn load_error(template: &str) -> TemplateLimit {
    let root = tempfile::tempdir().unwrap();
    let dir = model_dir(root.path(), &[("chat_template.jinja", template)]);
    let err = ModelText::from_dir(&dir).unwrap_err();
    let message = err.to_string();
    let file = dir.join("chat_template.jinja").display().to_string();
    assert!(message.contains(&file), "{message}");
    match err {
        TextError::TemplateLimit {
            template, limit, ..
        } => {
            assert_eq!(template, file);
            assert!(message.contains(&limit.to_string()), "{message}");
            limit
        }
        other => panic!("not a limit error: {other}"),
    }
}

#[test]
fn a_doubled_string_stops_at_the_size_limit() {
    // A `set` in a loop lasts one iteration (Jinja's scoping), so the
    // doubling goes through a namespace, a macro, or `set`s in a row.
    let forty_sets = "{% set s = 'x' %}".to_owned() + &"{% set s = s ~ s %}".repeat(40);
    for template in [
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
        // Without output: the string alone is too large.
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        &forty_sets,
        "{% macro d(s, n) %}{% if n %}{{ d(s ~ s, n - 1) }}{% endif %}{% endmacro %}{{ d('x', 40) }}",
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s * 2 %}{% endfor %}",
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s | replace('x', 'x' * 1000) %}{% endfor %}",
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s.replace('x', 'x' * 1000) %}{% endfor %}",
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = [ns.s, ns.s] | join %}{% endfor %}",
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ''.join([ns.s, ns.s]) %}{% endfor %}",
        "{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l | length }}",
        "{{ 'x' | indent(100000000000) }}\n\n",
        "{{ 'x' * 1000000000 }}",
    ] {
        assert_eq!(load_error(template), TemplateLimit::Size, "{template}");
    }
    // The loop without a namespace doubles nothing: it loads and renders.
    let root = tempfile::tempdir().unwrap();
    let template =
        "{% set s = 'x' %}{% for i in range(40) %}{% set s = s ~ s %}{% endfor %}{{ s }}";
    let dir = model_dir(root.path(), &[("chat_template.jinja", template)]);
    let text = ModelText::from_dir(&dir).unwrap();
    let one = Prompt::Messages(vec![Message::new("user", "q")]);
    assert_eq!(text.render(&one).unwrap(), "x");
}

#[test]
fn a_flood_of_output_stops_at_the_size_limit() {
    let raw = "y".repeat(1000);
    for template in [
        "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}".to_owned(),
        format!("{{% for i in range(100000) %}}{raw}{{% endfor %}}"),
    ] {
        assert_eq!(load_error(&template), TemplateLimit::Size, "{template}");
    }
}

#[test]
fn nested_loops_stop_at_the_fuel_limit() {
    for template in [
        "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
        "{% for a in range(100000) %}{% for b in range(100000) %}{{ '' }}{% endfor %}{% endfor %}",
    ] {
        assert_eq!(load_error(template), TemplateLimit::Fuel, "{template}");
    }
}

#[test]
fn endless_recursion_stops_at_the_recursion_limit() {
    for template in [
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "{% macro f(n) %}{% if true %}{{ f(n) }}{% endif %}{% endmacro %}{{ f(0) }}",
        "{% for m in [1] recursive %}{{ loop([1]) }}{% endfor %}",
    ] {
        assert_eq!(load_error(template), TemplateLimit::Recursion, "{template}");
    }
}

#[test]
fn a_template_in_tokenizer_config_is_named_too() {
    let root = tempfile::tempdir().unwrap();
    let config = json!({"chat_template": "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"});
    let dir = model_dir(
        root.path(),
        &[("tokenizer_config.json", &config.to_string())],
    );
    let err = ModelText::from_dir(&dir).unwrap_err().to_string();
    let file = dir.join("tokenizer_config.json").display().to_string();
    assert!(err.contains(&file) && err.contains("fuel limit"), "{err}");
}

#[test]
fn a_template_that_runs_away_on_some_prompts_fails_those_prompts() {
    // One message loads (the string is 1 KiB); three make it 1 GiB.
    let template = "{% set ns = namespace(s='x') %}{% for m in messages %}{% for i in range(10) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{% endfor %}{{ ns.s | length }}";
    let root = tempfile::tempdir().unwrap();
    let dir = model_dir(root.path(), &[("chat_template.jinja", template)]);
    let text = ModelText::from_dir(&dir).unwrap();
    let one = Prompt::Messages(vec![Message::new("user", "1")]);
    assert_eq!(text.render(&one).unwrap(), "1024");
    let three = Prompt::Messages(vec![
        Message::new("user", "1"),
        Message::new("assistant", "2"),
        Message::new("user", "3"),
    ]);
    let err = text.encode(&three).unwrap_err();
    assert!(
        matches!(
            err,
            TextError::TemplateLimit {
                limit: TemplateLimit::Size,
                ..
            }
        ),
        "{err}"
    );
    let message = err.to_string();
    assert!(
        message.contains(&dir.join("chat_template.jinja").display().to_string()),
        "{message}"
    );
    // The template still renders what it rendered before.
    assert_eq!(text.render(&one).unwrap(), "1024");
}

/// A conversation of `n` messages: a system prompt, then user questions,
/// assistant replies with reasoning and tool calls, and tool results.
fn long_conversation(n: usize) -> Vec<Message> {
    let mut messages = vec![Message::new("system", "You are a careful assistant.")];
    let mut i = 0;
    while messages.len() < n {
        messages.push(Message::new(
            "user",
            format!("question {i}: what is {i} + {i}?"),
        ));
        let call = ToolCall::function("add", json!({"a": i, "b": i})).with_id(format!("c{i}"));
        messages.push(
            Message::assistant_with_tool_calls("", vec![call]).with_reasoning("Use the tool."),
        );
        messages.push(Message::tool_result(
            format!("{}", 2 * i),
            Some(format!("c{i}")),
            Some("add".into()),
        ));
        messages.push(Message::new("assistant", format!("{i} + {i} = {}", 2 * i)));
        i += 1;
    }
    messages.push(Message::new("user", "thanks"));
    messages
}

#[test]
fn limits_leave_room_for_long_conversations() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat");
    let tools = [json!({"type": "function", "function": {
        "name": "add",
        "description": "Adds two integers.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer"}, "b": {"type": "integer"}
        }, "required": ["a", "b"]}
    }})];
    let messages = long_conversation(1000);
    for file in [
        "qwen3.jinja",
        "qwen2_5_instruct.jinja",
        "llama3_1_instruct.jinja",
        "llama3_2_instruct.jinja",
        "llama3_instruct.jinja",
    ] {
        let source = std::fs::read_to_string(fixtures.join(file)).unwrap();
        let special = SpecialTokens {
            bos_token: Some("<|begin_of_text|>".into()),
            eos_token: Some("<|im_end|>".into()),
            ..Default::default()
        };
        let template = ChatTemplate::from_file(file, &source, special).unwrap();
        template.check_limits().unwrap();
        let tools = (file != "llama3_instruct.jinja").then_some(&tools[..]);
        match template.render_counting(&messages, tools, true) {
            Ok((text, fuel)) => {
                eprintln!(
                    "{file}: {} messages, {} bytes, fuel {fuel}",
                    messages.len(),
                    text.len()
                );
                assert!(fuel < MAX_FUEL / 10, "{file}: fuel {fuel}");
            }
            // A template may refuse the conversation (raise_exception), but
            // not for a limit.
            Err(e) => {
                eprintln!("{file}: {e}");
                assert!(!matches!(e, TextError::TemplateLimit { .. }), "{file}: {e}");
            }
        }
    }
}
