//! The prompt data set the coordinator hands out: every configured data set,
//! read once at start by the workspace's one task loader
//! ([`asyncrl_tasks::load_datasets`]: JSONL or Parquet, a field mapping,
//! text or message prompts, prompt-length limits), indexed by task id and
//! fingerprinted. The coordinator's cursor walks it epoch after epoch.

use std::collections::HashMap;

use asyncrl_config::DatasetConfig;
use asyncrl_tasks::{TaskError, TaskItem};
use asyncrl_text::ModelText;
use sha2::{Digest, Sha256};

/// Every task of every configured data set, in issue order.
#[derive(Debug, Clone)]
pub struct TaskSet {
    items: Vec<TaskItem>,
    by_id: HashMap<String, usize>,
    fingerprint: String,
    /// Per data set: (name, tasks kept, prompts left out as too long).
    summary: Vec<(String, usize, usize)>,
}

impl TaskSet {
    /// Reads every configured data set; `text` measures prompt lengths for
    /// the data sets with `max_prompt_tokens`. Blocking file I/O: call it
    /// from `spawn_blocking` in async code.
    pub fn load(datasets: &[DatasetConfig], text: Option<&ModelText>) -> Result<Self, TaskError> {
        Self::load_within(datasets, text, None)
    }

    /// [`TaskSet::load`], and every prompt that leaves no room for a
    /// completion in `context` tokens (the model's `max_seq_len`) is
    /// refused or left out as `long_prompts` says
    /// ([`asyncrl_tasks::load_datasets_within`]).
    pub fn load_within(
        datasets: &[DatasetConfig],
        text: Option<&ModelText>,
        context: Option<usize>,
    ) -> Result<Self, TaskError> {
        let loaded = asyncrl_tasks::load_datasets_within(datasets, text, context)?;
        let summary = datasets
            .iter()
            .zip(&loaded)
            .map(|(d, l)| (d.name.clone(), l.items.len(), l.skipped_long))
            .collect();
        let items = loaded.into_iter().flat_map(|l| l.items).collect();
        let mut set = Self::from_items(items)?;
        set.summary = summary;
        Ok(set)
    }

    /// A task set from items in memory (tests, benches). Ids must be unique.
    pub fn from_items(items: Vec<TaskItem>) -> Result<Self, TaskError> {
        let mut by_id = HashMap::with_capacity(items.len());
        let mut hasher = Sha256::new();
        for (i, item) in items.iter().enumerate() {
            if let Some(first) = by_id.insert(item.id.clone(), i) {
                return Err(TaskError::DuplicateId {
                    id: item.id.clone(),
                    first: format!("item {first}"),
                    second: format!("item {i}"),
                });
            }
            // The prompt's JSON form tells text and messages apart.
            let prompt = serde_json::to_string(&item.prompt).unwrap_or_default();
            for part in [
                &item.id,
                &item.dataset,
                &prompt,
                &item.answer,
                &item.verifier,
            ] {
                hasher.update((part.len() as u64).to_le_bytes());
                hasher.update(part.as_bytes());
            }
        }
        let fingerprint = hex::encode(hasher.finalize())[..16].to_owned();
        Ok(Self {
            items,
            by_id,
            fingerprint,
            summary: Vec::new(),
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

    /// Per data set: its name, the tasks kept and the prompts left out as
    /// over `max_prompt_tokens`.
    pub fn summary(&self) -> &[(String, usize, usize)] {
        &self.summary
    }
}

/// Writes a JSONL tasks file of `n` arithmetic prompts (tests, benches,
/// examples). Blocking.
pub fn write_arith_file(path: &std::path::Path, n: usize) -> std::io::Result<()> {
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

    #[test]
    fn loads_files_in_order_with_stable_ids_and_fingerprints() {
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
        let ds = [
            DatasetConfig::jsonl("arith", &a),
            DatasetConfig::jsonl("rev", &b),
        ];
        let set = TaskSet::load(&ds, None).unwrap();
        assert_eq!(set.len(), 3);
        let ids: Vec<&str> = (0..3).map(|i| set.get(i).unwrap().id.as_str()).collect();
        assert_eq!(ids, ["arith-0", "arith-1", "rev_7"]);
        assert_eq!(set.get(1).unwrap().answer, "5");
        assert_eq!(set.get(2).unwrap().dataset, "rev");
        assert_eq!(set.index_of("rev_7"), Some(2));
        assert_eq!(
            set.summary(),
            &[("arith".to_owned(), 2, 0), ("rev".to_owned(), 1, 0)]
        );
        let again = TaskSet::load(&ds, None).unwrap();
        assert_eq!(set.fingerprint(), again.fingerprint());
        std::fs::write(
            &b,
            "{\"id\": \"rev_7\", \"prompt\": [{\"role\": \"user\", \"content\": \"abc\"}], \"answer\": \"cba\"}",
        )
        .unwrap();
        let changed = TaskSet::load(&ds, None).unwrap();
        assert_ne!(
            set.fingerprint(),
            changed.fingerprint(),
            "text → messages changes the task set"
        );
    }

    #[test]
    fn generated_arith_file_loads() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("arith.jsonl");
        write_arith_file(&p, 50).unwrap();
        let set = TaskSet::load(&[DatasetConfig::jsonl("arith", &p)], None).unwrap();
        assert_eq!(set.len(), 50);
        let t = set.get(4).unwrap();
        assert_eq!(t.verifier, "arith");
        let (a, b) = t
            .prompt_text()
            .trim_end_matches('=')
            .split_once('+')
            .unwrap();
        assert_eq!(
            a.parse::<usize>().unwrap() + b.parse::<usize>().unwrap(),
            t.answer.parse::<usize>().unwrap()
        );
    }
}
