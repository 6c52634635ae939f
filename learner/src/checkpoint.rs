//! Learner checkpoints on disk.
//!
//! A checkpoint is a directory `step-00000042/` holding `model.safetensors`
//! (the policy weights), `optimizer.safetensors` (AdamW moments) and
//! `meta.json` (step, version, optimizer step, RNG state, the sha256 of both
//! files). It is written under a temporary name, every file is fsynced, and
//! only then renamed into place (and the parent directory fsynced), so a
//! crash mid-write never leaves a half checkpoint that a restart could pick
//! up. Loading takes the newest directory whose meta parses and whose files
//! match their recorded sha256; anything else is skipped with a warning.
//!
//! A write that fails (a full volume, any I/O error) removes what it had
//! written and returns the error; the learner counts it
//! ([`failure_reason`]) and trains on, and its last good checkpoint stays
//! the resume point. What a crash cut off (`*.tmp-*` folders, the optimizer
//! state's temporary file, the torch engine's `.step-*.tmp`) is removed at
//! start by [`remove_interrupted`].

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint I/O on {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("checkpoint {path} is invalid: {reason}")]
    Invalid { path: PathBuf, reason: String },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_owned(),
        source,
    }
}

pub const MODEL_FILE: &str = "model.safetensors";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const META_FILE: &str = "meta.json";

/// What a checkpoint records besides the tensors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointMeta {
    pub format: u32,
    /// Learner steps completed.
    pub step: u64,
    /// Policy version of the saved weights.
    pub version: i32,
    pub optimizer_step: u64,
    /// State of the learner's mini-batch shuffling RNG.
    pub rng_state: u64,
    pub created_at_unix_ms: i64,
    pub model_sha256: String,
    pub optimizer_sha256: String,
}

/// A checkpoint read back from disk.
#[derive(Debug)]
pub struct LoadedCheckpoint {
    pub dir: PathBuf,
    pub meta: CheckpointMeta,
    pub model: Vec<u8>,
    pub optimizer: Vec<u8>,
}

use asyncrl_common::sha256_hex;

pub(crate) fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let mut f = fs::File::create(path).map_err(io(path))?;
    f.write_all(bytes).map_err(io(path))?;
    f.sync_all().map_err(io(path))
}

pub(crate) fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io(dir))
}

fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// The step of a complete checkpoint directory name.
fn parse_step(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    (digits.len() == 8 && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
}

/// Writes a checkpoint atomically and returns its directory.
pub fn write(
    root: &Path,
    meta: &mut CheckpointMeta,
    model: &[u8],
    optimizer: &[u8],
) -> Result<PathBuf, CheckpointError> {
    fs::create_dir_all(root).map_err(io(root))?;
    let name = step_dir_name(meta.step);
    let tmp = root.join(format!("{name}.tmp-{}", std::process::id()));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
    }
    fs::create_dir(&tmp).map_err(io(&tmp))?;
    let dest = root.join(&name);
    let written = (|| {
        meta.model_sha256 = sha256_hex(model);
        meta.optimizer_sha256 = sha256_hex(optimizer);
        write_synced(&tmp.join(MODEL_FILE), model)?;
        write_synced(&tmp.join(OPTIMIZER_FILE), optimizer)?;
        let meta_json = serde_json::to_vec_pretty(meta).map_err(|e| CheckpointError::Invalid {
            path: tmp.clone(),
            reason: e.to_string(),
        })?;
        write_synced(&tmp.join(META_FILE), &meta_json)?;
        sync_dir(&tmp)?;
        if dest.exists() {
            // A checkpoint of the same step (written before a crash): replace it.
            fs::remove_dir_all(&dest).map_err(io(&dest))?;
        }
        fs::rename(&tmp, &dest).map_err(io(&dest))
    })();
    if let Err(e) = written {
        // Give the space back (a full volume is the likely cause).
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }
    sync_dir(root)?;
    Ok(dest)
}

/// Whether `name` is something a checkpoint write leaves only while it
/// runs: `step-NNNNNNNN.tmp-PID` (this module), `.step-NNNNNNNN.tmp` (the
/// torch engine), `.optimizer-PID-MS.safetensors.tmp` (the optimizer
/// state on its way into a checkpoint).
fn interrupted_write(name: &str) -> bool {
    (name.starts_with("step-") && name.contains(".tmp-"))
        || (name.starts_with(".step-") && name.ends_with(".tmp"))
        || (name.starts_with(".optimizer-") && name.ends_with(".safetensors.tmp"))
}

/// Removes the checkpoint writes a crash cut off under `root` (see
/// [`interrupted_write`]); run at start, before anything writes there.
/// Returns what it removed (each also logged); what it cannot remove is
/// logged and left.
pub fn remove_interrupted(root: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(root) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for e in entries.filter_map(|e| e.ok()) {
        if !e.file_name().to_str().is_some_and(interrupted_write) {
            continue;
        }
        let path = e.path();
        let result = if e.file_type().is_ok_and(|t| t.is_dir()) {
            fs::remove_dir_all(&path)
        } else {
            fs::remove_file(&path)
        };
        match result {
            Ok(()) => {
                tracing::info!(path = %path.display(), "removed a checkpoint write that a crash cut off");
                removed.push(path);
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot remove a checkpoint write that a crash cut off")
            }
        }
    }
    removed.sort();
    removed
}

/// The `reason` label of a failed checkpoint write: the OS error found in
/// `err`'s causes (`no_space`: ENOSPC or EDQUOT; `read_only`: EROFS;
/// `permission`: EACCES or EPERM; `io`: any other), or `other`.
pub fn failure_reason(err: &(dyn std::error::Error + 'static)) -> &'static str {
    let mut cause = Some(err);
    while let Some(e) = cause {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            return match io.raw_os_error() {
                Some(libc::ENOSPC | libc::EDQUOT) => "no_space",
                Some(libc::EROFS) => "read_only",
                Some(libc::EACCES | libc::EPERM) => "permission",
                _ => "io",
            };
        }
        cause = e.source();
    }
    "other"
}

/// Reads a checkpoint directory and checks its sha256s; without
/// `optimizer`, the optimizer file is neither read nor checked (and
/// `LoadedCheckpoint::optimizer` is empty).
fn read_dir_checked(dir: &Path, optimizer: bool) -> Result<LoadedCheckpoint, CheckpointError> {
    let invalid = |reason: String| CheckpointError::Invalid {
        path: dir.to_owned(),
        reason,
    };
    let meta_bytes = fs::read(dir.join(META_FILE)).map_err(io(dir))?;
    let meta: CheckpointMeta =
        serde_json::from_slice(&meta_bytes).map_err(|e| invalid(format!("meta.json: {e}")))?;
    let model = fs::read(dir.join(MODEL_FILE)).map_err(io(dir))?;
    if sha256_hex(&model) != meta.model_sha256 {
        return Err(invalid(
            "model.safetensors does not match its sha256".into(),
        ));
    }
    let optimizer = if optimizer {
        fs::read(dir.join(OPTIMIZER_FILE)).map_err(io(dir))?
    } else {
        return Ok(LoadedCheckpoint {
            dir: dir.to_owned(),
            meta,
            model,
            optimizer: Vec::new(),
        });
    };
    if sha256_hex(&optimizer) != meta.optimizer_sha256 {
        return Err(invalid(
            "optimizer.safetensors does not match its sha256".into(),
        ));
    }
    Ok(LoadedCheckpoint {
        dir: dir.to_owned(),
        meta,
        model,
        optimizer,
    })
}

/// The weights of one checkpoint directory (`step-NNNNNNNN`), checked
/// against their sha256; the optimizer state is not read (`asyncrl eval`).
pub fn read_weights(dir: &Path) -> Result<LoadedCheckpoint, CheckpointError> {
    read_dir_checked(dir, false)
}

/// Complete checkpoint directories under `root`, newest first.
/// The `step-NNNNNNNN` folders under `root`, newest first (whatever engine
/// wrote them; each engine checks its own for completeness).
pub fn step_dirs(root: &Path) -> Result<Vec<(u64, PathBuf)>, CheckpointError> {
    let entries = match fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => {
            return Err(CheckpointError::Io {
                path: root.to_owned(),
                source: e,
            });
        }
    };
    let mut dirs: Vec<(u64, PathBuf)> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| parse_step(e.file_name().to_str()?).map(|s| (s, e.path())))
        .collect();
    dirs.sort_by_key(|d| std::cmp::Reverse(d.0));
    Ok(dirs)
}

/// The newest complete, intact checkpoint, if any.
pub fn load_latest(root: &Path) -> Result<Option<LoadedCheckpoint>, CheckpointError> {
    newest(root, true)
}

/// [`load_latest`] without the optimizer state (see [`read_weights`]).
pub fn latest_weights(root: &Path) -> Result<Option<LoadedCheckpoint>, CheckpointError> {
    newest(root, false)
}

fn newest(root: &Path, optimizer: bool) -> Result<Option<LoadedCheckpoint>, CheckpointError> {
    for (_, dir) in step_dirs(root)? {
        match read_dir_checked(&dir, optimizer) {
            Ok(c) => return Ok(Some(c)),
            Err(e) => {
                tracing::warn!(checkpoint = %dir.display(), error = %e, "skipping a damaged checkpoint")
            }
        }
    }
    Ok(None)
}

/// Deletes all but the `keep` newest complete checkpoints, and leftover
/// temporary directories of other processes (crashed writes).
pub fn prune(root: &Path, keep: usize) -> Result<(), CheckpointError> {
    for (_, dir) in step_dirs(root)?.into_iter().skip(keep.max(1)) {
        fs::remove_dir_all(&dir).map_err(io(&dir))?;
    }
    let own = format!(".tmp-{}", std::process::id());
    if let Ok(entries) = fs::read_dir(root) {
        for e in entries.filter_map(|e| e.ok()) {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("step-") && name.contains(".tmp-") && !name.ends_with(&own) {
                let _ = fs::remove_dir_all(e.path());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(step: u64) -> CheckpointMeta {
        CheckpointMeta {
            format: 1,
            step,
            version: step as i32,
            optimizer_step: step,
            rng_state: 42 + step,
            created_at_unix_ms: 0,
            model_sha256: String::new(),
            optimizer_sha256: String::new(),
        }
    }

    #[test]
    fn write_load_prune() {
        let dir = tempfile::tempdir().unwrap();
        assert!(load_latest(dir.path()).unwrap().is_none());
        for step in [1u64, 2, 3] {
            write(dir.path(), &mut meta(step), &[step as u8; 10], b"opt").unwrap();
        }
        let latest = load_latest(dir.path()).unwrap().unwrap();
        assert_eq!(latest.meta.step, 3);
        assert_eq!(latest.model, vec![3u8; 10]);
        prune(dir.path(), 2).unwrap();
        let left: Vec<u64> = step_dirs(dir.path())
            .unwrap()
            .into_iter()
            .map(|d| d.0)
            .collect();
        assert_eq!(left, vec![3, 2]);
    }

    #[test]
    fn half_written_and_damaged_checkpoints_are_skipped() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), &mut meta(4), b"good", b"opt").unwrap();
        // A crash mid-write leaves a temporary directory: never picked up.
        let tmp = dir.path().join("step-00000005.tmp-999999");
        fs::create_dir(&tmp).unwrap();
        fs::write(tmp.join(MODEL_FILE), b"half").unwrap();
        // A complete-looking directory with a corrupt file: skipped.
        write(dir.path(), &mut meta(6), b"bad!", b"opt").unwrap();
        fs::write(
            dir.path().join("step-00000006").join(MODEL_FILE),
            b"flipped",
        )
        .unwrap();
        // One without meta: skipped.
        fs::create_dir(dir.path().join("step-00000007")).unwrap();
        let latest = load_latest(dir.path()).unwrap().unwrap();
        assert_eq!(latest.meta.step, 4);
        assert_eq!(latest.model, b"good");
        prune(dir.path(), 5).unwrap();
        assert!(!tmp.exists(), "a crashed write's temp dir is cleaned up");
    }

    #[test]
    fn interrupted_writes_are_removed_at_start_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        write(root, &mut meta(4), b"good", b"opt").unwrap();
        let cut_off = [
            "step-00000005.tmp-999999",
            ".step-00000006.tmp",
            ".optimizer-999999-1700000000000.safetensors.tmp",
        ];
        fs::create_dir(root.join(cut_off[0])).unwrap();
        fs::write(root.join(cut_off[0]).join(MODEL_FILE), b"half").unwrap();
        fs::create_dir_all(root.join(cut_off[1]).join("shards")).unwrap();
        fs::write(root.join(cut_off[2]), b"half").unwrap();
        let kept = ["step-00000004", "pending-batches", "notes.txt", ".step-x"];
        fs::create_dir(root.join("pending-batches")).unwrap();
        fs::write(root.join("pending-batches/batch-step-00000005.arrow"), b"b").unwrap();
        fs::write(root.join("notes.txt"), b"n").unwrap();
        fs::write(root.join(".step-x"), b"n").unwrap();
        let removed = remove_interrupted(root);
        let mut want: Vec<PathBuf> = cut_off.iter().map(|n| root.join(n)).collect();
        want.sort();
        assert_eq!(removed, want);
        for n in cut_off {
            assert!(!root.join(n).exists(), "{n} is left");
        }
        for n in kept {
            assert!(root.join(n).exists(), "{n} was removed");
        }
        assert_eq!(load_latest(root).unwrap().unwrap().meta.step, 4);
        // A missing folder has nothing to remove.
        assert!(remove_interrupted(&root.join("absent")).is_empty());
    }

    #[test]
    fn a_failed_write_leaves_nothing_and_names_the_path_and_the_os_error() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        write(root, &mut meta(1), b"good", b"opt").unwrap();
        // Step 2's folder is taken by a file (root ignores permissions, so
        // this is how a test makes a write fail).
        fs::write(root.join("step-00000002"), b"in the way").unwrap();
        let err = write(root, &mut meta(2), b"new", b"opt").expect_err("the write fails");
        let line = err.to_string();
        assert!(
            line.contains(&root.join("step-00000002").display().to_string()),
            "{line}"
        );
        assert!(line.contains("os error"), "{line}");
        assert_eq!(failure_reason(&err), "io");
        let left: Vec<String> = fs::read_dir(root)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".tmp"))
            .collect();
        assert!(left.is_empty(), "the failed write left {left:?}");
        assert_eq!(load_latest(root).unwrap().unwrap().meta.step, 1);
    }

    #[test]
    fn failure_reasons_come_from_the_os_error() {
        let reason = |errno: i32| {
            let e = CheckpointError::Io {
                path: PathBuf::from("/ckpt/step-00000002.tmp-1/model.safetensors"),
                source: std::io::Error::from_raw_os_error(errno),
            };
            failure_reason(&e)
        };
        assert_eq!(reason(libc::ENOSPC), "no_space");
        assert_eq!(reason(libc::EDQUOT), "no_space");
        assert_eq!(reason(libc::EROFS), "read_only");
        assert_eq!(reason(libc::EACCES), "permission");
        assert_eq!(reason(libc::EIO), "io");
        let e = CheckpointError::Io {
            path: PathBuf::from("/ckpt/x"),
            source: std::io::Error::from_raw_os_error(libc::ENOSPC),
        };
        assert_eq!(
            e.to_string(),
            "checkpoint I/O on /ckpt/x: No space left on device (os error 28)"
        );
        let invalid = CheckpointError::Invalid {
            path: PathBuf::from("/ckpt/x"),
            reason: "r".into(),
        };
        assert_eq!(failure_reason(&invalid), "other");
    }

    #[test]
    fn names() {
        assert_eq!(parse_step("step-00000042"), Some(42));
        assert_eq!(parse_step("step-00000042.tmp-7"), None);
        assert_eq!(parse_step("step-42"), None);
    }
}
