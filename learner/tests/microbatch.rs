//! Micro-batches under a token budget (`max_tokens_per_microbatch`) with
//! gradient accumulation: one step with a budget that splits every
//! mini-batch gives the weights, loss and statistics of the same step
//! without one, for every clip mode, proximal mode and aggregation.

use arrow::array::RecordBatch;
use asyncrl_learner::advantages::AdvantageNorm;
use asyncrl_learner::batch::{Lanes, TrainBatch, assemble, completion_logprobs};
use asyncrl_learner::checkpoint::{self, LoadedCheckpoint};
use asyncrl_learner::objective::{
    ClipMode, ImportanceCorrection, KlEstimator, LossAggregation, ObjectiveConfig, ProximalMode,
};
use asyncrl_learner::trainer::{StepSettings, StepStats, Trainer, TrainerOptions};
use asyncrl_policy::{DeviceOptions, Policy, TinyModelSpec};
use asyncrl_protos::v1::{FinishReason, RewardStatus, Timings, Trajectory};
use asyncrl_tasks::SplitMix64;

/// Rows of the test batch and mini-batches per step.
const ROWS: usize = 16;
const MINIBATCHES: usize = 2;
/// The learner version the step starts from (token versions are 1..=4,
/// so version lags 0..=3: A-3PO's α is not trivial).
const START_VERSION: i32 = 4;

fn tiny_policy() -> Policy {
    let spec = TinyModelSpec {
        hidden_size: 32,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        intermediate_size: 64,
        init_std: 0.1,
        ..Default::default()
    };
    Policy::builtin_tiny(&spec, 5, DeviceOptions::cpu()).unwrap()
}

fn uniform(rng: &mut SplitMix64) -> f64 {
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

fn below(rng: &mut SplitMix64, n: u64) -> u64 {
    rng.next_u64() % n
}

/// Four groups of four rows of random tokens: prompts of 1–10 tokens,
/// completions of 0–12 (so padded lengths vary), mixed rewards, one
/// reward-failed row, token versions 1–4, and behaviour log-probs that are
/// the model's own plus noise (off-policy weights ≠ 1).
fn random_batch(policy: &Policy) -> RecordBatch {
    batch_of(policy, false)
}

/// [`random_batch`] with groups as a policy makes them: the rows of a
/// group share their prompt, and more. Group 1's rows also share their
/// first two completion tokens, group 2's first two rows are the same
/// trajectory, and group 3's last row's prompt differs from the others'
/// after its first token.
fn grouped_batch(policy: &Policy) -> RecordBatch {
    batch_of(policy, true)
}

/// [`grouped_batch`] with rows whose every advantage is 0 besides the
/// reward-failed row 6: group 3's rows all scored 1, and group 2's scored
/// 0, ½, 1, ½, so its second and fourth rows sit at the group's mean.
fn idle_rows_batch(policy: &Policy) -> RecordBatch {
    batch_with(policy, true, true)
}

fn batch_of(policy: &Policy, grouped: bool) -> RecordBatch {
    batch_with(policy, grouped, false)
}

fn batch_with(policy: &Policy, grouped: bool, idle_rows: bool) -> RecordBatch {
    let mut rng = SplitMix64::new(0xBA7C);
    let vocab = policy.config().vocab_size as u64;
    let mut trajs = Vec::new();
    for row in 0..ROWS {
        let (g, i) = (row / 4, row % 4);
        let prompt: Vec<i32> = (0..1 + below(&mut rng, 10))
            .map(|_| 1 + below(&mut rng, vocab - 1) as i32)
            .collect();
        let completion: Vec<i32> = (0..below(&mut rng, 13))
            .map(|_| 1 + below(&mut rng, vocab - 1) as i32)
            .collect();
        let n = completion.len();
        let failed = row == 6;
        trajs.push(Trajectory {
            uuid: uuid::Uuid::from_u128(row as u128 + 1).to_string(),
            task_id: format!("task-{g}"),
            group_id: format!("lease-{g}"),
            prompt_token_ids: prompt,
            completion_token_ids: completion,
            behaviour_logprobs: vec![0.0; n],
            policy_versions: (0..n).map(|_| 1 + below(&mut rng, 4) as i32).collect(),
            reward: if failed {
                f32::NAN
            } else {
                [0.0, 0.3, 1.0][below(&mut rng, 3) as usize]
            },
            reward_status: if failed {
                RewardStatus::Failed
            } else {
                RewardStatus::Ok
            } as i32,
            finish_reason: FinishReason::Stop as i32,
            worker_id: "test".into(),
            timings: Some(Timings::default()),
            group_size: 4,
            index_in_group: i as u32,
            admission_version: 1,
            turns: Vec::new(),
        });
    }
    if idle_rows {
        for (row, t) in trajs.iter_mut().enumerate().skip(8) {
            t.reward = if row >= 12 {
                1.0
            } else {
                [0.0, 0.5, 1.0, 0.5][row % 4]
            };
        }
    }
    if grouped {
        for row in 0..ROWS {
            let first = row / 4 * 4;
            trajs[row].prompt_token_ids = trajs[first].prompt_token_ids.clone();
        }
        let lead = trajs[4].completion_token_ids.clone();
        for t in &mut trajs[4..8] {
            for (k, tok) in lead.iter().take(2).enumerate() {
                if let Some(c) = t.completion_token_ids.get_mut(k) {
                    *c = *tok;
                }
            }
        }
        let (completion, versions) = (
            trajs[8].completion_token_ids.clone(),
            trajs[8].policy_versions.clone(),
        );
        trajs[9].behaviour_logprobs = vec![0.0; completion.len()];
        trajs[9].completion_token_ids = completion;
        trajs[9].policy_versions = versions;
        let prompt = &mut trajs[15].prompt_token_ids;
        match prompt.get_mut(1) {
            Some(tok) => *tok = 1 + *tok % (vocab as i32 - 1),
            None => prompt.push(1),
        }
    }
    let rb = asyncrl_protos::arrow_schema::to_record_batch(&trajs).unwrap();
    let b = assemble(std::slice::from_ref(&rb), 0, AdvantageNorm::Mean).unwrap();
    let lp =
        tch::no_grad(|| completion_logprobs(&policy.forward(&b.input_ids, None).unwrap(), &b, 1.0));
    for (row, t) in trajs.iter_mut().enumerate() {
        for k in 0..t.completion_token_ids.len() {
            let noise = 0.6 * (uniform(&mut rng) - 0.5);
            t.behaviour_logprobs[k] = (lp.double_value(&[row as i64, k as i64]) + noise) as f32;
        }
    }
    asyncrl_protos::arrow_schema::to_record_batch(&trajs).unwrap()
}

fn options(proximal: ProximalMode, max_tokens_per_microbatch: usize) -> TrainerOptions {
    TrainerOptions {
        proximal,
        minibatches: MINIBATCHES,
        advantage_norm: AdvantageNorm::Mean,
        max_tokens_per_microbatch,
        ..Default::default()
    }
}

fn knobs(clip_mode: ClipMode, aggregation: LossAggregation) -> StepSettings {
    corrected_knobs(clip_mode, aggregation, ImportanceCorrection::Mask)
}

fn corrected_knobs(
    clip_mode: ClipMode,
    aggregation: LossAggregation,
    importance_correction: ImportanceCorrection,
) -> StepSettings {
    StepSettings {
        objective: ObjectiveConfig {
            clip_mode,
            aggregation,
            importance_correction,
            importance_weight_floor: 0.8,
            eps_low: 0.1,
            eps_high: 0.1,
            // Tight enough that the weight cap, adaptive's contraction and
            // m2po's mask all act on this batch.
            importance_weight_cap: 1.3,
            adaptive_quantile: 0.5,
            adaptive_temperature: 0.05,
            m2po_threshold: 0.01,
            kl_coef: 0.0,
            kl_estimator: KlEstimator::K3,
            // Just above the upper clip bound: dual clip acts too.
            dual_clip: 1.15,
        },
        learning_rate: 5e-3,
    }
}

/// A checkpoint of a trainer at version [`START_VERSION`] + 1 with
/// optimizer state (one step taken), the state every compared step starts
/// from; and the batch.
fn starting_point(dir: &std::path::Path) -> (LoadedCheckpoint, RecordBatch) {
    starting_point_of(dir, random_batch)
}

/// [`starting_point`] with the batch `batch` makes.
fn starting_point_of(
    dir: &std::path::Path,
    batch: fn(&Policy) -> RecordBatch,
) -> (LoadedCheckpoint, RecordBatch) {
    let policy = tiny_policy();
    let rb = batch(&policy);
    // Every row takes forward + backward in this step. The starting point
    // is the same one whatever the default: the objective's masks (weight
    // cap, floor) are steps in the log-probs, so a start that differs by
    // float rounding can move a token across one in a later mini-batch.
    let mut t = Trainer::new(
        policy,
        TrainerOptions {
            forward_only_zero_advantage: false,
            ..options(ProximalMode::Approx, 0)
        },
    );
    let weights = t.weights_bytes().unwrap();
    t.adopt_published(&weights, START_VERSION).unwrap();
    t.train_step(
        std::slice::from_ref(&rb),
        &knobs(ClipMode::Ppo, LossAggregation::Token),
    )
    .unwrap();
    t.write_checkpoint(dir).unwrap();
    (checkpoint::load_latest(dir).unwrap().unwrap(), rb)
}

/// One step from the checkpoint: the stats and the parameters after it.
fn step_from(
    ckpt: &LoadedCheckpoint,
    rb: &RecordBatch,
    opts: TrainerOptions,
    knobs: &StepSettings,
) -> (StepStats, Vec<(String, tch::Tensor)>) {
    let mut t = Trainer::new(tiny_policy(), opts);
    if knobs.objective.kl_coef > 0.0 {
        // The starting weights, one step behind the checkpoint's.
        t.hold_reference().unwrap();
    }
    t.restore(ckpt).unwrap();
    let stats = t.train_step(std::slice::from_ref(rb), knobs).unwrap();
    (stats, params(&t))
}

/// A copy of the trainer's parameters.
fn params(t: &Trainer) -> Vec<(String, tch::Tensor)> {
    t.policy()
        .named_parameters()
        .into_iter()
        .map(|(n, p)| (n, p.detach().copy()))
        .collect()
}

fn max_abs_diff(a: &[(String, tch::Tensor)], b: &[(String, tch::Tensor)]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|((na, ta), (nb, tb))| {
            assert_eq!(na, nb);
            (ta - tb).abs().max().double_value(&[])
        })
        .fold(0.0, f64::max)
}

/// Asserts that two steps' loss and statistics agree to `tol` (relative to
/// the larger magnitude, or absolute below 1).
fn assert_same_stats(what: &str, got: &StepStats, want: &StepStats, tol: f64) {
    let close = |name: &str, g: f64, w: f64| {
        assert!(
            (g - w).abs() <= tol * g.abs().max(w.abs()).max(1.0),
            "{what}: {name} {g} vs {w}"
        );
    };
    close("loss", got.loss, want.loss);
    close("entropy", got.entropy, want.entropy);
    close("grad_norm", got.grad_norm, want.grad_norm);
    let (g, w) = (&got.objective, &want.objective);
    assert_eq!(g.tokens, w.tokens, "{what}: tokens");
    close(
        "clip_low_fraction",
        g.clip_low_fraction,
        w.clip_low_fraction,
    );
    close(
        "clip_high_fraction",
        g.clip_high_fraction,
        w.clip_high_fraction,
    );
    close(
        "weight_masked_fraction",
        g.weight_masked_fraction,
        w.weight_masked_fraction,
    );
    close(
        "m2po_masked_fraction",
        g.m2po_masked_fraction,
        w.m2po_masked_fraction,
    );
    close(
        "dual_clip_fraction",
        g.dual_clip_fraction,
        w.dual_clip_fraction,
    );
    close("approx_kl", g.approx_kl, w.approx_kl);
    close(
        "mean_importance_weight",
        g.mean_importance_weight,
        w.mean_importance_weight,
    );
    close("mean_version_lag", g.mean_version_lag, w.mean_version_lag);
    close("max_version_lag", g.max_version_lag, w.max_version_lag);
    close("kl_ref", g.kl_ref, w.kl_ref);
    let (g, w) = (&got.logprob_gap, &want.logprob_gap);
    assert_eq!(g.tokens, w.tokens, "{what}: logprob_gap.tokens");
    close("logprob_gap.mean_abs", g.mean_abs, w.mean_abs);
    close("logprob_gap.max_abs", g.max_abs, w.max_abs);
    close("logprob_gap.kl", g.kl, w.kl);
    assert_eq!(
        (got.tokens, got.version, got.version_lags.len()),
        (want.tokens, want.version, want.version_lags.len()),
        "{what}"
    );
}

/// Padded positions that force several micro-batches per mini-batch (rows
/// are up to 22 tokens long, mini-batches 8 rows).
const SPLITTING_BUDGET: usize = 40;

/// One step's objective settings: clip mode, importance correction,
/// proximal mode, aggregation and KL estimator (None: no KL loss).
type Case = (
    ClipMode,
    ImportanceCorrection,
    ProximalMode,
    LossAggregation,
    Option<KlEstimator>,
);

/// Every clip mode × proximal mode × aggregation, the corrections with
/// two clip modes, and the KL loss with both estimators.
fn all_cases() -> Vec<Case> {
    let mut cases: Vec<Case> = Vec::new();
    for clip_mode in ClipMode::ALL {
        for proximal in [
            ProximalMode::Recompute,
            ProximalMode::Approx,
            ProximalMode::Behaviour,
        ] {
            for aggregation in [LossAggregation::Token, LossAggregation::Sequence] {
                cases.push((
                    clip_mode,
                    ImportanceCorrection::Mask,
                    proximal,
                    aggregation,
                    None,
                ));
            }
        }
    }
    for correction in [ImportanceCorrection::Truncate, ImportanceCorrection::Icepop] {
        for clip_mode in [ClipMode::M2po, ClipMode::Gspo] {
            cases.push((
                clip_mode,
                correction,
                ProximalMode::Approx,
                LossAggregation::Sequence,
                None,
            ));
        }
    }
    for (clip_mode, estimator) in [
        (ClipMode::Ppo, KlEstimator::K1),
        (ClipMode::Adaptive, KlEstimator::K3),
    ] {
        cases.push((
            clip_mode,
            ImportanceCorrection::Mask,
            ProximalMode::Recompute,
            LossAggregation::Token,
            Some(estimator),
        ));
    }
    cases
}

fn case_knobs((clip_mode, correction, _, aggregation, kl): Case) -> StepSettings {
    let mut k = corrected_knobs(clip_mode, aggregation, correction);
    if let Some(estimator) = kl {
        k.objective.kl_coef = 0.5;
        k.objective.kl_estimator = estimator;
    }
    k
}

#[test]
fn microbatched_steps_match_the_unsplit_step() {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, rb) = starting_point(dir.path());
    let mut worst: f64 = 0.0;
    let mut dual_clipped: f64 = 0.0;
    for case in all_cases() {
        let (clip_mode, correction, proximal, aggregation, kl) = case;
        let what =
            format!("{clip_mode} / {correction} / {proximal:?} / {aggregation:?} / kl {kl:?}");
        let k = case_knobs(case);
        let (want, before) = step_from(&ckpt, &rb, options(proximal, 0), &k);
        let (got, after) = step_from(&ckpt, &rb, options(proximal, SPLITTING_BUDGET), &k);
        // One forward pass a mini-batch, two where its rows without a
        // valid token (row 6's reward failed) take theirs without gradient.
        let passes = if want.forward_only_rows > 0 { 1 } else { 0 };
        assert_eq!(want.microbatches, MINIBATCHES + passes, "{what}");
        assert!(
            got.microbatches >= 3 * MINIBATCHES,
            "{what}: only {} micro-batches",
            got.microbatches
        );
        assert_same_stats(&what, &got, &want, 1e-5);
        dual_clipped = dual_clipped.max(want.objective.dual_clip_fraction);
        let diff = max_abs_diff(&after, &before);
        println!(
            "{what}: {} micro-batches, max |Δparam| {diff:.3e}",
            got.microbatches
        );
        assert!(diff <= 1e-5, "{what}: parameters differ by {diff}");
        worst = worst.max(diff);
    }
    println!("worst max |Δparam| over all cases: {worst:.3e}");
    // The dual clip acted, so its accumulation over micro-batches was met.
    assert!(dual_clipped > 0.0, "no case met the dual clip");
    // The step itself moves the weights far more than the tolerance.
    let mut t = Trainer::new(tiny_policy(), options(ProximalMode::Approx, 0));
    t.restore(&ckpt).unwrap();
    let start = params(&t);
    let k = knobs(ClipMode::Ppo, LossAggregation::Token);
    let (_, after) = step_from(&ckpt, &rb, options(ProximalMode::Approx, 0), &k);
    assert!(max_abs_diff(&after, &start) > 1e-3);
}

#[test]
fn a_budget_below_one_row_trains_each_row_alone() {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, rb) = starting_point(dir.path());
    for proximal in [ProximalMode::Recompute, ProximalMode::Approx] {
        let k = knobs(ClipMode::Adaptive, LossAggregation::Token);
        let (want, before) = step_from(&ckpt, &rb, options(proximal, 0), &k);
        let (got, after) = step_from(&ckpt, &rb, options(proximal, 1), &k);
        assert_eq!(
            got.microbatches, ROWS,
            "{proximal:?}: one row per micro-batch"
        );
        assert!(got.loss.is_finite());
        assert_same_stats(&format!("{proximal:?}"), &got, &want, 1e-5);
        let diff = max_abs_diff(&after, &before);
        println!("budget 1, {proximal:?}: max |Δparam| {diff:.3e}");
        assert!(diff <= 1e-5, "{proximal:?}: parameters differ by {diff}");
    }
}

#[test]
fn a_budget_every_minibatch_fits_in_changes_nothing() {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, rb) = starting_point(dir.path());
    let batch = assemble(std::slice::from_ref(&rb), 0, AdvantageNorm::Mean).unwrap();
    // The whole batch at its padded length fits: no split anywhere.
    let fits = batch.input_ids.numel();
    for proximal in [ProximalMode::Recompute, ProximalMode::Approx] {
        for clip_mode in [ClipMode::Adaptive, ClipMode::M2po] {
            let k = knobs(clip_mode, LossAggregation::Sequence);
            let run = |budget: usize| {
                let mut t = Trainer::new(tiny_policy(), options(proximal, budget));
                t.restore(&ckpt).unwrap();
                let mut s = t.train_step(std::slice::from_ref(&rb), &k).unwrap();
                s.compute_seconds = 0.0;
                (s, t.weights_bytes().unwrap())
            };
            let (want, want_weights) = run(0);
            let (got, got_weights) = run(fits);
            assert_eq!(got, want, "{proximal:?} / {clip_mode}");
            assert!(
                got_weights == want_weights,
                "{proximal:?} / {clip_mode}: weights differ"
            );
        }
    }
}

fn packed(proximal: ProximalMode, budget: usize, lanes: Lanes) -> TrainerOptions {
    TrainerOptions {
        lanes,
        ..options(proximal, budget)
    }
}

/// One forward pass of `policy` over `batch` laid out as `lanes`: the
/// positions computed, and the completion log-probs and entropies at
/// temperature 0.7.
fn read_layout(
    policy: &Policy,
    batch: &TrainBatch,
    lanes: Lanes,
) -> (i64, tch::Tensor, tch::Tensor) {
    let fwd = batch.forward_inputs(lanes);
    let logits = tch::no_grad(|| fwd.logits(policy)).unwrap();
    (
        fwd.positions(),
        fwd.completion_logprobs(&logits, 0.7),
        fwd.completion_entropy(&logits, 0.7),
    )
}

/// The largest difference of `a` and `b` over `batch`'s real completion
/// tokens.
fn masked_diff(batch: &TrainBatch, a: &tch::Tensor, b: &tch::Tensor) -> f64 {
    let mask = batch.mask.to_kind(tch::Kind::Float);
    ((a - b) * &mask).abs().max().double_value(&[])
}

#[test]
fn packed_forward_passes_read_the_padded_log_probs_and_entropies() {
    tch::set_num_threads(1);
    let policy = tiny_policy();
    let rb = random_batch(&policy);
    let batch = assemble(std::slice::from_ref(&rb), 0, AdvantageNorm::Mean).unwrap();
    let read = |lanes: Lanes| read_layout(&policy, &batch, lanes);
    let (padded, lp, ent) = read(Lanes::Padded);
    let (lanes, packed_lp, packed_ent) = read(Lanes::Packed { min_width: 0 });
    let diff = |a: &tch::Tensor, b: &tch::Tensor| masked_diff(&batch, a, b);
    assert!(
        diff(&lp, &packed_lp) <= 1e-5,
        "log-probs: {}",
        diff(&lp, &packed_lp)
    );
    assert!(
        diff(&ent, &packed_ent) <= 1e-5,
        "entropies: {}",
        diff(&ent, &packed_ent)
    );
    // The same tokens read: the padded log-probs are not all alike.
    assert!(lp.masked_select(&batch.mask).std(true).double_value(&[]) > 0.1);
    assert_eq!(padded, batch.positions(Lanes::Padded));
    assert_eq!(lanes, batch.positions(Lanes::Packed { min_width: 0 }));
    // Lanes wider than any row: log-probs still the padded ones.
    let (wide, wide_lp, _) = read(Lanes::Packed { min_width: 48 });
    assert!(
        diff(&lp, &wide_lp) <= 1e-5,
        "wide lanes: {}",
        diff(&lp, &wide_lp)
    );
    assert_eq!(wide % 48, 0);
    let real: i64 = batch.lengths.iter().sum();
    println!("positions: padded {padded}, packed {lanes}, real tokens {real}");
    assert!(
        lanes < padded && lanes >= real,
        "{lanes} vs {padded}, {real} real"
    );
}

#[test]
fn packed_steps_match_padded_steps() {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, rb) = starting_point(dir.path());
    let mut worst: f64 = 0.0;
    for (budget, min_width) in [(0, 0), (SPLITTING_BUDGET, 0), (0, 64)] {
        let lanes = Lanes::Packed { min_width };
        for case in all_cases() {
            let (clip_mode, correction, proximal, aggregation, kl) = case;
            let what = format!(
                "budget {budget}, lanes {min_width}: {clip_mode} / {correction} / {proximal:?} / {aggregation:?} / kl {kl:?}"
            );
            let k = case_knobs(case);
            let (want, before) = step_from(&ckpt, &rb, packed(proximal, budget, Lanes::Padded), &k);
            let (got, after) = step_from(&ckpt, &rb, packed(proximal, budget, lanes), &k);
            assert_same_stats(&what, &got, &want, 1e-5);
            assert!(
                got.padded_tokens < want.padded_tokens,
                "{what}: {} positions packed, {} padded",
                got.padded_tokens,
                want.padded_tokens
            );
            if budget > 0 {
                assert!(
                    got.microbatches > MINIBATCHES && got.microbatches <= want.microbatches,
                    "{what}: {} micro-batches packed, {} padded",
                    got.microbatches,
                    want.microbatches
                );
            }
            let diff = max_abs_diff(&after, &before);
            assert!(diff <= 1e-5, "{what}: parameters differ by {diff}");
            worst = worst.max(diff);
        }
    }
    println!("worst max |Δparam| packed against padded: {worst:.3e}");
}

/// The layout that shares each group's common prefix.
const SHARED: Lanes = Lanes::Shared {
    min_width: 0,
    max_width: i64::MAX,
};

#[test]
fn shared_prefix_passes_read_the_padded_log_probs_and_entropies() {
    tch::set_num_threads(1);
    let policy = tiny_policy();
    let rb = grouped_batch(&policy);
    let batch = assemble(std::slice::from_ref(&rb), 0, AdvantageNorm::Mean).unwrap();
    let read = |lanes: Lanes| read_layout(&policy, &batch, lanes);
    let (padded, lp, ent) = read(Lanes::Padded);
    let (packed, _, _) = read(Lanes::Packed { min_width: 0 });
    let diff = |a: &tch::Tensor, b: &tch::Tensor| masked_diff(&batch, a, b);
    // Wide lanes (every group in one unit), and lanes narrow enough that
    // groups split into units that repeat their prefix.
    for (lanes, what) in [
        (SHARED, "shared"),
        (
            Lanes::Shared {
                min_width: 0,
                max_width: 24,
            },
            "shared, split groups",
        ),
    ] {
        let (shared, shared_lp, shared_ent) = read(lanes);
        assert!(
            diff(&lp, &shared_lp) <= 1e-5,
            "{what}: log-probs {}",
            diff(&lp, &shared_lp)
        );
        assert!(
            diff(&ent, &shared_ent) <= 1e-5,
            "{what}: entropies {}",
            diff(&ent, &shared_ent)
        );
        assert_eq!(shared, batch.positions(lanes), "{what}");
        println!("positions: padded {padded}, packed {packed}, {what} {shared}");
        assert!(
            shared < packed,
            "{what}: {shared} positions, packed {packed}"
        );
    }
    assert!(lp.masked_select(&batch.mask).std(true).double_value(&[]) > 0.1);
    // The groups' common prefixes, as assembled.
    let first = |g: usize| batch.shared[g * 4];
    assert!(first(0) >= 1 && first(1) >= first(0) && first(2) >= 1);
    assert_eq!(first(3), 1, "group 3's prompts part after one token");
}

#[test]
fn shared_prefix_steps_match_padded_steps() {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, rb) = starting_point_of(dir.path(), grouped_batch);
    let mut worst: f64 = 0.0;
    for budget in [0, SPLITTING_BUDGET] {
        for case in all_cases() {
            let (clip_mode, correction, proximal, aggregation, kl) = case;
            let what = format!(
                "budget {budget}: {clip_mode} / {correction} / {proximal:?} / {aggregation:?} / kl {kl:?}"
            );
            let k = case_knobs(case);
            let (want, before) = step_from(&ckpt, &rb, packed(proximal, budget, Lanes::Padded), &k);
            let (got, after) = step_from(&ckpt, &rb, packed(proximal, budget, SHARED), &k);
            assert_same_stats(&what, &got, &want, 1e-5);
            let (unshared, _) = step_from(
                &ckpt,
                &rb,
                packed(proximal, budget, Lanes::Packed { min_width: 0 }),
                &k,
            );
            assert!(
                got.padded_tokens < unshared.padded_tokens,
                "{what}: {} positions shared, {} packed",
                got.padded_tokens,
                unshared.padded_tokens
            );
            let diff = max_abs_diff(&after, &before);
            assert!(diff <= 1e-5, "{what}: parameters differ by {diff}");
            worst = worst.max(diff);
        }
    }
    println!("worst max |Δparam| shared against padded: {worst:.3e}");
}

#[test]
fn zero_advantage_rows_take_a_forward_pass_only_and_the_same_step() {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, rb) = starting_point_of(dir.path(), idle_rows_batch);
    // Rows 9, 11 and 12–15 have advantage 0 on every token; row 6 has no
    // valid token (its reward failed).
    let batch = assemble(std::slice::from_ref(&rb), 0, AdvantageNorm::Mean).unwrap();
    let signal = batch
        .advantages
        .ne(0.0)
        .logical_and(&batch.mask)
        .any_dim(1, false);
    let idle: Vec<usize> = (0..ROWS)
        .filter(|r| signal.int64_value(&[*r as i64]) == 0)
        .collect();
    assert_eq!(idle, [6, 9, 11, 12, 13, 14, 15]);
    let mut worst: f64 = 0.0;
    for lanes in [Lanes::Padded, SHARED] {
        for budget in [0, SPLITTING_BUDGET] {
            for case in all_cases() {
                let (clip_mode, correction, proximal, aggregation, kl) = case;
                let what = format!(
                    "{lanes:?}, budget {budget}: {clip_mode} / {correction} / {proximal:?} / {aggregation:?} / kl {kl:?}"
                );
                let k = case_knobs(case);
                let on = packed(proximal, budget, lanes);
                let off = TrainerOptions {
                    forward_only_zero_advantage: false,
                    ..packed(proximal, budget, lanes)
                };
                let (want, before) = step_from(&ckpt, &rb, off, &k);
                let (got, after) = step_from(&ckpt, &rb, on, &k);
                assert_eq!(want.forward_only_rows, 0, "{what}");
                if kl.is_some() {
                    // The KL loss has a gradient on every row.
                    assert_eq!(got.forward_only_rows, 0, "{what}");
                    assert_eq!(got.microbatches, want.microbatches, "{what}");
                } else {
                    // Every mini-batch (8 rows) holds a row with signal, so
                    // every idle row skips its backward pass.
                    assert_eq!(got.forward_only_rows, idle.len(), "{what}");
                    assert!(got.microbatches > want.microbatches, "{what}");
                }
                assert_same_stats(&what, &got, &want, 1e-5);
                let diff = max_abs_diff(&after, &before);
                assert!(diff <= 1e-5, "{what}: parameters differ by {diff}");
                worst = worst.max(diff);
            }
        }
    }
    println!("worst max |Δparam| forward-only against trained: {worst:.3e}");
}
