//! The capacity model: how many rollout workers keep the learner busy.
//!
//! Inputs, all measured by the coordinator:
//! - `r`: groups per second one worker delivers while it is kept full. By
//!   Little's law `r = S / L`, with `S` the groups a worker holds at once
//!   (its registered sequence capacity / G, at least 1) and `L` its mean
//!   lease duration (grant → accepted completion, EWMA).
//! - `T`: the learner's step time without waiting for data (`learner.status`
//!   `step_train_seconds`, EWMA; until the learner reports it, the interval
//!   between consecutive weight announcements, which is an upper bound).
//! - `D`: weight-dissemination latency, announce → new weights in use at a
//!   worker (heartbeat `weight_swap_latency_ms`, EWMA; until workers report
//!   it, the time from an announcement to the first heartbeat that shows the
//!   new version, an upper bound within one heartbeat interval).
//!
//! Rule (overlap-based, after ECHO-2): the learner consumes `B` groups every
//! `T` seconds. Rollouts of the next batches overlap its training, but in each
//! step a worker spends up to `D` seconds on weights that are being replaced
//! (fetch, swap, the tokens sampled meanwhile are a version older than
//! admission assumed), so it contributes `r · (T − D)` usable groups per step:
//!
//! ```text
//! N = ceil( B / (r · (T − D)) ),   clamped to [1, max];  N = max when T ≤ D
//! ```

use std::collections::{BTreeMap, HashMap};

/// The measured inputs of the rule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CapacityInputs {
    pub groups_per_step: u32,
    /// r: groups/s of one worker kept full.
    pub worker_groups_per_second: f64,
    /// T: learner step time (s).
    pub step_seconds: f64,
    /// D: dissemination latency (s).
    pub dissemination_seconds: f64,
    pub max_workers: u32,
}

/// The rule. `None` while an input is unknown (no measurement yet).
pub fn recommended_workers(i: &CapacityInputs) -> Option<f64> {
    let (r, t, d) = (
        i.worker_groups_per_second,
        i.step_seconds,
        i.dissemination_seconds.max(0.0),
    );
    if !(r.is_finite() && r > 0.0 && t.is_finite() && t > 0.0 && d.is_finite()) {
        return None;
    }
    let max = f64::from(i.max_workers.max(1));
    let window = t - d;
    if window <= 0.0 {
        return Some(max);
    }
    let n = (f64::from(i.groups_per_step) / (r * window)).ceil();
    Some(n.clamp(1.0, max))
}

/// Exponentially weighted moving average.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Ewma {
    value: Option<f64>,
}

impl Ewma {
    const ALPHA: f64 = 0.2;

    pub fn observe(&mut self, x: f64) {
        if !x.is_finite() || x < 0.0 {
            return;
        }
        self.value = Some(match self.value {
            None => x,
            Some(v) => v + Self::ALPHA * (x - v),
        });
    }

    pub fn get(&self) -> Option<f64> {
        self.value
    }
}

/// One worker as the estimator needs it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkerView<'a> {
    pub worker_id: &'a str,
    pub capacity: u32,
    pub alive: bool,
}

/// Turns raw observations into [`CapacityInputs`].
#[derive(Debug, Default, Clone)]
pub struct CapacityEstimator {
    lease_seconds: HashMap<String, Ewma>,
    train_seconds: Ewma,
    announce_interval: Ewma,
    reported_swap: Ewma,
    observed_swap: Ewma,
    /// version → published_at (ms), the most recent few.
    announcements: BTreeMap<i32, i64>,
    last_announce: Option<(i32, i64)>,
    /// Highest version each worker was seen with.
    worker_version: HashMap<String, i32>,
}

impl CapacityEstimator {
    pub fn new() -> Self {
        Self::default()
    }

    /// A lease of `worker` completed after `seconds`.
    pub fn on_completion(&mut self, worker: &str, seconds: f64) {
        self.lease_seconds
            .entry(worker.to_owned())
            .or_default()
            .observe(seconds);
    }

    /// The learner reported the compute time of a step.
    pub fn on_train_seconds(&mut self, seconds: f64) {
        if seconds > 0.0 {
            self.train_seconds.observe(seconds);
        }
    }

    /// A weight announcement: version, its publish time and the step.
    pub fn on_announcement(&mut self, version: i32, published_ms: i64) {
        if let Some((v0, t0)) = self.last_announce
            && version > v0
            && published_ms > t0
        {
            let per_step = (published_ms - t0) as f64 / 1000.0 / f64::from(version - v0);
            self.announce_interval.observe(per_step);
        }
        if self.last_announce.is_none_or(|(v0, _)| version > v0) {
            self.last_announce = Some((version, published_ms));
        }
        self.announcements.insert(version, published_ms);
        while self.announcements.len() > 16 {
            self.announcements.pop_first();
        }
    }

    /// A heartbeat: the worker's version, the swap latency it reports (ms,
    /// 0 = unknown) and when it arrived.
    pub fn on_heartbeat(&mut self, worker: &str, version: i32, swap_latency_ms: f64, now_ms: i64) {
        if swap_latency_ms > 0.0 {
            self.reported_swap.observe(swap_latency_ms / 1000.0);
        }
        let seen = self
            .worker_version
            .entry(worker.to_owned())
            .or_insert(version);
        if version > *seen {
            *seen = version;
            if let Some(&published) = self.announcements.get(&version)
                && now_ms >= published
            {
                self.observed_swap
                    .observe((now_ms - published) as f64 / 1000.0);
            }
        }
    }

    pub fn forget_worker(&mut self, worker: &str) {
        self.lease_seconds.remove(worker);
        self.worker_version.remove(worker);
    }

    /// r: mean over live workers with a lease measurement of S / L.
    pub fn worker_groups_per_second<'a>(
        &self,
        workers: impl Iterator<Item = WorkerView<'a>>,
        group_size: u32,
    ) -> Option<f64> {
        let rates: Vec<f64> = workers
            .filter(|w| w.alive)
            .filter_map(|w| {
                let l = self.lease_seconds.get(w.worker_id)?.get()?;
                let slots = (w.capacity / group_size.max(1)).max(1);
                (l > 0.0).then(|| f64::from(slots) / l)
            })
            .collect();
        (!rates.is_empty()).then(|| rates.iter().sum::<f64>() / rates.len() as f64)
    }

    pub fn step_seconds(&self) -> Option<f64> {
        self.train_seconds.get().or(self.announce_interval.get())
    }

    pub fn dissemination_seconds(&self) -> Option<f64> {
        self.reported_swap.get().or(self.observed_swap.get())
    }

    /// The inputs, with D = 0 while no dissemination was measured.
    pub fn inputs<'a>(
        &self,
        workers: impl Iterator<Item = WorkerView<'a>>,
        groups_per_step: u32,
        group_size: u32,
        max_workers: u32,
    ) -> CapacityInputs {
        CapacityInputs {
            groups_per_step,
            worker_groups_per_second: self
                .worker_groups_per_second(workers, group_size)
                .unwrap_or(f64::NAN),
            step_seconds: self.step_seconds().unwrap_or(f64::NAN),
            dissemination_seconds: self.dissemination_seconds().unwrap_or(0.0),
            max_workers,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs(b: u32, r: f64, t: f64, d: f64) -> CapacityInputs {
        CapacityInputs {
            groups_per_step: b,
            worker_groups_per_second: r,
            step_seconds: t,
            dissemination_seconds: d,
            max_workers: 100,
        }
    }

    #[test]
    fn the_rule_on_synthetic_measurements() {
        // 8 groups per 4 s step, 0.5 groups/s per worker: 4 workers.
        assert_eq!(recommended_workers(&inputs(8, 0.5, 4.0, 0.0)), Some(4.0));
        // Half of each step spent on weights in transit doubles it.
        assert_eq!(recommended_workers(&inputs(8, 0.5, 4.0, 2.0)), Some(8.0));
        // Rounds up: 8 / (0.6 · 4) = 3.33.
        assert_eq!(recommended_workers(&inputs(8, 0.6, 4.0, 0.0)), Some(4.0));
        // A fast learner needs more workers, a slow one fewer (never 0).
        assert_eq!(recommended_workers(&inputs(8, 0.5, 1.0, 0.0)), Some(16.0));
        assert_eq!(recommended_workers(&inputs(8, 0.5, 1000.0, 0.0)), Some(1.0));
        // Dissemination slower than a step: no count keeps up; the maximum.
        assert_eq!(recommended_workers(&inputs(8, 0.5, 4.0, 4.0)), Some(100.0));
        assert_eq!(
            recommended_workers(&inputs(8, 0.001, 4.0, 0.0)),
            Some(100.0)
        );
        // Unknown inputs: no recommendation.
        assert_eq!(recommended_workers(&inputs(8, f64::NAN, 4.0, 0.0)), None);
        assert_eq!(recommended_workers(&inputs(8, 0.5, 0.0, 0.0)), None);
    }

    #[test]
    fn the_estimator_turns_observations_into_inputs() {
        let mut e = CapacityEstimator::new();
        // Two workers, 16 sequences each with G = 8 → 2 groups at once; a
        // group takes 4 s → 0.5 groups/s each.
        for _ in 0..5 {
            e.on_completion("a", 4.0);
            e.on_completion("b", 4.0);
        }
        // Learner announces every 2 s (no train-time report yet).
        for v in 1..=4 {
            e.on_announcement(v, 10_000 + 2_000 * i64::from(v));
        }
        // Workers see each version 500 ms after its announcement.
        for v in 1..=4 {
            let at = 10_000 + 2_000 * i64::from(v) + 500;
            e.on_heartbeat("a", v, 0.0, at);
            e.on_heartbeat("b", v, 0.0, at);
        }
        let workers = [
            WorkerView {
                worker_id: "a",
                capacity: 16,
                alive: true,
            },
            WorkerView {
                worker_id: "b",
                capacity: 16,
                alive: true,
            },
            WorkerView {
                worker_id: "c",
                capacity: 16,
                alive: false,
            },
        ];
        let i = e.inputs(workers.iter().copied(), 8, 8, 100);
        assert!((i.worker_groups_per_second - 0.5).abs() < 1e-9, "{i:?}");
        assert!((i.step_seconds - 2.0).abs() < 1e-9, "{i:?}");
        assert!((i.dissemination_seconds - 0.5).abs() < 1e-9, "{i:?}");
        // 8 / (0.5 · 1.5) = 10.67 → 11.
        assert_eq!(recommended_workers(&i), Some(11.0));
        // The learner's own compute time wins over announcement intervals,
        // workers' reported swap latency over heartbeat observations.
        e.on_train_seconds(4.0);
        e.on_heartbeat("a", 4, 1_000.0, 20_000);
        let i = e.inputs(workers.iter().copied(), 8, 8, 100);
        assert_eq!((i.step_seconds, i.dissemination_seconds), (4.0, 1.0));
        // 8 / (0.5 · 3) = 5.33 → 6.
        assert_eq!(recommended_workers(&i), Some(6.0));
    }
}
