//! Building the policy from the `[model]` config, and the prompt/completion
//! text conventions every role shares (the SFT warm start, the rollout
//! worker and the learner must tokenize prompts identically).

use asyncrl_config::{DeviceName, ModelConfig as ModelSection, WeightDtypeName};

use crate::error::{PolicyError, Result};
use crate::model::{DeviceOptions, Policy};
use crate::sampling::SamplingParams;
use crate::tiny::TinyModelSpec;
use crate::weights::WeightDtype;

/// The device options `[model] device` asks for. `cuda` without a usable
/// CUDA device is an error rather than a silent fall-back to the CPU.
pub fn device_options(name: DeviceName) -> Result<DeviceOptions> {
    match name {
        DeviceName::Auto => Ok(DeviceOptions::auto()),
        DeviceName::Cpu => Ok(DeviceOptions::cpu()),
        DeviceName::Cuda if tch::Cuda::is_available() => Ok(DeviceOptions::auto()),
        DeviceName::Cuda => Err(PolicyError::InvalidRequest(
            "model.device = \"cuda\" but libtorch sees no CUDA device".into(),
        )),
    }
}

/// The tiny-model dimensions of `[model.tiny]`.
pub fn tiny_spec(section: &ModelSection) -> TinyModelSpec {
    let spec = TinyModelSpec::from(&section.tiny);
    TinyModelSpec {
        max_position_embeddings: (section.max_seq_len as i64).max(spec.max_position_embeddings),
        ..spec
    }
}

/// Loads `[model] path` (a Hugging Face folder), or builds the built-in
/// tiny model from `seed` when no path is set. Applies `cpu_threads`.
pub fn load_policy(section: &ModelSection, seed: u64) -> Result<Policy> {
    if section.cpu_threads > 0 {
        tch::set_num_threads(section.cpu_threads);
    }
    let opts = device_options(section.device)?;
    match &section.path {
        Some(dir) => Policy::from_pretrained(dir, opts),
        None => Policy::builtin_tiny(&tiny_spec(section), seed, opts),
    }
}

/// The dtype weights are published in.
pub fn weight_dtype(name: WeightDtypeName) -> WeightDtype {
    match name {
        WeightDtypeName::F32 => WeightDtype::F32,
        WeightDtypeName::Bf16 => WeightDtype::Bf16,
    }
}

/// Sampling parameters of `[model]`, stopping at the model's EOS tokens.
pub fn sampling_params(section: &ModelSection, policy: &Policy) -> SamplingParams {
    sampling_params_with_stops(section, policy.eos_token_ids())
}

/// Sampling parameters of `[model]`, stopping at `stop_token_ids` and
/// `model.stop_token_ids`.
pub fn sampling_params_with_stops(
    section: &ModelSection,
    mut stop_token_ids: Vec<i64>,
) -> SamplingParams {
    for id in &section.stop_token_ids {
        if !stop_token_ids.contains(id) {
            stop_token_ids.push(*id);
        }
    }
    SamplingParams {
        temperature: section.temperature,
        top_p: section.top_p,
        top_k: 0,
        max_new_tokens: section.max_new_tokens,
        stop_token_ids,
        seed: None,
    }
}

/// Token ids of a prompt ([`ModelText::encode_prompt`]).
pub fn encode_prompt(policy: &Policy, text: &str) -> Result<Vec<i64>> {
    Ok(policy.text()?.encode_prompt(text)?)
}

/// The text of a completion ([`ModelText::decode_completion`]).
pub fn decode_completion(
    policy: &Policy,
    tokens: &[i64],
    stop_token_ids: &[i64],
) -> Result<String> {
    Ok(policy.text()?.decode_completion(tokens, stop_token_ids)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_from_config_round_trips_text() {
        let mut section = ModelSection {
            device: DeviceName::Cpu,
            ..Default::default()
        };
        section.tiny.hidden_size = 32;
        section.tiny.num_hidden_layers = 1;
        section.tiny.num_attention_heads = 2;
        section.tiny.num_key_value_heads = 1;
        section.tiny.intermediate_size = 64;
        let p = load_policy(&section, 3).unwrap();
        let ids = encode_prompt(&p, "37+58=").unwrap();
        assert_eq!(ids[0], p.config().bos_token_id.unwrap(), "BOS first");
        assert_eq!(ids.len(), 7);
        let eos = p.eos_token_ids();
        let mut completion = p.tokenizer().unwrap().encode("95", false).unwrap();
        completion.push(eos[0]);
        assert_eq!(decode_completion(&p, &completion, &eos).unwrap(), "95");
        let params = sampling_params(&section, &p);
        assert_eq!(params.stop_token_ids, eos);
        assert_eq!(params.max_new_tokens, section.max_new_tokens);
        // Same seed, same weights.
        let q = load_policy(&section, 3).unwrap();
        assert_eq!(
            p.weights_to_safetensors(WeightDtype::F32).unwrap(),
            q.weights_to_safetensors(WeightDtype::F32).unwrap()
        );
    }

    /// `[model]`'s defaults have one home, the config crate: the policy's
    /// own defaults are the same values.
    #[test]
    fn the_policy_defaults_are_the_config_defaults() {
        let section = ModelSection::default();
        let params = SamplingParams::default();
        assert_eq!(params.temperature, section.temperature);
        assert_eq!(params.top_p, section.top_p);
        assert_eq!(params.max_new_tokens, section.max_new_tokens);
        assert_eq!((params.top_k, params.seed), (0, None));
        assert!(params.stop_token_ids.is_empty());
        let spec = TinyModelSpec::default();
        let t = &section.tiny;
        assert_eq!(
            (
                spec.hidden_size,
                spec.num_hidden_layers,
                spec.num_attention_heads,
                spec.num_key_value_heads,
                spec.intermediate_size
            ),
            (
                t.hidden_size,
                t.num_hidden_layers,
                t.num_attention_heads,
                t.num_key_value_heads,
                t.intermediate_size
            )
        );
        assert_eq!(tiny_spec(&section), spec);
    }

    #[test]
    fn missing_model_folder_is_an_error() {
        let section = ModelSection {
            path: Some("/nonexistent/model".into()),
            device: DeviceName::Cpu,
            ..Default::default()
        };
        let err = load_policy(&section, 0).unwrap_err().to_string();
        assert!(err.contains("/nonexistent/model"), "{err}");
    }
}
