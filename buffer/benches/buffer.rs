//! Buffer benchmarks against a private nats-server (started here):
//!
//! - `ingest/raw_jetstream_publish_ack`: JetStream publish-with-ack of the
//!   encoded trajectories (1 k completion tokens each), 64 in flight: the
//!   ceiling of the transport, no buffer involved;
//! - `ingest/through_buffer`: the same bytes published the same way, timed
//!   until the buffer has decoded, written, fsynced (fsync = "always") and
//!   acked every one;
//! - `serve_64_groups/core`: choosing, gathering and encoding a 64-group
//!   batch (G = 8, 1 k tokens) in process;
//! - `serve_64_groups/over_nats`: a learner's request for 64 groups answered
//!   over NATS, the batch fetched from the object store (it is above the
//!   inline limit);
//! - resident bytes per token, printed after the ingest bench.
//!
//! `cargo bench -p asyncrl-buffer` (quick: `-- --quick`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use futures::StreamExt;

use asyncrl_buffer::core::{Ask, Core, Outcome, RowMeta};
use asyncrl_buffer::testing::{traj, traj_of};
use asyncrl_buffer::{Buffer, BufferHandle, CancellationToken, encode_batch};
use asyncrl_config::{Config, SamplingPolicy};
use asyncrl_protos::arrow_schema::to_record_batch;
use asyncrl_protos::subjects::{BUFFER_BATCH, trajectory_subject};
use asyncrl_protos::v1::{BatchReply, BatchRequest};
use asyncrl_protos::{Message, Trajectory};
use asyncrl_telemetry::Metrics;
use asyncrl_testkit::NatsServer;
use asyncrl_transport::{Bus, NatsBus, StreamSpec, TransportMetrics};

const TOKENS: usize = 1024;
const IN_FLIGHT: usize = 64;

fn config(url: &str, dir: &std::path::Path, sampling: &str) -> Config {
    let extra = match sampling {
        "reuse" => "sampling = \"reuse\"\nreuse_max = 64",
        "fsync_never" => "fsync = \"never\"",
        _ => "",
    };
    Config::parse(
        &format!(
            "[run]\noutput_dir = \"{}\"\n[bus]\nurl = \"{url}\"\n[telemetry]\nlisten = \"\"\n[buffer]\ningest_batch = 256\nfetch_wait = \"20ms\"\n{extra}\n",
            dir.display()
        ),
        None,
    )
    .expect("bench config")
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

/// `n` fresh trajectories (groups of 1, so every one is servable at once).
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

fn ingested(m: &Metrics) -> u64 {
    let text = m.encode_prometheus_text().unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("asyncrl_buffer_ingested_trajectories_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

async fn request(bus: &dyn Bus, step: u64, groups: u32) -> BatchReply {
    let req = BatchRequest {
        learner_version: step as i32 - 1,
        num_groups: groups,
        eta: 1_000,
        zstd: false,
        step,
        wait_ms: 10_000,
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

fn benches(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let server = NatsServer::start().expect("nats-server");
    let url = server.url();
    let nats = rt.block_on(async {
        let config = config(&url, std::path::Path::new("/unused"), "fifo");
        NatsBus::connect(&config.bus, TransportMetrics::new())
            .await
            .unwrap()
    });
    let bus: Arc<dyn Bus> = Arc::new(nats.clone());
    rt.block_on(bus.ensure_stream(&StreamSpec::new("BENCHRAW", &["benchraw.>"])))
        .unwrap();
    let sample = traj(0, 1, 0, TOKENS).encode_to_vec().len();
    println!("one trajectory: {TOKENS} completion tokens, {sample} bytes of protobuf");

    // ------------------------------------------------------------ ingest
    let buffer = rt.block_on(start(bus.clone(), &url, "fifo"));
    let mut step = 0u64;
    let mut group = c.benchmark_group("ingest");
    group.throughput(Throughput::Elements(1));
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(4));
    group.bench_function("raw_jetstream_publish_ack", |b| {
        b.iter_custom(|iters| {
            let msgs: Vec<_> = messages(fresh(iters, 1), |id| format!("benchraw.{id}"));
            rt.block_on(async {
                let start = Instant::now();
                publish_all(&nats, &msgs).await;
                start.elapsed()
            })
        })
    });
    through_buffer(
        &mut group,
        "through_buffer",
        &rt,
        &nats,
        &bus,
        &buffer,
        &mut step,
    );
    group.finish();
    // Resident bytes per token: hold 2 000 trajectories and look.
    rt.block_on(async {
        step += 1;
        let ready = buffer.handle.stats().ready_groups as u32;
        if ready > 0 {
            request(bus.as_ref(), step, ready).await;
            step += 1;
        }
        let msgs: Vec<_> = messages(fresh(2_000, 1), trajectory_subject);
        let proto_bytes: usize = msgs.iter().map(|m| m.2.len()).sum();
        let before = ingested(&buffer.metrics);
        publish_all(&nats, &msgs).await;
        while ingested(&buffer.metrics) < before + 2_000 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // Train the previous step so only these 2 000 are held.
        request(bus.as_ref(), step, 1).await;
        let s = buffer.handle.stats();
        println!(
            "resident: {} trajectories, {} tokens, {} bytes = {:.2} bytes/token (protobuf on the wire: {:.2} bytes/token)",
            s.live_trajectories,
            s.live_tokens,
            s.resident_bytes,
            s.resident_bytes as f64 / s.live_tokens as f64,
            proto_bytes as f64 / (2_000.0 * (TOKENS + 16) as f64),
        );
    });
    let write = segment_write_mean(&buffer.metrics);
    println!(
        "mean segment write (encode + write + fdatasync) per fetched batch: {:.2} ms",
        write * 1e3
    );
    rt.block_on(buffer.stop());
    let buffer = rt.block_on(start(bus.clone(), &url, "fsync_never"));
    let mut group = c.benchmark_group("ingest");
    group.throughput(Throughput::Elements(1));
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(4));
    through_buffer(
        &mut group,
        "through_buffer_fsync_never",
        &rt,
        &nats,
        &bus,
        &buffer,
        &mut step,
    );
    group.finish();
    rt.block_on(buffer.stop());

    // ------------------------------------------------------------ serving
    let mut group = c.benchmark_group("serve_64_groups");
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(4));
    // In process: plan, commit, gather and encode (G = 8, 1 k tokens).
    let batch_trajs: Vec<Trajectory> = (0..64 * 8).map(|i| traj(i, 8, 0, TOKENS)).collect();
    let record_batch = to_record_batch(&batch_trajs).unwrap();
    let metas: Vec<RowMeta> = batch_trajs
        .iter()
        .map(|t| RowMeta::of(t).unwrap())
        .collect();
    group.bench_function("core", |b| {
        b.iter_batched(
            || {
                let mut core = Core::new(SamplingPolicy::Fifo, 1, 0);
                core.add_segment(1, true);
                core.apply(record_batch.clone(), &metas, 1, false);
                core
            },
            |mut core| {
                let plan = core.plan(Ask {
                    step: 1,
                    version: 0,
                    eta: 4,
                    num_groups: 64,
                });
                let Outcome::Serve(groups) = plan.outcome.clone() else {
                    panic!("not served")
                };
                core.commit(plan);
                let (batches, idx) = core.gather(&groups).unwrap();
                let enc = encode_batch(&batches, &idx, false, 0).unwrap();
                assert_eq!(enc.rows, 512);
                enc.ipc.len()
            },
            criterion::BatchSize::LargeInput,
        )
    });
    // Over NATS, with a reuse pool so that every request finds 64 groups.
    let buffer = rt.block_on(start(bus.clone(), &url, "reuse"));
    rt.block_on(publish_groups(&nats, &buffer, 128));
    let mut step = 0u64;
    let mut bytes = 0usize;
    group.bench_function("over_nats", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    if buffer.handle.stats().ready_groups < 64 {
                        // Untimed top-up of the pool.
                        publish_groups(&nats, &buffer, 64).await;
                    }
                    step += 1;
                    let start = Instant::now();
                    let reply = request(bus.as_ref(), step, 64).await;
                    assert_eq!(reply.num_groups, 64, "{}", reply.error);
                    let ipc = if reply.object_name.is_empty() {
                        reply.arrow_ipc
                    } else {
                        bus.object_store(&reply.object_bucket)
                            .await
                            .unwrap()
                            .get(&reply.object_name)
                            .await
                            .unwrap()
                    };
                    total += start.elapsed();
                    bytes = ipc.len();
                }
                total
            })
        })
    });
    group.finish();
    println!("a 64-group batch (512 trajectories × {TOKENS} tokens) is {bytes} bytes of Arrow IPC");
    rt.block_on(buffer.stop());
    drop(server);
}

fn segment_write_mean(m: &Metrics) -> f64 {
    let text = m.encode_prometheus_text().unwrap();
    let get = |suffix: &str| -> f64 {
        text.lines()
            .find_map(|l| {
                l.strip_prefix(&format!("asyncrl_buffer_segment_write_seconds_{suffix} "))
            })
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
    };
    get("sum") / get("count").max(1.0)
}

/// Publishes `iters` trajectories (64 in flight) and times until the
/// buffer has stored and acked them all; then trains them (untimed).
fn through_buffer(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    rt: &tokio::runtime::Runtime,
    nats: &NatsBus,
    bus: &Arc<dyn Bus>,
    buffer: &Running,
    step: &mut u64,
) {
    group.bench_function(name, |b| {
        b.iter_custom(|iters| {
            let msgs: Vec<_> = messages(fresh(iters, 1), trajectory_subject);
            let elapsed = rt.block_on(async {
                let before = ingested(&buffer.metrics);
                let start = Instant::now();
                publish_all(nats, &msgs).await;
                while ingested(&buffer.metrics) < before + iters {
                    tokio::time::sleep(Duration::from_micros(200)).await;
                }
                start.elapsed()
            });
            // Untimed: train everything so memory and disk stay bounded.
            rt.block_on(async {
                let ready = buffer.handle.stats().ready_groups as u32;
                if ready > 0 {
                    *step += 1;
                    let reply = request(bus.as_ref(), *step, ready).await;
                    assert!(reply.error.is_empty(), "{}", reply.error);
                }
            });
            elapsed
        })
    });
}

criterion_group!(buffer_benches, benches);
criterion_main!(buffer_benches);
