//! Verifiers of the built-in tasks.

use crate::BuiltinTask;

/// The verdict on one completion.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    Reward(f32),
    /// The data set has no built-in verifier (use a reward service).
    NoVerifier,
}

/// Scores a completion (the decoded text after the prompt, without the stop
/// token) against the reference answer, with the built-in verifier named
/// `verifier`.
///
/// - `arith`: 1 if the completion, trimmed, is exactly the answer, else 0.
/// - `reverse`: the fraction of answer positions whose character is right,
///   over `max(len(answer), len(completion))`, so that extra characters
///   cost as much as missing ones.
/// - `math`: [`crate::math_reward`], 1 if the final numbers agree.
pub fn score(verifier: &str, completion: &str, answer: &str) -> Verdict {
    if verifier == "math" {
        return Verdict::Reward(crate::math_reward(completion, answer));
    }
    match BuiltinTask::from_name(verifier) {
        Some(BuiltinTask::Arith | BuiltinTask::HiddenSum) => {
            Verdict::Reward(if completion.trim() == answer {
                1.0
            } else {
                0.0
            })
        }
        Some(BuiltinTask::Reverse) => {
            let got: Vec<char> = completion.trim().chars().collect();
            let want: Vec<char> = answer.chars().collect();
            let denom = got.len().max(want.len());
            if denom == 0 {
                return Verdict::Reward(1.0);
            }
            let right = got.iter().zip(&want).filter(|(g, w)| g == w).count();
            Verdict::Reward(right as f32 / denom as f32)
        }
        None => Verdict::NoVerifier,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verifier_table() {
        let cases: &[(&str, &str, &str, Verdict)] = &[
            ("arith", "95", "95", Verdict::Reward(1.0)),
            ("arith", " 95 ", "95", Verdict::Reward(1.0)),
            ("arith", "95 ", "-95", Verdict::Reward(0.0)),
            ("arith", "950", "95", Verdict::Reward(0.0)),
            ("arith", "", "95", Verdict::Reward(0.0)),
            ("arith", "-3", "-3", Verdict::Reward(1.0)),
            ("reverse", "54321", "54321", Verdict::Reward(1.0)),
            ("reverse", "54300", "54321", Verdict::Reward(0.6)),
            ("reverse", "5432", "54321", Verdict::Reward(0.8)),
            ("reverse", "5432199", "54321", Verdict::Reward(5.0 / 7.0)),
            ("reverse", "", "54", Verdict::Reward(0.0)),
            ("custom", "x", "y", Verdict::NoVerifier),
            ("service", "x", "y", Verdict::NoVerifier),
            (
                "math",
                "so \\boxed{72}",
                "... #### 72",
                Verdict::Reward(1.0),
            ),
            ("math", "71", "#### 72", Verdict::Reward(0.0)),
        ];
        for (dataset, completion, answer, want) in cases {
            assert_eq!(
                &score(dataset, completion, answer),
                want,
                "{dataset} {completion:?} vs {answer:?}"
            );
        }
    }

    proptest::proptest! {
        #[test]
        fn reverse_reward_is_a_fraction(c in "[0-9]{0,70}", a in "[0-9]{1,64}") {
            match score("reverse", &c, &a) {
                Verdict::Reward(r) => proptest::prop_assert!((0.0..=1.0).contains(&r)),
                other => proptest::prop_assert!(false, "{other:?}"),
            }
        }
    }
}
