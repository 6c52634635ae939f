//! The learner as a role: ask the buffer for batches, train, publish the
//! weights of every version, checkpoint, report.
//!
//! Per step `s`: seal the step's knobs (no change for step `s` is accepted
//! after this), checkpoint first if the coordinator asked for it, request
//! `B` groups for step `s` at version `v = s − 1` (the buffer long-polls and
//! replays the same groups if `s` was served before a crash), train on the
//! trainer thread, take the trainer's snapshot of the weights of version
//! `s`, upload them to the object store and then announce them in
//! `policy.version`, write `learner.status`, and checkpoint every
//! `checkpoint_every` steps, on SIGTERM, and after the last step of the run
//! (`run.max_steps`).
//!
//! The learner never waits for what it can do ahead:
//! - Step `s + 1` is sealed and its batch asked for (at version `s`, the
//!   version that will train it, so its staleness is checked against the
//!   right floor) while step `s` trains. The buffer takes that request as
//!   "step `s` is trained" and stops replaying `s`'s groups, so every batch
//!   is first stored in the checkpoint folder ([`crate::pending`], fsynced)
//!   and kept until its version is announced: a learner killed before then
//!   retrains the step from that copy, on the same groups.
//! - The upload of version `s` runs while step `s + 1` trains. One upload
//!   at a time: the upload of `s + 1` starts after `s` is announced, so
//!   versions are announced in order, each after its object is completely
//!   stored (with the sha256 the store computed); the last one before the
//!   run ends (also on SIGTERM). An upload's error fails the role after its
//!   transient errors were retried, as before.
//!
//! A checkpoint that cannot be written (a full volume, any write error) is
//! logged with its path and OS error and counted
//! (`asyncrl_learner_checkpoint_failures_total{reason}`); the learner
//! trains on, the last good checkpoint (`asyncrl_learner_checkpoint_last_step`)
//! stays the resume point, and the next checkpoint tries again. Only a
//! torch engine that died fails the role there. Writes a crash cut off are
//! removed at start ([`checkpoint::remove_interrupted`]).
//!
//! Resume: the newest complete checkpoint; if `policy.version` announces a
//! newer version (trained and published before a crash, after the last
//! checkpoint), its weights are taken from the object store and the step
//! counter continues from it, so versions never go backwards and no step's
//! groups are trained twice. Only the optimizer moments are then those of the
//! checkpoint.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use arrow::array::RecordBatch;
use asyncrl_config::Config;
use asyncrl_control::{KnobError, seal_step};
use asyncrl_protos::subjects::LEARNER_STATUS_KEY;
use asyncrl_protos::v1::{BatchReply, BatchRequest, LearnerStatus, RefusedGroup};
use asyncrl_protos::{Message, subjects};
use asyncrl_telemetry::Metrics;
use asyncrl_transport::{Bus, KvBucket, ObjectStore};
use bytes::Bytes;
use tokio_util::sync::CancellationToken;

use crate::actor::TrainerActor;
use crate::advantages::AdvantageNorm;
use crate::batch::BatchError;
use crate::checkpoint;
use crate::engine::TrainerEngine;
use crate::eval::Evaluator;
use crate::metrics::LearnerMetrics;
use crate::objective::{LossAggregation, ObjectiveConfig, ProximalMode};
use crate::outputs::{
    CsvLog, EvalRow, METRICS_CSV, MetricsRow, TRAINED_JSONL, TrainedLog, TrainedStep,
};
use crate::pending::PendingBatches;
use crate::torch_engine::EngineError;
use crate::trainer::{StepSettings, StepStats, TrainError, TrainerOptions};
use asyncrl_common::{Backoff, unix_ms};

/// What a learner run did.
#[derive(Debug, Clone, Default)]
pub struct LearnerSummary {
    pub steps: u64,
    pub version: i32,
    pub last: Option<StepStats>,
    pub metrics_csv: PathBuf,
    pub checkpoint_dir: PathBuf,
    /// [`crate::outputs::EVAL_CSV`] when `[eval]` is on.
    pub eval_csv: Option<PathBuf>,
}

/// What the learner tells a progress display (the one-process `asyncrl train`).
#[derive(Debug, Clone)]
pub enum LearnerEvent {
    Step(Box<StepStats>),
    Eval(EvalRow),
}

pub fn trainer_options(config: &Config) -> TrainerOptions {
    let l = &config.learner;
    TrainerOptions {
        temperature: asyncrl_policy::logprob_temperature(config.model.temperature),
        minibatches: l.minibatches,
        grad_clip: l.grad_clip,
        warmup_steps: l.warmup_steps,
        adamw: crate::adamw::AdamWConfig {
            beta1: l.beta1,
            beta2: l.beta2,
            eps: l.adam_eps,
            weight_decay: l.weight_decay,
        },
        advantage_norm: match l.advantage_norm {
            asyncrl_config::AdvantageNormName::Mean => AdvantageNorm::Mean,
            asyncrl_config::AdvantageNormName::MeanStd => AdvantageNorm::MeanStd,
            asyncrl_config::AdvantageNormName::LeaveOneOut => AdvantageNorm::LeaveOneOut,
        },
        proximal: match l.proximal {
            asyncrl_config::ProximalName::Recompute => ProximalMode::Recompute,
            asyncrl_config::ProximalName::Approx => ProximalMode::Approx,
            asyncrl_config::ProximalName::Behaviour => ProximalMode::Behaviour,
        },
        seed: config.run.seed,
        weight_dtype: asyncrl_policy::from_config::weight_dtype(config.model.weight_dtype),
        max_tokens_per_microbatch: l.max_tokens_per_microbatch,
        lanes: if l.packing && l.share_prefixes {
            crate::batch::Lanes::Shared {
                min_width: i64::try_from(l.packing_lane_tokens).unwrap_or(i64::MAX),
                max_width: i64::MAX,
            }
        } else if l.packing {
            crate::batch::Lanes::Packed {
                min_width: i64::try_from(l.packing_lane_tokens).unwrap_or(i64::MAX),
            }
        } else {
            crate::batch::Lanes::Padded
        },
        forward_only_zero_advantage: l.forward_only_zero_advantage,
    }
}

/// The objective and learning rate of a step from the sealed knobs.
pub fn step_settings(config: &Config, k: &asyncrl_control::StepKnobs) -> StepSettings {
    StepSettings {
        objective: ObjectiveConfig {
            eps_low: f64::from(k.eps_low),
            eps_high: f64::from(k.eps_high),
            clip_mode: k.clip_mode,
            importance_weight_cap: f64::from(k.importance_weight_cap),
            importance_correction: k.importance_correction,
            importance_weight_floor: f64::from(k.importance_weight_floor),
            dual_clip: f64::from(k.dual_clip),
            adaptive_quantile: f64::from(k.adaptive_quantile),
            adaptive_temperature: f64::from(k.adaptive_temperature),
            m2po_threshold: config.learner.m2po_threshold,
            kl_coef: config.learner.kl_coef,
            kl_estimator: config.learner.kl_estimator,
            aggregation: match config.learner.loss_aggregation {
                asyncrl_config::LossAggregationName::Token => LossAggregation::Token,
                asyncrl_config::LossAggregationName::Sequence => LossAggregation::Sequence,
            },
        },
        learning_rate: k.learning_rate,
    }
}

/// Whether a failed checkpoint means the torch engine's group is gone (the
/// role fails, as at any other call); any other failure is a write error the
/// learner trains on.
fn engine_died(e: &TrainError) -> bool {
    matches!(
        e,
        TrainError::Engine(
            EngineError::Exited { .. } | EngineError::Rpc { .. } | EngineError::StartTimeout(_)
        )
    )
}

pub fn checkpoint_dir(config: &Config) -> PathBuf {
    config
        .learner
        .checkpoint_dir
        .clone()
        .unwrap_or_else(|| config.run.output_dir.join("checkpoints"))
}

struct Ctx {
    config: Config,
    kv: Arc<dyn KvBucket>,
    actor: TrainerActor,
    metrics: LearnerMetrics,
    session: String,
    started_at: i64,
    start_version: i32,
    ckpt_dir: PathBuf,
    shutdown: CancellationToken,
    progress: Option<tokio::sync::mpsc::UnboundedSender<LearnerEvent>>,
    evaluator: Option<Evaluator>,
    /// Seals steps and gets their batches (also ahead, on its own task).
    fetcher: Fetcher,
    /// Uploads and announces weights (also in the background).
    publisher: Publisher,
}

/// Runs the learner until `run.max_steps` (0: until shutdown).
pub async fn run(
    config: Config,
    bus: Arc<dyn Bus>,
    metrics: Metrics,
    shutdown: CancellationToken,
) -> anyhow::Result<LearnerSummary> {
    run_with_progress(config, bus, metrics, shutdown, None).await
}

/// [`run`], sending the statistics of every step to `progress` (the
/// one-process `asyncrl train` shows them).
pub async fn run_with_progress(
    config: Config,
    bus: Arc<dyn Bus>,
    metrics: Metrics,
    shutdown: CancellationToken,
    progress: Option<tokio::sync::mpsc::UnboundedSender<LearnerEvent>>,
) -> anyhow::Result<LearnerSummary> {
    let ckpt_dir = checkpoint_dir(&config);
    // The run's lease first: nothing is sealed, trained or announced by a
    // second learner (it waits for a crashed predecessor's lease to lapse,
    // and refuses to start beside a live one).
    let session = uuid::Uuid::new_v4().to_string();
    let control = bus
        .kv(subjects::CONTROL_BUCKET)
        .await
        .context("cannot open the control KV bucket")?;
    let holder = format!(
        "{}:{}",
        std::env::var("HOSTNAME").unwrap_or_else(|_| "localhost".into()),
        std::process::id()
    );
    let ttl = config.learner.lease_ttl;
    let clock = asyncrl_common::SystemClock::shared();
    let lease = match asyncrl_control::lease::acquire(
        control.as_ref(),
        clock.as_ref(),
        &session,
        &holder,
        ttl,
        &shutdown,
    )
    .await
    {
        Ok(lease) => lease,
        Err(asyncrl_control::lease::LeaseError::Cancelled) => {
            return Ok(LearnerSummary::default());
        }
        Err(e) => return Err(e.into()),
    };
    let fence = asyncrl_control::weights::Fence {
        session: session.clone(),
        epoch: lease.epoch(),
    };
    let fenced = CancellationToken::new();
    let fence_error: Arc<std::sync::Mutex<Option<asyncrl_control::lease::LeaseError>>> =
        Arc::default();
    let renew_stop = CancellationToken::new();
    let renewer = AbortOnDrop(tokio::spawn(renew_lease(
        lease,
        control.clone(),
        clock,
        ttl,
        fenced.clone(),
        fence_error.clone(),
        renew_stop.clone(),
    )));
    // Before the engine reads or writes there (and only with the lease: a
    // refused second learner touches nothing).
    checkpoint::remove_interrupted(&ckpt_dir);
    let affinity = config.learner.cpu_affinity.clone();
    let engine_config = config.clone();
    let engine_ckpt_dir = ckpt_dir.clone();
    let actor = TrainerActor::spawn(move || -> anyhow::Result<Box<dyn TrainerEngine>> {
        if let Err(e) = crate::actor::pin_current_thread(&affinity) {
            tracing::warn!(cores = ?affinity, error = %e, "cannot pin the trainer thread");
        }
        crate::engine::start(&engine_config, &engine_ckpt_dir)
    })
    .await??;

    let on_eval = {
        let progress = progress.clone();
        move |row| {
            if let Some(tx) = &progress {
                let _ = tx.send(LearnerEvent::Eval(row));
            }
        }
    };
    let evaluator = Evaluator::start(&config, &metrics, on_eval)
        .await
        .context("cannot start the held-out evaluation ([eval])")?;
    let metrics = LearnerMetrics::register(&metrics)?;
    let (weights, kv) = asyncrl_control::weights::open(bus.as_ref()).await?;
    let pending = PendingBatches::new(&ckpt_dir);
    // The model's limits, and the run's context: no honest worker makes a
    // row longer than model.max_seq_len, so a longer one is refused (and
    // its group quarantined) even where the model could take it.
    let mut limits = actor.call(|t| t.batch_limits()).await?;
    limits.max_seq_len = limits.max_seq_len.min(config.model.max_seq_len);
    let config = Arc::new(config);
    let mut ctx = Ctx {
        session,
        started_at: unix_ms(),
        start_version: 0,
        fetcher: Fetcher {
            config: config.clone(),
            bus,
            kv: kv.clone(),
            metrics: metrics.clone(),
            shutdown: shutdown.clone(),
            limits,
            pending: pending.clone(),
            refused: Arc::default(),
        },
        publisher: Publisher {
            weights,
            shared_root: (config.learner.weight_transport
                == asyncrl_config::WeightTransportName::SharedPath)
                .then(|| config.learner.shared_weights_dir.clone())
                .flatten(),
            kv: kv.clone(),
            metrics: metrics.clone(),
            keep: config.learner.keep_weight_versions,
            shutdown: shutdown.clone(),
            pending,
            fence,
        },
        config: Config::clone(&config),
        kv,
        actor,
        metrics,
        ckpt_dir,
        shutdown,
        progress,
        evaluator,
    };
    let trained = async {
        // The step the engine resumed from (0: no checkpoint).
        let resumed = ctx.actor.call(|t| t.step()).await?;
        ctx.metrics
            .checkpoint_last_step
            .set(i64::try_from(resumed).unwrap_or(i64::MAX));
        ctx.reconcile_with_published().await?;
        ctx.start_version = ctx.actor.call(|t| t.version()).await?;
        ctx.write_status(0.0, 0.0).await;
        ctx.metrics.version.set(i64::from(ctx.start_version));
        ctx.train_loop().await
    };
    let summary = tokio::select! {
        r = trained => r,
        () = fenced.cancelled() => Err(anyhow::anyhow!("the learner stopped")),
    };
    // Fenced: that is the one line to print, whatever the train loop saw.
    let taken = fence_error
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take();
    if let Some(e) = taken {
        return Err(e.into());
    }
    let summary = summary?;
    // A clean stop hands the lease back at once.
    renew_stop.cancel();
    if let Some(lease) = renewer.join("learner lease renewal").await? {
        lease.release(control.as_ref()).await;
    }
    Ok(summary)
}

/// Renews the run's learner lease every quarter of its ttl until the
/// learner stops (returns the lease) or another learner takes it over:
/// then `fenced` is cancelled and the error kept for the learner to
/// report. A renewal the server cannot take is retried: the lease lapses
/// only if that lasts a whole ttl, and then the next renewal is fenced.
async fn renew_lease(
    mut lease: asyncrl_control::lease::Lease,
    kv: Arc<dyn KvBucket>,
    clock: asyncrl_common::SharedClock,
    ttl: Duration,
    fenced: CancellationToken,
    error: Arc<std::sync::Mutex<Option<asyncrl_control::lease::LeaseError>>>,
    stop: CancellationToken,
) -> Option<asyncrl_control::lease::Lease> {
    use asyncrl_control::lease::LeaseError;
    loop {
        tokio::select! {
            () = stop.cancelled() => return Some(lease),
            () = tokio::time::sleep(asyncrl_control::lease::renew_every(ttl)) => {}
        }
        match lease.renew(kv.as_ref(), clock.as_ref()).await {
            Ok(()) => {}
            Err(e @ LeaseError::Fenced { .. }) => {
                tracing::error!(error = %e, "fenced: another learner holds the run's lease");
                *error
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(e);
                fenced.cancel();
                return None;
            }
            Err(e) => tracing::warn!(error = %e, "cannot renew the learner lease; retrying"),
        }
    }
}

impl Ctx {
    /// Makes the trainer and `policy.version` agree (see the module docs).
    async fn reconcile_with_published(&mut self) -> anyhow::Result<()> {
        let local = self.actor.call(|t| t.version()).await?;
        let announced = asyncrl_control::weights::announced(self.kv.as_ref()).await?;
        match announced {
            Some(a) if a.version > local => {
                tracing::warn!(
                    checkpoint_version = local,
                    published_version = a.version,
                    "versions newer than the checkpoint were published before a restart: adopting the published weights"
                );
                let version = a.version;
                let cannot = || {
                    format!("cannot resume: cannot read the published weights of version {version}")
                };
                if a.folder.is_empty() {
                    let bytes =
                        asyncrl_control::weights::fetch(self.publisher.weights.as_ref(), &a)
                            .await
                            .with_context(cannot)?;
                    self.actor
                        .call(move |t| t.adopt_published(&bytes, version))
                        .await??;
                } else {
                    let ann = a.clone();
                    let files = tokio::task::spawn_blocking(move || {
                        asyncrl_control::weights::read_folder(&ann)
                    })
                    .await
                    .context("the weights reader panicked")?
                    .with_context(cannot)?;
                    let dir = PathBuf::from(&a.folder);
                    self.actor
                        .call(move |t| t.adopt_folder(&dir, &files, version))
                        .await??;
                }
            }
            Some(a) if a.version == local => {}
            _ => {
                let step = self.actor.call(|t| t.step()).await?;
                let weights = self.snapshot(local).await?;
                self.publisher.clone().publish(local, step, weights).await?;
            }
        }
        // Batches kept for steps whose versions are announced are done.
        let step = self.actor.call(|t| t.step()).await?;
        self.publisher.pending.remove_through(step).await?;
        Ok(())
    }

    /// The trainer's weights of `version` as the transport publishes them:
    /// bytes for the object store, or a complete folder under the shared
    /// root.
    async fn snapshot(&self, version: i32) -> anyhow::Result<Weights> {
        match &self.publisher.shared_root {
            None => Ok(Weights::Bytes(Bytes::from(
                self.actor.call(|t| t.weights_bytes()).await??,
            ))),
            Some(root) => {
                let dest = root.join(asyncrl_protos::subjects::weights_folder_name(version));
                let to = dest.clone();
                self.actor
                    .call(move |t| t.export_folder(&to))
                    .await?
                    .with_context(|| {
                        format!("cannot export version {version} to {}", dest.display())
                    })?;
                Ok(Weights::Folder(dest))
            }
        }
    }

    async fn write_status(&self, train_s: f64, wait_s: f64) {
        let step = self.actor.call(|t| t.step()).await.unwrap_or(0);
        write_status(self.kv.as_ref(), &self.status(step, train_s, wait_s)).await;
    }

    fn status(&self, step: u64, train_s: f64, wait_s: f64) -> LearnerStatus {
        LearnerStatus {
            session_id: self.session.clone(),
            started_at_unix_ms: self.started_at,
            start_version: self.start_version,
            step,
            step_train_seconds: train_s,
            step_wait_seconds: wait_s,
        }
    }

    /// Writes a checkpoint and prunes old ones. A write that fails is
    /// logged and counted and the learner trains on (see the module docs);
    /// only a torch engine that died fails the role.
    async fn checkpoint(&self) -> anyhow::Result<()> {
        let dir = self.ckpt_dir.clone();
        let keep = self.config.learner.keep_checkpoints;
        let (step, written, pruned) = self
            .actor
            .call(move |t| {
                let written = t.write_checkpoint(&dir);
                let pruned = written.is_ok().then(|| checkpoint::prune(&dir, keep));
                (t.step(), written, pruned)
            })
            .await?;
        let path = match written {
            Ok(path) => path,
            Err(e) if engine_died(&e) => return Err(e.into()),
            Err(e) => {
                let reason = checkpoint::failure_reason(&e);
                self.metrics
                    .checkpoint_failures
                    .get_or_create(&crate::metrics::ReasonLabel { reason })
                    .inc();
                tracing::error!(
                    step,
                    reason,
                    resume_step = self.metrics.checkpoint_last_step.get(),
                    checkpoint_dir = %self.ckpt_dir.display(),
                    error = %format!("{e:#}"),
                    "cannot write the checkpoint; training goes on, the last good checkpoint stays the resume point and the next checkpoint tries again"
                );
                return Ok(());
            }
        };
        self.metrics.checkpoints.inc();
        self.metrics
            .checkpoint_last_step
            .set(i64::try_from(step).unwrap_or(i64::MAX));
        tracing::info!(checkpoint = %path.display(), "checkpoint written");
        if let Some(Err(e)) = pruned {
            tracing::warn!(error = %e, "cannot remove old checkpoints");
        }
        Ok(())
    }

    async fn train_loop(&mut self) -> anyhow::Result<LearnerSummary> {
        let csv_path = self.config.run.output_dir.join(METRICS_CSV);
        let mut csv = CsvLog::<MetricsRow>::open(csv_path.clone())?;
        let mut trained_log = TrainedLog::open(self.config.run.output_dir.join(TRAINED_JSONL))?;
        let mut summary = LearnerSummary {
            metrics_csv: csv_path,
            checkpoint_dir: self.ckpt_dir.clone(),
            ..Default::default()
        };
        let max_steps = self.config.run.max_steps;
        let run_start = Instant::now();
        // The weights the run starts from (the warm start, or a resumed
        // checkpoint's) are evaluated first, so every curve has its origin.
        let (step0, version0) = self.actor.call(|t| (t.step(), t.version())).await?;
        if let Some(ev) = self.evaluator.as_mut()
            && ev.wants(version0, step0, true)
        {
            let bytes = Bytes::from(self.actor.call(|t| t.weights_bytes()).await??);
            ev.submit(version0, step0, 0.0, bytes);
        }
        // The next step's batch, asked for while this one trains.
        let mut prefetch: Option<(u64, AbortOnDrop<anyhow::Result<Option<Prepared>>>)> = None;
        // The weights of the last step trained, uploading while the next
        // one trains (one upload at a time: versions are announced in order).
        let mut upload: Option<Upload> = None;
        loop {
            let (step, version) = self.actor.call(|t| (t.step(), t.version())).await?;
            summary.steps = step;
            summary.version = version;
            if self.shutdown.is_cancelled() || (max_steps > 0 && step >= max_steps) {
                break;
            }
            let s = step + 1;
            let wait_start = Instant::now();
            let prepared = match prefetch.take() {
                Some((n, task)) if n == s => task.join("batch prefetch").await??,
                _ => self.fetcher.clone().prepare(s, version, step).await?,
            };
            let Some(Prepared { knobs: k, batches }) = prepared else {
                break;
            };
            let wait_s = wait_start.elapsed().as_secs_f64();
            if k.checkpoint {
                self.checkpoint().await?;
            }
            // Step s's batch is in the pending folder, so the buffer may
            // take the request for s + 1 as "s is trained".
            if max_steps == 0 || s < max_steps {
                let task = tokio::spawn(self.fetcher.clone().prepare(s + 1, version + 1, step));
                prefetch = Some((s + 1, AbortOnDrop(task)));
            }
            let (trajectories, min_token_version) = trained_ids(&batches);
            let tasks = trained_tasks(&batches);
            let groups = crate::batch::row_group_ids(&batches).unwrap_or_default();
            let step_knobs = step_settings(&self.config, &k);
            let stats = match self
                .actor
                .call(move |t| t.train_step(&batches, &step_knobs))
                .await?
            {
                Ok(stats) => stats,
                Err(
                    e @ (TrainError::Batch(_)
                    | TrainError::NonFiniteLoss(_)
                    | TrainError::NonFiniteGradient { .. }
                    | TrainError::Engine(EngineError::Refused {
                        call: "TrainStep", ..
                    })),
                ) => {
                    // Trained on none of it (the trainer refused a row that
                    // passed the check, or the loss or gradient is not
                    // finite): every group of the batch is refused, so the
                    // buffer quarantines them and serves the step anew.
                    let field = match &e {
                        TrainError::Batch(b) => b.field(),
                        TrainError::NonFiniteLoss(_) => "loss",
                        TrainError::NonFiniteGradient { .. } => "gradient",
                        _ => "engine",
                    };
                    self.metrics.bad_batch(field);
                    tracing::error!(step = s, field, error = %e, groups = groups.len(), "the step cannot be trained on this batch; its groups are quarantined and the step is asked for again");
                    let mut unique = groups;
                    unique.sort();
                    unique.dedup();
                    self.fetcher
                        .refuse(s, unique.into_iter().map(|g| (g, e.to_string())).collect());
                    prefetch = None;
                    self.fetcher.pending.remove_through(s).await?;
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            self.metrics.phase("wait", wait_s);
            // Recorded before the weights are published: a crash in between
            // retrains the same step (from its kept batch) and the log then
            // holds the step twice; readers keep the last entry.
            trained_log.append(&TrainedStep {
                max_version_lag: stats.objective.max_version_lag,
                min_token_version,
                published_version: stats.version,
                step: stats.step,
                tasks,
                trained_at_version: version,
                trajectories,
            })?;
            self.metrics.phase("compute", stats.compute_seconds);
            self.metrics.observe_step(&stats);

            // The trainer's snapshot of the weights; the upload runs while
            // the next step trains, after the previous one is announced.
            let snapshot_start = Instant::now();
            let weights = self.snapshot(stats.version).await?;
            let snapshot_s = snapshot_start.elapsed().as_secs_f64();
            if let Some(previous) = upload.take() {
                self.announced(previous, &mut csv, run_start).await?;
            }
            let publisher = self.publisher.clone();
            let (version_s, step_s, uploading) = (stats.version, stats.step, weights.clone());
            let task = tokio::spawn(async move {
                let publish_s = publisher.publish(version_s, step_s, uploading).await?;
                Ok(Announced {
                    at: Instant::now(),
                    publish_s,
                })
            });
            upload = Some(Upload {
                task: AbortOnDrop(task),
                stats: stats.clone(),
                wait_s,
                weights,
                last: max_steps > 0 && stats.step >= max_steps,
            });
            write_status(
                self.kv.as_ref(),
                &self.status(stats.step, stats.compute_seconds + snapshot_s, wait_s),
            )
            .await;
            tracing::info!(
                step = stats.step,
                version = stats.version,
                reward = stats.reward_mean,
                loss = stats.loss,
                tokens = stats.tokens,
                lag_mean = stats.objective.mean_version_lag,
                wait_s,
                compute_s = stats.compute_seconds,
                snapshot_s,
                "step"
            );
            if stats.step % self.config.learner.checkpoint_every == 0 {
                self.checkpoint().await?;
            }
            if let Some(tx) = &self.progress {
                let _ = tx.send(LearnerEvent::Step(Box::new(stats.clone())));
            }
            summary.last = Some(stats);
        }
        // A batch asked for ahead and not trained stays with the buffer
        // (served for its step: a restart gets the same groups).
        drop(prefetch);
        // The last version is announced before the run ends.
        if let Some(last) = upload.take() {
            self.announced(last, &mut csv, run_start).await?;
        }
        // The last step trained in this run, unless `checkpoint_every`
        // already saved it.
        let unsaved_last = summary
            .last
            .as_ref()
            .is_some_and(|s| s.step % self.config.learner.checkpoint_every != 0);
        if self.shutdown.is_cancelled() || unsaved_last {
            // SIGTERM or the end of the run: leave a checkpoint of exactly
            // where we are (the model the run produced).
            self.checkpoint().await?;
        }
        let (step, version) = self.actor.call(|t| (t.step(), t.version())).await?;
        summary.steps = step;
        summary.version = version;
        if let Some(ev) = self.evaluator.take() {
            // The end of the run is evaluated unless it already was (a
            // step count that is not a multiple of `every_steps` ends after
            // the loop's last step); a shutdown does not wait for one more.
            let mut ev = ev;
            if !self.shutdown.is_cancelled() && ev.wants(version, step, true) {
                let bytes = Bytes::from(self.actor.call(|t| t.weights_bytes()).await??);
                ev.submit(version, step, run_start.elapsed().as_secs_f64(), bytes);
            }
            summary.eval_csv = Some(ev.finish().await?);
        }
        Ok(summary)
    }

    /// Waits for an upload to be announced (its error fails the role) and
    /// writes what follows from it: the metrics row of its step (its
    /// `wall_seconds` is when the version was announced) and the
    /// evaluation of its version.
    async fn announced(
        &mut self,
        up: Upload,
        csv: &mut CsvLog<MetricsRow>,
        run_start: Instant,
    ) -> anyhow::Result<()> {
        let done = up.task.join("weight upload").await??;
        let wall = done.at.duration_since(run_start).as_secs_f64();
        self.metrics.phase("publish", done.publish_s);
        let (stats, version) = (&up.stats, up.stats.version);
        if let Some(ev) = self.evaluator.as_mut()
            && ev.wants(version, stats.step, up.last)
        {
            match up.weights.bytes().await {
                Ok(bytes) => ev.submit(version, stats.step, wall, bytes),
                Err(e) => {
                    tracing::warn!(version, error = %format!("{e:#}"), "cannot evaluate this version");
                }
            }
        }
        csv.append(&metrics_row(stats, wall, up.wait_s, done.publish_s))
    }
}

/// A batch in hand for a step: its sealed knobs and its checked record
/// batches, also stored in the pending folder.
struct Prepared {
    knobs: asyncrl_control::StepKnobs,
    batches: Vec<RecordBatch>,
}

/// Seals steps and gets their batches; cheap to clone, so the batch of the
/// next step can be fetched on its own task while the current one trains.
#[derive(Clone)]
struct Fetcher {
    config: Arc<Config>,
    bus: Arc<dyn Bus>,
    kv: Arc<dyn KvBucket>,
    metrics: LearnerMetrics,
    shutdown: CancellationToken,
    /// The model's limits (`max_version` is set per request).
    limits: crate::batch::BatchLimits,
    pending: PendingBatches,
    /// Per step, the groups of its last batch the learner will not train
    /// on: sent with the step's next request until the buffer has taken
    /// them (it quarantines them and serves the step anew).
    refused: Arc<std::sync::Mutex<BTreeMap<u64, Vec<RefusedGroup>>>>,
}

impl Fetcher {
    /// Seals step `s` and gets its batch for the trainer at `version`
    /// (`s − 1`): the copy in the pending folder if an earlier run of this
    /// learner fetched it, else the buffer's, which is stored there before
    /// this returns (so a request for `s + 1` may go out). None on shutdown.
    /// `trained_through`: the last step the trainer has trained (`s − 1`,
    /// or `s − 2` for a prefetch).
    async fn prepare(
        self,
        s: u64,
        version: i32,
        trained_through: u64,
    ) -> anyhow::Result<Option<Prepared>> {
        let Some(knobs) = self.seal(s).await? else {
            return Ok(None);
        };
        if let Some(bytes) = self.pending.load(s).await? {
            match self.check(bytes, version).await? {
                Checked::Good(batches) => {
                    tracing::info!(step = s, "training a batch fetched before the restart");
                    return Ok(Some(Prepared { knobs, batches }));
                }
                Checked::Refuse { error, groups } => {
                    // A restarted learner never trains a batch it refused.
                    self.refuse_batch(s, &error);
                    self.refuse(s, groups);
                    self.pending.remove_through(s).await?;
                }
                Checked::Bad(e) => {
                    // Never stored unchecked; a copy damaged on disk is
                    // asked of the buffer again.
                    tracing::warn!(step = s, error = %e, "the kept batch of this step is unusable; asking the buffer");
                }
            }
        }
        let Some(batches) = self
            .fetch_batch(s, version, knobs.eta, trained_through)
            .await?
        else {
            return Ok(None);
        };
        Ok(Some(Prepared { knobs, batches }))
    }

    /// Groups of step `s`'s batch the learner will not train on (group id,
    /// reason): the step's next request hands them to the buffer.
    fn refuse(&self, s: u64, groups: Vec<(String, String)>) {
        if groups.is_empty() {
            return;
        }
        let mut refused = self
            .refused
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let list = refused.entry(s).or_default();
        for (group_id, reason) in groups {
            if !list.iter().any(|g| g.group_id == group_id) {
                list.push(RefusedGroup { group_id, reason });
            }
        }
    }

    /// The refused groups to send with step `s`'s request.
    fn refused_for(&self, s: u64) -> Vec<RefusedGroup> {
        self.refused
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&s)
            .cloned()
            .unwrap_or_default()
    }

    /// The buffer has taken step `s`'s refusals (and those of earlier steps).
    fn refusals_taken(&self, s: u64) {
        let mut refused = self
            .refused
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *refused = refused.split_off(&(s + 1));
    }

    /// Decodes IPC bytes and checks them as the trainer at `version` will
    /// (off the runtime).
    async fn check(&self, bytes: Bytes, version: i32) -> anyhow::Result<Checked> {
        let limits = crate::batch::BatchLimits {
            max_version: version,
            ..self.limits
        };
        tokio::task::spawn_blocking(move || {
            let batches = match crate::batch::decode_ipc(&bytes) {
                Ok(b) => b,
                Err(e) => return Checked::Bad(e),
            };
            let rows = match crate::batch::check_rows(&batches, &limits) {
                Ok(rows) => rows,
                Err(e) => return Checked::Bad(e),
            };
            let Some(first) = rows.first() else {
                return Checked::Good(batches);
            };
            match crate::batch::refused_groups(&batches, &rows) {
                Ok(groups) if !groups.is_empty() => Checked::Refuse {
                    error: crate::batch::BatchError::Row {
                        row: match first {
                            BatchError::Row { row, .. } => *row,
                            _ => 0,
                        },
                        field: first.field(),
                        reason: format!("{first} (and {} more rows)", rows.len() - 1),
                    },
                    groups,
                },
                Ok(_) => Checked::Bad(rows.into_iter().next().unwrap_or(BatchError::Empty)),
                Err(e) => Checked::Bad(e),
            }
        })
        .await
        .context("the batch decoder task failed")
    }

    /// Seals step `s`, waiting for the coordinator to create the knob
    /// schedule if it has not yet.
    async fn seal(&self, s: u64) -> anyhow::Result<Option<asyncrl_control::StepKnobs>> {
        let mut logged = false;
        loop {
            match seal_step(self.kv.as_ref(), s).await {
                Ok(k) => return Ok(Some(k)),
                Err(KnobError::NoSchedule | KnobError::Transport(_) | KnobError::Store { .. }) => {
                    if !logged {
                        tracing::info!(step = s, "waiting for the coordinator's knob schedule");
                        logged = true;
                    }
                }
                Err(e) => return Err(e.into()),
            }
            tokio::select! {
                () = self.shutdown.cancelled() => return Ok(None),
                () = tokio::time::sleep(Duration::from_millis(200)) => {}
            }
        }
    }

    /// Asks the buffer for step `s` until it has the groups.
    async fn fetch_batch(
        &self,
        s: u64,
        version: i32,
        eta: u32,
        trained_through: u64,
    ) -> anyhow::Result<Option<Vec<RecordBatch>>> {
        let b = self.config.staleness.groups_per_step;
        let poll = self.config.learner.batch_poll_interval;
        let wait_ms: u32 = 1000;
        // A refusal names a state of the buffer that asking again does not
        // change (a step it already served and released, a step behind what
        // it trained): retried for a while in case the buffer is still
        // recovering, then an error instead of a silent hang.
        let mut refused_since: Option<(Instant, String)> = None;
        loop {
            if self.shutdown.is_cancelled() {
                return Ok(None);
            }
            let req = BatchRequest {
                learner_version: version,
                num_groups: b,
                eta,
                zstd: false,
                step: s,
                wait_ms,
                refused: self.refused_for(s),
                trained_through: Some(trained_through),
            };
            let sent_refusals = !req.refused.is_empty();
            let timeout =
                Duration::from_millis(u64::from(wait_ms)) + self.config.bus.request_timeout;
            let reply = tokio::select! {
                () = self.shutdown.cancelled() => return Ok(None),
                r = self.bus.request(subjects::BUFFER_BATCH, Bytes::from(req.encode_to_vec()), timeout) => r,
            };
            match reply {
                Ok(bytes) => {
                    let reply = match BatchReply::decode(bytes.as_ref()) {
                        Ok(r) => r,
                        Err(e) => {
                            // Asked again: a garbled reply is no state of the buffer.
                            self.metrics.bad_batch("batch_reply");
                            tracing::warn!(step = s, error = %e, "the buffer's batch reply does not decode as asyncrl.v1.BatchReply; asking again");
                            BatchReply::default()
                        }
                    };
                    if reply.error.is_empty() && sent_refusals {
                        self.refusals_taken(s);
                    }
                    if !reply.error.is_empty() {
                        match &refused_since {
                            Some((since, reason)) if *reason == reply.error => {
                                if since.elapsed() >= REFUSAL_PATIENCE {
                                    anyhow::bail!(
                                        "buffer: the buffer refuses step {s} (for {}s): {}",
                                        REFUSAL_PATIENCE.as_secs(),
                                        reply.error
                                    );
                                }
                            }
                            _ => {
                                tracing::warn!(step = s, error = %reply.error, "buffer refused the batch; retrying");
                                refused_since = Some((Instant::now(), reply.error.clone()));
                            }
                        }
                    } else if reply.num_groups > 0 {
                        let bytes = self.reply_bytes(&reply).await?;
                        match self.check(bytes.clone(), version).await? {
                            Checked::Good(batches) => {
                                // Durable before the next step is asked for.
                                self.pending.save(s, bytes).await?;
                                return Ok(Some(batches));
                            }
                            Checked::Refuse { error, groups } => {
                                // Asked again at once, with the groups to
                                // quarantine.
                                self.refuse_batch(s, &error);
                                self.refuse(s, groups);
                                continue;
                            }
                            Checked::Bad(e) => self.refuse_batch(s, &e),
                        }
                    }
                }
                Err(e) if e.is_transient() => {
                    tracing::debug!(step = s, error = %e, "buffer not answering yet")
                }
                Err(e) => return Err(e.into()),
            }
            tokio::select! {
                () = self.shutdown.cancelled() => return Ok(None),
                () = tokio::time::sleep(poll) => {}
            }
        }
    }

    /// The reply's Arrow IPC bytes (inline or from the object store).
    async fn reply_bytes(&self, reply: &BatchReply) -> anyhow::Result<Bytes> {
        if reply.object_name.is_empty() {
            return Ok(reply.arrow_ipc.clone());
        }
        Ok(self
            .bus
            .object_store(&reply.object_bucket)
            .await?
            .get(&reply.object_name)
            .await?)
    }

    /// A batch the learner will not train on: counted by its field, logged,
    /// and asked for again.
    fn refuse_batch(&self, step: u64, e: &BatchError) {
        self.metrics.bad_batch(e.field());
        tracing::warn!(step, field = e.field(), error = %e, "refusing a bad batch from the buffer; asking again");
    }
}

/// A batch, checked.
enum Checked {
    Good(Vec<RecordBatch>),
    /// Rows the learner will not train on: their groups (id, reason) are
    /// refused, for the buffer to quarantine; `error` sums them up.
    Refuse {
        error: BatchError,
        groups: Vec<(String, String)>,
    },
    /// A problem of the batch as a whole (it does not decode, a column is
    /// missing): asked for again as it is.
    Bad(BatchError),
}

/// How long a weight upload retries transient errors once the learner is
/// stopping (well inside the learner pod's 300 s grace period).
const PUBLISH_RETRY_STOPPING: Duration = Duration::from_secs(30);

/// Uploads the weights of a version and then announces it; cheap to clone,
/// so an upload runs on its own task while the next step trains.
#[derive(Clone)]
struct Publisher {
    weights: Arc<dyn ObjectStore>,
    /// `learner.shared_weights_dir` under the `shared_path` transport.
    shared_root: Option<PathBuf>,
    kv: Arc<dyn KvBucket>,
    metrics: LearnerMetrics,
    /// `learner.keep_weight_versions`.
    keep: usize,
    shutdown: CancellationToken,
    pending: PendingBatches,
    /// This learner's session and lease epoch, carried by every
    /// announcement.
    fence: asyncrl_control::weights::Fence,
}

impl Publisher {
    /// Stores `bytes` as the object of `version` and announces it (after
    /// the put: the announcement carries the sha256 the store computed),
    /// retrying transient errors; then deletes old versions and the kept
    /// batches of the steps now announced. Returns the seconds it took.
    async fn publish(self, version: i32, step: u64, weights: Weights) -> anyhow::Result<f64> {
        let started = Instant::now();
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        // When a shutdown began while this version was in hand.
        let mut stopping_since: Option<Instant> = None;
        loop {
            let outcome = match &weights {
                Weights::Bytes(bytes) => asyncrl_control::weights::publish(
                    self.weights.as_ref(),
                    self.kv.as_ref(),
                    version,
                    step,
                    bytes.clone(),
                    &self.fence,
                )
                .await
                .map(drop),
                Weights::Folder(dir) => {
                    match asyncrl_control::weights::publish_folder(
                        self.kv.as_ref(),
                        version,
                        step,
                        dir,
                        &self.fence,
                    )
                    .await
                    {
                        Ok(_) => Ok(()),
                        Err(asyncrl_control::weights::PublishFolderError::Announce(e)) => Err(e),
                        Err(e) => {
                            return Err(anyhow::Error::new(e).context(format!(
                                "cannot publish the weights of version {version}"
                            )));
                        }
                    }
                }
            };
            // After a SIGTERM the version in hand is still published (a
            // NATS node that restarts takes seconds, and the run's last
            // version should not be left unannounced), for a bounded time.
            let may_retry = !self.shutdown.is_cancelled()
                || stopping_since.get_or_insert_with(Instant::now).elapsed()
                    < PUBLISH_RETRY_STOPPING;
            match outcome {
                Ok(()) => break,
                Err(e) if e.is_transient() && may_retry => {
                    self.metrics.weight_publish_failures.inc();
                    tracing::warn!(version, error = %e, "publishing weights failed; retrying");
                    tokio::time::sleep(backoff.next_delay()).await;
                }
                Err(e) => {
                    return Err(anyhow::Error::new(e)
                        .context(format!("cannot publish the weights of version {version}")));
                }
            }
        }
        self.metrics.weight_publications.inc();
        self.metrics.version.set(i64::from(version));
        let upload_s = started.elapsed().as_secs_f64();
        tracing::info!(version, step, weights = %weights, upload_s, "weights published");
        // Keep the newest versions; older ones can no longer be asked for.
        let pruned = match (&weights, &self.shared_root) {
            (Weights::Folder(_), Some(root)) => {
                let (root, keep) = (root.clone(), self.keep);
                tokio::task::spawn_blocking(move || {
                    asyncrl_control::weights::prune_folders(&root, version, keep)
                })
                .await
                .map_err(|e| anyhow::anyhow!("the folder pruner panicked: {e}"))
                .and_then(|r| r.map(drop).map_err(anyhow::Error::new))
            }
            _ => asyncrl_control::weights::prune(self.weights.as_ref(), version, self.keep)
                .await
                .map(drop)
                .map_err(anyhow::Error::new),
        };
        if let Err(e) = pruned {
            tracing::warn!(version, error = %format!("{e:#}"), "cannot delete the weights of old versions");
        }
        self.pending.remove_through(step).await?;
        Ok(started.elapsed().as_secs_f64())
    }
}

/// A version's weights as its transport carries them.
#[derive(Clone)]
enum Weights {
    /// Safetensors bytes for the object store.
    Bytes(Bytes),
    /// A complete Hugging Face folder under the shared root.
    Folder(PathBuf),
}

impl std::fmt::Display for Weights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Weights::Bytes(b) => write!(f, "{} bytes", b.len()),
            Weights::Folder(dir) => write!(f, "folder {}", dir.display()),
        }
    }
}

impl Weights {
    /// The weights as one safetensors file (what `[eval]`'s built-in model
    /// loads): a folder's `model.safetensors`.
    async fn bytes(&self) -> anyhow::Result<Bytes> {
        match self {
            Weights::Bytes(b) => Ok(b.clone()),
            Weights::Folder(dir) => {
                let file = dir.join("model.safetensors");
                tokio::fs::read(&file)
                    .await
                    .map(Bytes::from)
                    .with_context(|| format!("cannot read {}", file.display()))
            }
        }
    }
}

/// A step whose weights are uploading: what is written about it once its
/// version is announced.
struct Upload {
    task: AbortOnDrop<anyhow::Result<Announced>>,
    stats: StepStats,
    wait_s: f64,
    weights: Weights,
    last: bool,
}

/// When an upload's version was announced and how long the upload took.
struct Announced {
    at: Instant,
    publish_s: f64,
}

/// A task that is cancelled when its handle is dropped (an error return of
/// the role leaves nothing running behind it).
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl<T> AbortOnDrop<T> {
    async fn join(mut self, what: &str) -> anyhow::Result<T> {
        (&mut self.0)
            .await
            .with_context(|| format!("the {what} task failed"))
    }
}

async fn write_status(kv: &dyn KvBucket, status: &LearnerStatus) {
    if let Err(e) = kv
        .put(LEARNER_STATUS_KEY, Bytes::from(status.encode_to_vec()))
        .await
    {
        tracing::warn!(error = %e, "cannot write learner.status");
    }
}

/// The trajectory ids and oldest token version of each record batch set.
/// The tasks of a batch's groups, each once, sorted (`trained.jsonl`'s
/// `tasks`: what the loss invariant of a run reads).
fn trained_tasks(batches: &[RecordBatch]) -> Vec<String> {
    use arrow::array::AsArray;
    let mut tasks: Vec<String> = batches
        .iter()
        .filter_map(|b| {
            b.column_by_name(asyncrl_protos::arrow_schema::TASK_ID)
                .and_then(|c| c.as_string_opt::<i32>())
        })
        .flat_map(|col| col.iter().flatten().map(str::to_owned).collect::<Vec<_>>())
        .collect();
    tasks.sort_unstable();
    tasks.dedup();
    tasks
}

fn trained_ids(batches: &[RecordBatch]) -> (Vec<String>, i32) {
    use arrow::array::AsArray;
    let mut ids = Vec::new();
    let mut min_version = i32::MAX;
    for b in batches {
        if let Some(col) = b
            .column_by_name(asyncrl_protos::arrow_schema::UUID)
            .and_then(|c| c.as_string_opt::<i32>())
        {
            ids.extend(col.iter().flatten().map(str::to_owned));
        }
        if let Some(list) = b
            .column_by_name(asyncrl_protos::arrow_schema::POLICY_VERSIONS)
            .and_then(|c| c.as_list_opt::<i32>())
            && let Some(v) = list
                .values()
                .as_primitive_opt::<arrow::datatypes::Int32Type>()
        {
            min_version = v.values().iter().copied().fold(min_version, i32::min);
        }
    }
    (
        ids,
        if min_version == i32::MAX {
            -1
        } else {
            min_version
        },
    )
}

/// How long the buffer may keep refusing a step (with the same reason)
/// before the learner gives up with an error.
const REFUSAL_PATIENCE: Duration = Duration::from_secs(30);

/// The `learner_metrics.csv` row of a step whose version was announced
/// `wall` seconds into the run, after waiting `wait` seconds for its batch
/// and `publish` seconds for the upload.
fn metrics_row(s: &StepStats, wall: f64, wait: f64, publish: f64) -> MetricsRow {
    let o = &s.objective;
    MetricsRow {
        step: s.step,
        version: s.version,
        wall_seconds: wall,
        reward_mean: s.reward_mean,
        reward_failed: s.reward_failed as u64,
        loss: s.loss,
        clip_low: o.clip_low_fraction,
        clip_high: o.clip_high_fraction,
        weight_masked: o.weight_masked_fraction,
        m2po_masked: o.m2po_masked_fraction,
        approx_kl: o.approx_kl,
        entropy: s.entropy,
        grad_norm: s.grad_norm,
        learning_rate: s.learning_rate,
        tokens: s.tokens,
        groups: s.groups as u64,
        version_lag_mean: o.mean_version_lag,
        version_lag_max: o.max_version_lag,
        wait_seconds: wait,
        compute_seconds: s.compute_seconds,
        publish_seconds: publish,
        padded_tokens: s.padded_tokens,
        logprob_gap_tokens: s.logprob_gap.tokens,
        logprob_gap_mean: s.logprob_gap.mean_abs,
        logprob_gap_max: s.logprob_gap.max_abs,
        logprob_kl: s.logprob_gap.kl,
    }
}
