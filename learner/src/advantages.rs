//! Group advantages: each completion's reward relative to its group (GRPO,
//! Dr. GRPO, RLOO).

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
    /// `A_i = r_i − mean_{j≠i} r_j` over the group's other scored
    /// completions (RLOO's leave-one-out baseline, Ahmadian et al. 2024,
    /// arXiv:2402.14740); equal to `n/(n − 1)·(r_i − mean(r))`.
    LeaveOneOut,
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
        AdvantageNorm::LeaveOneOut => n / (n - 1.0),
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
        // Leave-one-out: the mean of the others is the baseline.
        // r = [1, 0, 0, 1]: the others of r_0 average 1/3, so A_0 = 2/3.
        check(
            &[s(1.0), s(0.0), s(0.0), s(1.0)],
            LeaveOneOut,
            &[s(2.0 / 3.0), s(-2.0 / 3.0), s(-2.0 / 3.0), s(2.0 / 3.0)],
        );
        // r = [3, 1, 2]: baselines 1.5, 2.5, 2; a failed reward is not
        // among the others.
        check(
            &[s(3.0), s(1.0), None, s(2.0)],
            LeaveOneOut,
            &[s(1.5), s(-1.5), None, s(0.0)],
        );
        check(&[s(1.0), None], LeaveOneOut, &[s(0.0), None]);
        // Fractional rewards (the long-tailed task).
        check(&[s(0.25), s(0.75)], Mean, &[s(-0.25), s(0.25)]);
    }
}
