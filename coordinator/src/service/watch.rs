//! The inputs that come from the KV bucket and the clock: watches of the
//! policy version, the knob schedule and the learner status (re-watched
//! after a reconnect), and the ticker that has the actor check lease
//! deadlines and heartbeats.

use std::sync::Arc;
use std::time::Duration;

use asyncrl_protos::subjects::POLICY_VERSION_KEY;
use asyncrl_protos::v1::{LearnerStatus, WeightAnnouncement};
use asyncrl_transport::KvBucket;
use bytes::Bytes;
use futures::StreamExt;
use prost::Message;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::Event;
use crate::LEARNER_STATUS_KEY;
use crate::knobs::{self, KNOBS_KEY};

/// Watches a KV key for as long as the coordinator runs, re-watching after
/// an error or an end of the stream (a NATS reconnect).
pub(crate) fn spawn_watch(
    kv: Arc<dyn KvBucket>,
    key: &'static str,
    tx: mpsc::Sender<Event>,
    shutdown: CancellationToken,
    map: fn(Bytes, u64) -> Option<Event>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut backoff = Duration::from_millis(100);
        loop {
            let stream = tokio::select! {
                _ = shutdown.cancelled() => return,
                s = kv.watch(key) => s,
            };
            match stream {
                Ok(mut stream) => loop {
                    let ev = tokio::select! {
                        _ = shutdown.cancelled() => return,
                        ev = stream.next() => ev,
                    };
                    match ev {
                        Some(Ok(ev)) => {
                            backoff = Duration::from_millis(100);
                            let Some(value) = ev.value else { continue };
                            if let Some(event) = map(value, ev.revision)
                                && tx.send(event).await.is_err()
                            {
                                return;
                            }
                        }
                        Some(Err(e)) => {
                            tracing::warn!(key, error = %e, "KV watch failed; watching again");
                            break;
                        }
                        None => {
                            tracing::debug!(key, "KV watch ended; watching again");
                            break;
                        }
                    }
                },
                Err(e) => tracing::warn!(key, error = %e, "cannot watch KV key; retrying"),
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    })
}

pub(crate) fn map_version(value: Bytes, _rev: u64) -> Option<Event> {
    match WeightAnnouncement::decode(value.as_ref()) {
        Ok(a) => Some(Event::Version(a)),
        Err(e) => {
            tracing::warn!(key = POLICY_VERSION_KEY, error = %e, "policy.version does not decode as WeightAnnouncement");
            None
        }
    }
}

pub(crate) fn map_knobs(value: Bytes, revision: u64) -> Option<Event> {
    match knobs::decode_schedule(&value) {
        Ok(schedule) => Some(Event::Knobs { schedule, revision }),
        Err(e) => {
            tracing::warn!(key = KNOBS_KEY, error = %e, "the knob schedule does not decode");
            None
        }
    }
}

pub(crate) fn map_learner_status(value: Bytes, _rev: u64) -> Option<Event> {
    match LearnerStatus::decode(value.as_ref()) {
        Ok(s) => Some(Event::LearnerStatus(s)),
        Err(e) => {
            tracing::warn!(key = LEARNER_STATUS_KEY, error = %e, "learner.status does not decode");
            None
        }
    }
}

/// Sends a tick to the actor periodically.
pub(crate) fn spawn_ticker(
    every: Duration,
    tx: mpsc::Sender<Event>,
    shutdown: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut interval = tokio::time::interval(every);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = interval.tick() => {}
            }
            if tx
                .send(Event::Tick(tokio::time::Instant::now()))
                .await
                .is_err()
            {
                return;
            }
        }
    })
}
