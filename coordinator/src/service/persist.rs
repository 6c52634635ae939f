//! Writing the coordinator's state to the KV bucket: a compare-and-set on
//! the revision the coordinator last wrote, recognising its own earlier
//! writes whose reply was lost, and telling a transient failure from a
//! second coordinator.

use std::time::Instant;

use asyncrl_transport::TransportError;
use bytes::Bytes;
use prost::Message;

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

impl Actor {
    pub(super) async fn persist(&mut self) -> Result<(), PersistError> {
        let bytes = Bytes::from(self.sched.to_proto().encode_to_vec());
        self.metrics.state_bytes.set(bytes.len() as i64);
        let started = Instant::now();
        let mut retried = false;
        if self.unconfirmed.last() != Some(&bytes) {
            self.unconfirmed.push(bytes.clone());
        }
        if self.unconfirmed.len() > MAX_UNCONFIRMED_WRITES {
            self.unconfirmed.remove(0);
        }
        loop {
            let result = match self.state_rev {
                None => self.kv.create(STATE_KEY, bytes.clone()).await,
                Some(rev) => self.kv.update(STATE_KEY, bytes.clone(), rev).await,
            };
            match result {
                Ok(rev) => {
                    self.state_rev = Some(rev);
                    self.unconfirmed.clear();
                    self.metrics
                        .state_persist_seconds
                        .observe(started.elapsed().as_secs_f64());
                    return Ok(());
                }
                Err(TransportError::RevisionMismatch { .. } | TransportError::KeyExists { .. })
                    if !retried =>
                {
                    // Our own earlier write may have landed although its
                    // reply was lost (also one of an earlier persist, of a
                    // state that has changed since): then the stored value
                    // is ours.
                    retried = true;
                    let stored = self.kv.get(STATE_KEY).await.map_err(|e| {
                        PersistError::Transient(CoordinatorError::transport(
                            "read coordinator.state",
                            e,
                        ))
                    })?;
                    match stored {
                        Some(e) if self.unconfirmed.contains(&e.value) => {
                            self.state_rev = Some(e.revision);
                        }
                        Some(e) => {
                            return Err(PersistError::Fatal(
                                CoordinatorError::AnotherCoordinator {
                                    revision: e.revision,
                                },
                            ));
                        }
                        None => self.state_rev = None,
                    }
                }
                Err(TransportError::RevisionMismatch { .. } | TransportError::KeyExists { .. }) => {
                    return Err(PersistError::Fatal(CoordinatorError::AnotherCoordinator {
                        revision: self.state_rev.unwrap_or(0),
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
}
