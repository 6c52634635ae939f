//! `asyncrl-bench weights`: the time from a learner-side publish of a
//! version's weights (`asyncrl_control::weights::publish`: object put, then
//! the `policy.version` announcement) until N workers have them in use,
//! against the raw baseline of the same bytes in the same run: an async-nats
//! object-store put, then N concurrent gets, each on its own connection
//! (`asyncrl_transport::raw`; every byte is read and checked against the
//! object's digest by the client, then dropped).
//!
//! Two weight files:
//!
//! - `builtin`: the built-in model's weights (`[model]` defaults, the
//!   learner's `weight_dtype`), received by N whole rollout workers (each
//!   with its own NATS connection, model thread and metrics, registered with
//!   a scripted coordinator that grants nothing). "In use" is each worker's
//!   own report, `asyncrl_worker_policy_version`, which it sets once the
//!   bytes are fetched, checked against the announced sha256 and swapped
//!   into its model.
//! - a synthetic bf16 safetensors file of a given size (`1.5G`): N
//!   receivers, each on its own connection, that follow `policy.version`
//!   like a worker, fetch the announced object through the worker's fetch
//!   (`asyncrl_rollout_worker::fetch_weights`: checked against the announced
//!   sha256, shared by the receivers of this process), check its size and
//!   parse and validate its safetensors header and tensor extents, and then
//!   report the version. No model. "each" repeats that with every receiver
//!   fetching its own copy (`asyncrl_control::weights::fetch`), as workers
//!   in separate processes would; it holds N copies at once, so it runs only
//!   where N copies fit in half the available memory.
//!
//! Rounds alternate between the sides so that machine noise hits both; the
//! median round of each counts.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::load_average;
use super::stats::median;

use anyhow::{Context as _, Result, bail, ensure};
use asyncrl_config::{BusConfig, Config, DeviceName, ModelConfig};
use asyncrl_protos::subjects::{
    CONTROL_BUCKET, POLICY_VERSION_KEY, WEIGHTS_BUCKET, weights_object_name,
};
use asyncrl_protos::{Message, WeightAnnouncement};
use asyncrl_rollout_worker::scripted::{
    ScriptOptions, ScriptedCoordinator, ensure_trajectory_stream, publish_weights,
};
use asyncrl_rollout_worker::{CancellationToken, Worker, WorkerMetrics};
use asyncrl_telemetry::Metrics;
use asyncrl_transport::raw::{RawNats, RawObjects};
use asyncrl_transport::{Bus, NatsBus, ObjectStore, TransportMetrics};
use bytes::Bytes;
use clap::Args;
use futures::StreamExt;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::BenchServer;

#[derive(Debug, Args)]
pub struct WeightsArgs {
    /// NATS server to measure against; default: a private nats-server.
    #[arg(long)]
    nats_url: Option<String>,
    /// Numbers of workers N, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    workers: Vec<usize>,
    /// Weight files, comma-separated: `builtin` (the built-in model, whole
    /// workers) and/or sizes of synthetic bf16 safetensors files (`1.5G`,
    /// `256M`, `64K`, bytes).
    #[arg(long, value_delimiter = ',', default_value = "builtin,1.5G")]
    sizes: Vec<String>,
    /// Alternating rounds per case; the median counts.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Give up on one publish → in use after this many seconds.
    #[arg(long, default_value_t = 600)]
    timeout_s: u64,
}

/// One weight file of the bench.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Weights {
    Builtin,
    Synthetic(usize),
}

impl Weights {
    fn parse(text: &str) -> Result<Self> {
        let t = text.trim();
        if t.eq_ignore_ascii_case("builtin") {
            return Ok(Self::Builtin);
        }
        let (number, unit) = match t.find(|c: char| c.is_ascii_alphabetic()) {
            Some(i) => t.split_at(i),
            None => (t, ""),
        };
        let scale: f64 = match unit.to_ascii_uppercase().as_str() {
            "" | "B" => 1.0,
            "K" | "KB" => 1e3,
            "M" | "MB" => 1e6,
            "G" | "GB" => 1e9,
            other => bail!("--sizes: unknown unit {other:?} in {text:?} (K, M, G)"),
        };
        let n: f64 = number
            .parse()
            .with_context(|| format!("--sizes: {text:?} is neither `builtin` nor a size"))?;
        ensure!(
            n > 0.0 && n * scale >= 1024.0,
            "--sizes: {text:?} is below 1 KiB"
        );
        Ok(Self::Synthetic((n * scale) as usize))
    }

    fn label(&self) -> String {
        match self {
            Self::Builtin => "built-in model".into(),
            Self::Synthetic(n) => format!("synthetic bf16 {}", human_bytes(*n as u64)),
        }
    }
}

fn human_bytes(n: u64) -> String {
    let n = n as f64;
    if n >= 1e9 {
        format!("{:.2} GB", n / 1e9)
    } else if n >= 1e6 {
        format!("{:.1} MB", n / 1e6)
    } else {
        format!("{:.1} KB", n / 1e3)
    }
}

/// One row of the table.
#[derive(Debug, Clone)]
struct Row {
    weights: Weights,
    n: usize,
    bytes: u64,
    raw_s: f64,
    /// Of which the raw put.
    raw_put_s: f64,
    ours_s: f64,
    /// Of which our publish (put, then announce).
    ours_publish_s: f64,
    /// Every receiver fetching its own copy (synthetic files), when run.
    each_s: Option<f64>,
}

pub(crate) fn run(rt: &tokio::runtime::Runtime, args: WeightsArgs) -> Result<String> {
    let sizes = args
        .sizes
        .iter()
        .map(|s| Weights::parse(s))
        .collect::<Result<Vec<_>>>()?;
    ensure!(
        !args.workers.is_empty() && args.workers.iter().all(|&n| n > 0),
        "--workers: give at least one count, each ≥ 1"
    );
    ensure!(args.rounds > 0, "--rounds must be ≥ 1");
    let server = BenchServer::at_or_start(args.nats_url.as_deref())?;
    let load_before = load_average();
    let mem_before = mem_available();
    let model = bench_model();
    let mut rows = Vec::new();
    let mut notes = Vec::new();
    for &weights in &sizes {
        let bytes = match weights {
            Weights::Builtin => builtin_weights(&model)?,
            Weights::Synthetic(n) => {
                let need = 2 * n as u64;
                if let Some(avail) = mem_available()
                    && avail < need
                {
                    bail!(
                        "{}: needs about {} of free memory (the publisher's copy and the receivers' shared one), {} available",
                        weights.label(),
                        human_bytes(need),
                        human_bytes(avail)
                    );
                }
                synthetic_safetensors(n)
            }
        };
        for &n in &args.workers {
            let row = rt
                .block_on(measure(
                    &server.url,
                    weights,
                    &bytes,
                    n,
                    &model,
                    &args,
                    &mut notes,
                ))
                .with_context(|| format!("{} to {n} workers", weights.label()))?;
            tracing::info!(?row, "bench weights case done");
            rows.push(row);
        }
    }
    Ok(report(
        &server,
        &args,
        &rows,
        &notes,
        load_before,
        mem_before,
    ))
}

/// The publisher side: our bus (the learner's path) and the raw client.
struct Publisher {
    bus: Arc<dyn Bus>,
    store: Arc<dyn ObjectStore>,
    raw: RawObjects,
    raw_getters: Vec<RawObjects>,
}

async fn connect(url: &str) -> Result<Arc<dyn Bus>> {
    let bus = NatsBus::connect(&BusConfig::nats(url), TransportMetrics::new())
        .await
        .with_context(|| format!("connect to {url}"))?;
    Ok(Arc::new(bus))
}

async fn raw_bucket(url: &str) -> Result<RawObjects> {
    Ok(RawNats::connect(url)
        .await?
        .object_bucket("BENCH_RAW_WEIGHTS")
        .await?)
}

fn decode(value: &[u8]) -> Result<WeightAnnouncement> {
    WeightAnnouncement::decode(value)
        .with_context(|| format!("`{POLICY_VERSION_KEY}` is not a WeightAnnouncement"))
}

/// The next version to publish on this server (after what is announced).
async fn next_version(bus: &dyn Bus) -> Result<i32> {
    let kv = bus.kv(CONTROL_BUCKET).await?;
    Ok(match kv.get(POLICY_VERSION_KEY).await? {
        Some(entry) => decode(&entry.value)?.version + 1,
        None => 0,
    })
}

async fn measure(
    url: &str,
    weights: Weights,
    bytes: &Bytes,
    n: usize,
    model: &ModelConfig,
    args: &WeightsArgs,
    notes: &mut Vec<String>,
) -> Result<Row> {
    let bus = connect(url).await?;
    let store = bus.object_store(WEIGHTS_BUCKET).await?;
    let mut raw_getters = Vec::with_capacity(n);
    for _ in 0..n {
        raw_getters.push(raw_bucket(url).await?);
    }
    let publisher = Publisher {
        bus,
        store,
        raw: raw_bucket(url).await?,
        raw_getters,
    };
    let timeout = Duration::from_secs(args.timeout_s);
    let mut version = next_version(publisher.bus.as_ref()).await?;
    // What the receivers start on (untimed): this case's bytes.
    publish(&publisher, version, bytes.clone()).await?;

    let mut modes = vec![FetchMode::Shared];
    if let Weights::Synthetic(size) = weights {
        if mem_available().is_some_and(|a| (n * size) as u64 <= a / 2) {
            modes.push(FetchMode::Each);
        } else {
            notes.push(format!(
                "{} to {n} workers: \"each\" not run, {n} copies of {} do not fit in half the available memory",
                weights.label(),
                human_bytes(size as u64)
            ));
        }
    }
    // One side at a time (so that one side's receivers never fetch what
    // the other's publish announced); raw rounds alternate with each.
    let mut raw_times = Vec::new();
    let mut raw_puts = Vec::new();
    let mut publishes = Vec::new();
    let mut ours = Vec::new();
    for mode in modes {
        let mut side = match weights {
            Weights::Builtin => Receivers::workers(url, n, model, args.timeout_s).await?,
            Weights::Synthetic(_) => Receivers::synthetic(url, n, mode).await?,
        };
        side.wait_for(version, timeout)
            .await
            .context("the first weights")?;
        let mut times = Vec::new();
        for round in 0..args.rounds {
            let (raw, raw_put) = raw_round(&publisher, bytes, round).await?;
            raw_times.push(raw);
            raw_puts.push(raw_put);
            version += 1;
            let started = Instant::now();
            publish(&publisher, version, bytes.clone()).await?;
            if mode == FetchMode::Shared {
                publishes.push(started.elapsed().as_secs_f64());
            }
            side.wait_for(version, timeout).await?;
            times.push(started.elapsed().as_secs_f64());
            publisher
                .store
                .delete(&weights_object_name(version - 1))
                .await?;
        }
        side.stop().await?;
        ours.push(median(times));
    }
    let mut ours = ours.into_iter();
    Ok(Row {
        weights,
        n,
        bytes: bytes.len() as u64,
        raw_s: median(raw_times),
        raw_put_s: median(raw_puts),
        ours_s: ours.next().unwrap_or(f64::NAN),
        ours_publish_s: median(publishes),
        each_s: ours.next(),
    })
}

/// The learner's publish (`asyncrl_control::weights::publish`: put, then
/// announce), through the scripted publisher, which opens the bucket and
/// the KV first (two requests more than the learner, which keeps them).
async fn publish(p: &Publisher, version: i32, bytes: Bytes) -> Result<()> {
    publish_weights(p.bus.as_ref(), version, bytes)
        .await
        .with_context(|| format!("publish version {version}"))?;
    Ok(())
}

/// Raw put + N concurrent gets (each on its own connection): seconds in
/// all and of the put.
async fn raw_round(p: &Publisher, bytes: &Bytes, round: usize) -> Result<(f64, f64)> {
    let name = format!("raw-{round}");
    let started = Instant::now();
    p.raw.put(&name, bytes).await?;
    let put = started.elapsed().as_secs_f64();
    let gets = p.raw_getters.iter().map(|g| g.get_and_drop(&name));
    for got in futures::future::join_all(gets).await {
        let got = got?;
        ensure!(
            got == bytes.len() as u64,
            "raw get read {got} of {} bytes",
            bytes.len()
        );
    }
    let elapsed = started.elapsed().as_secs_f64();
    p.raw.delete(&name).await?;
    Ok((elapsed, put))
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum FetchMode {
    /// The worker's fetch: one per object and sha256 in this process.
    Shared,
    /// Every receiver its own.
    Each,
}

/// The N receivers of one side, and how to see which version each uses.
struct Receivers {
    /// The version each receiver has in use (-1: none yet).
    in_use: Vec<Box<dyn Fn() -> i64 + Send>>,
    stop: CancellationToken,
    tasks: Vec<JoinHandle<Result<()>>>,
    _coordinator: Option<ScriptedCoordinator>,
}

impl Receivers {
    /// N whole rollout workers with the built-in engine.
    async fn workers(url: &str, n: usize, model: &ModelConfig, timeout_s: u64) -> Result<Self> {
        let coordinator_bus = connect(url).await?;
        ensure_trajectory_stream(coordinator_bus.as_ref()).await?;
        let coordinator = ScriptedCoordinator::start(
            coordinator_bus,
            Vec::new(),
            ScriptOptions {
                retry_after_ms: 1_000,
                heartbeat_interval_ms: 5_000,
                ..ScriptOptions::default()
            },
        )
        .await?;
        let stop = CancellationToken::new();
        let mut in_use: Vec<Box<dyn Fn() -> i64 + Send>> = Vec::with_capacity(n);
        let mut tasks = Vec::with_capacity(n);
        for i in 0..n {
            let mut config = Config {
                bus: BusConfig::nats(url),
                model: model.clone(),
                ..Config::default()
            };
            config.worker.id = Some(format!("bench-weights-{i}"));
            config.worker.max_sequences = 4;
            config.worker.weight_fetch_timeout = Duration::from_secs(timeout_s);
            config.worker.heartbeat_interval = Duration::from_secs(5);
            config.worker.acquire_backoff_min = Duration::from_millis(500);
            config.worker.acquire_backoff_max = Duration::from_secs(2);
            config.validate().context("the bench's worker config")?;
            let metrics = Metrics::new();
            let handles = WorkerMetrics::new(&metrics)?;
            in_use.push(Box::new(move || handles.policy_version.get()));
            let bus = connect(url).await?;
            let worker = Worker::new(config, bus, metrics);
            let stop = stop.clone();
            tasks.push(tokio::spawn(async move {
                worker.run(stop).await?;
                Ok(())
            }));
        }
        Ok(Self {
            in_use,
            stop,
            tasks,
            _coordinator: Some(coordinator),
        })
    }

    /// N receivers of synthetic weights.
    async fn synthetic(url: &str, n: usize, mode: FetchMode) -> Result<Self> {
        let stop = CancellationToken::new();
        let mut in_use: Vec<Box<dyn Fn() -> i64 + Send>> = Vec::with_capacity(n);
        let mut tasks = Vec::with_capacity(n);
        for _ in 0..n {
            let (tx, rx) = watch::channel(-1i64);
            in_use.push(Box::new(move || *rx.borrow()));
            let bus = connect(url).await?;
            let stop = stop.clone();
            tasks.push(tokio::spawn(async move {
                stop.run_until_cancelled(receive(bus, mode, tx))
                    .await
                    .unwrap_or(Ok(()))
            }));
        }
        Ok(Self {
            in_use,
            stop,
            tasks,
            _coordinator: None,
        })
    }

    /// Waits until every receiver has `version` in use.
    async fn wait_for(&mut self, version: i32, timeout: Duration) -> Result<()> {
        let started = Instant::now();
        loop {
            if self.in_use.iter().all(|v| v() >= i64::from(version)) {
                return Ok(());
            }
            if let Some(done) = self.tasks.iter().position(JoinHandle::is_finished) {
                let task = self.tasks.remove(done);
                return match task.await {
                    Ok(Err(e)) => Err(e.context("a receiver stopped")),
                    Ok(Ok(())) => bail!("a receiver stopped"),
                    Err(e) => Err(anyhow::Error::new(e).context("a receiver panicked")),
                };
            }
            if started.elapsed() > timeout {
                let behind = self
                    .in_use
                    .iter()
                    .filter(|v| v() < i64::from(version))
                    .count();
                bail!("{behind} receivers lack version {version} after {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    async fn stop(self) -> Result<()> {
        self.stop.cancel();
        for task in self.tasks {
            task.await.context("a receiver panicked")??;
        }
        Ok(())
    }
}

/// One synthetic receiver: follows `policy.version`, fetches each newer
/// version, checks and validates it, reports it on `in_use`.
async fn receive(bus: Arc<dyn Bus>, mode: FetchMode, in_use: watch::Sender<i64>) -> Result<()> {
    let kv = bus.kv(CONTROL_BUCKET).await?;
    let store = bus.object_store(WEIGHTS_BUCKET).await?;
    let mut events = kv.watch(POLICY_VERSION_KEY).await?;
    while let Some(event) = events.next().await {
        let Some(value) = event?.value else { continue };
        let ann = decode(&value)?;
        if i64::from(ann.version) <= *in_use.borrow() {
            continue;
        }
        let bytes = match mode {
            FetchMode::Shared => asyncrl_rollout_worker::fetch_weights(&bus, &ann).await?,
            // What `asyncrl_control::weights::fetch` does, per receiver.
            FetchMode::Each => store.get_expecting(&ann.object_name, &ann.sha256).await?,
        };
        ensure!(
            bytes.len() as u64 == ann.byte_size,
            "version {}: {} bytes, announced {}",
            ann.version,
            bytes.len(),
            ann.byte_size
        );
        validate_safetensors(&bytes).with_context(|| format!("version {}", ann.version))?;
        drop(bytes);
        in_use.send_replace(i64::from(ann.version));
    }
    Ok(())
}

/// Parses a safetensors file and checks every tensor: a known dtype, its
/// extent the size of its shape, extents in order, without gaps, covering
/// the data exactly. Returns the number of tensors.
fn validate_safetensors(bytes: &[u8]) -> Result<usize> {
    ensure!(bytes.len() >= 8, "shorter than a safetensors header");
    let (len, rest) = bytes.split_at(8);
    let len = u64::from_le_bytes(len.try_into()?) as usize;
    ensure!(len <= rest.len(), "header of {len} bytes past the end");
    let (header, data) = rest.split_at(len);
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(header).context("header is not a JSON object")?;
    let mut extents = Vec::with_capacity(header.len());
    for (name, info) in &header {
        if name == "__metadata__" {
            continue;
        }
        let dtype = info["dtype"].as_str().unwrap_or_default();
        let width: usize = match dtype {
            "BF16" | "F16" | "I16" | "U16" => 2,
            "F32" | "I32" | "U32" => 4,
            "F64" | "I64" | "U64" => 8,
            "BOOL" | "U8" | "I8" | "F8_E4M3" | "F8_E5M2" => 1,
            other => bail!("tensor {name}: unknown dtype {other:?}"),
        };
        let shape: Vec<usize> = serde_json::from_value(info["shape"].clone())
            .with_context(|| format!("tensor {name}: shape"))?;
        let [start, end]: [usize; 2] = serde_json::from_value(info["data_offsets"].clone())
            .with_context(|| format!("tensor {name}: data_offsets"))?;
        let elements = shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .context("shape overflows")?;
        ensure!(
            end >= start && end - start == elements * width,
            "tensor {name}: {} bytes for {elements} {dtype} elements",
            end.saturating_sub(start)
        );
        extents.push((start, end));
    }
    extents.sort_unstable();
    let mut at = 0;
    for &(start, end) in &extents {
        ensure!(start == at, "tensor data has a gap or overlap at byte {at}");
        at = end;
    }
    ensure!(
        at == data.len(),
        "tensors cover {at} of {} data bytes",
        data.len()
    );
    Ok(extents.len())
}

/// A bf16 safetensors file of about `size` bytes: 4096-wide matrices of
/// pseudo-random values (no pattern a transport could shortcut).
fn synthetic_safetensors(size: usize) -> Bytes {
    const WIDTH: usize = 4096;
    const ROW: usize = WIDTH * 2;
    let rows_total = (size / ROW).max(1);
    let rows_per_tensor = 8192usize.min(rows_total);
    let mut tensors = Vec::new();
    let mut left = rows_total;
    while left > 0 {
        let rows = rows_per_tensor.min(left);
        tensors.push(rows);
        left -= rows;
    }
    let mut header = String::from("{\"__metadata__\":{\"format\":\"pt\"}");
    let mut offset = 0usize;
    for (i, rows) in tensors.iter().enumerate() {
        let end = offset + rows * ROW;
        let _ = write!(
            header,
            ",\"model.layers.{i}.weight\":{{\"dtype\":\"BF16\",\"shape\":[{rows},{WIDTH}],\"data_offsets\":[{offset},{end}]}}"
        );
        offset = end;
    }
    header.push('}');
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let mut out = Vec::with_capacity(8 + header.len() + offset);
    out.extend_from_slice(&(header.len() as u64).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    while out.len() + 8 <= 8 + header.len() + offset {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.resize(8 + header.len() + offset, 0);
    Bytes::from(out)
}

/// The model of the built-in case: `[model]` defaults on the CPU, one
/// intra-op thread per worker (16 workers share this machine's cores).
fn bench_model() -> ModelConfig {
    ModelConfig {
        device: DeviceName::Cpu,
        cpu_threads: 1,
        ..ModelConfig::default()
    }
}

/// The built-in model's weights as the learner publishes them.
fn builtin_weights(model: &ModelConfig) -> Result<Bytes> {
    let policy = asyncrl_policy::from_config::load_policy(model, 1)?;
    let dtype = asyncrl_policy::from_config::weight_dtype(model.weight_dtype);
    Ok(Bytes::from(policy.weights_to_safetensors(dtype)?))
}

/// MemAvailable of /proc/meminfo, in bytes.
fn mem_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// How total time grows with N: the exponent b of t ∝ N^b (least squares
/// over log–log), and t(N max) / t(N min).
fn growth(points: &[(usize, f64)]) -> Option<(f64, f64, usize, usize)> {
    let pts: Vec<(f64, f64)> = points
        .iter()
        .filter(|(n, t)| *n > 0 && t.is_finite() && *t > 0.0)
        .map(|&(n, t)| ((n as f64).ln(), t.ln()))
        .collect();
    if pts.len() < 2 {
        return None;
    }
    let k = pts.len() as f64;
    let (mx, my) = (
        pts.iter().map(|p| p.0).sum::<f64>() / k,
        pts.iter().map(|p| p.1).sum::<f64>() / k,
    );
    let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
    if sxx == 0.0 {
        return None;
    }
    let b = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum::<f64>() / sxx;
    let first = points.iter().min_by_key(|p| p.0)?;
    let last = points.iter().max_by_key(|p| p.0)?;
    Some((b, last.1 / first.1, first.0, last.0))
}

fn report(
    server: &BenchServer,
    args: &WeightsArgs,
    rows: &[Row],
    notes: &[String],
    load_before: String,
    mem_before: Option<u64>,
) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "weights: learner publish → in use on N workers against raw object-store put + N gets of the same bytes \
         ({}; median of {} alternating rounds; load average {} before, {} after; {} available before)",
        server.describe(),
        args.rounds,
        load_before,
        load_average(),
        mem_before.map_or("?".into(), human_bytes),
    );
    let _ = writeln!(
        out,
        "ours: built-in = N whole rollout workers (own connection and model thread each), in use = the worker's \
         asyncrl_worker_policy_version; synthetic = N receivers (own connection each) doing the worker's fetch \
         (shared in this process), size check and safetensors validation; each = every receiver its own fetch"
    );
    let _ = writeln!(
        out,
        "| weights | N | bytes | raw put+N gets (s) | of which put | ours publish→all in use (s) | of which publish | ratio | ours, each fetches (s) | ratio |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        let (each, each_ratio) = match r.each_s {
            Some(e) => (format!("{e:.3}"), format!("{:.2}", e / r.raw_s)),
            None => ("—".into(), "—".into()),
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {:.3} | {:.3} | {:.3} | {:.3} | {:.2} | {each} | {each_ratio} |",
            r.weights.label(),
            r.n,
            human_bytes(r.bytes),
            r.raw_s,
            r.raw_put_s,
            r.ours_s,
            r.ours_publish_s,
            r.ours_s / r.raw_s,
        );
    }
    let mut kinds: Vec<Weights> = Vec::new();
    for r in rows {
        if !kinds.contains(&r.weights) {
            kinds.push(r.weights);
        }
    }
    let _ = writeln!(out, "growth with N (t ∝ N^b; b < 1 is sub-linear):");
    for w in kinds {
        let of = |f: &dyn Fn(&Row) -> Option<f64>| -> Vec<(usize, f64)> {
            rows.iter()
                .filter(|r| r.weights == w)
                .filter_map(|r| f(r).map(|t| (r.n, t)))
                .collect()
        };
        let sides: [(&str, Vec<(usize, f64)>); 3] = [
            ("raw", of(&|r| Some(r.raw_s))),
            ("ours", of(&|r| Some(r.ours_s))),
            ("ours, each", of(&|r| r.each_s)),
        ];
        for (name, points) in sides {
            if let Some((b, ratio, lo, hi)) = growth(&points) {
                let _ = writeln!(
                    out,
                    "  {} {name}: b = {b:.2}; {hi} workers take {ratio:.2}x the time of {lo}",
                    w.label()
                );
            }
        }
    }
    for n in notes {
        let _ = writeln!(out, "note: {n}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_files_validate_and_a_damaged_header_does_not() {
        // Three full tensors of 8192 rows of 8 KiB and one of 5 rows.
        let bytes = synthetic_safetensors(3 * 8192 * 8192 + 5 * 8192 + 100);
        assert_eq!(validate_safetensors(&bytes).unwrap(), 4);
        let mut cut = bytes.to_vec();
        cut.truncate(cut.len() - 2);
        assert!(validate_safetensors(&cut).is_err());
        let mut bad = bytes.to_vec();
        let at = bad.windows(5).position(|w| w == b"BF16\"").unwrap();
        bad[at..at + 5].copy_from_slice(b"F32\" ");
        assert!(validate_safetensors(&bad).is_err());
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(Weights::parse("builtin").unwrap(), Weights::Builtin);
        assert_eq!(
            Weights::parse("1.5G").unwrap(),
            Weights::Synthetic(1_500_000_000)
        );
        assert_eq!(
            Weights::parse("64M").unwrap(),
            Weights::Synthetic(64_000_000)
        );
        assert!(Weights::parse("12X").is_err());
        assert!(Weights::parse("10").is_err());
    }

    #[test]
    fn growth_exponent() {
        let (b, ratio, lo, hi) = growth(&[(1, 1.0), (4, 2.0), (16, 4.0)]).unwrap();
        assert!((b - 0.5).abs() < 1e-9, "{b}");
        assert_eq!((ratio, lo, hi), (4.0, 1, 16));
    }
}
