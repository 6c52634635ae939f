//! The learner's own durable copy of the batches it holds but has not yet
//! published a version for (`<checkpoint_dir>/pending-batches/`).
//!
//! The buffer takes a request for step `s` as "every step below `s` is
//! trained" and stops replaying their groups (docs/contracts.md, Serving).
//! The learner asks for step `s + 1` while step `s` trains (and while its
//! weights upload), so from then on only this copy can give step `s` its
//! groups again after a crash. Each batch is written (fsynced, then renamed
//! into place) before the request for the next step goes out, and deleted
//! once the version its step produces is announced. A restarted learner
//! trains a step from its pending copy when it has one, so the step gets the
//! same groups, as the buffer's replay would give it.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use bytes::Bytes;

use crate::checkpoint::{sync_dir, write_synced};

/// The folder of pending batches, one Arrow IPC stream file per step.
#[derive(Debug, Clone)]
pub struct PendingBatches {
    dir: PathBuf,
}

const PREFIX: &str = "batch-step-";
const SUFFIX: &str = ".arrow";

fn file_name(step: u64) -> String {
    format!("{PREFIX}{step:08}{SUFFIX}")
}

fn parse_step(name: &str) -> Option<u64> {
    name.strip_prefix(PREFIX)?
        .strip_suffix(SUFFIX)?
        .parse()
        .ok()
}

impl PendingBatches {
    pub fn new(checkpoint_dir: &Path) -> Self {
        Self {
            dir: checkpoint_dir.join("pending-batches"),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Stores the batch of `step` durably.
    pub async fn save(&self, step: u64, ipc: Bytes) -> anyhow::Result<()> {
        self.off_runtime("writer", move |p| p.save_blocking(step, &ipc))
            .await
    }

    /// The stored batch of `step`, if any.
    pub async fn load(&self, step: u64) -> anyhow::Result<Option<Bytes>> {
        self.off_runtime("reader", move |p| p.load_blocking(step))
            .await
    }

    /// Deletes the batches of steps `≤ through` (their versions are
    /// announced) and temporary files of crashed writes.
    pub async fn remove_through(&self, through: u64) -> anyhow::Result<usize> {
        self.off_runtime("cleaner", move |p| p.remove_through_blocking(through))
            .await
    }

    /// Runs file work on a blocking thread (async code never blocks the
    /// runtime).
    async fn off_runtime<T: Send + 'static>(
        &self,
        what: &str,
        work: impl FnOnce(&Self) -> anyhow::Result<T> + Send + 'static,
    ) -> anyhow::Result<T> {
        let this = self.clone();
        tokio::task::spawn_blocking(move || work(&this))
            .await
            .with_context(|| format!("the pending-batch {what} panicked"))?
    }

    fn save_blocking(&self, step: u64, ipc: &[u8]) -> anyhow::Result<()> {
        std::fs::create_dir_all(&self.dir)
            .with_context(|| format!("cannot create {}", self.dir.display()))?;
        let path = self.dir.join(file_name(step));
        let tmp = self
            .dir
            .join(format!(".{}.tmp-{}", file_name(step), std::process::id()));
        write_synced(&tmp, ipc)?;
        std::fs::rename(&tmp, &path)
            .with_context(|| format!("cannot rename {} into place", tmp.display()))?;
        sync_dir(&self.dir)?;
        Ok(())
    }

    fn load_blocking(&self, step: u64) -> anyhow::Result<Option<Bytes>> {
        let path = self.dir.join(file_name(step));
        match std::fs::read(&path) {
            Ok(b) => Ok(Some(Bytes::from(b))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("cannot read {}", path.display())),
        }
    }

    fn remove_through_blocking(&self, through: u64) -> anyhow::Result<usize> {
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(e) => {
                return Err(e).with_context(|| format!("cannot list {}", self.dir.display()));
            }
        };
        let own = format!(".tmp-{}", std::process::id());
        let mut removed = 0;
        for e in entries {
            let e = e.with_context(|| format!("cannot list {}", self.dir.display()))?;
            let name = e.file_name().to_string_lossy().into_owned();
            let done = parse_step(&name).is_some_and(|s| s <= through);
            let stray = name.contains(".tmp-") && !name.ends_with(&own);
            if done || stray {
                std::fs::remove_file(e.path())
                    .with_context(|| format!("cannot delete {}", e.path().display()))?;
                removed += 1;
            }
        }
        Ok(removed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn saved_batches_load_back_until_their_step_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let p = PendingBatches::new(dir.path());
        assert_eq!(p.load(3).await.unwrap(), None);
        assert_eq!(p.remove_through(10).await.unwrap(), 0, "no folder yet");
        p.save(3, Bytes::from_static(b"three")).await.unwrap();
        p.save(4, Bytes::from_static(b"four")).await.unwrap();
        std::fs::write(p.dir().join(".batch-step-00000005.arrow.tmp-1"), b"x").unwrap();
        assert_eq!(p.load(3).await.unwrap().as_deref(), Some(&b"three"[..]));
        assert_eq!(
            p.remove_through(3).await.unwrap(),
            2,
            "step 3 and the stray"
        );
        assert_eq!(p.load(3).await.unwrap(), None);
        assert_eq!(p.load(4).await.unwrap().as_deref(), Some(&b"four"[..]));
    }
}
