//! GRPO advantages: each completion's reward relative to its group.

/// How rewards are normalised within a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdvantageNorm {
    /// `A_i = r_i − mean(r)` (Dr. GRPO: no std division).
    Mean,
    /// `A_i = (r_i − mean(r)) / (std(r) + 1e-6)`, population std (the
    /// original GRPO).
    #[default]
    MeanStd,
}

/// Group-normalised advantages. A completion whose reward failed (`None`)
/// gets no advantage (`None`: it is masked out of the loss, never treated as
/// a reward of 0) and does not enter the group statistics. A group with
/// fewer than two scored completions carries no signal: all advantages 0.
pub fn grpo_advantages(rewards: &[Option<f32>], norm: AdvantageNorm) -> Vec<Option<f32>> {
    let scored: Vec<f64> = rewards.iter().flatten().map(|r| f64::from(*r)).collect();
    if scored.len() < 2 {
        return rewards.iter().map(|r| r.map(|_| 0.0)).collect();
    }
    let n = scored.len() as f64;
    let mean = scored.iter().sum::<f64>() / n;
    let scale = match norm {
        AdvantageNorm::Mean => 1.0,
        AdvantageNorm::MeanStd => {
            let var = scored.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / n;
            1.0 / (var.sqrt() + 1e-6)
        }
    };
    rewards
        .iter()
        .map(|r| r.map(|r| ((f64::from(r) - mean) * scale) as f32))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(rewards: &[Option<f32>], norm: AdvantageNorm, want: &[Option<f32>]) {
        let got = grpo_advantages(rewards, norm);
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            match (g, w) {
                (Some(g), Some(w)) => assert!(
                    (g - w).abs() < 1e-4,
                    "{rewards:?} {norm:?}: got {got:?}, want {want:?}"
                ),
                (None, None) => {}
                _ => panic!("{rewards:?} {norm:?}: got {got:?}, want {want:?}"),
            }
        }
    }

    #[test]
    fn advantage_table() {
        use AdvantageNorm::*;
        let s = Some;
        check(
            &[s(1.0), s(0.0), s(0.0), s(1.0)],
            Mean,
            &[s(0.5), s(-0.5), s(-0.5), s(0.5)],
        );
        check(
            &[s(1.0), s(0.0), s(0.0), s(1.0)],
            MeanStd,
            &[s(1.0), s(-1.0), s(-1.0), s(1.0)],
        );
        // All equal: no signal, and no division by zero.
        check(
            &[s(1.0), s(1.0), s(1.0)],
            MeanStd,
            &[s(0.0), s(0.0), s(0.0)],
        );
        // A failed reward is masked, not a 0.
        check(&[s(1.0), None, s(0.0)], Mean, &[s(0.5), None, s(-0.5)]);
        // One scored completion: nothing to compare with.
        check(&[s(1.0), None], MeanStd, &[s(0.0), None]);
        check(&[], Mean, &[]);
        // Fractional rewards (the long-tailed task).
        check(&[s(0.25), s(0.75)], Mean, &[s(-0.25), s(0.25)]);
    }
}
