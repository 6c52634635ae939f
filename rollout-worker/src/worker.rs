//! The worker's main loop: start the model, wait for the first weights,
//! register, then acquire tasks as slots free up until shutdown, and drain.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use asyncrl_common::{SharedClock, SystemClock};
use asyncrl_config::{BatchingMode, Config};
use asyncrl_policy::ModelHandle;
use asyncrl_protos::Task;
use asyncrl_protos::subjects::{
    TASKS_ACQUIRE, TASKS_AVAILABLE, TASKS_RETURN, WORKERS_HEARTBEAT, WORKERS_REGISTER,
    worker_subject,
};
use asyncrl_protos::v1::{
    AcquireTasks, AcquireTasksReply, HeartbeatReply, RegisterWorker, RegisterWorkerReply,
    ReturnTasks, ReturnTasksReply, WorkerHeartbeat,
};
use asyncrl_telemetry::{Health, Metrics};
use asyncrl_transport::{Bus, Message};
use futures::stream::BoxStream;
use futures::{FutureExt as _, StreamExt as _};
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::client::{Backoff, call};
use crate::engine::Readiness;
use crate::error::WorkerError;
use crate::metrics::{WorkerMetrics, reason};
use crate::settings::{Settings, scorer};
use crate::state::{CompletionLengths, Counters, LeaseEntry, SeqGuard, Shared, bump};
use crate::task::{Stops, TaskEnd, run_task};

/// Readiness condition the worker declares in [`Health`].
pub const HEALTH_CONDITION: &str = "worker";

/// What a worker did, returned when it stops.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WorkerSummary {
    pub worker_id: String,
    /// Tasks acquired.
    pub tasks_started: u64,
    /// Tasks whose G trajectories were acked and whose completion was accepted.
    pub tasks_completed: u64,
    /// Tasks handed back to the coordinator unfinished.
    pub tasks_returned: u64,
    /// The lease ids handed back.
    pub returned_lease_ids: Vec<String>,
    /// Leases the coordinator revoked while the worker held them.
    pub tasks_revoked: u64,
    /// Tasks fully published whose completion the coordinator refused.
    pub completions_refused: u64,
    pub trajectories_published: u64,
    /// Sequences cancelled before they finished.
    pub sequences_cancelled: u64,
    /// Tokens the model sampled.
    pub tokens_generated: u64,
    pub weight_swaps: u64,
    pub weight_fetch_failures: u64,
    pub reward_failures: u64,
    /// The weight version in use at the end (None: no weights were ever
    /// announced).
    pub final_version: Option<i32>,
    /// Whether the drain ended with every held task completed or returned.
    pub drained_cleanly: bool,
}

/// A rollout worker, configured; [`Worker::run`] runs it.
pub struct Worker {
    config: Config,
    bus: Arc<dyn Bus>,
    metrics: Metrics,
    model: Option<ModelHandle>,
    health: Option<Health>,
    lengths: CompletionLengths,
    clock: SharedClock,
}

impl Worker {
    pub fn new(config: Config, bus: Arc<dyn Bus>, metrics: Metrics) -> Self {
        Self {
            config,
            bus,
            metrics,
            model: None,
            health: None,
            lengths: CompletionLengths::Model,
            clock: SystemClock::shared(),
        }
    }

    /// Reads wall-clock time (trajectory timestamps, the announce-to-in-use
    /// latency) from `clock` instead of the system clock. The worker's
    /// timers (heartbeats, drain grace, backoffs, timeouts) are tokio's, so
    /// a test on paused tokio time drives both.
    pub fn with_clock(mut self, clock: SharedClock) -> Self {
        self.clock = clock;
        self
    }

    /// Uses an existing model thread instead of building one from `[model]`
    /// (tests, benches, and a process that shares one model). Its batch
    /// size wins over `worker.max_sequences`.
    pub fn with_model(mut self, model: ModelHandle) -> Self {
        self.model = Some(model);
        self
    }

    /// Declares readiness (`worker`) in `health`: ready once the first
    /// weights are loaded and the worker is registered.
    pub fn with_health(mut self, health: Health) -> Self {
        self.health = Some(health);
        self
    }

    /// How completion lengths are decided (benchmarks only; see
    /// [`CompletionLengths`]).
    pub fn with_completion_lengths(mut self, lengths: CompletionLengths) -> Self {
        self.lengths = lengths;
        self
    }

    /// Runs the worker until `shutdown` is cancelled (the binary maps
    /// SIGTERM/SIGINT onto it), then drains: stops acquiring, lets the
    /// sequences in flight finish within `worker.drain_grace_period`,
    /// publishes them, returns the unfinished tasks, and returns.
    pub async fn run(self, shutdown: CancellationToken) -> Result<WorkerSummary, WorkerError> {
        let mut settings = Settings::from_config(&self.config)?;
        let metrics = WorkerMetrics::new(&self.metrics)?;
        let scorer = scorer(&self.config)?;
        let health = self.health.unwrap_or_default();
        health.set_not_ready(HEALTH_CONDITION, "starting the model");
        let built = match self.model {
            Some(m) => crate::engine::builtin::from_model(m, &settings.model).await,
            None => {
                crate::engine::build(
                    &self.config,
                    settings.max_sequences,
                    &settings.worker_id,
                    metrics.clone(),
                )
                .await
            }
        }
        .map_err(WorkerError::Engine)?;
        let engine = built.engine;
        let params = built.params;
        if engine.kind() == "builtin" {
            // The model thread is its one server (external engines keep
            // this gauge themselves).
            metrics.engine_servers_ready.set(1);
        }
        settings.max_sequences = engine.max_slots();
        tracing::info!(
            worker_id = %settings.worker_id,
            engine = engine.kind(),
            max_sequences = settings.max_sequences,
            max_tasks_in_flight = settings.max_tasks_in_flight,
            batching = ?settings.batching,
            temperature = params.temperature,
            top_p = params.top_p,
            max_new_tokens = params.max_new_tokens,
            "rollout worker starting"
        );
        let episodes =
            crate::episode::from_config(&self.config, &params, engine.max_seq_len(), &self.metrics)
                .map_err(WorkerError::Environment)?;
        let tokens_at_start = engine.counters().tokens_generated;
        let (loaded_tx, mut loaded_rx) = watch::channel(None);
        let shared = Arc::new(Shared {
            settings,
            bus: self.bus,
            engine: engine.clone(),
            stop_strings: built
                .text
                .stop_strings_with(&self.config.model.stop_strings),
            text: built.text,
            params,
            scorer,
            episodes,
            metrics,
            counters: Counters::default(),
            lengths: self.lengths,
            leases: Mutex::new(HashMap::new()),
            outstanding: AtomicUsize::new(0),
            slot_freed: Notify::new(),
            announced_version: AtomicI32::new(-1),
            swap_latency_ms: AtomicU64::new(0f64.to_bits()),
            draining: AtomicBool::new(false),
            fatal: Mutex::new(None),
            returned_lease_ids: Mutex::new(Vec::new()),
            tokens_sampled: AtomicU64::new(tokens_at_start),
            shared_sampled: AtomicU64::new(engine.counters().prompt_tokens_shared),
            loaded: loaded_rx.clone(),
            clock: self.clock,
        });
        let background = CancellationToken::new();
        let mut loops = JoinSet::new();
        loops.spawn(crate::weights::run(
            shared.clone(),
            loaded_tx,
            background.clone(),
        ));
        loops.spawn(sample_metrics(shared.clone(), background.clone()));

        let result = async {
            // The first weights.
            health.set_not_ready(
                HEALTH_CONDITION,
                "waiting for the first weight announcement",
            );
            if !wait_for_first_weights(&shared, &mut loaded_rx, &shutdown).await {
                return Ok(false);
            }
            // Registration.
            health.set_not_ready(HEALTH_CONDITION, "registering with the coordinator");
            let Some(heartbeat_every) = register(&shared, &shutdown).await? else {
                return Ok(false);
            };
            loops.spawn(heartbeat_loop(
                shared.clone(),
                heartbeat_every,
                background.clone(),
            ));
            health.set_ready(HEALTH_CONDITION);
            loops.spawn(follow_engine_readiness(
                shared.engine.readiness(),
                health.clone(),
                background.clone(),
            ));
            Ok::<bool, WorkerError>(true)
        }
        .await;
        let drained_cleanly = match result {
            Ok(true) => {
                let clean = acquire_and_drain(&shared, &shutdown).await;
                health.set_not_ready(HEALTH_CONDITION, "stopped");
                clean
            }
            Ok(false) => true,
            Err(e) => {
                background.cancel();
                while loops.join_next().await.is_some() {}
                health.set_not_ready(HEALTH_CONDITION, e.to_string());
                return Err(e);
            }
        };
        background.cancel();
        while let Some(r) = loops.join_next().await {
            r?;
        }
        sample_once(&shared);
        let c = &shared.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let summary = WorkerSummary {
            worker_id: shared.settings.worker_id.clone(),
            tasks_started: get(&c.tasks_started),
            tasks_completed: get(&c.tasks_completed),
            tasks_returned: get(&c.tasks_returned),
            returned_lease_ids: shared
                .returned_lease_ids
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone(),
            tasks_revoked: get(&c.tasks_revoked),
            completions_refused: get(&c.completions_refused),
            trajectories_published: get(&c.trajectories_published),
            sequences_cancelled: get(&c.sequences_cancelled),
            tokens_generated: shared.engine.counters().tokens_generated - tokens_at_start,
            weight_swaps: get(&c.weight_swaps),
            weight_fetch_failures: get(&c.weight_fetch_failures),
            reward_failures: get(&c.reward_failures),
            final_version: (get(&c.weight_swaps) > 0).then(|| shared.engine.version()),
            drained_cleanly,
        };
        tracing::info!(?summary, "rollout worker stopped");
        engine.shutdown().await;
        if let Some(reason) = shared.fatal() {
            return Err(WorkerError::Stopped(reason));
        }
        Ok(summary)
    }
}

/// Runs a worker with the model of `[model]` until `shutdown` is cancelled;
/// see [`Worker::run`].
pub async fn run(
    config: Config,
    bus: Arc<dyn Bus>,
    metrics: Metrics,
    shutdown: CancellationToken,
) -> Result<WorkerSummary, WorkerError> {
    Worker::new(config, bus, metrics).run(shutdown).await
}

/// Waits until the first announced weights are in use; false on shutdown.
async fn wait_for_first_weights(
    shared: &Arc<Shared>,
    loaded: &mut watch::Receiver<Option<i32>>,
    shutdown: &CancellationToken,
) -> bool {
    let started = Instant::now();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return false,
            r = loaded.wait_for(Option::is_some) => {
                return r.is_ok() && shared.fatal().is_none();
            }
            _ = tokio::time::sleep(crate::weights::STARTUP_LOG_EVERY) => {
                tracing::info!(waited_s = started.elapsed().as_secs(), "waiting for the learner's first weight announcement (policy.version)");
            }
        }
    }
}

/// Registers with the coordinator, retrying until it answers; returns the
/// heartbeat interval, or None on shutdown.
async fn register(
    shared: &Arc<Shared>,
    shutdown: &CancellationToken,
) -> Result<Option<Duration>, WorkerError> {
    let s = &shared.settings;
    let (min, max) = s.acquire_backoff;
    let mut backoff = Backoff::new(min, max);
    loop {
        let req = RegisterWorker {
            worker_id: s.worker_id.clone(),
            capacity: u32::try_from(s.max_sequences).unwrap_or(u32::MAX),
            policy_version: shared.engine.version(),
            hostname: s.hostname.clone(),
        };
        let r = shutdown
            .run_until_cancelled(call::<RegisterWorkerReply>(
                shared.bus.as_ref(),
                &worker_subject(WORKERS_REGISTER, &s.worker_id),
                &req,
                s.request_timeout,
            ))
            .await;
        match r {
            None => return Ok(None),
            Some(Ok(reply)) if reply.accepted => {
                let every = match reply.heartbeat_interval_ms {
                    0 => s.heartbeat_interval,
                    ms => s
                        .heartbeat_interval
                        .min(Duration::from_millis(u64::from(ms))),
                };
                tracing::info!(worker_id = %s.worker_id, version = shared.engine.version(), heartbeat_ms = every.as_millis() as u64, "registered with the coordinator");
                return Ok(Some(every));
            }
            Some(Ok(reply)) => {
                return Err(WorkerError::Rejected {
                    worker_id: s.worker_id.clone(),
                    reason: reply.reason,
                });
            }
            Some(Err(e)) => {
                shared
                    .metrics
                    .coordinator_errors
                    .get_or_create(&reason("register"))
                    .inc();
                tracing::warn!(error = %e, "cannot register with the coordinator; retrying");
                let delay = backoff.next_delay();
                if shutdown
                    .run_until_cancelled(tokio::time::sleep(delay))
                    .await
                    .is_none()
                {
                    return Ok(None);
                }
            }
        }
    }
}

/// How many tasks to ask for now.
pub(crate) fn tasks_wanted(
    batching: BatchingMode,
    max_sequences: usize,
    group_size: usize,
    max_tasks: usize,
    outstanding: usize,
    held: usize,
) -> usize {
    let room = max_tasks.saturating_sub(held);
    let g = group_size.max(1);
    let want = match batching {
        // Fill every free slot: a finished sequence makes room at once.
        BatchingMode::Continuous => max_sequences.saturating_sub(outstanding).div_ceil(g),
        // Wait until the whole batch has finished generating.
        BatchingMode::Static if outstanding == 0 => (max_sequences / g).max(1),
        BatchingMode::Static => 0,
    };
    want.min(room)
}

struct Running {
    tasks: JoinSet<(String, TaskEnd)>,
    stops: Stops,
    /// Leases to hand back, with the reason and whether the task failed.
    to_return: Vec<(String, String, bool)>,
}

impl Running {
    fn start(&mut self, shared: &Arc<Shared>, task: Task, granted_at: Instant) {
        let g = task.group_size as usize;
        if g == 0 || task.lease_id.is_empty() || task.task_id.is_empty() {
            tracing::warn!(task_id = %task.task_id, lease_id = %task.lease_id, group_size = task.group_size, "malformed task; returning it");
            if !task.lease_id.is_empty() {
                self.to_return.push((
                    task.lease_id,
                    "malformed task (group_size 0 or no id)".into(),
                    true,
                ));
            }
            return;
        }
        bump(&shared.counters.tasks_started);
        let guards: Vec<SeqGuard> = (0..g).map(|_| SeqGuard::new(shared)).collect();
        let abort = CancellationToken::new();
        shared.leases().insert(
            task.lease_id.clone(),
            LeaseEntry {
                task_id: task.task_id.clone(),
                cancel: abort.clone(),
                revoked: Arc::new(AtomicBool::new(false)),
            },
        );
        tracing::debug!(task_id = %task.task_id, lease_id = %task.lease_id, group_size = g, admission_version = task.admission_version, "task started");
        let stops = Stops {
            abort,
            ..self.stops.clone()
        };
        let shared = shared.clone();
        self.tasks.spawn(async move {
            let lease = task.lease_id.clone();
            (
                lease,
                run_task(shared, task, granted_at, guards, stops).await,
            )
        });
    }

    fn finished(
        &mut self,
        shared: &Arc<Shared>,
        r: Result<(String, TaskEnd), tokio::task::JoinError>,
    ) {
        match r {
            Ok((lease, TaskEnd::Unfinished(why))) => self.to_return.push((lease, why, false)),
            Ok((lease, TaskEnd::Failed(why))) => self.to_return.push((lease, why, true)),
            Ok(_) => {}
            Err(e) => {
                // A task future panicked: its lease is still in the map.
                tracing::error!(error = %e, "a task failed unexpectedly");
                shared.set_fatal(format!("a task failed unexpectedly: {e}"));
            }
        }
    }
}

/// Hands leases back to the coordinator: the failed tasks and the others
/// in one request each.
async fn return_tasks(shared: &Arc<Shared>, leases: Vec<(String, String, bool)>) {
    let (failed, other): (Vec<_>, Vec<_>) = leases.into_iter().partition(|(_, _, f)| *f);
    for (leases, task_failed) in [(failed, true), (other, false)] {
        let leases: Vec<(String, String)> = leases.into_iter().map(|(l, w, _)| (l, w)).collect();
        return_some(shared, leases, task_failed).await;
    }
}

/// Hands leases back to the coordinator (a few attempts).
async fn return_some(shared: &Arc<Shared>, leases: Vec<(String, String)>, task_failed: bool) {
    if leases.is_empty() {
        return;
    }
    let ids: Vec<String> = leases.iter().map(|(l, _)| l.clone()).collect();
    let why = leases.first().map(|(_, w)| w.clone()).unwrap_or_default();
    let req = ReturnTasks {
        task_failed,
        worker_id: shared.settings.worker_id.clone(),
        lease_ids: ids.clone(),
        reason: if shared.draining.load(Ordering::SeqCst) {
            format!("worker draining: {why}")
        } else {
            why.clone()
        },
    };
    let label = if shared.draining.load(Ordering::SeqCst) {
        "drain"
    } else {
        "failure"
    };
    let (min, max) = shared.settings.acquire_backoff;
    let mut backoff = Backoff::new(min, max);
    for attempt in 1..=5u32 {
        match call::<ReturnTasksReply>(
            shared.bus.as_ref(),
            &worker_subject(TASKS_RETURN, &shared.settings.worker_id),
            &req,
            shared.settings.request_timeout,
        )
        .await
        {
            Ok(reply) => {
                tracing::info!(leases = ?ids, returned = reply.returned, reason = %req.reason, "tasks returned to the coordinator");
                break;
            }
            Err(e) => {
                shared
                    .metrics
                    .coordinator_errors
                    .get_or_create(&reason("return"))
                    .inc();
                tracing::warn!(attempt, error = %e, leases = ?ids, "ReturnTasks failed");
                if attempt == 5 {
                    tracing::error!(leases = ?ids, "could not return tasks; their leases will expire at the coordinator");
                } else {
                    tokio::time::sleep(backoff.next_delay()).await;
                }
            }
        }
    }
    shared
        .metrics
        .tasks_returned
        .get_or_create(&reason(label))
        .inc_by(ids.len() as u64);
    shared
        .counters
        .tasks_returned
        .fetch_add(ids.len() as u64, Ordering::Relaxed);
    shared
        .returned_lease_ids
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .extend(ids);
}

/// The coordinator's [`TASKS_AVAILABLE`] hints; none (a stream that ends at
/// once) when the subscription fails: a refused acquire then waits out
/// `retry_after`, as it did before the hint.
async fn subscribe_to_capacity_hints(bus: &dyn Bus) -> BoxStream<'static, Message> {
    match bus.subscribe(TASKS_AVAILABLE).await {
        Ok(hints) => hints,
        Err(e) => {
            tracing::warn!(error = %e, subject = TASKS_AVAILABLE, "cannot subscribe to the coordinator's tasks-available hints; a refused acquire waits out retry_after");
            futures::stream::empty().boxed()
        }
    }
}

/// The acquire loop, then the drain. Returns whether the drain was clean.
async fn acquire_and_drain(shared: &Arc<Shared>, shutdown: &CancellationToken) -> bool {
    let s = &shared.settings;
    let mut run = Running {
        tasks: JoinSet::new(),
        stops: Stops {
            abort: CancellationToken::new(),
            generation: CancellationToken::new(),
            hard: CancellationToken::new(),
        },
        to_return: Vec::new(),
    };
    let (min, max) = s.acquire_backoff;
    let mut backoff = Backoff::new(min, max);
    let mut engine_ready = shared.engine.readiness();
    let mut available = subscribe_to_capacity_hints(shared.bus.as_ref()).await;
    loop {
        if !run.to_return.is_empty() {
            return_tasks(shared, std::mem::take(&mut run.to_return)).await;
        }
        if shutdown.is_cancelled() || shared.fatal().is_some() {
            break;
        }
        // An engine that is down or restarting gets no new work; the tasks
        // whose generation failed are returned above.
        let readiness = engine_ready.borrow_and_update().clone();
        if let Readiness::NotReady(why) = readiness {
            tracing::info!(reason = %why, "the engine is not ready; acquiring no tasks until it is");
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = engine_ready.wait_for(|r| *r == Readiness::Ready) => {}
                Some(r) = run.tasks.join_next() => run.finished(shared, r),
            }
            continue;
        }
        let want = tasks_wanted(
            s.batching,
            s.max_sequences,
            s.group_size_hint,
            s.max_tasks_in_flight,
            shared.outstanding.load(Ordering::SeqCst),
            shared.leases().len(),
        );
        if want == 0 {
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = shared.slot_freed.notified() => {}
                Some(r) = run.tasks.join_next() => run.finished(shared, r),
            }
            continue;
        }
        // Hints that came while the worker was busy are answered by this
        // acquire.
        while let Some(Some(_)) = available.next().now_or_never() {}
        let req = AcquireTasks {
            worker_id: s.worker_id.clone(),
            free_slots: u32::try_from(want).unwrap_or(u32::MAX),
        };
        // Not interrupted by shutdown: tasks granted meanwhile are returned
        // at once instead of waiting for their leases to expire.
        let reply = call::<AcquireTasksReply>(
            shared.bus.as_ref(),
            &worker_subject(TASKS_ACQUIRE, &s.worker_id),
            &req,
            s.request_timeout,
        )
        .await;
        let granted_at = Instant::now();
        let delay = match reply {
            Ok(reply) if !reply.tasks.is_empty() => {
                backoff.reset();
                tracing::debug!(asked = want, granted = reply.tasks.len(), "tasks acquired");
                for task in reply.tasks {
                    if shutdown.is_cancelled() {
                        run.to_return.push((
                            task.lease_id,
                            "granted while the worker was shutting down".into(),
                            false,
                        ));
                    } else {
                        run.start(shared, task, granted_at);
                    }
                }
                continue;
            }
            Ok(reply) => {
                tracing::debug!(reason = %reply.reason, retry_after_ms = reply.retry_after_ms, "no task granted");
                match reply.retry_after_ms {
                    0 => backoff.next_delay(),
                    ms => Duration::from_millis(u64::from(ms)),
                }
            }
            Err(e) => {
                shared
                    .metrics
                    .coordinator_errors
                    .get_or_create(&reason("acquire"))
                    .inc();
                tracing::warn!(error = %e, "acquire failed; backing off");
                backoff.next_delay()
            }
        };
        // A refusal mostly means "not before the learner's next version"
        // (η): a swap to new weights ends the wait at once instead of at the
        // coordinator's retry_after, which would otherwise sit on the
        // critical path of every synchronous (η = 0) step. So does the
        // coordinator's hint that capacity came back without a new version.
        let sleep = tokio::time::sleep(delay);
        tokio::pin!(sleep);
        let mut loaded = shared.loaded.clone();
        loaded.borrow_and_update();
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = &mut sleep => break,
                Ok(()) = loaded.changed() => break,
                Some(_) = available.next() => break,
                Some(r) = run.tasks.join_next() => run.finished(shared, r),
            }
        }
    }

    // Drain.
    shared.draining.store(true, Ordering::SeqCst);
    let grace = s.drain_grace_period;
    let held = shared.held_lease_ids();
    tracing::info!(
        held = held.len(),
        grace_ms = grace.as_millis() as u64,
        "draining: no new tasks; finishing the sequences in flight"
    );
    let generation = run.stops.generation.clone();
    let hard = run.stops.hard.clone();
    let hard_after = grace + 2 * s.request_timeout;
    let timers = tokio::spawn(async move {
        tokio::time::sleep(grace).await;
        generation.cancel();
        tokio::time::sleep(hard_after - grace).await;
        hard.cancel();
    });
    while let Some(r) = run.tasks.join_next().await {
        run.finished(shared, r);
    }
    timers.abort();
    let unfinished = run.to_return.len();
    return_tasks(shared, std::mem::take(&mut run.to_return)).await;
    let clean = shared.leases().is_empty();
    tracing::info!(returned = unfinished, clean, "drain finished");
    clean
}

/// Heartbeats with the held leases; cancels the sequences of revoked ones.
async fn heartbeat_loop(shared: Arc<Shared>, every: Duration, stop: CancellationToken) {
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last = (shared.engine.counters().tokens_generated, Instant::now());
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let stats = shared.engine.counters();
        let dt = last.1.elapsed().as_secs_f64();
        let tps = if dt > 0.0 {
            stats.tokens_generated.saturating_sub(last.0) as f64 / dt
        } else {
            0.0
        };
        last = (stats.tokens_generated, Instant::now());
        let req = WorkerHeartbeat {
            worker_id: shared.settings.worker_id.clone(),
            policy_version: shared.engine.version(),
            lease_ids: shared.held_lease_ids(),
            sequences_in_flight: u32::try_from(shared.outstanding.load(Ordering::SeqCst))
                .unwrap_or(u32::MAX),
            tokens_per_second: tps,
            draining: shared.draining.load(Ordering::SeqCst),
            weight_swap_latency_ms: shared.swap_latency_ms(),
        };
        let r = stop
            .run_until_cancelled(call::<HeartbeatReply>(
                shared.bus.as_ref(),
                &worker_subject(WORKERS_HEARTBEAT, &shared.settings.worker_id),
                &req,
                shared.settings.request_timeout,
            ))
            .await;
        match r {
            None => return,
            Some(Ok(reply)) => {
                for lease in &reply.revoked_lease_ids {
                    if !shared.revoke(lease) {
                        tracing::debug!(lease_id = %lease, "revoked lease is not held (already finished)");
                    }
                }
            }
            Some(Err(e)) => {
                shared
                    .metrics
                    .coordinator_errors
                    .get_or_create(&reason("heartbeat"))
                    .inc();
                tracing::warn!(error = %e, "heartbeat failed");
            }
        }
    }
}

/// Keeps the worker's readiness in step with its engine's (a worker whose
/// engine is down is not ready: Kubernetes stops counting it).
async fn follow_engine_readiness(
    mut ready: watch::Receiver<Readiness>,
    health: Health,
    stop: CancellationToken,
) {
    loop {
        match ready.borrow_and_update().clone() {
            Readiness::Ready => health.set_ready(HEALTH_CONDITION),
            Readiness::NotReady(why) => health.set_not_ready(HEALTH_CONDITION, why),
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            r = ready.changed() => if r.is_err() { return },
        }
    }
}

/// Samples the engine's counters into the metrics.
async fn sample_metrics(shared: Arc<Shared>, stop: CancellationToken) {
    let mut ticker = tokio::time::interval(shared.settings.metrics_interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last = Instant::now();
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = ticker.tick() => {
                let delta = sample_once(&shared);
                let dt = last.elapsed().as_secs_f64();
                last = Instant::now();
                if dt > 0.0 {
                    shared.metrics.tokens_per_second.set(delta as f64 / dt);
                }
            }
        }
    }
}

/// Moves the model's token count into the metrics; returns the new tokens.
fn sample_once(shared: &Shared) -> u64 {
    let stats = shared.engine.counters();
    let m = &shared.metrics;
    let before = shared
        .tokens_sampled
        .swap(stats.tokens_generated, Ordering::SeqCst);
    let delta = stats.tokens_generated.saturating_sub(before);
    m.tokens_generated.inc_by(delta);
    let shared_before = shared
        .shared_sampled
        .swap(stats.prompt_tokens_shared, Ordering::SeqCst);
    m.prompt_tokens_shared
        .inc_by(stats.prompt_tokens_shared.saturating_sub(shared_before));
    m.sequences_in_flight
        .set(shared.outstanding.load(Ordering::SeqCst) as i64);
    m.batch_occupancy.set(stats.in_flight as i64);
    m.tasks_in_flight.set(shared.leases().len() as i64);
    delta
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn continuous_batching_asks_for_work_as_soon_as_a_slot_frees() {
        use BatchingMode::*;
        // 16 slots, G = 8: two tasks fill the batch.
        assert_eq!(tasks_wanted(Continuous, 16, 8, 4, 0, 0), 2);
        assert_eq!(tasks_wanted(Continuous, 16, 8, 4, 16, 2), 0);
        // One sequence finished: one more task (its sequences queue behind).
        assert_eq!(tasks_wanted(Continuous, 16, 8, 4, 15, 2), 1);
        // ...bounded by the task cap.
        assert_eq!(tasks_wanted(Continuous, 16, 8, 4, 3, 4), 0);
        assert_eq!(tasks_wanted(Continuous, 16, 8, 10, 0, 9), 1);
        // Over-subscribed (queued sequences): nothing.
        assert_eq!(tasks_wanted(Continuous, 16, 8, 10, 23, 3), 0);
    }

    #[test]
    fn static_batching_waits_for_the_whole_batch() {
        use BatchingMode::*;
        assert_eq!(tasks_wanted(Static, 16, 8, 4, 0, 0), 2);
        assert_eq!(tasks_wanted(Static, 16, 8, 4, 1, 2), 0);
        // Finished generating, still publishing: the next batch may start.
        assert_eq!(tasks_wanted(Static, 16, 8, 4, 0, 2), 2);
        // G larger than the batch: one task at a time.
        assert_eq!(tasks_wanted(Static, 4, 8, 4, 0, 0), 1);
    }
}
