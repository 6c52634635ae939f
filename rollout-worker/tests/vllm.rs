//! The worker's vLLM engine against real vLLM CPU servers (from
//! `.venv-vllm`, installed by `scripts/setup --vllm`): token-exact generation,
//! exact per-token versions across weight swaps, a kill -9 of the server
//! mid-run, and one-line errors for every misconfiguration. Tests that only
//! attach share one server (`common::vllm::shared`); the others launch
//! their own through `worker.engine.launch`. The tests of this file run one
//! at a time (nextest test group `vllm`, and a lock for `cargo test`).

mod common;

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use asyncrl_config::{Config, EngineApi, EngineConfig, EngineKind, ModelConfig, PauseMode};
use asyncrl_policy::{ModelText, Policy};
use asyncrl_rollout_worker::scripted::{
    Received, ScriptOptions, ScriptedCoordinator, ScriptedTask, publish_weights, read_trajectories,
};
use asyncrl_rollout_worker::{CancellationToken, WorkerError, WorkerMetrics, WorkerSummary, run};
use asyncrl_tasks::BuiltinTask;
use asyncrl_telemetry::Metrics;
use common::vllm::{self as server, START_LIMIT};
use common::*;

const G: u32 = 4;
const MAX_NEW: usize = 40;
const MAX_SEQ: usize = 64;

/// One test of this file at a time (`cargo test` runs them on threads).
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn section(path: &Path) -> ModelConfig {
    let mut s = arch();
    // vLLM's processed log-probs are renormalized over the top-p nucleus.
    s.top_p = 1.0;
    s.path = Some(path.to_path_buf());
    s
}

fn engine(endpoint: &str, launch: Vec<String>, weights_dir: &Path) -> EngineConfig {
    EngineConfig {
        kind: EngineKind::Vllm,
        endpoints: vec![endpoint.to_owned()],
        launch,
        weights_dir: weights_dir.to_path_buf(),
        ready_timeout: START_LIMIT,
        request_timeout: Duration::from_secs(120),
        control_timeout: Duration::from_secs(120),
        ..EngineConfig::default()
    }
}

fn vllm_config(nats: &Nats, model: &Path, engine_section: EngineConfig, slots: usize) -> Config {
    let mut c = config(nats.config.clone(), section(model), G, slots);
    c.worker.engine = engine_section;
    c.worker.drain_grace_period = Duration::from_secs(30);
    c.validate().expect("valid vLLM test config");
    c
}

/// The architecture every test model has (the shared server serves seed
/// 1): head_dim 32, as vLLM's CPU attention has no kernel for 16.
fn arch() -> ModelConfig {
    let mut m = model_section(MAX_NEW, MAX_SEQ);
    m.tiny.hidden_size = 64;
    m.tiny.num_attention_heads = 2;
    m.tiny.num_key_value_heads = 1;
    m.tiny.intermediate_size = 128;
    m
}

async fn scripted(nats: &Nats, tasks: Vec<ScriptedTask>, admission: i32) -> ScriptedCoordinator {
    coordinator(
        &nats.bus,
        tasks,
        ScriptOptions {
            group_size: G,
            admission_version: admission,
            max_per_acquire: 2,
            heartbeat_interval_ms: 100,
            requeue_returned: true,
            ..ScriptOptions::default()
        },
    )
    .await
}

/// Every token's log-prob equals the learner's recompute under the weights
/// of the token's own version (with `first_version_only`, only the tokens
/// of each trajectory's first version: `keep` mode continues a sequence
/// on new weights with the KV cache of the old ones, which no recompute
/// reproduces); returns the largest difference.
fn check_exact(
    received: &[Received],
    policies: &HashMap<i32, Policy>,
    admission: i32,
    first_version_only: bool,
) -> f32 {
    let mut worst = 0f32;
    for r in received {
        let t = &r.trajectory;
        assert!(
            t.policy_versions.windows(2).all(|w| w[0] <= w[1]),
            "versions go backwards: {:?}",
            t.policy_versions
        );
        assert!(
            t.policy_versions.iter().all(|&v| v >= admission),
            "a token is older than the admission version {admission}: {:?}",
            t.policy_versions
        );
        for (&v, p) in policies {
            if !t.policy_versions.contains(&v)
                || (first_version_only && t.policy_versions.first() != Some(&v))
            {
                continue;
            }
            let lp = recompute(p, &t.prompt_token_ids, &t.completion_token_ids);
            for (i, (&ver, (&ours, &theirs))) in t
                .policy_versions
                .iter()
                .zip(lp.iter().zip(&t.behaviour_logprobs))
                .enumerate()
            {
                if ver == v {
                    let d = (ours - theirs).abs();
                    assert!(
                        d <= 1e-4,
                        "token {i} (version {v}) of {}: learner {ours} vs vLLM {theirs}",
                        t.uuid
                    );
                    worst = worst.max(d);
                }
            }
        }
        assert!(
            t.policy_versions.iter().all(|v| policies.contains_key(v)),
            "unknown version in {:?}",
            t.policy_versions
        );
    }
    worst
}

/// Trajectories of completed leases: G each, distinct uuids.
fn check_groups(received: &[Received], completed: &BTreeSet<String>) {
    let mut uuids = BTreeSet::new();
    let mut per_lease: HashMap<&str, usize> = HashMap::new();
    for r in received {
        assert!(uuids.insert(r.trajectory.uuid.clone()), "duplicate uuid");
        *per_lease.entry(r.trajectory.group_id.as_str()).or_default() += 1;
    }
    for lease in completed {
        assert_eq!(
            per_lease.get(lease.as_str()).copied().unwrap_or(0),
            G as usize,
            "{lease} completed with another number of trajectories"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_generation_is_token_exact_across_weight_swaps() {
    swaps(PauseMode::Abort).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_keep_mode_continues_sequences_with_exact_versions() {
    swaps(PauseMode::Keep).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_completions_fallback_is_token_exact_across_weight_swaps() {
    swaps_on(PauseMode::Abort, EngineApi::Completions).await;
}

/// Versions 1, 2, 3 announced while 8 sequences are in flight, through the
/// shared server in `mode`.
async fn swaps(mode: PauseMode) {
    swaps_on(mode, EngineApi::Generate).await;
}

async fn swaps_on(mode: PauseMode, api: EngineApi) {
    let _one = ONE_AT_A_TIME.lock().await;
    let (model, url) = tokio::task::spawn_blocking(|| server::shared(&arch(), policy))
        .await
        .unwrap();
    let nats = nats().await;
    let weights_dir = tempfile::tempdir().unwrap();
    let tasks = ScriptedTask::generated(BuiltinTask::Arith, 40, 3);
    let coordinator = scripted(&nats, tasks.clone(), 1).await;
    let mut e = engine(&url, vec![], weights_dir.path());
    e.pause_mode = mode;
    e.api = api;
    let config = vllm_config(&nats, &model, e, 8);
    let metrics = Metrics::new();
    let shutdown = CancellationToken::new();
    let worker = tokio::spawn(run(
        config,
        nats.bus.clone(),
        metrics.clone(),
        shutdown.clone(),
    ));

    // Versions 1, 2, 3 of the learner, each announced while sequences run.
    let mut policies = HashMap::new();
    for (version, after) in [(1, 0usize), (2, 8), (3, 16)] {
        let (ok, log) = coordinator
            .wait_for(Duration::from_secs(300), |l| {
                l.completed_leases().len() >= after
            })
            .await;
        assert!(ok, "{after} tasks did not complete: {log:#?}");
        let p = policy(&arch(), 100 + version as u64);
        publish_weights(nats.bus.as_ref(), version, weights(&p))
            .await
            .unwrap();
        policies.insert(version, p);
    }
    let (ok, log) = coordinator
        .wait_for(Duration::from_secs(300), |l| {
            l.completed_leases().len() >= tasks.len()
        })
        .await;
    assert!(ok, "not every task completed: {log:#?}");
    shutdown.cancel();
    let summary: WorkerSummary = worker.await.unwrap().expect("worker");
    assert!(summary.drained_cleanly, "{summary:?}");
    assert_eq!(summary.final_version, Some(3));

    let received = read_trajectories(
        nats.bus.as_ref(),
        "vllm-exact",
        1000,
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    let completed: BTreeSet<String> = log.completed_leases().into_iter().collect();
    check_groups(&received, &completed);
    let keep = mode == PauseMode::Keep;
    let worst = check_exact(&received, &policies, 1, keep);
    let mixed = received
        .iter()
        .filter(|r| {
            let v = &r.trajectory.policy_versions;
            v.first() != v.last()
        })
        .count();
    let m = WorkerMetrics::new(&metrics).unwrap();
    eprintln!(
        "{mode:?} through {api:?}: {} trajectories, {mixed} spanning a weight swap, {} resubmissions; largest |learner - vLLM| log-prob difference {worst:e}",
        received.len(),
        m.engine_resubmissions.get()
    );
    if keep {
        // Frozen, not aborted: nothing is resubmitted.
        assert_eq!(m.engine_resubmissions.get(), 0);
    }
    assert!(
        mixed > 0,
        "no trajectory spans a weight swap: the swaps came between sequences (the check could not fail)"
    );
    assert!(
        worst > 0.0
            || received
                .iter()
                .all(|r| r.trajectory.completion_token_ids.is_empty())
    );
    // The per-version folders of old versions are gone.
    let left: Vec<PathBuf> = std::fs::read_dir(weights_dir.path().join("worker-test"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert_eq!(left.len(), 1, "{left:?}");
    assert!(left[0].ends_with("v3"), "{left:?}");
}

/// A copy of `model` whose tokenizer swaps the ids of "1" and "2".
fn other_tokenizer(model: &Path, into: &Path) {
    std::fs::create_dir_all(into).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer_config.json"] {
        if model.join(f).is_file() {
            std::fs::copy(model.join(f), into.join(f)).unwrap();
        }
    }
    let mut tok: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("tokenizer.json")).unwrap())
            .unwrap();
    let vocab = tok["model"]["vocab"].as_object_mut().unwrap();
    let one = vocab["1"].clone();
    let two = vocab["2"].clone();
    vocab.insert("1".into(), two);
    vocab.insert("2".into(), one);
    std::fs::write(into.join("tokenizer.json"), tok.to_string()).unwrap();
}

/// A model folder in `dir` and the launch command of a server of the
/// worker's own for it on a free port (its pid goes to `dir/pid`).
fn own_server(dir: &Path, logprobs_mode: &str) -> (PathBuf, u16, Vec<String>) {
    let model = dir.join("model");
    policy(&arch(), 1).save_pretrained(&model, None).unwrap();
    let port = asyncrl_testkit::free_port().unwrap();
    let launch = server::launch_command(&model, port, logprobs_mode, &dir.join("pid"));
    (model, port, launch)
}

async fn start_err(config: Config, nats: &Nats) -> String {
    let r = tokio::time::timeout(
        Duration::from_secs(600),
        run(
            config,
            nats.bus.clone(),
            Metrics::new(),
            CancellationToken::new(),
        ),
    )
    .await
    .expect("the worker hung instead of refusing to start");
    match r {
        Err(e) => {
            let line = asyncrl_common::process::one_line(&anyhow::Error::from(e));
            eprintln!("refused: {line}");
            assert!(!line.contains('\n'), "not one line: {line}");
            line
        }
        Ok(s) => panic!("the worker ran: {s:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_refuses_a_server_that_tokenizes_differently() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (model, url) = tokio::task::spawn_blocking(|| server::shared(&arch(), policy))
        .await
        .unwrap();
    let nats = nats().await;
    let dir = tempfile::tempdir().unwrap();
    let other = dir.path().join("other");
    other_tokenizer(&model, &other);
    let config = vllm_config(&nats, &other, engine(&url, vec![], dir.path()), 4);
    let line = start_err(config, &nats).await;
    assert!(
        line.contains("`model.path`") && line.contains("tokenizes"),
        "{line}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_refuses_raw_logprobs() {
    let _one = ONE_AT_A_TIME.lock().await;
    let nats = nats().await;
    let dir = tempfile::tempdir().unwrap();
    let (model, port, launch) = own_server(dir.path(), "raw_logprobs");
    let config = vllm_config(
        &nats,
        &model,
        engine(&format!("http://127.0.0.1:{port}"), launch, dir.path()),
        4,
    );
    let line = start_err(config, &nats).await;
    assert!(
        line.contains("raw_logprobs") && line.contains("--logprobs-mode processed_logprobs"),
        "{line}"
    );
    // The worker stopped the server it launched.
    assert!(!server::healthy(&format!("http://127.0.0.1:{port}")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_refuses_weights_of_another_architecture() {
    let _one = ONE_AT_A_TIME.lock().await;
    let nats = nats().await;
    let dir = tempfile::tempdir().unwrap();
    let (model, port, launch) = own_server(dir.path(), "processed_logprobs");
    let coordinator = scripted(&nats, ScriptedTask::generated(BuiltinTask::Arith, 4, 1), 0).await;
    let config = vllm_config(
        &nats,
        &model,
        engine(&format!("http://127.0.0.1:{port}"), launch, dir.path()),
        4,
    );
    let worker = tokio::spawn(run(
        config,
        nats.bus.clone(),
        Metrics::new(),
        CancellationToken::new(),
    ));
    // The learner trains a wider model than the engine serves.
    let mut wide = arch();
    wide.tiny.hidden_size = 128;
    wide.tiny.num_attention_heads = 4;
    wide.tiny.num_key_value_heads = 2;
    wide.tiny.intermediate_size = 256;
    publish_weights(nats.bus.as_ref(), 1, weights(&policy(&wide, 7)))
        .await
        .unwrap();
    let r = tokio::time::timeout(Duration::from_secs(600), worker)
        .await
        .expect("the worker hung on weights its engine cannot load")
        .unwrap();
    let err = r.expect_err("the worker ran with weights its engine cannot load");
    assert!(matches!(err, WorkerError::Stopped(_)), "{err}");
    let line = err.to_string();
    assert!(
        line.contains("`model.path`") && line.contains("cannot load the learner's weights"),
        "{line}"
    );
    assert!(!line.contains('\n'), "{line}");
    assert!(coordinator.log().acquires.is_empty(), "it acquired tasks");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_kill_9_mid_run_loses_nothing() {
    let _one = ONE_AT_A_TIME.lock().await;
    let nats = nats().await;
    let dir = tempfile::tempdir().unwrap();
    let (model, port, launch) = own_server(dir.path(), "processed_logprobs");
    let pid_file = dir.path().join("pid");
    let tasks = ScriptedTask::generated(BuiltinTask::Arith, 24, 5);
    let coordinator = scripted(&nats, tasks.clone(), 1).await;
    let config = vllm_config(
        &nats,
        &model,
        engine(&format!("http://127.0.0.1:{port}"), launch, dir.path()),
        8,
    );
    let metrics = Metrics::new();
    let shutdown = CancellationToken::new();
    let worker = tokio::spawn(run(
        config,
        nats.bus.clone(),
        metrics.clone(),
        shutdown.clone(),
    ));
    let p1 = policy(&arch(), 101);
    publish_weights(nats.bus.as_ref(), 1, weights(&p1))
        .await
        .unwrap();
    let (ok, log) = coordinator
        .wait_for(START_LIMIT + Duration::from_secs(120), |l| {
            l.completed_leases().len() >= 4
        })
        .await;
    assert!(ok, "no tasks completed before the kill: {log:#?}");
    let first_pid: i32 = server::read_pid(&pid_file);
    // The server leads its process group (the launch command execs it).
    let before = server::group_members(first_pid);
    // SAFETY: kills the vLLM server this test's worker launched (its main
    // process only, as kill -9 or the OOM killer do).
    assert_eq!(unsafe { libc::kill(first_pid, libc::SIGKILL) }, 0);
    eprintln!(
        "the server's group before the kill: {before:?}; right after it: {:?}",
        server::group_members(first_pid)
    );
    let (ok, log) = coordinator
        .wait_for(START_LIMIT + Duration::from_secs(240), |l| {
            let done: BTreeSet<String> = l
                .completions
                .iter()
                .filter(|c| c.accepted)
                .map(|c| c.request.task_id.clone())
                .collect();
            done.len() == tasks.len()
        })
        .await;
    assert!(ok, "the run did not complete after the kill: {log:#?}");
    // The restart ended the killed server's whole group (vLLM's engine-core
    // and worker processes outlive its main process otherwise).
    assert!(
        asyncrl_testkit::wait_until(Duration::from_secs(30), || server::group_members(first_pid)
            .is_empty())
        .await,
        "the killed server's group outlived the restart: {:?}",
        server::group_members(first_pid)
    );
    shutdown.cancel();
    let summary = worker.await.unwrap().expect("worker");
    let second_pid: i32 = server::read_pid(&pid_file);
    assert_ne!(first_pid, second_pid, "the server was not restarted");
    assert!(
        asyncrl_testkit::wait_until(Duration::from_secs(30), || server::group_members(
            second_pid
        )
        .is_empty())
        .await,
        "the restarted server's group outlived the worker's stop: {:?}",
        server::group_members(second_pid)
    );
    let m = WorkerMetrics::new(&metrics).unwrap();
    assert!(m.engine_recoveries.get() >= 1);
    assert!(
        !log.returned_leases().is_empty(),
        "no task was in flight at the kill (the check could not fail)"
    );
    // Each task completed exactly once; every completed lease has its G
    // trajectories, and none is published twice.
    let mut per_task: HashMap<&str, usize> = HashMap::new();
    for c in log.completions.iter().filter(|c| c.accepted) {
        *per_task.entry(c.request.task_id.as_str()).or_default() += 1;
    }
    assert!(per_task.values().all(|&n| n == 1), "{per_task:?}");
    let received = read_trajectories(nats.bus.as_ref(), "vllm-kill", 1000, Duration::from_secs(5))
        .await
        .unwrap();
    let completed: BTreeSet<String> = log.completed_leases().into_iter().collect();
    check_groups(&received, &completed);
    let policies = HashMap::from([(1, p1)]);
    check_exact(&received, &policies, 1, false);
    eprintln!("{summary:?}");
    // The worker stopped the server it launched.
    assert!(!server::healthy(&format!("http://127.0.0.1:{port}")));
}

/// The shared server's watchdog (`common::vllm::spawn_watched`), with `sh`
/// and its child standing in for the server and a 1 s idle limit: the
/// group lives while a process holds the users lock, and ends, watchdog
/// included, once none does; its url file goes first.
#[test]
fn a_watched_server_ends_once_no_test_process_uses_it() {
    let dir = tempfile::tempdir().unwrap();
    let (users, start_lock, url) = (
        dir.path().join("users"),
        dir.path().join("lock"),
        dir.path().join("url"),
    );
    std::fs::write(&url, "http://127.0.0.1:1").unwrap();
    let held = server::hold_shared(&users);
    let mut cmd = std::process::Command::new("sh");
    cmd.args(["-c", "sleep 600 & wait"]);
    let watched = server::Watched {
        users: &users,
        start_lock: &start_lock,
        url: &url,
    };
    let pgid = server::spawn_watched(cmd, &watched, Duration::from_secs(1));
    let members = |n: usize| {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while server::group_members(pgid).len() != n {
            assert!(
                std::time::Instant::now() < deadline,
                "the group never had {n} members: {:?}",
                server::group_members(pgid)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    // The shell, its child and the watchdog.
    members(3);
    // Three idle limits while in use: nothing ends.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(server::group_members(pgid).len(), 3);
    assert!(url.exists());
    drop(held);
    members(0);
    assert!(!url.exists(), "the ending server's url file is left");
}

/// A stand-in for a broken engine (the one fake here: vLLM cannot be made
/// to send malformed JSON): it passes the start-up checks, accepts weight
/// swaps and answers every generation with a body that is not JSON.
mod fake {
    use super::*;
    use axum::Router;
    use axum::routing::{get, post};

    pub async fn start(text: &ModelText, openapi_ok: bool) -> String {
        let tokens = text
            .tokenizer()
            .encode("12+7=19 hello, world", true)
            .unwrap();
        let routes = [
            "/pause",
            "/resume",
            "/collective_rpc",
            "/update_weight_version",
            "/reset_prefix_cache",
            "/server_info",
            "/inference/v1/generate",
        ];
        let paths: serde_json::Map<String, serde_json::Value> = routes
            .iter()
            .map(|r| ((*r).to_owned(), serde_json::json!({})))
            .collect();
        let openapi = if openapi_ok {
            serde_json::json!({ "paths": paths }).to_string()
        } else {
            "{\"paths\": [unterminated".to_owned()
        };
        let tokenized = serde_json::json!({ "tokens": tokens }).to_string();
        let app = Router::new()
            .route("/health", get(|| async { "" }))
            .route("/openapi.json", get(move || async move { openapi }))
            .route(
                "/server_info",
                get(|| async {
                    r#"{"vllm_config":{"model_config":{"logprobs_mode":"processed_logprobs","max_model_len":256}}}"#
                }),
            )
            .route("/v1/models", get(|| async { r#"{"data":[{"id":"fake"}]}"# }))
            .route("/tokenize", post(move || async move { tokenized }))
            .route("/pause", post(|| async { "{}" }))
            .route("/resume", post(|| async { "{}" }))
            .route("/collective_rpc", post(|| async { "{}" }))
            .route("/update_weight_version", post(|| async { "{}" }))
            .route("/reset_prefix_cache", post(|| async { "{}" }))
            .route(
                "/inference/v1/generate",
                post(|| async { "{\"choices\": [{\"token_ids\": [1, 2" }),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        format!("http://{addr}")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_bad_endpoints_get_one_line_errors_and_never_hang_the_worker() {
    let _one = ONE_AT_A_TIME.lock().await;
    let nats = nats().await;
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    policy(&arch(), 1).save_pretrained(&model, None).unwrap();
    let text = ModelText::from_dir(&model).unwrap();

    // Nothing listens.
    let port = asyncrl_testkit::free_port().unwrap();
    let mut e = engine(&format!("http://127.0.0.1:{port}"), vec![], dir.path());
    e.ready_timeout = Duration::from_secs(2);
    let line = start_err(vllm_config(&nats, &model, e, 4), &nats).await;
    assert!(
        line.contains("`worker.engine.endpoints`") && line.contains("/health"),
        "{line}"
    );

    // A launch command that is not there.
    let mut e = engine(
        &format!("http://127.0.0.1:{port}"),
        vec!["/nonexistent/vllm-server".into()],
        dir.path(),
    );
    e.ready_timeout = Duration::from_secs(2);
    let line = start_err(vllm_config(&nats, &model, e, 4), &nats).await;
    assert!(line.contains("`worker.engine.launch`"), "{line}");

    // Malformed JSON at start-up.
    let url = fake::start(&text, false).await;
    let line = start_err(
        vllm_config(&nats, &model, engine(&url, vec![], dir.path()), 4),
        &nats,
    )
    .await;
    assert!(
        line.contains("`worker.engine.endpoints`") && line.contains("malformed"),
        "{line}"
    );

    // Malformed JSON for every generation: tasks go back, the worker lives
    // on and drains cleanly.
    let url = fake::start(&text, true).await;
    let coordinator = scripted(&nats, ScriptedTask::generated(BuiltinTask::Arith, 3, 1), 0).await;
    let metrics = Metrics::new();
    let shutdown = CancellationToken::new();
    let config = vllm_config(&nats, &model, engine(&url, vec![], dir.path()), 4);
    let worker = tokio::spawn(run(
        config,
        nats.bus.clone(),
        metrics.clone(),
        shutdown.clone(),
    ));
    publish_weights(nats.bus.as_ref(), 0, weights(&policy(&arch(), 2)))
        .await
        .unwrap();
    let (ok, log) = coordinator
        .wait_for(Duration::from_secs(60), |l| l.returns.len() >= 3)
        .await;
    assert!(
        ok,
        "tasks whose generation failed were not returned: {log:#?}"
    );
    assert!(
        !worker.is_finished(),
        "the worker stopped on a malformed reply"
    );
    let m = WorkerMetrics::new(&metrics).unwrap();
    assert!(
        WorkerMetrics::family_total(&m.engine_errors, &["malformed"]) >= 3,
        "malformed replies are counted"
    );
    shutdown.cancel();
    let summary = tokio::time::timeout(Duration::from_secs(60), worker)
        .await
        .expect("the drain hung")
        .unwrap()
        .expect("worker");
    assert_eq!(summary.trajectories_published, 0);
    assert!(summary.drained_cleanly, "{summary:?}");
    let _ = Arc::new(());
}
