//! The command line of `asyncrl eval` (clap lives in the binary; what it
//! does is `asyncrl_app::eval`).

use std::path::PathBuf;

use clap::Args;

#[derive(Debug, Args)]
pub(crate) struct EvalArgs {
    /// A Hugging Face model folder (config.json), a learner checkpoint
    /// (meta.json + model.safetensors) or a folder of checkpoints (the
    /// newest is evaluated).
    pub model: PathBuf,
    /// The problems: JSONL or Parquet with a prompt and a reference answer.
    #[arg(long)]
    pub data: PathBuf,
    /// A run's config: `[eval]` and `[model]` give the defaults (field
    /// names, verifier, samples, temperature, stop strings) and
    /// `model.path` the model a checkpoint was trained from.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// The model a checkpoint was trained from (its config.json and
    /// tokenizer); default: the config's `model.path`.
    #[arg(long = "base-model")]
    pub base_model: Option<PathBuf>,
    /// The built-in verifier (arith, reverse, math); default: the config's
    /// `eval.dataset.verifier`, else the one the file name starts with
    /// (`arith-all.jsonl` → arith).
    #[arg(long)]
    pub verifier: Option<String>,
    #[arg(long)]
    pub prompt_field: Option<String>,
    #[arg(long)]
    pub answer_field: Option<String>,
    /// Render text prompts with the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Evaluate the first N problems (0: all).
    #[arg(long)]
    pub problems: Option<usize>,
    /// Refuse data sets with more problems than this.
    #[arg(long)]
    pub max_problems: Option<usize>,
    /// Completions sampled per problem for sampled accuracy and pass@k.
    #[arg(long)]
    pub samples: Option<usize>,
    /// Skip the greedy completion (needs --samples).
    #[arg(long)]
    pub no_greedy: bool,
    #[arg(long)]
    pub temperature: Option<f64>,
    #[arg(long)]
    pub max_new_tokens: Option<usize>,
    #[arg(long)]
    pub seed: Option<u64>,
    /// Print the scores as one JSON object.
    #[arg(long)]
    pub json: bool,
}

impl From<EvalArgs> for asyncrl_app::eval::EvalArgs {
    fn from(a: EvalArgs) -> Self {
        Self {
            model: a.model,
            data: a.data,
            config: a.config,
            base_model: a.base_model,
            verifier: a.verifier,
            prompt_field: a.prompt_field,
            answer_field: a.answer_field,
            chat: a.chat,
            problems: a.problems,
            max_problems: a.max_problems,
            samples: a.samples,
            no_greedy: a.no_greedy,
            temperature: a.temperature,
            max_new_tokens: a.max_new_tokens,
            seed: a.seed,
            json: a.json,
        }
    }
}
