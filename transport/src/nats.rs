//! The NATS implementation: core NATS for pub/sub and request/reply,
//! JetStream for durable streams, KV buckets and the object store.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, kv, object_store, stream};
use async_nats::{Client, ConnectOptions, Event, ServerAddr};
use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use tokio::io::AsyncReadExt;

use asyncrl_config::BusConfig;

use crate::names::{validate_key, validate_publish_subject};
use crate::violations::{self, Denied, Violation, Violations};
use crate::{
    Acker, Bus, Consumer, ConsumerSpec, DeliverFrom, Delivery, KvBucket, KvEntry, KvEvent, Message,
    OBJECT_CHUNK, ObjectInfo, ObjectStore, PublishAck, Replier, Request, Result, StoreUsage,
    StreamSpec, TransportError, TransportMetrics, expect_sha256, sha256_hex,
};

/// What a publish refused by a full stream (or a full JetStream store)
/// says, if that is why it was refused.
fn stream_full(e: &jetstream::context::PublishError) -> Option<String> {
    let js = std::error::Error::source(e)?.downcast_ref::<jetstream::Error>()?;
    let full = matches!(
        js.error_code(),
        jetstream::ErrorCode::STREAM_STORE_FAILED
            | jetstream::ErrorCode::STORAGE_RESOURCES_EXCEEDED
            | jetstream::ErrorCode::INSUFFICIENT_RESOURCES
    ) || js.to_string().contains("maximum");
    full.then(|| js.to_string())
}

/// JetStream's form of a byte limit: -1 for none.
fn byte_limit(bytes: Option<u64>) -> i64 {
    bytes.map_or(-1, |b| i64::try_from(b).unwrap_or(i64::MAX))
}

/// Object metadata key under which earlier versions recorded their own
/// sha256 of an object (still checked when present). The client's digest
/// (`SHA-256=<base64url>`) is the same hash, computed once as it writes.
const SHA256_META: &str = "asyncrl-sha256";

/// Chunks of one object put awaiting their ack at a time.
const PUT_CHUNKS_IN_FLIGHT: usize = 32;

/// The object's sha256 (hex) from the client's digest, `None` without one.
fn digest_hex(info: &object_store::ObjectInfo) -> Option<String> {
    use base64::Engine as _;
    let encoded = info.digest.as_deref()?.strip_prefix("SHA-256=")?;
    let raw = base64::engine::general_purpose::URL_SAFE
        .decode(encoded)
        .or_else(|_| base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(encoded))
        .ok()?;
    (raw.len() == 32).then(|| hex::encode(raw))
}

/// A connection to NATS with JetStream.
#[derive(Clone)]
pub struct NatsBus {
    client: Client,
    js: jetstream::Context,
    replicas: usize,
    request_timeout: Duration,
    /// Byte limits of the KV buckets and object stores this bus creates.
    kv_max_bytes: u64,
    objects_max_bytes: Option<u64>,
    /// `bus.open_stores_only`: wait for a missing bucket, never create it.
    open_stores_only: bool,
    metrics: TransportMetrics,
    link: Arc<Link>,
}

/// The connection's state as the client's events report it.
#[derive(Debug, Default)]
pub(crate) struct Link {
    connected: AtomicBool,
    /// Unix ms of the last (re)connect.
    since_ms: AtomicI64,
    /// Publishes and subscriptions the server refused.
    violations: Violations,
    /// The connection's inbox (`<inbox prefix>.>`): where every reply and
    /// JetStream answer arrives. Once the server refuses a subscription
    /// there (credentials for another inbox prefix), no request can get an
    /// answer, and each fails at once naming the refused subscription.
    inbox: Vec<String>,
    /// The subjects of the latest replies this connection sent (at most
    /// [`RECENT_REPLIES`]): a refused publish on one is a reply refused.
    replies: std::sync::Mutex<std::collections::VecDeque<String>>,
}

/// How many reply subjects [`Link`] remembers.
const RECENT_REPLIES: usize = 1024;

impl Link {
    /// A reply is about to be sent on `subject`.
    pub(crate) fn replying(&self, subject: &str) {
        let mut replies = self
            .replies
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if replies.len() == RECENT_REPLIES {
            replies.pop_front();
        }
        replies.push_back(subject.to_owned());
    }

    fn is_reply(&self, subject: &str) -> bool {
        self.replies
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .any(|r| r == subject)
    }

    /// The server's refusal of this connection's inbox, if it came.
    fn inbox_refused(&self) -> Option<Violation> {
        self.violations.find(0, Denied::Subscribe, &self.inbox)
    }

    fn up(&self) {
        self.since_ms.store(unix_ms(), Ordering::SeqCst);
        self.connected.store(true, Ordering::SeqCst);
    }
}

use asyncrl_common::unix_ms;

/// Exponential backoff for reconnects: 50 ms doubling, capped at `max`.
fn reconnect_delay(attempts: usize, max: Duration) -> Duration {
    asyncrl_common::Backoff::delay_after(Duration::from_millis(50), max, attempts)
}

/// Runs a bus operation that publishes to subjects matching `patterns`. The
/// server drops a publish it refuses and says so only asynchronously, so
/// the operation would wait for its reply until it times out; it ends
/// instead with [`TransportError::PermissionDenied`] once the refusal of one
/// of its subjects is recorded (and a failure with a refusal behind it is
/// reported as the refusal).
async fn guarded<T>(
    link: &Link,
    metrics: &TransportMetrics,
    op: &'static str,
    patterns: &[String],
    operation: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    let since = link.violations.mark();
    let denied = |v: Violation| TransportError::PermissionDenied {
        op: v.kind.op(),
        subject: v.subject,
    };
    if let Some(v) = link.inbox_refused() {
        metrics.error(op);
        return Err(denied(v));
    }
    tokio::select! {
        biased;
        // A failure is counted by the operation itself.
        result = operation => result.map_err(|e| {
            match link
                .violations
                .find(since, Denied::Publish, patterns)
                .or_else(|| link.inbox_refused())
            {
                Some(v) => denied(v),
                None => e,
            }
        }),
        v = link.violations.wait(since, Denied::Publish, patterns) => {
            metrics.error(op);
            Err(denied(v))
        }
        v = link.violations.wait(0, Denied::Subscribe, &link.inbox) => {
            metrics.error(op);
            Err(denied(v))
        }
    }
}

/// A subscription's messages until the server refuses the subscription
/// (the refusal is logged and counted where it is recorded): a stream that
/// ends, rather than one that silently never yields.
/// `since`: the violations' mark taken before subscribing.
fn until_refused<T: Send + 'static>(
    link: &Arc<Link>,
    since: u64,
    subject: &str,
    stream: BoxStream<'static, T>,
) -> BoxStream<'static, T> {
    let link = link.clone();
    let patterns = vec![subject.to_owned()];
    let refused = Box::pin(async move {
        link.violations
            .wait(since, Denied::Subscribe, &patterns)
            .await
    });
    stream.take_until(refused).boxed()
}

async fn connect_options(
    config: &BusConfig,
    metrics: &TransportMetrics,
    link: &Arc<Link>,
) -> Result<ConnectOptions> {
    let url = config.url.clone();
    let mut opts = match (
        &config.credentials_file,
        &config.token,
        &config.token_file,
        &config.user,
    ) {
        (Some(path), ..) => ConnectOptions::with_credentials_file(path)
            .await
            .map_err(|e| {
                TransportError::connect(
                    &url,
                    format!("cannot read credentials file {}", path.display()),
                    e,
                )
            })?,
        (None, Some(token), ..) => ConnectOptions::with_token(token.expose().to_owned()),
        (None, None, Some(path), _) => {
            let token = std::fs::read_to_string(path).map_err(|e| {
                TransportError::connect(
                    &url,
                    format!("cannot read token file {}", path.display()),
                    e,
                )
            })?;
            ConnectOptions::with_token(token.trim().to_owned())
        }
        (None, None, None, Some(user)) => {
            let password = match (&config.password, &config.password_file) {
                (Some(password), _) => password.expose().to_owned(),
                (None, Some(path)) => {
                    let password = std::fs::read_to_string(path).map_err(|e| {
                        TransportError::connect(
                            &url,
                            format!("cannot read password file {}", path.display()),
                            e,
                        )
                    })?;
                    password.trim_end_matches(['\r', '\n']).to_owned()
                }
                (None, None) => String::new(),
            };
            ConnectOptions::with_user_and_password(user.clone(), password)
        }
        _ => ConnectOptions::new(),
    };
    if let Some(tls) = &config.tls {
        opts = opts.require_tls(tls.required);
        if let Some(ca) = &tls.ca_file {
            opts = opts.add_root_certificates(ca.clone());
        }
        if let (Some(cert), Some(key)) = (&tls.cert_file, &tls.key_file) {
            opts = opts.add_client_certificate(cert.clone(), key.clone());
        }
    }
    if let Some(prefix) = &config.inbox_prefix {
        // Every reply, JetStream API answer and push delivery (KV watches,
        // object reads) of this connection arrives under it.
        opts = opts.custom_inbox_prefix(prefix);
    }
    let max_delay = config.reconnect_max_delay;
    let m = metrics.clone();
    let link = link.clone();
    Ok(opts
        .name("asyncrl")
        .subscription_capacity(config.subscription_capacity)
        .connection_timeout(config.connect_timeout.min(Duration::from_secs(5)))
        .request_timeout(Some(config.request_timeout))
        .max_reconnects(None)
        .reconnect_delay_callback(move |attempts| reconnect_delay(attempts, max_delay))
        .event_callback(move |event| {
            let m = m.clone();
            let link = link.clone();
            match &event {
                Event::Connected => link.up(),
                Event::Disconnected => link.connected.store(false, Ordering::SeqCst),
                _ => {}
            }
            async move { record_event(&m, &link, &event) }
        }))
}

fn record_event(metrics: &TransportMetrics, link: &Link, event: &Event) {
    let name = match event {
        Event::Connected => {
            tracing::info!(event = "connected", "NATS connection (re)established");
            "connected"
        }
        Event::Disconnected => {
            tracing::warn!(
                event = "disconnected",
                "NATS connection lost; reconnecting with backoff"
            );
            "disconnected"
        }
        Event::LameDuckMode => {
            tracing::warn!(event = "lame_duck", "NATS server entered lame duck mode");
            "lame_duck"
        }
        Event::Draining => "draining",
        Event::Closed => {
            // Reconnects never stop (max_reconnects: None), so a closed
            // connection is one the process closed itself, on its way out:
            // not worth a warning next to a role's one-line error.
            tracing::info!(event = "closed", "NATS connection closed");
            "closed"
        }
        Event::SlowConsumer(sid) => {
            tracing::error!(
                event = "slow_consumer",
                sid,
                "NATS subscription fell behind and the client dropped messages; raise bus.subscription_capacity"
            );
            "slow_consumer"
        }
        Event::ServerError(async_nats::ServerError::Other(message))
            if let Some((kind, subject)) = violations::parse(message)
                && kind == Denied::Publish
                && link.is_reply(&subject) =>
        {
            // Not a permission the role lacks: `allow_responses` lets a
            // server pass a reply only to a request it delivered itself,
            // so a reply sent after this connection moved to another
            // server (one restarting in a cluster), or after the reply's
            // window, is refused. The requester times out and asks again.
            tracing::warn!(
                event = "reply_refused",
                subject = %subject,
                "NATS refused a reply on `{subject}`: its request came through a server this connection has left since, or the reply came too late; the requester asks again"
            );
            "reply_refused"
        }
        Event::ServerError(async_nats::ServerError::Other(message))
            if let Some((kind, subject)) = violations::parse(message) =>
        {
            tracing::error!(
                event = "permission_violation",
                op = kind.op(),
                subject = %subject,
                "NATS refused {} on `{subject}`: the credentials of this role lack the permission (see deploy/k8s/base/nats-auth.conf)",
                kind.op()
            );
            metrics.permission_violation(kind.op());
            link.violations.record(kind, subject);
            "permission_violation"
        }
        Event::ServerError(e) => {
            tracing::error!(event = "server_error", error = %e, "NATS server error");
            "server_error"
        }
        Event::ClientError(e) => {
            tracing::error!(event = "client_error", error = %e, "NATS client error");
            "client_error"
        }
    };
    metrics.event(name);
}

/// Whether opening a KV or object store bucket failed because its stream
/// does not exist (and not because the lookup went unanswered).
fn stream_missing(e: &(dyn std::error::Error + 'static)) -> bool {
    e.source()
        .and_then(|s| s.downcast_ref::<jetstream::context::GetStreamError>())
        .is_some_and(|g| {
            matches!(g.kind(), jetstream::context::GetStreamErrorKind::JetStream(j)
                if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND)
        })
}

/// How long [`Bus::ensure_stream`] and [`Bus::consumer`] (and opening a bucket) ask again when
/// JetStream does not answer a create or a bucket lookup (a cluster electing leaders under
/// load).
const ENSURE_STREAM_PATIENCE: Duration = Duration::from_secs(60);

impl NatsBus {
    /// Connects, retrying until `bus.connect_timeout`; after that the error
    /// names the URL and the last failure. Once connected, the client
    /// reconnects on its own (with backoff) for as long as the process lives.
    pub async fn connect(config: &BusConfig, metrics: TransportMetrics) -> Result<Self> {
        let servers: Vec<ServerAddr> = config
            .url
            .split(',')
            .map(|s| s.trim().parse::<ServerAddr>())
            .collect::<std::io::Result<_>>()
            .map_err(|e| TransportError::connect(&config.url, "invalid server URL", e))?;
        let deadline = tokio::time::Instant::now() + config.connect_timeout;
        let mut attempt = 0usize;
        let inbox = config.inbox_prefix.as_deref().unwrap_or("_INBOX");
        let link = Arc::new(Link {
            inbox: vec![format!("{inbox}.>")],
            ..Link::default()
        });
        let client = loop {
            let opts = connect_options(config, &metrics, &link).await?;
            match opts.connect(servers.clone()).await {
                Ok(client) => break client,
                Err(e) => {
                    attempt += 1;
                    let wait = reconnect_delay(attempt, Duration::from_secs(1));
                    if tokio::time::Instant::now() + wait >= deadline {
                        return Err(TransportError::connect(
                            &config.url,
                            format!(
                                "gave up after {attempt} attempts in {:?}",
                                config.connect_timeout
                            ),
                            e,
                        ));
                    }
                    tracing::debug!(url = %config.url, attempt, error = %e, "NATS connect failed; retrying");
                    tokio::time::sleep(wait).await;
                }
            }
        };
        let js = jetstream::new(client.clone());
        link.up();
        Ok(Self {
            client,
            js,
            replicas: config.replicas,
            request_timeout: config.request_timeout,
            kv_max_bytes: config.storage.kv_max_bytes,
            open_stores_only: config.open_stores_only,
            objects_max_bytes: (config.storage.object_store_max_bytes > 0)
                .then_some(config.storage.object_store_max_bytes),
            metrics,
            link,
        })
    }

    /// The underlying client (benches compare against it).
    pub fn client(&self) -> &Client {
        &self.client
    }

    pub fn jetstream(&self) -> &jetstream::Context {
        &self.js
    }

    /// The server's recent refusals on this connection, oldest first: the
    /// operation (`publish`, `subscribe`) and the subject it names. A
    /// refused subscription has no error to return (its stream ends); this
    /// says what was refused.
    pub fn refusals(&self) -> Vec<(&'static str, String)> {
        self.link.violations.list()
    }

    /// Runs a JetStream request (`attempt`: a create, a lookup) until it is answered: an error
    /// that `unanswered` says is one (a timeout) is asked again with
    /// backoff for up to [`ENSURE_STREAM_PATIENCE`]; any other error, a
    /// refusal, or the end of the patience is returned.
    async fn until_answered<T, E, F, Fut>(
        &self,
        op: &'static str,
        what: &str,
        mut attempt: F,
        unanswered: impl Fn(&E) -> bool,
    ) -> Result<T>
    where
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = std::result::Result<T, E>>,
    {
        let deadline = tokio::time::Instant::now() + ENSURE_STREAM_PATIENCE;
        let mut delay = Duration::from_millis(200);
        loop {
            let e = match attempt().await {
                Ok(v) => return Ok(v),
                Err(e) => e,
            };
            let again = unanswered(&e);
            let err = self.err(op, e);
            if !again
                || matches!(err, TransportError::PermissionDenied { .. })
                || tokio::time::Instant::now() + delay > deadline
            {
                return Err(err);
            }
            tracing::warn!(op, what, error = %err, retry_in = ?delay, "JetStream did not answer; asking again");
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_secs(5));
        }
    }

    fn err(
        &self,
        op: &'static str,
        e: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> TransportError {
        self.metrics.error(op);
        if let Some(v) = self.link.inbox_refused() {
            return TransportError::PermissionDenied {
                op: v.kind.op(),
                subject: v.subject,
            };
        }
        // Opening or creating a stream, bucket or consumer is a series of
        // JetStream API requests; one the server refused shows up as a
        // timeout of the request. A refusal of a JetStream API subject
        // within the time those requests may take is the reason.
        let jetstream_admin = matches!(
            op,
            "kv" | "object_store"
                | "ensure_stream"
                | "consumer"
                | "get_stream"
                | "stream_info"
                | "storage"
        );
        if jetstream_admin
            && let Some(v) =
                self.link
                    .violations
                    .recent(Denied::Publish, "$JS.API.>", self.request_timeout * 3)
        {
            return TransportError::PermissionDenied {
                op: v.kind.op(),
                subject: v.subject,
            };
        }
        TransportError::backend(op, e)
    }

    /// A bucket's `lookup` (None: missing). With `open_stores_only`, a
    /// missing bucket is looked up again with backoff until its owner has
    /// created it, for up to [`ENSURE_STREAM_PATIENCE`], and is then an
    /// error naming its stream; otherwise None is returned at once (the
    /// caller creates it).
    async fn await_created<T, F, Fut>(&self, stream: &str, mut lookup: F) -> Result<Option<T>>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<Option<T>>>,
    {
        let deadline = tokio::time::Instant::now() + ENSURE_STREAM_PATIENCE;
        let mut delay = Duration::from_millis(200);
        loop {
            if let Some(found) = lookup().await? {
                return Ok(Some(found));
            }
            if !self.open_stores_only {
                return Ok(None);
            }
            if tokio::time::Instant::now() + delay > deadline {
                return Err(TransportError::NoStream {
                    stream: stream.to_owned(),
                });
            }
            tracing::info!(stream, retry_in = ?delay, "waiting for the role that creates this store");
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_secs(5));
        }
    }

    async fn get_stream(&self, name: &str) -> Result<stream::Stream> {
        self.js.get_stream(name).await.map_err(|e| match e.kind() {
            jetstream::context::GetStreamErrorKind::JetStream(j)
                if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND =>
            {
                TransportError::NoStream {
                    stream: name.into(),
                }
            }
            _ => self.err("get_stream", e),
        })
    }
}

#[async_trait]
impl Bus for NatsBus {
    fn kind(&self) -> &'static str {
        "nats"
    }

    fn max_payload(&self) -> Option<usize> {
        Some(self.client.server_info().max_payload)
    }

    async fn publish(&self, subject: &str, payload: Bytes) -> Result<()> {
        validate_publish_subject(subject)?;
        self.client
            .publish(subject.to_owned(), payload)
            .await
            .map_err(|e| self.err("publish", e))
    }

    async fn subscribe(&self, subject: &str) -> Result<BoxStream<'static, Message>> {
        let since = self.link.violations.mark();
        let sub = self
            .client
            .subscribe(subject.to_owned())
            .await
            .map_err(|e| self.err("subscribe", e))?;
        let messages = sub
            .map(|m| Message {
                subject: m.subject.to_string(),
                payload: m.payload,
            })
            .boxed();
        Ok(until_refused(&self.link, since, subject, messages))
    }

    async fn request(&self, subject: &str, payload: Bytes, timeout: Duration) -> Result<Bytes> {
        validate_publish_subject(subject)?;
        let req = async_nats::Request::new()
            .payload(payload)
            .timeout(Some(timeout));
        let request = async {
            match self.client.send_request(subject.to_owned(), req).await {
                Ok(msg) => Ok(msg.payload),
                Err(e) => Err(match e.kind() {
                    async_nats::RequestErrorKind::NoResponders => TransportError::NoResponders {
                        subject: subject.into(),
                    },
                    async_nats::RequestErrorKind::TimedOut => TransportError::Timeout {
                        subject: subject.into(),
                        timeout,
                    },
                    _ => self.err("request", e),
                }),
            }
        };
        guarded(
            &self.link,
            &self.metrics,
            "request",
            &[subject.to_owned()],
            request,
        )
        .await
    }

    async fn serve(
        &self,
        subject: &str,
        queue_group: Option<&str>,
    ) -> Result<BoxStream<'static, Request>> {
        let since = self.link.violations.mark();
        let sub = match queue_group {
            Some(q) => {
                self.client
                    .queue_subscribe(subject.to_owned(), q.to_owned())
                    .await
            }
            None => self.client.subscribe(subject.to_owned()).await,
        }
        .map_err(|e| self.err("serve", e))?;
        let client = self.client.clone();
        let link = self.link.clone();
        let requests = sub
            .map(move |m| Request {
                subject: m.subject.to_string(),
                payload: m.payload,
                replier: Replier::Nats {
                    client: client.clone(),
                    reply: m.reply,
                    link: link.clone(),
                },
            })
            .boxed();
        Ok(until_refused(&self.link, since, subject, requests))
    }

    async fn ensure_stream(&self, spec: &StreamSpec) -> Result<()> {
        let retention = match spec.retention {
            crate::Retention::Limits => stream::RetentionPolicy::Limits,
            crate::Retention::WorkQueue => stream::RetentionPolicy::WorkQueue,
        };
        let config = stream::Config {
            name: spec.name.clone(),
            subjects: spec.subjects.clone(),
            duplicate_window: spec.duplicate_window,
            max_age: spec.max_age,
            num_replicas: spec.replicas.max(self.replicas),
            storage: stream::StorageType::File,
            retention,
            max_bytes: byte_limit(spec.max_bytes),
            discard: match spec.discard {
                crate::Discard::Old => stream::DiscardPolicy::Old,
                crate::Discard::New => stream::DiscardPolicy::New,
            },
            ..Default::default()
        };
        if let Ok(existing) = self.js.get_stream(&spec.name).await
            && let info = existing.cached_info()
            && info.config.retention != retention
        {
            // JetStream cannot change a stream's retention in place: say what
            // to do instead of a bare "can not change retention" error.
            self.metrics.error("ensure_stream");
            return Err(TransportError::backend(
                "ensure_stream",
                format!(
                    "stream `{}` exists with retention {:?}, and this configuration needs {:?} (bus.storage); JetStream cannot change it in place: let the buffer consume the stream, then delete it (`nats stream rm {}`) and restart the buffer, or set bus.storage.trajectories to match",
                    spec.name, info.config.retention, retention, spec.name
                ),
            ));
        }
        // A cluster forming a stream's replica group, electing a leader or
        // busy can leave a create unanswered within the request timeout, or
        // answer that it has too few peers for the replicas yet: it is asked
        // again (the create is idempotent).
        self.until_answered(
            "ensure_stream",
            &spec.name,
            || self.js.create_or_update_stream(config.clone()),
            |e| match e.kind() {
                jetstream::context::CreateStreamErrorKind::TimedOut
                | jetstream::context::CreateStreamErrorKind::JetStreamUnavailable => true,
                // Not enough peers to place the replicas yet (a cluster
                // starting, or a node restarting).
                jetstream::context::CreateStreamErrorKind::JetStream(j) => {
                    j.error_code() == jetstream::ErrorCode::CLUSTER_NO_PEERS
                }
                _ => false,
            },
        )
        .await?;
        Ok(())
    }

    async fn publish_durable(
        &self,
        subject: &str,
        msg_id: &str,
        payload: Bytes,
    ) -> Result<PublishAck> {
        validate_publish_subject(subject)?;
        let size = payload.len();
        let msg = jetstream::message::PublishMessage::build()
            .payload(payload)
            .message_id(msg_id);
        let map = |e: jetstream::context::PublishError| match e.kind() {
            jetstream::context::PublishErrorKind::StreamNotFound => {
                TransportError::NoStreamForSubject {
                    subject: subject.into(),
                }
            }
            jetstream::context::PublishErrorKind::MaxPayloadExceeded => {
                TransportError::PayloadTooLarge {
                    size,
                    max: self.client.server_info().max_payload,
                }
            }
            _ => match stream_full(&e) {
                Some(what) => {
                    self.metrics.error("stream_full");
                    TransportError::StreamFull {
                        subject: subject.into(),
                        what,
                    }
                }
                None => self.err("publish_durable", e),
            },
        };
        let publish = async {
            self.js
                .send_publish(subject.to_owned(), msg)
                .await
                .map_err(map)?
                .await
                .map_err(map)
        };
        let ack = guarded(
            &self.link,
            &self.metrics,
            "publish_durable",
            &[subject.to_owned()],
            publish,
        )
        .await?;
        Ok(PublishAck {
            stream: ack.stream,
            sequence: ack.sequence,
            duplicate: ack.duplicate,
        })
    }

    async fn stream_len(&self, stream: &str) -> Result<u64> {
        let mut s = self.get_stream(stream).await?;
        let info = s.info().await.map_err(|e| self.err("stream_info", e))?;
        Ok(info.state.messages)
    }

    async fn storage(&self) -> Result<Vec<StoreUsage>> {
        let mut streams = self.js.streams();
        let mut out = Vec::new();
        while let Some(info) = streams.next().await {
            let info = info.map_err(|e| self.err("storage", e))?;
            out.push(StoreUsage {
                name: info.config.name.clone(),
                messages: info.state.messages,
                bytes: info.state.bytes,
                max_bytes: u64::try_from(info.config.max_bytes).ok(),
            });
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    async fn consumer(&self, stream: &str, spec: &ConsumerSpec) -> Result<Box<dyn Consumer>> {
        let s = self.get_stream(stream).await?;
        let config = pull::Config {
            durable_name: Some(spec.durable_name.clone()),
            filter_subject: spec.filter_subject.clone().unwrap_or_default(),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: spec.ack_wait,
            max_deliver: spec.max_deliver.map_or(-1, i64::from),
            max_ack_pending: i64::try_from(spec.max_ack_pending).unwrap_or(i64::MAX),
            deliver_policy: match spec.deliver_from {
                DeliverFrom::All => jetstream::consumer::DeliverPolicy::All,
                DeliverFrom::New => jetstream::consumer::DeliverPolicy::New,
            },
            ..Default::default()
        };
        // As for a stream: a create left unanswered is asked again.
        let consumer = self
            .until_answered(
                "consumer",
                &spec.durable_name,
                || s.create_consumer(config.clone()),
                |e| matches!(e.kind(), stream::ConsumerErrorKind::TimedOut),
            )
            .await?;
        Ok(Box::new(NatsConsumer {
            consumer,
            request_timeout: self.request_timeout,
            metrics: self.metrics.clone(),
        }))
    }

    async fn kv(&self, bucket: &str) -> Result<Arc<dyn KvBucket>> {
        // Created only when it is missing: a lookup left unanswered (a
        // cluster electing) is asked again, never taken for "missing" (a
        // role without the right to create would be refused for nothing).
        let lookup = || {
            self.until_answered(
                "kv",
                bucket,
                || async {
                    match self.js.get_key_value(bucket).await {
                        Ok(store) => Ok(Some(store)),
                        Err(e) if stream_missing(&e) => Ok(None),
                        Err(e) => Err(e),
                    }
                },
                |e| matches!(e.kind(), jetstream::context::KeyValueErrorKind::GetBucket),
            )
        };
        let found = self.await_created(&format!("KV_{bucket}"), lookup).await?;
        let store = match found {
            Some(store) => store,
            None => {
                let config = kv::Config {
                    bucket: bucket.to_owned(),
                    history: 1,
                    max_bytes: byte_limit(Some(self.kv_max_bytes)),
                    storage: stream::StorageType::File,
                    num_replicas: self.replicas,
                    ..Default::default()
                };
                match self.js.create_key_value(config).await {
                    Ok(store) => store,
                    // Another process may have created it meanwhile.
                    Err(create) => self.js.get_key_value(bucket).await.map_err(|_| {
                        self.err(
                            "kv",
                            format!("cannot open or create bucket `{bucket}`: {create}"),
                        )
                    })?,
                }
            }
        };
        Ok(Arc::new(NatsKv {
            store,
            metrics: self.metrics.clone(),
            link: self.link.clone(),
        }))
    }

    async fn object_store(&self, bucket: &str) -> Result<Arc<dyn ObjectStore>> {
        // As for a KV bucket: created only when it is missing.
        let lookup = || {
            self.until_answered(
                "object_store",
                bucket,
                || async {
                    match self.js.get_object_store(bucket).await {
                        Ok(store) => Ok(Some(store)),
                        Err(e) if stream_missing(&e) => Ok(None),
                        Err(e) => Err(e),
                    }
                },
                |e| matches!(e.kind(), jetstream::context::ObjectStoreErrorKind::GetStore),
            )
        };
        let found = self.await_created(&format!("OBJ_{bucket}"), lookup).await?;
        let store = match found {
            Some(store) => store,
            None => {
                let config = object_store::Config {
                    bucket: bucket.to_owned(),
                    max_bytes: byte_limit(self.objects_max_bytes),
                    storage: stream::StorageType::File,
                    num_replicas: self.replicas,
                    ..Default::default()
                };
                match self.js.create_object_store(config).await {
                    Ok(store) => store,
                    Err(create) => self.js.get_object_store(bucket).await.map_err(|_| {
                        self.err(
                            "object_store",
                            format!("cannot open or create bucket `{bucket}`: {create}"),
                        )
                    })?,
                }
            }
        };
        Ok(Arc::new(NatsObjects {
            store,
            js: self.js.clone(),
            bucket: bucket.to_owned(),
            metrics: self.metrics.clone(),
            link: self.link.clone(),
        }))
    }

    async fn flush(&self) -> Result<()> {
        self.client.flush().await.map_err(|e| self.err("flush", e))
    }

    fn connected_since_unix_ms(&self) -> Option<i64> {
        let connected = self.link.connected.load(Ordering::SeqCst)
            && self.client.connection_state() == async_nats::connection::State::Connected;
        connected.then(|| self.link.since_ms.load(Ordering::SeqCst))
    }
}

// ---------------------------------------------------------------- consumer

struct NatsConsumer {
    consumer: jetstream::consumer::Consumer<pull::Config>,
    /// Bounds a fetch beyond its wait: a pull request lost with the
    /// connection (a server restart) is never answered.
    request_timeout: Duration,
    metrics: TransportMetrics,
}

impl NatsConsumer {
    fn delivery(&self, m: jetstream::Message) -> Result<Delivery> {
        let info = m.info().map_err(|e| TransportError::backend("fetch", e))?;
        let (stream_sequence, delivered) = (
            info.stream_sequence,
            u64::try_from(info.delivered).unwrap_or(1),
        );
        let msg_id = m
            .headers
            .as_ref()
            .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
            .map(|v| v.as_str().to_owned());
        Ok(Delivery {
            subject: m.subject.to_string(),
            payload: m.payload.clone(),
            msg_id,
            stream_sequence,
            delivered,
            acker: Acker::Nats(Box::new(m)),
        })
    }
}

#[async_trait]
impl Consumer for NatsConsumer {
    async fn fetch(&self, max: usize, wait: Duration) -> Result<Vec<Delivery>> {
        let mut out = Vec::new();
        // A pull request lost with the connection (the server restarted while
        // it was out) is never answered: without a bound the fetch would wait
        // forever. What arrived before the bound is returned.
        // Messages that arrived before an error are returned too: dropped
        // here, they would wait out their ack wait before coming again.
        let limit = wait + self.request_timeout;
        match tokio::time::timeout(limit, self.fetch_into(max, wait, &mut out)).await {
            Ok(Ok(())) => Ok(out),
            Ok(Err(e)) if !out.is_empty() => {
                tracing::debug!(error = %e, delivered = out.len(), "a fetch ended with an error after some messages; returning them");
                Ok(out)
            }
            Ok(Err(e)) => Err(e),
            Err(_) if !out.is_empty() => Ok(out),
            Err(_) => {
                self.metrics.error("fetch");
                Err(TransportError::Timeout {
                    subject: format!("fetch from consumer {:?}", self.consumer.cached_info().name),
                    timeout: limit,
                })
            }
        }
    }
}

impl NatsConsumer {
    async fn fetch_into(&self, max: usize, wait: Duration, out: &mut Vec<Delivery>) -> Result<()> {
        let max = max.max(1);
        let err = |e: Box<dyn std::error::Error + Send + Sync>| {
            self.metrics.error("fetch");
            TransportError::backend("fetch", e)
        };
        // Whatever is ready now, without waiting.
        let mut ready = self
            .consumer
            .fetch()
            .max_messages(max)
            .messages()
            .await
            .map_err(|e| err(e.into()))?;
        while let Some(m) = ready.next().await {
            out.push(self.delivery(m.map_err(err)?)?);
        }
        if !out.is_empty() || wait.is_zero() {
            return Ok(());
        }
        // Nothing ready: wait for one message, then take what else is ready.
        let mut one = self
            .consumer
            .batch()
            .max_messages(1)
            .expires(wait.max(Duration::from_millis(10)))
            .messages()
            .await
            .map_err(|e| err(e.into()))?;
        while let Some(m) = one.next().await {
            out.push(self.delivery(m.map_err(err)?)?);
        }
        if !out.is_empty() && max > 1 {
            let mut rest = self
                .consumer
                .fetch()
                .max_messages(max - 1)
                .messages()
                .await
                .map_err(|e| err(e.into()))?;
            while let Some(m) = rest.next().await {
                out.push(self.delivery(m.map_err(err)?)?);
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------- KV

struct NatsKv {
    store: kv::Store,
    metrics: TransportMetrics,
    link: Arc<Link>,
}

impl NatsKv {
    fn err(
        &self,
        op: &'static str,
        e: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> TransportError {
        self.metrics.error(op);
        TransportError::backend(op, e)
    }

    /// A write of `key`: refused by the server, it ends as
    /// [`TransportError::PermissionDenied`] (see [`guarded`]).
    async fn write<T>(
        &self,
        op: &'static str,
        key: &str,
        write: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        let subject = format!("{}{key}", self.store.prefix);
        guarded(&self.link, &self.metrics, op, &[subject], write).await
    }
}

/// How often, and how far apart, a KV get that found no responders is
/// tried again (about 5 s in all: a replicated stream's election).
const KV_GET_NO_RESPONDER_RETRIES: u32 = 50;
const KV_GET_RETRY_DELAY: Duration = Duration::from_millis(100);

/// Whether a KV get failed because no server answered its request (a
/// replicated bucket being created or electing a leader).
fn is_no_responders(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if err.to_string().contains("no responders") {
            return true;
        }
        cur = err.source();
    }
    false
}

#[async_trait]
impl KvBucket for NatsKv {
    async fn get(&self, key: &str) -> Result<Option<KvEntry>> {
        validate_key(key)?;
        // A replicated bucket (bus.replicas > 1) answers its direct gets
        // from no server for a moment after it is created and while its
        // replicas elect a leader: those "no responders" are retried for
        // a few seconds, as a write waits out the same election.
        let mut attempt = 0u32;
        let entry = loop {
            match self.store.entry(key.to_owned()).await {
                Ok(entry) => break entry,
                Err(e) if attempt < KV_GET_NO_RESPONDER_RETRIES && is_no_responders(&e) => {
                    attempt += 1;
                    tracing::debug!(key, attempt, error = %e, "kv get: no responders; retrying");
                    tokio::time::sleep(KV_GET_RETRY_DELAY).await;
                }
                Err(e) => return Err(self.err("kv_get", e)),
            }
        };
        Ok(entry
            .filter(|e| e.operation == kv::Operation::Put)
            .map(|e| KvEntry {
                key: e.key,
                value: e.value,
                revision: e.revision,
            }))
    }

    async fn put(&self, key: &str, value: Bytes) -> Result<u64> {
        validate_key(key)?;
        let put = async {
            self.store
                .put(key, value)
                .await
                .map_err(|e| self.err("kv_put", e))
        };
        self.write("kv_put", key, put).await
    }

    async fn create(&self, key: &str, value: Bytes) -> Result<u64> {
        validate_key(key)?;
        let create = async {
            self.store
                .create(key, value)
                .await
                .map_err(|e| match e.kind() {
                    kv::CreateErrorKind::AlreadyExists => {
                        TransportError::KeyExists { key: key.into() }
                    }
                    _ => self.err("kv_create", e),
                })
        };
        self.write("kv_create", key, create).await
    }

    async fn update(&self, key: &str, value: Bytes, revision: u64) -> Result<u64> {
        validate_key(key)?;
        let update = async {
            self.store
                .update(key, value, revision)
                .await
                .map_err(|e| match e.kind() {
                    kv::UpdateErrorKind::WrongLastRevision => TransportError::RevisionMismatch {
                        key: key.into(),
                        expected: revision,
                    },
                    _ => self.err("kv_update", e),
                })
        };
        self.write("kv_update", key, update).await
    }

    async fn delete(&self, key: &str) -> Result<()> {
        validate_key(key)?;
        let delete = async {
            self.store
                .delete(key)
                .await
                .map_err(|e| self.err("kv_delete", e))
        };
        self.write("kv_delete", key, delete).await
    }

    async fn keys(&self) -> Result<Vec<String>> {
        let keys = self
            .store
            .keys()
            .await
            .map_err(|e| self.err("kv_keys", e))?;
        let keys: Vec<std::result::Result<String, _>> = keys.collect().await;
        keys.into_iter()
            .map(|k| k.map_err(|e| self.err("kv_keys", e)))
            .collect()
    }

    async fn watch(&self, key: &str) -> Result<BoxStream<'static, Result<KvEvent>>> {
        // watch_with_history delivers the last value of each matching key
        // first (a plain watch would not), then every update.
        let watch = self
            .store
            .watch_with_history(key)
            .await
            .map_err(|e| self.err("kv_watch", e))?;
        let metrics = self.metrics.clone();
        Ok(watch
            .map(move |entry| match entry {
                Ok(e) => Ok(KvEvent {
                    key: e.key,
                    value: (e.operation == kv::Operation::Put).then_some(e.value),
                    revision: e.revision,
                }),
                Err(e) => {
                    metrics.error("kv_watch");
                    Err(TransportError::backend("kv_watch", e))
                }
            })
            .boxed())
    }
}

// ---------------------------------------------------------------- objects

struct NatsObjects {
    store: object_store::ObjectStore,
    js: jetstream::Context,
    bucket: String,
    metrics: TransportMetrics,
    link: Arc<Link>,
}

impl NatsObjects {
    fn err(
        &self,
        op: &'static str,
        e: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> TransportError {
        self.metrics.error(op);
        TransportError::backend(op, e)
    }

    /// A write to the bucket (chunks, metadata, and the purge of replaced
    /// or deleted chunks): refused by the server, it ends as
    /// [`TransportError::PermissionDenied`] (see [`guarded`]).
    async fn write<T>(
        &self,
        op: &'static str,
        write: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        let subjects = [
            format!("$O.{}.>", self.bucket),
            format!("$JS.API.STREAM.PURGE.OBJ_{}", self.bucket),
        ];
        guarded(&self.link, &self.metrics, op, &subjects, write).await
    }

    fn not_found(&self, name: &str) -> TransportError {
        TransportError::ObjectNotFound {
            bucket: self.bucket.clone(),
            name: name.into(),
        }
    }

    /// Writes an object the way the client does (chunks on
    /// `$O.<bucket>.C.<nuid>`, then the metadata with its digest as a rollup
    /// on `$O.<bucket>.M.<name>`, then the purge of a replaced object's
    /// chunks), but with up to [`PUT_CHUNKS_IN_FLIGHT`] chunks awaiting their
    /// ack instead of one, and the sha256 computed on a blocking thread
    /// meanwhile. The object counts as stored once its metadata is acked,
    /// which happens only after every chunk was acked. Returns the
    /// metadata and the sha256 (hex).
    async fn put_pipelined(
        &self,
        name: &str,
        data: Bytes,
    ) -> Result<(object_store::ObjectInfo, String)> {
        use base64::Engine as _;
        let encoded = base64::engine::general_purpose::URL_SAFE.encode(name);
        let replaced = self.store.info(name).await.ok().filter(|i| !i.deleted);
        let hashing = {
            let data = data.clone();
            tokio::task::spawn_blocking(move || asyncrl_common::sha256(&data))
        };
        let nuid = self
            .js
            .client()
            .new_inbox()
            .rsplit('.')
            .next()
            .unwrap_or_default()
            .to_owned();
        let chunk_subject = format!("$O.{}.C.{nuid}", self.bucket);
        let mut acks = std::collections::VecDeque::with_capacity(PUT_CHUNKS_IN_FLIGHT);
        let mut chunks = 0;
        let mut offset = 0;
        while offset < data.len() {
            let end = (offset + OBJECT_CHUNK).min(data.len());
            let ack = self
                .js
                .publish(chunk_subject.clone(), data.slice(offset..end))
                .await
                .map_err(|e| self.err("object_put", e))?;
            acks.push_back(ack);
            if acks.len() >= PUT_CHUNKS_IN_FLIGHT
                && let Some(ack) = acks.pop_front()
            {
                ack.await.map_err(|e| self.err("object_put", e))?;
            }
            offset = end;
            chunks += 1;
        }
        while let Some(ack) = acks.pop_front() {
            ack.await.map_err(|e| self.err("object_put", e))?;
        }
        let digest = hashing.await.map_err(|e| self.err("object_put", e))?;
        let info = object_store::ObjectInfo {
            name: name.to_owned(),
            description: None,
            metadata: HashMap::new(),
            headers: None,
            options: Some(object_store::ObjectOptions {
                link: None,
                max_chunk_size: Some(OBJECT_CHUNK),
            }),
            bucket: self.bucket.clone(),
            nuid,
            size: data.len(),
            chunks,
            modified: None,
            digest: Some(format!(
                "SHA-256={}",
                base64::engine::general_purpose::URL_SAFE.encode(digest)
            )),
            deleted: false,
        };
        let meta = serde_json::to_vec(&info).map_err(|e| self.err("object_put", e))?;
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(async_nats::header::NATS_ROLLUP, "sub");
        self.js
            .publish_with_headers(
                format!("$O.{}.M.{encoded}", self.bucket),
                headers,
                meta.into(),
            )
            .await
            .map_err(|e| self.err("object_put", e))?
            .await
            .map_err(|e| self.err("object_put", e))?;
        if let Some(old) = replaced
            && old.nuid != info.nuid
        {
            self.js
                .get_stream_no_info(format!("OBJ_{}", self.bucket))
                .await
                .map_err(|e| self.err("object_put", e))?
                .purge()
                .filter(format!("$O.{}.C.{}", self.bucket, old.nuid))
                .await
                .map_err(|e| self.err("object_put", e))?;
        }
        Ok((info, hex::encode(digest)))
    }

    /// Reads an object and returns it with its sha256 (hex), checked once:
    /// the client hashes the chunks as they arrive and refuses a read whose
    /// hash differs from the object's digest, so the digest is then the
    /// bytes' sha256 (an object without a digest is hashed here).
    async fn get_checked(&self, name: &str) -> Result<(Bytes, String)> {
        let mut object = self.store.get(name).await.map_err(|e| match e.kind() {
            object_store::GetErrorKind::NotFound => self.not_found(name),
            _ => self.err("object_get", e),
        })?;
        let size = object.info.size;
        let digest = digest_hex(&object.info).filter(|_| object.info.chunks > 0);
        let recorded = object.info.metadata.get(SHA256_META).cloned();
        // Read into the final buffer (zeroed lazily by the allocator), then
        // make sure the object ends there. Not `read_to_end`: the client
        // fills the buffer of the read that fails its digest check.
        let mut buf = vec![0u8; size];
        let mut filled = 0;
        let mut extra = [0u8; 1];
        loop {
            let into = if filled < size {
                &mut buf[filled..]
            } else {
                &mut extra[..]
            };
            let n = match object.read(into).await {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                    self.metrics.error("object_checksum");
                    return Err(TransportError::ChecksumMismatch {
                        name: name.into(),
                        expected: digest.unwrap_or_default(),
                        actual:
                            "another hash (the chunks as read do not match the object's digest)"
                                .into(),
                    });
                }
                Err(e) => return Err(self.err("object_get", e)),
            };
            if n == 0 {
                break;
            }
            if filled == size {
                return Err(self.err(
                    "object_get",
                    format!("object `{name}` has more than its {size} bytes"),
                ));
            }
            filled += n;
        }
        if filled != size {
            return Err(self.err(
                "object_get",
                format!("object `{name}`: read {filled} of {size} bytes"),
            ));
        }
        let actual = match digest {
            Some(sha) => sha,
            None => sha256_hex(&buf),
        };
        if let Some(expected) = recorded
            && let Err(e) = expect_sha256(name, actual.clone(), &expected)
        {
            self.metrics.error("object_checksum");
            return Err(e);
        }
        Ok((Bytes::from(buf), actual))
    }

    fn info_of(info: &object_store::ObjectInfo) -> ObjectInfo {
        ObjectInfo {
            name: info.name.clone(),
            size: info.size as u64,
            sha256: digest_hex(info)
                .or_else(|| info.metadata.get(SHA256_META).cloned())
                .unwrap_or_default(),
            chunks: info.chunks,
        }
    }
}

#[async_trait]
impl ObjectStore for NatsObjects {
    async fn put(&self, name: &str, data: Bytes) -> Result<ObjectInfo> {
        if name.is_empty() {
            return Err(TransportError::InvalidName {
                name: name.into(),
                reason: "empty object name".into(),
            });
        }
        let put = self.put_pipelined(name, data);
        let (info, sha256) = self.write("object_put", put).await?;
        Ok(ObjectInfo {
            name: info.name,
            size: info.size as u64,
            sha256,
            chunks: info.chunks,
        })
    }

    async fn get(&self, name: &str) -> Result<Bytes> {
        self.get_checked(name).await.map(|(data, _)| data)
    }

    async fn get_expecting(&self, name: &str, sha256: &str) -> Result<Bytes> {
        let (data, actual) = self.get_checked(name).await?;
        if let Err(e) = expect_sha256(name, actual, sha256) {
            self.metrics.error("object_checksum");
            return Err(e);
        }
        Ok(data)
    }

    async fn info(&self, name: &str) -> Result<Option<ObjectInfo>> {
        match self.store.info(name).await {
            Ok(info) if !info.deleted => Ok(Some(Self::info_of(&info))),
            Ok(_) => Ok(None),
            Err(e) if e.kind() == object_store::InfoErrorKind::NotFound => Ok(None),
            Err(e) => Err(self.err("object_info", e)),
        }
    }

    async fn delete(&self, name: &str) -> Result<()> {
        let delete = async {
            self.store.delete(name).await.map_err(|e| match e.kind() {
                object_store::DeleteErrorKind::NotFound => self.not_found(name),
                _ => self.err("object_delete", e),
            })?;
            // The client's delete purges the chunks but leaves a "deleted"
            // metadata message behind, one per name. Names are per version
            // (`policy-v…`), so those tombstones would pile up for the whole
            // run and pin the stream's file blocks on disk: purge it too.
            use base64::Engine as _;
            let meta = format!(
                "$O.{}.M.{}",
                self.bucket,
                base64::engine::general_purpose::URL_SAFE.encode(name)
            );
            let stream = self
                .js
                .get_stream_no_info(format!("OBJ_{}", self.bucket))
                .await
                .map_err(|e| self.err("object_delete", e))?;
            stream
                .purge()
                .filter(meta)
                .await
                .map_err(|e| self.err("object_delete", e))?;
            Ok(())
        };
        self.write("object_delete", delete).await
    }

    async fn list(&self) -> Result<Vec<ObjectInfo>> {
        let list = self
            .store
            .list()
            .await
            .map_err(|e| self.err("object_list", e))?;
        let items: Vec<_> = list.collect().await;
        let mut out = Vec::new();
        for item in items {
            let info = item.map_err(|e| self.err("object_list", e))?;
            if !info.deleted {
                out.push(Self::info_of(&info));
            }
        }
        Ok(out)
    }
}
