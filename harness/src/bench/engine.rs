//! `asyncrl-bench engine`: the vLLM engine against the built-in one, on the
//! same model, workload and machine, one after the other.
//!
//! 1. **Throughput.** The same requests (the `arith` prompts of a fixed
//!    seed, `--requests` completions of at most `--max-new-tokens` tokens,
//!    `--concurrency` in flight) through the built-in engine (the tch
//!    model thread, continuous batching) and through a vLLM CPU server the
//!    bench launches from `.venv-vllm` (`--enforce-eager`, float32).
//!    Generated tokens/s of each and their ratio.
//! 2. **Orchestration overhead.** The bench process's own CPU time
//!    (`getrusage(RUSAGE_SELF)`: the worker's side; vLLM runs in its own
//!    processes) per 1,000 tokens generated through vLLM.
//! 3. **Weight swap.** The engine's swap (write the version folder, pause →
//!    reload → set version → reset prefix cache → resume) against vLLM's
//!    raw `reload_weights` call on the same folder, medians of `--swaps`.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use asyncrl_config::{Config, EngineKind};
use asyncrl_policy::SequenceRequest;
use asyncrl_rollout_worker::WorkerMetrics;
use asyncrl_rollout_worker::engine::{self, Engine};
use asyncrl_telemetry::Metrics;
use bytes::Bytes;

/// What to run.
#[derive(Debug, Clone)]
pub struct EngineBenchOptions {
    /// A Hugging Face folder of a Llama-family model (the warm start).
    pub model: PathBuf,
    /// The python of the vLLM venv.
    pub vllm_python: PathBuf,
    pub requests: usize,
    pub max_new_tokens: usize,
    pub concurrency: usize,
    pub swaps: usize,
    pub port: u16,
}

/// What one engine did.
#[derive(Debug, Clone, Copy)]
pub struct Throughput {
    pub tokens: u64,
    pub seconds: f64,
    /// CPU seconds of this process while generating.
    pub own_cpu_seconds: f64,
}

impl Throughput {
    pub fn tokens_per_second(&self) -> f64 {
        self.tokens as f64 / self.seconds
    }
}

#[derive(Debug, Clone)]
pub struct EngineBenchReport {
    pub options: EngineBenchOptions,
    pub builtin: Throughput,
    pub vllm: Throughput,
    pub swap_median: Duration,
    pub raw_reload_median: Duration,
}

impl fmt::Display for EngineBenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let o = &self.options;
        writeln!(
            f,
            "engine bench: {} ({} requests, ≤ {} new tokens, {} in flight)",
            o.model.display(),
            o.requests,
            o.max_new_tokens,
            o.concurrency
        )?;
        for (name, t) in [("built-in", &self.builtin), ("vLLM", &self.vllm)] {
            writeln!(
                f,
                "  {name:<9} {:>7} tokens in {:>6.2} s = {:>8.1} tokens/s",
                t.tokens,
                t.seconds,
                t.tokens_per_second()
            )?;
        }
        writeln!(
            f,
            "  ratio vLLM / built-in tokens/s: {:.2}",
            self.vllm.tokens_per_second() / self.builtin.tokens_per_second()
        )?;
        writeln!(
            f,
            "  worker CPU around vLLM: {:.1} ms per 1,000 tokens ({:.2} s for {} tokens; built-in engine, all in-process: {:.1} ms)",
            1e6 * self.vllm.own_cpu_seconds / self.vllm.tokens.max(1) as f64,
            self.vllm.own_cpu_seconds,
            self.vllm.tokens,
            1e6 * self.builtin.own_cpu_seconds / self.builtin.tokens.max(1) as f64,
        )?;
        writeln!(
            f,
            "  weight swap (pause → reload → version → reset → resume): median {:.1} ms; raw reload_weights: median {:.1} ms; ratio {:.2}",
            self.swap_median.as_secs_f64() * 1e3,
            self.raw_reload_median.as_secs_f64() * 1e3,
            self.swap_median.as_secs_f64() / self.raw_reload_median.as_secs_f64().max(1e-9)
        )
    }
}

/// CPU time (user + system) of this process.
fn own_cpu_seconds() -> f64 {
    // SAFETY: getrusage writes into the struct we pass.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    if rc != 0 {
        return 0.0;
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(u.ru_utime) + tv(u.ru_stime)
}

fn config(opts: &EngineBenchOptions, kind: EngineKind, weights_dir: &std::path::Path) -> Config {
    let mut c = Config::default();
    c.model.path = Some(opts.model.clone());
    c.model.device = asyncrl_config::DeviceName::Cpu;
    c.model.temperature = 1.0;
    c.model.top_p = 1.0;
    c.model.max_new_tokens = opts.max_new_tokens;
    c.model.max_seq_len = 32 + opts.max_new_tokens;
    c.worker.max_sequences = opts.concurrency;
    c.worker.engine.kind = kind;
    if kind == EngineKind::Vllm {
        let e = &mut c.worker.engine;
        e.endpoints = vec![format!("http://127.0.0.1:{}", opts.port)];
        e.weights_dir = weights_dir.to_path_buf();
        let mut launch: Vec<String> = [
            "env",
            "VLLM_SERVER_DEV_MODE=1",
            "VLLM_CPU_KVCACHE_SPACE=1",
            "VLLM_NO_USAGE_STATS=1",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        launch.push(opts.vllm_python.to_string_lossy().into_owned());
        for a in [
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--dtype",
            "float32",
            "--logprobs-mode",
            "processed_logprobs",
            "--enable-scale-out",
            "--enforce-eager",
            "--host",
            "127.0.0.1",
        ] {
            launch.push(a.to_owned());
        }
        launch.extend([
            "--model".to_owned(),
            opts.model.to_string_lossy().into_owned(),
            "--max-model-len".to_owned(),
            c.model.max_seq_len.to_string(),
            "--port".to_owned(),
            opts.port.to_string(),
        ]);
        e.launch = launch;
    }
    c
}

/// Runs every request through `engine`, `concurrency` at a time.
async fn drive(
    engine: Arc<dyn Engine>,
    requests: Vec<SequenceRequest>,
    concurrency: usize,
) -> anyhow::Result<Throughput> {
    let cpu0 = own_cpu_seconds();
    let tokens0 = engine.counters().tokens_generated;
    let started = Instant::now();
    let sem = Arc::new(tokio::sync::Semaphore::new(concurrency));
    let mut set = tokio::task::JoinSet::new();
    for r in requests {
        let engine = engine.clone();
        let permit = sem.clone().acquire_owned().await?;
        set.spawn(async move {
            let out = engine.generate(r).await;
            drop(permit);
            out
        });
    }
    while let Some(r) = set.join_next().await {
        r?.context("a generation failed")?;
    }
    Ok(Throughput {
        tokens: engine.counters().tokens_generated - tokens0,
        seconds: started.elapsed().as_secs_f64(),
        own_cpu_seconds: own_cpu_seconds() - cpu0,
    })
}

/// The median of `v` (zero when empty).
fn median(v: Vec<Duration>) -> Duration {
    let m = super::stats::median(v.iter().map(Duration::as_secs_f64).collect());
    if m.is_nan() {
        Duration::ZERO
    } else {
        Duration::from_secs_f64(m)
    }
}

pub async fn run_engine_bench(opts: EngineBenchOptions) -> anyhow::Result<EngineBenchReport> {
    let weights_dir = tempfile::tempdir().context("weights folder")?;
    let metrics = WorkerMetrics::new(&Metrics::new())?;
    let weights = Bytes::from(
        std::fs::read(opts.model.join("model.safetensors"))
            .with_context(|| format!("{}/model.safetensors", opts.model.display()))?,
    );
    let prompts: Vec<String> =
        asyncrl_tasks::generate(asyncrl_tasks::BuiltinTask::Arith, opts.requests, 7)
            .into_iter()
            .map(|i| i.prompt_text().to_owned())
            .collect();

    let mut results = Vec::new();
    let mut swaps = Vec::new();
    let mut raw = Vec::new();
    for kind in [EngineKind::Builtin, EngineKind::Vllm] {
        let c = config(&opts, kind, weights_dir.path());
        let (built, vllm) = match kind {
            EngineKind::Builtin => (
                engine::build(&c, opts.concurrency, "bench", metrics.clone())
                    .await
                    .context("start the built-in engine")?,
                None,
            ),
            EngineKind::Vllm => {
                let (vllm, text, params) =
                    engine::vllm::build(&c, opts.concurrency, "bench", metrics.clone())
                        .await
                        .context("start the vLLM engine")?;
                let engine: Arc<dyn Engine> = vllm.clone();
                (
                    engine::Built {
                        engine,
                        text,
                        params,
                    },
                    Some(vllm),
                )
            }
        };
        let measured = async {
            built.engine.load_weights(weights.clone(), 0).await?;
            let requests = prompts
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let mut params = built.params.clone();
                    params.seed = Some(i as u64);
                    Ok(SequenceRequest {
                        prompt: built.text.encode_prompt(p)?,
                        params,
                    })
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            let t = drive(built.engine.clone(), requests, opts.concurrency).await?;
            if let Some(vllm) = &vllm {
                for v in 1..=opts.swaps as i32 {
                    let started = Instant::now();
                    built.engine.load_weights(weights.clone(), v).await?;
                    swaps.push(started.elapsed());
                    raw.push(vllm.time_raw_reload().await?);
                }
            }
            anyhow::Ok(t)
        }
        .await;
        built.engine.shutdown().await;
        results.push(measured.with_context(|| format!("{kind:?} engine"))?);
    }
    Ok(EngineBenchReport {
        options: opts,
        builtin: results[0],
        vllm: results[1],
        swap_median: median(swaps),
        raw_reload_median: median(raw),
    })
}
