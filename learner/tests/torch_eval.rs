//! `[eval]` through the torch engine (`eval.engine`): the evaluator's
//! one-rank engine process generates, greedily, the completions the
//! built-in model generates from the same weights, first from the model
//! folder and then from a version's published bytes it adopts; bad prompts
//! are refused with the reason and it keeps serving.

use std::path::PathBuf;

use asyncrl_config::{Config, EvalEngineName, TrainerEngineName};
use asyncrl_learner::engine::TrainerEngine as _;
use asyncrl_learner::eval::resolve_engine;
use asyncrl_learner::torch_engine::TorchEngine;
use asyncrl_policy::{DecodeBatchOptions, Policy, SamplingParams, SequenceRequest, WeightDtype};

fn python() -> PathBuf {
    let venv = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.venv/bin/python"));
    if venv.is_file() {
        venv
    } else {
        PathBuf::from("python3")
    }
}

fn prompts(vocab: i64) -> Vec<Vec<i64>> {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        3 + (state % (vocab as u64 - 3)) as i64
    };
    [3usize, 7, 1, 5, 9, 4]
        .iter()
        .map(|&n| (0..n).map(|_| next()).collect())
        .collect()
}

fn builtin_greedy(policy: &Policy, prompts: &[Vec<i64>], new: usize) -> Vec<Vec<i64>> {
    let _g = tch::no_grad_guard();
    let requests = prompts
        .iter()
        .map(|p| SequenceRequest {
            prompt: p.clone(),
            params: SamplingParams {
                temperature: 0.0,
                top_p: 1.0,
                top_k: 0,
                max_new_tokens: new,
                stop_token_ids: Vec::new(),
                seed: Some(0),
            },
        })
        .collect();
    asyncrl_policy::generate(
        policy,
        requests,
        DecodeBatchOptions {
            max_slots: 8,
            max_seq_len: 32,
        },
    )
    .expect("builtin generation")
    .into_iter()
    .map(|o| o.tokens)
    .collect()
}

#[test]
fn the_torch_evaluator_generates_what_the_builtin_model_does_from_the_same_weights() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = Config::default();
    let first = asyncrl_policy::from_config::load_policy(&config.model, 1).unwrap();
    let mut second = asyncrl_policy::from_config::load_policy(&config.model, 2).unwrap();
    let model = dir.path().join("model");
    first.save_pretrained(&model, None).unwrap();
    config.model.path = Some(model);
    config.learner.torch.python = python();
    config.run.output_dir = dir.path().join("out");
    // `auto` evaluates with the engine that trains (the built-in model
    // reads this folder).
    assert_eq!(resolve_engine(&config), EvalEngineName::Builtin);
    config.learner.trainer = TrainerEngineName::Torch;
    assert_eq!(resolve_engine(&config), EvalEngineName::Torch);
    config.learner.trainer = TrainerEngineName::Builtin;
    config.eval.engine = EvalEngineName::Torch;
    assert_eq!(resolve_engine(&config), EvalEngineName::Torch);

    let vocab = first.config().vocab_size;
    let prompts = prompts(vocab);
    let seeds = vec![0; prompts.len()];
    let mut engine = TorchEngine::start_evaluator(&config, dir.path().join("work")).unwrap();
    let got = engine.generate(&prompts, &seeds, 12, 0.0, &[]).unwrap();
    assert_eq!(
        got,
        builtin_greedy(&first, &prompts, 12),
        "the folder's weights"
    );

    // A later version, as the learner hands it over: its published bytes.
    let bytes = second.weights_to_safetensors(WeightDtype::F32).unwrap();
    second.load_weights_from_bytes(&bytes, 1).unwrap();
    engine.adopt_published(&bytes, 1).unwrap();
    let got = engine.generate(&prompts, &seeds, 12, 0.0, &[]).unwrap();
    assert_eq!(
        got,
        builtin_greedy(&second, &prompts, 12),
        "version 1's weights"
    );
    assert_ne!(
        got,
        builtin_greedy(&first, &prompts, 12),
        "the two versions' completions are the same: the test would not see a missed load"
    );

    // A stop token ends a completion, and is kept.
    let stop = got[0][3];
    let stopped = engine.generate(&prompts, &seeds, 12, 0.0, &[stop]).unwrap();
    let at = got[0].iter().position(|&t| t == stop).unwrap();
    assert_eq!(stopped[0], got[0][..=at]);

    // Refused with the reason; the engine keeps serving.
    let err = engine
        .generate(&[vec![vocab + 5]], &[0], 4, 0.0, &[])
        .unwrap_err();
    assert!(
        format!("{err:#}").contains("outside the vocabulary"),
        "{err:#}"
    );
    assert_eq!(
        engine.generate(&prompts, &seeds, 12, 0.0, &[]).unwrap(),
        got
    );
}
