//! The supervised warm start of the built-in model: cross-entropy on
//! `prompt → answer <eos>` (loss on the answer and the stop token only), so
//! that RL starts from a policy that earns some reward. Prompts are encoded
//! exactly as the rollout worker encodes them
//! (`asyncrl_text::ModelText::encode`).

use asyncrl_policy::ModelText;
use asyncrl_policy::Policy;
use asyncrl_tasks::{SplitMix64, TaskItem};
use tch::{Kind, Tensor};

use crate::adamw::{AdamW, AdamWConfig};
use crate::trainer::TrainError;

#[derive(Debug, Clone)]
pub struct SftOptions {
    pub steps: usize,
    pub batch_size: usize,
    pub learning_rate: f64,
    pub seed: u64,
    /// Evaluate on this many held-out items (greedy and sampled at `temperature`).
    pub temperature: f64,
    pub grad_clip: f64,
}

impl Default for SftOptions {
    fn default() -> Self {
        Self {
            steps: 300,
            batch_size: 32,
            learning_rate: 3e-3,
            seed: 0,
            temperature: 1.0,
            grad_clip: 1.0,
        }
    }
}

/// Mean reward of a model on tasks: greedy and sampled.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Accuracy {
    pub greedy: f64,
    pub sampled: f64,
}

#[derive(Debug, Clone, Default)]
pub struct SftReport {
    pub before: Accuracy,
    pub after: Accuracy,
    /// Loss every 10 steps.
    pub losses: Vec<f64>,
    pub seconds: f64,
}

/// Token ids of a task's prompt, as the rollout worker makes them.
fn encode_task_prompt(
    text: &ModelText,
    prompt: &asyncrl_tasks::Prompt,
) -> Result<Vec<i64>, TrainError> {
    Ok(text
        .encode(prompt)
        .map_err(asyncrl_policy::PolicyError::from)?)
}

/// One supervised example: token ids and, per token, whether it is a
/// target (the model wrote it).
#[derive(Debug, Clone, PartialEq)]
struct Example {
    ids: Vec<i64>,
    target: Vec<bool>,
}

fn encode_example(text: &ModelText, item: &TaskItem, eos: i64) -> Result<Example, TrainError> {
    let mut ids = encode_task_prompt(text, &item.prompt)?;
    let prompt_len = ids.len();
    ids.extend(
        text.tokenizer()
            .encode(&item.answer, false)
            .map_err(asyncrl_policy::PolicyError::from)?,
    );
    ids.push(eos);
    let target = (0..ids.len()).map(|i| i >= prompt_len).collect();
    Ok(Example { ids, target })
}

/// The examples of demonstrated episodes: every token of each, the
/// model's replies as targets (the environment's tokens are context only,
/// as in RL).
fn demonstrated_examples(
    episodes: &crate::eval::EpisodeEval,
    text: &ModelText,
    items: &[TaskItem],
    eos: &[i64],
) -> Result<Vec<Example>, TrainError> {
    let demos: Vec<Vec<String>> = items
        .iter()
        .map(|it| {
            asyncrl_environment::builtin::HiddenSum::demonstration(&asyncrl_environment::EnvTask {
                task_id: it.id.clone(),
                dataset: it.dataset.clone(),
                prompt: serde_json::Value::Null,
                answer: it.answer.clone(),
                metadata: serde_json::Value::Null,
            })
        })
        .collect();
    let stop = eos.first().copied().unwrap_or(0);
    let outputs = episodes.run(text, items, 1, eos, |requests| {
        requests
            .iter()
            .map(|r| {
                let reply = demos[r.episode]
                    .get(r.turn)
                    .or(demos[r.episode].last())
                    .map(String::as_str)
                    .unwrap_or_default();
                let mut tokens = text
                    .tokenizer()
                    .encode(reply, false)
                    .map_err(asyncrl_policy::PolicyError::from)?;
                tokens.push(stop);
                Ok(crate::eval::untracked_reply(tokens, r, eos))
            })
            .collect()
    })?;
    Ok(outputs
        .into_iter()
        .map(|out| {
            let mask = asyncrl_protos::model_token_mask(&out.turns, out.completion.len());
            let mut target = vec![false; out.prompt.len()];
            target.extend(mask);
            let mut ids = out.prompt;
            ids.extend(out.completion);
            Example { ids, target }
        })
        .collect())
}

/// One cross-entropy step on `examples` (on their target tokens); returns
/// the loss.
fn sft_step(
    policy: &Policy,
    opt: &mut AdamW,
    examples: &[&Example],
    opts: &SftOptions,
) -> Result<f64, TrainError> {
    let pad = policy.config().pad_token_id.unwrap_or(0);
    let l = examples
        .iter()
        .map(|e| e.ids.len())
        .max()
        .unwrap_or(2)
        .max(2);
    let n = examples.len();
    let mut ids = vec![pad; n * l];
    let mut target_mask = vec![0f32; n * (l - 1)];
    for (i, ex) in examples.iter().enumerate() {
        ids[i * l..i * l + ex.ids.len()].copy_from_slice(&ex.ids);
        // Position j predicts token j+1.
        for j in 0..ex.ids.len().saturating_sub(1) {
            if ex.target[j + 1] {
                target_mask[i * (l - 1) + j] = 1.0;
            }
        }
    }
    let device = policy.device();
    let input = Tensor::from_slice(&ids)
        .view([n as i64, l as i64])
        .to_device(device);
    let mask = Tensor::from_slice(&target_mask)
        .view([n as i64, l as i64 - 1])
        .to_device(device);
    let params = policy.named_parameters();
    AdamW::zero_grad(&params);
    let logits = policy.forward(&input, None)?;
    let logp = logits
        .narrow(1, 0, l as i64 - 1)
        .log_softmax(-1, Kind::Float);
    let next = input.narrow(1, 1, l as i64 - 1).unsqueeze(-1);
    let nll = -logp.gather(-1, &next, false).squeeze_dim(-1);
    let loss = (nll * &mask).sum(Kind::Float) / mask.sum(Kind::Float).clamp_min(1.0);
    loss.backward();
    AdamW::clip_grad_norm(&params, opts.grad_clip);
    opt.step(&params, opts.learning_rate);
    Ok(loss.double_value(&[]))
}

/// Greedy and sampled (one completion or episode per problem) mean reward
/// on `items`.
pub fn evaluate(
    policy: &Policy,
    items: &[TaskItem],
    temperature: f64,
    max_new_tokens: usize,
    seed: u64,
    episodes: Option<&crate::eval::EpisodeEval>,
) -> Result<Accuracy, TrainError> {
    let spec = crate::eval::EvalSpec {
        greedy: true,
        samples: 1,
        temperature,
        max_new_tokens,
        seed,
        stop_strings: Vec::new(),
        episodes: episodes.cloned(),
    };
    let scores = crate::eval::evaluate(policy, &policy.text()?, items, &spec)?;
    Ok(Accuracy {
        greedy: scores.greedy.unwrap_or_default(),
        sampled: scores.sampled.unwrap_or_default(),
    })
}

/// Warm-starts `policy` on `train`, evaluating on `eval` before and after.
/// With `episodes`, each item is a demonstrated episode of the built-in
/// hidden_sum game ([`asyncrl_environment::builtin::HiddenSum::demonstration`])
/// in that environment, learnt on the replies only, and evaluated as
/// episodes.
pub fn warm_start(
    policy: &mut Policy,
    train: &[TaskItem],
    eval: &[TaskItem],
    max_new_tokens: usize,
    opts: &SftOptions,
    episodes: Option<&crate::eval::EpisodeEval>,
) -> Result<SftReport, TrainError> {
    let start = std::time::Instant::now();
    let score = |policy: &Policy| {
        evaluate(
            policy,
            eval,
            opts.temperature,
            max_new_tokens,
            opts.seed,
            episodes,
        )
    };
    let mut report = SftReport {
        before: score(policy)?,
        ..Default::default()
    };
    let mut rng = SplitMix64::new(opts.seed ^ 0x5F7);
    let mut opt = AdamW::new(AdamWConfig::default());
    let text = policy.text()?;
    let eos = policy.eos_token_ids();
    let examples: Vec<Example> = match episodes {
        Some(episodes) => demonstrated_examples(episodes, &text, train, &eos)?,
        None => {
            let stop = eos.first().copied().unwrap_or(0);
            train
                .iter()
                .map(|it| encode_example(&text, it, stop))
                .collect::<Result<_, _>>()?
        }
    };
    for step in 0..opts.steps {
        let batch: Vec<&Example> = (0..opts.batch_size.max(1))
            .map(|_| &examples[rng.below(examples.len() as u64) as usize])
            .collect();
        let loss = sft_step(policy, &mut opt, &batch, opts)?;
        if !loss.is_finite() {
            return Err(TrainError::NonFiniteLoss(loss));
        }
        if step % 10 == 0 || step + 1 == opts.steps {
            report.losses.push(loss);
            tracing::info!(step, loss, "warm start");
        }
    }
    policy.mark_weights_changed();
    report.after = score(policy)?;
    report.seconds = start.elapsed().as_secs_f64();
    Ok(report)
}

#[derive(Debug, thiserror::Error)]
pub enum WarmStartError {
    #[error("the config names no data set (`coordinator.datasets`)")]
    NoDataset,
    #[error(transparent)]
    Tasks(#[from] asyncrl_tasks::TaskError),
    #[error(transparent)]
    Train(#[from] TrainError),
    #[error(transparent)]
    Policy(#[from] asyncrl_policy::PolicyError),
    #[error("the warm start's episodes: {0:#}")]
    Episodes(anyhow::Error),
    #[error("cannot encode the warm start's record")]
    Record(#[source] serde_json::Error),
    #[error("cannot write {path}: {source}")]
    Write {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

/// `warmstart.json`, beside a warm start's weights: what it was made with
/// (`scripts/run` redoes a warm start made with other settings) and its
/// held-out accuracy before and after.
#[derive(Debug, serde::Serialize)]
struct WarmStartRecord<'a> {
    dataset: &'a str,
    steps: usize,
    batch_size: usize,
    learning_rate: f64,
    eval_items: usize,
    before: Accuracy,
    after: Accuracy,
    temperature: f64,
    seconds: f64,
    /// Portable kernels make the same weights on every x86-64 CPU; native
    /// ones, weights that follow the CPU.
    kernels: asyncrl_policy::kernels::Kernels,
}

/// `asyncrl warmstart`: builds the model of `[model]` (the built-in one when
/// no path is set), warm-starts it on the first data set of
/// `[coordinator].datasets` (holding out `eval_items` for the report), and
/// saves it as a Hugging Face folder in `out` with `warmstart.json` (the
/// report) beside the weights.
pub fn run_warm_start(
    config: &asyncrl_config::Config,
    opts: &SftOptions,
    eval_items: usize,
    out: &std::path::Path,
) -> Result<SftReport, WarmStartError> {
    let dataset = config
        .coordinator
        .datasets
        .first()
        .ok_or(WarmStartError::NoDataset)?;
    let items = asyncrl_tasks::load_dataset(dataset, None)?.items;
    let hold = eval_items.min(items.len() / 2);
    let (train, eval) = items.split_at(items.len() - hold);
    // The warm start begins from the built-in model of `[model.tiny]`
    // (`model.path` names where its result will be read from).
    let mut section = config.model.clone();
    section.path = None;
    let mut policy = asyncrl_policy::from_config::load_policy(&section, config.run.seed)?;
    // Multi-turn (`[environment]`): demonstrated episodes of the built-in
    // hidden_sum game, in-process whatever `environment.url` names (the
    // example server plays the same game).
    let episodes = match &config.environment {
        None => None,
        Some(env) => Some(
            crate::eval::EpisodeEval::new(
                std::sync::Arc::new(asyncrl_environment::builtin::HiddenSum::new()),
                asyncrl_environment::EpisodeLimits {
                    max_turns: env.max_turns,
                    max_turn_tokens: env.turn_tokens(config.model.max_new_tokens),
                    max_episode_tokens: env.episode_tokens(config.model.max_seq_len),
                },
            )
            .map_err(WarmStartError::Episodes)?,
        ),
    };
    let max_new_tokens = episodes
        .as_ref()
        .map_or(config.model.max_new_tokens, |e| e.limits.max_turn_tokens);
    let report = warm_start(
        &mut policy,
        train,
        eval,
        max_new_tokens,
        opts,
        episodes.as_ref(),
    )?;
    policy.set_version(0);
    policy.save_pretrained(out, None)?;
    let record = WarmStartRecord {
        dataset: &dataset.name,
        steps: opts.steps,
        batch_size: opts.batch_size,
        learning_rate: opts.learning_rate,
        eval_items: eval.len(),
        before: report.before,
        after: report.after,
        temperature: opts.temperature,
        seconds: (report.seconds * 10.0).round() / 10.0,
        kernels: asyncrl_policy::kernels::current(),
    };
    let path = out.join("warmstart.json");
    let mut json = serde_json::to_vec(&record).map_err(WarmStartError::Record)?;
    json.push(b'\n');
    std::fs::write(&path, json).map_err(|source| WarmStartError::Write { path, source })?;
    Ok(report)
}
