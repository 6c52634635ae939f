//! The admin API and `asyncrl ctl` against a running coordinator: knobs
//! applied at the step they name (a scripted learner seals its steps),
//! refused when late, refused without the token, pause/resume and
//! checkpoint, all of it journaled; and the API over TLS.

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use asyncrl_config::{ClipModeName, Config, ImportanceCorrectionName};
use asyncrl_coordinator::ctl::{CtlArgs, CtlCommand, CtlError, ctl};
use asyncrl_coordinator::journal::Journal;
use asyncrl_coordinator::{Coordinator, seal_step};
use asyncrl_protos::v1::coordinator_admin_client::CoordinatorAdminClient;
use asyncrl_protos::v1::{Knobs, SetKnobsRequest};
use asyncrl_telemetry::{Health, Metrics};
use asyncrl_testkit::eventually;
use asyncrl_transport::{Bus, KvBucket, LocalBus};
use common::{Learner, Worker, config, write_tasks};

use tokio_util::sync::CancellationToken;

const TOKEN: &str = "s3cret-token";

async fn start(cfg: Config, bus: &Arc<dyn Bus>) -> Coordinator {
    Coordinator::start(
        cfg,
        bus.clone(),
        Metrics::new(),
        Health::new(),
        &CancellationToken::new(),
    )
    .await
    .expect("start coordinator")
}

fn args(c: &Coordinator, command: CtlCommand, token: Option<&str>) -> CtlArgs {
    let mut a = CtlArgs::new(command);
    a.endpoint = Some(format!("http://{}", c.admin_addr().unwrap()));
    a.token = token.map(str::to_owned);
    a.who = Some("alice".into());
    a
}

fn set(assignments: &[&str], at_step: Option<u64>) -> CtlCommand {
    CtlCommand::Set {
        assignments: assignments.iter().map(|s| s.to_string()).collect(),
        at_step,
    }
}

/// The scripted learner's step boundary: seal step `s`, "train", announce
/// version `s`.
async fn learner_step(
    kv: &dyn KvBucket,
    learner: &Learner,
    s: u64,
) -> asyncrl_coordinator::StepKnobs {
    let k = seal_step(kv, s).await.expect("seal");
    learner.announce(s as i32).await;
    k
}

async fn wait_version(c: &Coordinator, v: i32) {
    eventually(&format!("version {v}"), Duration::from_secs(5), || async {
        (c.status().await.unwrap().policy_version == v).then_some(())
    })
    .await;
}

async fn wait_sealed(c: &Coordinator, s: u64) {
    eventually(&format!("sealed {s}"), Duration::from_secs(5), || async {
        (c.knobs().await.unwrap().sealed_through_step >= s).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn knobs_apply_at_their_step_are_refused_when_late_or_unauthorized_and_are_journaled() {
    let bus: Arc<dyn Bus> = Arc::new(LocalBus::new());
    let dir = tempfile::tempdir().unwrap();
    let tasks = write_tasks(dir.path(), 50);
    let mut cfg = config(dir.path(), &tasks, 2, 2);
    cfg.coordinator.admin_listen = "127.0.0.1:0".into();
    cfg.coordinator.admin_token = Some(TOKEN.into());
    let journal_path = dir.path().join("journal.jsonl");
    let c = start(cfg.clone(), &bus).await;
    let learner = Learner::new(&bus).await;
    let kv = learner.kv.clone();

    // Step 1 trained and announced, step 2 sealed (in progress).
    let k1 = learner_step(kv.as_ref(), &learner, 1).await;
    assert_eq!(
        (k1.eta, k1.learning_rate, k1.clip_mode),
        (2, 1e-6, ClipModeName::Adaptive)
    );
    seal_step(kv.as_ref(), 2).await.unwrap();
    wait_version(&c, 1).await;
    wait_sealed(&c, 2).await;

    // A change for a later step is accepted for exactly that step.
    let out = ctl(
        &cfg,
        &args(
            &c,
            set(
                &[
                    "lr=2e-6",
                    "clip_mode=gspo",
                    "importance_correction=icepop",
                    "iw_floor=0.25",
                    "dual_clip=3",
                ],
                Some(4),
            ),
            Some(TOKEN),
        ),
    )
    .await
    .unwrap();
    assert!(out.contains("from learner step 4"), "{out}");
    // One for the step in progress is refused, not applied late.
    let late = ctl(&cfg, &args(&c, set(&["eta=1"], Some(2)), Some(TOKEN)))
        .await
        .unwrap_err();
    assert!(
        matches!(&late, CtlError::Refused(r) if r.contains("step 2 has already started")),
        "{late}"
    );
    // No step named: the next step boundary (3).
    let out = ctl(&cfg, &args(&c, set(&["lr=5e-6"], None), Some(TOKEN)))
        .await
        .unwrap();
    assert!(out.contains("from learner step 3"), "{out}");
    // Without the token, or with a wrong one: refused.
    let err = ctl(&cfg, &args(&c, set(&["eta=1"], Some(9)), Some("wrong")))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, CtlError::Rpc { code: tonic::Code::Unauthenticated, message, .. } if message.contains("wrong bearer token")),
        "{err}"
    );
    let mut raw = CoordinatorAdminClient::connect(format!("http://{}", c.admin_addr().unwrap()))
        .await
        .unwrap();
    let status = raw
        .set_knobs(SetKnobsRequest {
            knobs: Some(Knobs {
                eta: Some(0),
                ..Default::default()
            }),
            apply_at_step: 9,
            requested_by: "mallory".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated);
    assert!(status.message().contains("missing"), "{}", status.message());
    // Out of range: refused with the knob named (checked by ctl before
    // sending, and by the server).
    let err = ctl(&cfg, &args(&c, set(&["eps_low=2"], None), Some(TOKEN)))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("`eps_low` = 2"), "{err}");
    let mut authed = tonic::Request::new(SetKnobsRequest {
        knobs: Some(Knobs {
            importance_weight_cap: Some(0.1),
            ..Default::default()
        }),
        apply_at_step: 0,
        requested_by: "bob".into(),
    });
    authed
        .metadata_mut()
        .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
    let r = raw.set_knobs(authed).await.unwrap().into_inner();
    assert!(
        !r.accepted && r.reason.contains("`importance_weight_cap`"),
        "{r:?}"
    );

    let knobs_text = ctl(&cfg, &args(&c, CtlCommand::Knobs, None)).await.unwrap();
    assert!(
        knobs_text.contains("knobs in effect at learner step 2 (sealed through step 2)"),
        "{knobs_text}"
    );
    assert!(knobs_text.contains("scheduled changes"), "{knobs_text}");
    assert!(knobs_text.contains("learning_rate=5e-6"), "{knobs_text}");

    // The learner trains on: each step gets exactly its knobs.
    learner.announce(2).await;
    let k3 = learner_step(kv.as_ref(), &learner, 3).await;
    let k4 = seal_step(kv.as_ref(), 4).await.unwrap();
    assert_eq!(
        (k3.learning_rate, k3.clip_mode),
        (5e-6, ClipModeName::Adaptive)
    );
    assert_eq!((k4.learning_rate, k4.clip_mode), (2e-6, ClipModeName::Gspo));
    assert_eq!(
        (k4.importance_correction, k4.importance_weight_floor),
        (ImportanceCorrectionName::Icepop, 0.25)
    );
    assert_eq!(
        (k3.importance_correction, k3.importance_weight_floor),
        (ImportanceCorrectionName::Mask, 0.5)
    );
    assert_eq!((k3.dual_clip, k4.dual_clip), (0.0, 3.0));
    assert_eq!(k4.eta, 2);
    wait_sealed(&c, 4).await;

    // Pause stops admission at once, resume reopens it.
    let w = Worker::new(&bus, "w");
    w.register(4).await;
    let out = ctl(&cfg, &args(&c, CtlCommand::Pause, Some(TOKEN)))
        .await
        .unwrap();
    assert!(out.contains("pause in effect"), "{out}");
    let denied = w.acquire(1).await;
    assert!(
        denied.tasks.is_empty() && denied.reason.contains("paused"),
        "{}",
        denied.reason
    );
    assert!(c.status().await.unwrap().paused);
    ctl(&cfg, &args(&c, CtlCommand::Resume, Some(TOKEN)))
        .await
        .unwrap();
    assert_eq!(w.acquire(1).await.tasks.len(), 1);
    // Checkpoint: the learner is told at its next step boundary.
    let out = ctl(&cfg, &args(&c, CtlCommand::Checkpoint, Some(TOKEN)))
        .await
        .unwrap();
    assert!(out.contains("checkpoints before step 5"), "{out}");
    learner.announce(4).await;
    let k5 = learner_step(kv.as_ref(), &learner, 5).await;
    assert!(k5.checkpoint);
    wait_sealed(&c, 5).await;

    let status = ctl(&cfg, &args(&c, CtlCommand::Status, None))
        .await
        .unwrap();
    assert!(
        status.contains("policy version") && status.contains("admission             open"),
        "{status}"
    );
    assert!(
        status
            .lines()
            .any(|l| l.starts_with("w ") && l.contains("test-host") && l.contains("alive")),
        "{status}"
    );

    // Everything is in the journal, with who and the outcome.
    let entries = eventually("applied entries", Duration::from_secs(5), || async {
        let e = Journal::read_all(&journal_path).await.ok()?;
        (e.iter().filter(|e| e.outcome == "applied").count() >= 5).then_some(e)
    })
    .await;
    let find = |pred: &dyn Fn(&asyncrl_coordinator::journal::JournalEntry) -> bool| {
        entries.iter().find(|e| pred(e)).cloned()
    };
    let at4 = find(&|e| e.outcome == "accepted" && e.effective_step == Some(4))
        .expect("accepted for step 4");
    assert_eq!(
        (at4.who.as_str(), at4.action.as_str()),
        ("alice", "set_knobs")
    );
    assert_eq!(at4.request["knobs"]["clip_mode"], "gspo");
    assert_eq!(at4.request["knobs"]["importance_correction"], "icepop");
    assert!(
        at4.peer
            .as_deref()
            .is_some_and(|p| p.starts_with("127.0.0.1:"))
    );
    let applied4 =
        find(&|e| e.outcome == "applied" && e.ref_seq == Some(at4.seq)).expect("applied at 4");
    assert_eq!(applied4.effective_step, Some(4));
    assert!(
        find(&|e| e.outcome == "refused"
            && e.reason
                .as_deref()
                .is_some_and(|r| r.contains("already started")))
        .is_some()
    );
    assert!(
        find(&|e| e.outcome == "refused" && e.reason.as_deref() == Some("wrong bearer token"))
            .is_some()
    );
    let m = find(&|e| e.who == "mallory").expect("mallory journaled");
    assert_eq!(m.outcome, "refused");
    assert!(find(&|e| e.who == "bob" && e.outcome == "refused").is_some());
    for action in ["pause", "resume", "checkpoint"] {
        let e = find(&|e| e.action == action && e.outcome == "accepted").expect(action);
        assert!(
            find(&|x| x.outcome == "applied" && x.ref_seq == Some(e.seq)).is_some(),
            "{action} not applied"
        );
    }
    let seqs: Vec<u64> = entries.iter().map(|e| e.seq).collect();
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");

    // A restarted coordinator keeps the knobs and continues the journal.
    c.shutdown();
    c.join().await.unwrap();
    let c = start(cfg.clone(), &bus).await;
    let k = c.knobs().await.unwrap().knobs.unwrap();
    assert_eq!(k.learning_rate, Some(2e-6));
    let out = ctl(&cfg, &args(&c, set(&["eta=3"], None), Some(TOKEN)))
        .await
        .unwrap();
    let next = seqs.last().unwrap() + 1;
    assert!(out.contains(&format!("journal #{next}")), "{out}");
    c.shutdown();
    c.join().await.unwrap();
}

#[tokio::test]
async fn without_a_configured_token_every_mutating_call_is_refused() {
    let bus: Arc<dyn Bus> = Arc::new(LocalBus::new());
    let dir = tempfile::tempdir().unwrap();
    let tasks = write_tasks(dir.path(), 5);
    let mut cfg = config(dir.path(), &tasks, 2, 0);
    cfg.coordinator.admin_listen = "127.0.0.1:0".into();
    let c = start(cfg.clone(), &bus).await;
    let err = ctl(&cfg, &args(&c, CtlCommand::Pause, Some("anything")))
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("no admin token configured"),
        "{err}"
    );
    // Reads stay open.
    assert!(ctl(&cfg, &args(&c, CtlCommand::Status, None)).await.is_ok());
    // ctl without any token says so before calling.
    let err = ctl(&cfg, &args(&c, CtlCommand::Resume, None))
        .await
        .unwrap_err();
    assert!(matches!(err, CtlError::NoToken), "{err}");
    let entries = Journal::read_all(&dir.path().join("journal.jsonl"))
        .await
        .unwrap();
    assert_eq!(entries.len(), 1);
    assert_eq!(
        (entries[0].action.as_str(), entries[0].outcome.as_str()),
        ("pause", "refused")
    );
    c.shutdown();
    c.join().await.unwrap();
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl must be installed to make the test certificates");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA and a server certificate for localhost / 127.0.0.1.
fn make_certs(dir: &Path) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "2",
            "-subj",
            "/CN=asyncrl test CA",
        ],
    );
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=localhost",
        ],
    );
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=critical,CA:FALSE\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.pem",
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
        ],
    );
}

#[tokio::test]
async fn the_admin_api_over_tls() {
    let bus: Arc<dyn Bus> = Arc::new(LocalBus::new());
    let dir = tempfile::tempdir().unwrap();
    make_certs(dir.path());
    let tasks = write_tasks(dir.path(), 5);
    let mut cfg = config(dir.path(), &tasks, 2, 0);
    cfg.coordinator.admin_listen = "127.0.0.1:0".into();
    cfg.coordinator.admin_token = Some(TOKEN.into());
    cfg.coordinator.admin_tls = Some(asyncrl_config::AdminTlsConfig {
        cert_file: Some(dir.path().join("server.pem")),
        key_file: Some(dir.path().join("server.key")),
        ca_file: Some(dir.path().join("ca.pem")),
        domain: None,
    });
    let c = start(cfg.clone(), &bus).await;
    let port = c.admin_addr().unwrap().port();
    // ctl resolves https and the CA from the config.
    let mut a = CtlArgs::new(CtlCommand::Status);
    a.endpoint = Some(format!("https://localhost:{port}"));
    let out = ctl(&cfg, &a).await.unwrap();
    assert!(out.contains("policy version"), "{out}");
    let mut a = CtlArgs::new(CtlCommand::Pause);
    a.endpoint = Some(format!("https://127.0.0.1:{port}"));
    a.domain = Some("localhost".into());
    let out = ctl(&cfg, &a).await.unwrap();
    assert!(out.contains("accepted"), "{out}");
    // Plain HTTP/2 against the TLS port does not get through.
    let mut plain = CtlArgs::new(CtlCommand::Status);
    plain.endpoint = Some(format!("http://127.0.0.1:{port}"));
    plain.timeout_s = 2.0;
    assert!(ctl(&cfg, &plain).await.is_err());
    c.shutdown();
    c.join().await.unwrap();
}
