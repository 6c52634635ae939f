//! The policy model shared by the learner and the rollout worker.
//!
//! - [`Policy`]: a decoder-only transformer of the Llama / Qwen2 family in
//!   `tch` (token embedding, RMSNorm, rotary position embedding, grouped-query
//!   attention with Qwen2's q/k/v bias, SwiGLU MLP, tied or untied LM head).
//!   Loads and saves Hugging Face model folders
//!   ([`Policy::from_pretrained`], [`Policy::save_pretrained`]); the built-in
//!   tiny model ([`Policy::builtin_tiny`]) uses the same code path with its
//!   own character-level tokenizer ([`PolicyTokenizer::builtin`]).
//! - Weights as safetensors bytes for publication and weight swaps
//!   ([`Policy::weights_to_safetensors`], [`Policy::load_weights_from_bytes`]).
//! - Batched, KV-cached sampling with continuous batching and weight swaps
//!   between steps ([`DecodeBatch`]), and the log-probs the learner needs
//!   ([`token_logprobs`]); see [`sampling`] for which distribution the
//!   log-probs refer to (`log_softmax(logits / τ)` over the full vocabulary,
//!   before top-p/top-k truncation; τ = 1 for greedy decoding).
//! - [`ModelHandle`]: the policy on its own OS thread, with async methods.
//!
//! # Padding and positions
//!
//! Batches are right-padded. [`Policy::forward`] takes an optional
//! `attention_mask` (1 = token, 0 = padding); positions are
//! `cumsum(mask) - 1`, so left padding works too. The decode batch gives each
//! sequence its own positions (`0..len` in its cache slot).
//!
//! # Devices
//!
//! [`DeviceOptions::auto`] picks the first CUDA device when present, with
//! bf16 autocast (parameters stay float32, matmuls run in bf16, norms and
//! log-probs in float32), else the CPU in float32.

pub mod actor;
pub mod affinity;
pub mod config;
pub mod decode;
pub mod error;
pub mod from_config;
pub mod kernels;
pub mod model;
pub mod sampling;
pub mod tiny;
pub mod weights;

/// The text side of a model lives in `asyncrl-text` (no libtorch there).
pub use asyncrl_text::{self as text, ModelText, PolicyTokenizer, tokenizer};

pub use actor::{EngineOptions, EngineStats, ModelHandle};
pub use affinity::pin_current_thread;
pub use config::{ModelConfig, ModelType, RopeScaling};
pub use decode::{
    DecodeBatch, DecodeBatchOptions, FinishReason, SampledToken, SeqId, SequenceOutput,
    SequenceRequest, StepOutput, generate,
};
pub use error::{PolicyError, Result};
pub use model::{DeviceOptions, Policy, SharedLanes, parameter_names_and_shapes};
pub use sampling::{
    SamplingParams, logprob_temperature, sequence_logprobs, token_logprobs,
    token_logprobs_and_entropy,
};
pub use tiny::TinyModelSpec;
pub use weights::WeightDtype;
