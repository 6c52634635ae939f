//! Held-out evaluation: greedy accuracy, mean sampled accuracy and pass@k
//! of a policy on problems with reference answers, scored by the built-in
//! verifiers.
//!
//! [`evaluate`] scores one policy (`asyncrl eval`, the warm start's report).
//! [`Evaluator`] is the learner's `[eval]`: a thread with its own copy of the
//! model that evaluates the weights of the versions the learner hands it,
//! off the learner's critical path (the learner only clones the bytes it
//! publishes anyway), and writes `eval.csv` (one [`EvalRow`] per version,
//! see [`crate::outputs`]) and the `asyncrl_eval_*` metrics, and hands each
//! row to the learner (for `asyncrl train`'s progress line).
//!
//! Architecture invariant: an evaluation row names the version whose
//! weights were scored; the learner hands over the bytes it published for
//! that version, never the weights of a later step.

use std::collections::{BTreeSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, mpsc};
use std::time::Instant;

use anyhow::Context as _;
use asyncrl_config::{Config, EvalEngineName, TrainerEngineName};
use asyncrl_environment::{
    EnvTask, Environment, EpisodeFailure, EpisodeLimits, EpisodeOutput, LockstepEpisode, Reply,
    ReplyEnd, ReplyRequest, run_lockstep,
};
use asyncrl_policy::{DecodeBatchOptions, ModelText, Policy, SamplingParams, SequenceRequest};
use asyncrl_tasks::{TaskItem, Verdict};
use asyncrl_telemetry::{Metrics, TelemetryError};
use bytes::Bytes;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

use crate::engine::TrainerEngine as _;
use crate::outputs::{CsvLog, EVAL_CSV};
use crate::torch_engine::TorchEngine;
use crate::trainer::TrainError;

// The scores and the row are records of `eval.csv`, at home in
// [`crate::outputs`]; [`evaluate`] returns the scores.
pub use crate::outputs::{EvalRow, EvalScores};

/// How to evaluate.
#[derive(Debug, Clone)]
pub struct EvalSpec {
    /// Greedy accuracy (one completion per problem at temperature 0).
    pub greedy: bool,
    /// Completions sampled per problem (0: none).
    pub samples: usize,
    pub temperature: f64,
    pub max_new_tokens: usize,
    /// Seed of sample `j` of problem `i`: `seed + i·samples + j`.
    pub seed: u64,
    /// Stop strings (the text a verifier sees ends before the first).
    pub stop_strings: Vec<String>,
    /// Multi-turn: each problem is an episode in this environment, scored
    /// by the rewards the environment gives (`None`: one completion scored
    /// by the item's verifier).
    pub episodes: Option<EpisodeEval>,
}

impl EvalSpec {
    /// `[eval]` with the defaults it takes from `[model]`, and episodes in
    /// `[environment]`'s environment when the config has one (its HTTP
    /// client counts its calls in `metrics`). Each reply of an episode has
    /// at most `eval.max_new_tokens` tokens (default: the episode's turn
    /// limit).
    pub fn from_config(config: &Config, metrics: &Metrics) -> anyhow::Result<Self> {
        let e = &config.eval;
        let episodes = EpisodeEval::from_config(config, metrics)?;
        let max_new_tokens = match (&episodes, e.max_new_tokens) {
            (_, Some(n)) => n,
            (Some(ep), None) => ep.limits.max_turn_tokens,
            (None, None) => config.model.max_new_tokens,
        };
        Ok(Self {
            greedy: e.greedy,
            samples: e.samples,
            temperature: e.temperature.unwrap_or(config.model.temperature),
            max_new_tokens,
            seed: e.seed,
            stop_strings: config.model.stop_strings.clone(),
            episodes,
        })
    }
}

/// The environment of a multi-turn evaluation and the limits of its
/// episodes (`[environment]`'s). The environment runs without
/// `environment.tool_latency`: an evaluation measures the policy, not the
/// tool. Its calls run on a runtime of the evaluation's own, on the
/// evaluating thread.
#[derive(Clone)]
pub struct EpisodeEval {
    pub env: Arc<dyn Environment>,
    pub limits: EpisodeLimits,
    runtime: Arc<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for EpisodeEval {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EpisodeEval")
            .field("env", &self.env.name())
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl EpisodeEval {
    /// `None` without `[environment]`.
    pub fn from_config(config: &Config, metrics: &Metrics) -> anyhow::Result<Option<Self>> {
        let Some(cfg) = &config.environment else {
            return Ok(None);
        };
        let mut cfg = cfg.clone();
        cfg.tool_latency = std::time::Duration::ZERO;
        let env = asyncrl_environment::from_config(&cfg, metrics)
            .with_context(|| format!("environment.url = {:?}", cfg.url))?;
        let turn_tokens = config
            .eval
            .max_new_tokens
            .unwrap_or_else(|| cfg.turn_tokens(config.model.max_new_tokens));
        Ok(Some(Self::new(
            env,
            EpisodeLimits {
                max_turns: cfg.max_turns,
                max_turn_tokens: turn_tokens,
                max_episode_tokens: cfg.episode_tokens(config.model.max_seq_len),
            },
        )?))
    }

    pub fn new(env: Arc<dyn Environment>, limits: EpisodeLimits) -> anyhow::Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start the runtime of the evaluation's environment calls")?;
        Ok(Self {
            env,
            limits,
            runtime: Arc::new(runtime),
        })
    }

    /// Runs one episode of each item, `per_item` times, item-major, with
    /// `generate` making every reply (all the replies of a round in one
    /// call): each episode's output, in order.
    pub fn run(
        &self,
        text: &ModelText,
        items: &[TaskItem],
        per_item: usize,
        eos: &[i64],
        mut generate: impl FnMut(&[ReplyRequest]) -> Result<Vec<Reply>, TrainError>,
    ) -> Result<Vec<EpisodeOutput>, TrainError> {
        let run_id = uuid::Uuid::new_v4();
        let mut episodes = Vec::with_capacity(items.len() * per_item);
        for (i, item) in items.iter().enumerate() {
            let task = EnvTask::from_prompt(&item.id, &item.dataset, &item.prompt, &item.answer)
                .map_err(|e| TrainError::Episode {
                    task_id: item.id.clone(),
                    source: EpisodeFailure::Task(e),
                })?;
            for j in 0..per_item {
                episodes.push(LockstepEpisode {
                    episode_id: format!("eval-{run_id}-{i}-{j}"),
                    task: task.clone(),
                    messages: asyncrl_environment::prompt_messages(&item.prompt),
                });
            }
        }
        let outputs = run_lockstep(
            &self.runtime,
            self.env.as_ref(),
            text,
            episodes,
            self.limits,
            eos,
            &mut generate,
        )?;
        outputs
            .into_iter()
            .enumerate()
            .map(|(n, out)| {
                out.map_err(|source| TrainError::Episode {
                    task_id: items[n / per_item.max(1)].id.clone(),
                    source,
                })
            })
            .collect()
    }
}

/// A reply made of `tokens` generated for `request` without log-probs (an
/// evaluation's, a demonstration's): cut to the request's token limit, and
/// ended by a stop token when its last token is one.
pub fn untracked_reply(mut tokens: Vec<i64>, request: &ReplyRequest, stops: &[i64]) -> Reply {
    tokens.truncate(request.max_new_tokens.max(1));
    let end = match tokens.last() {
        Some(t) if stops.contains(t) => ReplyEnd::Stop,
        _ => ReplyEnd::Length,
    };
    Reply {
        logprobs: vec![0.0; tokens.len()],
        versions: vec![0; tokens.len()],
        tokens,
        end,
    }
}

/// Scores `policy` on `items` (blocking; run it on the model's thread).
pub fn evaluate(
    policy: &Policy,
    text: &ModelText,
    items: &[TaskItem],
    spec: &EvalSpec,
) -> Result<EvalScores, TrainError> {
    let _g = tch::no_grad_guard();
    let eos = policy.eos_token_ids();
    evaluate_with(text, items, spec, &eos, |prompts, seeds, temperature| {
        let requests = prompts
            .iter()
            .zip(seeds)
            .map(|(prompt, seed)| SequenceRequest {
                prompt: prompt.clone(),
                params: SamplingParams {
                    temperature,
                    top_p: 1.0,
                    top_k: 0,
                    max_new_tokens: spec.max_new_tokens,
                    stop_token_ids: eos.clone(),
                    seed: Some(*seed),
                },
            })
            .collect();
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(1);
        let outs = asyncrl_policy::generate(
            policy,
            requests,
            DecodeBatchOptions {
                max_slots: 64,
                max_seq_len: longest + spec.max_new_tokens + 1,
            },
        )?;
        Ok(outs.into_iter().map(|o| o.tokens).collect())
    })
}

/// Generates completions: `(prompts, seeds, temperature)` → one token list
/// per prompt, in order (temperature 0: greedy).
pub trait Generate: FnMut(&[Vec<i64>], &[u64], f64) -> Result<Vec<Vec<i64>>, TrainError> {}
impl<F: FnMut(&[Vec<i64>], &[u64], f64) -> Result<Vec<Vec<i64>>, TrainError>> Generate for F {}

/// Scores the completions `generate` gives on `items`: the prompts are
/// rendered and tokenized by `text`, completions decoded up to `eos` and
/// the first stop string, and scored by the items' built-in verifiers.
pub fn evaluate_with(
    text: &ModelText,
    items: &[TaskItem],
    spec: &EvalSpec,
    eos: &[i64],
    mut generate: impl Generate,
) -> Result<EvalScores, TrainError> {
    let start = Instant::now();
    if let Some(episodes) = &spec.episodes {
        return score_runs(items, spec, start, |temperature, per_item| {
            let outputs = episodes.run(text, items, per_item, eos, |requests| {
                let prompts: Vec<Vec<i64>> = requests.iter().map(|r| r.prompt.clone()).collect();
                // Seed of reply t of sample j of problem i: the single-turn
                // seed, plus t·2³².
                let seeds: Vec<u64> = requests
                    .iter()
                    .map(|r| {
                        spec.seed
                            .wrapping_add(r.episode as u64)
                            .wrapping_add((r.turn as u64) << 32)
                    })
                    .collect();
                let outs = generate(&prompts, &seeds, temperature)?;
                Ok(outs
                    .into_iter()
                    .zip(requests)
                    .map(|(tokens, r)| untracked_reply(tokens, r, eos))
                    .collect())
            })?;
            Ok(outputs.iter().map(|o| f64::from(o.reward)).collect())
        });
    }
    let prompts: Vec<Vec<i64>> = items
        .iter()
        .map(|it| text.encode(&it.prompt))
        .collect::<Result<_, _>>()
        .map_err(asyncrl_policy::PolicyError::from)?;
    // Rewards of `per_item` completions of every item, item-major.
    let run = |temperature: f64, per_item: usize| -> Result<Vec<f64>, TrainError> {
        let mut requests = Vec::with_capacity(items.len() * per_item);
        let mut seeds = Vec::with_capacity(items.len() * per_item);
        for (i, prompt) in prompts.iter().enumerate() {
            for j in 0..per_item {
                requests.push(prompt.clone());
                seeds.push(spec.seed.wrapping_add((i * per_item + j) as u64));
            }
        }
        let outs = generate(&requests, &seeds, temperature)?;
        outs.iter()
            .enumerate()
            .map(|(n, tokens)| {
                let item = &items[n / per_item];
                let completion = asyncrl_policy::text::text_before_stop_string(
                    text.decode_completion(tokens, eos)
                        .map_err(asyncrl_policy::PolicyError::from)?,
                    &spec.stop_strings,
                );
                Ok(
                    match asyncrl_tasks::score(&item.verifier, &completion, &item.answer) {
                        Verdict::Reward(r) => f64::from(r),
                        _ => 0.0,
                    },
                )
            })
            .collect()
    };
    score_runs(items, spec, start, run)
}

/// The scores of `run(temperature, per_item)`'s rewards (item-major):
/// greedy at temperature 0, sampled and pass@k at the spec's.
fn score_runs(
    items: &[TaskItem],
    spec: &EvalSpec,
    start: Instant,
    mut run: impl FnMut(f64, usize) -> Result<Vec<f64>, TrainError>,
) -> Result<EvalScores, TrainError> {
    let mean = |v: &[f64]| {
        if v.is_empty() {
            0.0
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        }
    };
    let mut scores = EvalScores {
        problems: items.len(),
        k: spec.samples,
        ..Default::default()
    };
    if spec.greedy {
        scores.greedy = Some(mean(&run(0.0, 1)?));
    }
    if spec.samples > 0 {
        let rewards = run(spec.temperature, spec.samples)?;
        scores.sampled = Some(mean(&rewards));
        let solved = rewards
            .chunks(spec.samples)
            .filter(|c| c.iter().any(|r| *r >= 1.0))
            .count();
        scores.pass_at_k = Some(if items.is_empty() {
            0.0
        } else {
            solved as f64 / items.len() as f64
        });
    }
    scores.seconds = start.elapsed().as_secs_f64();
    Ok(scores)
}

type F64Gauge = Gauge<f64, AtomicU64>;

/// `asyncrl_eval_*`.
#[derive(Clone)]
pub struct EvalMetrics {
    pub version: Gauge,
    pub greedy_accuracy: F64Gauge,
    pub sampled_accuracy: F64Gauge,
    pub pass_at_k: F64Gauge,
    pub problems: Gauge,
    pub evaluations: Counter,
    pub skipped: Counter,
    pub failures: Counter,
    pub seconds: Histogram,
}

impl EvalMetrics {
    pub fn register(m: &Metrics) -> Result<Self, TelemetryError> {
        Ok(Self {
            version: m.register(
                "eval_policy_version",
                "Policy version of the last held-out evaluation",
                Gauge::default(),
            )?,
            greedy_accuracy: m.register(
                "eval_greedy_accuracy",
                "Held-out greedy accuracy of the last evaluated version",
                F64Gauge::default(),
            )?,
            sampled_accuracy: m.register(
                "eval_sampled_accuracy",
                "Held-out mean accuracy of the sampled completions of the last evaluated version",
                F64Gauge::default(),
            )?,
            pass_at_k: m.register(
                "eval_pass_at_k",
                "Held-out pass@k (k = eval.samples) of the last evaluated version",
                F64Gauge::default(),
            )?,
            problems: m.register(
                "eval_problems",
                "Problems of one held-out evaluation",
                Gauge::default(),
            )?,
            evaluations: m.register(
                "eval_evaluations",
                "Held-out evaluations completed",
                Counter::default(),
            )?,
            skipped: m.register(
                "eval_skipped",
                "Versions handed to the evaluator but skipped because more than 4 were waiting",
                Counter::default(),
            )?,
            failures: m.register(
                "eval_failures",
                "Held-out evaluations that failed (logged; training goes on)",
                Counter::default(),
            )?,
            seconds: m.register_with_unit(
                "eval_duration",
                "Time of one held-out evaluation",
                prometheus_client::registry::Unit::Seconds,
                Histogram::new([0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0]),
            )?,
        })
    }

    fn observe(&self, row: &EvalRow) {
        let s = &row.scores;
        self.version.set(i64::from(row.version));
        if let Some(g) = s.greedy {
            self.greedy_accuracy.set(g);
        }
        if let Some(x) = s.sampled {
            self.sampled_accuracy.set(x);
        }
        if let Some(p) = s.pass_at_k {
            self.pass_at_k.set(p);
        }
        self.problems.set(s.problems as i64);
        self.evaluations.inc();
        self.seconds.observe(s.seconds);
    }
}

/// The versions already in an `eval.csv` (a resumed learner appends).
fn evaluated_versions(path: &Path) -> anyhow::Result<BTreeSet<i32>> {
    if !path.exists() {
        return Ok(BTreeSet::new());
    }
    Ok(crate::outputs::read_eval(path)?
        .into_iter()
        .map(|r| r.version)
        .collect())
}

/// Versions waiting for the evaluator at most; older ones are skipped.
pub const MAX_WAITING: usize = 4;

/// A version for the evaluator: its weights as the learner published them.
struct EvalJob {
    version: i32,
    step: u64,
    wall_seconds: f64,
    weights: Bytes,
}

/// The learner's evaluation thread (see the module docs).
pub struct Evaluator {
    every: u64,
    tx: Option<mpsc::Sender<EvalJob>>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Versions evaluated (in `eval.csv`) or handed over already.
    done: BTreeSet<i32>,
    csv: PathBuf,
}

impl Evaluator {
    /// Loads the held-out problems and a copy of the model on a new thread,
    /// which hands every row it writes to `on_row` as well. `None` when
    /// `[eval]` is off. Errors (a missing data set, rows without answers,
    /// too many problems, a model that does not load, an `eval.csv` of
    /// other columns) stop the learner before it trains.
    pub async fn start(
        config: &Config,
        metrics: &Metrics,
        on_row: impl FnMut(EvalRow) + Send + 'static,
    ) -> anyhow::Result<Option<Self>> {
        if !config.eval.enabled() {
            return Ok(None);
        }
        let registry = metrics.clone();
        let metrics = EvalMetrics::register(metrics)?;
        let csv = config.run.output_dir.join(EVAL_CSV);
        let done = evaluated_versions(&csv)?;
        let every = config.eval.every_steps;
        let (tx, rx) = mpsc::channel::<EvalJob>();
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel::<anyhow::Result<()>>();
        let config = config.clone();
        let path = csv.clone();
        let thread = std::thread::Builder::new()
            .name("asyncrl-eval".into())
            .spawn(move || {
                // Before the model loads: libtorch's threads inherit it.
                if let Err(e) =
                    asyncrl_policy::affinity::lower_current_thread_priority(config.eval.nice)
                {
                    tracing::warn!(
                        nice = config.eval.nice,
                        error = %e,
                        "cannot lower the evaluator's CPU priority; it evaluates at the learner's"
                    );
                }
                let setup = || -> anyhow::Result<_> {
                    let (backend, text) = Backend::start(&config)?;
                    let items = asyncrl_tasks::load_eval_problems(&config.eval, Some(&text))?;
                    let spec = EvalSpec::from_config(&config, &registry)?;
                    let file = CsvLog::<EvalRow>::open(path)?;
                    tracing::info!(
                        engine = backend.name(),
                        problems = items.len(),
                        "held-out evaluation ready"
                    );
                    Ok((backend, text, items, file, spec))
                };
                match setup() {
                    Ok((backend, text, items, file, spec)) => {
                        let _ = ready_tx.send(Ok(()));
                        eval_loop(backend, &text, &items, &spec, rx, file, &metrics, on_row);
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                }
            })
            .context("cannot start the evaluator thread")?;
        ready_rx
            .await
            .context("the evaluator thread stopped while starting")??;
        Ok(Some(Self {
            every,
            tx: Some(tx),
            thread: Some(thread),
            done,
            csv,
        }))
    }

    /// Whether the version a step produced is evaluated: every
    /// `every_steps`-th, the first of a run and the last (`last`).
    pub fn wants(&self, version: i32, step: u64, last: bool) -> bool {
        !self.done.contains(&version) && (last || step.is_multiple_of(self.every))
    }

    /// Hands a version's published weights to the evaluator (never blocks).
    pub fn submit(&mut self, version: i32, step: u64, wall_seconds: f64, weights: Bytes) {
        if !self.done.insert(version) {
            return;
        }
        if let Some(tx) = &self.tx
            && tx
                .send(EvalJob {
                    version,
                    step,
                    wall_seconds,
                    weights,
                })
                .is_err()
        {
            tracing::warn!(
                version,
                "the evaluator thread has stopped; version not evaluated"
            );
        }
    }

    /// Evaluates what was handed over and stops the thread.
    pub async fn finish(mut self) -> anyhow::Result<PathBuf> {
        self.tx = None;
        if let Some(thread) = self.thread.take() {
            tokio::task::spawn_blocking(move || thread.join())
                .await
                .context("joining the evaluator thread")?
                .map_err(|_| anyhow::anyhow!("the evaluator thread panicked"))?;
        }
        Ok(self.csv.clone())
    }
}

/// What `eval.engine` resolves to: `auto` evaluates with the engine that
/// trains (`learner.trainer`), and through the torch engine whenever the
/// built-in model does not run the architecture (a `model.path` whose
/// `config.json` it cannot read).
pub fn resolve_engine(config: &Config) -> EvalEngineName {
    match (config.eval.engine, &config.model.path) {
        (EvalEngineName::Auto, _) if config.learner.trainer == TrainerEngineName::Torch => {
            EvalEngineName::Torch
        }
        (EvalEngineName::Auto, None) => EvalEngineName::Builtin,
        (EvalEngineName::Auto, Some(dir)) => {
            if asyncrl_policy::ModelConfig::from_file(&dir.join("config.json")).is_ok() {
                EvalEngineName::Builtin
            } else {
                EvalEngineName::Torch
            }
        }
        (engine, _) => engine,
    }
}

/// What generates the evaluator's completions.
enum Backend {
    /// The built-in model, on the evaluator's thread.
    Builtin(Box<Policy>),
    /// A one-rank torch engine process of the evaluator's own, so that
    /// evaluation stays off the training group's critical path.
    Torch {
        engine: Box<TorchEngine>,
        eos: Vec<i64>,
    },
}

impl Backend {
    fn start(config: &Config) -> anyhow::Result<(Self, ModelText)> {
        if resolve_engine(config) == EvalEngineName::Torch {
            let dir = config.model.path.as_deref().context(
                "model.path: evaluation through the torch engine needs a Hugging Face model folder",
            )?;
            let text = ModelText::from_dir(dir).with_context(|| {
                format!("model.path {}: the evaluator's tokenizer", dir.display())
            })?;
            let work = config.run.output_dir.join(".torch-eval");
            let engine = TorchEngine::start_evaluator(config, work)
                .context("the evaluator cannot start its torch engine (eval.engine)")?;
            let eos = text.eos_token_ids().to_vec();
            return Ok((
                Backend::Torch {
                    engine: Box::new(engine),
                    eos,
                },
                text,
            ));
        }
        let policy = asyncrl_policy::from_config::load_policy(&config.model, config.run.seed)
            .context("the evaluator cannot load the model")?;
        let text = policy.text().context("the evaluator's model text")?;
        Ok((Backend::Builtin(Box::new(policy)), text))
    }

    fn name(&self) -> &'static str {
        match self {
            Backend::Builtin(_) => "builtin",
            Backend::Torch { .. } => "torch",
        }
    }

    /// Loads a version's published weights and scores them.
    fn score(
        &mut self,
        weights: &Bytes,
        version: i32,
        text: &ModelText,
        items: &[TaskItem],
        spec: &EvalSpec,
    ) -> Result<EvalScores, TrainError> {
        match self {
            Backend::Builtin(policy) => {
                policy.load_weights_from_bytes(weights, version)?;
                evaluate(policy, text, items, spec)
            }
            Backend::Torch { engine, eos } => {
                engine.adopt_published(weights, version)?;
                evaluate_with(text, items, spec, eos, |prompts, seeds, temperature| {
                    engine.generate(prompts, seeds, spec.max_new_tokens, temperature, eos)
                })
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn eval_loop(
    mut backend: Backend,
    text: &ModelText,
    items: &[TaskItem],
    spec: &EvalSpec,
    rx: mpsc::Receiver<EvalJob>,
    mut csv: CsvLog<EvalRow>,
    metrics: &EvalMetrics,
    mut on_row: impl FnMut(EvalRow),
) {
    let mut queue: VecDeque<EvalJob> = VecDeque::new();
    loop {
        if queue.is_empty() {
            match rx.recv() {
                Ok(job) => queue.push_back(job),
                Err(_) => return,
            }
        }
        queue.extend(rx.try_iter());
        // Far behind the learner: the oldest waiting versions are skipped
        // (each holds a copy of the weights). The last version of a run is
        // the newest, so it is never skipped.
        while queue.len() > MAX_WAITING {
            if let Some(old) = queue.pop_front() {
                tracing::info!(
                    version = old.version,
                    "evaluation skipped: the evaluator is behind"
                );
                metrics.skipped.inc();
            }
        }
        let Some(job) = queue.pop_front() else {
            continue;
        };
        let scored = backend.score(&job.weights, job.version, text, items, spec);
        let scores = match scored {
            Ok(s) => s,
            Err(e) => {
                metrics.failures.inc();
                tracing::warn!(version = job.version, error = %format!("{:#}", anyhow::Error::new(e)), "evaluation failed");
                continue;
            }
        };
        let row = EvalRow {
            version: job.version,
            step: job.step,
            wall_seconds: job.wall_seconds,
            scores,
        };
        tracing::info!(version = row.version, step = row.step, scores = %row.scores, "evaluated");
        metrics.observe(&row);
        if let Err(e) = csv.append(&row) {
            metrics.failures.inc();
            tracing::warn!(error = %format!("{e:#}"), "cannot write the evaluation row");
        }
        on_row(row);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use asyncrl_environment::builtin::HiddenSum;

    fn items() -> Vec<TaskItem> {
        asyncrl_tasks::hidden_sum_all(4)
    }

    fn spec(samples: usize) -> EvalSpec {
        EvalSpec {
            greedy: true,
            samples,
            temperature: 1.0,
            max_new_tokens: 4,
            seed: 7,
            stop_strings: Vec::new(),
            episodes: Some(
                EpisodeEval::new(
                    Arc::new(HiddenSum::new()),
                    EpisodeLimits {
                        max_turns: 3,
                        max_turn_tokens: 4,
                        max_episode_tokens: 40,
                    },
                )
                .unwrap(),
            ),
        }
    }

    /// A policy that asks for `x` when the context has no `x=` yet, then
    /// answers `A + x` (or `A + x + 1` when `wrong`).
    fn player<'a>(text: &'a ModelText, wrong: impl Fn(i64) -> bool + 'a) -> impl Generate + 'a {
        let eos = text.eos_token_ids()[0];
        move |prompts: &[Vec<i64>], _seeds: &[u64], _temperature: f64| {
            Ok(prompts
                .iter()
                .map(|p| {
                    let so_far = text.tokenizer().decode(p, true).unwrap();
                    // `A+x=`, then `x?x=<x>;` once it has asked.
                    let reply = match so_far.rsplit_once("x=") {
                        Some((_, x)) if !x.is_empty() => {
                            let a: i64 = so_far.split_once('+').unwrap().0.parse().unwrap();
                            let x: i64 = x.trim_end_matches(';').parse().unwrap();
                            let sum = a + x + i64::from(wrong(a));
                            sum.to_string()
                        }
                        _ => "x?".to_owned(),
                    };
                    let mut tokens = text.tokenizer().encode(&reply, false).unwrap();
                    tokens.push(eos);
                    tokens
                })
                .collect())
        }
    }

    #[test]
    fn a_multi_turn_evaluation_scores_episodes_by_the_environments_rewards() {
        let text = ModelText::builtin();
        let eos = text.eos_token_ids().to_vec();
        let items = items();
        // Asks, then answers right: every episode earns 1, greedy and sampled.
        let scores =
            evaluate_with(&text, &items, &spec(2), &eos, player(&text, |_| false)).unwrap();
        assert_eq!(scores.greedy, Some(1.0));
        assert_eq!(scores.sampled, Some(1.0));
        assert_eq!(scores.pass_at_k, Some(1.0));
        // Wrong whenever the visible operand is 0: a quarter of 16 problems.
        let scores =
            evaluate_with(&text, &items, &spec(0), &eos, player(&text, |a| a == 0)).unwrap();
        assert_eq!(scores.greedy, Some(0.75));
        // Answers at once, without asking: right only by luck (`0`, when
        // the sum is 0: 1 of 16).
        let blind =
            |prompts: &[Vec<i64>], _: &[u64], _: f64| -> Result<Vec<Vec<i64>>, TrainError> {
                let mut tokens = text.tokenizer().encode("0", false).unwrap();
                tokens.push(eos[0]);
                Ok(vec![tokens; prompts.len()])
            };
        let scores = evaluate_with(&text, &items, &spec(0), &eos, blind).unwrap();
        assert_eq!(scores.greedy, Some(1.0 / 16.0));
    }

    #[test]
    fn an_episode_the_environment_cannot_play_fails_the_evaluation_naming_its_task() {
        let text = ModelText::builtin();
        let eos = text.eos_token_ids().to_vec();
        let mut items = items();
        items[3].prompt = asyncrl_tasks::Prompt::Text("what?".to_owned());
        let err = evaluate_with(&text, &items, &spec(0), &eos, player(&text, |_| false))
            .unwrap_err()
            .to_string();
        assert!(err.contains(&items[3].id) && err.contains("reset"), "{err}");
    }
}
