//! `asyncrl bench staleness`: the same task and budget under η ∈ {…} ×
//! clip ∈ {…} × seeds, each a full one-process run from the same starting
//! model; writes a CSV of every step, PNG curves (reward vs trained samples
//! and vs wall-clock, one line per setting with the seed spread) and a
//! markdown table (final reward, time to a target reward, mean staleness).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use asyncrl_config::{ClipModeName, Config};

use crate::metrics_csv::read_columns;
use crate::plot::{Series, line_chart, smooth};
use crate::train::{TrainOptions, train};

#[derive(Debug, Clone)]
pub struct StalenessBench {
    pub etas: Vec<u32>,
    pub clips: Vec<ClipModeName>,
    pub seeds: Vec<u64>,
    pub steps: u64,
    /// Reward the "time to target" column measures.
    pub target: f64,
    pub out: PathBuf,
}

/// One step of one run.
#[derive(Debug, Clone)]
struct Row {
    eta: u32,
    clip: ClipModeName,
    seed: u64,
    step: u64,
    samples: u64,
    wall: f64,
    reward: f64,
    lag: f64,
}

fn read_run(
    csv: &Path,
    eta: u32,
    clip: ClipModeName,
    seed: u64,
    samples_per_step: u64,
) -> anyhow::Result<Vec<Row>> {
    let rows = read_columns(
        csv,
        &["step", "wall_seconds", "reward_mean", "version_lag_mean"],
    )?;
    Ok(rows
        .into_iter()
        .map(|r| {
            let step = r[0] as u64;
            Row {
                eta,
                clip,
                seed,
                step,
                samples: step * samples_per_step,
                wall: r[1],
                reward: r[2],
                lag: r[3],
            }
        })
        .collect())
}

/// Runs every setting and writes the report into `bench.out`.
pub async fn staleness(base: Config, bench: StalenessBench) -> anyhow::Result<String> {
    std::fs::create_dir_all(&bench.out)
        .with_context(|| format!("cannot create {}", bench.out.display()))?;
    let samples_per_step =
        u64::from(base.staleness.groups_per_step) * u64::from(base.staleness.group_size);
    let mut all: Vec<Row> = Vec::new();
    let started = std::time::Instant::now();
    for &eta in &bench.etas {
        for &clip in &bench.clips {
            for &seed in &bench.seeds {
                let name = format!("eta{eta}-{}-seed{seed}", clip.as_str());
                let mut c = base.clone();
                c.staleness.eta = eta;
                c.coordinator.initial_knobs.clip_mode = clip;
                c.run.seed = seed;
                c.run.max_steps = bench.steps;
                c.run.name = name.clone();
                c.run.output_dir = bench.out.join("runs").join(&name);
                c.telemetry.listen = String::new();
                c.coordinator.admin_listen = "127.0.0.1:0".into();
                c.validate()?;
                if c.run.output_dir.exists() {
                    std::fs::remove_dir_all(&c.run.output_dir)
                        .with_context(|| format!("cannot clear {}", c.run.output_dir.display()))?;
                }
                eprintln!("bench staleness: {name} ...");
                let summary = train(
                    c,
                    TrainOptions {
                        workers: 1,
                        ..Default::default()
                    },
                )
                .await
                .with_context(|| format!("run {name}"))?;
                eprintln!(
                    "bench staleness: {name}: {} steps in {:.1}s, reward {:.3} -> {:.3}",
                    summary.steps, summary.seconds, summary.reward_first, summary.reward_last
                );
                all.extend(read_run(
                    &summary.metrics_csv,
                    eta,
                    clip,
                    seed,
                    samples_per_step,
                )?);
            }
        }
    }
    let mut csv = String::from(
        "eta,clip,seed,step,trained_samples,wall_seconds,reward_mean,version_lag_mean\n",
    );
    for r in &all {
        let _ = writeln!(
            csv,
            "{},{},{},{},{},{:.3},{:.6},{:.4}",
            r.eta,
            r.clip.as_str(),
            r.seed,
            r.step,
            r.samples,
            r.wall,
            r.reward,
            r.lag
        );
    }
    let csv_path = bench.out.join("staleness.csv");
    std::fs::write(&csv_path, csv)
        .with_context(|| format!("cannot write {}", csv_path.display()))?;

    // One line per (eta, clip): the seed mean of the smoothed reward, with
    // the min..max over seeds as a band.
    let window = (bench.steps as usize / 10).max(1);
    let mut by_samples = Vec::new();
    let mut by_time = Vec::new();
    let mut table = String::new();
    let _ = writeln!(
        table,
        "| η | clip | final reward (mean ± spread over {} seeds) | time to reward {:.2} (s) | mean staleness (versions) | wall time (s) |",
        bench.seeds.len(),
        bench.target
    );
    let _ = writeln!(table, "|---|---|---|---|---|---|");
    for &eta in &bench.etas {
        for &clip in &bench.clips {
            let runs: Vec<Vec<&Row>> = bench
                .seeds
                .iter()
                .map(|s| {
                    all.iter()
                        .filter(|r| r.eta == eta && r.clip == clip && r.seed == *s)
                        .collect()
                })
                .collect();
            let n = runs.iter().map(Vec::len).min().unwrap_or(0);
            if n == 0 {
                continue;
            }
            let smoothed: Vec<Vec<(f64, f64)>> = runs
                .iter()
                .map(|rows| {
                    smooth(
                        &rows
                            .iter()
                            .map(|r| (r.samples as f64, r.reward))
                            .collect::<Vec<_>>(),
                        window,
                    )
                })
                .collect();
            let mean_at =
                |i: usize| smoothed.iter().map(|s| s[i].1).sum::<f64>() / smoothed.len() as f64;
            let points: Vec<(f64, f64)> = (0..n).map(|i| (smoothed[0][i].0, mean_at(i))).collect();
            let band: Vec<(f64, f64)> = (0..n)
                .map(|i| {
                    let v = smoothed.iter().map(|s| s[i].1);
                    (
                        v.clone().fold(f64::INFINITY, f64::min),
                        v.fold(f64::NEG_INFINITY, f64::max),
                    )
                })
                .collect();
            let label = format!("η={eta} {}", clip.as_str());
            by_samples.push(Series {
                name: label.clone(),
                points,
                band: Some(band),
            });
            let wall: Vec<(f64, f64)> = (0..n)
                .map(|i| {
                    (
                        runs.iter().map(|r| r[i].wall).sum::<f64>() / runs.len() as f64,
                        mean_at(i),
                    )
                })
                .collect();
            by_time.push(Series {
                name: label,
                points: wall.clone(),
                band: None,
            });

            let tail = (n / 10).max(1);
            let finals: Vec<f64> = runs
                .iter()
                .map(|r| r[n - tail..n].iter().map(|x| x.reward).sum::<f64>() / tail as f64)
                .collect();
            let fmean = finals.iter().sum::<f64>() / finals.len() as f64;
            let spread = finals.iter().fold(0.0f64, |m, f| m.max((f - fmean).abs()));
            let time_to = wall
                .iter()
                .find(|(_, r)| *r >= bench.target)
                .map(|(t, _)| format!("{t:.1}"))
                .unwrap_or("not reached".into());
            let lag = runs.iter().flatten().map(|r| r.lag).sum::<f64>()
                / runs.iter().map(Vec::len).sum::<usize>() as f64;
            let total_wall = runs.iter().map(|r| r[n - 1].wall).sum::<f64>() / runs.len() as f64;
            let _ = writeln!(
                table,
                "| {eta} | {} | {fmean:.3} ± {spread:.3} | {time_to} | {lag:.2} | {total_wall:.1} |",
                clip.as_str()
            );
        }
    }
    let samples_png = bench.out.join("reward_vs_samples.png");
    line_chart(
        &samples_png,
        "Reward vs trained samples",
        "trained samples",
        "mean reward (smoothed)",
        &by_samples,
    )?;
    let time_png = bench.out.join("reward_vs_wallclock.png");
    line_chart(
        &time_png,
        "Reward vs wall-clock",
        "seconds",
        "mean reward (smoothed)",
        &by_time,
    )?;
    let table_path = bench.out.join("staleness.md");
    std::fs::write(&table_path, &table)
        .with_context(|| format!("cannot write {}", table_path.display()))?;
    let mut report = table;
    let _ = writeln!(
        report,
        "\n{} runs of {} steps in {:.0}s\nwrote {}, {}, {}, {}",
        all.iter()
            .map(|r| (r.eta, r.clip.as_str(), r.seed))
            .collect::<std::collections::HashSet<_>>()
            .len(),
        bench.steps,
        started.elapsed().as_secs_f64(),
        csv_path.display(),
        samples_png.display(),
        time_png.display(),
        table_path.display()
    );
    Ok(report)
}
