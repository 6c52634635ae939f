//! The learner role against a scripted buffer over the in-process bus and a
//! real nats-server: it publishes every version (weights in the object store,
//! announcement in `policy.version`, sha256 matching), reports its status,
//! writes its metrics file, and a restarted learner continues the version
//! sequence without going backwards.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use asyncrl_config::{Config, DeviceName};
use asyncrl_control::knobs::{KNOBS_KEY, encode_schedule, initial_knobs, new_schedule};
use asyncrl_protos::v1::{
    BatchReply, BatchRequest, FinishReason, LearnerStatus, RewardStatus, Timings, Trajectory,
    WeightAnnouncement,
};
use asyncrl_protos::{Message, subjects};
use asyncrl_transport::{Bus, LocalBus, NatsBus, TransportMetrics};
use bytes::Bytes;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

fn config(dir: &std::path::Path, max_steps: u64) -> Config {
    let mut c = Config::default();
    c.run.output_dir = dir.to_owned();
    c.run.max_steps = max_steps;
    c.staleness.groups_per_step = 2;
    c.staleness.group_size = 2;
    c.model.device = DeviceName::Cpu;
    c.model.tiny.hidden_size = 32;
    c.model.tiny.num_hidden_layers = 1;
    c.model.tiny.num_attention_heads = 2;
    c.model.tiny.num_key_value_heads = 1;
    c.model.tiny.intermediate_size = 64;
    c.learner.checkpoint_every = 2;
    c.learner.keep_weight_versions = 3;
    c.coordinator.initial_knobs.learning_rate = 1e-3;
    c
}

fn group(step: u64, g: u32) -> Vec<Trajectory> {
    (0..2u32)
        .map(|i| Trajectory {
            uuid: uuid::Uuid::from_u128(
                u128::from(step) << 32 | u128::from(g) << 8 | u128::from(i) | 1 << 100,
            )
            .to_string(),
            task_id: format!("t{step}-{g}"),
            group_id: format!("l{step}-{g}"),
            prompt_token_ids: vec![1, 5, 6, 7],
            completion_token_ids: vec![8 + i as i32, 2],
            behaviour_logprobs: vec![-1.0, -2.0],
            policy_versions: vec![0, 0],
            reward: i as f32,
            reward_status: RewardStatus::Ok as i32,
            finish_reason: FinishReason::Stop as i32,
            worker_id: "w".into(),
            timings: Some(Timings::default()),
            group_size: 2,
            index_in_group: i,
            admission_version: 0,
        })
        .collect()
}

/// A buffer that answers every batch request with B fresh groups, and
/// records the steps it was asked for.
async fn scripted_buffer(bus: Arc<dyn Bus>, asked: Arc<AtomicU64>) {
    let mut requests = bus.serve(subjects::BUFFER_BATCH, None).await.unwrap();
    tokio::spawn(async move {
        while let Some(req) = requests.next().await {
            let r = BatchRequest::decode(req.payload.as_ref()).unwrap();
            asked.fetch_max(r.step, Ordering::SeqCst);
            let trajs: Vec<Trajectory> = (0..r.num_groups).flat_map(|g| group(r.step, g)).collect();
            let rb = asyncrl_protos::arrow_schema::to_record_batch(&trajs).unwrap();
            let mut ipc = Vec::new();
            {
                let mut w =
                    arrow::ipc::writer::StreamWriter::try_new(&mut ipc, &rb.schema()).unwrap();
                w.write(&rb).unwrap();
                w.finish().unwrap();
            }
            let reply = BatchReply {
                arrow_ipc: Bytes::from(ipc),
                num_groups: r.num_groups,
                step: r.step,
                num_trajectories: trajs.len() as u32,
                ..Default::default()
            };
            req.respond(Bytes::from(reply.encode_to_vec()))
                .await
                .unwrap();
        }
    });
}

async fn announced(bus: &Arc<dyn Bus>) -> WeightAnnouncement {
    let kv = bus.kv(subjects::CONTROL_BUCKET).await.unwrap();
    WeightAnnouncement::decode(
        kv.get(subjects::POLICY_VERSION_KEY)
            .await
            .unwrap()
            .unwrap()
            .value
            .as_ref(),
    )
    .unwrap()
}

async fn exercise(bus: Arc<dyn Bus>) {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let asked = Arc::new(AtomicU64::new(0));
    scripted_buffer(bus.clone(), asked.clone()).await;
    let kv = bus.kv(subjects::CONTROL_BUCKET).await.unwrap();
    let c = config(dir.path(), 3);
    kv.put(KNOBS_KEY, encode_schedule(&new_schedule(initial_knobs(&c))))
        .await
        .unwrap();

    let summary = asyncrl_learner::service::run(
        c.clone(),
        bus.clone(),
        asyncrl_telemetry::Metrics::new(),
        CancellationToken::new(),
    )
    .await
    .unwrap();
    assert_eq!((summary.steps, summary.version), (3, 3));
    assert_eq!(asked.load(Ordering::SeqCst), 3);
    let a = announced(&bus).await;
    assert_eq!((a.version, a.step), (3, 3));
    let store = bus.object_store(subjects::WEIGHTS_BUCKET).await.unwrap();
    let bytes = store
        .get_expecting(&a.object_name, &a.sha256)
        .await
        .unwrap();
    assert_eq!(bytes.len() as u64, a.byte_size);
    // Versions 0..=3 were published; only the newest 3 are kept.
    let mut names: Vec<String> = store
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.name)
        .collect();
    names.sort();
    assert_eq!(
        names,
        (1..=3)
            .map(subjects::weights_object_name)
            .collect::<Vec<_>>()
    );
    let status = LearnerStatus::decode(
        kv.get(asyncrl_protos::subjects::LEARNER_STATUS_KEY)
            .await
            .unwrap()
            .unwrap()
            .value
            .as_ref(),
    )
    .unwrap();
    assert_eq!(status.step, 3);
    let csv = std::fs::read_to_string(&summary.metrics_csv).unwrap();
    assert_eq!(csv.lines().count(), 4, "header + 3 steps:\n{csv}");
    // Steps 1..=3 were sealed: a knob change for them would be refused.
    let sched =
        asyncrl_control::knobs::decode_schedule(&kv.get(KNOBS_KEY).await.unwrap().unwrap().value)
            .unwrap();
    assert_eq!(sched.sealed_through_step, 3);

    // The run's last step (3, not a multiple of checkpoint_every = 2) was
    // checkpointed when the run ended.
    let latest = asyncrl_learner::checkpoint::load_latest(&summary.checkpoint_dir)
        .unwrap()
        .expect("a checkpoint");
    assert_eq!(latest.meta.step, 3);
    // A crash between publishing version 3 and that checkpoint leaves the
    // one of step 2: emulate it.
    std::fs::remove_dir_all(&latest.dir).unwrap();
    assert_eq!(
        asyncrl_learner::checkpoint::load_latest(&summary.checkpoint_dir)
            .unwrap()
            .expect("the step-2 checkpoint")
            .meta
            .step,
        2
    );

    // Restart (the checkpoint is at step 2, version 3 was published after it):
    // the learner adopts version 3 and continues with step 4.
    let c = config(dir.path(), 5);
    let summary = asyncrl_learner::service::run(
        c,
        bus.clone(),
        asyncrl_telemetry::Metrics::new(),
        CancellationToken::new(),
    )
    .await
    .unwrap();
    assert_eq!((summary.steps, summary.version), (5, 5));
    assert_eq!(asked.load(Ordering::SeqCst), 5);
    assert_eq!(announced(&bus).await.version, 5);
    let status2 = LearnerStatus::decode(
        kv.get(asyncrl_protos::subjects::LEARNER_STATUS_KEY)
            .await
            .unwrap()
            .unwrap()
            .value
            .as_ref(),
    )
    .unwrap();
    assert_ne!(
        status2.session_id, status.session_id,
        "a restart is a new session"
    );
    assert_eq!(status2.start_version, 3);
    let csv = std::fs::read_to_string(&summary.metrics_csv).unwrap();
    assert_eq!(csv.lines().count(), 6, "the resumed run appends:\n{csv}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn learner_role_over_the_local_bus() {
    exercise(Arc::new(LocalBus::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn learner_role_over_nats() {
    let server = asyncrl_testkit::NatsServer::start().unwrap();
    let bus = NatsBus::connect(
        &asyncrl_config::BusConfig::nats(server.url()),
        TransportMetrics::new(),
    )
    .await
    .unwrap();
    exercise(Arc::new(bus)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_while_waiting_for_batches_checkpoints_and_returns() {
    let bus: Arc<dyn Bus> = Arc::new(LocalBus::new());
    let dir = tempfile::tempdir().unwrap();
    let c = config(dir.path(), 0);
    let kv = bus.kv(subjects::CONTROL_BUCKET).await.unwrap();
    kv.put(KNOBS_KEY, encode_schedule(&new_schedule(initial_knobs(&c))))
        .await
        .unwrap();
    let stop = CancellationToken::new();
    let task = tokio::spawn(asyncrl_learner::service::run(
        c,
        bus.clone(),
        asyncrl_telemetry::Metrics::new(),
        stop.clone(),
    ));
    // No buffer: the learner publishes version 0 and waits.
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(announced(&bus).await.version, 0);
    stop.cancel();
    let summary = tokio::time::timeout(Duration::from_secs(20), task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(summary.steps, 0);
    assert!(
        asyncrl_learner::checkpoint::load_latest(&summary.checkpoint_dir)
            .unwrap()
            .is_some(),
        "SIGTERM leaves a checkpoint"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffer_that_keeps_refusing_a_step_stops_the_learner_with_its_reason() {
    let bus: Arc<dyn Bus> = Arc::new(LocalBus::new());
    let dir = tempfile::tempdir().unwrap();
    let c = config(dir.path(), 3);
    let kv = bus.kv(subjects::CONTROL_BUCKET).await.unwrap();
    kv.put(KNOBS_KEY, encode_schedule(&new_schedule(initial_knobs(&c))))
        .await
        .unwrap();
    // What a buffer that served later steps of an earlier run answers.
    let mut requests = bus.serve(subjects::BUFFER_BATCH, None).await.unwrap();
    let asked = Arc::new(AtomicU64::new(0));
    let counter = asked.clone();
    tokio::spawn(async move {
        while let Some(req) = requests.next().await {
            counter.fetch_add(1, Ordering::SeqCst);
            let reply = BatchReply {
                error: "step 1 is already trained (a request for step 9 came before)".into(),
                ..Default::default()
            };
            let _ = req.respond(Bytes::from(reply.encode_to_vec())).await;
        }
    });
    let started = std::time::Instant::now();
    let result = tokio::time::timeout(
        Duration::from_secs(120),
        asyncrl_learner::service::run(
            c,
            bus.clone(),
            asyncrl_telemetry::Metrics::new(),
            CancellationToken::new(),
        ),
    )
    .await
    .expect("the learner gives up instead of asking forever");
    let e = result
        .expect_err("a permanent refusal is an error")
        .to_string();
    assert!(e.contains("refuses step 1"), "{e}");
    assert!(e.contains("already trained"), "{e}");
    assert!(
        started.elapsed() >= Duration::from_secs(30),
        "retried for a while first"
    );
    assert!(
        asked.load(Ordering::SeqCst) > 1,
        "it asked again before giving up"
    );
}
