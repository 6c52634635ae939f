//! `asyncrl-bench chaos`: a soak of the whole system under random faults,
//! with its invariants checked while it runs and at the end.
//!
//! Every role runs as a child process of this binary (coordinator, buffer,
//! learner, two or more rollout workers) over private NATS, by default as
//! production runs it: a three-node JetStream cluster with every stream at
//! R3, TLS with verified client certificates, each role its own user of
//! `deploy/k8s/base/nats-auth.conf`, and routes that authenticate over TLS
//! (`--nats-nodes 1`, `--plain` for less), with the tiny built-in model
//! and short sequences (fast steps). A seeded RNG
//! plans the faults before the run starts (times relative to the start, so
//! a seed always means the same schedule): kill -9 of a role (restarted
//! after a short delay), SIGTERM of a role (it drains and exits; restarted),
//! SIGSTOP of a role and SIGCONT after a pause shorter or longer than the
//! heartbeat and lease timeouts, and kill -9 of a nats-server (in a
//! cluster the trajectory stream's leader; restarted on the same ports and
//! store). One fault is in flight at a time; one that is
//! due while another is still in flight starts when that one ends.
//!
//! The learner trains for the whole fault phase (no step target: the run
//! ends when the phase does), so every fault lands while it trains, and
//! the first kill -9 of the schedule is the learner's.
//!
//! The invariants are read from what survives any storage policy of the
//! trajectory stream: the learner's `trained.jsonl` (per step: the
//! trajectory and task ids, the version trained at, the oldest token
//! version, the largest version lag), `policy.version` in the control KV
//! bucket (watched, and read at every sample), and at the end the
//! coordinator's persisted state, what the stopped buffer holds and what
//! the streams still hold:
//! - every trajectory and every task was trained exactly once (an id never
//!   in two steps; a step trained again after a learner crash lists the
//!   same ids), every step a complete batch of B·G;
//! - nothing was lost: every task the coordinator issued is trained, held
//!   (buffer or stream), waiting to be issued again, leased, or quarantined;
//! - no trained token was older than η;
//! - versions never went backwards (the KV value; each step trains at
//!   step − 1 and publishes step);
//! - the steps are contiguous, and training never stalled for longer than
//!   the stall limit, to the end of the fault phase;
//! - the learner was killed (kill -9) while it trained;
//! - each role's resident memory and each directory's disk use show no
//!   upward trend after warm-up (a least-squares slope projected over the
//!   run, against a threshold that linear growth fails);
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
use asyncrl_protos::subjects::{
    CONTROL_BUCKET, COORDINATOR_STATE_KEY, GROUP_DROP_STREAM, POLICY_VERSION_KEY,
    TRAJECTORY_STREAM, TRAJECTORY_SUBJECT_PREFIX,
};
use asyncrl_protos::v1::{CoordinatorState, GroupDropped};
use asyncrl_transport::Bus;
use futures::StreamExt as _;
use rand::SeedableRng as _;
use rand::seq::SliceRandom as _;
use rand::{Rng as _, rngs::StdRng};

use asyncrl_app::plot::{Series, line_chart};

use super::stats::median;
use crate::cluster::NatsSetup;
use crate::configs;
use crate::invariants::{LossCheck, TaskWhereabouts, check_loss, check_trained};
use crate::process::{READY_LINE, RoleProcess};
use crate::secure::SecureNats;

/// What `asyncrl-bench chaos` runs.
#[derive(Debug, Clone)]
pub struct ChaosBench {
    /// Faults are injected during this long (from the start of the roles).
    pub duration: Duration,
    pub seed: u64,
    pub workers: usize,
    /// Mean gap between faults (each gap is uniform in 0.5..1.5 times it).
    pub fault_every: Duration,
    pub sample_every: Duration,
    /// Training has stalled when no step was trained for this long.
    pub stall_limit: Duration,
    pub eta: u32,
    pub groups_per_step: u32,
    pub group_size: u32,
    /// Memory is flat when its projected growth over the run is at most
    /// max(`mem_growth_frac` × median, `mem_growth_mib`).
    pub mem_growth_mib: f64,
    pub mem_growth_frac: f64,
    /// Disk use is flat when its projected growth over the run is at most
    /// max(`disk_growth_frac` × median, `disk_growth_mib`).
    pub disk_growth_mib: f64,
    pub disk_growth_frac: f64,
    /// nats-servers (1, or 3 for a cluster with every stream at R3).
    pub nats_nodes: usize,
    /// TLS, per-role credentials and authenticated routes, as production.
    pub secure: bool,
    pub out: PathBuf,
    /// The command line, for the report.
    pub command: String,
}

/// Tasks in the soak's data set: the run passes through it several times
/// (each pass an epoch, with its own wire task ids).
const TASKS: usize = 4096;

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
    /// kill -9 of a nats-server (in a cluster, the trajectory stream's
    /// leader), restarted after `param` seconds.
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
/// faults), targets uniform over `roles`, except the first kill -9, which
/// is the learner's (`learner`: its index), so that every soak kills it
/// while it trains. SIGSTOP pauses are short (under the heartbeat's
/// dead-after) or long (past it, often past the lease) with equal odds.
pub fn schedule(
    seed: u64,
    duration: f64,
    every: f64,
    roles: usize,
    learner: usize,
) -> Vec<Planned> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = Vec::new();
    let mut t = 0.0;
    let mut round: Vec<FaultKind> = Vec::new();
    let mut learner_killed = false;
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
        let mut target = rng.random_range(0..roles);
        if kind == FaultKind::Kill9 && !learner_killed {
            learner_killed = true;
            target = learner;
        }
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

/// The growth verdict of a series: one role's memory, or one directory's
/// disk use.
#[derive(Debug, Clone)]
pub struct Trend {
    /// The role or the directory.
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

/// Judges one series from its samples `(t, incarnation, bytes)`: the
/// incarnation with the longest sampled span, its samples from `warmup`
/// seconds after its first sample on; flat when slope × `run_secs` ≤
/// max(frac × median, mib). Not judged with fewer than `min_samples`
/// samples, or samples spanning less than `warmup` seconds: a slope over a
/// few seconds (a role that exited early) projected
/// over the whole run is noise, not a leak.
pub fn trend(
    role: &str,
    samples: &[(f64, u32, u64)],
    warmup: f64,
    run_secs: f64,
    min_samples: usize,
    mib: f64,
    frac: f64,
) -> Trend {
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
        return Trend {
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
    Trend {
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

/// The longest time training went without a new step, `(seconds, ending
/// at)`: between consecutive steps in `samples` (`(t, highest step)`),
/// from `start` to the first step, and from the last step to `end`.
pub fn longest_stall(samples: &[(f64, u64)], start: f64, end: f64) -> (f64, f64) {
    let mut last_change = start;
    let mut last_step = 0;
    let mut worst = (0.0, start);
    for &(t, step) in samples {
        if step > last_step {
            if t - last_change > worst.0 {
                worst = (t - last_change, t);
            }
            last_step = step;
            last_change = t;
        }
    }
    if end - last_change > worst.0 {
        worst = (end - last_change, end);
    }
    worst
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

/// The NATS of a run, in words (the report).
fn nats_description(spec: &ChaosBench) -> String {
    let servers = if spec.nats_nodes > 1 {
        format!(
            "a private {}-node JetStream cluster (every stream, bucket and object store at R{})",
            spec.nats_nodes, spec.nats_nodes
        )
    } else {
        "a private nats-server".to_owned()
    };
    if spec.secure {
        format!(
            "{servers} secured as in production: TLS with verified client certificates (a test CA), each role its own user with the permissions of `deploy/k8s/base/nats-auth.conf`{}",
            if spec.nats_nodes > 1 {
                ", routes that authenticate and speak TLS"
            } else {
                ""
            }
        )
    } else {
        format!("{servers}, plain (no TLS, no credentials)")
    }
}

/// A nats-server's name in the report: `nats-n0`, `nats-n1`, ...
fn nats_name(nats: &asyncrl_testkit::NatsCluster, node: usize) -> String {
    format!("nats-{}", nats.name(node))
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
        /// The node (index in the cluster).
        node: usize,
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

/// Every message a stream holds now: `(subject, payload)`.
async fn stream_messages(
    js: &async_nats::jetstream::Context,
    name: &str,
) -> anyhow::Result<Vec<(String, Vec<u8>)>> {
    let mut stream = js
        .get_stream(name)
        .await
        .with_context(|| format!("cannot open the stream {name}"))?;
    let state = stream
        .info()
        .await
        .with_context(|| format!("cannot read the state of {name}"))?
        .state
        .clone();
    let mut out = Vec::with_capacity(state.messages as usize);
    if state.messages == 0 {
        return Ok(out);
    }
    for seq in state.first_sequence..=state.last_sequence {
        // A sequence acked and removed since is a gap, not an error.
        if let Ok(m) = stream.get_raw_message(seq).await {
            out.push((m.subject.to_string(), m.payload.to_vec()));
        }
    }
    Ok(out)
}

/// When the run ended.
struct End {
    /// The learner was stopped (the end of training) at this many seconds.
    training: f64,
    /// Every role had stopped.
    run: f64,
    /// Planned faults that fell after the fault phase.
    unplanned: usize,
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
    nats: asyncrl_testkit::NatsCluster,
    /// Starts of each node.
    nats_starts: Vec<u32>,
    /// How the servers are secured, and how the bench's own connections
    /// reach them (as the unrestricted observer).
    nats_setup: NatsSetup,
    nats_url: String,
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

    fn trained_text(&self) -> String {
        std::fs::read_to_string(self.run_dir.join("trained.jsonl")).unwrap_or_default()
    }

    fn batch(&self) -> usize {
        (self.spec.groups_per_step * self.spec.group_size) as usize
    }

    /// Reaps exited roles: an exit nobody asked for is a crash, and the
    /// role is started again.
    fn reap(&mut self) {
        let t = self.now();
        for i in 0..self.procs.len() {
            if self.procs[i].expect_exit {
                continue;
            }
            let Some(status) = self.procs[i].poll() else {
                continue;
            };
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
            if !self.procs[i].is_running() {
                self.start_proc(i)?;
            }
        }
        Ok(())
    }

    /// Injects a planned fault; returns what it waits for next (None: it is
    /// over already, e.g. skipped).
    fn inject(&mut self, p: &Planned) -> anyhow::Result<Option<Next>> {
        let t = self.now();
        let nats_node = (p.kind == FaultKind::NatsKill).then(|| self.nats_target());
        let target = match nats_node {
            Some(node) => nats_name(&self.nats, node),
            None => self.procs[p.target].name.clone(),
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
                let node = nats_node.unwrap_or(0);
                self.nats.kill9(node);
                rec.outcome = format!("killed; restart after {:.1}s", p.param);
                Some(Next::NatsUp {
                    node,
                    at: t + p.param,
                })
            }
            _ if !self.procs[p.target].is_running() => {
                rec.injected = false;
                rec.outcome = "skipped: the role is down".into();
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
                if !self.procs[role].is_running() {
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
            Next::NatsUp { node, at } => {
                if t < at {
                    return Ok(Some(Next::NatsUp { node, at }));
                }
                self.restart_nats(node)?;
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
        for (i, node) in self.nats.nodes().iter().enumerate() {
            rss.push(
                node.pid()
                    .and_then(rss_bytes)
                    .map(|b| (self.nats_starts[i], b)),
            );
        }
        let s = Sample {
            t,
            step: check.max_step,
            stream_messages,
            nats_bytes: self
                .nats
                .nodes()
                .iter()
                .map(|n| dir_bytes(&n.store_dir().join("jetstream")))
                .sum(),
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

    /// The loss invariant, once every role has stopped (nats-server up):
    /// where each task the coordinator issued is.
    fn loss_check(&self, tasks: &Path) -> anyhow::Result<LossCheck> {
        let taskset = asyncrl_coordinator::TaskSet::load(
            &[asyncrl_config::DatasetConfig::jsonl(
                "arith",
                tasks.to_path_buf(),
            )],
            None,
        )
        .context("cannot load the task file")?;
        let buffer_config = asyncrl_config::Config::load(&self.spec.out.join("buffer.toml"))
            .context("cannot load the buffer's config")?
            .buffer;
        let held = asyncrl_buffer::held_tasks(&self.run_dir.join("buffer"), &buffer_config)
            .context("cannot read what the buffer holds")?;
        let trained = check_trained(&self.trained_text(), self.spec.eta, self.batch()).tasks;
        let bus = self.bus.clone();
        let (setup, url) = (&self.nats_setup, &self.nats_url);
        let (state, in_stream, drop_pending) = self.rt.block_on(async move {
            let kv = bus
                .kv(CONTROL_BUCKET)
                .await
                .context("cannot open the control bucket")?;
            let entry = kv
                .get(COORDINATOR_STATE_KEY)
                .await
                .context("cannot read the coordinator's state")?
                .context("the coordinator stored no state")?;
            let state = CoordinatorState::decode(entry.value.as_ref())
                .context("cannot decode the coordinator's state")?;
            let client = setup.observe(url).await?;
            let js = async_nats::jetstream::new(client);
            let prefix = format!("{TRAJECTORY_SUBJECT_PREFIX}.");
            let in_stream = stream_messages(&js, TRAJECTORY_STREAM)
                .await?
                .into_iter()
                .filter_map(|(subject, _)| subject.strip_prefix(&prefix).map(str::to_owned))
                .collect();
            let drop_pending = stream_messages(&js, GROUP_DROP_STREAM)
                .await?
                .into_iter()
                .filter_map(|(_, payload)| GroupDropped::decode(payload.as_slice()).ok())
                .map(|g| g.task_id)
                .collect();
            anyhow::Ok((state, in_stream, drop_pending))
        })?;
        Ok(check_loss(
            &state,
            |i| taskset.get(i).map(|t| t.id.clone()),
            &TaskWhereabouts {
                trained,
                held,
                in_stream,
                drop_pending,
            },
        ))
    }

    /// The node a NATS fault kills: the trajectory stream's leader (in a
    /// cluster: the fault that moves the stream's leadership), else node 0.
    fn nats_target(&mut self) -> usize {
        self.nats.stream_leader(TRAJECTORY_STREAM).unwrap_or(0)
    }

    fn restart_nats(&mut self, node: usize) -> anyhow::Result<()> {
        self.nats
            .restart(node)
            .with_context(|| format!("restart {}", nats_name(&self.nats, node)))?;
        self.nats_starts[node] += 1;
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
    nats: &NatsSetup,
    worker: Option<&str>,
) -> asyncrl_config::Config {
    let mut c = configs::cluster_role(run_dir, url, tasks);
    // Every stream, bucket and object store on every server; the roles'
    // own users and TLS when the servers are secured.
    c.bus.replicas = nats.cluster_nodes.max(1);
    c.bus.tls = nats.bus_tls.clone();
    c.bus.roles = nats.bus_roles.clone();
    c.run.name = "chaos".into();
    c.run.seed = spec.seed;
    // No step target: the learner trains until the run stops it.
    c.run.max_steps = 0;
    c.staleness.eta = spec.eta;
    c.staleness.groups_per_step = spec.groups_per_step;
    c.staleness.group_size = spec.group_size;
    c.bus.connect_timeout = Duration::from_secs(30);
    c.buffer.retention = asyncrl_config::RetentionPolicy::default();
    c.buffer.segment_max_bytes = 256 * 1024;
    // Compacted often, so that a served log growing with the run shows.
    c.buffer.state_log_compact_bytes = 256 * 1024;
    c.worker.id = worker.map(str::to_owned);
    c
}

/// How long the run may take, after the fault phase, to end the fault in
/// flight and bring back the roles it took down.
const SETTLE_LIMIT: f64 = 120.0;

/// The learner's index in [`role_names`].
fn learner_index(workers: usize) -> usize {
    role_names(workers)
        .iter()
        .position(|(_, role)| *role == "learner")
        .unwrap_or(0)
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
        learner_index(spec.workers),
    );
    let mut out = String::new();
    for p in &plan {
        let target = match p.kind {
            FaultKind::NatsKill => "nats (leader)",
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
    anyhow::ensure!(
        !spec.sample_every.is_zero() && !spec.fault_every.is_zero() && !spec.stall_limit.is_zero(),
        "--sample-every, --fault-every and --stall-limit must be positive"
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

    let tasks = out.join("tasks.jsonl");
    let items = asyncrl_tasks::generate_with(
        asyncrl_tasks::BuiltinTask::Arith,
        TASKS,
        spec.seed,
        asyncrl_tasks::GenerateOptions { max_operand: 20 },
    );
    asyncrl_tasks::write_jsonl(&tasks, &items).context("cannot write the task file")?;

    let nats_setup = if spec.secure {
        let pki = out.join("pki");
        std::fs::create_dir_all(&pki)
            .with_context(|| format!("cannot create {}", pki.display()))?;
        let tag = format!("{}-{}", spec.seed, std::process::id());
        SecureNats::new(&pki, &tag)?.setup(spec.nats_nodes)?
    } else {
        NatsSetup {
            cluster_nodes: spec.nats_nodes,
            ..NatsSetup::default()
        }
    };
    let nats = nats_setup
        .start()
        .context("cannot start the nats-servers (run scripts/setup)")?;
    let url = nats_setup.bus_url(&nats);
    // The bench's own connection: the observer, unrestricted.
    let (user, password) = nats_setup.observer.clone().unzip();
    let mut bus_config = asyncrl_config::BusConfig {
        url: url.clone(),
        user,
        password: password.map(asyncrl_config::Secret::new),
        tls: nats_setup.bus_tls.clone(),
        replicas: nats.len(),
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
        role_config(spec, &run_dir, &tasks, &url, &nats_setup, worker)
            .write(&config)
            .with_context(|| format!("cannot write the config of {name}"))?;
        procs.push(Proc {
            p: RoleProcess::new(&name, role, config, logs.join(format!("{name}.log"))),
            expect_exit: false,
        });
    }

    let mut samples_csv = std::fs::File::create(out.join("samples.csv"))
        .with_context(|| format!("cannot create {}", out.join("samples.csv").display()))?;
    let mut header =
        String::from("t_s,learner_step,stream_messages,nats_store_bytes,buffer_dir_bytes");
    let node_names: Vec<String> = (0..nats.len()).map(|i| nats_name(&nats, i)).collect();
    for p in procs
        .iter()
        .map(|p| p.name.as_str())
        .chain(node_names.iter().map(String::as_str))
    {
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
        learner_index(spec.workers),
    );
    let start = Instant::now();
    let versions = Arc::new(Mutex::new(VersionLog::default()));
    let mut c = Chaos {
        spec,
        rt,
        bin,
        start,
        nats_starts: vec![1; nats.len()],
        nats,
        nats_setup,
        nats_url: url.clone(),
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
        "bench chaos: {} roles over {url}, {} faults planned in {duration:.0}s of training; logs in {}",
        c.procs.len(),
        plan.len(),
        logs.display()
    );

    // The fault phase, training all along; then the fault in flight ends
    // and the roles it took down come back (bounded: a role that keeps
    // crashing is a failed verdict, not a hung bench).
    let sample_every = spec.sample_every.as_secs_f64();
    let settle_deadline = duration + SETTLE_LIMIT;
    let mut next_sample = 0.0;
    let mut planned = plan.iter().peekable();
    let mut in_flight: Option<Next> = None;
    loop {
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
            break;
        }
        if t >= settle_deadline {
            eprintln!(
                "bench chaos: t={t:.0}s the run did not settle within {SETTLE_LIMIT:.0}s of the fault phase's end"
            );
            if let Some(Next::NatsUp { node, .. }) = in_flight {
                c.restart_nats(node)?;
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let unplanned = planned.count();
    c.sample()?;
    let training_end = c.now();
    let stopped = c.stop_all();
    c.sample()?;
    watcher.abort();
    let end = c.now();
    let loss = c.loss_check(&tasks);
    if let Err(e) = &loss {
        eprintln!("bench chaos: cannot check for loss: {e:#}");
    }
    // Per stream, summed over the nodes (each holds a replica at R3).
    let mut store_parts: BTreeMap<String, u64> = BTreeMap::new();
    for i in 0..c.nats.len() {
        let dir = c.nats.nodes()[i].store_dir().to_path_buf();
        for (stream, bytes) in store_breakdown(&dir.join("jetstream")) {
            *store_parts.entry(stream).or_default() += bytes;
        }
        let _ = std::fs::copy(
            dir.join("nats-server.log"),
            logs.join(format!("{}.log", nats_name(&c.nats, i))),
        );
        c.nats.node(i).stop();
    }
    let mut store_parts: Vec<(String, u64)> = store_parts.into_iter().collect();
    store_parts.sort_by_key(|p| std::cmp::Reverse(p.1));

    let report = write_report(
        &c,
        &stopped,
        &End {
            training: training_end,
            run: end,
            unplanned,
        },
        &loss,
        &logs,
        &store_parts,
    )?;
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
    ended: &End,
    loss: &anyhow::Result<LossCheck>,
    logs: &Path,
    store_parts: &[(String, u64)],
) -> anyhow::Result<Report> {
    let (unplanned, end) = (ended.unplanned, ended.run);
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
                "{} trajectories of {} tasks in {} steps, each in one step, every step B·G = {}; {} steps trained again after a learner crash, on the same trajectories",
                check.trajectories,
                check.tasks.len(),
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
    // Training through the fault phase: no stall longer than the limit,
    // from the start to the learner's stop.
    let duration = spec.duration.as_secs_f64();
    let steps_at: Vec<(f64, u64)> = c
        .samples
        .iter()
        .filter(|s| s.t <= ended.training)
        .map(|s| (s.t, s.step))
        .collect();
    let (stall, stall_at) = longest_stall(&steps_at, 0.0, ended.training);
    let limit = spec.stall_limit.as_secs_f64();
    let kv_last = versions.last();
    verdicts.push(Verdict {
        name: "training through the fault phase",
        pass: check.max_step > 0 && stall <= limit && ended.training >= duration,
        detail: format!(
            "{} steps trained in {:.0} s (the fault phase {duration:.0} s), policy.version {}; longest time without a new step {stall:.1} s (ending at t={stall_at:.0}s), limit {limit:.0} s",
            check.max_step,
            ended.training,
            kv_last.map_or("unknown".into(), |v| v.to_string()),
        ),
    });
    let learner_kills: Vec<f64> = c
        .faults
        .iter()
        .filter(|f| f.injected && f.kind == FaultKind::Kill9 && f.target == "learner")
        .map(|f| f.at)
        .collect();
    verdicts.push(Verdict {
        name: "learner killed while training",
        pass: !learner_kills.is_empty(),
        detail: if learner_kills.is_empty() {
            "no kill -9 of the learner was injected (each was skipped)".into()
        } else {
            format!(
                "kill -9 of the learner at t = {} s, each while it trained",
                learner_kills
                    .iter()
                    .map(|t| format!("{t:.0}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        },
    });
    verdicts.push(match loss {
        Ok(l) => Verdict {
            name: "nothing lost",
            pass: l.lost_count == 0 && l.issued > 0,
            detail: if l.lost_count == 0 {
                format!(
                    "{} tasks issued: {} trained, {} held by the buffer, {} in the stream, {} queued to be issued again, {} leased, {} with a drop report pending, {} quarantined",
                    l.issued,
                    l.trained,
                    l.held,
                    l.in_stream,
                    l.queued,
                    l.leased,
                    l.drop_pending,
                    l.quarantined
                )
            } else {
                format!(
                    "{} of {} issued tasks are neither trained, held, waiting nor quarantined: {}",
                    l.lost_count,
                    l.issued,
                    l.lost.join(", ")
                )
            },
        },
        Err(e) => Verdict {
            name: "nothing lost",
            pass: false,
            detail: format!("could not be checked: {e:#}"),
        },
    });

    // Memory.
    let warmup = (0.2 * duration).min(60.0);
    let mut names: Vec<String> = c.procs.iter().map(|p| p.name.clone()).collect();
    names.extend((0..c.nats.len()).map(|i| nats_name(&c.nats, i)));
    let trends: Vec<Trend> = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let pts: Vec<(f64, u32, u64)> = c
                .samples
                .iter()
                .filter_map(|s| s.rss[i].map(|(inc, b)| (s.t, inc, b)))
                .collect();
            trend(
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
    // The nats-servers are sampled and shown, but judged are the roles:
    // their file-store caches follow the write rate (see the report).
    let role_trends = &trends[..c.procs.len()];
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

    // Disk: the same rule as memory, on each directory's bytes.
    let disk_series = |bytes: &dyn Fn(&Sample) -> u64| -> Vec<(f64, u32, u64)> {
        c.samples.iter().map(|s| (s.t, 0, bytes(s))).collect()
    };
    let disks = [
        trend(
            "nats store",
            &disk_series(&|s| s.nats_bytes),
            warmup,
            duration,
            5,
            spec.disk_growth_mib,
            spec.disk_growth_frac,
        ),
        trend(
            "buffer data dir",
            &disk_series(&|s| s.buffer_bytes),
            warmup,
            duration,
            5,
            spec.disk_growth_mib,
            spec.disk_growth_frac,
        ),
    ];
    let disk_growing: Vec<String> = disks
        .iter()
        .filter(|d| d.flat != Some(true))
        .map(|d| match d.flat {
            Some(_) => format!("{} (+{:.1} MiB projected)", d.role, d.projected_mib),
            None => format!("{} (too few samples to judge)", d.role),
        })
        .collect();
    verdicts.push(Verdict {
        name: "disk flat after warm-up",
        pass: disk_growing.is_empty(),
        detail: if disk_growing.is_empty() {
            disks
                .iter()
                .map(|d| {
                    format!(
                        "{}: median {:.1} MiB, {:+.2} MiB projected over the run (threshold {:.1})",
                        d.role, d.median_mib, d.projected_mib, d.threshold_mib
                    )
                })
                .collect::<Vec<_>>()
                .join("; ")
        } else {
            format!("growing: {}", disk_growing.join(", "))
        },
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
        "Every role ran as its own process over {} while faults were injected at seeded random times: kill -9 of a role (restarted after a delay), SIGTERM of a role (sent once the role has installed its handler, i.e. logged `{READY_LINE}`; it drains and exits, then is restarted), SIGSTOP/SIGCONT of a role for a pause shorter or longer than the heartbeat's dead-after (3 s) and the lease (6 s), and kill -9 of {} (restarted on the same ports and store). One fault is in flight at a time, and every one lands while the learner trains (it trains until the fault phase ends; the schedule's first kill -9 is the learner's). The invariants are checked at every sample and at the end from the learner's `trained.jsonl` and `policy.version` in the `{CONTROL_BUCKET}` KV bucket (watched, and read at every sample); the loss invariant at the end from the coordinator's persisted state, what the stopped buffer holds (its served log and segments) and what the trajectory and drop-report streams still hold.\n",
        nats_description(spec),
        if spec.nats_nodes > 1 {
            "the node that led the trajectory stream"
        } else {
            "nats-server"
        }
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
        "- config: η = {}, B = {}, G = {}, {} workers, tiny built-in model, {TASKS} tasks (several epochs), no step target: the learner trains through the fault phase and is stopped at t={:.0}s",
        spec.eta, spec.groups_per_step, spec.group_size, spec.workers, ended.training
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
        "## Memory\n\nRule: per process, the samples of its longest-lived start, from {warmup:.0} s (20 % of the fault phase, at most 60 s) after that start on; least-squares slope; flat when slope × {duration:.0} s (the fault phase) ≤ max({:.0} % of the median, {:.0} MiB). Fewer than 5 samples: not judged. The nats-servers are sampled and shown but not judged: they are not ours, and their file stores cache blocks in memory as the write rate asks.\n",
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
            match (m.role.starts_with("nats-"), m.flat) {
                (true, Some(true)) => "flat (shown, not judged)",
                (true, Some(false)) => "growing (shown, not judged)",
                (_, Some(true)) => "flat",
                (_, Some(false)) => "GROWING",
                (_, None) => "not judged",
            }
        );
    }
    let _ = writeln!(
        w,
        "\n## Disk\n\nRule: as for memory, per directory: the samples from {warmup:.0} s on; least-squares slope; flat when slope × {duration:.0} s ≤ max({:.0} % of the median, {:.1} MiB). A directory that grows linearly by a third of its size over the run fails it.\n\n| directory | samples | median MiB | slope MiB/min | projected MiB | threshold MiB | verdict |\n|---|---|---|---|---|---|---|",
        spec.disk_growth_frac * 100.0,
        spec.disk_growth_mib
    );
    for d in &disks {
        let _ = writeln!(
            w,
            "| {} | {} | {:.2} | {:.3} | {:.2} | {:.2} | {} |",
            d.role,
            d.samples,
            d.median_mib,
            d.slope_mib_per_min,
            d.projected_mib,
            d.threshold_mib,
            match d.flat {
                Some(true) => "flat",
                Some(false) => "GROWING",
                None => "not judged",
            }
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
        let a = schedule(7, 600.0, 5.0, 5, 2);
        assert_eq!(a, schedule(7, 600.0, 5.0, 5, 2));
        assert_ne!(a, schedule(8, 600.0, 5.0, 5, 2));
        // The first kill -9 is the learner's, whatever the seed.
        for seed in 0..20 {
            let first = schedule(seed, 600.0, 5.0, 5, 2)
                .into_iter()
                .find(|p| p.kind == FaultKind::Kill9)
                .expect("a kill -9 in 600 s");
            assert_eq!(first.target, 2, "seed {seed}");
        }
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
        let m = trend("learner", &s, 12.0, 600.0, 5, 32.0, 0.1);
        assert_eq!((m.incarnation, m.flat), (2, Some(true)), "{m:?}");
        // A leak of 1 MiB/s: 600 MiB over the run.
        let leak: Vec<(f64, u32, u64)> = (0..60)
            .map(|i| (i as f64 * 2.0, 1, (100 + 2 * i) * mib))
            .collect();
        let m = trend("worker-1", &leak, 12.0, 600.0, 5, 32.0, 0.1);
        assert_eq!(m.flat, Some(false), "{m:?}");
        assert!((m.slope_mib_per_min - 60.0).abs() < 1e-6);
        assert_eq!(trend("x", &leak[..4], 0.0, 600.0, 5, 32.0, 0.1).flat, None);
        // Growth sampled over 6 s after a 12 s warm-up (a role that exited
        // early) is not extrapolated over the run.
        let short: Vec<(f64, u32, u64)> = (0..30)
            .map(|i| (i as f64 * 0.6, 1, (100 + 4 * i) * mib))
            .collect();
        let m = trend("learner", &short, 12.0, 600.0, 5, 32.0, 0.1);
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
    fn linear_growth_fails_the_memory_and_disk_rules_and_a_sawtooth_passes() {
        let mib = MIB as u64;
        // The defaults of `asyncrl-bench chaos`: memory max(5 %, 16 MiB),
        // disk max(25 %, 1 MiB), over a 30-minute run sampled every 2 s.
        let run = 1800.0;
        let times = || (0..900).map(|i| i as f64 * 2.0);
        // A role of 400 MiB leaking 1 MiB a minute: 30 MiB over the run.
        let leak: Vec<(f64, u32, u64)> = times()
            .map(|t| (t, 1, 400 * mib + (t / 60.0 * MIB) as u64))
            .collect();
        let m = trend("learner", &leak, 60.0, run, 5, 16.0, 0.05);
        assert_eq!(m.flat, Some(false), "{m:?}");
        // The buffer's served log growing 316 bytes a step at 7 steps a
        // second on 2 MiB of segments: about 4 MiB over the run.
        let log: Vec<(f64, u32, u64)> = times()
            .map(|t| (t, 0, 2 * mib + (t * 7.0 * 316.0) as u64))
            .collect();
        let d = trend("buffer data dir", &log, 60.0, run, 5, 1.0, 0.25);
        assert_eq!(d.flat, Some(false), "{d:?}");
        // Segments written and retired: a sawtooth between 1 and 3 MiB.
        let saw: Vec<(f64, u32, u64)> = times()
            .map(|t| (t, 0, mib + ((t % 120.0) / 60.0 * MIB) as u64))
            .collect();
        let d = trend("buffer data dir", &saw, 60.0, run, 5, 1.0, 0.25);
        assert_eq!(d.flat, Some(true), "{d:?}");
    }

    #[test]
    fn the_longest_stall_counts_from_the_start_and_to_the_end() {
        let steps = [
            (5.0, 0),
            (10.0, 3),
            (12.0, 5),
            (40.0, 5),
            (70.0, 9),
            (75.0, 12),
        ];
        assert_eq!(longest_stall(&steps, 0.0, 80.0), (58.0, 70.0));
        // Training that stopped at t=75 of a run stopped at 200.
        assert_eq!(longest_stall(&steps, 0.0, 200.0), (125.0, 200.0));
        // No step at all: the whole run.
        assert_eq!(longest_stall(&[(1.0, 0)], 0.0, 30.0), (30.0, 30.0));
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
