//! Writing the coordinator's state to the KV bucket: a compare-and-set on
//! the revision the coordinator last wrote, recognising its own earlier
//! writes whose reply was lost, and telling a transient failure from a
//! second coordinator.
//!
//! A write is prepared by the actor ([`Actor::begin_write`]: the state
//! encoded as it is now) and runs on its own ([`StateWrite`], owning what it
//! needs), so that the actor keeps taking events while it is in flight; its
//! outcome is applied by [`Actor::end_write`]. At most one write is in
//! flight: each one's compare-and-set needs the revision of the one before.

use std::sync::Arc;
use std::time::Instant;

use asyncrl_transport::{KvBucket, TransportError};
use bytes::Bytes;
use futures::future::BoxFuture;

use super::actor::Actor;
use asyncrl_protos::subjects::COORDINATOR_STATE_KEY as STATE_KEY;

use crate::CoordinatorError;

/// How many unconfirmed state writes are remembered (each one a state the
/// coordinator may find stored as its own after a lost reply).
const MAX_UNCONFIRMED_WRITES: usize = 16;

pub(super) enum PersistError {
    Fatal(CoordinatorError),
    Transient(CoordinatorError),
}

impl std::fmt::Debug for PersistError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PersistError::Fatal(e) | PersistError::Transient(e) => write!(f, "{e}"),
        }
    }
}

/// A state write in flight: resolves to the revision it stored.
pub(super) struct StateWrite {
    pub(super) done: BoxFuture<'static, Result<u64, PersistError>>,
    started: Instant,
}

impl Actor {
    /// Encodes the state as it is now and starts writing it.
    pub(super) fn begin_write(&mut self) -> StateWrite {
        let bytes = Bytes::from(self.sched.encode_state());
        self.metrics.state_bytes.set(bytes.len() as i64);
        if self.unconfirmed.last() != Some(&bytes) {
            self.unconfirmed.push(bytes.clone());
        }
        if self.unconfirmed.len() > MAX_UNCONFIRMED_WRITES {
            self.unconfirmed.remove(0);
        }
        let done = write_state(
            self.kv.clone(),
            bytes,
            self.state_rev,
            self.unconfirmed.clone(),
        );
        StateWrite {
            done: Box::pin(done),
            started: Instant::now(),
        }
    }

    /// Applies the outcome of a finished write.
    pub(super) fn end_write(
        &mut self,
        write: &StateWrite,
        outcome: Result<u64, PersistError>,
    ) -> Result<(), PersistError> {
        let rev = outcome?;
        self.state_rev = Some(rev);
        self.unconfirmed.clear();
        self.metrics
            .state_persist_seconds
            .observe(write.started.elapsed().as_secs_f64());
        Ok(())
    }
}

/// One compare-and-set write of `bytes` over revision `rev` (a create when
/// there is none), recognising as its own a stored value among
/// `unconfirmed` (an earlier write whose reply was lost).
async fn write_state(
    kv: Arc<dyn KvBucket>,
    bytes: Bytes,
    mut rev: Option<u64>,
    unconfirmed: Vec<Bytes>,
) -> Result<u64, PersistError> {
    let mut retried = false;
    loop {
        let result = match rev {
            None => kv.create(STATE_KEY, bytes.clone()).await,
            Some(r) => kv.update(STATE_KEY, bytes.clone(), r).await,
        };
        match result {
            Ok(r) => return Ok(r),
            Err(TransportError::RevisionMismatch { .. } | TransportError::KeyExists { .. })
                if !retried =>
            {
                // Our own earlier write may have landed although its
                // reply was lost (also one of an earlier persist, of a
                // state that has changed since): then the stored value
                // is ours.
                retried = true;
                let stored = kv.get(STATE_KEY).await.map_err(|e| {
                    PersistError::Transient(CoordinatorError::transport(
                        "read coordinator.state",
                        e,
                    ))
                })?;
                match stored {
                    Some(e) if unconfirmed.contains(&e.value) => rev = Some(e.revision),
                    Some(e) => {
                        return Err(PersistError::Fatal(CoordinatorError::AnotherCoordinator {
                            revision: e.revision,
                        }));
                    }
                    None => rev = None,
                }
            }
            Err(TransportError::RevisionMismatch { .. } | TransportError::KeyExists { .. }) => {
                return Err(PersistError::Fatal(CoordinatorError::AnotherCoordinator {
                    revision: rev.unwrap_or(0),
                }));
            }
            Err(e) => {
                return Err(PersistError::Transient(CoordinatorError::transport(
                    "write coordinator.state",
                    e,
                )));
            }
        }
    }
}
