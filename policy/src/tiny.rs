//! The built-in tiny model for the built-in tasks: a small Llama-architecture
//! decoder with the character-level tokenizer of
//! [`PolicyTokenizer::builtin`], built from a seed. It is saved and loaded as
//! a Hugging Face folder like any other model.

use asyncrl_config::TinyModelConfig;
use rand::{Rng, SeedableRng, rngs::StdRng};
use serde::{Deserialize, Serialize};
use tch::Tensor;

use crate::config::{ModelConfig, ModelType, RopeScaling};
use crate::error::Result;
use crate::model::{DeviceOptions, Policy};
use crate::tokenizer::PolicyTokenizer;

/// Dimensions of the built-in tiny model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TinyModelSpec {
    pub hidden_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    pub num_key_value_heads: i64,
    pub intermediate_size: i64,
    pub max_position_embeddings: i64,
    pub rope_theta: f64,
    pub tie_word_embeddings: bool,
    /// Standard deviation of the normal initialisation of the matrices.
    pub init_std: f64,
}

impl Default for TinyModelSpec {
    /// The dimensions of `[model.tiny]`'s defaults (their one home is
    /// asyncrl-config's `TinyModelConfig`).
    fn default() -> Self {
        Self::from(&TinyModelConfig::default())
    }
}

impl From<&TinyModelConfig> for TinyModelSpec {
    /// The dimensions of `[model.tiny]`, the defaults for the rest.
    fn from(t: &TinyModelConfig) -> Self {
        Self {
            hidden_size: t.hidden_size,
            num_hidden_layers: t.num_hidden_layers,
            num_attention_heads: t.num_attention_heads,
            num_key_value_heads: t.num_key_value_heads,
            intermediate_size: t.intermediate_size,
            max_position_embeddings: 512,
            rope_theta: 10000.0,
            tie_word_embeddings: true,
            init_std: 0.02,
        }
    }
}

impl TinyModelSpec {
    /// The model config for the built-in vocabulary.
    pub fn config(&self) -> ModelConfig {
        let tok = PolicyTokenizer::builtin();
        let id = |t: &str| tok.token_to_id(t);
        ModelConfig {
            model_type: ModelType::Llama,
            vocab_size: tok.vocab_size() as i64,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_hidden_layers: self.num_hidden_layers,
            num_attention_heads: self.num_attention_heads,
            num_key_value_heads: self.num_key_value_heads,
            head_dim: if self.num_attention_heads > 0 {
                self.hidden_size / self.num_attention_heads
            } else {
                0
            },
            rms_norm_eps: 1e-6,
            rope_theta: self.rope_theta,
            rope_scaling: RopeScaling::None,
            max_position_embeddings: self.max_position_embeddings,
            tie_word_embeddings: self.tie_word_embeddings,
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            bos_token_id: id(crate::tokenizer::BUILTIN_BOS),
            eos_token_ids: id(crate::tokenizer::BUILTIN_EOS).into_iter().collect(),
            pad_token_id: id(crate::tokenizer::BUILTIN_PAD),
            raw: None,
        }
    }
}

/// A standard normal draw (Box-Muller), so that the initial weights depend
/// only on the seed (not on libtorch's generator).
fn normal(rng: &mut StdRng) -> f64 {
    let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
    let u2: f64 = rng.random::<f64>();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

impl Policy {
    /// The built-in tiny model with freshly initialised weights: matrices
    /// normal(0, `init_std`), norms 1, from `seed` alone (the same seed gives
    /// the same weights on every machine). Version 0.
    pub fn builtin_tiny(spec: &TinyModelSpec, seed: u64, opts: DeviceOptions) -> Result<Self> {
        let mut policy = Policy::random_init(spec.config(), seed, spec.init_std, opts)?;
        policy.tokenizer = Some(PolicyTokenizer::builtin());
        policy.extra_files.insert(
            "tokenizer_config.json".into(),
            asyncrl_text::builtin_tokenizer_config(),
        );
        Ok(policy)
    }

    /// A model of any config with random weights from `seed`: matrices and
    /// biases normal(0, `std`), norm weights 1. No tokenizer. Version 0.
    pub fn random_init(cfg: ModelConfig, seed: u64, std: f64, opts: DeviceOptions) -> Result<Self> {
        let mut rng = StdRng::seed_from_u64(seed);
        Policy::build(cfg, opts, &mut |name, shape| {
            let n: i64 = shape.iter().product();
            let values: Vec<f32> = if name.ends_with("norm.weight") {
                vec![1.0; n as usize]
            } else {
                (0..n).map(|_| (normal(&mut rng) * std) as f32).collect()
            };
            Ok(Tensor::from_slice(&values).f_reshape(shape)?)
        })
    }
}
