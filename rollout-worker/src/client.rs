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
    #[error("the reply on `{subject}` does not decode: {reason}")]
    Decode { subject: String, reason: String },
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
    Rep::decode(reply.as_ref()).map_err(|e| CallError::Decode {
        subject: subject.to_owned(),
        reason: e.to_string(),
    })
}

/// Exponential backoff between `min` and `max`.
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    min: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    pub fn new(min: Duration, max: Duration) -> Self {
        Self {
            min,
            max: max.max(min),
            next: min,
        }
    }

    /// The delay to wait now; the following one doubles.
    pub fn next_delay(&mut self) -> Duration {
        let d = self.next;
        self.next = (self.next * 2).min(self.max);
        d
    }

    pub fn reset(&mut self) {
        self.next = self.min;
    }
}

/// Milliseconds since the Unix epoch.
pub(crate) fn unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_the_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(350));
        let got: Vec<u128> = (0..4).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(got, vec![100, 200, 350, 350]);
        b.reset();
        assert_eq!(b.next_delay(), Duration::from_millis(100));
    }
}
