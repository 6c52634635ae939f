//! NATS subjects, stream, bucket and object-store names: the addresses of the
//! contract. Every role uses these constants (optionally under a run prefix),
//! never string literals of its own.

/// JetStream stream holding every published trajectory.
pub const TRAJECTORY_STREAM: &str = "TRAJECTORIES";
/// Subject trajectories are published on (`trajectories.<task id>`).
pub const TRAJECTORY_SUBJECT_PREFIX: &str = "trajectories";
/// Dead-letter stream for messages the buffer could not decode.
pub const DEAD_LETTER_STREAM: &str = "TRAJECTORIES_DLQ";
pub const DEAD_LETTER_SUBJECT: &str = "trajectories_dlq";
/// The most payload bytes a dead letter carries (the rest is cut, and the
/// letter says so): far below any server's `max_payload`, so a letter is
/// always published.
pub const DEAD_LETTER_PAYLOAD_MAX: usize = 64 * 1024;

/// Coordinator request/reply subjects.
pub const TASKS_ACQUIRE: &str = "asyncrl.tasks.acquire";
pub const TASKS_COMPLETE: &str = "asyncrl.tasks.complete";
pub const TASKS_RETURN: &str = "asyncrl.tasks.return";
pub const WORKERS_REGISTER: &str = "asyncrl.workers.register";
pub const WORKERS_HEARTBEAT: &str = "asyncrl.workers.heartbeat";
/// The coordinator's hint that capacity came back without a new policy
/// version (a group the buffer dropped returned its share: no reward
/// signal, or stale and issued again; leases expired, ended with a dead
/// worker or returned; a knob change), published with an empty payload
/// (plain publish, fire-and-forget). A worker whose acquire was refused
/// asks again at once instead of at the refusal's `retry_after_ms`; a hint
/// that is lost costs only that wait.
pub const TASKS_AVAILABLE: &str = "asyncrl.tasks.available";
/// The coordinator's request subjects, each of which a worker addresses
/// with its own id appended (`asyncrl.tasks.acquire.<worker id>`,
/// [`worker_subject`]): the NATS permission of a worker's user names the
/// subjects of its id only, so the server refuses a request a worker makes
/// in another worker's name, and the coordinator refuses a request whose
/// `worker_id` is not the one its subject names (docs/decisions.md, "Worker
/// identity is the request subject").
pub const WORKER_REQUEST_SUBJECTS: [&str; 5] = [
    WORKERS_REGISTER,
    WORKERS_HEARTBEAT,
    TASKS_ACQUIRE,
    TASKS_COMPLETE,
    TASKS_RETURN,
];

/// The subject worker `worker_id` sends a request of `base` (one of
/// [`WORKER_REQUEST_SUBJECTS`]) on: `<base>.<worker id>`.
pub fn worker_subject(base: &str, worker_id: &str) -> String {
    format!("{base}.{worker_id}")
}

/// The subjects of `base` of every worker (`<base>.*`), which the
/// coordinator serves.
pub fn worker_subject_pattern(base: &str) -> String {
    worker_subject(base, "*")
}

/// The worker id a request subject of `base` names (`<base>.<id>`); None
/// for `base` itself or any other subject.
pub fn subject_worker<'a>(subject: &'a str, base: &str) -> Option<&'a str> {
    subject
        .strip_prefix(base)?
        .strip_prefix('.')
        .filter(|id| !id.is_empty() && !id.contains('.'))
}

/// The root of every asyncrl inbox. NATS delivers the replies to a request
/// (and JetStream API answers, watch and object-store deliveries) on the
/// requester's inbox; each role process uses its own prefix under this one
/// (`bus.inbox_prefix`), so that its user may subscribe to its own replies
/// only, not to every reply on the bus (`_INBOX.>`).
pub const INBOX_ROOT: &str = "_INBOX.asyncrl";

/// The inbox prefix of a role process (`_INBOX.asyncrl.<role>`) of the
/// coordinator, buffer and learner.
pub fn role_inbox_prefix(role: &str) -> String {
    format!("{INBOX_ROOT}.{role}")
}

/// The inbox prefix of rollout worker `worker_id`
/// (`_INBOX.asyncrl.worker.<worker id>`).
pub fn worker_inbox_prefix(worker_id: &str) -> String {
    format!("{INBOX_ROOT}.worker.{worker_id}")
}

/// Buffer request/reply subject for learner batches.
pub const BUFFER_BATCH: &str = "asyncrl.buffer.batch";
/// The buffer reports each group it dropped here (`asyncrl.v1.GroupDropped`),
/// into the [`GROUP_DROPS`] stream: a report is never lost while the
/// coordinator is down or reconnecting, because a dropped group's task must
/// be issued again.
pub const BUFFER_GROUP_DROPPED: &str = "asyncrl.buffer.group_dropped";
/// The stream holding the buffer's drop reports until the coordinator has
/// applied (and persisted) each one.
pub const GROUP_DROP_STREAM: &str = "GROUP_DROPS";
/// The coordinator's durable consumer of [`GROUP_DROP_STREAM`].
pub const GROUP_DROP_CONSUMER: &str = "asyncrl-coordinator";

/// KV bucket with the control state (policy version, knobs, coordinator state).
pub const CONTROL_BUCKET: &str = "asyncrl_control";
/// Key holding the current [`crate::WeightAnnouncement`].
pub const POLICY_VERSION_KEY: &str = "policy.version";
/// Object store with the weights of each version.
pub const WEIGHTS_BUCKET: &str = "WEIGHTS";

/// KV key (in [`CONTROL_BUCKET`]) of the coordinator's persisted state
/// (`asyncrl.v1.CoordinatorState`).
pub const COORDINATOR_STATE_KEY: &str = "coordinator.state";
/// KV key the learner writes its `asyncrl.v1.LearnerStatus` to.
pub const LEARNER_STATUS_KEY: &str = "learner.status";
/// The run's learner lease (`LearnerLease`): the learner that may seal steps
/// and announce versions.
pub const LEARNER_LEASE_KEY: &str = "learner.lease";
/// KV key of the coordinator's `asyncrl.v1.EpochsClosed`: the data set
/// epochs no attempt of which will be issued or counted again.
pub const EPOCHS_CLOSED_KEY: &str = "coordinator.closed_epoch";
/// KV key of the knob schedule (`asyncrl.v1.KnobSchedule`).
pub const KNOBS_KEY: &str = "knobs";
/// Queue group of the coordinator's request subjects.
pub const COORDINATOR_QUEUE_GROUP: &str = "asyncrl-coordinator";
/// Queue group of the buffer's batch server.
pub const BUFFER_QUEUE_GROUP: &str = "asyncrl-buffer";
/// Format of the weights objects (`WeightAnnouncement.format`).
pub const WEIGHTS_FORMAT: &str = "safetensors";
/// `WeightAnnouncement.format` of a version in a shared folder.
pub const WEIGHTS_FORMAT_FOLDER: &str = "hf-folder";
/// The folder of a version under the shared_path transport's root.
pub fn weights_folder_name(version: i32) -> String {
    format!("{WEIGHTS_FOLDER_PREFIX}{version:08}")
}

/// The version a folder name of [`weights_folder_name`] holds.
pub fn weights_folder_version(name: &str) -> Option<i32> {
    let digits = name.strip_prefix(WEIGHTS_FOLDER_PREFIX)?;
    (digits.len() == 8 && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
}

/// The name a version folder is written under before it is renamed into
/// place (a cut-off write leaves it behind).
pub fn weights_folder_tmp_name(version: i32) -> String {
    format!(".{}.tmp", weights_folder_name(version))
}

const WEIGHTS_FOLDER_PREFIX: &str = "policy-v";

/// A JetStream stream of the contract: its name and the subjects it holds.
/// Retention and the duplicate window come from the deployment's bus
/// settings (`asyncrl_control::streams` builds the full spec).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamContract {
    pub name: &'static str,
    pub subjects: &'static [&'static str],
}

/// The stream the workers publish trajectories to.
pub const TRAJECTORIES: StreamContract = StreamContract {
    name: TRAJECTORY_STREAM,
    subjects: &["trajectories.>"],
};

/// The stream of messages the buffer could not use (`asyncrl.v1.DeadLetter`).
pub const DEAD_LETTERS: StreamContract = StreamContract {
    name: DEAD_LETTER_STREAM,
    subjects: &[DEAD_LETTER_SUBJECT],
};

/// The stream of the buffer's dropped-group reports.
pub const GROUP_DROPS: StreamContract = StreamContract {
    name: GROUP_DROP_STREAM,
    subjects: &[BUFFER_GROUP_DROPPED],
};

/// Subject of one trajectory: `trajectories.<task id>`.
pub fn trajectory_subject(task_id: &str) -> String {
    format!("{TRAJECTORY_SUBJECT_PREFIX}.{task_id}")
}

const WEIGHTS_OBJECT_PREFIX: &str = "policy-v";
const WEIGHTS_OBJECT_SUFFIX: &str = ".safetensors";

/// Object name of the weights of `version`.
pub fn weights_object_name(version: i32) -> String {
    format!("{WEIGHTS_OBJECT_PREFIX}{version:08}{WEIGHTS_OBJECT_SUFFIX}")
}

/// The version whose weights an object of the weights store holds (None for
/// any other object).
pub fn weights_object_version(name: &str) -> Option<i32> {
    name.strip_prefix(WEIGHTS_OBJECT_PREFIX)?
        .strip_suffix(WEIGHTS_OBJECT_SUFFIX)?
        .parse()
        .ok()
}

/// The task id on the wire: the data set item's id and the epoch
/// (`arith-17-e0`), so that every epoch's attempt at an item is its own GRPO
/// group (the buffer keeps the first complete group per task id).
pub fn wire_task_id(item_id: &str, epoch: u64) -> String {
    format!("{item_id}-e{epoch}")
}

/// The item id and epoch of a wire task id.
pub fn split_wire_task_id(task_id: &str) -> Option<(&str, u64)> {
    let (id, epoch) = task_id.rsplit_once("-e")?;
    Some((id, epoch.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weight_object_names_round_trip() {
        for v in [0, 7, 12_345_678, i32::MAX] {
            assert_eq!(weights_object_version(&weights_object_name(v)), Some(v));
        }
        assert_eq!(weights_object_version("policy-vx.safetensors"), None);
        assert_eq!(weights_object_version("other-v00000001.safetensors"), None);
        assert_eq!(weights_object_version("policy-v00000001.bin"), None);
    }

    #[test]
    fn wire_task_ids_round_trip() {
        assert_eq!(wire_task_id("arith-17", 3), "arith-17-e3");
        assert_eq!(split_wire_task_id("arith-17-e3"), Some(("arith-17", 3)));
        assert_eq!(split_wire_task_id("my-exam-e-e12"), Some(("my-exam-e", 12)));
        assert_eq!(split_wire_task_id("arith-17"), None);
        assert_eq!(split_wire_task_id("arith-17-ex"), None);
    }

    #[test]
    fn worker_subjects_name_their_worker() {
        let subject = worker_subject(TASKS_RETURN, "w-1");
        assert_eq!(subject, "asyncrl.tasks.return.w-1");
        assert_eq!(subject_worker(&subject, TASKS_RETURN), Some("w-1"));
        assert_eq!(subject_worker(&subject, TASKS_COMPLETE), None);
        assert_eq!(subject_worker(TASKS_RETURN, TASKS_RETURN), None);
        assert_eq!(
            subject_worker("asyncrl.tasks.returns.w", TASKS_RETURN),
            None
        );
        assert_eq!(
            subject_worker("asyncrl.tasks.return.a.b", TASKS_RETURN),
            None
        );
        assert_eq!(
            worker_subject_pattern(TASKS_RETURN),
            "asyncrl.tasks.return.*"
        );
    }

    #[test]
    fn inbox_prefixes_are_apart() {
        assert_eq!(role_inbox_prefix("learner"), "_INBOX.asyncrl.learner");
        assert_eq!(worker_inbox_prefix("w-1"), "_INBOX.asyncrl.worker.w-1");
    }

    #[test]
    fn trajectory_subjects_are_in_their_stream() {
        let subject = trajectory_subject("arith-1-e0");
        let wildcard = TRAJECTORIES.subjects[0];
        assert!(
            subject.starts_with(wildcard.trim_end_matches('>')),
            "{subject} {wildcard}"
        );
    }

    #[test]
    fn weight_object_names_sort_by_version() {
        let mut names: Vec<String> = [10, 2, 1000, 0]
            .iter()
            .map(|v| weights_object_name(*v))
            .collect();
        names.sort();
        assert_eq!(
            names,
            vec![
                weights_object_name(0),
                weights_object_name(2),
                weights_object_name(10),
                weights_object_name(1000)
            ]
        );
    }
}
