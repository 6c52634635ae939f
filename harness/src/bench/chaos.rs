//! `asyncrl-bench chaos`: a soak of the whole system under random faults,
//! with its invariants checked while it runs and at the end.
//!
//! Every role runs as a child process of this binary (coordinator, buffer,
//! learner, two or more rollout workers) over a private nats-server, with
//! the tiny built-in model and short sequences (fast steps). A seeded RNG
//! plans the faults before the run starts (times relative to the start, so
//! a seed always means the same schedule): kill -9 of a role (restarted
//! after a short delay), SIGTERM of a role (it drains and exits; restarted),
//! SIGSTOP of a role and SIGCONT after a pause shorter or longer than the
//! heartbeat and lease timeouts, and kill -9 of nats-server (restarted on
//! the same port and store). One fault is in flight at a time; one that is
//! due while another is still in flight starts when that one ends.
//!
//! The invariants are read from what survives any storage policy of the
//! trajectory stream: the learner's `trained.jsonl` (per step: the
//! trajectory ids, the version trained at, the oldest token version, the
//! largest version lag) and `policy.version` in the control KV bucket
//! (watched, and read at every sample):
//! - every trajectory was trained exactly once (an id never in two steps; a
//!   step trained again after a learner crash lists the same ids), every
//!   step a complete batch of B·G;
//! - no trained token was older than η;
//! - versions never went backwards (the KV value; each step trains at
//!   step − 1 and publishes step);
//! - the steps are contiguous and the run reached its step target;
//! - each role's resident memory shows no upward trend after warm-up;
//! - the NATS store and the buffer's data directory stay bounded;
//! - every role stopped with SIGTERM exits 0, and none exits on its own.
//!
//! The report (CSV of samples and faults, PNG of memory and disk, markdown)
//! is written whatever the outcome; a failed invariant makes the command
//! fail after writing it.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use asyncrl_common::dir_bytes;
use asyncrl_protos::Message as _;
use asyncrl_protos::subjects::{CONTROL_BUCKET, POLICY_VERSION_KEY, TRAJECTORY_STREAM};
use asyncrl_transport::Bus;
use futures::StreamExt as _;
use rand::SeedableRng as _;
use rand::seq::SliceRandom as _;
use rand::{Rng as _, rngs::StdRng};

use asyncrl_app::plot::{Series, line_chart};

use super::stats::median;
use crate::configs;
use crate::invariants::check_trained;
use crate::process::{READY_LINE, RoleProcess};

/// What `asyncrl-bench chaos` runs.
#[derive(Debug, Clone)]
pub struct ChaosBench {
    /// Faults are injected during this long (from the start of the roles).
    pub duration: Duration,
    pub seed: u64,
    pub workers: usize,
    /// The learner's `run.max_steps`.
    pub steps: u64,
    /// Mean gap between faults (each gap is uniform in 0.5..1.5 times it).
    pub fault_every: Duration,
    pub sample_every: Duration,
    /// How long the learner may take to reach the step target after the
    /// fault phase.
    pub final_wait: Duration,
    pub eta: u32,
    pub groups_per_step: u32,
    pub group_size: u32,
    /// Memory is flat when its projected growth over the run is at most
    /// max(`mem_growth_frac` × median, `mem_growth_mib`).
    pub mem_growth_mib: f64,
    pub mem_growth_frac: f64,
    /// Disk is bounded when the second half's maximum is at most
    /// (1 + `disk_margin`) × the first half's plus 4 MiB, or at most
    /// `disk_bound_mib`.
    pub disk_margin: f64,
    pub disk_bound_mib: f64,
    pub out: PathBuf,
    /// The command line, for the report.
    pub command: String,
}

/// The step target when none is given: four steps per second of the
/// duration, at least 20. The tiny model trained about 6 steps a second
/// under faults on two idle cores (a 5-minute run: 900 steps in 152 s) and
/// about 3.5 with the cores busy; a learner that reaches the target early
/// has exited (faults aimed at it are skipped), one that is slow has the
/// final wait.
pub fn default_steps(duration: Duration) -> u64 {
    (duration.as_secs() * 4).max(20)
}

/// The bounded wait for the step target when none is given: half the
/// duration, at least 2 minutes.
pub fn default_final_wait(duration: Duration) -> Duration {
    (duration / 2).max(Duration::from_secs(120))
}

/// Parses `90`, `90s`, `1500ms`, `30m`, `2h` (the bench's durations): a bare
/// number is seconds, anything else is humantime's syntax (as in the config).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    if let Ok(secs) = t.parse::<f64>() {
        return Duration::try_from_secs_f64(secs).map_err(|e| format!("`{text}`: {e}"));
    }
    humantime::parse_duration(t)
        .map_err(|e| format!("`{text}` is not a duration (e.g. 90s, 30m, 1500ms): {e}"))
}

// ------------------------------------------------------------ the schedule

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FaultKind {
    /// kill -9 of a role, restarted after `param` seconds.
    Kill9,
    /// SIGTERM of a role; once it has exited, restarted after `param` s.
    Sigterm,
    /// SIGSTOP of a role, SIGCONT after `param` seconds.
    Stop,
    /// kill -9 of nats-server, restarted after `param` seconds.
    NatsKill,
}

impl FaultKind {
    pub const ALL: [FaultKind; 4] = [Self::Kill9, Self::Sigterm, Self::Stop, Self::NatsKill];

    pub fn name(self) -> &'static str {
        match self {
            Self::Kill9 => "kill9",
            Self::Sigterm => "sigterm",
            Self::Stop => "sigstop",
            Self::NatsKill => "nats_kill9",
        }
    }
}

/// One planned fault.
#[derive(Debug, Clone, PartialEq)]
pub struct Planned {
    /// Seconds after the start.
    pub at: f64,
    pub kind: FaultKind,
    /// Index into the role list (coordinator, buffer, learner, workers);
    /// unused for [`FaultKind::NatsKill`].
    pub target: usize,
    /// Restart delay or pause, seconds.
    pub param: f64,
}

/// The fault schedule of a seed: gaps uniform in 0.5..1.5 × `every`, kinds
/// in rounds of a shuffled [`FaultKind::ALL`] (every kind once per four
/// faults), targets uniform over `roles`. SIGSTOP pauses are short (under
/// the heartbeat's dead-after) or long (past it, often past the lease) with
/// equal odds.
pub fn schedule(seed: u64, duration: f64, every: f64, roles: usize) -> Vec<Planned> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = Vec::new();
    let mut t = 0.0;
    let mut round: Vec<FaultKind> = Vec::new();
    loop {
        t += every * rng.random_range(0.5..1.5);
        if t >= duration {
            return out;
        }
        if round.is_empty() {
            round = FaultKind::ALL.to_vec();
            round.shuffle(&mut rng);
        }
        let kind = round.pop().unwrap_or(FaultKind::Kill9);
        let target = rng.random_range(0..roles);
        let param = match kind {
            FaultKind::Kill9 | FaultKind::Sigterm => rng.random_range(0.2..3.0),
            FaultKind::Stop => {
                if rng.random_bool(0.5) {
                    rng.random_range(0.1..2.5)
                } else {
                    rng.random_range(4.0..10.0)
                }
            }
            FaultKind::NatsKill => rng.random_range(0.5..5.0),
        };
        out.push(Planned {
            at: t,
            kind,
            target,
            param,
        });
    }
}

// ---------------------------------------------------------- memory and disk

/// Least-squares slope of `points` (x, y); None for fewer than 2 distinct x.
pub fn slope(points: &[(f64, f64)]) -> Option<f64> {
    let n = points.len() as f64;
    if points.len() < 2 {
        return None;
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    (sxx > 0.0).then(|| sxy / sxx)
}

/// The memory verdict of one role.
#[derive(Debug, Clone)]
pub struct MemoryTrend {
    pub role: String,
    /// Which start of the role was judged (its longest-lived one).
    pub incarnation: u32,
    pub samples: usize,
    pub median_mib: f64,
    pub slope_mib_per_min: f64,
    pub projected_mib: f64,
    pub threshold_mib: f64,
    /// None: too few samples after warm-up to judge.
    pub flat: Option<bool>,
}

/// Judges one role from its samples `(t, incarnation, rss bytes)`: the
/// incarnation with the longest sampled span, its samples from `warmup`
/// seconds after its first sample on; flat when slope × `run_secs` ≤
/// max(frac × median, mib). Not judged with fewer than `min_samples`
/// samples, or samples spanning less than `warmup` seconds: a slope over a
/// few seconds (a learner that reached its step target early) projected
/// over the whole run is noise, not a leak.
pub fn memory_trend(
    role: &str,
    samples: &[(f64, u32, u64)],
    warmup: f64,
    run_secs: f64,
    min_samples: usize,
    mib: f64,
    frac: f64,
) -> MemoryTrend {
    let mut spans: BTreeMap<u32, (f64, f64)> = BTreeMap::new();
    for &(t, inc, _) in samples {
        let e = spans.entry(inc).or_insert((t, t));
        e.0 = e.0.min(t);
        e.1 = e.1.max(t);
    }
    let longest = spans
        .iter()
        .max_by(|a, b| (a.1.1 - a.1.0).total_cmp(&(b.1.1 - b.1.0)))
        .map(|(inc, span)| (*inc, span.0));
    let Some((inc, first)) = longest else {
        return MemoryTrend {
            role: role.into(),
            incarnation: 0,
            samples: 0,
            median_mib: 0.0,
            slope_mib_per_min: 0.0,
            projected_mib: 0.0,
            threshold_mib: mib,
            flat: None,
        };
    };
    let pts: Vec<(f64, f64)> = samples
        .iter()
        .filter(|s| s.1 == inc && s.0 >= first + warmup)
        .map(|s| (s.0, s.2 as f64 / MIB))
        .collect();
    let med = if pts.is_empty() {
        0.0
    } else {
        median(pts.iter().map(|p| p.1).collect())
    };
    let threshold = (frac * med).max(mib);
    let span = match (pts.first(), pts.last()) {
        (Some(a), Some(b)) => b.0 - a.0,
        _ => 0.0,
    };
    let k = slope(&pts).unwrap_or(0.0);
    let projected = k * run_secs;
    MemoryTrend {
        role: role.into(),
        incarnation: inc,
        samples: pts.len(),
        median_mib: med,
        slope_mib_per_min: k * 60.0,
        projected_mib: projected,
        threshold_mib: threshold,
        flat: (pts.len() >= min_samples && span >= warmup).then_some(projected <= threshold),
    }
}

/// The disk verdict of one directory.
#[derive(Debug, Clone)]
pub struct DiskBound {
    pub dir: String,
    pub max_first_mib: f64,
    pub max_second_mib: f64,
    pub bounded: bool,
    pub by: &'static str,
}

/// Bounded when the second half's maximum is at most (1 + margin) × the
/// first half's + 4 MiB, or at most `bound_mib`.
pub fn disk_bound(dir: &str, points: &[(f64, u64)], margin: f64, bound_mib: f64) -> DiskBound {
    let end = points.iter().map(|p| p.0).fold(0.0, f64::max);
    let half = end / 2.0;
    let max_of = |first: bool| {
        points
            .iter()
            .filter(|p| (p.0 < half) == first)
            .map(|p| p.1 as f64 / MIB)
            .fold(0.0, f64::max)
    };
    let (a, b) = (max_of(true), max_of(false));
    let (bounded, by) = if b <= a * (1.0 + margin) + 4.0 {
        (
            true,
            "second-half max within the margin of the first half's",
        )
    } else if b <= bound_mib {
        (true, "below the configured bound")
    } else {
        (false, "grew past the margin and the bound")
    };
    DiskBound {
        dir: dir.into(),
        max_first_mib: a,
        max_second_mib: b,
        bounded,
        by,
    }
}

const MIB: f64 = 1024.0 * 1024.0;

/// Bytes per stream directory of a JetStream store (the `streams/<name>`
/// directories found up to three levels down), largest first.
fn store_breakdown(dir: &Path) -> Vec<(String, u64)> {
    fn walk(dir: &Path, depth: usize, out: &mut Vec<(String, u64)>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            if !e.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            if e.file_name() == "streams" {
                for s in std::fs::read_dir(e.path()).into_iter().flatten().flatten() {
                    out.push((
                        s.file_name().to_string_lossy().into_owned(),
                        dir_bytes(&s.path()),
                    ));
                }
            } else if depth > 0 {
                walk(&e.path(), depth - 1, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, 3, &mut out);
    out.sort_by_key(|p| std::cmp::Reverse(p.1));
    out
}

/// VmRSS of a process in bytes (None when it is gone or a zombie).
fn rss_bytes(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = text.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

// ------------------------------------------------------------ the processes

/// A role of the soak: its process, and what the soak expects of it.
struct Proc {
    p: RoleProcess,
    /// A SIGTERM was sent: its exit is expected.
    expect_exit: bool,
    /// The learner exited 0 at the step target.
    done: bool,
}

impl std::ops::Deref for Proc {
    type Target = RoleProcess;
    fn deref(&self) -> &RoleProcess {
        &self.p
    }
}

impl std::ops::DerefMut for Proc {
    fn deref_mut(&mut self) -> &mut RoleProcess {
        &mut self.p
    }
}

impl Proc {
    fn start(&mut self, bin: &Path, t: f64) -> anyhow::Result<()> {
        self.p.start(bin, t)?;
        self.expect_exit = false;
        Ok(())
    }
}

/// What an in-flight fault waits for next.
enum Next {
    Restart {
        role: usize,
        at: f64,
    },
    /// SIGTERM once the role handles it (a role still starting up would
    /// die of the signal before it could drain).
    AwaitReady {
        role: usize,
        deadline: f64,
        delay: f64,
    },
    AwaitExit {
        role: usize,
        deadline: f64,
        delay: f64,
    },
    Thaw {
        role: usize,
        at: f64,
    },
    NatsUp {
        at: f64,
    },
}

/// A fault as it happened (a row of faults.csv).
#[derive(Debug, Clone)]
struct FaultRecord {
    planned: f64,
    at: f64,
    kind: FaultKind,
    target: String,
    param: f64,
    outcome: String,
    injected: bool,
    done_at: Option<f64>,
}

/// A role that exited without being told to.
#[derive(Debug, Clone)]
struct Crash {
    at: f64,
    role: String,
    status: String,
}

/// `policy.version` as seen (watch and polling).
#[derive(Debug, Default)]
struct VersionLog {
    /// (seconds, KV revision, version) of each distinct version seen.
    seen: Vec<(f64, u64, i64)>,
    /// Highest KV revision seen.
    revision: u64,
    backwards: Vec<String>,
}

impl VersionLog {
    /// Records the value of `policy.version` at KV `revision`. The watch
    /// and the per-sample reads arrive in any order: a revision at or below
    /// one seen already is old news, not a step back.
    fn record(&mut self, t: f64, revision: u64, version: i64) {
        if revision <= self.revision {
            return;
        }
        self.revision = revision;
        match self.seen.last() {
            Some(&(_, _, last)) if last == version => {}
            Some(&(_, _, last)) => {
                if version < last {
                    self.backwards.push(format!(
                        "policy.version went from {last} to {version} (KV revision {revision}) at t={t:.1}s"
                    ));
                }
                self.seen.push((t, revision, version));
            }
            None => self.seen.push((t, revision, version)),
        }
    }

    fn last(&self) -> Option<i64> {
        self.seen.last().map(|v| v.2)
    }
}

fn decode_version(bytes: &[u8]) -> Option<i64> {
    asyncrl_protos::WeightAnnouncement::decode(bytes)
        .ok()
        .map(|a| i64::from(a.version))
}

/// Watches `policy.version` for as long as the task lives, reopening the
/// watch whenever it ends (server restarts).
async fn watch_versions(bus: Arc<dyn Bus>, log: Arc<Mutex<VersionLog>>, start: Instant) {
    loop {
        if let Ok(Ok(kv)) =
            tokio::time::timeout(Duration::from_secs(2), bus.kv(CONTROL_BUCKET)).await
            && let Ok(Ok(mut watch)) =
                tokio::time::timeout(Duration::from_secs(2), kv.watch(POLICY_VERSION_KEY)).await
        {
            while let Some(Ok(event)) = watch.next().await {
                if let Some(v) = event.value.as_deref().and_then(decode_version) {
                    log.lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .record(start.elapsed().as_secs_f64(), event.revision, v);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// One sample row.
#[derive(Debug, Clone)]
struct Sample {
    t: f64,
    step: u64,
    stream_messages: Option<u64>,
    nats_bytes: u64,
    buffer_bytes: u64,
    /// Per process (roles, then nats-server): (incarnation, rss bytes).
    rss: Vec<Option<(u32, u64)>>,
}

/// An invariant's verdict in the report.
#[derive(Debug, Clone)]
pub struct Verdict {
    pub name: &'static str,
    pub pass: bool,
    pub detail: String,
}

struct Chaos<'a> {
    spec: &'a ChaosBench,
    rt: &'a tokio::runtime::Runtime,
    bin: PathBuf,
    start: Instant,
    nats: asyncrl_testkit::NatsServer,
    nats_starts: u32,
    bus: Arc<dyn Bus>,
    procs: Vec<Proc>,
    run_dir: PathBuf,
    faults: Vec<FaultRecord>,
    crashes: Vec<Crash>,
    /// Roles to start again after a crash: (role, at).
    recover: Vec<(usize, f64)>,
    samples: Vec<Sample>,
    versions: Arc<Mutex<VersionLog>>,
    /// Violations seen by the continuous check: (first seen at, text).
    seen_violations: BTreeMap<String, f64>,
    samples_csv: std::fs::File,
    faults_csv: std::fs::File,
}

impl Chaos<'_> {
    fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    fn index(&self, name: &str) -> Option<usize> {
        self.procs.iter().position(|p| p.name == name)
    }

    fn trained_text(&self) -> String {
        std::fs::read_to_string(self.run_dir.join("trained.jsonl")).unwrap_or_default()
    }

    fn batch(&self) -> usize {
        (self.spec.groups_per_step * self.spec.group_size) as usize
    }

    fn learner_done(&self) -> bool {
        self.index("learner").is_some_and(|i| self.procs[i].done)
    }

    /// Reaps exited roles: a learner at its step target is done; any other
    /// exit nobody asked for is a crash, and the role is started again.
    fn reap(&mut self) {
        let t = self.now();
        for i in 0..self.procs.len() {
            if self.procs[i].expect_exit {
                continue;
            }
            let Some(status) = self.procs[i].poll() else {
                continue;
            };
            if self.procs[i].role == "learner" && status.success() {
                let max = check_trained(&self.trained_text(), self.spec.eta, 0).max_step;
                if max >= self.spec.steps {
                    let p = &mut self.procs[i];
                    p.done = true;
                    p.note(&format!("finished the step target at t={t:.1}s"));
                    eprintln!("bench chaos: t={t:.0}s the learner reached step {max}");
                    continue;
                }
            }
            let p = &self.procs[i];
            p.note(&format!("exited on its own with {status} at t={t:.1}s"));
            eprintln!(
                "bench chaos: t={t:.0}s {} exited on its own: {status}",
                p.name
            );
            self.crashes.push(Crash {
                at: t,
                role: p.name.clone(),
                status: status.to_string(),
            });
            self.recover.push((i, t + 1.0));
        }
    }

    /// Appends the last fault to faults.csv.
    fn write_fault_row(&mut self) -> anyhow::Result<()> {
        let Some(f) = self.faults.last() else {
            return Ok(());
        };
        writeln!(
            self.faults_csv,
            "{:.2},{:.2},{},{},{:.2},{}",
            f.planned,
            f.at,
            f.kind.name(),
            f.target,
            f.param,
            f.outcome.replace(',', ";")
        )
        .context("cannot write faults.csv")
    }

    fn start_proc(&mut self, i: usize) -> anyhow::Result<()> {
        let t = self.now();
        let bin = self.bin.clone();
        self.procs[i].start(&bin, t)
    }

    /// Starts the roles recovering from a crash whose time has come.
    fn recover_due(&mut self) -> anyhow::Result<()> {
        let t = self.now();
        let due: Vec<usize> = self
            .recover
            .iter()
            .filter(|r| r.1 <= t)
            .map(|r| r.0)
            .collect();
        self.recover.retain(|r| r.1 > t);
        for i in due {
            if !self.procs[i].is_running() && !self.procs[i].done {
                self.start_proc(i)?;
            }
        }
        Ok(())
    }

    /// Injects a planned fault; returns what it waits for next (None: it is
    /// over already, e.g. skipped).
    fn inject(&mut self, p: &Planned) -> anyhow::Result<Option<Next>> {
        let t = self.now();
        let target = match p.kind {
            FaultKind::NatsKill => "nats-server".to_owned(),
            _ => self.procs[p.target].name.clone(),
        };
        let mut rec = FaultRecord {
            planned: p.at,
            at: t,
            kind: p.kind,
            target: target.clone(),
            param: p.param,
            outcome: String::new(),
            injected: true,
            done_at: None,
        };
        let next = match p.kind {
            FaultKind::NatsKill => {
                self.nats.kill();
                rec.outcome = format!("killed; restart after {:.1}s", p.param);
                Some(Next::NatsUp { at: t + p.param })
            }
            _ if !self.procs[p.target].is_running() => {
                rec.injected = false;
                rec.outcome = if self.procs[p.target].done {
                    "skipped: the learner has finished".into()
                } else {
                    "skipped: the role is down".into()
                };
                None
            }
            FaultKind::Kill9 => {
                let proc = &mut self.procs[p.target];
                let status = proc.kill9();
                proc.note(&format!("killed with SIGKILL at t={t:.1}s"));
                rec.outcome = format!(
                    "killed ({}); restart after {:.1}s",
                    status.map(|s| s.to_string()).unwrap_or_default(),
                    p.param
                );
                Some(Next::Restart {
                    role: p.target,
                    at: t + p.param,
                })
            }
            FaultKind::Sigterm => {
                rec.outcome = "SIGTERM due".into();
                Some(Next::AwaitReady {
                    role: p.target,
                    deadline: t + 60.0,
                    delay: p.param,
                })
            }
            FaultKind::Stop => {
                let proc = &mut self.procs[p.target];
                proc.signal(libc::SIGSTOP);
                proc.note(&format!("sent SIGSTOP at t={t:.1}s for {:.1}s", p.param));
                rec.outcome = format!("stopped for {:.1}s", p.param);
                Some(Next::Thaw {
                    role: p.target,
                    at: t + p.param,
                })
            }
        };
        eprintln!(
            "bench chaos: t={t:.0}s {} {target}: {}",
            p.kind.name(),
            rec.outcome
        );
        if next.is_none() {
            rec.done_at = Some(t);
        }
        self.faults.push(rec);
        Ok(next)
    }

    /// Moves the in-flight fault on; returns what it waits for next (None
    /// when it is over).
    fn progress(&mut self, next: Next) -> anyhow::Result<Option<Next>> {
        let t = self.now();
        let rec = self.faults.len() - 1;
        let next = match next {
            Next::Restart { role, at } => {
                if t < at {
                    return Ok(Some(Next::Restart { role, at }));
                }
                if !self.procs[role].is_running() && !self.procs[role].done {
                    self.start_proc(role)?;
                }
                let _ = write!(self.faults[rec].outcome, "; restarted at t={t:.1}s");
                None
            }
            Next::AwaitReady {
                role,
                deadline,
                delay,
            } => {
                let ready = self.procs[role].handles_sigterm();
                if !ready && self.procs[role].is_running() && t <= deadline {
                    return Ok(Some(Next::AwaitReady {
                        role,
                        deadline,
                        delay,
                    }));
                }
                let proc = &mut self.procs[role];
                if !proc.is_running() {
                    // It exited on its own meanwhile (reaped as a crash).
                    let _ = write!(self.faults[rec].outcome, "; the role exited first");
                    None
                } else {
                    if !ready {
                        self.crashes.push(Crash {
                            at: t,
                            role: proc.name.clone(),
                            status: "did not start serving /metrics within 60s".into(),
                        });
                    }
                    proc.expect_exit = true;
                    proc.signal(libc::SIGTERM);
                    proc.note(&format!("sent SIGTERM at t={t:.1}s"));
                    let waited = t - self.faults[rec].at;
                    let _ = write!(self.faults[rec].outcome, "; sent at t={t:.1}s");
                    if waited > 0.5 {
                        let _ =
                            write!(self.faults[rec].outcome, " (role ready after {waited:.1}s)");
                    }
                    Some(Next::AwaitExit {
                        role,
                        deadline: t + 60.0,
                        delay,
                    })
                }
            }
            Next::AwaitExit {
                role,
                deadline,
                delay,
            } => match self.procs[role].poll() {
                Some(status) => {
                    self.procs[role].expect_exit = false;
                    let took = t - self.faults[rec].at;
                    let _ = write!(
                        self.faults[rec].outcome,
                        "; exited {status} after {took:.1}s"
                    );
                    if !status.success() {
                        self.crashes.push(Crash {
                            at: t,
                            role: self.procs[role].name.clone(),
                            status: format!("{status} after SIGTERM"),
                        });
                    }
                    Some(Next::Restart {
                        role,
                        at: t + delay,
                    })
                }
                None if t > deadline => {
                    let status = self.procs[role].kill9();
                    self.procs[role].expect_exit = false;
                    let _ = write!(
                        self.faults[rec].outcome,
                        "; did not exit within 60s, killed ({status:?})"
                    );
                    self.crashes.push(Crash {
                        at: t,
                        role: self.procs[role].name.clone(),
                        status: "did not exit within 60s of SIGTERM".into(),
                    });
                    Some(Next::Restart {
                        role,
                        at: t + delay,
                    })
                }
                None => Some(Next::AwaitExit {
                    role,
                    deadline,
                    delay,
                }),
            },
            Next::Thaw { role, at } => {
                if t < at {
                    return Ok(Some(Next::Thaw { role, at }));
                }
                self.procs[role].signal(libc::SIGCONT);
                self.procs[role].note(&format!("sent SIGCONT at t={t:.1}s"));
                let _ = write!(self.faults[rec].outcome, "; continued at t={t:.1}s");
                None
            }
            Next::NatsUp { at } => {
                if t < at {
                    return Ok(Some(Next::NatsUp { at }));
                }
                self.nats.restart().context("restart nats-server")?;
                self.nats_starts += 1;
                let _ = write!(self.faults[rec].outcome, "; restarted at t={t:.1}s");
                None
            }
        };
        if next.is_none() {
            self.faults[rec].done_at = Some(self.now());
            self.write_fault_row()?;
        }
        Ok(next)
    }

    /// Takes one sample and runs the continuous checks.
    fn sample(&mut self) -> anyhow::Result<()> {
        let t = self.now();
        let text = self.trained_text();
        let check = check_trained(&text, self.spec.eta, self.batch());
        let bus = self.bus.clone();
        let (stream_messages, kv_version) = self.rt.block_on(async move {
            let limit = Duration::from_millis(800);
            let len = tokio::time::timeout(limit, bus.stream_len(TRAJECTORY_STREAM))
                .await
                .ok()
                .and_then(Result::ok);
            let version = tokio::time::timeout(limit, async {
                let kv = bus.kv(CONTROL_BUCKET).await.ok()?;
                let entry = kv.get(POLICY_VERSION_KEY).await.ok()??;
                Some((entry.revision, decode_version(&entry.value)?))
            })
            .await
            .ok()
            .flatten();
            (len, version)
        });
        if let Some((revision, v)) = kv_version {
            self.versions
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .record(t, revision, v);
        }
        let mut rss: Vec<Option<(u32, u64)>> = self
            .procs
            .iter()
            .map(|p| {
                let pid = p.pid()?;
                Some((p.starts, rss_bytes(pid)?))
            })
            .collect();
        rss.push(
            self.nats
                .pid()
                .and_then(rss_bytes)
                .map(|b| (self.nats_starts, b)),
        );
        let s = Sample {
            t,
            step: check.max_step,
            stream_messages,
            nats_bytes: dir_bytes(&self.nats.store_dir().join("jetstream")),
            buffer_bytes: dir_bytes(&self.run_dir.join("buffer")),
            rss,
        };
        let mut row = format!(
            "{:.2},{},{},{},{}",
            s.t,
            s.step,
            s.stream_messages.map(|m| m.to_string()).unwrap_or_default(),
            s.nats_bytes,
            s.buffer_bytes
        );
        for r in &s.rss {
            match r {
                Some((inc, b)) => write!(row, ",{inc},{b}"),
                None => write!(row, ",,"),
            }
            .context("format a sample")?;
        }
        writeln!(self.samples_csv, "{row}").context("cannot write samples.csv")?;
        self.samples.push(s);
        let backwards = self
            .versions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .backwards
            .clone();
        for v in check
            .exactly_once
            .iter()
            .chain(&check.staleness)
            .chain(&check.versions)
            .chain(&check.contiguous)
            .chain(&backwards)
        {
            if !self.seen_violations.contains_key(v) {
                eprintln!("bench chaos: t={t:.0}s VIOLATION: {v}");
                self.seen_violations.insert(v.clone(), t);
            }
        }
        Ok(())
    }

    fn stop_all(&mut self) -> Vec<(String, String, bool)> {
        // The learner (if still running) and the workers first (they
        // drain), then the buffer and the coordinator.
        let mut order: Vec<usize> = (0..self.procs.len()).collect();
        order.sort_by_key(|&i| match self.procs[i].role.as_str() {
            "coordinator" => 3,
            "buffer" => 2,
            "learner" => 0,
            _ => 1,
        });
        let mut out = Vec::new();
        for i in order {
            if !self.procs[i].is_running() {
                continue;
            }
            if self.procs[i].frozen {
                self.procs[i].signal(libc::SIGCONT);
            }
            let ready_by = Instant::now() + Duration::from_secs(60);
            while !self.procs[i].handles_sigterm()
                && Instant::now() < ready_by
                && self.procs[i].poll().is_none()
            {
                std::thread::sleep(Duration::from_millis(50));
            }
            if !self.procs[i].is_running() {
                let name = self.procs[i].name.clone();
                let status = self.procs[i]
                    .exited
                    .map(|s| s.to_string())
                    .unwrap_or_default();
                out.push((name, format!("{status} before the SIGTERM"), false));
                continue;
            }
            self.procs[i].expect_exit = true;
            self.procs[i].signal(libc::SIGTERM);
            let t = self.now();
            self.procs[i].note(&format!("sent SIGTERM (end of the run) at t={t:.1}s"));
            let deadline = Instant::now() + Duration::from_secs(60);
            let status = loop {
                if let Some(s) = self.procs[i].poll() {
                    break Some(s);
                }
                if Instant::now() > deadline {
                    break None;
                }
                std::thread::sleep(Duration::from_millis(50));
            };
            let name = self.procs[i].name.clone();
            match status {
                Some(s) => out.push((name, s.to_string(), s.success())),
                None => {
                    self.procs[i].kill9();
                    out.push((name, "no exit within 60s (killed)".into(), false));
                }
            }
        }
        out
    }
}

/// The config of a role (only `worker.id` differs between them): the
/// cluster tests' role config ([`configs::cluster_role`]) with the soak's
/// spec, a longer connect timeout (roles are restarted while the server
/// is down), the product's buffer retention and small segments (so that
/// compaction runs during the soak).
fn role_config(
    spec: &ChaosBench,
    run_dir: &Path,
    tasks: &Path,
    url: &str,
    worker: Option<&str>,
) -> asyncrl_config::Config {
    let mut c = configs::cluster_role(run_dir, url, tasks);
    c.run.name = "chaos".into();
    c.run.seed = spec.seed;
    c.run.max_steps = spec.steps;
    c.staleness.eta = spec.eta;
    c.staleness.groups_per_step = spec.groups_per_step;
    c.staleness.group_size = spec.group_size;
    c.bus.connect_timeout = Duration::from_secs(30);
    c.buffer.retention = asyncrl_config::RetentionPolicy::default();
    c.buffer.segment_max_bytes = 256 * 1024;
    c.worker.id = worker.map(str::to_owned);
    c
}

/// The role names of a run with `workers` workers, in target order.
fn role_names(workers: usize) -> Vec<(String, &'static str)> {
    let mut names: Vec<(String, &'static str)> = vec![
        ("coordinator".into(), "coordinator"),
        ("buffer".into(), "buffer"),
        ("learner".into(), "learner"),
    ];
    for i in 1..=workers {
        names.push((format!("worker-{i}"), "worker"));
    }
    names
}

/// The fault schedule of `spec` as text (`--plan-only`): one line per
/// planned fault.
pub fn plan_text(spec: &ChaosBench) -> String {
    let names = role_names(spec.workers);
    let plan = schedule(
        spec.seed,
        spec.duration.as_secs_f64(),
        spec.fault_every.as_secs_f64(),
        names.len(),
    );
    let mut out = String::new();
    for p in &plan {
        let target = match p.kind {
            FaultKind::NatsKill => "nats-server",
            _ => names[p.target].0.as_str(),
        };
        let _ = writeln!(
            out,
            "{:>8.2}s  {:<10} {:<12} {:.2}s",
            p.at,
            p.kind.name(),
            target,
            p.param
        );
    }
    out
}

/// Runs the chaos soak and writes its report; fails (after writing it) when
/// an invariant does not hold.
pub fn chaos(rt: &tokio::runtime::Runtime, spec: &ChaosBench) -> anyhow::Result<String> {
    anyhow::ensure!(spec.workers >= 2, "--workers must be at least 2");
    anyhow::ensure!(spec.steps >= 1, "--steps must be at least 1");
    anyhow::ensure!(
        !spec.sample_every.is_zero() && !spec.fault_every.is_zero(),
        "--sample-every and --fault-every must be positive"
    );
    let out = &spec.out;
    let run_dir = out.join("run");
    let logs = out.join("logs");
    // The run directory is the bench's own: a learner would resume from an
    // old trained.jsonl and checkpoints.
    for dir in [&run_dir, &logs] {
        if dir.exists() {
            std::fs::remove_dir_all(dir)
                .with_context(|| format!("cannot clear {}", dir.display()))?;
        }
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let bin = crate::process::asyncrl_bin()?;

    // Enough tasks that the run never wraps an epoch.
    let n_tasks = ((spec.steps + u64::from(spec.eta) + 8) * u64::from(spec.groups_per_step) * 2
        + 200) as usize;
    let tasks = out.join("tasks.jsonl");
    let items = asyncrl_tasks::generate_with(
        asyncrl_tasks::BuiltinTask::Arith,
        n_tasks,
        spec.seed,
        asyncrl_tasks::GenerateOptions { max_operand: 20 },
    );
    asyncrl_tasks::write_jsonl(&tasks, &items).context("cannot write the task file")?;

    let nats = asyncrl_testkit::NatsServer::start().context("cannot start a nats-server")?;
    let url = nats.url();
    let mut bus_config = asyncrl_config::BusConfig {
        url: url.clone(),
        ..Default::default()
    };
    bus_config.connect_timeout = Duration::from_secs(10);
    bus_config.reconnect_max_delay = Duration::from_millis(500);
    let bus = rt
        .block_on(asyncrl_transport::connect(
            &bus_config,
            asyncrl_transport::TransportMetrics::new(),
        ))
        .with_context(|| format!("cannot connect to {url}"))?;

    let mut procs = Vec::new();
    for (name, role) in role_names(spec.workers) {
        let config = out.join(format!("{name}.toml"));
        let worker = (role == "worker").then_some(name.as_str());
        role_config(spec, &run_dir, &tasks, &url, worker)
            .write(&config)
            .with_context(|| format!("cannot write the config of {name}"))?;
        procs.push(Proc {
            p: RoleProcess::new(&name, role, config, logs.join(format!("{name}.log"))),
            expect_exit: false,
            done: false,
        });
    }

    let mut samples_csv = std::fs::File::create(out.join("samples.csv"))
        .with_context(|| format!("cannot create {}", out.join("samples.csv").display()))?;
    let mut header =
        String::from("t_s,learner_step,stream_messages,nats_store_bytes,buffer_dir_bytes");
    for p in procs.iter().map(|p| p.name.as_str()).chain(["nats-server"]) {
        let _ = write!(header, ",{p}_start,{p}_rss_bytes");
    }
    writeln!(samples_csv, "{header}").context("cannot write samples.csv")?;
    let mut faults_csv = std::fs::File::create(out.join("faults.csv"))
        .with_context(|| format!("cannot create {}", out.join("faults.csv").display()))?;
    writeln!(faults_csv, "planned_s,at_s,kind,target,param_s,outcome")
        .context("cannot write faults.csv")?;

    let duration = spec.duration.as_secs_f64();
    let plan = schedule(
        spec.seed,
        duration,
        spec.fault_every.as_secs_f64(),
        procs.len(),
    );
    let start = Instant::now();
    let versions = Arc::new(Mutex::new(VersionLog::default()));
    let mut c = Chaos {
        spec,
        rt,
        bin,
        start,
        nats,
        nats_starts: 1,
        bus: bus.clone(),
        procs,
        run_dir: run_dir.clone(),
        faults: Vec::new(),
        crashes: Vec::new(),
        recover: Vec::new(),
        samples: Vec::new(),
        versions: versions.clone(),
        seen_violations: BTreeMap::new(),
        samples_csv,
        faults_csv,
    };
    for i in 0..c.procs.len() {
        c.start_proc(i)?;
    }
    let watcher = rt.spawn(watch_versions(bus, versions.clone(), start));
    eprintln!(
        "bench chaos: {} roles over {url}, {} faults planned in {duration:.0}s, step target {}; logs in {}",
        c.procs.len(),
        plan.len(),
        spec.steps,
        logs.display()
    );

    // The fault phase, then the wait for the step target.
    let sample_every = spec.sample_every.as_secs_f64();
    let final_deadline = duration + spec.final_wait.as_secs_f64();
    let mut next_sample = 0.0;
    let mut planned = plan.iter().peekable();
    let mut in_flight: Option<Next> = None;
    let reached = loop {
        c.reap();
        c.recover_due()?;
        let t = c.now();
        if let Some(next) = in_flight.take() {
            in_flight = c.progress(next)?;
        }
        if in_flight.is_none()
            && let Some(p) = planned.next_if(|p| p.at <= t && t < duration)
        {
            in_flight = c.inject(p)?;
            if in_flight.is_none() {
                c.write_fault_row()?;
            }
        }
        if t >= next_sample {
            c.sample()?;
            next_sample = t + sample_every;
        }
        if t >= duration && in_flight.is_none() && c.recover.is_empty() {
            if c.learner_done() {
                break true;
            }
            if t >= final_deadline {
                break false;
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let unplanned = planned.count();
    c.sample()?;
    let stopped = c.stop_all();
    c.sample()?;
    watcher.abort();
    let end = c.now();
    let store_parts = store_breakdown(&c.nats.store_dir().join("jetstream"));
    let _ = std::fs::copy(
        c.nats.store_dir().join("nats-server.log"),
        logs.join("nats-server.log"),
    );
    c.nats.stop();

    let report = write_report(&c, &stopped, reached, unplanned, end, &logs, &store_parts)?;
    let failed: Vec<&str> = report
        .verdicts
        .iter()
        .filter(|v| !v.pass)
        .map(|v| v.name)
        .collect();
    if !failed.is_empty() {
        anyhow::bail!(
            "bench chaos: invariants failed: {} (see {})",
            failed.join(", "),
            out.join("chaos.md").display()
        );
    }
    Ok(report.summary)
}

struct Report {
    verdicts: Vec<Verdict>,
    summary: String,
}

fn write_report(
    c: &Chaos<'_>,
    stopped: &[(String, String, bool)],
    reached: bool,
    unplanned: usize,
    end: f64,
    logs: &Path,
    store_parts: &[(String, u64)],
) -> anyhow::Result<Report> {
    let spec = c.spec;
    let out = &spec.out;
    let check = check_trained(&c.trained_text(), spec.eta, c.batch());
    let versions = c
        .versions
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let first_seen = |v: &String| {
        c.seen_violations
            .get(v)
            .map(|t| format!(" (first seen at t={t:.0}s)"))
            .unwrap_or_default()
    };
    let list = |vs: &[String]| {
        vs.iter()
            .take(5)
            .map(|v| format!("{v}{}", first_seen(v)))
            .collect::<Vec<_>>()
            .join("; ")
    };
    let mut verdicts = Vec::new();
    verdicts.push(Verdict {
        name: "trained exactly once",
        pass: check.exactly_once.is_empty(),
        detail: if check.exactly_once.is_empty() {
            format!(
                "{} trajectories in {} steps, each in one step, every step B·G = {}; {} steps trained again after a learner crash, on the same trajectories",
                check.trajectories,
                check.max_step,
                c.batch(),
                check.retrained
            )
        } else {
            list(&check.exactly_once)
        },
    });
    verdicts.push(Verdict {
        name: "no token older than η",
        pass: check.staleness.is_empty(),
        detail: if check.staleness.is_empty() {
            format!(
                "max version lag {} and oldest token age {} ≤ η = {}",
                check.max_version_lag, check.max_token_age, spec.eta
            )
        } else {
            list(&check.staleness)
        },
    });
    let back: Vec<String> = versions
        .backwards
        .iter()
        .chain(&check.versions)
        .cloned()
        .collect();
    verdicts.push(Verdict {
        name: "versions never backwards",
        pass: back.is_empty(),
        detail: if back.is_empty() {
            format!(
                "{} distinct policy.version values seen (watch + a read per sample), non-decreasing, last {}; every step trained at step − 1 and published step",
                versions.seen.len(),
                versions.last().map_or("none".into(), |v| v.to_string())
            )
        } else {
            list(&back)
        },
    });
    verdicts.push(Verdict {
        name: "steps contiguous",
        pass: check.contiguous.is_empty(),
        detail: if check.contiguous.is_empty() {
            format!(
                "steps 1..={} all present ({} lines)",
                check.max_step, check.lines
            )
        } else {
            list(&check.contiguous)
        },
    });
    let kv_last = versions.last();
    let target_ok = reached && check.max_step == spec.steps && kv_last == Some(spec.steps as i64);
    verdicts.push(Verdict {
        name: "step target reached",
        pass: target_ok,
        detail: format!(
            "target {}, reached {} (trained.jsonl), policy.version {}, learner {}",
            spec.steps,
            check.max_step,
            kv_last.map_or("unknown".into(), |v| v.to_string()),
            if reached {
                "exited 0 at the target".to_owned()
            } else {
                format!(
                    "had not finished {:.0}s after the fault phase",
                    spec.final_wait.as_secs_f64()
                )
            }
        ),
    });

    // Memory.
    let duration = spec.duration.as_secs_f64();
    let warmup = (0.2 * duration).min(60.0);
    let mut names: Vec<String> = c.procs.iter().map(|p| p.name.clone()).collect();
    names.push("nats-server".into());
    let trends: Vec<MemoryTrend> = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let pts: Vec<(f64, u32, u64)> = c
                .samples
                .iter()
                .filter_map(|s| s.rss[i].map(|(inc, b)| (s.t, inc, b)))
                .collect();
            memory_trend(
                name,
                &pts,
                warmup,
                duration,
                5,
                spec.mem_growth_mib,
                spec.mem_growth_frac,
            )
        })
        .collect();
    // nats-server is sampled and shown, but judged are the roles: its
    // file-store caches follow the write rate (see the report).
    let role_trends = &trends[..trends.len() - 1];
    let growing: Vec<String> = role_trends
        .iter()
        .filter(|m| m.flat == Some(false))
        .map(|m| format!("{} (+{:.1} MiB projected)", m.role, m.projected_mib))
        .collect();
    let judged = role_trends.iter().filter(|m| m.flat.is_some()).count();
    verdicts.push(Verdict {
        name: "memory flat after warm-up",
        pass: growing.is_empty() && judged > 0,
        detail: if !growing.is_empty() {
            format!("growing: {}", growing.join(", "))
        } else if judged == 0 {
            "no process had enough samples after warm-up to judge".into()
        } else {
            format!(
                "{judged} of {} roles judged, none growing",
                role_trends.len()
            )
        },
    });

    // Disk.
    let disks = [
        disk_bound(
            "nats store",
            &c.samples
                .iter()
                .map(|s| (s.t, s.nats_bytes))
                .collect::<Vec<_>>(),
            spec.disk_margin,
            spec.disk_bound_mib,
        ),
        disk_bound(
            "buffer data dir",
            &c.samples
                .iter()
                .map(|s| (s.t, s.buffer_bytes))
                .collect::<Vec<_>>(),
            spec.disk_margin,
            spec.disk_bound_mib,
        ),
    ];
    verdicts.push(Verdict {
        name: "disk bounded",
        pass: disks.iter().all(|d| d.bounded),
        detail: disks
            .iter()
            .map(|d| {
                format!(
                    "{}: max {:.1} MiB then {:.1} MiB ({})",
                    d.dir, d.max_first_mib, d.max_second_mib, d.by
                )
            })
            .collect::<Vec<_>>()
            .join("; "),
    });

    // Exits.
    let unclean: Vec<String> = stopped
        .iter()
        .filter(|s| !s.2)
        .map(|s| format!("{} {} at the end", s.0, s.1))
        .chain(
            c.crashes
                .iter()
                .map(|k| format!("{} {} at t={:.0}s", k.role, k.status, k.at)),
        )
        .collect();
    verdicts.push(Verdict {
        name: "clean exits",
        pass: unclean.is_empty(),
        detail: if unclean.is_empty() {
            format!(
                "no role exited on its own; every SIGTERM ended in exit 0 ({} at the end)",
                stopped.len()
            )
        } else {
            unclean.join("; ")
        },
    });

    // Charts.
    let mem_series: Vec<Series> = names
        .iter()
        .enumerate()
        .map(|(i, name)| Series {
            name: name.clone(),
            points: c
                .samples
                .iter()
                .filter_map(|s| s.rss[i].map(|(_, b)| (s.t, b as f64 / MIB)))
                .collect(),
            band: None,
        })
        .filter(|s| !s.points.is_empty())
        .collect();
    line_chart(
        &out.join("memory.png"),
        "Resident memory per process (chaos)",
        "seconds",
        "MiB",
        &mem_series,
    )?;
    let disk_series = vec![
        Series {
            name: "nats store".into(),
            points: c
                .samples
                .iter()
                .map(|s| (s.t, s.nats_bytes as f64 / MIB))
                .collect(),
            band: None,
        },
        Series {
            name: "buffer data dir".into(),
            points: c
                .samples
                .iter()
                .map(|s| (s.t, s.buffer_bytes as f64 / MIB))
                .collect(),
            band: None,
        },
    ];
    line_chart(
        &out.join("disk.png"),
        "Disk use (chaos)",
        "seconds",
        "MiB",
        &disk_series,
    )?;

    // Markdown.
    let mut per_kind: BTreeMap<FaultKind, (usize, usize)> =
        FaultKind::ALL.iter().map(|k| (*k, (0, 0))).collect();
    for f in &c.faults {
        let e = per_kind.entry(f.kind).or_default();
        if f.injected {
            e.0 += 1;
        } else {
            e.1 += 1;
        }
    }
    let mut md = String::new();
    let w = &mut md;
    let _ = writeln!(w, "# Chaos soak\n");
    let _ = writeln!(
        w,
        "Every role ran as its own process over a private nats-server while faults were injected at seeded random times: kill -9 of a role (restarted after a delay), SIGTERM of a role (sent once the role has installed its handler, i.e. logged `{READY_LINE}`; it drains and exits, then is restarted), SIGSTOP/SIGCONT of a role for a pause shorter or longer than the heartbeat's dead-after (3 s) and the lease (6 s), and kill -9 of nats-server (restarted on the same port and store). One fault is in flight at a time. The invariants are checked at every sample and at the end from the learner's `trained.jsonl` and `policy.version` in the `{CONTROL_BUCKET}` KV bucket (watched, and read at every sample), never from the trajectory stream (whose messages may be released once stored).\n"
    );
    let _ = writeln!(w, "- command: `{}`", spec.command);
    let _ = writeln!(
        w,
        "- seed {}, fault phase {:.0} s, mean gap between faults {:.1} s, samples every {:.1} s, run took {end:.0} s",
        spec.seed,
        duration,
        spec.fault_every.as_secs_f64(),
        spec.sample_every.as_secs_f64()
    );
    let _ = writeln!(
        w,
        "- config: η = {}, B = {}, G = {}, {} workers, tiny built-in model, step target {}",
        spec.eta, spec.groups_per_step, spec.group_size, spec.workers, spec.steps
    );
    let _ = writeln!(w, "- role logs: `{}`\n", logs.display());
    let _ = writeln!(
        w,
        "## Invariants\n\n| invariant | result | numbers |\n|---|---|---|"
    );
    for v in &verdicts {
        let _ = writeln!(
            w,
            "| {} | {} | {} |",
            v.name,
            if v.pass { "PASS" } else { "FAIL" },
            v.detail.replace('|', "/")
        );
    }
    let _ = writeln!(
        w,
        "\n## Faults\n\n| kind | injected | skipped |\n|---|---|---|"
    );
    for (k, (n, s)) in &per_kind {
        let _ = writeln!(w, "| {} | {n} | {s} |", k.name());
    }
    let _ = writeln!(
        w,
        "\n{} faults in all; {unplanned} planned faults fell after the end of the fault phase (one in flight delays the next). Every fault with its outcome: `faults.csv`.\n",
        c.faults.len()
    );
    let _ = writeln!(
        w,
        "## Memory\n\nRule: per process, the samples of its longest-lived start, from {warmup:.0} s (20 % of the fault phase, at most 60 s) after that start on; least-squares slope; flat when slope × {duration:.0} s (the fault phase) ≤ max({:.0} % of the median, {:.0} MiB). Fewer than 5 samples: not judged. nats-server is sampled and shown but not judged: it is not one of ours, and its file store caches blocks in memory as the write rate asks.\n",
        spec.mem_growth_frac * 100.0,
        spec.mem_growth_mib
    );
    let _ = writeln!(
        w,
        "| process | start judged | samples | median MiB | slope MiB/min | projected MiB | threshold MiB | verdict |\n|---|---|---|---|---|---|---|---|"
    );
    for m in &trends {
        let _ = writeln!(
            w,
            "| {} | #{} | {} | {:.1} | {:.2} | {:.1} | {:.1} | {} |",
            m.role,
            m.incarnation,
            m.samples,
            m.median_mib,
            m.slope_mib_per_min,
            m.projected_mib,
            m.threshold_mib,
            match (m.role.as_str(), m.flat) {
                ("nats-server", Some(true)) => "flat (shown, not judged)",
                ("nats-server", Some(false)) => "growing (shown, not judged)",
                (_, Some(true)) => "flat",
                (_, Some(false)) => "GROWING",
                (_, None) => "not judged",
            }
        );
    }
    let _ = writeln!(
        w,
        "\n## Disk\n\nRule: bounded when the maximum in the second half of the run is at most {:.0} % above the first half's maximum plus 4 MiB, or at most {:.0} MiB.\n\n| directory | max first half MiB | max second half MiB | verdict |\n|---|---|---|---|",
        spec.disk_margin * 100.0,
        spec.disk_bound_mib
    );
    for d in &disks {
        let _ = writeln!(
            w,
            "| {} | {:.2} | {:.2} | {} |",
            d.dir,
            d.max_first_mib,
            d.max_second_mib,
            if d.bounded { d.by } else { "UNBOUNDED" }
        );
    }
    if !store_parts.is_empty() {
        let _ = writeln!(
            w,
            "\nThe NATS store at the end, by stream (KV buckets are `KV_*`, object stores `OBJ_*`):\n\n| stream | MiB |\n|---|---|"
        );
        for (name, bytes) in store_parts {
            let _ = writeln!(w, "| {name} | {:.2} |", *bytes as f64 / MIB);
        }
    }
    let max_stream = c.samples.iter().filter_map(|s| s.stream_messages).max();
    let _ = writeln!(
        w,
        "\nLargest message count of the `{TRAJECTORY_STREAM}` stream seen: {}.\n\nFiles: `samples.csv` (every sample), `faults.csv`, `memory.png`, `disk.png`.",
        max_stream.map_or("none".into(), |m| m.to_string())
    );
    std::fs::write(out.join("chaos.md"), &md)
        .with_context(|| format!("cannot write {}", out.join("chaos.md").display()))?;

    let mut summary = String::new();
    let _ = writeln!(summary, "bench chaos: {}", out.join("chaos.md").display());
    for v in &verdicts {
        let _ = writeln!(
            summary,
            "  {:<26} {}  {}",
            v.name,
            if v.pass { "PASS" } else { "FAIL" },
            v.detail
        );
    }
    let _ = writeln!(
        summary,
        "  faults: {}",
        per_kind
            .iter()
            .map(|(k, (n, _))| format!("{} {n}", k.name()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(Report { verdicts, summary })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_always_means_the_same_schedule_and_every_kind_comes_round() {
        let a = schedule(7, 600.0, 5.0, 5);
        assert_eq!(a, schedule(7, 600.0, 5.0, 5));
        assert_ne!(a, schedule(8, 600.0, 5.0, 5));
        assert!(a.windows(2).all(|w| w[0].at < w[1].at));
        assert!(a.iter().all(|p| p.at < 600.0 && p.target < 5));
        for round in a.chunks_exact(4) {
            let kinds: std::collections::HashSet<FaultKind> =
                round.iter().map(|p| p.kind).collect();
            assert_eq!(kinds.len(), 4, "{round:?}");
        }
        let stops: Vec<f64> = a
            .iter()
            .filter(|p| p.kind == FaultKind::Stop)
            .map(|p| p.param)
            .collect();
        assert!(stops.iter().any(|&p| p < 3.0) && stops.iter().any(|&p| p > 6.0));
    }

    #[test]
    fn memory_is_judged_on_the_longest_start_after_warm_up() {
        let mib = MIB as u64;
        // Start 1: short, climbing; start 2: long and flat after warm-up.
        let mut s: Vec<(f64, u32, u64)> = (0..5)
            .map(|i| (i as f64, 1, (100 + i * 50) * mib))
            .collect();
        s.extend((0..60).map(|i| {
            (
                10.0 + i as f64 * 2.0,
                2,
                if i < 5 { 50 * mib } else { 200 * mib },
            )
        }));
        let m = memory_trend("learner", &s, 12.0, 600.0, 5, 32.0, 0.1);
        assert_eq!((m.incarnation, m.flat), (2, Some(true)), "{m:?}");
        // A leak of 1 MiB/s: 600 MiB over the run.
        let leak: Vec<(f64, u32, u64)> = (0..60)
            .map(|i| (i as f64 * 2.0, 1, (100 + 2 * i) * mib))
            .collect();
        let m = memory_trend("worker-1", &leak, 12.0, 600.0, 5, 32.0, 0.1);
        assert_eq!(m.flat, Some(false), "{m:?}");
        assert!((m.slope_mib_per_min - 60.0).abs() < 1e-6);
        assert_eq!(
            memory_trend("x", &leak[..4], 0.0, 600.0, 5, 32.0, 0.1).flat,
            None
        );
        // Growth sampled over 6 s after a 12 s warm-up (a role that exited
        // early) is not extrapolated over the run.
        let short: Vec<(f64, u32, u64)> = (0..30)
            .map(|i| (i as f64 * 0.6, 1, (100 + 4 * i) * mib))
            .collect();
        let m = memory_trend("learner", &short, 12.0, 600.0, 5, 32.0, 0.1);
        assert_eq!((m.samples, m.flat), (10, None), "{m:?}");
    }

    #[test]
    fn versions_are_ordered_by_kv_revision() {
        let mut log = VersionLog::default();
        log.record(0.0, 3, 1);
        log.record(0.1, 5, 2);
        // A read answered before revision 5 arrives late: old news.
        log.record(0.2, 3, 1);
        log.record(0.3, 5, 2);
        assert!(log.backwards.is_empty(), "{:?}", log.backwards);
        assert_eq!((log.seen.len(), log.last()), (2, Some(2)));
        // A newer revision with a lower version is a step back.
        log.record(0.4, 9, 1);
        assert_eq!(log.backwards.len(), 1, "{:?}", log.backwards);
    }

    #[test]
    fn disk_is_bounded_by_margin_or_bound() {
        let mib = MIB as u64;
        let flat: Vec<(f64, u64)> = (0..10).map(|i| (i as f64, 10 * mib)).collect();
        assert!(disk_bound("d", &flat, 0.25, 64.0).bounded);
        let growing: Vec<(f64, u64)> = (0..10).map(|i| (i as f64, i * 20 * mib)).collect();
        assert!(!disk_bound("d", &growing, 0.25, 64.0).bounded);
        assert!(disk_bound("d", &growing, 0.25, 1024.0).bounded);
    }

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration("30m"), Ok(Duration::from_secs(1800)));
        assert_eq!(parse_duration("60s"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("90"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1500ms"), Ok(Duration::from_millis(1500)));
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("m").is_err());
    }
}
