//! `asyncrl train`: every role in one process (the in-process bus by
//! default, or one NATS server with `--bus`), a progress line per step, and
//! at the end a summary with the paths of the outputs and reward curves.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use asyncrl_config::{BusKind, Config};
use asyncrl_learner::outputs::{EvalRow, read_eval, read_metrics};
use asyncrl_learner::service::LearnerEvent;
use asyncrl_rollout_worker::{CompletionLengths, Worker};
use asyncrl_transport::Bus;
use indicatif::{ProgressBar, ProgressStyle};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::check::check_tasks;
use crate::plot::{Series, line_chart, smooth};
use crate::roles;

#[derive(Debug, Clone, Default)]
pub struct TrainOptions {
    /// Rollout workers to run in the process.
    pub workers: usize,
    /// Draw a progress bar (off when stderr is not a terminal or in tests).
    pub progress: bool,
    /// How the workers decide completion lengths (benchmarks set
    /// [`CompletionLengths::ReferenceAnswer`]; runs leave it to the model).
    pub completion_lengths: CompletionLengths,
    /// Replace what a previous in-process run left in `run.output_dir`.
    pub fresh: bool,
}

/// What a run produced.
#[derive(Debug, Clone)]
pub struct TrainSummary {
    pub steps: u64,
    pub version: i32,
    pub seconds: f64,
    pub reward_first: f64,
    pub reward_last: f64,
    pub metrics_csv: PathBuf,
    pub checkpoints: PathBuf,
    pub curves: Vec<PathBuf>,
    pub telemetry: Option<std::net::SocketAddr>,
    /// `eval.csv` and its first and last rows, when `[eval]` is on.
    pub eval: Option<EvalSummary>,
    /// With dynamic sampling on (`buffer.min_reward_spread > 0`): the
    /// groups the buffer dropped for no signal, of those completed.
    pub no_signal: Option<NoSignalSummary>,
}

/// What dynamic sampling dropped in a run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NoSignalSummary {
    pub dropped: u64,
    pub completed: u64,
}

impl NoSignalSummary {
    fn of(m: &asyncrl_buffer::BufferMetrics) -> Self {
        Self {
            dropped: m.no_signal_dropped(),
            completed: m.groups_completed.get(),
        }
    }

    /// Dropped per completed group (0 before any completed).
    pub fn fraction(&self) -> f64 {
        if self.completed == 0 {
            0.0
        } else {
            (self.dropped as f64 / self.completed as f64).min(1.0)
        }
    }
}

/// The held-out evaluation of a run: where it started and ended.
#[derive(Debug, Clone)]
pub struct EvalSummary {
    pub csv: PathBuf,
    pub first: EvalRow,
    pub last: EvalRow,
    pub rows: usize,
}

impl std::fmt::Display for TrainSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "trained {} steps (policy version {}) in {:.1}s",
            self.steps, self.version, self.seconds
        )?;
        writeln!(
            f,
            "mean reward of the training batches: {:.3} (first 5 steps) -> {:.3} (last 5 steps)",
            self.reward_first, self.reward_last
        )?;
        if let Some(n) = &self.no_signal {
            writeln!(
                f,
                "dynamic sampling: {} of {} complete groups dropped for no reward signal ({:.1}%)",
                n.dropped,
                n.completed,
                100.0 * n.fraction()
            )?;
        }
        if let Some(e) = &self.eval {
            writeln!(
                f,
                "held-out evaluation ({} problems, {} versions): {} (v{}) -> {} (v{})",
                e.last.scores.problems,
                e.rows,
                eval_scores_text(&e.first),
                e.first.version,
                eval_scores_text(&e.last),
                e.last.version
            )?;
            writeln!(f, "evaluation:  {}", e.csv.display())?;
        }
        writeln!(f, "metrics:     {}", self.metrics_csv.display())?;
        if let Some(addr) = self.telemetry {
            writeln!(
                f,
                "prometheus:  http://{addr}/metrics (served while the run was up)"
            )?;
        }
        writeln!(f, "checkpoints: {}", self.checkpoints.display())?;
        for c in &self.curves {
            writeln!(f, "curve:       {}", c.display())?;
        }
        Ok(())
    }
}

type RoleResult = (&'static str, anyhow::Result<()>);

/// Runs every role until the learner reaches `run.max_steps` (or Ctrl-C).
pub async fn train(config: Config, opts: TrainOptions) -> anyhow::Result<TrainSummary> {
    clear_or_refuse_previous_run(&config, opts.fresh)?;
    std::fs::create_dir_all(&config.run.output_dir).with_context(|| {
        format!(
            "cannot create run.output_dir {}",
            config.run.output_dir.display()
        )
    })?;
    // A data set that cannot be read stops the run before any role starts:
    // one error line, not the other roles' retries around the coordinator's.
    let check = config.clone();
    tokio::task::spawn_blocking(move || check_tasks(&check))
        .await
        .context("reading the data sets failed")??;
    let process = roles::start(&config, "train").await?;
    // One connection for every role: the base [bus] credentials, not the
    // per-role [bus.roles.*] tables.
    let bus = roles::connect(&config, &process.metrics, roles::BusUser::AllRoles).await?;
    // Workers stop first (they drain: publish what they finished, return the
    // rest to the coordinator), then the coordinator and the buffer.
    let workers_stop = CancellationToken::new();
    let roles_stop = CancellationToken::new();
    let mut tasks: JoinSet<RoleResult> = JoinSet::new();
    let mut workers: JoinSet<RoleResult> = JoinSet::new();
    let coordinator_up = spawn_roles(
        &mut tasks,
        &config,
        &bus,
        &process.metrics,
        &process.health,
        &roles_stop,
    );
    // Workers start once the coordinator serves: they would otherwise
    // retry (and warn about) their registration while it loads the data.
    if coordinator_up.await.is_err() {
        // The coordinator failed to start; its task holds the error.
        roles_stop.cancel();
        while let Some(done) = tasks.join_next().await {
            if let (role @ "coordinator", Err(e)) = done.context("a role task failed")? {
                return Err(e.context(format!("{role} stopped")));
            }
        }
        anyhow::bail!("the coordinator stopped before it started serving");
    }
    spawn_workers(
        &mut workers,
        &config,
        &bus,
        &process.metrics,
        &workers_stop,
        opts.workers.max(1),
        opts.completion_lengths,
    );

    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<LearnerEvent>();
    let learner_stop = process.shutdown.clone();
    let learner = {
        let (config, bus, metrics) = (config.clone(), bus.clone(), process.metrics.clone());
        tokio::spawn(async move {
            asyncrl_learner::service::run_with_progress(
                config,
                bus,
                metrics,
                learner_stop,
                Some(tx),
            )
            .await
        })
    };
    let bar = progress_bar(&config, opts.progress);
    // The buffer's metrics (one registry per process): the progress line
    // and the summary show what dynamic sampling drops.
    let buffer_metrics = if config.buffer.dynamic_sampling() {
        Some(
            asyncrl_buffer::BufferMetrics::register(&process.metrics)
                .context("reading the buffer's metrics")?,
        )
    } else {
        None
    };
    let start = Instant::now();
    let mut learner = learner;
    let mut last_eval = String::new();
    let outcome = loop {
        tokio::select! {
            Some(event) = rx.recv() => match event {
                LearnerEvent::Step(stats) => {
                    bar.set_position(stats.step);
                    let no_signal = buffer_metrics
                        .as_ref()
                        .map(|m| format!(" no-signal {:.1}%", 100.0 * NoSignalSummary::of(m).fraction()))
                        .unwrap_or_default();
                    bar.set_message(format!(
                        "v{} reward {:.3} lag {:.2} ({} max) {:.0} tok/s{no_signal}{last_eval}",
                        stats.version,
                        stats.reward_mean,
                        stats.objective.mean_version_lag,
                        stats.objective.max_version_lag,
                        stats.tokens as f64 / (stats.compute_seconds.max(1e-9)),
                    ));
                }
                LearnerEvent::Eval(row) => {
                    last_eval = format!(" | eval v{}: {}", row.version, eval_scores_text(&row));
                    bar.println(format!(
                        "held-out evaluation of version {} (step {}): {}",
                        row.version, row.step, row.scores
                    ));
                }
            },
            r = &mut learner => break r.context("the learner task failed")?.context("learner"),
            Some(done) = tasks.join_next() => role_ended(done, &process.shutdown, &mut learner).await?,
            Some(done) = workers.join_next() => role_ended(done, &process.shutdown, &mut learner).await?,
        }
    };
    bar.finish_and_clear();
    // The learner is done: drain the workers (they return their unfinished
    // tasks), then stop the coordinator and the buffer.
    workers_stop.cancel();
    let grace = config.worker.drain_grace_period + Duration::from_secs(10);
    drain(&mut workers, grace).await;
    roles_stop.cancel();
    drain(&mut tasks, Duration::from_secs(30)).await;
    process.shutdown.cancel();
    let summary = outcome?;
    let seconds = start.elapsed().as_secs_f64();
    let mut curves = write_curves(&summary.metrics_csv, &config.run.output_dir)?;
    let eval = match &summary.eval_csv {
        Some(csv) => {
            let rows = read_eval(csv)?;
            if rows.len() >= 2 {
                let png = config.run.output_dir.join("eval_accuracy.png");
                plot_eval(&rows, &png)?;
                curves.push(png);
            }
            match (rows.first(), rows.last()) {
                (Some(first), Some(last)) => Some(EvalSummary {
                    csv: csv.clone(),
                    first: first.clone(),
                    last: last.clone(),
                    rows: rows.len(),
                }),
                _ => None,
            }
        }
        None => None,
    };
    let (first, last) = reward_ends(&summary.metrics_csv)?;
    Ok(TrainSummary {
        steps: summary.steps,
        version: summary.version,
        seconds,
        reward_first: first,
        reward_last: last,
        metrics_csv: summary.metrics_csv,
        checkpoints: summary.checkpoint_dir,
        curves,
        telemetry: process.telemetry_addr,
        eval,
        no_signal: buffer_metrics.as_ref().map(NoSignalSummary::of),
    })
}

/// The state a previous run left in `run.output_dir`: checkpoints, the
/// buffer's segments, the learner's and coordinator's logs (the paths that
/// exist and are not empty).
fn previous_run_state(config: &Config) -> Vec<PathBuf> {
    let out = &config.run.output_dir;
    let journal = asyncrl_coordinator::journal::path(config);
    [
        asyncrl_learner::service::checkpoint_dir(config),
        config.buffer.data_dir_in(out),
        out.join(asyncrl_learner::outputs::METRICS_CSV),
        out.join(asyncrl_learner::outputs::EVAL_CSV),
        out.join(asyncrl_learner::outputs::TRAINED_JSONL),
        journal,
    ]
    .into_iter()
    .filter(|p| match std::fs::metadata(p) {
        Ok(m) if m.is_dir() => std::fs::read_dir(p).is_ok_and(|mut d| d.next().is_some()),
        Ok(m) => m.len() > 0,
        Err(_) => false,
    })
    .collect()
}

/// Over the in-process bus the coordinator's state and the published
/// weights live in memory, so a run cannot resume what an earlier one left
/// on disk (its buffer would refuse the steps it already served): such a
/// directory is refused, or cleared with `fresh`. Over NATS the server
/// holds that state and a run resumes.
fn clear_or_refuse_previous_run(config: &Config, fresh: bool) -> anyhow::Result<()> {
    if config.bus.kind() != BusKind::Local {
        if fresh {
            anyhow::bail!(
                "--fresh clears a previous in-process run; over NATS (bus.url = {}) a run resumes from the server's state instead",
                config.bus.url
            );
        }
        return Ok(());
    }
    let previous = previous_run_state(config);
    if previous.is_empty() {
        return Ok(());
    }
    let names = previous
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ");
    if !fresh {
        anyhow::bail!(
            "run.output_dir {} holds a previous run ({names}); an in-process run (bus.url = \"local\") cannot resume it: pass --fresh to replace it, or set another run.output_dir",
            config.run.output_dir.display()
        );
    }
    for p in &previous {
        let removed = if p.is_dir() {
            std::fs::remove_dir_all(p)
        } else {
            std::fs::remove_file(p)
        };
        removed.with_context(|| format!("--fresh: cannot remove {}", p.display()))?;
    }
    tracing::info!(removed = %names, "--fresh: cleared the previous run");
    Ok(())
}

/// A role task that ended while the learner still runs: an error (unless
/// the process is shutting down).
async fn role_ended(
    done: Result<RoleResult, tokio::task::JoinError>,
    shutdown: &CancellationToken,
    learner: &mut tokio::task::JoinHandle<anyhow::Result<asyncrl_learner::service::LearnerSummary>>,
) -> anyhow::Result<()> {
    let (role, result) = done.context("a role task failed")?;
    if shutdown.is_cancelled() {
        return Ok(());
    }
    shutdown.cancel();
    let _ = learner.await;
    result.with_context(|| format!("{role} stopped"))?;
    anyhow::bail!("the {role} stopped before the learner finished")
}

async fn drain(tasks: &mut JoinSet<RoleResult>, grace: Duration) {
    let drained = tokio::time::timeout(grace, async {
        while let Some(done) = tasks.join_next().await {
            if let Ok((role, Err(e))) = done {
                tracing::warn!(role, error = %format!("{e:#}"), "role ended with an error while stopping");
            }
        }
    })
    .await;
    if drained.is_err() {
        tracing::warn!("roles did not stop within {grace:?}; aborting them");
        tasks.abort_all();
    }
}

/// Starts the coordinator and the buffer; the receiver fires once the
/// coordinator serves (it is dropped unfired if the coordinator fails to
/// start, and the coordinator's task then ends with the error).
fn spawn_roles(
    tasks: &mut JoinSet<RoleResult>,
    config: &Config,
    bus: &Arc<dyn Bus>,
    metrics: &asyncrl_telemetry::Metrics,
    health: &asyncrl_telemetry::Health,
    stop: &CancellationToken,
) -> tokio::sync::oneshot::Receiver<()> {
    let (up_tx, up_rx) = tokio::sync::oneshot::channel();
    let (c, b, m, h, s) = (
        config.clone(),
        bus.clone(),
        metrics.clone(),
        health.clone(),
        stop.clone(),
    );
    tasks.spawn(async move {
        let run = async move {
            let coordinator = asyncrl_coordinator::Coordinator::start(c, b, m, h, &s).await?;
            let _ = up_tx.send(());
            coordinator.join().await
        };
        ("coordinator", run.await.map_err(Into::into))
    });
    let (c, b, m, s) = (config.clone(), bus.clone(), metrics.clone(), stop.clone());
    tasks.spawn(async move {
        (
            "buffer",
            asyncrl_buffer::run(c, b, m, s).await.map_err(Into::into),
        )
    });
    up_rx
}

fn spawn_workers(
    tasks: &mut JoinSet<RoleResult>,
    config: &Config,
    bus: &Arc<dyn Bus>,
    metrics: &asyncrl_telemetry::Metrics,
    stop: &CancellationToken,
    workers: usize,
    lengths: CompletionLengths,
) {
    for i in 0..workers {
        let mut c = config.clone();
        if workers > 1 {
            let base = c.worker.id.clone().unwrap_or_else(|| "local-worker".into());
            c.worker.id = Some(format!("{base}-{i}"));
        }
        // One process, one registry: the workers share the worker metrics.
        let (b, m, s) = (
            bus.clone(),
            if i == 0 {
                metrics.clone()
            } else {
                asyncrl_telemetry::Metrics::new()
            },
            stop.clone(),
        );
        tasks.spawn(async move {
            (
                "worker",
                Worker::new(c, b, m)
                    .with_completion_lengths(lengths)
                    .run(s)
                    .await
                    .map(|_| ())
                    .map_err(Into::into),
            )
        });
    }
}

fn progress_bar(config: &Config, enabled: bool) -> ProgressBar {
    if !enabled {
        return ProgressBar::hidden();
    }
    let bar = if config.run.max_steps > 0 {
        ProgressBar::new(config.run.max_steps)
    } else {
        ProgressBar::new_spinner()
    };
    let style = ProgressStyle::with_template("{elapsed_precise} [{bar:30}] step {pos}/{len} {msg}")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    bar.set_style(style);
    bar.enable_steady_tick(Duration::from_millis(250));
    bar
}

/// (step, wall seconds, reward) of every step of a learner metrics CSV.
fn read_rewards(csv: &Path) -> anyhow::Result<Vec<(f64, f64, f64)>> {
    Ok(read_metrics(csv)?
        .into_iter()
        .filter(|r| r.wall_seconds.is_finite() && r.reward_mean.is_finite())
        .map(|r| (r.step as f64, r.wall_seconds, r.reward_mean))
        .collect())
}

fn reward_ends(csv: &Path) -> anyhow::Result<(f64, f64)> {
    let rows = read_rewards(csv)?;
    let mean = |rows: &[(f64, f64, f64)]| {
        if rows.is_empty() {
            0.0
        } else {
            rows.iter().map(|r| r.2).sum::<f64>() / rows.len() as f64
        }
    };
    let n = rows.len();
    Ok((mean(&rows[..n.min(5)]), mean(&rows[n.saturating_sub(5)..])))
}

fn write_curves(csv: &Path, out: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let rows = read_rewards(csv)?;
    if rows.len() < 2 {
        return Ok(Vec::new());
    }
    let by_step: Vec<(f64, f64)> = rows.iter().map(|r| (r.0, r.2)).collect();
    let by_time: Vec<(f64, f64)> = rows.iter().map(|r| (r.1, r.2)).collect();
    let window = (rows.len() / 10).max(1);
    let step_png = out.join("reward_vs_step.png");
    line_chart(
        &step_png,
        "Training reward",
        "learner step",
        "mean reward",
        &[
            Series {
                name: "per step".into(),
                points: by_step.clone(),
                band: None,
            },
            Series {
                name: format!("moving mean ({window})"),
                points: smooth(&by_step, window),
                band: None,
            },
        ],
    )?;
    let time_png = out.join("reward_vs_time.png");
    line_chart(
        &time_png,
        "Training reward",
        "wall-clock seconds",
        "mean reward",
        &[Series {
            name: format!("moving mean ({window})"),
            points: smooth(&by_time, window),
            band: None,
        }],
    )?;
    Ok(vec![step_png, time_png])
}

/// The scores of an evaluation row, short: `greedy 0.735 sampled 0.610 pass@8 0.910`.
pub fn eval_scores_text(row: &EvalRow) -> String {
    let s = &row.scores;
    let mut parts = Vec::new();
    if let Some(g) = s.greedy {
        parts.push(format!("greedy {g:.3}"));
    }
    if let Some(x) = s.sampled {
        parts.push(format!("sampled {x:.3}"));
    }
    if let Some(p) = s.pass_at_k {
        parts.push(format!("pass@{} {p:.3}", s.k));
    }
    parts.join(" ")
}

/// Held-out accuracy vs learner step: one line per score the run measured.
fn plot_eval(rows: &[EvalRow], png: &Path) -> anyhow::Result<()> {
    type Pick = fn(&EvalRow) -> Option<f64>;
    let k = rows.last().map_or(0, |r| r.scores.k);
    let picks: [(String, Pick); 3] = [
        ("greedy".into(), |r| r.scores.greedy),
        ("sampled".into(), |r| r.scores.sampled),
        (format!("pass@{k}"), |r| r.scores.pass_at_k),
    ];
    let series: Vec<Series> = picks
        .into_iter()
        .filter_map(|(name, pick)| {
            let points: Vec<(f64, f64)> = rows
                .iter()
                .filter_map(|r| pick(r).map(|v| (r.step as f64, v)))
                .collect();
            (!points.is_empty()).then_some(Series {
                name,
                points,
                band: None,
            })
        })
        .collect();
    line_chart(
        png,
        "Held-out accuracy",
        "learner step",
        "accuracy",
        &series,
    )
}
