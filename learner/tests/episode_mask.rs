//! Multi-turn episodes: the context tokens of an episode (the environment's
//! replies and the chat template's scaffolding) are in the learner's rows
//! but out of everything it computes. Property: the objective of a batch
//! with context tokens masked equals the objective computed on the model
//! tokens alone (loss, statistics and gradient), for every clip mode,
//! aggregation and proximal mode, whatever values the context positions
//! hold. And `assemble` masks exactly the context tokens of an episode read
//! from Arrow.

use asyncrl_learner::advantages::AdvantageNorm;
use asyncrl_learner::batch::assemble;
use asyncrl_learner::objective::{
    ClipMode, LossAggregation, ObjectiveConfig, TokenInputs, decoupled_ppo_loss,
};
use asyncrl_protos::arrow_schema::to_record_batch;
use asyncrl_protos::v1::{FinishReason, RewardStatus, Trajectory, Turn};
use proptest::prelude::*;
use tch::Tensor;

/// One token of a generated row: a model token (log-probs, version) or a
/// context token (garbage everywhere, masked).
#[derive(Debug, Clone)]
struct Tok {
    model: bool,
    behaviour: f64,
    current: f64,
    version: i64,
}

fn token() -> impl Strategy<Value = Tok> {
    (
        proptest::bool::weighted(0.6),
        -6.0f64..0.0,
        -0.8f64..0.8,
        0i64..4,
        -50.0f64..50.0,
    )
        .prop_map(|(model, b, shift, v, garbage)| {
            if model {
                Tok {
                    model,
                    behaviour: b,
                    current: (b + shift).min(0.0),
                    version: v,
                }
            } else {
                // A context position: values no model token could have.
                Tok {
                    model,
                    behaviour: garbage,
                    current: -garbage.abs(),
                    version: 1000 + v,
                }
            }
        })
}

struct Rows {
    behaviour: Tensor,
    current: Tensor,
    advantages: Tensor,
    versions: Tensor,
    mask: Tensor,
}

/// `[N, T]` tensors of `rows` (right-padded, padding masked). With
/// `model_only`, context tokens are left out (the row compacted).
fn tensors(rows: &[(Vec<Tok>, f64)], model_only: bool) -> Rows {
    let kept: Vec<Vec<&Tok>> = rows
        .iter()
        .map(|(r, _)| r.iter().filter(|t| t.model || !model_only).collect())
        .collect();
    let n = rows.len();
    let t = kept.iter().map(Vec::len).max().unwrap_or(1).max(1);
    let (mut b, mut c, mut a, mut v, mut m) = (
        vec![0f64; n * t],
        vec![0f64; n * t],
        vec![0f64; n * t],
        vec![0i64; n * t],
        vec![false; n * t],
    );
    for (i, row) in kept.iter().enumerate() {
        for (j, tok) in row.iter().enumerate() {
            let at = i * t + j;
            b[at] = tok.behaviour;
            c[at] = tok.current;
            a[at] = if tok.model { rows[i].1 } else { 77.0 };
            v[at] = tok.version;
            m[at] = tok.model;
        }
    }
    let shape = [n as i64, t as i64];
    Rows {
        behaviour: Tensor::from_slice(&b).view(shape),
        current: Tensor::from_slice(&c).view(shape).set_requires_grad(true),
        advantages: Tensor::from_slice(&a).view(shape),
        versions: Tensor::from_slice(&v).view(shape),
        mask: Tensor::from_slice(&m).view(shape),
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * (1.0 + a.abs().max(b.abs()))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn the_objective_with_context_tokens_masked_equals_the_objective_on_model_tokens_alone(
        rows in proptest::collection::vec(
            (proptest::collection::vec(token(), 1..12), -2.0f64..2.0), 1..6),
        proximal_from_behaviour in proptest::bool::ANY,
    ) {
        for clip_mode in ClipMode::ALL {
            for aggregation in [LossAggregation::Token, LossAggregation::Sequence] {
                // With a KL loss too: a context token carries none of it.
                let cfg = ObjectiveConfig { clip_mode, aggregation, kl_coef: 0.2, ..Default::default() };
                let full = tensors(&rows, false);
                let alone = tensors(&rows, true);
                let run = |r: &Rows| {
                    let proximal = proximal_from_behaviour.then(|| (&r.behaviour * 0.9).detach());
                    let reference = (r.current.detach() * 1.1 - 0.05).detach();
                    let inputs = TokenInputs {
                        behaviour: &r.behaviour,
                        current: &r.current,
                        proximal: proximal.as_ref(),
                        advantages: &r.advantages,
                        versions: &r.versions,
                        mask: &r.mask,
                        reference: Some(&reference),
                    };
                    let out = decoupled_ppo_loss(&inputs, 4, &cfg).unwrap();
                    out.loss.backward();
                    (out.loss.double_value(&[]), out.stats)
                };
                let (loss_full, stats_full) = run(&full);
                let (loss_alone, stats_alone) = run(&alone);
                let what = format!("{clip_mode:?}/{aggregation:?}");
                prop_assert!(close(loss_full, loss_alone), "{}: loss {} vs {}", what, loss_full, loss_alone);
                prop_assert_eq!(stats_full.tokens, stats_alone.tokens, "{}", what);
                for (name, x, y) in [
                    ("clip_low", stats_full.clip_low_fraction, stats_alone.clip_low_fraction),
                    ("clip_high", stats_full.clip_high_fraction, stats_alone.clip_high_fraction),
                    ("weight_masked", stats_full.weight_masked_fraction, stats_alone.weight_masked_fraction),
                    ("m2po_masked", stats_full.m2po_masked_fraction, stats_alone.m2po_masked_fraction),
                    ("kl_ref", stats_full.kl_ref, stats_alone.kl_ref),
                ] {
                    prop_assert!(close(x, y), "{}: {} {} vs {}", what, name, x, y);
                }
                // The gradient: the same at every model token, 0 at every
                // context token.
                let g_full = full.current.grad();
                let g_alone = alone.current.grad();
                let t_full = full.current.size()[1];
                let t_alone = alone.current.size()[1];
                let gf = Vec::<f64>::try_from(g_full.view([-1])).unwrap();
                let ga = Vec::<f64>::try_from(g_alone.view([-1])).unwrap();
                for (i, (row, _)) in rows.iter().enumerate() {
                    let mut k = 0usize;
                    for (j, tok) in row.iter().enumerate() {
                        let g = gf[i * t_full as usize + j];
                        if tok.model {
                            let want = ga[i * t_alone as usize + k];
                            prop_assert!(close(g, want), "{}: gradient of row {} token {}: {} vs {}", what, i, j, g, want);
                            k += 1;
                        } else {
                            prop_assert_eq!(g, 0.0, "{}: a context token has a gradient", what);
                        }
                    }
                }
            }
        }
    }
}

/// An episode of two turns: 2 model tokens, 3 context tokens, 2 model
/// tokens.
fn episode(i: u128, group: &str, reward: f32) -> Trajectory {
    Trajectory {
        uuid: uuid::Uuid::from_u128(i + 1).to_string(),
        task_id: format!("task-{group}"),
        group_id: group.into(),
        prompt_token_ids: vec![1, 5, 6],
        completion_token_ids: vec![10, 11, 20, 21, 22, 12, 2],
        behaviour_logprobs: vec![-0.5, -0.25, -1.0, -0.125],
        policy_versions: vec![3, 3, 4, 4],
        reward,
        reward_status: RewardStatus::Ok as i32,
        finish_reason: FinishReason::Stop as i32,
        worker_id: "w".into(),
        timings: None,
        group_size: 2,
        index_in_group: (i % 2) as u32,
        admission_version: 3,
        turns: vec![
            Turn {
                context_tokens: 0,
                model_tokens: 2,
                reward: None,
            },
            Turn {
                context_tokens: 3,
                model_tokens: 2,
                reward: Some(reward),
            },
        ],
    }
}

#[test]
fn assemble_masks_exactly_the_context_tokens_of_an_episode() {
    let batch = to_record_batch(&[episode(0, "g", 1.0), episode(1, "g", 0.0)]).unwrap();
    let b = assemble(&[batch], 0, AdvantageNorm::default()).unwrap();
    let mask = Vec::<bool>::try_from(b.mask.view([-1])).unwrap();
    let row = [true, true, false, false, false, true, true];
    assert_eq!(mask, [row, row].concat());
    assert_eq!(b.tokens, 8);
    let behaviour = Vec::<f32>::try_from(b.behaviour.view([-1])).unwrap();
    assert_eq!(&behaviour[..7], &[-0.5, -0.25, 0.0, 0.0, 0.0, -1.0, -0.125]);
    let versions = Vec::<i64>::try_from(b.versions.view([-1])).unwrap();
    assert_eq!(&versions[..7], &[3, 3, 0, 0, 0, 4, 4]);
    assert_eq!(b.min_version, 3);
    // The whole episode is in the row: prompt, model and context tokens.
    let ids = Vec::<i64>::try_from(b.input_ids.view([-1])).unwrap();
    assert_eq!(&ids[..10], &[1, 5, 6, 10, 11, 20, 21, 22, 12, 2]);
}
