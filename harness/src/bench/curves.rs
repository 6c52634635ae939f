//! What the scale bench's curves share: the CPU time of a process, the
//! least-squares fits (constant, logarithmic, linear) that name a curve's
//! growth, and a [`Curve`]'s CSV, charts and Markdown. `scale.rs` runs the
//! curves; `scale_coordinator.rs`, `scale_buffer.rs` and
//! `scale_learner.rs` measure them with these.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context as _;

use asyncrl_app::plot::{Series, line_chart};

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
    use std::time::Duration;

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
