//! `asyncrl-bench worker`: generated tokens/s of the worker with continuous
//! batching against static batching (acquire a batch, wait until its
//! slowest sequence has finished, acquire the next), on the long-tailed
//! `reverse` task, in one run.
//!
//! Both modes run the whole worker (scripted coordinator, weights from the
//! object store, scoring, publishing to the trajectory stream) over the
//! in-process bus, on the same tasks, with a fresh model thread of the same
//! weights each. Rounds alternate between the modes so that machine noise
//! hits both; the best round of each mode counts.
//!
//! The untrained built-in model does not know when to stop, so by default
//! every completion is made exactly as long as its reference answer (plus
//! the end token; [`CompletionLengths::ReferenceAnswer`]): the workload has
//! the task's heavy-tailed lengths, as a policy that has learnt the task
//! would produce.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use asyncrl_config::{BatchingMode, Config, DeviceName, ModelConfig};
use asyncrl_policy::from_config::load_policy;
use asyncrl_policy::{DecodeBatchOptions, EngineOptions, ModelHandle, WeightDtype};
use asyncrl_tasks::BuiltinTask;
use asyncrl_telemetry::Metrics;
use asyncrl_transport::{Bus, LocalBus};
use bytes::Bytes;
use tokio_util::sync::CancellationToken;

use asyncrl_rollout_worker::scripted::{
    AnnounceError, ScriptOptions, ScriptedCoordinator, ScriptedTask, ensure_trajectory_stream,
    publish_weights,
};
use asyncrl_rollout_worker::{CompletionLengths, Worker, WorkerError};

#[derive(Debug, Clone)]
pub struct BatchingBenchOptions {
    /// `reverse` tasks per run.
    pub tasks: usize,
    /// G: completions per task.
    pub group_size: u32,
    /// Slots of the decode batch.
    pub max_sequences: usize,
    /// Runs per mode (alternating); the best counts.
    pub rounds: usize,
    /// Seed of the data set and of the model's weights.
    pub seed: u64,
    /// The model (default: the built-in tiny model of `[model]`'s defaults,
    /// on the CPU unless `device` says otherwise).
    pub model: ModelConfig,
    pub lengths: CompletionLengths,
    /// Give up on a run after this long.
    pub run_timeout: Duration,
}

impl Default for BatchingBenchOptions {
    fn default() -> Self {
        Self {
            tasks: 128,
            group_size: 8,
            max_sequences: 64,
            rounds: 2,
            seed: 0,
            // One intra-op thread: the comparison is about scheduling, and
            // more threads contend with the worker's own runtime on small
            // machines (set `cpu_threads` for a real measurement).
            model: ModelConfig {
                device: DeviceName::Cpu,
                cpu_threads: 1,
                ..ModelConfig::default()
            },
            lengths: CompletionLengths::ReferenceAnswer,
            run_timeout: Duration::from_secs(600),
        }
    }
}

/// One run of one mode.
#[derive(Debug, Clone)]
pub struct BatchingBenchRow {
    pub mode: BatchingMode,
    /// Tokens sampled.
    pub tokens: u64,
    /// First grant to last completion.
    pub seconds: f64,
    /// Decoding steps.
    pub steps: u64,
    pub max_sequences: usize,
}

impl BatchingBenchRow {
    pub fn tokens_per_second(&self) -> f64 {
        self.tokens as f64 / self.seconds.max(1e-9)
    }

    /// Mean fraction of the batch's slots that sampled a token per step.
    pub fn occupancy(&self) -> f64 {
        self.tokens as f64 / (self.steps.max(1) as f64 * self.max_sequences as f64)
    }
}

#[derive(Debug, Clone)]
pub struct BatchingBenchReport {
    pub options: BatchingBenchOptions,
    /// The best run of each mode: continuous first, then static.
    pub continuous: BatchingBenchRow,
    pub static_: BatchingBenchRow,
    /// Median / p99 / max completion length of the data set (tokens).
    pub length_quantiles: (usize, usize, usize),
}

impl BatchingBenchReport {
    /// Continuous tokens/s over static tokens/s.
    pub fn ratio(&self) -> f64 {
        self.continuous.tokens_per_second() / self.static_.tokens_per_second().max(1e-9)
    }

    /// Static decoding steps over continuous decoding steps for the same
    /// tokens: the speed-up where a step costs the same whatever its number
    /// of rows (a memory-bound decode on a GPU). On a CPU a step's cost
    /// grows with its rows, so [`Self::ratio`] is smaller.
    pub fn step_ratio(&self) -> f64 {
        self.static_.steps as f64 / self.continuous.steps.max(1) as f64
    }
}

impl fmt::Display for BatchingBenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let o = &self.options;
        let (p50, p99, max) = self.length_quantiles;
        let t = &o.model.tiny;
        writeln!(
            f,
            "rollout worker: continuous vs static batching on `reverse` ({} tasks x G={}, {} slots, \
             completion length median {p50} / p99 {p99} / max {max} tokens; model {}; best of {} alternating rounds)",
            o.tasks,
            o.group_size,
            o.max_sequences,
            match &o.model.path {
                Some(p) => p.display().to_string(),
                None => format!(
                    "built-in tiny h{} x{} layers on {:?}",
                    t.hidden_size, t.num_hidden_layers, o.model.device
                ),
            },
            o.rounds
        )?;
        writeln!(
            f,
            "{:<12} {:>10} {:>10} {:>12} {:>8} {:>10}",
            "mode", "tokens", "seconds", "tokens/s", "steps", "occupancy"
        )?;
        for (name, r) in [("continuous", &self.continuous), ("static", &self.static_)] {
            writeln!(
                f,
                "{:<12} {:>10} {:>10.3} {:>12.1} {:>8} {:>9.1}%",
                name,
                r.tokens,
                r.seconds,
                r.tokens_per_second(),
                r.steps,
                100.0 * r.occupancy()
            )?;
        }
        writeln!(f, "continuous / static tokens/s: {:.2}x", self.ratio())?;
        writeln!(
            f,
            "static / continuous decoding steps for the same tokens: {:.2}x",
            self.step_ratio()
        )
    }
}

/// Runs the bench; see the module docs.
pub async fn run_batching_bench(
    options: BatchingBenchOptions,
) -> Result<BatchingBenchReport, WorkerError> {
    let tasks = ScriptedTask::generated(BuiltinTask::Reverse, options.tasks, options.seed);
    let mut lens: Vec<usize> = tasks.iter().map(|t| t.answer.chars().count() + 1).collect();
    lens.sort_unstable();
    let q = |p: f64| {
        lens.get(((lens.len() as f64 - 1.0) * p).round() as usize)
            .copied()
            .unwrap_or(0)
    };
    let length_quantiles = (q(0.5), q(0.99), lens.last().copied().unwrap_or(0));
    let mut runs = Vec::new();
    for _ in 0..options.rounds.max(1) {
        for mode in [BatchingMode::Continuous, BatchingMode::Static] {
            let row = run_once(&options, mode, tasks.clone()).await?;
            tracing::info!(
                ?mode,
                tokens_per_s = row.tokens_per_second(),
                "bench run done"
            );
            runs.push(row);
        }
    }
    let best = |mode: BatchingMode| {
        runs.iter()
            .filter(|r| r.mode == mode)
            .max_by(|a, b| a.tokens_per_second().total_cmp(&b.tokens_per_second()))
            .cloned()
    };
    let (Some(continuous), Some(static_)) =
        (best(BatchingMode::Continuous), best(BatchingMode::Static))
    else {
        return Err(WorkerError::Settings {
            key: "bench".into(),
            reason: "no run finished".into(),
        });
    };
    Ok(BatchingBenchReport {
        options,
        continuous,
        static_,
        length_quantiles,
    })
}

async fn run_once(
    o: &BatchingBenchOptions,
    mode: BatchingMode,
    tasks: Vec<ScriptedTask>,
) -> Result<BatchingBenchRow, WorkerError> {
    let n = tasks.len();
    let bus: Arc<dyn Bus> = Arc::new(LocalBus::new());
    ensure_trajectory_stream(bus.as_ref()).await?;
    let section = o.model.clone();
    let seed = o.seed;
    let model = ModelHandle::spawn(
        EngineOptions {
            batch: DecodeBatchOptions {
                max_slots: o.max_sequences,
                max_seq_len: o.model.max_seq_len,
            },
            thread_name: "asyncrl-bench-model".into(),
            ..EngineOptions::default()
        },
        move || load_policy(&section, seed),
    )
    .await?;
    let weights = model.weights_bytes(WeightDtype::F32).await?;
    publish_weights(bus.as_ref(), 0, Bytes::from(weights))
        .await
        .map_err(|e| match e {
            AnnounceError::Transport(t) => WorkerError::from(t),
            other => WorkerError::Settings {
                key: asyncrl_protos::subjects::POLICY_VERSION_KEY.into(),
                reason: format!("cannot announce the weights: {other}"),
            },
        })?;
    let coordinator = ScriptedCoordinator::start(
        bus.clone(),
        tasks,
        ScriptOptions {
            group_size: o.group_size,
            retry_after_ms: 5,
            ..ScriptOptions::default()
        },
    )
    .await?;
    let mut config = Config {
        model: o.model.clone(),
        ..Config::default()
    };
    config.staleness.group_size = o.group_size;
    config.worker.id = Some(format!("bench-{mode:?}").to_lowercase());
    config.worker.max_sequences = o.max_sequences;
    config.worker.batching = mode;
    let shutdown = CancellationToken::new();
    let worker = tokio::spawn(
        Worker::new(config, bus.clone(), Metrics::new())
            .with_model(model.clone())
            .with_completion_lengths(o.lengths)
            .run(shutdown.clone()),
    );
    let (done, log) = coordinator
        .wait_for(o.run_timeout, |log| log.completed_leases().len() >= n)
        .await;
    shutdown.cancel();
    let summary = worker.await??;
    if !done {
        return Err(WorkerError::Settings {
            key: "bench".into(),
            reason: format!(
                "{mode:?} run finished {} of {n} tasks within {:?}",
                summary.tasks_completed, o.run_timeout
            ),
        });
    }
    let first = log.granted.first().map(|(t, _)| *t);
    let last = log.completions.iter().map(|c| c.at).max();
    let seconds = match (first, last) {
        (Some(a), Some(b)) => b.duration_since(a).as_secs_f64(),
        _ => 0.0,
    };
    let stats = model.stats();
    Ok(BatchingBenchRow {
        mode,
        tokens: stats.tokens_generated,
        seconds,
        steps: stats.steps,
        max_sequences: o.max_sequences,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn continuous_batching_needs_fewer_steps_for_the_same_tokens() {
        let mut opts = BatchingBenchOptions {
            tasks: 24,
            group_size: 2,
            max_sequences: 8,
            rounds: 1,
            ..BatchingBenchOptions::default()
        };
        opts.model.tiny.hidden_size = 32;
        opts.model.tiny.num_hidden_layers = 1;
        opts.model.tiny.num_attention_heads = 2;
        opts.model.tiny.num_key_value_heads = 1;
        opts.model.tiny.intermediate_size = 64;
        let report = run_batching_bench(opts).await.unwrap();
        let text = report.to_string();
        assert!(text.contains("continuous / static tokens/s"), "{text}");
        let (c, s) = (&report.continuous, &report.static_);
        assert_eq!(
            (c.mode, s.mode),
            (BatchingMode::Continuous, BatchingMode::Static)
        );
        // Every completion is as long as its reference answer plus one.
        assert_eq!(c.tokens, s.tokens, "{text}");
        assert!(c.tokens > 0);
        assert!(c.steps < s.steps, "{text}");
        assert!(c.occupancy() > s.occupancy(), "{text}");
    }
}
