//! Exponential backoff, the one used for every retry loop.

use std::time::Duration;

/// Exponential backoff between `min` and `max`: `min`, `2·min`, … capped at
/// `max`; [`Backoff::reset`] after a success.
#[derive(Debug, Clone)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    pub fn new(min: Duration, max: Duration) -> Self {
        Self {
            min,
            max: max.max(min),
            next: min,
        }
    }

    /// The delay to wait now; the following one doubles.
    pub fn next_delay(&mut self) -> Duration {
        let d = self.next;
        self.next = (self.next * 2).min(self.max);
        d
    }

    /// Back to `min` (after a success).
    pub fn reset(&mut self) {
        self.next = self.min;
    }

    /// The delay after `attempts` failures without keeping state:
    /// `min · 2^attempts`, capped at `max`.
    pub fn delay_after(min: Duration, max: Duration, attempts: usize) -> Duration {
        let exp = attempts.min(30) as u32;
        min.saturating_mul(1u32 << exp).min(max.max(min))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_to_the_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(350));
        let got: Vec<u128> = (0..4).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(got, vec![100, 200, 350, 350]);
        b.reset();
        assert_eq!(b.next_delay(), Duration::from_millis(100));
    }

    #[test]
    fn stateless_delay_matches_the_sequence() {
        let (min, max) = (Duration::from_millis(50), Duration::from_secs(2));
        let mut b = Backoff::new(min, max);
        for attempts in 0..40 {
            assert_eq!(Backoff::delay_after(min, max, attempts), b.next_delay());
        }
    }
}
