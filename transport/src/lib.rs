//! One async interface for everything the roles need from a message bus, and
//! two implementations of it:
//!
//! - [`NatsBus`]: NATS with JetStream (streams, KV, object store), for
//!   processes and pods;
//! - [`LocalBus`]: in-process (tokio), for the one-process default.
//!
//! The conformance suite in `tests/conformance.rs` runs the same checks
//! against both; a role never knows which one it talks to.
//!
//! What the interface offers:
//! - plain publish/subscribe and request/reply with a timeout ([`Bus::request`],
//!   [`Bus::serve`]);
//! - durable streams with publish-with-id (server-side dedupe), and durable
//!   pull consumers with explicit ack and redelivery after the ack wait;
//! - key-value buckets whose watch yields the current value first, then
//!   every update;
//! - an object store for large blobs (chunked on NATS), sha256-checked on read.

mod local;
mod metrics;
mod names;
mod nats;
pub mod raw;
mod violations;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::BoxStream;

pub use local::LocalBus;
pub use metrics::TransportMetrics;
pub use names::subject_matches;
pub use nats::NatsBus;

pub type Result<T> = std::result::Result<T, TransportError>;

/// What can go wrong on the bus. Callers branch on the kind: a `Timeout` is
/// retried, a `ChecksumMismatch` keeps the old weights, a `RevisionMismatch`
/// re-reads and retries a compare-and-set.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum TransportError {
    #[error("cannot connect to NATS at {url}: {what}: {source}")]
    Connect {
        url: String,
        /// What failed (e.g. "cannot read token file /x").
        what: String,
        #[source]
        source: BackendError,
    },
    #[error("no responder is listening on `{subject}`")]
    NoResponders { subject: String },
    #[error("request on `{subject}` timed out after {timeout:?}")]
    Timeout { subject: String, timeout: Duration },
    #[error("no stream `{stream}`")]
    NoStream { stream: String },
    #[error("no stream captures subject `{subject}`")]
    NoStreamForSubject { subject: String },
    #[error("key `{key}` already exists")]
    KeyExists { key: String },
    #[error("key `{key}` changed concurrently (expected revision {expected})")]
    RevisionMismatch { key: String, expected: u64 },
    #[error("object `{name}` not found in `{bucket}`")]
    ObjectNotFound { bucket: String, name: String },
    #[error("object `{name}` failed its checksum: expected sha256 {expected}, got {actual}")]
    ChecksumMismatch {
        name: String,
        expected: String,
        actual: String,
    },
    #[error("the stream of `{subject}` is full ({what}); retry once its consumer has caught up")]
    StreamFull { subject: String, what: String },
    #[error("payload of {size} bytes exceeds the bus limit of {max} bytes")]
    PayloadTooLarge { size: usize, max: usize },
    #[error("invalid name `{name}`: {reason}")]
    InvalidName { name: String, reason: String },
    #[error("the bus is closed")]
    Closed,
    /// The server refused a publish or subscription of this connection's
    /// user (its permissions in the server config). Not transient: the same
    /// call with the same credentials is refused again.
    #[error(
        "NATS refused {op} on `{subject}`: the credentials of this role lack the permission (see deploy/k8s/base/nats-auth.conf)"
    )]
    PermissionDenied {
        /// `publish` or `subscribe`.
        op: &'static str,
        subject: String,
    },
    #[error("{op} failed: {source}")]
    Backend {
        op: &'static str,
        #[source]
        source: BackendError,
    },
}

/// The NATS client's error behind a [`TransportError::Backend`], kept with
/// its chain of causes (shared, so that the error stays `Clone`).
#[derive(Debug, Clone)]
pub struct BackendError(std::sync::Arc<dyn std::error::Error + Send + Sync>);

impl std::fmt::Display for BackendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for BackendError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

/// Two backend errors are equal when they say the same (the client's
/// errors are not comparable themselves).
impl PartialEq for BackendError {
    fn eq(&self, other: &Self) -> bool {
        self.0.to_string() == other.0.to_string()
    }
}

impl TransportError {
    pub(crate) fn connect(
        url: &str,
        what: impl Into<String>,
        e: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        TransportError::Connect {
            url: url.to_owned(),
            what: what.into(),
            source: BackendError(std::sync::Arc::from(e.into())),
        }
    }

    pub(crate) fn backend(
        op: &'static str,
        e: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        TransportError::Backend {
            op,
            source: BackendError(std::sync::Arc::from(e.into())),
        }
    }

    /// Whether retrying the same call later can succeed.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            TransportError::NoResponders { .. }
                | TransportError::Timeout { .. }
                | TransportError::StreamFull { .. }
                | TransportError::Backend { .. }
                | TransportError::Connect { .. }
        )
    }
}

/// A plain (non-durable) message.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    pub subject: String,
    pub payload: Bytes,
}

/// An incoming request; answer it with [`Request::respond`].
pub struct Request {
    pub subject: String,
    pub payload: Bytes,
    replier: Replier,
}

pub(crate) enum Replier {
    Nats {
        client: async_nats::Client,
        reply: Option<async_nats::Subject>,
        link: Arc<nats::Link>,
    },
    Local(Option<tokio::sync::oneshot::Sender<Bytes>>),
}

impl Request {
    /// Sends the reply. Errors only if the bus is gone; a requester that has
    /// timed out meanwhile is not an error.
    pub async fn respond(mut self, payload: Bytes) -> Result<()> {
        match &mut self.replier {
            Replier::Nats {
                client,
                reply,
                link,
            } => match reply.take() {
                Some(reply) => {
                    link.replying(&reply);
                    client
                        .publish(reply, payload)
                        .await
                        .map_err(|e| TransportError::backend("reply", e))
                }
                None => Ok(()),
            },
            Replier::Local(tx) => {
                if let Some(tx) = tx.take() {
                    let _ = tx.send(payload);
                }
                Ok(())
            }
        }
    }
}

/// A durable stream: which subjects it captures and how long it keeps them.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamSpec {
    pub name: String,
    pub subjects: Vec<String>,
    /// A message whose id was seen within this window is dropped as a duplicate.
    pub duplicate_window: Duration,
    /// Messages older than this are removed (zero: kept until deleted).
    pub max_age: Duration,
    pub replicas: usize,
    /// When a message leaves the stream besides `max_age` and the limits.
    pub retention: Retention,
    /// Bytes the stream may hold (None: no limit of its own).
    pub max_bytes: Option<u64>,
    /// What happens to a publish when the stream is at `max_bytes`.
    pub discard: Discard,
}

impl StreamSpec {
    pub fn new(name: impl Into<String>, subjects: &[&str]) -> Self {
        Self {
            name: name.into(),
            subjects: subjects.iter().map(|s| s.to_string()).collect(),
            duplicate_window: Duration::from_secs(120),
            max_age: Duration::ZERO,
            replicas: 1,
            retention: Retention::Limits,
            max_bytes: None,
            discard: Discard::Old,
        }
    }
}

/// When a stream lets go of a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retention {
    /// Only by age or by the limits (`max_bytes` with [`Discard::Old`]).
    Limits,
    /// Once a consumer has acked it (a work queue: one consumer per
    /// subject). The duplicate window still applies to a released message's
    /// id: a republished copy is dropped as a duplicate.
    WorkQueue,
}

/// What a full stream does with a new message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Discard {
    /// Removes the oldest messages to make room.
    Old,
    /// Refuses the publish with [`TransportError::StreamFull`] (transient:
    /// retry once the consumer has caught up).
    New,
}

/// How much one JetStream store holds (a stream, a KV bucket or an object
/// store), as [`Bus::storage`] reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct StoreUsage {
    /// The store's name as the bus knows it (`TRAJECTORIES`,
    /// `KV_asyncrl_control`, `OBJ_WEIGHTS`).
    pub name: String,
    pub messages: u64,
    pub bytes: u64,
    /// Its byte limit (None: none of its own).
    pub max_bytes: Option<u64>,
}

/// The server's answer to a durable publish.
#[derive(Debug, Clone, PartialEq)]
pub struct PublishAck {
    pub stream: String,
    pub sequence: u64,
    /// The id was seen before: nothing was stored, `sequence` is the original's.
    pub duplicate: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeliverFrom {
    /// Every message still in the stream.
    All,
    /// Only messages published after the consumer was created.
    New,
}

/// A durable pull consumer: its position survives restarts of the consumer
/// (and, on NATS, of the server).
#[derive(Debug, Clone, PartialEq)]
pub struct ConsumerSpec {
    pub durable_name: String,
    pub filter_subject: Option<String>,
    /// An un-acked message is delivered again after this long.
    pub ack_wait: Duration,
    /// Give up on a message after this many deliveries (`None`: never).
    pub max_deliver: Option<u32>,
    /// At most this many delivered, un-acked messages at once.
    pub max_ack_pending: usize,
    pub deliver_from: DeliverFrom,
}

impl ConsumerSpec {
    pub fn new(durable_name: impl Into<String>) -> Self {
        Self {
            durable_name: durable_name.into(),
            filter_subject: None,
            ack_wait: Duration::from_secs(30),
            max_deliver: None,
            max_ack_pending: 10_000,
            deliver_from: DeliverFrom::All,
        }
    }
}

/// A message from a durable stream. It is delivered again after the ack wait
/// unless acked.
pub struct Delivery {
    pub subject: String,
    pub payload: Bytes,
    /// The publisher's message id (`Nats-Msg-Id`), if any.
    pub msg_id: Option<String>,
    pub stream_sequence: u64,
    /// How many times this message has been delivered (1 the first time).
    pub delivered: u64,
    acker: Acker,
}

pub(crate) enum Acker {
    Nats(Box<async_nats::jetstream::Message>),
    Local(local::LocalAcker),
}

impl Delivery {
    /// Acknowledges the message: it will not be delivered again.
    pub async fn ack(&self) -> Result<()> {
        match &self.acker {
            Acker::Nats(m) => m
                .double_ack()
                .await
                .map_err(|e| TransportError::backend("ack", e)),
            Acker::Local(a) => a.ack(),
        }
    }

    /// Acknowledges all of `deliveries` (messages of one consumer), with
    /// one confirmation for the lot instead of one per message: each is
    /// acked without waiting, in order, and the last one waits for the
    /// server's confirmation, which it sends after handling the earlier
    /// acks of the same connection. Ok means all were acked.
    pub async fn ack_all(deliveries: &[&Delivery]) -> Result<()> {
        let Some((last, rest)) = deliveries.split_last() else {
            return Ok(());
        };
        for d in rest {
            match &d.acker {
                Acker::Nats(m) => m
                    .ack()
                    .await
                    .map_err(|e| TransportError::backend("ack", e))?,
                Acker::Local(a) => a.ack()?,
            }
        }
        last.ack().await
    }

    /// Asks for redelivery after `delay` (immediately when zero).
    pub async fn nak(&self, delay: Duration) -> Result<()> {
        match &self.acker {
            Acker::Nats(m) => {
                let kind = async_nats::jetstream::AckKind::Nak((!delay.is_zero()).then_some(delay));
                m.ack_with(kind)
                    .await
                    .map_err(|e| TransportError::backend("nak", e))
            }
            Acker::Local(a) => a.nak(delay),
        }
    }

    /// Says the message is still being worked on: restarts its ack wait.
    pub async fn in_progress(&self) -> Result<()> {
        match &self.acker {
            Acker::Nats(m) => m
                .ack_with(async_nats::jetstream::AckKind::Progress)
                .await
                .map_err(|e| TransportError::backend("in_progress", e)),
            Acker::Local(a) => a.in_progress(),
        }
    }
}

impl std::fmt::Debug for Delivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Delivery")
            .field("subject", &self.subject)
            .field("msg_id", &self.msg_id)
            .field("stream_sequence", &self.stream_sequence)
            .field("delivered", &self.delivered)
            .field("bytes", &self.payload.len())
            .finish()
    }
}

#[async_trait]
pub trait Consumer: Send + Sync {
    /// Returns up to `max` messages, waiting up to `wait` for the first one.
    /// An empty vector means nothing arrived in time.
    async fn fetch(&self, max: usize, wait: Duration) -> Result<Vec<Delivery>>;
}

/// A value in a KV bucket.
#[derive(Debug, Clone, PartialEq)]
pub struct KvEntry {
    pub key: String,
    pub value: Bytes,
    pub revision: u64,
}

/// A change seen by a watch; `value` is `None` when the key was deleted.
#[derive(Debug, Clone, PartialEq)]
pub struct KvEvent {
    pub key: String,
    pub value: Option<Bytes>,
    pub revision: u64,
}

#[async_trait]
pub trait KvBucket: Send + Sync {
    async fn get(&self, key: &str) -> Result<Option<KvEntry>>;
    /// Writes unconditionally; returns the new revision.
    async fn put(&self, key: &str, value: Bytes) -> Result<u64>;
    /// Writes only if the key does not exist ([`TransportError::KeyExists`]).
    async fn create(&self, key: &str, value: Bytes) -> Result<u64>;
    /// Writes only if the key is at `revision` ([`TransportError::RevisionMismatch`]).
    async fn update(&self, key: &str, value: Bytes, revision: u64) -> Result<u64>;
    async fn delete(&self, key: &str) -> Result<()>;
    async fn keys(&self) -> Result<Vec<String>>;
    /// Watches `key` (NATS wildcards allowed: `a.*`, `a.>`): yields the current
    /// value of every matching key first, then every change.
    async fn watch(&self, key: &str) -> Result<BoxStream<'static, Result<KvEvent>>>;
}

/// What the object store knows about a blob.
#[derive(Debug, Clone, PartialEq)]
pub struct ObjectInfo {
    pub name: String,
    pub size: u64,
    /// Lower-case hex SHA-256 of the bytes, computed by us at put time.
    pub sha256: String,
    pub chunks: usize,
}

#[async_trait]
pub trait ObjectStore: Send + Sync {
    /// Stores a blob (replacing one of the same name) and returns its info.
    async fn put(&self, name: &str, data: Bytes) -> Result<ObjectInfo>;
    /// Reads a blob and checks it against the sha256 recorded at put time.
    async fn get(&self, name: &str) -> Result<Bytes>;
    async fn info(&self, name: &str) -> Result<Option<ObjectInfo>>;
    async fn delete(&self, name: &str) -> Result<()>;
    async fn list(&self) -> Result<Vec<ObjectInfo>>;

    /// Reads a blob and checks it against a sha256 announced by its producer
    /// as well (e.g. a weight announcement).
    async fn get_expecting(&self, name: &str, sha256: &str) -> Result<Bytes> {
        let data = self.get(name).await?;
        expect_sha256(name, sha256_hex(&data), sha256)?;
        Ok(data)
    }
}

/// Chunk size of the objects both buses store (reported by the in-process
/// one), NATS' default.
pub(crate) const OBJECT_CHUNK: usize = 128 * 1024;

/// Checks an object's verified sha256 against the one its producer
/// announced (both hex, any case).
pub(crate) fn expect_sha256(name: &str, actual: String, expected: &str) -> Result<()> {
    if actual.eq_ignore_ascii_case(expected) {
        Ok(())
    } else {
        Err(TransportError::ChecksumMismatch {
            name: name.into(),
            expected: expected.into(),
            actual,
        })
    }
}

/// The bus every role talks over.
#[async_trait]
pub trait Bus: Send + Sync {
    /// "nats" or "local".
    fn kind(&self) -> &'static str;

    /// Fire-and-forget publish to plain subscribers.
    async fn publish(&self, subject: &str, payload: Bytes) -> Result<()>;
    /// Subscribes to a subject (wildcards allowed).
    async fn subscribe(&self, subject: &str) -> Result<BoxStream<'static, Message>>;

    /// Sends a request and waits up to `timeout` for the reply.
    /// Fails fast with [`TransportError::NoResponders`] when nobody serves it.
    async fn request(&self, subject: &str, payload: Bytes, timeout: Duration) -> Result<Bytes>;
    /// Serves requests on a subject. With a queue group, each request goes to
    /// one member of the group.
    async fn serve(
        &self,
        subject: &str,
        queue_group: Option<&str>,
    ) -> Result<BoxStream<'static, Request>>;

    /// Creates the stream, or updates it to `spec` if it exists.
    async fn ensure_stream(&self, spec: &StreamSpec) -> Result<()>;
    /// Publishes to a durable stream with a message id; a republished id
    /// within the stream's duplicate window is acknowledged but not stored.
    async fn publish_durable(
        &self,
        subject: &str,
        msg_id: &str,
        payload: Bytes,
    ) -> Result<PublishAck>;
    /// Number of messages held by a stream.
    async fn stream_len(&self, stream: &str) -> Result<u64>;
    /// What every store of the bus holds (streams, KV buckets, object
    /// stores), for the storage gauges and their alert.
    async fn storage(&self) -> Result<Vec<StoreUsage>>;
    /// Creates (or binds to) a durable pull consumer.
    async fn consumer(&self, stream: &str, spec: &ConsumerSpec) -> Result<Box<dyn Consumer>>;

    /// Opens a KV bucket, creating it if missing.
    async fn kv(&self, bucket: &str) -> Result<Arc<dyn KvBucket>>;
    /// Opens an object store, creating it if missing.
    async fn object_store(&self, bucket: &str) -> Result<Arc<dyn ObjectStore>>;

    /// Waits until everything published so far has reached the server.
    async fn flush(&self) -> Result<()>;

    /// The largest message the server takes (NATS `max_payload`); `None`:
    /// no limit (the in-process bus). A reply larger than this is never
    /// delivered.
    fn max_payload(&self) -> Option<usize> {
        None
    }

    /// Since when (Unix ms) this process has been connected without a
    /// break; `None` while it is disconnected. Whoever judges others by
    /// silence (the coordinator's heartbeat sweep) must not count the time
    /// it could not hear. The in-process bus is always connected.
    fn connected_since_unix_ms(&self) -> Option<i64> {
        Some(0)
    }
}

/// Connects to the bus named by the config: the in-process bus for
/// `url = "local"`, NATS otherwise.
pub async fn connect(
    config: &asyncrl_config::BusConfig,
    metrics: TransportMetrics,
) -> Result<Arc<dyn Bus>> {
    match config.kind() {
        asyncrl_config::BusKind::Local => Ok(Arc::new(LocalBus::new())),
        asyncrl_config::BusKind::Nats => Ok(Arc::new(NatsBus::connect(config, metrics).await?)),
    }
}

/// Lower-case hex SHA-256 (the object store's checksum).
pub use asyncrl_common::sha256_hex;
