//! The model configuration: the part of a Hugging Face `config.json` that the
//! Llama / Qwen2 decoder needs, parsed with errors that name the key.
//!
//! Both spellings of the rotary settings are accepted: the transformers 4.x
//! keys `rope_theta` + `rope_scaling`, and the 5.x key `rope_parameters`
//! (`{"rope_type": ..., "rope_theta": ...}`).

use std::path::Path;

use serde_json::{Map, Value, json};

use crate::error::{PolicyError, Result};

/// The model families this crate implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelType {
    /// `model_type = "llama"` (`LlamaForCausalLM`).
    Llama,
    /// `model_type = "qwen2"` (`Qwen2ForCausalLM`): q/k/v projections with bias.
    Qwen2,
}

impl ModelType {
    /// The `model_type` string of `config.json`.
    pub fn as_str(self) -> &'static str {
        match self {
            ModelType::Llama => "llama",
            ModelType::Qwen2 => "qwen2",
        }
    }

    /// The `architectures` entry transformers uses for this family.
    pub fn architecture(self) -> &'static str {
        match self {
            ModelType::Llama => "LlamaForCausalLM",
            ModelType::Qwen2 => "Qwen2ForCausalLM",
        }
    }
}

/// Rotary-embedding frequency scaling. Anything else in the config
/// (`dynamic`, `yarn`, `longrope`, ...) is refused with
/// [`PolicyError::UnsupportedRopeScaling`].
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// No scaling (`rope_scaling` absent or null, or `rope_type = "default"`).
    None,
    /// Positions divided by `factor` (`rope_type = "linear"`).
    Linear { factor: f64 },
    /// Llama 3.x frequency-dependent scaling (`rope_type = "llama3"`).
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
}

/// The architecture of a decoder-only Llama / Qwen2 model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub model_type: ModelType,
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    /// Grouped-query attention: fewer key/value heads than query heads.
    pub num_key_value_heads: i64,
    pub head_dim: i64,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: i64,
    /// The LM head shares the token embedding (no `lm_head.weight` tensor).
    pub tie_word_embeddings: bool,
    /// Bias on the q/k/v projections (always for Qwen2; Llama's `attention_bias`).
    pub qkv_bias: bool,
    /// Bias on the output projection (Llama's `attention_bias`; never for Qwen2).
    pub o_bias: bool,
    /// Bias on the MLP projections (Llama's `mlp_bias`).
    pub mlp_bias: bool,
    pub bos_token_id: Option<i64>,
    pub eos_token_ids: Vec<i64>,
    pub pad_token_id: Option<i64>,
    /// The `config.json` this was parsed from, kept so that saving writes
    /// back every key (also those this crate does not use).
    pub raw: Option<Value>,
}

impl ModelConfig {
    /// Reads and parses `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| PolicyError::io(path, e))?;
        let value: Value =
            serde_json::from_str(&text).map_err(|source| PolicyError::json(path, source))?;
        Self::from_json(&value)
    }

    /// Parses a `config.json` value.
    pub fn from_json(value: &Value) -> Result<Self> {
        let obj = value
            .as_object()
            .ok_or_else(|| PolicyError::config("(root)", "config.json must be a JSON object"))?;
        let model_type = match obj.get("model_type").and_then(Value::as_str) {
            Some("llama") => ModelType::Llama,
            Some("qwen2") => ModelType::Qwen2,
            Some(other) => return Err(PolicyError::UnsupportedModelType(other.to_owned())),
            None => return Err(PolicyError::config("model_type", "missing")),
        };
        let hidden_size = req_int(obj, "hidden_size")?;
        let num_attention_heads = req_int(obj, "num_attention_heads")?;
        let num_key_value_heads =
            opt_int(obj, "num_key_value_heads")?.unwrap_or(num_attention_heads);
        let head_dim = match opt_int(obj, "head_dim")? {
            Some(d) => d,
            None => {
                if num_attention_heads <= 0 || hidden_size % num_attention_heads != 0 {
                    return Err(PolicyError::config(
                        "hidden_size",
                        format!(
                            "{hidden_size} is not divisible by num_attention_heads = {num_attention_heads} (and no head_dim is given)"
                        ),
                    ));
                }
                hidden_size / num_attention_heads
            }
        };
        if let Some(act) = obj.get("hidden_act").filter(|v| !v.is_null())
            && act.as_str() != Some("silu")
        {
            return Err(PolicyError::config(
                "hidden_act",
                format!("{act} is not supported (only \"silu\")"),
            ));
        }
        if model_type == ModelType::Qwen2 && obj.get("use_sliding_window") == Some(&json!(true)) {
            return Err(PolicyError::config(
                "use_sliding_window",
                "sliding-window attention is not supported",
            ));
        }
        if let Some(tp) = opt_int(obj, "pretraining_tp")?
            && tp != 1
        {
            return Err(PolicyError::config(
                "pretraining_tp",
                format!("{tp} is not supported (only 1)"),
            ));
        }
        let (rope_theta, rope_scaling) = parse_rope(obj)?;
        let attention_bias = opt_bool(obj, "attention_bias")?.unwrap_or(false);
        let (qkv_bias, o_bias, mlp_bias) = match model_type {
            ModelType::Qwen2 => (true, false, false),
            ModelType::Llama => (
                attention_bias,
                attention_bias,
                opt_bool(obj, "mlp_bias")?.unwrap_or(false),
            ),
        };
        let eos_token_ids = match obj.get("eos_token_id") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_i64()
                        .ok_or_else(|| PolicyError::config("eos_token_id", "must hold integers"))
                })
                .collect::<Result<_>>()?,
            Some(v) => vec![v.as_i64().ok_or_else(|| {
                PolicyError::config("eos_token_id", "must be an integer or a list of integers")
            })?],
        };
        let cfg = ModelConfig {
            model_type,
            vocab_size: req_int(obj, "vocab_size")?,
            hidden_size,
            intermediate_size: req_int(obj, "intermediate_size")?,
            num_hidden_layers: req_int(obj, "num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: opt_f64(obj, "rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            max_position_embeddings: opt_int(obj, "max_position_embeddings")?.unwrap_or(2048),
            // transformers' Llama and Qwen2 configs default to untied.
            tie_word_embeddings: opt_bool(obj, "tie_word_embeddings")?.unwrap_or(false),
            qkv_bias,
            o_bias,
            mlp_bias,
            bos_token_id: opt_int(obj, "bos_token_id")?,
            eos_token_ids,
            pad_token_id: opt_int(obj, "pad_token_id")?,
            raw: Some(value.clone()),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks that the dimensions fit together.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
        ];
        for (key, v) in positive {
            if v <= 0 {
                return Err(PolicyError::config(key, format!("must be > 0, got {v}")));
            }
        }
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            return Err(PolicyError::config(
                "num_key_value_heads",
                format!(
                    "{} does not divide num_attention_heads = {}",
                    self.num_key_value_heads, self.num_attention_heads
                ),
            ));
        }
        if self.head_dim % 2 != 0 {
            return Err(PolicyError::config(
                "head_dim",
                format!("{} must be even for rotary embeddings", self.head_dim),
            ));
        }
        if self.rope_theta <= 0.0 || !self.rope_theta.is_finite() {
            return Err(PolicyError::config(
                "rope_theta",
                format!("must be > 0, got {}", self.rope_theta),
            ));
        }
        if self.rms_norm_eps < 0.0 || !self.rms_norm_eps.is_finite() {
            return Err(PolicyError::config(
                "rms_norm_eps",
                format!("must be >= 0, got {}", self.rms_norm_eps),
            ));
        }
        for (key, id) in [
            ("bos_token_id", self.bos_token_id),
            ("pad_token_id", self.pad_token_id),
        ] {
            if let Some(id) = id
                && (id < 0 || id >= self.vocab_size)
            {
                return Err(PolicyError::config(
                    key,
                    format!(
                        "{id} is outside the vocabulary (vocab_size = {})",
                        self.vocab_size
                    ),
                ));
            }
        }
        for &id in &self.eos_token_ids {
            if id < 0 || id >= self.vocab_size {
                return Err(PolicyError::config(
                    "eos_token_id",
                    format!(
                        "{id} is outside the vocabulary (vocab_size = {})",
                        self.vocab_size
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Query heads per key/value head.
    pub fn kv_groups(&self) -> i64 {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// The `config.json` to write: the one this config was read from (every
    /// key kept) with the architecture fields set from this struct and the
    /// dtype set to float32 (the weights are saved in float32), or a fresh
    /// one for a config built in code.
    pub fn to_hf_json(&self) -> Value {
        let mut obj: Map<String, Value> = self
            .raw
            .as_ref()
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default();
        let fresh = obj.is_empty();
        obj.insert("model_type".into(), json!(self.model_type.as_str()));
        obj.insert(
            "architectures".into(),
            json!([self.model_type.architecture()]),
        );
        obj.insert("vocab_size".into(), json!(self.vocab_size));
        obj.insert("hidden_size".into(), json!(self.hidden_size));
        obj.insert("intermediate_size".into(), json!(self.intermediate_size));
        obj.insert("num_hidden_layers".into(), json!(self.num_hidden_layers));
        obj.insert(
            "num_attention_heads".into(),
            json!(self.num_attention_heads),
        );
        obj.insert(
            "num_key_value_heads".into(),
            json!(self.num_key_value_heads),
        );
        obj.insert("head_dim".into(), json!(self.head_dim));
        obj.insert("rms_norm_eps".into(), json!(self.rms_norm_eps));
        obj.insert(
            "max_position_embeddings".into(),
            json!(self.max_position_embeddings),
        );
        obj.insert(
            "tie_word_embeddings".into(),
            json!(self.tie_word_embeddings),
        );
        obj.insert("hidden_act".into(), json!("silu"));
        if self.model_type == ModelType::Llama {
            obj.insert("attention_bias".into(), json!(self.qkv_bias));
            obj.insert("mlp_bias".into(), json!(self.mlp_bias));
        }
        obj.insert("bos_token_id".into(), json!(self.bos_token_id));
        obj.insert(
            "eos_token_id".into(),
            match self.eos_token_ids.as_slice() {
                [] => Value::Null,
                [one] => json!(one),
                many => json!(many),
            },
        );
        obj.insert("pad_token_id".into(), json!(self.pad_token_id));
        let rope_params = self.rope_parameters_json();
        if obj.contains_key("rope_parameters") {
            obj.insert("rope_parameters".into(), rope_params);
        } else {
            // transformers 4.x keys; 5.x reads and converts them too.
            obj.insert("rope_theta".into(), json!(self.rope_theta));
            obj.insert(
                "rope_scaling".into(),
                match self.rope_scaling {
                    RopeScaling::None => Value::Null,
                    _ => rope_params,
                },
            );
        }
        // The weights are always written in float32.
        if obj.contains_key("torch_dtype") {
            obj.insert("torch_dtype".into(), json!("float32"));
        }
        if obj.contains_key("dtype") || fresh {
            obj.insert("dtype".into(), json!("float32"));
        }
        if fresh {
            obj.insert("initializer_range".into(), json!(0.02));
            obj.insert("use_cache".into(), json!(true));
            obj.insert("attention_dropout".into(), json!(0.0));
        }
        Value::Object(obj)
    }

    fn rope_parameters_json(&self) -> Value {
        match self.rope_scaling {
            RopeScaling::None => json!({"rope_type": "default", "rope_theta": self.rope_theta}),
            RopeScaling::Linear { factor } => {
                json!({"rope_type": "linear", "rope_theta": self.rope_theta, "factor": factor})
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => json!({
                "rope_type": "llama3",
                "rope_theta": self.rope_theta,
                "factor": factor,
                "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": original_max_position_embeddings,
            }),
        }
    }
}

/// `rope_theta` and the scaling, from `rope_parameters` (transformers 5) or
/// `rope_theta` + `rope_scaling` (transformers 4).
fn parse_rope(obj: &Map<String, Value>) -> Result<(f64, RopeScaling)> {
    let (params, key) = match obj.get("rope_parameters").filter(|v| !v.is_null()) {
        Some(p) => (Some(p), "rope_parameters"),
        None => (
            obj.get("rope_scaling").filter(|v| !v.is_null()),
            "rope_scaling",
        ),
    };
    let params = match params {
        Some(Value::Object(p)) => Some(p),
        Some(_) => return Err(PolicyError::config(key, "must be an object or null")),
        None => None,
    };
    let theta = match params
        .and_then(|p| p.get("rope_theta"))
        .filter(|v| !v.is_null())
    {
        Some(v) => v
            .as_f64()
            .ok_or_else(|| PolicyError::config(format!("{key}.rope_theta"), "must be a number"))?,
        None => opt_f64(obj, "rope_theta")?.unwrap_or(10000.0),
    };
    let Some(p) = params else {
        return Ok((theta, RopeScaling::None));
    };
    let rope_type = p
        .get("rope_type")
        .or_else(|| p.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let num = |name: &str| -> Result<f64> {
        p.get(name)
            .and_then(Value::as_f64)
            .ok_or_else(|| PolicyError::config(format!("{key}.{name}"), "missing or not a number"))
    };
    let scaling = match rope_type {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: num("factor")?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: num("original_max_position_embeddings")?,
        },
        other => return Err(PolicyError::UnsupportedRopeScaling(other.to_owned())),
    };
    Ok((theta, scaling))
}

fn req_int(obj: &Map<String, Value>, key: &str) -> Result<i64> {
    opt_int(obj, key)?.ok_or_else(|| PolicyError::config(key, "missing"))
}

fn opt_int(obj: &Map<String, Value>, key: &str) -> Result<Option<i64>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_i64()
            .map(Some)
            .ok_or_else(|| PolicyError::config(key, format!("must be an integer, got {v}"))),
    }
}

fn opt_f64(obj: &Map<String, Value>, key: &str) -> Result<Option<f64>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| PolicyError::config(key, format!("must be a number, got {v}"))),
    }
}

fn opt_bool(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .ok_or_else(|| PolicyError::config(key, format!("must be true or false, got {v}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> Value {
        json!({
            "model_type": "llama", "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 1
        })
    }

    #[test]
    fn parses_v4_and_v5_rope_keys() {
        let mut v = base();
        v["rope_theta"] = json!(500.0);
        let c = ModelConfig::from_json(&v).unwrap();
        assert_eq!(c.rope_theta, 500.0);
        assert_eq!(c.rope_scaling, RopeScaling::None);
        assert_eq!(c.head_dim, 4);
        let mut v = base();
        v["rope_parameters"] = json!({"rope_type": "linear", "rope_theta": 7.0, "factor": 2.0});
        let c = ModelConfig::from_json(&v).unwrap();
        assert_eq!(c.rope_theta, 7.0);
        assert_eq!(c.rope_scaling, RopeScaling::Linear { factor: 2.0 });
    }

    #[test]
    fn refuses_unsupported_things_with_the_key() {
        let mut v = base();
        v["rope_scaling"] = json!({"type": "yarn", "factor": 4.0});
        let e = ModelConfig::from_json(&v).unwrap_err();
        assert!(
            matches!(e, PolicyError::UnsupportedRopeScaling(ref t) if t == "yarn"),
            "{e}"
        );
        let mut v = base();
        v["model_type"] = json!("gpt2");
        let e = ModelConfig::from_json(&v).unwrap_err();
        assert!(e.to_string().contains("gpt2"), "{e}");
        let mut v = base();
        v["num_key_value_heads"] = json!(3);
        let e = ModelConfig::from_json(&v).unwrap_err();
        assert!(e.to_string().contains("num_key_value_heads"), "{e}");
        let mut v = base();
        v["hidden_size"] = json!("eight");
        let e = ModelConfig::from_json(&v).unwrap_err();
        assert!(e.to_string().contains("`hidden_size`"), "{e}");
    }

    #[test]
    fn round_trips_through_hf_json() {
        let mut v = base();
        v["model_type"] = json!("qwen2");
        v["eos_token_id"] = json!([3, 4]);
        v["some_unknown_key"] = json!("kept");
        let c = ModelConfig::from_json(&v).unwrap();
        assert!(c.qkv_bias && !c.o_bias);
        let out = c.to_hf_json();
        assert_eq!(out["some_unknown_key"], json!("kept"));
        let c2 = ModelConfig::from_json(&out).unwrap();
        assert_eq!(
            ModelConfig {
                raw: None,
                ..c.clone()
            },
            ModelConfig { raw: None, ..c2 }
        );
    }
}
