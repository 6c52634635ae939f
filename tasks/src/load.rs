//! The one task loader of the workspace: JSONL and Parquet files, a field
//! mapping (`[[coordinator.datasets]]`), prompts as text or messages, and
//! a prompt-length limit checked with the model's own tokenizer and chat
//! template. The coordinator (its data set), the warm start and
//! `asyncrl train --check-config` all read tasks here.
//!
//! Rules, the same for both formats:
//! - A row is one task. The prompt field holds a non-empty string or a
//!   non-empty list of `{"role", "content"}` messages; the answer field a
//!   string or a number; the id field (optional per row) a string of
//!   `[A-Za-z0-9_-]` (a NATS subject token). Other fields are ignored.
//! - Without an id, a task is `<data set>-<row>`, the row counted from 0
//!   over the file's rows (blank JSONL lines are no rows), so ids stay put
//!   when a length limit leaves rows out.
//! - A bad row is an error naming the file, the row (JSONL: line) and the
//!   field. Ids are unique across all data sets.
//! - A prompt over `max_prompt_tokens` is refused (`long_prompts = "error"`)
//!   or counted and left out (`"skip"`), never truncated. With the model's
//!   context length ([`load_datasets_within`]), so is a prompt that leaves
//!   no room for a completion (`model.max_seq_len` tokens or more), whether
//!   or not `max_prompt_tokens` is set: no worker could ever answer it.

use std::collections::HashMap;
use std::io::BufRead;

use arrow::array::{
    Array, ArrayRef, AsArray, BooleanArray, LargeListArray, ListArray, StructArray,
};
use arrow::datatypes::{
    DataType, Float32Type, Float64Type, Int8Type, Int16Type, Int32Type, Int64Type, UInt8Type,
    UInt16Type, UInt32Type, UInt64Type,
};
use asyncrl_config::{DatasetConfig, DatasetFormat, LongPrompts};
use asyncrl_text::{Message, ModelText, Prompt};
use serde_json::Value;

use crate::{TaskError, TaskItem};

/// What loading one data set gave.
#[derive(Debug, Clone)]
pub struct LoadedDataset {
    pub items: Vec<TaskItem>,
    /// Rows left out because their prompt was over `max_prompt_tokens`.
    pub skipped_long: usize,
    /// The longest kept prompt in tokens, when lengths were measured.
    pub longest_prompt: Option<usize>,
}

/// The held-out problems of `[eval]`: every row must have a reference
/// answer, and more problems than `eval.max_problems` are refused, not cut
/// (`eval.problems` takes the first N).
pub fn load_eval_problems(
    eval: &asyncrl_config::EvalConfig,
    text: Option<&ModelText>,
) -> Result<Vec<TaskItem>, TaskError> {
    let d = eval.dataset.as_ref().ok_or(TaskError::NoEvalDataset)?;
    let mut items = load_dataset(d, text)?.items;
    if let Some(row) = items.iter().position(|it| it.answer.trim().is_empty()) {
        return Err(TaskError::NoAnswer {
            dataset: d.name.clone(),
            path: d.path.clone(),
            row,
            field: d.answer_field.clone(),
        });
    }
    let wanted = if eval.problems == 0 {
        items.len()
    } else {
        eval.problems
    };
    if wanted > items.len() {
        return Err(TaskError::FewerProblems {
            dataset: d.name.clone(),
            path: d.path.clone(),
            wanted,
            problems: items.len(),
        });
    }
    if wanted > eval.max_problems {
        return Err(TaskError::TooManyProblems {
            dataset: d.name.clone(),
            path: d.path.clone(),
            problems: items.len(),
            max: eval.max_problems,
        });
    }
    items.truncate(wanted);
    Ok(items)
}

/// A task id is used as a NATS subject token (`trajectories.<task id>`).
pub fn valid_task_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// Where a row is, for errors.
#[derive(Debug, Clone, Copy)]
enum RowAt {
    Line(usize),
    Row(usize),
}

impl std::fmt::Display for RowAt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RowAt::Line(n) => write!(f, "line {n}"),
            RowAt::Row(n) => write!(f, "row {n}"),
        }
    }
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// Loads every data set (in order), with prompt lengths measured by `text`
/// when a data set sets `max_prompt_tokens`. Ids are unique across all.
pub fn load_datasets(
    datasets: &[DatasetConfig],
    text: Option<&ModelText>,
) -> Result<Vec<LoadedDataset>, TaskError> {
    load_datasets_within(datasets, text, None)
}

/// [`load_datasets`], and with `context` (the model's `max_seq_len`) every
/// prompt is measured by `text` and one that leaves no room for a
/// completion (`context` tokens or more) is handled as `long_prompts`
/// says, like a prompt over `max_prompt_tokens`.
pub fn load_datasets_within(
    datasets: &[DatasetConfig],
    text: Option<&ModelText>,
    context: Option<usize>,
) -> Result<Vec<LoadedDataset>, TaskError> {
    if datasets.is_empty() {
        return Err(TaskError::NoDatasets);
    }
    let mut seen: HashMap<String, String> = HashMap::new();
    let mut out = Vec::with_capacity(datasets.len());
    for d in datasets {
        let loaded = load_dataset_within(d, text, context)?;
        for item in &loaded.items {
            let here = format!("{} (data set `{}`)", d.path.display(), d.name);
            if let Some(first) = seen.insert(item.id.clone(), here.clone()) {
                return Err(TaskError::DuplicateId {
                    id: item.id.clone(),
                    first,
                    second: here,
                });
            }
        }
        out.push(loaded);
    }
    Ok(out)
}

/// Loads one data set. Blocking file I/O.
pub fn load_dataset(
    d: &DatasetConfig,
    text: Option<&ModelText>,
) -> Result<LoadedDataset, TaskError> {
    load_dataset_within(d, text, None)
}

/// Which bound a prompt is measured against.
#[derive(Debug, Clone, Copy)]
enum Bound {
    /// `max_prompt_tokens`.
    MaxPromptTokens(usize),
    /// The model's context (`model.max_seq_len`): a prompt must leave room
    /// for one completion token.
    Context(usize),
}

impl Bound {
    /// The most tokens a prompt may have.
    fn max(self) -> usize {
        match self {
            Bound::MaxPromptTokens(n) => n,
            Bound::Context(n) => n.saturating_sub(1),
        }
    }
}

/// [`load_dataset`] with the model's context length (see
/// [`load_datasets_within`]).
pub fn load_dataset_within(
    d: &DatasetConfig,
    text: Option<&ModelText>,
    context: Option<usize>,
) -> Result<LoadedDataset, TaskError> {
    let format = match d.format {
        DatasetFormat::Auto
            if d.path
                .extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("parquet")) =>
        {
            DatasetFormat::Parquet
        }
        DatasetFormat::Auto => DatasetFormat::Jsonl,
        f => f,
    };
    let bound = match (d.max_prompt_tokens, context) {
        (Some(n), Some(c)) if c.saturating_sub(1) < n => Some(Bound::Context(c)),
        (Some(n), _) => Some(Bound::MaxPromptTokens(n)),
        (None, Some(c)) => Some(Bound::Context(c)),
        (None, None) => None,
    };
    let limit = match (bound, text) {
        (Some(b), Some(t)) => Some((b, t)),
        (Some(_), None) => {
            return Err(TaskError::NoTokenizer {
                dataset: d.name.clone(),
            });
        }
        (None, _) => None,
    };
    let mut rows = RowMapper {
        d,
        limit,
        items: Vec::new(),
        index: 0,
        skipped_long: 0,
        longest: None,
        seen: HashMap::new(),
    };
    match format {
        DatasetFormat::Parquet => read_parquet(d, &mut rows)?,
        _ => read_jsonl(d, &mut rows)?,
    }
    if rows.items.is_empty() {
        return Err(TaskError::Empty {
            dataset: d.name.clone(),
            path: d.path.clone(),
            skipped_long: rows.skipped_long,
        });
    }
    if rows.skipped_long > 0 {
        tracing::warn!(
            dataset = %d.name,
            path = %d.path.display(),
            skipped = rows.skipped_long,
            max_prompt_tokens = bound.map(Bound::max),
            "left out prompts over max_prompt_tokens or the model's context"
        );
    }
    Ok(LoadedDataset {
        items: rows.items,
        skipped_long: rows.skipped_long,
        longest_prompt: rows.longest,
    })
}

/// Turns rows (as JSON objects of the mapped fields) into tasks.
struct RowMapper<'a> {
    d: &'a DatasetConfig,
    limit: Option<(Bound, &'a ModelText)>,
    items: Vec<TaskItem>,
    /// The next row's index (from 0).
    index: usize,
    skipped_long: usize,
    longest: Option<usize>,
    /// Ids so far, with where they were.
    seen: HashMap<String, String>,
}

impl RowMapper<'_> {
    fn bad(&self, at: RowAt, field: Option<&str>, reason: String) -> TaskError {
        TaskError::Row {
            path: self.d.path.clone(),
            at: at.to_string(),
            field: field.map(str::to_owned),
            reason,
        }
    }

    fn row(&mut self, at: RowAt, get: &dyn Fn(&str) -> Option<Value>) -> Result<(), TaskError> {
        let d = self.d;
        let index = self.index;
        self.index += 1;
        let pf = d.prompt_field.as_str();
        let prompt = match get(pf) {
            None | Some(Value::Null) => return Err(self.bad(at, Some(pf), "missing".into())),
            Some(Value::String(s)) => {
                if s.trim().is_empty() {
                    return Err(self.bad(at, Some(pf), "the prompt is empty".into()));
                }
                if d.apply_chat_template {
                    Prompt::Messages(vec![Message::new("user", s)])
                } else if d.system_prompt.is_some() {
                    return Err(self.bad(
                        at,
                        Some(pf),
                        "a text prompt gets the system_prompt only with apply_chat_template = true"
                            .into(),
                    ));
                } else {
                    Prompt::Text(s)
                }
            }
            Some(v @ Value::Array(_)) => {
                let messages: Vec<Message> = serde_json::from_value(v).map_err(|e| {
                    self.bad(
                        at,
                        Some(pf),
                        format!("not a list of {{\"role\", \"content\"}} messages ({e})"),
                    )
                })?;
                Prompt::Messages(messages)
            }
            Some(other) => {
                return Err(self.bad(
                    at,
                    Some(pf),
                    format!(
                        "must be a string or a list of messages, found {}",
                        kind_of(&other)
                    ),
                ));
            }
        };
        let prompt = match (prompt, &d.system_prompt) {
            (Prompt::Messages(mut m), Some(system))
                if m.first().is_none_or(|f| f.role != "system") =>
            {
                m.insert(0, Message::new("system", system.clone()));
                Prompt::Messages(m)
            }
            (p, _) => p,
        };
        prompt
            .validate()
            .map_err(|reason| self.bad(at, Some(pf), reason))?;
        let af = d.answer_field.as_str();
        let answer = match get(af) {
            None | Some(Value::Null) => return Err(self.bad(at, Some(af), "missing".into())),
            Some(Value::String(s)) => s,
            Some(Value::Number(n)) => n.to_string(),
            Some(other) => {
                return Err(self.bad(
                    at,
                    Some(af),
                    format!("must be a string or a number, found {}", kind_of(&other)),
                ));
            }
        };
        let idf = d.id_field.as_str();
        let id = match get(idf) {
            None | Some(Value::Null) => format!("{}-{index}", d.name),
            Some(Value::String(s)) if valid_task_id(&s) => s,
            Some(Value::Number(n)) if n.is_u64() || n.is_i64() => {
                let s = n.to_string();
                if !valid_task_id(&s) {
                    return Err(self.bad(at, Some(idf), format!("{s} is not a valid id")));
                }
                s
            }
            Some(Value::String(s)) => {
                return Err(self.bad(
                    at,
                    Some(idf),
                    format!(
                        "{s:?} may hold only letters, digits, `_` and `-` (at most 128; it is a NATS subject token)"
                    ),
                ));
            }
            Some(other) => {
                return Err(self.bad(
                    at,
                    Some(idf),
                    format!("must be a string or an integer, found {}", kind_of(&other)),
                ));
            }
        };
        if let Some((bound, text)) = self.limit {
            let max = bound.max();
            let n = text
                .encode(&prompt)
                .map_err(|e| self.bad(at, Some(pf), format!("cannot tokenize the prompt: {e}")))?
                .len();
            if n > max {
                match d.long_prompts {
                    LongPrompts::Skip => {
                        self.skipped_long += 1;
                        return Ok(());
                    }
                    LongPrompts::Error => {
                        return Err(self.bad(
                            at,
                            Some(pf),
                            match bound {
                                Bound::MaxPromptTokens(_) => format!(
                                    "the prompt is {n} tokens, over max_prompt_tokens = {max} (set long_prompts = \"skip\" to leave such rows out)"
                                ),
                                Bound::Context(c) => format!(
                                    "the prompt is {n} tokens, which leaves no room for a completion in model.max_seq_len = {c} (set long_prompts = \"skip\" to leave such rows out)"
                                ),
                            },
                        ));
                    }
                }
            }
            self.longest = Some(self.longest.unwrap_or(0).max(n));
        }
        if let Some(first) = self.seen.insert(id.clone(), at.to_string()) {
            return Err(TaskError::DuplicateId {
                id,
                first: format!("{} {first}", d.path.display()),
                second: format!("{} {at}", d.path.display()),
            });
        }
        self.items.push(TaskItem {
            id,
            dataset: d.name.clone(),
            prompt,
            answer,
            verifier: d.verifier_name().to_owned(),
        });
        Ok(())
    }
}

fn read_err(d: &DatasetConfig, source: std::io::Error) -> TaskError {
    TaskError::Read {
        dataset: d.name.clone(),
        path: d.path.clone(),
        source,
    }
}

fn read_jsonl(d: &DatasetConfig, rows: &mut RowMapper<'_>) -> Result<(), TaskError> {
    let file = std::fs::File::open(&d.path).map_err(|e| read_err(d, e))?;
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| read_err(d, e))?;
        let at = RowAt::Line(i + 1);
        if line.trim().is_empty() {
            continue;
        }
        let value: Value = serde_json::from_str(&line)
            .map_err(|e| rows.bad(at, None, format!("not valid JSON ({e})")))?;
        let Value::Object(obj) = value else {
            return Err(rows.bad(
                at,
                None,
                format!(
                    "expected a JSON object with the fields `{}` and `{}`",
                    d.prompt_field, d.answer_field
                ),
            ));
        };
        rows.row(at, &|f| obj.get(f).cloned())?;
    }
    Ok(())
}

fn read_parquet(d: &DatasetConfig, rows: &mut RowMapper<'_>) -> Result<(), TaskError> {
    use parquet::arrow::ProjectionMask;
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

    let file = std::fs::File::open(&d.path).map_err(|e| read_err(d, e))?;
    let parquet_err = |source: parquet::errors::ParquetError| TaskError::Parquet {
        path: d.path.clone(),
        source,
    };
    let builder = ParquetRecordBatchReaderBuilder::try_new(file).map_err(parquet_err)?;
    let schema = builder.schema().clone();
    let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
    let column = |field: &str| names.iter().position(|n| *n == field);
    for (key, field) in [
        ("prompt_field", &d.prompt_field),
        ("answer_field", &d.answer_field),
    ] {
        if column(field).is_none() {
            return Err(TaskError::NoColumn {
                path: d.path.clone(),
                column: field.clone(),
                key: format!("{key} of data set `{}`", d.name),
                columns: names.join(", "),
            });
        }
    }
    let wanted: Vec<usize> = [&d.prompt_field, &d.answer_field, &d.id_field]
        .iter()
        .filter_map(|f| column(f))
        .collect();
    let mask = ProjectionMask::roots(builder.parquet_schema(), wanted);
    let reader = builder.with_projection(mask).build().map_err(parquet_err)?;
    let mut row = 0usize;
    for batch in reader {
        let batch = batch.map_err(|source| TaskError::Arrow {
            path: d.path.clone(),
            source,
        })?;
        let cols: Vec<(String, ArrayRef)> = batch
            .schema()
            .fields()
            .iter()
            .zip(batch.columns())
            .map(|(f, c)| (f.name().clone(), c.clone()))
            .collect();
        for i in 0..batch.num_rows() {
            let at = RowAt::Row(row);
            row += 1;
            // Convert only the mapped cells of this row.
            let mut cells: HashMap<&str, Value> = HashMap::new();
            for (name, col) in &cols {
                let v = cell(col.as_ref(), i).map_err(|reason| rows.bad(at, Some(name), reason))?;
                cells.insert(name.as_str(), v);
            }
            rows.row(at, &|f| cells.get(f).cloned())?;
        }
    }
    Ok(())
}

/// One Arrow cell as JSON: the types a task field can hold (strings,
/// integers, floats, booleans, lists and structs of them).
fn cell(col: &dyn Array, i: usize) -> Result<Value, String> {
    if col.is_null(i) {
        return Ok(Value::Null);
    }
    macro_rules! num {
        ($t:ty) => {
            Value::from(col.as_primitive::<$t>().value(i))
        };
    }
    Ok(match col.data_type() {
        DataType::Utf8 => Value::from(col.as_string::<i32>().value(i)),
        DataType::LargeUtf8 => Value::from(col.as_string::<i64>().value(i)),
        DataType::Utf8View => Value::from(col.as_string_view().value(i)),
        DataType::Boolean => {
            let b: &BooleanArray = col.as_boolean();
            Value::from(b.value(i))
        }
        DataType::Int8 => num!(Int8Type),
        DataType::Int16 => num!(Int16Type),
        DataType::Int32 => num!(Int32Type),
        DataType::Int64 => num!(Int64Type),
        DataType::UInt8 => num!(UInt8Type),
        DataType::UInt16 => num!(UInt16Type),
        DataType::UInt32 => num!(UInt32Type),
        DataType::UInt64 => num!(UInt64Type),
        DataType::Float32 => num!(Float32Type),
        DataType::Float64 => num!(Float64Type),
        DataType::List(_) => {
            let l: &ListArray = col.as_list::<i32>();
            list(l.value(i).as_ref())?
        }
        DataType::LargeList(_) => {
            let l: &LargeListArray = col.as_list::<i64>();
            list(l.value(i).as_ref())?
        }
        DataType::Struct(fields) => {
            let s: &StructArray = col.as_struct();
            let mut obj = serde_json::Map::new();
            for (f, c) in fields.iter().zip(s.columns()) {
                obj.insert(f.name().clone(), cell(c.as_ref(), i)?);
            }
            Value::Object(obj)
        }
        other => {
            return Err(format!(
                "has Arrow type {other}, which a task field cannot hold"
            ));
        }
    })
}

fn list(values: &dyn Array) -> Result<Value, String> {
    (0..values.len())
        .map(|j| cell(values, j))
        .collect::<Result<Vec<_>, _>>()
        .map(Value::Array)
}

#[cfg(test)]
mod tests;
