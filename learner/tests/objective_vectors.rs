//! The learner's objective as test vectors: one definition of correctness
//! for every trainer engine. For every clip mode × proximal mode ×
//! aggregation (with decoupled PPO's masking correction), and for the
//! truncating (TIS) and IcePop corrections × ppo, m2po, gspo × the
//! recompute and approx proximal modes × aggregation, and for the k1 and
//! k3 KL losses against a reference policy on three of those, seeded inputs (a mini-batch of ragged rows, one of them
//! without a valid token, versions from stale to one the learner has not
//! reached) go through [`decoupled_ppo_loss`] and through an
//! [`ObjectivePlan`] split into two micro-batches; the file records the
//! inputs, the loss, every statistic, the gradient of the loss with
//! respect to the current log-probs, and the micro-batches' losses.
//!
//! The vectors are checked in (`trainer/tests/data/objective_vectors.json`)
//! and the `torch` trainer engine's tests (pytest, `scripts/test`) check its
//! objective against them. This test checks that the file is what the Rust
//! objective computes now, so that neither side can change alone; after an
//! intended change of the objective, regenerate it with
//! `ASYNCRL_WRITE_VECTORS=1 cargo test -p asyncrl-learner --test objective_vectors`.

use std::path::PathBuf;

use asyncrl_learner::objective::{
    ClipMode, ImportanceCorrection, KlEstimator, LossAggregation, ObjectiveConfig, ObjectivePlan,
    ObjectiveStats, PlanInputs, ProximalMode, TokenInputs, decoupled_ppo_loss,
};
use serde_json::{Value, json};
use tch::{Kind, Tensor};

/// Rows and tokens of every case.
const ROWS: usize = 4;
const TOKENS: usize = 6;
/// The learner's version: tokens are 0–3 versions old, and one token is
/// from version 11 (seen only after a learner restart; A-3PO treats it as
/// fresh).
const VERSION: i64 = 10;
/// The micro-batches every case is also computed as.
const MICRO_BATCHES: [&[i64]; 2] = [&[0, 2], &[1, 3]];

fn vectors_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../trainer/tests/data/objective_vectors.json")
}

/// A deterministic generator (SplitMix64), so that the inputs never depend
/// on a library's random streams.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [lo, hi), rounded to 1e-6 so that the JSON is exact.
    fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        let u = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        ((lo + u * (hi - lo)) * 1e6).round() / 1e6
    }
}

/// The inputs of one case, as rows of values.
struct Inputs {
    behaviour: Vec<Vec<f64>>,
    /// The recompute pass's log-probs (used as `p` in recompute mode).
    recomputed: Vec<Vec<f64>>,
    current: Vec<Vec<f64>>,
    advantages: Vec<Vec<f64>>,
    versions: Vec<Vec<i64>>,
    mask: Vec<Vec<bool>>,
}

fn inputs(seed: u64) -> Inputs {
    let mut rng = Rng(seed);
    // Row lengths: ragged, and row 2 has no valid token (a reward-failed
    // sequence): it stays out of the sequence mean's denominator.
    let lengths = [6, 4, 0, 3];
    let mut x = Inputs {
        behaviour: Vec::new(),
        recomputed: Vec::new(),
        current: Vec::new(),
        advantages: Vec::new(),
        versions: Vec::new(),
        mask: Vec::new(),
    };
    for (row, len) in lengths.iter().enumerate() {
        let advantage = rng.uniform(-1.5, 1.5);
        let (mut b, mut p, mut c, mut v, mut m) = (vec![], vec![], vec![], vec![], vec![]);
        for t in 0..TOKENS {
            let bt = rng.uniform(-3.0, -0.05);
            // Some tokens far off-policy (weight exp(p − b) over the cap of
            // 5), the rest near.
            let far = rng.uniform(0.0, 1.0) < 0.15;
            let pt = bt + if far { 1.8 } else { rng.uniform(-0.4, 0.4) };
            let ct = pt + rng.uniform(-0.35, 0.35);
            let vt = if row == 3 && t == 1 {
                VERSION + 1
            } else {
                VERSION - (rng.next() % 4) as i64
            };
            b.push(bt);
            p.push(pt);
            c.push(ct);
            v.push(vt);
            m.push(t < *len);
        }
        x.behaviour.push(b);
        x.recomputed.push(p);
        x.current.push(c);
        x.advantages.push(vec![advantage; TOKENS]);
        x.versions.push(v);
        x.mask.push(m);
    }
    x
}

/// The reference policy's log-probs of a case with a KL loss: the current
/// ones moved by up to ±0.5, from a stream of their own (the other inputs
/// stay those of `inputs(seed)`).
fn reference(x: &Inputs, seed: u64) -> Vec<Vec<f64>> {
    let mut rng = Rng(seed ^ 0x4B4C_5245_4600_0000);
    x.current
        .iter()
        .map(|row| row.iter().map(|c| c + rng.uniform(-0.5, 0.5)).collect())
        .collect()
}

fn f64_tensor(rows: &[Vec<f64>]) -> Tensor {
    let flat: Vec<f64> = rows.iter().flatten().copied().collect();
    Tensor::from_slice(&flat).view([ROWS as i64, TOKENS as i64])
}

fn matrix(t: &Tensor) -> Vec<Vec<f64>> {
    let flat = Vec::<f64>::try_from(t.to_kind(Kind::Double).flatten(0, -1)).expect("a matrix");
    flat.chunks(TOKENS).map(<[f64]>::to_vec).collect()
}

fn stats_json(s: &ObjectiveStats) -> Value {
    json!({
        "tokens": s.tokens,
        "clip_low_fraction": s.clip_low_fraction,
        "clip_high_fraction": s.clip_high_fraction,
        "weight_masked_fraction": s.weight_masked_fraction,
        "m2po_masked_fraction": s.m2po_masked_fraction,
        "dual_clip_fraction": s.dual_clip_fraction,
        "approx_kl": s.approx_kl,
        "mean_importance_weight": s.mean_importance_weight,
        "mean_version_lag": s.mean_version_lag,
        "max_version_lag": s.max_version_lag,
        "kl_ref": s.kl_ref,
    })
}

/// The names the config and the knobs give the modes.
fn proximal_name(mode: ProximalMode) -> &'static str {
    match mode {
        ProximalMode::Recompute => "recompute",
        ProximalMode::Approx => "approx",
        ProximalMode::Behaviour => "behaviour",
    }
}

fn aggregation_name(aggregation: LossAggregation) -> &'static str {
    match aggregation {
        LossAggregation::Token => "token",
        LossAggregation::Sequence => "sequence",
    }
}

/// What one case varies.
#[derive(Clone, Copy)]
struct Spec {
    clip: ClipMode,
    correction: ImportanceCorrection,
    mode: ProximalMode,
    aggregation: LossAggregation,
    /// The KL loss's estimator (None: no KL loss).
    kl: Option<KlEstimator>,
    /// The dual-clip bound (0: off).
    dual_clip: f64,
}

impl Spec {
    /// Decoupled PPO's masking correction, no KL loss, no dual clip.
    fn new(clip: ClipMode, mode: ProximalMode, aggregation: LossAggregation) -> Self {
        Spec {
            clip,
            correction: ImportanceCorrection::Mask,
            mode,
            aggregation,
            kl: None,
            dual_clip: 0.0,
        }
    }
}

fn case(spec: Spec, seed: u64) -> Value {
    let Spec {
        clip,
        correction,
        mode,
        aggregation,
        kl,
        dual_clip,
    } = spec;
    let x = inputs(seed);
    let reference_rows = kl.map(|_| reference(&x, seed));
    let reference = reference_rows.as_deref().map(f64_tensor);
    // GSPO's sequence ratios and weights are means over a row: a narrower
    // clip range and weight band make its clipping and correction happen
    // on these inputs.
    let gspo = clip == ClipMode::Gspo;
    let cfg = ObjectiveConfig {
        eps_low: if gspo { 0.02 } else { 0.2 },
        eps_high: if gspo { 0.02 } else { 0.28 },
        clip_mode: clip,
        importance_weight_cap: if gspo { 1.25 } else { 5.0 },
        importance_correction: correction,
        importance_weight_floor: if gspo { 0.85 } else { 0.75 },
        adaptive_quantile: 0.75,
        adaptive_temperature: 0.1,
        m2po_threshold: 0.04,
        aggregation,
        kl_coef: if kl.is_some() { 0.3 } else { 0.0 },
        kl_estimator: kl.unwrap_or_default(),
        dual_clip,
    };
    let behaviour = f64_tensor(&x.behaviour);
    // The proximal log-probs each mode hands the objective (as the trainer
    // does): the recompute pass's, the behaviour ones (naive PPO), or none
    // (A-3PO's approximation from the versions).
    let proximal = match mode {
        ProximalMode::Recompute => Some(f64_tensor(&x.recomputed)),
        ProximalMode::Behaviour => Some(behaviour.shallow_clone()),
        ProximalMode::Approx => None,
    };
    let advantages = f64_tensor(&x.advantages);
    let flat_versions: Vec<i64> = x.versions.iter().flatten().copied().collect();
    let versions = Tensor::from_slice(&flat_versions).view([ROWS as i64, TOKENS as i64]);
    let flat_mask: Vec<bool> = x.mask.iter().flatten().copied().collect();
    let mask = Tensor::from_slice(&flat_mask).view([ROWS as i64, TOKENS as i64]);

    let current = f64_tensor(&x.current).set_requires_grad(true);
    let out = decoupled_ppo_loss(
        &TokenInputs {
            behaviour: &behaviour,
            current: &current,
            proximal: proximal.as_ref(),
            advantages: &advantages,
            versions: &versions,
            mask: &mask,
            reference: reference.as_ref(),
        },
        VERSION,
        &cfg,
    )
    .expect("the objective");
    out.loss.backward();
    let grad = matrix(&current.grad());

    // The same mini-batch as two micro-batches of one plan.
    let detached = current.detach();
    let plan = ObjectivePlan::new(
        &PlanInputs {
            behaviour: &behaviour,
            proximal: proximal.as_ref(),
            current: Some(&detached),
            advantages: &advantages,
            versions: &versions,
            mask: &mask,
            reference: reference.as_ref(),
        },
        VERSION,
        &cfg,
    )
    .expect("a plan");
    let mut micro_losses = Vec::new();
    for rows in MICRO_BATCHES {
        let idx = Tensor::from_slice(rows);
        let part = plan
            .loss(Some(&idx), &detached.index_select(0, &idx))
            .expect("a micro-batch loss");
        micro_losses.push(part.loss.double_value(&[]));
    }

    let name = match (correction, kl) {
        (_, Some(k)) => format!(
            "{}-{}-{}-kl-{}",
            clip.as_str(),
            proximal_name(mode),
            aggregation_name(aggregation),
            k.as_str()
        ),
        (ImportanceCorrection::Mask, None) => format!(
            "{}-{}-{}",
            clip.as_str(),
            proximal_name(mode),
            aggregation_name(aggregation)
        ),
        _ => format!(
            "{}-{}-{}-{}",
            clip.as_str(),
            correction.as_str(),
            proximal_name(mode),
            aggregation_name(aggregation)
        ),
    };
    json!({
        "name": if dual_clip > 0.0 { format!("{name}-dual-clip") } else { name },
        "config": {
            "eps_low": cfg.eps_low,
            "eps_high": cfg.eps_high,
            "clip_mode": cfg.clip_mode.as_str(),
            "importance_weight_cap": cfg.importance_weight_cap,
            "importance_correction": cfg.importance_correction.as_str(),
            "importance_weight_floor": cfg.importance_weight_floor,
            "adaptive_quantile": cfg.adaptive_quantile,
            "adaptive_temperature": cfg.adaptive_temperature,
            "m2po_threshold": cfg.m2po_threshold,
            "aggregation": aggregation_name(cfg.aggregation),
            "kl_coef": cfg.kl_coef,
            "kl_estimator": cfg.kl_estimator.as_str(),
            "dual_clip": cfg.dual_clip,
        },
        "proximal_mode": proximal_name(mode),
        "learner_version": VERSION,
        "inputs": {
            "behaviour": x.behaviour,
            "proximal": proximal.as_ref().map(matrix),
            "current": x.current,
            "advantages": x.advantages,
            "versions": x.versions,
            "mask": x.mask,
            "reference": reference_rows,
        },
        "loss": out.loss.double_value(&[]),
        "stats": stats_json(&out.stats),
        "grad_current": grad,
        "micro_batches": MICRO_BATCHES,
        "micro_losses": micro_losses,
    })
}

fn generate() -> Value {
    let mut cases = Vec::new();
    let mut seed = 1;
    for clip in ClipMode::ALL {
        for proximal in [
            ProximalMode::Recompute,
            ProximalMode::Approx,
            ProximalMode::Behaviour,
        ] {
            for aggregation in [LossAggregation::Token, LossAggregation::Sequence] {
                cases.push(case(Spec::new(clip, proximal, aggregation), seed));
                seed += 1;
            }
        }
    }
    for correction in [ImportanceCorrection::Truncate, ImportanceCorrection::Icepop] {
        for clip in [ClipMode::Ppo, ClipMode::M2po, ClipMode::Gspo] {
            for proximal in [ProximalMode::Recompute, ProximalMode::Approx] {
                for aggregation in [LossAggregation::Token, LossAggregation::Sequence] {
                    let spec = Spec {
                        correction,
                        ..Spec::new(clip, proximal, aggregation)
                    };
                    cases.push(case(spec, seed));
                    seed += 1;
                }
            }
        }
    }
    for estimator in [KlEstimator::K1, KlEstimator::K3] {
        for (clip, proximal, aggregation) in [
            (
                ClipMode::Ppo,
                ProximalMode::Recompute,
                LossAggregation::Token,
            ),
            (
                ClipMode::Gspo,
                ProximalMode::Approx,
                LossAggregation::Sequence,
            ),
            (ClipMode::M2po, ProximalMode::Approx, LossAggregation::Token),
        ] {
            let spec = Spec {
                kl: Some(estimator),
                ..Spec::new(clip, proximal, aggregation)
            };
            cases.push(case(spec, seed));
            seed += 1;
        }
    }
    // Dual clip, with a bound just above each mode's upper clip bound, on
    // seeds of their own whose rows with a negative advantage have ratios
    // (within about exp(±0.35) of the proximal ones, more for fresh tokens
    // under approx) above it: it acts in every one of these cases.
    for (clip, proximal, aggregation, correction, bound, seed) in [
        (
            ClipMode::Ppo,
            ProximalMode::Recompute,
            LossAggregation::Token,
            ImportanceCorrection::Mask,
            1.3,
            61,
        ),
        (
            ClipMode::Adaptive,
            ProximalMode::Approx,
            LossAggregation::Token,
            ImportanceCorrection::Mask,
            1.3,
            62,
        ),
        (
            ClipMode::M2po,
            ProximalMode::Behaviour,
            LossAggregation::Sequence,
            ImportanceCorrection::Mask,
            1.3,
            64,
        ),
        (
            ClipMode::Gspo,
            ProximalMode::Approx,
            LossAggregation::Sequence,
            ImportanceCorrection::Truncate,
            1.05,
            69,
        ),
    ] {
        let spec = Spec {
            correction,
            dual_clip: bound,
            ..Spec::new(clip, proximal, aggregation)
        };
        cases.push(case(spec, seed));
    }
    json!({
        "about": "asyncrl's learner objective (learner/src/objective.rs) on seeded inputs; written by learner/tests/objective_vectors.rs (ASYNCRL_WRITE_VECTORS=1), checked by it and by trainer/tests/test_objective.py",
        "rows": ROWS,
        "tokens": TOKENS,
        "cases": cases,
    })
}

/// Every number of `got` within `tol` of `want` (relative for large
/// values), and the same structure; the first difference, by path.
fn compare(path: &str, got: &Value, want: &Value, tol: f64) -> Result<(), String> {
    match (got, want) {
        (Value::Number(g), Value::Number(w)) => {
            let (g, w) = (
                g.as_f64().unwrap_or(f64::NAN),
                w.as_f64().unwrap_or(f64::NAN),
            );
            if (g - w).abs() <= tol * w.abs().max(1.0) {
                Ok(())
            } else {
                Err(format!("{path}: {g} (now) vs {w} (in the file)"))
            }
        }
        (Value::Array(g), Value::Array(w)) if g.len() == w.len() => g
            .iter()
            .zip(w)
            .enumerate()
            .try_for_each(|(i, (g, w))| compare(&format!("{path}[{i}]"), g, w, tol)),
        (Value::Object(g), Value::Object(w)) if g.len() == w.len() => {
            g.iter().try_for_each(|(k, gv)| match w.get(k) {
                Some(wv) => compare(&format!("{path}.{k}"), gv, wv, tol),
                None => Err(format!("{path}.{k}: not in the file")),
            })
        }
        _ if got == want => Ok(()),
        _ => Err(format!("{path}: {got} (now) vs {want} (in the file)")),
    }
}

#[test]
fn the_checked_in_vectors_are_what_the_objective_computes() {
    let now = generate();
    let path = vectors_path();
    if std::env::var_os("ASYNCRL_WRITE_VECTORS").is_some() {
        let text = serde_json::to_string_pretty(&now).expect("JSON");
        std::fs::write(&path, text + "\n").expect("write the vectors");
        return;
    }
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (write it with ASYNCRL_WRITE_VECTORS=1)",
            path.display()
        )
    });
    let file: Value = serde_json::from_str(&text).expect("the vectors are JSON");
    if let Err(diff) = compare("", &now, &file, 1e-12) {
        panic!(
            "{} is not what the objective computes now: {diff}. After an intended change, regenerate it (ASYNCRL_WRITE_VECTORS=1) and make the torch engine agree.",
            path.display()
        );
    }
}

#[test]
fn the_vectors_exercise_every_branch() {
    let v = generate();
    let cases = v["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 4 * 3 * 2 + 2 * 3 * 2 * 2 + 2 * 3 + 4);
    // Dual clip acts in each of its cases (and in no other).
    for c in cases {
        let dual = c["stats"]["dual_clip_fraction"]
            .as_f64()
            .unwrap_or(f64::NAN);
        if c["config"]["dual_clip"].as_f64().unwrap_or(0.0) > 0.0 {
            assert!(dual > 0.0, "{}: dual_clip_fraction {dual}", c["name"]);
        } else {
            assert_eq!(dual, 0.0, "{}", c["name"]);
        }
    }
    // A KL case has a KL to its reference; the others none.
    for c in cases {
        let kl = c["stats"]["kl_ref"].as_f64().unwrap_or(f64::NAN);
        if c["config"]["kl_coef"].as_f64().unwrap_or(0.0) > 0.0 {
            assert!(kl != 0.0 && kl.is_finite(), "{}: kl_ref {kl}", c["name"]);
        } else {
            assert_eq!(kl, 0.0, "{}", c["name"]);
        }
    }
    // Each objective (clip mode, correction) meets every branch it has.
    for (clip, correction, keys) in [
        (
            "ppo",
            "mask",
            &[
                "clip_low_fraction",
                "clip_high_fraction",
                "weight_masked_fraction",
            ][..],
        ),
        (
            "adaptive",
            "mask",
            &[
                "clip_low_fraction",
                "clip_high_fraction",
                "weight_masked_fraction",
            ][..],
        ),
        (
            "m2po",
            "mask",
            &[
                "clip_low_fraction",
                "clip_high_fraction",
                "weight_masked_fraction",
                "m2po_masked_fraction",
            ][..],
        ),
        (
            "gspo",
            "mask",
            &[
                "clip_low_fraction",
                "clip_high_fraction",
                "weight_masked_fraction",
            ][..],
        ),
        ("ppo", "truncate", &["weight_masked_fraction"][..]),
        (
            "gspo",
            "truncate",
            &[
                "clip_low_fraction",
                "clip_high_fraction",
                "weight_masked_fraction",
            ][..],
        ),
        ("ppo", "icepop", &["weight_masked_fraction"][..]),
        (
            "m2po",
            "icepop",
            &["weight_masked_fraction", "m2po_masked_fraction"][..],
        ),
        ("gspo", "icepop", &["weight_masked_fraction"][..]),
    ] {
        for key in keys {
            assert!(
                cases.iter().any(|c| c["config"]["clip_mode"] == clip
                    && c["config"]["importance_correction"] == correction
                    && c["stats"][*key].as_f64().unwrap_or(0.0) > 0.0),
                "no {clip}/{correction} case has {key} > 0"
            );
        }
    }
    for c in cases {
        // Micro-batches that partition the rows sum to the whole loss.
        let sum: f64 = c["micro_losses"]
            .as_array()
            .expect("micro losses")
            .iter()
            .filter_map(Value::as_f64)
            .sum();
        let loss = c["loss"].as_f64().expect("loss");
        assert!((sum - loss).abs() < 1e-12, "{}: {sum} vs {loss}", c["name"]);
        // The row without a valid token has no gradient.
        let grad = &c["grad_current"][2];
        assert!(
            grad.as_array()
                .expect("a row")
                .iter()
                .all(|g| g.as_f64() == Some(0.0)),
            "{}",
            c["name"]
        );
    }
}
