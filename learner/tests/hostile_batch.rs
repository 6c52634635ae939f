//! Hostile batches at the learner's boundary: what the buffer's reply holds
//! is decoded (`batch::decode_ipc`) and checked (`batch::check`) before a
//! tensor is sized from it or the model sees it. Wrong list lengths, NaN/inf
//! log-probs, versions from the future or negative, token ids outside the
//! vocabulary, rows beyond the model's context, a declared list length far
//! beyond the data, empty batches, wrong columns, truncated or random IPC
//! bytes: each is an error naming the field, never a panic. The learner role
//! counts each refused batch in `asyncrl_learner_bad_batches_total{field}`,
//! trains on none of it, asks again, and trains the next valid batch.
//! Every test counts the inputs it tried.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use arrow::array::{ArrayRef, Int32Array, ListArray, RecordBatch};
use arrow::buffer::OffsetBuffer;
use arrow::datatypes::{DataType, Field};
use asyncrl_config::{Config, DeviceName};
use asyncrl_control::knobs::{KNOBS_KEY, encode_schedule, initial_knobs, new_schedule};
use asyncrl_learner::batch::{BatchError, BatchLimits, check, decode_ipc};
use asyncrl_protos::arrow_schema::{self as cols, to_record_batch};
use asyncrl_protos::v1::{
    BatchReply, BatchRequest, FinishReason, RewardStatus, Timings, Trajectory,
};
use asyncrl_protos::{Message, subjects};
use asyncrl_transport::{Bus, LocalBus};
use bytes::Bytes;
use futures::StreamExt;
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestRunner};
use tokio_util::sync::CancellationToken;

const LIMITS: BatchLimits = BatchLimits {
    vocab_size: 100,
    max_seq_len: 64,
    max_version: 3,
};

fn traj(i: u32, prompt: usize, completion: usize) -> Trajectory {
    Trajectory {
        uuid: uuid::Uuid::from_u128(u128::from(i) + 1).to_string(),
        task_id: format!("t{}", i / 2),
        group_id: format!("g{}", i / 2),
        prompt_token_ids: (0..prompt).map(|k| 1 + (k % 50) as i32).collect(),
        completion_token_ids: (0..completion).map(|k| 2 + (k % 50) as i32).collect(),
        behaviour_logprobs: (0..completion).map(|k| -0.1 * (k as f32 + 1.0)).collect(),
        policy_versions: (0..completion).map(|k| (k as i32 / 2).min(3)).collect(),
        reward: (i % 2) as f32,
        reward_status: RewardStatus::Ok as i32,
        finish_reason: FinishReason::Stop as i32,
        worker_id: "w".into(),
        timings: Some(Timings::default()),
        group_size: 2,
        index_in_group: i % 2,
        admission_version: 0,
        turns: Vec::new(),
    }
}

fn ipc(rb: &RecordBatch) -> Vec<u8> {
    let mut out = Vec::new();
    let mut w = arrow::ipc::writer::StreamWriter::try_new(&mut out, &rb.schema()).unwrap();
    w.write(rb).unwrap();
    w.finish().unwrap();
    drop(w);
    out
}

/// Decodes and checks, as the learner does; a panic fails the test.
fn refuse(bytes: &[u8]) -> Result<(), BatchError> {
    let r = std::panic::catch_unwind(|| {
        let batches = decode_ipc(bytes)?;
        check(&batches, &LIMITS)
    });
    r.unwrap_or_else(|_| panic!("decode/check panicked on {} bytes", bytes.len()))
}

/// One way to break a valid batch, and the field the error must name.
#[derive(Debug, Clone)]
enum Corruption {
    LogprobsLength(usize, i8),
    VersionsLength(usize, i8),
    Logprob(usize, f32),
    Version(usize, i32),
    TokenId(usize, i32, bool),
    LongRow(usize, usize),
    EmptyPrompt(usize),
    Reward(usize, f32),
}

impl Corruption {
    fn field(&self) -> &'static str {
        match self {
            Corruption::LogprobsLength(..) | Corruption::Logprob(..) => cols::BEHAVIOUR_LOGPROBS,
            Corruption::VersionsLength(..) | Corruption::Version(..) => cols::POLICY_VERSIONS,
            Corruption::TokenId(_, _, true) | Corruption::EmptyPrompt(_) => cols::PROMPT_TOKEN_IDS,
            Corruption::TokenId(_, _, false) | Corruption::LongRow(..) => {
                cols::COMPLETION_TOKEN_IDS
            }
            Corruption::Reward(..) => cols::REWARD,
        }
    }

    fn apply(&self, trajs: &mut [Trajectory]) {
        let n = trajs.len();
        let pick = |r: usize| r % n;
        match *self {
            Corruption::LogprobsLength(r, d) => {
                let t = &mut trajs[pick(r)];
                push_token(t);
                resize(&mut t.behaviour_logprobs, d, -0.5);
            }
            Corruption::VersionsLength(r, d) => {
                let t = &mut trajs[pick(r)];
                push_token(t);
                resize(&mut t.policy_versions, d, 0);
            }
            Corruption::Logprob(r, lp) => {
                let t = &mut trajs[pick(r)];
                push_token(t);
                *t.behaviour_logprobs.last_mut().unwrap() = lp;
            }
            Corruption::Version(r, v) => {
                let t = &mut trajs[pick(r)];
                push_token(t);
                *t.policy_versions.last_mut().unwrap() = v;
            }
            Corruption::TokenId(r, id, prompt) => {
                let t = &mut trajs[pick(r)];
                push_token(t);
                if prompt {
                    t.prompt_token_ids[0] = id;
                } else {
                    *t.completion_token_ids.last_mut().unwrap() = id;
                }
            }
            Corruption::LongRow(r, extra) => {
                let t = &mut trajs[pick(r)];
                let len = LIMITS.max_seq_len + extra - t.prompt_token_ids.len();
                let v = *t.policy_versions.last().unwrap_or(&0);
                t.completion_token_ids = vec![5; len];
                t.behaviour_logprobs = vec![-1.0; len];
                t.policy_versions = vec![v; len];
            }
            Corruption::EmptyPrompt(r) => trajs[pick(r)].prompt_token_ids.clear(),
            Corruption::Reward(r, x) => trajs[pick(r)].reward = x,
        }
    }
}

fn resize<T: Clone>(v: &mut Vec<T>, delta: i8, fill: T) {
    let len = (v.len() as i64 + i64::from(delta)).max(0) as usize;
    v.resize(len, fill);
}

/// Makes sure the row has a completion token to corrupt.
fn push_token(t: &mut Trajectory) {
    if t.completion_token_ids.is_empty() {
        t.completion_token_ids.push(3);
        t.behaviour_logprobs.push(-0.5);
        t.policy_versions.push(0);
    }
}

fn corruption() -> impl Strategy<Value = Corruption> {
    let bad_lp = prop_oneof![
        Just(f32::NAN),
        Just(f32::INFINITY),
        Just(f32::NEG_INFINITY),
        0.01f32..1e30,
    ];
    let bad_version = prop_oneof![4i32..i32::MAX, i32::MIN..0];
    let bad_id = prop_oneof![100i32..i32::MAX, i32::MIN..0];
    let delta = prop_oneof![1i8..5, -5i8..0];
    prop_oneof![
        (any::<usize>(), delta.clone()).prop_map(|(r, d)| Corruption::LogprobsLength(r, d)),
        (any::<usize>(), delta).prop_map(|(r, d)| Corruption::VersionsLength(r, d)),
        (any::<usize>(), bad_lp).prop_map(|(r, x)| Corruption::Logprob(r, x)),
        (any::<usize>(), bad_version).prop_map(|(r, v)| Corruption::Version(r, v)),
        (any::<usize>(), bad_id, any::<bool>())
            .prop_map(|(r, id, p)| Corruption::TokenId(r, id, p)),
        (any::<usize>(), 1usize..5000).prop_map(|(r, x)| Corruption::LongRow(r, x)),
        any::<usize>().prop_map(Corruption::EmptyPrompt),
        (
            any::<usize>(),
            prop_oneof![Just(f32::NAN), Just(f32::INFINITY), Just(f32::NEG_INFINITY)]
        )
            .prop_map(|(r, x)| Corruption::Reward(r, x)),
    ]
}

/// Valid rows: 1..8 trajectories, prompts 1..20, completions 0..20.
fn valid_trajs() -> impl Strategy<Value = Vec<Trajectory>> {
    proptest::collection::vec((1usize..20, 0usize..20), 1..8).prop_map(|shapes| {
        shapes
            .into_iter()
            .enumerate()
            .map(|(i, (p, c))| traj(i as u32, p, c))
            .collect()
    })
}

fn runner(cases: u32) -> TestRunner {
    TestRunner::new(ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    })
}

#[test]
fn corrupted_batches_are_refused_naming_the_field() {
    let tried = AtomicUsize::new(0);
    let valid = AtomicUsize::new(0);
    let fields = std::sync::Mutex::new(BTreeMap::<&'static str, usize>::new());
    runner(600)
        .run(
            &(valid_trajs(), proptest::option::of(corruption())),
            |(mut trajs, corruption)| {
                tried.fetch_add(1, Ordering::Relaxed);
                if let Some(c) = &corruption {
                    c.apply(&mut trajs);
                }
                let rb = to_record_batch(&trajs).unwrap();
                let bytes = ipc(&rb);
                match (corruption, refuse(&bytes)) {
                    (None, r) => {
                        prop_assert!(r.is_ok(), "a valid batch was refused: {r:?}");
                        valid.fetch_add(1, Ordering::Relaxed);
                    }
                    (Some(c), Err(e)) => {
                        prop_assert_eq!(e.field(), c.field(), "{:?}: {}", c, e);
                        prop_assert!(e.to_string().contains(c.field()), "{}", e);
                        *fields.lock().unwrap().entry(c.field()).or_insert(0) += 1;
                    }
                    (Some(c), Ok(())) => prop_assert!(false, "{c:?} was accepted"),
                }
                Ok(())
            },
        )
        .unwrap();
    let (tried, valid) = (tried.into_inner(), valid.into_inner());
    let by_field = fields.into_inner().unwrap();
    println!("corrupted batches tried: {tried} ({valid} valid), refused by field: {by_field:?}");
    assert_eq!(tried, 600);
    assert!(valid > 0 && valid < tried);
    // Every field the corruptions target was hit.
    assert_eq!(by_field.len(), 5, "{by_field:?}");
}

#[test]
fn random_and_truncated_ipc_bytes_are_errors_never_panics() {
    let mut tried = 0usize;
    // Every prefix of a valid stream, and every byte flipped.
    let trajs: Vec<Trajectory> = (0..4).map(|i| traj(i, 5, 7)).collect();
    let good = ipc(&to_record_batch(&trajs).unwrap());
    refuse(&good).expect("the uncut stream is valid");
    for cut in 0..good.len() {
        tried += 1;
        let _ = refuse(&good[..cut]);
    }
    // The Arrow decoder panics on some of these (caught and returned as
    // `DecoderPanic`); its panic messages are kept off the test output.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let from_arrow = info.location().is_some_and(|l| l.file().contains("arrow"));
        if !from_arrow {
            default_hook(info);
        }
    }));
    let (mut flipped_refused, mut decoder_panics) = (0usize, 0usize);
    for at in 0..good.len() {
        let mut bad = good.clone();
        bad[at] ^= 0xa5;
        tried += 1;
        match refuse(&bad) {
            Ok(()) => {}
            Err(e) => {
                flipped_refused += 1;
                if matches!(e, BatchError::DecoderPanic(_)) {
                    decoder_panics += 1;
                }
            }
        }
    }
    // Empty, and random bytes.
    for bytes in [&b""[..], b"garbage", &[0xff; 8], &[0; 64]] {
        tried += 1;
        assert!(refuse(bytes).is_err());
    }
    let random = AtomicUsize::new(0);
    runner(500)
        .run(&proptest::collection::vec(any::<u8>(), 0..2048), |bytes| {
            random.fetch_add(1, Ordering::Relaxed);
            prop_assert!(refuse(&bytes).is_err());
            Ok(())
        })
        .unwrap();
    let random = random.into_inner();
    println!(
        "IPC inputs tried: {tried} truncated/flipped/fixed ({flipped_refused} flipped refused, \
         {decoder_panics} of them Arrow decoder panics caught), {random} random"
    );
    assert_eq!(random, 500);
    assert_eq!(tried, 2 * good.len() + 4);
    assert!(tried > 1000);
}

#[test]
fn wrong_schemas_and_empty_batches_are_refused() {
    let mut tried = 0usize;
    let trajs: Vec<Trajectory> = (0..2).map(|i| traj(i, 3, 4)).collect();
    let rb = to_record_batch(&trajs).unwrap();
    let n = rb.num_columns();
    // Each column dropped.
    for c in 0..n {
        let keep: Vec<usize> = (0..n).filter(|k| *k != c).collect();
        let bytes = ipc(&rb.project(&keep).unwrap());
        tried += 1;
        let e = refuse(&bytes).unwrap_err();
        assert_eq!(e.field(), "schema", "{e}");
        assert!(e.to_string().contains(rb.schema().field(c).name()), "{e}");
    }
    // Each list column with the wrong item type; an extra column.
    for name in [
        cols::PROMPT_TOKEN_IDS,
        cols::COMPLETION_TOKEN_IDS,
        cols::BEHAVIOUR_LOGPROBS,
        cols::POLICY_VERSIONS,
    ] {
        let mut fields: Vec<Field> = Vec::new();
        let mut columns: Vec<ArrayRef> = Vec::new();
        for (f, col) in rb.schema().fields().iter().zip(rb.columns()) {
            if f.name() == name {
                let item = Arc::new(Field::new("item", DataType::Int64, false));
                let list = ListArray::new(
                    item.clone(),
                    OffsetBuffer::from_lengths([1, 1]),
                    Arc::new(arrow::array::Int64Array::from(vec![1i64, 2])),
                    None,
                );
                fields.push(Field::new(name, DataType::List(item), false));
                columns.push(Arc::new(list));
            } else {
                fields.push(f.as_ref().clone());
                columns.push(col.clone());
            }
        }
        let bad =
            RecordBatch::try_new(Arc::new(arrow::datatypes::Schema::new(fields)), columns).unwrap();
        tried += 1;
        let e = refuse(&ipc(&bad)).unwrap_err();
        assert_eq!(e.field(), "schema", "{e}");
        assert!(e.to_string().contains(name), "{e}");
    }
    let mut fields: Vec<Field> = rb
        .schema()
        .fields()
        .iter()
        .map(|f| f.as_ref().clone())
        .collect();
    fields.push(Field::new("surprise", DataType::Int32, false));
    let mut columns = rb.columns().to_vec();
    columns.push(Arc::new(Int32Array::from(vec![1, 2])));
    let extra =
        RecordBatch::try_new(Arc::new(arrow::datatypes::Schema::new(fields)), columns).unwrap();
    tried += 1;
    let e = refuse(&ipc(&extra)).unwrap_err();
    assert!(e.to_string().contains("surprise"), "{e}");
    // Empty: no record batch, and a record batch of no rows.
    let empty = RecordBatch::new_empty(cols::trajectory_schema());
    tried += 1;
    assert!(matches!(refuse(&ipc(&empty)), Err(BatchError::Empty)));
    let mut schema_only = Vec::new();
    arrow::ipc::writer::StreamWriter::try_new(&mut schema_only, &cols::trajectory_schema())
        .unwrap()
        .finish()
        .unwrap();
    tried += 1;
    assert!(matches!(refuse(&schema_only), Err(BatchError::Empty)));
    println!("wrong-schema and empty batches tried: {tried}");
    assert_eq!(tried, n + 4 + 1 + 2);
}

/// A list column whose offsets declare far more values than the stream
/// holds (a length of up to 2^31 − 1 over a handful of values), patched into
/// the bytes of a valid stream: refused by the decoder's validation before
/// anything is sized from it.
#[test]
fn declared_lengths_beyond_the_data_are_refused() {
    // Prompts of 3 and 4 tokens (offsets 0, 3, 7); completions, log-probs
    // and versions of 5 and 6 (offsets 0, 5, 11, three times).
    let trajs = vec![traj(0, 3, 5), traj(1, 4, 6)];
    let good = ipc(&to_record_batch(&trajs).unwrap());
    let offsets = |o: [i32; 3]| -> Vec<u8> { o.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let mut tried = 0usize;
    for (pattern, columns) in [(offsets([0, 3, 7]), 1), (offsets([0, 5, 11]), 3)] {
        let at: Vec<usize> = good
            .windows(pattern.len())
            .enumerate()
            .filter(|(_, w)| *w == pattern.as_slice())
            .map(|(i, _)| i)
            .collect();
        assert_eq!(at.len(), columns, "offset buffers found at {at:?}");
        for pos in at {
            for declared in [12i32, 100, 1 << 20, i32::MAX, -1] {
                let mut bad = good.clone();
                bad[pos + 8..pos + 12].copy_from_slice(&declared.to_le_bytes());
                tried += 1;
                let e = refuse(&bad).unwrap_err();
                assert!(
                    matches!(e, BatchError::Ipc(_) | BatchError::DecoderPanic(_)),
                    "offset buffer at {pos} declaring {declared}: {e}"
                );
            }
        }
    }
    println!("declared-length batches tried: {tried}");
    assert_eq!(tried, 4 * 5);
}

fn config(dir: &std::path::Path) -> Config {
    let mut c = Config::default();
    c.run.output_dir = dir.to_owned();
    c.run.max_steps = 1;
    c.staleness.groups_per_step = 1;
    c.staleness.group_size = 2;
    c.model.device = DeviceName::Cpu;
    c.model.tiny.hidden_size = 32;
    c.model.tiny.num_hidden_layers = 1;
    c.model.tiny.num_attention_heads = 2;
    c.model.tiny.num_key_value_heads = 1;
    c.model.tiny.intermediate_size = 64;
    c.learner.batch_poll_interval = std::time::Duration::from_millis(1);
    c
}

fn reply_with(trajs: &[Trajectory]) -> Bytes {
    let rb = to_record_batch(trajs).unwrap();
    reply_ipc(ipc(&rb))
}

fn reply_ipc(ipc: Vec<u8>) -> Bytes {
    Bytes::from(
        BatchReply {
            arrow_ipc: Bytes::from(ipc),
            num_groups: 1,
            step: 1,
            num_trajectories: 2,
            ..Default::default()
        }
        .encode_to_vec(),
    )
}

/// The learner role against a buffer that first serves one hostile reply of
/// every kind, then a valid batch: each hostile one is counted under its
/// field and not trained; the run trains step 1 on the valid batch only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_learner_role_counts_and_refuses_hostile_batches_then_trains() {
    tch::set_num_threads(1);
    let bus: Arc<dyn Bus> = Arc::new(LocalBus::new());
    let dir = tempfile::tempdir().unwrap();
    let c = config(dir.path());
    let kv = bus.kv(subjects::CONTROL_BUCKET).await.unwrap();
    kv.put(KNOBS_KEY, encode_schedule(&new_schedule(initial_knobs(&c))))
        .await
        .unwrap();

    let good: Vec<Trajectory> = (0..2).map(|i| traj(100 + i, 4, 3)).collect();
    // Version 0 tokens only (the learner starts at version 0).
    let good: Vec<Trajectory> = good
        .into_iter()
        .map(|mut t| {
            t.policy_versions = vec![0; t.completion_token_ids.len()];
            t
        })
        .collect();
    let with = |f: &dyn Fn(&mut Trajectory)| {
        let mut t = good.clone();
        f(&mut t[1]);
        reply_with(&t)
    };
    let valid_ipc = ipc(&to_record_batch(&good).unwrap());
    // (reply, the field it must be counted under)
    let hostile: Vec<(Bytes, &str)> = vec![
        (Bytes::from_static(b"\x0a\xff\xff\xff"), "batch_reply"),
        (reply_ipc(b"not arrow at all".to_vec()), "arrow_ipc"),
        (
            reply_ipc(valid_ipc[..valid_ipc.len() / 2].to_vec()),
            "arrow_ipc",
        ),
        (
            reply_ipc(ipc(&RecordBatch::new_empty(cols::trajectory_schema()))),
            "batch",
        ),
        (
            reply_ipc(ipc(&to_record_batch(&good)
                .unwrap()
                .project(&[0, 1, 2])
                .unwrap())),
            "schema",
        ),
        (
            with(&|t| t.behaviour_logprobs.push(-1.0)),
            cols::BEHAVIOUR_LOGPROBS,
        ),
        (
            with(&|t| {
                t.policy_versions.pop();
            }),
            cols::POLICY_VERSIONS,
        ),
        (
            with(&|t| t.behaviour_logprobs[0] = f32::NAN),
            cols::BEHAVIOUR_LOGPROBS,
        ),
        (
            with(&|t| t.behaviour_logprobs[0] = f32::INFINITY),
            cols::BEHAVIOUR_LOGPROBS,
        ),
        // From the future: the learner is at version 0 for step 1.
        (
            with(&|t| t.policy_versions = vec![1; 3]),
            cols::POLICY_VERSIONS,
        ),
        (with(&|t| t.policy_versions[0] = -1), cols::POLICY_VERSIONS),
        (
            with(&|t| t.completion_token_ids[0] = 1_000_000),
            cols::COMPLETION_TOKEN_IDS,
        ),
        (
            with(&|t| t.prompt_token_ids[0] = -3),
            cols::PROMPT_TOKEN_IDS,
        ),
        // Beyond the tiny model's 512 positions.
        (
            with(&|t| {
                t.completion_token_ids = vec![3; 600];
                t.behaviour_logprobs = vec![-1.0; 600];
                t.policy_versions = vec![0; 600];
            }),
            cols::COMPLETION_TOKEN_IDS,
        ),
        (with(&|t| t.reward = f32::NAN), cols::REWARD),
    ];
    let mut want: BTreeMap<String, u64> = BTreeMap::new();
    for (_, field) in &hostile {
        *want.entry((*field).to_owned()).or_insert(0) += 1;
    }
    let mut script: std::collections::VecDeque<Bytes> =
        hostile.iter().map(|(b, _)| b.clone()).collect();
    let n_hostile = script.len();
    script.push_back(reply_with(&good));
    let served = Arc::new(AtomicUsize::new(0));
    let counter = served.clone();
    let mut requests = bus.serve(subjects::BUFFER_BATCH, None).await.unwrap();
    let fallback = good.clone();
    tokio::spawn(async move {
        while let Some(req) = requests.next().await {
            let r = BatchRequest::decode(req.payload.as_ref()).unwrap();
            assert_eq!(
                r.step, 1,
                "the learner stays at step 1 until a batch is good"
            );
            counter.fetch_add(1, Ordering::SeqCst);
            let reply = script.pop_front().unwrap_or_else(|| reply_with(&fallback));
            let _ = req.respond(reply).await;
        }
    });

    let metrics = asyncrl_telemetry::Metrics::new();
    let summary = tokio::time::timeout(
        std::time::Duration::from_secs(120),
        asyncrl_learner::service::run(c, bus.clone(), metrics.clone(), CancellationToken::new()),
    )
    .await
    .expect("the learner finishes")
    .expect("hostile batches do not stop the learner");
    assert_eq!((summary.steps, summary.version), (1, 1));
    assert_eq!(served.load(Ordering::SeqCst), n_hostile + 1);

    // Counted per field.
    let text = metrics.encode_prometheus_text().unwrap();
    let mut got: BTreeMap<String, u64> = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("asyncrl_learner_bad_batches_total{field=\"") {
            let (field, value) = rest.split_once("\"} ").unwrap();
            got.insert(field.to_owned(), value.trim().parse().unwrap());
        }
    }
    println!("hostile replies served to the learner role: {n_hostile}; counted: {got:?}");
    assert_eq!(got, want);
    assert_eq!(got.values().sum::<u64>(), n_hostile as u64);

    // Trained on the valid batch only.
    let trained = asyncrl_learner::outputs::read_trained(
        &dir.path().join(asyncrl_learner::outputs::TRAINED_JSONL),
    )
    .unwrap();
    assert_eq!(trained.len(), 1, "{trained:?}");
    let mut ids = trained[0].trajectories.clone();
    ids.sort();
    let mut want: Vec<String> = good.iter().map(|t| t.uuid.clone()).collect();
    want.sort();
    assert_eq!(ids, want, "trained on the valid batch's trajectories");
}
