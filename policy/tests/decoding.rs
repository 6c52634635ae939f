//! KV-cached decoding against full forward passes, sampling semantics, and
//! weight swaps between decoding steps.

mod common;

use std::collections::HashMap;

use asyncrl_policy::{
    DecodeBatch, DecodeBatchOptions, DeviceOptions, FinishReason, ModelType, Policy,
    SamplingParams, SequenceRequest, TinyModelSpec, WeightDtype, generate, sequence_logprobs,
    token_logprobs,
};
use common::{full_logits, ids, max_abs_diff, max_abs_diff_slices, random_policy};
use tch::Tensor;

const TOL: f64 = 1e-4;

fn request(prompt: Vec<i64>, params: SamplingParams) -> SequenceRequest {
    SequenceRequest { prompt, params }
}

fn sampled(max_new_tokens: usize, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        max_new_tokens,
        seed: Some(seed),
        ..SamplingParams::default()
    }
}

/// Runs requests through one batch (fewer slots than requests, so that slots
/// are reused and rows are not contiguous), keeping the logits of every step.
fn run_keeping_logits(
    policy: &Policy,
    requests: Vec<SequenceRequest>,
    max_slots: usize,
) -> (
    Vec<asyncrl_policy::SequenceOutput>,
    HashMap<u64, Vec<Tensor>>,
) {
    let mut batch = DecodeBatch::new(
        policy,
        DecodeBatchOptions {
            max_slots,
            max_seq_len: 64,
        },
    )
    .unwrap();
    batch.keep_logits(true);
    let mut queue: std::collections::VecDeque<_> = requests.into();
    let mut logits: HashMap<u64, Vec<Tensor>> = HashMap::new();
    let mut done = Vec::new();
    while !(queue.is_empty() && batch.is_empty()) {
        // add at most one sequence per step so that prefill and decoding
        // rows mix
        if batch.free_slots() > 0
            && let Some(r) = queue.pop_front()
        {
            batch.add(r).unwrap();
        }
        let out = batch.step(policy).unwrap();
        for (id, l) in out.logits {
            logits.entry(id).or_default().push(l);
        }
        done.extend(out.finished);
    }
    done.sort_by_key(|o| o.id);
    (done, logits)
}

#[test]
fn policy_and_decode_batch_can_move_between_threads() {
    fn is_send<T: Send>() {}
    is_send::<Policy>();
    is_send::<DecodeBatch>();
    is_send::<asyncrl_policy::ModelHandle>();
    fn is_sync<T: Sync>() {}
    is_sync::<asyncrl_policy::ModelHandle>();
}

#[test]
fn kv_cached_decoding_equals_full_forward() {
    for (model_type, tied) in [(ModelType::Qwen2, false), (ModelType::Llama, true)] {
        let policy = random_policy(model_type, tied, 7);
        let requests: Vec<_> = [5usize, 1, 9, 3, 12]
            .iter()
            .enumerate()
            .map(|(i, &len)| request(ids(i as u64, len, 61), sampled(6 + i, 100 + i as u64)))
            .collect();
        let (outputs, logits) = run_keeping_logits(&policy, requests, 3);
        assert_eq!(outputs.len(), 5);
        for o in &outputs {
            let steps = &logits[&o.id];
            assert_eq!(steps.len(), o.tokens.len());
            let mut all = o.prompt.clone();
            all.extend(&o.tokens);
            let full = full_logits(&policy, &all[..all.len() - 1]);
            for (i, step_logits) in steps.iter().enumerate() {
                let pos = o.prompt.len() - 1 + i;
                let d = max_abs_diff(step_logits, &full.get(pos as i64));
                assert!(
                    d <= TOL,
                    "{model_type:?} seq {} pos {pos}: max diff {d}",
                    o.id
                );
            }
        }
    }
}

#[test]
fn padded_batches_match_unpadded_sequences() {
    let policy = random_policy(ModelType::Qwen2, false, 3);
    let seqs = [ids(1, 7, 61), ids(2, 3, 61), ids(3, 5, 61)];
    let t = 7;
    for left in [false, true] {
        let mut flat = Vec::new();
        let mut mask = Vec::new();
        for s in &seqs {
            let pad = t - s.len();
            let (ids_row, mask_row): (Vec<i64>, Vec<i64>) = if left {
                (
                    std::iter::repeat_n(0, pad)
                        .chain(s.iter().copied())
                        .collect(),
                    std::iter::repeat_n(0, pad)
                        .chain(std::iter::repeat_n(1, s.len()))
                        .collect(),
                )
            } else {
                (
                    s.iter()
                        .copied()
                        .chain(std::iter::repeat_n(0, pad))
                        .collect(),
                    std::iter::repeat_n(1, s.len())
                        .chain(std::iter::repeat_n(0, pad))
                        .collect(),
                )
            };
            flat.extend(ids_row);
            mask.extend(mask_row);
        }
        let input = Tensor::from_slice(&flat).reshape([3, t as i64]);
        let mask = Tensor::from_slice(&mask).reshape([3, t as i64]);
        let batched = tch::no_grad(|| policy.forward(&input, Some(&mask))).unwrap();
        for (b, s) in seqs.iter().enumerate() {
            let alone = full_logits(&policy, s);
            let off = if left { (t - s.len()) as i64 } else { 0 };
            let got = batched.get(b as i64).narrow(0, off, s.len() as i64);
            let d = max_abs_diff(&got, &alone);
            assert!(d <= TOL, "left={left} row {b}: {d}");
        }
    }
}

#[test]
fn packed_rows_match_unpacked_sequences() {
    // Lane 0 holds three sequences and two padding positions, lane 1 one
    // sequence that fills it; two neighbours share a token id at their
    // border, and a one-token sequence sits between others.
    let seqs = [ids(1, 5, 61), ids(2, 1, 61), ids(3, 4, 61), ids(4, 12, 61)];
    let lanes: [&[usize]; 2] = [&[0, 1, 2], &[3]];
    let t = 12usize;
    for (model_type, tied) in [(ModelType::Qwen2, false), (ModelType::Llama, true)] {
        let policy = random_policy(model_type, tied, 5);
        let mut flat = Vec::new();
        let mut segments = Vec::new();
        for lane in lanes {
            let mut used = 0;
            for (k, s) in lane.iter().enumerate() {
                flat.extend(&seqs[*s]);
                segments.extend(std::iter::repeat_n(k as i64 + 1, seqs[*s].len()));
                used += seqs[*s].len();
            }
            flat.extend(std::iter::repeat_n(7i64, t - used));
            segments.extend(std::iter::repeat_n(0i64, t - used));
        }
        let input = Tensor::from_slice(&flat).reshape([2, t as i64]);
        let segments = Tensor::from_slice(&segments).reshape([2, t as i64]);
        let packed = tch::no_grad(|| policy.forward_packed(&input, &segments)).unwrap();
        for (l, lane) in lanes.iter().enumerate() {
            let mut off = 0;
            for s in *lane {
                let alone = full_logits(&policy, &seqs[*s]);
                let n = seqs[*s].len() as i64;
                let got = packed.get(l as i64).narrow(0, off, n);
                let d = max_abs_diff(&got, &alone);
                assert!(d <= 1e-5, "{model_type:?} lane {l} sequence {s}: {d}");
                off += n;
            }
        }
        // A mask of the wrong shape is refused, naming it.
        let bad = Tensor::zeros([2, 3], (tch::Kind::Int64, tch::Device::Cpu));
        let err = policy.forward_packed(&input, &bad).unwrap_err();
        assert!(err.to_string().contains("segments"), "{err}");
    }
}

#[test]
fn shared_prefix_lanes_match_unpacked_sequences() {
    // One lane: a prefix of 4 tokens, two continuations of it (3 and 2
    // tokens), then an unshared sequence of 3, then padding. Each token
    // must get its own sequence's logits: prefix + continuation alone.
    let prefix = ids(1, 4, 61);
    let (a, b, solo) = (ids(2, 3, 61), ids(3, 2, 61), ids(4, 3, 61));
    let t = 14i64;
    let mut flat: Vec<i64> = [&prefix[..], &a, &b, &solo].concat();
    let mut positions: Vec<i64> = [
        (0..4).collect::<Vec<i64>>(),
        (4..7).collect(),
        (4..6).collect(),
        (0..3).collect(),
    ]
    .concat();
    let mut segments: Vec<i64> = [vec![1; 4], vec![2; 3], vec![3; 2], vec![4; 3]].concat();
    let mut parents: Vec<i64> = [vec![0; 4], vec![1; 3], vec![1; 2], vec![0; 3]].concat();
    let pad = t as usize - flat.len();
    flat.extend(std::iter::repeat_n(7i64, pad));
    positions.extend(std::iter::repeat_n(0i64, pad));
    segments.extend(std::iter::repeat_n(0i64, pad));
    parents.extend(std::iter::repeat_n(0i64, pad));
    let lane = |v: &[i64]| Tensor::from_slice(v).reshape([1, t]);
    for (model_type, tied) in [(ModelType::Qwen2, false), (ModelType::Llama, true)] {
        let policy = random_policy(model_type, tied, 5);
        let lanes = asyncrl_policy::SharedLanes {
            positions: lane(&positions),
            segments: lane(&segments),
            parents: lane(&parents),
        };
        let shared = tch::no_grad(|| policy.forward_shared(&lane(&flat), &lanes)).unwrap();
        let row = shared.get(0);
        let with_a = full_logits(&policy, &[&prefix[..], &a].concat());
        let with_b = full_logits(&policy, &[&prefix[..], &b].concat());
        let alone = full_logits(&policy, &solo);
        for (what, got, want) in [
            ("prefix", row.narrow(0, 0, 4), with_a.narrow(0, 0, 4)),
            (
                "continuation a",
                row.narrow(0, 4, 3),
                with_a.narrow(0, 4, 3),
            ),
            (
                "continuation b",
                row.narrow(0, 7, 2),
                with_b.narrow(0, 4, 2),
            ),
            ("unshared", row.narrow(0, 9, 3), alone),
        ] {
            let d = max_abs_diff(&got, &want);
            assert!(d <= 1e-5, "{model_type:?} {what}: {d}");
        }
        // Continuation b must not see a's tokens: a forward that lets it
        // (b as a's continuation) differs.
        let leaked = full_logits(&policy, &[&prefix[..], &a, &b].concat());
        assert!(max_abs_diff(&row.narrow(0, 7, 2), &leaked.narrow(0, 7, 2)) > 1e-3);
        // Tensors of the wrong shape are refused, naming them.
        let bad = asyncrl_policy::SharedLanes {
            positions: lane(&positions),
            segments: lane(&segments),
            parents: Tensor::zeros([1, 3], (tch::Kind::Int64, tch::Device::Cpu)),
        };
        let err = policy.forward_shared(&lane(&flat), &bad).unwrap_err();
        assert!(err.to_string().contains("parents"), "{err}");
    }
}

#[test]
fn greedy_is_deterministic_and_follows_the_argmax() {
    let policy = random_policy(ModelType::Llama, false, 11);
    let prompts = [ids(5, 4, 61), ids(6, 8, 61)];
    let greedy = |p: &SamplingParams| {
        generate(
            &policy,
            prompts
                .iter()
                .map(|x| request(x.clone(), p.clone()))
                .collect(),
            DecodeBatchOptions {
                max_slots: 2,
                max_seq_len: 64,
            },
        )
        .unwrap()
    };
    let a = greedy(&SamplingParams::greedy(10));
    let b = greedy(&SamplingParams::greedy(10));
    // top_k = 1 at temperature 1 is greedy too, whatever the seed
    let c = greedy(&SamplingParams {
        top_k: 1,
        max_new_tokens: 10,
        seed: Some(99),
        ..SamplingParams::default()
    });
    for ((x, y), z) in a.iter().zip(&b).zip(&c) {
        assert_eq!(x.tokens, y.tokens);
        assert_eq!(x.tokens, z.tokens);
        assert_eq!(x.tokens.len(), 10);
        assert_eq!(x.finish_reason, FinishReason::MaxNewTokens);
        let mut all = x.prompt.clone();
        all.extend(&x.tokens);
        let full = full_logits(&policy, &all[..all.len() - 1]);
        for (i, &tok) in x.tokens.iter().enumerate() {
            let pos = (x.prompt.len() - 1 + i) as i64;
            assert_eq!(full.get(pos).argmax(0, false).int64_value(&[]), tok);
        }
    }
}

#[test]
fn seeded_sampling_does_not_depend_on_the_batch() {
    let policy = random_policy(ModelType::Qwen2, true, 5);
    let opts = DecodeBatchOptions {
        max_slots: 4,
        max_seq_len: 64,
    };
    let target = request(ids(9, 6, 61), sampled(12, 1234));
    let alone = generate(&policy, vec![target.clone()], opts).unwrap();
    let others: Vec<_> = (0..3)
        .map(|i| request(ids(20 + i, 3 + i as usize, 61), sampled(5, i)))
        .collect();
    let mut mixed = others.clone();
    mixed.insert(1, target);
    let together = generate(&policy, mixed, opts).unwrap();
    assert_eq!(alone[0].tokens, together[1].tokens);
    assert!(max_abs_diff_slices(&alone[0].logprobs, &together[1].logprobs) <= TOL);
    // a different seed gives a different sequence (12 tokens over 61)
    let other_seed = generate(
        &policy,
        vec![request(ids(9, 6, 61), sampled(12, 4321))],
        opts,
    )
    .unwrap();
    assert_ne!(alone[0].tokens, other_seed[0].tokens);
}

#[test]
fn stop_tokens_end_sequences_and_limits_hold() {
    let policy = random_policy(ModelType::Llama, true, 13);
    let prompt = ids(4, 5, 61);
    let first = generate(
        &policy,
        vec![request(prompt.clone(), SamplingParams::greedy(8))],
        DecodeBatchOptions::default(),
    )
    .unwrap();
    let stop = first[0].tokens[2];
    let stopped = generate(
        &policy,
        vec![request(
            prompt.clone(),
            SamplingParams {
                stop_token_ids: vec![stop],
                ..SamplingParams::greedy(8)
            },
        )],
        DecodeBatchOptions::default(),
    )
    .unwrap();
    let expected_len = first[0].tokens.iter().position(|&t| t == stop).unwrap() + 1;
    assert_eq!(stopped[0].finish_reason, FinishReason::Stop);
    assert_eq!(stopped[0].tokens, first[0].tokens[..expected_len].to_vec());
    assert_eq!(stopped[0].logprobs.len(), expected_len);

    // max_new_tokens for every sequence, with sampling; max_seq_len caps the total
    let outs = generate(
        &policy,
        (0..5)
            .map(|i| request(ids(i, 3, 61), sampled(i as usize * 3, i)))
            .collect(),
        DecodeBatchOptions {
            max_slots: 2,
            max_seq_len: 10,
        },
    )
    .unwrap();
    for (i, o) in outs.iter().enumerate() {
        let want = (i * 3).min(10 - 3);
        assert_eq!(o.tokens.len(), want, "sequence {i}");
        assert_eq!(o.logprobs.len(), want);
        assert_eq!(o.versions, vec![0; want]);
        let reason = if i * 3 <= 7 {
            FinishReason::MaxNewTokens
        } else {
            FinishReason::MaxSeqLen
        };
        assert_eq!(o.finish_reason, reason, "sequence {i}");
    }
    // invalid requests are refused
    let mut batch = DecodeBatch::new(
        &policy,
        DecodeBatchOptions {
            max_slots: 1,
            max_seq_len: 4,
        },
    )
    .unwrap();
    assert!(
        batch
            .add(request(vec![], SamplingParams::default()))
            .is_err()
    );
    assert!(
        batch
            .add(request(vec![1; 4], SamplingParams::default()))
            .is_err()
    );
    assert!(
        batch
            .add(request(vec![61], SamplingParams::default()))
            .is_err(),
        "id >= vocab"
    );
    assert!(
        batch
            .add(request(vec![-1], SamplingParams::default()))
            .is_err(),
        "negative id"
    );
    let bad_top_p = SamplingParams {
        top_p: 0.0,
        ..SamplingParams::default()
    };
    assert!(batch.add(request(vec![1], bad_top_p)).is_err());
    batch
        .add(request(vec![1], SamplingParams::default()))
        .unwrap();
    assert!(
        batch
            .add(request(vec![1], SamplingParams::default()))
            .is_err(),
        "no free slot"
    );
}

#[test]
fn returned_logprobs_equal_token_logprobs_of_a_full_forward() {
    let policy = random_policy(ModelType::Qwen2, false, 17);
    for (temperature, top_p, top_k) in [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 0.8, 5), (0.0, 1.0, 0)]
    {
        let outs = generate(
            &policy,
            (0..4)
                .map(|i| {
                    request(
                        ids(30 + i, 2 + 3 * i as usize, 61),
                        SamplingParams {
                            temperature,
                            top_p,
                            top_k,
                            max_new_tokens: 9,
                            seed: Some(i),
                            ..SamplingParams::default()
                        },
                    )
                })
                .collect(),
            DecodeBatchOptions {
                max_slots: 3,
                max_seq_len: 64,
            },
        )
        .unwrap();
        let seqs: Vec<Vec<i64>> = outs
            .iter()
            .map(|o| o.prompt.iter().chain(&o.tokens).copied().collect())
            .collect();
        let full = sequence_logprobs(&policy, &seqs, temperature).unwrap();
        for (o, lp) in outs.iter().zip(&full) {
            let completion = &lp[o.prompt.len() - 1..];
            let d = max_abs_diff_slices(&o.logprobs, completion);
            assert!(d <= TOL, "temperature {temperature}: {d}");
        }
    }
    // token_logprobs on a tensor batch agrees and has gradients
    let ids_t = Tensor::from_slice(&ids(1, 6, 61)).reshape([1, 6]);
    let lp = token_logprobs(&policy, &ids_t, None, 0.7).unwrap();
    assert_eq!(lp.size(), vec![1, 5]);
    assert!(lp.requires_grad());
    let seq_lp = sequence_logprobs(&policy, &[ids(1, 6, 61)], 0.7).unwrap();
    let lp_vec = Vec::<f32>::try_from(lp.detach().squeeze_dim(0)).unwrap();
    assert!(max_abs_diff_slices(&lp_vec, &seq_lp[0]) <= TOL);
}

#[test]
fn top_p_never_samples_outside_the_nucleus() {
    let policy = random_policy(ModelType::Llama, false, 23);
    let prompt = ids(77, 5, 61);
    let temperature = 0.5;
    let top_p = 0.6;
    // the next-token distribution after the prompt, and its nucleus
    let logits = full_logits(&policy, &prompt).get(4);
    let probs =
        Vec::<f64>::try_from((logits / temperature).softmax(-1, tch::Kind::Double)).unwrap();
    let mut order: Vec<usize> = (0..probs.len()).collect();
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
    let mut nucleus = Vec::new();
    let mut mass = 0.0;
    for &t in &order {
        if mass >= top_p {
            break;
        }
        nucleus.push(t);
        mass += probs[t];
    }
    assert!(
        nucleus.len() >= 2 && nucleus.len() < probs.len() / 2,
        "nucleus {nucleus:?}"
    );
    let n = 600;
    let draw = |top_p: f64| -> Vec<usize> {
        let outs = generate(
            &policy,
            (0..n)
                .map(|i| {
                    request(
                        prompt.clone(),
                        SamplingParams {
                            temperature,
                            top_p,
                            max_new_tokens: 1,
                            seed: Some(1000 + i),
                            ..SamplingParams::default()
                        },
                    )
                })
                .collect(),
            DecodeBatchOptions {
                max_slots: 64,
                max_seq_len: 16,
            },
        )
        .unwrap();
        outs.iter().map(|o| o.tokens[0] as usize).collect()
    };
    let with_top_p = draw(top_p);
    let mut counts = vec![0usize; probs.len()];
    for &t in &with_top_p {
        assert!(
            nucleus.contains(&t),
            "token {t} (p = {}) is outside the nucleus",
            probs[t]
        );
        counts[t] += 1;
    }
    // frequencies follow the renormalised nucleus (loose: 600 draws)
    for &t in &nucleus {
        let expected = probs[t] / mass;
        let got = counts[t] as f64 / n as f64;
        assert!(
            (got - expected).abs() < 0.08,
            "token {t}: {got} vs {expected}"
        );
    }
    // without top-p, tokens outside the nucleus do get drawn (the test has power)
    let plain = draw(1.0);
    let outside = plain.iter().filter(|t| !nucleus.contains(t)).count();
    let expected_outside = (1.0 - mass) * n as f64;
    assert!(
        outside as f64 > expected_outside * 0.5,
        "{outside} vs {expected_outside}"
    );
}

#[test]
fn weight_swap_mid_decode_recomputes_the_cache() {
    let old = random_policy(ModelType::Qwen2, false, 31);
    let reference_old = random_policy(ModelType::Qwen2, false, 31);
    let new = random_policy(ModelType::Qwen2, false, 32);
    let new_bytes = new.weights_to_safetensors(WeightDtype::F32).unwrap();
    let mut policy = old;
    let mut batch = DecodeBatch::new(
        &policy,
        DecodeBatchOptions {
            max_slots: 4,
            max_seq_len: 64,
        },
    )
    .unwrap();
    let a = batch.add(request(ids(1, 6, 61), sampled(10, 1))).unwrap();
    let b = batch.add(request(ids(2, 3, 61), sampled(10, 2))).unwrap();
    for _ in 0..4 {
        let out = batch.step(&policy).unwrap();
        assert!(out.finished.is_empty());
    }
    policy.load_weights_from_bytes(&new_bytes, 1).unwrap();
    assert_eq!(policy.version(), 1);
    // a sequence that starts after the swap
    let c = batch.add(request(ids(3, 4, 61), sampled(5, 3))).unwrap();
    let mut outs = Vec::new();
    let mut recomputed = 0;
    while !batch.is_empty() {
        let out = batch.step(&policy).unwrap();
        recomputed += out.recomputed;
        outs.extend(out.finished);
    }
    assert_eq!(recomputed, 2, "both in-flight sequences recomputed once");
    outs.sort_by_key(|o| o.id);
    assert_eq!(outs.iter().map(|o| o.id).collect::<Vec<_>>(), vec![a, b, c]);
    for o in &outs[..2] {
        assert_eq!(o.versions, [vec![0; 4], vec![1; 6]].concat());
        assert_eq!(o.recomputations, 1);
        let seq: Vec<i64> = o.prompt.iter().chain(&o.tokens).copied().collect();
        let under_old =
            &sequence_logprobs(&reference_old, std::slice::from_ref(&seq), 1.0).unwrap()[0];
        let under_new = &sequence_logprobs(&policy, &[seq], 1.0).unwrap()[0];
        let p = o.prompt.len() - 1;
        assert!(max_abs_diff_slices(&o.logprobs[..4], &under_old[p..p + 4]) <= TOL);
        assert!(max_abs_diff_slices(&o.logprobs[4..], &under_new[p + 4..]) <= TOL);
        // and they really differ between the two weight sets
        assert!(
            max_abs_diff_slices(&o.logprobs[4..], &{
                let seq: Vec<i64> = o.prompt.iter().chain(&o.tokens).copied().collect();
                sequence_logprobs(&reference_old, &[seq], 1.0).unwrap()[0][p + 4..].to_vec()
            }) > 1e-3
        );
    }
    assert_eq!(outs[2].versions, vec![1; 5]);
    assert_eq!(outs[2].recomputations, 0);
}

/// What one run of a decode batch gave: outputs by id, the logits of every
/// step by id, and the positions computed and shared.
struct Run {
    outputs: Vec<asyncrl_policy::SequenceOutput>,
    logits: HashMap<u64, Vec<Tensor>>,
    computed: usize,
    shared: usize,
    recomputed: usize,
}

/// Runs `requests` through a batch of `max_slots`, adding up to
/// `add_per_step` of them before each step; after step `swap_at` the
/// policy's weights become `swap` (version 1).
fn run_sharing(
    mut policy: Policy,
    requests: Vec<SequenceRequest>,
    max_slots: usize,
    add_per_step: usize,
    share: bool,
    swap: Option<(usize, &[u8])>,
) -> Run {
    let mut batch = DecodeBatch::new(
        &policy,
        DecodeBatchOptions {
            max_slots,
            max_seq_len: 64,
        },
    )
    .unwrap();
    batch.keep_logits(true);
    batch.share_prompts(share);
    let mut queue: std::collections::VecDeque<_> = requests.into();
    let mut run = Run {
        outputs: Vec::new(),
        logits: HashMap::new(),
        computed: 0,
        shared: 0,
        recomputed: 0,
    };
    let mut steps = 0;
    while !(queue.is_empty() && batch.is_empty()) {
        for _ in 0..add_per_step {
            if batch.free_slots() == 0 {
                break;
            }
            let Some(r) = queue.pop_front() else { break };
            batch.add(r).unwrap();
        }
        let out = batch.step(&policy).unwrap();
        steps += 1;
        if let Some((at, bytes)) = swap
            && steps == at
        {
            policy.load_weights_from_bytes(bytes, 1).unwrap();
        }
        for (id, l) in out.logits {
            run.logits.entry(id).or_default().push(l);
        }
        run.computed += out.positions_computed;
        run.shared += out.positions_shared;
        run.recomputed += out.recomputed;
        run.outputs.extend(out.finished);
    }
    run.outputs.sort_by_key(|o| o.id);
    run
}

#[test]
fn sequences_with_one_prompt_share_its_cache_and_decode_as_alone() {
    // Groups of one prompt (as a task's completions are), a prompt of its
    // own, and a two-token prompt (too short to share), in three ways: all
    // starting together, one sequence a step into a batch smaller than a
    // group (later ones copy from a slot that holds the prompt), and a
    // weight swap mid-decode (every sequence recomputes; a group's prompt
    // is computed once).
    let mut requests = Vec::new();
    for (g, (len, n)) in [(7usize, 4usize), (3, 3), (1, 1), (2, 2), (11, 5)]
        .iter()
        .enumerate()
    {
        let prompt = ids(40 + g as u64, *len, 61);
        for j in 0..*n {
            requests.push(request(prompt.clone(), sampled(6, (g * 10 + j) as u64)));
        }
    }
    for (model_type, tied) in [(ModelType::Qwen2, false), (ModelType::Llama, true)] {
        let swap_bytes = random_policy(model_type, tied, 32)
            .weights_to_safetensors(WeightDtype::F32)
            .unwrap();
        for (max_slots, add_per_step, swap) in [
            (32, 32, None),
            (3, 1, None),
            (32, 32, Some((2, swap_bytes.as_slice()))),
        ] {
            let case = format!("{model_type:?} slots {max_slots}, swap {}", swap.is_some());
            let policy = || random_policy(model_type, tied, 31);
            let alone = run_sharing(
                policy(),
                requests.clone(),
                max_slots,
                add_per_step,
                false,
                swap,
            );
            let shared = run_sharing(
                policy(),
                requests.clone(),
                max_slots,
                add_per_step,
                true,
                swap,
            );
            assert_eq!(alone.shared, 0, "{case}");
            assert!(shared.shared > 0, "{case}: nothing shared");
            // Every position is computed or copied, never both, never lost.
            assert_eq!(shared.computed + shared.shared, alone.computed, "{case}");
            assert_eq!(shared.recomputed, alone.recomputed, "{case}");
            assert_eq!(shared.outputs.len(), requests.len(), "{case}");
            for (a, b) in alone.outputs.iter().zip(&shared.outputs) {
                assert_eq!(
                    (a.id, &a.tokens, &a.versions),
                    (b.id, &b.tokens, &b.versions),
                    "{case}"
                );
                assert!(
                    max_abs_diff_slices(&a.logprobs, &b.logprobs) <= TOL,
                    "{case}"
                );
                for (x, y) in alone.logits[&a.id].iter().zip(&shared.logits[&b.id]) {
                    let d = max_abs_diff(x, y);
                    assert!(d <= TOL, "{case}: seq {} logits differ by {d}", a.id);
                }
            }
        }
    }
    // What is shared, exactly, when all start together: a group of n with
    // a prompt of P tokens computes P - 1 positions once and copies them n - 1
    // times; one of its own, or of two tokens, shares nothing.
    let policy = random_policy(ModelType::Qwen2, false, 31);
    let run = run_sharing(policy, requests.clone(), 32, 32, true, None);
    assert_eq!(run.shared, 3 * 6 + 2 * 2 + 4 * 10);
}

#[test]
fn weight_bytes_round_trip_and_bad_payloads_change_nothing() {
    let src = random_policy(ModelType::Qwen2, false, 41);
    let bytes = src.weights_to_safetensors(WeightDtype::F32).unwrap();
    assert_eq!(
        bytes,
        src.weights_to_safetensors(WeightDtype::F32).unwrap(),
        "deterministic"
    );
    let mut dst = random_policy(ModelType::Qwen2, false, 42);
    let probe = ids(8, 9, 61);
    let before = full_logits(&dst, &probe);
    // garbage, a missing tensor, a wrong shape, an extra tensor: refused, unchanged
    assert!(dst.load_weights_from_bytes(b"not safetensors", 3).is_err());
    let other_shape = Policy::random_init(
        common::small_config(ModelType::Qwen2, true),
        1,
        0.1,
        DeviceOptions::cpu(),
    )
    .unwrap()
    .weights_to_safetensors(WeightDtype::F32)
    .unwrap();
    assert!(dst.load_weights_from_bytes(&other_shape, 3).is_err());
    let llama = random_policy(ModelType::Llama, false, 1)
        .weights_to_safetensors(WeightDtype::F32)
        .unwrap();
    assert!(
        dst.load_weights_from_bytes(&llama, 3).is_err(),
        "missing biases"
    );
    assert_eq!(max_abs_diff(&before, &full_logits(&dst, &probe)), 0.0);
    assert_eq!(dst.version(), 0);
    dst.load_weights_from_bytes(&bytes, 5).unwrap();
    assert_eq!(dst.version(), 5);
    assert_eq!(
        max_abs_diff(&full_logits(&src, &probe), &full_logits(&dst, &probe)),
        0.0
    );
    // bf16: half the size, close
    let half = src.weights_to_safetensors(WeightDtype::Bf16).unwrap();
    assert!(half.len() < bytes.len() * 6 / 10);
    dst.load_weights_from_bytes(&half, 6).unwrap();
    assert!(max_abs_diff(&full_logits(&src, &probe), &full_logits(&dst, &probe)) < 0.1);
}

#[test]
fn builtin_tiny_saves_and_loads_as_a_hugging_face_folder() {
    let spec = TinyModelSpec {
        hidden_size: 64,
        num_hidden_layers: 2,
        intermediate_size: 128,
        ..TinyModelSpec::default()
    };
    let tiny = Policy::builtin_tiny(&spec, 3, DeviceOptions::cpu()).unwrap();
    let same = Policy::builtin_tiny(&spec, 3, DeviceOptions::cpu()).unwrap();
    let tok = tiny.tokenizer().unwrap();
    let prompt = [
        vec![tiny.config().bos_token_id.unwrap()],
        tok.encode("37+58=", false).unwrap(),
    ]
    .concat();
    assert_eq!(
        max_abs_diff(&full_logits(&tiny, &prompt), &full_logits(&same, &prompt)),
        0.0
    );
    assert_eq!(tiny.eos_token_ids(), vec![2]);
    for shard in [None, Some(20_000)] {
        let dir = tempfile::tempdir().unwrap();
        tiny.save_pretrained(dir.path(), shard).unwrap();
        if shard.is_some() {
            assert!(dir.path().join("model.safetensors.index.json").is_file());
        } else {
            assert!(dir.path().join("model.safetensors").is_file());
        }
        let back = Policy::from_pretrained(dir.path(), DeviceOptions::cpu()).unwrap();
        assert_eq!(back.config().vocab_size, tiny.config().vocab_size);
        assert_eq!(
            max_abs_diff(&full_logits(&tiny, &prompt), &full_logits(&back, &prompt)),
            0.0
        );
        let back_tok = back.tokenizer().unwrap();
        assert_eq!(
            back_tok.encode("sort: 3 1 2", false).unwrap(),
            tok.encode("sort: 3 1 2", false).unwrap()
        );
        assert_eq!(back.eos_token_ids(), vec![2]);
    }
}

#[test]
fn loading_refuses_unsupported_folders_with_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let tiny = Policy::builtin_tiny(
        &TinyModelSpec {
            num_hidden_layers: 1,
            ..TinyModelSpec::default()
        },
        1,
        DeviceOptions::cpu(),
    )
    .unwrap();
    tiny.save_pretrained(dir.path(), None).unwrap();
    let cfg_path = dir.path().join("config.json");
    let cfg = std::fs::read_to_string(&cfg_path).unwrap();
    std::fs::write(&cfg_path, cfg.replace("\"llama\"", "\"gpt_neox\"")).unwrap();
    let e = Policy::from_pretrained(dir.path(), DeviceOptions::cpu()).unwrap_err();
    assert!(e.to_string().contains("gpt_neox"), "{e}");
    std::fs::write(&cfg_path, &cfg).unwrap();
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let e = Policy::from_pretrained(dir.path(), DeviceOptions::cpu()).unwrap_err();
    assert!(e.to_string().contains("model.safetensors"), "{e}");
    let e = Policy::from_pretrained(&dir.path().join("nope"), DeviceOptions::cpu()).unwrap_err();
    assert!(e.to_string().contains("config.json"), "{e}");
}
