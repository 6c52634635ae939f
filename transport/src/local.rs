//! The in-process bus: every role in one process, no server. Same semantics
//! as NATS where the roles depend on them (dedupe window, durable consumers
//! with ack wait and redelivery, KV watch with the current value first,
//! sha256-checked objects); everything lives in memory for the life of the
//! process. Subscriptions are unbounded queues: a slow subscriber costs
//! memory, it never loses messages.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::time::Instant;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::names::{subject_matches, validate_key, validate_publish_subject};
use crate::{
    Acker, Bus, Consumer, ConsumerSpec, DeliverFrom, Delivery, Discard, KvBucket, KvEntry, KvEvent,
    Message, OBJECT_CHUNK, ObjectInfo, ObjectStore, PublishAck, Replier, Request, Result,
    Retention, StoreUsage, StreamSpec, TransportError, expect_sha256, sha256_hex,
};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves plain data behind,
    // never a half-applied invariant worth refusing service for.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The in-process bus. Cheap to clone; clones share everything.
#[derive(Clone, Default)]
pub struct LocalBus {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    subs: Mutex<Subs>,
    streams: Mutex<HashMap<String, Arc<LocalStream>>>,
    kvs: Mutex<HashMap<String, Arc<LocalKv>>>,
    objects: Mutex<HashMap<String, Arc<LocalObjects>>>,
}

#[derive(Default)]
struct Subs {
    subscribers: Vec<(String, mpsc::UnboundedSender<Message>)>,
    responders: Vec<Responder>,
    round_robin: usize,
}

/// A `serve` registration. Each request goes to exactly one responder
/// (round-robin), which is what queue groups give on NATS; the in-process
/// bus has no use for fan-out requests.
struct Responder {
    pattern: String,
    tx: mpsc::UnboundedSender<Request>,
}

impl LocalBus {
    pub fn new() -> Self {
        Self::default()
    }

    fn stream(&self, name: &str) -> Result<Arc<LocalStream>> {
        lock(&self.inner.streams)
            .get(name)
            .cloned()
            .ok_or_else(|| TransportError::NoStream {
                stream: name.into(),
            })
    }
}

#[async_trait]
impl Bus for LocalBus {
    fn kind(&self) -> &'static str {
        "local"
    }

    async fn publish(&self, subject: &str, payload: Bytes) -> Result<()> {
        validate_publish_subject(subject)?;
        let mut subs = lock(&self.inner.subs);
        subs.subscribers.retain(|(pattern, tx)| {
            if !subject_matches(pattern, subject) {
                return !tx.is_closed();
            }
            tx.send(Message {
                subject: subject.into(),
                payload: payload.clone(),
            })
            .is_ok()
        });
        Ok(())
    }

    async fn subscribe(&self, subject: &str) -> Result<BoxStream<'static, Message>> {
        let (tx, rx) = mpsc::unbounded_channel();
        lock(&self.inner.subs)
            .subscribers
            .push((subject.into(), tx));
        Ok(UnboundedReceiverStream::new(rx).boxed())
    }

    async fn request(&self, subject: &str, payload: Bytes, timeout: Duration) -> Result<Bytes> {
        validate_publish_subject(subject)?;
        let (tx, rx) = oneshot::channel();
        let mut request = Some(Request {
            subject: subject.into(),
            payload,
            replier: Replier::Local(Some(tx)),
        });
        {
            let mut subs = lock(&self.inner.subs);
            subs.responders.retain(|r| !r.tx.is_closed());
            let matching: Vec<usize> = (0..subs.responders.len())
                .filter(|i| subject_matches(&subs.responders[*i].pattern, subject))
                .collect();
            if matching.is_empty() {
                return Err(TransportError::NoResponders {
                    subject: subject.into(),
                });
            }
            // Spread requests over the members of a queue group.
            subs.round_robin = subs.round_robin.wrapping_add(1);
            let start = subs.round_robin % matching.len();
            for k in 0..matching.len() {
                let r = &subs.responders[matching[(start + k) % matching.len()]];
                match r
                    .tx
                    .send(request.take().expect("request is only sent once"))
                {
                    Ok(()) => break,
                    Err(mpsc::error::SendError(back)) => request = Some(back),
                }
            }
            if request.is_some() {
                return Err(TransportError::NoResponders {
                    subject: subject.into(),
                });
            }
        }
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(_)) => Err(TransportError::backend(
                "request",
                format!("the responder on `{subject}` dropped the request without replying"),
            )),
            Err(_) => Err(TransportError::Timeout {
                subject: subject.into(),
                timeout,
            }),
        }
    }

    async fn serve(
        &self,
        subject: &str,
        _queue_group: Option<&str>,
    ) -> Result<BoxStream<'static, Request>> {
        let (tx, rx) = mpsc::unbounded_channel();
        lock(&self.inner.subs).responders.push(Responder {
            pattern: subject.into(),
            tx,
        });
        Ok(UnboundedReceiverStream::new(rx).boxed())
    }

    async fn ensure_stream(&self, spec: &StreamSpec) -> Result<()> {
        if spec.name.is_empty() || spec.name.contains(['.', '*', '>', ' ']) {
            return Err(TransportError::InvalidName {
                name: spec.name.clone(),
                reason: "not a stream name".into(),
            });
        }
        let mut streams = lock(&self.inner.streams);
        for (name, other) in streams.iter() {
            if name == &spec.name {
                continue;
            }
            let other = lock(&other.state);
            if spec
                .subjects
                .iter()
                .any(|s| other.spec.subjects.iter().any(|o| o == s))
            {
                return Err(TransportError::backend(
                    "ensure_stream",
                    format!("subjects of `{}` overlap with stream `{name}`", spec.name),
                ));
            }
        }
        match streams.get(&spec.name) {
            Some(existing) => lock(&existing.state).spec = spec.clone(),
            None => {
                streams.insert(spec.name.clone(), Arc::new(LocalStream::new(spec.clone())));
            }
        }
        Ok(())
    }

    async fn publish_durable(
        &self,
        subject: &str,
        msg_id: &str,
        payload: Bytes,
    ) -> Result<PublishAck> {
        validate_publish_subject(subject)?;
        let stream = {
            let streams = lock(&self.inner.streams);
            streams
                .values()
                .find(|s| {
                    lock(&s.state)
                        .spec
                        .subjects
                        .iter()
                        .any(|p| subject_matches(p, subject))
                })
                .cloned()
        };
        let stream = stream.ok_or_else(|| TransportError::NoStreamForSubject {
            subject: subject.into(),
        })?;
        stream.append(subject, msg_id, payload)
    }

    async fn stream_len(&self, stream: &str) -> Result<u64> {
        let stream = self.stream(stream)?;
        let mut state = lock(&stream.state);
        state.expire(Instant::now());
        Ok(state.msgs.len() as u64)
    }

    async fn storage(&self) -> Result<Vec<StoreUsage>> {
        let mut out = Vec::new();
        let streams: Vec<Arc<LocalStream>> = lock(&self.inner.streams).values().cloned().collect();
        for stream in streams {
            let mut s = lock(&stream.state);
            s.expire(Instant::now());
            out.push(StoreUsage {
                name: s.spec.name.clone(),
                messages: s.msgs.len() as u64,
                bytes: s.bytes,
                max_bytes: s.spec.max_bytes,
            });
        }
        let kvs: Vec<(String, Arc<LocalKv>)> = lock(&self.inner.kvs)
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (name, kv) in kvs {
            let state = lock(&kv.state);
            out.push(StoreUsage {
                name: format!("KV_{name}"),
                messages: state.entries.len() as u64,
                bytes: state.entries.values().map(|(v, _)| v.len() as u64).sum(),
                max_bytes: None,
            });
        }
        let objects: Vec<(String, Arc<LocalObjects>)> = lock(&self.inner.objects)
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (name, store) in objects {
            let objects = lock(&store.objects);
            out.push(StoreUsage {
                name: format!("OBJ_{name}"),
                messages: objects.len() as u64,
                bytes: objects.values().map(|(v, _)| v.len() as u64).sum(),
                max_bytes: None,
            });
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    async fn consumer(&self, stream: &str, spec: &ConsumerSpec) -> Result<Box<dyn Consumer>> {
        let s = self.stream(stream)?;
        {
            let mut state = lock(&s.state);
            // As JetStream: a work queue hands each message to one consumer,
            // so two consumers whose subjects overlap are refused.
            if state.spec.retention == Retention::WorkQueue {
                let overlaps = |a: &Option<String>, b: &Option<String>| match (a, b) {
                    (Some(a), Some(b)) => subject_matches(a, b) || subject_matches(b, a),
                    _ => true,
                };
                if let Some((other, _)) = state.consumers.iter().find(|(name, c)| {
                    **name != spec.durable_name
                        && overlaps(&c.spec.filter_subject, &spec.filter_subject)
                }) {
                    return Err(TransportError::backend(
                        "consumer",
                        format!(
                            "work-queue stream `{stream}` already has consumer `{other}` on these subjects"
                        ),
                    ));
                }
            }
            let next = state.last_seq + 1;
            state
                .consumers
                .entry(spec.durable_name.clone())
                .and_modify(|c| c.spec = spec.clone())
                .or_insert_with(|| ConsumerState {
                    spec: spec.clone(),
                    next_seq: if spec.deliver_from == DeliverFrom::New {
                        next
                    } else {
                        1
                    },
                    pending: BTreeMap::new(),
                });
        }
        Ok(Box::new(LocalConsumer {
            stream: s,
            name: spec.durable_name.clone(),
        }))
    }

    async fn kv(&self, bucket: &str) -> Result<Arc<dyn KvBucket>> {
        let kv = lock(&self.inner.kvs)
            .entry(bucket.to_owned())
            .or_insert_with(|| {
                Arc::new(LocalKv {
                    state: Mutex::new(KvState::default()),
                })
            })
            .clone();
        Ok(kv)
    }

    async fn object_store(&self, bucket: &str) -> Result<Arc<dyn ObjectStore>> {
        let store = lock(&self.inner.objects)
            .entry(bucket.to_owned())
            .or_insert_with(|| {
                Arc::new(LocalObjects {
                    bucket: bucket.into(),
                    objects: Mutex::new(BTreeMap::new()),
                })
            })
            .clone();
        Ok(store)
    }

    async fn flush(&self) -> Result<()> {
        Ok(())
    }
}

// ---------------------------------------------------------------- streams

struct LocalStream {
    state: Mutex<StreamState>,
    notify: Notify,
}

struct Stored {
    subject: String,
    payload: Bytes,
    msg_id: Option<String>,
    at: Instant,
}

struct StreamState {
    spec: StreamSpec,
    msgs: BTreeMap<u64, Stored>,
    /// Payload bytes of `msgs`.
    bytes: u64,
    last_seq: u64,
    /// Message ids within the duplicate window, and their sequence.
    ids: HashMap<String, u64>,
    /// The same ids in publish order, to expire them.
    id_order: VecDeque<(Instant, String)>,
    consumers: HashMap<String, ConsumerState>,
}

struct ConsumerState {
    spec: ConsumerSpec,
    /// The next sequence never delivered to this consumer.
    next_seq: u64,
    /// Delivered, un-acked: sequence -> (redelivery deadline, deliveries).
    pending: BTreeMap<u64, (Instant, u64)>,
}

impl LocalStream {
    fn new(spec: StreamSpec) -> Self {
        Self {
            state: Mutex::new(StreamState {
                spec,
                msgs: BTreeMap::new(),
                bytes: 0,
                last_seq: 0,
                ids: HashMap::new(),
                id_order: VecDeque::new(),
                consumers: HashMap::new(),
            }),
            notify: Notify::new(),
        }
    }

    fn append(&self, subject: &str, msg_id: &str, payload: Bytes) -> Result<PublishAck> {
        let now = Instant::now();
        let mut s = lock(&self.state);
        s.expire(now);
        let window = s.spec.duplicate_window;
        while let Some((at, _)) = s.id_order.front() {
            if now.duration_since(*at) < window {
                break;
            }
            if let Some((_, id)) = s.id_order.pop_front() {
                s.ids.remove(&id);
            }
        }
        let name = s.spec.name.clone();
        if !msg_id.is_empty()
            && let Some(seq) = s.ids.get(msg_id)
        {
            return Ok(PublishAck {
                stream: name,
                sequence: *seq,
                duplicate: true,
            });
        }
        let size = payload.len() as u64;
        if let Some(max) = s.spec.max_bytes {
            match s.spec.discard {
                Discard::New if s.bytes + size > max => {
                    return Err(TransportError::StreamFull {
                        subject: subject.into(),
                        what: format!("{} of {max} bytes held", s.bytes),
                    });
                }
                Discard::New => {}
                Discard::Old => {
                    while s.bytes + size > max {
                        let Some(seq) = s.msgs.keys().next().copied() else {
                            break;
                        };
                        s.remove(seq);
                    }
                }
            }
        }
        s.last_seq += 1;
        let seq = s.last_seq;
        let stored = Stored {
            subject: subject.into(),
            payload,
            msg_id: (!msg_id.is_empty()).then(|| msg_id.to_owned()),
            at: now,
        };
        s.msgs.insert(seq, stored);
        s.bytes += size;
        if !msg_id.is_empty() {
            s.ids.insert(msg_id.to_owned(), seq);
            s.id_order.push_back((now, msg_id.to_owned()));
        }
        drop(s);
        self.notify.notify_waiters();
        Ok(PublishAck {
            stream: name,
            sequence: seq,
            duplicate: false,
        })
    }
}

impl StreamState {
    fn remove(&mut self, seq: u64) {
        if let Some(m) = self.msgs.remove(&seq) {
            self.bytes -= m.payload.len() as u64;
        }
    }

    /// Drops messages older than the stream's max age.
    fn expire(&mut self, now: Instant) {
        let max_age = self.spec.max_age;
        if max_age.is_zero() {
            return;
        }
        while let Some((seq, m)) = self.msgs.first_key_value() {
            if now.duration_since(m.at) < max_age {
                break;
            }
            let seq = *seq;
            self.remove(seq);
        }
    }

    /// Takes up to `max` deliverable messages for `consumer`: due redeliveries
    /// first, then new messages. Returns the deliveries and, when there are
    /// none, the earliest instant a redelivery becomes due.
    fn take(
        &mut self,
        consumer: &str,
        max: usize,
        now: Instant,
    ) -> (Vec<(u64, u64)>, Option<Instant>) {
        self.expire(now);
        let Some(c) = self.consumers.get_mut(consumer) else {
            return (Vec::new(), None);
        };
        let mut out = Vec::new();
        let mut next_due: Option<Instant> = None;
        let mut gone = Vec::new();
        for (seq, (deadline, delivered)) in c.pending.iter_mut() {
            if out.len() >= max {
                break;
            }
            if !self.msgs.contains_key(seq) {
                gone.push(*seq);
                continue;
            }
            if *deadline > now {
                next_due = Some(next_due.map_or(*deadline, |d: Instant| d.min(*deadline)));
                continue;
            }
            if c.spec
                .max_deliver
                .is_some_and(|m| *delivered >= u64::from(m))
            {
                gone.push(*seq);
                continue;
            }
            *delivered += 1;
            *deadline = now + c.spec.ack_wait;
            out.push((*seq, *delivered));
        }
        for seq in gone {
            c.pending.remove(&seq);
        }
        while out.len() < max && c.pending.len() < c.spec.max_ack_pending {
            let Some((seq, m)) = self.msgs.range(c.next_seq..).next() else {
                break;
            };
            let seq = *seq;
            c.next_seq = seq + 1;
            if let Some(filter) = &c.spec.filter_subject
                && !subject_matches(filter, &m.subject)
            {
                continue;
            }
            c.pending.insert(seq, (now + c.spec.ack_wait, 1));
            out.push((seq, 1));
        }
        (out, next_due)
    }
}

struct LocalConsumer {
    stream: Arc<LocalStream>,
    name: String,
}

#[async_trait]
impl Consumer for LocalConsumer {
    async fn fetch(&self, max: usize, wait: Duration) -> Result<Vec<Delivery>> {
        let deadline = Instant::now() + wait;
        loop {
            let notified = self.stream.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let now = Instant::now();
            let (taken, next_due) = {
                let mut s = lock(&self.stream.state);
                let (taken, next_due) = s.take(&self.name, max.max(1), now);
                let deliveries: Vec<Delivery> = taken
                    .into_iter()
                    .filter_map(|(seq, delivered)| {
                        let m = s.msgs.get(&seq)?;
                        Some(Delivery {
                            subject: m.subject.clone(),
                            payload: m.payload.clone(),
                            msg_id: m.msg_id.clone(),
                            stream_sequence: seq,
                            delivered,
                            acker: Acker::Local(LocalAcker {
                                stream: self.stream.clone(),
                                consumer: self.name.clone(),
                                seq,
                            }),
                        })
                    })
                    .collect();
                (deliveries, next_due)
            };
            if !taken.is_empty() || now >= deadline {
                return Ok(taken);
            }
            let wake = next_due.map_or(deadline, |d| d.min(deadline));
            tokio::select! {
                _ = &mut notified => {}
                _ = tokio::time::sleep_until(wake) => {}
            }
        }
    }
}

pub(crate) struct LocalAcker {
    stream: Arc<LocalStream>,
    consumer: String,
    seq: u64,
}

impl LocalAcker {
    fn with_pending(
        &self,
        f: impl FnOnce(&mut BTreeMap<u64, (Instant, u64)>, Duration),
    ) -> Result<()> {
        let mut s = lock(&self.stream.state);
        let c = s.consumers.get_mut(&self.consumer).ok_or_else(|| {
            TransportError::backend("ack", format!("consumer `{}` is gone", self.consumer))
        })?;
        let ack_wait = c.spec.ack_wait;
        f(&mut c.pending, ack_wait);
        Ok(())
    }

    pub(crate) fn ack(&self) -> Result<()> {
        self.with_pending(|p, _| {
            p.remove(&self.seq);
        })?;
        // A work queue lets go of a message once it is acked.
        let mut s = lock(&self.stream.state);
        if s.spec.retention == Retention::WorkQueue {
            s.remove(self.seq);
        }
        Ok(())
    }

    pub(crate) fn nak(&self, delay: Duration) -> Result<()> {
        self.with_pending(|p, _| {
            if let Some(entry) = p.get_mut(&self.seq) {
                entry.0 = Instant::now() + delay;
            }
        })?;
        self.stream.notify.notify_waiters();
        Ok(())
    }

    pub(crate) fn in_progress(&self) -> Result<()> {
        self.with_pending(|p, ack_wait| {
            if let Some(entry) = p.get_mut(&self.seq) {
                entry.0 = Instant::now() + ack_wait;
            }
        })
    }
}

// ---------------------------------------------------------------- KV

struct LocalKv {
    state: Mutex<KvState>,
}

#[derive(Default)]
struct KvState {
    entries: BTreeMap<String, (Bytes, u64)>,
    revision: u64,
    watchers: Vec<(String, mpsc::UnboundedSender<Result<KvEvent>>)>,
}

impl KvState {
    fn write(&mut self, key: &str, value: Option<Bytes>) -> u64 {
        self.revision += 1;
        let revision = self.revision;
        match &value {
            Some(v) => {
                self.entries.insert(key.to_owned(), (v.clone(), revision));
            }
            None => {
                self.entries.remove(key);
            }
        }
        let event = KvEvent {
            key: key.to_owned(),
            value,
            revision,
        };
        self.watchers.retain(|(pattern, tx)| {
            !subject_matches(pattern, key) || tx.send(Ok(event.clone())).is_ok()
        });
        revision
    }
}

#[async_trait]
impl KvBucket for LocalKv {
    async fn get(&self, key: &str) -> Result<Option<KvEntry>> {
        validate_key(key)?;
        Ok(lock(&self.state).entries.get(key).map(|(v, r)| KvEntry {
            key: key.to_owned(),
            value: v.clone(),
            revision: *r,
        }))
    }

    async fn put(&self, key: &str, value: Bytes) -> Result<u64> {
        validate_key(key)?;
        Ok(lock(&self.state).write(key, Some(value)))
    }

    async fn create(&self, key: &str, value: Bytes) -> Result<u64> {
        validate_key(key)?;
        let mut s = lock(&self.state);
        if s.entries.contains_key(key) {
            return Err(TransportError::KeyExists { key: key.into() });
        }
        Ok(s.write(key, Some(value)))
    }

    async fn update(&self, key: &str, value: Bytes, revision: u64) -> Result<u64> {
        validate_key(key)?;
        let mut s = lock(&self.state);
        match s.entries.get(key) {
            Some((_, r)) if *r == revision => Ok(s.write(key, Some(value))),
            _ => Err(TransportError::RevisionMismatch {
                key: key.into(),
                expected: revision,
            }),
        }
    }

    async fn delete(&self, key: &str) -> Result<()> {
        validate_key(key)?;
        let mut s = lock(&self.state);
        if s.entries.contains_key(key) {
            s.write(key, None);
        }
        Ok(())
    }

    async fn keys(&self) -> Result<Vec<String>> {
        Ok(lock(&self.state).entries.keys().cloned().collect())
    }

    async fn watch(&self, key: &str) -> Result<BoxStream<'static, Result<KvEvent>>> {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut s = lock(&self.state);
        // Under the lock: the current values, then every later write, no gap.
        for (k, (v, r)) in s.entries.iter() {
            if subject_matches(key, k) {
                let _ = tx.send(Ok(KvEvent {
                    key: k.clone(),
                    value: Some(v.clone()),
                    revision: *r,
                }));
            }
        }
        s.watchers.push((key.to_owned(), tx));
        Ok(UnboundedReceiverStream::new(rx).boxed())
    }
}

// ---------------------------------------------------------------- objects

struct LocalObjects {
    bucket: String,
    objects: Mutex<BTreeMap<String, (Bytes, ObjectInfo)>>,
}

impl LocalObjects {
    /// The object and its sha256 (hex), checked against the one recorded
    /// at put time.
    fn get_checked(&self, name: &str) -> Result<(Bytes, String)> {
        let (data, info) = lock(&self.objects).get(name).cloned().ok_or_else(|| {
            TransportError::ObjectNotFound {
                bucket: self.bucket.clone(),
                name: name.into(),
            }
        })?;
        let actual = sha256_hex(&data);
        expect_sha256(name, actual.clone(), &info.sha256)?;
        Ok((data, actual))
    }
}

#[async_trait]
impl ObjectStore for LocalObjects {
    async fn put(&self, name: &str, data: Bytes) -> Result<ObjectInfo> {
        if name.is_empty() {
            return Err(TransportError::InvalidName {
                name: name.into(),
                reason: "empty object name".into(),
            });
        }
        let size = data.len() as u64;
        let info = ObjectInfo {
            name: name.to_owned(),
            size,
            sha256: sha256_hex(&data),
            chunks: size.div_ceil(OBJECT_CHUNK as u64) as usize,
        };
        lock(&self.objects).insert(name.to_owned(), (data, info.clone()));
        Ok(info)
    }

    async fn get(&self, name: &str) -> Result<Bytes> {
        self.get_checked(name).map(|(data, _)| data)
    }

    /// One hash of the bytes checks them against both the sha256 recorded
    /// at put time and the announced one.
    async fn get_expecting(&self, name: &str, sha256: &str) -> Result<Bytes> {
        let (data, actual) = self.get_checked(name)?;
        expect_sha256(name, actual, sha256)?;
        Ok(data)
    }

    async fn info(&self, name: &str) -> Result<Option<ObjectInfo>> {
        Ok(lock(&self.objects).get(name).map(|(_, i)| i.clone()))
    }

    async fn delete(&self, name: &str) -> Result<()> {
        lock(&self.objects)
            .remove(name)
            .map(|_| ())
            .ok_or_else(|| TransportError::ObjectNotFound {
                bucket: self.bucket.clone(),
                name: name.into(),
            })
    }

    async fn list(&self) -> Result<Vec<ObjectInfo>> {
        Ok(lock(&self.objects)
            .values()
            .map(|(_, i)| i.clone())
            .collect())
    }
}
