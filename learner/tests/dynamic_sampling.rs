//! Dynamic sampling end to end over a real nats-server: the real buffer
//! (`buffer.min_reward_spread` on) and the real learner, killed mid-run and
//! restarted. No group whose rewards do not spread is trained (each is
//! reported dropped, `no_signal`, once), and every other trajectory is
//! trained exactly once across the kill.

mod common;

use std::collections::HashSet;

use common::trained_steps;
use std::sync::Arc;
use std::time::Duration;

use asyncrl_config::{Config, DeviceName};
use asyncrl_control::knobs::{KNOBS_KEY, encode_schedule, initial_knobs, new_schedule};
use asyncrl_protos::subjects::{self, BUFFER_GROUP_DROPPED, trajectory_subject};
use asyncrl_protos::v1::{FinishReason, GroupDropped, RewardStatus, Timings, Trajectory};
use asyncrl_protos::{GroupDropReason, Message};
use asyncrl_transport::{Bus, NatsBus, TransportMetrics};
use bytes::Bytes;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

const STEPS: u64 = 6;
const WAIT: Duration = Duration::from_secs(120);

fn config(dir: &std::path::Path, url: &str) -> Config {
    let mut c = Config::isolated(dir.join("run"), url);
    c.run.max_steps = STEPS;
    c.staleness.groups_per_step = 2;
    c.staleness.group_size = 2;
    // Every group is sampled at version 0: none goes stale in this run.
    c.staleness.eta = 8;
    c.model.device = DeviceName::Cpu;
    c.model.tiny.hidden_size = 32;
    c.model.tiny.num_hidden_layers = 1;
    c.model.tiny.num_attention_heads = 2;
    c.model.tiny.num_key_value_heads = 1;
    c.model.tiny.intermediate_size = 64;
    c.learner.checkpoint_every = 2;
    c.learner.keep_weight_versions = 3;
    // The restarted learner takes the killed one's lease once it lapses.
    c.learner.lease_ttl = Duration::from_millis(500);
    c.coordinator.initial_knobs.learning_rate = 1e-3;
    c.buffer.data_dir = Some(dir.join("buffer"));
    c.buffer.ingest_batch = 64;
    c.buffer.fetch_wait = Duration::from_millis(50);
    c.buffer.ack_wait = Duration::from_secs(2);
    c.buffer.min_reward_spread = 0.5;
    c.validate().expect("test config");
    c
}

/// Group `g` (task `t{g}`, lease `l{g}`) of two members, rewarded 0 and 1,
/// or both 1 when `flat`.
fn group(g: u32, flat: bool) -> Vec<Trajectory> {
    (0..2u32)
        .map(|i| Trajectory {
            uuid: uuid::Uuid::from_u128(u128::from(g) << 8 | u128::from(i) | 1 << 100).to_string(),
            task_id: format!("t{g}"),
            group_id: format!("l{g}"),
            prompt_token_ids: vec![1, 5, 6, 7],
            completion_token_ids: vec![8 + i as i32, 2],
            behaviour_logprobs: vec![-1.0, -2.0],
            policy_versions: vec![0, 0],
            reward: if flat { 1.0 } else { i as f32 },
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_group_without_signal_is_trained_and_the_rest_once_across_a_learner_kill() {
    tch::set_num_threads(1);
    let server = asyncrl_testkit::NatsServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let c = config(dir.path(), &server.url());
    let bus: Arc<dyn Bus> = Arc::new(
        NatsBus::connect(&c.bus, TransportMetrics::new())
            .await
            .unwrap(),
    );
    let kv = bus.kv(subjects::CONTROL_BUCKET).await.unwrap();
    kv.put(KNOBS_KEY, encode_schedule(&new_schedule(initial_knobs(&c))))
        .await
        .unwrap();
    let buffer_metrics = asyncrl_telemetry::Metrics::new();
    let buffer = asyncrl_buffer::Buffer::open(&c, bus.clone(), &buffer_metrics)
        .await
        .unwrap();
    let buffer_stop = CancellationToken::new();
    let buffer_task = tokio::spawn(buffer.run(buffer_stop.clone()));
    let mut reports = bus.subscribe(BUFFER_GROUP_DROPPED).await.unwrap();
    // 18 groups, every third without signal: 12 with signal, as many as 6
    // steps of 2 train.
    let mut flat = HashSet::new();
    let mut with_signal = HashSet::new();
    for g in 0..18u32 {
        let no_signal = g % 3 == 1;
        for t in group(g, no_signal) {
            if no_signal {
                flat.insert(t.group_id.clone());
            } else {
                with_signal.insert(t.uuid.clone());
            }
            bus.publish_durable(
                &trajectory_subject(&t.task_id),
                &t.uuid,
                Bytes::from(t.encode_to_vec()),
            )
            .await
            .unwrap();
        }
    }
    let out = c.run.output_dir.clone();

    // The first learner trains steps 1..=3, then is killed (its task
    // dropped, nothing graceful).
    let first = tokio::spawn(asyncrl_learner::service::run(
        c.clone(),
        bus.clone(),
        asyncrl_telemetry::Metrics::new(),
        CancellationToken::new(),
    ));
    asyncrl_testkit::eventually("step 3 trained", WAIT, || async {
        trained_steps(&out).contains_key(&3).then_some(())
    })
    .await;
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());

    // The restarted learner finishes the run.
    let summary = tokio::time::timeout(
        WAIT,
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
    assert_eq!((summary.steps, summary.version), (STEPS, STEPS as i32));

    // Every step once (a retrained step lists the same trajectories), no
    // trajectory twice, none of a group without signal, all the others.
    let trained = trained_steps(&out);
    assert_eq!(
        trained.keys().copied().collect::<Vec<_>>(),
        (1..=STEPS).collect::<Vec<_>>()
    );
    let mut seen = HashSet::new();
    for (step, t) in &trained {
        assert_eq!(t.trajectories.len(), 4, "step {step}: 2 groups of 2");
        for id in &t.trajectories {
            assert!(seen.insert(id.clone()), "{id} trained twice");
            assert!(
                with_signal.contains(id),
                "step {step} trained {id}, of a group without signal"
            );
        }
    }
    assert_eq!(seen, with_signal, "every group with signal is trained");

    // Each group without signal was reported dropped once, with its reason.
    let mut dropped = HashSet::new();
    while dropped.len() < flat.len() {
        let msg = tokio::time::timeout(WAIT, reports.next())
            .await
            .expect("a drop report")
            .unwrap();
        let d = GroupDropped::decode(msg.payload).unwrap();
        assert_eq!(d.kind(), GroupDropReason::NoSignal, "{d:?}");
        assert!(dropped.insert(d.group_id.clone()), "{d:?} reported twice");
    }
    assert_eq!(dropped, flat);
    let text = buffer_metrics.encode_prometheus_text().unwrap();
    assert!(
        text.contains("asyncrl_buffer_groups_dropped_total{reason=\"no_signal\"} 6"),
        "{text}"
    );
    buffer_stop.cancel();
    buffer_task.await.unwrap().unwrap();
}
