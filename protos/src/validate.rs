//! Decoding and validation of wire messages. A message that decodes but breaks
//! the contract (mismatched lengths, bad ids, non-finite log-probs, ...) is as
//! unusable as one that does not decode; both get a [`ContractError`] naming
//! the field, so that the caller can dead-letter it with the reason.

use prost::Message;

use crate::v1::{RewardStatus, Trajectory};

#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum ContractError {
    #[error("message does not decode as {message}: {reason}")]
    Decode {
        message: &'static str,
        reason: String,
    },
    #[error("field `{field}` is invalid: {reason}")]
    Field { field: &'static str, reason: String },
    #[error("arrow column `{column}` is missing or has the wrong type")]
    ArrowColumn { column: &'static str },
    #[error("arrow error: {0}")]
    Arrow(String),
}

fn field(field: &'static str, reason: impl Into<String>) -> ContractError {
    ContractError::Field {
        field,
        reason: reason.into(),
    }
}

/// Decodes a trajectory message and checks it against the contract.
pub fn decode_trajectory(bytes: &[u8]) -> Result<Trajectory, ContractError> {
    let t = Trajectory::decode(bytes).map_err(|e| ContractError::Decode {
        message: "asyncrl.v1.Trajectory",
        reason: e.to_string(),
    })?;
    t.validate()?;
    Ok(t)
}

impl Trajectory {
    /// Checks the invariants every consumer relies on.
    pub fn validate(&self) -> Result<(), ContractError> {
        uuid::Uuid::parse_str(&self.uuid).map_err(|e| field("uuid", e.to_string()))?;
        if self.task_id.is_empty() {
            return Err(field("task_id", "is empty"));
        }
        if self.group_id.is_empty() {
            return Err(field("group_id", "is empty"));
        }
        if self.prompt_token_ids.is_empty() {
            return Err(field("prompt_token_ids", "is empty"));
        }
        if let Some(t) = self.prompt_token_ids.iter().find(|t| **t < 0) {
            return Err(field("prompt_token_ids", format!("negative token id {t}")));
        }
        if let Some(t) = self.completion_token_ids.iter().find(|t| **t < 0) {
            return Err(field(
                "completion_token_ids",
                format!("negative token id {t}"),
            ));
        }
        let n = self.model_token_count()?;
        let what = if self.turns.is_empty() {
            "completion tokens"
        } else {
            "model tokens"
        };
        if self.behaviour_logprobs.len() != n {
            return Err(field(
                "behaviour_logprobs",
                format!(
                    "has {} entries for {n} {what}",
                    self.behaviour_logprobs.len()
                ),
            ));
        }
        if self.policy_versions.len() != n {
            return Err(field(
                "policy_versions",
                format!("has {} entries for {n} {what}", self.policy_versions.len()),
            ));
        }
        if let Some(lp) = self
            .behaviour_logprobs
            .iter()
            .find(|lp| !lp.is_finite() || **lp > 1e-3)
        {
            return Err(field(
                "behaviour_logprobs",
                format!("{lp} is not a log-probability"),
            ));
        }
        if let Some(v) = self.policy_versions.iter().find(|v| **v < 0) {
            return Err(field("policy_versions", format!("negative version {v}")));
        }
        if self.policy_versions.windows(2).any(|w| w[1] < w[0]) {
            return Err(field(
                "policy_versions",
                "versions go backwards within a completion",
            ));
        }
        if self.admission_version < 0 {
            return Err(field("admission_version", "is negative"));
        }
        if self.group_size == 0 {
            return Err(field("group_size", "is 0"));
        }
        if self.index_in_group >= self.group_size {
            return Err(field(
                "index_in_group",
                format!(
                    "{} is not below group_size {}",
                    self.index_in_group, self.group_size
                ),
            ));
        }
        match RewardStatus::try_from(self.reward_status) {
            Ok(RewardStatus::Ok) if !self.reward.is_finite() => {
                return Err(field("reward", format!("{} is not finite", self.reward)));
            }
            Ok(RewardStatus::Ok | RewardStatus::Failed) => {}
            Ok(RewardStatus::Unspecified) | Err(_) => {
                return Err(field(
                    "reward_status",
                    format!("{} is not OK or FAILED", self.reward_status),
                ));
            }
        }
        Ok(())
    }

    /// The number of completion tokens the policy sampled: all of them for a
    /// single-turn completion, the turns' model tokens for an episode, whose
    /// turns must cover the completion exactly (the first with no context
    /// tokens, each with at least one model token, rewards finite).
    pub fn model_token_count(&self) -> Result<usize, ContractError> {
        model_token_count(&self.turns, self.completion_token_ids.len())
    }

    /// Per completion token: whether the policy sampled it (its log-prob and
    /// version are the next entries of `behaviour_logprobs` and
    /// `policy_versions`). All true for a single-turn completion. Assumes a
    /// valid trajectory ([`Trajectory::validate`]).
    pub fn model_token_mask(&self) -> Vec<bool> {
        model_token_mask(&self.turns, self.completion_token_ids.len())
    }

    /// The oldest policy version that produced a token of this trajectory
    /// (the admission version when the completion is empty).
    pub fn oldest_version(&self) -> i32 {
        self.policy_versions
            .iter()
            .copied()
            .min()
            .unwrap_or(self.admission_version)
    }
}

/// The number of model tokens of a `completion_len`-token completion laid
/// out by `turns` (see [`Trajectory::model_token_count`]); an error names
/// what is wrong with the layout.
pub fn model_token_count(
    turns: &[crate::v1::Turn],
    completion_len: usize,
) -> Result<usize, ContractError> {
    let n = completion_len;
    if turns.is_empty() {
        return Ok(n);
    }
    if turns[0].context_tokens != 0 {
        return Err(field(
            "turns",
            format!(
                "turn 0 has {} context tokens; the prompt precedes the first reply",
                turns[0].context_tokens
            ),
        ));
    }
    let mut covered = 0usize;
    let mut model = 0usize;
    for (i, turn) in turns.iter().enumerate() {
        if turn.model_tokens == 0 {
            return Err(field("turns", format!("turn {i} has no model token")));
        }
        if let Some(r) = turn.reward.filter(|r| !r.is_finite()) {
            return Err(field(
                "turns",
                format!("turn {i}'s reward {r} is not finite"),
            ));
        }
        covered += turn.context_tokens as usize + turn.model_tokens as usize;
        model += turn.model_tokens as usize;
    }
    if covered != n {
        return Err(field(
            "turns",
            format!("cover {covered} tokens of a {n}-token completion"),
        ));
    }
    Ok(model)
}

/// Per completion token of a `completion_len`-token completion laid out by
/// `turns`: whether the policy sampled it. Empty `turns`: every token.
pub fn model_token_mask(turns: &[crate::v1::Turn], completion_len: usize) -> Vec<bool> {
    if turns.is_empty() {
        return vec![true; completion_len];
    }
    let mut mask = Vec::with_capacity(completion_len);
    for t in turns {
        mask.extend(std::iter::repeat_n(false, t.context_tokens as usize));
        mask.extend(std::iter::repeat_n(true, t.model_tokens as usize));
    }
    mask.resize(completion_len, false);
    mask
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::{FinishReason, Timings, Turn};

    pub(crate) fn sample() -> Trajectory {
        Trajectory {
            uuid: "7c9e6679-7425-40de-944b-e07fc1f90ae7".into(),
            task_id: "arith-17".into(),
            group_id: "lease-1".into(),
            prompt_token_ids: vec![1, 2, 3],
            completion_token_ids: vec![4, 5],
            behaviour_logprobs: vec![-0.5, -1.25],
            policy_versions: vec![3, 4],
            reward: 1.0,
            reward_status: RewardStatus::Ok as i32,
            finish_reason: FinishReason::Stop as i32,
            worker_id: "w0".into(),
            timings: Some(Timings {
                generation_ms: 12,
                ..Default::default()
            }),
            group_size: 4,
            index_in_group: 1,
            admission_version: 3,
            turns: Vec::new(),
        }
    }

    /// A two-turn episode: 2 model tokens, 3 context tokens, 1 model token.
    pub(crate) fn episode() -> Trajectory {
        Trajectory {
            completion_token_ids: vec![4, 5, 6, 7, 8, 9],
            behaviour_logprobs: vec![-0.5, -1.25, -0.125],
            policy_versions: vec![3, 3, 4],
            turns: vec![
                Turn {
                    context_tokens: 0,
                    model_tokens: 2,
                    reward: None,
                },
                Turn {
                    context_tokens: 3,
                    model_tokens: 1,
                    reward: Some(1.0),
                },
            ],
            ..sample()
        }
    }

    /// One case: mutate a valid trajectory, expect the named field to be refused.
    fn check(name: &str, mutate: impl Fn(&mut Trajectory), expect_field: Option<&str>) {
        let mut t = sample();
        mutate(&mut t);
        let got = decode_trajectory(&t.encode_to_vec());
        match (got, expect_field) {
            (Ok(back), None) => {
                assert_eq!(
                    back.encode_to_vec(),
                    t.encode_to_vec(),
                    "{name}: round trip changed the message"
                )
            }
            (Err(ContractError::Field { field, .. }), Some(want)) => {
                assert_eq!(field, want, "{name}: wrong field blamed")
            }
            (got, want) => panic!("{name}: expected {want:?}, got {got:?}"),
        }
    }

    #[test]
    fn contract_table() {
        check("valid", |_| {}, None);
        check(
            "empty completion is fine",
            |t| {
                t.completion_token_ids.clear();
                t.behaviour_logprobs.clear();
                t.policy_versions.clear();
            },
            None,
        );
        check(
            "failed reward may be NaN",
            |t| {
                t.reward_status = RewardStatus::Failed as i32;
                t.reward = f32::NAN;
            },
            None,
        );
        check("bad uuid", |t| t.uuid = "nope".into(), Some("uuid"));
        check("no task", |t| t.task_id.clear(), Some("task_id"));
        check("no group", |t| t.group_id.clear(), Some("group_id"));
        check(
            "no prompt",
            |t| t.prompt_token_ids.clear(),
            Some("prompt_token_ids"),
        );
        check(
            "negative token",
            |t| t.completion_token_ids[0] = -1,
            Some("completion_token_ids"),
        );
        check(
            "short logprobs",
            |t| {
                t.behaviour_logprobs.pop();
            },
            Some("behaviour_logprobs"),
        );
        check(
            "short versions",
            |t| {
                t.policy_versions.pop();
            },
            Some("policy_versions"),
        );
        check(
            "positive logprob",
            |t| t.behaviour_logprobs[0] = 0.7,
            Some("behaviour_logprobs"),
        );
        check(
            "nan logprob",
            |t| t.behaviour_logprobs[0] = f32::NAN,
            Some("behaviour_logprobs"),
        );
        check(
            "versions backwards",
            |t| t.policy_versions = vec![5, 4],
            Some("policy_versions"),
        );
        check(
            "negative version",
            |t| t.policy_versions = vec![-1, 0],
            Some("policy_versions"),
        );
        check("zero group", |t| t.group_size = 0, Some("group_size"));
        check(
            "index out of group",
            |t| t.index_in_group = 4,
            Some("index_in_group"),
        );
        check("nan reward", |t| t.reward = f32::INFINITY, Some("reward"));
        check(
            "unspecified reward status",
            |t| t.reward_status = 0,
            Some("reward_status"),
        );
    }

    /// Like [`check`], on [`episode`].
    fn check_episode(name: &str, mutate: impl Fn(&mut Trajectory), expect_field: Option<&str>) {
        let mut t = episode();
        mutate(&mut t);
        let got = decode_trajectory(&t.encode_to_vec());
        match (got, expect_field) {
            (Ok(back), None) => assert_eq!(back, t, "{name}: round trip changed the message"),
            (Err(ContractError::Field { field, .. }), Some(want)) => {
                assert_eq!(field, want, "{name}: wrong field blamed")
            }
            (got, want) => panic!("{name}: expected {want:?}, got {got:?}"),
        }
    }

    #[test]
    fn episode_contract_table() {
        check_episode("valid", |_| {}, None);
        check_episode(
            "log-probs for context tokens too",
            |t| t.behaviour_logprobs = vec![-0.5; 6],
            Some("behaviour_logprobs"),
        );
        check_episode(
            "versions for context tokens too",
            |t| t.policy_versions = vec![3; 6],
            Some("policy_versions"),
        );
        check_episode(
            "turns short of the completion",
            |t| t.completion_token_ids.push(10),
            Some("turns"),
        );
        check_episode(
            "context before the first reply",
            |t| t.turns[0].context_tokens = 1,
            Some("turns"),
        );
        check_episode(
            "a turn without a model token",
            |t| {
                t.turns[1].model_tokens = 0;
                t.turns[1].context_tokens = 4;
                t.behaviour_logprobs.pop();
                t.policy_versions.pop();
            },
            Some("turns"),
        );
        check_episode(
            "non-finite turn reward",
            |t| t.turns[1].reward = Some(f32::NAN),
            Some("turns"),
        );
        let t = episode();
        assert_eq!(
            t.model_token_mask(),
            vec![true, true, false, false, false, true]
        );
        assert_eq!(t.oldest_version(), 3);
        assert_eq!(sample().model_token_mask(), vec![true, true]);
    }

    #[test]
    fn garbage_is_a_decode_error() {
        let err = decode_trajectory(&[0xff, 0xff, 0xff]).unwrap_err();
        assert!(matches!(err, ContractError::Decode { .. }), "{err}");
    }

    #[test]
    fn oldest_version() {
        assert_eq!(sample().oldest_version(), 3);
        let mut t = sample();
        t.policy_versions.clear();
        assert_eq!(t.oldest_version(), 3);
    }

    proptest::proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            let _ = decode_trajectory(&bytes);
        }
    }
}
