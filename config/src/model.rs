//! `[model]`: which policy to train and how it samples. Learner and rollout
//! worker read the same section, so the temperature the behaviour log-probs
//! refer to is the one the learner uses.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::{ConfigError, check_range};

#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DeviceName {
    /// The first CUDA device when there is one (bf16 autocast), else the CPU.
    #[default]
    Auto,
    Cpu,
    Cuda,
}

#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum WeightDtypeName {
    /// Weights are published as float32.
    #[default]
    F32,
    /// Weights are published as bfloat16 (half the bytes to move).
    Bf16,
}

/// Dimensions of the built-in tiny model (used when `model.path` is unset).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TinyModelConfig {
    pub hidden_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    pub num_key_value_heads: i64,
    pub intermediate_size: i64,
}

impl Default for TinyModelConfig {
    fn default() -> Self {
        Self {
            hidden_size: 128,
            num_hidden_layers: 4,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            intermediate_size: 352,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// A Hugging Face model folder (config.json, safetensors, tokenizer.json).
    /// Unset: the built-in tiny model, initialised from `run.seed`.
    pub path: Option<PathBuf>,
    pub tiny: TinyModelConfig,
    pub device: DeviceName,
    /// Sampling temperature. Behaviour log-probs are `log_softmax(logits/τ)`
    /// over the full vocabulary, and the learner trains on the same τ.
    pub temperature: f64,
    /// Nucleus sampling: keep the smallest set of tokens with this mass.
    pub top_p: f64,
    pub max_new_tokens: usize,
    /// Longest prompt + completion a worker decodes.
    pub max_seq_len: usize,
    pub weight_dtype: WeightDtypeName,
    /// Threads libtorch may use for intra-op parallelism on the CPU (0: its default).
    pub cpu_threads: i32,
    /// Token ids that end a completion, besides the model's EOS tokens
    /// (`config.json` and `generation_config.json`).
    pub stop_token_ids: Vec<i64>,
    /// Texts that end a completion (besides `generation_config.json`'s
    /// `stop_strings`): the completion keeps its tokens up to the one that
    /// completes the string, exactly as sampled.
    pub stop_strings: Vec<String>,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            path: None,
            tiny: TinyModelConfig::default(),
            device: DeviceName::Auto,
            temperature: 1.0,
            top_p: 1.0,
            max_new_tokens: 16,
            max_seq_len: 128,
            weight_dtype: WeightDtypeName::F32,
            cpu_threads: 0,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
        }
    }
}

impl ModelConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(p) = &self.path
            && p.as_os_str().is_empty()
        {
            return Err(ConfigError::invalid(
                "model.path",
                "is empty (leave it out for the built-in model)",
            ));
        }
        if let Some(id) = self.stop_token_ids.iter().find(|&&id| id < 0) {
            return Err(ConfigError::invalid(
                "model.stop_token_ids",
                format!("holds {id}; token ids are at least 0"),
            ));
        }
        if self.stop_strings.iter().any(String::is_empty) {
            return Err(ConfigError::invalid(
                "model.stop_strings",
                "holds an empty string",
            ));
        }
        let t = &self.tiny;
        check_range("model.tiny.hidden_size", t.hidden_size, 8, 4096)?;
        check_range("model.tiny.num_hidden_layers", t.num_hidden_layers, 1, 64)?;
        check_range(
            "model.tiny.num_attention_heads",
            t.num_attention_heads,
            1,
            64,
        )?;
        check_range(
            "model.tiny.num_key_value_heads",
            t.num_key_value_heads,
            1,
            t.num_attention_heads,
        )?;
        check_range(
            "model.tiny.intermediate_size",
            t.intermediate_size,
            8,
            16384,
        )?;
        if t.hidden_size % t.num_attention_heads != 0 {
            return Err(ConfigError::invalid(
                "model.tiny.hidden_size",
                format!(
                    "= {} is not a multiple of num_attention_heads {}",
                    t.hidden_size, t.num_attention_heads
                ),
            ));
        }
        if t.num_attention_heads % t.num_key_value_heads != 0 {
            return Err(ConfigError::invalid(
                "model.tiny.num_key_value_heads",
                format!(
                    "= {} does not divide num_attention_heads {}",
                    t.num_key_value_heads, t.num_attention_heads
                ),
            ));
        }
        check_range("model.temperature", self.temperature, 0.0, 10.0)?;
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(ConfigError::invalid(
                "model.top_p",
                format!("= {} is out of range (0, 1]", self.top_p),
            ));
        }
        check_range("model.max_new_tokens", self.max_new_tokens, 1, 1 << 16)?;
        check_range("model.max_seq_len", self.max_seq_len, 2, 1 << 17)?;
        if self.max_new_tokens >= self.max_seq_len {
            return Err(ConfigError::invalid(
                "model.max_new_tokens",
                format!(
                    "= {} leaves no room for a prompt in model.max_seq_len = {}",
                    self.max_new_tokens, self.max_seq_len
                ),
            ));
        }
        check_range("model.cpu_threads", self.cpu_threads, 0, 1024)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::test_check::check;

    #[test]
    fn stop_conditions_table() {
        check(
            "[model]\nstop_token_ids = [7, 9]\nstop_strings = [\"</answer>\", \"\\n\\n\"]",
            None,
        );
        check(
            "[model]\nstop_token_ids = [-1]",
            Some("model.stop_token_ids"),
        );
        check("[model]\nstop_strings = [\"\"]", Some("model.stop_strings"));
        check("[model]\nstop_strings = \"x\"", Some("model.stop_strings"));
    }
}
