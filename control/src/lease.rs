//! The run's learner lease: one learner at a time seals steps and announces
//! versions.
//!
//! The lease is the KV key `learner.lease` (`asyncrl.v1.LearnerLease`),
//! written only with compare-and-set. A learner takes it before it seals or
//! publishes anything ([`acquire`]):
//! - no lease, or one not renewed for its `ttl`: taken, with the epoch one
//!   higher (a learner restarted after a crash waits at most one `ttl` for
//!   its old lease to lapse);
//! - a live lease of another session: it waits, and after twice the `ttl`
//!   refuses to start with one line naming the live learner.
//!
//! While it runs it renews the lease ([`Lease::renew`]); a renewal that
//! finds the key changed means another learner took over (this one was
//! frozen past its `ttl`): it is fenced ([`LeaseError::Fenced`]) and stops.
//! Every announcement carries the session and the epoch, and is a
//! compare-and-set on the previous announcement that refuses to replace one
//! of a later epoch ([`crate::weights::announce`]): a fenced learner that
//! has not noticed yet cannot announce over its successor.

use std::time::Duration;

use asyncrl_common::Clock;
use asyncrl_protos::Message;
use asyncrl_protos::subjects::LEARNER_LEASE_KEY;
use asyncrl_protos::v1::LearnerLease;
use asyncrl_transport::{KvBucket, TransportError};
use bytes::Bytes;
use tokio_util::sync::CancellationToken;

#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// Another learner holds a live lease (and kept it for twice its ttl).
    #[error(
        "another learner holds this run's lease: session {session} on {holder} (epoch {epoch}, renewed {ago_ms} ms ago, ttl {ttl_ms} ms); stop it first (two learners would both train and announce)"
    )]
    Held {
        session: String,
        holder: String,
        epoch: u64,
        ago_ms: i64,
        ttl_ms: u64,
    },
    /// Another learner took the lease over: this one must stop.
    #[error(
        "this learner was fenced: learner session {session} on {holder} took the run's lease over (epoch {epoch}); stopping so that only one learner trains and announces"
    )]
    Fenced {
        session: String,
        holder: String,
        epoch: u64,
    },
    #[error("the KV key `{LEARNER_LEASE_KEY}` does not decode as a LearnerLease: {0}")]
    Decode(#[source] prost::DecodeError),
    #[error("cannot {action} the learner lease (KV key `{LEARNER_LEASE_KEY}`): {source}")]
    Transport {
        action: &'static str,
        #[source]
        source: TransportError,
    },
    #[error("stopped while waiting for the learner lease")]
    Cancelled,
}

/// A lease this learner holds.
#[derive(Debug, Clone)]
pub struct Lease {
    value: LearnerLease,
    revision: u64,
}

fn transport(action: &'static str) -> impl FnOnce(TransportError) -> LeaseError {
    move |source| LeaseError::Transport { action, source }
}

fn decode(bytes: &[u8]) -> Result<LearnerLease, LeaseError> {
    LearnerLease::decode(bytes).map_err(LeaseError::Decode)
}

/// The lease as it is (None: no learner has taken it).
pub async fn current(kv: &dyn KvBucket) -> Result<Option<(LearnerLease, u64)>, LeaseError> {
    match kv.get(LEARNER_LEASE_KEY).await.map_err(transport("read"))? {
        Some(entry) => Ok(Some((decode(&entry.value)?, entry.revision))),
        None => Ok(None),
    }
}

/// Takes the run's lease for `session` (running on `holder`), waiting up
/// to twice `ttl` for a live lease of another session to lapse.
pub async fn acquire(
    kv: &dyn KvBucket,
    clock: &dyn Clock,
    session: &str,
    holder: &str,
    ttl: Duration,
    stop: &CancellationToken,
) -> Result<Lease, LeaseError> {
    let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
    let started = tokio::time::Instant::now();
    let mut waiting_logged = false;
    loop {
        let now = clock.now_unix_ms();
        let (epoch, revision) = match current(kv).await? {
            None => (1, None),
            Some((old, rev)) => {
                let ago_ms = now - old.renewed_at_unix_ms;
                let lapsed = ago_ms > i64::try_from(old.ttl_ms).unwrap_or(i64::MAX);
                if old.session_id != session && !lapsed {
                    if started.elapsed() >= 2 * ttl {
                        return Err(LeaseError::Held {
                            session: old.session_id,
                            holder: old.holder,
                            epoch: old.epoch,
                            ago_ms,
                            ttl_ms: old.ttl_ms,
                        });
                    }
                    if !waiting_logged {
                        tracing::warn!(session = %old.session_id, holder = %old.holder, epoch = old.epoch, ago_ms, "another learner holds the run's lease; waiting for it to lapse");
                        waiting_logged = true;
                    }
                    tokio::select! {
                        () = stop.cancelled() => return Err(LeaseError::Cancelled),
                        () = tokio::time::sleep(renew_every(ttl)) => {}
                    }
                    continue;
                }
                (old.epoch + 1, Some(rev))
            }
        };
        let value = LearnerLease {
            session_id: session.to_owned(),
            holder: holder.to_owned(),
            epoch,
            acquired_at_unix_ms: now,
            renewed_at_unix_ms: now,
            ttl_ms,
        };
        let bytes = Bytes::from(value.encode_to_vec());
        let written = match revision {
            None => kv.create(LEARNER_LEASE_KEY, bytes).await,
            Some(rev) => kv.update(LEARNER_LEASE_KEY, bytes, rev).await,
        };
        match written {
            Ok(revision) => {
                tracing::info!(session, holder, epoch, "took the run's learner lease");
                return Ok(Lease { value, revision });
            }
            // Another learner got there first: look again.
            Err(TransportError::KeyExists { .. } | TransportError::RevisionMismatch { .. }) => {}
            Err(e) => return Err(transport("take")(e)),
        }
    }
}

/// How often a held lease is renewed: a quarter of its ttl.
pub fn renew_every(ttl: Duration) -> Duration {
    (ttl / 4).max(Duration::from_millis(10))
}

impl Lease {
    pub fn epoch(&self) -> u64 {
        self.value.epoch
    }

    pub fn session(&self) -> &str {
        &self.value.session_id
    }

    /// Renews the lease (compare-and-set on the revision this learner
    /// wrote). A changed key means another learner took it: fenced.
    pub async fn renew(&mut self, kv: &dyn KvBucket, clock: &dyn Clock) -> Result<(), LeaseError> {
        let mut next = self.value.clone();
        next.renewed_at_unix_ms = clock.now_unix_ms();
        match kv
            .update(
                LEARNER_LEASE_KEY,
                Bytes::from(next.encode_to_vec()),
                self.revision,
            )
            .await
        {
            Ok(revision) => {
                self.value = next;
                self.revision = revision;
                Ok(())
            }
            Err(TransportError::RevisionMismatch { .. } | TransportError::KeyExists { .. }) => {
                Err(self.fenced(kv).await)
            }
            Err(e) => Err(transport("renew")(e)),
        }
    }

    /// Whether the lease is still this learner's (a read, no write).
    pub async fn check(&self, kv: &dyn KvBucket) -> Result<(), LeaseError> {
        match current(kv).await? {
            Some((_, rev)) if rev == self.revision => Ok(()),
            _ => Err(self.fenced(kv).await),
        }
    }

    /// The error naming whoever holds the lease now.
    async fn fenced(&self, kv: &dyn KvBucket) -> LeaseError {
        match current(kv).await {
            Ok(Some((now, _))) => LeaseError::Fenced {
                session: now.session_id,
                holder: now.holder,
                epoch: now.epoch,
            },
            Ok(None) => LeaseError::Fenced {
                session: "(none: the lease was deleted)".into(),
                holder: "?".into(),
                epoch: 0,
            },
            Err(e) => e,
        }
    }

    /// Releases the lease at a clean stop, so that the next learner need
    /// not wait for it to lapse (only if it is still this learner's).
    pub async fn release(self, kv: &dyn KvBucket) {
        let mut gone = self.value.clone();
        gone.renewed_at_unix_ms = 0;
        if let Err(e) = kv
            .update(
                LEARNER_LEASE_KEY,
                Bytes::from(gone.encode_to_vec()),
                self.revision,
            )
            .await
        {
            tracing::debug!(error = %e, "the learner lease was not released (no longer ours?)");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use asyncrl_common::{SharedClock, TokioClock};
    use asyncrl_transport::{Bus, LocalBus};

    use super::*;

    fn clock() -> SharedClock {
        TokioClock::starting_at(1_700_000_000_000).shared()
    }

    async fn kv() -> Arc<dyn KvBucket> {
        LocalBus::new()
            .kv(asyncrl_protos::subjects::CONTROL_BUCKET)
            .await
            .unwrap()
    }

    const TTL: Duration = Duration::from_millis(400);

    #[tokio::test(start_paused = true)]
    async fn a_second_learner_waits_then_refuses_naming_the_live_one() {
        let kv = kv().await;
        let clock = clock();
        let stop = CancellationToken::new();
        let mut a = acquire(kv.as_ref(), clock.as_ref(), "A", "host-a:1", TTL, &stop)
            .await
            .unwrap();
        assert_eq!(a.epoch(), 1);
        // A keeps renewing while B waits: B refuses after two ttls.
        let renewer = {
            let (kv, clock) = (kv.clone(), clock.clone());
            let stop = stop.clone();
            tokio::spawn(async move {
                while !stop.is_cancelled() {
                    tokio::time::sleep(renew_every(TTL)).await;
                    a.renew(kv.as_ref(), clock.as_ref()).await.unwrap();
                }
                a
            })
        };
        let err = acquire(kv.as_ref(), clock.as_ref(), "B", "host-b:2", TTL, &stop)
            .await
            .unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, LeaseError::Held { .. }), "{text}");
        assert!(text.contains("session A on host-a:1"), "{text}");
        stop.cancel();
        let a = renewer.await.unwrap();
        a.check(kv.as_ref()).await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_lapsed_lease_is_taken_over_and_its_old_holder_is_fenced() {
        let kv = kv().await;
        let clock = clock();
        let stop = CancellationToken::new();
        let mut a = acquire(kv.as_ref(), clock.as_ref(), "A", "host-a:1", TTL, &stop)
            .await
            .unwrap();
        // A is frozen (no renewal): B waits for the lease to lapse and
        // takes it over with the next epoch.
        let b = acquire(kv.as_ref(), clock.as_ref(), "B", "host-b:2", TTL, &stop)
            .await
            .unwrap();
        assert_eq!(b.epoch(), 2);
        // A wakes up: its renewal finds B's lease.
        let err = a.renew(kv.as_ref(), clock.as_ref()).await.unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, LeaseError::Fenced { epoch: 2, .. }), "{text}");
        assert!(text.contains("session B on host-b:2"), "{text}");
        assert!(a.check(kv.as_ref()).await.is_err());
        b.check(kv.as_ref()).await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_released_lease_is_taken_at_once() {
        let kv = kv().await;
        let clock = clock();
        let stop = CancellationToken::new();
        let a = acquire(kv.as_ref(), clock.as_ref(), "A", "h:1", TTL, &stop)
            .await
            .unwrap();
        a.release(kv.as_ref()).await;
        let started = tokio::time::Instant::now();
        let b = acquire(kv.as_ref(), clock.as_ref(), "B", "h:2", TTL, &stop)
            .await
            .unwrap();
        assert_eq!(b.epoch(), 2);
        assert!(started.elapsed() < TTL, "no wait for a released lease");
    }
}
