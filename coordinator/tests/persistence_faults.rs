//! What the coordinator does when it cannot write its state: it answers no
//! request whose effect is not stored (grants are refused, completions get
//! no answer so that workers retry), reports not-ready, and recovers once
//! the bucket takes writes again. A second writer of its state stops it.
//!
//! All of it over the in-process bus, on paused tokio time with the
//! coordinator on a [`TokioClock`]: the timeouts below are tokio time, not
//! a bet on how fast a loaded machine is.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use asyncrl_common::{SharedClock, TokioClock};
use asyncrl_coordinator::{Coordinator, CoordinatorError};
use asyncrl_protos::subjects::COORDINATOR_STATE_KEY as STATE_KEY;
use asyncrl_protos::subjects::TASKS_COMPLETE;
use asyncrl_protos::v1::{CompleteTask, CompleteTaskReply};
use asyncrl_telemetry::{Health, Metrics};
use asyncrl_testkit::eventually;
use asyncrl_transport::{
    Bus, Consumer, ConsumerSpec, KvBucket, KvEntry, KvEvent, LocalBus, Message, ObjectStore,
    PublishAck, Request, Result, StoreUsage, StreamSpec, TransportError,
};
use bytes::Bytes;
use common::{Worker, config, write_tasks};

use futures::stream::BoxStream;
use prost::Message as _;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

/// The in-process bus, with KV writes of `coordinator.state` that fail on
/// demand (as when NATS is unreachable), that land but whose reply is lost
/// (as when the server restarts at the wrong moment), or that wait for a
/// permit each (a slow server, under the test's control).
struct FlakyBus {
    inner: LocalBus,
    fail: Arc<AtomicBool>,
    lose_replies: Arc<AtomicBool>,
    gate: Arc<Gate>,
}

struct FlakyKv {
    inner: Arc<dyn KvBucket>,
    fail: Arc<AtomicBool>,
    lose_replies: Arc<AtomicBool>,
    gate: Arc<Gate>,
}

/// Holds state writes: each one waits for a permit; counts those started.
struct Gate {
    permits: Semaphore,
    started: AtomicUsize,
}

impl Gate {
    fn open() -> Arc<Self> {
        Arc::new(Self {
            permits: Semaphore::new(Semaphore::MAX_PERMITS),
            started: AtomicUsize::new(0),
        })
    }

    fn closed() -> Arc<Self> {
        Arc::new(Self {
            permits: Semaphore::new(0),
            started: AtomicUsize::new(0),
        })
    }

    async fn pass(&self, key: &str) {
        if key == STATE_KEY {
            self.started.fetch_add(1, Ordering::SeqCst);
            self.permits
                .acquire()
                .await
                .expect("the gate is never closed for good")
                .forget();
        }
    }

    fn started(&self) -> usize {
        self.started.load(Ordering::SeqCst)
    }
}

fn timeout(key: &str) -> TransportError {
    TransportError::Timeout {
        subject: format!("$KV.asyncrl_control.{key}"),
        timeout: Duration::from_secs(1),
    }
}

impl FlakyKv {
    fn check(&self, key: &str) -> Result<()> {
        if key == STATE_KEY && self.fail.load(Ordering::SeqCst) {
            return Err(timeout(key));
        }
        Ok(())
    }

    fn reply(&self, key: &str, r: Result<u64>) -> Result<u64> {
        if key == STATE_KEY && self.lose_replies.load(Ordering::SeqCst) {
            return r.and(Err(timeout(key)));
        }
        r
    }
}

#[async_trait]
impl KvBucket for FlakyKv {
    async fn get(&self, key: &str) -> Result<Option<KvEntry>> {
        self.inner.get(key).await
    }
    async fn put(&self, key: &str, value: Bytes) -> Result<u64> {
        self.check(key)?;
        self.inner.put(key, value).await
    }
    async fn create(&self, key: &str, value: Bytes) -> Result<u64> {
        self.check(key)?;
        self.gate.pass(key).await;
        let r = self.inner.create(key, value).await;
        self.reply(key, r)
    }
    async fn update(&self, key: &str, value: Bytes, revision: u64) -> Result<u64> {
        self.check(key)?;
        self.gate.pass(key).await;
        let r = self.inner.update(key, value, revision).await;
        self.reply(key, r)
    }
    async fn delete(&self, key: &str) -> Result<()> {
        self.inner.delete(key).await
    }
    async fn keys(&self) -> Result<Vec<String>> {
        self.inner.keys().await
    }
    async fn watch(&self, key: &str) -> Result<BoxStream<'static, Result<KvEvent>>> {
        self.inner.watch(key).await
    }
}

#[async_trait]
impl Bus for FlakyBus {
    fn kind(&self) -> &'static str {
        "flaky-local"
    }
    async fn publish(&self, subject: &str, payload: Bytes) -> Result<()> {
        self.inner.publish(subject, payload).await
    }
    async fn subscribe(&self, subject: &str) -> Result<BoxStream<'static, Message>> {
        self.inner.subscribe(subject).await
    }
    async fn request(&self, subject: &str, payload: Bytes, timeout: Duration) -> Result<Bytes> {
        self.inner.request(subject, payload, timeout).await
    }
    async fn serve(&self, subject: &str, q: Option<&str>) -> Result<BoxStream<'static, Request>> {
        self.inner.serve(subject, q).await
    }
    async fn ensure_stream(&self, spec: &StreamSpec) -> Result<()> {
        self.inner.ensure_stream(spec).await
    }
    async fn publish_durable(&self, subject: &str, id: &str, payload: Bytes) -> Result<PublishAck> {
        self.inner.publish_durable(subject, id, payload).await
    }
    async fn stream_len(&self, stream: &str) -> Result<u64> {
        self.inner.stream_len(stream).await
    }
    async fn storage(&self) -> Result<Vec<StoreUsage>> {
        self.inner.storage().await
    }
    async fn consumer(&self, stream: &str, spec: &ConsumerSpec) -> Result<Box<dyn Consumer>> {
        self.inner.consumer(stream, spec).await
    }
    async fn kv(&self, bucket: &str) -> Result<Arc<dyn KvBucket>> {
        Ok(Arc::new(FlakyKv {
            inner: self.inner.kv(bucket).await?,
            fail: self.fail.clone(),
            lose_replies: self.lose_replies.clone(),
            gate: self.gate.clone(),
        }))
    }
    async fn object_store(&self, bucket: &str) -> Result<Arc<dyn ObjectStore>> {
        self.inner.object_store(bucket).await
    }
    async fn flush(&self) -> Result<()> {
        self.inner.flush().await
    }
}

/// The coordinator's clock in these tests (paused tokio time).
fn paused_clock() -> SharedClock {
    TokioClock::starting_at(1_700_000_000_000).shared()
}

/// A coordinator (B = 4, η = 0, 20 tasks) over a [`FlakyBus`] whose state
/// writes fail while `fail` is set and whose write replies are lost while
/// `lose_replies` is set.
async fn start_flaky(
    fail: Arc<AtomicBool>,
    lose_replies: Arc<AtomicBool>,
) -> (Arc<dyn Bus>, tempfile::TempDir, Health, Coordinator) {
    start_gated(fail, lose_replies, Gate::open()).await
}

/// [`start_flaky`], with state writes that pass `gate`.
async fn start_gated(
    fail: Arc<AtomicBool>,
    lose_replies: Arc<AtomicBool>,
    gate: Arc<Gate>,
) -> (Arc<dyn Bus>, tempfile::TempDir, Health, Coordinator) {
    let bus: Arc<dyn Bus> = Arc::new(FlakyBus {
        inner: LocalBus::new(),
        fail,
        lose_replies,
        gate,
    });
    let dir = tempfile::tempdir().unwrap();
    let tasks = write_tasks(dir.path(), 20);
    let health = Health::new();
    let c = Coordinator::start_with_clock(
        config(dir.path(), &tasks, 4, 0),
        bus.clone(),
        Metrics::new(),
        health.clone(),
        &CancellationToken::new(),
        paused_clock(),
    )
    .await
    .unwrap();
    (bus, dir, health, c)
}

#[tokio::test(start_paused = true)]
async fn unwritable_state_refuses_grants_withholds_completions_and_recovers() {
    let fail = Arc::new(AtomicBool::new(false));
    let (bus, _dir, health, c) = start_flaky(fail.clone(), Arc::default()).await;
    let w = Worker::new(&bus, "w");
    w.register(4).await;
    let held = w.acquire(2).await.tasks;
    assert_eq!(held.len(), 2);

    fail.store(true, Ordering::SeqCst);
    let denied = w.acquire(1).await;
    assert!(
        denied.tasks.is_empty(),
        "a grant that cannot be stored must not be handed out"
    );
    assert!(
        denied.reason.contains("cannot write its state"),
        "{}",
        denied.reason
    );
    assert!(!health.is_ready());
    let complete = CompleteTask {
        worker_id: "w".into(),
        task_id: held[0].task_id.clone(),
        lease_id: held[0].lease_id.clone(),
        num_trajectories: 2,
    };
    let r = bus
        .request(
            TASKS_COMPLETE,
            Bytes::from(complete.encode_to_vec()),
            Duration::from_millis(300),
        )
        .await;
    // No answer: a timeout on NATS, a dropped request in process; either
    // way an error the worker retries.
    assert!(
        r.as_ref().is_err_and(|e| e.is_transient()),
        "an unstored completion gets no answer: {r:?}"
    );

    fail.store(false, Ordering::SeqCst);
    // The worker retries its completion: counted once.
    let r = bus
        .request(
            TASKS_COMPLETE,
            Bytes::from(complete.encode_to_vec()),
            common::TIMEOUT,
        )
        .await
        .unwrap();
    let r = CompleteTaskReply::decode(r.as_ref()).unwrap();
    assert!(r.accepted, "{}", r.reason);
    eventually("ready again", Duration::from_secs(5), || async {
        health.is_ready().then_some(())
    })
    .await;
    assert!(w.complete(&held[1]).await.accepted);
    let s = c.status().await.unwrap();
    assert_eq!(s.accepted_groups, 2);
    // The grant refused during the outage holds a lease that will expire;
    // admission counts it until then.
    assert_eq!(s.running_groups, 1);
    c.shutdown();
    c.join().await.unwrap();
}

/// A state write that landed although its reply was lost is the
/// coordinator's own, also once its state has changed since: it goes on
/// (it used to stop, taking the write for a second coordinator's).
#[tokio::test(start_paused = true)]
async fn a_state_write_whose_reply_was_lost_is_recognised_as_its_own() {
    let lose = Arc::new(AtomicBool::new(false));
    let (bus, _dir, health, c) = start_flaky(Arc::default(), lose.clone()).await;
    let w = Worker::new(&bus, "w");
    w.register(4).await;
    assert_eq!(w.acquire(1).await.tasks.len(), 1);
    // The grant's state lands, its reply does not: no grant handed out.
    lose.store(true, Ordering::SeqCst);
    let denied = w.acquire(1).await;
    assert!(denied.tasks.is_empty(), "{denied:?}");
    lose.store(false, Ordering::SeqCst);
    // Further changes are written over it, and the coordinator goes on.
    let granted = eventually("a grant again", Duration::from_secs(5), || async {
        let t = w.acquire(1).await.tasks;
        (!t.is_empty()).then_some(t)
    })
    .await;
    assert_eq!(granted.len(), 1);
    assert!(w.complete(&granted[0]).await.accepted);
    assert!(health.is_ready());
    let s = c.status().await.expect("the coordinator still runs");
    assert_eq!(s.accepted_groups, 1);
    c.shutdown();
    c.join().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_second_writer_of_the_state_stops_the_coordinator() {
    let bus: Arc<dyn Bus> = Arc::new(LocalBus::new());
    let dir = tempfile::tempdir().unwrap();
    let tasks = write_tasks(dir.path(), 20);
    let c = Coordinator::start_with_clock(
        config(dir.path(), &tasks, 4, 0),
        bus.clone(),
        Metrics::new(),
        Health::new(),
        &CancellationToken::new(),
        paused_clock(),
    )
    .await
    .unwrap();
    let w = Worker::new(&bus, "w");
    w.register(4).await;
    assert_eq!(w.acquire(1).await.tasks.len(), 1);
    // Someone else (a second coordinator) writes the state.
    let kv = bus
        .kv(asyncrl_protos::subjects::CONTROL_BUCKET)
        .await
        .unwrap();
    let mut theirs = kv.get(STATE_KEY).await.unwrap().unwrap().value.to_vec();
    theirs.extend_from_slice(&[0x50, 0x01]); // field 10 (accepted) = 1
    kv.put(STATE_KEY, Bytes::from(theirs)).await.unwrap();
    let _ = tokio::time::timeout(
        Duration::from_secs(2),
        w.bus.request(
            asyncrl_protos::subjects::TASKS_ACQUIRE,
            Bytes::from(
                asyncrl_protos::v1::AcquireTasks {
                    worker_id: "w".into(),
                    free_slots: 1,
                }
                .encode_to_vec(),
            ),
            Duration::from_secs(1),
        ),
    )
    .await;
    let err = tokio::time::timeout(Duration::from_secs(5), c.join())
        .await
        .expect("the coordinator stops")
        .unwrap_err();
    assert!(
        matches!(err, CoordinatorError::AnotherCoordinator { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("only one coordinator"), "{err}");
}

/// Lets every runnable task run until all wait (paused time moves on only
/// then).
async fn settle() {
    tokio::time::sleep(Duration::from_millis(50)).await;
}

/// While a state write is in flight the coordinator keeps taking requests
/// (pipelined group commit), yet no reply goes out before a write that
/// holds every change made before it: a grant handled during the write in
/// flight is answered only after the next write, which stores its lease,
/// and so is a heartbeat taken meanwhile.
#[tokio::test(start_paused = true)]
async fn replies_wait_for_the_write_that_covers_them_while_the_next_is_prepared() {
    let gate = Gate::closed();
    let (bus, _dir, _health, c) = start_gated(Arc::default(), Arc::default(), gate.clone()).await;
    Worker::new(&bus, "a").register(4).await;
    Worker::new(&bus, "b").register(4).await;
    let spawn_acquire = |id: &'static str| {
        let w = Worker::new(&bus, id);
        tokio::spawn(async move { w.acquire(1).await })
    };

    let first = spawn_acquire("a");
    settle().await;
    assert_eq!(gate.started(), 1, "the first grant's write is in flight");
    let second = spawn_acquire("b");
    let heartbeat = {
        let w = Worker::new(&bus, "a");
        tokio::spawn(async move { w.heartbeat(&[], false).await })
    };
    settle().await;
    // The coordinator answers its admin API and has made the second grant,
    // while the first write is still held.
    let s = tokio::time::timeout(Duration::from_secs(1), c.status())
        .await
        .expect("the coordinator takes events while a write is in flight")
        .unwrap();
    assert_eq!(s.running_groups, 2);
    assert!(!first.is_finished() && !second.is_finished() && !heartbeat.is_finished());
    assert_eq!(gate.started(), 1, "one write in flight at a time");

    // The first write lands: its grant goes out, the next write starts.
    gate.permits.add_permits(1);
    let first = first.await.unwrap();
    assert_eq!(first.tasks.len(), 1, "{}", first.reason);
    settle().await;
    assert_eq!(gate.started(), 2);
    assert!(
        !second.is_finished() && !heartbeat.is_finished(),
        "replies taken during the first write wait for the second"
    );

    gate.permits.add_permits(1);
    let second = second.await.unwrap();
    assert_eq!(second.tasks.len(), 1, "{}", second.reason);
    heartbeat.await.unwrap();
    // The stored state holds both leases.
    let kv = bus
        .kv(asyncrl_protos::subjects::CONTROL_BUCKET)
        .await
        .unwrap();
    let stored = kv.get(STATE_KEY).await.unwrap().expect("state written");
    let state = asyncrl_protos::v1::CoordinatorState::decode(stored.value.as_ref()).unwrap();
    let mut seqs: Vec<String> = state
        .leases
        .iter()
        .map(|l| format!("{}-{}", state.lease_prefix, l.seq))
        .collect();
    seqs.sort();
    let mut granted = vec![
        first.tasks[0].lease_id.clone(),
        second.tasks[0].lease_id.clone(),
    ];
    granted.sort();
    assert_eq!(seqs, granted);
    gate.permits.add_permits(Semaphore::MAX_PERMITS - 2);
    c.shutdown();
    c.join().await.unwrap();
}
