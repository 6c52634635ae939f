//! Read-modify-write and following of one KV key, written once.
//!
//! - [`edit`]: compare-and-set on the key's revision, retried when another
//!   writer got there first (the knob schedule is written by the coordinator
//!   and sealed by the learner).
//! - [`follow`]: a watch that yields the current value first and re-opens
//!   itself with backoff after an error or the end of its stream (a NATS
//!   reconnect ends it), until cancelled.

use std::future::Future;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Duration;

use asyncrl_common::Backoff;
use asyncrl_transport::{Bus, KvBucket, KvEntry, TransportError};
use bytes::Bytes;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

/// What an edit decided, given the key's current entry.
#[derive(Debug)]
pub enum Change<T> {
    /// Write this value (create the key if it is missing), then return `T`.
    Write(Bytes, T),
    /// Write nothing and return `T`.
    Keep(T),
}

/// The outcome of a successful [`edit`].
#[derive(Debug, Clone, PartialEq)]
pub struct Edited<T> {
    pub outcome: T,
    /// The key's revision after the edit (0 when kept and the key is missing).
    pub revision: u64,
    /// Whether the edit wrote the key.
    pub wrote: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum EditError<E> {
    /// The edit function refused.
    #[error(transparent)]
    Refused(E),
    #[error("cannot {action} KV key `{key}`: {source}")]
    Transport {
        key: String,
        action: &'static str,
        #[source]
        source: TransportError,
    },
    #[error("KV key `{key}` kept changing under compare-and-set ({attempts} attempts)")]
    Contended { key: String, attempts: u32 },
}

/// Reads `key`, lets `decide` choose a change for the current entry (None:
/// the key is missing), and writes it with compare-and-set on the revision
/// read (create when missing). Another writer in between makes it read and
/// decide again, up to `attempts` times.
pub async fn edit<T, E>(
    kv: &dyn KvBucket,
    key: &str,
    attempts: u32,
    mut decide: impl FnMut(Option<&KvEntry>) -> Result<Change<T>, E>,
) -> Result<Edited<T>, EditError<E>> {
    let transport = |action, source| EditError::Transport {
        key: key.to_owned(),
        action,
        source,
    };
    for _ in 0..attempts.max(1) {
        let entry = kv.get(key).await.map_err(|e| transport("read", e))?;
        let (value, outcome) = match decide(entry.as_ref()).map_err(EditError::Refused)? {
            Change::Keep(outcome) => {
                return Ok(Edited {
                    outcome,
                    revision: entry.map_or(0, |e| e.revision),
                    wrote: false,
                });
            }
            Change::Write(value, outcome) => (value, outcome),
        };
        let written = match &entry {
            Some(e) => kv.update(key, value, e.revision).await,
            None => kv.create(key, value).await,
        };
        match written {
            Ok(revision) => {
                return Ok(Edited {
                    outcome,
                    revision,
                    wrote: true,
                });
            }
            Err(TransportError::RevisionMismatch { .. } | TransportError::KeyExists { .. }) => {
                continue;
            }
            Err(e) => return Err(transport("write", e)),
        }
    }
    Err(EditError::Contended {
        key: key.to_owned(),
        attempts,
    })
}

/// Backoff of a [`follow`] that has to re-open its watch.
pub const FOLLOW_BACKOFF: (Duration, Duration) =
    (Duration::from_millis(100), Duration::from_secs(2));

/// How often a [`follow`] looks whether the bus reconnected.
const FOLLOW_RECONNECT_CHECK: Duration = Duration::from_secs(1);

/// Follows `key` of `bucket` until `stop` is cancelled or `on_value` breaks:
/// calls `on_value(value, revision)` for the current value and every later
/// put (deletes are skipped), and re-opens the watch with `backoff` when
/// opening it fails, it fails or it ends, and once the bus has reconnected
/// since it was opened: in a JetStream cluster the server that held the
/// watch's consumer may be gone, and the client's own re-creation of it
/// can stall without an error (nats-io/nats.rs#1596). A re-opened watch
/// delivers the current value again; revisions already passed to
/// `on_value` are skipped.
pub async fn follow<F, Fut>(
    bus: Arc<dyn Bus>,
    bucket: &str,
    key: &str,
    mut backoff: Backoff,
    stop: CancellationToken,
    mut on_value: F,
) where
    F: FnMut(Bytes, u64) -> Fut,
    Fut: Future<Output = ControlFlow<()>>,
{
    let mut delivered = 0u64;
    loop {
        let session = bus.connected_since_unix_ms();
        let open = async {
            let kv = bus.kv(bucket).await?;
            kv.watch(key).await
        };
        match stop.run_until_cancelled(open).await {
            None => return,
            Some(Err(e)) => {
                tracing::warn!(bucket, key, error = %e, "cannot watch KV key; retrying");
            }
            Some(Ok(mut events)) => loop {
                let next = async {
                    loop {
                        tokio::select! {
                            event = events.next() => return Some(event),
                            () = tokio::time::sleep(FOLLOW_RECONNECT_CHECK) => {
                                let now = bus.connected_since_unix_ms();
                                if now.is_some() && now != session {
                                    return None;
                                }
                            }
                        }
                    }
                };
                let Some(next) = stop.run_until_cancelled(next).await else {
                    return;
                };
                let Some(next) = next else {
                    tracing::info!(bucket, key, "the bus reconnected; watching KV key again");
                    backoff.reset();
                    break;
                };
                match next {
                    None => {
                        tracing::debug!(bucket, key, "KV watch ended; watching again");
                        break;
                    }
                    Some(Err(e)) => {
                        tracing::warn!(bucket, key, error = %e, "KV watch failed; watching again");
                        break;
                    }
                    Some(Ok(event)) => {
                        backoff.reset();
                        if event.revision <= delivered {
                            continue;
                        }
                        delivered = event.revision;
                        let Some(value) = event.value else { continue };
                        if on_value(value, event.revision).await.is_break() {
                            return;
                        }
                    }
                }
            },
        }
        if stop
            .run_until_cancelled(tokio::time::sleep(backoff.next_delay()))
            .await
            .is_none()
        {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use asyncrl_transport::LocalBus;

    fn counter(entry: Option<&KvEntry>) -> u64 {
        entry.map_or(0, |e| {
            String::from_utf8_lossy(&e.value).parse().unwrap_or(0)
        })
    }

    #[tokio::test]
    async fn edit_creates_updates_keeps_and_refuses() {
        let bus = LocalBus::new();
        let kv = bus.kv("b").await.unwrap();
        let bump = |e: Option<&KvEntry>| {
            let n = counter(e) + 1;
            Ok::<_, String>(Change::Write(Bytes::from(n.to_string()), n))
        };
        let first = edit(kv.as_ref(), "k", 4, bump).await.unwrap();
        assert_eq!((first.outcome, first.wrote), (1, true));
        let second = edit(kv.as_ref(), "k", 4, bump).await.unwrap();
        assert_eq!(second.outcome, 2);
        assert!(second.revision > first.revision);
        let kept = edit(kv.as_ref(), "k", 4, |e| {
            Ok::<_, String>(Change::Keep(counter(e)))
        })
        .await
        .unwrap();
        assert_eq!(
            (kept.outcome, kept.wrote, kept.revision),
            (2, false, second.revision)
        );
        let refused = edit(kv.as_ref(), "k", 4, |_| {
            Err::<Change<()>, _>("no".to_owned())
        })
        .await;
        assert!(matches!(refused, Err(EditError::Refused(r)) if r == "no"));
    }

    #[tokio::test]
    async fn edit_retries_after_a_concurrent_write() {
        let bus = LocalBus::new();
        let kv = bus.kv("b").await.unwrap();
        kv.put("k", Bytes::from("10")).await.unwrap();
        let mut calls = 0;
        let got = edit(kv.as_ref(), "k", 4, |e| {
            calls += 1;
            let n = counter(e);
            if calls == 1 {
                // Another writer lands between our read and our write.
                let kv = kv.clone();
                futures::executor::block_on(kv.put("k", Bytes::from("20"))).unwrap();
            }
            Ok::<_, String>(Change::Write(Bytes::from((n + 1).to_string()), n + 1))
        })
        .await
        .unwrap();
        assert_eq!((calls, got.outcome), (2, 21));
        let contended = edit(kv.as_ref(), "k", 2, |e| {
            let kv = kv.clone();
            futures::executor::block_on(kv.put("k", Bytes::from("0"))).unwrap();
            Ok::<_, String>(Change::Write(Bytes::from(counter(e).to_string()), ()))
        })
        .await;
        assert!(
            matches!(contended, Err(EditError::Contended { attempts: 2, .. })),
            "{contended:?}"
        );
    }

    #[tokio::test]
    async fn follow_yields_the_current_value_then_updates() {
        let bus: Arc<dyn Bus> = Arc::new(LocalBus::new());
        let kv = bus.kv("b").await.unwrap();
        kv.put("k", Bytes::from("a")).await.unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let stop = CancellationToken::new();
        let task = tokio::spawn(follow(
            bus.clone(),
            "b",
            "k",
            Backoff::new(FOLLOW_BACKOFF.0, FOLLOW_BACKOFF.1),
            stop.clone(),
            move |v, _| {
                let tx = tx.clone();
                async move {
                    let last = v == "c";
                    let _ = tx.send(v);
                    if last {
                        ControlFlow::Break(())
                    } else {
                        ControlFlow::Continue(())
                    }
                }
            },
        ));
        assert_eq!(rx.recv().await.unwrap(), "a");
        kv.put("k", Bytes::from("b")).await.unwrap();
        assert_eq!(rx.recv().await.unwrap(), "b");
        kv.put("k", Bytes::from("c")).await.unwrap();
        assert_eq!(rx.recv().await.unwrap(), "c");
        // `on_value` broke: follow returned by itself.
        task.await.unwrap();
    }
}
