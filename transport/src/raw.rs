//! The NATS client used directly, without our [`Bus`](crate::Bus): the
//! baselines that `asyncrl-bench` measures our paths against, in the same
//! run and on the same server. Nothing in a role uses this.

use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;

use crate::{NatsBus, Result, TransportError};

/// A plain async-nats connection.
#[derive(Clone)]
pub struct RawNats {
    client: async_nats::Client,
}

impl std::fmt::Debug for RawNats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawNats").finish_non_exhaustive()
    }
}

/// A responder that answers every request with the same bytes until dropped.
#[derive(Debug)]
pub struct Echo {
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Echo {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Runs `op(0)`, …, `op(n − 1)` with `in_flight` of them at a time and
/// returns how long it took until every one had succeeded (the first
/// error otherwise). What each bench side times, ours and raw alike.
pub async fn timed_burst<T, E, F, Fut>(
    n: usize,
    in_flight: usize,
    op: F,
) -> std::result::Result<Duration, E>
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = std::result::Result<T, E>>,
{
    let start = Instant::now();
    let results: Vec<std::result::Result<T, E>> = futures::stream::iter(0..n)
        .map(op)
        .buffer_unordered(in_flight.max(1))
        .collect()
        .await;
    let elapsed = start.elapsed();
    results.into_iter().try_for_each(|r| r.map(drop))?;
    Ok(elapsed)
}

impl RawNats {
    pub async fn connect(url: &str) -> Result<Self> {
        let client = async_nats::connect(url)
            .await
            .map_err(|e| TransportError::backend("raw connect", e))?;
        Ok(Self { client })
    }

    /// Publishes `n` messages of `payload` to JetStream `subject`, each with
    /// the message id `<tag>-<i>`, `in_flight` at a time, and waits for every
    /// ack. Returns the time it took.
    pub async fn publish_with_ack(
        &self,
        subject: &str,
        payload: &Bytes,
        n: usize,
        in_flight: usize,
        tag: &str,
    ) -> Result<Duration> {
        let js = async_nats::jetstream::new(self.client.clone());
        timed_burst(n, in_flight, |i| {
            let msg = async_nats::jetstream::message::PublishMessage::build()
                .payload(payload.clone())
                .message_id(format!("{tag}-{i}"));
            let js = js.clone();
            async move { js.send_publish(subject.to_owned(), msg).await?.await }
        })
        .await
        .map_err(|e| TransportError::backend("raw publish", e))
    }

    /// Answers every request on `subject` with `reply` until the returned
    /// [`Echo`] is dropped (the subscription reached the server on return).
    pub async fn echo(&self, subject: &str, reply: Bytes) -> Result<Echo> {
        let mut sub = self
            .client
            .subscribe(subject.to_owned())
            .await
            .map_err(|e| TransportError::backend("raw subscribe", e))?;
        self.client
            .flush()
            .await
            .map_err(|e| TransportError::backend("raw flush", e))?;
        let client = self.client.clone();
        let task = tokio::spawn(async move {
            while let Some(m) = sub.next().await {
                if let Some(to) = m.reply
                    && client.publish(to, reply.clone()).await.is_err()
                {
                    return;
                }
            }
        });
        Ok(Echo { task })
    }

    /// Sends `n` requests of `payload` on `subject`, `concurrency` at a time,
    /// and waits for every reply. Returns the time it took.
    pub async fn request_burst(
        &self,
        subject: &str,
        payload: &Bytes,
        n: usize,
        concurrency: usize,
    ) -> Result<Duration> {
        timed_burst(n, concurrency, |_| {
            let client = self.client.clone();
            let payload = payload.clone();
            let subject = subject.to_owned();
            async move { client.request(subject, payload).await }
        })
        .await
        .map_err(|e| TransportError::backend("raw request", e))
    }
}

/// An object-store bucket opened with the client directly: the baseline of
/// `asyncrl-bench weights` (put once, N gets of the same bytes).
#[derive(Clone)]
pub struct RawObjects {
    store: async_nats::jetstream::object_store::ObjectStore,
}

impl std::fmt::Debug for RawObjects {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawObjects").finish_non_exhaustive()
    }
}

impl RawNats {
    /// Opens (creating if needed, without a byte limit) the object-store
    /// bucket `bucket`.
    pub async fn object_bucket(&self, bucket: &str) -> Result<RawObjects> {
        let js = async_nats::jetstream::new(self.client.clone());
        let store = match js.get_object_store(bucket).await {
            Ok(store) => store,
            Err(_) => js
                .create_object_store(async_nats::jetstream::object_store::Config {
                    bucket: bucket.to_owned(),
                    ..Default::default()
                })
                .await
                .map_err(|e| TransportError::backend("raw object bucket", e))?,
        };
        Ok(RawObjects { store })
    }
}

impl RawObjects {
    /// Stores `data` as `name` (the client hashes it for its digest).
    pub async fn put(&self, name: &str, data: &[u8]) -> Result<()> {
        let mut reader = data;
        self.store
            .put(name, &mut reader)
            .await
            .map_err(|e| TransportError::backend("raw object put", e))?;
        Ok(())
    }

    /// Reads every byte of `name` (the client checks them against the
    /// object's digest) and drops them as they arrive. Returns the size.
    pub async fn get_and_drop(&self, name: &str) -> Result<u64> {
        let mut object = self
            .store
            .get(name)
            .await
            .map_err(|e| TransportError::backend("raw object get", e))?;
        // A buffer larger than a chunk, so that each chunk is copied once.
        let mut buf = vec![0u8; 1 << 20];
        let mut total = 0u64;
        loop {
            use tokio::io::AsyncReadExt as _;
            let n = object
                .read(&mut buf)
                .await
                .map_err(|e| TransportError::backend("raw object get", e))?;
            if n == 0 {
                return Ok(total);
            }
            total += n as u64;
        }
    }

    pub async fn delete(&self, name: &str) -> Result<()> {
        self.store
            .delete(name)
            .await
            .map_err(|e| TransportError::backend("raw object delete", e))
    }
}

impl NatsBus {
    /// Deletes a stream (benches remove the streams they created).
    pub async fn delete_stream(&self, name: &str) -> Result<()> {
        self.jetstream()
            .delete_stream(name)
            .await
            .map_err(|e| TransportError::backend("delete stream", e))?;
        Ok(())
    }
}
