//! State shared by the worker's loops and task futures.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use asyncrl_policy::{ModelText, SamplingParams};
use asyncrl_transport::Bus;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;

use crate::metrics::WorkerMetrics;
use crate::reward::Scorer;
use crate::settings::Settings;

/// How long each completion may be.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum CompletionLengths {
    /// The model decides: a completion ends at a stop token,
    /// `model.max_new_tokens` or `model.max_seq_len`.
    #[default]
    Model,
    /// Benchmarks only: every completion is exactly as long as the tokens of
    /// its task's reference answer plus one (stop tokens ignored), so that
    /// an untrained model produces the length distribution of the task (the
    /// long tail of `reverse`) instead of its own.
    ReferenceAnswer,
}

/// A lease the worker holds.
pub(crate) struct LeaseEntry {
    pub task_id: String,
    /// Cancelled when the lease is revoked (or the task aborts itself).
    pub cancel: CancellationToken,
    pub revoked: Arc<AtomicBool>,
}

/// Per-worker counters (the metrics may be shared by several workers of one
/// process; these are this worker's own, for its summary).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub tasks_started: AtomicU64,
    pub tasks_completed: AtomicU64,
    pub tasks_returned: AtomicU64,
    pub tasks_revoked: AtomicU64,
    pub completions_refused: AtomicU64,
    pub completions_failed: AtomicU64,
    pub trajectories_published: AtomicU64,
    pub sequences_cancelled: AtomicU64,
    pub weight_swaps: AtomicU64,
    pub weight_fetch_failures: AtomicU64,
    pub reward_failures: AtomicU64,
}

pub(crate) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

pub(crate) struct Shared {
    pub settings: Settings,
    pub bus: Arc<dyn Bus>,
    /// What generates (the built-in model or an external engine).
    pub engine: Arc<dyn crate::engine::Engine>,
    /// The model's tokenizer and stop tokens.
    pub text: ModelText,
    /// Sampling parameters of `[model]` (stop tokens = the model's EOS and
    /// `model.stop_token_ids`).
    pub params: SamplingParams,
    /// Stop strings: `model.stop_strings`, then the model's
    /// `generation_config.json` ones.
    pub stop_strings: Vec<String>,
    pub scorer: Scorer,
    /// `[environment]`: every task is a multi-turn episode.
    pub episodes: Option<crate::episode::Episodes>,
    pub metrics: WorkerMetrics,
    pub counters: Counters,
    pub lengths: CompletionLengths,
    pub leases: Mutex<HashMap<String, LeaseEntry>>,
    /// Sequences submitted (or about to be) and not finished generating.
    pub outstanding: AtomicUsize,
    /// Signalled whenever a sequence stops generating or a task ends.
    pub slot_freed: Notify,
    /// Newest version announced by the learner (-1: none yet).
    pub announced_version: AtomicI32,
    /// Announce-to-in-use latency of the last swap, ms (f64 bits).
    pub swap_latency_ms: AtomicU64,
    pub draining: AtomicBool,
    /// Set when the model thread is gone: the worker stops acquiring.
    pub fatal: Mutex<Option<String>>,
    pub returned_lease_ids: Mutex<Vec<String>>,
    /// The engine's token count last moved into the metrics.
    pub tokens_sampled: AtomicU64,
    /// The engine's shared prompt count last moved into the metrics.
    pub shared_sampled: AtomicU64,
    /// The version of every weight swap (from the weight loader).
    pub loaded: watch::Receiver<Option<i32>>,
    /// Wall-clock time (`Worker::with_clock`).
    pub clock: asyncrl_common::SharedClock,
}

impl Shared {
    pub fn leases(&self) -> std::sync::MutexGuard<'_, HashMap<String, LeaseEntry>> {
        self.leases.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn held_lease_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.leases().keys().cloned().collect();
        ids.sort();
        ids
    }

    pub fn set_fatal(&self, reason: String) {
        let mut f = self.fatal.lock().unwrap_or_else(PoisonError::into_inner);
        if f.is_none() {
            tracing::error!(reason = %reason, "the worker cannot continue");
            *f = Some(reason);
        }
        self.slot_freed.notify_one();
    }

    pub fn fatal(&self) -> Option<String> {
        self.fatal
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Revokes a held lease; returns whether it was held.
    pub fn revoke(&self, lease_id: &str) -> bool {
        let leases = self.leases();
        match leases.get(lease_id) {
            Some(entry) => {
                if !entry.revoked.swap(true, Ordering::SeqCst) {
                    tracing::warn!(lease_id, task_id = %entry.task_id, "lease revoked by the coordinator; cancelling its sequences");
                    self.metrics.tasks_revoked.inc();
                    bump(&self.counters.tasks_revoked);
                }
                entry.cancel.cancel();
                true
            }
            None => false,
        }
    }

    /// Waits until the weights in use are at least `version`: a task admitted
    /// at version v is not sampled with older weights, or the coordinator's
    /// staleness bound (which counts from the admission version) does not
    /// hold. Gives up after `limit` (the buffer's staleness check remains).
    pub async fn weights_at_least(&self, version: i32, limit: std::time::Duration) {
        let mut loaded = self.loaded.clone();
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            loaded.borrow_and_update();
            let in_use = self.engine.version();
            if in_use >= version {
                return;
            }
            tokio::select! {
                r = loaded.changed() => {
                    if r.is_err() {
                        // The weight loader stopped: nothing newer comes.
                        return;
                    }
                }
                _ = tokio::time::sleep_until(deadline) => {
                    tracing::warn!(
                        admission_version = version,
                        in_use,
                        waited_ms = limit.as_millis() as u64,
                        "the weights of the task's admission version are not in use yet; generating with older ones"
                    );
                    return;
                }
            }
        }
    }

    pub fn swap_latency_ms(&self) -> f64 {
        f64::from_bits(self.swap_latency_ms.load(Ordering::Relaxed))
    }
}

/// One sequence's claim on the worker's capacity: counted in
/// [`Shared::outstanding`] from creation until dropped (the sequence
/// finished generating, was cancelled or failed), and dropping it wakes the
/// acquire loop.
pub(crate) struct SeqGuard {
    shared: Arc<Shared>,
}

impl SeqGuard {
    pub fn new(shared: &Arc<Shared>) -> Self {
        shared.outstanding.fetch_add(1, Ordering::SeqCst);
        Self {
            shared: shared.clone(),
        }
    }
}

impl Drop for SeqGuard {
    fn drop(&mut self) {
        self.shared.outstanding.fetch_sub(1, Ordering::SeqCst);
        self.shared.slot_freed.notify_one();
    }
}
