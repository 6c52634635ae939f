//! The append-only JSONL journal of control requests: every knob change,
//! pause, resume and checkpoint request, who asked, when, and the outcome
//! (accepted for step N, refused because ..., applied at step N). One JSON
//! object per line; `seq` grows by one per entry, across restarts.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt;

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("cannot open the journal {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot append to the journal {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// One line of the journal.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JournalEntry {
    pub seq: u64,
    pub unix_ms: i64,
    /// RFC 3339, UTC.
    pub time: String,
    /// Who asked (`requested_by`, or `coordinator` for its own entries).
    pub who: String,
    /// The caller's address, when it came over the network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer: Option<String>,
    /// set_knobs | pause | resume | checkpoint | applied
    pub action: String,
    /// What was asked (knobs and the step asked for).
    #[serde(default)]
    pub request: serde_json::Value,
    /// accepted | refused | applied
    pub outcome: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effective_step: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// For `applied`: the seq of the request that was applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ref_seq: Option<u64>,
}

/// The journal file.
#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    file: tokio::fs::File,
    next_seq: u64,
    applied: HashSet<u64>,
}

pub use asyncrl_common::unix_ms as now_unix_ms;

/// The journal's path: `coordinator.journal_path`, by default
/// `<run.output_dir>/coordinator-journal.jsonl`.
pub fn path(config: &asyncrl_config::Config) -> PathBuf {
    config
        .coordinator
        .journal_path
        .clone()
        .unwrap_or_else(|| config.run.output_dir.join("coordinator-journal.jsonl"))
}

fn rfc3339(unix_ms: i64) -> String {
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(unix_ms.max(0) as u64);
    humantime::format_rfc3339_millis(t).to_string()
}

impl Journal {
    /// Opens (creating it and its directory if needed) and reads where the
    /// sequence stands. A torn last line (a crash mid-write) is cut off
    /// (`asyncrl_common::linelog`).
    pub async fn open(path: &Path) -> Result<Self, JournalError> {
        let open_err = |source| JournalError::Open {
            path: path.to_owned(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            tokio::fs::create_dir_all(dir).await.map_err(open_err)?;
        }
        let opened = {
            let path = path.to_owned();
            tokio::task::spawn_blocking(move || {
                asyncrl_common::linelog::open_checked(&path, |bytes| bytes.len())
            })
            .await
            .map_err(|e| open_err(std::io::Error::other(e)))?
        };
        let (file, existing) = opened.map_err(open_err)?;
        let existing = String::from_utf8_lossy(&existing);
        let mut next_seq = 1;
        let mut applied = HashSet::new();
        for (i, line) in existing.lines().enumerate() {
            match serde_json::from_str::<JournalEntry>(line) {
                Ok(e) => {
                    next_seq = next_seq.max(e.seq + 1);
                    if e.outcome == "applied" {
                        applied.extend(e.ref_seq);
                    }
                }
                Err(err) => tracing::warn!(
                    journal = %path.display(),
                    line = i + 1,
                    error = %err,
                    "skipping an unreadable journal line"
                ),
            }
        }
        let file = tokio::fs::File::from_std(file);
        Ok(Self {
            path: path.to_owned(),
            file,
            next_seq,
            applied,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The seq the next entry will get.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Whether an `applied` entry for request `seq` was written.
    pub fn was_applied(&self, seq: u64) -> bool {
        self.applied.contains(&seq)
    }

    /// Appends an entry (its `seq`, `unix_ms` and `time` are filled in) and
    /// syncs it to disk. Returns the seq.
    pub async fn append(&mut self, mut entry: JournalEntry) -> Result<u64, JournalError> {
        entry.seq = self.next_seq;
        if entry.unix_ms == 0 {
            entry.unix_ms = now_unix_ms();
        }
        entry.time = rfc3339(entry.unix_ms);
        let mut line = serde_json::to_vec(&entry).map_err(|e| JournalError::Write {
            path: self.path.clone(),
            source: std::io::Error::other(e),
        })?;
        line.push(b'\n');
        let write_err = |source| JournalError::Write {
            path: self.path.clone(),
            source,
        };
        self.file.write_all(&line).await.map_err(write_err)?;
        self.file.sync_data().await.map_err(write_err)?;
        self.next_seq += 1;
        if entry.outcome == "applied" {
            self.applied.extend(entry.ref_seq);
        }
        Ok(entry.seq)
    }

    /// Reads every entry of a journal file (tests, tools).
    pub async fn read_all(path: &Path) -> Result<Vec<JournalEntry>, JournalError> {
        let text = tokio::fs::read_to_string(path)
            .await
            .map_err(|source| JournalError::Open {
                path: path.to_owned(),
                source,
            })?;
        Ok(text
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect())
    }
}

/// An entry with the fields every entry has; the rest default.
pub fn entry(who: &str, action: &str, outcome: &str) -> JournalEntry {
    JournalEntry {
        seq: 0,
        unix_ms: 0,
        time: String::new(),
        who: who.to_owned(),
        peer: None,
        action: action.to_owned(),
        request: serde_json::Value::Null,
        outcome: outcome.to_owned(),
        effective_step: None,
        reason: None,
        ref_seq: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn appends_and_continues_the_sequence_after_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/journal.jsonl");
        let mut j = Journal::open(&path).await.unwrap();
        let mut e = entry("alice", "set_knobs", "accepted");
        e.effective_step = Some(5);
        e.request = serde_json::json!({"eta": 2});
        assert_eq!(j.append(e).await.unwrap(), 1);
        let mut applied = entry("coordinator", "applied", "applied");
        applied.ref_seq = Some(1);
        assert_eq!(j.append(applied).await.unwrap(), 2);
        drop(j);
        // A torn line from a crash mid-write.
        let mut raw = std::fs::read(&path).unwrap();
        raw.extend_from_slice(b"{\"seq\": 3, \"who\": \"tor");
        std::fs::write(&path, raw).unwrap();
        let mut j = Journal::open(&path).await.unwrap();
        assert_eq!(j.next_seq(), 3);
        assert!(j.was_applied(1));
        assert_eq!(j.append(entry("bob", "pause", "refused")).await.unwrap(), 3);
        let all = Journal::read_all(&path).await.unwrap();
        assert_eq!(all.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2, 3]);
        assert_eq!(all[0].request["eta"], 2);
        assert!(
            all[0].time.ends_with('Z') && all[0].unix_ms > 0,
            "{:?}",
            all[0]
        );
        assert_eq!(all[2].who, "bob");
    }

    #[tokio::test]
    async fn unwritable_path_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, "x").unwrap();
        let err = Journal::open(&file.join("journal.jsonl"))
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("journal.jsonl"), "{err}");
    }
}
