//! The learner's metrics (`asyncrl_learner_*`).

use asyncrl_telemetry::{Metrics, TelemetryError};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use std::sync::atomic::AtomicU64;

use crate::trainer::StepStats;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BoundLabel {
    pub bound: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FieldLabel {
    pub field: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabel {
    pub phase: &'static str,
}

type F64Gauge = Gauge<f64, AtomicU64>;

#[derive(Clone)]
pub struct LearnerMetrics {
    pub step: Gauge,
    pub version: Gauge,
    pub loss: F64Gauge,
    pub clip_fraction: Family<BoundLabel, F64Gauge>,
    pub masked_fraction: Family<ReasonLabel, F64Gauge>,
    pub approx_kl: F64Gauge,
    pub kl_ref: F64Gauge,
    pub entropy: F64Gauge,
    pub grad_norm: F64Gauge,
    pub learning_rate: F64Gauge,
    pub reward_mean: F64Gauge,
    pub importance_weight_mean: F64Gauge,
    pub version_lag_mean: F64Gauge,
    pub version_lag_max: F64Gauge,
    pub version_lag: Histogram,
    pub tokens: Counter,
    /// Rows that took a forward pass without gradient (every advantage 0).
    pub forward_only_rows: Counter,
    pub tokens_per_second: F64Gauge,
    pub step_seconds: Family<PhaseLabel, Histogram>,
    pub weight_publications: Counter,
    pub weight_publish_failures: Counter,
    pub checkpoints: Counter,
    /// Checkpoint writes that failed (the learner trains on), by
    /// [`crate::checkpoint::failure_reason`].
    pub checkpoint_failures: Family<ReasonLabel, Counter>,
    /// The step of the newest checkpoint the learner wrote or resumed from
    /// (0: none): where a restart would resume.
    pub checkpoint_last_step: Gauge,
    /// Batches the learner refused and asked for again, by the field at
    /// fault (`BatchError::field`): nothing of them was trained.
    pub bad_batches: Family<FieldLabel, Counter>,
    /// The engine/trainer mismatch (`objective::LogprobGap`) of the last
    /// step that had tokens of its starting version.
    pub logprob_gap: Family<StatLabel, F64Gauge>,
    pub logprob_kl: F64Gauge,
    pub logprob_gap_tokens: Counter,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StatLabel {
    pub stat: &'static str,
}

fn seconds_buckets() -> Histogram {
    Histogram::new([
        0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
    ])
}

impl LearnerMetrics {
    pub fn register(m: &Metrics) -> Result<Self, TelemetryError> {
        Ok(Self {
            step: m.register("learner_step", "Learner steps completed", Gauge::default())?,
            version: m.register(
                "learner_policy_version",
                "Policy version the learner last published",
                Gauge::default(),
            )?,
            loss: m.register("learner_loss", "Loss of the last step", F64Gauge::default())?,
            clip_fraction: m.register(
                "learner_clip_fraction",
                "Fraction of trained tokens whose ratio hit the lower / upper clip bound, or (dual) the dual-clip bound with a negative advantage",
                Family::default(),
            )?,
            masked_fraction: m.register(
                "learner_masked_fraction",
                "Fraction of trained tokens masked (importance-weight cap, m2po)",
                Family::default(),
            )?,
            approx_kl: m.register(
                "learner_approx_kl",
                "mean 0.5 (c - p)^2 of the last step",
                F64Gauge::default(),
            )?,
            kl_ref: m.register(
                "learner_kl_ref",
                "Mean per-token KL estimate (learner.kl_estimator) to the reference policy in the last step; 0 without a KL loss",
                F64Gauge::default(),
            )?,
            entropy: m.register(
                "learner_entropy",
                "Mean policy entropy at the trained tokens",
                F64Gauge::default(),
            )?,
            grad_norm: m.register(
                "learner_grad_norm",
                "Global gradient norm before clipping",
                F64Gauge::default(),
            )?,
            learning_rate: m.register(
                "learner_learning_rate",
                "Learning rate of the last step",
                F64Gauge::default(),
            )?,
            reward_mean: m.register(
                "learner_reward_mean",
                "Mean reward of the last batch",
                F64Gauge::default(),
            )?,
            importance_weight_mean: m.register(
                "learner_importance_weight_mean",
                "Mean off-policy weight exp(p - b) of the last step",
                F64Gauge::default(),
            )?,
            version_lag_mean: m.register(
                "learner_version_lag_mean",
                "Mean version lag of the tokens of the last step",
                F64Gauge::default(),
            )?,
            version_lag_max: m.register(
                "learner_version_lag_max",
                "Largest version lag of a token of the last step",
                F64Gauge::default(),
            )?,
            version_lag: m.register(
                "learner_token_version_lag",
                "Version lag (learner version - behaviour version) of every trained token",
                Histogram::new([0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0]),
            )?,
            tokens: m.register(
                "learner_tokens",
                "Completion tokens trained on",
                Counter::default(),
            )?,
            forward_only_rows: m.register(
                "learner_forward_only_rows",
                "Trained rows whose every advantage was 0: a forward pass without gradient, no backward (learner.forward_only_zero_advantage)",
                Counter::default(),
            )?,
            tokens_per_second: m.register(
                "learner_tokens_per_second",
                "Trained tokens per second of compute in the last step",
                F64Gauge::default(),
            )?,
            step_seconds: m.register_with_unit(
                "learner_step_phase",
                "Time of each phase of a step: wait (for the batch), compute, publish",
                prometheus_client::registry::Unit::Seconds,
                Family::new_with_constructor(seconds_buckets as fn() -> Histogram),
            )?,
            weight_publications: m.register(
                "learner_weight_publications",
                "Weight versions published",
                Counter::default(),
            )?,
            weight_publish_failures: m.register(
                "learner_weight_publish_failures",
                "Failed attempts to publish weights (retried)",
                Counter::default(),
            )?,
            checkpoints: m.register(
                "learner_checkpoints",
                "Checkpoints written",
                Counter::default(),
            )?,
            checkpoint_failures: m.register(
                "learner_checkpoint_failures",
                "Checkpoint writes that failed (training goes on; the last good checkpoint stays the resume point), by reason",
                Family::default(),
            )?,
            checkpoint_last_step: m.register(
                "learner_checkpoint_last_step",
                "Step of the newest good checkpoint (0: none)",
                Gauge::default(),
            )?,
            bad_batches: m.register(
                "learner_bad_batches",
                "Batches refused (not trained; asked for again), by the field at fault",
                Family::default(),
            )?,
            logprob_gap: m.register(
                "learner_logprob_gap",
                "|behaviour log-prob - learner log-prob| of the tokens sampled at the version a step starts from (stat: mean, max); 0 for an exact engine",
                Family::default(),
            )?,
            logprob_kl: m.register(
                "learner_logprob_kl",
                "k3 estimate of KL(behaviour || learner) over the same tokens",
                F64Gauge::default(),
            )?,
            logprob_gap_tokens: m.register(
                "learner_logprob_gap_tokens",
                "Tokens whose behaviour log-prob was compared with the learner's",
                Counter::default(),
            )?,
        })
    }

    /// Counts a refused batch under its field.
    pub fn bad_batch(&self, field: &'static str) {
        self.bad_batches.get_or_create(&FieldLabel { field }).inc();
    }

    pub fn observe_step(&self, s: &StepStats) {
        self.step.set(s.step as i64);
        self.loss.set(s.loss);
        self.clip_fraction
            .get_or_create(&BoundLabel { bound: "low" })
            .set(s.objective.clip_low_fraction);
        self.clip_fraction
            .get_or_create(&BoundLabel { bound: "high" })
            .set(s.objective.clip_high_fraction);
        self.clip_fraction
            .get_or_create(&BoundLabel { bound: "dual" })
            .set(s.objective.dual_clip_fraction);
        self.masked_fraction
            .get_or_create(&ReasonLabel {
                reason: "weight_cap",
            })
            .set(s.objective.weight_masked_fraction);
        self.masked_fraction
            .get_or_create(&ReasonLabel { reason: "m2po" })
            .set(s.objective.m2po_masked_fraction);
        self.approx_kl.set(s.objective.approx_kl);
        self.kl_ref.set(s.objective.kl_ref);
        self.entropy.set(s.entropy);
        self.grad_norm.set(s.grad_norm);
        self.learning_rate.set(s.learning_rate);
        self.reward_mean.set(s.reward_mean);
        self.importance_weight_mean
            .set(s.objective.mean_importance_weight);
        self.version_lag_mean.set(s.objective.mean_version_lag);
        self.version_lag_max.set(s.objective.max_version_lag);
        for lag in &s.version_lags {
            self.version_lag.observe(f64::from(*lag));
        }
        let gap = &s.logprob_gap;
        if gap.tokens > 0 {
            self.logprob_gap
                .get_or_create(&StatLabel { stat: "mean" })
                .set(gap.mean_abs);
            self.logprob_gap
                .get_or_create(&StatLabel { stat: "max" })
                .set(gap.max_abs);
            self.logprob_kl.set(gap.kl);
            self.logprob_gap_tokens.inc_by(gap.tokens as u64);
        }
        self.tokens.inc_by(s.tokens.max(0) as u64);
        self.forward_only_rows.inc_by(s.forward_only_rows as u64);
        if s.compute_seconds > 0.0 {
            self.tokens_per_second
                .set(s.tokens as f64 / s.compute_seconds);
        }
    }

    pub fn phase(&self, phase: &'static str, seconds: f64) {
        self.step_seconds
            .get_or_create(&PhaseLabel { phase })
            .observe(seconds);
    }
}
