//! Helpers for the buffer's tests and benches (not part of the API).

use asyncrl_protos::{FinishReason, RewardStatus, Timings, Trajectory};

/// Trajectory number `i` of a run where every task has `g` completions:
/// task and group `i / g`, index `i % g`, `tokens` completion tokens all
/// sampled at `version` (and admitted at it), a 16-token prompt.
pub fn traj(i: u32, g: u32, version: i32, tokens: usize) -> Trajectory {
    traj_of(
        &format!("task-{}", i / g),
        &format!("lease-{}", i / g),
        i,
        i % g,
        g,
        version,
        tokens,
    )
}

/// One trajectory with everything named; `uuid_n` makes the uuid.
pub fn traj_of(
    task: &str,
    group: &str,
    uuid_n: u32,
    index: u32,
    g: u32,
    version: i32,
    tokens: usize,
) -> Trajectory {
    Trajectory {
        uuid: uuid_of(task, group, uuid_n),
        task_id: task.into(),
        group_id: group.into(),
        prompt_token_ids: (0..16).map(|k| 100 + k).collect(),
        completion_token_ids: (0..tokens as i32).map(|k| (k * 7919) % 50_000).collect(),
        behaviour_logprobs: (0..tokens).map(|k| -0.01 * (k % 100) as f32).collect(),
        policy_versions: vec![version; tokens],
        reward: (uuid_n % 2) as f32,
        reward_status: RewardStatus::Ok as i32,
        finish_reason: FinishReason::Stop as i32,
        worker_id: "w0".into(),
        timings: Some(Timings {
            started_at_unix_ms: 1_700_000_000_000,
            finished_at_unix_ms: 1_700_000_000_100,
            generation_ms: 100,
            reward_ms: 1,
            weight_swaps: 0,
        }),
        group_size: g,
        index_in_group: index,
        admission_version: version,
        turns: Vec::new(),
    }
}

/// A uuid that depends on the task, group and number (stable across runs).
pub fn uuid_of(task: &str, group: &str, n: u32) -> String {
    let mut h: u128 = 0xcbf2_9ce4_8422_2325_cbf2_9ce4_8422_2325;
    for b in task.bytes().chain([0]).chain(group.bytes()).chain([0]) {
        h = (h ^ u128::from(b)).wrapping_mul(0x0000_0000_0100_0000_0000_0000_0000_013b);
    }
    h ^= u128::from(n);
    h = h.wrapping_mul(0x0000_0000_0100_0000_0000_0000_0000_013b);
    uuid::Uuid::from_u128(h ^ u128::from(n)).to_string()
}
