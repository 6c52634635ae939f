//! The text side of a model: its tokenizer, BOS and stop tokens, and the
//! prompt/completion conventions every role shares (the SFT warm start, the
//! rollout worker and the learner must tokenize prompts identically).
//!
//! A rollout worker whose weights live in an external engine (vLLM) needs
//! only this part of the model: [`ModelText::from_dir`] reads it from a
//! Hugging Face folder without loading any weights.

use std::path::Path;

use crate::config::ModelConfig;
use crate::error::{PolicyError, Result};
use crate::model::Policy;
use crate::tokenizer::PolicyTokenizer;

/// A model's tokenizer, BOS token and stop tokens.
#[derive(Debug, Clone)]
pub struct ModelText {
    tokenizer: PolicyTokenizer,
    bos_token_id: Option<i64>,
    eos_token_ids: Vec<i64>,
    vocab_size: i64,
    tie_word_embeddings: bool,
}

impl ModelText {
    /// Reads `config.json`, `tokenizer.json` and (when present)
    /// `generation_config.json` of a Hugging Face model folder.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
        let tok_path = dir.join("tokenizer.json");
        if !tok_path.is_file() {
            return Err(PolicyError::InvalidRequest(format!(
                "{} has no tokenizer.json",
                dir.display()
            )));
        }
        let tokenizer = PolicyTokenizer::from_file(&tok_path)?;
        let gen_path = dir.join("generation_config.json");
        let generation_config = if gen_path.is_file() {
            Some(std::fs::read(&gen_path).map_err(|e| PolicyError::io(&gen_path, e))?)
        } else {
            None
        };
        Ok(Self {
            tokenizer,
            bos_token_id: cfg.bos_token_id,
            eos_token_ids: eos_token_ids(&cfg, generation_config.as_deref()),
            vocab_size: cfg.vocab_size,
            tie_word_embeddings: cfg.tie_word_embeddings,
        })
    }

    /// The text side of a loaded policy.
    pub fn of(policy: &Policy) -> Result<Self> {
        let tokenizer = policy
            .tokenizer()
            .ok_or_else(|| PolicyError::InvalidRequest("the model has no tokenizer.json".into()))?
            .clone();
        Ok(Self {
            tokenizer,
            bos_token_id: policy.config().bos_token_id,
            eos_token_ids: policy.eos_token_ids(),
            vocab_size: policy.config().vocab_size,
            tie_word_embeddings: policy.config().tie_word_embeddings,
        })
    }

    pub fn tokenizer(&self) -> &PolicyTokenizer {
        &self.tokenizer
    }

    /// Token ids that end a completion by default.
    pub fn eos_token_ids(&self) -> &[i64] {
        &self.eos_token_ids
    }

    /// Whether the LM head shares the embedding's weights (`config.json`).
    pub fn tie_word_embeddings(&self) -> bool {
        self.tie_word_embeddings
    }

    /// `vocab_size` of the model's `config.json`.
    pub fn vocab_size(&self) -> i64 {
        self.vocab_size
    }

    /// Token ids of a prompt: the tokenizer with its special tokens, and the
    /// model's BOS in front when the tokenizer did not put it there.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<i64>> {
        let mut ids = self.tokenizer.encode(text, true)?;
        if let Some(bos) = self.bos_token_id
            && ids.first() != Some(&bos)
        {
            ids.insert(0, bos);
        }
        if ids.is_empty() {
            return Err(PolicyError::InvalidRequest(format!(
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
}

/// Token ids that end a completion by default: the config's `eos_token_id`
/// (one or a list) and `generation_config.json`'s, within the vocabulary.
pub(crate) fn eos_token_ids(cfg: &ModelConfig, generation_config: Option<&[u8]>) -> Vec<i64> {
    let mut ids = cfg.eos_token_ids.clone();
    if let Some(bytes) = generation_config
        && let Ok(v) = serde_json::from_slice::<serde_json::Value>(bytes)
    {
        match v.get("eos_token_id") {
            Some(serde_json::Value::Array(a)) => {
                ids.extend(a.iter().filter_map(serde_json::Value::as_i64))
            }
            Some(x) => ids.extend(x.as_i64()),
            None => {}
        }
    }
    ids.retain(|&id| id >= 0 && id < cfg.vocab_size);
    ids.sort_unstable();
    ids.dedup();
    ids
}
