//! Weights of a policy version: the object `policy-v<version>.safetensors`
//! in the `WEIGHTS` object store and its announcement in the KV key
//! `policy.version`. The learner publishes, workers (and a restarted
//! learner) fetch; both go through here.
//!
//! Architecture invariant: a version is announced only after its object is
//! completely stored (the announcement carries the sha256 the store
//! computed), and fetched bytes are checked against that sha256.

use asyncrl_common::unix_ms;
use asyncrl_protos::subjects::{
    CONTROL_BUCKET, POLICY_VERSION_KEY, WEIGHTS_BUCKET, WEIGHTS_FORMAT, weights_object_name,
    weights_object_version,
};
use asyncrl_protos::{Message, WeightAnnouncement};
use std::sync::Arc;

use asyncrl_transport::{Bus, KvBucket, ObjectStore, TransportError};
use bytes::Bytes;

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

/// Stores `weights` as the object of `version` and then announces it in
/// `policy.version` (trained `step`). Returns the announcement written.
pub async fn publish(
    store: &dyn ObjectStore,
    kv: &dyn KvBucket,
    version: i32,
    step: u64,
    weights: Bytes,
) -> Result<WeightAnnouncement, TransportError> {
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
    };
    announce(kv, &announcement).await?;
    Ok(announcement)
}

/// Writes an announcement as it is.
pub async fn announce(
    kv: &dyn KvBucket,
    announcement: &WeightAnnouncement,
) -> Result<(), TransportError> {
    kv.put(
        POLICY_VERSION_KEY,
        Bytes::from(announcement.encode_to_vec()),
    )
    .await?;
    Ok(())
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
            publish(store, kv, v, v as u64, Bytes::from(vec![v as u8; 10]))
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
