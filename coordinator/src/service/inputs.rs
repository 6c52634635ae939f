//! The inputs that reach the actor over the bus: worker requests on their
//! subjects (served in the coordinator's queue group) and the buffer's
//! dropped-group reports.

use std::sync::Arc;
use std::time::Duration;

use asyncrl_protos::subjects::BUFFER_GROUP_DROPPED;
use asyncrl_protos::v1::GroupDropped;
use asyncrl_transport::Bus;
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

/// Forwards the buffer's dropped-group reports.
pub(crate) fn spawn_group_dropped(
    bus: Arc<dyn Bus>,
    tx: mpsc::Sender<Event>,
    shutdown: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let sub = tokio::select! {
                _ = shutdown.cancelled() => return,
                s = bus.subscribe(BUFFER_GROUP_DROPPED) => s,
            };
            match sub {
                Ok(mut sub) => loop {
                    let m = tokio::select! {
                        _ = shutdown.cancelled() => return,
                        m = sub.next() => m,
                    };
                    let Some(m) = m else { break };
                    match GroupDropped::decode(m.payload.as_ref()) {
                        Ok(g) => {
                            if tx.send(Event::GroupDropped(g)).await.is_err() {
                                return;
                            }
                        }
                        Err(e) => tracing::warn!(error = %e, "malformed GroupDropped"),
                    }
                },
                Err(e) => {
                    tracing::warn!(error = %e, "cannot subscribe to dropped-group reports; retrying")
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            }
        }
    })
}
