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

/// Coordinator request/reply subjects.
pub const TASKS_ACQUIRE: &str = "asyncrl.tasks.acquire";
pub const TASKS_COMPLETE: &str = "asyncrl.tasks.complete";
pub const TASKS_RETURN: &str = "asyncrl.tasks.return";
pub const WORKERS_REGISTER: &str = "asyncrl.workers.register";
pub const WORKERS_HEARTBEAT: &str = "asyncrl.workers.heartbeat";
/// Buffer request/reply subject for learner batches.
pub const BUFFER_BATCH: &str = "asyncrl.buffer.batch";
/// Buffer publishes dropped groups here (plain pub/sub).
pub const BUFFER_GROUP_DROPPED: &str = "asyncrl.buffer.group_dropped";

/// KV bucket with the control state (policy version, knobs, coordinator state).
pub const CONTROL_BUCKET: &str = "asyncrl_control";
/// Key holding the current [`crate::WeightAnnouncement`].
pub const POLICY_VERSION_KEY: &str = "policy.version";
/// Object store with the weights of each version.
pub const WEIGHTS_BUCKET: &str = "WEIGHTS";

/// Subject of one trajectory: `trajectories.<task id>`.
pub fn trajectory_subject(task_id: &str) -> String {
    format!("{TRAJECTORY_SUBJECT_PREFIX}.{task_id}")
}

/// Object name of the weights of `version`.
pub fn weights_object_name(version: i32) -> String {
    format!("policy-v{version:08}.safetensors")
}

#[cfg(test)]
mod tests {
    use super::*;

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
