//! Weight swaps: watch `policy.version`, fetch the announced object, verify
//! its sha256 and swap it in at the next decoding-step boundary.
//!
//! A fetch that fails (checksum mismatch, timeout, missing object, bus
//! error) keeps the old weights in use, is counted, and is retried with
//! backoff; a newer announcement cuts the backoff short and is fetched
//! instead. Bytes that verify but do not load as this model's weights are
//! not retried (the same bytes would fail again): the worker waits for a
//! newer version. Versions never go backwards.
//!
//! Workers of one process share each fetch ([`fetch`]): the first worker
//! that wants a version's object (name and announced sha256) fetches it,
//! the others that want it meanwhile wait for the same bytes instead of
//! fetching their own copy, and the bytes are held only as long as a worker
//! still holds them. Every copy handed out is the one checked against the
//! announced sha256.

use std::collections::HashMap;
use std::ops::ControlFlow;
use std::sync::atomic::Ordering;
use std::sync::{Arc, LazyLock, Mutex, PoisonError};
use std::time::{Duration, Instant};

use asyncrl_protos::WeightAnnouncement;
use asyncrl_protos::subjects::{
    CONTROL_BUCKET, POLICY_VERSION_KEY, WEIGHTS_BUCKET, WEIGHTS_FORMAT, WEIGHTS_FORMAT_FOLDER,
};
use asyncrl_transport::{Bus, TransportError};
use bytes::Bytes;
use futures::FutureExt;
use futures::future::{BoxFuture, Shared as SharedFuture, WeakShared};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::client::Backoff;
use crate::engine::EngineError;
use crate::metrics::reason;
use crate::state::{Shared, bump};

/// Runs until `stop`: keeps the model on the newest announced weights and
/// reports each version in use on `loaded`.
pub(crate) async fn run(
    shared: Arc<Shared>,
    loaded: watch::Sender<Option<i32>>,
    stop: CancellationToken,
) {
    let (ann_tx, ann_rx) = watch::channel::<Option<WeightAnnouncement>>(None);
    let watcher = tokio::spawn(watch_announcements(shared.clone(), ann_tx, stop.clone()));
    load_loop(&shared, ann_rx, &loaded, &stop).await;
    stop.cancel();
    let _ = watcher.await;
}

/// Follows the KV key `policy.version`, publishing every newer announcement
/// on `tx`; re-opens the watch with backoff when it fails.
async fn watch_announcements(
    shared: Arc<Shared>,
    tx: watch::Sender<Option<WeightAnnouncement>>,
    stop: CancellationToken,
) {
    let (min, max) = shared.settings.weight_backoff;
    let bus = shared.bus.clone();
    asyncrl_control::kv::follow(
        bus,
        CONTROL_BUCKET,
        POLICY_VERSION_KEY,
        Backoff::new(min, max),
        stop,
        |value, revision| {
            on_announcement(&shared, &tx, value, revision);
            std::future::ready(ControlFlow::Continue(()))
        },
    )
    .await;
}

fn on_announcement(
    shared: &Shared,
    tx: &watch::Sender<Option<WeightAnnouncement>>,
    value: Bytes,
    revision: u64,
) {
    let ann = match asyncrl_control::weights::decode_announcement(&value) {
        Ok(a) => a,
        Err(e) => {
            tracing::warn!(error = %e, revision, "announcement ignored");
            return;
        }
    };
    let newer = tx
        .borrow()
        .as_ref()
        .is_none_or(|cur| ann.version > cur.version);
    if !newer {
        tracing::debug!(
            version = ann.version,
            "announcement of an older or equal version ignored"
        );
        return;
    }
    tracing::info!(version = ann.version, object = %ann.object_name, step = ann.step, "new weights announced");
    shared
        .announced_version
        .fetch_max(ann.version, Ordering::SeqCst);
    shared
        .metrics
        .weights_announced_version
        .set(i64::from(ann.version));
    let _ = tx.send(Some(ann));
}

/// Why a fetch or load failed; the label is the metric's reason.
#[derive(Debug)]
struct FetchFailure {
    label: &'static str,
    message: String,
    /// Whether fetching the same version again can succeed.
    retry: bool,
}

async fn load_loop(
    shared: &Arc<Shared>,
    mut ann_rx: watch::Receiver<Option<WeightAnnouncement>>,
    loaded: &watch::Sender<Option<i32>>,
    stop: &CancellationToken,
) {
    let (min, max) = shared.settings.weight_backoff;
    let mut backoff = Backoff::new(min, max);
    let mut current: Option<i32> = None;
    // A version whose bytes verified but did not load: not retried.
    let mut given_up: Option<i32> = None;
    loop {
        // The newest announcement we do not run yet.
        let wanted = {
            let ann = ann_rx.borrow_and_update();
            ann.as_ref()
                .filter(|a| current.is_none_or(|v| a.version > v))
                .filter(|a| given_up.is_none_or(|v| a.version > v))
                .cloned()
        };
        let Some(ann) = wanted else {
            match stop.run_until_cancelled(ann_rx.changed()).await {
                Some(Ok(())) => continue,
                _ => return,
            }
        };
        let attempt = stop.run_until_cancelled(fetch_and_load(shared, &ann)).await;
        match attempt {
            None => return,
            Some(Ok(())) => {
                backoff.reset();
                current = Some(ann.version);
                let _ = loaded.send(Some(ann.version));
            }
            Some(Err(f)) if f.label == "model_gone" => {
                shared.set_fatal(f.message);
                return;
            }
            Some(Err(f)) if f.label == "rejected" && current.is_none() => {
                // The very first weights do not fit the engine's model: a
                // configuration error, not something to wait out.
                shared.set_fatal(f.message);
                return;
            }
            Some(Err(f)) => {
                shared
                    .metrics
                    .weight_fetch_failures
                    .get_or_create(&reason(f.label))
                    .inc();
                bump(&shared.counters.weight_fetch_failures);
                tracing::warn!(
                    version = ann.version,
                    object = %ann.object_name,
                    reason = f.label,
                    error = %f.message,
                    in_use = shared.engine.version(),
                    "weight fetch failed; keeping the weights in use"
                );
                if !f.retry {
                    given_up = Some(ann.version);
                    continue;
                }
                // Retry after the backoff, or at once when a newer version
                // is announced meanwhile.
                let delay = backoff.next_delay();
                let newer = async {
                    loop {
                        if ann_rx.changed().await.is_err() {
                            // The watcher is gone: only the delay remains.
                            std::future::pending::<()>().await;
                        }
                        if ann_rx
                            .borrow()
                            .as_ref()
                            .is_some_and(|a| a.version > ann.version)
                        {
                            return;
                        }
                    }
                };
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(delay) => {}
                    _ = newer => backoff.reset(),
                }
            }
        }
    }
}

async fn fetch_and_load(
    shared: &Arc<Shared>,
    ann: &WeightAnnouncement,
) -> Result<(), FetchFailure> {
    let readable = if ann.folder.is_empty() {
        ann.format.is_empty() || ann.format == WEIGHTS_FORMAT
    } else {
        ann.format == WEIGHTS_FORMAT_FOLDER
    };
    if !readable {
        return Err(FetchFailure {
            label: "format",
            message: format!(
                "weights in format {:?}; this worker reads {WEIGHTS_FORMAT} objects and {WEIGHTS_FORMAT_FOLDER} folders",
                ann.format
            ),
            retry: false,
        });
    }
    let timeout = shared.settings.weight_fetch_timeout;
    if !ann.folder.is_empty() {
        // An engine that loads folders itself (vLLM) reloads the checked
        // folder in place: nothing is held in memory or copied.
        if shared.engine.loads_folders() {
            check_shared_folder(ann, timeout, asyncrl_control::weights::verify_folder).await?;
            let dir = std::path::PathBuf::from(&ann.folder);
            return load(shared, ann, &ann.folder, Source::Folder(dir)).await;
        }
        let bytes = read_shared_folder(ann, timeout).await?;
        return load(shared, ann, &ann.folder, Source::Bytes(bytes)).await;
    }
    let name = asyncrl_control::weights::object_name(ann);
    let bytes: Bytes = match tokio::time::timeout(timeout, fetch(&shared.bus, ann)).await {
        Err(_) => {
            return Err(FetchFailure {
                label: "timeout",
                message: format!("fetching {name} took longer than {timeout:?}"),
                retry: true,
            });
        }
        Ok(Err(e)) => {
            let label = match &e {
                TransportError::ChecksumMismatch { .. } => "checksum",
                TransportError::ObjectNotFound { .. } => "not_found",
                _ => "transport",
            };
            return Err(FetchFailure {
                label,
                message: e.to_string(),
                retry: true,
            });
        }
        Ok(Ok(b)) => b,
    };
    if ann.byte_size != 0 && ann.byte_size != bytes.len() as u64 {
        return Err(FetchFailure {
            label: "checksum",
            message: format!(
                "{name} has {} bytes, the announcement says {}",
                bytes.len(),
                ann.byte_size
            ),
            retry: true,
        });
    }
    load(shared, ann, &name, Source::Bytes(bytes)).await
}

/// What a version is loaded from.
enum Source {
    Bytes(Bytes),
    /// A checked `shared_path` folder the engine reads itself.
    Folder(std::path::PathBuf),
}

/// A version of the `shared_path` transport: every file of its folder,
/// checked against the announced sha256s (a folder altered or half-written
/// is refused, and fetched again later), as one safetensors file.
async fn read_shared_folder(
    ann: &WeightAnnouncement,
    timeout: Duration,
) -> Result<Bytes, FetchFailure> {
    let files = check_shared_folder(ann, timeout, asyncrl_control::weights::read_folder).await?;
    merge_shards(&files).map_err(|e| FetchFailure {
        label: "load",
        message: format!("the weights in {} are no safetensors: {e}", ann.folder),
        retry: false,
    })
}

/// Runs `check` (a reader of an announced folder) off the runtime, within
/// `timeout`, its failures labelled as every fetch failure is.
async fn check_shared_folder<T: Send + 'static>(
    ann: &WeightAnnouncement,
    timeout: Duration,
    check: fn(&WeightAnnouncement) -> Result<T, asyncrl_control::weights::FolderError>,
) -> Result<T, FetchFailure> {
    use asyncrl_control::weights::FolderError;
    let owned = ann.clone();
    let read = tokio::task::spawn_blocking(move || check(&owned));
    match tokio::time::timeout(timeout, read).await {
        Err(_) => Err(FetchFailure {
            label: "timeout",
            message: format!("reading {} took longer than {timeout:?}", ann.folder),
            retry: true,
        }),
        Ok(Err(e)) => Err(FetchFailure {
            label: "transport",
            message: format!("the folder reader failed: {e}"),
            retry: true,
        }),
        Ok(Ok(Err(e))) => {
            let label = match &e {
                FolderError::Mismatch { .. } => "checksum",
                FolderError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
                    "not_found"
                }
                _ => "transport",
            };
            Err(FetchFailure {
                label,
                message: e.to_string(),
                retry: true,
            })
        }
        Ok(Ok(Ok(v))) => Ok(v),
    }
}

/// One safetensors file holding every tensor of `files` (the shards of a
/// folder; one file is passed through as it is).
fn merge_shards(files: &[(String, Bytes)]) -> Result<Bytes, safetensors::SafeTensorError> {
    if let [(_, bytes)] = files {
        return Ok(bytes.clone());
    }
    let parsed = files
        .iter()
        .map(|(_, b)| safetensors::SafeTensors::deserialize(b))
        .collect::<Result<Vec<_>, _>>()?;
    let tensors: Vec<(String, safetensors::tensor::TensorView<'_>)> =
        parsed.iter().flat_map(|st| st.tensors()).collect();
    safetensors::serialize(tensors, None).map(Bytes::from)
}

/// Swaps fetched and checked weights into the engine.
async fn load(
    shared: &Arc<Shared>,
    ann: &WeightAnnouncement,
    name: &str,
    source: Source,
) -> Result<(), FetchFailure> {
    shared
        .metrics
        .weights_fetched_version
        .set(i64::from(ann.version));
    let started = Instant::now();
    let loaded = match source {
        Source::Bytes(bytes) => shared.engine.load_weights(bytes, ann.version).await,
        Source::Folder(dir) => shared.engine.load_weights_folder(&dir, ann.version).await,
    };
    match loaded {
        Ok(()) => {
            let now = shared.clock.now_unix_ms();
            let latency_ms = if ann.published_at_unix_ms > 0 {
                (now - ann.published_at_unix_ms).max(0) as f64
            } else {
                started.elapsed().as_secs_f64() * 1000.0
            };
            shared
                .swap_latency_ms
                .store(latency_ms.to_bits(), Ordering::Relaxed);
            shared
                .metrics
                .weight_swap_latency_seconds
                .observe(latency_ms / 1000.0);
            shared.metrics.weight_swaps.inc();
            shared.metrics.policy_version.set(i64::from(ann.version));
            bump(&shared.counters.weight_swaps);
            tracing::info!(
                version = ann.version,
                object = %name,
                swap_latency_ms = latency_ms,
                load_ms = started.elapsed().as_millis() as u64,
                "weights swapped in"
            );
            Ok(())
        }
        Err(EngineError::Gone) => Err(FetchFailure {
            label: "model_gone",
            message: EngineError::Gone.to_string(),
            retry: false,
        }),
        Err(e @ EngineError::Rejected(_)) => Err(FetchFailure {
            label: "rejected",
            message: format!(
                "`model.path`: the engine cannot load the learner's weights (version {}), so it serves another model: {e}",
                ann.version
            ),
            retry: false,
        }),
        // The engine recovers on its own and reloads the newest weights;
        // fetching again later is harmless.
        Err(e @ (EngineError::Unavailable(_) | EngineError::Invalid(_))) => Err(FetchFailure {
            label: "engine",
            message: e.to_string(),
            retry: true,
        }),
        Err(e @ EngineError::Model(_)) => Err(FetchFailure {
            label: "load",
            message: e.to_string(),
            retry: false,
        }),
    }
}

type FetchFuture = BoxFuture<'static, Result<Bytes, TransportError>>;
type Fetch = SharedFuture<FetchFuture>;

/// The fetches in flight or still held in this process, by object name and
/// announced sha256 (lower case).
type Fetches = HashMap<(String, String), WeakShared<FetchFuture>>;
static FETCHES: LazyLock<Mutex<Fetches>> = LazyLock::new(Mutex::default);

/// Fetches the weights `ann` announces from the `WEIGHTS` object store of
/// `bus`, checked against the announced sha256. Callers in this process that
/// want the same object with the same sha256 while another fetches it (or
/// still holds its bytes) get those bytes and fetch nothing; a failure is
/// shared by the calls that waited for it, and the next call fetches again.
pub async fn fetch(bus: &Arc<dyn Bus>, ann: &WeightAnnouncement) -> Result<Bytes, TransportError> {
    let key = (
        asyncrl_control::weights::object_name(ann),
        ann.sha256.to_ascii_lowercase(),
    );
    let bus = bus.clone();
    let ann = ann.clone();
    single_flight(key, async move {
        let store = bus.object_store(WEIGHTS_BUCKET).await?;
        asyncrl_control::weights::fetch(store.as_ref(), &ann).await
    })
    .await
}

/// Runs `fetch` unless a fetch of `key` is in flight or its bytes are still
/// held, then returns that one's outcome.
async fn single_flight(
    key: (String, String),
    fetch: impl Future<Output = Result<Bytes, TransportError>> + Send + 'static,
) -> Result<Bytes, TransportError> {
    let shared: Fetch = {
        let mut fetches = FETCHES.lock().unwrap_or_else(PoisonError::into_inner);
        fetches.retain(|_, weak| weak.upgrade().is_some());
        match fetches.get(&key).and_then(WeakShared::upgrade) {
            Some(shared) => shared,
            None => {
                let shared = fetch.boxed().shared();
                if let Some(weak) = shared.downgrade() {
                    fetches.insert(key.clone(), weak);
                }
                shared
            }
        }
    };
    let result = shared.clone().await;
    if result.is_err() {
        // Not kept for later calls: they fetch again.
        let mut fetches = FETCHES.lock().unwrap_or_else(PoisonError::into_inner);
        if fetches
            .get(&key)
            .and_then(WeakShared::upgrade)
            .is_some_and(|held| held.ptr_eq(&shared))
        {
            fetches.remove(&key);
        }
    }
    result
}

/// How often the worker logs that it still waits for the first weights.
pub(crate) const STARTUP_LOG_EVERY: Duration = Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use tokio::sync::Notify;

    fn key(name: &str) -> (String, String) {
        (name.to_owned(), "ab".repeat(32))
    }

    /// A fetch that counts its runs and finishes when `go` is notified.
    fn counted(
        runs: &Arc<AtomicUsize>,
        go: &Arc<Notify>,
        out: Result<Bytes, TransportError>,
    ) -> impl Future<Output = Result<Bytes, TransportError>> + Send + 'static {
        let (runs, go) = (runs.clone(), go.clone());
        async move {
            runs.fetch_add(1, Ordering::SeqCst);
            go.notified().await;
            out
        }
    }

    /// `n` concurrent calls of `key` whose fetch ends with `out` once every
    /// call is waiting for it; their outcomes.
    async fn concurrent(
        n: usize,
        name: &str,
        runs: &Arc<AtomicUsize>,
        go: &Arc<Notify>,
        out: Result<Bytes, TransportError>,
    ) -> Vec<Result<Bytes, TransportError>> {
        let waiters: Vec<_> = (0..n)
            .map(|_| tokio::spawn(single_flight(key(name), counted(runs, go, out.clone()))))
            .collect();
        while runs.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        for _ in 0..n {
            tokio::task::yield_now().await;
        }
        go.notify_one();
        let mut outcomes = Vec::new();
        for w in waiters {
            outcomes.push(w.await.unwrap());
        }
        outcomes
    }

    #[tokio::test]
    async fn concurrent_calls_share_one_fetch_and_release_it() {
        let (runs, go) = (Arc::new(AtomicUsize::new(0)), Arc::new(Notify::new()));
        let bytes = Bytes::from(vec![7u8; 1000]);
        for got in concurrent(8, "shared", &runs, &go, Ok(bytes.clone())).await {
            assert_eq!(
                got.unwrap().as_ptr(),
                bytes.as_ptr(),
                "one copy for every caller"
            );
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        // Nobody holds the bytes any more: the next call fetches again.
        go.notify_one();
        single_flight(key("shared"), counted(&runs, &go, Ok(bytes.clone())))
            .await
            .unwrap();
        assert_eq!(runs.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_failure_is_shared_by_its_waiters_and_not_kept() {
        let (runs, go) = (Arc::new(AtomicUsize::new(0)), Arc::new(Notify::new()));
        let mismatch = TransportError::ChecksumMismatch {
            name: "w".into(),
            expected: "a".into(),
            actual: "b".into(),
        };
        for got in concurrent(4, "failing", &runs, &go, Err(mismatch.clone())).await {
            assert_eq!(got.unwrap_err(), mismatch);
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        go.notify_one();
        let held = Bytes::from_static(b"ok");
        let got = single_flight(key("failing"), counted(&runs, &go, Ok(held.clone())))
            .await
            .unwrap();
        assert_eq!((got, runs.load(Ordering::SeqCst)), (held, 2));
    }
}
