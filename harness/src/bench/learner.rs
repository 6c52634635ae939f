//! The learner bench: training throughput (tokens/s) of the built-in tiny
//! model on the CPU, next to the same model's step in PyTorch eager.
//!
//! One run does both sides, one after the other (never concurrently):
//!
//! 1. **Ours** (libtorch through tch): [`Policy::builtin_tiny`] on the CPU,
//!    random token ids `[N, L]` from a fixed seed, and per iteration a full
//!    learner step: forward to float32 logits, log-softmax and gather of the
//!    target token's log-prob at every one of the `N·L` positions, a PPO-like
//!    loss `-mean(exp(c - sg(c)) · A)` (the ratio at `c = p`, so its value is
//!    `-mean(A)` and its gradient that of the policy-gradient term), backward,
//!    global gradient-norm clipping and an [`AdamW`] step.
//! 2. **PyTorch eager**: the model is saved with [`Policy::save_pretrained`]
//!    into a temporary folder and `harness/src/bench/torch_eager.py` (embedded in
//!    this crate and written next to it) opens it with
//!    `transformers.AutoModelForCausalLM` (same weights, same architecture,
//!    float32) and times the same step with `torch.optim.AdamW` and
//!    `clip_grad_norm_`, with the same shapes, threads, warm-up and
//!    iterations. It prints one JSON line, which is parsed here.
//!
//! Throughput on each side is `N·L·iterations / t`, where `t` is the sum of
//! the timed iterations' wall times (warm-up excluded); the median step time
//! is reported too. The ratio is ours / PyTorch (above 1: we are faster).
//! The thread count is set with `tch::set_num_threads` here and with
//! `torch.set_num_threads` (and `OMP_NUM_THREADS` / `MKL_NUM_THREADS`) in the
//! Python process.

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::Context as _;
use asyncrl_policy::{DeviceOptions, Policy, TinyModelSpec};
use serde::Deserialize;
use tch::{Device, Kind, Tensor};

use asyncrl_learner::adamw::{AdamW, AdamWConfig};

use super::stats::median;

/// The Python script of the PyTorch side (`harness/src/bench/torch_eager.py`).
pub const TORCH_EAGER_SCRIPT: &str = include_str!("torch_eager.py");

/// Learning rate of both sides' AdamW (the value hardly matters for speed).
const BENCH_LR: f64 = 1e-5;
/// Gradient-norm clip of both sides.
const BENCH_MAX_GRAD_NORM: f64 = 1.0;

/// What to run.
#[derive(Debug, Clone, PartialEq)]
pub struct LearnerBenchOptions {
    /// Batch rows `N`.
    pub rows: i64,
    /// Sequence length `L` (every position is a trained token).
    pub seq_len: i64,
    /// Timed iterations (after the warm-up).
    pub iterations: usize,
    /// Untimed iterations first.
    pub warmup: usize,
    /// Intra-op CPU threads, on both sides.
    pub threads: i32,
    /// The built-in model's dimensions.
    pub spec: TinyModelSpec,
    /// Seed of the weights and of the inputs.
    pub seed: u64,
    /// The Python interpreter with torch and transformers.
    pub python: PathBuf,
}

impl Default for LearnerBenchOptions {
    fn default() -> Self {
        Self {
            rows: 64,
            seq_len: 32,
            iterations: 20,
            warmup: 3,
            threads: 1,
            spec: TinyModelSpec::default(),
            seed: 0,
            python: default_python(),
        }
    }
}

/// `$ASYNCRL_PYTHON` if set, else `<workspace>/.venv/bin/python` (the
/// workspace this crate was built from).
pub fn default_python() -> PathBuf {
    match std::env::var_os("ASYNCRL_PYTHON") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => {
            let harness = Path::new(env!("CARGO_MANIFEST_DIR"));
            harness.parent().unwrap_or(harness).join(".venv/bin/python")
        }
    }
}

/// One side's figures.
#[derive(Debug, Clone, PartialEq)]
pub struct SideResult {
    /// `N·L·iterations` / seconds.
    pub tokens_per_s: f64,
    /// Sum of the timed iterations' wall times.
    pub seconds: f64,
    /// Median wall time of one iteration.
    pub median_step_s: f64,
}

/// The result of [`run_learner_bench`].
#[derive(Debug, Clone, PartialEq)]
pub struct LearnerBenchReport {
    pub rows: i64,
    pub seq_len: i64,
    pub iterations: usize,
    pub warmup: usize,
    pub threads: i32,
    /// Scalar parameters of the model (ours).
    pub params: i64,
    /// Scalar parameters transformers counted (should equal `params`).
    pub torch_params: i64,
    pub ours: SideResult,
    pub pytorch: SideResult,
    /// The PyTorch side's versions and attention implementation.
    pub torch_version: String,
    pub transformers_version: String,
    pub attn_implementation: String,
}

impl LearnerBenchReport {
    /// Our tokens/s over PyTorch eager's.
    pub fn ratio(&self) -> f64 {
        if self.pytorch.tokens_per_s > 0.0 {
            self.ours.tokens_per_s / self.pytorch.tokens_per_s
        } else {
            f64::NAN
        }
    }
}

impl fmt::Display for LearnerBenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "learner bench (CPU, float32): built-in tiny model, {} params; batch {}x{} = {} tokens/step; {} threads; {} iterations after {} warm-up",
            self.params,
            self.rows,
            self.seq_len,
            self.rows * self.seq_len,
            self.threads,
            self.iterations,
            self.warmup
        )?;
        writeln!(
            f,
            "  step: forward + log-softmax gather + PPO-ratio loss + backward + grad clip + AdamW"
        )?;
        writeln!(
            f,
            "  ours (libtorch/tch):  {:>10.0} tokens/s  (median step {:.2} ms)",
            self.ours.tokens_per_s,
            self.ours.median_step_s * 1e3
        )?;
        writeln!(
            f,
            "  PyTorch eager:        {:>10.0} tokens/s  (median step {:.2} ms; torch {}, transformers {}, attention {})",
            self.pytorch.tokens_per_s,
            self.pytorch.median_step_s * 1e3,
            self.torch_version,
            self.transformers_version,
            self.attn_implementation
        )?;
        write!(f, "  ratio ours/pytorch:   {:.2}", self.ratio())
    }
}

/// What the Python script prints.
#[derive(Debug, Deserialize)]
struct TorchOutput {
    tokens_per_s: f64,
    seconds: f64,
    median_step_s: f64,
    params: i64,
    #[serde(default)]
    torch: String,
    #[serde(default)]
    transformers: String,
    #[serde(default)]
    attn_implementation: Option<String>,
}

/// A temporary directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> anyhow::Result<Self> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let path = std::env::temp_dir().join(format!(
            "asyncrl-learner-bench-{}-{nanos}",
            std::process::id()
        ));
        std::fs::create_dir_all(&path).with_context(|| format!("create {}", path.display()))?;
        Ok(Self(path))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The per-token loss of both sides: `-mean(exp(c - sg(c)) · A)` over all
/// positions, `c` the log-prob of `targets` under `logits`.
fn ppo_like_loss(logits: &Tensor, targets: &Tensor, adv: &Tensor) -> anyhow::Result<Tensor> {
    let logp = logits
        .f_log_softmax(-1, Kind::Float)?
        .f_gather(-1, &targets.f_unsqueeze(-1)?, false)?
        .f_squeeze_dim(-1)?;
    let ratio = (&logp - logp.detach()).f_exp()?;
    Ok(ratio.f_mul(adv)?.f_mean(Kind::Float)?.f_neg()?)
}

/// Runs our side, then the PyTorch side, and reports both.
pub fn run_learner_bench(opts: LearnerBenchOptions) -> anyhow::Result<LearnerBenchReport> {
    if opts.rows < 1 || opts.seq_len < 1 || opts.iterations < 1 || opts.threads < 1 {
        anyhow::bail!(
            "invalid bench options: rows ({}), seq_len ({}), iterations ({}) and threads ({}) must be at least 1",
            opts.rows,
            opts.seq_len,
            opts.iterations,
            opts.threads
        );
    }
    if opts.seq_len > opts.spec.max_position_embeddings {
        anyhow::bail!(
            "invalid bench options: seq_len {} exceeds the model's max_position_embeddings {}",
            opts.seq_len,
            opts.spec.max_position_embeddings
        );
    }
    tch::set_num_threads(opts.threads);
    let policy = Policy::builtin_tiny(&opts.spec, opts.seed, DeviceOptions::cpu())?;
    let vocab = policy.config().vocab_size;
    let params = policy.named_parameters();
    let n_params: i64 = params.iter().map(|(_, t)| t.numel() as i64).sum();

    // Save before training, so that PyTorch starts from the same weights.
    let tmp = TempDir::new()?;
    let model_dir = tmp.0.join("model");
    policy.save_pretrained(&model_dir, None)?;

    tch::manual_seed(opts.seed as i64);
    let shape = [opts.rows, opts.seq_len];
    let ids = Tensor::f_randint(vocab, shape, (Kind::Int64, Device::Cpu))?;
    let targets = Tensor::f_randint(vocab, shape, (Kind::Int64, Device::Cpu))?;
    let adv = Tensor::f_randn(shape, (Kind::Float, Device::Cpu))?;
    let mut opt = AdamW::new(AdamWConfig::default());
    let mut step = || -> anyhow::Result<()> {
        let logits = policy.forward(&ids, None)?;
        let loss = ppo_like_loss(&logits, &targets, &adv)?;
        loss.f_backward()?;
        AdamW::clip_grad_norm(&params, BENCH_MAX_GRAD_NORM);
        opt.step(&params, BENCH_LR);
        AdamW::zero_grad(&params);
        Ok(())
    };
    for _ in 0..opts.warmup {
        step()?;
    }
    let mut times = Vec::with_capacity(opts.iterations);
    for _ in 0..opts.iterations {
        let t0 = Instant::now();
        step()?;
        times.push(t0.elapsed().as_secs_f64());
    }
    let tokens = (opts.rows * opts.seq_len) as f64 * opts.iterations as f64;
    let seconds: f64 = times.iter().sum();
    let ours = SideResult {
        tokens_per_s: if seconds > 0.0 { tokens / seconds } else { 0.0 },
        seconds,
        median_step_s: median(times),
    };

    let torch = run_python_side(&opts, &tmp.0, &model_dir)?;
    Ok(LearnerBenchReport {
        rows: opts.rows,
        seq_len: opts.seq_len,
        iterations: opts.iterations,
        warmup: opts.warmup,
        threads: opts.threads,
        params: n_params,
        torch_params: torch.params,
        ours,
        pytorch: SideResult {
            tokens_per_s: torch.tokens_per_s,
            seconds: torch.seconds,
            median_step_s: torch.median_step_s,
        },
        torch_version: torch.torch,
        transformers_version: torch.transformers,
        attn_implementation: torch
            .attn_implementation
            .unwrap_or_else(|| "default".into()),
    })
}

fn run_python_side(
    opts: &LearnerBenchOptions,
    tmp: &Path,
    model_dir: &Path,
) -> anyhow::Result<TorchOutput> {
    let script = tmp.join("torch_eager.py");
    std::fs::write(&script, TORCH_EAGER_SCRIPT)
        .with_context(|| format!("write {}", script.display()))?;
    let request = serde_json::json!({
        "model_dir": model_dir,
        "rows": opts.rows,
        "seq_len": opts.seq_len,
        "iterations": opts.iterations,
        "warmup": opts.warmup,
        "threads": opts.threads,
        "seed": opts.seed,
        "lr": BENCH_LR,
        "max_grad_norm": BENCH_MAX_GRAD_NORM,
    });
    let request_path = tmp.join("request.json");
    std::fs::write(&request_path, request.to_string())
        .with_context(|| format!("write {}", request_path.display()))?;
    let threads = opts.threads.to_string();
    let out = Command::new(&opts.python)
        .arg(&script)
        .arg(&request_path)
        .env("OMP_NUM_THREADS", &threads)
        .env("MKL_NUM_THREADS", &threads)
        .env("TOKENIZERS_PARALLELISM", "false")
        .output()
        .with_context(|| format!("run {}", opts.python.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        anyhow::bail!(
            "the PyTorch side ({}) failed with {}:\n{}",
            opts.python.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // The result is the last line; transformers may log before it.
    let line = stdout
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("");
    serde_json::from_str(line)
        .with_context(|| format!("the PyTorch side printed no valid result; stdout:\n{stdout}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loss_at_equal_logprobs_is_minus_mean_advantage() {
        let logits = Tensor::randn([2, 3, 5], (Kind::Float, Device::Cpu));
        let targets = Tensor::from_slice(&[0i64, 1, 2, 3, 4, 0]).reshape([2, 3]);
        let adv = Tensor::from_slice(&[1.0f32, -2.0, 0.5, 0.0, 3.0, 1.5]).reshape([2, 3]);
        let loss = ppo_like_loss(&logits, &targets, &adv)
            .expect("loss")
            .double_value(&[]);
        assert!((loss + 4.0 / 6.0).abs() < 1e-6, "{loss}");
    }

    #[test]
    fn bench_runs_both_sides() {
        let opts = LearnerBenchOptions {
            rows: 4,
            seq_len: 8,
            iterations: 2,
            warmup: 1,
            ..LearnerBenchOptions::default()
        };
        let report = run_learner_bench(opts).expect("learner bench");
        assert!(report.ours.tokens_per_s > 0.0, "{report}");
        assert!(report.pytorch.tokens_per_s > 0.0, "{report}");
        assert!(
            report.ratio().is_finite() && report.ratio() > 0.0,
            "{report}"
        );
        // The same model on both sides.
        assert_eq!(report.params, report.torch_params, "{report}");
        let text = report.to_string();
        assert!(text.contains("tokens/s"), "{text}");
        assert!(text.contains("ratio ours/pytorch"), "{text}");
        assert!(text.contains("4x8"), "{text}");
    }
}
