//! Weight swaps against a real nats-server: a rollout that spans a swap has
//! versions [v, …, v, v+1, …, v+1] and its later log-probs are the new
//! weights'; a checksum mismatch or a missing object keeps the old weights,
//! is counted and retried.

mod common;

use std::time::Duration;

use asyncrl_protos::WeightAnnouncement;
use asyncrl_protos::subjects::{WEIGHTS_BUCKET, weights_object_name};
use asyncrl_rollout_worker::metrics::WEIGHT_FAILURE_REASONS;
use asyncrl_rollout_worker::scripted::{ScriptOptions, ScriptedTask, announce, read_trajectories};
use asyncrl_rollout_worker::{CancellationToken, WorkerMetrics};
use asyncrl_tasks::BuiltinTask;
use asyncrl_transport::sha256_hex;
use common::*;

/// Announces `bytes` as `version` with a checksum that is not theirs.
async fn announce_with_a_wrong_checksum(
    bus: &std::sync::Arc<dyn asyncrl_transport::Bus>,
    version: i32,
    bytes: bytes::Bytes,
) -> WeightAnnouncement {
    store_and_announce(bus, version, bytes, sha256_hex(b"something else")).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_spanning_a_swap_switches_version_and_weights_mid_sequence() {
    const G: u32 = 4;
    let rig = Rig::nats(
        model_section(40, 96),
        4,
        ScriptedTask::generated(BuiltinTask::Reverse, 1, 3),
        ScriptOptions {
            group_size: G,
            admission_version: 5,
            ..ScriptOptions::default()
        },
    )
    .await;
    let Rig {
        bus, coordinator, ..
    } = &rig;
    let (p5, p6) = (rig.policy(100), rig.policy(200));
    rig.publish(5, &p5).await;
    let shutdown = CancellationToken::new();
    let ThrottledWorker {
        model,
        throttle,
        handles,
        task: worker,
    } = rig
        .start_throttled(Duration::from_millis(3), &shutdown)
        .await;

    // Let the G sequences sample a token or two with version 5, then hold
    // the model between two steps while version 6 is announced and fetched.
    assert!(
        eventually(Duration::from_secs(30), || model.stats().tokens_generated
            >= u64::from(G))
        .await,
        "generation did not start"
    );
    throttle.freeze().await;
    let before = model.stats();
    assert!(
        before.in_flight >= 1,
        "nothing in flight to swap under: {before:?}"
    );
    assert_eq!(before.version, 5);
    rig.publish(6, &p6).await;
    assert!(
        eventually(Duration::from_secs(10), || handles
            .weights_fetched_version
            .get()
            == 6)
        .await,
        "the worker did not fetch version 6"
    );
    // The swap is queued on the model thread; let it run.
    tokio::time::sleep(Duration::from_millis(50)).await;
    throttle.thaw();

    let (done, log) = coordinator
        .wait_for(Duration::from_secs(60), |l| l.completed_leases().len() == 1)
        .await;
    assert!(done, "{log:#?}");
    shutdown.cancel();
    let summary = worker.await.unwrap().unwrap();
    throttle.stop().await;

    let received = read_trajectories(bus.as_ref(), "swap", G as usize, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(received.len(), G as usize);
    let mut spanning = 0;
    for r in &received {
        let t = &r.trajectory;
        let n = t.completion_token_ids.len();
        // Versions: a run of 5s, then a run of 6s.
        let k = t.policy_versions.iter().position(|&v| v == 6).unwrap_or(n);
        assert!(
            t.policy_versions[..k].iter().all(|&v| v == 5)
                && t.policy_versions[k..].iter().all(|&v| v == 6),
            "{:?}",
            t.policy_versions
        );
        let lp5 = recompute(&p5, &t.prompt_token_ids, &t.completion_token_ids);
        let lp6 = recompute(&p6, &t.prompt_token_ids, &t.completion_token_ids);
        let b = &t.behaviour_logprobs;
        let d5 = max_abs_diff(&b[..k], &lp5[..k]);
        let d6 = max_abs_diff(&b[k..], &lp6[k..]);
        assert!(d5 <= 1e-4, "tokens before the swap: {d5}");
        assert!(d6 <= 1e-4, "tokens after the swap: {d6}");
        if k < n {
            spanning += 1;
            // The later tokens are really the new weights', not the old.
            assert!(max_abs_diff(&b[k..], &lp5[k..]) > 1e-3);
            assert_eq!(t.timings.as_ref().unwrap().weight_swaps, 1);
        }
    }
    assert!(spanning >= 1, "no rollout spanned the swap");
    assert!(model.stats().recomputed_sequences >= 1);
    assert_eq!(summary.weight_swaps, 2);
    assert_eq!(summary.final_version, Some(6));
    assert_eq!(handles.policy_version.get(), 6);
    assert!(
        log.heartbeats
            .iter()
            .any(|(_, h)| h.policy_version == 6 && h.weight_swap_latency_ms > 0.0),
        "heartbeats report the new version and the swap latency"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_checksum_or_missing_object_keeps_the_old_weights_and_is_retried() {
    const G: u32 = 2;
    let rig = Rig::nats(
        model_section(12, 48),
        4,
        Vec::new(),
        ScriptOptions {
            group_size: G,
            ..ScriptOptions::default()
        },
    )
    .await;
    let Rig {
        bus, coordinator, ..
    } = &rig;
    let (p5, p6, p7) = (rig.policy(100), rig.policy(200), rig.policy(300));
    rig.publish(5, &p5).await;
    let RunningWorker {
        handles,
        shutdown,
        task: worker,
    } = start_worker_at(rig.config.clone(), bus, 5).await;

    // Version 6: the object is there, but the announced checksum is not its.
    let mut bad = announce_with_a_wrong_checksum(bus, 6, weights(&p6)).await;
    let store = bus.object_store(WEIGHTS_BUCKET).await.unwrap();
    assert!(
        eventually(Duration::from_secs(10), || failures(
            &handles.weight_fetch_failures,
            "checksum"
        ) >= 3)
        .await,
        "checksum failures are counted and retried"
    );
    assert_eq!(handles.policy_version.get(), 5, "old weights kept");

    // Generation goes on with version 5, and its log-probs are version 5's.
    coordinator.push_tasks(ScriptedTask::generated(BuiltinTask::Arith, 1, 1));
    let (done, _) = coordinator
        .wait_for(Duration::from_secs(30), |l| l.completed_leases().len() == 1)
        .await;
    assert!(done);
    let first = read_trajectories(bus.as_ref(), "bad-sha", G as usize, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(first.len(), G as usize);
    for r in &first {
        let t = &r.trajectory;
        assert!(t.policy_versions.iter().all(|&v| v == 5));
        let lp = recompute(&p5, &t.prompt_token_ids, &t.completion_token_ids);
        assert!(max_abs_diff(&lp, &t.behaviour_logprobs) <= 1e-4);
    }

    // Version 7 is announced before its object exists: counted as not
    // found, retried with backoff, and loaded once the object appears
    // (without a new announcement).
    let good7 = weights(&p7);
    bad.version = 7;
    bad.object_name = weights_object_name(7);
    bad.sha256 = sha256_hex(&good7);
    bad.byte_size = good7.len() as u64;
    announce(bus.as_ref(), &bad).await.unwrap();
    assert!(
        eventually(Duration::from_secs(10), || failures(
            &handles.weight_fetch_failures,
            "not_found"
        ) >= 2)
        .await,
        "missing objects are counted and retried"
    );
    assert_eq!(handles.policy_version.get(), 5);
    store.put(&weights_object_name(7), good7).await.unwrap();
    assert!(
        eventually(Duration::from_secs(10), || handles.policy_version.get()
            == 7)
        .await,
        "version 7 loaded once its object is there"
    );

    coordinator.push_tasks(ScriptedTask::generated(BuiltinTask::Arith, 1, 2));
    let (done, _) = coordinator
        .wait_for(Duration::from_secs(30), |l| l.completed_leases().len() == 2)
        .await;
    assert!(done);
    shutdown.cancel();
    let summary = worker.await.unwrap().unwrap();
    let second = read_trajectories(bus.as_ref(), "bad-sha", G as usize, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(second.len(), G as usize);
    for r in &second {
        let t = &r.trajectory;
        assert!(t.policy_versions.iter().all(|&v| v == 7));
        let lp = recompute(&p7, &t.prompt_token_ids, &t.completion_token_ids);
        assert!(max_abs_diff(&lp, &t.behaviour_logprobs) <= 1e-4);
    }
    assert_eq!(summary.weight_swaps, 2, "5 and 7; never the bad 6");
    assert_eq!(summary.final_version, Some(7));
    let total = WorkerMetrics::family_total(&handles.weight_fetch_failures, WEIGHT_FAILURE_REASONS);
    assert_eq!(summary.weight_fetch_failures, total);
    assert!(total >= 5);
}

/// A task admitted at a version newer than the weights in use (the
/// coordinator saw the announcement first) is not sampled with the older
/// weights: the staleness bound counts from the admission version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_admitted_at_a_newer_version_waits_for_its_weights() {
    const G: u32 = 2;
    let rig = Rig::nats(
        model_section(8, 48),
        4,
        Vec::new(),
        ScriptOptions {
            group_size: G,
            admission_version: 6,
            ..ScriptOptions::default()
        },
    )
    .await;
    let Rig {
        bus, coordinator, ..
    } = &rig;
    let (p5, p6) = (rig.policy(100), rig.policy(200));
    rig.publish(5, &p5).await;
    let RunningWorker {
        handles,
        shutdown,
        task: worker,
    } = start_worker_at(rig.config.clone(), bus, 5).await;
    coordinator.push_tasks(ScriptedTask::generated(BuiltinTask::Arith, 2, 1));
    let (granted, log) = coordinator
        .wait_for(Duration::from_secs(10), |l| l.granted_leases().len() == 2)
        .await;
    assert!(granted, "{log:#?}");
    // Granted at version 6 while version 5 is in use: nothing is sampled.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(handles.tokens_generated.get(), 0);
    assert!(coordinator.log().completed_leases().is_empty());

    rig.publish(6, &p6).await;
    let (done, log) = coordinator
        .wait_for(Duration::from_secs(30), |l| l.completed_leases().len() == 2)
        .await;
    assert!(done, "{log:#?}");
    shutdown.cancel();
    worker.await.unwrap().unwrap();
    let received = read_trajectories(
        bus.as_ref(),
        "admission",
        2 * G as usize,
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    assert_eq!(received.len(), 2 * G as usize);
    for r in &received {
        let t = &r.trajectory;
        assert_eq!(t.admission_version, 6);
        assert!(
            t.policy_versions.iter().all(|&v| v >= 6),
            "a token older than the admission version: {:?}",
            t.policy_versions
        );
    }
}

/// Workers of one process, each on its own connection, share each weight
/// fetch: all of them swap in the announced version, a checksum mismatch is
/// every worker's (counted, old weights kept), and a failure is not kept:
/// a version announced before its object exists is loaded by every worker
/// once the object appears.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_of_one_process_share_fetches_and_each_checks_them() {
    const WORKERS: usize = 3;
    let rig = Rig::nats(
        model_section(12, 48),
        4,
        Vec::new(),
        ScriptOptions {
            group_size: 2,
            ..ScriptOptions::default()
        },
    )
    .await;
    let (bus, nats) = (&rig.bus, rig.nats.as_ref().expect("nats"));
    let (p5, p6, p7) = (rig.policy(100), rig.policy(200), rig.policy(300));
    rig.publish(5, &p5).await;
    let mut workers = Vec::new();
    for i in 0..WORKERS {
        let mut config = rig.config.clone();
        config.worker.id = Some(format!("worker-shared-{i}"));
        let own: std::sync::Arc<dyn asyncrl_transport::Bus> = std::sync::Arc::new(
            asyncrl_transport::NatsBus::connect(
                &nats.config,
                asyncrl_transport::TransportMetrics::new(),
            )
            .await
            .unwrap(),
        );
        workers.push(start_worker_at(config, &own, 5).await);
    }

    // Version 6 announced with a checksum that is not its object's.
    let mut ann = announce_with_a_wrong_checksum(bus, 6, weights(&p6)).await;
    let store = bus.object_store(WEIGHTS_BUCKET).await.unwrap();
    for w in &workers {
        assert!(
            eventually(Duration::from_secs(20), || failures(
                &w.handles.weight_fetch_failures,
                "checksum"
            ) >= 2)
            .await,
            "every worker counts the mismatch"
        );
        assert_eq!(w.handles.policy_version.get(), 5, "old weights kept");
    }

    // Version 7 announced before its object exists, then stored.
    let good7 = weights(&p7);
    ann.version = 7;
    ann.object_name = weights_object_name(7);
    ann.sha256 = sha256_hex(&good7);
    ann.byte_size = good7.len() as u64;
    announce(bus.as_ref(), &ann).await.unwrap();
    for w in &workers {
        assert!(
            eventually(Duration::from_secs(20), || failures(
                &w.handles.weight_fetch_failures,
                "not_found"
            ) >= 1)
            .await,
            "every worker counts the missing object"
        );
    }
    store
        .put(&weights_object_name(7), good7.clone())
        .await
        .unwrap();
    for w in &workers {
        assert!(
            eventually(Duration::from_secs(30), || w.handles.policy_version.get()
                == 7)
            .await,
            "every worker loads version 7 once its object is there"
        );
    }
    for w in workers {
        w.shutdown.cancel();
        let summary = w.task.await.unwrap().unwrap();
        assert_eq!(summary.final_version, Some(7));
    }
}

/// The `shared_path` transport: a version announced as a folder (here
/// sharded, with its index) loads only while every file matches its
/// announced sha256; an altered shard keeps the old weights, is counted and
/// retried, and the repaired folder loads, its shards as one model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_folder_loads_only_intact_and_its_shards_as_one_model() {
    const G: u32 = 2;
    let rig = Rig::nats(
        model_section(12, 48),
        4,
        Vec::new(),
        ScriptOptions {
            group_size: G,
            ..ScriptOptions::default()
        },
    )
    .await;
    let Rig {
        bus, coordinator, ..
    } = &rig;
    let (p5, p6) = (rig.policy(100), rig.policy(200));
    rig.publish(5, &p5).await;
    let RunningWorker {
        handles,
        shutdown,
        task: worker,
    } = start_worker_at(rig.config.clone(), bus, 5).await;

    // Version 6 as the learner writes it: a folder, sharded (small shards).
    let root = tempfile::tempdir().unwrap();
    let dir = root
        .path()
        .join(asyncrl_protos::subjects::weights_folder_name(6));
    p6.save_pretrained(&dir, Some(4096)).unwrap();
    let mut sums = serde_json::Map::new();
    let mut shards: Vec<std::path::PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    shards.sort();
    assert!(shards.len() >= 2, "the folder is sharded: {shards:?}");
    for shard in &shards {
        sums.insert(
            shard.file_name().unwrap().to_string_lossy().into_owned(),
            serde_json::Value::String(sha256_hex(&std::fs::read(shard).unwrap())),
        );
    }
    std::fs::write(
        dir.join(asyncrl_control::weights::FOLDER_SHA256_FILE),
        serde_json::Value::Object(sums).to_string(),
    )
    .unwrap();
    let kv = bus
        .kv(asyncrl_protos::subjects::CONTROL_BUCKET)
        .await
        .unwrap();
    // A shard altered after sha256.json was written (same size), then
    // announced: refused, counted, retried.
    let intact = std::fs::read(&shards[0]).unwrap();
    let mut altered = intact.clone();
    let last = altered.len() - 1;
    altered[last] ^= 0xff;
    std::fs::write(&shards[0], &altered).unwrap();
    let ann = asyncrl_control::weights::publish_folder(
        kv.as_ref(),
        6,
        6,
        &dir,
        &asyncrl_control::weights::Fence::default(),
    )
    .await
    .unwrap();
    assert_eq!(ann.files.len(), shards.len());
    assert!(
        eventually(Duration::from_secs(10), || failures(
            &handles.weight_fetch_failures,
            "checksum"
        ) >= 2)
        .await,
        "an altered shard is counted and retried: version {}, failures {:?}",
        handles.policy_version.get(),
        WEIGHT_FAILURE_REASONS
            .iter()
            .map(|r| (*r, failures(&handles.weight_fetch_failures, r)))
            .collect::<Vec<_>>()
    );
    assert_eq!(handles.policy_version.get(), 5, "old weights kept");

    // Repaired: version 6 loads without a new announcement.
    std::fs::write(&shards[0], &intact).unwrap();
    assert!(
        eventually(Duration::from_secs(10), || handles.policy_version.get()
            == 6)
        .await,
        "version 6 loaded once its folder is intact"
    );
    coordinator.push_tasks(ScriptedTask::generated(BuiltinTask::Arith, 1, 1));
    let (done, _) = coordinator
        .wait_for(Duration::from_secs(30), |l| l.completed_leases().len() == 1)
        .await;
    assert!(done);
    shutdown.cancel();
    worker.await.unwrap().unwrap();
    let got = read_trajectories(bus.as_ref(), "folder", G as usize, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(got.len(), G as usize);
    for r in &got {
        let t = &r.trajectory;
        assert!(t.policy_versions.iter().all(|&v| v == 6));
        // Sampled with the folder's weights, all shards of them.
        let lp = recompute(&p6, &t.prompt_token_ids, &t.completion_token_ids);
        assert!(max_abs_diff(&lp, &t.behaviour_logprobs) <= 1e-4);
    }
}
