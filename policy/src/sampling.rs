//! Sampling parameters, the sampler, and the log-probabilities the learner
//! recomputes.
//!
//! # Which distribution the log-probs refer to
//!
//! For a sampling temperature `τ > 0` the log-prob of token `x` after prefix
//! `s` is
//!
//! ```text
//! log π_τ(x | s) = log_softmax(logits(s) / τ)[x]
//! ```
//!
//! over the **full** vocabulary: before top-p / top-k truncation. Greedy
//! decoding (`τ = 0`) reports the `τ = 1` log-prob `log_softmax(logits)[x]`.
//! [`token_logprobs`] computes exactly this quantity (pass the same
//! temperature; 0 means 1 there as well), so behaviour, proximal and current
//! log-probs of the learner's objective all refer to one distribution.
//! Truncation only restricts which tokens can be drawn: the sampled token is
//! drawn from the renormalised nucleus, its reported log-prob is the
//! untruncated one.

use rand::{Rng, SeedableRng, rngs::StdRng};
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::error::{PolicyError, Result};
use crate::model::Policy;

/// How one sequence is sampled.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy (argmax).
    pub temperature: f64,
    /// Nucleus sampling: the smallest set of most likely tokens whose
    /// probability (under `logits / temperature`) reaches `top_p`; 1 = off.
    pub top_p: f64,
    /// Only the `top_k` most likely tokens; 0 = off, 1 = greedy.
    pub top_k: usize,
    /// The completion ends after this many tokens.
    pub max_new_tokens: usize,
    /// The completion ends after any of these tokens (which is included in
    /// the completion, with its log-prob).
    pub stop_token_ids: Vec<i64>,
    /// Seed of this sequence's random numbers: the same prompt, parameters
    /// and seed give the same tokens, whatever else is in the batch (up to
    /// floating-point differences of batched kernels). None = a random seed.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    /// `[model]`'s defaults (their one home is asyncrl-config's
    /// `ModelConfig`), no top-k, no stop tokens, a random seed.
    fn default() -> Self {
        crate::from_config::sampling_params_with_stops(
            &asyncrl_config::ModelConfig::default(),
            Vec::new(),
        )
    }
}

impl SamplingParams {
    /// Greedy decoding of at most `max_new_tokens` tokens.
    pub fn greedy(max_new_tokens: usize) -> Self {
        Self {
            temperature: 0.0,
            max_new_tokens,
            ..Self::default()
        }
    }

    /// Checks the values.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(PolicyError::InvalidRequest(format!(
                "temperature must be >= 0, got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(PolicyError::InvalidRequest(format!(
                "top_p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        Ok(())
    }

    /// Whether the token is chosen by argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }
}

/// The temperature the reported log-probs use for a sampling temperature:
/// itself when > 0, 1 for greedy decoding.
pub fn logprob_temperature(sampling_temperature: f64) -> f64 {
    if sampling_temperature > 0.0 {
        sampling_temperature
    } else {
        1.0
    }
}

/// Per-row sampling state handed to [`sample_rows`].
pub(crate) struct RowSampler<'a> {
    pub params: &'a SamplingParams,
    pub rng: &'a mut StdRng,
}

/// A fresh random-number generator for a sequence.
pub(crate) fn sequence_rng(seed: Option<u64>) -> StdRng {
    match seed {
        Some(s) => StdRng::seed_from_u64(s),
        None => StdRng::from_os_rng(),
    }
}

/// Samples one token per row of `logits` `[A, V]` (float32); returns the
/// tokens and their log-probs (see the module docs for which distribution).
///
/// One uniform number per row comes from the row's own generator (so a
/// sequence's draws do not depend on the batch), and the token is found by
/// inverse-CDF search over the descending-sorted, truncated probabilities.
pub(crate) fn sample_rows(
    logits: &Tensor,
    rows: &mut [RowSampler<'_>],
) -> Result<(Vec<i64>, Vec<f32>)> {
    let a = rows.len() as i64;
    let v = logits.size().get(1).copied().unwrap_or(0);
    let device = logits.device();
    let logits = logits.f_to_kind(Kind::Float)?;
    let temps: Vec<f32> = rows
        .iter()
        .map(|r| logprob_temperature(r.params.temperature) as f32)
        .collect();
    let temps = Tensor::from_slice(&temps)
        .f_reshape([a, 1])?
        .f_to_device(device)?;
    let scaled = logits.f_div(&temps)?;
    let logp = scaled.f_sub(&scaled.f_logsumexp([-1], true)?)?;
    let greedy_tok = logits.f_argmax(-1, false)?;

    let any_sampled = rows.iter().any(|r| !r.params.is_greedy());
    let tokens = if any_sampled {
        let probs = logp.f_exp()?;
        let (sorted_p, sorted_idx) = probs.f_sort(-1, true)?;
        let cum = sorted_p.f_cumsum(-1, Kind::Float)?;
        let exclusive = cum.f_sub(&sorted_p)?;
        let top_p: Vec<f32> = rows.iter().map(|r| r.params.top_p as f32).collect();
        let top_p = Tensor::from_slice(&top_p)
            .f_reshape([a, 1])?
            .f_to_device(device)?;
        // keep a token while the mass before it is below top_p (the first
        // token is always kept)
        let mut keep = exclusive.f_lt_tensor(&top_p)?;
        let top_k: Vec<i64> = rows
            .iter()
            .map(|r| {
                if r.params.top_k == 0 {
                    v
                } else {
                    r.params.top_k as i64
                }
            })
            .collect();
        let top_k = Tensor::from_slice(&top_k)
            .f_reshape([a, 1])?
            .f_to_device(device)?;
        let rank = Tensor::f_arange(v, (Kind::Int64, device))?.f_unsqueeze(0)?;
        keep = keep.f_logical_and(&rank.f_lt_tensor(&top_k)?)?;
        let kept = sorted_p.f_mul(&keep.f_to_kind(Kind::Float)?)?;
        let kept_cum = kept.f_cumsum(-1, Kind::Float)?;
        let total = kept_cum.f_narrow(-1, v - 1, 1)?;
        let u: Vec<f32> = rows.iter_mut().map(|r| r.rng.random::<f32>()).collect();
        let target = Tensor::from_slice(&u)
            .f_reshape([a, 1])?
            .f_to_device(device)?
            .f_mul(&total)?;
        // first position whose cumulative mass exceeds the target
        let pos = target.f_searchsorted(&kept_cum, false, true, "right", None::<Tensor>)?;
        let n_kept = keep.f_sum_dim_intlist(-1, true, Kind::Int64)?;
        let pos = pos.f_minimum(&n_kept.f_sub_scalar(1)?)?.f_clamp_min(0)?;
        let sampled = sorted_idx.f_gather(1, &pos, false)?.f_squeeze_dim(1)?;
        let greedy: Vec<bool> = rows.iter().map(|r| r.params.is_greedy()).collect();
        let greedy = Tensor::from_slice(&greedy).f_to_device(device)?;
        greedy_tok.f_where_self(&greedy, &sampled)?
    } else {
        greedy_tok
    };
    let lp = logp
        .f_gather(1, &tokens.f_unsqueeze(1)?, false)?
        .f_squeeze_dim(1)?;
    let tokens = Vec::<i64>::try_from(tokens.f_to_device(tch::Device::Cpu)?)?;
    let lp = Vec::<f32>::try_from(lp.f_to_device(tch::Device::Cpu)?)?;
    Ok((tokens, lp))
}

/// Log-probs of each token given its prefix: `out[b, t]` is the log-prob of
/// `input_ids[b, t + 1]` after `input_ids[b, ..=t]`, under
/// `log_softmax(logits / logprob_temperature(temperature))`, the quantity
/// the sampler reports (see the module docs). Shape `[B, T - 1]`, float32,
/// with gradients unless called under `tch::no_grad`.
///
/// `attention_mask` (`[B, T]`, 1 = token) marks padding; this crate pads on
/// the right. Values at padding targets are meaningless: mask them.
pub fn token_logprobs(
    model: &Policy,
    input_ids: &Tensor,
    attention_mask: Option<&Tensor>,
    temperature: f64,
) -> Result<Tensor> {
    let (lp, _) = token_logprobs_impl(model, input_ids, attention_mask, temperature, false)?;
    Ok(lp)
}

/// [`token_logprobs`] and the entropy `[B, T - 1]` of each position's
/// (temperature-scaled) distribution.
pub fn token_logprobs_and_entropy(
    model: &Policy,
    input_ids: &Tensor,
    attention_mask: Option<&Tensor>,
    temperature: f64,
) -> Result<(Tensor, Tensor)> {
    let (lp, ent) = token_logprobs_impl(model, input_ids, attention_mask, temperature, true)?;
    let ent = ent.ok_or_else(|| PolicyError::InvalidRequest("entropy not computed".into()))?;
    Ok((lp, ent))
}

fn token_logprobs_impl(
    model: &Policy,
    input_ids: &Tensor,
    attention_mask: Option<&Tensor>,
    temperature: f64,
    entropy: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let size = input_ids.size();
    if size.len() != 2 || size[1] < 2 {
        return Err(PolicyError::InvalidRequest(format!(
            "token_logprobs needs input_ids of shape [batch, time >= 2], got {size:?}"
        )));
    }
    let t = size[1];
    let hidden = model.hidden_states(input_ids, attention_mask)?;
    let logits = model
        .logits_from_hidden(&hidden.f_narrow(1, 0, t - 1)?)?
        .f_div_scalar(logprob_temperature(temperature))?;
    let targets = input_ids
        .f_narrow(1, 1, t - 1)?
        .f_to_device(model.device())?
        .f_to_kind(Kind::Int64)?;
    let lse = logits.f_logsumexp([-1], true)?;
    let lp = logits
        .f_gather(2, &targets.f_unsqueeze(-1)?, false)?
        .f_sub(&lse)?
        .f_squeeze_dim(-1)?;
    let ent = if entropy {
        let logp = logits.f_sub(&lse)?;
        Some(
            logp.f_exp()?
                .f_mul(&logp)?
                .f_sum_dim_intlist(-1, false, Kind::Float)?
                .f_neg()?,
        )
    } else {
        None
    };
    Ok((lp, ent))
}

/// [`token_logprobs`] for a list of token sequences (no gradient): for each
/// sequence, the log-probs of its tokens 1.. (`len - 1` values). Sequences
/// are right-padded into one batch.
pub fn sequence_logprobs(
    model: &Policy,
    sequences: &[Vec<i64>],
    temperature: f64,
) -> Result<Vec<Vec<f32>>> {
    if sequences.is_empty() {
        return Ok(Vec::new());
    }
    if let Some(s) = sequences.iter().find(|s| s.len() < 2) {
        return Err(PolicyError::InvalidRequest(format!(
            "every sequence needs at least 2 tokens, got {}",
            s.len()
        )));
    }
    let b = sequences.len() as i64;
    let t = sequences.iter().map(Vec::len).max().unwrap_or(0) as i64;
    let mut ids = Vec::with_capacity((b * t) as usize);
    let mut mask = Vec::with_capacity((b * t) as usize);
    for s in sequences {
        ids.extend_from_slice(s);
        mask.extend(std::iter::repeat_n(1i64, s.len()));
        let pad = t as usize - s.len();
        ids.extend(std::iter::repeat_n(0i64, pad));
        mask.extend(std::iter::repeat_n(0i64, pad));
    }
    let ids = Tensor::from_slice(&ids).f_reshape([b, t])?;
    let mask = Tensor::from_slice(&mask).f_reshape([b, t])?;
    let lp = tch::no_grad(|| token_logprobs(model, &ids, Some(&mask), temperature))?
        .f_to_device(tch::Device::Cpu)?;
    let mut out = Vec::with_capacity(sequences.len());
    for (i, s) in sequences.iter().enumerate() {
        let row = lp.f_get(i as i64)?.f_narrow(0, 0, s.len() as i64 - 1)?;
        out.push(Vec::<f32>::try_from(row)?);
    }
    Ok(out)
}
