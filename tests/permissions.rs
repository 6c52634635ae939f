//! The roles' NATS users and permissions (deploy/k8s/base/nats-auth.conf,
//! the file the Kubernetes deployment ships) on a real nats-server:
//! - every role runs end to end with its own credentials and the run's
//!   invariants hold;
//! - the worker's credentials cannot write `policy.version`, the knobs, the
//!   coordinator's state or a weights object, nor serve a coordinator
//!   subject: the server refuses, and the bus reports it as
//!   `PermissionDenied` naming the subject, at once (not after a timeout);
//! - a role process started with credentials that lack what it must do
//!   exits with one error line naming the permission and the subject;
//! - no role reads another's replies: each may subscribe to its own inbox
//!   prefix only, not to `_INBOX.>` nor to another role's or worker's;
//! - the coordinator's tasks-available hint reaches every worker user;
//! - a worker started before the stores it reads exist waits for their
//!   owners to create them, and never asks to create one;
//! - a worker with its own user (nats-worker-user.conf.template) cannot
//!   register, acquire, heartbeat, complete or return in another worker's
//!   name, through the real coordinator: the server refuses the other
//!   worker's subjects, the coordinator refuses a worker_id that is not
//!   its subject's (counted), and the lease is left as it was.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use asyncrl_config::{BusConfig, Config, DatasetConfig, RoleAuth, Secret};
use asyncrl_harness::cluster::{Cluster, Expect, NatsSetup, Spec};
use asyncrl_protos::subjects::{
    BUFFER_GROUP_DROPPED, CONTROL_BUCKET, COORDINATOR_QUEUE_GROUP, COORDINATOR_STATE_KEY,
    KNOBS_KEY, LEARNER_LEASE_KEY, LEARNER_STATUS_KEY, POLICY_VERSION_KEY, TASKS_ACQUIRE,
    TASKS_AVAILABLE, TASKS_COMPLETE, TASKS_RETURN, WEIGHTS_BUCKET, WORKER_REQUEST_SUBJECTS,
    WORKERS_HEARTBEAT, WORKERS_REGISTER, role_inbox_prefix, weights_object_name,
    worker_inbox_prefix, worker_subject,
};
use asyncrl_protos::v1::{
    AcquireTasks, AcquireTasksReply, CompleteTask, CompleteTaskReply, HeartbeatReply,
    RegisterWorker, RegisterWorkerReply, ReturnTasks, ReturnTasksReply, WorkerHeartbeat,
};
use asyncrl_testkit::{NatsServer, ServerConfig, workspace_root};
use asyncrl_transport::{Bus, NatsBus, TransportError, TransportMetrics};
use bytes::Bytes;
use futures::StreamExt as _;

const ROLES: [&str; 4] = ["coordinator", "buffer", "learner", "worker"];
const OBSERVER: (&str, &str) = ("observer", "observer-pw");
/// Workers with their own users (nats-worker-user.conf.template):
/// `worker-<id>`.
const BOUND_WORKERS: [&str; 2] = ["a", "b"];
/// The worker id the connections of the shared `worker` user go by.
const SHARED_WORKER_ID: &str = "shared-w";

fn password(role: &str) -> String {
    format!("{role}-pw-{}", std::process::id())
}

/// The shipped permission file.
fn nats_auth_conf() -> String {
    let path = workspace_root().join("deploy/k8s/base/nats-auth.conf");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The shipped template of one worker's own user, for worker `id`.
fn worker_user(id: &str) -> String {
    let path = workspace_root().join("deploy/k8s/base/nats-worker-user.conf.template");
    let template =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    template
        .replace(
            "WORKER_PASSWORD",
            &format!("\"{}\"", password(&bound_user(id))),
        )
        .replace("WORKER_ID", id)
}

fn bound_user(id: &str) -> String {
    format!("worker-{id}")
}

/// nats-server with the roles' users of the shipped permission file (their
/// passwords in its environment, as nats.yaml sets them), the users of
/// [`BOUND_WORKERS`] from the shipped template, plus the test's own
/// unrestricted observer.
fn server_config() -> ServerConfig {
    let bound: String = BOUND_WORKERS.iter().map(|id| worker_user(id)).collect();
    let mut config = ServerConfig::new(format!(
        "include nats-auth.conf\n\
         authorization {{\n  users: [\n    $ASYNCRL_COORDINATOR\n    $ASYNCRL_BUFFER\n    \
         $ASYNCRL_LEARNER\n    $ASYNCRL_WORKER\n{bound}    {{ user: {}, password: {} }}\n  ]\n}}\n",
        OBSERVER.0, OBSERVER.1
    ))
    .file("nats-auth.conf", nats_auth_conf());
    for role in ROLES {
        config = config.env(
            format!("NATS_{}_PASSWORD", role.to_uppercase()),
            password(role),
        );
    }
    config
}

/// `bus.roles` of every role: `as_user[role]` is the user it connects as
/// (its own unless a test swaps them). The learner reads its password from
/// a file, the others have it inline.
fn role_auth(secrets: &Path, as_user: impl Fn(&str) -> &'static str) -> BTreeMap<String, RoleAuth> {
    let mut roles = BTreeMap::new();
    for role in ROLES {
        let user = as_user(role);
        let mut auth = RoleAuth {
            user: Some(user.into()),
            ..RoleAuth::default()
        };
        if role == "learner" {
            let file = secrets.join(format!("{role}-password"));
            std::fs::write(&file, format!("{}\n", password(user))).unwrap();
            auth.password_file = Some(file);
        } else {
            auth.password = Some(Secret::new(password(user)));
        }
        roles.insert(role.to_owned(), auth);
    }
    roles
}

fn setup(secrets: &Path, as_user: impl Fn(&str) -> &'static str) -> NatsSetup {
    NatsSetup {
        server: Some(server_config()),
        bus_roles: role_auth(secrets, as_user),
        observer: Some((OBSERVER.0.into(), OBSERVER.1.into())),
        ..NatsSetup::default()
    }
}

fn own_user(role: &str) -> &'static str {
    ROLES.into_iter().find(|r| *r == role).expect("a role")
}

/// The lines of a role's log where the server refused something.
fn refusals(log: &str) -> Vec<&str> {
    log.lines().filter(|l| l.contains("NATS refused")).collect()
}

#[test]
fn every_role_runs_end_to_end_with_its_own_credentials() {
    let secrets = tempfile::tempdir().unwrap();
    let mut cluster = Cluster::start_with(
        Spec {
            max_steps: 8,
            ..Spec::default()
        },
        setup(secrets.path(), own_user),
    );
    let report = cluster.finish(&Expect::default());
    assert_eq!(report.steps, 8);
    assert!(report.trained_trajectories > 0, "{report:?}");
    for role in ["coordinator", "buffer", "learner"] {
        let log = cluster.log(role);
        assert_eq!(
            refusals(&log),
            Vec::<&str>::new(),
            "{role} was refused something its role needs"
        );
    }
    // A worker that starts before the coordinator has created the control
    // bucket may try to create it, and is refused: workers create nothing.
    for worker in cluster.workers() {
        let log = cluster.log(&worker);
        for line in refusals(&log) {
            assert!(
                line.contains("`$JS.API.STREAM.CREATE.KV_asyncrl_control`"),
                "{worker} was refused something its role needs: {line}"
            );
        }
    }
}

/// The inbox prefix a connection of `user` has, as the role processes
/// derive it (`asyncrl <role>`): the role's, or the worker's (the shared
/// user's connections go by [`SHARED_WORKER_ID`]); none (`_INBOX`) for the
/// observer.
fn inbox_of(user: &str) -> Option<String> {
    match user {
        "coordinator" | "buffer" | "learner" => Some(role_inbox_prefix(user)),
        "worker" => Some(worker_inbox_prefix(SHARED_WORKER_ID)),
        other => other.strip_prefix("worker-").map(worker_inbox_prefix),
    }
}

/// A bus connection of `user` (a role's user, or the observer), with the
/// inbox prefix of [`inbox_of`].
async fn connect(server: &NatsServer, user: &str, password: &str) -> (NatsBus, TransportMetrics) {
    connect_with_inbox(server, user, password, inbox_of(user)).await
}

async fn connect_with_inbox(
    server: &NatsServer,
    user: &str,
    password: &str,
    inbox_prefix: Option<String>,
) -> (NatsBus, TransportMetrics) {
    let config = BusConfig {
        user: Some(user.into()),
        password: Some(Secret::new(password)),
        inbox_prefix,
        // Long: a refusal must not wait for it.
        request_timeout: Duration::from_secs(30),
        ..BusConfig::nats(server.url())
    };
    let metrics = TransportMetrics::new();
    let bus = NatsBus::connect(&config, metrics.clone())
        .await
        .unwrap_or_else(|e| panic!("connect as {user}: {e}"));
    (bus, metrics)
}

/// `result` is the server's refusal of a publish on a subject `subject`
/// matches (a NATS wildcard), with the message an operator reads.
fn assert_refused<T: std::fmt::Debug>(
    what: &str,
    result: Result<T, TransportError>,
    subject: &str,
) {
    match result {
        Err(e @ TransportError::PermissionDenied { .. }) => {
            let TransportError::PermissionDenied { op, subject: got } = &e else {
                unreachable!()
            };
            assert_eq!(*op, "publish", "{what}");
            assert!(
                asyncrl_transport::subject_matches(subject, got),
                "{what}: refused on {got}, expected {subject}"
            );
            assert!(!e.is_transient(), "{what}: a refusal is not retried");
            let message = e.to_string();
            assert!(
                message.starts_with(&format!("NATS refused publish on `{got}`"))
                    && message.contains("lack the permission")
                    && message.contains("deploy/k8s/base/nats-auth.conf"),
                "{what}: {message}"
            );
        }
        other => panic!("{what}: expected PermissionDenied on {subject}, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_credentials_cannot_write_what_other_roles_own() {
    let server = NatsServer::start_with_config(&server_config()).expect("start nats-server");
    // What the other roles would have created: the control bucket with a
    // version, the weights of that version.
    let (observer, _) = connect(&server, OBSERVER.0, OBSERVER.1).await;
    let control = observer.kv(CONTROL_BUCKET).await.unwrap();
    control
        .put(POLICY_VERSION_KEY, Bytes::from_static(b"v1"))
        .await
        .unwrap();
    let state_revision = control
        .put(COORDINATOR_STATE_KEY, Bytes::from_static(b"state"))
        .await
        .unwrap();
    let weights = observer.object_store(WEIGHTS_BUCKET).await.unwrap();
    weights
        .put(&weights_object_name(1), Bytes::from_static(b"weights v1"))
        .await
        .unwrap();

    let (worker, metrics) = connect(&server, "worker", &password("worker")).await;
    // What a worker may do: read the version and the weights.
    let kv = worker.kv(CONTROL_BUCKET).await.unwrap();
    assert_eq!(
        kv.get(POLICY_VERSION_KEY).await.unwrap().map(|e| e.value),
        Some(Bytes::from_static(b"v1"))
    );
    let objects = worker.object_store(WEIGHTS_BUCKET).await.unwrap();
    assert_eq!(
        objects.get(&weights_object_name(1)).await.unwrap(),
        Bytes::from_static(b"weights v1")
    );

    // What it may not: each refused by the server, reported at once.
    let started = Instant::now();
    assert_refused(
        "worker writes policy.version",
        kv.put(POLICY_VERSION_KEY, Bytes::from_static(b"v999"))
            .await,
        &format!("$KV.{CONTROL_BUCKET}.{POLICY_VERSION_KEY}"),
    );
    assert_refused(
        "worker writes the knobs",
        kv.put(KNOBS_KEY, Bytes::from_static(b"lr=1")).await,
        &format!("$KV.{CONTROL_BUCKET}.{KNOBS_KEY}"),
    );
    assert_refused(
        "worker takes the learner lease (which would fence the learner)",
        kv.put(LEARNER_LEASE_KEY, Bytes::from_static(b"mallory"))
            .await,
        &format!("$KV.{CONTROL_BUCKET}.{LEARNER_LEASE_KEY}"),
    );
    assert_refused(
        "worker overwrites the coordinator's state",
        kv.update(
            COORDINATOR_STATE_KEY,
            Bytes::from_static(b"forged"),
            state_revision,
        )
        .await,
        &format!("$KV.{CONTROL_BUCKET}.{COORDINATOR_STATE_KEY}"),
    );
    assert_refused(
        "worker puts a weights object",
        objects
            .put(
                &weights_object_name(2),
                Bytes::from_static(b"forged weights"),
            )
            .await,
        &format!("$O.{WEIGHTS_BUCKET}.>"),
    );
    assert_refused(
        "worker deletes a weights object",
        objects.delete(&weights_object_name(1)).await,
        &format!("$O.{WEIGHTS_BUCKET}.>"),
    );
    assert_refused(
        "worker forges a drop report (which would issue a trained task again)",
        worker
            .publish_durable(
                BUFFER_GROUP_DROPPED,
                "dropped.forged.stale",
                Bytes::from_static(b"forged"),
            )
            .await,
        BUFFER_GROUP_DROPPED,
    );
    eprintln!(
        "7 refusals reported in {:?} (request timeout 30 s)",
        started.elapsed()
    );
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "refusals took {:?}: they waited for the 30 s request timeout",
        started.elapsed()
    );
    assert_eq!(metrics.permission_violation_count("publish"), 7);
    assert_eq!(metrics.error_count("kv_put"), 3);

    // Nothing changed.
    assert_eq!(
        control
            .get(POLICY_VERSION_KEY)
            .await
            .unwrap()
            .map(|e| e.value),
        Some(Bytes::from_static(b"v1"))
    );
    assert_eq!(control.get(KNOBS_KEY).await.unwrap(), None);
    assert_eq!(
        control
            .get(COORDINATOR_STATE_KEY)
            .await
            .unwrap()
            .map(|e| e.value),
        Some(Bytes::from_static(b"state"))
    );
    let names: Vec<String> = weights
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|o| o.name)
        .collect();
    assert_eq!(names, [weights_object_name(1)]);

    // A worker cannot pose as the coordinator: its subscription to a
    // coordinator subject is refused and ends, so requests reach the real one.
    let mut served = worker
        .serve(TASKS_ACQUIRE, Some(COORDINATOR_QUEUE_GROUP))
        .await
        .unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(20), served.next())
        .await
        .expect("the refused subscription ends");
    assert!(ended.is_none(), "a worker served {TASKS_ACQUIRE}");
    assert_eq!(metrics.permission_violation_count("subscribe"), 1);
}

/// A worker may start before the coordinator and the learner have created
/// the control bucket and the weights store (or reach a cluster node that
/// does not know them yet): it waits for them, and never asks the server to
/// create one, which its user may not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_started_first_waits_for_the_stores_and_never_creates_one() {
    let server = NatsServer::start_with_config(&server_config()).expect("start nats-server");
    // The observer sees the worker's bucket lookups (JetStream API requests
    // are plain publishes).
    let spy =
        async_nats::ConnectOptions::with_user_and_password(OBSERVER.0.into(), OBSERVER.1.into())
            .connect(server.url())
            .await
            .expect("connect as the observer");
    let mut lookups = spy
        .subscribe(format!("$JS.API.STREAM.INFO.KV_{CONTROL_BUCKET}"))
        .await
        .expect("subscribe");
    spy.flush().await.expect("flush");

    let config = BusConfig {
        user: Some("worker".into()),
        password: Some(Secret::new(password("worker"))),
        inbox_prefix: inbox_of("worker"),
        open_stores_only: true,
        ..BusConfig::nats(server.url())
    };
    let worker = NatsBus::connect(&config, TransportMetrics::new())
        .await
        .expect("connect as the worker");
    let opening = tokio::spawn(async move {
        let kv = worker.kv(CONTROL_BUCKET).await.map(|_| ());
        let weights = worker.object_store(WEIGHTS_BUCKET).await.map(|_| ());
        (kv, weights, worker.refusals())
    });
    // It looked, found nothing, and looked again: it is waiting.
    for n in 1..=2 {
        tokio::time::timeout(Duration::from_secs(60), lookups.next())
            .await
            .unwrap_or_else(|_| panic!("lookup {n} of the control bucket"))
            .expect("the spy's subscription");
    }
    // The owners create the stores.
    let (coordinator, _) = connect(&server, "coordinator", &password("coordinator")).await;
    coordinator
        .kv(CONTROL_BUCKET)
        .await
        .expect("the coordinator creates the control bucket");
    let (learner, _) = connect(&server, "learner", &password("learner")).await;
    learner
        .object_store(WEIGHTS_BUCKET)
        .await
        .expect("the learner creates the weights store");

    let (kv, weights, refused) = opening.await.expect("the worker's task");
    kv.expect("the worker opens the control bucket once it exists");
    weights.expect("the worker opens the weights store once it exists");
    assert!(
        refused.is_empty(),
        "the worker asked for what its user may not do: {refused:?}"
    );
}

#[test]
fn a_learner_with_worker_credentials_exits_with_one_error_naming_the_permission() {
    let secrets = tempfile::tempdir().unwrap();
    let mut cluster = Cluster::start_with(
        Spec {
            max_steps: 4,
            workers: 1,
            ..Spec::default()
        },
        setup(secrets.path(), |role| {
            if role == "learner" {
                "worker"
            } else {
                own_user(role)
            }
        }),
    );
    let status = cluster.wait_exit("learner", Duration::from_secs(120));
    assert!(!status.success(), "the learner exited with {status}");
    let log = cluster.current_log("learner");
    let errors: Vec<&str> = log.lines().filter(|l| l.starts_with("error: ")).collect();
    assert_eq!(errors.len(), 1, "one error line:\n{log}");
    let line = errors[0];
    assert!(
        (line.contains("NATS refused publish on `$")
            || line.contains("NATS refused subscribe on `"))
            && line.contains("the credentials of this role lack the permission"),
        "{line}"
    );
    // It names the subject the learner needed: its own inbox (where every
    // answer arrives: the worker's user may not subscribe to the learner's),
    // creating the WEIGHTS store (or the control bucket, when it starts
    // before the coordinator), or writing a weights object or its control
    // keys.
    let needed = [
        format!("subscribe on `{}.", role_inbox_prefix("learner")),
        format!("`$JS.API.STREAM.CREATE.OBJ_{WEIGHTS_BUCKET}`"),
        format!("`$JS.API.STREAM.CREATE.KV_{CONTROL_BUCKET}`"),
        format!("`$O.{WEIGHTS_BUCKET}."),
        format!("`$KV.{CONTROL_BUCKET}."),
    ];
    assert!(
        needed.iter().any(|subject| line.contains(subject.as_str())),
        "{line}"
    );
}

/// What the end-to-end run may not reach in a few steps: the learner
/// replacing and deleting weights (old versions pruned), the buffer's batch
/// objects (batches too large for an inline reply) read by the learner and
/// deleted by the buffer, the buffer's storage report, the learner's batch
/// request served by the buffer. Each with its own user, nothing refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_owners_credentials_cover_weight_pruning_batch_objects_and_storage_reports() {
    let server = NatsServer::start_with_config(&server_config()).expect("start nats-server");
    let (learner, learner_metrics) = connect(&server, "learner", &password("learner")).await;
    let (buffer, buffer_metrics) = connect(&server, "buffer", &password("buffer")).await;
    let (coordinator, coordinator_metrics) =
        connect(&server, "coordinator", &password("coordinator")).await;

    // The learner creates the control bucket and the weights store, writes
    // its keys, replaces and prunes weights.
    let control = learner.kv(CONTROL_BUCKET).await.unwrap();
    for key in [POLICY_VERSION_KEY, LEARNER_STATUS_KEY, KNOBS_KEY] {
        control.put(key, Bytes::from_static(b"x")).await.unwrap();
    }
    let weights = learner.object_store(WEIGHTS_BUCKET).await.unwrap();
    for v in [1, 2, 2, 3] {
        let bytes = Bytes::from(vec![u8::try_from(v).unwrap(); 300_000]);
        weights.put(&weights_object_name(v), bytes).await.unwrap();
    }
    weights.delete(&weights_object_name(1)).await.unwrap();
    let left: Vec<String> = weights
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|o| o.name)
        .collect();
    assert_eq!(left, [weights_object_name(2), weights_object_name(3)]);

    // The coordinator writes its state and the knobs.
    let control = coordinator.kv(CONTROL_BUCKET).await.unwrap();
    control
        .put(COORDINATOR_STATE_KEY, Bytes::from_static(b"state"))
        .await
        .unwrap();
    control
        .put(KNOBS_KEY, Bytes::from_static(b"lr"))
        .await
        .unwrap();

    // The buffer's batch objects: put by the buffer, read by the learner,
    // deleted by the buffer; its batch subject served to the learner.
    let bucket = asyncrl_config::BufferConfig::default().batch_object_bucket;
    let batches = buffer.object_store(&bucket).await.unwrap();
    let batch = Bytes::from(vec![7u8; 2_000_000]);
    batches.put("batch-1", batch.clone()).await.unwrap();
    let read = learner.object_store(&bucket).await.unwrap();
    assert_eq!(read.get("batch-1").await.unwrap(), batch);
    batches.delete("batch-1").await.unwrap();
    let mut served = buffer
        .serve(
            asyncrl_protos::subjects::BUFFER_BATCH,
            Some(asyncrl_protos::subjects::BUFFER_QUEUE_GROUP),
        )
        .await
        .unwrap();
    let answer = tokio::spawn(async move {
        let req = served.next().await.expect("a batch request");
        req.respond(Bytes::from_static(b"batch")).await.unwrap();
    });
    // Until the server has the buffer's subscription, nobody responds.
    let reply = asyncrl_testkit::eventually(
        "the buffer serving the batch subject",
        Duration::from_secs(20),
        || async {
            match learner
                .request(
                    asyncrl_protos::subjects::BUFFER_BATCH,
                    Bytes::from_static(b"next"),
                    Duration::from_secs(10),
                )
                .await
            {
                Err(TransportError::NoResponders { .. }) => None,
                other => Some(other.unwrap()),
            }
        },
    )
    .await;
    assert_eq!(reply, Bytes::from_static(b"batch"));
    answer.await.unwrap();
    let stores = buffer.storage().await.unwrap();
    assert!(!stores.is_empty());

    for (role, metrics) in [
        ("learner", &learner_metrics),
        ("buffer", &buffer_metrics),
        ("coordinator", &coordinator_metrics),
    ] {
        for op in ["publish", "subscribe"] {
            assert_eq!(
                metrics.permission_violation_count(op),
                0,
                "{role} was refused a {op}"
            );
        }
    }
}

/// Subscribes `bus` to `subject` and expects the server to refuse it: the
/// subscription ends, and the refusal names the subject.
async fn assert_subscription_refused(who: &str, bus: &NatsBus, subject: &str) {
    let mut sub = bus.subscribe(subject).await.unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(20), sub.next())
        .await
        .unwrap_or_else(|_| panic!("{who}: the subscription to {subject} was not refused"));
    assert!(ended.is_none(), "{who} read a message on {subject}");
    assert!(
        bus.refusals().contains(&("subscribe", subject.to_owned())),
        "{who}: no refusal naming {subject}: {:?}",
        bus.refusals()
    );
}

/// Every role's user may subscribe to its own inbox prefix and to no other
/// inbox: not `_INBOX.>` (every reply on the bus), not another role's, not
/// another worker's (for the workers with their own users).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_role_subscribes_to_replies_not_its_own() {
    let server = NatsServer::start_with_config(&server_config()).expect("start nats-server");
    let (observer, _) = connect(&server, OBSERVER.0, OBSERVER.1).await;
    let users: Vec<String> = ROLES
        .iter()
        .map(|r| (*r).to_owned())
        .chain(BOUND_WORKERS.iter().map(|id| bound_user(id)))
        .collect();
    let inboxes: Vec<String> = users.iter().filter_map(|u| inbox_of(u)).collect();
    for user in &users {
        let (bus, metrics) = connect(&server, user, &password(user)).await;
        let own = inbox_of(user).unwrap();
        // Its own: what is published there arrives.
        let mut mine = bus.subscribe(&format!("{own}.>")).await.unwrap();
        let got = first_delivery(
            &observer,
            &format!("{own}.probe"),
            Bytes::from_static(b"reply"),
            &mut mine,
        )
        .await
        .unwrap_or_else(|_| panic!("{user}: nothing arrived on its own inbox"))
        .unwrap_or_else(|| panic!("{user}: its own inbox was refused: {:?}", bus.refusals()));
        assert_eq!(got.payload, Bytes::from_static(b"reply"));

        let mut others = vec!["_INBOX.>".to_owned(), "_INBOX.asyncrl.>".to_owned()];
        for inbox in &inboxes {
            // The shared worker user may read every worker's inbox (see
            // nats-auth.conf): only workers with their own users are apart.
            let shared_worker_reads =
                user == "worker" && inbox.starts_with(&worker_inbox_prefix(""));
            if *inbox != own && !shared_worker_reads {
                others.push(format!("{inbox}.>"));
            }
        }
        for subject in &others {
            assert_subscription_refused(user, &bus, subject).await;
        }
        assert_eq!(
            metrics.permission_violation_count("subscribe"),
            others.len() as u64,
            "{user}"
        );
    }
}

/// The coordinator's tasks-available hint reaches every worker user (the
/// shared one and those with their own users), and the coordinator may
/// publish it: a refused worker is woken when capacity comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinators_tasks_available_hint_reaches_every_worker_user() {
    let server = NatsServer::start_with_config(&server_config()).expect("start nats-server");
    let (coordinator, coordinator_metrics) =
        connect(&server, "coordinator", &password("coordinator")).await;
    let workers: Vec<String> = std::iter::once("worker".to_owned())
        .chain(BOUND_WORKERS.iter().map(|id| bound_user(id)))
        .collect();
    for user in &workers {
        let (bus, metrics) = connect(&server, user, &password(user)).await;
        let mut hints = bus.subscribe(TASKS_AVAILABLE).await.unwrap();
        first_delivery(&coordinator, TASKS_AVAILABLE, Bytes::new(), &mut hints)
            .await
            .unwrap_or_else(|_| panic!("{user}: no hint arrived"))
            .unwrap_or_else(|| panic!("{user}: the hint was refused: {:?}", bus.refusals()));
        assert_eq!(metrics.permission_violation_count("subscribe"), 0, "{user}");
    }
    assert_eq!(
        coordinator_metrics.permission_violation_count("publish"),
        0,
        "the coordinator was refused the hint: {:?}",
        coordinator.refusals()
    );
}

/// What `sub` yields first while `from` publishes `payload` on `subject`
/// every 200 ms (a subscription reaches the server on its own connection,
/// so the first publishes may come before it), for at most 20 s: `Err` when
/// nothing came, `Ok(None)` when the subscription ended (refused).
async fn first_delivery(
    from: &NatsBus,
    subject: &str,
    payload: Bytes,
    sub: &mut futures::stream::BoxStream<'static, asyncrl_transport::Message>,
) -> Result<Option<asyncrl_transport::Message>, tokio::time::error::Elapsed> {
    let publish = async {
        loop {
            from.publish(subject, payload.clone()).await.unwrap();
            from.flush().await.unwrap();
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    tokio::select! {
        got = tokio::time::timeout(Duration::from_secs(20), sub.next()) => got,
        () = publish => unreachable!(),
    }
}

async fn call<Rep: prost::Message + Default>(
    bus: &NatsBus,
    subject: &str,
    req: impl prost::Message,
) -> Rep {
    let payload = Bytes::from(req.encode_to_vec());
    // Until the coordinator serves the subject, nobody responds.
    let reply = asyncrl_testkit::eventually(subject, Duration::from_secs(30), || async {
        match bus
            .request(subject, payload.clone(), Duration::from_secs(10))
            .await
        {
            Err(TransportError::NoResponders { .. }) => None,
            other => Some(other.unwrap_or_else(|e| panic!("{subject}: {e}"))),
        }
    })
    .await;
    Rep::decode(reply.as_ref()).unwrap_or_else(|e| panic!("{subject}: {e}"))
}

/// The coordinator's refusals of a worker_id that is not its subject's,
/// by subject, from its metrics.
fn identity_refusals(metrics: &asyncrl_telemetry::Metrics) -> BTreeMap<String, u64> {
    let text = metrics.encode_prometheus_text().unwrap();
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("asyncrl_coordinator_bad_requests_total{") else {
            continue;
        };
        if !rest.contains("reason=\"identity\"") {
            continue;
        }
        let subject = rest
            .split("subject=\"")
            .nth(1)
            .and_then(|s| s.split('"').next())
            .unwrap()
            .to_owned();
        let value: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
        out.insert(subject, value as u64);
    }
    out
}

/// Worker `a` (its own user, from the shipped template) against worker
/// `b`'s lease, through the real coordinator service: it cannot read `b`'s
/// grant, the server refuses it `b`'s subjects (and the bare ones), and the
/// coordinator refuses, and counts, each request on `a`'s own subjects that
/// claims to be `b`. `b`'s lease is left as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_cannot_act_in_another_workers_name() {
    let server = NatsServer::start_with_config(&server_config()).expect("start nats-server");
    let dir = tempfile::tempdir().unwrap();
    let tasks = dir.path().join("arith.jsonl");
    asyncrl_coordinator::dataset::write_arith_file(&tasks, 20).unwrap();
    let mut config = Config::default();
    config.run.output_dir = dir.path().to_owned();
    config.staleness.groups_per_step = 2;
    config.staleness.eta = 1;
    config.staleness.group_size = 2;
    config.coordinator.datasets = vec![DatasetConfig::jsonl("arith", tasks)];
    config.coordinator.admin_listen = String::new();
    config.coordinator.journal_path = Some(dir.path().join("journal.jsonl"));
    let (coordinator_bus, coordinator_transport) =
        connect(&server, "coordinator", &password("coordinator")).await;
    let metrics = asyncrl_telemetry::Metrics::new();
    let coordinator = asyncrl_coordinator::Coordinator::start(
        config,
        std::sync::Arc::new(coordinator_bus),
        metrics.clone(),
        asyncrl_telemetry::Health::new(),
        &asyncrl_coordinator::ShutdownToken::new(),
    )
    .await
    .expect("start the coordinator");

    let (a, a_metrics) = connect(&server, "worker-a", &password("worker-a")).await;
    let (b, _) = connect(&server, "worker-b", &password("worker-b")).await;
    let registered: RegisterWorkerReply = call(
        &b,
        &worker_subject(WORKERS_REGISTER, "b"),
        RegisterWorker {
            worker_id: "b".into(),
            capacity: 4,
            policy_version: 0,
            hostname: "host-b".into(),
        },
    )
    .await;
    assert!(registered.accepted, "{registered:?}");

    // `a` listens for `b`'s replies: refused, it reads nothing of the grant.
    let b_inbox = format!("{}.>", worker_inbox_prefix("b"));
    let mut spy = a.subscribe(&b_inbox).await.unwrap();
    let granted: AcquireTasksReply = call(
        &b,
        &worker_subject(TASKS_ACQUIRE, "b"),
        AcquireTasks {
            worker_id: "b".into(),
            free_slots: 1,
        },
    )
    .await;
    assert_eq!(granted.tasks.len(), 1, "{granted:?}");
    let task = granted.tasks[0].clone();
    let ended = tokio::time::timeout(Duration::from_secs(20), spy.next())
        .await
        .expect("the spy's subscription is refused");
    assert!(ended.is_none(), "worker a read worker b's grant");
    assert!(
        a.refusals().contains(&("subscribe", b_inbox.clone())),
        "{:?}",
        a.refusals()
    );

    // The server: `a` may not send on `b`'s subjects, nor on the bare ones.
    for base in WORKER_REQUEST_SUBJECTS {
        for subject in [worker_subject(base, "b"), base.to_owned()] {
            let result = a
                .request(&subject, Bytes::from_static(b""), Duration::from_secs(30))
                .await;
            match result {
                Err(TransportError::PermissionDenied { op, subject: got }) => {
                    assert_eq!((op, got.as_str()), ("publish", subject.as_str()));
                }
                other => panic!("worker a sent on {subject}: {other:?}"),
            }
        }
    }
    assert_eq!(a_metrics.permission_violation_count("publish"), 10);

    // The coordinator: on `a`'s own subjects, `b`'s id is refused.
    let returned: ReturnTasksReply = call(
        &a,
        &worker_subject(TASKS_RETURN, "a"),
        ReturnTasks {
            worker_id: "b".into(),
            lease_ids: vec![task.lease_id.clone()],
            reason: "forged".into(),
            // As failed: it would count toward the task's quarantine.
            task_failed: true,
        },
    )
    .await;
    assert_eq!(returned.returned, 0);
    let completed: CompleteTaskReply = call(
        &a,
        &worker_subject(TASKS_COMPLETE, "a"),
        CompleteTask {
            worker_id: "b".into(),
            task_id: task.task_id.clone(),
            lease_id: task.lease_id.clone(),
            num_trajectories: 2,
        },
    )
    .await;
    assert!(!completed.accepted);
    assert!(
        completed.reason.contains("is not the worker \"a\""),
        "{}",
        completed.reason
    );
    let heartbeat: HeartbeatReply = call(
        &a,
        &worker_subject(WORKERS_HEARTBEAT, "a"),
        WorkerHeartbeat {
            worker_id: "b".into(),
            lease_ids: vec![task.lease_id.clone()],
            draining: true,
            ..WorkerHeartbeat::default()
        },
    )
    .await;
    assert_eq!(heartbeat, HeartbeatReply::default());
    let registered: RegisterWorkerReply = call(
        &a,
        &worker_subject(WORKERS_REGISTER, "a"),
        RegisterWorker {
            worker_id: "b".into(),
            capacity: 1,
            policy_version: 0,
            hostname: "forged".into(),
        },
    )
    .await;
    assert!(!registered.accepted);
    let acquired: AcquireTasksReply = call(
        &a,
        &worker_subject(TASKS_ACQUIRE, "a"),
        AcquireTasks {
            worker_id: "b".into(),
            free_slots: 4,
        },
    )
    .await;
    assert!(acquired.tasks.is_empty(), "{acquired:?}");
    let counted = identity_refusals(&metrics);
    let expected: BTreeMap<String, u64> = WORKER_REQUEST_SUBJECTS
        .iter()
        .map(|s| ((*s).to_owned(), 1))
        .collect();
    assert_eq!(counted, expected);

    // `b`'s lease is as it was: running, held by `b`, not draining, and `b`
    // completes it.
    let status = coordinator.status().await.unwrap();
    assert_eq!(status.running_groups, 1, "{status:?}");
    let workers = coordinator.workers().await.unwrap();
    assert!(
        workers
            .workers
            .iter()
            .all(|w| w.worker_id != "b" || !w.draining),
        "{workers:?}"
    );
    let heartbeat: HeartbeatReply = call(
        &b,
        &worker_subject(WORKERS_HEARTBEAT, "b"),
        WorkerHeartbeat {
            worker_id: "b".into(),
            lease_ids: vec![task.lease_id.clone()],
            ..WorkerHeartbeat::default()
        },
    )
    .await;
    assert!(heartbeat.revoked_lease_ids.is_empty(), "{heartbeat:?}");
    let completed: CompleteTaskReply = call(
        &b,
        &worker_subject(TASKS_COMPLETE, "b"),
        CompleteTask {
            worker_id: "b".into(),
            task_id: task.task_id.clone(),
            lease_id: task.lease_id.clone(),
            num_trajectories: 2,
        },
    )
    .await;
    assert!(completed.accepted, "{completed:?}");
    assert_eq!(coordinator.status().await.unwrap().accepted_groups, 1);

    // What the worker user may read, its own user reads too.
    let kv = a.kv(CONTROL_BUCKET).await.unwrap();
    kv.get(POLICY_VERSION_KEY).await.unwrap();
    // The coordinator's own user covers serving both subject forms.
    for op in ["subscribe", "publish"] {
        assert_eq!(
            coordinator_transport.permission_violation_count(op),
            0,
            "the coordinator was refused a {op}"
        );
    }
    coordinator.shutdown();
}
