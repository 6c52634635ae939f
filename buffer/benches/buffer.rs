//! Buffer benchmarks against a private nats-server (started here), each
//! printed beside its raw baseline, measured in the same run in alternating
//! rounds (the machine may be loaded: compare only within one run):
//!
//! - ingest: JetStream publish-with-ack of the encoded trajectories (1 k
//!   completion tokens each, 64 in flight) to a plain stream (raw: the
//!   ceiling of the transport, no buffer involved) against the same bytes
//!   published the same way to `TRAJECTORIES`, timed until the buffer has
//!   decoded, written, fsynced and acked every one (fsync "always", then
//!   "never"); with the CPU time of this process (publisher and buffer) and
//!   of nats-server per 1 000 messages;
//! - resident bytes per token;
//! - serving a 64-group batch (G = 8, 1 k tokens, 6.4 MB) in process: plan,
//!   commit, gather and encode, with the groups' rows in runs (as one
//!   worker's group arrives) and scattered (every row its own run), against
//!   the previous gather (interleave + IPC writer) and a memcpy of the bytes;
//! - serving it over NATS, request to bytes in hand (the batch goes through
//!   the object store), against a put and a get of the same bytes through
//!   the async-nats object store directly.
//!
//! `cargo bench -p asyncrl-buffer` (quick: `-- --quick`; only some parts:
//! `-- ingest`, `-- serve`, `-- nats`, `-- fsync_never`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use arrow::array::RecordBatch;
use arrow::ipc::writer::StreamWriter;
use bytes::Bytes;
use futures::StreamExt;
use tokio::io::AsyncReadExt;

use asyncrl_buffer::core::{Ask, Core, Outcome, RowMeta};
use asyncrl_buffer::testing::{traj, traj_of};
use asyncrl_buffer::{
    Buffer, BufferHandle, CancellationToken, batch_parts, encode_batch, encode_parts,
};
use asyncrl_config::{Config, FsyncPolicy, SamplingPolicy};
use asyncrl_protos::arrow_schema::to_record_batch;
use asyncrl_protos::subjects::{BUFFER_BATCH, trajectory_subject};
use asyncrl_protos::v1::{BatchReply, BatchRequest};
use asyncrl_protos::{Message, Trajectory};
use asyncrl_telemetry::Metrics;
use asyncrl_testkit::NatsServer;
use asyncrl_transport::{Bus, NatsBus, StreamSpec, TransportMetrics};

const TOKENS: usize = 1024;
const IN_FLIGHT: usize = 64;
const GROUPS: usize = 64;
const G: u32 = 8;

fn config(url: &str, dir: &std::path::Path, sampling: &str) -> Config {
    let mut c = Config::isolated(dir, url);
    c.buffer.ingest_batch = 256;
    c.buffer.fetch_wait = Duration::from_millis(20);
    match sampling {
        "fifo" => {}
        "reuse" => {
            c.buffer.sampling = SamplingPolicy::Reuse;
            c.buffer.reuse_max = Some(64);
        }
        "fsync_never" => c.buffer.fsync = FsyncPolicy::Never,
        other => panic!("no bench config {other:?}"),
    }
    c.validate().expect("bench config");
    c
}

async fn publish_all(bus: &NatsBus, msgs: &[(String, String, Bytes)]) {
    let results: Vec<_> = futures::stream::iter(msgs.iter())
        .map(|(subject, id, payload)| bus.publish_durable(subject, id, payload.clone()))
        .buffer_unordered(IN_FLIGHT)
        .collect()
        .await;
    for r in results {
        r.expect("publish");
    }
}

/// (subject, message id, payload) of each trajectory, to publish.
fn messages(trajs: Vec<Trajectory>, subject: fn(&str) -> String) -> Vec<(String, String, Bytes)> {
    trajs
        .into_iter()
        .map(|t| {
            (
                subject(&t.task_id),
                t.uuid.clone(),
                Bytes::from(t.encode_to_vec()),
            )
        })
        .collect()
}

/// Publishes 128 fresh groups of 8 and waits until the buffer holds at
/// least `ready` groups.
async fn publish_groups(nats: &NatsBus, buffer: &Running, ready: usize) {
    publish_all(nats, &messages(fresh(128 * 8, 8), trajectory_subject)).await;
    while buffer.handle.stats().ready_groups < ready {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

static SERIAL: AtomicU64 = AtomicU64::new(0);

/// `n` fresh trajectories in groups of `g` (1: every one servable at once).
fn fresh(n: u64, g: u32) -> Vec<Trajectory> {
    // Whole groups only: start at a multiple of g.
    let g64 = u64::from(g);
    let n = n.div_ceil(g64) * g64;
    let base = loop {
        let cur = SERIAL.load(Ordering::SeqCst);
        let base = cur.div_ceil(g64) * g64;
        if SERIAL
            .compare_exchange(cur, base + n, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            break base;
        }
    };
    (0..n)
        .map(|i| {
            let k = base + i;
            let group = k / u64::from(g);
            traj_of(
                &format!("t{group}"),
                &format!("g{group}"),
                k as u32,
                (k % u64::from(g)) as u32,
                g,
                0,
                TOKENS,
            )
        })
        .collect()
}

struct Running {
    handle: BufferHandle,
    metrics: Metrics,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), asyncrl_buffer::BufferError>>,
    _dir: tempfile::TempDir,
}

impl Running {
    async fn stop(self) {
        self.stop.cancel();
        self.task.await.unwrap().unwrap();
    }
}

async fn start(bus: Arc<dyn Bus>, url: &str, sampling: &str) -> Running {
    let dir = tempfile::tempdir().unwrap();
    let config = config(url, dir.path(), sampling);
    let metrics = Metrics::new();
    let buffer = Buffer::open(&config, bus, &metrics).await.expect("open");
    let handle = buffer.handle();
    let stop = CancellationToken::new();
    let task = tokio::spawn(buffer.run(stop.clone()));
    Running {
        handle,
        metrics,
        stop,
        task,
        _dir: dir,
    }
}

/// A metric's value from the registry's text (0 when absent).
fn metric(m: &Metrics, name: &str) -> f64 {
    let text = m.encode_prometheus_text().unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

async fn request(bus: &dyn Bus, step: u64, groups: u32) -> BatchReply {
    let req = BatchRequest {
        learner_version: step as i32 - 1,
        num_groups: groups,
        eta: 1_000,
        zstd: false,
        step,
        wait_ms: 10_000,
        ..Default::default()
    };
    let bytes = bus
        .request(
            BUFFER_BATCH,
            Bytes::from(req.encode_to_vec()),
            Duration::from_secs(30),
        )
        .await
        .expect("batch request");
    BatchReply::decode(bytes).expect("batch reply")
}

// ------------------------------------------------------------ CPU and load

/// CPU time of this process: (user + system, system).
fn cpu_self() -> (Duration, Duration) {
    // SAFETY: getrusage only writes the struct it is given.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return (Duration::ZERO, Duration::ZERO);
    }
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1_000);
    (tv(ru.ru_utime) + tv(ru.ru_stime), tv(ru.ru_stime))
}

/// CPU time (user + system) of process `pid`, from /proc.
fn cpu_of(pid: Option<u32>) -> Duration {
    let Some(stat) = pid.and_then(|p| std::fs::read_to_string(format!("/proc/{p}/stat")).ok())
    else {
        return Duration::ZERO;
    };
    // Fields after the command's closing parenthesis; utime and stime are
    // the 14th and 15th fields of the line.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|v| v.parse().ok())
        .collect();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Duration::from_secs_f64(f.iter().sum::<u64>() as f64 / hz)
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() { 0.0 } else { v[v.len() / 2] }
}

fn range(v: &[f64]) -> (f64, f64) {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (lo, hi)
}

/// One timed run: wall time and CPU of this process and of nats-server.
#[derive(Default, Clone, Copy)]
struct Run {
    wall: f64,
    cpu_self: f64,
    /// Of which in the kernel.
    sys_self: f64,
    cpu_server: f64,
}

async fn timed<F: std::future::Future<Output = ()>>(server: Option<u32>, f: F) -> Run {
    let (c0, s0) = (cpu_self(), cpu_of(server));
    let start = Instant::now();
    f.await;
    Run {
        wall: start.elapsed().as_secs_f64(),
        cpu_self: (cpu_self().0 - c0.0).as_secs_f64(),
        sys_self: (cpu_self().1 - c0.1).as_secs_f64(),
        cpu_server: (cpu_of(server).saturating_sub(s0)).as_secs_f64(),
    }
}

struct Bench {
    rt: tokio::runtime::Runtime,
    server: NatsServer,
    url: String,
    nats: NatsBus,
    bus: Arc<dyn Bus>,
    js: async_nats::jetstream::Context,
    rounds: usize,
    per_round: u64,
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    // Parts named on the command line (all when none is).
    let parts = ["ingest", "fsync_never", "serve", "nats"];
    let named: Vec<&str> = parts
        .into_iter()
        .filter(|p| args.iter().any(|a| a == p))
        .collect();
    let want = |p: &str| named.is_empty() || named.contains(&p);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let server = NatsServer::start().expect("nats-server");
    let url = server.url();
    let (nats, js) = rt.block_on(async {
        let config = config(&url, std::path::Path::new("/unused"), "fifo");
        let nats = NatsBus::connect(&config.bus, TransportMetrics::new())
            .await
            .unwrap();
        let client = async_nats::connect(&url).await.unwrap();
        (nats, async_nats::jetstream::new(client))
    });
    let bus: Arc<dyn Bus> = Arc::new(nats.clone());
    rt.block_on(bus.ensure_stream(&StreamSpec::new("BENCHRAW", &["benchraw.>"])))
        .unwrap();
    let b = Bench {
        rt,
        server,
        url,
        nats,
        bus,
        js,
        rounds: if quick { 3 } else { 5 },
        per_round: if quick { 1_024 } else { 3_072 },
    };
    let sample = traj(0, 1, 0, TOKENS).encode_to_vec().len();
    println!("one trajectory: {TOKENS} completion tokens, {sample} bytes of protobuf");
    println!("load average at start: {}", loadavg());
    let mut step = 0u64;
    if want("ingest") {
        ingest(&b, "always", &mut step);
    }
    if want("fsync_never") {
        ingest(&b, "never", &mut step);
    }
    if want("serve") {
        serve_in_process(if quick { 10 } else { 30 });
    }
    if want("nats") {
        serve_over_nats(&b, if quick { 4 } else { 8 });
    }
    println!("load average at end: {}", loadavg());
}

// ------------------------------------------------------------ ingest

/// Raw publish-with-ack against the buffer's ingest, alternating rounds.
fn ingest(b: &Bench, fsync: &str, step: &mut u64) {
    let buffer = b.rt.block_on(start(
        b.bus.clone(),
        &b.url,
        if fsync == "never" {
            "fsync_never"
        } else {
            "fifo"
        },
    ));
    let pid = b.server.pid();
    let n = b.per_round;
    let (mut raw, mut ours) = (Vec::new(), Vec::new());
    for round in 0..=b.rounds {
        let raw_round = || {
            let msgs = messages(fresh(n, 1), |id| format!("benchraw.{id}"));
            let run = b.rt.block_on(timed(pid, publish_all(&b.nats, &msgs)));
            // Untimed: keep the raw stream small.
            b.rt.block_on(async {
                b.js.get_stream("BENCHRAW")
                    .await
                    .unwrap()
                    .purge()
                    .await
                    .unwrap()
            });
            run
        };
        let mut ours_round = || {
            let msgs = messages(fresh(n, 1), trajectory_subject);
            let run = b.rt.block_on(timed(pid, async {
                let before = buffer.handle.ingested();
                publish_all(&b.nats, &msgs).await;
                while buffer.handle.ingested() < before + n {
                    tokio::time::sleep(Duration::from_micros(200)).await;
                }
            }));
            // Untimed: train everything so memory and disk stay bounded.
            b.rt.block_on(async {
                let ready = buffer.handle.stats().ready_groups as u32;
                if ready > 0 {
                    *step += 1;
                    let reply = request(b.bus.as_ref(), *step, ready).await;
                    assert!(reply.error.is_empty(), "{}", reply.error);
                }
            });
            run
        };
        // Round 0 warms up; then the order alternates.
        let (r, o) = if round % 2 == 0 {
            let r = raw_round();
            (r, ours_round())
        } else {
            let o = ours_round();
            (raw_round(), o)
        };
        if round > 0 {
            raw.push(r);
            ours.push(o);
        }
    }
    let rate = |v: &[Run]| -> Vec<f64> { v.iter().map(|r| n as f64 / r.wall).collect() };
    let (raw_rates, our_rates) = (rate(&raw), rate(&ours));
    let mut ratios: Vec<f64> = our_rates
        .iter()
        .zip(&raw_rates)
        .map(|(o, r)| o / r)
        .collect();
    let (rlo, rhi) = range(&ratios);
    let per_k = |v: &[Run], f: fn(&Run) -> f64| -> f64 {
        let mut x: Vec<f64> = v.iter().map(|r| f(r) / n as f64 * 1e6).collect();
        median(&mut x)
    };
    println!(
        "\ningest, fsync = {fsync}: {} rounds of {n} trajectories, alternating",
        b.rounds
    );
    println!(
        "| path | trajectories/s (median) | CPU ms / 1k msgs: bench process (of which kernel) | nats-server |"
    );
    println!("|---|---|---|---|");
    for (name, runs, rates) in [
        ("raw JetStream publish-with-ack", &raw, raw_rates),
        ("through the buffer", &ours, our_rates),
    ] {
        let mut rates = rates;
        println!(
            "| {name} | {:.0} | {:.1} ({:.1}) | {:.1} |",
            median(&mut rates),
            per_k(runs, |r| r.cpu_self),
            per_k(runs, |r| r.sys_self),
            per_k(runs, |r| r.cpu_server),
        );
    }
    println!(
        "ingest ratio (fsync = {fsync}), ours / raw: median {:.2} (rounds {rlo:.2} – {rhi:.2})",
        median(&mut ratios)
    );
    if fsync == "always" {
        // Resident bytes per token: hold 2 000 trajectories and look.
        b.rt.block_on(async {
            let msgs: Vec<_> = messages(fresh(2_000, 1), trajectory_subject);
            let proto_bytes: usize = msgs.iter().map(|m| m.2.len()).sum();
            let before = buffer.handle.ingested();
            publish_all(&b.nats, &msgs).await;
            while buffer.handle.ingested() < before + 2_000 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            // Train the previous step so only these 2 000 are held.
            *step += 1;
            request(b.bus.as_ref(), *step, 1).await;
            *step += 1;
            let s = buffer.handle.stats();
            println!(
                "resident: {} trajectories, {} tokens, {} bytes = {:.2} bytes/token (protobuf on the wire: {:.2} bytes/token)",
                s.live_trajectories,
                s.live_tokens,
                s.resident_bytes,
                s.resident_bytes as f64 / s.live_tokens as f64,
                proto_bytes as f64 / (2_000.0 * (TOKENS + 16) as f64),
            );
            let ready = buffer.handle.stats().ready_groups as u32;
            request(b.bus.as_ref(), *step, ready).await;
        });
    }
    let m = &buffer.metrics;
    let mean = |name: &str| {
        metric(m, &format!("{name}_sum")) / metric(m, &format!("{name}_count")).max(1.0)
    };
    println!(
        "mean segment write (encode + write + fdatasync) per fetched batch: {:.2} ms",
        mean("asyncrl_buffer_segment_write_seconds") * 1e3
    );
    b.rt.block_on(buffer.stop());
}

// ------------------------------------------------------------ serving

/// A core holding 64 complete groups of 8 (1 k tokens), ingested in batches
/// of 256; `scattered`: the groups' members interleaved (every row its own
/// run), else each group's rows in a run.
fn core_of(batches: &[(RecordBatch, Vec<RowMeta>)]) -> Core {
    let mut core = Core::new(SamplingPolicy::Fifo, 1, 0);
    core.add_segment(1, true);
    for (batch, metas) in batches {
        core.apply(batch.clone(), metas, 1, false);
    }
    core
}

fn resident(scattered: bool) -> Vec<(RecordBatch, Vec<RowMeta>)> {
    let n = GROUPS as u32 * G;
    let order: Vec<u32> = if scattered {
        (0..G)
            .flat_map(|m| (0..GROUPS as u32).map(move |g| g * G + m))
            .collect()
    } else {
        (0..n).collect()
    };
    let trajs: Vec<Trajectory> = order.iter().map(|&i| traj(i, G, 0, TOKENS)).collect();
    trajs
        .chunks(256)
        .map(|c| {
            let metas = c.iter().map(|t| RowMeta::of(t).unwrap()).collect();
            (to_record_batch(c).unwrap(), metas)
        })
        .collect()
}

fn plan_64(core: &mut Core) -> Vec<Arc<str>> {
    let plan = core.plan(Ask::next(1, 0, 4, GROUPS));
    let Outcome::Serve(groups) = plan.outcome.clone() else {
        panic!("not served: {:?}", plan.outcome)
    };
    core.commit(plan);
    groups
}

/// How a served batch is produced, from a fresh core holding 64 groups.
#[derive(Clone, Copy)]
enum Serve {
    /// Plan, commit, gather and encode into one byte vector (what the
    /// buffer hands to the bus).
    Bytes,
    /// The same, stopping at the IPC stream as buffers (no copy).
    Rope,
    /// The previous path: interleave into one batch, then the IPC writer.
    Interleave,
}

fn serve_once(core: &mut Core, how: Serve) -> usize {
    let groups = plan_64(core);
    let (batches, idx) = core.gather(&groups).unwrap();
    match how {
        Serve::Bytes => {
            let enc = encode_batch(&batches, &idx, false, 0).unwrap();
            assert_eq!(enc.rows, GROUPS * G as usize);
            enc.ipc.len()
        }
        Serve::Rope => {
            let parts = batch_parts(&batches, &idx).unwrap();
            let rope = encode_parts(&parts).unwrap();
            rope.iter().map(|b| b.len()).sum()
        }
        Serve::Interleave => {
            let refs: Vec<&RecordBatch> = batches.iter().collect();
            let batch = arrow::compute::interleave_record_batch(&refs, &idx).unwrap();
            let mut w = StreamWriter::try_new(Vec::new(), &batch.schema()).unwrap();
            w.write(&batch).unwrap();
            w.finish().unwrap();
            w.into_inner().unwrap().len()
        }
    }
}

fn serve_in_process(iters: usize) {
    println!(
        "\nserve a {GROUPS}-group batch in process (G = {G}, {TOKENS} tokens): median of {iters}, variants alternating"
    );
    println!(
        "| rows | slices + encode to bytes (ours) | slices + IPC buffers, no copy | interleave + IPC writer (before) | memcpy of the bytes | bytes |"
    );
    println!("|---|---|---|---|---|---|");
    for scattered in [false, true] {
        let resident = resident(scattered);
        let ways = [Serve::Bytes, Serve::Rope, Serve::Interleave];
        let mut ms: Vec<Vec<f64>> = vec![Vec::new(); ways.len() + 1];
        let mut size = 0;
        for i in 0..iters {
            for k in 0..ways.len() {
                let w = (i + k) % ways.len();
                let mut core = core_of(&resident);
                let t = Instant::now();
                let n = serve_once(&mut core, ways[w]);
                ms[w].push(t.elapsed().as_secs_f64() * 1e3);
                if w == 0 {
                    size = n;
                }
                drop(core);
            }
            // The floor: one copy of as many bytes into a fresh vector.
            let src = vec![1u8; size];
            let t = Instant::now();
            let copy = src.clone();
            ms[ways.len()].push(t.elapsed().as_secs_f64() * 1e3);
            assert_eq!(copy.len(), size);
        }
        let m: Vec<f64> = ms.iter_mut().map(|v| median(v)).collect();
        println!(
            "| {} | {:.2} ms | {:.3} ms | {:.2} ms | {:.2} ms | {size} |",
            if scattered {
                "scattered (each row its own run)"
            } else {
                "in runs (a group's rows together)"
            },
            m[0],
            m[1],
            m[2],
            m[3]
        );
    }
}

/// A learner's request for 64 groups, answered over NATS (the batch goes
/// through the object store), against a put + get of the same bytes through
/// the async-nats object store directly; alternating rounds.
fn serve_over_nats(b: &Bench, rounds: usize) {
    let buffer = b.rt.block_on(start(b.bus.clone(), &b.url, "reuse"));
    b.rt.block_on(publish_groups(&b.nats, &buffer, 128));
    let store = b.rt.block_on(async {
        b.js.create_object_store(async_nats::jetstream::object_store::Config {
            bucket: "BENCHRAW_OBJ".into(),
            ..Default::default()
        })
        .await
        .unwrap()
    });
    let mut step = 0u64;
    let mut bytes = Bytes::new();
    let (mut ours, mut raw, mut serve) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..=rounds {
        let ours_round = |step: &mut u64, bytes: &mut Bytes| {
            b.rt.block_on(async {
                if buffer.handle.stats().ready_groups < GROUPS {
                    // Untimed top-up of the pool.
                    publish_groups(&b.nats, &buffer, GROUPS).await;
                }
                *step += 1;
                let serve0 = metric(&buffer.metrics, "asyncrl_buffer_serve_latency_seconds_sum");
                let start = Instant::now();
                let reply = request(b.bus.as_ref(), *step, GROUPS as u32).await;
                assert_eq!(reply.num_groups, GROUPS as u32, "{}", reply.error);
                let ipc = if reply.object_name.is_empty() {
                    reply.arrow_ipc
                } else {
                    b.bus
                        .object_store(&reply.object_bucket)
                        .await
                        .unwrap()
                        .get(&reply.object_name)
                        .await
                        .unwrap()
                };
                let took = start.elapsed().as_secs_f64();
                *bytes = ipc;
                let s = metric(&buffer.metrics, "asyncrl_buffer_serve_latency_seconds_sum");
                (took, s - serve0)
            })
        };
        let raw_round = |bytes: &Bytes| {
            b.rt.block_on(async {
                let name = "raw";
                let start = Instant::now();
                let mut reader: &[u8] = bytes;
                store.put(name, &mut reader).await.unwrap();
                let mut got = Vec::new();
                store
                    .get(name)
                    .await
                    .unwrap()
                    .read_to_end(&mut got)
                    .await
                    .unwrap();
                let took = start.elapsed().as_secs_f64();
                assert_eq!(got.len(), bytes.len());
                store.delete(name).await.unwrap();
                took
            })
        };
        // Round 0 warms up (and gives the raw path its bytes).
        let ((o, s), r) = if round % 2 == 0 {
            let o = ours_round(&mut step, &mut bytes);
            (o, raw_round(&bytes))
        } else {
            let r = raw_round(&bytes);
            (ours_round(&mut step, &mut bytes), r)
        };
        if round > 0 {
            ours.push(o * 1e3);
            raw.push(r * 1e3);
            serve.push(s * 1e3);
        }
    }
    let mut ratios: Vec<f64> = raw.iter().zip(&ours).map(|(r, o)| r / o).collect();
    let (lo, hi) = range(&ratios);
    let mb = bytes.len() as f64 / 1e6;
    let (o, r, s) = (median(&mut ours), median(&mut raw), median(&mut serve));
    println!(
        "\nserve a {GROUPS}-group batch over NATS ({mb:.1} MB of Arrow IPC), {rounds} rounds, alternating"
    );
    println!("| path | ms (median) | MB/s |");
    println!("|---|---|---|");
    println!(
        "| raw: async-nats object store put + get of the same bytes | {r:.1} | {:.0} |",
        mb / r * 1e3
    );
    println!(
        "| ours: request → bytes in hand | {o:.1} | {:.0} |",
        mb / o * 1e3
    );
    println!("| of which the buffer's answer (plan, encode, put, served log) | {s:.1} | |");
    println!(
        "serve-over-NATS throughput ratio, ours / raw: median {:.2} (rounds {lo:.2} – {hi:.2})",
        median(&mut ratios)
    );
    b.rt.block_on(buffer.stop());
}
