//! The prompt data set: JSONL files, one `{"prompt": ..., "answer": ...}` per
//! line (an optional `"id"`; other fields are ignored). Loaded once at start;
//! the coordinator's cursor walks it epoch after epoch.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use asyncrl_config::DatasetConfig;
use serde_json::Value;
use sha2::{Digest, Sha256};

#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    #[error(
        "no task data set configured: add [[coordinator.datasets]] with a name and a JSONL path"
    )]
    NoDatasets,
    #[error("cannot read tasks file {path} (data set `{dataset}`): {source}")]
    Read {
        dataset: String,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("tasks file {path} line {line}: {reason}")]
    Line {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    #[error("tasks file {path} holds no task (data set `{dataset}`)")]
    Empty { dataset: String, path: PathBuf },
    #[error("task id `{id}` appears twice: {first} and {second}")]
    DuplicateId {
        id: String,
        first: String,
        second: String,
    },
}

/// One prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskItem {
    /// Stable id (a NATS subject token): `"id"` from the file, or
    /// `<dataset>-<n>` with n the task's 0-based position in its file.
    pub task_id: String,
    pub dataset: String,
    pub prompt: String,
    pub answer: String,
}

/// Every task of every configured data set, in issue order.
#[derive(Debug, Clone)]
pub struct TaskSet {
    items: Vec<TaskItem>,
    by_id: HashMap<String, usize>,
    fingerprint: String,
}

/// A task id is used as a NATS subject token (`trajectories.<task id>`).
pub fn valid_task_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

fn field_text(obj: &serde_json::Map<String, Value>, name: &str) -> Result<Option<String>, String> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        // Answers of arithmetic tasks are often written as numbers.
        Some(Value::Number(n)) if name != "prompt" => Ok(Some(n.to_string())),
        Some(other) => Err(format!(
            "field `{name}` must be a string, found {}",
            match other {
                Value::Bool(_) => "a boolean",
                Value::Number(_) => "a number",
                Value::Array(_) => "an array",
                Value::Object(_) => "an object",
                _ => "something else",
            }
        )),
    }
}

/// Parses one line; `Ok(None)` for a blank line.
fn parse_line(text: &str) -> Result<Option<(Option<String>, String, String)>, String> {
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Ok(None);
    }
    let value: Value =
        serde_json::from_str(trimmed).map_err(|e| format!("not valid JSON ({e})"))?;
    let Value::Object(obj) = value else {
        return Err("expected a JSON object like {\"prompt\": ..., \"answer\": ...}".into());
    };
    let prompt = field_text(&obj, "prompt")?.ok_or("missing field `prompt`")?;
    if prompt.is_empty() {
        return Err("field `prompt` is empty".into());
    }
    let answer = field_text(&obj, "answer")?.ok_or("missing field `answer`")?;
    let id = field_text(&obj, "id")?;
    if let Some(id) = &id
        && !valid_task_id(id)
    {
        return Err(format!(
            "field `id` = {id:?} may hold only letters, digits, `_` and `-` (at most 128; it is a NATS subject token)"
        ));
    }
    Ok(Some((id, prompt, answer)))
}

impl TaskSet {
    /// Reads every configured data set. Blocking file I/O: call it from
    /// `spawn_blocking` in async code.
    pub fn load(datasets: &[DatasetConfig]) -> Result<Self, DatasetError> {
        if datasets.is_empty() {
            return Err(DatasetError::NoDatasets);
        }
        let mut items = Vec::new();
        let mut origin: Vec<String> = Vec::new();
        for d in datasets {
            let text = std::fs::read_to_string(&d.path).map_err(|source| DatasetError::Read {
                dataset: d.name.clone(),
                path: d.path.clone(),
                source,
            })?;
            let before = items.len();
            let mut n = 0usize;
            for (i, line) in text.lines().enumerate() {
                let parsed = parse_line(line).map_err(|reason| DatasetError::Line {
                    path: d.path.clone(),
                    line: i + 1,
                    reason,
                })?;
                let Some((id, prompt, answer)) = parsed else {
                    continue;
                };
                let task_id = id.unwrap_or_else(|| format!("{}-{n}", d.name));
                n += 1;
                items.push(TaskItem {
                    task_id,
                    dataset: d.name.clone(),
                    prompt,
                    answer,
                });
                origin.push(format!("{} line {}", d.path.display(), i + 1));
            }
            if items.len() == before {
                return Err(DatasetError::Empty {
                    dataset: d.name.clone(),
                    path: d.path.clone(),
                });
            }
        }
        Self::from_items_with_origin(items, &origin)
    }

    /// A task set from items in memory (tests, benches).
    pub fn from_items(items: Vec<TaskItem>) -> Result<Self, DatasetError> {
        let origin: Vec<String> = (0..items.len()).map(|i| format!("item {i}")).collect();
        Self::from_items_with_origin(items, &origin)
    }

    fn from_items_with_origin(
        items: Vec<TaskItem>,
        origin: &[String],
    ) -> Result<Self, DatasetError> {
        let mut by_id = HashMap::with_capacity(items.len());
        let mut hasher = Sha256::new();
        for (i, item) in items.iter().enumerate() {
            if let Some(first) = by_id.insert(item.task_id.clone(), i) {
                return Err(DatasetError::DuplicateId {
                    id: item.task_id.clone(),
                    first: origin[first].clone(),
                    second: origin[i].clone(),
                });
            }
            for part in [&item.task_id, &item.dataset, &item.prompt, &item.answer] {
                hasher.update((part.len() as u64).to_le_bytes());
                hasher.update(part.as_bytes());
            }
        }
        let fingerprint = hex::encode(hasher.finalize())[..16].to_owned();
        Ok(Self {
            items,
            by_id,
            fingerprint,
        })
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    pub fn get(&self, index: usize) -> Option<&TaskItem> {
        self.items.get(index)
    }

    pub fn index_of(&self, task_id: &str) -> Option<usize> {
        self.by_id.get(task_id).copied()
    }

    /// Short sha256 over every task; the persisted cursor is only valid for
    /// the task set it was made with.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }
}

/// Writes a JSONL tasks file of `n` arithmetic prompts (tests, benches,
/// examples). Blocking.
pub fn write_arith_file(path: &Path, n: usize) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    for i in 0..n {
        let (a, b) = (i % 97 + 3, (i * 7) % 89 + 1);
        let line =
            serde_json::json!({"prompt": format!("{a}+{b}="), "answer": (a + b).to_string()});
        writeln!(f, "{line}")?;
    }
    f.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dataset(name: &str, path: &Path) -> DatasetConfig {
        DatasetConfig {
            name: name.into(),
            path: path.to_owned(),
        }
    }

    #[test]
    fn loads_files_in_order_with_stable_ids() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a.jsonl");
        let b = dir.path().join("b.jsonl");
        std::fs::write(
            &a,
            "{\"prompt\": \"1+1=\", \"answer\": \"2\"}\n\n{\"prompt\": \"2+3=\", \"answer\": 5, \"level\": 1}\n",
        )
        .unwrap();
        std::fs::write(
            &b,
            "{\"id\": \"rev_7\", \"prompt\": \"abc\", \"answer\": \"cba\"}",
        )
        .unwrap();
        let set = TaskSet::load(&[dataset("arith", &a), dataset("rev", &b)]).unwrap();
        assert_eq!(set.len(), 3);
        let ids: Vec<&str> = (0..3)
            .map(|i| set.get(i).unwrap().task_id.as_str())
            .collect();
        assert_eq!(ids, ["arith-0", "arith-1", "rev_7"]);
        assert_eq!(set.get(1).unwrap().answer, "5");
        assert_eq!(set.get(2).unwrap().dataset, "rev");
        assert_eq!(set.index_of("rev_7"), Some(2));
        let again = TaskSet::load(&[dataset("arith", &a), dataset("rev", &b)]).unwrap();
        assert_eq!(set.fingerprint(), again.fingerprint());
        std::fs::write(
            &b,
            "{\"id\": \"rev_7\", \"prompt\": \"abd\", \"answer\": \"dba\"}",
        )
        .unwrap();
        let changed = TaskSet::load(&[dataset("arith", &a), dataset("rev", &b)]).unwrap();
        assert_ne!(set.fingerprint(), changed.fingerprint());
    }

    #[test]
    fn bad_lines_name_the_file_and_the_line() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("bad.jsonl");
        for (text, line, want) in [
            (
                "{\"prompt\": \"x\", \"answer\": \"y\"}\n{oops",
                2,
                "not valid JSON",
            ),
            ("[1, 2]", 1, "expected a JSON object"),
            ("{\"answer\": \"y\"}", 1, "missing field `prompt`"),
            ("{\"prompt\": \"x\"}", 1, "missing field `answer`"),
            (
                "{\"prompt\": 3, \"answer\": \"y\"}",
                1,
                "`prompt` must be a string, found a number",
            ),
            (
                "{\"prompt\": \"\", \"answer\": \"y\"}",
                1,
                "`prompt` is empty",
            ),
            (
                "\n\n{\"prompt\": \"x\", \"answer\": [1]}",
                3,
                "`answer` must be a string, found an array",
            ),
            (
                "{\"id\": \"a.b\", \"prompt\": \"x\", \"answer\": \"y\"}",
                1,
                "NATS subject token",
            ),
        ] {
            std::fs::write(&p, text).unwrap();
            let err = TaskSet::load(&[dataset("t", &p)]).unwrap_err().to_string();
            assert!(
                err.contains(&format!("{} line {line}: ", p.display())) && err.contains(want),
                "{text:?}: {err}"
            );
        }
    }

    #[test]
    fn missing_empty_and_duplicate_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.jsonl");
        let err = TaskSet::load(&[dataset("t", &missing)])
            .unwrap_err()
            .to_string();
        assert!(err.contains("nope.jsonl") && err.contains("`t`"), "{err}");
        let empty = dir.path().join("empty.jsonl");
        std::fs::write(&empty, "\n  \n").unwrap();
        let err = TaskSet::load(&[dataset("t", &empty)])
            .unwrap_err()
            .to_string();
        assert!(err.contains("holds no task"), "{err}");
        let dup = dir.path().join("dup.jsonl");
        std::fs::write(
            &dup,
            "{\"id\": \"x\", \"prompt\": \"a\", \"answer\": \"b\"}\n{\"id\": \"x\", \"prompt\": \"c\", \"answer\": \"d\"}\n",
        )
        .unwrap();
        let err = TaskSet::load(&[dataset("t", &dup)])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`x` appears twice") && err.contains("line 1") && err.contains("line 2"),
            "{err}"
        );
        assert!(matches!(TaskSet::load(&[]), Err(DatasetError::NoDatasets)));
    }

    #[test]
    fn generated_arith_file_loads() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("arith.jsonl");
        write_arith_file(&p, 50).unwrap();
        let set = TaskSet::load(&[dataset("arith", &p)]).unwrap();
        assert_eq!(set.len(), 50);
        let t = set.get(4).unwrap();
        let (a, b) = t.prompt.trim_end_matches('=').split_once('+').unwrap();
        assert_eq!(
            a.parse::<usize>().unwrap() + b.parse::<usize>().unwrap(),
            t.answer.parse::<usize>().unwrap()
        );
    }
}
