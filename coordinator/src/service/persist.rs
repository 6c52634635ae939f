//! The coordinator's persisted state in the KV bucket ([`StateStore`]):
//! read once at start, then written with a compare-and-set on the revision
//! the coordinator last wrote, recognising its own earlier writes whose reply
//! was lost, and telling a transient failure from a second coordinator.
//!
//! A write is prepared by [`StateStore::begin_write`] (the state encoded as
//! it is now) and runs on its own ([`StateWrite`], owning what it needs), so
//! that the actor keeps taking events while it is in flight; its outcome is
//! applied by [`StateStore::end_write`]. At most one write is in flight: each
//! one's compare-and-set needs the revision of the one before.

use std::sync::Arc;
use std::time::Instant;

use asyncrl_protos::subjects::COORDINATOR_STATE_KEY as STATE_KEY;
use asyncrl_protos::v1::CoordinatorState;
use asyncrl_transport::{KvBucket, TransportError};
use bytes::Bytes;
use futures::future::BoxFuture;
use prost::Message;

use crate::dataset::TaskSet;
use crate::error::CoordinatorError;
use crate::metrics::CoordinatorMetrics;
use crate::scheduler::{Scheduler, SchedulerParams};

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

/// The persisted state's key in the KV bucket, as this coordinator last
/// wrote it.
pub(super) struct StateStore {
    kv: Arc<dyn KvBucket>,
    /// The revision this coordinator last wrote or read (None: nothing
    /// stored yet).
    revision: Option<u64>,
    /// State writes since the last confirmed one whose outcome is unknown
    /// (the request timed out: it may have landed), and the current one.
    unconfirmed: Vec<Bytes>,
    /// The last write failed (transiently): requests that change the state
    /// are refused until one succeeds.
    failed: bool,
    metrics: CoordinatorMetrics,
}

/// A state write in flight: resolves to the revision it stored.
pub(super) struct StateWrite {
    pub(super) done: BoxFuture<'static, Result<u64, PersistError>>,
    started: Instant,
    /// The highest closed epoch of the state it writes.
    pub(super) closed_epoch: Option<u64>,
}

impl StateStore {
    /// Reads the persisted state: the scheduler it restores (restored
    /// leases get a fresh deadline), or a new one when there is none.
    pub(super) async fn load(
        kv: Arc<dyn KvBucket>,
        params: SchedulerParams,
        tasks: &TaskSet,
        now: i64,
        metrics: CoordinatorMetrics,
    ) -> Result<(Self, Scheduler), CoordinatorError> {
        let (sched, revision) = match kv
            .get(STATE_KEY)
            .await
            .map_err(|e| CoordinatorError::transport("read coordinator.state", e))?
        {
            Some(entry) => {
                let state = CoordinatorState::decode(entry.value.as_ref())
                    .map_err(CoordinatorError::StateDecode)?;
                let s = Scheduler::from_proto(
                    params,
                    &state,
                    tasks.len() as u64,
                    tasks.fingerprint(),
                    now,
                )?;
                tracing::info!(
                    epoch = s.epoch(),
                    cursor = s.cursor(),
                    leases = s.running(),
                    requeued = s.queue_len(),
                    accepted = s.accepted(),
                    version = s.version(),
                    "coordinator state restored; restored leases get a fresh deadline"
                );
                (s, Some(entry.revision))
            }
            None => {
                let prefix = format!("{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff);
                tracing::info!(tasks = tasks.len(), lease_prefix = %prefix, "new coordinator state");
                (
                    Scheduler::new(params, tasks.len() as u64, tasks.fingerprint(), &prefix),
                    None,
                )
            }
        };
        let store = Self {
            kv,
            revision,
            unconfirmed: Vec::new(),
            failed: false,
            metrics,
        };
        Ok((store, sched))
    }

    /// Whether the last write failed (transiently) and none has succeeded
    /// since.
    pub(super) fn failed(&self) -> bool {
        self.failed
    }

    /// Whether this coordinator has stored no state yet.
    pub(super) fn nothing_stored(&self) -> bool {
        self.revision.is_none()
    }

    /// Encodes the state as it is now and starts writing it.
    pub(super) fn begin_write(&mut self, sched: &Scheduler) -> StateWrite {
        let bytes = Bytes::from(sched.encode_state());
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
            self.revision,
            self.unconfirmed.clone(),
        );
        StateWrite {
            done: Box::pin(done),
            started: Instant::now(),
            closed_epoch: sched.closed_epoch(),
        }
    }

    /// Applies the outcome of a finished write: Ok(true) when it is the
    /// first to succeed after a failed one. A transient failure marks the
    /// store failed.
    pub(super) fn end_write(
        &mut self,
        write: &StateWrite,
        outcome: Result<u64, PersistError>,
    ) -> Result<bool, PersistError> {
        let rev = match outcome {
            Ok(rev) => rev,
            Err(e) => {
                if let PersistError::Transient(_) = e {
                    self.failed = true;
                }
                return Err(e);
            }
        };
        self.revision = Some(rev);
        self.unconfirmed.clear();
        self.metrics
            .state_persist_seconds
            .observe(write.started.elapsed().as_secs_f64());
        Ok(std::mem::replace(&mut self.failed, false))
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
