//! The served log: what the buffer decided that the segments alone cannot
//! tell after a restart. Which groups went to which learner step (so a
//! repeated request gets the same groups and nothing is served twice), and
//! which groups were dropped for staleness (a decision that depends on the
//! learner's version at the time).
//!
//! One record per line, `crc32-hex json\n`, appended and (with `fsync =
//! "always"`) made durable before the decision takes effect: before the
//! batch reply is sent, before a dropped group is reported. A torn last line
//! is cut off on open. Past `buffer.state_log_compact_bytes` the log is
//! rewritten as one snapshot plus the records still needed (atomically:
//! temp file, fsync, rename, fsync of the directory).

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use asyncrl_config::FsyncPolicy;

use crate::BufferError;
use crate::segment::sync_dir;

pub const STATE_LOG: &str = "served.log";

/// A group named by its task and its id (lease).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GroupRef {
    pub task: String,
    pub group: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DropReason {
    /// Never served, and now older than `v − η`.
    Stale,
    /// Served at least once (`reuse`), and now older than `v − η`.
    Expired,
    /// Dynamic sampling: never served, its rewards span less than
    /// `buffer.min_reward_spread`. Its task is done (not issued again).
    NoSignal,
}

/// A group the learner refused, quarantined by a [`Record::Refused`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Quarantined {
    pub group: GroupRef,
    pub trajectories: u32,
    /// The other attempts of the task already superseded (group ids): the
    /// task is issued again and only a new attempt may be kept.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub closed: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Record {
    /// `groups` were served, in this order, for learner `step` at `version`.
    Served {
        step: u64,
        version: i32,
        eta: u32,
        groups: Vec<GroupRef>,
        unix_ms: i64,
        /// The last step the learner had trained when it asked (a prefetch
        /// asks for step s + 1 while s trains); absent: `step - 1`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        trained_through: Option<u64>,
    },
    /// The learner refused `groups` of the batch served for `step`: they
    /// are quarantined (released; their tasks issued again, as after a
    /// stale drop), the step's other groups are served as if never served
    /// for it, and the step is served anew.
    Refused {
        step: u64,
        groups: Vec<Quarantined>,
        reason: String,
        /// Other groups of the step that had expired and whose one serve
        /// was this step's: never trained, so dropped as stale (their tasks
        /// issued again, `closed` as for a stale drop).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        stale: Vec<Quarantined>,
    },
    /// A group will never be served (again).
    Dropped {
        group: GroupRef,
        reason: DropReason,
        trajectories: u32,
        version: i32,
        /// A stale drop: the other attempts of the task already superseded
        /// (group ids). The task is issued again and only a new attempt may
        /// be kept, so these stay superseded.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        closed: Vec<String>,
    },
    /// Everything older, folded: steps up to `done_through` are trained,
    /// `consumed` groups will never be served again, and `reused` groups were
    /// served (at trained steps) or expired but are still held.
    Snapshot {
        done_through: u64,
        consumed: Vec<GroupRef>,
        #[serde(default)]
        reused: Vec<Reused>,
        /// Groups dropped as stale before they were ever served whose task
        /// no other attempt has completed and been trained on yet: the task
        /// was issued again, so its rows are skipped and its next attempt
        /// is kept.
        #[serde(default)]
        stale: Vec<GroupRef>,
        /// Every data set epoch up to this one is closed: a row of such an
        /// epoch whose task `consumed` does not name is a late copy (the
        /// consumed tasks of closed epochs are forgotten once their rows
        /// are deleted).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        closed_epoch: Option<u64>,
    },
}

/// A held group's serving history folded into a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reused {
    pub group: GroupRef,
    /// Times served at steps the snapshot folded (not counting the `Served`
    /// records kept after it).
    pub serves: u32,
    pub expired: bool,
}

fn encode_line(record: &Record) -> Result<Vec<u8>, BufferError> {
    let json = serde_json::to_string(record).map_err(BufferError::StateLogEncode)?;
    Ok(format!("{:08x} {json}\n", crc32fast::hash(json.as_bytes())).into_bytes())
}

/// Parses log bytes: the records of every complete valid line, the length
/// of that valid prefix, and why parsing stopped early (if it did). Never
/// panics.
pub fn decode_log(bytes: &[u8]) -> (Vec<Record>, u64, Option<String>) {
    let mut records = Vec::new();
    let mut pos = 0usize;
    while pos < bytes.len() {
        let Some(nl) = bytes[pos..].iter().position(|b| *b == b'\n') else {
            return (
                records,
                pos as u64,
                Some(format!("torn line at byte {pos}")),
            );
        };
        let line = &bytes[pos..pos + nl];
        let parsed = std::str::from_utf8(line)
            .ok()
            .and_then(|l| l.split_once(' '))
            .and_then(|(crc, json)| {
                let crc = u32::from_str_radix(crc, 16).ok()?;
                (crc32fast::hash(json.as_bytes()) == crc).then_some(json)
            })
            .and_then(|json| serde_json::from_str::<Record>(json).ok());
        match parsed {
            Some(r) => records.push(r),
            None => return (records, pos as u64, Some(format!("bad line at byte {pos}"))),
        }
        pos += nl + 1;
    }
    (records, pos as u64, None)
}

pub struct StateLog {
    dir: PathBuf,
    path: PathBuf,
    file: File,
    len: u64,
    /// Bytes of the leading snapshot (what the last compaction wrote):
    /// compaction is due when the log has grown past it by
    /// `state_log_compact_bytes`, so a snapshot larger than that is not
    /// rewritten at every append.
    base: u64,
    /// A failed append left bytes past `len` that could not be cut off yet:
    /// the next append cuts them first (a line after garbage would be lost
    /// on the next open, which stops at the first bad line).
    torn: bool,
    fsync: FsyncPolicy,
}

impl StateLog {
    /// Opens (or creates) the log in `dir` and returns its records. A torn
    /// or garbled tail (a crash mid-append) is cut off.
    pub fn open(dir: &Path, fsync: FsyncPolicy) -> Result<(Self, Vec<Record>), BufferError> {
        fs::create_dir_all(dir).map_err(|e| BufferError::io("create directory", dir, e))?;
        let path = dir.join(STATE_LOG);
        let (mut records, mut tail) = (Vec::new(), None);
        let (file, kept) = asyncrl_common::linelog::open_checked(&path, |bytes| {
            let (decoded, valid, why) = decode_log(bytes);
            (records, tail) = (decoded, why);
            valid as usize
        })
        .map_err(|e| BufferError::io("open", &path, e))?;
        if let Some(reason) = tail {
            tracing::warn!(path = %path.display(), reason, "the served log had a torn or bad tail (crash mid-append)");
        }
        let valid = kept.len() as u64;
        sync_dir(dir)?;
        let base = match records.first() {
            Some(first @ Record::Snapshot { .. }) => encode_line(first)?.len() as u64,
            _ => 0,
        };
        Ok((
            Self {
                dir: dir.to_owned(),
                path,
                file,
                len: valid,
                base: base.min(valid),
                torn: false,
                fsync,
            },
            records,
        ))
    }

    /// Bytes in the file.
    pub fn bytes(&self) -> u64 {
        self.len
    }

    /// Bytes appended after the leading snapshot (the whole file when it
    /// has none): what compaction would fold.
    pub fn growth(&self) -> u64 {
        self.len - self.base
    }

    /// Appends records with one write and (per the fsync policy) one fsync.
    pub fn append(&mut self, records: &[Record]) -> Result<(), BufferError> {
        if records.is_empty() {
            return Ok(());
        }
        let mut bytes = Vec::new();
        for r in records {
            bytes.extend_from_slice(&encode_line(r)?);
        }
        if self.torn {
            self.file
                .set_len(self.len)
                .map_err(|e| BufferError::io("cut a failed append off", &self.path, e))?;
            self.torn = false;
        }
        let written = self.file.write_all(&bytes).and_then(|()| match self.fsync {
            FsyncPolicy::Always => self.file.sync_data(),
            FsyncPolicy::Never => Ok(()),
        });
        if let Err(e) = written {
            // Not durable, so not decided: cut it off (the file is opened
            // for appending, so the next write lands at the cut).
            self.torn = self.file.set_len(self.len).is_err();
            return Err(BufferError::io("append to", &self.path, e));
        }
        self.len += bytes.len() as u64;
        Ok(())
    }

    /// Replaces the whole log by `records`, atomically.
    pub fn rewrite(&mut self, records: &[Record]) -> Result<(), BufferError> {
        let tmp = self.dir.join(format!("{STATE_LOG}.tmp"));
        let mut bytes = Vec::new();
        let mut base = 0;
        for r in records {
            bytes.extend_from_slice(&encode_line(r)?);
            if base == 0 && matches!(r, Record::Snapshot { .. }) {
                base = bytes.len() as u64;
            }
        }
        // Opened for appending before the rename: the handle follows the
        // file, so no append can go to the replaced one.
        let _ = fs::remove_file(&tmp);
        let written = OpenOptions::new()
            .append(true)
            .create_new(true)
            .open(&tmp)
            .and_then(|mut f| {
                f.write_all(&bytes)?;
                f.sync_all()?;
                Ok(f)
            })
            .map_err(|e| BufferError::io("write", &tmp, e));
        let file = match written {
            Ok(f) => f,
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                return Err(e);
            }
        };
        fs::rename(&tmp, &self.path).map_err(|e| BufferError::io("rename", &tmp, e))?;
        self.file = file;
        self.len = bytes.len() as u64;
        self.base = base;
        self.torn = false;
        sync_dir(&self.dir)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(i: u32) -> GroupRef {
        GroupRef {
            task: format!("task-{i}"),
            group: format!("lease-{i}"),
        }
    }

    fn records() -> Vec<Record> {
        vec![
            Record::Served {
                step: 1,
                version: 0,
                eta: 2,
                groups: vec![g(1), g(2)],
                unix_ms: 5,
                trained_through: None,
            },
            Record::Dropped {
                group: g(3),
                reason: DropReason::Stale,
                trajectories: 4,
                version: 9,
                closed: vec!["g-5".into()],
            },
            Record::Snapshot {
                done_through: 4,
                consumed: vec![g(7)],
                reused: vec![Reused {
                    group: g(8),
                    serves: 1,
                    expired: false,
                }],
                stale: vec![g(9)],
                closed_epoch: Some(3),
            },
        ]
    }

    #[test]
    fn append_reopen_and_torn_tail() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, back) = StateLog::open(dir.path(), FsyncPolicy::Always).unwrap();
        assert!(back.is_empty());
        log.append(&records()[..2]).unwrap();
        log.append(&records()[2..]).unwrap();
        let full = log.bytes();
        drop(log);
        let (_, back) = StateLog::open(dir.path(), FsyncPolicy::Always).unwrap();
        assert_eq!(back, records());
        // A crash mid-append: half a line at the end.
        let path = dir.path().join(STATE_LOG);
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(b"0badc0de {\"kind\":\"ser").unwrap();
        let (mut log, back) = StateLog::open(dir.path(), FsyncPolicy::Never).unwrap();
        assert_eq!(back, records());
        assert_eq!(fs::metadata(&path).unwrap().len(), full);
        log.append(&records()[..1]).unwrap();
        drop(log);
        let (_, back) = StateLog::open(dir.path(), FsyncPolicy::Never).unwrap();
        assert_eq!(back.len(), 4);
    }

    #[test]
    fn every_cut_keeps_the_complete_lines() {
        let mut bytes = Vec::new();
        let mut ends = vec![0];
        for r in records() {
            bytes.extend_from_slice(&encode_line(&r).unwrap());
            ends.push(bytes.len());
        }
        for cut in 0..=bytes.len() {
            let (recs, valid, tail) = decode_log(&bytes[..cut]);
            let n = ends.iter().skip(1).filter(|e| **e <= cut).count();
            assert_eq!(recs[..], records()[..n]);
            assert_eq!(valid as usize, ends[n]);
            assert_eq!(tail.is_some(), cut != ends[n]);
        }
        // A flipped byte inside a line stops the scan there.
        let mut bad = bytes.clone();
        bad[ends[1] + 20] ^= 1;
        let (recs, valid, tail) = decode_log(&bad);
        assert_eq!(recs.len(), 1);
        assert_eq!(valid as usize, ends[1]);
        assert!(tail.is_some());
    }

    #[test]
    fn rewrite_replaces_atomically() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, _) = StateLog::open(dir.path(), FsyncPolicy::Always).unwrap();
        log.append(&records()).unwrap();
        log.rewrite(&records()[2..]).unwrap();
        log.append(&records()[..1]).unwrap();
        drop(log);
        let (_, back) = StateLog::open(dir.path(), FsyncPolicy::Always).unwrap();
        assert_eq!(back, vec![records()[2].clone(), records()[0].clone()]);
        assert!(!dir.path().join(format!("{STATE_LOG}.tmp")).exists());
    }

    /// Compaction is due on growth past the last snapshot, not on the
    /// file's size: a snapshot larger than the threshold (a long run's
    /// history) is not rewritten at every append.
    #[test]
    fn growth_counts_from_the_leading_snapshot_across_rewrites_and_reopens() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, _) = StateLog::open(dir.path(), FsyncPolicy::Never).unwrap();
        log.append(&records()[..2]).unwrap();
        // No snapshot yet: everything is growth.
        assert_eq!(log.growth(), log.bytes());
        let snapshot = &records()[2..];
        let snapshot_bytes = encode_line(&snapshot[0]).unwrap().len() as u64;
        log.rewrite(snapshot).unwrap();
        assert_eq!(log.bytes(), snapshot_bytes);
        assert_eq!(log.growth(), 0);
        log.append(&records()[..1]).unwrap();
        let appended = encode_line(&records()[0]).unwrap().len() as u64;
        assert_eq!(log.growth(), appended);
        drop(log);
        // Reopened: the leading snapshot is still not growth.
        let (log, back) = StateLog::open(dir.path(), FsyncPolicy::Never).unwrap();
        assert_eq!(back.len(), 2);
        assert_eq!(log.bytes(), snapshot_bytes + appended);
        assert_eq!(log.growth(), appended);
    }

    proptest::proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..1024)) {
            let (_, valid, _) = decode_log(&bytes);
            proptest::prop_assert!(valid as usize <= bytes.len());
        }
    }
}
