//! The running buffer: recovery, the ingest loop and the batch server.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use tokio::sync::watch;

use asyncrl_config::{BufferConfig, Config, RetentionPolicy};
use asyncrl_protos::arrow_schema::{from_record_batch, to_record_batch, trajectory_schema};
use asyncrl_protos::subjects::{
    BUFFER_BATCH, BUFFER_GROUP_DROPPED, CONTROL_BUCKET, DEAD_LETTER_PAYLOAD_MAX,
    DEAD_LETTER_SUBJECT, EPOCHS_CLOSED_KEY, TRAJECTORY_STREAM, TRAJECTORY_SUBJECT_PREFIX,
};
use asyncrl_protos::v1::{
    BatchReply, BatchRequest, DeadLetter, EpochsClosed, GroupDropped, RefusedGroup,
};
use asyncrl_protos::{ContractError, GroupDropReason, Message, Trajectory, decode_trajectory};
use asyncrl_telemetry::{Health, Metrics};
use asyncrl_transport::{Bus, Consumer, ConsumerSpec, DeliverFrom, Delivery, ObjectStore, Request};
use tokio_util::sync::CancellationToken;

use crate::core::{Applied, Ask, Core, DroppedGroup, Outcome, RowMeta, Stats};
use crate::metrics::BufferMetrics;
use crate::reply::encode_batch;
use crate::segment::{self, SegmentWriter};
use crate::statelog::StateLog;
use crate::{BufferError, segment_dir};

/// Readiness condition the buffer declares in [`Health`].
pub const HEALTH_CONDITION: &str = "buffer";
/// Readiness condition that is not ready while a disk write the buffer
/// depends on fails (a full disk); the reason names the file and the OS error.
pub const DISK_HEALTH_CONDITION: &str = "buffer_disk";
/// First retry of a failed segment write; the delay doubles up to
/// [`disk_retry_max`].
const DISK_RETRY_MIN: Duration = Duration::from_millis(100);
/// Queue group of the batch server.
const SERVE_QUEUE: &str = asyncrl_protos::subjects::BUFFER_QUEUE_GROUP;

use asyncrl_common::{Backoff, unix_ms};
pub use asyncrl_control::streams::{
    dead_letter_stream_spec, group_drop_stream_spec, trajectory_stream_spec,
};

/// How long a stopping buffer keeps trying to deliver the drop reports it
/// still holds.
const DROP_REPORT_DRAIN: Duration = Duration::from_secs(5);

struct Shared {
    core: Mutex<Core>,
    /// Bumped whenever groups become ready (wakes waiting batch requests).
    ready: watch::Sender<u64>,
    metrics: BufferMetrics,
    health: Health,
    bus: Arc<dyn Bus>,
    seg_dir: PathBuf,
    retention: RetentionPolicy,
    /// The writers whose last disk write failed, with why (see
    /// [`Shared::disk_failed`]).
    disk: Mutex<BTreeMap<DiskUser, DiskEpisode>>,
    /// Drop reports for the reporter task ([`report_drops`]).
    drops: tokio::sync::mpsc::UnboundedSender<GroupDropped>,
}

/// A part of the buffer that needs the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum DiskUser {
    /// Segment writes: without them nothing is acked.
    Ingest,
    /// Served-log writes: without them no batch is served.
    Serve,
}

impl DiskUser {
    fn consequence(self) -> &'static str {
        match self {
            DiskUser::Ingest => {
                "ingest stopped (nothing acked, the fetched batch is retried with backoff)"
            }
            DiskUser::Serve => "batch requests refused (a batch is never served unlogged)",
        }
    }
}

/// A run of failed disk writes of one [`DiskUser`].
struct DiskEpisode {
    reason: String,
    failures: u64,
    since: Instant,
}

impl Shared {
    fn core(&self) -> MutexGuard<'_, Core> {
        // Every core method leaves it consistent before it can panic (none
        // is expected to), so a poisoned lock is still usable.
        self.core.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn update_gauges(&self) {
        let s = self.core().stats();
        let m = &self.metrics;
        m.ready_groups.set(s.ready_groups as i64);
        m.collecting_groups.set(s.collecting_groups as i64);
        m.remembered_tasks.set(s.completed_tasks as i64);
        m.closed_epoch.set(
            s.closed_epoch
                .map_or(-1, |e| i64::try_from(e).unwrap_or(i64::MAX)),
        );
        m.resident_bytes.set(s.resident_bytes as i64);
        m.resident_bytes_per_token.set(if s.live_tokens > 0 {
            s.resident_bytes as f64 / s.live_tokens as f64
        } else {
            0.0
        });
    }

    /// A disk write of `user` failed (`what` names the write, for the
    /// metric). The first failure of an episode is logged as a warning and
    /// makes the buffer unready with the reason; retries only count.
    fn disk_failed(&self, user: DiskUser, what: &'static str, error: &BufferError) {
        self.metrics
            .disk_write_failures
            .get_or_create(&BufferMetrics::what(what))
            .inc();
        let mut disk = self.disk.lock().unwrap_or_else(PoisonError::into_inner);
        let reason = format!("{}: {error}", user.consequence());
        match disk.get_mut(&user) {
            Some(episode) => {
                episode.failures += 1;
                tracing::debug!(?user, what, error = %error, failures = episode.failures, "disk write failed again");
                if episode.reason == reason {
                    return;
                }
                episode.reason = reason;
            }
            None => {
                tracing::warn!(?user, what, error = %error, consequence = user.consequence(), "cannot write to disk (full?); the buffer is unready until a write succeeds");
                disk.insert(
                    user,
                    DiskEpisode {
                        reason,
                        failures: 1,
                        since: Instant::now(),
                    },
                );
            }
        }
        self.metrics.disk_write_blocked.set(1);
        self.set_disk_health(&disk);
    }

    /// A disk write of `user` succeeded: ends its episode, if any.
    fn disk_ok(&self, user: DiskUser) {
        let mut disk = self.disk.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(episode) = disk.remove(&user) else {
            return;
        };
        tracing::info!(
            ?user,
            failures = episode.failures,
            blocked_s = episode.since.elapsed().as_secs_f64(),
            "disk writes succeed again; resumed"
        );
        if disk.is_empty() {
            self.metrics.disk_write_blocked.set(0);
        }
        self.set_disk_health(&disk);
    }

    fn set_disk_health(&self, disk: &BTreeMap<DiskUser, DiskEpisode>) {
        if disk.is_empty() {
            self.health.set_ready(DISK_HEALTH_CONDITION);
        } else {
            let reasons: Vec<&str> = disk.values().map(|e| e.reason.as_str()).collect();
            self.health
                .set_not_ready(DISK_HEALTH_CONDITION, reasons.join("; "));
        }
    }

    async fn report_dropped(&self, dropped: &[DroppedGroup]) {
        for d in dropped {
            self.metrics
                .groups_dropped
                .get_or_create(&BufferMetrics::reason(d.reason.label()))
                .inc();
            if d.reason == GroupDropReason::Stale {
                self.metrics.stale_dropped.inc();
            }
            if d.reason == GroupDropReason::NoSignal {
                self.metrics.update_no_signal_fraction();
            }
            tracing::info!(task = %d.task, group = %d.group, reason = d.reason.label(), trajectories = d.trajectories, "group dropped");
            self.send_drop_report(GroupDropped {
                task_id: d.task.clone(),
                group_id: d.group.clone(),
                kind: d.reason as i32,
                trajectories: d.trajectories,
            });
        }
    }

    /// Hands a report to the reporter task ([`report_drops`]).
    fn send_drop_report(&self, msg: GroupDropped) {
        self.metrics.drop_reports_pending.inc();
        if let Err(e) = self.drops.send(msg) {
            self.metrics.drop_reports_pending.dec();
            tracing::error!(group = %e.0.group_id, "the drop reporter has stopped; a dropped group is not reported");
        }
    }

    /// Reports again, at start, the stale drops whose task is still open:
    /// a report stored in the served log but not yet in the stream died
    /// with the previous process. The coordinator applies a report once
    /// (a repeat finds its completion gone); the stream's duplicate window
    /// drops a recent repeat before that.
    fn report_open_stale_drops(&self) {
        let open = self.core().stale_drops();
        if open.is_empty() {
            return;
        }
        tracing::info!(
            groups = open.len(),
            "reporting the stale drops of open tasks again"
        );
        for (task, group) in open {
            self.send_drop_report(GroupDropped {
                task_id: task.to_string(),
                group_id: group.to_string(),
                kind: GroupDropReason::Stale as i32,
                trajectories: 0,
            });
        }
    }

    /// Deletes the segments that hold nothing live any more (retention).
    async fn retire_segments(&self) -> Result<(), BufferError> {
        if self.retention != RetentionPolicy::Delete {
            return Ok(());
        }
        let ids = self.core().deletable_segments();
        if ids.is_empty() {
            return Ok(());
        }
        let dir = self.seg_dir.clone();
        let deleted = tokio::task::spawn_blocking(move || {
            let mut deleted = Vec::new();
            for id in ids {
                segment::delete_segment(&dir, id)?;
                deleted.push(id);
            }
            Ok::<_, BufferError>((deleted, segment::disk_bytes(&dir)))
        })
        .await??;
        let (deleted, disk) = deleted;
        let mut core = self.core();
        for id in &deleted {
            core.forget_segment(*id);
            tracing::info!(segment = id, "segment fully consumed; deleted");
        }
        self.metrics.segments_deleted.inc_by(deleted.len() as u64);
        self.metrics.disk_bytes.set(disk as i64);
        Ok(())
    }
}

/// A cheap handle on a running buffer's state (for tests and status pages).
#[derive(Clone)]
pub struct BufferHandle {
    shared: Arc<Shared>,
}

impl BufferHandle {
    pub fn stats(&self) -> Stats {
        self.shared.core().stats()
    }

    /// Trajectories stored since the start (`asyncrl_buffer_ingested_trajectories_total`),
    /// without locking the buffer's state.
    pub fn ingested(&self) -> u64 {
        self.shared.metrics.ingested.get()
    }
}

/// What recovery found on disk.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Recovered {
    pub segments: usize,
    pub trajectories: usize,
    pub torn_tails: usize,
    pub log_records: usize,
    pub missing_groups: Vec<String>,
}

/// An opened buffer: state recovered from disk, streams and consumer ready.
pub struct Buffer {
    shared: Arc<Shared>,
    config: BufferConfig,
    writer: SegmentWriter,
    log: StateLog,
    consumer: Box<dyn Consumer>,
    requests: futures::stream::BoxStream<'static, Request>,
    recovered: Recovered,
    /// The `asyncrl_nats_store_*` gauges of every JetStream store.
    storage: crate::storage::StorageReporter,
    drop_reports: tokio::sync::mpsc::UnboundedReceiver<GroupDropped>,
}

impl Buffer {
    /// Recovers the state from the data directory and binds the durable
    /// consumer. Creates the trajectory and dead-letter streams if missing.
    pub async fn open(
        config: &Config,
        bus: Arc<dyn Bus>,
        metrics: &Metrics,
    ) -> Result<Self, BufferError> {
        let storage =
            crate::storage::StorageReporter::register(metrics, config.bus.storage.report_every)?;
        let metrics = BufferMetrics::register(metrics)?;
        let data_dir = config.buffer.data_dir_in(&config.run.output_dir);
        let cfg = config.buffer.clone();
        let seed = config.run.seed;
        let (core, log, writer, recovered) =
            tokio::task::spawn_blocking(move || recover(data_dir, &cfg, seed)).await??;
        tracing::info!(
            segments = recovered.segments,
            trajectories = recovered.trajectories,
            torn_tails = recovered.torn_tails,
            log_records = recovered.log_records,
            ready_groups = core.stats().ready_groups,
            active_segment = writer.id(),
            "buffer state recovered from disk"
        );
        if !recovered.missing_groups.is_empty() {
            tracing::error!(
                groups = ?recovered.missing_groups,
                "the served log names groups whose trajectories are not on disk; their steps cannot be replayed"
            );
        }
        bus.ensure_stream(&trajectory_stream_spec(&config.bus))
            .await?;
        bus.ensure_stream(&dead_letter_stream_spec(&config.bus))
            .await?;
        bus.ensure_stream(&group_drop_stream_spec(&config.bus))
            .await?;
        let spec = ConsumerSpec {
            filter_subject: Some(format!("{TRAJECTORY_SUBJECT_PREFIX}.>")),
            ack_wait: config.buffer.ack_wait,
            max_deliver: Some(MAX_DELIVER),
            max_ack_pending: config.buffer.max_ack_pending,
            deliver_from: DeliverFrom::All,
            ..ConsumerSpec::new(config.buffer.consumer_name.clone())
        };
        let consumer = bus.consumer(TRAJECTORY_STREAM, &spec).await?;
        // Subscribed now, so that no request is lost between open and run.
        let requests = bus.serve(BUFFER_BATCH, Some(SERVE_QUEUE)).await?;
        let seg_dir = writer.dir().to_owned();
        metrics.disk_bytes.set(segment::disk_bytes(&seg_dir) as i64);
        let health = Health::new();
        health.set_not_ready(HEALTH_CONDITION, "starting");
        let (drops, drop_reports) = tokio::sync::mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            core: Mutex::new(core),
            ready: watch::channel(0).0,
            metrics,
            health,
            bus,
            seg_dir,
            retention: config.buffer.retention,
            disk: Mutex::new(BTreeMap::new()),
            drops,
        });
        shared.update_gauges();
        Ok(Self {
            drop_reports,
            shared,
            config: config.buffer.clone(),
            writer,
            log,
            consumer,
            requests,
            recovered,
            storage,
        })
    }

    /// Uses `health` (the process's) for the buffer's readiness condition.
    pub fn with_health(mut self, health: Health) -> Self {
        health.set_not_ready(HEALTH_CONDITION, "starting");
        if let Some(shared) = Arc::get_mut(&mut self.shared) {
            shared.health = health;
        }
        self
    }

    pub fn handle(&self) -> BufferHandle {
        BufferHandle {
            shared: self.shared.clone(),
        }
    }

    pub fn recovered(&self) -> &Recovered {
        &self.recovered
    }

    /// Ingests and serves until `shutdown` is cancelled (or a fatal error).
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), BufferError> {
        let Self {
            shared,
            config,
            writer,
            log,
            consumer,
            requests,
            storage,
            drop_reports,
            ..
        } = self;
        // Retire what recovery found fully consumed.
        shared.retire_segments().await?;
        shared.report_open_stale_drops();
        shared.health.set_ready(HEALTH_CONDITION);
        let stop = shutdown.child_token();
        let (closed_tx, closed) = watch::channel(None);
        tokio::spawn(follow_closed_epochs(
            shared.bus.clone(),
            closed_tx,
            stop.clone(),
        ));
        let ingest = Ingest {
            shared: shared.clone(),
            config: config.clone(),
            writer: Some(writer),
            closed,
        };
        let server = Server {
            shared: shared.clone(),
            config,
            log: Some(log),
            objects: None,
            objects_by_step: BTreeMap::new(),
            last_refusal: None,
        };
        let ingest_task = tokio::spawn({
            let stop = stop.clone();
            async move {
                let r = ingest.run(consumer, stop.clone()).await;
                stop.cancel();
                r
            }
        });
        let serve_task = tokio::spawn({
            let stop = stop.clone();
            async move {
                let r = server.run(requests, stop.clone()).await;
                stop.cancel();
                r
            }
        });
        // Store sizes: only a reading, so it never ends the buffer's run.
        tokio::spawn(storage.run(shared.bus.clone(), stop.clone()));
        // Its own stop: it drains what ingest and serve reported until
        // both have ended.
        let reporter_stop = CancellationToken::new();
        let reporter = tokio::spawn(report_drops(
            shared.bus.clone(),
            drop_reports,
            shared.metrics.clone(),
            reporter_stop.clone(),
        ));
        let (a, b) = tokio::join!(ingest_task, serve_task);
        shared.health.set_not_ready(HEALTH_CONDITION, "stopped");
        // Both tasks have ended: no report is added any more.
        reporter_stop.cancel();
        if let Err(e) = reporter.await {
            tracing::error!(error = %e, "the drop reporter failed");
        }
        a??;
        b??;
        tracing::info!("buffer stopped");
        Ok(())
    }
}

/// Follows `coordinator.closed_epoch` (the coordinator's `EpochsClosed`)
/// for as long as the buffer runs, passing each value to ingest.
async fn follow_closed_epochs(
    bus: Arc<dyn Bus>,
    closed: watch::Sender<Option<u64>>,
    stop: CancellationToken,
) {
    let (min, max) = asyncrl_control::kv::FOLLOW_BACKOFF;
    asyncrl_control::kv::follow(
        bus,
        CONTROL_BUCKET,
        EPOCHS_CLOSED_KEY,
        Backoff::new(min, max),
        stop,
        move |value, _| {
            match EpochsClosed::decode(value.as_ref()) {
                Ok(e) => {
                    closed.send_replace(Some(e.through));
                }
                Err(e) => {
                    tracing::warn!(key = EPOCHS_CLOSED_KEY, error = %e, "the closed epochs do not decode as asyncrl.v1.EpochsClosed; ignored");
                }
            }
            std::future::ready(std::ops::ControlFlow::Continue(()))
        },
    )
    .await;
}

/// Delivers the buffer's drop reports to the [`GROUP_DROP_STREAM`] stream,
/// in order, each retried with backoff until the stream has stored it (a
/// lost report would be a task never issued again). The message id names
/// the group and the reason, so a report stored but not acknowledged and
/// sent again is stored once. Once `stop` is cancelled (after nothing adds
/// reports any more) it keeps trying for [`DROP_REPORT_DRAIN`], then says
/// what it could not deliver; the next start reports stale drops again.
async fn report_drops(
    bus: Arc<dyn Bus>,
    mut reports: tokio::sync::mpsc::UnboundedReceiver<GroupDropped>,
    metrics: BufferMetrics,
    stop: CancellationToken,
) {
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
    let mut deadline: Option<tokio::time::Instant> = None;
    loop {
        let msg = if deadline.is_some() {
            match reports.try_recv() {
                Ok(m) => m,
                Err(_) => return,
            }
        } else {
            tokio::select! {
                m = reports.recv() => match m {
                    Some(m) => m,
                    None => return,
                },
                () = stop.cancelled() => {
                    deadline = Some(tokio::time::Instant::now() + DROP_REPORT_DRAIN);
                    continue;
                }
            }
        };
        let id = format!("dropped.{}.{}", msg.group_id, msg.kind().label());
        let payload = Bytes::from(msg.encode_to_vec());
        loop {
            match bus
                .publish_durable(BUFFER_GROUP_DROPPED, &id, payload.clone())
                .await
            {
                Ok(_) => {
                    metrics.drop_reports_pending.dec();
                    backoff.reset();
                    break;
                }
                Err(e) => {
                    metrics.drop_report_failures.inc();
                    let wait = backoff.next_delay();
                    tracing::warn!(error = %e, group = %msg.group_id, retry_in = ?wait, "cannot report a dropped group yet; retrying");
                    if deadline.is_none() && stop.is_cancelled() {
                        deadline = Some(tokio::time::Instant::now() + DROP_REPORT_DRAIN);
                    }
                    if let Some(d) = deadline
                        && tokio::time::Instant::now() + wait > d
                    {
                        let left = 1 + reports.len();
                        tracing::error!(
                            reports = left,
                            "stopping with dropped groups not reported to the coordinator; the next start reports the stale ones again"
                        );
                        return;
                    }
                    tokio::time::sleep(wait).await;
                }
            }
        }
    }
}

/// Runs the buffer until `shutdown` is cancelled: in-process (local mode,
/// over [`asyncrl_transport::LocalBus`]) or as its own process over NATS.
pub async fn run(
    config: Config,
    bus: Arc<dyn Bus>,
    metrics: Metrics,
    shutdown: CancellationToken,
) -> Result<(), BufferError> {
    Buffer::open(&config, bus, &metrics)
        .await?
        .run(shutdown)
        .await
}

// ---------------------------------------------------------------- recovery

fn recover(
    data_dir: PathBuf,
    cfg: &BufferConfig,
    seed: u64,
) -> Result<(Core, StateLog, SegmentWriter, Recovered), BufferError> {
    let seg_dir = segment_dir(&data_dir);
    std::fs::create_dir_all(&seg_dir).map_err(|e| BufferError::io("create", &seg_dir, e))?;
    let (log, records) = StateLog::open(&data_dir, cfg.fsync)?;
    let mut core = Core::new(cfg.sampling, cfg.max_serves(), seed)
        .with_min_reward_spread(cfg.min_reward_spread);
    core.seed(&records);
    let mut rec = Recovered {
        log_records: records.len(),
        ..Default::default()
    };
    let schema = trajectory_schema();
    let ids = segment::list_segments(&seg_dir)?;
    for id in &ids {
        let scan = segment::read_segment(&seg_dir, *id, &schema)?;
        if let Some(reason) = &scan.tail_error {
            rec.torn_tails += 1;
            tracing::warn!(
                segment = id,
                reason,
                valid_bytes = scan.valid_len,
                "segment ends in a torn or garbled frame (a crash mid-write; nothing in it was acked); cutting it off"
            );
            if scan.valid_len == 0 {
                segment::delete_segment(&seg_dir, *id)?;
                continue;
            }
            segment::truncate_segment(&seg_dir, *id, scan.valid_len)?;
        }
        core.add_segment(*id, false);
        rec.segments += 1;
        for batch in scan.batches {
            let trajs = from_record_batch(&batch).map_err(|e| BufferError::Segment {
                path: segment::segment_path(&seg_dir, *id),
                reason: e.to_string(),
            })?;
            let metas: Vec<RowMeta> = trajs.iter().filter_map(RowMeta::of).collect();
            if metas.len() != trajs.len() {
                return Err(BufferError::Segment {
                    path: segment::segment_path(&seg_dir, *id),
                    reason: "a stored trajectory has no valid uuid".into(),
                });
            }
            rec.trajectories += metas.len();
            core.apply(batch, &metas, *id, true);
        }
    }
    rec.missing_groups = core.finish_recovery();
    let next = ids.last().map_or(1, |last| last + 1);
    let writer =
        SegmentWriter::create(&seg_dir, next, &schema, cfg.segment_compression, cfg.fsync)?;
    core.add_segment(next, true);
    Ok((core, log, writer, rec))
}

/// The tasks whose complete groups a stopped buffer still holds (served at
/// no trained step yet), read from its data directory without writing to
/// it: the served log and the segments replayed as a restart would. The
/// loss invariant of a run: every task that completed is trained, held, or
/// dropped with a reason that issued it again.
pub fn held_tasks(
    data_dir: &std::path::Path,
    cfg: &BufferConfig,
) -> Result<std::collections::BTreeSet<String>, BufferError> {
    let log = data_dir.join(crate::statelog::STATE_LOG);
    let records = match std::fs::read(&log) {
        Ok(bytes) => crate::statelog::decode_log(&bytes).0,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(BufferError::io("read", &log, e)),
    };
    let mut core =
        Core::new(cfg.sampling, cfg.max_serves(), 0).with_min_reward_spread(cfg.min_reward_spread);
    core.seed(&records);
    let seg_dir = segment_dir(data_dir);
    let schema = trajectory_schema();
    for id in segment::list_segments(&seg_dir)? {
        let scan = segment::read_segment(&seg_dir, id, &schema)?;
        core.add_segment(id, false);
        for batch in scan.batches {
            let trajs = from_record_batch(&batch).map_err(|e| BufferError::Segment {
                path: segment::segment_path(&seg_dir, id),
                reason: e.to_string(),
            })?;
            let metas: Vec<RowMeta> = trajs.iter().filter_map(RowMeta::of).collect();
            core.apply(batch, &metas, id, true);
        }
    }
    core.finish_recovery();
    Ok(core.held_tasks())
}

// ---------------------------------------------------------------- ingest

struct Ingest {
    shared: Arc<Shared>,
    config: BufferConfig,
    /// `None` only while a blocking write holds it.
    writer: Option<SegmentWriter>,
    /// The closed epochs the coordinator published ([`follow_closed_epochs`]),
    /// applied between batches.
    closed: watch::Receiver<Option<u64>>,
}

/// JetStream delivers a trajectory message at most this many times (a
/// message is never redelivered for ever). A message on its last delivery
/// that still cannot be stored is dead-lettered instead of naked, so that
/// it is kept (the letter holds it whole when it fits) and counted
/// (`buffer_dead_lettered_total{reason="max_deliver"}`).
pub const MAX_DELIVER: u32 = 25;

/// A dead letter's payload: the message's bytes when the letter then fits
/// the server's `max_payload` (with room for its other fields), else their
/// first [`DEAD_LETTER_PAYLOAD_MAX`] bytes, so that the letter always fits
/// (a malformed message near the limit would otherwise be redelivered
/// forever).
fn dead_letter_payload(payload: &[u8], max_payload: Option<usize>) -> DeadLetter {
    let fits = max_payload.is_none_or(|max| payload.len() + 4096 <= max);
    let keep = if fits {
        payload.len()
    } else {
        payload.len().min(DEAD_LETTER_PAYLOAD_MAX)
    };
    DeadLetter {
        payload: payload[..keep].to_vec(),
        payload_size: payload.len() as u64,
        truncated: keep < payload.len(),
        ..Default::default()
    }
}

/// A reason from the learner, cut to what a log line and a letter hold.
fn clip_reason(reason: &str) -> String {
    const MAX: usize = 1024;
    if reason.len() <= MAX {
        return reason.to_owned();
    }
    let mut end = MAX;
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &reason[..end])
}

/// Why a message is dead-lettered: the kind (metric label) and the reason.
fn contract_kind(e: &ContractError) -> &'static str {
    match e {
        ContractError::Decode { .. } => "decode",
        _ => "contract",
    }
}

/// What became of a fetched batch.
enum Taken {
    /// Written (or nothing to write), acked, applied.
    Done,
    /// A disk write failed: nothing of the batch was acked or applied; these
    /// deliveries are to be written again.
    DiskBlocked(Vec<Delivery>),
}

/// The longest wait between retries of a failed segment write: short enough
/// that the held messages are kept from redelivery (`in_progress`) well
/// within the ack wait.
fn disk_retry_max(config: &BufferConfig) -> Duration {
    (config.ack_wait / 3).clamp(DISK_RETRY_MIN, Duration::from_secs(5))
}

impl Ingest {
    async fn run(
        mut self,
        consumer: Box<dyn Consumer>,
        stop: CancellationToken,
    ) -> Result<(), BufferError> {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        let mut disk_backoff = Backoff::new(DISK_RETRY_MIN, disk_retry_max(&self.config));
        let mut pending: Option<Vec<Delivery>> = None;
        // Fetched batches that could not be written (the disk failed), oldest
        // first. While there are any, nothing is fetched: the oldest is
        // written again with backoff, and the buffer takes in nothing new.
        let mut held: VecDeque<Vec<Delivery>> = VecDeque::new();
        let mut retry_now = false;
        loop {
            if let Some(batch) = held.pop_front() {
                if !retry_now {
                    tokio::select! {
                        () = stop.cancelled() => {
                            held.push_front(batch);
                            break;
                        }
                        () = tokio::time::sleep(disk_backoff.next_delay()) => {}
                    }
                    // Still ours: keep JetStream from redelivering them.
                    futures::future::join_all(
                        std::iter::once(&batch)
                            .chain(held.iter())
                            .flatten()
                            .map(|d| d.in_progress()),
                    )
                    .await;
                }
                match self.process(batch).await {
                    Ok(Taken::Done) => {
                        disk_backoff.reset();
                        retry_now = true;
                        self.shared.health.set_ready(HEALTH_CONDITION);
                    }
                    Ok(Taken::DiskBlocked(batch)) => {
                        held.push_front(batch);
                        retry_now = false;
                    }
                    Err(e) => {
                        retry_now = false;
                        self.failed(e, &stop).await?;
                    }
                }
                continue;
            }
            let fetch = consumer.fetch(self.config.ingest_batch, self.config.fetch_wait);
            let fetched = match pending.take() {
                // Fetch the next batch while this one is written and acked.
                // A batch is never abandoned midway: it is written and acked
                // as a whole (or naked, or held while the disk fails), also
                // when stopping.
                Some(batch) => {
                    let (r, fetched) = tokio::join!(self.process(batch), fetch);
                    match r {
                        Ok(Taken::Done) => self.shared.health.set_ready(HEALTH_CONDITION),
                        Ok(Taken::DiskBlocked(batch)) => {
                            held.push_back(batch);
                            retry_now = false;
                        }
                        Err(e) => self.failed(e, &stop).await?,
                    }
                    fetched
                }
                None => tokio::select! {
                    () = stop.cancelled() => break,
                    r = fetch => r,
                },
            };
            match fetched {
                Ok(d) if !d.is_empty() => {
                    if held.is_empty() {
                        pending = Some(d);
                    } else {
                        held.push_back(d);
                    }
                }
                Ok(_) => {
                    // Idle: nothing else would apply a closure now.
                    if self.closed.has_changed().unwrap_or(false) {
                        self.close_epochs().await;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "fetching trajectories failed; retrying");
                    tokio::select! {
                        () = stop.cancelled() => {}
                        () = tokio::time::sleep(backoff.next_delay()) => {}
                    }
                    continue;
                }
            }
            backoff.reset();
            if stop.is_cancelled() {
                if let Some(batch) = pending.take()
                    && let Taken::DiskBlocked(batch) = self.process(batch).await?
                {
                    held.push_back(batch);
                }
                break;
            }
        }
        if !held.is_empty() {
            // Stopping while the disk fails: hand back what was not written.
            let n: usize = held.iter().map(Vec::len).sum();
            tracing::warn!(
                messages = n,
                "stopping with batches not written (disk write failing); they will be redelivered"
            );
            futures::future::join_all(held.iter().flatten().map(|d| d.nak(Duration::from_secs(1))))
                .await;
        }
        Ok(())
    }

    /// A batch failed for another reason than the disk (its messages were
    /// naked): unready for a while, or the end for a fatal error.
    async fn failed(&self, e: BufferError, stop: &CancellationToken) -> Result<(), BufferError> {
        if matches!(e, BufferError::Join(_) | BufferError::Lost(_)) {
            return Err(e);
        }
        tracing::error!(error = %e, "ingest batch failed; its messages will be redelivered");
        self.shared
            .health
            .set_not_ready(HEALTH_CONDITION, format!("ingest failing: {e}"));
        tokio::select! {
            () = stop.cancelled() => {}
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
        Ok(())
    }

    /// Applies the closed epochs published since the last batch: releases
    /// the late attempts still collecting and forgets what may be.
    async fn close_epochs(&mut self) {
        let Some(through) = *self.closed.borrow_and_update() else {
            return;
        };
        let dropped = {
            let mut core = self.shared.core();
            if core.closed_epoch().is_some_and(|known| known > through) {
                tracing::warn!(
                    published = through,
                    known = core.closed_epoch(),
                    "the coordinator's closed epoch went down (its state was reset?); keeping the higher one"
                );
            }
            core.close_epochs(through)
        };
        self.shared.report_dropped(&dropped).await;
        self.shared.update_gauges();
        if !dropped.is_empty()
            && let Err(e) = self.shared.retire_segments().await
        {
            tracing::warn!(error = %e, "cannot delete the segments the late attempts held; retrying later");
        }
    }

    async fn process(&mut self, deliveries: Vec<Delivery>) -> Result<Taken, BufferError> {
        if self.closed.has_changed().unwrap_or(false) {
            self.close_epochs().await;
        }
        let payloads: Vec<Bytes> = deliveries.iter().map(|d| d.payload.clone()).collect();
        let decoded: Vec<Result<Trajectory, ContractError>> =
            tokio::task::spawn_blocking(move || {
                payloads.iter().map(|p| decode_trajectory(p)).collect()
            })
            .await?;
        // Dead letters (index, kind, reason), duplicates, and the rest.
        let mut dead: Vec<(usize, &'static str, String)> = Vec::new();
        let mut duplicates = 0u64;
        let mut late = 0u64;
        // The stored ones: delivery index and row metadata, and (apart, to
        // move them into the writer without a copy) the trajectories.
        let mut fresh: Vec<(usize, RowMeta)> = Vec::new();
        let mut trajs: Vec<Trajectory> = Vec::new();
        {
            let core = self.shared.core();
            let mut seen = HashSet::new();
            for (i, r) in decoded.into_iter().enumerate() {
                match r {
                    Err(e) => dead.push((i, contract_kind(&e), e.to_string())),
                    Ok(t) => match RowMeta::of(&t) {
                        None => dead.push((i, "contract", "field `uuid` is invalid".into())),
                        Some(m) if core.is_known(&m) || !seen.insert(m.uuid) => {
                            duplicates += 1;
                        }
                        Some(m) if core.is_late(&m) => late += 1,
                        Some(m) => {
                            fresh.push((i, m));
                            trajs.push(t);
                        }
                    },
                }
            }
        }
        let mut applied = Applied::default();
        if !fresh.is_empty() {
            let mut writer = self
                .writer
                .take()
                .ok_or_else(|| BufferError::Lost("the segment writer"))?;
            let cfg = self.config.clone();
            let started = Instant::now();
            let (writer, rotated_to, result) = tokio::task::spawn_blocking(move || {
                let mut rotated = None;
                let r = write_batch(&mut writer, &trajs, &cfg, &mut rotated);
                (writer, rotated, r)
            })
            .await?;
            self.writer = Some(writer);
            let written = match result {
                Ok(w) => w,
                Err(e) => {
                    if let Some(next) = rotated_to {
                        // The full segment was closed; the new one is empty.
                        self.shared.core().add_segment(next, true);
                    }
                    return match e {
                        WriteError::Disk { what, error } => {
                            // Nothing of this batch is acked or applied; it
                            // is written again once the disk takes it.
                            self.shared.disk_failed(DiskUser::Ingest, what, &error);
                            Ok(Taken::DiskBlocked(deliveries))
                        }
                        WriteError::Other(e) => {
                            // Nothing of this batch is acked: ask for it
                            // again soon; a message on its last delivery is
                            // dead-lettered instead.
                            let last: Vec<(usize, &'static str, String)> = deliveries
                                .iter()
                                .enumerate()
                                .filter(|(_, d)| d.delivered >= u64::from(MAX_DELIVER))
                                .map(|(i, d)| {
                                    (
                                        i,
                                        "max_deliver",
                                        format!(
                                            "delivered {} times (max_deliver) and still not stored: {e}",
                                            d.delivered
                                        ),
                                    )
                                })
                                .collect();
                            let failed = self.dead_letter(&deliveries, &last).await;
                            let done: HashSet<usize> = last
                                .iter()
                                .map(|(i, _, _)| *i)
                                .filter(|i| !failed.contains(i))
                                .collect();
                            let acks: Vec<&Delivery> =
                                done.iter().map(|i| &deliveries[*i]).collect();
                            if let Err(e) = Delivery::ack_all(&acks).await {
                                tracing::warn!(error = %e, "acking dead-lettered messages failed");
                            }
                            futures::future::join_all(
                                deliveries
                                    .iter()
                                    .enumerate()
                                    .filter(|(i, _)| !done.contains(i))
                                    .map(|(_, d)| d.nak(Duration::from_secs(1))),
                            )
                            .await;
                            Err(e)
                        }
                    };
                }
            };
            self.shared.disk_ok(DiskUser::Ingest);
            if let Some(error) = &written.rotate_failed {
                self.shared
                    .metrics
                    .disk_write_failures
                    .get_or_create(&BufferMetrics::what("segment_create"))
                    .inc();
                tracing::warn!(error = %error, segment = written.segment, "segment full, but the next one cannot be created; retrying before the next append");
            }
            self.shared
                .metrics
                .segment_write_latency
                .observe(started.elapsed().as_secs_f64());
            self.shared
                .metrics
                .disk_bytes
                .set(written.disk_bytes as i64);
            let metas: Vec<RowMeta> = fresh.iter().map(|(_, m)| m.clone()).collect();
            {
                // One lock: the batch's segment is live before a rotation
                // makes it inactive (and so deletable).
                let mut core = self.shared.core();
                applied = core.apply(written.batch, &metas, written.segment, false);
                if let Some(next) = rotated_to {
                    core.add_segment(next, true);
                }
            }
            for (row, reason) in &applied.violations {
                dead.push((fresh[*row].0, "group", reason.clone()));
            }
        }
        // Dead letters first: a message is acked only once its dead letter
        // is stored (the msg id makes a republish after a crash a no-op).
        let dead_idx: HashSet<usize> = dead.iter().map(|(i, _, _)| *i).collect();
        let failed_dlq = self.dead_letter(&deliveries, &dead).await;
        // One confirmation for the batch's acks, not one per message.
        let (nak, ack): (Vec<_>, Vec<_>) = deliveries
            .iter()
            .enumerate()
            .partition(|(i, _)| failed_dlq.contains(i));
        let ack: Vec<&Delivery> = ack.into_iter().map(|(_, d)| d).collect();
        let naks =
            futures::future::join_all(nak.iter().map(|(_, d)| d.nak(Duration::from_secs(1))));
        let (acked, naks) = tokio::join!(Delivery::ack_all(&ack), naks);
        let nak_errors = naks.iter().filter(|r| r.is_err()).count();
        if let Err(e) = acked {
            // Harmless: the messages come again and are dropped as duplicates.
            tracing::warn!(error = %e, messages = ack.len(), "acking a batch failed; its messages will be redelivered and deduplicated");
        }
        if nak_errors > 0 {
            tracing::warn!(
                nak_errors,
                "some naks failed; those messages will be redelivered after the ack wait"
            );
        }
        let m = &self.shared.metrics;
        m.ingested.inc_by(applied.stored as u64);
        if applied.newly_ready > 0 {
            m.groups_completed.inc_by(applied.newly_ready as u64);
            m.update_no_signal_fraction();
        }
        m.duplicates.inc_by(duplicates + applied.duplicates as u64);
        m.superseded_trajectories
            .inc_by(late + applied.superseded as u64);
        tracing::debug!(
            messages = deliveries.len(),
            stored = applied.stored,
            duplicates = duplicates + applied.duplicates as u64,
            late_of_closed_epochs = late,
            dead_lettered = dead_idx.len(),
            newly_ready = applied.newly_ready,
            "ingested a batch"
        );
        self.shared.report_dropped(&applied.dropped).await;
        self.shared.update_gauges();
        if applied.newly_ready > 0 {
            self.shared.ready.send_modify(|n| *n += 1);
        }
        self.shared.retire_segments().await?;
        Ok(Taken::Done)
    }
}

impl Ingest {
    /// Publishes the dead letters of `dead` (delivery index, kind, reason)
    /// and counts them by kind; returns the indices whose letter could not
    /// be published (to be naked: they come again).
    async fn dead_letter(
        &self,
        deliveries: &[Delivery],
        dead: &[(usize, &'static str, String)],
    ) -> HashSet<usize> {
        let max_payload = self.shared.bus.max_payload();
        let results = futures::future::join_all(dead.iter().map(|(i, kind, reason)| {
            let d = &deliveries[*i];
            let letter = DeadLetter {
                reason: reason.clone(),
                subject: d.subject.clone(),
                stream_sequence: d.stream_sequence,
                msg_id: d.msg_id.clone().unwrap_or_default(),
                ..dead_letter_payload(&d.payload, max_payload)
            };
            let bus = self.shared.bus.clone();
            let id = format!("dlq-{}", d.stream_sequence);
            async move {
                tracing::warn!(subject = %d.subject, seq = d.stream_sequence, kind, reason = %reason, "dead-lettering a trajectory message");
                let r = bus
                    .publish_durable(DEAD_LETTER_SUBJECT, &id, Bytes::from(letter.encode_to_vec()))
                    .await;
                (*i, *kind, r)
            }
        }))
        .await;
        let mut failed = HashSet::new();
        for (i, kind, r) in results {
            match r {
                Ok(_) => {
                    self.shared
                        .metrics
                        .dead_lettered
                        .get_or_create(&BufferMetrics::reason(kind))
                        .inc();
                }
                Err(e) => {
                    tracing::warn!(error = %e, seq = deliveries[i].stream_sequence, "cannot dead-letter; will retry on redelivery");
                    failed.insert(i);
                }
            }
        }
        failed
    }
}

/// Why a batch could not be written.
enum WriteError {
    /// The disk refused a write (`what`: the metric label); the segment is
    /// left valid and the write can be retried.
    Disk {
        what: &'static str,
        error: BufferError,
    },
    Other(BufferError),
}

/// A batch in its segment.
struct Written {
    batch: arrow::array::RecordBatch,
    /// The segment the batch went to.
    segment: u64,
    /// Bytes of all segments on disk.
    disk_bytes: u64,
    /// The segment filled up and the next one could not be created (done
    /// before the next append instead).
    rotate_failed: Option<BufferError>,
}

/// Encodes and appends one batch (blocking), rotating the segment when full:
/// after the append that fills it, or, when that rotation failed, before the
/// next append. `rotated` is set to the new active segment when one was
/// created, also when the append then failed.
fn write_batch(
    writer: &mut SegmentWriter,
    trajs: &[Trajectory],
    cfg: &BufferConfig,
    rotated: &mut Option<u64>,
) -> Result<Written, WriteError> {
    let batch = to_record_batch(trajs).map_err(|e| WriteError::Other(e.into()))?;
    if writer.bytes() >= cfg.segment_max_bytes {
        rotate(writer, cfg).map_err(|error| WriteError::Disk {
            what: "segment_create",
            error,
        })?;
        *rotated = Some(writer.id());
    }
    let appended = writer.append(&batch).map_err(|error| match &error {
        BufferError::Io { op, .. } => WriteError::Disk {
            what: if *op == "fsync segment" {
                "segment_fsync"
            } else {
                "segment_append"
            },
            error,
        },
        _ => WriteError::Other(error),
    })?;
    let mut rotate_failed = None;
    if writer.bytes() >= cfg.segment_max_bytes {
        match rotate(writer, cfg) {
            Ok(()) => *rotated = Some(writer.id()),
            Err(e) => rotate_failed = Some(e),
        }
    }
    Ok(Written {
        batch,
        segment: appended.segment,
        disk_bytes: segment::disk_bytes(writer.dir()),
        rotate_failed,
    })
}

/// Closes the active segment and starts the next one.
fn rotate(writer: &mut SegmentWriter, cfg: &BufferConfig) -> Result<(), BufferError> {
    let next = SegmentWriter::create(
        writer.dir(),
        writer.id() + 1,
        &trajectory_schema(),
        cfg.segment_compression,
        cfg.fsync,
    )?;
    tracing::info!(from = writer.id(), to = next.id(), "segment full; rotated");
    *writer = next;
    Ok(())
}

// ---------------------------------------------------------------- serving

struct Server {
    shared: Arc<Shared>,
    config: BufferConfig,
    /// `None` only while a blocking append holds it.
    log: Option<StateLog>,
    objects: Option<Arc<dyn ObjectStore>>,
    /// Batches handed over through the object store, by step.
    objects_by_step: BTreeMap<u64, String>,
    /// The last refusal (step, reason): a learner asking again gets the same
    /// answer, logged once as a warning.
    last_refusal: Option<(u64, String)>,
}

impl Server {
    async fn run(
        mut self,
        mut requests: futures::stream::BoxStream<'static, Request>,
        stop: CancellationToken,
    ) -> Result<(), BufferError> {
        loop {
            let req = tokio::select! {
                () = stop.cancelled() => break,
                r = requests.next() => r,
            };
            let Some(req) = req else {
                tracing::warn!("batch request subscription ended");
                break;
            };
            let reply = match BatchRequest::decode(req.payload.clone()) {
                Ok(r) if r.learner_version < 0 => {
                    // No learner is at a negative version; as a staleness
                    // floor it would serve groups of any age.
                    self.shared.metrics.batches_refused.inc();
                    tracing::warn!(
                        step = r.step,
                        version = r.learner_version,
                        "batch request with a negative learner_version refused"
                    );
                    BatchReply {
                        step: r.step,
                        error: format!("learner_version {} is negative", r.learner_version),
                        ..Default::default()
                    }
                }
                Ok(r) => self.answer(r, &stop).await,
                Err(e) => {
                    self.shared.metrics.batches_refused.inc();
                    tracing::warn!(error = %e, "batch request does not decode; refused");
                    BatchReply {
                        error: format!("request does not decode as asyncrl.v1.BatchRequest: {e}"),
                        ..Default::default()
                    }
                }
            };
            if let Err(e) = req.respond(Bytes::from(reply.encode_to_vec())).await {
                tracing::warn!(error = %e, step = reply.step, "cannot send a batch reply");
            }
        }
        Ok(())
    }

    async fn append(&mut self, records: Vec<crate::statelog::Record>) -> Result<(), BufferError> {
        let mut log = self
            .log
            .take()
            .ok_or_else(|| BufferError::Lost("the served log"))?;
        let (log, r) = tokio::task::spawn_blocking(move || {
            let r = log.append(&records);
            (log, r)
        })
        .await?;
        self.log = Some(log);
        match r {
            Ok(()) => {
                self.shared.disk_ok(DiskUser::Serve);
                Ok(())
            }
            Err(e) => {
                if matches!(e, BufferError::Io { .. }) {
                    self.shared.disk_failed(DiskUser::Serve, "served_log", &e);
                }
                Err(e)
            }
        }
    }

    /// Compaction: one snapshot instead of the history, once the log has
    /// grown by `state_log_compact_bytes` past the last snapshot. Runs after
    /// a plan is committed, so that the snapshot includes what was just
    /// appended.
    async fn maybe_compact(&mut self) {
        let compact_at = self.config.state_log_compact_bytes;
        if self.log.as_ref().is_none_or(|l| l.growth() <= compact_at) {
            return;
        }
        let snapshot = self.shared.core().snapshot();
        let Some(mut log) = self.log.take() else {
            return;
        };
        let joined = tokio::task::spawn_blocking(move || {
            let r = log.rewrite(&snapshot);
            (log, r)
        })
        .await;
        match joined {
            Ok((log, r)) => {
                self.log = Some(log);
                match r {
                    Ok(()) => tracing::info!("served log compacted"),
                    Err(e) => {
                        self.shared
                            .metrics
                            .disk_write_failures
                            .get_or_create(&BufferMetrics::what("served_log_compact"))
                            .inc();
                        tracing::warn!(error = %e, "cannot compact the served log; keeping it")
                    }
                }
            }
            Err(e) => tracing::error!(error = %e, "served log compaction task failed"),
        }
    }

    /// Applies the learner's refusal of groups it was served for `step`
    /// (see `BatchRequest.refused`): each group's rows are dead-lettered,
    /// the refusal is made durable, the groups are released and reported
    /// quarantined (the coordinator issues their tasks again), and the
    /// step's other groups become servable again. Groups the step no longer
    /// holds are ignored (a retried request). An error leaves everything as
    /// it was; the learner asks again.
    async fn quarantine(&mut self, step: u64, refused: &[RefusedGroup]) -> Result<(), String> {
        let refused: Vec<(String, String)> = refused
            .iter()
            .map(|g| (g.group_id.clone(), clip_reason(&g.reason)))
            .collect();
        let Some(refusal) = self.shared.core().plan_refusal(step, &refused) else {
            return Ok(());
        };
        for (group, reason) in &refusal.groups {
            self.dead_letter_group(step, group, reason).await?;
        }
        let record = self.shared.core().refusal_record(&refusal);
        self.append(vec![record])
            .await
            .map_err(|e| format!("buffer cannot persist its served log: {e}"))?;
        let dropped = self.shared.core().commit_refusal(refusal);
        let mut quarantined = 0;
        for d in &dropped {
            if d.reason == GroupDropReason::Quarantined {
                quarantined += 1;
                tracing::warn!(step, task = %d.task, group = %d.group, trajectories = d.trajectories, "the learner refused a group: quarantined (dead-lettered; its task is issued again)");
            } else {
                tracing::info!(step, task = %d.task, group = %d.group, trajectories = d.trajectories, "a group expired whose every serve was refused: dropped as stale (its task is issued again)");
            }
        }
        self.shared
            .metrics
            .dead_lettered
            .get_or_create(&BufferMetrics::reason("quarantined"))
            .inc_by(quarantined);
        self.maybe_compact().await;
        self.shared.report_dropped(&dropped).await;
        self.shared.update_gauges();
        Ok(())
    }

    /// Publishes a quarantined group's rows (Arrow IPC, truncated to what a
    /// letter holds) to the dead-letter stream, once (the msg id).
    async fn dead_letter_group(
        &self,
        step: u64,
        group: &Arc<str>,
        reason: &str,
    ) -> Result<(), String> {
        let (task, gathered) = {
            let core = self.shared.core();
            (
                core.group_task(group),
                core.gather(std::slice::from_ref(group)),
            )
        };
        let (batches, indices) =
            gathered.map_err(|e| format!("cannot dead-letter group `{group}`: {e}"))?;
        let encoded =
            tokio::task::spawn_blocking(move || encode_batch(&batches, &indices, true, 0))
                .await
                .map_err(|e| format!("cannot dead-letter group `{group}`: {e}"))?
                .map_err(|e| format!("cannot dead-letter group `{group}`: {e}"))?;
        let letter = DeadLetter {
            reason: format!("refused by the learner at step {step}: {reason}"),
            subject: BUFFER_BATCH.to_owned(),
            task_id: task.unwrap_or_default(),
            group_id: group.to_string(),
            step,
            ..dead_letter_payload(&encoded.ipc, self.shared.bus.max_payload())
        };
        self.shared
            .bus
            .publish_durable(
                DEAD_LETTER_SUBJECT,
                &format!("dlq-quarantine-{group}"),
                Bytes::from(letter.encode_to_vec()),
            )
            .await
            .map_err(|e| format!("cannot dead-letter group `{group}`: {e}"))?;
        Ok(())
    }

    async fn answer(&mut self, r: BatchRequest, stop: &CancellationToken) -> BatchReply {
        if !r.refused.is_empty()
            && let Err(error) = self.quarantine(r.step, &r.refused).await
        {
            tracing::warn!(step = r.step, %error, "cannot quarantine the groups the learner refused; it will ask again");
            return BatchReply {
                step: r.step,
                error,
                ..Default::default()
            };
        }
        let ask = Ask {
            trained_through: r.trained_through.map_or(r.step.saturating_sub(1), |t| {
                t.min(r.step.saturating_sub(1))
            }),
            ..Ask::next(r.step, r.learner_version, r.eta, r.num_groups as usize)
        };
        let wait = Duration::from_millis(u64::from(r.wait_ms)).min(self.config.max_request_wait);
        let deadline = tokio::time::Instant::now() + wait;
        let mut ready_rx = self.shared.ready.subscribe();
        let zstd = r.zstd || self.config.serve_zstd;
        loop {
            ready_rx.borrow_and_update();
            let started = Instant::now();
            let (plan, records) = {
                let core = self.shared.core();
                let plan = core.plan(ask);
                let records = core.records(&plan, unix_ms());
                (plan, records)
            };
            let outcome = plan.outcome.clone();
            let stale_dropped = plan
                .drops
                .iter()
                .filter(|(_, why)| *why == crate::statelog::DropReason::Stale)
                .count() as u32;
            if !records.is_empty()
                && let Err(e) = self.append(records).await
            {
                tracing::error!(error = %e, step = ask.step, "cannot persist the served log; refusing the batch");
                return BatchReply {
                    step: ask.step,
                    error: format!("buffer cannot persist its served log: {e}"),
                    ..Default::default()
                };
            }
            let dropped = self.shared.core().commit(plan);
            self.maybe_compact().await;
            self.shared.report_dropped(&dropped).await;
            let replayed = matches!(outcome, Outcome::Replay(_));
            let reply = match outcome {
                Outcome::Serve(groups) | Outcome::Replay(groups) => {
                    let mut reply = self.batch_reply(ask, &groups, replayed, zstd).await;
                    reply.stale_dropped = stale_dropped;
                    if reply.error.is_empty() {
                        let m = &self.shared.metrics;
                        if replayed {
                            m.batches_replayed.inc();
                        } else {
                            m.batches_served.inc();
                            m.groups_served.inc_by(groups.len() as u64);
                        }
                        m.serve_latency.observe(started.elapsed().as_secs_f64());
                    }
                    tracing::info!(step = ask.step, version = ask.version, groups = groups.len(), replayed, stale_dropped, error = %reply.error, "batch served");
                    self.cleanup_objects().await;
                    if let Err(e) = self.shared.retire_segments().await {
                        tracing::warn!(error = %e, "retention failed; will retry");
                    }
                    self.shared.update_gauges();
                    reply
                }
                Outcome::Refused(error) => {
                    self.shared.metrics.batches_refused.inc();
                    let again = self
                        .last_refusal
                        .as_ref()
                        .is_some_and(|(step, e)| *step == ask.step && *e == error);
                    if again {
                        tracing::debug!(step = ask.step, version = ask.version, %error, "batch request refused again");
                    } else {
                        tracing::warn!(step = ask.step, version = ask.version, %error, "batch request refused");
                        self.last_refusal = Some((ask.step, error.clone()));
                    }
                    BatchReply {
                        step: ask.step,
                        error,
                        stale_dropped,
                        ..Default::default()
                    }
                }
                Outcome::NotReady { ready } => {
                    if !dropped.is_empty() {
                        self.shared.update_gauges();
                        if let Err(e) = self.shared.retire_segments().await {
                            tracing::warn!(error = %e, "retention failed; will retry");
                        }
                    }
                    let now = tokio::time::Instant::now();
                    if now < deadline {
                        tokio::select! {
                            () = stop.cancelled() => {}
                            r = ready_rx.changed() => { if r.is_err() { return BatchReply::default(); } continue; }
                            () = tokio::time::sleep_until(deadline) => { continue; }
                        }
                    }
                    BatchReply {
                        step: ask.step,
                        ready_groups: ready as u32,
                        stale_dropped,
                        ..Default::default()
                    }
                }
            };
            return reply;
        }
    }

    async fn batch_reply(
        &mut self,
        ask: Ask,
        groups: &[Arc<str>],
        replayed: bool,
        zstd: bool,
    ) -> BatchReply {
        let mut reply = BatchReply {
            step: ask.step,
            num_groups: groups.len() as u32,
            replayed,
            ..Default::default()
        };
        let gathered = self.shared.core().gather(groups);
        let (batches, indices) = match gathered {
            Ok(g) => g,
            Err(e) => {
                reply.error = format!("cannot assemble step {}: {e}", ask.step);
                return reply;
            }
        };
        // A replay reports staleness against the version it was served at.
        let version = self
            .shared
            .core()
            .served_version(ask.step)
            .map_or(ask.version, |(v, _)| v);
        let encoded =
            tokio::task::spawn_blocking(move || encode_batch(&batches, &indices, zstd, version))
                .await;
        let encoded = match encoded {
            Ok(Ok(e)) => e,
            Ok(Err(e)) => {
                reply.error = format!("cannot encode step {}: {e}", ask.step);
                return reply;
            }
            Err(e) => {
                reply.error = format!("cannot encode step {}: {e}", ask.step);
                return reply;
            }
        };
        if !replayed {
            for (lag, n) in &encoded.lags {
                self.shared
                    .metrics
                    .served_token_staleness
                    .observe_n(*lag, *n);
            }
        }
        reply.num_trajectories = encoded.rows as u32;
        if encoded.ipc.len() as u64 <= self.config.inline_reply_max_bytes {
            reply.arrow_ipc = Bytes::from(encoded.ipc);
            return reply;
        }
        // Too large for one message: hand it over through the object store.
        let name = format!("step-{:012}", ask.step);
        let store = match self.objects.clone() {
            Some(s) => s,
            None => match self
                .shared
                .bus
                .object_store(&self.config.batch_object_bucket)
                .await
            {
                Ok(s) => {
                    self.objects = Some(s.clone());
                    s
                }
                Err(e) => {
                    reply.error = format!("cannot open the batch object store: {e}");
                    return reply;
                }
            },
        };
        match store.put(&name, Bytes::from(encoded.ipc)).await {
            Ok(_) => {
                reply.object_bucket = self.config.batch_object_bucket.clone();
                reply.object_name = name.clone();
                self.objects_by_step.insert(ask.step, name);
            }
            Err(e) => reply.error = format!("cannot store step {} as an object: {e}", ask.step),
        }
        reply
    }

    /// Deletes handed-over batch objects of trained steps.
    async fn cleanup_objects(&mut self) {
        let done = self.shared.core().stats().done_through;
        let Some(store) = self.objects.clone() else {
            return;
        };
        while let Some(entry) = self.objects_by_step.first_entry() {
            if *entry.key() > done {
                break;
            }
            let name = entry.remove();
            if let Err(e) = store.delete(&name).await {
                tracing::debug!(error = %e, name, "cannot delete a trained batch object");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use asyncrl_config::{FsyncPolicy, SegmentCompression};

    use super::*;
    use crate::testing::traj;

    fn trajs(from: u32, n: u32) -> Vec<Trajectory> {
        (from..from + n).map(|i| traj(i, 4, 0, 16)).collect()
    }

    fn rows(dir: &std::path::Path, id: u64) -> Vec<String> {
        let scan = segment::read_segment(dir, id, &trajectory_schema()).unwrap();
        assert_eq!(scan.tail_error, None);
        scan.batches
            .iter()
            .flat_map(|b| from_record_batch(b).unwrap())
            .map(|t| t.uuid)
            .collect()
    }

    /// The next segment cannot be created (its path is taken by a
    /// directory: a real OS error): the full segment takes no more frames,
    /// the batch is refused as a disk failure, and once the path is free
    /// the batch goes to the new segment.
    #[test]
    fn a_failed_rotation_refuses_the_batch_and_is_retried_before_the_next_append() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let mut w = SegmentWriter::create(
            dir,
            1,
            &trajectory_schema(),
            SegmentCompression::None,
            FsyncPolicy::Always,
        )
        .unwrap();
        // Full after one batch.
        let cfg = BufferConfig {
            segment_max_bytes: w.bytes() + 1,
            fsync: FsyncPolicy::Always,
            ..BufferConfig::default()
        };
        let blocker = segment::segment_path(dir, 2);
        std::fs::create_dir(&blocker).unwrap();
        // Appended; the rotation after it fails and is reported, not fatal.
        let mut rotated = None;
        let first = trajs(0, 3);
        let Ok(written) = write_batch(&mut w, &first, &cfg, &mut rotated) else {
            panic!("the append itself works");
        };
        assert_eq!((written.segment, rotated), (1, None));
        assert!(written.rotate_failed.is_some());
        let full_len = std::fs::metadata(segment::segment_path(dir, 1))
            .unwrap()
            .len();
        // The segment is full: the next batch needs the rotation first.
        let second = trajs(3, 2);
        match write_batch(&mut w, &second, &cfg, &mut rotated) {
            Err(WriteError::Disk { what, error }) => {
                assert_eq!(what, "segment_create");
                assert!(error.to_string().contains("seg-"), "{error}");
            }
            Err(WriteError::Other(e)) => panic!("not a disk error: {e}"),
            Ok(_) => panic!("written past the segment size"),
        }
        assert_eq!(rotated, None);
        assert_eq!(
            std::fs::metadata(segment::segment_path(dir, 1))
                .unwrap()
                .len(),
            full_len
        );
        // The path is free again: rotated, then appended to the new segment.
        std::fs::remove_dir(&blocker).unwrap();
        let Ok(written) = write_batch(&mut w, &second, &cfg, &mut rotated) else {
            panic!("written once the segment can be created");
        };
        assert_eq!(written.segment, 2);
        // (and rotated again after the append, as this segment is full too)
        assert_eq!(rotated, Some(3));
        assert_eq!(
            rows(dir, 1),
            first.iter().map(|t| t.uuid.clone()).collect::<Vec<_>>()
        );
        assert_eq!(
            rows(dir, 2),
            second.iter().map(|t| t.uuid.clone()).collect::<Vec<_>>()
        );
        assert!(rows(dir, 3).is_empty());
    }

    /// A leftover of a failed creation (no longer than a header) is
    /// replaced; a segment with data is never overwritten.
    #[test]
    fn creation_replaces_only_an_empty_leftover() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let create = |id| {
            SegmentWriter::create(
                dir,
                id,
                &trajectory_schema(),
                SegmentCompression::None,
                FsyncPolicy::Never,
            )
        };
        std::fs::write(segment::segment_path(dir, 1), &segment::MAGIC[..5]).unwrap();
        let mut w = create(1).expect("a torn header is replaced");
        w.append(&to_record_batch(&trajs(0, 2)).unwrap()).unwrap();
        drop(w);
        let err = create(1).err().expect("a segment with data is kept");
        assert!(err.to_string().contains("create segment"), "{err}");
        assert_eq!(rows(dir, 1).len(), 2);
    }
}
