//! `asyncrl train --check-config`, and the check every `asyncrl train` runs
//! before any role starts: the config (already validated when loaded), the
//! model's text side (tokenizer, chat template, stop tokens), every data set
//! through the one task loader, and every prompt rendered and tokenized the
//! way the rollout worker will, so a bad row or a missing template is one
//! error line before anything runs.

use std::fmt;

use anyhow::Context as _;
use asyncrl_config::Config;
use asyncrl_tasks::{Prompt, TaskItem};
use asyncrl_text::ModelText;

/// What the check found.
#[derive(Debug)]
pub struct CheckReport {
    /// `model.path`, or "the built-in model".
    pub model: String,
    /// `model_type` and size of the model folder's config.json (with the
    /// tensor roles built in).
    pub architecture: Option<String>,
    pub chat_template: bool,
    pub eos_token_ids: Vec<i64>,
    pub stop_strings: Vec<String>,
    pub max_seq_len: usize,
    pub max_new_tokens: usize,
    pub datasets: Vec<DatasetCheck>,
    /// `[eval]`: (data set, path, problems evaluated, every N steps).
    pub eval: Option<(String, String, usize, u64)>,
}

#[derive(Debug)]
pub struct DatasetCheck {
    pub name: String,
    pub path: String,
    pub verifier: String,
    pub tasks: usize,
    pub skipped_long: usize,
    /// The longest prompt in tokens (after the chat template).
    pub longest_prompt: usize,
    /// Prompts whose tokens plus `model.max_new_tokens` exceed
    /// `model.max_seq_len` (their completions are cut short).
    pub over_seq_len: usize,
    /// The first task: its id, its rendered prompt and its token count.
    pub first_id: String,
    pub first_rendered: String,
    pub first_tokens: usize,
}

/// Reads the model's text side and every data set; renders and tokenizes
/// every prompt. Blocking (file I/O and tokenizing).
pub fn check_tasks(config: &Config) -> anyhow::Result<CheckReport> {
    let model = match &config.model.path {
        Some(p) => p.display().to_string(),
        None => "the built-in model".to_owned(),
    };
    let architecture = architecture(config)?;
    let text = asyncrl_tasks::model_text(&config.model)
        .with_context(|| format!("cannot read the text side of model.path ({model})"))?;
    let loaded = asyncrl_tasks::load_datasets_within(
        &config.coordinator.datasets,
        Some(&text),
        Some(config.model.max_seq_len),
    )?;
    let mut datasets = Vec::new();
    for (d, l) in config.coordinator.datasets.iter().zip(&loaded) {
        let mut longest = 0usize;
        let mut over = 0usize;
        let mut first = None;
        for item in &l.items {
            let n = encode(&text, item)
                .with_context(|| format!("data set `{}` ({})", d.name, d.path.display()))?;
            longest = longest.max(n);
            if n + config.model.max_new_tokens > config.model.max_seq_len {
                over += 1;
            }
            if first.is_none() {
                let rendered = text.render(&item.prompt)?;
                first = Some((item.id.clone(), rendered, n));
            }
        }
        let (first_id, first_rendered, first_tokens) = first.unwrap_or_default();
        datasets.push(DatasetCheck {
            name: d.name.clone(),
            path: d.path.display().to_string(),
            verifier: d.verifier_name().to_owned(),
            tasks: l.items.len(),
            skipped_long: l.skipped_long,
            longest_prompt: longest,
            over_seq_len: over,
            first_id,
            first_rendered,
            first_tokens,
        });
    }
    let eval = match (&config.eval.dataset, config.eval.enabled()) {
        (Some(d), true) => {
            let items = asyncrl_tasks::load_eval_problems(&config.eval, Some(&text))?;
            for item in &items {
                encode(&text, item).with_context(|| {
                    format!("eval data set `{}` ({})", d.name, d.path.display())
                })?;
            }
            Some((
                d.name.clone(),
                d.path.display().to_string(),
                items.len(),
                config.eval.every_steps,
            ))
        }
        _ => None,
    };
    Ok(CheckReport {
        eval,
        model,
        architecture,
        chat_template: text.chat_template().is_some(),
        eos_token_ids: text.eos_token_ids().to_vec(),
        stop_strings: text.stop_strings_with(&config.model.stop_strings),
        max_seq_len: config.model.max_seq_len,
        max_new_tokens: config.model.max_new_tokens,
        datasets,
    })
}

fn encode(text: &ModelText, item: &TaskItem) -> anyhow::Result<usize> {
    let ids = text.encode(&item.prompt).with_context(|| {
        format!(
            "task `{}`: cannot {} the prompt",
            item.id,
            match item.prompt {
                Prompt::Text(_) => "tokenize",
                Prompt::Messages(_) => "render and tokenize",
            }
        )
    })?;
    Ok(ids.len())
}

#[cfg(feature = "torch")]
fn architecture(config: &Config) -> anyhow::Result<Option<String>> {
    let Some(dir) = &config.model.path else {
        return Ok(None);
    };
    let path = dir.join("config.json");
    let weights = ["model.safetensors", "model.safetensors.index.json"];
    if !weights.iter().any(|w| dir.join(w).is_file()) {
        anyhow::bail!(
            "model.path {} has no weights ({})",
            dir.display(),
            weights.join(" or ")
        );
    }
    // The built-in model runs the workers' generation, the built-in trainer
    // or `[eval]` (`eval.engine`): then it must know the architecture.
    // Otherwise vLLM and the torch engine load it, and the config only has
    // to name it.
    let builtin_needed = config.worker.engine.kind == asyncrl_config::EngineKind::Builtin
        || config.learner.trainer == asyncrl_config::TrainerEngineName::Builtin
        || (config.eval.enabled()
            && asyncrl_learner::eval::resolve_engine(config)
                == asyncrl_config::EvalEngineName::Builtin);
    if !builtin_needed {
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("model.path: cannot read {}", path.display()))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("model.path: {} is not JSON", path.display()))?;
        let text_config = json.get("text_config").unwrap_or(&json);
        let field = |k: &str| text_config.get(k).or_else(|| json.get(k)).cloned();
        let Some(model_type) = json.get("model_type").and_then(|v| v.as_str()) else {
            anyhow::bail!("model.path: {} names no model_type", path.display());
        };
        let show = |v: Option<serde_json::Value>| v.map_or("?".to_owned(), |v| v.to_string());
        return Ok(Some(format!(
            "{model_type:?} (vLLM and the torch engine), {} layers, hidden {}, vocab {}",
            show(field("num_hidden_layers")),
            show(field("hidden_size")),
            show(field("vocab_size"))
        )));
    }
    let cfg = asyncrl_policy::ModelConfig::from_file(&path)
        .with_context(|| format!("model.path: {}", path.display()))?;
    Ok(Some(format!(
        "{:?}, {} layers, hidden {}, vocab {}",
        cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    )))
}

#[cfg(not(feature = "torch"))]
fn architecture(_: &Config) -> anyhow::Result<Option<String>> {
    Ok(None)
}

impl fmt::Display for CheckReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "config ok")?;
        writeln!(f, "model: {}", self.model)?;
        if let Some(a) = &self.architecture {
            writeln!(f, "  architecture: {a}")?;
        }
        writeln!(
            f,
            "  chat template: {}",
            if self.chat_template { "yes" } else { "no" }
        )?;
        writeln!(f, "  stop token ids: {:?}", self.eos_token_ids)?;
        if !self.stop_strings.is_empty() {
            writeln!(f, "  stop strings: {:?}", self.stop_strings)?;
        }
        writeln!(
            f,
            "  max_seq_len {}, max_new_tokens {}",
            self.max_seq_len, self.max_new_tokens
        )?;
        for d in &self.datasets {
            writeln!(
                f,
                "data set `{}` ({}): {} tasks, verifier {}, longest prompt {} tokens",
                d.name, d.path, d.tasks, d.verifier, d.longest_prompt
            )?;
            if d.skipped_long > 0 {
                writeln!(
                    f,
                    "  {} prompts over max_prompt_tokens left out",
                    d.skipped_long
                )?;
            }
            if d.over_seq_len > 0 {
                writeln!(
                    f,
                    "  warning: {} prompts leave fewer than max_new_tokens = {} tokens before max_seq_len = {}",
                    d.over_seq_len, self.max_new_tokens, self.max_seq_len
                )?;
            }
            writeln!(
                f,
                "  first task `{}` ({} tokens):\n{}",
                d.first_id,
                d.first_tokens,
                indent(&d.first_rendered)
            )?;
        }
        if let Some((name, path, problems, every)) = &self.eval {
            writeln!(
                f,
                "held-out evaluation: data set `{name}` ({path}), {problems} problems, every {every} steps"
            )?;
        }
        Ok(())
    }
}

fn indent(text: &str) -> String {
    text.lines()
        .map(|l| format!("    | {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}
