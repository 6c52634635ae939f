//! The inputs that reach the actor over the bus: worker requests on their
//! subjects (served in the coordinator's queue group) and the buffer's
//! dropped-group reports.

use std::sync::Arc;
use std::time::Duration;

use asyncrl_common::Backoff;
use asyncrl_protos::subjects::{BUFFER_GROUP_DROPPED, GROUP_DROP_CONSUMER, GROUP_DROP_STREAM};
use asyncrl_protos::v1::GroupDropped;
use asyncrl_transport::{Bus, Consumer, ConsumerSpec, DeliverFrom};
use futures::StreamExt;
use prost::Message;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::events::{Event, RequestKind};
use asyncrl_protos::subjects::{COORDINATOR_QUEUE_GROUP, worker_subject_pattern};

use crate::error::CoordinatorError;

/// Forwards the worker requests to the actor: each kind on its subject
/// (the in-process roles, the coordinator tests) and on the subjects of
/// every worker (`<subject>.<worker id>`, what a worker sends on, and all
/// that a worker's NATS user may publish).
pub(crate) async fn spawn_request_forwarders(
    bus: &Arc<dyn Bus>,
    tx: &mpsc::Sender<Event>,
    shutdown: &CancellationToken,
) -> Result<Vec<tokio::task::JoinHandle<()>>, CoordinatorError> {
    let mut handles = Vec::new();
    for kind in [
        RequestKind::Register,
        RequestKind::Heartbeat,
        RequestKind::Acquire,
        RequestKind::Complete,
        RequestKind::Return,
    ] {
        for subject in [
            kind.subject().to_owned(),
            worker_subject_pattern(kind.subject()),
        ] {
            handles.push(forward(bus, kind, &subject, tx, shutdown).await?);
        }
    }
    Ok(handles)
}

async fn forward(
    bus: &Arc<dyn Bus>,
    kind: RequestKind,
    subject: &str,
    tx: &mpsc::Sender<Event>,
    shutdown: &CancellationToken,
) -> Result<tokio::task::JoinHandle<()>, CoordinatorError> {
    {
        let mut stream = bus
            .serve(subject, Some(COORDINATOR_QUEUE_GROUP))
            .await
            .map_err(|e| CoordinatorError::transport(subject, e))?;
        let tx = tx.clone();
        let shutdown = shutdown.clone();
        let subject = subject.to_owned();
        Ok(tokio::spawn(async move {
            loop {
                let req = tokio::select! {
                    _ = shutdown.cancelled() => break,
                    r = stream.next() => r,
                };
                let Some(req) = req else {
                    tracing::warn!(subject, "request subscription ended");
                    break;
                };
                if tx.send(Event::Request { kind, req }).await.is_err() {
                    break;
                }
            }
        }))
    }
}

/// Opens the coordinator's durable consumer of the buffer's drop reports
/// (creating their stream when the coordinator starts first).
pub(crate) async fn group_drop_consumer(
    bus: &Arc<dyn Bus>,
    config: &asyncrl_config::BusConfig,
) -> Result<Box<dyn Consumer>, CoordinatorError> {
    bus.ensure_stream(&asyncrl_control::streams::group_drop_stream_spec(config))
        .await
        .map_err(|e| CoordinatorError::transport("create the GROUP_DROPS stream", e))?;
    let spec = ConsumerSpec {
        ack_wait: DROP_ACK_WAIT,
        max_ack_pending: 1024,
        deliver_from: DeliverFrom::All,
        ..ConsumerSpec::new(GROUP_DROP_CONSUMER)
    };
    bus.consumer(GROUP_DROP_STREAM, &spec)
        .await
        .map_err(|e| CoordinatorError::transport("open the GROUP_DROPS consumer", e))
}

/// A report not acked within this long is delivered again: the actor acks
/// one once the state that holds its effect is written, or, for a report
/// that overtook its group's completion, not at all (it comes back until
/// the completion has been counted). Short, because a report fetched but
/// lost on the way (a fetch cut by a leader change) waits this long before
/// its task is issued again; a report delivered again is applied once.
pub(crate) const DROP_ACK_WAIT: Duration = Duration::from_secs(5);

/// Forwards the buffer's dropped-group reports (from the durable stream,
/// so none is lost while the coordinator is down or reconnecting). A
/// malformed report is acked and counted: it can never be applied.
pub(crate) fn spawn_group_dropped(
    consumer: Box<dyn Consumer>,
    tx: mpsc::Sender<Event>,
    metrics: crate::metrics::CoordinatorMetrics,
    shutdown: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        loop {
            let fetched = tokio::select! {
                _ = shutdown.cancelled() => return,
                f = consumer.fetch(64, Duration::from_secs(1)) => f,
            };
            let deliveries = match fetched {
                Ok(d) => {
                    backoff.reset();
                    d
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot fetch dropped-group reports; retrying");
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep(backoff.next_delay()) => {}
                    }
                    continue;
                }
            };
            for d in deliveries {
                match GroupDropped::decode(d.payload.as_ref()) {
                    Ok(report) => {
                        let ev = Event::GroupDropped {
                            report,
                            delivery: d,
                        };
                        if tx.send(ev).await.is_err() {
                            return;
                        }
                    }
                    Err(e) => {
                        metrics
                            .bad_requests
                            .get_or_create(&crate::metrics::BadRequestLabel {
                                subject: BUFFER_GROUP_DROPPED.into(),
                                reason: "decode".into(),
                            })
                            .inc();
                        tracing::warn!(error = %e, stream_sequence = d.stream_sequence, "malformed GroupDropped report; discarded");
                        if let Err(e) = d.ack().await {
                            tracing::debug!(error = %e, "cannot ack a malformed report");
                        }
                    }
                }
            }
        }
    })
}
