//! Hostile peers through the real bus: while `asyncrl train` runs every
//! role over a nats-server, a peer with the worker's powers publishes
//! groups the learner cannot train on to the trajectory stream (token ids
//! beyond the vocabulary, versions from the future, rows longer than the
//! context, behaviour log-probs that make the loss non-finite) and a
//! malformed message near the server's payload limit; the data set holds
//! prompts that can never fit the context. The run reaches its step
//! target, nothing hostile is trained, and each input is quarantined and
//! counted: its dead letter names it and its reason.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use asyncrl_config::LongPrompts;
use asyncrl_harness::configs;
use asyncrl_harness::invariants::check_trained_file;
use asyncrl_learner::outputs::TRAINED_JSONL;
use asyncrl_protos::WeightAnnouncement;
use asyncrl_protos::subjects::{
    CONTROL_BUCKET, DEAD_LETTER_PAYLOAD_MAX, DEAD_LETTER_STREAM, POLICY_VERSION_KEY,
    trajectory_subject,
};
use asyncrl_protos::v1::DeadLetter;
use asyncrl_protos::{FinishReason, Message, RewardStatus, Trajectory};
use asyncrl_testkit::NatsServer;
use asyncrl_transport::{Bus, ConsumerSpec, NatsBus, TransportMetrics};
use bytes::Bytes;
use futures::StreamExt as _;

const STEPS: u64 = 24;
const G: u32 = 4;

/// A hostile group: `g` members of task `hostile-<kind>`, each a valid
/// trajectory but for what `spoil` does to it.
fn group(kind: &str, n: u32, spoil: impl Fn(&mut Trajectory)) -> Vec<Trajectory> {
    (0..G)
        .map(|i| {
            let tokens = 6;
            let mut t = Trajectory {
                uuid: format!("00000000-0000-4000-8000-{:012x}", n * 16 + i),
                task_id: format!("hostile-{kind}"),
                group_id: format!("hostile-{kind}-g"),
                prompt_token_ids: vec![1, 5, 6, 7],
                completion_token_ids: vec![5; tokens],
                behaviour_logprobs: vec![-0.5; tokens],
                policy_versions: vec![0; tokens],
                reward: i as f32,
                reward_status: RewardStatus::Ok as i32,
                finish_reason: FinishReason::Stop as i32,
                worker_id: "mallory".into(),
                timings: None,
                group_size: G,
                index_in_group: i,
                admission_version: 0,
                turns: Vec::new(),
            };
            spoil(&mut t);
            t
        })
        .collect()
}

fn hostile_groups() -> BTreeMap<&'static str, Vec<Trajectory>> {
    let mut out = BTreeMap::new();
    out.insert(
        "vocab",
        group("vocab", 1, |t| t.completion_token_ids[2] = 1_000_000),
    );
    out.insert(
        "future",
        group("future", 2, |t| t.policy_versions = vec![1_000; 6]),
    );
    out.insert(
        "long",
        group("long", 3, |t| {
            t.completion_token_ids = vec![5; 400];
            t.behaviour_logprobs = vec![-0.5; 400];
            t.policy_versions = vec![0; 400];
        }),
    );
    out.insert(
        "logprob",
        group("logprob", 4, |t| t.behaviour_logprobs = vec![-1000.0; 6]),
    );
    out
}

/// The arith data set, with 20 prompts that can never fit the context.
fn tasks(dir: &Path) -> std::path::PathBuf {
    let path = configs::write_arith(dir.join("tasks.jsonl"), 400, 20, 5);
    let mut text = std::fs::read_to_string(&path).unwrap();
    for i in 0..20 {
        let prompt = format!("{}{i}=", "1+".repeat(4_000));
        text.push_str(&serde_json::json!({"prompt": prompt, "answer": "1"}).to_string());
        text.push('\n');
    }
    std::fs::write(&path, text).unwrap();
    path
}

/// Publishes `payload` to the trajectory stream, waiting for the buffer to
/// have created it.
async fn publish(bus: &NatsBus, subject: &str, id: &str, payload: Bytes) {
    for _ in 0..600 {
        if bus
            .publish_durable(subject, id, payload.clone())
            .await
            .is_ok()
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("cannot publish {id} to {subject}");
}

#[test]
fn hostile_trajectories_and_tasks_are_quarantined_and_training_reaches_its_target() {
    let server = NatsServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let mut config = configs::tiny_run(&out, &server.url(), &tasks(dir.path()));
    config.run.max_steps = STEPS;
    config.staleness.eta = 8;
    config.staleness.groups_per_step = 4;
    config.staleness.group_size = G;
    config.model.max_new_tokens = 8;
    config.model.max_seq_len = 64;
    config.coordinator.datasets[0].long_prompts = LongPrompts::Skip;
    config.telemetry.log_filter = "warn".into();
    let cfg = configs::write(&config, dir.path().join("asyncrl.toml"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_asyncrl"))
        .args(["train", cfg.to_str().unwrap()])
        .env("NO_COLOR", "1")
        .stdout(std::fs::File::create(dir.path().join("stdout")).unwrap())
        .stderr(std::fs::File::create(dir.path().join("stderr")).unwrap())
        .spawn()
        .unwrap();

    let rt = tokio::runtime::Runtime::new().unwrap();
    let groups = hostile_groups();
    let bus = rt.block_on(async {
        let bus = NatsBus::connect(&config.bus, TransportMetrics::new())
            .await
            .unwrap();
        for (kind, members) in &groups {
            for t in members {
                publish(
                    &bus,
                    &trajectory_subject(&t.task_id),
                    &t.uuid,
                    Bytes::from(t.encode_to_vec()),
                )
                .await;
            }
            eprintln!("published the {kind} group");
        }
        // A malformed message near the server's 1 MiB max_payload.
        let junk = Bytes::from(vec![0xffu8; 1024 * 1024 - 1024]);
        publish(&bus, &trajectory_subject("hostile-junk"), "junk", junk).await;
        bus
    });

    // A run that stalls on a hostile input never ends: it is given ten
    // times what it needs on a loaded machine.
    let deadline = std::time::Instant::now() + Duration::from_secs(300);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let stderr = std::fs::read_to_string(dir.path().join("stderr")).unwrap_or_default();
            panic!("the run did not reach step {STEPS} in 300 s (stalled):\n{stderr}");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let stderr = std::fs::read_to_string(dir.path().join("stderr")).unwrap();
    assert!(status.success(), "train failed: {status}\n{stderr}");

    // The step target, every step a whole batch, nothing hostile trained.
    let check = check_trained_file(&out.join(TRAINED_JSONL), 8, (4 * G) as usize);
    assert!(check.violations().is_empty(), "{:#?}", check.violations());
    assert_eq!(check.max_step, STEPS);
    let trained = std::fs::read_to_string(out.join(TRAINED_JSONL)).unwrap();
    let hostile: HashSet<&String> = groups.values().flatten().map(|t| &t.uuid).collect();
    for uuid in &hostile {
        assert!(!trained.contains(uuid.as_str()), "{uuid} was trained");
    }

    // Each hostile group is quarantined with its reason; the junk message
    // is dead-lettered with its first bytes and its size.
    let letters = rt.block_on(async {
        let consumer = bus
            .consumer(DEAD_LETTER_STREAM, &ConsumerSpec::new("test-dlq"))
            .await
            .unwrap();
        let mut letters = Vec::new();
        loop {
            let got = consumer.fetch(64, Duration::from_secs(2)).await.unwrap();
            if got.is_empty() {
                break;
            }
            letters.extend(
                got.iter()
                    .map(|d| DeadLetter::decode(d.payload.clone()).unwrap()),
            );
        }
        letters
    });
    let quarantined = |kind: &str| {
        letters
            .iter()
            .find(|l| l.group_id == format!("hostile-{kind}-g"))
            .unwrap_or_else(|| panic!("no dead letter for the {kind} group: {letters:#?}"))
    };
    for (kind, why) in [
        ("vocab", "outside the vocabulary"),
        ("future", "the learner's version"),
        ("long", "beyond the model's"),
        ("logprob", "not finite"),
    ] {
        let letter = quarantined(kind);
        assert!(letter.reason.contains(why), "{kind}: {}", letter.reason);
        assert_eq!(letter.task_id, format!("hostile-{kind}"));
        assert!(letter.step >= 1);
    }
    let junk = letters
        .iter()
        .find(|l| l.msg_id == "junk")
        .expect("the junk message's letter");
    assert!(junk.truncated);
    assert_eq!(junk.payload.len(), DEAD_LETTER_PAYLOAD_MAX);
    assert_eq!(junk.payload_size, 1024 * 1024 - 1024);
    // The long prompts were left out at load, counted; the quarantines
    // were logged.
    assert!(
        stderr.contains("left out prompts over max_prompt_tokens or the model's context"),
        "{stderr}"
    );
    assert!(stderr.contains("quarantined"), "{stderr}");
}

/// A second learner started on a running run refuses to start, with one
/// line naming the live one, and announces nothing: every version of the
/// run is announced once, in order, by the first learner's session.
#[test]
fn a_second_learner_refuses_to_start_and_nothing_is_announced_twice() {
    let server = NatsServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let tasks = configs::write_arith(dir.path().join("tasks.jsonl"), 400, 20, 5);
    let mut config = configs::tiny_run(dir.path().join("out"), &server.url(), &tasks);
    // Trains until stopped: the first learner is live whenever the second
    // one looks, however slow the machine.
    config.run.max_steps = 0;
    config.staleness.groups_per_step = 4;
    config.staleness.group_size = G;
    config.model.max_new_tokens = 8;
    config.model.max_seq_len = 64;
    config.learner.lease_ttl = Duration::from_millis(500);
    let cfg = configs::write(&config, dir.path().join("asyncrl.toml"));
    let rt = tokio::runtime::Runtime::new().unwrap();
    // Every write of policy.version, from the first.
    let (kv, mut history) = rt.block_on(async {
        let bus = NatsBus::connect(&config.bus, TransportMetrics::new())
            .await
            .unwrap();
        let kv = bus.kv(CONTROL_BUCKET).await.unwrap();
        let watch = kv.watch(POLICY_VERSION_KEY).await.unwrap();
        (kv, watch)
    });
    let mut train = Command::new(env!("CARGO_BIN_EXE_asyncrl"))
        .args(["train", cfg.to_str().unwrap()])
        .env("NO_COLOR", "1")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("train.stderr")).unwrap())
        .spawn()
        .unwrap();
    // Once the first learner has announced a version, a second one.
    rt.block_on(async {
        for _ in 0..600 {
            if kv.get(POLICY_VERSION_KEY).await.unwrap().is_some() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("no version was announced");
    });
    let second = Command::new(env!("CARGO_BIN_EXE_asyncrl"))
        .args(["learner", "--config", cfg.to_str().unwrap()])
        .env("NO_COLOR", "1")
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert_eq!(second.status.code(), Some(1), "{stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    assert!(
        errors[0].contains("another learner holds this run's lease: session"),
        "{stderr}"
    );
    // SIGTERM: the run stops cleanly.
    // SAFETY: kill only sends a signal to our own child.
    unsafe { libc::kill(train.id() as i32, libc::SIGTERM) };
    let status = train.wait().unwrap();
    let train_err = std::fs::read_to_string(dir.path().join("train.stderr")).unwrap();
    assert!(status.success(), "{train_err}");
    // Every version from 0 once, in order, all from the first learner's
    // session.
    let announced = rt.block_on(async {
        let mut seen = Vec::new();
        while let Ok(Some(Ok(event))) =
            tokio::time::timeout(Duration::from_secs(2), history.next()).await
        {
            if let Some(value) = event.value {
                let a = WeightAnnouncement::decode(value.as_ref()).unwrap();
                seen.push((a.version, a.learner_session, a.lease_epoch));
            }
        }
        seen
    });
    let versions: Vec<i32> = announced.iter().map(|(v, _, _)| *v).collect();
    let last = *versions.last().expect("versions announced");
    assert_eq!(versions, (0..=last).collect::<Vec<_>>(), "{announced:?}");
    let sessions: HashSet<&String> = announced.iter().map(|(_, s, _)| s).collect();
    assert_eq!(sessions.len(), 1, "{announced:?}");
    assert!(announced.iter().all(|(_, s, e)| !s.is_empty() && *e == 1));
}
