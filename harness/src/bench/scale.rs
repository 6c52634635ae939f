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
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;

use super::{load_average, scale_buffer, scale_coordinator, scale_learner};

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
