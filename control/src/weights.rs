//! Weights of a policy version: the object `policy-v<version>.safetensors`
//! in the `WEIGHTS` object store and its announcement in the KV key
//! `policy.version`. The learner publishes, workers (and a restarted
//! learner) fetch; both go through here.
//!
//! Architecture invariant: a version is announced only after its object is
//! completely stored (the announcement carries the sha256 the store
//! computed), and fetched bytes are checked against that sha256.
//!
//! The `shared_path` transport keeps the same guarantees without the bus
//! carrying the bytes: the learner writes the version as a Hugging Face
//! folder `policy-vNNNNNNNN` under a root every worker mounts (under a
//! temporary name, renamed complete, with `sha256.json`), then announces
//! the folder and each file's sha256; readers ([`read_folder`]) check every
//! file against the announcement, so a half-written or altered folder is
//! never loaded. Old folders are pruned as old objects are.

use asyncrl_common::unix_ms;
use asyncrl_protos::subjects::{
    CONTROL_BUCKET, POLICY_VERSION_KEY, WEIGHTS_BUCKET, WEIGHTS_FORMAT, WEIGHTS_FORMAT_FOLDER,
    weights_folder_version, weights_object_name, weights_object_version,
};
use asyncrl_protos::v1::WeightFile;
use asyncrl_protos::{Message, WeightAnnouncement};
use std::sync::Arc;

use asyncrl_transport::{Bus, KvBucket, ObjectStore, TransportError};
use bytes::Bytes;

/// The file of a version folder that lists each weight file's sha256 (the
/// torch engine's `SHA256_FILE`).
pub const FOLDER_SHA256_FILE: &str = "sha256.json";

#[derive(Debug, thiserror::Error)]
pub enum FolderError {
    #[error("weights folder {path}: {source}")]
    Io {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("weights folder {folder}: {reason}")]
    Invalid { folder: String, reason: String },
    #[error(
        "weights file {path}: sha256 {actual} (size {size}), the announcement says {expected} (size {expected_size})"
    )]
    Mismatch {
        path: std::path::PathBuf,
        expected: String,
        actual: String,
        size: u64,
        expected_size: u64,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error("KV key `{POLICY_VERSION_KEY}` does not decode as a WeightAnnouncement: {0}")]
    Decode(#[source] prost::DecodeError),
}

/// Opens the object store and the KV bucket the functions below take (once:
/// each open is a request to the server).
pub async fn open(
    bus: &dyn Bus,
) -> Result<(Arc<dyn ObjectStore>, Arc<dyn KvBucket>), TransportError> {
    Ok((
        bus.object_store(WEIGHTS_BUCKET).await?,
        bus.kv(CONTROL_BUCKET).await?,
    ))
}

/// Who announces: the learner session and the epoch of its lease
/// ([`crate::lease`]). The default (no session, epoch 0) is a writer
/// outside any lease (tests, benches), which any leased learner fences.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fence {
    pub session: String,
    pub epoch: u64,
}

/// Why an announcement was not written.
#[derive(Debug, thiserror::Error)]
pub enum AnnounceError {
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The current announcement comes from a later lease epoch: this
    /// writer was fenced by another learner.
    #[error(
        "version {version} was not announced: learner session {session} (lease epoch {epoch}) announced version {their_version} after this learner was fenced (lease epoch {ours})"
    )]
    Fenced {
        version: i32,
        session: String,
        epoch: u64,
        their_version: i32,
        ours: u64,
    },
    #[error("KV key `{POLICY_VERSION_KEY}` kept changing under compare-and-set")]
    Contended,
}

impl AnnounceError {
    /// Worth retrying (the server, not a fence).
    pub fn is_transient(&self) -> bool {
        match self {
            AnnounceError::Transport(e) => e.is_transient(),
            AnnounceError::Contended => true,
            _ => false,
        }
    }
}

/// Stores `weights` as the object of `version` and then announces it in
/// `policy.version` (trained `step`). Returns the announcement written.
pub async fn publish(
    store: &dyn ObjectStore,
    kv: &dyn KvBucket,
    version: i32,
    step: u64,
    weights: Bytes,
    fence: &Fence,
) -> Result<WeightAnnouncement, AnnounceError> {
    let name = weights_object_name(version);
    let info = store.put(&name, weights).await?;
    let announcement = WeightAnnouncement {
        version,
        object_name: name,
        sha256: info.sha256,
        byte_size: info.size,
        format: WEIGHTS_FORMAT.into(),
        published_at_unix_ms: unix_ms(),
        step,
        learner_session: fence.session.clone(),
        lease_epoch: fence.epoch,
        ..Default::default()
    };
    announce(kv, &announcement).await?;
    Ok(announcement)
}

/// The weight files of a complete version folder, as its `sha256.json`
/// lists them (with their sizes on disk).
pub fn folder_files(dir: &std::path::Path) -> Result<Vec<WeightFile>, FolderError> {
    let sums_path = dir.join(FOLDER_SHA256_FILE);
    let text = std::fs::read_to_string(&sums_path).map_err(|source| FolderError::Io {
        path: sums_path.clone(),
        source,
    })?;
    let sums: std::collections::BTreeMap<String, String> =
        parse_sums(&text).ok_or_else(|| FolderError::Invalid {
            folder: dir.display().to_string(),
            reason: format!("{FOLDER_SHA256_FILE} is not a JSON object of file names to sha256s"),
        })?;
    if sums.is_empty() {
        return Err(FolderError::Invalid {
            folder: dir.display().to_string(),
            reason: format!("{FOLDER_SHA256_FILE} lists no weight file"),
        });
    }
    sums.into_iter()
        .map(|(name, sha256)| {
            let path = dir.join(&name);
            let size = std::fs::metadata(&path)
                .map_err(|source| FolderError::Io { path, source })?
                .len();
            Ok(WeightFile {
                name,
                sha256,
                byte_size: size,
            })
        })
        .collect()
}

/// `{"file": "sha256", ...}` (the only shape `sha256.json` has).
fn parse_sums(text: &str) -> Option<std::collections::BTreeMap<String, String>> {
    let value: serde_json::Value = serde_json::from_str(text).ok()?;
    value
        .as_object()?
        .iter()
        .map(|(k, v)| Some((k.clone(), v.as_str()?.to_ascii_lowercase())))
        .collect()
}

/// Announces the complete version folder `dir` (trained `step`), with the
/// sha256 of each file. Returns the announcement written.
pub async fn publish_folder(
    kv: &dyn KvBucket,
    version: i32,
    step: u64,
    dir: &std::path::Path,
    fence: &Fence,
) -> Result<WeightAnnouncement, PublishFolderError> {
    let owned = dir.to_owned();
    let files = tokio::task::spawn_blocking(move || folder_files(&owned))
        .await
        .map_err(|e| FolderError::Io {
            path: dir.to_owned(),
            source: std::io::Error::other(e),
        })??;
    let announcement = WeightAnnouncement {
        version,
        object_name: String::new(),
        sha256: String::new(),
        byte_size: files.iter().map(|f| f.byte_size).sum(),
        format: WEIGHTS_FORMAT_FOLDER.into(),
        published_at_unix_ms: unix_ms(),
        step,
        folder: dir.display().to_string(),
        files,
        learner_session: fence.session.clone(),
        lease_epoch: fence.epoch,
    };
    announce(kv, &announcement).await?;
    Ok(announcement)
}

#[derive(Debug, thiserror::Error)]
pub enum PublishFolderError {
    #[error(transparent)]
    Folder(#[from] FolderError),
    #[error(transparent)]
    Announce(#[from] AnnounceError),
}

/// The path of every file an announcement lists (none may leave its
/// folder, and there must be at least one).
fn announced_paths(
    announcement: &WeightAnnouncement,
) -> Result<Vec<(&asyncrl_protos::v1::WeightFile, std::path::PathBuf)>, FolderError> {
    let folder = std::path::Path::new(&announcement.folder);
    if announcement.files.is_empty() {
        return Err(FolderError::Invalid {
            folder: announcement.folder.clone(),
            reason: "the announcement lists no file".into(),
        });
    }
    announcement
        .files
        .iter()
        .map(|f| {
            if f.name.contains('/') || f.name.contains("..") {
                return Err(FolderError::Invalid {
                    folder: announcement.folder.clone(),
                    reason: format!("file name {:?} leaves the folder", f.name),
                });
            }
            Ok((f, folder.join(&f.name)))
        })
        .collect()
}

fn check_file(
    f: &asyncrl_protos::v1::WeightFile,
    path: std::path::PathBuf,
    actual: String,
    size: u64,
) -> Result<(), FolderError> {
    if actual != f.sha256.to_ascii_lowercase() || size != f.byte_size {
        return Err(FolderError::Mismatch {
            path,
            expected: f.sha256.clone(),
            actual,
            size,
            expected_size: f.byte_size,
        });
    }
    Ok(())
}

/// Reads every file of an announced folder, each checked against its
/// announced sha256 and size (blocking: call it off the async runtime).
pub fn read_folder(announcement: &WeightAnnouncement) -> Result<Vec<(String, Bytes)>, FolderError> {
    announced_paths(announcement)?
        .into_iter()
        .map(|(f, path)| {
            let bytes = std::fs::read(&path).map_err(|source| FolderError::Io {
                path: path.clone(),
                source,
            })?;
            let actual = asyncrl_common::sha256_hex(&bytes);
            check_file(f, path, actual, bytes.len() as u64)?;
            Ok((f.name.clone(), Bytes::from(bytes)))
        })
        .collect()
}

/// Checks every file of an announced folder against its announced sha256
/// and size without holding it (an engine then loads the folder itself;
/// blocking: call it off the async runtime).
pub fn verify_folder(announcement: &WeightAnnouncement) -> Result<(), FolderError> {
    for (f, path) in announced_paths(announcement)? {
        let (actual, size) =
            asyncrl_common::sha256_hex_of_file(&path).map_err(|source| FolderError::Io {
                path: path.clone(),
                source,
            })?;
        check_file(f, path, actual, size)?;
    }
    Ok(())
}

/// Deletes the version folders `policy-vNNNNNNNN` of versions
/// `≤ newest − keep` under `root`, and writes that were cut off
/// (`.policy-v*.tmp` of versions `≤ newest`). A write of a version after
/// `newest` is left alone: the exporter may be writing it while `newest`
/// is published (the learner exports the next version during a
/// publication). Returns how many were deleted.
pub fn prune_folders(
    root: &std::path::Path,
    newest: i32,
    keep: usize,
) -> Result<usize, FolderError> {
    let entries = match std::fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(source) => {
            return Err(FolderError::Io {
                path: root.to_owned(),
                source,
            });
        }
    };
    let mut deleted = 0;
    for e in entries.filter_map(Result::ok) {
        let name = e.file_name().to_string_lossy().into_owned();
        let old = weights_folder_version(&name)
            .is_some_and(|v| i64::from(v) <= i64::from(newest) - keep as i64);
        let cut_off = name
            .strip_prefix('.')
            .and_then(|n| n.strip_suffix(".tmp"))
            .and_then(weights_folder_version)
            .is_some_and(|v| v <= newest);
        if old || cut_off {
            std::fs::remove_dir_all(e.path()).map_err(|source| FolderError::Io {
                path: e.path(),
                source,
            })?;
            deleted += 1;
        }
    }
    Ok(deleted)
}

/// Writes an announcement: a compare-and-set on the current one, refused
/// when that comes from a later lease epoch (this writer is fenced), and
/// no write when the same version with the same bytes is announced already
/// (a retry whose first write landed).
pub async fn announce(
    kv: &dyn KvBucket,
    announcement: &WeightAnnouncement,
) -> Result<(), AnnounceError> {
    let value = Bytes::from(announcement.encode_to_vec());
    let edited = crate::kv::edit(kv, POLICY_VERSION_KEY, 8, |entry| {
        let Some(entry) = entry else {
            return Ok(crate::kv::Change::Write(value.clone(), ()));
        };
        let Ok(current) = decode_announcement(&entry.value) else {
            // Not an announcement (garbage in the key): replaced.
            return Ok(crate::kv::Change::Write(value.clone(), ()));
        };
        if current.lease_epoch > announcement.lease_epoch {
            return Err(AnnounceError::Fenced {
                version: announcement.version,
                session: current.learner_session,
                epoch: current.lease_epoch,
                their_version: current.version,
                ours: announcement.lease_epoch,
            });
        }
        let same = current.version == announcement.version
            && current.sha256 == announcement.sha256
            && current.files == announcement.files
            && current.learner_session == announcement.learner_session;
        Ok(if same {
            crate::kv::Change::Keep(())
        } else {
            crate::kv::Change::Write(value.clone(), ())
        })
    })
    .await;
    match edited {
        Ok(_) => Ok(()),
        Err(crate::kv::EditError::Refused(e)) => Err(e),
        Err(crate::kv::EditError::Transport { source, .. }) => Err(source.into()),
        Err(crate::kv::EditError::Contended { .. }) => Err(AnnounceError::Contended),
    }
}

/// The current announcement (None before the first publication).
pub async fn announced(kv: &dyn KvBucket) -> Result<Option<WeightAnnouncement>, WeightsError> {
    match kv.get(POLICY_VERSION_KEY).await? {
        Some(entry) => decode_announcement(&entry.value).map(Some),
        None => Ok(None),
    }
}

/// Decodes the value of `policy.version`.
pub fn decode_announcement(value: &[u8]) -> Result<WeightAnnouncement, WeightsError> {
    WeightAnnouncement::decode(value).map_err(WeightsError::Decode)
}

/// The object an announcement names (announcements that leave it empty name
/// the version's default object).
pub fn object_name(announcement: &WeightAnnouncement) -> String {
    if announcement.object_name.is_empty() {
        weights_object_name(announcement.version)
    } else {
        announcement.object_name.clone()
    }
}

/// Fetches the announced weights, checked against the announced sha256.
pub async fn fetch(
    store: &dyn ObjectStore,
    announcement: &WeightAnnouncement,
) -> Result<Bytes, TransportError> {
    store
        .get_expecting(&object_name(announcement), &announcement.sha256)
        .await
}

/// Deletes the weights of versions `≤ newest − keep` (nobody can be told to
/// fetch them any more). Returns how many objects were deleted.
pub async fn prune(
    store: &dyn ObjectStore,
    newest: i32,
    keep: usize,
) -> Result<usize, TransportError> {
    let mut deleted = 0;
    for info in store.list().await? {
        let old = weights_object_version(&info.name)
            .is_some_and(|v| i64::from(v) <= i64::from(newest) - keep as i64);
        if old {
            store.delete(&info.name).await?;
            deleted += 1;
        }
    }
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    use super::*;
    use asyncrl_transport::LocalBus;

    #[tokio::test]
    async fn publish_fetch_and_prune() {
        let bus = LocalBus::new();
        let (store, kv) = open(&bus).await.unwrap();
        let (store, kv) = (store.as_ref(), kv.as_ref());
        assert_eq!(announced(kv).await.unwrap(), None);
        for v in 0..4 {
            publish(
                store,
                kv,
                v,
                v as u64,
                Bytes::from(vec![v as u8; 10]),
                &Fence::default(),
            )
            .await
            .unwrap();
        }
        let ann = announced(kv).await.unwrap().unwrap();
        assert_eq!((ann.version, ann.step, ann.byte_size), (3, 3, 10));
        assert_eq!(ann.format, WEIGHTS_FORMAT);
        assert_eq!(
            fetch(store, &ann).await.unwrap(),
            Bytes::from(vec![3u8; 10])
        );

        let mut wrong = ann.clone();
        wrong.sha256 = "0".repeat(64);
        assert!(matches!(
            fetch(store, &wrong).await,
            Err(TransportError::ChecksumMismatch { .. })
        ));

        assert_eq!(prune(store, 3, 2).await.unwrap(), 2);
        for v in 0..4 {
            let kept = store.info(&weights_object_name(v)).await.unwrap().is_some();
            assert_eq!(kept, v >= 2, "version {v}");
        }
    }

    /// A version folder as an exporter writes it: the files, then
    /// `sha256.json`, under a temporary name renamed complete.
    fn write_folder(
        root: &std::path::Path,
        version: i32,
        files: &[(&str, &[u8])],
    ) -> std::path::PathBuf {
        let dest = root.join(asyncrl_protos::subjects::weights_folder_name(version));
        let tmp = root.join(asyncrl_protos::subjects::weights_folder_tmp_name(version));
        std::fs::create_dir_all(&tmp).unwrap();
        let mut sums = serde_json::Map::new();
        for (name, bytes) in files {
            std::fs::write(tmp.join(name), bytes).unwrap();
            sums.insert(
                (*name).to_owned(),
                serde_json::Value::String(asyncrl_common::sha256_hex(bytes)),
            );
        }
        std::fs::write(
            tmp.join(FOLDER_SHA256_FILE),
            serde_json::Value::Object(sums).to_string(),
        )
        .unwrap();
        std::fs::rename(&tmp, &dest).unwrap();
        dest
    }

    #[tokio::test]
    async fn a_folder_is_announced_with_its_checksums_and_read_back_only_intact() {
        let bus = LocalBus::new();
        let (_, kv) = open(&bus).await.unwrap();
        let root = tempfile::tempdir().unwrap();
        let dir = write_folder(
            root.path(),
            3,
            &[
                ("model-00001-of-00002.safetensors", b"first"),
                ("model-00002-of-00002.safetensors", b"second!"),
            ],
        );
        let ann = publish_folder(kv.as_ref(), 3, 3, &dir, &Fence::default())
            .await
            .unwrap();
        assert_eq!(announced(kv.as_ref()).await.unwrap().as_ref(), Some(&ann));
        assert_eq!((ann.version, ann.byte_size), (3, 12));
        assert_eq!(ann.format, WEIGHTS_FORMAT_FOLDER);
        assert_eq!(ann.files.len(), 2);
        let read = read_folder(&ann).unwrap();
        verify_folder(&ann).unwrap();
        assert_eq!(
            read[1],
            (
                "model-00002-of-00002.safetensors".to_owned(),
                Bytes::from_static(b"second!")
            )
        );

        // Altered after the announcement (same size, other bytes): refused.
        std::fs::write(dir.join("model-00001-of-00002.safetensors"), b"firsT").unwrap();
        // Both readers: the one that holds the files and the one that only
        // checks them for an engine that loads the folder itself.
        assert!(matches!(
            read_folder(&ann),
            Err(FolderError::Mismatch { .. })
        ));
        assert!(matches!(
            verify_folder(&ann),
            Err(FolderError::Mismatch { .. })
        ));
        // A file that is gone, or a name that leaves the folder: refused.
        std::fs::remove_file(dir.join("model-00001-of-00002.safetensors")).unwrap();
        assert!(matches!(read_folder(&ann), Err(FolderError::Io { .. })));
        assert!(matches!(verify_folder(&ann), Err(FolderError::Io { .. })));
        let mut escape = ann.clone();
        escape.files[0].name = "../elsewhere".into();
        assert!(matches!(
            read_folder(&escape),
            Err(FolderError::Invalid { .. })
        ));
        assert!(matches!(
            verify_folder(&escape),
            Err(FolderError::Invalid { .. })
        ));
    }

    #[tokio::test]
    async fn a_folder_without_its_checksums_is_never_announced() {
        let bus = LocalBus::new();
        let (_, kv) = open(&bus).await.unwrap();
        let root = tempfile::tempdir().unwrap();
        // A write cut off before sha256.json: nothing to announce.
        let half = root
            .path()
            .join(asyncrl_protos::subjects::weights_folder_name(1));
        std::fs::create_dir_all(&half).unwrap();
        std::fs::write(half.join("model.safetensors"), b"partial").unwrap();
        let err = publish_folder(kv.as_ref(), 1, 1, &half, &Fence::default())
            .await
            .unwrap_err();
        assert!(err.to_string().contains(FOLDER_SHA256_FILE), "{err}");
        assert_eq!(announced(kv.as_ref()).await.unwrap(), None);
    }

    #[test]
    fn old_and_cut_off_folders_are_pruned() {
        let root = tempfile::tempdir().unwrap();
        for v in 1..=5 {
            write_folder(root.path(), v, &[("model.safetensors", b"w")]);
        }
        // Cut off: a write of version 3 (published since, or never). In
        // progress: the write of version 6, the next one.
        let tmp = asyncrl_protos::subjects::weights_folder_tmp_name;
        std::fs::create_dir_all(root.path().join(tmp(3))).unwrap();
        std::fs::create_dir_all(root.path().join(tmp(6))).unwrap();
        std::fs::create_dir_all(root.path().join("unrelated")).unwrap();
        assert_eq!(prune_folders(root.path(), 5, 2).unwrap(), 4);
        let mut left: Vec<String> = std::fs::read_dir(root.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        let name = asyncrl_protos::subjects::weights_folder_name;
        let mut want = [tmp(6), name(4), name(5), "unrelated".to_owned()];
        want.sort();
        assert_eq!(left, want);
    }

    #[tokio::test]
    async fn an_announcement_of_an_older_lease_epoch_is_refused_and_a_repeat_is_no_write() {
        let bus = LocalBus::new();
        let (store, kv) = open(&bus).await.unwrap();
        let old = Fence {
            session: "A".into(),
            epoch: 1,
        };
        let new = Fence {
            session: "B".into(),
            epoch: 2,
        };
        let a3 = publish(
            store.as_ref(),
            kv.as_ref(),
            3,
            3,
            Bytes::from_static(b"a3"),
            &old,
        )
        .await
        .unwrap();
        let rev = kv.get(POLICY_VERSION_KEY).await.unwrap().unwrap().revision;
        // The same announcement again (a retry whose write landed): no write.
        announce(kv.as_ref(), &a3).await.unwrap();
        assert_eq!(
            kv.get(POLICY_VERSION_KEY).await.unwrap().unwrap().revision,
            rev
        );
        // B took the lease over and announced; A, fenced, cannot announce.
        publish(
            store.as_ref(),
            kv.as_ref(),
            3,
            3,
            Bytes::from_static(b"b3"),
            &new,
        )
        .await
        .unwrap();
        let err = publish(
            store.as_ref(),
            kv.as_ref(),
            4,
            4,
            Bytes::from_static(b"a4"),
            &old,
        )
        .await
        .unwrap_err();
        assert!(
            matches!(err, AnnounceError::Fenced { epoch: 2, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("learner session B"), "{err}");
        let now = announced(kv.as_ref()).await.unwrap().unwrap();
        assert_eq!((now.version, now.learner_session.as_str()), (3, "B"));
    }

    #[tokio::test]
    async fn a_bad_announcement_is_a_decode_error() {
        let bus = LocalBus::new();
        let kv = bus.kv(CONTROL_BUCKET).await.unwrap();
        kv.put(POLICY_VERSION_KEY, Bytes::from_static(b"\xff\xff"))
            .await
            .unwrap();
        let err = announced(kv.as_ref()).await.unwrap_err();
        assert!(matches!(err, WeightsError::Decode(_)));
        assert!(err.to_string().contains(POLICY_VERSION_KEY), "{err}");
    }
}
