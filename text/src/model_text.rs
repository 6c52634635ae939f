//! The text side of a model: its tokenizer, BOS and stop tokens, its chat
//! template, and the prompt/completion conventions every role shares (the
//! SFT warm start, the rollout worker, the coordinator's prompt-length check
//! must tokenize prompts identically).
//!
//! [`ModelText::from_dir`] reads it from a Hugging Face folder without
//! loading any weights (a rollout worker whose weights live in vLLM, the
//! coordinator); a loaded policy builds it with [`ModelText::from_parts`].

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use crate::chat::{ChatTemplate, Message, Prompt, SpecialTokens};
use crate::error::{Result, TextError};
use crate::tokenizer::PolicyTokenizer;
use crate::tool_calls::ToolCallFormat;

/// What the text side needs from `config.json`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelFacts {
    pub bos_token_id: Option<i64>,
    /// `eos_token_id` of `config.json` (one or a list).
    pub eos_token_ids: Vec<i64>,
    pub vocab_size: i64,
    pub tie_word_embeddings: bool,
}

impl ModelFacts {
    /// Reads the fields of a `config.json` value (`path` names it in errors).
    pub fn from_config_json(value: &Value, path: &Path) -> Result<Self> {
        let field = |key: &str, message: &str| TextError::Field {
            path: path.to_owned(),
            key: key.into(),
            message: message.into(),
        };
        let int = |key: &str| -> Result<Option<i64>> {
            match value.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v
                    .as_i64()
                    .map(Some)
                    .ok_or_else(|| field(key, "must be an integer")),
            }
        };
        let eos_token_ids = match value.get("eos_token_id") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_i64()
                        .ok_or_else(|| field("eos_token_id", "must hold integers"))
                })
                .collect::<Result<_>>()?,
            Some(v) => vec![v.as_i64().ok_or_else(|| {
                field("eos_token_id", "must be an integer or a list of integers")
            })?],
        };
        let tie_word_embeddings = match value.get("tie_word_embeddings") {
            // transformers' Llama and Qwen2 configs default to untied.
            None | Some(Value::Null) => false,
            Some(v) => v
                .as_bool()
                .ok_or_else(|| field("tie_word_embeddings", "must be a boolean"))?,
        };
        Ok(Self {
            bos_token_id: int("bos_token_id")?,
            eos_token_ids,
            vocab_size: int("vocab_size")?.ok_or_else(|| field("vocab_size", "missing"))?,
            tie_word_embeddings,
        })
    }
}

/// The small files of a model folder the text side reads (besides
/// `config.json` and `tokenizer.json`).
pub const TEXT_FILES: [&str; 3] = [
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
];

/// A model's tokenizer, BOS token, stop tokens and chat template.
#[derive(Debug, Clone)]
pub struct ModelText {
    /// The model folder (or "the built-in model"), for errors.
    name: String,
    tokenizer: PolicyTokenizer,
    bos_token_id: Option<i64>,
    eos_token_ids: Vec<i64>,
    stop_strings: Vec<String>,
    vocab_size: i64,
    tie_word_embeddings: bool,
    chat_template: Option<ChatTemplate>,
}

fn read_json(path: &Path) -> Result<Value> {
    let bytes = std::fs::read(path).map_err(|e| TextError::io(path, e))?;
    serde_json::from_slice(&bytes).map_err(|source| TextError::Json {
        path: path.to_owned(),
        source,
    })
}

/// A special token of `tokenizer_config.json`: a string, or an added-token
/// object with its `content`.
fn special_token(cfg: &Value, key: &str) -> Option<String> {
    match cfg.get(key)? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

impl ModelText {
    /// Reads `config.json`, `tokenizer.json` and, when present,
    /// `tokenizer_config.json`, `generation_config.json` and
    /// `chat_template.jinja` of a Hugging Face model folder.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let cfg_path = dir.join("config.json");
        let facts = ModelFacts::from_config_json(&read_json(&cfg_path)?, &cfg_path)?;
        let tok_path = dir.join("tokenizer.json");
        if !tok_path.is_file() {
            return Err(TextError::Invalid(format!(
                "{} has no tokenizer.json",
                dir.display()
            )));
        }
        let tokenizer = PolicyTokenizer::from_file(&tok_path)?;
        let mut files = BTreeMap::new();
        for name in TEXT_FILES {
            let path = dir.join(name);
            if path.is_file() {
                files.insert(
                    name.to_owned(),
                    std::fs::read(&path).map_err(|e| TextError::io(&path, e))?,
                );
            }
        }
        Self::from_parts(dir.display().to_string(), tokenizer, facts, &files)
    }

    /// The text side from a tokenizer, the `config.json` facts and the small
    /// files of [`TEXT_FILES`] (those the model has). `name` names the model
    /// in errors.
    pub fn from_parts(
        name: String,
        tokenizer: PolicyTokenizer,
        facts: ModelFacts,
        files: &BTreeMap<String, Vec<u8>>,
    ) -> Result<Self> {
        let json = |file: &str| -> Result<Option<Value>> {
            files
                .get(file)
                .map(|bytes| {
                    serde_json::from_slice(bytes).map_err(|source| TextError::Json {
                        path: Path::new(&name).join(file),
                        source,
                    })
                })
                .transpose()
        };
        let tokenizer_config = json("tokenizer_config.json")?;
        let generation_config = json("generation_config.json")?;
        let eos_token_ids = eos_token_ids(
            &facts.eos_token_ids,
            facts.vocab_size,
            generation_config.as_ref(),
        );
        let mut stop_strings = Vec::new();
        if let Some(g) = &generation_config {
            match g.get("stop_strings") {
                Some(Value::String(s)) => stop_strings.push(s.clone()),
                Some(Value::Array(a)) => {
                    stop_strings.extend(a.iter().filter_map(Value::as_str).map(str::to_owned))
                }
                _ => {}
            }
        }
        stop_strings.retain(|s| !s.is_empty());

        // chat_template.jinja wins over tokenizer_config.json's, as in
        // transformers.
        let source = match files.get("chat_template.jinja") {
            Some(bytes) => Some((
                Path::new(&name)
                    .join("chat_template.jinja")
                    .display()
                    .to_string(),
                String::from_utf8_lossy(bytes).into_owned(),
            )),
            None => tokenizer_config
                .as_ref()
                .and_then(|c| c.get("chat_template"))
                .and_then(template_source)
                .map(|src| {
                    let path = Path::new(&name).join("tokenizer_config.json");
                    (format!("{} (`chat_template`)", path.display()), src)
                }),
        };
        let chat_template = source
            .map(|(origin, src)| {
                let mut special = SpecialTokens::default();
                if let Some(c) = &tokenizer_config {
                    for name in SpecialTokens::NAMES {
                        special.set(name, special_token(c, name));
                    }
                }
                let template = ChatTemplate::from_file(origin, &src, special)?;
                // A template that runs away does so on any conversation:
                // say so when the model loads.
                template.check_limits()?;
                Ok::<_, TextError>(template)
            })
            .transpose()?;
        Ok(Self {
            name,
            tokenizer,
            bos_token_id: facts.bos_token_id,
            eos_token_ids,
            stop_strings,
            vocab_size: facts.vocab_size,
            tie_word_embeddings: facts.tie_word_embeddings,
            chat_template,
        })
    }

    /// The text side of the built-in tiny model (character vocabulary,
    /// `<bos>` first, `<eos>` to stop, [`BUILTIN_CHAT_TEMPLATE`]), as
    /// `Policy::builtin_tiny` has it. `tie_word_embeddings` is the tiny
    /// model's default (true).
    pub fn builtin() -> Self {
        let tokenizer = PolicyTokenizer::builtin();
        let facts = ModelFacts {
            bos_token_id: tokenizer.token_to_id(crate::tokenizer::BUILTIN_BOS),
            eos_token_ids: tokenizer
                .token_to_id(crate::tokenizer::BUILTIN_EOS)
                .into_iter()
                .collect(),
            vocab_size: tokenizer.vocab_size() as i64,
            tie_word_embeddings: true,
        };
        let files = BTreeMap::from([(
            "tokenizer_config.json".to_owned(),
            builtin_tokenizer_config(),
        )]);
        // The built-in files are fixed and known to load; a failure is a bug.
        #[allow(clippy::expect_used)]
        Self::from_parts("the built-in model".into(), tokenizer, facts, &files)
            .expect("the built-in text side loads")
    }

    pub fn tokenizer(&self) -> &PolicyTokenizer {
        &self.tokenizer
    }

    /// Token ids that end a completion by default (`config.json`'s and
    /// `generation_config.json`'s `eos_token_id`, within the vocabulary).
    pub fn eos_token_ids(&self) -> &[i64] {
        &self.eos_token_ids
    }

    /// `stop_strings` of `generation_config.json`.
    pub fn stop_strings(&self) -> &[String] {
        &self.stop_strings
    }

    /// The stop strings completions end at: `configured` (`model.stop_strings`)
    /// first, then the model's own, without repeats.
    pub fn stop_strings_with(&self, configured: &[String]) -> Vec<String> {
        let mut out = configured.to_vec();
        for s in &self.stop_strings {
            if !out.contains(s) {
                out.push(s.clone());
            }
        }
        out
    }

    /// Whether the LM head shares the embedding's weights (`config.json`).
    pub fn tie_word_embeddings(&self) -> bool {
        self.tie_word_embeddings
    }

    /// `vocab_size` of the model's `config.json`.
    pub fn vocab_size(&self) -> i64 {
        self.vocab_size
    }

    /// The chat template, when the model has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// The text the model reads for a prompt: the text itself, or the
    /// messages rendered with the chat template and its generation prompt.
    pub fn render(&self, prompt: &Prompt) -> Result<String> {
        match prompt {
            Prompt::Text(text) => Ok(text.clone()),
            Prompt::Messages(messages) => self.render_messages(messages, None, true),
        }
    }

    /// The text of `messages` with the tool definitions `tools`, rendered
    /// with the chat template as transformers' `apply_chat_template(messages,
    /// tools=tools, add_generation_prompt=add_generation_prompt)` renders
    /// it; an error names the model when it has no chat template.
    pub fn render_messages(
        &self,
        messages: &[Message],
        tools: Option<&[Value]>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.chat_template
            .as_ref()
            .ok_or_else(|| TextError::NoChatTemplate {
                model: self.name.clone(),
            })?
            .render_with_tools(messages, tools, add_generation_prompt)
    }

    /// Token ids of [`Self::render_messages`]: the text tokenized without
    /// adding special tokens (the template writes them), as transformers'
    /// `apply_chat_template(..., tokenize=True)` does.
    pub fn encode_messages(
        &self,
        messages: &[Message],
        tools: Option<&[Value]>,
        add_generation_prompt: bool,
    ) -> Result<Vec<i64>> {
        let text = self.render_messages(messages, tools, add_generation_prompt)?;
        let ids = self.tokenizer.encode(&text, false)?;
        if ids.is_empty() {
            return Err(TextError::Invalid(
                "the messages render to no tokens".into(),
            ));
        }
        Ok(ids)
    }

    /// How the model writes tool calls, read from its chat template
    /// ([`ToolCallFormat::detect`]); `None` without a template or when the
    /// template shows no format this crate parses.
    pub fn tool_call_format(&self) -> Option<ToolCallFormat> {
        ToolCallFormat::detect(self.chat_template.as_ref()?.source())
    }

    /// Token ids of a prompt. Text: [`Self::encode_prompt`]. Messages: the
    /// rendered template, tokenized without adding special tokens (the
    /// template writes them), as transformers' `apply_chat_template` does.
    pub fn encode(&self, prompt: &Prompt) -> Result<Vec<i64>> {
        match prompt {
            Prompt::Text(text) => self.encode_prompt(text),
            Prompt::Messages(messages) => self.encode_messages(messages, None, true),
        }
    }

    /// Token ids of a text prompt: the tokenizer with its special tokens,
    /// and the model's BOS in front when the tokenizer did not put it there.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<i64>> {
        let mut ids = self.tokenizer.encode(text, true)?;
        if let Some(bos) = self.bos_token_id
            && ids.first() != Some(&bos)
        {
            ids.insert(0, bos);
        }
        if ids.is_empty() {
            return Err(TextError::Invalid(format!(
                "prompt {text:?} encodes to no tokens"
            )));
        }
        Ok(ids)
    }

    /// The text of a completion: its tokens without a final stop token,
    /// decoded without special tokens (what verifiers and reward services
    /// see).
    pub fn decode_completion(&self, tokens: &[i64], stop_token_ids: &[i64]) -> Result<String> {
        let end = match tokens.last() {
            Some(last) if stop_token_ids.contains(last) => tokens.len() - 1,
            _ => tokens.len(),
        };
        self.tokenizer.decode(&tokens[..end], true)
    }

    /// Where a completion ends by a stop string: the smallest `n` such that
    /// the text of `tokens[..n]` (decoded as in [`Self::decode_completion`])
    /// contains one of `stop_strings`; `None` when none occurs. The tokens
    /// kept are a prefix of the sampled ones, so they stay exactly as
    /// sampled (the stop string's last token is kept, as vLLM keeps it).
    pub fn stop_string_end(
        &self,
        tokens: &[i64],
        stop_strings: &[String],
    ) -> Result<Option<usize>> {
        if stop_strings.is_empty() || tokens.is_empty() {
            return Ok(None);
        }
        let hit = |n: usize| -> Result<bool> {
            let text = self.tokenizer.decode(&tokens[..n], true)?;
            Ok(stop_strings.iter().any(|s| text.contains(s.as_str())))
        };
        if !hit(tokens.len())? {
            return Ok(None);
        }
        // The text of a longer prefix extends the text of a shorter one, so
        // "holds a stop string" is monotone in n: bisect.
        let (mut lo, mut hi) = (0usize, tokens.len());
        while lo + 1 < hi {
            let mid = lo + (hi - lo) / 2;
            if hit(mid)? {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        Ok(Some(hi))
    }
}

/// The text verifiers see: up to (not including) the first stop string, as
/// vLLM returns it.
pub fn text_before_stop_string(mut text: String, stop_strings: &[String]) -> String {
    if let Some(cut) = stop_strings
        .iter()
        .filter_map(|s| text.find(s.as_str()))
        .min()
    {
        text.truncate(cut);
    }
    text
}

/// The built-in tiny model's chat template: `<bos>`, then each message's
/// content, an assistant's followed by `<eos>` (the token that ends a
/// reply), a tool's by `;`. Every character is in the built-in vocabulary,
/// so that multi-turn episodes (`[environment]`) run on the tiny model:
/// `<bos>7+x=` `x?<eos>` `x=12;` `19<eos>`.
pub const BUILTIN_CHAT_TEMPLATE: &str = "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content }}{{ eos_token }}{% elif m.role == 'tool' %}{{ m.content }};{% else %}{{ m.content }}{% endif %}{% endfor %}";

/// `tokenizer_config.json` of the built-in tokenizer, so that transformers'
/// `AutoTokenizer` opens a saved built-in model folder; with the built-in
/// chat template ([`BUILTIN_CHAT_TEMPLATE`]).
pub fn builtin_tokenizer_config() -> Vec<u8> {
    let v = serde_json::json!({
        "chat_template": BUILTIN_CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": crate::tokenizer::BUILTIN_BOS,
        "eos_token": crate::tokenizer::BUILTIN_EOS,
        "pad_token": crate::tokenizer::BUILTIN_PAD,
        "unk_token": crate::tokenizer::BUILTIN_UNK,
        "model_max_length": 1_000_000,
        "clean_up_tokenization_spaces": false,
    });
    serde_json::to_vec_pretty(&v).unwrap_or_default()
}

/// Token ids that end a completion by default: `config.json`'s
/// `eos_token_id` (`config_ids`) and `generation_config.json`'s, within the
/// vocabulary, sorted.
pub fn eos_token_ids(
    config_ids: &[i64],
    vocab_size: i64,
    generation_config: Option<&Value>,
) -> Vec<i64> {
    let mut ids = config_ids.to_vec();
    match generation_config.and_then(|g| g.get("eos_token_id")) {
        Some(Value::Array(a)) => ids.extend(a.iter().filter_map(Value::as_i64)),
        Some(x) => ids.extend(x.as_i64()),
        None => {}
    }
    ids.retain(|&id| id >= 0 && id < vocab_size);
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// The Jinja source of `chat_template`: a string, or a list of named
/// templates of which the one named "default" is used.
fn template_source(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Array(items) => items
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(str::to_owned),
        _ => None,
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn text_ends_before_the_first_stop_string() {
        let stops = ["</a>".to_owned(), "\n\n".to_owned()];
        assert_eq!(text_before_stop_string("42</a> x".into(), &stops), "42");
        assert_eq!(text_before_stop_string("4\n\n2</a>".into(), &stops), "4");
        assert_eq!(text_before_stop_string("42".into(), &stops), "42");
        assert_eq!(text_before_stop_string("42</a>".into(), &[]), "42</a>");
    }

    use super::*;

    fn builtin(files: &[(&str, &str)]) -> ModelText {
        let tok = PolicyTokenizer::builtin();
        let facts = ModelFacts {
            bos_token_id: tok.token_to_id("<bos>"),
            eos_token_ids: vec![2],
            vocab_size: tok.vocab_size() as i64,
            tie_word_embeddings: false,
        };
        let files = files
            .iter()
            .map(|(n, t)| (n.to_string(), t.as_bytes().to_vec()))
            .collect();
        ModelText::from_parts("test-model".into(), tok, facts, &files).unwrap()
    }

    #[test]
    fn text_prompts_get_bos_and_messages_get_the_template() {
        let t = builtin(&[(
            "tokenizer_config.json",
            r#"{"bos_token": "<bos>", "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.role[0] }}:{{ m.content }};{% endfor %}{% if add_generation_prompt %}a:{% endif %}"}"#,
        )]);
        assert_eq!(t.encode(&Prompt::Text("1+1=".into())).unwrap()[0], 1);
        let msgs = Prompt::Messages(vec![
            Message::new("system", "x"),
            Message::new("user", "1+1="),
        ]);
        assert_eq!(t.render(&msgs).unwrap(), "<bos>s:x;u:1+1=;a:");
        let ids = t.encode(&msgs).unwrap();
        assert_eq!(ids[0], 1, "the template's BOS, once");
        assert_eq!(ids[1], t.tokenizer().token_to_id("s").unwrap());
        assert_eq!(ids.iter().filter(|&&i| i == 1).count(), 1);
    }

    #[test]
    fn messages_without_a_template_name_the_model() {
        let t = builtin(&[]);
        let err = t
            .encode(&Prompt::Messages(vec![Message::new("user", "q")]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("test-model") && err.contains("no chat template"),
            "{err}"
        );
    }

    #[test]
    fn jinja_file_wins_and_generation_config_adds_stops() {
        let t = builtin(&[
            ("tokenizer_config.json", r#"{"chat_template": "A"}"#),
            ("chat_template.jinja", "B{{ messages[0].content }}"),
            (
                "generation_config.json",
                r###"{"eos_token_id": [2, 5, 9999], "stop_strings": ["##", ""]}"###,
            ),
        ]);
        let m = Prompt::Messages(vec![Message::new("user", "q")]);
        assert_eq!(t.render(&m).unwrap(), "Bq");
        assert_eq!(t.eos_token_ids(), &[2, 5]);
        assert_eq!(t.stop_strings(), &["##".to_owned()]);
    }

    #[test]
    fn stop_string_end_keeps_the_completing_token() {
        let t = builtin(&[]);
        let ids = t.tokenizer().encode("12 ## 34", false).unwrap();
        let stops = vec!["##".to_owned()];
        // "12 #" does not hold "##"; "12 ##" does: 5 tokens are kept.
        assert_eq!(t.stop_string_end(&ids, &stops).unwrap(), Some(5));
        assert_eq!(t.stop_string_end(&ids, &["%".into()]).unwrap(), None);
        assert_eq!(t.stop_string_end(&ids, &[]).unwrap(), None);
        assert_eq!(
            t.stop_string_end(&ids, &["34".into(), "2 ".into()])
                .unwrap(),
            Some(3)
        );
    }
}
