//! Prompt data sets.
//!
//! - The one task loader ([`load_datasets`], [`load_dataset`]): JSONL and
//!   Parquet files with a field mapping, prompts as text or chat messages,
//!   prompt-length limits (see the `load` module for the rules).
//! - Deterministic generators for the built-in tasks ([`BuiltinTask`]).
//! - The built-in verifiers ([`score`]): `arith`, `reverse`, and `math`
//!   (numeric final answers: GSM8K `####`, `\boxed{}`, the last number).
//!
//! No tensors here: the coordinator (which owns the data set), the rollout
//! worker (which scores) and the learner's warm start all use this crate.

mod generate;
mod load;
mod math;
mod verify;

use std::path::{Path, PathBuf};

pub use asyncrl_text::{Message, Prompt};
pub use generate::{
    BuiltinTask, GenerateOptions, REVERSE_MAX_LEN, SplitMix64, arith_all, generate, generate_with,
    hidden_sum_all,
};
pub use load::{
    LoadedDataset, load_dataset, load_dataset_within, load_datasets, load_datasets_within,
    load_eval_problems, valid_task_id,
};
pub use math::{MathAnswer, extract_final_answer, math_reward};
pub use verify::{Verdict, score};

/// One prompt with its reference answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskItem {
    /// Stable id (a NATS subject token): the row's id field, or
    /// `<data set>-<row>`.
    pub id: String,
    /// The data set it came from.
    pub dataset: String,
    pub prompt: Prompt,
    pub answer: String,
    /// The verifier that scores its completions (`arith`, `reverse`,
    /// `math`, or `service`).
    pub verifier: String,
}

impl TaskItem {
    /// The prompt as text (a text prompt; the last message's content of a
    /// message prompt), for logs and the built-in tiny tasks.
    pub fn prompt_text(&self) -> &str {
        match &self.prompt {
            Prompt::Text(t) => t,
            Prompt::Messages(m) => m.last().map(|m| m.content.as_str()).unwrap_or(""),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    #[error(
        "no task data set configured: add [[coordinator.datasets]] with a name and a JSONL or Parquet path"
    )]
    NoDatasets,
    #[error("cannot read tasks file {path} (data set `{dataset}`): {source}")]
    Read {
        dataset: String,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("tasks file {path}, {at}{}: {reason}", field.as_ref().map(|f| format!(", field `{f}`")).unwrap_or_default())]
    Row {
        path: PathBuf,
        /// `line N` (JSONL, from 1) or `row N` (Parquet, from 0).
        at: String,
        field: Option<String>,
        reason: String,
    },
    #[error("tasks file {path} has no column `{column}` (the {key}); its columns: {columns}")]
    NoColumn {
        path: PathBuf,
        column: String,
        key: String,
        columns: String,
    },
    #[error("tasks file {path}: not a readable Parquet file: {source}")]
    Parquet {
        path: PathBuf,
        source: parquet::errors::ParquetError,
    },
    #[error("tasks file {path}: {source}")]
    Arrow {
        path: PathBuf,
        source: arrow::error::ArrowError,
    },
    #[error("tasks file {path} holds no task (data set `{dataset}`{})", if *skipped_long > 0 { format!("; {skipped_long} prompts were over max_prompt_tokens") } else { String::new() })]
    Empty {
        dataset: String,
        path: PathBuf,
        skipped_long: usize,
    },
    #[error("task id `{id}` appears twice: in {first} and in {second}")]
    DuplicateId {
        id: String,
        first: String,
        second: String,
    },
    #[error(
        "data set `{dataset}` sets max_prompt_tokens, which needs the model's tokenizer (model.path, or the built-in model)"
    )]
    NoTokenizer { dataset: String },
    #[error("`eval.dataset` is not set: name the held-out data set")]
    NoEvalDataset,
    #[error(
        "eval data set `{dataset}` ({path}): row {row} has an empty answer (field `{field}`); evaluation needs a reference answer for every problem"
    )]
    NoAnswer {
        dataset: String,
        path: PathBuf,
        row: usize,
        field: String,
    },
    #[error(
        "eval data set `{dataset}` ({path}) has {problems} problems, more than eval.max_problems = {max} (evaluate the first ones with eval.problems, or raise eval.max_problems)"
    )]
    TooManyProblems {
        dataset: String,
        path: PathBuf,
        problems: usize,
        max: usize,
    },
    #[error(
        "eval.problems = {wanted} but the eval data set `{dataset}` ({path}) has only {problems} problems"
    )]
    FewerProblems {
        dataset: String,
        path: PathBuf,
        wanted: usize,
        problems: usize,
    },
    #[error("cannot write task file {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The text side of `[model]`: the folder of `model.path`, or the built-in
/// model's. Reads small files only (no weights). Blocking.
pub fn model_text(
    model: &asyncrl_config::ModelConfig,
) -> asyncrl_text::Result<asyncrl_text::ModelText> {
    match &model.path {
        Some(dir) => asyncrl_text::ModelText::from_dir(dir),
        None => Ok(asyncrl_text::ModelText::builtin()),
    }
}

/// Writes tasks as JSONL (used by the generators).
pub fn write_jsonl(path: &Path, items: &[TaskItem]) -> Result<(), TaskError> {
    let write_err = |source| TaskError::Write {
        path: path.to_owned(),
        source,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(write_err)?;
    }
    let mut out = String::new();
    for item in items {
        let value =
            serde_json::json!({"id": item.id, "prompt": item.prompt, "answer": item.answer});
        out.push_str(&value.to_string());
        out.push('\n');
    }
    std::fs::write(path, out).map_err(write_err)
}
