//! What one batch of events leaves to do: the replies that may go out with
//! the batch, and the durable ones that wait for the state write covering
//! their change (group commit).

use asyncrl_transport::{Delivery, Request};
use bytes::Bytes;

use super::persist::{PersistError, StateWrite};

/// A reply that may go out with the batch.
pub(super) struct Reply {
    pub(super) req: Request,
    pub(super) payload: Bytes,
}

/// The reply to a request that changed the persisted state: it goes out
/// only once the batch is written.
pub(super) struct DurableReply {
    pub(super) req: Request,
    pub(super) reply: Bytes,
    /// What to answer if the state cannot be written; None: no answer, so
    /// that the requester times out and retries.
    pub(super) if_unwritten: Option<Bytes>,
}

impl DurableReply {
    /// The state is written: the reply goes out.
    pub(super) fn written(self) -> Reply {
        Reply {
            req: self.req,
            payload: self.reply,
        }
    }

    /// The state is not written: the answer for that, if there is one.
    pub(super) fn unwritten(self) -> Option<Reply> {
        let payload = self.if_unwritten?;
        Some(Reply {
            req: self.req,
            payload,
        })
    }
}

/// What the events of one batch left to do.
#[derive(Default)]
pub(super) struct BatchOutcome {
    /// The persisted state changed: write it before the durable replies.
    pub(super) dirty: bool,
    pub(super) durable: Vec<DurableReply>,
    pub(super) ready: Vec<Reply>,
    /// Drop reports to ack once the state holding their effect is written.
    pub(super) acks: Vec<Delivery>,
    /// Events were taken (a failed write is retried on the next events).
    pub(super) events: bool,
}

/// A state write in flight and the replies that wait for it.
pub(super) struct InFlight {
    pub(super) write: StateWrite,
    pub(super) durable: Vec<DurableReply>,
    pub(super) ready: Vec<Reply>,
    pub(super) acks: Vec<Delivery>,
}

/// Acks stream messages without holding up the actor (a lost ack means a
/// redelivery, which the actor applies idempotently).
pub(super) fn ack_later(deliveries: Vec<Delivery>) {
    if deliveries.is_empty() {
        return;
    }
    tokio::spawn(async move {
        for d in deliveries {
            if let Err(e) = d.ack().await {
                tracing::debug!(error = %e, "could not ack a drop report; it will be delivered again");
            }
        }
    });
}

/// The outcome of the write in flight; never resolves when there is none.
pub(super) async fn written(in_flight: &mut Option<InFlight>) -> Result<u64, PersistError> {
    match in_flight {
        Some(w) => (&mut w.write.done).await,
        None => std::future::pending().await,
    }
}

/// Sends replies, all at once.
pub(super) async fn send_replies(replies: Vec<Reply>) {
    if replies.is_empty() {
        return;
    }
    futures::future::join_all(replies.into_iter().map(|r| async move {
        if let Err(e) = r.req.respond(r.payload).await {
            tracing::debug!(error = %e, "could not send a reply");
        }
    }))
    .await;
}
