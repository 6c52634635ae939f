//! Chat-template parity with Hugging Face transformers, a reference nobody
//! here wrote.
//!
//! The templates of `tests/fixtures/chat/*.jinja` are the exact
//! `chat_template` strings of Qwen2.5-Instruct, Qwen3, Meta-Llama-3-Instruct,
//! Llama-3.1-Instruct and Llama-3.2-Instruct (`tests/fixtures/chat/README.md`
//! says where each comes from). For each, the test writes a model folder
//! (config.json, a small byte-level BPE tokenizer.json with the templates'
//! special tokens, tokenizer_config.json, and for one model the template as
//! `chat_template.jinja` instead), has `tests/python/chat_reference.py` apply
//! transformers' `apply_chat_template(messages, tools=tools,
//! add_generation_prompt=True)` to every case of
//! `tests/fixtures/chat/messages.json` (messages with tool calls, tool
//! results and reasoning; tool definitions or none), and checks that
//! [`ModelText::render_messages`] gives the same text, byte for byte, and
//! [`ModelText::encode_messages`] the same token ids; where transformers
//! raises, this crate must fail too. Cases without tools also go through
//! [`ModelText::render`] and [`ModelText::encode`] (the `Prompt` path).
//!
//! The Python interpreter is `$ASYNCRL_PYTHON` or `<workspace>/.venv/bin/python`
//! (scripts/setup installs transformers there); without it the test fails.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use asyncrl_text::{Message, ModelText, Prompt};
use serde::Deserialize;
use serde_json::{Value, json};

/// The special tokens of the templates, added to the test tokenizer in this
/// order after the byte-level vocabulary and the merges.
const SPECIAL_TOKENS: [&str; 8] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
];

/// The tokenizer pipeline of a model family, as in its tokenizer.json on
/// the Hub (transformers 5 even rebuilds Qwen2's from its own code, so the
/// test tokenizer must have exactly that one).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Family {
    /// NFC, Qwen2's split regex, byte-level.
    Qwen2,
    /// Llama-3's split regex, byte-level, and a post-processor that
    /// prepends `<|begin_of_text|>` (which a chat encoding must not add).
    Llama3,
}

/// Qwen2's pre-tokenizer regex (transformers' `tokenization_qwen2.py`).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama-3's pre-tokenizer regex (its tokenizer.json; transformers'
/// `convert_slow_tokenizer.py`).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// One model folder the test writes and compares on.
struct Model {
    /// Names the model in failures.
    name: &'static str,
    /// The template file under tests/fixtures/chat/.
    template: &'static str,
    /// Written as `chat_template.jinja` rather than inside
    /// tokenizer_config.json.
    jinja_file: bool,
    family: Family,
    model_type: &'static str,
    bos_token: Option<&'static str>,
    eos_token: &'static str,
    pad_token: Option<&'static str>,
    /// `bos_token_id` of config.json.
    config_bos: &'static str,
}

const MODELS: [Model; 6] = [
    Model {
        name: "Qwen2.5-Instruct",
        template: "qwen2_5_instruct.jinja",
        jinja_file: false,
        family: Family::Qwen2,
        model_type: "qwen2",
        bos_token: None,
        eos_token: "<|im_end|>",
        pad_token: Some("<|endoftext|>"),
        config_bos: "<|endoftext|>",
    },
    Model {
        name: "Qwen2.5-Instruct (chat_template.jinja)",
        template: "qwen2_5_instruct.jinja",
        jinja_file: true,
        family: Family::Qwen2,
        model_type: "qwen2",
        bos_token: None,
        eos_token: "<|im_end|>",
        pad_token: Some("<|endoftext|>"),
        config_bos: "<|endoftext|>",
    },
    Model {
        name: "Qwen3",
        template: "qwen3.jinja",
        jinja_file: false,
        family: Family::Qwen2,
        model_type: "qwen3",
        bos_token: None,
        eos_token: "<|im_end|>",
        pad_token: Some("<|endoftext|>"),
        config_bos: "<|endoftext|>",
    },
    Model {
        name: "Meta-Llama-3-Instruct",
        template: "llama3_instruct.jinja",
        jinja_file: false,
        family: Family::Llama3,
        model_type: "llama",
        bos_token: Some("<|begin_of_text|>"),
        eos_token: "<|eot_id|>",
        pad_token: None,
        config_bos: "<|begin_of_text|>",
    },
    Model {
        name: "Llama-3.1-Instruct",
        template: "llama3_1_instruct.jinja",
        jinja_file: false,
        family: Family::Llama3,
        model_type: "llama",
        bos_token: Some("<|begin_of_text|>"),
        eos_token: "<|eot_id|>",
        pad_token: None,
        config_bos: "<|begin_of_text|>",
    },
    Model {
        name: "Llama-3.2-Instruct",
        template: "llama3_2_instruct.jinja",
        jinja_file: false,
        family: Family::Llama3,
        model_type: "llama",
        bos_token: Some("<|begin_of_text|>"),
        eos_token: "<|eot_id|>",
        pad_token: None,
        config_bos: "<|begin_of_text|>",
    },
];

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat")
}

fn python() -> PathBuf {
    match std::env::var_os("ASYNCRL_PYTHON") {
        Some(p) => PathBuf::from(p),
        None => Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("the crate is in the workspace")
            .join(".venv/bin/python"),
    }
}

/// GPT-2's byte-to-character table of byte-level BPE: the character that
/// stands for each byte.
fn byte_chars() -> Vec<char> {
    let printable: Vec<u32> = (u32::from(b'!')..=u32::from(b'~'))
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut extra = 0;
    (0..256u32)
        .map(|b| {
            let c = if printable.contains(&b) {
                b
            } else {
                extra += 1;
                255 + extra
            };
            char::from_u32(c).expect("a valid char")
        })
        .collect()
}

fn byte_level(bytes: &[u8], table: &[char]) -> String {
    bytes.iter().map(|&b| table[usize::from(b)]).collect()
}

/// The merges of the test tokenizer, as byte strings, so that tokenization is
/// not byte by byte: common English pieces, a space run, a newline pair,
/// pieces of the special-token syntax and half of a CJK character.
fn merges() -> Vec<(Vec<u8>, Vec<u8>)> {
    let text: &[(&str, &str)] = &[
        (" ", "t"),
        ("h", "e"),
        (" t", "he"),
        ("i", "n"),
        ("e", "r"),
        ("a", "n"),
        (" ", "a"),
        ("o", "n"),
        ("r", "e"),
        ("\n", "\n"),
        ("s", "t"),
        ("e", "n"),
        ("e", "m"),
        (" ", "s"),
        ("o", "u"),
        (" ", "w"),
        ("a", "s"),
        ("i", "s"),
        (" ", "i"),
        (" ", "c"),
        (" ", "y"),
        (" y", "ou"),
        (" ", " "),
        ("  ", "  "),
        ("a", "r"),
        ("<", "|"),
        ("|", ">"),
        ("u", "s"),
        ("us", "er"),
        ("as", "s"),
        ("ass", "is"),
        ("assis", "t"),
        ("assist", "an"),
        ("assistan", "t"),
        ("s", "y"),
        ("sy", "st"),
        ("syst", "em"),
    ];
    let mut out: Vec<(Vec<u8>, Vec<u8>)> = text
        .iter()
        .map(|(a, b)| (a.as_bytes().to_vec(), b.as_bytes().to_vec()))
        .collect();
    // "é" as one token, and two bytes of a three-byte character: a token
    // that is not a whole character.
    let e = "é".as_bytes();
    out.push((e[..1].to_vec(), e[1..].to_vec()));
    let ni = "你".as_bytes();
    out.push((ni[..1].to_vec(), ni[1..2].to_vec()));
    out
}

/// A byte-level BPE tokenizer.json with the pipeline of `family` and the
/// templates' special tokens; its vocabulary size; the id of each special
/// token.
fn tokenizer_json(family: Family) -> (Value, usize, BTreeMap<&'static str, usize>) {
    let table = byte_chars();
    let mut vocab = serde_json::Map::new();
    for (b, c) in table.iter().enumerate() {
        vocab.insert(c.to_string(), json!(b));
    }
    let mut merge_list = Vec::new();
    for (a, b) in merges() {
        let (a, b) = (byte_level(&a, &table), byte_level(&b, &table));
        assert!(
            vocab.contains_key(&a) && vocab.contains_key(&b),
            "merge {a:?} {b:?}: a part is not in the vocabulary yet"
        );
        let merged = format!("{a}{b}");
        assert!(!vocab.contains_key(&merged), "merge {merged:?} twice");
        vocab.insert(merged, json!(vocab.len()));
        merge_list.push(json!([a, b]));
    }
    let mut ids = BTreeMap::new();
    let mut added = Vec::new();
    for (i, tok) in SPECIAL_TOKENS.iter().enumerate() {
        let id = vocab.len() + i;
        ids.insert(*tok, id);
        added.push(json!({
            "id": id, "content": tok, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true
        }));
    }
    let size = vocab.len() + SPECIAL_TOKENS.len();
    let byte_level_step = |trim_offsets: bool| {
        json!({
            "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": trim_offsets,
            "use_regex": false
        })
    };
    let split = |pattern: &str| {
        json!({
            "type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated",
            "invert": false
        })
    };
    let (normalizer, pre_tokenizer, post_processor) = match family {
        Family::Qwen2 => (
            json!({"type": "NFC"}),
            json!({"type": "Sequence", "pretokenizers": [split(QWEN2_SPLIT), byte_level_step(false)]}),
            byte_level_step(false),
        ),
        Family::Llama3 => {
            let bos = "<|begin_of_text|>";
            let prepend = json!({
                "type": "TemplateProcessing",
                "single": [
                    {"SpecialToken": {"id": bos, "type_id": 0}},
                    {"Sequence": {"id": "A", "type_id": 0}}
                ],
                "pair": [
                    {"SpecialToken": {"id": bos, "type_id": 0}},
                    {"Sequence": {"id": "A", "type_id": 0}},
                    {"SpecialToken": {"id": bos, "type_id": 1}},
                    {"Sequence": {"id": "B", "type_id": 1}}
                ],
                "special_tokens": {bos: {"id": bos, "ids": [ids[bos]], "tokens": [bos]}}
            });
            (
                Value::Null,
                json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_SPLIT), byte_level_step(true)]}),
                json!({"type": "Sequence", "processors": [byte_level_step(false), prepend]}),
            )
        }
    };
    let value = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {
            "type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
            "use_regex": true
        },
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": Value::Object(vocab),
            "merges": merge_list,
        }
    });
    (value, size, ids)
}

fn write_json(path: &Path, value: &Value) {
    let text = serde_json::to_string_pretty(value).expect("serialize");
    std::fs::write(path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

/// Writes the model folder of `m` under `root` and returns it.
fn write_model(root: &Path, m: &Model) -> PathBuf {
    let dir = root.join(m.name.replace(['(', ')', ' ', '.'], "_"));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let template_path = fixtures().join(m.template);
    let template = std::fs::read_to_string(&template_path)
        .unwrap_or_else(|e| panic!("{}: {e}", template_path.display()));
    let (tokenizer, vocab_size, ids) = tokenizer_json(m.family);
    write_json(&dir.join("tokenizer.json"), &tokenizer);
    write_json(
        &dir.join("config.json"),
        &json!({
            "model_type": m.model_type,
            "vocab_size": vocab_size,
            "bos_token_id": ids[m.config_bos],
            "eos_token_id": ids[m.eos_token],
        }),
    );
    let mut cfg = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": m.bos_token,
        "eos_token": m.eos_token,
        "pad_token": m.pad_token,
        "unk_token": null,
        "clean_up_tokenization_spaces": false,
        "model_max_length": 131072,
    });
    if m.jinja_file {
        std::fs::write(dir.join("chat_template.jinja"), &template).expect("write template");
    } else {
        cfg["chat_template"] = json!(template);
    }
    write_json(&dir.join("tokenizer_config.json"), &cfg);
    dir
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Case {
    name: String,
    /// Tool definitions (JSON schemas), passed as `tools=`; `None` passes
    /// `tools=None`.
    #[serde(default)]
    tools: Option<Vec<Value>>,
    messages: Vec<Message>,
}

/// What transformers gives for one message list.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct Reference {
    text: Option<String>,
    ids: Option<Vec<i64>>,
    error: Option<String>,
}

#[derive(Deserialize)]
struct ReferenceRun {
    transformers_version: String,
    tokenizer_class: String,
    cases: Vec<Reference>,
}

/// Runs the Python reference on one model folder.
fn transformers_reference(py: &Path, dir: &Path) -> ReferenceRun {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/chat_reference.py");
    let mut cmd = Command::new(py);
    cmd.arg(&script)
        .arg(dir)
        .arg(fixtures().join("messages.json"))
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_OFFLINE", "1")
        .env("TOKENIZERS_PARALLELISM", "false");
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}); it needs transformers (scripts/setup installs it):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{cmd:?} printed no reference JSON ({e}):\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// Where two texts first differ, for failure messages.
fn first_difference(a: &str, b: &str) -> usize {
    a.char_indices()
        .zip(b.chars())
        .find(|((_, x), y)| x != y)
        .map(|((i, _), _)| i)
        .unwrap_or_else(|| a.len().min(b.len()))
}

/// Compares this crate with transformers on one (model, message list);
/// returns what differs.
fn check(
    model: &str,
    text: &ModelText,
    index: usize,
    case: &Case,
    reference: &Reference,
) -> Option<String> {
    let what = format!("{model}, message list {index} ({})", case.name);
    let rendered = text.render_messages(&case.messages, case.tools.as_deref(), true);
    let encoded = text.encode_messages(&case.messages, case.tools.as_deref(), true);
    if case.tools.is_none() {
        // The Prompt path renders and encodes the same.
        let prompt = Prompt::Messages(case.messages.clone());
        let (r, e) = (text.render(&prompt), text.encode(&prompt));
        let same = match (&rendered, &r, &encoded, &e) {
            (Ok(a), Ok(b), Ok(c), Ok(d)) => a == b && c == d,
            (Err(_), Err(_), Err(_), Err(_)) => true,
            _ => false,
        };
        if !same {
            return Some(format!(
                "{what}: render_messages / encode_messages ({rendered:?}, {encoded:?}) and \
                 render / encode ({r:?}, {e:?}) differ"
            ));
        }
    }
    match reference {
        Reference {
            error: Some(error), ..
        } => match (&rendered, &encoded) {
            (Err(_), Err(_)) => None,
            _ => Some(format!(
                "{what}: transformers raises {error:?}, but this crate renders {rendered:?} \
                 and encodes {encoded:?}"
            )),
        },
        Reference {
            text: Some(want_text),
            ids: Some(want_ids),
            error: None,
        } => {
            let mut problems = Vec::new();
            match &rendered {
                Ok(got) if got == want_text => {}
                Ok(got) => {
                    let at = first_difference(got, want_text);
                    problems.push(format!(
                        "text differs from byte {at}:\n  transformers: {want_text:?}\n  this crate:   {got:?}"
                    ));
                }
                Err(e) => problems.push(format!(
                    "this crate cannot render ({e}); transformers renders {want_text:?}"
                )),
            }
            match &encoded {
                Ok(got) if got == want_ids => {}
                Ok(got) => problems.push(format!(
                    "token ids differ:\n  transformers: {want_ids:?}\n  this crate:   {got:?}"
                )),
                Err(e) => problems.push(format!(
                    "this crate cannot encode ({e}); transformers gives {want_ids:?}"
                )),
            }
            (!problems.is_empty()).then(|| format!("{what}: {}", problems.join("\n")))
        }
        other => Some(format!("{what}: malformed reference {other:?}")),
    }
}

/// The `Today Date: ...` line of a rendered Llama-3.x prompt.
fn date_line(text: &str) -> Option<&str> {
    text.lines().find(|l| l.starts_with("Today Date: "))
}

fn today() -> String {
    format!("Today Date: {}", chrono::Local::now().format("%d %b %Y"))
}

#[test]
fn chat_templates_render_and_encode_like_transformers() {
    let py = python();
    assert!(
        py.is_file(),
        "{} not found: run scripts/setup (or set ASYNCRL_PYTHON to a Python with transformers)",
        py.display()
    );
    let messages_path = fixtures().join("messages.json");
    let cases: Vec<Case> = serde_json::from_str(
        &std::fs::read_to_string(&messages_path)
            .unwrap_or_else(|e| panic!("{}: {e}", messages_path.display())),
    )
    .unwrap_or_else(|e| panic!("{}: {e}", messages_path.display()));
    assert!(cases.len() >= 40, "{} message lists", cases.len());
    assert!(
        cases.iter().filter(|c| c.tools.is_some()).count() >= 10
            && cases
                .iter()
                .any(|c| c.messages.iter().any(|m| !m.tool_calls.is_empty()))
            && cases
                .iter()
                .any(|c| c.messages.iter().any(|m| m.reasoning_content.is_some())),
        "the cases cover tools, tool calls and reasoning"
    );

    let day_before = today();
    let work = tempfile::tempdir().expect("tempdir");
    let dirs: Vec<PathBuf> = MODELS.iter().map(|m| write_model(work.path(), m)).collect();
    // One Python process per model folder, all at once.
    let references: Vec<ReferenceRun> = std::thread::scope(|s| {
        let handles: Vec<_> = dirs
            .iter()
            .map(|dir| s.spawn(|| transformers_reference(&py, dir)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("reference thread"))
            .collect()
    });

    let mut failures = Vec::new();
    let mut compared = 0;
    let mut texts = Vec::new();
    for ((model, dir), reference) in MODELS.iter().zip(&dirs).zip(&references) {
        eprintln!(
            "{}: transformers {} ({})",
            model.name, reference.transformers_version, reference.tokenizer_class
        );
        assert_eq!(
            reference.cases.len(),
            cases.len(),
            "{}: one reference per message list",
            model.name
        );
        let text = ModelText::from_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", model.name));
        assert!(
            text.chat_template().is_some(),
            "{}: no chat template read",
            model.name
        );
        for (i, (case, r)) in cases.iter().zip(&reference.cases).enumerate() {
            failures.extend(check(model.name, &text, i, case, r));
            compared += 1;
        }
        texts.push(text);
    }
    assert!(
        failures.is_empty(),
        "{} of {compared} (template, message list) pairs differ from transformers:\n\n{}",
        failures.len(),
        failures.join("\n\n")
    );
    eprintln!("{compared} (template, message list) pairs render and encode as in transformers");

    // The cases are not trivial: transformers rejects some, the tokenizer
    // merges bytes, and the template's special tokens are single ids.
    let qwen = &references[0].cases;
    assert!(qwen.iter().any(|r| r.error.is_some()), "no error case");
    let ids = qwen[0].ids.as_ref().expect("ids of the first list");
    let (_, _, special) = tokenizer_json(Family::Qwen2);
    let first_special = special["<|endoftext|>"] as i64;
    assert!(ids.contains(&(special["<|im_start|>"] as i64)), "{ids:?}");
    assert!(
        ids.iter().any(|&id| (256..first_special).contains(&id)),
        "no merged token in {ids:?}"
    );

    // The tool cases are not trivial either: every tool-aware template
    // writes the tools (dropping them changes the text), and transformers
    // refuses two calls in one Llama-3.1 message and tools without a user
    // message.
    let case = |name: &str| {
        cases
            .iter()
            .position(|c| c.name == name)
            .unwrap_or_else(|| panic!("no case {name}"))
    };
    let tools_user = case("tools_user");
    for ((model, reference), text) in MODELS.iter().zip(&references).zip(&texts) {
        if model.template == "llama3_instruct.jinja" {
            continue;
        }
        let want = reference.cases[tools_user]
            .text
            .as_deref()
            .unwrap_or_else(|| panic!("{}: tools_user renders", model.name));
        assert!(want.contains("get_weather"), "{}: {want:?}", model.name);
        let without = text
            .render_messages(&cases[tools_user].messages, None, true)
            .expect("render");
        assert_ne!(without, want, "{}: the tools change the text", model.name);
    }
    for (model, reference) in MODELS.iter().zip(&references) {
        let llama31 =
            model.template.starts_with("llama3_1") || model.template.starts_with("llama3_2");
        for name in ["tool_call_two", "tools_only_system"] {
            let error = reference.cases[case(name)].error.as_deref();
            assert_eq!(
                error.is_some(),
                llama31,
                "{}: {name}: {error:?}",
                model.name
            );
        }
    }

    // The Llama-3.x date line, the same on both sides: Llama-3.1's template
    // fixes it, Llama-3.2's takes today's date from strftime_now.
    let first = Prompt::Messages(cases[0].messages.clone());
    let mut dated = 0;
    for ((model, reference), text) in MODELS.iter().zip(&references).zip(&texts) {
        let Some(want) = reference.cases[0].text.as_deref().and_then(date_line) else {
            continue;
        };
        dated += 1;
        let got = text.render(&first).expect("render");
        assert_eq!(date_line(&got), Some(want), "{}: date line", model.name);
        match model.template {
            "llama3_1_instruct.jinja" => {
                assert_eq!(want, "Today Date: 26 Jul 2024", "{}", model.name)
            }
            "llama3_2_instruct.jinja" => assert!(
                want == day_before || want == today(),
                "{}: {want:?} is not today ({day_before:?})",
                model.name
            ),
            _ => {}
        }
    }
    assert_eq!(dated, 2, "the Llama-3.1 and 3.2 prompts have a date line");
}
