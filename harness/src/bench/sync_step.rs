//! `asyncrl-bench sync-step`: where the time of one synchronous (η = 0)
//! step goes, on the main job's config (`examples/arith.toml` by default).
//!
//! With η = 0 nothing overlaps: the learner trains, publishes version v,
//! the worker fetches and swaps it in, asks for tasks (admission), generates
//! and scores, publishes its trajectories, the buffer ingests them and
//! serves the next batch, and the learner trains again. Every part that is
//! neither generation nor training is pure overhead of the system.
//!
//! The bench runs the whole job in this process (`train`) and records the
//! roles' own tracing events with their time (a capturing layer installed as
//! the process's subscriber), then cuts each step's cycle, from the buffer
//! serving batch k − 1 to it serving batch k, at these boundaries:
//!
//! 1. the worker has swapped in version k − 1 (`weights swapped in`);
//! 2. its first grant after that (`tasks acquired`);
//! 3. its last trajectory of the step is acknowledged (`trajectory published`);
//! 4. the buffer serves batch k (`batch served`).
//!
//! The first segment holds the learner's step k − 1: its compute comes from
//! its `step` event, the upload (put + announcement) from its `weights
//! published` event, the announcement → in use part from the swap's own
//! latency, and the rest (batch transfer and decode, logs, status) is
//! "learner other".
//!
//! Variants (alternating rounds): one libtorch thread per role on its own
//! core (as the main job runs), and two threads for each role on both cores
//! (the phases alternate, so whichever runs has the whole machine).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Instant;

use anyhow::Context as _;
use asyncrl_config::Config;
use clap::Args;
use tracing::field::{Field, Visit};
use tracing_subscriber::Layer;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt as _;

use super::stats::median;
use asyncrl_app::train::{TrainOptions, train};

#[derive(Debug, Args)]
pub struct SyncStepArgs {
    /// The job (its model, data, batch sizes); η is set to 0.
    #[arg(default_value = "examples/arith.toml")]
    config: PathBuf,
    /// Learner steps per run.
    #[arg(long, default_value_t = 60)]
    steps: u64,
    /// First steps of each run not counted.
    #[arg(long, default_value_t = 10)]
    warmup: u64,
    /// Runs of each variant (alternating).
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    #[arg(long, default_value = "docs/results/sync-step")]
    out: PathBuf,
}

/// One captured event: its message, when, and its numeric fields.
#[derive(Debug, Clone)]
struct Event {
    at: Instant,
    message: String,
    fields: BTreeMap<&'static str, f64>,
}

impl Event {
    fn get(&self, name: &str) -> Option<f64> {
        self.fields.get(name).copied()
    }
}

/// The events the breakdown reads.
const CAPTURED: [&str; 6] = [
    "step",
    "weights published",
    "weights swapped in",
    "tasks acquired",
    "trajectory published",
    "batch served",
];

#[derive(Default)]
struct Visitor {
    message: String,
    fields: BTreeMap<&'static str, f64>,
}

impl Visit for Visitor {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.message = format!("{value:?}");
        }
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message = value.to_owned();
        }
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.fields.insert(field.name(), value);
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.fields.insert(field.name(), value as f64);
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.fields.insert(field.name(), value as f64);
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.fields.insert(field.name(), f64::from(u8::from(value)));
    }
}

type Sink = Arc<Mutex<Vec<Event>>>;

struct Capture {
    sink: Sink,
}

impl<S: tracing::Subscriber> Layer<S> for Capture {
    fn on_event(
        &self,
        event: &tracing::Event<'_>,
        _ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        let at = Instant::now();
        let mut v = Visitor::default();
        event.record(&mut v);
        if CAPTURED.contains(&v.message.as_str()) {
            self.sink
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(Event {
                    at,
                    message: v.message,
                    fields: v.fields,
                });
        }
    }
}

/// Installs the capturing subscriber once per process (warnings still go
/// to stderr) and returns its sink.
fn capture() -> anyhow::Result<Sink> {
    static SINK: OnceLock<Sink> = OnceLock::new();
    if let Some(sink) = SINK.get() {
        return Ok(sink.clone());
    }
    let sink: Sink = Arc::default();
    let targets = Targets::new()
        .with_target("asyncrl_rollout_worker", tracing::Level::DEBUG)
        .with_target("asyncrl_buffer", tracing::Level::INFO)
        .with_target("asyncrl_learner", tracing::Level::INFO);
    let subscriber = tracing_subscriber::registry()
        .with(Capture { sink: sink.clone() }.with_filter(targets))
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_filter(tracing_subscriber::filter::LevelFilter::WARN),
        );
    tracing::subscriber::set_global_default(subscriber)
        .context("bench sync-step records the roles' events and needs the process's subscriber")?;
    Ok(SINK.get_or_init(|| sink).clone())
}

/// One counted step's cycle, in seconds.
#[derive(Debug, Clone, Default, PartialEq)]
struct Breakdown {
    step: u64,
    total: f64,
    train: f64,
    /// Learner publish (put + announce) + announcement → in use on the worker.
    weights: f64,
    /// Batch transfer and decode, logs, status: the learner's step minus its
    /// compute and publish.
    learner_other: f64,
    admission: f64,
    /// First grant → last trajectory acknowledged (scoring included).
    generation: f64,
    /// Mean scoring time of one completion (inside `generation`).
    scoring: f64,
    /// Last trajectory acknowledged → the buffer serves the batch.
    trajectories_to_batch: f64,
}

impl Breakdown {
    /// What is neither generating, scoring nor training.
    fn overhead(&self) -> f64 {
        self.weights + self.learner_other + self.admission + self.trajectories_to_batch
    }
}

/// Cuts every step after `warmup` into its phases. Events are in time order.
fn breakdown(events: &[Event], warmup: u64) -> Vec<Breakdown> {
    fn of<'a>(events: &'a [Event], m: &'static str) -> impl Iterator<Item = &'a Event> {
        events.iter().filter(move |e| e.message == m)
    }
    let of = |m: &'static str| of(events, m);
    let served: BTreeMap<u64, Instant> = of("batch served")
        .filter(|e| e.get("replayed") != Some(1.0))
        .filter_map(|e| Some((e.get("step")? as u64, e.at)))
        .collect();
    let steps: BTreeMap<u64, &Event> = of("step")
        .filter_map(|e| Some((e.get("step")? as u64, e)))
        .collect();
    let mut out = Vec::new();
    for (&k, &end) in served.range(warmup.max(1) + 1..) {
        let (Some(&start), Some(prev)) = (served.get(&(k - 1)), steps.get(&(k - 1))) else {
            continue;
        };
        let Some(version) = prev.get("version") else {
            continue;
        };
        let within = |e: &&Event| e.at > start && e.at <= end;
        let Some(swap) = of("weights swapped in")
            .filter(within)
            .find(|e| e.get("version") == Some(version))
        else {
            continue;
        };
        let b2 = swap.at;
        let b3 = of("tasks acquired")
            .filter(within)
            .find(|e| e.get("granted").unwrap_or(0.0) > 0.0)
            .map_or(b2, |e| e.at.max(b2));
        let published: Vec<&Event> = of("trajectory published").filter(within).collect();
        let b4 = published
            .iter()
            .map(|e| e.at)
            .max()
            .map_or(b3, |t| t.max(b3));
        let secs = |a: Instant, b: Instant| b.saturating_duration_since(a).as_secs_f64();
        let train = prev.get("compute_s").unwrap_or(0.0);
        let upload = of("weights published")
            .filter(within)
            .find(|e| e.get("version") == Some(version))
            .and_then(|e| e.get("upload_s"))
            .unwrap_or(0.0);
        let weights = upload + swap.get("swap_latency_ms").unwrap_or(0.0) / 1e3;
        let scoring = if published.is_empty() {
            0.0
        } else {
            published
                .iter()
                .map(|e| e.get("reward_ms").unwrap_or(0.0))
                .sum::<f64>()
                / published.len() as f64
                / 1e3
        };
        out.push(Breakdown {
            step: k,
            total: secs(start, end),
            train,
            weights,
            learner_other: (secs(start, b2) - train - weights).max(0.0),
            admission: secs(b2, b3),
            generation: secs(b3, b4),
            scoring,
            trajectories_to_batch: secs(b4, end),
        });
    }
    out
}

/// One run: its variant, round, counted steps and wall-clock per step.
type Run = (Variant, usize, Vec<Breakdown>, f64);

#[derive(Debug, Clone, Copy, PartialEq)]
enum Variant {
    /// One thread per role, learner on core 0, worker on core 1.
    Pinned,
    /// Two threads per role, both cores, no pinning.
    BothCores,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::Pinned => "1 thread each (learner core 0, worker core 1)",
            Variant::BothCores => "2 threads each, both cores",
        }
    }
    fn slug(self) -> &'static str {
        match self {
            Variant::Pinned => "pinned",
            Variant::BothCores => "both-cores",
        }
    }
}

fn run_config(
    base: &Config,
    args: &SyncStepArgs,
    v: Variant,
    round: usize,
) -> anyhow::Result<Config> {
    let mut c = base.clone();
    c.run.name = format!("sync-step-{}-{round}", v.slug());
    c.run.max_steps = args.steps;
    c.run.output_dir = args.out.join("runs").join(&c.run.name);
    c.staleness.eta = 0;
    c.telemetry.listen = String::new();
    c.coordinator.admin_listen = "127.0.0.1:0".into();
    c.learner.checkpoint_every = args.steps.max(1);
    c.eval.every_steps = 0;
    match v {
        Variant::Pinned => {
            c.model.cpu_threads = 1;
            c.learner.cpu_affinity = vec![0];
            c.worker.cpu_affinity = vec![1];
        }
        Variant::BothCores => {
            c.model.cpu_threads = 2;
            c.learner.cpu_affinity = Vec::new();
            c.worker.cpu_affinity = Vec::new();
        }
    }
    c.validate().context("the bench's run config")?;
    Ok(c)
}

pub(crate) fn run(rt: &tokio::runtime::Runtime, args: SyncStepArgs) -> anyhow::Result<String> {
    if args.steps <= args.warmup + 1 {
        anyhow::bail!(
            "--steps ({}) must exceed --warmup ({}) by at least 2",
            args.steps,
            args.warmup
        );
    }
    let base = Config::load(&args.config)
        .with_context(|| format!("the job's config {}", args.config.display()))?;
    let sink = capture()?;
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create {}", args.out.display()))?;
    let started = Instant::now();
    let mut rows: Vec<Run> = Vec::new();
    for round in 0..args.rounds.max(1) {
        for v in [Variant::Pinned, Variant::BothCores] {
            let config = run_config(&base, &args, v, round)?;
            eprintln!("bench sync-step: {} round {round} ...", v.name());
            sink.lock().unwrap_or_else(PoisonError::into_inner).clear();
            let summary = rt
                .block_on(train(
                    config,
                    TrainOptions {
                        workers: 1,
                        progress: false,
                        completion_lengths: Default::default(),
                        fresh: true,
                    },
                ))
                .with_context(|| format!("run {} round {round}", v.slug()))?;
            let events = std::mem::take(&mut *sink.lock().unwrap_or_else(PoisonError::into_inner));
            let steps = breakdown(&events, args.warmup);
            if steps.len() < 2 {
                anyhow::bail!(
                    "run {} round {round}: only {} of {} steps could be cut into phases (events: {})",
                    v.slug(),
                    steps.len(),
                    args.steps - args.warmup - 1,
                    events.len()
                );
            }
            let sps = summary.seconds / summary.steps.max(1) as f64;
            eprintln!(
                "bench sync-step: {} round {round}: median step {:.3}s, overhead {:.1} %",
                v.name(),
                median(steps.iter().map(|b| b.total).collect()),
                100.0 * median(steps.iter().map(|b| b.overhead() / b.total).collect())
            );
            rows.push((v, round, steps, sps));
        }
    }
    write_report(&args, &rows, started.elapsed().as_secs_f64())
}

/// A phase's name in the report and how to read it off a step.
type Phase = (&'static str, fn(&Breakdown) -> f64);

const PHASES: [Phase; 7] = [
    ("generation (first grant → last trajectory acked)", |b| {
        b.generation
    }),
    ("of which scoring (mean per completion)", |b| b.scoring),
    ("training (learner compute)", |b| b.train),
    ("weights: publish → fetch → swap", |b| b.weights),
    ("admission (swap → first grant)", |b| b.admission),
    ("trajectories → buffer → batch served", |b| {
        b.trajectories_to_batch
    }),
    (
        "learner other (batch transfer, decode, logs, status)",
        |b| b.learner_other,
    ),
];

fn write_report(args: &SyncStepArgs, rows: &[Run], seconds: f64) -> anyhow::Result<String> {
    let mut csv = String::from(
        "variant,round,step,total_s,generation_s,scoring_s,train_s,weights_s,admission_s,trajectories_to_batch_s,learner_other_s\n",
    );
    for (v, round, steps, _) in rows {
        for b in steps {
            let _ = writeln!(
                csv,
                "{},{round},{},{:.5},{:.5},{:.5},{:.5},{:.5},{:.5},{:.5},{:.5}",
                v.slug(),
                b.step,
                b.total,
                b.generation,
                b.scoring,
                b.train,
                b.weights,
                b.admission,
                b.trajectories_to_batch,
                b.learner_other
            );
        }
    }
    let csv_path = args.out.join("sync-step.csv");
    std::fs::write(&csv_path, csv)
        .with_context(|| format!("cannot write {}", csv_path.display()))?;

    let mut md = String::new();
    let variants = [Variant::Pinned, Variant::BothCores];
    let all = |v: Variant| -> Vec<&Breakdown> {
        rows.iter()
            .filter(|r| r.0 == v)
            .flat_map(|r| r.2.iter())
            .collect()
    };
    let _ = writeln!(
        md,
        "Median per counted step (s) of η = 0 runs of `{}` ({} steps per run, {} warm-up steps not counted, {} rounds of each variant, {:.0} s in all):\n",
        args.config.display(),
        args.steps,
        args.warmup,
        args.rounds.max(1),
        seconds
    );
    let _ = write!(md, "| phase |");
    for v in variants {
        let _ = write!(md, " {} |", v.name());
    }
    let _ = writeln!(md, "\n|---|---|---|");
    for (name, f) in PHASES {
        let _ = write!(md, "| {name} |");
        for v in variants {
            let steps = all(v);
            let phase = median(steps.iter().map(|b| f(b)).collect());
            let share = median(steps.iter().map(|b| f(b) / b.total).collect());
            let _ = write!(md, " {phase:.4} ({:.1} %) |", 100.0 * share);
        }
        let _ = writeln!(md);
    }
    let _ = write!(md, "| **step (batch k−1 served → batch k served)** |");
    for v in variants {
        let _ = write!(
            md,
            " **{:.4}** |",
            median(all(v).iter().map(|b| b.total).collect())
        );
    }
    let _ = write!(md, "\n| **neither generating, scoring nor training** |");
    for v in variants {
        let steps = all(v);
        let _ = write!(
            md,
            " **{:.4} ({:.1} %)** |",
            median(steps.iter().map(|b| b.overhead()).collect()),
            100.0 * median(steps.iter().map(|b| b.overhead() / b.total).collect())
        );
    }
    let _ = write!(
        md,
        "\n| wall-clock per step over the whole run (warm-up included) |"
    );
    for v in variants {
        let per_run: Vec<f64> = rows.iter().filter(|r| r.0 == v).map(|r| r.3).collect();
        let _ = write!(md, " {:.4} |", median(per_run));
    }
    let _ = writeln!(
        md,
        "\n\nShares are medians of each step's share, so they need not add up to 100 %. \
         Scoring runs inside the generation window (one completion's scoring time is shown)."
    );
    let md_path = args.out.join("sync-step.md");
    std::fs::write(&md_path, &md).with_context(|| format!("cannot write {}", md_path.display()))?;
    let _ = writeln!(md, "\nwrote {}, {}", csv_path.display(), md_path.display());
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn ev(t0: Instant, ms: u64, message: &str, fields: &[(&'static str, f64)]) -> Event {
        Event {
            at: t0 + Duration::from_millis(ms),
            message: message.into(),
            fields: fields.iter().copied().collect(),
        }
    }

    #[test]
    fn a_step_is_cut_at_swap_first_grant_last_trajectory_and_batch() {
        let t0 = Instant::now();
        let events = vec![
            ev(t0, 0, "batch served", &[("step", 1.0), ("replayed", 0.0)]),
            ev(
                t0,
                40,
                "step",
                &[("step", 1.0), ("version", 1.0), ("compute_s", 0.030)],
            ),
            ev(
                t0,
                44,
                "weights published",
                &[("version", 1.0), ("upload_s", 0.004)],
            ),
            ev(
                t0,
                50,
                "weights swapped in",
                &[("version", 1.0), ("swap_latency_ms", 6.0)],
            ),
            // An empty grant does not count.
            ev(t0, 52, "tasks acquired", &[("granted", 0.0)]),
            ev(t0, 60, "tasks acquired", &[("granted", 16.0)]),
            ev(t0, 100, "trajectory published", &[("reward_ms", 1.0)]),
            ev(t0, 130, "trajectory published", &[("reward_ms", 3.0)]),
            // A replayed batch is not the step's.
            ev(t0, 131, "batch served", &[("step", 2.0), ("replayed", 1.0)]),
            ev(t0, 140, "batch served", &[("step", 2.0), ("replayed", 0.0)]),
        ];
        let b = breakdown(&events, 0);
        assert_eq!(b.len(), 1, "{b:?}");
        let b = &b[0];
        let close = |a: f64, e: f64| (a - e).abs() < 1e-9;
        assert_eq!(b.step, 2);
        assert!(close(b.total, 0.140), "{b:?}");
        assert!(close(b.train, 0.030));
        assert!(close(b.weights, 0.010));
        assert!(close(b.learner_other, 0.010), "{b:?}");
        assert!(close(b.admission, 0.010));
        assert!(close(b.generation, 0.070));
        assert!(close(b.scoring, 0.002));
        assert!(close(b.trajectories_to_batch, 0.010));
        assert!(close(b.overhead(), 0.040));
        // The warm-up steps are left out.
        assert!(breakdown(&events, 2).is_empty());
    }

    #[test]
    fn a_grant_before_the_swap_counts_no_admission() {
        let t0 = Instant::now();
        let events = vec![
            ev(t0, 0, "batch served", &[("step", 1.0)]),
            ev(
                t0,
                20,
                "step",
                &[("step", 1.0), ("version", 1.0), ("compute_s", 0.010)],
            ),
            ev(t0, 25, "tasks acquired", &[("granted", 4.0)]),
            ev(t0, 30, "weights swapped in", &[("version", 1.0)]),
            ev(t0, 50, "trajectory published", &[]),
            ev(t0, 60, "batch served", &[("step", 2.0)]),
        ];
        let b = breakdown(&events, 0);
        assert_eq!(b.len(), 1);
        assert_eq!(b[0].admission, 0.0);
        assert!((b[0].generation - 0.020).abs() < 1e-9);
    }
}
