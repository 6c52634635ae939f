//! One learner step, synchronous, on the thread that owns the model.
//!
//! `train_step` turns the buffer's record batches into padded tensors,
//! computes the proximal log-probs (recompute pass or A-3PO approx), splits
//! the batch into mini-batches and takes one AdamW step per mini-batch on
//! the decoupled PPO loss, then bumps the policy version: step `s` produces
//! version `s`.
//!
//! Packing (`lanes`, on by default): each forward pass packs its rows
//! into lanes as wide as its longest row (or a minimum width), several
//! rows to a lane, with
//! positions that restart and attention that stays inside each row
//! ([`TrainBatch::forward_inputs`]), so it computes about the real tokens
//! instead of rows × the longest row; log-probs, losses and gradients are
//! the padded computation's up to float rounding.
//!
//! Memory: with `max_tokens_per_microbatch` set, every forward pass (the
//! recompute pass, and each mini-batch's forward + backward) runs on
//! micro-batches of at most that many positions (lanes, or rows, × the
//! longest row of the micro-batch; see [`TrainBatch::microbatches`]), since the
//! logits of a whole batch at a real vocabulary are the memory peak. The
//! gradients of a mini-batch's micro-batches accumulate and the mini-batch
//! still takes one clip and one optimizer step. The objective's
//! mini-batch-level statistics (normalisers, adaptive's quantile, m2po's
//! mask, A-3PO's proximal log-probs) come from an [`ObjectivePlan`] over the
//! whole mini-batch, so the accumulated gradient is the un-split one up to
//! float rounding. A mini-batch that fits in one micro-batch takes exactly
//! the un-split path.
//!
//! Zero-advantage rows (`forward_only_zero_advantage`, on by default): a
//! row whose every valid token has advantage 0 (a group whose completions
//! all scored alike, under GRPO's baselines) contributes exactly nothing
//! to the gradient of the PPO-family surrogates, so without a KL loss
//! such rows take a forward pass without gradient (their log-probs still
//! feed the plan's batch statistics and the step's statistics) and only
//! the rows with signal take forward + backward. The step's loss,
//! statistics and gradient are those of training every row, up to float
//! rounding.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use arrow::array::RecordBatch;
use asyncrl_policy::{Policy, WeightDtype};
use asyncrl_tasks::SplitMix64;
use tch::{Kind, Tensor};

use crate::adamw::{AdamW, AdamWConfig};
use crate::advantages::AdvantageNorm;
use crate::batch::{Lanes, TrainBatch, assemble};
use crate::checkpoint::{self, CheckpointMeta, LoadedCheckpoint};
use crate::objective::{
    LogprobGap, ObjectiveConfig, ObjectivePlan, ObjectiveStats, ObjectiveSums, PlanInputs,
    ProximalMode, TokenInputs, decoupled_ppo_loss, logprob_gap,
};

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Batch(#[from] crate::batch::BatchError),
    #[error(transparent)]
    Objective(#[from] crate::objective::ObjectiveError),
    #[error(transparent)]
    Policy(#[from] asyncrl_policy::PolicyError),
    #[error(transparent)]
    Checkpoint(#[from] crate::checkpoint::CheckpointError),
    #[error(transparent)]
    Optimizer(#[from] crate::adamw::AdamWError),
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    #[error("the loss is not finite ({0}); the step was not applied")]
    NonFiniteLoss(f64),
    /// The gradient norm of a mini-batch is not finite: its update was not
    /// applied (nor any after it).
    #[error(
        "the gradient is not finite (norm {norm}) in mini-batch {minibatch}; it was not applied"
    )]
    NonFiniteGradient { norm: f64, minibatch: usize },
    /// The `torch` engine process group failed or refused a call.
    #[error(transparent)]
    Engine(#[from] crate::torch_engine::EngineError),
    /// A held-out or demonstrated episode failed (its environment, its
    /// template); `episode` names it.
    #[error("episode of task {task_id:?}: {source}")]
    Episode {
        task_id: String,
        #[source]
        source: asyncrl_environment::EpisodeFailure,
    },
}

/// Static settings of the trainer (from `[learner]` and `[model]`).
#[derive(Debug, Clone)]
pub struct TrainerOptions {
    /// The sampling temperature: log-probs are `log_softmax(logits / τ)`.
    pub temperature: f64,
    pub minibatches: usize,
    pub grad_clip: f64,
    pub warmup_steps: u64,
    pub adamw: AdamWConfig,
    pub advantage_norm: AdvantageNorm,
    pub proximal: ProximalMode,
    pub seed: u64,
    pub weight_dtype: WeightDtype,
    /// Positions (lanes, or rows, × longest row) of one forward pass at
    /// most: mini-batches and the recompute pass are split into
    /// micro-batches of this size, with gradient accumulation (0: no
    /// split). A row longer than this is a micro-batch of its own.
    pub max_tokens_per_microbatch: usize,
    /// How a forward pass lays out its rows: packed several to a lane
    /// (the default, lanes as wide as the longest row), or padded.
    pub lanes: Lanes,
    /// Rows whose every valid token has advantage 0 take a forward pass
    /// without gradient (no backward) when the objective has no KL loss:
    /// their gradient is exactly zero (module docs).
    pub forward_only_zero_advantage: bool,
}

impl Default for TrainerOptions {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            minibatches: 1,
            grad_clip: 1.0,
            warmup_steps: 0,
            adamw: AdamWConfig::default(),
            advantage_norm: AdvantageNorm::MeanStd,
            proximal: ProximalMode::Approx,
            seed: 0,
            weight_dtype: WeightDtype::F32,
            max_tokens_per_microbatch: 0,
            lanes: Lanes::Shared {
                min_width: 0,
                max_width: i64::MAX,
            },
            forward_only_zero_advantage: true,
        }
    }
}

/// What one training step runs with: the objective and the learning rate,
/// from the knobs the learner sealed for it ([`asyncrl_control::StepKnobs`]).
#[derive(Debug, Clone, PartialEq)]
pub struct StepSettings {
    pub objective: ObjectiveConfig,
    pub learning_rate: f64,
}

/// What one step did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepStats {
    pub step: u64,
    /// Version of the weights after the step.
    pub version: i32,
    pub loss: f64,
    /// Objective statistics, token-weighted over the mini-batches.
    pub objective: ObjectiveStats,
    pub entropy: f64,
    pub grad_norm: f64,
    pub learning_rate: f64,
    pub groups: usize,
    pub trajectories: usize,
    pub tokens: i64,
    /// Positions of the batch laid out for one forward pass: rows, or
    /// packed lanes, × the longest row. What the forward and backward
    /// passes compute (the step's cost follows it; padded, long-tailed
    /// batches pad every row to their longest sequence).
    pub padded_tokens: i64,
    /// Forward passes of the step: one per mini-batch, more when
    /// `max_tokens_per_microbatch` splits mini-batches into micro-batches
    /// or zero-advantage rows take their own pass without gradient.
    pub microbatches: usize,
    /// Rows that took a forward pass without gradient (every advantage
    /// 0; `forward_only_zero_advantage`).
    pub forward_only_rows: usize,
    /// Mean reward of the scored trajectories.
    pub reward_mean: f64,
    pub reward_failed: usize,
    /// Forward + backward + optimizer time.
    pub compute_seconds: f64,
    /// Per-token version lags of the trained tokens (for the histogram).
    pub version_lags: Vec<u32>,
    /// Behaviour log-probs against the learner's own at the version the
    /// step starts from (the engine/trainer mismatch).
    pub logprob_gap: LogprobGap,
}

/// The policy, its optimizer and the step counter, owned by one thread.
pub struct Trainer {
    policy: Policy,
    /// The frozen reference policy of the KL loss ([`Trainer::hold_reference`]).
    reference: Option<Policy>,
    opt: AdamW,
    opts: TrainerOptions,
    step: u64,
    rng: SplitMix64,
}

impl Trainer {
    pub fn new(policy: Policy, opts: TrainerOptions) -> Self {
        let rng = SplitMix64::new(opts.seed ^ 0x5EED_1EA2_0000_0001);
        Self {
            opt: AdamW::new(opts.adamw.clone()),
            rng,
            policy,
            reference: None,
            opts,
            step: 0,
        }
    }

    /// Keeps a frozen copy of the weights as they are now as the reference
    /// policy of the KL loss (`kl_coef > 0`). Call it with the weights the
    /// run started from, before restoring a checkpoint or adopting
    /// published weights: a restarted learner then holds the same
    /// reference as the first one.
    pub fn hold_reference(&mut self) -> Result<(), TrainError> {
        self.reference = Some(self.policy.frozen_copy()?);
        Ok(())
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    pub fn policy_mut(&mut self) -> &mut Policy {
        &mut self.policy
    }

    pub fn options(&self) -> &TrainerOptions {
        &self.opts
    }

    /// Changes the micro-batch token budget (0 = no split) for the next
    /// steps (the memory bench measures several on one trainer).
    pub fn set_max_tokens_per_microbatch(&mut self, tokens: usize) {
        self.opts.max_tokens_per_microbatch = tokens;
    }

    /// Learner steps completed.
    pub fn step(&self) -> u64 {
        self.step
    }

    pub fn version(&self) -> i32 {
        self.policy.version()
    }

    /// The learning rate of step `step` (1-based) under linear warmup.
    pub fn scheduled_lr(&self, base: f64, step: u64) -> f64 {
        scheduled_lr(&self.opts, base, step)
    }

    /// Trains one step on `batches` (complete groups) and bumps the version.
    pub fn train_step(
        &mut self,
        batches: &[RecordBatch],
        knobs: &StepSettings,
    ) -> Result<StepStats, TrainError> {
        let start = Instant::now();
        // Nothing is sized from the batch, and the model never sees it,
        // before it is checked against the model and the version.
        crate::batch::check(batches, &self.batch_limits())?;
        let host = assemble(batches, self.pad_id(), self.opts.advantage_norm)?;
        let device = self.policy.device();
        let batch = host.to_device(device);
        let version_before = self.policy.version();
        let params = self.policy.named_parameters();
        let budget = self.opts.max_tokens_per_microbatch;

        // The recompute pass runs under the budget too: at a real vocabulary
        // the logits of the whole batch would be the step's memory peak.
        let proximal = match self.opts.proximal {
            ProximalMode::Recompute => Some(self.detached_logprobs(&batch, budget)?),
            // Naive PPO: the behaviour policy is the trust region's centre.
            ProximalMode::Behaviour => Some(batch.behaviour.detach()),
            ProximalMode::Approx => None,
        };
        let recomputed = self.opts.proximal == ProximalMode::Recompute;
        // The reference policy's log-probs, one no-grad pass over the batch
        // (under the budget), for the KL loss.
        let reference = if knobs.objective.kl_coef > 0.0 {
            let r = self
                .reference
                .as_ref()
                .ok_or(crate::objective::ObjectiveError::ReferenceNeeded)?;
            Some(detached_logprobs(
                r,
                &batch,
                budget,
                self.lanes(),
                self.opts.temperature,
            )?)
        } else {
            None
        };

        let n = batch.input_ids.size()[0];
        let order = shuffled_order(&mut self.rng, n);
        let k = self.opts.minibatches.clamp(1, n.max(1) as usize);
        let lr = self.scheduled_lr(knobs.learning_rate, self.step + 1);
        let mut stats = StepStats {
            learning_rate: lr,
            ..Default::default()
        };
        let mut weighted = ObjectiveStats::default();
        let mut total_tokens = 0f64;
        let mut entropy_sum = 0f64;
        let mut loss_sum = 0f64;
        // The engine/trainer mismatch: the recompute pass covers the whole
        // batch; without it, the first mini-batch's forward (still at the
        // step's starting weights) covers its rows.
        if let Some(p) = proximal.as_ref().filter(|_| recomputed) {
            stats.logprob_gap = logprob_gap(
                &batch.behaviour,
                p,
                &batch.versions,
                &batch.mask,
                i64::from(version_before),
            );
        }
        for (i, chunk) in order.chunks(order.len().div_ceil(k).max(1)).enumerate() {
            let mb = batch.rows(chunk);
            let rows = Tensor::from_slice(chunk).to_device(device);
            let mb_prox = proximal.as_ref().map(|p| p.index_select(0, &rows));
            let mb_ref = reference.as_ref().map(|r| r.index_select(0, &rows));
            let mb_given = Given {
                proximal: mb_prox.as_ref(),
                reference: mb_ref.as_ref(),
            };
            AdamW::zero_grad(&params);
            let micro = mb.microbatches(budget, self.lanes());
            let gap_wanted = i == 0 && !recomputed;
            let split = self.zero_advantage_split(&mb, knobs);
            if let Some(s) = &split {
                stats.forward_only_rows += s.idle.len();
            }
            let (loss, objective, entropy, gap) = match split {
                None if micro.len() <= 1 => {
                    stats.microbatches += 1;
                    self.whole_minibatch(&mb, &mb_given, version_before, knobs, gap_wanted)?
                }
                Some(s) if micro.len() <= 1 => {
                    stats.microbatches += 2;
                    self.split_minibatch(&mb, &mb_given, &s, version_before, knobs, gap_wanted)?
                }
                split => {
                    let parts = match split {
                        None => micro.into_iter().map(|rows| (rows, true)).collect(),
                        Some(s) => s.microbatches(&mb, budget, self.lanes()),
                    };
                    stats.microbatches += parts.len();
                    self.accumulate_microbatches(
                        &mb,
                        &mb_given,
                        &parts,
                        version_before,
                        knobs,
                        gap_wanted,
                    )?
                }
            };
            if let Some(gap) = gap {
                stats.logprob_gap = gap;
            }
            let norm = AdamW::clip_grad_norm(&params, self.opts.grad_clip);
            if !norm.is_finite() {
                AdamW::zero_grad(&params);
                return Err(TrainError::NonFiniteGradient { norm, minibatch: i });
            }
            stats.grad_norm = stats.grad_norm.max(norm);
            self.opt.step(&params, lr);
            let w = mb.tokens as f64;
            total_tokens += w;
            loss_sum += loss * w;
            entropy_sum += entropy * w;
            let s = &objective;
            weighted.clip_low_fraction += s.clip_low_fraction * w;
            weighted.clip_high_fraction += s.clip_high_fraction * w;
            weighted.weight_masked_fraction += s.weight_masked_fraction * w;
            weighted.m2po_masked_fraction += s.m2po_masked_fraction * w;
            weighted.dual_clip_fraction += s.dual_clip_fraction * w;
            weighted.approx_kl += s.approx_kl * w;
            weighted.mean_importance_weight += s.mean_importance_weight * w;
            weighted.mean_version_lag += s.mean_version_lag * w;
            weighted.max_version_lag = weighted.max_version_lag.max(s.max_version_lag);
            weighted.kl_ref += s.kl_ref * w;
        }
        let norm = |x: f64| {
            if total_tokens > 0.0 {
                x / total_tokens
            } else {
                0.0
            }
        };
        stats.objective = ObjectiveStats {
            tokens: total_tokens as i64,
            clip_low_fraction: norm(weighted.clip_low_fraction),
            clip_high_fraction: norm(weighted.clip_high_fraction),
            weight_masked_fraction: norm(weighted.weight_masked_fraction),
            m2po_masked_fraction: norm(weighted.m2po_masked_fraction),
            dual_clip_fraction: norm(weighted.dual_clip_fraction),
            approx_kl: norm(weighted.approx_kl),
            mean_importance_weight: norm(weighted.mean_importance_weight),
            mean_version_lag: norm(weighted.mean_version_lag),
            max_version_lag: weighted.max_version_lag,
            kl_ref: norm(weighted.kl_ref),
        };
        stats.loss = norm(loss_sum);
        stats.entropy = norm(entropy_sum);

        self.step += 1;
        let version = version_before + 1;
        self.policy.set_version(version);
        self.policy.mark_weights_changed();
        stats.step = self.step;
        stats.version = version;
        record_batch_facts(&mut stats, &host, version_before, self.lanes());
        stats.compute_seconds = start.elapsed().as_secs_f64();
        Ok(stats)
    }

    /// The layout of the step's forward passes, under its micro-batch
    /// budget.
    fn lanes(&self) -> Lanes {
        self.opts.lanes.within(self.opts.max_tokens_per_microbatch)
    }

    /// What a batch may hold for this model at this version.
    pub fn batch_limits(&self) -> crate::batch::BatchLimits {
        let c = self.policy.config();
        crate::batch::BatchLimits {
            vocab_size: c.vocab_size,
            max_seq_len: usize::try_from(c.max_position_embeddings).unwrap_or(0),
            max_version: self.policy.version(),
        }
    }

    fn pad_id(&self) -> i64 {
        self.policy.config().pad_token_id.unwrap_or(0)
    }

    /// The completion log-probs of every row of `batch` under the current
    /// weights, without gradient (see [`detached_logprobs`]).
    fn detached_logprobs(&self, batch: &TrainBatch, budget: usize) -> Result<Tensor, TrainError> {
        detached_logprobs(
            &self.policy,
            batch,
            budget,
            self.lanes(),
            self.opts.temperature,
        )
    }

    /// Forward + backward of mini-batch `mb` in one pass (the un-split
    /// path): its loss, objective statistics, entropy and, when
    /// `gap_wanted`, the logprob gap of its rows.
    fn whole_minibatch(
        &self,
        mb: &TrainBatch,
        given: &Given<'_>,
        version_before: i32,
        knobs: &StepSettings,
        gap_wanted: bool,
    ) -> Result<MinibatchOutcome, TrainError> {
        let temperature = self.opts.temperature;
        let fwd = mb.forward_inputs(self.lanes());
        let logits = fwd.logits(&self.policy)?;
        let current = fwd.completion_logprobs(&logits, temperature);
        let gap = gap_wanted.then(|| {
            logprob_gap(
                &mb.behaviour,
                &current,
                &mb.versions,
                &mb.mask,
                i64::from(version_before),
            )
        });
        let inputs = TokenInputs {
            behaviour: &mb.behaviour,
            current: &current,
            proximal: given.proximal,
            advantages: &mb.advantages,
            versions: &mb.versions,
            mask: &mb.mask,
            reference: given.reference,
        };
        let out = decoupled_ppo_loss(&inputs, i64::from(version_before), &knobs.objective)?;
        let loss = out.loss.double_value(&[]);
        if !loss.is_finite() {
            return Err(TrainError::NonFiniteLoss(loss));
        }
        out.loss.backward();
        let entropy = masked_entropy(&fwd, &logits, mb, temperature);
        Ok((loss, out.stats, entropy, gap))
    }

    /// The rows of `mb` with signal and those without (every valid token's
    /// advantage 0), when the latter may skip the backward pass: the
    /// option is on, the objective has no KL loss (whose gradient does not
    /// vanish with the advantage), and both sets are non-empty (a
    /// mini-batch without signal trains as it is, so that the optimizer
    /// sees the zero gradients it always saw).
    fn zero_advantage_split(&self, mb: &TrainBatch, knobs: &StepSettings) -> Option<SignalSplit> {
        if !self.opts.forward_only_zero_advantage || knobs.objective.kl_coef > 0.0 {
            return None;
        }
        let _g = tch::no_grad_guard();
        let has_signal = mb
            .advantages
            .ne(0.0)
            .logical_and(&mb.mask.to_kind(Kind::Bool))
            .any_dim(1, false)
            .to_device(tch::Device::Cpu);
        let flags = Vec::<bool>::try_from(&has_signal).ok()?;
        let (signal, idle): (Vec<i64>, Vec<i64>) =
            (0..flags.len() as i64).partition(|r| flags[*r as usize]);
        (!signal.is_empty() && !idle.is_empty()).then_some(SignalSplit { signal, idle })
    }

    /// [`Trainer::whole_minibatch`] of a mini-batch whose rows split into
    /// `split`: one forward + backward pass over the rows with signal,
    /// one forward pass without gradient over the rest, the plan over
    /// both. The same loss, statistics and gradient up to float rounding.
    fn split_minibatch(
        &self,
        mb: &TrainBatch,
        given: &Given<'_>,
        split: &SignalSplit,
        version_before: i32,
        knobs: &StepSettings,
        gap_wanted: bool,
    ) -> Result<MinibatchOutcome, TrainError> {
        let temperature = self.opts.temperature;
        let version = i64::from(version_before);
        let device = mb.mask.device();
        let mut entropy_sum = 0.0;
        let mut parts = Vec::with_capacity(2);
        for (rows, grad) in [(&split.signal, true), (&split.idle, false)] {
            let _g = (!grad).then(tch::no_grad_guard);
            let part = mb.rows(rows);
            let fwd = part.forward_inputs(self.lanes());
            let logits = fwd.logits(&self.policy)?;
            let current = fwd.completion_logprobs(&logits, temperature);
            entropy_sum += masked_entropy(&fwd, &logits, &part, temperature) * part.tokens as f64;
            parts.push((Tensor::from_slice(rows).to_device(device), current, grad));
        }
        // Every row's current log-probs, detached: what the plan (A-3PO's
        // proximal log-probs, adaptive's quantile, m2po's mask) and the
        // logprob gap read.
        let mut current_all = Tensor::zeros(mb.mask.size(), (parts[0].1.kind(), device));
        {
            let _g = tch::no_grad_guard();
            for (idx, current, _) in &parts {
                let _ = current_all.f_index_copy_(0, idx, &current.detach())?;
            }
        }
        let plan = minibatch_plan(mb, given, Some(&current_all), version, knobs)?;
        let mut loss = 0.0;
        let mut sums = ObjectiveSums::default();
        for (idx, current, grad) in &parts {
            let _g = (!grad).then(tch::no_grad_guard);
            loss += part_loss(&plan, idx, current, *grad, &mut sums)?;
        }
        let gap = gap_wanted
            .then(|| logprob_gap(&mb.behaviour, &current_all, &mb.versions, &mb.mask, version));
        let entropy = per_token(entropy_sum, mb.tokens);
        Ok((loss, plan.stats(&sums), entropy, gap))
    }

    /// Forward + backward of mini-batch `mb` micro-batch by micro-batch
    /// (`micro`: row indices into `mb`, and whether the micro-batch takes
    /// a backward pass: zero-advantage rows take a forward pass only),
    /// gradients accumulating in the parameters. The objective is planned
    /// over the whole mini-batch first; in approx mode a clip mode with batch statistics of `p` (adaptive,
    /// m2po) first takes a no-grad pass over the micro-batches for A-3PO's
    /// proximal log-probs. Returns what [`Trainer::whole_minibatch`] does,
    /// with the same values up to float rounding.
    fn accumulate_microbatches(
        &self,
        mb: &TrainBatch,
        given: &Given<'_>,
        micro: &[(Vec<i64>, bool)],
        version_before: i32,
        knobs: &StepSettings,
        gap_wanted: bool,
    ) -> Result<MinibatchOutcome, TrainError> {
        let temperature = self.opts.temperature;
        let budget = self.opts.max_tokens_per_microbatch;
        let version = i64::from(version_before);
        let device = mb.mask.device();
        let mb_prox = given.proximal;
        let pre_pass = if mb_prox.is_none() && ObjectivePlan::needs_proximal(&knobs.objective) {
            Some(self.detached_logprobs(mb, budget)?)
        } else {
            None
        };
        let plan = minibatch_plan(mb, given, pre_pass.as_ref(), version, knobs)?;
        // The current log-probs of every row, for the logprob gap (the
        // pre-pass has them already).
        let mut gap_current = match (&pre_pass, gap_wanted) {
            (None, true) => Some(Tensor::zeros(mb.mask.size(), (Kind::Float, device))),
            _ => None,
        };
        let mut loss = 0.0;
        let mut sums = ObjectiveSums::default();
        let mut entropy_sum = 0.0;
        for (rows, grad) in micro {
            let _g = (!grad).then(tch::no_grad_guard);
            let part = mb.rows(rows);
            let idx = Tensor::from_slice(rows).to_device(device);
            let fwd = part.forward_inputs(self.lanes());
            let logits = fwd.logits(&self.policy)?;
            let current = fwd.completion_logprobs(&logits, temperature);
            if let Some(all) = gap_current.as_mut() {
                let _g = tch::no_grad_guard();
                let _ = all.f_index_copy_(0, &idx, &current.detach().to_kind(Kind::Float))?;
            }
            loss += part_loss(&plan, &idx, &current, *grad, &mut sums)?;
            entropy_sum += masked_entropy(&fwd, &logits, &part, temperature) * part.tokens as f64;
        }
        let gap = gap_wanted.then(|| {
            let current = gap_current.as_ref().or(pre_pass.as_ref());
            current.map_or_else(LogprobGap::default, |c| {
                logprob_gap(&mb.behaviour, c, &mb.versions, &mb.mask, version)
            })
        });
        let entropy = per_token(entropy_sum, mb.tokens);
        Ok((loss, plan.stats(&sums), entropy, gap))
    }

    /// The current weights as safetensors bytes (for the object store).
    pub fn weights_bytes(&self) -> Result<Vec<u8>, TrainError> {
        Ok(self.policy.weights_to_safetensors(self.opts.weight_dtype)?)
    }

    /// The current weights as a Hugging Face folder at `dest` (config,
    /// tokenizer, one `model.safetensors` in the publication dtype, and
    /// `sha256.json`), written under a temporary name, fsynced and renamed.
    pub fn export_folder(&self, dest: &Path) -> Result<(), TrainError> {
        let io = |path: &Path| {
            let path = path.to_owned();
            move |source| checkpoint::CheckpointError::Io { path, source }
        };
        let name = dest
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let tmp = dest.with_file_name(format!(".{name}.tmp"));
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
        }
        self.policy.save_pretrained(&tmp, None)?;
        let weights = self.weights_bytes()?;
        let file = tmp.join("model.safetensors");
        checkpoint::write_synced(&file, &weights)?;
        let sums = serde_json::json!({ "model.safetensors": asyncrl_common::sha256_hex(&weights) });
        checkpoint::write_synced(&tmp.join("sha256.json"), sums.to_string().as_bytes())?;
        checkpoint::sync_dir(&tmp)?;
        if dest.exists() {
            std::fs::remove_dir_all(dest).map_err(io(dest))?;
        }
        std::fs::rename(&tmp, dest).map_err(io(dest))?;
        if let Some(parent) = dest.parent() {
            checkpoint::sync_dir(parent)?;
        }
        Ok(())
    }

    /// Writes a checkpoint of the current state under `root`.
    pub fn write_checkpoint(&self, root: &Path) -> Result<PathBuf, TrainError> {
        let model = self.policy.weights_to_safetensors(WeightDtype::F32)?;
        let state = self.opt.state_tensors();
        let optimizer = if state.is_empty() {
            Vec::new()
        } else {
            let tmp = tempfile_in(root)?;
            let bytes = Tensor::write_safetensors(&state, &tmp)
                .map_err(|e| std::io::Error::other(e.to_string()))
                .and_then(|()| std::fs::read(&tmp));
            let _ = std::fs::remove_file(&tmp);
            bytes.map_err(|e| checkpoint::CheckpointError::Io {
                path: tmp.clone(),
                source: e,
            })?
        };
        let mut meta = CheckpointMeta {
            format: 1,
            step: self.step,
            version: self.policy.version(),
            optimizer_step: self.opt.step,
            rng_state: self.rng.state(),
            created_at_unix_ms: asyncrl_common::unix_ms(),
            model_sha256: String::new(),
            optimizer_sha256: String::new(),
        };
        Ok(checkpoint::write(root, &mut meta, &model, &optimizer)?)
    }

    /// Restores weights, optimizer state, step, version and RNG from a checkpoint.
    pub fn restore(&mut self, ckpt: &LoadedCheckpoint) -> Result<(), TrainError> {
        self.policy
            .load_weights_from_bytes(&ckpt.model, ckpt.meta.version)?;
        let state: BTreeMap<String, Tensor> = if ckpt.optimizer.is_empty() {
            BTreeMap::new()
        } else {
            let tmp = tempfile_in(&ckpt.dir)?;
            std::fs::write(&tmp, &ckpt.optimizer).map_err(|e| checkpoint::CheckpointError::Io {
                path: tmp.clone(),
                source: e,
            })?;
            let tensors = Tensor::read_safetensors(&tmp);
            let _ = std::fs::remove_file(&tmp);
            tensors?.into_iter().collect()
        };
        self.opt.load_state(
            ckpt.meta.optimizer_step,
            state,
            &self.policy.named_parameters(),
        )?;
        self.step = ckpt.meta.step;
        self.rng = SplitMix64::new(ckpt.meta.rng_state);
        Ok(())
    }

    /// Adopts published weights of `version` (newer than the checkpoint the
    /// learner restored: the steps in between were trained and published
    /// before a crash, so their weights are taken from the object store and
    /// the step counter continues from `version`; the optimizer moments stay
    /// those of the checkpoint).
    pub fn adopt_published(&mut self, bytes: &[u8], version: i32) -> Result<(), TrainError> {
        self.policy.load_weights_from_bytes(bytes, version)?;
        self.step = u64::try_from(version).unwrap_or(0);
        Ok(())
    }
}

/// The learning rate of step `step` (1-based) under linear warmup.
pub(crate) fn scheduled_lr(opts: &TrainerOptions, base: f64, step: u64) -> f64 {
    if opts.warmup_steps == 0 {
        base
    } else {
        base * (step as f64 / opts.warmup_steps as f64).min(1.0)
    }
}

/// The learner's seeded shuffle of `n` rows (Fisher-Yates with our own
/// PRNG, so a checkpointed state replays exactly); every engine trains its
/// mini-batches in this order.
pub(crate) fn shuffled_order(rng: &mut SplitMix64, n: i64) -> Vec<i64> {
    let mut order: Vec<i64> = (0..n).collect();
    for i in (1..order.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    order
}

/// What a step's statistics say about its batch whatever engine trained it:
/// groups, rows, tokens, padded positions, rewards and version lags.
pub(crate) fn record_batch_facts(
    stats: &mut StepStats,
    host: &TrainBatch,
    version_before: i32,
    lanes: Lanes,
) {
    stats.groups = host.groups;
    stats.trajectories = host.rewards.len();
    stats.tokens = host.tokens;
    stats.padded_tokens = host.positions(lanes);
    let scored: Vec<f64> = host
        .rewards
        .iter()
        .flatten()
        .map(|r| f64::from(*r))
        .collect();
    stats.reward_failed = host.rewards.len() - scored.len();
    stats.reward_mean = if scored.is_empty() {
        0.0
    } else {
        scored.iter().sum::<f64>() / scored.len() as f64
    };
    let lags =
        (-host.versions.to_kind(Kind::Int64) + i64::from(version_before)).masked_select(&host.mask);
    stats.version_lags = Vec::<i64>::try_from(lags)
        .unwrap_or_default()
        .into_iter()
        .map(|l| l.max(0) as u32)
        .collect();
}

/// What a mini-batch's forward + backward reports: its loss, objective
/// statistics, mean entropy, and the logprob gap when asked for.
type MinibatchOutcome = (f64, ObjectiveStats, f64, Option<LogprobGap>);

/// The objective's plan of mini-batch `mb` from what it is given and the
/// current log-probs of its rows, when known.
fn minibatch_plan(
    mb: &TrainBatch,
    given: &Given<'_>,
    current: Option<&Tensor>,
    version: i64,
    knobs: &StepSettings,
) -> Result<ObjectivePlan, TrainError> {
    Ok(ObjectivePlan::new(
        &PlanInputs {
            behaviour: &mb.behaviour,
            proximal: given.proximal,
            current,
            advantages: &mb.advantages,
            versions: &mb.versions,
            mask: &mb.mask,
            reference: given.reference,
        },
        version,
        &knobs.objective,
    )?)
}

/// The loss of rows `idx` of `plan` from their current log-probs, its
/// statistics added to `sums`, and its backward pass when `grad`.
fn part_loss(
    plan: &ObjectivePlan,
    idx: &Tensor,
    current: &Tensor,
    grad: bool,
    sums: &mut ObjectiveSums,
) -> Result<f64, TrainError> {
    let out = plan.loss(Some(idx), current)?;
    let value = out.loss.double_value(&[]);
    if !value.is_finite() {
        return Err(TrainError::NonFiniteLoss(value));
    }
    if grad {
        out.loss.backward();
    }
    sums.add(&out.sums);
    Ok(value)
}

/// `sum` over `tokens` (0 without tokens).
fn per_token(sum: f64, tokens: i64) -> f64 {
    if tokens > 0 { sum / tokens as f64 } else { 0.0 }
}

/// A mini-batch's rows (indices into it) with signal (some valid token
/// with a non-zero advantage) and without.
struct SignalSplit {
    signal: Vec<i64>,
    idle: Vec<i64>,
}

impl SignalSplit {
    /// Micro-batches of at most `budget` positions: the rows with signal
    /// (with a backward pass) and the rows without (forward only), each
    /// split as [`TrainBatch::microbatches`] splits rows.
    fn microbatches(&self, mb: &TrainBatch, budget: usize, lanes: Lanes) -> Vec<(Vec<i64>, bool)> {
        [(&self.signal, true), (&self.idle, false)]
            .into_iter()
            .flat_map(|(rows, grad)| {
                mb.rows(rows)
                    .microbatches(budget, lanes)
                    .into_iter()
                    .map(move |m| (m.iter().map(|k| rows[*k as usize]).collect(), grad))
            })
            .collect()
    }
}

/// What a mini-batch's objective is given besides its rows: the proximal
/// log-probs (recompute, behaviour) and the reference's (the KL loss).
struct Given<'a> {
    proximal: Option<&'a Tensor>,
    reference: Option<&'a Tensor>,
}

/// The completion log-probs of every row of `batch` under `policy`'s
/// weights, without gradient, `[N, T]`: one forward pass over the batch,
/// or one per micro-batch of at most `budget` positions.
fn detached_logprobs(
    policy: &Policy,
    batch: &TrainBatch,
    budget: usize,
    lanes: Lanes,
    temperature: f64,
) -> Result<Tensor, TrainError> {
    let _g = tch::no_grad_guard();
    let micro = batch.microbatches(budget, lanes);
    if micro.len() <= 1 {
        let fwd = batch.forward_inputs(lanes);
        let logits = fwd.logits(policy)?;
        return Ok(fwd.completion_logprobs(&logits, temperature).detach());
    }
    let mut out = Tensor::zeros(batch.mask.size(), (Kind::Float, batch.mask.device()));
    for rows in &micro {
        let fwd = batch.rows(rows).forward_inputs(lanes);
        let logits = fwd.logits(policy)?;
        let lp = fwd.completion_logprobs(&logits, temperature);
        let idx = Tensor::from_slice(rows).to_device(out.device());
        let _ = out.f_index_copy_(0, &idx, &lp.to_kind(Kind::Float))?;
    }
    Ok(out)
}

/// Mean entropy (at temperature τ) of the next-token distributions that
/// produced the valid completion tokens of `batch`, from the `logits` of
/// its forward inputs `fwd`.
fn masked_entropy(
    fwd: &crate::batch::ForwardInputs,
    logits: &Tensor,
    batch: &TrainBatch,
    temperature: f64,
) -> f64 {
    let _g = tch::no_grad_guard();
    let at = fwd.completion_entropy(logits, temperature);
    let mask = batch.mask.to_kind(Kind::Float);
    let n = mask.sum(Kind::Double).double_value(&[]);
    if n > 0.0 {
        (at * mask).sum(Kind::Double).double_value(&[]) / n
    } else {
        0.0
    }
}

fn tempfile_in(dir: &Path) -> Result<PathBuf, TrainError> {
    std::fs::create_dir_all(dir).map_err(|e| checkpoint::CheckpointError::Io {
        path: dir.to_owned(),
        source: e,
    })?;
    Ok(dir.join(format!(
        ".optimizer-{}-{}.safetensors.tmp",
        std::process::id(),
        asyncrl_common::unix_ms()
    )))
}
