//! Prompt data sets.
//!
//! - The task file format: JSONL, one `{"prompt": ..., "answer": ...}` per
//!   line (an optional `"id"` names the item; otherwise it is
//!   `<file stem>-<line>`). Users replace these files with their own.
//! - Deterministic generators for the built-in tasks ([`BuiltinTask`]).
//! - Their verifiers ([`score`]): the reward of a completion.
//!
//! No tensors here: the coordinator (which owns the data set) and the
//! rollout worker (which scores) both use this crate.

mod generate;
mod math;
mod verify;

use std::io::BufRead;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use generate::{
    BuiltinTask, GenerateOptions, REVERSE_MAX_LEN, SplitMix64, generate, generate_with,
};
pub use math::{MathAnswer, extract_final_answer, math_reward};
pub use verify::{Verdict, score};

/// One prompt with its reference answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskItem {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub id: String,
    pub prompt: String,
    #[serde(default)]
    pub answer: String,
}

#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    #[error("cannot read task file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("task file {path}, line {line}: {reason}")]
    Line {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    #[error("task file {path} has no tasks")]
    Empty { path: PathBuf },
    #[error("cannot write task file {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Reads a JSONL task file. Blank lines are skipped; any other bad line is
/// an error naming the file and the line. Ids must be unique.
pub fn load_jsonl(path: &Path) -> Result<Vec<TaskItem>, TaskError> {
    let file = std::fs::File::open(path).map_err(|source| TaskError::Read {
        path: path.to_owned(),
        source,
    })?;
    let stem = path
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("task")
        .to_owned();
    let mut items = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line_no = i + 1;
        let line = line.map_err(|source| TaskError::Read {
            path: path.to_owned(),
            source,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let bad = |reason: String| TaskError::Line {
            path: path.to_owned(),
            line: line_no,
            reason,
        };
        let mut item: TaskItem = serde_json::from_str(&line).map_err(|e| bad(e.to_string()))?;
        if item.prompt.is_empty() {
            return Err(bad("`prompt` is empty".into()));
        }
        if item.id.is_empty() {
            item.id = format!("{stem}-{line_no}");
        }
        if !item
            .id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_".contains(c))
        {
            return Err(bad(format!(
                "`id` {:?} may only hold [A-Za-z0-9_-]",
                item.id
            )));
        }
        if !seen.insert(item.id.clone()) {
            return Err(bad(format!("duplicate id {:?}", item.id)));
        }
        items.push(item);
    }
    if items.is_empty() {
        return Err(TaskError::Empty {
            path: path.to_owned(),
        });
    }
    Ok(items)
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
        // Serialising a struct of strings cannot fail.
        out.push_str(&serde_json::to_string(item).unwrap_or_default());
        out.push('\n');
    }
    std::fs::write(path, out).map_err(write_err)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(text: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("arith.jsonl");
        std::fs::write(&path, text).unwrap();
        (dir, path)
    }

    fn check(text: &str, expect: Result<usize, &str>) {
        let (_dir, path) = write(text);
        match (load_jsonl(&path), expect) {
            (Ok(items), Ok(n)) => assert_eq!(items.len(), n, "{text:?}"),
            (Err(e), Err(want)) => {
                let msg = e.to_string();
                assert!(
                    msg.contains(want),
                    "{text:?}: `{msg}` should contain `{want}`"
                );
                assert!(
                    msg.contains("arith.jsonl"),
                    "error should name the file: {msg}"
                );
            }
            (got, want) => panic!("{text:?}: expected {want:?}, got {got:?}"),
        }
    }

    #[test]
    fn loader_table() {
        check("{\"prompt\":\"1+1=\",\"answer\":\"2\"}\n", Ok(1));
        check(
            "{\"prompt\":\"1+1=\",\"answer\":\"2\"}\n\n{\"prompt\":\"2+2=\",\"answer\":\"4\"}",
            Ok(2),
        );
        check("{\"id\":\"a\",\"prompt\":\"x\"}\n", Ok(1));
        check("", Err("has no tasks"));
        check("{\"prompt\":\"1+1=\"\n", Err("line 1"));
        check(
            "{\"prompt\":\"a\",\"answer\":\"b\"}\nnot json\n",
            Err("line 2"),
        );
        check(
            "{\"prompt\":\"\",\"answer\":\"2\"}\n",
            Err("`prompt` is empty"),
        );
        check(
            "{\"prompt\":\"a\",\"answr\":\"2\"}\n",
            Err("unknown field `answr`"),
        );
        check(
            "{\"id\":\"x\",\"prompt\":\"a\"}\n{\"id\":\"x\",\"prompt\":\"b\"}\n",
            Err("duplicate id"),
        );
        check("{\"id\":\"x y\",\"prompt\":\"a\"}\n", Err("may only hold"));
    }

    #[test]
    fn default_ids_name_file_and_line() {
        let (_dir, path) = write("{\"prompt\":\"a\"}\n\n{\"prompt\":\"b\"}\n");
        let items = load_jsonl(&path).unwrap();
        assert_eq!(items[0].id, "arith-1");
        assert_eq!(items[1].id, "arith-3");
    }

    #[test]
    fn missing_file_is_named() {
        let err = load_jsonl(Path::new("/nonexistent/tasks.jsonl"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("/nonexistent/tasks.jsonl"), "{err}");
    }

    #[test]
    fn write_then_load_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/gen.jsonl");
        let items = generate(BuiltinTask::Arith, 50, 7);
        write_jsonl(&path, &items).unwrap();
        assert_eq!(load_jsonl(&path).unwrap(), items);
    }
}
