//! `asyncrl-bench staleness`: the same task, model and budget under
//! η ∈ {…} × objective ∈ {…} × seeds, each a full one-process run from the
//! same starting model with held-out evaluation (`[eval]` of the base
//! config) every few steps. Writes:
//! - `staleness.csv`: every learner step of every run (training reward,
//!   version lag);
//! - `staleness_eval.csv`: every held-out evaluation of every run;
//! - `accuracy_vs_samples.png`, `accuracy_vs_wallclock.png`: held-out
//!   greedy accuracy, one panel per objective, one line per η (seed mean,
//!   min..max over seeds as a band);
//! - `staleness.md`: final accuracy ± spread, samples and time to a target
//!   accuracy, staleness per setting; what staleness costs per objective;
//!   sync (η = 0) against the best asynchronous setting in time to target.
//!
//! Every setting runs with the same hyperparameters; only η, the objective
//! and the seed change.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use asyncrl_config::{
    AdvantageNormName, ClipModeName, Config, ImportanceCorrectionName, ProximalName,
};

use asyncrl_app::plot::{Series, panel_chart};
use asyncrl_app::train::{NoSignalSummary, TrainOptions, train};
use asyncrl_learner::outputs::{EVAL_CSV, METRICS_CSV, read_eval, read_metrics};

/// The objectives the study compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Objective {
    /// PPO clipping around the behaviour policy, no off-policy weight: what
    /// a system without decoupled PPO trains with.
    Naive,
    /// Decoupled PPO: PPO clipping around the proximal policy (recomputed
    /// with the weights before the step), behaviour tokens weighted by
    /// π_prox / π_behav (capped).
    Decoupled,
    /// Decoupled PPO with staleness-adaptive clipping.
    Adaptive,
    /// Decoupled PPO with M2PO's second-moment masking.
    M2po,
    /// GSPO's sequence-level ratio around the recomputed proximal policy.
    Gspo,
    /// Decoupled PPO with the off-policy weight truncated at the cap (TIS)
    /// instead of masked above it.
    Tis,
    /// Decoupled PPO with tokens whose weight is outside [floor, cap]
    /// masked (IcePop).
    Icepop,
    /// Decoupled PPO with RLOO's leave-one-out advantages.
    Rloo,
    /// The base config's objective as it is (the main job's, say).
    Job,
    /// The base config's, with dynamic sampling: groups whose rewards span
    /// less than [`DYNAMIC_MIN_SPREAD`] are dropped at the buffer.
    JobDynamic,
    /// The base config's, with the learner padding every row instead of
    /// packing (`learner.packing = false`).
    JobPadded,
    /// The base config's, with the built-in worker's prompt sharing off
    /// (`worker.share_prompts = false`).
    JobUnshared,
    /// The base config's, with every row trained, zero-advantage ones too
    /// (`learner.forward_only_zero_advantage = false`).
    JobBackwardAll,
    /// The base config's, with the evaluator at the learner's CPU priority
    /// (`eval.nice = 0`).
    JobEvalNice0,
    /// [`Objective::JobDynamic`] with dual-clip PPO's bound
    /// [`DUAL_CLIP_BOUND`] on negative-advantage ratios.
    JobDualClip,
}

/// The `dual_clip` knob of [`Objective::JobDualClip`]: verl's default
/// `clip_ratio_c`.
pub const DUAL_CLIP_BOUND: f64 = 3.0;

/// `buffer.min_reward_spread` of [`Objective::JobDynamic`]: with 0/1
/// rewards, a group is kept unless every completion scored alike.
pub const DYNAMIC_MIN_SPREAD: f64 = 0.5;

/// What an [`Objective`] sets in the config (`None`: the base config's).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ObjectiveSettings {
    pub clip_mode: Option<ClipModeName>,
    pub proximal: Option<ProximalName>,
    pub correction: Option<ImportanceCorrectionName>,
    pub advantage_norm: Option<AdvantageNormName>,
    pub min_reward_spread: Option<f64>,
    pub packing: Option<bool>,
    pub share_prompts: Option<bool>,
    pub forward_only_zero_advantage: Option<bool>,
    pub eval_nice: Option<u8>,
    pub dual_clip: Option<f64>,
}

impl Objective {
    pub const ALL: [Objective; 15] = [
        Objective::Naive,
        Objective::Decoupled,
        Objective::Adaptive,
        Objective::M2po,
        Objective::Gspo,
        Objective::Tis,
        Objective::Icepop,
        Objective::Rloo,
        Objective::Job,
        Objective::JobDynamic,
        Objective::JobPadded,
        Objective::JobUnshared,
        Objective::JobBackwardAll,
        Objective::JobEvalNice0,
        Objective::JobDualClip,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Objective::Naive => "naive",
            Objective::Decoupled => "decoupled",
            Objective::Adaptive => "adaptive",
            Objective::M2po => "m2po",
            Objective::Gspo => "gspo",
            Objective::Tis => "tis",
            Objective::Icepop => "icepop",
            Objective::Rloo => "rloo",
            Objective::Job => "job",
            Objective::JobDynamic => "job-dynamic",
            Objective::JobPadded => "job-padded",
            Objective::JobUnshared => "job-unshared",
            Objective::JobBackwardAll => "job-backward-all",
            Objective::JobEvalNice0 => "job-eval-nice0",
            Objective::JobDualClip => "job-dual-clip",
        }
    }

    pub fn parse(s: &str) -> anyhow::Result<Self> {
        Self::ALL
            .into_iter()
            .find(|o| o.as_str() == s)
            .with_context(|| {
                format!(
                    "unknown objective {s:?} (naive, decoupled, adaptive, m2po, gspo, tis, icepop, rloo, job, job-dynamic, job-padded, job-unshared, job-backward-all, job-eval-nice0, job-dual-clip)"
                )
            })
    }

    /// The clip mode, proximal policy, importance correction and advantage
    /// of this objective, and the job variants' sampling and packing.
    pub fn settings(self) -> ObjectiveSettings {
        let job = ObjectiveSettings {
            clip_mode: None,
            proximal: None,
            correction: None,
            advantage_norm: None,
            min_reward_spread: None,
            packing: None,
            share_prompts: None,
            forward_only_zero_advantage: None,
            eval_nice: None,
            dual_clip: None,
        };
        let (clip_mode, proximal, correction, advantage_norm) = match self {
            Objective::Job => return job,
            Objective::JobDynamic => {
                return ObjectiveSettings {
                    min_reward_spread: Some(DYNAMIC_MIN_SPREAD),
                    ..job
                };
            }
            Objective::JobPadded => {
                return ObjectiveSettings {
                    packing: Some(false),
                    ..job
                };
            }
            Objective::JobUnshared => {
                return ObjectiveSettings {
                    share_prompts: Some(false),
                    ..job
                };
            }
            Objective::JobBackwardAll => {
                return ObjectiveSettings {
                    forward_only_zero_advantage: Some(false),
                    ..job
                };
            }
            Objective::JobEvalNice0 => {
                return ObjectiveSettings {
                    eval_nice: Some(0),
                    ..job
                };
            }
            Objective::JobDualClip => {
                return ObjectiveSettings {
                    min_reward_spread: Some(DYNAMIC_MIN_SPREAD),
                    dual_clip: Some(DUAL_CLIP_BOUND),
                    ..job
                };
            }
            Objective::Naive => (
                ClipModeName::Ppo,
                ProximalName::Behaviour,
                ImportanceCorrectionName::Mask,
                None,
            ),
            Objective::Decoupled => (
                ClipModeName::Ppo,
                ProximalName::Recompute,
                ImportanceCorrectionName::Mask,
                None,
            ),
            Objective::Adaptive => (
                ClipModeName::Adaptive,
                ProximalName::Recompute,
                ImportanceCorrectionName::Mask,
                None,
            ),
            Objective::M2po => (
                ClipModeName::M2po,
                ProximalName::Recompute,
                ImportanceCorrectionName::Mask,
                None,
            ),
            Objective::Gspo => (
                ClipModeName::Gspo,
                ProximalName::Recompute,
                ImportanceCorrectionName::Mask,
                None,
            ),
            Objective::Tis => (
                ClipModeName::Ppo,
                ProximalName::Recompute,
                ImportanceCorrectionName::Truncate,
                None,
            ),
            Objective::Icepop => (
                ClipModeName::Ppo,
                ProximalName::Recompute,
                ImportanceCorrectionName::Icepop,
                None,
            ),
            Objective::Rloo => (
                ClipModeName::Ppo,
                ProximalName::Recompute,
                ImportanceCorrectionName::Mask,
                Some(AdvantageNormName::LeaveOneOut),
            ),
        };
        ObjectiveSettings {
            clip_mode: Some(clip_mode),
            proximal: Some(proximal),
            correction: Some(correction),
            advantage_norm,
            ..job
        }
    }
}

#[derive(Debug, Clone)]
pub struct StalenessBench {
    pub etas: Vec<u32>,
    pub objectives: Vec<Objective>,
    pub seeds: Vec<u64>,
    pub steps: u64,
    /// Evaluate every this many learner steps.
    pub eval_every: u64,
    /// Held-out greedy accuracy the "to target" columns measure.
    pub target: f64,
    pub out: PathBuf,
    /// Write the report from the runs already in `out/runs` (another
    /// target, say) instead of training.
    pub report_only: bool,
}

/// Evaluations at the end of a run that its final accuracy averages.
const FINAL_EVALS: usize = 3;

/// One learner step of one run.
#[derive(Debug, Clone)]
struct StepRow {
    step: u64,
    wall: f64,
    reward: f64,
    lag: f64,
    lag_max: f64,
}

/// One held-out evaluation of one run.
#[derive(Debug, Clone, Copy)]
struct EvalPoint {
    step: u64,
    samples: u64,
    wall: f64,
    accuracy: f64,
}

/// Everything one run produced.
#[derive(Debug, Clone)]
struct Run {
    eta: u32,
    objective: Objective,
    seed: u64,
    steps: Vec<StepRow>,
    evals: Vec<EvalPoint>,
    /// Dynamic sampling's drops, from the run's [`NO_SIGNAL_CSV`].
    no_signal: Option<NoSignalSummary>,
}

/// What dynamic sampling dropped in a run (written next to its CSVs).
const NO_SIGNAL_CSV: &str = "no_signal.csv";

fn read_no_signal(path: &Path) -> anyhow::Result<Option<NoSignalSummary>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    let row = text
        .lines()
        .nth(1)
        .with_context(|| format!("{} has no data row", path.display()))?;
    let (d, c) = row
        .split_once(',')
        .with_context(|| format!("{}: expected dropped,completed", path.display()))?;
    let num = |x: &str| {
        x.trim()
            .parse::<u64>()
            .with_context(|| format!("{}: {x:?} is not a count", path.display()))
    };
    Ok(Some(NoSignalSummary {
        dropped: num(d)?,
        completed: num(c)?,
    }))
}

impl Run {
    /// The mean of the last [`FINAL_EVALS`] evaluations: one evaluation
    /// of a small model moves by a few points from version to version.
    fn final_accuracy(&self) -> f64 {
        let n = self.evals.len();
        mean(
            self.evals[n.saturating_sub(FINAL_EVALS)..]
                .iter()
                .map(|e| e.accuracy),
        )
    }

    /// The mean of every evaluation after the first: the area under the
    /// curve, which counts how soon a run got where it got.
    fn mean_accuracy(&self) -> f64 {
        mean(self.evals.iter().skip(1).map(|e| e.accuracy))
    }

    /// The first evaluation at or above `target`.
    fn reached(&self, target: f64) -> Option<EvalPoint> {
        self.evals.iter().copied().find(|e| e.accuracy >= target)
    }

    fn mean_lag(&self) -> f64 {
        mean(self.steps.iter().map(|s| s.lag))
    }

    fn max_lag(&self) -> f64 {
        self.steps.iter().map(|s| s.lag_max).fold(0.0, f64::max)
    }

    fn wall(&self) -> f64 {
        self.steps.last().map_or(0.0, |s| s.wall)
    }
}

fn mean(v: impl Iterator<Item = f64>) -> f64 {
    let (n, sum) = v.fold((0usize, 0.0), |(n, s), x| (n + 1, s + x));
    if n == 0 { f64::NAN } else { sum / n as f64 }
}

fn read_steps(csv: &Path) -> anyhow::Result<Vec<StepRow>> {
    Ok(read_metrics(csv)?
        .into_iter()
        .map(|r| StepRow {
            step: r.step,
            wall: r.wall_seconds,
            reward: r.reward_mean,
            lag: r.version_lag_mean,
            lag_max: r.version_lag_max,
        })
        .collect())
}

/// The config of one run: the base with η, the objective, the seed, the
/// step budget and the evaluation cadence set.
fn run_config(
    base: &Config,
    bench: &StalenessBench,
    eta: u32,
    objective: Objective,
    seed: u64,
) -> anyhow::Result<Config> {
    let name = format!("eta{eta}-{}-seed{seed}", objective.as_str());
    let mut c = base.clone();
    c.staleness.eta = eta;
    let s = objective.settings();
    let knobs = &mut c.coordinator.initial_knobs;
    knobs.clip_mode = s.clip_mode.unwrap_or(knobs.clip_mode);
    knobs.importance_correction = s.correction.unwrap_or(knobs.importance_correction);
    knobs.dual_clip = s.dual_clip.unwrap_or(knobs.dual_clip);
    c.learner.proximal = s.proximal.unwrap_or(c.learner.proximal);
    c.learner.advantage_norm = s.advantage_norm.unwrap_or(c.learner.advantage_norm);
    c.learner.packing = s.packing.unwrap_or(c.learner.packing);
    c.worker.share_prompts = s.share_prompts.unwrap_or(c.worker.share_prompts);
    c.learner.forward_only_zero_advantage = s
        .forward_only_zero_advantage
        .unwrap_or(c.learner.forward_only_zero_advantage);
    c.eval.nice = s.eval_nice.unwrap_or(c.eval.nice);
    c.buffer.min_reward_spread = s.min_reward_spread.unwrap_or(c.buffer.min_reward_spread);
    c.run.seed = seed;
    c.run.max_steps = bench.steps;
    c.run.name = name.clone();
    c.run.output_dir = bench.out.join("runs").join(&name);
    c.telemetry.listen = String::new();
    c.coordinator.admin_listen = "127.0.0.1:0".into();
    c.eval.every_steps = bench.eval_every;
    c.validate()?;
    Ok(c)
}

/// Runs every setting and writes the report into `bench.out`.
pub async fn staleness(base: Config, bench: StalenessBench) -> anyhow::Result<String> {
    if base.eval.dataset.is_none() {
        anyhow::bail!(
            "bench staleness measures held-out accuracy: the base config needs [eval] dataset = {{ name, path }} (e.g. the output of `asyncrl data generate --task arith --all`)"
        );
    }
    if bench.eval_every == 0 {
        anyhow::bail!("--eval-every must be at least 1");
    }
    std::fs::create_dir_all(&bench.out)
        .with_context(|| format!("cannot create {}", bench.out.display()))?;
    let samples_per_step =
        u64::from(base.staleness.groups_per_step) * u64::from(base.staleness.group_size);
    let mut runs: Vec<Run> = Vec::new();
    let started = std::time::Instant::now();
    // Seeds outermost: a run cut short still leaves whole seeds of every
    // setting, and slow drifts of the machine spread over all settings.
    for &seed in &bench.seeds {
        for &eta in &bench.etas {
            for &objective in &bench.objectives {
                let c = run_config(&base, &bench, eta, objective, seed)?;
                let name = c.run.name.clone();
                let dir = c.run.output_dir.clone();
                if !bench.report_only {
                    eprintln!("bench staleness: {name} ...");
                    let summary = train(
                        c,
                        TrainOptions {
                            workers: 1,
                            fresh: true,
                            ..Default::default()
                        },
                    )
                    .await
                    .with_context(|| format!("run {name}"))?;
                    eprintln!(
                        "bench staleness: {name}: {} steps in {:.1}s",
                        summary.steps, summary.seconds
                    );
                    if let Some(n) = summary.no_signal {
                        let path = dir.join(NO_SIGNAL_CSV);
                        std::fs::write(
                            &path,
                            format!("dropped,completed\n{},{}\n", n.dropped, n.completed),
                        )
                        .with_context(|| format!("cannot write {}", path.display()))?;
                    }
                }
                let evals: Vec<EvalPoint> = read_eval(&dir.join(EVAL_CSV))
                    .with_context(|| format!("run {name}"))?
                    .into_iter()
                    .map(|r| EvalPoint {
                        step: r.step,
                        samples: r.step * samples_per_step,
                        wall: r.wall_seconds,
                        accuracy: r.scores.greedy.unwrap_or(f64::NAN),
                    })
                    .collect();
                let run = Run {
                    eta,
                    objective,
                    seed,
                    steps: read_steps(&dir.join(METRICS_CSV))
                        .with_context(|| format!("run {name}"))?,
                    evals,
                    no_signal: read_no_signal(&dir.join(NO_SIGNAL_CSV))?,
                };
                eprintln!(
                    "bench staleness: {name}: held-out accuracy {:.3} -> {:.3}, mean lag {:.2}",
                    run.evals.first().map_or(f64::NAN, |e| e.accuracy),
                    run.final_accuracy(),
                    run.mean_lag()
                );
                runs.push(run);
            }
        }
    }
    let files = write_report(&bench, &runs, samples_per_step)?;
    let mut report = std::fs::read_to_string(&files[0])
        .with_context(|| format!("cannot read {}", files[0].display()))?;
    let _ = writeln!(
        report,
        "\n{} runs of {} steps{} in {:.0}s\nwrote {}",
        runs.len(),
        bench.steps,
        if bench.report_only {
            " (report only)"
        } else {
            ""
        },
        started.elapsed().as_secs_f64(),
        files
            .iter()
            .map(|f| f.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(report)
}

/// The seed mean of the accuracy at each evaluation (and its min..max),
/// over the evaluations every seed has.
struct Curve {
    samples: Vec<f64>,
    wall: Vec<f64>,
    mean: Vec<f64>,
    band: Vec<(f64, f64)>,
}

fn curve(runs: &[&Run]) -> Curve {
    let n = runs.iter().map(|r| r.evals.len()).min().unwrap_or(0);
    let at = |i: usize| runs.iter().map(move |r| r.evals[i]);
    Curve {
        samples: (0..n)
            .map(|i| at(i).next().map_or(0.0, |e| e.samples as f64))
            .collect(),
        wall: (0..n).map(|i| mean(at(i).map(|e| e.wall))).collect(),
        mean: (0..n).map(|i| mean(at(i).map(|e| e.accuracy))).collect(),
        band: (0..n)
            .map(|i| {
                at(i).fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), e| {
                    (lo.min(e.accuracy), hi.max(e.accuracy))
                })
            })
            .collect(),
    }
}

/// Mean over seeds of what `f` gives, and how many seeds gave it.
fn mean_reached(runs: &[&Run], f: impl Fn(&Run) -> Option<f64>) -> (f64, usize) {
    let got: Vec<f64> = runs.iter().filter_map(|r| f(r)).collect();
    (mean(got.iter().copied()), got.len())
}

fn write_report(
    bench: &StalenessBench,
    runs: &[Run],
    samples_per_step: u64,
) -> anyhow::Result<Vec<PathBuf>> {
    let write = |name: &str, text: &str| -> anyhow::Result<PathBuf> {
        let path = bench.out.join(name);
        std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
        Ok(path)
    };
    let mut steps_csv = String::from(
        "eta,objective,seed,step,trained_samples,wall_seconds,reward_mean,version_lag_mean,version_lag_max\n",
    );
    let mut eval_csv =
        String::from("eta,objective,seed,step,trained_samples,wall_seconds,greedy_accuracy\n");
    for r in runs {
        for s in &r.steps {
            let _ = writeln!(
                steps_csv,
                "{},{},{},{},{},{:.3},{:.6},{:.4},{}",
                r.eta,
                r.objective.as_str(),
                r.seed,
                s.step,
                s.step * samples_per_step,
                s.wall,
                s.reward,
                s.lag,
                s.lag_max
            );
        }
        for e in &r.evals {
            let _ = writeln!(
                eval_csv,
                "{},{},{},{},{},{:.3},{:.6}",
                r.eta,
                r.objective.as_str(),
                r.seed,
                e.step,
                e.samples,
                e.wall,
                e.accuracy
            );
        }
    }
    let steps_path = write("staleness.csv", &steps_csv)?;
    let eval_path = write("staleness_eval.csv", &eval_csv)?;

    // Settings in the order asked for; each with its seeds' runs.
    let mut settings: BTreeMap<(usize, usize), Vec<&Run>> = BTreeMap::new();
    for r in runs {
        let ei = bench.etas.iter().position(|e| *e == r.eta).unwrap_or(0);
        let oi = bench
            .objectives
            .iter()
            .position(|o| *o == r.objective)
            .unwrap_or(0);
        settings.entry((oi, ei)).or_default().push(r);
    }
    let mut by_samples = Vec::new();
    let mut by_time = Vec::new();
    for (oi, objective) in bench.objectives.iter().enumerate() {
        let mut s_series = Vec::new();
        let mut t_series = Vec::new();
        for (ei, eta) in bench.etas.iter().enumerate() {
            let Some(rs) = settings.get(&(oi, ei)) else {
                continue;
            };
            let c = curve(rs);
            if c.mean.is_empty() {
                continue;
            }
            s_series.push(Series {
                name: format!("η={eta}"),
                points: c
                    .samples
                    .iter()
                    .copied()
                    .zip(c.mean.iter().copied())
                    .collect(),
                band: Some(c.band.clone()),
            });
            t_series.push(Series {
                name: format!("η={eta}"),
                points: c.wall.iter().copied().zip(c.mean.iter().copied()).collect(),
                band: Some(c.band),
            });
        }
        by_samples.push((objective.as_str().to_owned(), s_series));
        by_time.push((objective.as_str().to_owned(), t_series));
    }
    let seeds = bench.seeds.len();
    let samples_png = bench.out.join("accuracy_vs_samples.png");
    panel_chart(
        &samples_png,
        &format!(
            "Held-out greedy accuracy vs trained samples (mean, band: min..max of {seeds} seeds)"
        ),
        "trained samples",
        "held-out greedy accuracy",
        &by_samples,
    )?;
    let time_png = bench.out.join("accuracy_vs_wallclock.png");
    panel_chart(
        &time_png,
        &format!("Held-out greedy accuracy vs wall-clock (mean, band: min..max of {seeds} seeds)"),
        "seconds since the learner started",
        "held-out greedy accuracy",
        &by_time,
    )?;

    let md = markdown(bench, &settings);
    let md_path = write("staleness.md", &md)?;
    Ok(vec![md_path, steps_path, eval_path, samples_png, time_png])
}

fn markdown(bench: &StalenessBench, settings: &BTreeMap<(usize, usize), Vec<&Run>>) -> String {
    let target = bench.target;
    let seeds = bench.seeds.len();
    let mut md = String::new();
    let _ = writeln!(
        md,
        "| η | objective | final held-out accuracy (mean of the last {FINAL_EVALS} evaluations; mean ± half-range over {seeds} seeds) | mean accuracy over the run | trained samples to {target:.2} | time to {target:.2} (s) | mean / max staleness (versions) | wall time (s) |"
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|");
    // (objective index, eta) -> (final mean, time to target mean, seeds reaching)
    let mut finals: BTreeMap<(usize, u32), (f64, f64, usize)> = BTreeMap::new();
    for (&(oi, ei), rs) in settings {
        let eta = bench.etas[ei];
        let objective = bench.objectives[oi];
        let fs: Vec<f64> = rs.iter().map(|r| r.final_accuracy()).collect();
        let fmean = mean(fs.iter().copied());
        let half = (fs.iter().copied().fold(f64::NEG_INFINITY, f64::max)
            - fs.iter().copied().fold(f64::INFINITY, f64::min))
            / 2.0;
        let (t, n_t) = mean_reached(rs, |r| r.reached(target).map(|e| e.wall));
        let (smp, _) = mean_reached(rs, |r| r.reached(target).map(|e| e.samples as f64));
        let reach = |v: f64, fmt: &dyn Fn(f64) -> String| match n_t {
            0 => "not reached".to_owned(),
            n if n == rs.len() => fmt(v),
            n => format!("{} ({n} of {} seeds)", fmt(v), rs.len()),
        };
        let auc = mean(rs.iter().map(|r| r.mean_accuracy()));
        let lag = mean(rs.iter().map(|r| r.mean_lag()));
        let lag_max = rs.iter().map(|r| r.max_lag()).fold(0.0, f64::max);
        let wall = mean(rs.iter().map(|r| r.wall()));
        let _ = writeln!(
            md,
            "| {eta} | {} | {fmean:.3} ± {half:.3} | {auc:.3} | {} | {} | {lag:.2} / {lag_max:.0} | {wall:.1} |",
            objective.as_str(),
            reach(smp, &|v| format!("{v:.0}")),
            reach(t, &|v| format!("{v:.1}")),
        );
        finals.insert(
            (oi, eta),
            (fmean, if n_t == rs.len() { t } else { f64::NAN }, n_t),
        );
    }

    // What staleness costs: final accuracy at each η against η = 0.
    if bench.etas.contains(&0) {
        let _ = writeln!(
            md,
            "\n**Cost of staleness** (final held-out accuracy at η minus at η = 0, same objective):\n"
        );
        let _ = writeln!(
            md,
            "| objective | {} |",
            bench
                .etas
                .iter()
                .filter(|e| **e != 0)
                .map(|e| format!("η = {e}"))
                .collect::<Vec<_>>()
                .join(" | ")
        );
        let _ = writeln!(
            md,
            "|---|{}",
            "---|".repeat(bench.etas.iter().filter(|e| **e != 0).count())
        );
        for (oi, o) in bench.objectives.iter().enumerate() {
            let Some(&(base, _, _)) = finals.get(&(oi, 0)) else {
                continue;
            };
            let cells: Vec<String> = bench
                .etas
                .iter()
                .filter(|e| **e != 0)
                .map(|e| {
                    finals
                        .get(&(oi, *e))
                        .map_or("—".to_owned(), |f| format!("{:+.3}", f.0 - base))
                })
                .collect();
            let _ = writeln!(md, "| {} | {} |", o.as_str(), cells.join(" | "));
        }
    }

    // Sync against async: wall-clock time to the target accuracy.
    let sync_best = finals
        .iter()
        .filter(|((_, eta), f)| *eta == 0 && f.1.is_finite())
        .min_by(|a, b| a.1.1.total_cmp(&b.1.1));
    let async_best = finals
        .iter()
        .filter(|((_, eta), f)| *eta > 0 && f.1.is_finite())
        .min_by(|a, b| a.1.1.total_cmp(&b.1.1));
    let _ = writeln!(
        md,
        "\n**Sync vs async** (wall-clock seconds to held-out accuracy {target:.2}, mean over seeds; settings where every seed reached it):\n"
    );
    match (sync_best, async_best) {
        (Some(((so, _), s)), Some(((ao, aeta), a))) => {
            let _ = writeln!(
                md,
                "- fastest synchronous (η = 0): {} in {:.1} s",
                bench.objectives[*so].as_str(),
                s.1
            );
            let _ = writeln!(
                md,
                "- fastest asynchronous: η = {aeta}, {} in {:.1} s",
                bench.objectives[*ao].as_str(),
                a.1
            );
            let _ = writeln!(
                md,
                "- ratio sync / async: **{:.2}** (above 1: async reaches the target sooner)",
                s.1 / a.1
            );
        }
        _ => {
            let _ = writeln!(
                md,
                "- not measurable: the target was not reached by every seed of a synchronous and an asynchronous setting"
            );
        }
    }
    for (oi, o) in bench.objectives.iter().enumerate() {
        let Some(&(_, sync_t, _)) = finals.get(&(oi, 0)) else {
            continue;
        };
        let best = finals
            .iter()
            .filter(|((i, eta), f)| *i == oi && *eta > 0 && f.1.is_finite())
            .min_by(|a, b| a.1.1.total_cmp(&b.1.1));
        if let (true, Some(((_, eta), f))) = (sync_t.is_finite(), best) {
            let _ = writeln!(
                md,
                "- {}: η = 0 {:.1} s, best η = {eta} {:.1} s, ratio {:.2}",
                o.as_str(),
                sync_t,
                f.1,
                sync_t / f.1
            );
        }
    }
    let dropped: Vec<&Run> = settings
        .values()
        .flatten()
        .copied()
        .filter(|r| r.no_signal.is_some())
        .collect();
    if !dropped.is_empty() {
        let _ = writeln!(
            md,
            "\n**Dynamic sampling** (groups dropped for no reward signal, of the groups completed; \
             the samples columns count trained samples, so the samples generated are more by \
             this share):\n"
        );
        for r in dropped {
            if let Some(n) = r.no_signal {
                let _ = writeln!(
                    md,
                    "- η = {}, {}, seed {}: {} of {} ({:.1} %)",
                    r.eta,
                    r.objective.as_str(),
                    r.seed,
                    n.dropped,
                    n.completed,
                    100.0 * n.fraction()
                );
            }
        }
    }
    md
}
