//! Requests to the coordinator over the bus (protobuf request/reply).

use std::time::Duration;

use asyncrl_protos::Message;
use asyncrl_transport::{Bus, TransportError};
use bytes::Bytes;

/// A failed request.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CallError {
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error("the reply on `{subject}` does not decode: {source}")]
    Decode {
        subject: String,
        #[source]
        source: asyncrl_protos::prost::DecodeError,
    },
}

/// Sends `request` on `subject` and decodes the reply.
pub(crate) async fn call<Rep: Message + Default>(
    bus: &dyn Bus,
    subject: &str,
    request: &impl Message,
    timeout: Duration,
) -> Result<Rep, CallError> {
    let payload = Bytes::from(request.encode_to_vec());
    let reply = bus.request(subject, payload, timeout).await?;
    Rep::decode(reply.as_ref()).map_err(|source| CallError::Decode {
        subject: subject.to_owned(),
        source,
    })
}

pub(crate) use asyncrl_common::Backoff;
