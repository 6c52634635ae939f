//! `asyncrl-bench speedup`: synchronous (η = 0) against asynchronous
//! (η = 4) training on the long-tailed `reverse` task, with the learner and
//! the worker pinned to separate cores, and the pipelining bound computed
//! from the same runs.
//!
//! Every run is a full one-process `train` (coordinator, buffer, learner,
//! one worker over the in-process bus) from the same built-in model and the
//! same data. The untrained model does not know when to stop, so each
//! completion is made as long as its reference answer
//! ([`CompletionLengths::ReferenceAnswer`]): generation has the task's
//! heavy-tailed lengths (median 4 tokens, a few of 64), as a policy that has
//! learnt the task would produce.
//!
//! What is measured, from each run's `learner_metrics.csv`, after the
//! warm-up steps:
//! - seconds per learner step (wall-clock between the first counted step
//!   and the last, over the steps in between);
//! - in the synchronous run, T_gen = the learner's mean wait for its batch
//!   (with η = 0 nothing is generated while the learner computes, so the
//!   wait is the generation of one batch, weight fetch included) and
//!   T_train = seconds per step − T_gen (compute, publish and the rest of
//!   the learner's step);
//! - the pipelining bound: a pipeline that overlaps the two perfectly
//!   steps every max(T_gen, T_train), so async can at best be
//!   (T_gen + T_train) / max(T_gen, T_train) times faster;
//! - the measured speedup: sync seconds per step / async seconds per step.
//!
//! The sync and async runs alternate (`rounds` of each), so that machine
//! noise hits both; the ratio is of the medians over rounds.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context as _;

use super::stats::median;
use asyncrl_config::{ClipModeName, Config, DatasetConfig, DeviceName};
use asyncrl_rollout_worker::CompletionLengths;
use asyncrl_tasks::BuiltinTask;

use asyncrl_app::plot::{Series, line_chart};
use asyncrl_app::train::{TrainOptions, train};
use asyncrl_learner::outputs::{MetricsRow, read_metrics};

#[derive(Debug, Clone)]
pub struct SpeedupBench {
    /// Learner steps per run.
    pub steps: u64,
    /// First steps of each run left out of the measurement (model threads
    /// starting, the pipeline filling).
    pub warmup: u64,
    /// η of the asynchronous runs.
    pub eta: u32,
    /// Runs of each mode, alternating.
    pub rounds: usize,
    /// B groups per learner step.
    pub groups_per_step: u32,
    /// G completions per prompt.
    pub group_size: u32,
    /// Slots of the worker's decode batch.
    pub max_sequences: usize,
    /// Cores of the learner's and of the worker's model thread (disjoint).
    pub learner_cores: Vec<usize>,
    pub worker_cores: Vec<usize>,
    pub seed: u64,
    pub out: PathBuf,
}

impl Default for SpeedupBench {
    fn default() -> Self {
        Self {
            steps: 40,
            warmup: 5,
            eta: 4,
            rounds: 2,
            groups_per_step: 8,
            group_size: 8,
            max_sequences: 64,
            learner_cores: vec![0],
            worker_cores: vec![1],
            seed: 0,
            out: PathBuf::from("docs/results/speedup"),
        }
    }
}

/// What one run measured (steps after the warm-up).
#[derive(Debug, Clone)]
struct RunStats {
    eta: u32,
    round: usize,
    seconds_per_step: f64,
    wait: f64,
    compute: f64,
    publish: f64,
    tokens_per_step: f64,
    /// Rows × padded length: what the learner's compute follows.
    padded_per_step: f64,
    lag_mean: f64,
    lag_max: f64,
    /// (step, wall seconds) of every step, warm-up included.
    curve: Vec<(f64, f64)>,
}

impl RunStats {
    fn from_csv(csv: &Path, eta: u32, round: usize, warmup: u64) -> anyhow::Result<Self> {
        let rows = read_metrics(csv)?;
        let counted: Vec<&MetricsRow> = rows.iter().filter(|r| r.step > warmup).collect();
        let (Some(first), Some(last)) = (rows.iter().rfind(|r| r.step <= warmup), counted.last())
        else {
            anyhow::bail!(
                "{}: fewer steps than the warm-up ({warmup}) plus one",
                csv.display()
            );
        };
        let n = counted.len() as f64;
        let mean = |f: fn(&MetricsRow) -> f64| counted.iter().map(|r| f(r)).sum::<f64>() / n;
        Ok(Self {
            eta,
            round,
            seconds_per_step: (last.wall_seconds - first.wall_seconds)
                / (last.step - first.step) as f64,
            wait: mean(|r| r.wait_seconds),
            compute: mean(|r| r.compute_seconds),
            publish: mean(|r| r.publish_seconds),
            tokens_per_step: mean(|r| r.tokens as f64),
            padded_per_step: mean(|r| r.padded_tokens as f64),
            lag_mean: mean(|r| r.version_lag_mean),
            lag_max: counted
                .iter()
                .map(|r| r.version_lag_max)
                .fold(0.0, f64::max),
            curve: rows
                .iter()
                .map(|r| (r.wall_seconds, r.step as f64))
                .collect(),
        })
    }

    fn mode(&self) -> &'static str {
        if self.eta == 0 { "sync" } else { "async" }
    }
}

/// The outcome: medians over rounds.
#[derive(Debug, Clone)]
pub struct SpeedupReport {
    pub sync_seconds_per_step: f64,
    pub async_seconds_per_step: f64,
    pub t_gen: f64,
    pub t_train: f64,
    pub eta: u32,
    pub async_lag_max: f64,
}

impl SpeedupReport {
    pub fn measured(&self) -> f64 {
        self.sync_seconds_per_step / self.async_seconds_per_step.max(1e-12)
    }

    /// (T_gen + T_train) / max(T_gen, T_train).
    pub fn bound(&self) -> f64 {
        (self.t_gen + self.t_train) / self.t_gen.max(self.t_train).max(1e-12)
    }
}

/// Checks the cores before anything runs: both sets non-empty, disjoint,
/// and allowed to this process.
fn check_cores(bench: &SpeedupBench) -> anyhow::Result<()> {
    if bench.learner_cores.is_empty() || bench.worker_cores.is_empty() {
        anyhow::bail!("--learner-cores and --worker-cores must each name at least one core");
    }
    if let Some(c) = bench
        .learner_cores
        .iter()
        .find(|c| bench.worker_cores.contains(c))
    {
        anyhow::bail!("core {c} is in both --learner-cores and --worker-cores; they must differ");
    }
    if let Some(allowed) = asyncrl_policy::affinity::current_thread_cores()
        && let Some(c) = bench
            .learner_cores
            .iter()
            .chain(&bench.worker_cores)
            .find(|c| !allowed.contains(c))
    {
        anyhow::bail!(
            "core {c} is not available to this process (allowed: {allowed:?}); the bench needs two cores"
        );
    }
    Ok(())
}

/// The config of one run.
fn run_config(bench: &SpeedupBench, eta: u32, name: &str, data: &Path) -> anyhow::Result<Config> {
    let mut c = Config::default();
    c.run.name = name.to_owned();
    c.run.seed = bench.seed;
    c.run.max_steps = bench.steps;
    c.run.output_dir = bench.out.join("runs").join(name);
    c.staleness.eta = eta;
    c.staleness.groups_per_step = bench.groups_per_step;
    c.staleness.group_size = bench.group_size;
    c.telemetry.listen = String::new();
    c.telemetry.log_filter = "warn".into();
    c.model.device = DeviceName::Cpu;
    c.model.cpu_threads = 1;
    // "rev:" + up to 64 digits + "=", then up to 64 digits and the end token.
    c.model.max_new_tokens = asyncrl_tasks::REVERSE_MAX_LEN as usize + 1;
    c.model.max_seq_len = 2 * asyncrl_tasks::REVERSE_MAX_LEN as usize + 8;
    c.coordinator.datasets = vec![DatasetConfig::jsonl(
        BuiltinTask::Reverse.name(),
        data.to_owned(),
    )];
    c.coordinator.admin_listen = "127.0.0.1:0".into();
    c.coordinator.initial_knobs.clip_mode = ClipModeName::Adaptive;
    c.learner.cpu_affinity = bench.learner_cores.clone();
    // One checkpoint, after the last measured step.
    c.learner.checkpoint_every = bench.steps.max(1);
    c.worker.cpu_affinity = bench.worker_cores.clone();
    c.worker.max_sequences = bench.max_sequences;
    c.worker.drain_grace_period = std::time::Duration::from_secs(5);
    c.validate().context("the bench's run config")?;
    Ok(c)
}

/// Runs the rounds and writes the report into `bench.out`.
pub async fn speedup(bench: SpeedupBench) -> anyhow::Result<String> {
    check_cores(&bench)?;
    if bench.steps <= bench.warmup + 1 {
        anyhow::bail!(
            "--steps ({}) must exceed --warmup ({}) by at least 2",
            bench.steps,
            bench.warmup
        );
    }
    if bench.eta == 0 {
        anyhow::bail!("--eta must be at least 1 (the async side; sync is η = 0)");
    }
    let runs_dir = bench.out.join("runs");
    std::fs::create_dir_all(&runs_dir)
        .with_context(|| format!("cannot create {}", runs_dir.display()))?;
    // Enough prompts that no run repeats one.
    let tasks =
        (bench.steps as usize + 2 * bench.eta as usize + 8) * bench.groups_per_step as usize;
    let items = asyncrl_tasks::generate(BuiltinTask::Reverse, tasks, bench.seed);
    let data = runs_dir.join("reverse.jsonl");
    asyncrl_tasks::write_jsonl(&data, &items)
        .with_context(|| format!("cannot write {}", data.display()))?;

    let started = std::time::Instant::now();
    let mut runs: Vec<RunStats> = Vec::new();
    for round in 0..bench.rounds.max(1) {
        for eta in [0, bench.eta] {
            let name = format!("eta{eta}-round{round}");
            let config = run_config(&bench, eta, &name, &data)?;
            eprintln!("bench speedup: {name} ...");
            let summary = train(
                config,
                TrainOptions {
                    workers: 1,
                    progress: false,
                    completion_lengths: CompletionLengths::ReferenceAnswer,
                    // An earlier bench's run in the same place is replaced.
                    fresh: true,
                },
            )
            .await
            .with_context(|| format!("run {name}"))?;
            let stats = RunStats::from_csv(&summary.metrics_csv, eta, round, bench.warmup)?;
            eprintln!(
                "bench speedup: {name}: {:.3}s/step (wait {:.3}s, compute {:.3}s, publish {:.3}s)",
                stats.seconds_per_step, stats.wait, stats.compute, stats.publish
            );
            runs.push(stats);
        }
    }

    let of = |eta: u32| runs.iter().filter(move |r| r.eta == eta);
    let sync_sps = median(of(0).map(|r| r.seconds_per_step).collect());
    let t_gen = median(of(0).map(|r| r.wait).collect());
    let report = SpeedupReport {
        sync_seconds_per_step: sync_sps,
        async_seconds_per_step: median(of(bench.eta).map(|r| r.seconds_per_step).collect()),
        t_gen,
        t_train: sync_sps - t_gen,
        eta: bench.eta,
        async_lag_max: of(bench.eta).map(|r| r.lag_max).fold(0.0, f64::max),
    };
    write_report(&bench, &runs, &report, started.elapsed().as_secs_f64())
}

fn write_report(
    bench: &SpeedupBench,
    runs: &[RunStats],
    report: &SpeedupReport,
    seconds: f64,
) -> anyhow::Result<String> {
    let mut csv = String::from(
        "mode,eta,round,seconds_per_step,wait_seconds,compute_seconds,publish_seconds,tokens_per_step,padded_tokens_per_step,version_lag_mean,version_lag_max\n",
    );
    for r in runs {
        let _ = writeln!(
            csv,
            "{},{},{},{:.4},{:.4},{:.4},{:.4},{:.1},{:.1},{:.3},{}",
            r.mode(),
            r.eta,
            r.round,
            r.seconds_per_step,
            r.wait,
            r.compute,
            r.publish,
            r.tokens_per_step,
            r.padded_per_step,
            r.lag_mean,
            r.lag_max
        );
    }
    let csv_path = bench.out.join("speedup.csv");
    std::fs::write(&csv_path, csv)
        .with_context(|| format!("cannot write {}", csv_path.display()))?;

    let series: Vec<Series> = runs
        .iter()
        .map(|r| Series {
            name: format!("{} (η={}) round {}", r.mode(), r.eta, r.round),
            points: r.curve.clone(),
            band: None,
        })
        .collect();
    let png = bench.out.join("speedup.png");
    line_chart(
        &png,
        "Learner steps vs wall-clock (reverse task, learner and worker on separate cores)",
        "seconds",
        "learner steps",
        &series,
    )?;

    let mut md = String::new();
    let _ = writeln!(
        md,
        "| run | s/step | learner wait (s) | compute (s) | publish (s) | learner busy | tokens/step (padded) | staleness mean / max |"
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|");
    for r in runs {
        let _ = writeln!(
            md,
            "| {} η={} round {} | {:.3} | {:.3} | {:.3} | {:.3} | {:.0} % | {:.0} ({:.0}) | {:.2} / {} |",
            r.mode(),
            r.eta,
            r.round,
            r.seconds_per_step,
            r.wait,
            r.compute,
            r.publish,
            100.0 * (r.compute + r.publish) / r.seconds_per_step.max(1e-12),
            r.tokens_per_step,
            r.padded_per_step,
            r.lag_mean,
            r.lag_max
        );
    }
    let _ = writeln!(
        md,
        "\nFrom the synchronous runs (medians): T_gen = {:.3} s (learner waiting for a batch), \
         T_train = {:.3} s (the rest of its step).\n\n\
         | | value |\n|---|---|\n\
         | sync s/step | {:.3} |\n\
         | async (η={}) s/step | {:.3} |\n\
         | **measured speedup** | **{:.2}×** |\n\
         | pipelining bound (T_gen + T_train) / max(T_gen, T_train) | {:.2}× |\n\
         | measured / bound | {:.2} |\n\
         | max staleness of a trained token (async) | {} (η = {}) |\n\n\
         {} steps per run ({} warm-up steps not counted), B = {}, G = {}, {} decode slots, \
         learner on cores {:?}, worker on cores {:?}; {} rounds in {:.0} s.",
        report.t_gen,
        report.t_train,
        report.sync_seconds_per_step,
        report.eta,
        report.async_seconds_per_step,
        report.measured(),
        report.bound(),
        report.measured() / report.bound().max(1e-12),
        report.async_lag_max,
        report.eta,
        bench.steps,
        bench.warmup,
        bench.groups_per_step,
        bench.group_size,
        bench.max_sequences,
        bench.learner_cores,
        bench.worker_cores,
        bench.rounds.max(1),
        seconds
    );
    let md_path = bench.out.join("speedup.md");
    std::fs::write(&md_path, &md).with_context(|| format!("cannot write {}", md_path.display()))?;
    let _ = writeln!(
        md,
        "\nwrote {}, {}, {}",
        csv_path.display(),
        png.display(),
        md_path.display()
    );
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bound_is_one_plus_the_smaller_over_the_larger() {
        let r = |t_gen, t_train| SpeedupReport {
            sync_seconds_per_step: t_gen + t_train,
            async_seconds_per_step: 1.0,
            t_gen,
            t_train,
            eta: 4,
            async_lag_max: 0.0,
        };
        assert!((r(1.0, 1.0).bound() - 2.0).abs() < 1e-12);
        assert!((r(3.0, 1.0).bound() - 4.0 / 3.0).abs() < 1e-12);
        assert!((r(1.0, 3.0).bound() - 4.0 / 3.0).abs() < 1e-12);
        assert!((r(2.0, 0.0).bound() - 1.0).abs() < 1e-12);
        assert!((r(1.5, 0.5).measured() - 2.0).abs() < 1e-12);
    }

    #[test]
    fn run_stats_count_only_the_steps_after_the_warm_up() {
        let dir = tempfile::tempdir().unwrap();
        let csv = dir.path().join("m.csv");
        let mut log = asyncrl_learner::outputs::CsvLog::<MetricsRow>::open(csv.clone()).unwrap();
        let row = |step: u64, wall: f64, wait: f64, tokens: i64, lag: (f64, f64), padded: i64| {
            MetricsRow {
                step,
                version: step as i32,
                wall_seconds: wall,
                reward_mean: 0.1,
                wait_seconds: wait,
                compute_seconds: 0.5,
                publish_seconds: 0.1,
                tokens,
                version_lag_mean: lag.0,
                version_lag_max: lag.1,
                padded_tokens: padded,
                ..MetricsRow::default()
            }
        };
        // Two slow warm-up steps, then one step per second.
        log.append(&row(1, 10.0, 9.0, 100, (0.0, 0.0), 900))
            .unwrap();
        log.append(&row(2, 12.0, 1.5, 100, (0.0, 0.0), 900))
            .unwrap();
        for s in 3..=6u64 {
            let wall = (12 + (s - 2)) as f64;
            log.append(&row(s, wall, 0.4, 200, (1.5, (s - 2) as f64), 640))
                .unwrap();
        }
        let r = RunStats::from_csv(&csv, 4, 0, 2).unwrap();
        assert!((r.seconds_per_step - 1.0).abs() < 1e-12);
        assert!((r.wait - 0.4).abs() < 1e-12);
        assert!((r.tokens_per_step - 200.0).abs() < 1e-12);
        assert!((r.padded_per_step - 640.0).abs() < 1e-12);
        assert_eq!(r.lag_max, 4.0);
        assert_eq!(r.curve.len(), 6);
        let e = RunStats::from_csv(&csv, 4, 0, 6).unwrap_err();
        assert!(
            e.to_string().contains("fewer steps than the warm-up"),
            "{e}"
        );
    }

    #[test]
    fn cores_must_be_two_disjoint_non_empty_sets() {
        let mut b = SpeedupBench {
            learner_cores: vec![0],
            worker_cores: vec![0],
            ..SpeedupBench::default()
        };
        let e = check_cores(&b).unwrap_err().to_string();
        assert!(e.contains("core 0 is in both"), "{e}");
        b.worker_cores.clear();
        let e = check_cores(&b).unwrap_err().to_string();
        assert!(e.contains("at least one core"), "{e}");
        b.worker_cores = vec![1000];
        let e = check_cores(&b).unwrap_err().to_string();
        assert!(e.contains("core 1000 is not available"), "{e}");
    }
}
