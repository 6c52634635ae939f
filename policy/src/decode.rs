//! Continuous batching with a slot-based KV cache.
//!
//! A [`DecodeBatch`] holds up to `max_slots` sequences. Between steps,
//! sequences can be added ([`DecodeBatch::add`]) and removed
//! ([`DecodeBatch::remove`]); each [`DecodeBatch::step`] samples one token
//! for every sequence in it and returns the sequences that finished, which
//! free their slots.
//!
//! The weights may change between two steps (a weight swap:
//! [`Policy::load_weights_from_bytes`]). The batch notices through
//! [`Policy::weights_generation`] and, in the next step, recomputes the KV
//! cache of every sequence in flight (prompt and the tokens sampled so far)
//! under the new weights before sampling its next token, which carries the
//! new version. Nothing in flight is discarded.
//!
//! Layout: each slot owns a row of the cache (`max_seq_len` positions); a
//! sequence's tokens sit at positions `0..len` of its row (right padding,
//! per-sequence positions), so sequences of any lengths share a step.
//!
//! Prompt sharing (on by default, [`DecodeBatch::share_prompts`]): the
//! completions of one group, or the samples of one evaluation problem, are
//! sequences with the same prompt. Before its forwards a step gives each
//! sequence that still has more than one token to compute the prompt
//! positions another slot holds already, by copying that slot's keys and
//! values (after a weight swap, or when the sequence is new); sequences
//! that start together with the same prompt have it computed once, in a
//! forward of its own, and copied to the others. The last prompt token is
//! always computed in the sequence's own row (its logits sample the first
//! completion token), so a new sequence that took its prompt by copy joins
//! the one-token decoding rows. The keys and values are those the sequence
//! would have computed itself (the same tokens at the same positions under
//! the same weights), up to floating-point rounding.

use std::collections::HashMap;

use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::error::{PolicyError, Result};
use crate::model::{CachePlan, KvCache, Policy};
use crate::sampling::{RowSampler, SamplingParams, sample_rows, sequence_rng};

/// Identifies a sequence of a [`DecodeBatch`].
pub type SeqId = u64;

/// Size of a [`DecodeBatch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecodeBatchOptions {
    /// Sequences decoded together.
    pub max_slots: usize,
    /// Most tokens (prompt + completion) of one sequence; a sequence that
    /// reaches it ends with [`FinishReason::MaxSeqLen`].
    pub max_seq_len: usize,
}

impl Default for DecodeBatchOptions {
    fn default() -> Self {
        Self {
            max_slots: 16,
            max_seq_len: 512,
        }
    }
}

/// A sequence to generate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SequenceRequest {
    /// Prompt token ids (not empty).
    pub prompt: Vec<i64>,
    pub params: SamplingParams,
}

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FinishReason {
    /// A stop token was sampled (it is the last completion token).
    Stop,
    /// `max_new_tokens` tokens were generated.
    MaxNewTokens,
    /// Prompt + completion reached the batch's `max_seq_len`.
    MaxSeqLen,
    /// Removed before it finished.
    Cancelled,
    /// The decoded completion reached a stop string (set by the rollout
    /// worker, which cuts the completion after the token that completed
    /// it).
    StopString,
}

/// A finished (or cancelled) sequence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SequenceOutput {
    pub id: SeqId,
    pub prompt: Vec<i64>,
    /// The sampled token ids, exactly as sampled.
    pub tokens: Vec<i64>,
    /// Log-prob of each sampled token (see [`crate::sampling`] for the
    /// distribution), under the weights that sampled it.
    pub logprobs: Vec<f32>,
    /// The policy version of the weights that sampled each token.
    pub versions: Vec<i32>,
    pub finish_reason: FinishReason,
    /// How often the KV cache of this sequence was recomputed after a
    /// weight swap.
    pub recomputations: u32,
}

/// One sampled token of a step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampledToken {
    pub id: SeqId,
    pub token: i64,
    pub logprob: f32,
    pub version: i32,
}

/// What a step produced.
#[derive(Debug, Default)]
pub struct StepOutput {
    /// One token for each sequence that was in the batch.
    pub sampled: Vec<SampledToken>,
    /// Sequences that ended in this step (their slots are free again).
    pub finished: Vec<SequenceOutput>,
    /// Sequences whose KV cache was recomputed in this step (after a weight
    /// swap).
    pub recomputed: usize,
    /// With [`DecodeBatch::keep_logits`]: the float32 logits `[vocab]` each
    /// sequence's token was sampled from (before temperature), for tests and
    /// debugging.
    pub logits: Vec<(SeqId, Tensor)>,
    /// Token positions run through the model in this step.
    pub positions_computed: usize,
    /// Prompt positions taken by copy from another slot's cache instead
    /// (prompt sharing).
    pub positions_shared: usize,
}

/// Fewest prompt positions a sequence takes by copy (fewer are computed).
const MIN_SHARED: usize = 2;

struct Slot {
    id: SeqId,
    prompt_len: usize,
    /// Prompt then completion.
    tokens: Vec<i64>,
    logprobs: Vec<f32>,
    versions: Vec<i32>,
    /// Positions 0..cached of the slot's cache row hold this sequence's keys
    /// and values under the current weights.
    cached: usize,
    params: SamplingParams,
    rng: StdRng,
    recomputations: u32,
}

impl Slot {
    fn into_output(self, finish_reason: FinishReason) -> SequenceOutput {
        let mut tokens = self.tokens;
        let completion = tokens.split_off(self.prompt_len);
        SequenceOutput {
            id: self.id,
            prompt: tokens,
            tokens: completion,
            logprobs: self.logprobs,
            versions: self.versions,
            finish_reason,
            recomputations: self.recomputations,
        }
    }
}

/// A batch of sequences decoded step by step with a slot-based KV cache.
/// See the module docs.
pub struct DecodeBatch {
    opts: DecodeBatchOptions,
    cache: KvCache,
    slots: Vec<Option<Slot>>,
    next_id: SeqId,
    /// `weights_generation` of the policy the cache was computed with.
    cache_generation: Option<u64>,
    /// Sequences that finished without a step (max_new_tokens = 0).
    done: Vec<SequenceOutput>,
    layers: i64,
    kv_heads: i64,
    head_dim: i64,
    keep_logits: bool,
    share_prompts: bool,
    vocab_size: i64,
}

impl std::fmt::Debug for DecodeBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeBatch")
            .field("opts", &self.opts)
            .field("active", &self.len())
            .finish()
    }
}

impl DecodeBatch {
    /// An empty batch for `policy` (its cache is allocated now:
    /// layers × 2 × max_slots × max_seq_len × kv_heads × head_dim values).
    pub fn new(policy: &Policy, opts: DecodeBatchOptions) -> Result<Self> {
        if opts.max_slots == 0 || opts.max_seq_len < 2 {
            return Err(PolicyError::InvalidRequest(format!(
                "a decode batch needs max_slots >= 1 and max_seq_len >= 2, got {opts:?}"
            )));
        }
        let cfg = policy.config();
        Ok(Self {
            cache: KvCache::new(policy, opts.max_slots as i64, opts.max_seq_len as i64)?,
            slots: (0..opts.max_slots).map(|_| None).collect(),
            next_id: 0,
            cache_generation: None,
            done: Vec::new(),
            layers: cfg.num_hidden_layers,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            keep_logits: false,
            share_prompts: true,
            vocab_size: cfg.vocab_size,
            opts,
        })
    }

    /// Whether [`StepOutput::logits`] is filled (off by default).
    pub fn keep_logits(&mut self, on: bool) {
        self.keep_logits = on;
    }

    /// Whether sequences with the same prompt share its keys and values
    /// (on by default; see the module docs).
    pub fn share_prompts(&mut self, on: bool) {
        self.share_prompts = on;
    }

    /// The batch's size.
    pub fn options(&self) -> DecodeBatchOptions {
        self.opts
    }

    /// Sequences in the batch.
    pub fn len(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    /// Whether no sequence is in the batch (nor a finished one waiting to be
    /// returned by the next step).
    pub fn is_empty(&self) -> bool {
        self.len() == 0 && self.done.is_empty()
    }

    /// Slots free for [`DecodeBatch::add`].
    pub fn free_slots(&self) -> usize {
        self.slots.iter().filter(|s| s.is_none()).count()
    }

    /// The ids of the sequences in the batch.
    pub fn ids(&self) -> Vec<SeqId> {
        self.slots.iter().flatten().map(|s| s.id).collect()
    }

    /// Adds a sequence; its prompt is processed in the next step, which also
    /// samples its first token. Fails when the request is invalid or no slot
    /// is free.
    pub fn add(&mut self, request: SequenceRequest) -> Result<SeqId> {
        request.params.validate()?;
        if request.prompt.is_empty() {
            return Err(PolicyError::InvalidRequest("the prompt is empty".into()));
        }
        if request.prompt.len() >= self.opts.max_seq_len {
            return Err(PolicyError::InvalidRequest(format!(
                "the prompt has {} tokens; this batch holds sequences of at most {} tokens",
                request.prompt.len(),
                self.opts.max_seq_len
            )));
        }
        if let Some(bad) = request
            .prompt
            .iter()
            .find(|&&t| t < 0 || t >= self.vocab_size)
        {
            return Err(PolicyError::InvalidRequest(format!(
                "prompt token {bad} is outside the vocabulary (0..{})",
                self.vocab_size
            )));
        }
        let id = self.next_id;
        let slot = Slot {
            id,
            prompt_len: request.prompt.len(),
            tokens: request.prompt,
            logprobs: Vec::new(),
            versions: Vec::new(),
            cached: 0,
            rng: sequence_rng(request.params.seed),
            params: request.params,
            recomputations: 0,
        };
        if slot.params.max_new_tokens == 0 {
            self.next_id += 1;
            self.done.push(slot.into_output(FinishReason::MaxNewTokens));
            return Ok(id);
        }
        // lowest free slot first, so that busy slots stay contiguous
        let free = self.slots.iter().position(Option::is_none).ok_or_else(|| {
            PolicyError::InvalidRequest("no free slot in the decode batch".into())
        })?;
        self.next_id += 1;
        self.slots[free] = Some(slot);
        Ok(id)
    }

    /// Removes a sequence before it finished; returns what it generated so
    /// far (finish reason [`FinishReason::Cancelled`]), or None for an
    /// unknown id.
    pub fn remove(&mut self, id: SeqId) -> Option<SequenceOutput> {
        if let Some(i) = self.done.iter().position(|o| o.id == id) {
            return Some(self.done.remove(i));
        }
        let slot = self
            .slots
            .iter_mut()
            .find(|s| s.as_ref().is_some_and(|s| s.id == id))?;
        slot.take().map(|s| s.into_output(FinishReason::Cancelled))
    }

    /// Makes the next step recompute the KV cache of every sequence in
    /// flight (done automatically when the policy's weights generation
    /// changes).
    pub fn invalidate_cache(&mut self) {
        for s in self.slots.iter_mut().flatten() {
            s.cached = 0;
        }
    }

    /// Samples one token for every sequence in the batch (processing new
    /// prompts, and recomputing caches after a weight swap, first).
    pub fn step(&mut self, policy: &Policy) -> Result<StepOutput> {
        let cfg = policy.config();
        if (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
            != (self.layers, self.kv_heads, self.head_dim)
        {
            return Err(PolicyError::InvalidRequest(
                "the policy's architecture differs from the one this decode batch was made for"
                    .into(),
            ));
        }
        let mut out = StepOutput {
            finished: std::mem::take(&mut self.done),
            ..StepOutput::default()
        };
        let generation = policy.weights_generation();
        if self.cache_generation != Some(generation) {
            for s in self.slots.iter_mut().flatten() {
                if s.cached > 0 {
                    s.cached = 0;
                    s.recomputations += 1;
                    out.recomputed += 1;
                }
            }
            self.cache_generation = Some(generation);
        }
        if self.share_prompts {
            tch::no_grad(|| self.take_shared_prompts(policy, &mut out))?;
        }
        // Decoding rows (one new token) and prefill rows (a prompt, or a
        // whole sequence to recompute) run as two forwards so that the many
        // one-token rows are not padded to the longest prompt.
        let (mut decode, mut prefill) = (Vec::new(), Vec::new());
        for (i, s) in self.slots.iter().enumerate() {
            if let Some(s) = s {
                if s.tokens.len() - s.cached == 1 {
                    decode.push(i);
                } else {
                    prefill.push(i);
                }
            }
        }
        let version = policy.version();
        for group in [decode, prefill] {
            if group.is_empty() {
                continue;
            }
            let rows = self.uncached_rows(&group)?;
            out.positions_computed += rows.iter().map(|r| r.2).sum::<usize>();
            let logits = tch::no_grad(|| self.forward_rows(policy, &rows))?;
            let mut rows: Vec<RowSampler<'_>> = Vec::with_capacity(group.len());
            // Borrow each slot's params and rng mutably, in group order.
            let mut by_index: Vec<Option<&mut Slot>> =
                self.slots.iter_mut().map(Option::as_mut).collect();
            for &i in &group {
                let s = by_index[i].take().ok_or_else(|| {
                    PolicyError::InvalidRequest("internal: slot listed twice".into())
                })?;
                rows.push(RowSampler {
                    params: &s.params,
                    rng: &mut s.rng,
                });
            }
            let (tokens, logprobs) = sample_rows(&logits, &mut rows)?;
            drop(rows);
            if self.keep_logits {
                for (r, &i) in group.iter().enumerate() {
                    if let Some(s) = &self.slots[i] {
                        out.logits.push((s.id, logits.f_get(r as i64)?));
                    }
                }
            }
            for ((&i, token), logprob) in group.iter().zip(tokens).zip(logprobs) {
                let max_seq_len = self.opts.max_seq_len;
                let Some(s) = self.slots[i].as_mut() else {
                    continue;
                };
                s.cached = s.tokens.len();
                s.tokens.push(token);
                s.logprobs.push(logprob);
                s.versions.push(version);
                out.sampled.push(SampledToken {
                    id: s.id,
                    token,
                    logprob,
                    version,
                });
                let reason = if s.params.stop_token_ids.contains(&token) {
                    Some(FinishReason::Stop)
                } else if s.logprobs.len() >= s.params.max_new_tokens {
                    Some(FinishReason::MaxNewTokens)
                } else if s.tokens.len() >= max_seq_len {
                    Some(FinishReason::MaxSeqLen)
                } else {
                    None
                };
                if let Some(reason) = reason
                    && let Some(s) = self.slots[i].take()
                {
                    out.finished.push(s.into_output(reason));
                }
            }
        }
        Ok(out)
    }

    /// `(slot, first, count)` of each slot of `group`: its uncached tokens.
    fn uncached_rows(&self, group: &[usize]) -> Result<Vec<(usize, usize, usize)>> {
        group
            .iter()
            .map(|&i| {
                let s = self.slots[i]
                    .as_ref()
                    .ok_or_else(|| PolicyError::InvalidRequest("internal: empty slot".into()))?;
                Ok((i, s.cached, s.tokens.len() - s.cached))
            })
            .collect()
    }

    /// The ids `[A, longest]` and cache plan of `rows` (`(slot, first,
    /// count)`: tokens `first..first + count` of the slot, right-padded).
    fn rows_input(
        &self,
        policy: &Policy,
        rows: &[(usize, usize, usize)],
    ) -> Result<(Tensor, CachePlan)> {
        let longest = rows.iter().map(|r| r.2).max().unwrap_or(1).max(1);
        let mut ids = Vec::with_capacity(rows.len() * longest);
        let mut plan = Vec::with_capacity(rows.len());
        for &(i, first, count) in rows {
            let s = self.slots[i]
                .as_ref()
                .ok_or_else(|| PolicyError::InvalidRequest("internal: empty slot".into()))?;
            ids.extend_from_slice(&s.tokens[first..first + count]);
            ids.extend(std::iter::repeat_n(0i64, longest - count));
            plan.push((i as i64, first as i64, count as i64));
        }
        let ids = Tensor::from_slice(&ids).f_reshape([rows.len() as i64, longest as i64])?;
        Ok((ids, CachePlan::new(&plan, policy.device())?))
    }

    /// Runs `rows` (see [`DecodeBatch::rows_input`]); logits `[A, V]` at
    /// each row's last token.
    fn forward_rows(&mut self, policy: &Policy, rows: &[(usize, usize, usize)]) -> Result<Tensor> {
        let (ids, plan) = self.rows_input(policy, rows)?;
        let logits = policy.forward_cached(&mut self.cache, &ids, &plan)?;
        Ok(logits.f_to_kind(Kind::Float)?)
    }

    /// Prompt sharing (see the module docs): every sequence with more than
    /// one token to compute takes the prompt positions another slot holds,
    /// by copy; sequences with the same prompt and none of it cached have
    /// it computed once, in the slot of the first of them, then copied.
    fn take_shared_prompts(&mut self, policy: &Policy, out: &mut StepOutput) -> Result<()> {
        // (slot, prompt positions it could take: not its last token).
        let wanting: Vec<(usize, usize)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let s = s.as_ref()?;
                let want = s.prompt_len.min(s.tokens.len() - 1);
                (s.tokens.len() - s.cached > 1 && want >= s.cached + MIN_SHARED)
                    .then_some((i, want))
            })
            .collect();
        if wanting.is_empty() {
            return Ok(());
        }
        // For each prompt, the slot holding most of it in its cache.
        let mut holders: HashMap<&[i64], (usize, usize)> = HashMap::new();
        for (i, s) in self.slots.iter().enumerate() {
            if let Some(s) = s
                && s.cached > 0
            {
                let best = holders
                    .entry(&s.tokens[..s.prompt_len])
                    .or_insert((i, s.cached));
                if s.cached > best.1 {
                    *best = (i, s.cached);
                }
            }
        }
        // (from, to, positions)
        let mut copies: Vec<(usize, usize, usize)> = Vec::new();
        let mut starting: HashMap<&[i64], Vec<(usize, usize)>> = HashMap::new();
        for &(i, want) in &wanting {
            let Some(s) = self.slots[i].as_ref() else {
                continue;
            };
            let prompt = &s.tokens[..s.prompt_len];
            match holders.get(prompt) {
                Some(&(from, held)) if held.min(want) >= s.cached + MIN_SHARED => {
                    copies.push((from, i, held.min(want)));
                }
                _ if s.cached == 0 => starting.entry(prompt).or_default().push((i, want)),
                _ => {}
            }
        }
        // Sequences starting together with one prompt: the first computes
        // the positions all of them can take; in slot order, so that a
        // step does not depend on hashing.
        let mut together: Vec<Vec<(usize, usize)>> =
            starting.into_values().filter(|g| g.len() > 1).collect();
        together.sort_by_key(|g| g[0].0);
        let mut fill = Vec::with_capacity(together.len());
        for g in &together {
            let positions = g.iter().map(|&(_, want)| want).min().unwrap_or(0);
            fill.push((g[0].0, 0, positions));
            copies.extend(g[1..].iter().map(|&(to, _)| (g[0].0, to, positions)));
        }
        if !fill.is_empty() {
            let (ids, plan) = self.rows_input(policy, &fill)?;
            policy.fill_cached(&mut self.cache, &ids, &plan)?;
            for &(i, _, positions) in &fill {
                if let Some(s) = self.slots[i].as_mut() {
                    s.cached = positions;
                }
                out.positions_computed += positions;
            }
        }
        if copies.is_empty() {
            return Ok(());
        }
        let longest = copies.iter().map(|c| c.2).max().unwrap_or(0);
        let from: Vec<i64> = copies.iter().map(|c| c.0 as i64).collect();
        let to: Vec<i64> = copies.iter().map(|c| c.1 as i64).collect();
        // Positions past a copy's own count land past what its slot holds
        // and are written before they are attended.
        self.cache.copy_slots(&from, &to, longest as i64)?;
        for &(_, to, positions) in &copies {
            if let Some(s) = self.slots[to].as_mut() {
                out.positions_shared += positions - s.cached;
                s.cached = positions;
            }
        }
        Ok(())
    }

    /// Runs `requests` to completion in this batch (up to `max_slots` at a
    /// time, a finished sequence's slot going to the next request), returning
    /// the outputs in request order. Sequences already in the batch continue
    /// and their outputs are dropped.
    pub fn generate(
        &mut self,
        policy: &Policy,
        requests: Vec<SequenceRequest>,
    ) -> Result<Vec<SequenceOutput>> {
        let n = requests.len();
        let mut pending = requests.into_iter().enumerate();
        let mut order: std::collections::HashMap<SeqId, usize> = Default::default();
        let mut results: Vec<Option<SequenceOutput>> = (0..n).map(|_| None).collect();
        let mut next = pending.next();
        loop {
            while self.free_slots() > 0 {
                let Some((i, req)) = next.take() else { break };
                let id = self.add(req)?;
                order.insert(id, i);
                next = pending.next();
            }
            if next.is_none() && results.iter().all(Option::is_some) {
                break;
            }
            let step = self.step(policy)?;
            for o in step.finished {
                if let Some(&i) = order.get(&o.id) {
                    results[i] = Some(o);
                }
            }
        }
        results
            .into_iter()
            .map(|r| {
                r.ok_or_else(|| PolicyError::InvalidRequest("internal: lost a sequence".into()))
            })
            .collect()
    }
}

/// Generates completions for `requests` with a fresh batch of `opts` (static
/// use of [`DecodeBatch`]).
pub fn generate(
    policy: &Policy,
    requests: Vec<SequenceRequest>,
    opts: DecodeBatchOptions,
) -> Result<Vec<SequenceOutput>> {
    let mut batch = DecodeBatch::new(policy, opts)?;
    batch.generate(policy, requests)
}
