//! `asyncrl eval MODEL --data FILE`: held-out accuracy of a Hugging Face
//! model folder, a learner checkpoint (`checkpoints/step-NNNNNNNN`) or a
//! run's checkpoint folder (its newest checkpoint), with the same
//! evaluation the learner's `[eval]` runs.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use asyncrl_config::{BUILTIN_VERIFIERS, Config, DatasetConfig};
use asyncrl_learner::checkpoint;
use asyncrl_learner::eval::{EvalSpec, evaluate};
use asyncrl_policy::Policy;

/// What `asyncrl eval` was asked (the command line, without its parser).
#[derive(Debug, Clone, Default)]
pub struct EvalArgs {
    /// A Hugging Face model folder (config.json), a learner checkpoint
    /// (meta.json + model.safetensors) or a folder of checkpoints (the
    /// newest is evaluated).
    pub model: PathBuf,
    /// The problems: JSONL or Parquet with a prompt and a reference answer.
    pub data: PathBuf,
    /// A run's config: `[eval]` and `[model]` give the defaults (field
    /// names, verifier, samples, temperature, stop strings) and
    /// `model.path` the model a checkpoint was trained from.
    pub config: Option<PathBuf>,
    /// The model a checkpoint was trained from (its config.json and
    /// tokenizer); default: the config's `model.path`.
    pub base_model: Option<PathBuf>,
    /// The built-in verifier (arith, reverse, math); default: the config's
    /// `eval.dataset.verifier`, else the one the file name starts with
    /// (`arith-all.jsonl` → arith).
    pub verifier: Option<String>,
    pub prompt_field: Option<String>,
    pub answer_field: Option<String>,
    /// Render text prompts with the model's chat template.
    pub chat: bool,
    /// Evaluate the first N problems (0: all).
    pub problems: Option<usize>,
    /// Refuse data sets with more problems than this.
    pub max_problems: Option<usize>,
    /// Completions sampled per problem for sampled accuracy and pass@k.
    pub samples: Option<usize>,
    /// Skip the greedy completion (needs --samples).
    pub no_greedy: bool,
    pub temperature: Option<f64>,
    pub max_new_tokens: Option<usize>,
    pub seed: Option<u64>,
    /// Print the scores as one JSON object.
    pub json: bool,
}

/// What `asyncrl eval` prints.
pub fn eval_command(args: EvalArgs) -> anyhow::Result<()> {
    let mut config = match &args.config {
        Some(p) => crate::roles::load(p, None)?,
        None => Config::default(),
    };
    let (policy, what) = load_model(
        &args.model,
        args.base_model.as_deref(),
        &config,
        args.config.is_some(),
    )?;
    apply_args(&mut config, &args)?;
    let text = policy.text().context("the model's tokenizer")?;
    let items = asyncrl_tasks::load_eval_problems(&config.eval, Some(&text))?;
    let spec = EvalSpec::from_config(&config, &asyncrl_telemetry::Metrics::new())?;
    let scores = evaluate(&policy, &text, &items, &spec)?;
    if args.json {
        let json = serde_json::json!({
            "model": what,
            "version": policy.version(),
            "data": args.data,
            "problems": scores.problems,
            "greedy_accuracy": scores.greedy,
            "sampled_accuracy": scores.sampled,
            "pass_at_k": scores.pass_at_k,
            "k": scores.k,
            "seconds": scores.seconds,
        });
        println!("{json}");
    } else {
        println!("{what} (version {}): {scores}", policy.version());
    }
    Ok(())
}

/// The data set and evaluation settings: the config's `[eval]` with the
/// command line on top.
fn apply_args(config: &mut Config, args: &EvalArgs) -> anyhow::Result<()> {
    let e = &mut config.eval;
    let mut d = match e.dataset.take() {
        Some(mut d) => {
            d.path = args.data.clone();
            d
        }
        None => {
            let stem = args
                .data
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or_default();
            let name: String = stem
                .chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                        c
                    } else {
                        '_'
                    }
                })
                .take(64)
                .collect();
            let mut d = DatasetConfig::jsonl(
                if name.is_empty() { "eval".into() } else { name },
                &args.data,
            );
            d.verifier = BUILTIN_VERIFIERS
                .iter()
                .find(|v| stem.starts_with(*v))
                .map(|v| (*v).to_owned());
            d
        }
    };
    if let Some(v) = &args.verifier {
        d.verifier = Some(v.clone());
    }
    if d.verifier_name() == "service" {
        anyhow::bail!(
            "no built-in verifier for {}: pass --verifier ({})",
            args.data.display(),
            BUILTIN_VERIFIERS.join(", ")
        );
    }
    if let Some(f) = &args.prompt_field {
        d.prompt_field = f.clone();
    }
    if let Some(f) = &args.answer_field {
        d.answer_field = f.clone();
    }
    d.apply_chat_template |= args.chat;
    e.dataset = Some(d);
    if let Some(n) = args.problems {
        e.problems = n;
    }
    if let Some(n) = args.max_problems {
        e.max_problems = n;
    }
    if let Some(k) = args.samples {
        e.samples = k;
    }
    if args.no_greedy {
        e.greedy = false;
    }
    if args.temperature.is_some() {
        e.temperature = args.temperature;
    }
    if args.max_new_tokens.is_some() {
        e.max_new_tokens = args.max_new_tokens;
    }
    if let Some(s) = args.seed {
        e.seed = s;
    }
    config.eval.validate()?;
    Ok(())
}

/// The policy at `path` and a description of what was loaded.
fn load_model(
    path: &Path,
    base: Option<&Path>,
    config: &Config,
    has_config: bool,
) -> anyhow::Result<(Policy, String)> {
    let opts = asyncrl_policy::from_config::device_options(config.model.device)?;
    if !path.is_dir() {
        anyhow::bail!("model {} is not a folder", path.display());
    }
    if path.join("config.json").is_file() {
        let policy = Policy::from_pretrained(path, opts)
            .with_context(|| format!("cannot load the model folder {}", path.display()))?;
        return Ok((policy, path.display().to_string()));
    }
    let ckpt = if path.join("meta.json").is_file() {
        checkpoint::read_weights(path)?
    } else {
        checkpoint::latest_weights(path)?.with_context(|| {
            format!(
                "{} is neither a model folder (config.json) nor a learner checkpoint (meta.json), nor holds checkpoints (step-NNNNNNNN)",
                path.display()
            )
        })?
    };
    let base = base
        .map(Path::to_owned)
        .or_else(|| config.model.path.clone());
    let mut policy = match (&base, has_config) {
        (Some(dir), _) => Policy::from_pretrained(dir, opts)
            .with_context(|| format!("cannot load the base model folder {}", dir.display()))?,
        // A run of the built-in model: the config builds it.
        (None, true) => asyncrl_policy::from_config::load_policy(&config.model, config.run.seed)?,
        (None, false) => anyhow::bail!(
            "{} is a learner checkpoint, which holds weights only: name the model it was trained from with --base-model DIR (or the run's --config)",
            ckpt.dir.display()
        ),
    };
    let base = base.map_or_else(
        || "the built-in model".to_owned(),
        |b| b.display().to_string(),
    );
    policy
        .load_weights_from_bytes(&ckpt.model, ckpt.meta.version)
        .with_context(|| {
            format!(
                "the weights of {} do not fit the base model ({base})",
                ckpt.dir.display(),
            )
        })?;
    Ok((
        policy,
        format!("{} (step {})", ckpt.dir.display(), ckpt.meta.step),
    ))
}
