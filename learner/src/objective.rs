//! The learner's objective (DESIGN.md, "The learner's objective").
//!
//! Per token t: behaviour log-prob `b` (from the worker, at the sampling
//! temperature), proximal log-prob `p`, current log-prob `c` (with
//! gradient), advantage `A`, behaviour version `v_b`.
//!
//! ```text
//! u = exp(c − p)                    trust-region ratio
//! w = exp(p − b)                    off-policy weight (detached); w > cap ⇒ token masked
//! loss = −agg[ w · min(u·A, clip(u, lo, hi)·A) ]
//! ```
//!
//! Proximal log-probs come from an extra forward pass (`recompute`, passed in)
//! or from A-3PO's interpolation (`approx`): with `v_p = v`, `v_θ = v + 1`,
//! `α = clamp((v_p − v_b)/(v_θ − v_b), 0, 1)` and `p = b + α·(c.detach() − b)`;
//! a fresh token (`v_b = v`) gets `α = 0`, i.e. `p = b`.
//!
//! Clip modes: `ppo` (`lo = 1 − ε_lo`, `hi = 1 + ε_hi`); `adaptive`
//! (staleness-adaptive: `d = |p − b|`, `q` the batch quantile of `d`,
//! `κ = exp(−max(0, d − q)/τ)`; `A > 0` contracts only `hi = 1 + ε_hi·κ`,
//! `A < 0` only `lo = 1 − ε_lo·κ`); `m2po` (mask the tokens with the largest
//! `(b − p)²` until the mean of the rest is at most a threshold, then plain
//! PPO clipping on the rest); `gspo` (GSPO, Zheng et al. 2025,
//! arXiv:2507.18071: one length-normalised ratio per sequence
//! `s = exp(mean_t (c − p))`, clipped as in PPO, and one off-policy weight
//! per sequence `w = exp(mean_t (p − b))`; every valid token of the
//! sequence carries `w · min(s·A, clip(s, lo, hi)·A)`, so the sequence
//! aggregation is GSPO's objective exactly and the token aggregation weighs
//! each sequence by its length).
//!
//! Dual clip (dual-clip PPO, Ye et al. 2020, arXiv:1912.09729; verl's
//! `clip_ratio_c`), when `dual_clip = d > 0` (then `d ≥ 1`): a token with
//! `A < 0` carries `max(min(u·A, clip(u, lo, hi)·A), d·A)`, so a token whose
//! ratio has run above `d` (a likely token of a bad completion that the
//! policy now favours much more than the sampler did) adds a bounded,
//! gradient-free term instead of one that grows with `u`. Under gspo `u` is
//! the sequence's ratio.
//!
//! Importance corrections of `w` (of a token, of a sequence under gspo):
//! `mask` (decoupled PPO: `w > cap` masks); `truncate` (TIS, Yao et al.
//! 2025, "Your efficient RL framework secretly brings you off-policy RL
//! training": the weight is `min(w, cap)`); `icepop` (masked importance
//! sampling, IcePop, Ling Team 2025, arXiv:2510.18855: `w` outside
//! `[floor, cap]` masks).
//!
//! KL loss against a frozen reference policy (log-probs `r`), when
//! `kl_coef = β > 0`: the loss gains `β·agg[k]` over the valid tokens (masked
//! ones included) with `k1 = c − r` or `k3 = exp(r − c) − (r − c) − 1`
//! (Schulman 2020, "Approximating KL divergence"; k3 is GRPO's, Shao et al.
//! 2024, arXiv:2402.03300).
//!
//! Masked tokens (importance correction, m2po) contribute nothing but stay
//! in the denominator of the mean, so masking removes a token's gradient
//! without rescaling the others.
//!
//! The loss is computed in two parts so that a mini-batch can run as several
//! micro-batches with gradient accumulation: an [`ObjectivePlan`] holds what
//! depends on the whole mini-batch (the aggregation's normalisers, the
//! adaptive quantile, m2po's mask, `p` where known), and
//! [`ObjectivePlan::loss`] is the loss of any subset of its rows, scaled so
//! that the subsets' losses (and gradients) sum to the whole one.
//! [`decoupled_ppo_loss`] is the plan and the loss of all rows.

use serde::Deserialize;
use tch::{Kind, Tensor};

/// The clipping mode (the one enum of config, knobs and objective).
pub use asyncrl_config::ClipModeName as ClipMode;
/// How the off-policy weight is corrected (the one enum of config, knobs
/// and objective).
pub use asyncrl_config::ImportanceCorrectionName as ImportanceCorrection;
/// The per-token KL estimator of the KL loss.
pub use asyncrl_config::KlEstimatorName as KlEstimator;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProximalMode {
    /// One extra forward pass with the weights before the step.
    Recompute,
    /// A-3PO interpolation from the token's version lag; no extra pass.
    #[default]
    Approx,
    /// No decoupling (naive PPO): the behaviour log-probs are the proximal
    /// ones, so `w = 1` and the ratio is `exp(c − b)`. What a system
    /// without decoupled PPO trains with; for comparisons.
    Behaviour,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossAggregation {
    /// Mean over all valid tokens of the batch.
    #[default]
    Token,
    /// Mean over sequences of each sequence's token mean.
    Sequence,
}

/// The knobs of the objective (live knobs from the coordinator land here).
#[derive(Debug, Clone, PartialEq)]
pub struct ObjectiveConfig {
    pub eps_low: f64,
    pub eps_high: f64,
    pub clip_mode: ClipMode,
    /// The upper bound of the off-policy weight `exp(p − b)`: above it a
    /// token is masked (`mask`, `icepop`) or its weight truncated to it
    /// (`truncate`).
    pub importance_weight_cap: f64,
    pub importance_correction: ImportanceCorrection,
    /// `icepop`: below this weight a token is masked.
    pub importance_weight_floor: f64,
    /// Batch quantile `q` of `|p − b|` above which `κ < 1` (adaptive).
    pub adaptive_quantile: f64,
    /// Temperature `τ` of the contraction (adaptive).
    pub adaptive_temperature: f64,
    /// Mean `(b − p)²` the unmasked tokens must stay under (m2po).
    pub m2po_threshold: f64,
    pub aggregation: LossAggregation,
    /// Weight β of the KL loss against the reference policy (0: none).
    pub kl_coef: f64,
    pub kl_estimator: KlEstimator,
    /// Dual-clip PPO's bound on the ratio of a token with `A < 0`
    /// (0: off; otherwise at least 1).
    pub dual_clip: f64,
}

impl Default for ObjectiveConfig {
    fn default() -> Self {
        Self {
            eps_low: 0.2,
            eps_high: 0.2,
            clip_mode: ClipMode::Adaptive,
            importance_weight_cap: 5.0,
            importance_correction: ImportanceCorrection::Mask,
            importance_weight_floor: 0.5,
            adaptive_quantile: 0.9,
            adaptive_temperature: 0.1,
            m2po_threshold: 0.04,
            aggregation: LossAggregation::Token,
            kl_coef: 0.0,
            kl_estimator: KlEstimator::K3,
            dual_clip: 0.0,
        }
    }
}

/// Per-token inputs, all `[N, T]` on one device. Padding positions are
/// `false` in `mask`; their values are ignored.
pub struct TokenInputs<'a> {
    /// Behaviour log-probs `b` (float).
    pub behaviour: &'a Tensor,
    /// Current log-probs `c` (float, with gradient).
    pub current: &'a Tensor,
    /// Proximal log-probs `p` from a recompute pass; `None` ⇒ A-3PO approx.
    pub proximal: Option<&'a Tensor>,
    /// Advantage of each token (the sequence's advantage, broadcast).
    pub advantages: &'a Tensor,
    /// Behaviour version `v_b` of each token (any numeric kind).
    pub versions: &'a Tensor,
    /// Valid (non-padding, not reward-failed) tokens (bool).
    pub mask: &'a Tensor,
    /// The reference policy's log-probs `r` (the KL loss; needed when
    /// `kl_coef > 0`).
    pub reference: Option<&'a Tensor>,
}

/// The loss and what a dashboard wants to know about it. Fractions are over
/// the valid tokens of the batch.
#[derive(Debug)]
pub struct ObjectiveOutput {
    pub loss: Tensor,
    pub stats: ObjectiveStats,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct ObjectiveStats {
    pub tokens: i64,
    /// Tokens whose ratio hit the lower / upper bound.
    pub clip_low_fraction: f64,
    pub clip_high_fraction: f64,
    /// Tokens whose off-policy weight the importance correction acted on:
    /// masked (`mask`, `icepop`) or truncated (`truncate`).
    pub weight_masked_fraction: f64,
    /// Tokens masked by m2po.
    pub m2po_masked_fraction: f64,
    /// Tokens with `A < 0` whose ratio was above the dual-clip bound.
    pub dual_clip_fraction: f64,
    /// `mean 0.5·(c − p)²` over valid tokens.
    pub approx_kl: f64,
    pub mean_importance_weight: f64,
    /// `v − v_b` over valid tokens.
    pub mean_version_lag: f64,
    pub max_version_lag: f64,
    /// The KL estimate (the configured estimator) against the reference
    /// policy, mean over valid tokens; 0 without a reference.
    pub kl_ref: f64,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ObjectiveError {
    #[error("input `{name}` has shape {got:?}, expected {want:?}")]
    Shape {
        name: &'static str,
        got: Vec<i64>,
        want: Vec<i64>,
    },
    #[error(
        "clip mode `{0}` needs the proximal (or current) log-probs of the whole mini-batch to plan the objective"
    )]
    ProximalNeeded(ClipMode),
    #[error("kl_coef > 0 needs the reference policy's log-probs")]
    ReferenceNeeded,
}

/// A-3PO's proximal approximation (detached): `p = b + α·(c − b)` with
/// `α = clamp((v − v_b)/(v + 1 − v_b), 0, 1)`.
pub fn approx_proximal(
    behaviour: &Tensor,
    current: &Tensor,
    versions: &Tensor,
    learner_version: i64,
) -> Tensor {
    let vb = versions.to_kind(Kind::Double);
    let v = learner_version as f64;
    // Tokens from a version the learner has not reached (possible only after
    // a learner restart) are treated as fresh: α = 0.
    let alpha = ((-&vb + v) / (-&vb + (v + 1.0)))
        .clamp(0.0, 1.0)
        .where_self(&vb.lt(v), &vb.zeros_like())
        .to_kind(behaviour.kind());
    (behaviour + alpha * (current.detach() - behaviour)).detach()
}

/// How far the behaviour log-probs (what the engine reported when it
/// sampled) are from the learner's own log-probs of the same tokens under
/// the same weights: the engine/trainer mismatch, the most common silent
/// failure of RL systems (log-probs before temperature, re-tokenised text,
/// a stale prefix cache, other precision). Only tokens sampled with the
/// version the learner's log-probs were computed at are compared; with
/// exact engines the gap is 0.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LogprobGap {
    /// Tokens compared (0: none of the batch was sampled at that version).
    pub tokens: i64,
    /// Mean and max `|b − l|`.
    pub mean_abs: f64,
    pub max_abs: f64,
    /// The k3 estimate of KL(behaviour ‖ learner):
    /// mean `exp(l − b) − 1 − (l − b)` (non-negative, 0 when equal).
    pub kl: f64,
}

/// The [`LogprobGap`] of `behaviour` against the learner's `learner`
/// log-probs (`[N, T]`, computed with the weights of `version`), over the
/// valid tokens whose behaviour version is `version`.
pub fn logprob_gap(
    behaviour: &Tensor,
    learner: &Tensor,
    versions: &Tensor,
    mask: &Tensor,
    version: i64,
) -> LogprobGap {
    let _g = tch::no_grad_guard();
    let same = mask
        .to_kind(Kind::Bool)
        .logical_and(&versions.to_kind(Kind::Int64).eq(version));
    let tokens = same.sum(Kind::Int64).int64_value(&[]);
    if tokens == 0 {
        return LogprobGap::default();
    }
    let b = behaviour.to_kind(Kind::Double).masked_select(&same);
    let l = learner.detach().to_kind(Kind::Double).masked_select(&same);
    let d = &l - &b;
    let abs = d.abs();
    LogprobGap {
        tokens,
        mean_abs: abs.mean(Kind::Double).double_value(&[]),
        max_abs: abs.max().double_value(&[]),
        kl: (d.exp() - 1.0 - &d).mean(Kind::Double).double_value(&[]),
    }
}

fn fraction(count: &Tensor, total: f64) -> f64 {
    if total > 0.0 {
        count.double_value(&[]) / total
    } else {
        0.0
    }
}

/// m2po: masks the valid tokens with the largest `m2 = (b − p)²` until the
/// mean of the rest is at most `threshold`. Returns the keep mask (bool).
fn m2po_keep(m2: &Tensor, valid: &Tensor, threshold: f64) -> Tensor {
    let flat_valid: Vec<bool> =
        Vec::<bool>::try_from(valid.flatten(0, -1).to_device(tch::Device::Cpu)).unwrap_or_default();
    let flat_m2: Vec<f64> = Vec::<f64>::try_from(
        m2.flatten(0, -1)
            .to_kind(Kind::Double)
            .to_device(tch::Device::Cpu),
    )
    .unwrap_or_default();
    let mut idx: Vec<usize> = (0..flat_m2.len()).filter(|i| flat_valid[*i]).collect();
    idx.sort_by(|a, b| flat_m2[*b].total_cmp(&flat_m2[*a]));
    let mut rest_sum: f64 = idx.iter().map(|i| flat_m2[*i]).sum();
    let mut rest_n = idx.len();
    let mut keep = flat_valid.clone();
    for i in &idx {
        if rest_n == 0 || rest_sum / rest_n as f64 <= threshold {
            break;
        }
        keep[*i] = false;
        rest_sum -= flat_m2[*i];
        rest_n -= 1;
    }
    Tensor::from_slice(&keep)
        .view(valid.size().as_slice())
        .to_device(valid.device())
}

/// The weights the importance correction masks (`mask`: above the cap;
/// `icepop`: outside `[floor, cap]`; `truncate`: none).
fn correction_masks(w: &Tensor, cfg: &ObjectiveConfig) -> Tensor {
    match cfg.importance_correction {
        ImportanceCorrection::Mask => w.gt(cfg.importance_weight_cap),
        ImportanceCorrection::Icepop => w
            .gt(cfg.importance_weight_cap)
            .logical_or(&w.lt(cfg.importance_weight_floor)),
        ImportanceCorrection::Truncate => w.zeros_like().to_kind(Kind::Bool),
    }
}

fn check_shape(name: &'static str, t: &Tensor, want: &[i64]) -> Result<(), ObjectiveError> {
    if t.size() != want {
        return Err(ObjectiveError::Shape {
            name,
            got: t.size(),
            want: want.to_vec(),
        });
    }
    Ok(())
}

/// Computes the decoupled PPO loss at learner version `learner_version`
/// (the version whose weights produce `current`): the [`ObjectivePlan`] of
/// all rows and its [`ObjectivePlan::loss`] over all of them.
pub fn decoupled_ppo_loss(
    inputs: &TokenInputs<'_>,
    learner_version: i64,
    cfg: &ObjectiveConfig,
) -> Result<ObjectiveOutput, ObjectiveError> {
    check_shape("current", inputs.current, &inputs.behaviour.size())?;
    let plan = ObjectivePlan::new(
        &PlanInputs {
            behaviour: inputs.behaviour,
            proximal: inputs.proximal,
            current: Some(inputs.current),
            advantages: inputs.advantages,
            versions: inputs.versions,
            mask: inputs.mask,
            reference: inputs.reference,
        },
        learner_version,
        cfg,
    )?;
    let part = plan.loss(None, inputs.current)?;
    let stats = plan.stats(&part.sums);
    Ok(ObjectiveOutput {
        loss: part.loss,
        stats,
    })
}

/// What an [`ObjectivePlan`] is built from: the detached per-token inputs
/// of a whole mini-batch, all `[N, T]` on one device.
pub struct PlanInputs<'a> {
    /// Behaviour log-probs `b` (float).
    pub behaviour: &'a Tensor,
    /// Proximal log-probs `p` from a recompute pass; `None` ⇒ A-3PO approx.
    pub proximal: Option<&'a Tensor>,
    /// Current log-probs `c` of every row (used detached, for A-3PO's `p`).
    /// Without `proximal`, the clip modes with batch statistics of `p`
    /// (adaptive, m2po: [`ObjectivePlan::needs_proximal`]) need them; plain
    /// PPO computes `p` token by token in [`ObjectivePlan::loss`].
    pub current: Option<&'a Tensor>,
    pub advantages: &'a Tensor,
    /// Behaviour version `v_b` of each token (any numeric kind).
    pub versions: &'a Tensor,
    /// Valid tokens (bool).
    pub mask: &'a Tensor,
    /// The reference policy's log-probs `r` (needed when `kl_coef > 0`).
    pub reference: Option<&'a Tensor>,
}

/// The mini-batch-level part of the objective, computed once from detached
/// inputs: the normalisers of the aggregation (valid tokens, sequences with
/// a valid token), adaptive's quantile of `|p − b|` over the valid tokens,
/// m2po's keep mask, the proximal log-probs when they are known, and the
/// version-lag statistics. [`ObjectivePlan::loss`] then gives the loss of
/// any subset of the rows (a micro-batch) from that subset's current
/// log-probs, scaled so that the losses of micro-batches that partition the
/// rows sum to the loss of the whole mini-batch, and so do the gradients:
/// gradient accumulation over micro-batches is exact up to float rounding.
#[derive(Debug)]
pub struct ObjectivePlan {
    cfg: ObjectiveConfig,
    learner_version: i64,
    behaviour: Tensor,
    advantages: Tensor,
    versions: Tensor,
    /// Valid tokens (bool).
    valid: Tensor,
    /// `p` of every row (detached), when known before the loss: recompute,
    /// or approx with the current log-probs given.
    proximal: Option<Tensor>,
    /// The reference policy's log-probs (detached).
    reference: Option<Tensor>,
    /// m2po: the tokens kept by the weight cap and m2po's mask (bool).
    keep: Option<Tensor>,
    /// adaptive: the quantile `q` of `|p − b|` over the valid tokens.
    quantile: f64,
    n_valid: f64,
    n_seq: f64,
    m2po_masked: f64,
    lag_sum: f64,
    max_version_lag: f64,
}

/// Token counts and sums of one [`ObjectivePlan::loss`] call; summed over
/// micro-batches and divided by the mini-batch's valid tokens by
/// [`ObjectivePlan::stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ObjectiveSums {
    pub clip_low: f64,
    pub clip_high: f64,
    pub weight_masked: f64,
    pub dual_clip: f64,
    /// Σ `0.5·(c − p)²` over valid tokens.
    pub approx_kl: f64,
    /// Σ `w` over valid tokens.
    pub importance_weight: f64,
    /// Σ of the KL estimate against the reference over valid tokens.
    pub kl_ref: f64,
}

impl ObjectiveSums {
    pub fn add(&mut self, other: &ObjectiveSums) {
        self.clip_low += other.clip_low;
        self.clip_high += other.clip_high;
        self.weight_masked += other.weight_masked;
        self.dual_clip += other.dual_clip;
        self.approx_kl += other.approx_kl;
        self.importance_weight += other.importance_weight;
        self.kl_ref += other.kl_ref;
    }
}

/// The loss of some rows of a plan (see [`ObjectivePlan::loss`]).
#[derive(Debug)]
pub struct PartialLoss {
    pub loss: Tensor,
    pub sums: ObjectiveSums,
}

impl ObjectivePlan {
    /// Whether the plan needs `p` of every row up front (a recompute pass,
    /// or [`PlanInputs::current`] for approx): adaptive's quantile and
    /// m2po's mask are statistics of `p` over the whole mini-batch.
    pub fn needs_proximal(cfg: &ObjectiveConfig) -> bool {
        matches!(cfg.clip_mode, ClipMode::Adaptive | ClipMode::M2po)
    }

    /// Plans the objective of a mini-batch at learner version
    /// `learner_version`.
    pub fn new(
        inputs: &PlanInputs<'_>,
        learner_version: i64,
        cfg: &ObjectiveConfig,
    ) -> Result<Self, ObjectiveError> {
        let shape = inputs.behaviour.size();
        check_shape("advantages", inputs.advantages, &shape)?;
        check_shape("versions", inputs.versions, &shape)?;
        check_shape("mask", inputs.mask, &shape)?;
        if let Some(p) = inputs.proximal {
            check_shape("proximal", p, &shape)?;
        }
        if let Some(c) = inputs.current {
            check_shape("current", c, &shape)?;
        }
        if let Some(r) = inputs.reference {
            check_shape("reference", r, &shape)?;
        }
        if cfg.kl_coef > 0.0 && inputs.reference.is_none() {
            return Err(ObjectiveError::ReferenceNeeded);
        }
        let kind = inputs
            .current
            .or(inputs.proximal)
            .map_or(inputs.behaviour.kind(), Tensor::kind);
        let _g = tch::no_grad_guard();
        let b = inputs.behaviour.to_kind(kind).detach();
        let valid = inputs.mask.to_kind(Kind::Bool);
        let valid_f = valid.to_kind(kind);
        let n_valid = valid_f.sum(Kind::Double).double_value(&[]);
        let n_seq = valid_f
            .sum_dim_intlist(-1, false, kind)
            .gt(0.0)
            .to_kind(kind)
            .sum(Kind::Double)
            .double_value(&[]);
        let proximal = match (inputs.proximal, inputs.current) {
            (Some(p), _) => Some(p.to_kind(kind).detach()),
            (None, Some(c)) => Some(approx_proximal(&b, c, inputs.versions, learner_version)),
            (None, None) => None,
        };
        let mut keep = None;
        let mut m2po_masked = 0.0;
        let mut quantile = 0.0;
        if Self::needs_proximal(cfg) {
            let p = proximal
                .as_ref()
                .ok_or(ObjectiveError::ProximalNeeded(cfg.clip_mode))?;
            let log_w = (p - &b).detach();
            match cfg.clip_mode {
                ClipMode::M2po => {
                    let masked = correction_masks(&log_w.exp(), cfg).logical_and(&valid);
                    let unmasked = valid.logical_and(&masked.logical_not());
                    let kept = m2po_keep(&log_w.square(), &unmasked, cfg.m2po_threshold);
                    m2po_masked = fraction(
                        &unmasked.logical_and(&kept.logical_not()).sum(Kind::Double),
                        n_valid,
                    );
                    keep = Some(kept);
                }
                ClipMode::Adaptive => {
                    if n_valid > 0.0 {
                        quantile = log_w
                            .abs()
                            .masked_select(&valid)
                            .to_kind(Kind::Double)
                            .quantile_scalar(cfg.adaptive_quantile, None, false, "linear")
                            .double_value(&[]);
                    }
                }
                ClipMode::Ppo | ClipMode::Gspo => {}
            }
        }
        let lag = (-inputs.versions.to_kind(Kind::Double) + learner_version as f64)
            * valid.to_kind(Kind::Double);
        Ok(Self {
            cfg: cfg.clone(),
            learner_version,
            behaviour: inputs.behaviour.detach(),
            advantages: inputs.advantages.detach(),
            versions: inputs.versions.detach(),
            valid,
            proximal,
            reference: inputs.reference.map(Tensor::detach),
            keep,
            quantile,
            n_valid,
            n_seq,
            m2po_masked,
            lag_sum: lag.sum(Kind::Double).double_value(&[]),
            max_version_lag: if n_valid > 0.0 {
                lag.max().double_value(&[])
            } else {
                0.0
            },
        })
    }

    /// Valid tokens of the mini-batch.
    pub fn tokens(&self) -> i64 {
        self.n_valid as i64
    }

    /// The loss of rows `rows` of the plan (a device tensor of indices;
    /// `None`: all rows, in order) from their current log-probs `current`
    /// (`[rows, T]`, with gradient), divided by the mini-batch's
    /// normaliser: the losses of micro-batches that partition the rows sum
    /// to the loss of the mini-batch.
    pub fn loss(
        &self,
        rows: Option<&Tensor>,
        current: &Tensor,
    ) -> Result<PartialLoss, ObjectiveError> {
        let pick = |t: &Tensor| match rows {
            Some(r) => t.index_select(0, r),
            None => t.shallow_clone(),
        };
        let cfg = &self.cfg;
        let behaviour = pick(&self.behaviour);
        check_shape("current", current, &behaviour.size())?;
        let kind = current.kind();
        let b = behaviour.to_kind(kind).detach();
        let c = current;
        let a = pick(&self.advantages).to_kind(kind).detach();
        let valid = pick(&self.valid);
        let valid_f = valid.to_kind(kind);

        let p = match &self.proximal {
            Some(p) => pick(p).to_kind(kind).detach(),
            None => approx_proximal(&b, c, &pick(&self.versions), self.learner_version),
        };
        // Per token, or (gspo) the sequence's mean broadcast to its tokens.
        let level = |x: Tensor| -> Tensor {
            if cfg.clip_mode == ClipMode::Gspo {
                let n = valid_f.sum_dim_intlist(-1, true, kind).clamp_min(1.0);
                (x.where_self(&valid, &x.zeros_like())
                    .sum_dim_intlist(-1, true, kind)
                    / n)
                    .expand_as(&valid_f)
            } else {
                x
            }
        };
        let log_w = level((&p - &b).detach()).detach();
        let w = log_w.exp();
        let masked = correction_masks(&w, cfg).logical_and(&valid);
        // The tokens the correction acted on, and the weight it leaves.
        let (corrected, w_applied) = match cfg.importance_correction {
            ImportanceCorrection::Truncate => (
                w.gt(cfg.importance_weight_cap).logical_and(&valid),
                w.clamp_max(cfg.importance_weight_cap),
            ),
            ImportanceCorrection::Mask | ImportanceCorrection::Icepop => {
                (masked.shallow_clone(), w.shallow_clone())
            }
        };
        let keep = match &self.keep {
            Some(k) => pick(k),
            None => valid.logical_and(&masked.logical_not()),
        };
        let keep_f = keep.to_kind(kind);

        let u = level(c - &p).exp();
        let ones = u.ones_like().detach();
        let (lo, hi) = match cfg.clip_mode {
            ClipMode::Ppo | ClipMode::M2po | ClipMode::Gspo => {
                (&ones * (1.0 - cfg.eps_low), &ones * (1.0 + cfg.eps_high))
            }
            ClipMode::Adaptive => {
                let d = log_w.abs();
                let kappa =
                    ((&d - self.quantile).relu() / -cfg.adaptive_temperature.max(1e-12)).exp();
                let hi_contracted = &kappa * cfg.eps_high + 1.0;
                let lo_contracted = -(&kappa * cfg.eps_low) + 1.0;
                let hi = hi_contracted.where_self(&a.gt(0.0), &(&ones * (1.0 + cfg.eps_high)));
                let lo = lo_contracted.where_self(&a.lt(0.0), &(&ones * (1.0 - cfg.eps_low)));
                (lo.detach(), hi.detach())
            }
        };
        let clipped = u.clamp_tensor(Some(&lo), Some(&hi));
        let surrogate = (&u * &a).minimum(&(&clipped * &a));
        // Dual clip: a term with A < 0 is at least d·A; `dual_clipped` are
        // the tokens above the bound (None when off: nothing to count).
        let (surrogate, dual_clipped) = if cfg.dual_clip > 0.0 {
            let negative = a.lt(0.0);
            (
                surrogate
                    .maximum(&(&a * cfg.dual_clip))
                    .where_self(&negative, &surrogate),
                Some(negative.logical_and(&u.gt(cfg.dual_clip))),
            )
        } else {
            (surrogate, None)
        };
        // The KL estimate against the reference, 0 on padding (where, not a
        // product: a padded position's values may be anything).
        let kl = match &self.reference {
            Some(r) => {
                let d = pick(r).to_kind(kind).detach() - c;
                let k = match cfg.kl_estimator {
                    KlEstimator::K1 => -&d,
                    KlEstimator::K3 => d.exp() - &d - 1.0,
                };
                Some(k.where_self(&valid, &k.zeros_like()))
            }
            None => None,
        };
        let surrogate_term = &w_applied * surrogate * &keep_f;
        let per_token = match kl.as_ref().filter(|_| cfg.kl_coef > 0.0) {
            Some(k) => surrogate_term - k * cfg.kl_coef,
            None => surrogate_term,
        };

        let objective = match cfg.aggregation {
            LossAggregation::Token => per_token.sum(kind) / self.n_valid.max(1.0),
            LossAggregation::Sequence => {
                let per_seq_n = valid_f.sum_dim_intlist(-1, false, kind);
                let has = per_seq_n.gt(0.0).to_kind(kind);
                let per_seq = per_token.sum_dim_intlist(-1, false, kind) / per_seq_n.clamp_min(1.0);
                (per_seq * has).sum(kind) / self.n_seq.max(1.0)
            }
        };
        let loss = -objective;

        let _g = tch::no_grad_guard();
        let count = |t: Tensor| t.sum(Kind::Double).double_value(&[]);
        let sums = ObjectiveSums {
            clip_low: count(keep.logical_and(&a.lt(0.0)).logical_and(&u.lt_tensor(&lo))),
            clip_high: count(keep.logical_and(&a.gt(0.0)).logical_and(&u.gt_tensor(&hi))),
            weight_masked: count(corrected),
            dual_clip: dual_clipped.map_or(0.0, |d| count(keep.logical_and(&d))),
            approx_kl: count((c.detach() - &p).square() * 0.5 * &valid_f),
            importance_weight: count(&w * &valid_f),
            kl_ref: kl.map_or(0.0, |k| count(k.detach())),
        };
        Ok(PartialLoss { loss, sums })
    }

    /// The statistics of the mini-batch from the [`ObjectiveSums`] of the
    /// losses of all its rows.
    pub fn stats(&self, sums: &ObjectiveSums) -> ObjectiveStats {
        let n = self.n_valid;
        let f = |x: f64| if n > 0.0 { x / n } else { 0.0 };
        ObjectiveStats {
            tokens: n as i64,
            clip_low_fraction: f(sums.clip_low),
            clip_high_fraction: f(sums.clip_high),
            weight_masked_fraction: f(sums.weight_masked),
            m2po_masked_fraction: self.m2po_masked,
            dual_clip_fraction: f(sums.dual_clip),
            approx_kl: f(sums.approx_kl),
            mean_importance_weight: f(sums.importance_weight),
            mean_version_lag: f(self.lag_sum),
            max_version_lag: self.max_version_lag,
            kl_ref: f(sums.kl_ref),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One token of a hand-computed case.
    #[derive(Clone, Copy)]
    struct Tok {
        b: f64,
        /// Proximal log-prob; `None` in every token of a case ⇒ approx mode.
        p: Option<f64>,
        c: f64,
        a: f64,
        v: i64,
    }

    fn tok(b: f64, p: f64, c: f64, a: f64) -> Tok {
        Tok {
            b,
            p: Some(p),
            c,
            a,
            v: 10,
        }
    }

    const LN2: f64 = std::f64::consts::LN_2;

    struct Case {
        name: &'static str,
        /// Sequences of tokens (ragged; padded in `check`).
        seqs: Vec<Vec<Tok>>,
        cfg: ObjectiveConfig,
        version: i64,
        loss: f64,
        clip_low: f64,
        clip_high: f64,
        masked: f64,
        m2po_masked: f64,
        dual_clipped: f64,
        /// Expected sign of d loss / d c at token (0, 0): -1, 0 or +1.
        grad_sign: i32,
    }

    fn base(name: &'static str, seqs: Vec<Vec<Tok>>, loss: f64) -> Case {
        Case {
            name,
            seqs,
            cfg: ObjectiveConfig {
                clip_mode: ClipMode::Ppo,
                ..Default::default()
            },
            version: 10,
            loss,
            clip_low: 0.0,
            clip_high: 0.0,
            masked: 0.0,
            m2po_masked: 0.0,
            dual_clipped: 0.0,
            grad_sign: -1,
        }
    }

    fn check(case: Case) {
        let n = case.seqs.len();
        let t = case.seqs.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let mut b = vec![0f64; n * t];
        let mut p = vec![0f64; n * t];
        let mut c = vec![0f64; n * t];
        let mut a = vec![0f64; n * t];
        let mut v = vec![0i64; n * t];
        let mut m = vec![false; n * t];
        let mut approx = false;
        for (i, seq) in case.seqs.iter().enumerate() {
            for (j, tk) in seq.iter().enumerate() {
                let k = i * t + j;
                b[k] = tk.b;
                c[k] = tk.c;
                a[k] = tk.a;
                v[k] = tk.v;
                m[k] = true;
                match tk.p {
                    Some(pv) => p[k] = pv,
                    None => approx = true,
                }
            }
        }
        let shape = [n as i64, t as i64];
        let tb = Tensor::from_slice(&b).view(shape);
        let tp = Tensor::from_slice(&p).view(shape);
        let tc = Tensor::from_slice(&c).view(shape).set_requires_grad(true);
        let ta = Tensor::from_slice(&a).view(shape);
        let tv = Tensor::from_slice(&v).view(shape);
        let tm = Tensor::from_slice(&m).view(shape);
        let inputs = TokenInputs {
            behaviour: &tb,
            current: &tc,
            proximal: if approx { None } else { Some(&tp) },
            advantages: &ta,
            versions: &tv,
            mask: &tm,
            reference: None,
        };
        let out = decoupled_ppo_loss(&inputs, case.version, &case.cfg).unwrap();
        let loss = out.loss.double_value(&[]);
        let name = case.name;
        let close = |what: &str, got: f64, want: f64| {
            assert!(
                (got - want).abs() < 1e-6,
                "{name}: {what} = {got}, expected {want}"
            );
        };
        close("loss", loss, case.loss);
        close(
            "clip_low_fraction",
            out.stats.clip_low_fraction,
            case.clip_low,
        );
        close(
            "clip_high_fraction",
            out.stats.clip_high_fraction,
            case.clip_high,
        );
        close(
            "weight_masked_fraction",
            out.stats.weight_masked_fraction,
            case.masked,
        );
        close(
            "m2po_masked_fraction",
            out.stats.m2po_masked_fraction,
            case.m2po_masked,
        );
        close(
            "dual_clip_fraction",
            out.stats.dual_clip_fraction,
            case.dual_clipped,
        );
        assert!(loss.is_finite(), "{name}: loss not finite");
        out.loss.backward();
        let g = tc.grad();
        let g00 = if g.defined() {
            g.double_value(&[0, 0])
        } else {
            0.0
        };
        let sign = if g00 > 1e-9 {
            1
        } else if g00 < -1e-9 {
            -1
        } else {
            0
        };
        assert_eq!(sign, case.grad_sign, "{name}: d loss/d c[0,0] = {g00}");
    }

    #[test]
    fn objective_table() {
        let l = (0.5f64).ln();
        // On-policy, fresh: u = w = 1, loss = −A.
        check(base("on-policy", vec![vec![tok(l, l, l, 1.0)]], -1.0));
        // A > 0, ratio 1.5 above 1 + 0.2: clipped to 1.2, no gradient.
        check(Case {
            clip_high: 1.0,
            grad_sign: 0,
            ..base(
                "upper clip",
                vec![vec![tok(-1.0, -1.0, -1.0 + 1.5f64.ln(), 1.0)]],
                -1.2,
            )
        });
        // A < 0, ratio 0.5 below 1 − 0.2: clipped to 0.8, no gradient.
        check(Case {
            clip_low: 1.0,
            grad_sign: 0,
            ..base(
                "lower clip",
                vec![vec![tok(-1.0, -1.0, -1.0 + 0.5f64.ln(), -1.0)]],
                0.8,
            )
        });
        // A > 0 with a low ratio is not clipped (pessimistic min picks u·A).
        check(base(
            "low ratio, positive advantage",
            vec![vec![tok(-1.0, -1.0, -1.0 + 0.5f64.ln(), 1.0)]],
            -0.5,
        ));
        // A < 0 with a high ratio is not clipped either; the gradient pushes c down.
        check(Case {
            grad_sign: 1,
            ..base(
                "high ratio, negative advantage",
                vec![vec![tok(-1.0, -1.0, -1.0 + 1.5f64.ln(), -1.0)]],
                1.5,
            )
        });
        // Off-policy weight w = 2 scales the token.
        check(base(
            "off-policy weight",
            vec![vec![tok(-2.0, -2.0 + LN2, -2.0 + LN2, 1.0)]],
            -2.0,
        ));
        // w = 6 > cap 5: that token is masked but stays in the denominator.
        check(Case {
            masked: 0.5,
            grad_sign: 0,
            ..base(
                "weight above cap",
                vec![vec![
                    tok(-3.0, -3.0 + 6f64.ln(), -3.0 + 6f64.ln(), 1.0),
                    tok(-1.0, -1.0, -1.0, 1.0),
                ]],
                -0.5,
            )
        });
        // Every token masked: loss 0, no gradient, no NaN.
        check(Case {
            masked: 1.0,
            grad_sign: 0,
            ..base(
                "all masked",
                vec![vec![tok(-3.0, -3.0 + 6f64.ln(), -3.0 + 6f64.ln(), 1.0)]],
                0.0,
            )
        });
        // A = 0: nothing to learn.
        check(Case {
            grad_sign: 0,
            ..base(
                "zero advantage",
                vec![vec![tok(-1.0, -1.0, -1.0, 0.0)]],
                0.0,
            )
        });
        // A zero-length completion next to a normal one.
        check(base(
            "zero-length completion",
            vec![vec![tok(-1.0, -1.0, -1.0, 1.0)], vec![]],
            -1.0,
        ));
        check(Case {
            cfg: ObjectiveConfig {
                clip_mode: ClipMode::Ppo,
                aggregation: LossAggregation::Sequence,
                ..Default::default()
            },
            ..base(
                "zero-length completion, sequence mean",
                vec![vec![tok(-1.0, -1.0, -1.0, 1.0)], vec![]],
                -1.0,
            )
        });
        check(Case {
            grad_sign: 0,
            ..base("only zero-length completions", vec![vec![], vec![]], 0.0)
        });
        // Token mean vs sequence mean.
        let one = vec![tok(-1.0, -1.0, -1.0, 1.0)];
        let three = vec![tok(-1.0, -1.0, -1.0, -1.0); 3];
        check(base("token mean", vec![one.clone(), three.clone()], 0.5));
        check(Case {
            cfg: ObjectiveConfig {
                clip_mode: ClipMode::Ppo,
                aggregation: LossAggregation::Sequence,
                ..Default::default()
            },
            ..base("sequence mean", vec![one, three], 0.0)
        });
    }

    #[test]
    fn dual_clip_table() {
        let dual = |d: f64| ObjectiveConfig {
            clip_mode: ClipMode::Ppo,
            dual_clip: d,
            ..Default::default()
        };
        let ratio = |u: f64, a: f64| tok(-1.0, -1.0, -1.0 + u.ln(), a);
        // A < 0, ratio 4 above the bound 3: max(min(−4, −1.2), −3) = −3,
        // loss 3, no gradient.
        check(Case {
            cfg: dual(3.0),
            dual_clipped: 1.0,
            grad_sign: 0,
            ..base(
                "dual clip, ratio above the bound",
                vec![vec![ratio(4.0, -1.0)]],
                3.0,
            )
        });
        // Without it the same token costs u·|A| = 4 and pushes c down.
        check(Case {
            grad_sign: 1,
            ..base(
                "no dual clip, same token",
                vec![vec![ratio(4.0, -1.0)]],
                4.0,
            )
        });
        // A < 0, ratio 2 between 1 + ε and the bound: unchanged (u·A = −2).
        check(Case {
            cfg: dual(3.0),
            grad_sign: 1,
            ..base(
                "dual clip, ratio below the bound",
                vec![vec![ratio(2.0, -1.0)]],
                2.0,
            )
        });
        // A > 0 is never dual-clipped: ratio 4 clips to 1.2 as in PPO.
        check(Case {
            cfg: dual(3.0),
            clip_high: 1.0,
            grad_sign: 0,
            ..base(
                "dual clip, positive advantage",
                vec![vec![ratio(4.0, 1.0)]],
                -1.2,
            )
        });
        // With the off-policy weight w = 2 and A = −0.5: 2·max(−5·0.5, −3·0.5)
        // = −3 on one of two tokens; the other (on-policy, A = −0.5) adds
        // −0.5. Mean loss (3 + 0.5)/2; the first token has no gradient.
        check(Case {
            cfg: dual(3.0),
            dual_clipped: 0.5,
            grad_sign: 0,
            ..base(
                "dual clip, weighted",
                vec![vec![
                    tok(-2.0, -2.0 + LN2, -2.0 + LN2 + 5f64.ln(), -0.5),
                    tok(-1.0, -1.0, -1.0, -0.5),
                ]],
                1.75,
            )
        });
        // gspo: the bound applies to the sequence's ratio, s = exp(mean(c − p))
        // = exp((ln 16 + 0)/2) = 4 > 3: both tokens carry −3·A.
        check(Case {
            cfg: ObjectiveConfig {
                clip_mode: ClipMode::Gspo,
                ..dual(3.0)
            },
            dual_clipped: 1.0,
            grad_sign: 0,
            ..base(
                "dual clip, gspo sequence ratio",
                vec![vec![ratio(16.0, -1.0), ratio(1.0, -1.0)]],
                3.0,
            )
        });
    }

    #[test]
    fn approx_proximal_table() {
        // Version lag 0: α = 0, p = b, so u = exp(c − b) = 1.5 is clipped to 1.2.
        let fresh = Tok {
            b: -1.0,
            p: None,
            c: -1.0 + 1.5f64.ln(),
            a: 1.0,
            v: 10,
        };
        check(Case {
            clip_high: 1.0,
            grad_sign: 0,
            ..base("approx, lag 0", vec![vec![fresh]], -1.2)
        });
        // Lag 1: α = 1/2. c − b = ln 4 ⇒ p = b + ln 2: w = 2, u = 2 → clip 1.2, obj 2.4.
        let stale = Tok {
            b: -2.0,
            p: None,
            c: -2.0 + 4f64.ln(),
            a: 1.0,
            v: 9,
        };
        check(Case {
            clip_high: 1.0,
            grad_sign: 0,
            ..base("approx, lag 1", vec![vec![stale]], -2.4)
        });
        // Same with a wide trust region: unclipped, obj = w·u = 4, gradient flows.
        check(Case {
            cfg: ObjectiveConfig {
                clip_mode: ClipMode::Ppo,
                eps_high: 3.0,
                ..Default::default()
            },
            ..base("approx, lag 1, unclipped", vec![vec![stale]], -4.0)
        });
        // A token from the future (v_b > v) is treated as fresh (α clamped to 0).
        // (α = 1 would give w = 1.5, u = 1 and a loss of −1.5.)
        let future = Tok {
            b: -1.0,
            p: None,
            c: -1.0 + 1.5f64.ln(),
            a: 1.0,
            v: 12,
        };
        check(Case {
            clip_high: 1.0,
            grad_sign: 0,
            ..base("approx, future version", vec![vec![future]], -1.2)
        });
        // α itself.
        let b = Tensor::from_slice(&[0.0f64, 0.0, 0.0, 0.0]);
        let c = Tensor::from_slice(&[-1.0f64, -1.0, -1.0, -1.0]);
        let v = Tensor::from_slice(&[10i64, 9, 7, 11, 12]);
        let b = Tensor::cat(&[b, Tensor::from_slice(&[0.0f64])], 0);
        let c = Tensor::cat(&[c, Tensor::from_slice(&[-1.0f64])], 0);
        let p = Vec::<f64>::try_from(approx_proximal(&b, &c, &v, 10)).unwrap();
        let want = [0.0, -0.5, -0.75, 0.0, 0.0];
        for (g, w) in p.iter().zip(want) {
            assert!((g - w).abs() < 1e-12, "{p:?}");
        }
    }

    #[test]
    fn adaptive_clipping_table() {
        let adaptive = ObjectiveConfig {
            clip_mode: ClipMode::Adaptive,
            adaptive_quantile: 0.9,
            adaptive_temperature: 0.05,
            ..Default::default()
        };
        // d = [0, ln 2]; q = 0.9·ln 2; κ₂ = exp(−0.1·ln 2/0.05) = 0.25.
        let fresh_pos = tok(-1.0, -1.0, -1.0, 1.0);
        let stale_pos = tok(-2.0, -2.0 + LN2, -2.0 + LN2 + 1.1f64.ln(), 1.0);
        // A > 0: upper bound 1 + 0.2·0.25 = 1.05 < 1.1 → clipped: obj₂ = 2·1.05.
        check(Case {
            cfg: adaptive.clone(),
            clip_high: 0.5,
            ..base(
                "adaptive contracts the upper bound",
                vec![vec![fresh_pos, stale_pos]],
                -(1.0 + 2.1) / 2.0,
            )
        });
        // Plain PPO leaves u = 1.1 alone: obj₂ = 2·1.1.
        check(base(
            "ppo keeps the upper bound",
            vec![vec![fresh_pos, stale_pos]],
            -(1.0 + 2.2) / 2.0,
        ));
        // A < 0: lower bound 1 − 0.2·0.25 = 0.95 > 0.9 → clipped: obj₂ = 2·(−0.95).
        let fresh_neg = tok(-1.0, -1.0, -1.0, -1.0);
        let stale_neg = tok(-2.0, -2.0 + LN2, -2.0 + LN2 + 0.9f64.ln(), -1.0);
        check(Case {
            cfg: adaptive.clone(),
            clip_low: 0.5,
            grad_sign: 1,
            ..base(
                "adaptive contracts the lower bound",
                vec![vec![fresh_neg, stale_neg]],
                (1.0 + 1.9) / 2.0,
            )
        });
        // A < 0 with a high ratio: only the lower bound is contracted, so u = 1.1 is untouched.
        let stale_neg_high = tok(-2.0, -2.0 + LN2, -2.0 + LN2 + 1.1f64.ln(), -1.0);
        check(Case {
            cfg: adaptive,
            grad_sign: 1,
            ..base(
                "adaptive leaves the other endpoint",
                vec![vec![fresh_neg, stale_neg_high]],
                (1.0 + 2.2) / 2.0,
            )
        });
    }

    #[test]
    fn m2po_table() {
        let m2po = ObjectiveConfig {
            clip_mode: ClipMode::M2po,
            m2po_threshold: 0.04,
            ..Default::default()
        };
        // (b − p)² = [0, 0, 0.25]: mean 0.083 > 0.04 → mask the largest; the rest has mean 0.
        let toks = vec![
            tok(-1.0, -1.0, -1.0, 1.0),
            tok(-1.0, -1.0, -1.0, 1.0),
            tok(-2.0, -1.5, -1.5, 1.0),
        ];
        check(Case {
            cfg: m2po.clone(),
            m2po_masked: 1.0 / 3.0,
            ..base("m2po masks the outlier", vec![toks], -2.0 / 3.0)
        });
        // (b − p)² = 0.01 everywhere: below the threshold, nothing masked.
        let toks = vec![tok(-1.1, -1.0, -1.0, 1.0), tok(-1.1, -1.0, -1.0, 1.0)];
        check(Case {
            cfg: m2po,
            ..base("m2po keeps a calm batch", vec![toks], -(0.1f64).exp())
        });
    }

    #[test]
    fn shape_mismatch_is_an_error() {
        let a = Tensor::zeros([2, 3], (Kind::Float, tch::Device::Cpu));
        let b = Tensor::zeros([2, 2], (Kind::Float, tch::Device::Cpu));
        let m = Tensor::ones([2, 3], (Kind::Bool, tch::Device::Cpu));
        let inputs = TokenInputs {
            behaviour: &a,
            current: &a,
            proximal: None,
            advantages: &b,
            versions: &a,
            mask: &m,
            reference: None,
        };
        let err = decoupled_ppo_loss(&inputs, 0, &ObjectiveConfig::default()).unwrap_err();
        assert!(matches!(
            err,
            ObjectiveError::Shape {
                name: "advantages",
                ..
            }
        ));
    }

    proptest::proptest! {
        /// With b = p = c the loss is −mean(A) and nothing is clipped or masked.
        #[test]
        fn on_policy_loss_is_minus_mean_advantage(
            rows in proptest::collection::vec(
                proptest::collection::vec((-8.0f64..0.0, -3.0f64..3.0, proptest::bool::ANY), 1..6), 1..5),
            mode in 0usize..3,
            approx in proptest::bool::ANY,
        ) {
            let t = rows.iter().map(Vec::len).max().unwrap_or(1);
            let n = rows.len();
            let mut lp = vec![0f64; n * t];
            let mut adv = vec![0f64; n * t];
            let mut mask = vec![false; n * t];
            for (i, row) in rows.iter().enumerate() {
                for (j, (l, a, m)) in row.iter().enumerate() {
                    lp[i * t + j] = *l;
                    adv[i * t + j] = *a;
                    mask[i * t + j] = *m;
                }
            }
            let shape = [n as i64, t as i64];
            let b = Tensor::from_slice(&lp).view(shape);
            let c = b.copy().set_requires_grad(true);
            let a = Tensor::from_slice(&adv).view(shape);
            let m = Tensor::from_slice(&mask).view(shape);
            let v = Tensor::full(shape, 3, (Kind::Int64, tch::Device::Cpu));
            let inputs = TokenInputs { behaviour: &b, current: &c, proximal: if approx { None } else { Some(&b) }, advantages: &a, versions: &v, mask: &m, reference: None };
            let clip_mode = [ClipMode::Ppo, ClipMode::Adaptive, ClipMode::M2po][mode];
            let cfg = ObjectiveConfig { clip_mode, ..Default::default() };
            let out = decoupled_ppo_loss(&inputs, 3, &cfg).unwrap();
            let valid: Vec<f64> = adv.iter().zip(&mask).filter(|(_, m)| **m).map(|(a, _)| *a).collect();
            let want = if valid.is_empty() { 0.0 } else { -valid.iter().sum::<f64>() / valid.len() as f64 };
            proptest::prop_assert!((out.loss.double_value(&[]) - want).abs() < 1e-9);
            proptest::prop_assert_eq!(out.stats.clip_low_fraction, 0.0);
            proptest::prop_assert_eq!(out.stats.clip_high_fraction, 0.0);
            proptest::prop_assert_eq!(out.stats.weight_masked_fraction, 0.0);
            proptest::prop_assert_eq!(out.stats.m2po_masked_fraction, 0.0);
        }
    }

    proptest::proptest! {
        /// The plan's losses over micro-batches that partition the rows sum
        /// to the whole batch's loss, with the same gradient and statistics,
        /// for every clip mode, aggregation and proximal source.
        #[test]
        fn microbatch_losses_sum_to_the_whole_loss(
            rows in proptest::collection::vec(
                proptest::collection::vec(
                    (-4.0f64..0.0, -0.6f64..0.6, -0.6f64..0.6, -2.0f64..2.0, 0i64..4, proptest::bool::weighted(0.85)),
                    0..6),
                1..7),
            part in proptest::collection::vec(0i64..3, 7),
            mode in 0usize..3,
            approx in proptest::bool::ANY,
            sequence in proptest::bool::ANY,
        ) {
            let t = rows.iter().map(Vec::len).max().unwrap_or(0).max(1);
            let n = rows.len();
            let mut b = vec![0f64; n * t];
            let mut p = vec![0f64; n * t];
            let mut c = vec![0f64; n * t];
            let mut adv = vec![0f64; n * t];
            let mut ver = vec![0i64; n * t];
            let mut mask = vec![false; n * t];
            for (i, row) in rows.iter().enumerate() {
                for (j, (lb, dp, dc, a, v, m)) in row.iter().enumerate() {
                    let k = i * t + j;
                    (b[k], p[k], c[k], adv[k], ver[k], mask[k]) = (*lb, lb + dp, lb + dp + dc, *a, *v, *m);
                }
            }
            let shape = [n as i64, t as i64];
            let tensor = |x: &[f64]| Tensor::from_slice(x).view(shape);
            let (b, p, a) = (tensor(&b), tensor(&p), tensor(&adv));
            let v = Tensor::from_slice(&ver).view(shape);
            let m = Tensor::from_slice(&mask).view(shape);
            let cfg = ObjectiveConfig {
                clip_mode: [ClipMode::Ppo, ClipMode::Adaptive, ClipMode::M2po][mode],
                aggregation: if sequence { LossAggregation::Sequence } else { LossAggregation::Token },
                importance_weight_cap: 1.5,
                adaptive_temperature: 0.05,
                m2po_threshold: 0.01,
                ..Default::default()
            };
            let proximal = (!approx).then_some(&p);

            let whole_c = tensor(&c).set_requires_grad(true);
            let inputs = TokenInputs { behaviour: &b, current: &whole_c, proximal, advantages: &a, versions: &v, mask: &m, reference: None };
            let whole = decoupled_ppo_loss(&inputs, 3, &cfg).unwrap();
            whole.loss.backward();

            let split_c = tensor(&c).set_requires_grad(true);
            let detached = split_c.detach();
            let plan = ObjectivePlan::new(&PlanInputs {
                behaviour: &b,
                proximal,
                current: ObjectivePlan::needs_proximal(&cfg).then_some(&detached),
                advantages: &a,
                versions: &v,
                mask: &m,
                reference: None,
            }, 3, &cfg).unwrap();
            let mut loss = 0.0;
            let mut sums = ObjectiveSums::default();
            for k in 0..3 {
                let idx: Vec<i64> = (0..n as i64).filter(|i| part[*i as usize] == k).collect();
                if idx.is_empty() {
                    continue;
                }
                let idx = Tensor::from_slice(&idx);
                let out = plan.loss(Some(&idx), &split_c.index_select(0, &idx)).unwrap();
                out.loss.backward();
                loss += out.loss.double_value(&[]);
                sums.add(&out.sums);
            }
            let close = |x: f64, y: f64| (x - y).abs() <= 1e-9 * (1.0 + y.abs());
            proptest::prop_assert!(close(loss, whole.loss.double_value(&[])), "{loss} vs {:?}", whole.loss);
            let grad = |c: &Tensor| if c.grad().defined() { c.grad() } else { c.zeros_like() };
            let diff = (grad(&split_c) - grad(&whole_c)).abs().max().double_value(&[]);
            proptest::prop_assert!(diff <= 1e-9, "max gradient difference {diff}");
            let (got, want) = (plan.stats(&sums), &whole.stats);
            proptest::prop_assert_eq!(got.tokens, want.tokens);
            for (name, g, w) in [
                ("clip_low", got.clip_low_fraction, want.clip_low_fraction),
                ("clip_high", got.clip_high_fraction, want.clip_high_fraction),
                ("weight_masked", got.weight_masked_fraction, want.weight_masked_fraction),
                ("m2po_masked", got.m2po_masked_fraction, want.m2po_masked_fraction),
                ("approx_kl", got.approx_kl, want.approx_kl),
                ("importance", got.mean_importance_weight, want.mean_importance_weight),
                ("lag", got.mean_version_lag, want.mean_version_lag),
                ("max_lag", got.max_version_lag, want.max_version_lag),
            ] {
                proptest::prop_assert!(close(g, w), "{name}: {g} vs {w}");
            }
        }
    }

    #[test]
    fn a_plan_without_proximal_log_probs_is_an_error_for_batch_statistics() {
        let z = Tensor::zeros([1, 2], (Kind::Float, tch::Device::Cpu));
        let m = Tensor::ones([1, 2], (Kind::Bool, tch::Device::Cpu));
        let inputs = PlanInputs {
            behaviour: &z,
            proximal: None,
            current: None,
            advantages: &z,
            versions: &z,
            mask: &m,
            reference: None,
        };
        for clip_mode in ClipMode::ALL {
            let cfg = ObjectiveConfig {
                clip_mode,
                ..Default::default()
            };
            let got = ObjectivePlan::new(&inputs, 0, &cfg).map(|_| ());
            // PPO's and GSPO's terms need only their own rows.
            if matches!(clip_mode, ClipMode::Ppo | ClipMode::Gspo) {
                assert_eq!(got, Ok(()));
            } else {
                assert_eq!(got, Err(ObjectiveError::ProximalNeeded(clip_mode)));
            }
        }
    }

    /// One case of [`logprob_gap`]: behaviour, learner, versions and mask of
    /// one row, the version compared, and what it must report.
    fn check_gap(b: &[f32], l: &[f32], v: &[i32], m: &[bool], version: i64, want: LogprobGap) {
        let row = |x: &[f32]| Tensor::from_slice(x).reshape([1, -1]);
        let got = logprob_gap(
            &row(b),
            &row(l),
            &Tensor::from_slice(v).reshape([1, -1]),
            &Tensor::from_slice(m).reshape([1, -1]),
            version,
        );
        let close = |a: f64, b: f64| (a - b).abs() < 1e-6;
        assert!(
            got.tokens == want.tokens
                && close(got.mean_abs, want.mean_abs)
                && close(got.max_abs, want.max_abs)
                && close(got.kl, want.kl),
            "got {got:?}, want {want:?}"
        );
    }

    #[test]
    fn logprob_gap_compares_only_tokens_of_the_version() {
        let t = true;
        // Exact engine: no gap.
        check_gap(
            &[-1.0, -2.0],
            &[-1.0, -2.0],
            &[3, 3],
            &[t, t],
            3,
            LogprobGap {
                tokens: 2,
                ..LogprobGap::default()
            },
        );
        // One token off by 0.5: |d| mean 0.25, max 0.5, k3 = (e^0.5 − 1.5)/2.
        check_gap(
            &[-1.0, -2.0],
            &[-1.0, -1.5],
            &[3, 3],
            &[t, t],
            3,
            LogprobGap {
                tokens: 2,
                mean_abs: 0.25,
                max_abs: 0.5,
                kl: ((0.5f64).exp() - 1.5) / 2.0,
            },
        );
        // Other versions and padding are left out.
        check_gap(
            &[-1.0, -2.0, -3.0],
            &[-9.0, -2.0, -9.0],
            &[2, 3, 3],
            &[t, t, false],
            3,
            LogprobGap {
                tokens: 1,
                ..LogprobGap::default()
            },
        );
        // Nothing at the version: nothing compared.
        check_gap(&[-1.0], &[-5.0], &[1], &[t], 3, LogprobGap::default());
    }

    /// The objectives added from their papers, computed token by token in
    /// plain f64 straight from the published formulas (loss, statistics
    /// and the analytic gradient `∂loss/∂c`), against the tensor objective.
    mod published {
        use super::*;

        /// Ragged rows of (b, p, c), the reference policy's log-probs `r`
        /// and a sequence advantage per row.
        struct Rows {
            b: Vec<Vec<f64>>,
            p: Vec<Vec<f64>>,
            c: Vec<Vec<f64>>,
            r: Vec<Vec<f64>>,
            a: Vec<f64>,
        }

        /// SplitMix64, so that the inputs are the same everywhere.
        fn rows(seed: u64) -> Rows {
            let mut state = seed;
            let mut uniform = |lo: f64, hi: f64| {
                state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = state;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                lo + ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64 * (hi - lo)
            };
            let mut r = Rows {
                b: vec![],
                p: vec![],
                c: vec![],
                r: vec![],
                a: vec![],
            };
            for len in [5, 2, 7, 1, 4, 6] {
                let (mut b, mut p, mut c) = (vec![], vec![], vec![]);
                for _ in 0..len {
                    let bt = uniform(-3.0, -0.1);
                    // Some tokens far above or below the behaviour policy.
                    let shift = match uniform(0.0, 1.0) {
                        x if x < 0.12 => 1.9,
                        x if x < 0.24 => -0.9,
                        _ => uniform(-0.3, 0.3),
                    };
                    let pt = bt + shift;
                    b.push(bt);
                    p.push(pt);
                    c.push(pt + uniform(-0.4, 0.4));
                }
                r.a.push(uniform(-1.5, 1.5));
                r.r.push(c.iter().map(|c| c + uniform(-0.6, 0.6)).collect());
                r.b.push(b);
                r.p.push(p);
                r.c.push(c);
            }
            r
        }

        /// What the reference computes.
        struct Reference {
            loss: f64,
            /// `∂loss/∂c`, per row and token.
            grad: Vec<Vec<f64>>,
            clip_low: f64,
            clip_high: f64,
            corrected: f64,
            /// Tokens the dual clip acted on.
            dual: f64,
        }

        /// The tensor objective on `r` (recompute mode: `p` given).
        fn tensor_objective(r: &Rows, cfg: &ObjectiveConfig) -> (ObjectiveOutput, Vec<Vec<f64>>) {
            let n = r.b.len();
            let t = r.b.iter().map(Vec::len).max().unwrap_or(1);
            let pad = |x: &Vec<Vec<f64>>| -> Tensor {
                let flat: Vec<f64> = x
                    .iter()
                    .flat_map(|row| (0..t).map(move |j| row.get(j).copied().unwrap_or(0.0)))
                    .collect();
                Tensor::from_slice(&flat).view([n as i64, t as i64])
            };
            let mask: Vec<bool> =
                r.b.iter()
                    .flat_map(|row| (0..t).map(move |j| j < row.len()))
                    .collect();
            let a: Vec<Vec<f64>> = r.a.iter().map(|a| vec![*a; t]).collect();
            let (tb, tp, tr) = (pad(&r.b), pad(&r.p), pad(&r.r));
            let tc = pad(&r.c).set_requires_grad(true);
            let ta = pad(&a);
            let tv = Tensor::full([n as i64, t as i64], 10i64, (Kind::Int64, tch::Device::Cpu));
            let tm = Tensor::from_slice(&mask).view([n as i64, t as i64]);
            let out = decoupled_ppo_loss(
                &TokenInputs {
                    behaviour: &tb,
                    current: &tc,
                    proximal: Some(&tp),
                    advantages: &ta,
                    versions: &tv,
                    mask: &tm,
                    reference: Some(&tr),
                },
                10,
                cfg,
            )
            .unwrap();
            out.loss.backward();
            let g = Vec::<f64>::try_from(tc.grad().flatten(0, -1)).unwrap();
            let grad =
                r.b.iter()
                    .enumerate()
                    .map(|(i, row)| (0..row.len()).map(|j| g[i * t + j]).collect())
                    .collect();
            (out, grad)
        }

        fn compare(what: &str, r: &Rows, cfg: &ObjectiveConfig, want: &Reference) {
            let (out, grad) = tensor_objective(r, cfg);
            let tokens: usize = r.b.iter().map(Vec::len).sum();
            let close = |name: &str, got: f64, want: f64| {
                assert!(
                    (got - want).abs() < 1e-9,
                    "{what}: {name} = {got}, the formula gives {want}"
                );
            };
            close("loss", out.loss.double_value(&[]), want.loss);
            close(
                "clip_low_fraction",
                out.stats.clip_low_fraction,
                want.clip_low / tokens as f64,
            );
            close(
                "clip_high_fraction",
                out.stats.clip_high_fraction,
                want.clip_high / tokens as f64,
            );
            close(
                "weight_masked_fraction",
                out.stats.weight_masked_fraction,
                want.corrected / tokens as f64,
            );
            close(
                "dual_clip_fraction",
                out.stats.dual_clip_fraction,
                want.dual / tokens as f64,
            );
            for (i, row) in want.grad.iter().enumerate() {
                for (j, g) in row.iter().enumerate() {
                    close(&format!("d loss/d c[{i}][{j}]"), grad[i][j], *g);
                }
            }
        }

        /// The corrected importance weight and whether the correction acted:
        /// decoupled PPO masks above the cap; TIS (Yao et al. 2025)
        /// truncates, `min(w, C)`; IcePop (arXiv:2510.18855) keeps `w` in
        /// `[α, β]` and masks the rest, `M(k) = k·1[α ≤ k ≤ β]`.
        fn corrected(w: f64, cfg: &ObjectiveConfig) -> (f64, bool) {
            let (cap, floor) = (cfg.importance_weight_cap, cfg.importance_weight_floor);
            match cfg.importance_correction {
                ImportanceCorrection::Mask if w > cap => (0.0, true),
                ImportanceCorrection::Truncate if w > cap => (cap, true),
                ImportanceCorrection::Icepop if w > cap || w < floor => (0.0, true),
                _ => (w, false),
            }
        }

        /// PPO's clipped surrogate `min(x·A, clip(x, 1 − ε_lo, 1 + ε_hi)·A)`
        /// of a ratio `x`: its value, `∂/∂x`, and which bound clipped it
        /// (−1 low, 1 high, 2 the dual clip). With dual clip (Ye et al.
        /// 2020, arXiv:1912.09729, eq. 6) `c > 0` and `A < 0` it is
        /// `max(min(x·A, clip(x)·A), c·A)`.
        fn surrogate(x: f64, a: f64, cfg: &ObjectiveConfig) -> (f64, f64, i32) {
            let (lo, hi) = (1.0 - cfg.eps_low, 1.0 + cfg.eps_high);
            let clipped = x.clamp(lo, hi);
            let ppo = if clipped * a < x * a {
                (clipped * a, 0.0, if x > hi { 1 } else { -1 })
            } else {
                (x * a, a, 0)
            };
            let bound = cfg.dual_clip * a;
            if cfg.dual_clip > 0.0 && a < 0.0 && bound > ppo.0 {
                (bound, 0.0, 2)
            } else {
                ppo
            }
        }

        /// Token-level decoupled objective with a corrected weight (TIS,
        /// IcePop): `J = 1/N Σ_t ŵ_t · min(u_t A, clip(u_t) A)`,
        /// `u_t = exp(c_t − p_t)`, `w_t = exp(p_t − b_t)`;
        /// `∂J/∂c_t = ŵ_t · ∂surrogate/∂u · u_t / N`. Token aggregation.
        fn token_reference(r: &Rows, cfg: &ObjectiveConfig) -> Reference {
            let n: usize = r.b.iter().map(Vec::len).sum();
            let mut out = Reference {
                loss: 0.0,
                grad: vec![],
                clip_low: 0.0,
                clip_high: 0.0,
                corrected: 0.0,
                dual: 0.0,
            };
            for i in 0..r.b.len() {
                let mut g = vec![];
                for j in 0..r.b[i].len() {
                    let (w, acted) = corrected((r.p[i][j] - r.b[i][j]).exp(), cfg);
                    let u = (r.c[i][j] - r.p[i][j]).exp();
                    let (value, d, side) = surrogate(u, r.a[i], cfg);
                    out.loss -= w * value / n as f64;
                    g.push(-w * d * u / n as f64);
                    out.corrected += f64::from(u8::from(acted));
                    let kept = w > 0.0;
                    out.clip_low += f64::from(u8::from(kept && side < 0));
                    out.clip_high += f64::from(u8::from(kept && side == 1));
                    out.dual += f64::from(u8::from(kept && side == 2));
                }
                out.grad.push(g);
            }
            out
        }

        /// GSPO (arXiv:2507.18071, eq. 5–7 and 10):
        /// `J = 1/G Σ_i min(s_i A_i, clip(s_i, 1 − ε_lo, 1 + ε_hi) A_i)` with
        /// `s_i = (π(y_i)/π_old(y_i))^{1/|y_i|} = exp(1/|y_i| Σ_t (c − p))`,
        /// here times the sequence's corrected off-policy weight
        /// `w_i = exp(1/|y_i| Σ_t (p − b))` (1 when the proximal policy is
        /// the behaviour one, GSPO as published); `∂s_i/∂c_t = s_i/|y_i|`.
        /// Sequence aggregation; clip and correction counts are per token.
        fn gspo_reference(r: &Rows, cfg: &ObjectiveConfig) -> Reference {
            let g_seq = r.b.len() as f64;
            let mut out = Reference {
                loss: 0.0,
                grad: vec![],
                clip_low: 0.0,
                clip_high: 0.0,
                corrected: 0.0,
                dual: 0.0,
            };
            for i in 0..r.b.len() {
                let len = r.b[i].len() as f64;
                let mean = |x: &[f64], y: &[f64]| -> f64 {
                    x.iter().zip(y).map(|(x, y)| x - y).sum::<f64>() / len
                };
                let s_i = mean(&r.c[i], &r.p[i]).exp();
                let (w, acted) = corrected(mean(&r.p[i], &r.b[i]).exp(), cfg);
                let (value, d, side) = surrogate(s_i, r.a[i], cfg);
                out.loss -= w * value / g_seq;
                out.grad
                    .push(vec![-w * d * s_i / len / g_seq; r.b[i].len()]);
                out.corrected += len * f64::from(u8::from(acted));
                let kept = w > 0.0;
                out.clip_low += len * f64::from(u8::from(kept && side < 0));
                out.clip_high += len * f64::from(u8::from(kept && side == 1));
                out.dual += len * f64::from(u8::from(kept && side == 2));
            }
            out
        }

        #[test]
        fn gspo_is_the_published_sequence_level_objective() {
            for seed in 1..=6 {
                let mut r = rows(seed);
                for (correction, cap, floor) in [
                    (ImportanceCorrection::Mask, 1.3, 0.5),
                    (ImportanceCorrection::Truncate, 1.15, 0.5),
                    (ImportanceCorrection::Icepop, 1.3, 0.85),
                ] {
                    let cfg = ObjectiveConfig {
                        clip_mode: ClipMode::Gspo,
                        aggregation: LossAggregation::Sequence,
                        eps_low: 0.04,
                        eps_high: 0.06,
                        importance_weight_cap: cap,
                        importance_correction: correction,
                        importance_weight_floor: floor,
                        ..Default::default()
                    };
                    compare(
                        &format!("gspo/{correction}, seed {seed}"),
                        &r,
                        &cfg,
                        &gspo_reference(&r, &cfg),
                    );
                }
                // As published: the old policy is the behaviour policy.
                r.p = r.b.clone();
                let cfg = ObjectiveConfig {
                    clip_mode: ClipMode::Gspo,
                    aggregation: LossAggregation::Sequence,
                    eps_low: 3e-2,
                    eps_high: 4e-2,
                    ..Default::default()
                };
                compare(
                    &format!("gspo as published, seed {seed}"),
                    &r,
                    &cfg,
                    &gspo_reference(&r, &cfg),
                );
            }
        }

        #[test]
        fn truncated_and_masked_importance_sampling_are_the_published_weights() {
            for seed in 11..=16 {
                let r = rows(seed);
                for correction in ImportanceCorrection::ALL {
                    let cfg = ObjectiveConfig {
                        clip_mode: ClipMode::Ppo,
                        aggregation: LossAggregation::Token,
                        importance_weight_cap: 2.0,
                        importance_correction: correction,
                        importance_weight_floor: 0.5,
                        ..Default::default()
                    };
                    compare(
                        &format!("{correction}, seed {seed}"),
                        &r,
                        &cfg,
                        &token_reference(&r, &cfg),
                    );
                }
            }
        }

        /// Dual-clip PPO: the token-level objective (with each importance
        /// correction) and GSPO's sequence-level one, with the bound on the
        /// ratio of negative-advantage terms.
        #[test]
        fn dual_clip_is_the_published_bound() {
            let (mut token_acted, mut gspo_acted) = (0.0, 0.0);
            for seed in 31..=36 {
                let r = rows(seed);
                for correction in ImportanceCorrection::ALL {
                    let cfg = ObjectiveConfig {
                        clip_mode: ClipMode::Ppo,
                        aggregation: LossAggregation::Token,
                        importance_weight_cap: 2.0,
                        importance_correction: correction,
                        dual_clip: 1.25,
                        ..Default::default()
                    };
                    let want = token_reference(&r, &cfg);
                    token_acted += want.dual;
                    compare(
                        &format!("dual clip/{correction}, seed {seed}"),
                        &r,
                        &cfg,
                        &want,
                    );
                }
                let cfg = ObjectiveConfig {
                    clip_mode: ClipMode::Gspo,
                    aggregation: LossAggregation::Sequence,
                    eps_low: 0.04,
                    eps_high: 0.06,
                    importance_weight_cap: 1.3,
                    dual_clip: 1.08,
                    ..Default::default()
                };
                let want = gspo_reference(&r, &cfg);
                gspo_acted += want.dual;
                compare(&format!("gspo dual clip, seed {seed}"), &r, &cfg, &want);
            }
            // These inputs do cross the bound, at both levels.
            assert!(
                token_acted > 0.0 && gspo_acted > 0.0,
                "dual-clipped: {token_acted} tokens, {gspo_acted} gspo tokens"
            );
        }

        /// The KL loss (Schulman 2020; GRPO, arXiv:2402.03300, eq. 4 uses
        /// k3): `β/N Σ_t k_t` with `k1 = c − r`, `∂k1/∂c = 1`, and
        /// `k3 = exp(r − c) − (r − c) − 1`, `∂k3/∂c = 1 − exp(r − c)`,
        /// added to the token-level objective; token aggregation.
        #[test]
        fn kl_losses_are_the_published_estimators() {
            for seed in 21..=26 {
                let r = rows(seed);
                let n: usize = r.b.iter().map(Vec::len).sum();
                for (estimator, beta) in [(KlEstimator::K1, 0.3), (KlEstimator::K3, 0.7)] {
                    let cfg = ObjectiveConfig {
                        clip_mode: ClipMode::Ppo,
                        aggregation: LossAggregation::Token,
                        importance_weight_cap: 2.0,
                        kl_coef: beta,
                        kl_estimator: estimator,
                        ..Default::default()
                    };
                    let mut want = token_reference(&r, &cfg);
                    let mut kl_sum = 0.0;
                    for i in 0..r.b.len() {
                        for j in 0..r.b[i].len() {
                            let d = r.r[i][j] - r.c[i][j];
                            let (k, dk) = match estimator {
                                KlEstimator::K1 => (-d, 1.0),
                                KlEstimator::K3 => (d.exp() - d - 1.0, 1.0 - d.exp()),
                            };
                            kl_sum += k;
                            want.loss += beta * k / n as f64;
                            want.grad[i][j] += beta * dk / n as f64;
                        }
                    }
                    compare(&format!("kl {estimator:?}, seed {seed}"), &r, &cfg, &want);
                    let (out, _) = tensor_objective(&r, &cfg);
                    assert!(
                        (out.stats.kl_ref - kl_sum / n as f64).abs() < 1e-9,
                        "kl {estimator:?}, seed {seed}: kl_ref {} vs {}",
                        out.stats.kl_ref,
                        kl_sum / n as f64
                    );
                }
            }
            // Without a reference, a KL loss is refused, not skipped.
            let cfg = ObjectiveConfig {
                kl_coef: 0.1,
                ..Default::default()
            };
            let z = Tensor::zeros([1, 2], (Kind::Double, tch::Device::Cpu));
            let m = Tensor::ones([1, 2], (Kind::Bool, tch::Device::Cpu));
            let err = decoupled_ppo_loss(
                &TokenInputs {
                    behaviour: &z,
                    current: &z,
                    proximal: Some(&z),
                    advantages: &z,
                    versions: &z,
                    mask: &m,
                    reference: None,
                },
                0,
                &cfg,
            )
            .unwrap_err();
            assert_eq!(err, ObjectiveError::ReferenceNeeded);
        }

        /// The references would pass a test that never meets the branches:
        /// these inputs do meet them.
        #[test]
        fn the_reference_inputs_meet_every_branch() {
            let all: Vec<Rows> = (1..=16).map(rows).collect();
            let ws: Vec<f64> = all
                .iter()
                .flat_map(|r| {
                    r.p.iter()
                        .flatten()
                        .zip(r.b.iter().flatten())
                        .map(|(p, b)| (p - b).exp())
                        .collect::<Vec<_>>()
                })
                .collect();
            assert!(ws.iter().any(|w| *w > 2.0) && ws.iter().any(|w| *w < 0.5));
            let cfg = ObjectiveConfig {
                clip_mode: ClipMode::Gspo,
                eps_low: 0.04,
                eps_high: 0.06,
                ..Default::default()
            };
            let sides: Vec<i32> = all
                .iter()
                .flat_map(|r| {
                    (0..r.b.len())
                        .map(|i| {
                            let len = r.b[i].len() as f64;
                            let log_s: f64 =
                                r.c[i].iter().zip(&r.p[i]).map(|(c, p)| c - p).sum::<f64>() / len;
                            surrogate(log_s.exp(), r.a[i], &cfg).2
                        })
                        .collect::<Vec<_>>()
                })
                .collect();
            assert!(sides.contains(&1) && sides.contains(&-1) && sides.contains(&0));
        }
    }
}
