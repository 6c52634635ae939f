//! Shared helpers of the buffer's integration tests.
#![allow(dead_code)]

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use asyncrl_buffer::{Buffer, BufferHandle, CancellationToken, decode_batch};
use asyncrl_config::Config;
use asyncrl_protos::arrow_schema::from_record_batch;
use asyncrl_protos::subjects::{BUFFER_BATCH, trajectory_subject};
use asyncrl_protos::v1::{BatchReply, BatchRequest};
use asyncrl_protos::{Message, Trajectory};
use asyncrl_telemetry::Metrics;
use asyncrl_transport::{Bus, NatsBus, TransportMetrics};

/// A config for a test: the bus at `url`, the buffer's data in `dir`, short
/// waits so that tests are quick.
pub fn config(url: &str, dir: &Path) -> Config {
    let mut c = Config::isolated(dir.join("run"), url);
    c.bus.connect_timeout = Duration::from_secs(5);
    c.buffer.data_dir = Some(dir.join("buffer"));
    c.buffer.ingest_batch = 64;
    c.buffer.fetch_wait = Duration::from_millis(50);
    c.buffer.ack_wait = Duration::from_secs(2);
    c.validate().expect("test config");
    c
}

pub async fn nats(url: &str) -> Arc<dyn Bus> {
    let config = config(url, Path::new("/unused"));
    Arc::new(
        NatsBus::connect(&config.bus, TransportMetrics::new())
            .await
            .expect("connect to the test nats-server"),
    )
}

/// A buffer running in this process, with its own metrics registry.
pub struct Running {
    pub handle: BufferHandle,
    pub metrics: Metrics,
    pub stop: CancellationToken,
    pub recovered: asyncrl_buffer::Recovered,
    pub task: tokio::task::JoinHandle<Result<(), asyncrl_buffer::BufferError>>,
}

impl Running {
    pub async fn start(config: &Config, bus: Arc<dyn Bus>) -> Self {
        let metrics = Metrics::new();
        let buffer = Buffer::open(config, bus, &metrics)
            .await
            .expect("open buffer");
        let handle = buffer.handle();
        let recovered = buffer.recovered().clone();
        let stop = CancellationToken::new();
        let task = tokio::spawn(buffer.run(stop.clone()));
        Self {
            handle,
            metrics,
            stop,
            recovered,
            task,
        }
    }

    pub async fn shutdown(self) {
        self.stop.cancel();
        self.task
            .await
            .expect("buffer task")
            .expect("buffer ran without error");
    }

    /// The value of `asyncrl_<name>` (a counter's `_total` included).
    pub fn metric(&self, name: &str) -> f64 {
        metric(&self.metrics, name)
    }
}

pub fn metric(metrics: &Metrics, name: &str) -> f64 {
    let text = metrics.encode_prometheus_text().expect("encode metrics");
    let prefix = format!("asyncrl_{name} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Publishes trajectories the way workers do: subject per task, msg id = uuid.
pub async fn publish(bus: &dyn Bus, trajs: &[Trajectory]) {
    for t in trajs {
        publish_as(bus, t, &t.uuid).await;
    }
}

pub async fn publish_as(bus: &dyn Bus, t: &Trajectory, msg_id: &str) {
    bus.publish_durable(
        &trajectory_subject(&t.task_id),
        msg_id,
        Bytes::from(t.encode_to_vec()),
    )
    .await
    .expect("publish trajectory");
}

/// Waits until `f` holds, failing the test after `timeout`.
pub async fn eventually(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    asyncrl_testkit::eventually(what, timeout, || std::future::ready(f().then_some(()))).await
}

/// A learner's request, and the trajectories of the reply (fetched from the
/// object store when the batch was handed over there).
pub async fn ask(
    bus: &dyn Bus,
    step: u64,
    version: i32,
    eta: u32,
    groups: u32,
    wait_ms: u32,
) -> Result<(BatchReply, Vec<Trajectory>), String> {
    let req = BatchRequest {
        learner_version: version,
        num_groups: groups,
        eta,
        zstd: step.is_multiple_of(2),
        step,
        wait_ms,
        ..Default::default()
    };
    ask_request(bus, req).await
}

/// Sends `req` as the learner does; the reply and its trajectories.
pub async fn ask_request(
    bus: &dyn Bus,
    req: BatchRequest,
) -> Result<(BatchReply, Vec<Trajectory>), String> {
    let wait_ms = req.wait_ms;
    let timeout = Duration::from_millis(u64::from(wait_ms) + 5_000);
    let bytes = bus
        .request(BUFFER_BATCH, Bytes::from(req.encode_to_vec()), timeout)
        .await
        .map_err(|e| e.to_string())?;
    let reply = BatchReply::decode(bytes).map_err(|e| e.to_string())?;
    if !reply.error.is_empty() {
        return Err(reply.error.clone());
    }
    let ipc = if reply.object_name.is_empty() {
        reply.arrow_ipc.clone()
    } else {
        bus.object_store(&reply.object_bucket)
            .await
            .map_err(|e| e.to_string())?
            .get(&reply.object_name)
            .await
            .map_err(|e| e.to_string())?
    };
    let mut trajs = Vec::new();
    if reply.num_groups > 0 {
        for b in decode_batch(&ipc).map_err(|e| e.to_string())? {
            trajs.extend(from_record_batch(&b).map_err(|e| e.to_string())?);
        }
        if trajs.len() != reply.num_trajectories as usize {
            return Err(format!(
                "reply says {} trajectories, batch holds {}",
                reply.num_trajectories,
                trajs.len()
            ));
        }
    }
    Ok((reply, trajs))
}

pub fn uuids(trajs: &[Trajectory]) -> HashSet<String> {
    trajs.iter().map(|t| t.uuid.clone()).collect()
}

/// Groups of a batch, in order, each checked to be complete and contiguous.
pub fn groups_of(trajs: &[Trajectory]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for chunk in trajs.chunk_by(|a, b| a.group_id == b.group_id) {
        let g = chunk[0].group_size as usize;
        assert_eq!(
            chunk.len(),
            g,
            "group {} is not complete",
            chunk[0].group_id
        );
        let idx: Vec<u32> = chunk.iter().map(|t| t.index_in_group).collect();
        assert_eq!(
            idx,
            (0..g as u32).collect::<Vec<_>>(),
            "members out of order"
        );
        out.push(chunk[0].group_id.clone());
    }
    out
}
