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
        let n = self.completion_token_ids.len();
        if self.behaviour_logprobs.len() != n {
            return Err(field(
                "behaviour_logprobs",
                format!(
                    "has {} entries for {n} completion tokens",
                    self.behaviour_logprobs.len()
                ),
            ));
        }
        if self.policy_versions.len() != n {
            return Err(field(
                "policy_versions",
                format!(
                    "has {} entries for {n} completion tokens",
                    self.policy_versions.len()
                ),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::{FinishReason, Timings};

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
