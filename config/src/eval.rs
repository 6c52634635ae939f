//! `[eval]`: held-out evaluation of the policy while it trains (the learner
//! evaluates the weights of every `every_steps`-th version, of the first and
//! of the last on a thread with its own copy of the model) and the defaults
//! of `asyncrl eval`.

use serde::{Deserialize, Serialize};

use crate::{ConfigError, DatasetConfig, check_range};

/// What generates the learner's held-out completions (`eval.engine`).
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum EvalEngineName {
    /// The engine that trains (`learner.trainer`); `torch` also when the
    /// built-in model does not run the architecture.
    #[default]
    Auto,
    /// The built-in model, on its own thread (Llama and Qwen2).
    Builtin,
    /// A one-rank torch engine process of its own (`learner.torch.python`):
    /// any Hugging Face causal LM.
    Torch,
}

impl EvalEngineName {
    pub fn as_str(self) -> &'static str {
        match self {
            EvalEngineName::Auto => "auto",
            EvalEngineName::Builtin => "builtin",
            EvalEngineName::Torch => "torch",
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EvalConfig {
    /// Evaluate the weights of every N-th version (plus the first and the
    /// last of the run); 0: no evaluation.
    pub every_steps: u64,
    /// The held-out problems (the same keys as `[[coordinator.datasets]]`);
    /// every row needs a reference answer and a built-in verifier.
    pub dataset: Option<DatasetConfig>,
    /// Evaluate the first N problems of the data set (0: all of them).
    pub problems: usize,
    /// The most problems one evaluation may take: a data set (or
    /// `problems`) above it is refused, not cut.
    pub max_problems: usize,
    /// Greedy accuracy (temperature 0, one completion per problem).
    pub greedy: bool,
    /// Completions sampled per problem at `temperature` (0: none): the
    /// mean sampled accuracy and pass@k with k = `samples`.
    pub samples: usize,
    /// Sampling temperature (default: `model.temperature`).
    pub temperature: Option<f64>,
    /// Seed of the sampled completions (the same for every version, so
    /// versions are compared on the same random draws).
    pub seed: u64,
    /// Tokens per completion at most (default: `model.max_new_tokens`).
    pub max_new_tokens: Option<usize>,
    /// What generates the completions: `auto`, `builtin` or `torch`.
    pub engine: EvalEngineName,
    /// The evaluator thread's nice value (Linux, 0–19): above 0 it takes
    /// the CPU that training leaves, so that evaluating on the learner's
    /// cores slows training less (its rows come later; a version it falls
    /// far behind on is skipped and counted). 0: the learner's priority.
    pub nice: u8,
}

impl Default for EvalConfig {
    fn default() -> Self {
        Self {
            every_steps: 0,
            dataset: None,
            problems: 0,
            max_problems: 10_000,
            greedy: true,
            samples: 0,
            temperature: None,
            seed: 0,
            max_new_tokens: None,
            engine: EvalEngineName::Auto,
            nice: 10,
        }
    }
}

/// Completions per problem at most (`eval.samples`).
pub const MAX_EVAL_SAMPLES: usize = 1024;

impl EvalConfig {
    /// Whether the learner evaluates while it trains.
    pub fn enabled(&self) -> bool {
        self.every_steps > 0
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(d) = &self.dataset {
            d.validate("eval.dataset")?;
            if d.verifier_name() == "service" {
                return Err(ConfigError::invalid(
                    "eval.dataset.verifier",
                    format!(
                        "= {:?}: evaluation scores with a built-in verifier ({})",
                        d.verifier_name(),
                        crate::BUILTIN_VERIFIERS.join(", ")
                    ),
                ));
            }
        } else if self.enabled() {
            return Err(ConfigError::invalid(
                "eval.dataset",
                "is missing: `eval.every_steps` > 0 needs the held-out data set",
            ));
        }
        check_range("eval.max_problems", self.max_problems, 1, usize::MAX)?;
        check_range("eval.problems", self.problems, 0, self.max_problems)?;
        check_range("eval.samples", self.samples, 0, MAX_EVAL_SAMPLES)?;
        check_range("eval.nice", self.nice, 0, 19)?;
        if !self.greedy && self.samples == 0 {
            return Err(ConfigError::invalid(
                "eval.greedy",
                "= false with eval.samples = 0 leaves nothing to evaluate",
            ));
        }
        if let Some(t) = self.temperature
            && !(t > 0.0 && t <= 100.0)
        {
            return Err(ConfigError::invalid(
                "eval.temperature",
                format!("= {t} must be in (0, 100] (greedy is eval.greedy)"),
            ));
        }
        if self.max_new_tokens == Some(0) {
            return Err(ConfigError::invalid(
                "eval.max_new_tokens",
                "must be at least 1 (leave it out for model.max_new_tokens)",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::Config;

    fn check(toml: &str, want: Result<(), &str>) {
        let got = Config::parse(toml, None).map(|_| ());
        match (got, want) {
            (Ok(()), Ok(())) => {}
            (Err(e), Err(part)) => assert!(e.to_string().contains(part), "{e} lacks {part:?}"),
            (got, want) => panic!("{toml}: got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn eval_section() {
        check("", Ok(()));
        check(
            "[eval]\nevery_steps = 10\ndataset = { name = \"arith\", path = \"e.jsonl\" }",
            Ok(()),
        );
        check("[eval]\nevery_steps = 10", Err("`eval.dataset` is missing"));
        check(
            "[eval]\nevery_steps = 10\nengine = \"torch\"\ndataset = { name = \"arith\", path = \"e.jsonl\" }",
            Err("`model.path` eval.engine = \"torch\" evaluates a Hugging Face model folder"),
        );
        check(
            "[model]\npath = \"m\"\n[eval]\nevery_steps = 10\nengine = \"torch\"\ndataset = { name = \"arith\", path = \"e.jsonl\" }",
            Ok(()),
        );
        check("[eval]\nengine = \"vllm\"", Err("`eval.engine`"));
        check(
            "[eval]\nevery_steps = 1\ndataset = { name = \"x\", path = \"e.jsonl\" }",
            Err("eval.dataset.verifier"),
        );
        check(
            "[eval]\ndataset = { name = \"a b\", path = \"e.jsonl\", verifier = \"math\" }",
            Err("eval.dataset.name"),
        );
        check(
            "[eval]\nproblems = 20\nmax_problems = 10",
            Err("eval.problems"),
        );
        check("[eval]\ngreedy = false", Err("leaves nothing to evaluate"));
        check(
            "[eval]\nsamples = 4\ntemperature = 0.0",
            Err("eval.temperature"),
        );
        check(
            "[eval]\nsamples = 4\ntemperature = nan",
            Err("eval.temperature"),
        );
        check("[eval]\nmax_new_tokens = 0", Err("eval.max_new_tokens"));
        check("[eval]\nevery = 3", Err("unknown field `every`"));
    }
}
