//! `asyncrl-bench gpu` (`scripts/gpu-check`): both trainer engines at real
//! model shapes, random weights, one batch: step time, peak memory and
//! tokens per second of each, the torch engine with and without activation
//! checkpointing, and the loss each engine computes on the same batch from
//! the same weights, as ratios against the built-in trainer measured in the
//! same run.
//!
//! - `qwen2.5-1.5b`: Qwen2.5-1.5B's `config.json`. The built-in trainer
//!   trains it, then writes its weights as the model folder the torch
//!   engine loads, so both start from the same weights.
//! - `qwen3-8b`: Qwen3-8B's layer shapes, `--qwen3-layers` of its 36
//!   decoder layers (fp32 weights, gradients and both AdamW moments of the
//!   whole model, 16 bytes per parameter, are about 131 GB: more than one
//!   GPU holds). The built-in model does not run Qwen3, so only the torch
//!   engine trains it (weights written by `asyncrl_trainer.tiny
//!   --config-json`). Per-layer memory is the difference to the same model
//!   with half the layers, reported with the projection to 36 layers.
//! - `tiny-qwen2`, `tiny-qwen3`: the same code at toy sizes, for the CPU
//!   (the test that keeps this bench working where there is no GPU).
//!
//! Peak memory is the device's used memory (`nvidia-smi`) above what was in
//! use before the phase, on CUDA; on the CPU it is the resident memory of
//! this process and its descendants (the engine's ranks), sampled every
//! 50 ms. Times are the mean of the steps after the first (which allocates
//! gradients and AdamW state).

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use asyncrl_config::{Config, MixedPrecisionName, ProximalName, TrainerEngineName};
use asyncrl_learner::engine::TrainerEngine;
use asyncrl_learner::objective::ObjectiveConfig;
use asyncrl_learner::trainer::{StepSettings, Trainer, TrainerOptions};
use asyncrl_policy::{DeviceOptions, ModelConfig, Policy};
use asyncrl_protos::v1::{FinishReason, RewardStatus, Timings, Trajectory};

#[derive(Debug, Clone)]
pub struct GpuBenchOptions {
    /// `cuda` or `cpu`.
    pub device: String,
    pub shapes: Vec<String>,
    /// Decoder layers of the `qwen3-8b` shape.
    pub qwen3_layers: usize,
    /// Rows of the batch (one group).
    pub rows: usize,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Steps per engine (the first allocates its state; at least 2).
    pub steps: usize,
    /// Micro-batch token budget of both engines (0: no split).
    pub microbatch_tokens: usize,
    /// The interpreter with torch, transformers and `asyncrl_trainer`.
    pub python: PathBuf,
    /// Where the model folders go (large: GBs per shape).
    pub work: PathBuf,
    pub seed: u64,
}

/// One engine's measurement on one shape.
#[derive(Debug, Clone)]
pub struct EngineRun {
    pub shape: String,
    /// `builtin`, `torch`, `torch+ac` (activation checkpointing), or the
    /// torch engine at half depth (`torch, L/2 layers`).
    pub engine: String,
    pub parameters: u64,
    pub layers: usize,
    pub step_seconds: f64,
    pub first_step_seconds: f64,
    pub peak_mib: f64,
    pub tokens_per_second: f64,
    /// The loss of the first step (weights before any update).
    pub first_loss: f64,
}

#[derive(Debug, Clone)]
pub struct GpuBenchReport {
    pub opts: GpuBenchOptions,
    pub device_name: String,
    pub runs: Vec<EngineRun>,
}

/// Shapes by name: (`config.json`, the built-in model runs it).
pub fn shape_config(name: &str, qwen3_layers: usize) -> anyhow::Result<serde_json::Value> {
    let qwen2 = |hidden: u64, inter: u64, layers: u64, heads: u64, kv: u64, vocab: u64| {
        serde_json::json!({
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "hidden_size": hidden,
            "intermediate_size": inter,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": true,
            "vocab_size": vocab,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "hidden_act": "silu",
            "use_sliding_window": false,
            "torch_dtype": "bfloat16",
        })
    };
    let qwen3 = |hidden: u64, inter: u64, layers: u64, heads: u64, kv: u64, vocab: u64| {
        serde_json::json!({
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_size": hidden,
            "intermediate_size": inter,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "head_dim": 128.min(hidden / heads * 2),
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": false,
            "vocab_size": vocab,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "hidden_act": "silu",
            "torch_dtype": "bfloat16",
        })
    };
    Ok(match name {
        // Qwen2.5-1.5B(-Instruct)'s published config.
        "qwen2.5-1.5b" => qwen2(1536, 8960, 28, 12, 2, 151_936),
        // Qwen3-8B's published layer shapes (36 layers there).
        "qwen3-8b" => qwen3(4096, 12288, qwen3_layers as u64, 32, 8, 151_936),
        "tiny-qwen2" => qwen2(64, 128, 2, 4, 2, 256),
        "tiny-qwen3" => qwen3(64, 128, qwen3_layers.min(4) as u64, 4, 2, 256),
        other => {
            anyhow::bail!("unknown shape {other:?}: qwen2.5-1.5b, qwen3-8b, tiny-qwen2, tiny-qwen3")
        }
    })
}

/// Samples the peak memory in use while it lives.
struct PeakMemory {
    stop: Arc<AtomicBool>,
    peak_bits: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
    baseline: f64,
}

fn memory_in_use(cuda: bool) -> f64 {
    if cuda {
        // The whole device's used memory (MiB): every engine's processes.
        let out = std::process::Command::new("nvidia-smi")
            .args(["--query-gpu=memory.used", "--format=csv,noheader,nounits"])
            .output();
        return out
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.lines().next().and_then(|l| l.trim().parse().ok()))
            .unwrap_or(0.0);
    }
    let rss = |pid: u32| -> f64 {
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("VmRSS:"))
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|v| v.parse::<f64>().ok())
            })
            .map_or(0.0, |kb| kb / 1024.0)
    };
    let me = std::process::id();
    rss(me)
        + crate::process::descendants(me)
            .into_iter()
            .map(|(pid, _)| rss(pid))
            .sum::<f64>()
}

impl PeakMemory {
    fn start(cuda: bool) -> Self {
        let baseline = memory_in_use(cuda);
        let stop = Arc::new(AtomicBool::new(false));
        let peak_bits = Arc::new(AtomicU64::new(baseline.to_bits()));
        let thread = {
            let (stop, peak_bits) = (stop.clone(), peak_bits.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let now = memory_in_use(cuda);
                    let _ = peak_bits.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |p| {
                        (now > f64::from_bits(p)).then_some(now.to_bits())
                    });
                    std::thread::sleep(Duration::from_millis(50));
                }
            })
        };
        Self {
            stop,
            peak_bits,
            thread: Some(thread),
            baseline,
        }
    }

    /// The peak above the memory in use when sampling started (MiB).
    fn finish(mut self) -> f64 {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        (f64::from_bits(self.peak_bits.load(Ordering::Relaxed)) - self.baseline).max(0.0)
    }
}

/// One group of `rows` random completions, rewards alternating.
fn batch(opts: &GpuBenchOptions, vocab: u64) -> anyhow::Result<arrow::array::RecordBatch> {
    let mut rng = asyncrl_tasks::SplitMix64::new(opts.seed ^ 0xB47C);
    let below = vocab.saturating_sub(3).max(1);
    let trajectories: Vec<Trajectory> = (0..opts.rows)
        .map(|i| {
            let mut tokens =
                |n: usize| -> Vec<i32> { (0..n).map(|_| 3 + rng.below(below) as i32).collect() };
            let prompt = tokens(opts.prompt_tokens);
            let completion = tokens(opts.completion_tokens);
            Trajectory {
                uuid: format!("00000000-0000-4000-8000-{i:012}"),
                task_id: "gpu-0".into(),
                group_id: "gpu-group".into(),
                prompt_token_ids: prompt,
                behaviour_logprobs: vec![-12.0; completion.len()],
                policy_versions: vec![0; completion.len()],
                completion_token_ids: completion,
                reward: (i % 2) as f32,
                reward_status: RewardStatus::Ok as i32,
                finish_reason: FinishReason::Length as i32,
                worker_id: "bench".into(),
                timings: Some(Timings::default()),
                group_size: opts.rows as u32,
                index_in_group: i as u32,
                admission_version: 0,
                turns: Vec::new(),
            }
        })
        .collect();
    Ok(asyncrl_protos::arrow_schema::to_record_batch(
        &trajectories,
    )?)
}

fn settings() -> StepSettings {
    StepSettings {
        objective: ObjectiveConfig::default(),
        learning_rate: 1e-6,
    }
}

/// What is measured of a run besides its steps.
struct RunLabel<'a> {
    shape: &'a str,
    engine: &'a str,
    parameters: u64,
    layers: usize,
}

/// Trains `steps` steps of `engine` on `batch`, sampling peak memory.
fn measure_steps(
    label: RunLabel<'_>,
    engine: &mut dyn TrainerEngine,
    batch: &arrow::array::RecordBatch,
    steps: usize,
    cuda: bool,
) -> anyhow::Result<EngineRun> {
    let peak = PeakMemory::start(cuda);
    let mut times = Vec::with_capacity(steps);
    let mut first_loss = f64::NAN;
    let mut tokens = 0;
    for s in 0..steps {
        let start = Instant::now();
        let stats = engine.train_step(std::slice::from_ref(batch), &settings())?;
        if cuda {
            tch::Cuda::synchronize(0);
        }
        times.push(start.elapsed().as_secs_f64());
        if s == 0 {
            first_loss = stats.loss;
        }
        tokens = stats.tokens;
    }
    let peak_mib = peak.finish();
    let rest = &times[1..];
    let step = rest.iter().sum::<f64>() / rest.len().max(1) as f64;
    let run = EngineRun {
        shape: label.shape.to_owned(),
        engine: label.engine.to_owned(),
        parameters: label.parameters,
        layers: label.layers,
        step_seconds: step,
        first_step_seconds: times[0],
        peak_mib,
        tokens_per_second: tokens as f64 / step,
        first_loss,
    };
    eprintln!("{run:?}");
    Ok(run)
}

fn torch_config(opts: &GpuBenchOptions, model: &Path, work: &Path, ac: bool) -> Config {
    let mut config = Config::isolated(work.join("out"), "local");
    config.model.path = Some(model.to_owned());
    config.learner.trainer = TrainerEngineName::Torch;
    config.learner.torch.python = opts.python.clone();
    config.learner.torch.world_size = 1;
    config.learner.torch.mixed_precision = MixedPrecisionName::Auto;
    config.learner.torch.activation_checkpointing = ac;
    config.learner.proximal = ProximalName::Recompute;
    config.learner.max_tokens_per_microbatch = opts.microbatch_tokens;
    config.coordinator.initial_knobs.learning_rate = 1e-6;
    config
}

#[allow(clippy::too_many_arguments)]
fn run_torch(
    opts: &GpuBenchOptions,
    shape: &str,
    label: &str,
    model: &Path,
    layers: usize,
    ac: bool,
    batch: &arrow::array::RecordBatch,
    runs: &mut Vec<EngineRun>,
) -> anyhow::Result<()> {
    let cuda = opts.device == "cuda";
    let work = tempfile::tempdir_in(&opts.work).context("a temp dir")?;
    let config = torch_config(opts, model, work.path(), ac);
    let trainer_opts = asyncrl_learner::service::trainer_options(&config);
    let mut engine = asyncrl_learner::torch_engine::TorchEngine::start(
        &config,
        trainer_opts,
        &work.path().join("checkpoints"),
    )
    .with_context(|| format!("{shape}: the torch engine ({label})"))?;
    let run = RunLabel {
        shape,
        engine: label,
        parameters: engine.parameters(),
        layers,
    };
    runs.push(measure_steps(run, &mut engine, batch, opts.steps, cuda)?);
    Ok(())
}

/// Writes a random Qwen3 model folder of `cfg` through `asyncrl_trainer.tiny`.
fn write_python_model(
    opts: &GpuBenchOptions,
    cfg: &serde_json::Value,
    dir: &Path,
) -> anyhow::Result<()> {
    let json = dir.with_extension("json");
    std::fs::write(&json, serde_json::to_vec_pretty(cfg)?)?;
    let out = std::process::Command::new(&opts.python)
        .args(["-m", "asyncrl_trainer.tiny", "--config-json"])
        .arg(&json)
        .arg("--out")
        .arg(dir)
        .arg(format!("--seed={}", opts.seed))
        .output()
        .with_context(|| format!("cannot run {}", opts.python.display()))?;
    anyhow::ensure!(
        out.status.success(),
        "asyncrl_trainer.tiny --config-json failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

pub fn run_gpu_bench(opts: GpuBenchOptions) -> anyhow::Result<GpuBenchReport> {
    let cuda = match opts.device.as_str() {
        "cuda" => {
            anyhow::ensure!(
                tch::Cuda::is_available(),
                "--device cuda: libtorch sees no CUDA device (scripts/gpu-check loads the GPU build's libraries)"
            );
            true
        }
        "cpu" => false,
        other => anyhow::bail!("--device {other:?}: cuda or cpu"),
    };
    anyhow::ensure!(opts.steps >= 2, "--steps {}: at least 2", opts.steps);
    std::fs::create_dir_all(&opts.work)
        .with_context(|| format!("cannot create {}", opts.work.display()))?;
    let device_name = if cuda {
        std::process::Command::new("nvidia-smi")
            .args(["--query-gpu=name,memory.total", "--format=csv,noheader"])
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .map_or_else(|| "cuda".to_owned(), |s| s.trim().to_owned())
    } else {
        "cpu".to_owned()
    };
    let mut runs = Vec::new();
    for shape in &opts.shapes {
        let cfg_json = shape_config(shape, opts.qwen3_layers)?;
        let vocab = cfg_json["vocab_size"].as_u64().unwrap_or(256);
        let batch = batch(&opts, vocab)?;
        let model = opts.work.join(shape);
        if model.exists() {
            std::fs::remove_dir_all(&model)
                .with_context(|| format!("cannot clear {}", model.display()))?;
        }
        let layers = cfg_json["num_hidden_layers"].as_u64().unwrap_or(0) as usize;
        if cfg_json["model_type"] == "qwen2" {
            // The built-in trainer first; its weights become the folder.
            let cfg = ModelConfig::from_json(&cfg_json)?;
            let device = if cuda {
                DeviceOptions::auto()
            } else {
                DeviceOptions::cpu()
            };
            let policy = Policy::random_init(cfg, opts.seed, 0.02, device)?;
            let parameters = policy.num_parameters() as u64;
            let mut trainer = Trainer::new(
                policy,
                TrainerOptions {
                    proximal: asyncrl_learner::objective::ProximalMode::Recompute,
                    max_tokens_per_microbatch: opts.microbatch_tokens,
                    ..Default::default()
                },
            );
            // The folder holds the weights before any step.
            trainer
                .policy()
                .save_pretrained(&model, None)
                .context("write the model folder the torch engine loads")?;
            let label = RunLabel {
                shape,
                engine: "builtin",
                parameters,
                layers,
            };
            runs.push(measure_steps(
                label,
                &mut trainer,
                &batch,
                opts.steps,
                cuda,
            )?);
            drop(trainer);
            for (label, ac) in [("torch", false), ("torch+ac", true)] {
                run_torch(&opts, shape, label, &model, layers, ac, &batch, &mut runs)?;
            }
        } else {
            write_python_model(&opts, &cfg_json, &model)?;
            for (label, ac) in [("torch", false), ("torch+ac", true)] {
                run_torch(&opts, shape, label, &model, layers, ac, &batch, &mut runs)?;
            }
            // Half the depth: the per-layer cost by difference.
            if layers >= 2 {
                let mut half = cfg_json.clone();
                half["num_hidden_layers"] = serde_json::json!(layers / 2);
                let half_dir = opts.work.join(format!("{shape}-half"));
                if half_dir.exists() {
                    std::fs::remove_dir_all(&half_dir)?;
                }
                write_python_model(&opts, &half, &half_dir)?;
                let label = format!("torch, {} layers", layers / 2);
                run_torch(
                    &opts,
                    shape,
                    &label,
                    &half_dir,
                    layers / 2,
                    false,
                    &batch,
                    &mut runs,
                )?;
                let _ = std::fs::remove_dir_all(&half_dir);
            }
        }
        let _ = std::fs::remove_dir_all(&model);
    }
    Ok(GpuBenchReport {
        opts,
        device_name,
        runs,
    })
}

impl fmt::Display for GpuBenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let o = &self.opts;
        writeln!(
            f,
            "gpu bench on {}: {} rows × ({} prompt + {} completion) tokens, {} steps (mean of steps 2..), micro-batches ≤ {} tokens (0: none)",
            self.device_name,
            o.rows,
            o.prompt_tokens,
            o.completion_tokens,
            o.steps,
            o.microbatch_tokens
        )?;
        writeln!(
            f,
            "| shape | engine | parameters | layers | step (s) | first step (s) | peak (MiB) | tokens/s | loss, first step |"
        )?;
        writeln!(f, "|---|---|---:|---:|---:|---:|---:|---:|---:|")?;
        for r in &self.runs {
            writeln!(
                f,
                "| {} | {} | {} | {} | {:.3} | {:.3} | {:.0} | {:.0} | {:.6} |",
                r.shape,
                r.engine,
                r.parameters,
                r.layers,
                r.step_seconds,
                r.first_step_seconds,
                r.peak_mib,
                r.tokens_per_second,
                r.first_loss
            )?;
        }
        for shape in &o.shapes {
            let of = |e: &str| {
                self.runs
                    .iter()
                    .find(|r| &r.shape == shape && r.engine == e)
            };
            let base = of("builtin").or_else(|| of("torch"));
            let Some(base) = base else { continue };
            for r in self
                .runs
                .iter()
                .filter(|r| &r.shape == shape && !std::ptr::eq(*r, base))
            {
                writeln!(
                    f,
                    "{shape}: {} / {}: step time {:.2}, peak memory {:.2}, tokens/s {:.2}, loss difference {:.2e}",
                    r.engine,
                    base.engine,
                    r.step_seconds / base.step_seconds,
                    r.peak_mib / base.peak_mib.max(1e-9),
                    r.tokens_per_second / base.tokens_per_second,
                    (r.first_loss - base.first_loss).abs()
                )?;
            }
            // Per-layer memory by difference, projected to the real depth.
            let full = of("torch");
            let half = self
                .runs
                .iter()
                .find(|r| &r.shape == shape && r.engine.starts_with("torch, "));
            if let (Some(full), Some(half)) = (full, half)
                && full.layers > half.layers
            {
                let per_layer =
                    (full.peak_mib - half.peak_mib) / (full.layers - half.layers) as f64;
                let at = |layers: usize| {
                    full.peak_mib + per_layer * (layers as f64 - full.layers as f64)
                };
                writeln!(
                    f,
                    "{shape}: {per_layer:.0} MiB per decoder layer; projected peak at 36 layers on one device, world size 1: {:.0} MiB",
                    at(36)
                )?;
            }
        }
        Ok(())
    }
}
