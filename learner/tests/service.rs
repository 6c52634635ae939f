//! The learner role against a scripted buffer over the in-process bus and a
//! real nats-server: it publishes every version (weights in the object store,
//! announcement in `policy.version`, sha256 matching), reports its status,
//! writes its metrics file, and a restarted learner continues the version
//! sequence without going backwards. A checkpoint it cannot write is
//! counted and it trains on; what a crash cut off is removed at start.

mod common;

use std::sync::Arc;

use common::trained_steps;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use asyncrl_config::{Config, DeviceName};
use asyncrl_control::knobs::{KNOBS_KEY, encode_schedule, initial_knobs, new_schedule};
use asyncrl_learner::outputs::read_metrics;
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
            turns: Vec::new(),
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
    let rows = read_metrics(&summary.metrics_csv).unwrap();
    assert_eq!(
        rows.iter().map(|r| (r.step, r.version)).collect::<Vec<_>>(),
        [(1, 1), (2, 2), (3, 3)],
        "one row per step: {rows:?}"
    );
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
    let rows = read_metrics(&summary.metrics_csv).unwrap();
    assert_eq!(
        rows.iter().map(|r| (r.step, r.version)).collect::<Vec<_>>(),
        [(1, 1), (2, 2), (3, 3), (4, 4), (5, 5)],
        "the resumed run appends: {rows:?}"
    );
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

/// What the buffer's contract says about batch requests
/// (docs/contracts.md, Serving): a request for step `s` means every step
/// below `s` is trained, their groups are never served again and a request
/// for one of them is refused; a step served before and not yet trained
/// gets the same groups again.
#[derive(Default)]
struct ContractBuffer {
    done_through: u64,
    served: std::collections::BTreeMap<u64, Vec<Trajectory>>,
    /// Every trajectory ever served, by step.
    all: std::collections::BTreeMap<u64, Vec<String>>,
    /// (step, learner_version, eta) of every request.
    requests: Vec<(u64, i32, u32)>,
    refusals: Vec<String>,
}

impl ContractBuffer {
    fn answer(&mut self, r: &BatchRequest) -> BatchReply {
        self.requests.push((r.step, r.learner_version, r.eta));
        let trajs = if let Some(t) = self.served.get(&r.step) {
            t.clone()
        } else if r.step <= self.done_through {
            let e = format!("step {} is already trained", r.step);
            self.refusals.push(e.clone());
            return BatchReply {
                error: e,
                ..Default::default()
            };
        } else {
            let t: Vec<Trajectory> = (0..r.num_groups).flat_map(|g| group(r.step, g)).collect();
            self.done_through = r.step - 1;
            self.served = self.served.split_off(&r.step);
            self.served.insert(r.step, t.clone());
            self.all
                .insert(r.step, t.iter().map(|t| t.uuid.clone()).collect());
            t
        };
        let rb = asyncrl_protos::arrow_schema::to_record_batch(&trajs).unwrap();
        let mut ipc = Vec::new();
        {
            let mut w = arrow::ipc::writer::StreamWriter::try_new(&mut ipc, &rb.schema()).unwrap();
            w.write(&rb).unwrap();
            w.finish().unwrap();
        }
        BatchReply {
            arrow_ipc: Bytes::from(ipc),
            num_groups: r.num_groups,
            step: r.step,
            num_trajectories: trajs.len() as u32,
            ..Default::default()
        }
    }
}

/// A [`LocalBus`] whose weight uploads of one version wait at a gate, and
/// whose `policy.version` checks, at the moment of every announcement, that
/// the announced object is completely stored with the announced sha256 and
/// size.
struct GatedBus {
    inner: Arc<LocalBus>,
    gated_object: std::sync::Mutex<Option<String>>,
    gate: Arc<tokio::sync::Semaphore>,
    /// Sent when an upload reaches the gate.
    at_gate: tokio::sync::mpsc::UnboundedSender<String>,
    /// (version, the object was complete and matched) of every announcement.
    announcements: std::sync::Mutex<Vec<(i32, bool)>>,
}

struct GatedObjects {
    bus: Arc<GatedBus>,
    inner: Arc<dyn asyncrl_transport::ObjectStore>,
}

struct CheckedKv {
    bus: Arc<GatedBus>,
    inner: Arc<dyn asyncrl_transport::KvBucket>,
}

impl CheckedKv {
    /// An announcement written: its version, and whether its object was
    /// complete in the store by then.
    async fn record(
        &self,
        key: &str,
        value: &Bytes,
    ) -> Result<(), asyncrl_transport::TransportError> {
        if key == subjects::POLICY_VERSION_KEY {
            let a = WeightAnnouncement::decode(value.as_ref()).unwrap();
            let store = self
                .bus
                .inner
                .object_store(subjects::WEIGHTS_BUCKET)
                .await?;
            let complete = store
                .get_expecting(&a.object_name, &a.sha256)
                .await
                .is_ok_and(|b| b.len() as u64 == a.byte_size);
            self.bus
                .announcements
                .lock()
                .unwrap()
                .push((a.version, complete));
        }
        Ok(())
    }
}

mod gated {
    use super::*;
    use asyncrl_transport::{
        ConsumerSpec, KvBucket, KvEntry, KvEvent, ObjectInfo, ObjectStore, PublishAck, Request,
        StoreUsage, StreamSpec,
    };
    use futures::stream::BoxStream;
    type Result<T> = std::result::Result<T, asyncrl_transport::TransportError>;

    #[async_trait::async_trait]
    impl ObjectStore for GatedObjects {
        async fn put(&self, name: &str, data: Bytes) -> Result<ObjectInfo> {
            let gated = self.bus.gated_object.lock().unwrap().as_deref() == Some(name);
            if gated {
                let _ = self.bus.at_gate.send(name.to_owned());
                let _permit = self.bus.gate.acquire().await.unwrap();
            }
            self.inner.put(name, data).await
        }
        async fn get(&self, name: &str) -> Result<Bytes> {
            self.inner.get(name).await
        }
        async fn info(&self, name: &str) -> Result<Option<ObjectInfo>> {
            self.inner.info(name).await
        }
        async fn delete(&self, name: &str) -> Result<()> {
            self.inner.delete(name).await
        }
        async fn list(&self) -> Result<Vec<ObjectInfo>> {
            self.inner.list().await
        }
    }

    #[async_trait::async_trait]
    impl KvBucket for CheckedKv {
        async fn get(&self, key: &str) -> Result<Option<KvEntry>> {
            self.inner.get(key).await
        }
        async fn put(&self, key: &str, value: Bytes) -> Result<u64> {
            self.record(key, &value).await?;
            self.inner.put(key, value).await
        }
        async fn create(&self, key: &str, value: Bytes) -> Result<u64> {
            let revision = self.inner.create(key, value.clone()).await?;
            self.record(key, &value).await?;
            Ok(revision)
        }
        async fn update(&self, key: &str, value: Bytes, revision: u64) -> Result<u64> {
            let revision = self.inner.update(key, value.clone(), revision).await?;
            self.record(key, &value).await?;
            Ok(revision)
        }
        async fn delete(&self, key: &str) -> Result<()> {
            self.inner.delete(key).await
        }
        async fn keys(&self) -> Result<Vec<String>> {
            self.inner.keys().await
        }
        async fn watch(&self, key: &str) -> Result<BoxStream<'static, Result<KvEvent>>> {
            self.inner.watch(key).await
        }
    }

    /// The bus the learner is given: `Arc<GatedBus>` (the stores it opens
    /// point back at it).
    pub struct Handle(pub Arc<GatedBus>);

    #[async_trait::async_trait]
    impl Bus for Handle {
        fn kind(&self) -> &'static str {
            "gated-local"
        }
        async fn publish(&self, subject: &str, payload: Bytes) -> Result<()> {
            self.0.inner.publish(subject, payload).await
        }
        async fn subscribe(
            &self,
            subject: &str,
        ) -> Result<BoxStream<'static, asyncrl_transport::Message>> {
            self.0.inner.subscribe(subject).await
        }
        async fn request(&self, subject: &str, payload: Bytes, timeout: Duration) -> Result<Bytes> {
            self.0.inner.request(subject, payload, timeout).await
        }
        async fn serve(
            &self,
            subject: &str,
            q: Option<&str>,
        ) -> Result<BoxStream<'static, Request>> {
            self.0.inner.serve(subject, q).await
        }
        async fn ensure_stream(&self, spec: &StreamSpec) -> Result<()> {
            self.0.inner.ensure_stream(spec).await
        }
        async fn publish_durable(
            &self,
            subject: &str,
            id: &str,
            payload: Bytes,
        ) -> Result<PublishAck> {
            self.0.inner.publish_durable(subject, id, payload).await
        }
        async fn stream_len(&self, stream: &str) -> Result<u64> {
            self.0.inner.stream_len(stream).await
        }
        async fn storage(&self) -> Result<Vec<StoreUsage>> {
            self.0.inner.storage().await
        }
        async fn consumer(
            &self,
            stream: &str,
            spec: &ConsumerSpec,
        ) -> Result<Box<dyn asyncrl_transport::Consumer>> {
            self.0.inner.consumer(stream, spec).await
        }
        async fn kv(&self, bucket: &str) -> Result<Arc<dyn KvBucket>> {
            Ok(Arc::new(CheckedKv {
                bus: self.0.clone(),
                inner: self.0.inner.kv(bucket).await?,
            }))
        }
        async fn object_store(&self, bucket: &str) -> Result<Arc<dyn ObjectStore>> {
            Ok(Arc::new(GatedObjects {
                bus: self.0.clone(),
                inner: self.0.inner.object_store(bucket).await?,
            }))
        }
        async fn flush(&self) -> Result<()> {
            self.0.inner.flush().await
        }
    }
}

/// The learner asks for step s + 1 while step s trains and uploads the
/// weights of s while s + 1 trains. Killed (its task dropped, nothing
/// graceful) after it has trained steps 2 and 3, with the buffer already
/// past them (it asked for step 4) and version 2 still uploading, the
/// restarted learner retrains steps 2 and 3 on exactly the same groups from
/// its kept copies (the buffer would refuse them), and every trajectory
/// served is trained exactly once. No announcement ever names an object
/// that is not completely stored with its sha256, versions are announced in
/// order (3 never before 2), and every batch is asked for at the version
/// that trains it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefetched_batch_is_trained_exactly_once_across_a_kill_and_uploads_announce_in_order() {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let (at_gate_tx, mut at_gate) = tokio::sync::mpsc::unbounded_channel();
    let gated = Arc::new(GatedBus {
        inner: Arc::new(LocalBus::new()),
        gated_object: std::sync::Mutex::new(Some(subjects::weights_object_name(2))),
        gate: Arc::new(tokio::sync::Semaphore::new(0)),
        at_gate: at_gate_tx,
        announcements: std::sync::Mutex::new(Vec::new()),
    });
    let bus: Arc<dyn Bus> = Arc::new(gated::Handle(gated.clone()));
    let buffer = Arc::new(std::sync::Mutex::new(ContractBuffer::default()));
    let (asked_tx, mut asked) = tokio::sync::mpsc::unbounded_channel();
    {
        let mut requests = bus.serve(subjects::BUFFER_BATCH, None).await.unwrap();
        let buffer = buffer.clone();
        tokio::spawn(async move {
            while let Some(req) = requests.next().await {
                let r = BatchRequest::decode(req.payload.as_ref()).unwrap();
                let reply = buffer.lock().unwrap().answer(&r);
                let _ = req.respond(Bytes::from(reply.encode_to_vec())).await;
                let _ = asked_tx.send(r.step);
            }
        });
    }
    let mut c = config(dir.path(), 6);
    // No checkpoint before the kill: the restart adopts version 1.
    c.learner.checkpoint_every = 100;
    let kv = bus.kv(subjects::CONTROL_BUCKET).await.unwrap();
    kv.put(KNOBS_KEY, encode_schedule(&new_schedule(initial_knobs(&c))))
        .await
        .unwrap();

    let first = tokio::spawn(asyncrl_learner::service::run(
        c.clone(),
        bus.clone(),
        asyncrl_telemetry::Metrics::new(),
        CancellationToken::new(),
    ));
    let deadline = Duration::from_secs(60);
    let gated_name = tokio::time::timeout(deadline, at_gate.recv())
        .await
        .expect("the upload of version 2 reaches the gate")
        .unwrap();
    assert_eq!(gated_name, subjects::weights_object_name(2));
    // Step 4 is asked for when step 3 starts training: the buffer now
    // takes steps 1..=3 as trained.
    tokio::time::timeout(deadline, async { while asked.recv().await != Some(4) {} })
        .await
        .expect("step 4 is asked for while step 3 trains");
    // Step 3 trained (it waits for version 2's upload to publish its own).
    tokio::time::timeout(deadline, async {
        while !trained_steps(dir.path()).contains_key(&3) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("step 3 is trained while version 2 uploads");
    assert_eq!(
        announced(&bus).await.version,
        1,
        "version 2 is not announced before its object is stored, nor 3 before 2"
    );
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());
    assert!(
        buffer.lock().unwrap().done_through >= 3,
        "the buffer no longer replays steps 2 and 3"
    );

    // The restart: no more gate.
    *gated.gated_object.lock().unwrap() = None;
    let summary = tokio::time::timeout(
        Duration::from_secs(120),
        asyncrl_learner::service::run(
            c.clone(),
            bus.clone(),
            asyncrl_telemetry::Metrics::new(),
            CancellationToken::new(),
        ),
    )
    .await
    .expect("the restarted learner finishes")
    .unwrap();
    assert_eq!((summary.steps, summary.version), (6, 6));

    let b = buffer.lock().unwrap();
    assert!(b.refusals.is_empty(), "refused: {:?}", b.refusals);
    for &(step, version, _) in &b.requests {
        assert_eq!(
            i64::from(version),
            step as i64 - 1,
            "step {step} is asked for at the version that trains it"
        );
    }
    let trained = trained_steps(dir.path());
    assert_eq!(
        trained.keys().copied().collect::<Vec<_>>(),
        (1..=6).collect::<Vec<_>>()
    );
    let mut seen = std::collections::HashSet::new();
    for (step, t) in &trained {
        assert_eq!(
            (t.trained_at_version, t.published_version),
            (*step as i32 - 1, *step as i32),
            "step {step}"
        );
        let ids = &t.trajectories;
        assert_eq!(
            ids, &b.all[step],
            "step {step} trained on the groups served for it"
        );
        for id in ids {
            assert!(seen.insert(id.clone()), "{id} trained twice");
        }
    }
    let served: usize = b.all.values().map(Vec::len).sum();
    assert_eq!(seen.len(), served, "every trajectory served is trained");

    let announcements = gated.announcements.lock().unwrap().clone();
    assert!(
        announcements.iter().all(|(_, complete)| *complete),
        "an announcement named an incomplete object: {announcements:?}"
    );
    assert_eq!(
        announcements.iter().map(|a| a.0).collect::<Vec<_>>(),
        (0..=6).collect::<Vec<_>>(),
        "versions announced once each, in order"
    );
    let pending = summary.checkpoint_dir.join("pending-batches");
    assert_eq!(
        std::fs::read_dir(&pending).map(|d| d.count()).unwrap_or(0),
        0,
        "kept batches are deleted once their versions are announced"
    );
}

/// Checkpoints at every step; those of steps 2 and 3 cannot be written
/// (their folders are taken by files: the tests run as root, which chmod
/// does not stop). Each failure is counted, the learner trains on to its
/// step target and the next checkpoint is written; a write a crash cut off
/// is removed at start, and the failed writes leave nothing behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_that_cannot_be_written_is_counted_and_the_learner_trains_on() {
    tch::set_num_threads(1);
    let bus: Arc<dyn Bus> = Arc::new(LocalBus::new());
    let dir = tempfile::tempdir().unwrap();
    scripted_buffer(bus.clone(), Arc::new(AtomicU64::new(0))).await;
    let mut c = config(dir.path(), 4);
    c.learner.checkpoint_every = 1;
    c.learner.keep_checkpoints = 10;
    let kv = bus.kv(subjects::CONTROL_BUCKET).await.unwrap();
    kv.put(KNOBS_KEY, encode_schedule(&new_schedule(initial_knobs(&c))))
        .await
        .unwrap();
    let ckpt = asyncrl_learner::service::checkpoint_dir(&c);
    std::fs::create_dir_all(&ckpt).unwrap();
    let cut_off = ckpt.join("step-00000009.tmp-4242");
    std::fs::create_dir(&cut_off).unwrap();
    std::fs::write(cut_off.join("model.safetensors"), b"half").unwrap();
    for step in [2, 3] {
        std::fs::write(ckpt.join(format!("step-{step:08}")), b"in the way").unwrap();
    }
    let metrics = asyncrl_telemetry::Metrics::new();
    let summary = tokio::time::timeout(
        Duration::from_secs(120),
        asyncrl_learner::service::run(c, bus.clone(), metrics.clone(), CancellationToken::new()),
    )
    .await
    .expect("the learner finishes")
    .expect("failed checkpoints do not stop the learner");
    assert_eq!((summary.steps, summary.version), (4, 4));
    assert_eq!(announced(&bus).await.version, 4);

    let text = metrics.encode_prometheus_text().unwrap();
    let value = |name: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {text}"))
    };
    assert_eq!(
        value("asyncrl_learner_checkpoint_failures_total{reason=\"io\"}"),
        2.0
    );
    assert_eq!(value("asyncrl_learner_checkpoints_total"), 2.0);
    assert_eq!(value("asyncrl_learner_checkpoint_last_step"), 4.0);

    assert!(
        !cut_off.exists(),
        "the cut-off write was not removed at start"
    );
    let left: Vec<String> = std::fs::read_dir(&ckpt)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp"))
        .collect();
    assert!(left.is_empty(), "temporary files left: {left:?}");
    let written: Vec<u64> = asyncrl_learner::checkpoint::step_dirs(&ckpt)
        .unwrap()
        .into_iter()
        .filter(|(_, p)| p.is_dir())
        .map(|(s, _)| s)
        .collect();
    assert_eq!(written, vec![4, 1]);
    let latest = asyncrl_learner::checkpoint::load_latest(&ckpt)
        .unwrap()
        .expect("a checkpoint");
    assert_eq!(latest.meta.step, 4);
}
