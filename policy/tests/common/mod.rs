//! Helpers shared by the integration tests.
#![allow(dead_code)]

use asyncrl_policy::{DeviceOptions, ModelConfig, ModelType, Policy, RopeScaling};
use tch::Tensor;

/// Largest absolute difference of two tensors of the same shape.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size(), "shapes differ");
    (a.to_kind(tch::Kind::Double) - b.to_kind(tch::Kind::Double))
        .abs()
        .max()
        .double_value(&[])
}

pub fn max_abs_diff_slices(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "lengths differ: {a:?} vs {b:?}");
    a.iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - f64::from(*y)).abs())
        .fold(0.0, f64::max)
}

/// A small config of either family (Qwen2 gets q/k/v biases), with GQA.
pub fn small_config(model_type: ModelType, tied: bool) -> ModelConfig {
    ModelConfig {
        model_type,
        vocab_size: 61,
        hidden_size: 48,
        intermediate_size: 80,
        num_hidden_layers: 2,
        num_attention_heads: 6,
        num_key_value_heads: 2,
        head_dim: 8,
        rms_norm_eps: 1e-6,
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::None,
        max_position_embeddings: 256,
        tie_word_embeddings: tied,
        qkv_bias: model_type == ModelType::Qwen2,
        o_bias: false,
        mlp_bias: false,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
        pad_token_id: Some(0),
        raw: None,
    }
}

/// A random model with weights large enough that every part matters.
pub fn random_policy(model_type: ModelType, tied: bool, seed: u64) -> Policy {
    Policy::random_init(
        small_config(model_type, tied),
        seed,
        0.15,
        DeviceOptions::cpu(),
    )
    .expect("random policy")
}

/// Full-forward logits `[T, V]` of one sequence.
pub fn full_logits(policy: &Policy, ids: &[i64]) -> Tensor {
    let input = Tensor::from_slice(ids).reshape([1, ids.len() as i64]);
    tch::no_grad(|| policy.forward(&input, None))
        .expect("forward")
        .squeeze_dim(0)
}

/// Deterministic pseudo-random token ids in 0..vocab.
pub fn ids(seed: u64, len: usize, vocab: i64) -> Vec<i64> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % vocab as u64) as i64
        })
        .collect()
}
