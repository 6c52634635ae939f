//! `asyncrl-bench scale`: how each role's cost grows with its work.
//!
//! - **coordinator** (`scale_coordinator.rs`): the real coordinator as its
//!   own process (`asyncrl coordinator`) over a private nats-server, and W
//!   scripted workers in this process speaking the real protos at a
//!   worker's rates (register, heartbeat every `heartbeat_interval` with the
//!   held leases, acquire → hold → complete per slot). Measured: the
//!   coordinator process's CPU seconds per wall second (`/proc/<pid>/stat`)
//!   and acquire → grant latency p50/p99, vs W;
//! - **buffer** (`scale_buffer.rs`): the buffer's core in process holding N
//!   short trajectories; resident bytes per token (`/proc/self/statm` delta
//!   and the core's own Arrow accounting) and the time to serve a 64-group
//!   batch (plan, commit, gather, encode), vs N;
//! - **learner** (`scale_learner.rs`): one real `Trainer::train_step` of the
//!   built-in model on one thread, vs batch tokens.
//!
//! Each curve is a CSV and PNGs; `scale.md` lists every curve with the
//! least-squares fit of a constant, a logarithmic and a linear model and
//! names the growth that fits best.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;

use super::{load_average, scale_buffer, scale_coordinator, scale_learner};
use asyncrl_app::plot::{Series, line_chart};

#[derive(Debug, Args)]
pub struct ScaleArgs {
    /// Which curves to measure (coordinator, buffer, learner).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "coordinator,buffer,learner"
    )]
    only: Vec<String>,
    /// Simulated worker counts of the coordinator curve.
    #[arg(long, value_delimiter = ',', default_value = "1,10,100,300,1000")]
    workers: Vec<usize>,
    /// Untimed time after the workers started, per worker count.
    #[arg(long, default_value = "5s", value_parser = super::chaos::parse_duration)]
    warmup: Duration,
    /// Measured time per worker count.
    #[arg(long, default_value = "20s", value_parser = super::chaos::parse_duration)]
    window: Duration,
    /// Mean time a simulated worker holds a task (uniform in 0.5..1.5 × it).
    #[arg(long, default_value = "4s", value_parser = super::chaos::parse_duration)]
    task_time: Duration,
    /// Tasks each simulated worker holds at once.
    #[arg(long, default_value_t = 2)]
    slots: usize,
    /// The coordinator's heartbeat interval (what workers are told).
    #[arg(long, default_value = "2s", value_parser = super::chaos::parse_duration)]
    heartbeat: Duration,
    /// NATS connections the simulated workers share.
    #[arg(long, default_value_t = 16)]
    connections: usize,
    /// Resident trajectory counts of the buffer curve.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "10000,30000,100000,300000,1000000"
    )]
    trajectories: Vec<usize>,
    /// Completion tokens of each buffered trajectory (plus a 16-token prompt).
    #[arg(long, default_value_t = 32)]
    completion_tokens: usize,
    /// Timed 64-group serves per resident count (the median counts).
    #[arg(long, default_value_t = 10)]
    serves: usize,
    /// Batch sizes (tokens) of the learner curve.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "512,1024,2048,4096,8192,16384"
    )]
    batch_tokens: Vec<usize>,
    /// Tokens of each trained sequence (16 of them prompt).
    #[arg(long, default_value_t = 64)]
    seq_tokens: usize,
    /// Timed learner steps per batch size (after one untimed).
    #[arg(long, default_value_t = 3)]
    iterations: usize,
    #[arg(long, default_value = "docs/results/scale")]
    out: PathBuf,
}

pub(crate) fn run(rt: &tokio::runtime::Runtime, args: ScaleArgs) -> anyhow::Result<String> {
    for what in &args.only {
        anyhow::ensure!(
            ["coordinator", "buffer", "learner"].contains(&what.as_str()),
            "--only: unknown curve {what:?} (coordinator, buffer, learner)"
        );
    }
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create {}", args.out.display()))?;
    let wants = |w: &str| args.only.iter().any(|o| o == w);
    let load_before = load_average();
    let started = std::time::Instant::now();
    let mut sections = Vec::new();
    if wants("coordinator") {
        let opts = scale_coordinator::Options {
            workers: args.workers.clone(),
            warmup: args.warmup,
            window: args.window,
            task_time: args.task_time,
            slots: args.slots.max(1),
            heartbeat: args.heartbeat,
            connections: args.connections.max(1),
        };
        let curve = scale_coordinator::measure(rt, &opts).context("coordinator curve")?;
        sections.push(curve.write(&args.out)?);
    }
    if wants("buffer") {
        let opts = scale_buffer::Options {
            trajectories: args.trajectories.clone(),
            completion_tokens: args.completion_tokens.max(1),
            serves: args.serves.max(1),
        };
        let curve = scale_buffer::measure(&opts).context("buffer curve")?;
        sections.push(curve.write(&args.out)?);
    }
    if wants("learner") {
        let opts = scale_learner::Options {
            batch_tokens: args.batch_tokens.clone(),
            seq_tokens: args.seq_tokens.max(17),
            iterations: args.iterations.max(1),
        };
        let curve = scale_learner::measure(&opts).context("learner curve")?;
        sections.push(curve.write(&args.out)?);
    }
    let mut md = String::new();
    let _ = writeln!(md, "# Cost curves (`asyncrl-bench scale`)\n");
    let _ = writeln!(
        md,
        "    {}\n",
        std::env::args().collect::<Vec<_>>().join(" ")
    );
    let _ = writeln!(
        md,
        "Measured {} UTC on {} ({} CPUs); load average {} before, {} after; {:.0} s in all.\n",
        utc_now(),
        hostname(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load_before,
        load_average(),
        started.elapsed().as_secs_f64()
    );
    let _ = writeln!(
        md,
        "Each metric is fitted by least squares as a constant `a`, a logarithm `a + b·ln x` and a line `a + b·x`; \
         `best` is the constant when the spread is within 10 % of the mean, else the model with the higher R² \
         (`slope` is the log-log slope: 0 flat, 1 linear). PNGs plot log10(x).\n"
    );
    for s in &sections {
        md.push_str(s);
        md.push('\n');
    }
    let path = args.out.join("scale.md");
    std::fs::write(&path, &md).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(format!("{md}\nwritten: {}\n", args.out.display()))
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "unknown host".into())
}

fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}",
        rem / 3600,
        (rem % 3600) / 60
    )
}

/// CPU seconds (user + system) a process has used, from `/proc/<pid>/stat`
/// (`"self"` for this process).
pub(crate) fn process_cpu_seconds(pid: &str) -> anyhow::Result<f64> {
    let path = format!("/proc/{pid}/stat");
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {path}"))?;
    // The command name may hold spaces: the fields start after its ')'.
    let rest = text
        .rsplit_once(')')
        .map(|(_, r)| r)
        .with_context(|| format!("{path} has no command field"))?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat(5); `rest` starts at 3.
    let ticks = |i: usize| -> anyhow::Result<f64> {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .map(|v| v as f64)
            .with_context(|| format!("{path}: field {} is not a number", i + 3))
    };
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    anyhow::ensure!(hz > 0, "sysconf(_SC_CLK_TCK) failed");
    Ok((ticks(11)? + ticks(12)?) / hz as f64)
}

/// A percentile (0..=100) of `xs` by the nearest rank; NaN when empty.
pub(crate) fn percentile(xs: &mut [f64], p: f64) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * xs.len() as f64).ceil() as usize;
    xs[rank.clamp(1, xs.len()) - 1]
}

// ------------------------------------------------------------ fitting

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Growth {
    Constant,
    Log,
    Linear,
}

impl Growth {
    fn name(self) -> &'static str {
        match self {
            Growth::Constant => "constant",
            Growth::Log => "log",
            Growth::Linear => "linear",
        }
    }
}

/// One least-squares fit `a + b·f(x)`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fit {
    pub growth: Growth,
    pub a: f64,
    pub b: f64,
    pub r2: f64,
    /// Root mean square error.
    pub rmse: f64,
}

impl Fit {
    pub fn at(&self, x: f64) -> f64 {
        match self.growth {
            Growth::Constant => self.a,
            Growth::Log => self.a + self.b * x.ln(),
            Growth::Linear => self.a + self.b * x,
        }
    }

    fn formula(&self) -> String {
        match self.growth {
            Growth::Constant => format!("{:.4}", self.a),
            Growth::Log => format!("{:.4} + {:.4}·ln x", self.a, self.b),
            Growth::Linear => format!("{:.4} + {:.4e}·x", self.a, self.b),
        }
    }
}

/// The three fits of `(x, y)` points (x > 0) and the index of the best.
#[derive(Debug, Clone)]
pub(crate) struct Fits {
    pub fits: [Fit; 3],
    pub best: usize,
    /// Slope of ln y against ln x (NaN when a y is not positive).
    pub loglog_slope: f64,
}

impl Fits {
    pub fn best(&self) -> Fit {
        self.fits[self.best]
    }
}

/// Least squares of `y = a + b·u`: (a, b).
fn line(us: &[f64], ys: &[f64]) -> (f64, f64) {
    let n = us.len() as f64;
    let (mu, my) = (us.iter().sum::<f64>() / n, ys.iter().sum::<f64>() / n);
    let sxx: f64 = us.iter().map(|u| (u - mu).powi(2)).sum();
    let sxy: f64 = us.iter().zip(ys).map(|(u, y)| (u - mu) * (y - my)).sum();
    let b = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    (my - b * mu, b)
}

pub(crate) fn fit(points: &[(f64, f64)]) -> Fits {
    let xs: Vec<f64> = points.iter().map(|p| p.0).collect();
    let ys: Vec<f64> = points.iter().map(|p| p.1).collect();
    let n = ys.len().max(1) as f64;
    let mean = ys.iter().sum::<f64>() / n;
    let sst: f64 = ys.iter().map(|y| (y - mean).powi(2)).sum();
    let make = |growth: Growth, a: f64, b: f64| {
        let mut f = Fit {
            growth,
            a,
            b,
            r2: 0.0,
            rmse: 0.0,
        };
        let sse: f64 = xs
            .iter()
            .zip(&ys)
            .map(|(x, y)| (y - f.at(*x)).powi(2))
            .sum();
        f.r2 = if sst > 0.0 { 1.0 - sse / sst } else { 1.0 };
        f.rmse = (sse / n).sqrt();
        f
    };
    let logs: Vec<f64> = xs.iter().map(|x| x.ln()).collect();
    let (la, lb) = line(&logs, &ys);
    let (na, nb) = line(&xs, &ys);
    let fits = [
        make(Growth::Constant, mean, 0.0),
        make(Growth::Log, la, lb),
        make(Growth::Linear, na, nb),
    ];
    // Flat within noise: every point within 10 % of the mean.
    let flat = ys
        .iter()
        .all(|y| (y - mean).abs() <= 0.10 * mean.abs().max(f64::MIN_POSITIVE));
    let best = if flat || ys.len() < 3 {
        0
    } else if fits[2].r2 >= fits[1].r2 {
        2
    } else {
        1
    };
    let loglog_slope = if ys.iter().all(|y| *y > 0.0) {
        let ly: Vec<f64> = ys.iter().map(|y| y.ln()).collect();
        line(&logs, &ly).1
    } else {
        f64::NAN
    };
    Fits {
        fits,
        best,
        loglog_slope,
    }
}

// ------------------------------------------------------------ output

/// One measured curve: a CSV of its rows, and metrics fitted against `x`.
pub(crate) struct Curve {
    /// File stem (`coordinator`, `buffer`, `learner`).
    pub name: &'static str,
    pub title: String,
    /// What x is, e.g. "simulated workers".
    pub x_label: &'static str,
    pub header: Vec<&'static str>,
    pub rows: Vec<Vec<f64>>,
    /// Column of x in `rows`.
    pub x_col: usize,
    /// Charts: (file suffix, y label, columns plotted, fitted).
    pub charts: Vec<Chart>,
    /// Markdown before the table (setup, caveats).
    pub notes: String,
    /// Markdown after the fits (e.g. the headline figures).
    pub headline: String,
}

pub(crate) struct Chart {
    pub suffix: &'static str,
    pub y_label: &'static str,
    pub columns: Vec<usize>,
}

fn fmt_num(v: f64) -> String {
    if !v.is_finite() || (v.fract() == 0.0 && v.abs() < 1e15) || v.abs() >= 1000.0 {
        format!("{v:.0}")
    } else if v.abs() >= 0.01 {
        format!("{v:.3}")
    } else {
        format!("{v:.3e}")
    }
}

impl Curve {
    fn points(&self, col: usize) -> Vec<(f64, f64)> {
        self.rows
            .iter()
            .map(|r| (r[self.x_col], r[col]))
            .filter(|(x, y)| *x > 0.0 && y.is_finite())
            .collect()
    }

    /// Writes `<name>.csv` and a PNG per chart; returns the markdown section.
    pub fn write(&self, out: &Path) -> anyhow::Result<String> {
        let csv_path = out.join(format!("{}.csv", self.name));
        let mut csv = self.header.join(",");
        csv.push('\n');
        for r in &self.rows {
            let cells: Vec<String> = r.iter().map(|v| format!("{v}")).collect();
            csv.push_str(&cells.join(","));
            csv.push('\n');
        }
        std::fs::write(&csv_path, csv)
            .with_context(|| format!("cannot write {}", csv_path.display()))?;

        let mut md = String::new();
        let _ = writeln!(md, "## {}\n", self.title);
        md.push_str(&self.notes);
        let _ = writeln!(md, "\n| {} |", self.header.join(" | "));
        let _ = writeln!(md, "|{}", "---|".repeat(self.header.len()));
        for r in &self.rows {
            let cells: Vec<String> = r.iter().map(|v| fmt_num(*v)).collect();
            let _ = writeln!(md, "| {} |", cells.join(" | "));
        }
        let _ = writeln!(
            md,
            "\n| metric vs {} | best | fit | R² constant / log / linear | log-log slope |",
            self.x_label
        );
        let _ = writeln!(md, "|---|---|---|---|---|");
        let mut files = vec![format!("`{}.csv`", self.name)];
        for chart in &self.charts {
            let mut series = Vec::new();
            for &col in &chart.columns {
                let points = self.points(col);
                if points.len() < 2 {
                    continue;
                }
                let fits = fit(&points);
                let best = fits.best();
                let r2: Vec<String> = fits.fits[1..]
                    .iter()
                    .map(|f| format!("{:.3}", f.r2))
                    .collect();
                let _ = writeln!(
                    md,
                    "| {} | **{}** | {} (RMSE {}) | — / {} | {:.2} |",
                    self.header[col],
                    best.growth.name(),
                    best.formula(),
                    fmt_num(best.rmse),
                    r2.join(" / "),
                    fits.loglog_slope
                );
                let (x0, x1) = (points[0].0, points[points.len() - 1].0);
                let dense: Vec<(f64, f64)> = (0..=40)
                    .map(|i| {
                        let x = (x0.ln() + (x1.ln() - x0.ln()) * f64::from(i) / 40.0).exp();
                        (x.log10(), best.at(x))
                    })
                    .collect();
                series.push(Series {
                    name: self.header[col].to_owned(),
                    points: points.iter().map(|(x, y)| (x.log10(), *y)).collect(),
                    band: None,
                });
                series.push(Series {
                    name: format!("{} fit ({})", self.header[col], best.growth.name()),
                    points: dense,
                    band: None,
                });
            }
            if series.is_empty() {
                continue;
            }
            let file = format!("{}_{}.png", self.name, chart.suffix);
            line_chart(
                &out.join(&file),
                &self.title,
                &format!("log10({})", self.x_label),
                chart.y_label,
                &series,
            )?;
            files.push(format!("`{file}`"));
        }
        md.push('\n');
        md.push_str(&self.headline);
        let _ = writeln!(md, "\nFiles: {}.", files.join(", "));
        Ok(md)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn xs() -> Vec<f64> {
        vec![1.0, 10.0, 100.0, 300.0, 1000.0]
    }

    #[test]
    fn each_growth_is_recognised() {
        let linear: Vec<(f64, f64)> = xs().into_iter().map(|x| (x, 0.5 * x)).collect();
        let log: Vec<(f64, f64)> = xs().into_iter().map(|x| (x, 3.0 + 2.0 * x.ln())).collect();
        let flat: Vec<(f64, f64)> = xs()
            .into_iter()
            .enumerate()
            .map(|(i, x)| (x, 10.0 + if i % 2 == 0 { 0.3 } else { -0.3 }))
            .collect();
        let f = fit(&linear);
        assert_eq!(f.best().growth, Growth::Linear);
        assert!((f.best().b - 0.5).abs() < 1e-9 && f.best().r2 > 0.999_999);
        assert!((f.loglog_slope - 1.0).abs() < 1e-9, "{}", f.loglog_slope);
        let f = fit(&log);
        assert_eq!(f.best().growth, Growth::Log);
        assert!((f.best().b - 2.0).abs() < 1e-9);
        let f = fit(&flat);
        assert_eq!(f.best().growth, Growth::Constant);
        assert!((f.best().a - 10.0).abs() < 0.2);
    }

    #[test]
    fn percentile_by_nearest_rank() {
        let mut v: Vec<f64> = (1..=100).map(f64::from).rev().collect();
        assert_eq!(percentile(&mut v, 50.0), 50.0);
        assert_eq!(percentile(&mut v, 99.0), 99.0);
        assert_eq!(percentile(&mut v, 100.0), 100.0);
        assert!(percentile(&mut [], 50.0).is_nan());
    }

    #[test]
    fn own_cpu_time_is_read_and_grows() {
        // Busy until the clock-tick counter moves (a reader that returned
        // a constant would spin to the bound and fail).
        let before = process_cpu_seconds("self").expect("read /proc/self/stat");
        let mut x = 0u64;
        let t = std::time::Instant::now();
        let mut after = before;
        while after <= before && t.elapsed() < Duration::from_secs(60) {
            for _ in 0..1_000_000 {
                x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            }
            after = process_cpu_seconds("self").expect("read /proc/self/stat");
        }
        std::hint::black_box(x);
        assert!(after > before, "{before} -> {after}");
    }
}
