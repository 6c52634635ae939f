//! The model thread and its async handle.

mod common;

use std::time::Duration;

use asyncrl_policy::{
    DecodeBatchOptions, DeviceOptions, EngineOptions, ModelHandle, Policy, PolicyError,
    SamplingParams, SequenceRequest, TinyModelSpec, WeightDtype, generate, sequence_logprobs,
};
use bytes::Bytes;
use common::max_abs_diff_slices;

fn spec() -> TinyModelSpec {
    TinyModelSpec {
        hidden_size: 64,
        num_hidden_layers: 2,
        intermediate_size: 128,
        init_std: 0.1,
        ..TinyModelSpec::default()
    }
}

fn tiny(seed: u64) -> Policy {
    Policy::builtin_tiny(&spec(), seed, DeviceOptions::cpu()).expect("tiny")
}

async fn spawn(seed: u64, max_slots: usize) -> ModelHandle {
    ModelHandle::spawn(
        EngineOptions {
            batch: DecodeBatchOptions {
                max_slots,
                max_seq_len: 256,
            },
            ..EngineOptions::default()
        },
        move || Ok(tiny(seed)),
    )
    .await
    .expect("spawn")
}

fn request(
    prompt: &str,
    handle: &ModelHandle,
    max_new_tokens: usize,
    seed: u64,
) -> SequenceRequest {
    let tok = handle.tokenizer().expect("tokenizer");
    let bos = handle.config().bos_token_id.expect("bos");
    SequenceRequest {
        prompt: [vec![bos], tok.encode(prompt, false).expect("encode")].concat(),
        params: SamplingParams {
            max_new_tokens,
            seed: Some(seed),
            ..SamplingParams::default()
        },
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generates_with_continuous_batching() {
    let handle = spawn(1, 3).await;
    let requests: Vec<_> = (0..8)
        .map(|i| request(&format!("{i}+{i}="), &handle, 2 + 3 * i, i as u64))
        .collect();
    // submitted concurrently from separate tasks, more than the slots
    let mut tasks = Vec::new();
    for r in requests.clone() {
        let h = handle.clone();
        tasks.push(tokio::spawn(async move { h.generate(r).await }));
    }
    let mut outs = Vec::new();
    for t in tasks {
        outs.push(t.await.expect("join").expect("generate"));
    }
    // the same tokens as a direct run on the same weights (seeded sampling
    // does not depend on the batch)
    let direct =
        generate(&tiny(1), requests.clone(), DecodeBatchOptions::default()).expect("direct");
    for ((o, d), r) in outs.iter().zip(&direct).zip(&requests) {
        assert_eq!(o.tokens, d.tokens);
        assert_eq!(o.tokens.len(), r.params.max_new_tokens);
        assert!(max_abs_diff_slices(&o.logprobs, &d.logprobs) <= 1e-4);
    }
    let stats = handle.stats();
    assert_eq!(stats.sequences_finished, 8);
    assert_eq!(stats.in_flight, 0);
    let total: usize = requests.iter().map(|r| r.params.max_new_tokens).sum();
    assert_eq!(stats.tokens_generated, total as u64);
    // generate_many keeps the order
    let many = handle
        .generate_many(requests[..3].to_vec())
        .await
        .expect("many");
    for (m, d) in many.iter().zip(&direct) {
        assert_eq!(m.tokens, d.tokens);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_weight_swap_mid_rollout_switches_versions_and_log_probs() {
    let handle = spawn(1, 4).await;
    let new_bytes = Bytes::from(
        tiny(2)
            .weights_to_safetensors(WeightDtype::F32)
            .expect("bytes"),
    );
    let r = request("sort: 9 3 7 1 =", &handle, 200, 7);
    let h = handle.clone();
    let rollout = tokio::spawn(async move { h.generate(r).await });
    while handle.stats().tokens_generated < 5 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    handle.load_weights(new_bytes, 1).await.expect("swap");
    assert_eq!(handle.version(), 1);
    let out = rollout.await.expect("join").expect("generate");
    let k = out.versions.iter().take_while(|&&v| v == 0).count();
    assert!(
        k >= 5 && k < out.versions.len(),
        "swap landed at {k} of {}",
        out.versions.len()
    );
    assert!(
        out.versions[k..].iter().all(|&v| v == 1),
        "{:?}",
        out.versions
    );
    assert_eq!(out.recomputations, 1);
    let seq: Vec<i64> = out.prompt.iter().chain(&out.tokens).copied().collect();
    let p = out.prompt.len() - 1;
    let old = &sequence_logprobs(&tiny(1), std::slice::from_ref(&seq), 1.0).expect("old")[0];
    let new = &sequence_logprobs(&tiny(2), std::slice::from_ref(&seq), 1.0).expect("new")[0];
    assert!(max_abs_diff_slices(&out.logprobs[..k], &old[p..p + k]) <= 1e-4);
    assert!(max_abs_diff_slices(&out.logprobs[k..], &new[p + k..]) <= 1e-4);
    // the handle's log-probs now follow the new weights
    let via_handle = handle
        .token_logprobs(vec![seq], 1.0)
        .await
        .expect("logprobs");
    assert!(max_abs_diff_slices(&via_handle[0], new) <= 1e-4);
    assert_eq!(handle.stats().weight_swaps, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_future_cancels_the_sequence() {
    let handle = spawn(3, 2).await;
    let r = request("1+1=", &handle, 100_000, 1);
    let timed_out = tokio::time::timeout(Duration::from_millis(30), handle.generate(r)).await;
    assert!(
        timed_out.is_err(),
        "a 100k-token request cannot finish in 30 ms"
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while handle.stats().in_flight > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the slot was not freed"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // and the thread still serves
    let out = handle
        .generate(request("2+2=", &handle, 3, 2))
        .await
        .expect("generate");
    assert_eq!(out.tokens.len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weights_save_errors_and_closures_through_the_handle() {
    let handle = spawn(4, 2).await;
    let bytes = handle.weights_bytes(WeightDtype::F32).await.expect("bytes");
    assert_eq!(
        bytes,
        tiny(4)
            .weights_to_safetensors(WeightDtype::F32)
            .expect("direct")
    );
    // a bad payload is refused and the old weights stay in use
    let e = handle
        .load_weights(Bytes::from_static(b"garbage"), 9)
        .await
        .unwrap_err();
    assert!(matches!(e, PolicyError::Safetensors { .. }), "{e}");
    assert_eq!(handle.version(), 0);
    // closures run on the model thread
    let n = handle
        .with_policy(|p| p.num_parameters())
        .await
        .expect("run");
    assert_eq!(n, tiny(4).num_parameters());
    handle
        .with_policy(|p| p.set_version(3))
        .await
        .expect("set version");
    assert_eq!(handle.version(), 3);
    let dir = tempfile::tempdir().expect("tempdir");
    handle
        .save_pretrained(dir.path().to_owned(), None)
        .await
        .expect("save");
    assert!(dir.path().join("config.json").is_file());
    assert!(dir.path().join("tokenizer.json").is_file());
    // invalid requests fail fast
    let mut r = request("1", &handle, 3, 1);
    r.prompt.clear();
    assert!(handle.generate(r).await.is_err());
    // a loader error comes back from spawn
    let e = ModelHandle::spawn(EngineOptions::default(), || {
        Policy::from_pretrained(
            std::path::Path::new("/nonexistent/model"),
            DeviceOptions::cpu(),
        )
    })
    .await
    .unwrap_err();
    assert!(e.to_string().contains("config.json"), "{e}");
}
