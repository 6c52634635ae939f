//! The inputs that come from the KV bucket and the clock: watches of the
//! policy version, the knob schedule and the learner status (re-watched
//! after a reconnect), and the ticker that has the actor check lease
//! deadlines and heartbeats.

use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Duration;

use asyncrl_common::Backoff;
use asyncrl_control::kv as follow;
use asyncrl_protos::subjects::{
    CONTROL_BUCKET, EPOCHS_CLOSED_KEY, LEARNER_STATUS_KEY, POLICY_VERSION_KEY,
};
use asyncrl_protos::v1::{EpochsClosed, LearnerStatus, WeightAnnouncement};
use asyncrl_transport::Bus;
use bytes::Bytes;
use prost::Message;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::events::Event;
use crate::knobs::{self, KNOBS_KEY};

/// Follows a key of the control bucket for as long as the coordinator
/// runs (`asyncrl_control::kv::follow`: the current value first, re-watched
/// after an error or a reconnect), mapping each value to an actor event.
pub(crate) fn spawn_watch(
    bus: Arc<dyn Bus>,
    key: &'static str,
    tx: mpsc::Sender<Event>,
    shutdown: CancellationToken,
    map: fn(Bytes, u64) -> Option<Event>,
) -> tokio::task::JoinHandle<()> {
    let (min, max) = follow::FOLLOW_BACKOFF;
    tokio::spawn(follow::follow(
        bus,
        CONTROL_BUCKET,
        key,
        Backoff::new(min, max),
        shutdown,
        move |value, revision| {
            let tx = tx.clone();
            async move {
                let Some(event) = map(value, revision) else {
                    return ControlFlow::Continue(());
                };
                match tx.send(event).await {
                    Ok(()) => ControlFlow::Continue(()),
                    // The actor is gone: the coordinator is stopping.
                    Err(_) => ControlFlow::Break(()),
                }
            }
        },
    ))
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

/// Writes `coordinator.closed_epoch` (`asyncrl.v1.EpochsClosed`) whenever
/// the stored state closes a later epoch, retrying with backoff until the
/// write lands (a later value replaces one still waiting). Only the
/// coordinator writes the key; the buffer follows it.
pub(crate) fn spawn_epochs_closed(
    bus: Arc<dyn Bus>,
    mut closed: tokio::sync::watch::Receiver<Option<u64>>,
    shutdown: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let (min, max) = follow::FOLLOW_BACKOFF;
        let mut backoff = Backoff::new(min, max);
        let mut written: Option<u64> = None;
        loop {
            let through = *closed.borrow_and_update();
            if let Some(through) = through.filter(|t| Some(*t) != written) {
                let value = Bytes::from(EpochsClosed { through }.encode_to_vec());
                let put = async {
                    bus.kv(CONTROL_BUCKET)
                        .await?
                        .put(EPOCHS_CLOSED_KEY, value)
                        .await
                };
                match shutdown.run_until_cancelled(put).await {
                    None => return,
                    Some(Ok(_)) => {
                        tracing::debug!(through, "closed epochs published");
                        written = Some(through);
                        backoff.reset();
                    }
                    Some(Err(e)) => {
                        tracing::warn!(key = EPOCHS_CLOSED_KEY, through, error = %e, "cannot write the closed epochs; retrying");
                        let wait = tokio::time::sleep(backoff.next_delay());
                        if shutdown.run_until_cancelled(wait).await.is_none() {
                            return;
                        }
                        continue;
                    }
                }
            }
            match shutdown.run_until_cancelled(closed.changed()).await {
                Some(Ok(())) => {}
                // Cancelled, or the actor is gone.
                None | Some(Err(_)) => return,
            }
        }
    })
}
