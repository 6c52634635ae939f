//! The one set of invariant checks of a run, read from the learner's
//! `trained.jsonl` ([`asyncrl_learner::outputs::TrainedStep`], described in
//! docs/contracts.md): every trajectory trained exactly once (a step
//! retrained after a learner crash lists the same trajectories), B·G
//! trajectories a step, no token older than η versions when trained,
//! versions in order (step s trains at s − 1 and publishes s), and steps
//! contiguous from 1. The chaos bench checks them at every sample and at
//! the end; the cluster tests ([`crate::cluster::Cluster::check_invariants`])
//! at the end, beside their audit of the trajectory stream.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::Path;

use asyncrl_learner::outputs::TrainedStep;

/// What `trained.jsonl` says, checked.
#[derive(Debug, Clone, Default)]
pub struct TrainedCheck {
    pub lines: usize,
    /// Highest step.
    pub max_step: u64,
    pub trajectories: usize,
    /// Steps listed more than once (trained again after a learner crash).
    pub retrained: usize,
    pub max_version_lag: f64,
    /// Largest trained_at_version − min_token_version.
    pub max_token_age: i64,
    /// The tasks trained on (`tasks` of each step; empty in a file that
    /// does not record them).
    pub tasks: BTreeSet<String>,
    pub exactly_once: Vec<String>,
    pub staleness: Vec<String>,
    pub versions: Vec<String>,
    pub contiguous: Vec<String>,
}

/// Checks the whole lines of `trained.jsonl` (the last one may be being
/// written: text after the last newline is ignored).
pub fn check_trained(text: &str, eta: u32, batch: usize) -> TrainedCheck {
    let whole = &text[..text.rfind('\n').map_or(0, |i| i + 1)];
    let mut c = TrainedCheck::default();
    let mut steps: BTreeMap<u64, TrainedStep> = BTreeMap::new();
    let mut trained_in: HashMap<String, u64> = HashMap::new();
    let mut task_in: HashMap<String, u64> = HashMap::new();
    let eta = i64::from(eta);
    for (n, raw) in whole.lines().enumerate() {
        if raw.trim().is_empty() {
            continue;
        }
        let line: TrainedStep = match serde_json::from_str(raw) {
            Ok(l) => l,
            Err(e) => {
                c.contiguous
                    .push(format!("line {} is not a step record: {e}", n + 1));
                continue;
            }
        };
        c.lines += 1;
        let step = line.step;
        if i64::from(line.published_version) != step as i64
            || i64::from(line.trained_at_version) != step as i64 - 1
        {
            c.versions.push(format!(
                "step {step} trained at version {} and published {} (expected {} and {step})",
                line.trained_at_version,
                line.published_version,
                step as i64 - 1
            ));
        }
        if line.max_version_lag > eta as f64 {
            c.staleness.push(format!(
                "step {step}: max_version_lag {} > η = {eta}",
                line.max_version_lag
            ));
        }
        let age = i64::from(line.trained_at_version) - i64::from(line.min_token_version);
        if !line.trajectories.is_empty() && age > eta {
            c.staleness.push(format!(
                "step {step}: a token of version {} trained at version {} (η = {eta})",
                line.min_token_version, line.trained_at_version
            ));
        }
        c.max_version_lag = c.max_version_lag.max(line.max_version_lag);
        if !line.trajectories.is_empty() {
            c.max_token_age = c.max_token_age.max(age);
        }
        let ids: HashSet<&String> = line.trajectories.iter().collect();
        if ids.len() != line.trajectories.len() {
            c.exactly_once
                .push(format!("step {step} lists a trajectory twice"));
        }
        if line.trajectories.len() != batch {
            c.exactly_once.push(format!(
                "step {step} trained {} trajectories, not B·G = {batch}",
                line.trajectories.len()
            ));
        }
        if let Some(prev) = steps.get(&step) {
            let before: HashSet<&String> = prev.trajectories.iter().collect();
            if before != ids {
                c.exactly_once.push(format!(
                    "step {step} was trained twice on different trajectories"
                ));
            }
            c.retrained += 1;
        } else {
            for id in &line.trajectories {
                if let Some(other) = trained_in.insert(id.clone(), step)
                    && other != step
                {
                    c.exactly_once.push(format!(
                        "trajectory {id} was trained in steps {other} and {step}"
                    ));
                }
            }
            for task in &line.tasks {
                if let Some(other) = task_in.insert(task.clone(), step)
                    && other != step
                {
                    c.exactly_once.push(format!(
                        "task {task} was trained in steps {other} and {step}"
                    ));
                }
            }
        }
        steps.insert(step, line);
    }
    c.trajectories = trained_in.len();
    c.tasks = task_in.into_keys().collect();
    c.max_step = steps.keys().next_back().copied().unwrap_or(0);
    let missing: Vec<u64> = (1..=c.max_step)
        .filter(|s| !steps.contains_key(s))
        .collect();
    if !missing.is_empty() {
        c.contiguous
            .push(format!("steps missing below {}: {missing:?}", c.max_step));
    }
    c
}

/// [`check_trained`] of the file at `path` (a run that has not trained yet
/// has none: nothing to check).
pub fn check_trained_file(path: &Path, eta: u32, batch: usize) -> TrainedCheck {
    check_trained(
        &std::fs::read_to_string(path).unwrap_or_default(),
        eta,
        batch,
    )
}

impl TrainedCheck {
    /// Every violation found, one line each (empty: every invariant holds).
    pub fn violations(&self) -> Vec<&str> {
        self.exactly_once
            .iter()
            .chain(&self.staleness)
            .chain(&self.versions)
            .chain(&self.contiguous)
            .map(String::as_str)
            .collect()
    }
}

/// Where the tasks a run issued are at its end: the loss invariant. Every
/// task the coordinator issued (every data set position before its cursor)
/// must be trained, held (by the buffer, or as trajectories still in the
/// stream), waiting to be issued again (queued, or its drop report not yet
/// applied), leased, or quarantined with its reason counted. A task in none
/// of these was lost.
#[derive(Debug, Clone, Default)]
pub struct LossCheck {
    pub issued: usize,
    pub trained: usize,
    pub held: usize,
    pub in_stream: usize,
    pub queued: usize,
    pub leased: usize,
    pub drop_pending: usize,
    pub quarantined: usize,
    /// The lost tasks' wire ids (at most 20), and how many there were.
    pub lost: Vec<String>,
    pub lost_count: usize,
}

/// Where a run's tasks are, for [`check_loss`] (wire task ids).
#[derive(Debug, Clone, Default)]
pub struct TaskWhereabouts {
    pub trained: BTreeSet<String>,
    /// Held by the stopped buffer (`asyncrl_buffer::held_tasks`).
    pub held: BTreeSet<String>,
    /// With trajectories in the trajectory stream.
    pub in_stream: BTreeSet<String>,
    /// Named by a drop report still in the GROUP_DROPS stream.
    pub drop_pending: BTreeSet<String>,
}

/// Checks [`LossCheck`] against the coordinator's persisted state;
/// `item_id` names the data set item at an index (None: out of range).
pub fn check_loss(
    state: &asyncrl_protos::v1::CoordinatorState,
    item_id: impl Fn(usize) -> Option<String>,
    at: &TaskWhereabouts,
) -> LossCheck {
    use asyncrl_protos::subjects::wire_task_id;
    let wire =
        |index: u64, epoch: u64| item_id(index as usize).map(|item| wire_task_id(&item, epoch));
    let queued: BTreeSet<String> = state
        .queue
        .iter()
        .filter_map(|t| wire(t.index, t.epoch))
        .collect();
    let leased: BTreeSet<String> = state
        .leases
        .iter()
        .filter_map(|l| wire(l.index, l.epoch))
        .collect();
    let quarantined: BTreeSet<u64> = state.quarantined.iter().copied().collect();
    let mut c = LossCheck::default();
    let len = state.dataset_len;
    for epoch in 0..=state.epoch {
        let end = if epoch == state.epoch {
            state.cursor
        } else {
            len
        };
        for index in 0..end.min(len) {
            let Some(id) = wire(index, epoch) else {
                continue;
            };
            c.issued += 1;
            if at.trained.contains(&id) {
                c.trained += 1;
            } else if at.held.contains(&id) {
                c.held += 1;
            } else if at.in_stream.contains(&id) {
                c.in_stream += 1;
            } else if queued.contains(&id) {
                c.queued += 1;
            } else if leased.contains(&id) {
                c.leased += 1;
            } else if at.drop_pending.contains(&id) {
                c.drop_pending += 1;
            } else if quarantined.contains(&index) {
                c.quarantined += 1;
            } else {
                c.lost_count += 1;
                if c.lost.len() < 20 {
                    c.lost.push(id);
                }
            }
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(step: u64, ids: &[&str], min_token: i64, lag: f64) -> String {
        serde_json::json!({
            "step": step,
            "trained_at_version": step as i64 - 1,
            "published_version": step,
            "min_token_version": min_token,
            "max_version_lag": lag,
            "trajectories": ids,
        })
        .to_string()
            + "\n"
    }

    #[test]
    fn trained_log_checks_catch_each_violation() {
        let ok = line(1, &["a", "b"], 0, 0.0) + &line(2, &["c", "d"], 0, 1.0);
        // A step trained again after a crash, on the same trajectories.
        let retrained = ok.clone() + &line(2, &["d", "c"], 0, 1.0) + &line(3, &["e", "f"], 1, 1.0);
        let c = check_trained(&retrained, 1, 2);
        assert!(c.exactly_once.is_empty() && c.staleness.is_empty(), "{c:?}");
        assert!(c.versions.is_empty() && c.contiguous.is_empty(), "{c:?}");
        assert_eq!((c.max_step, c.retrained, c.trajectories), (3, 1, 6));
        // A torn last line is not read.
        assert_eq!(
            check_trained(&(ok.clone() + "{\"step\": 3"), 1, 2).max_step,
            2
        );

        let twice = ok.clone() + &line(3, &["a", "x"], 1, 0.0);
        assert_eq!(check_trained(&twice, 1, 2).exactly_once.len(), 1);
        let other = ok.clone() + &line(2, &["c", "x"], 0, 1.0);
        assert!(!check_trained(&other, 1, 2).exactly_once.is_empty());
        let short = ok.clone() + &line(3, &["x"], 1, 0.0);
        assert_eq!(check_trained(&short, 1, 2).exactly_once.len(), 1);
        let stale = ok.clone() + &line(3, &["x", "y"], 0, 1.0);
        assert_eq!(check_trained(&stale, 1, 2).staleness.len(), 1);
        let lag = ok.clone() + &line(3, &["x", "y"], 2, 1.5);
        assert_eq!(check_trained(&lag, 1, 2).staleness.len(), 1);
        let gap = ok.clone() + &line(4, &["x", "y"], 3, 0.0);
        assert_eq!(check_trained(&gap, 1, 2).contiguous.len(), 1);
        let wrong_version = ok.replace("\"published_version\":2", "\"published_version\":1");
        assert_eq!(check_trained(&wrong_version, 1, 2).versions.len(), 1);
    }

    #[test]
    fn a_task_issued_and_found_nowhere_is_lost() {
        use asyncrl_protos::v1::{CoordinatorState, PersistedLease, TaskRef};
        let item = |i: usize| (i < 10).then(|| format!("arith-{i}"));
        let id = |i: usize| asyncrl_protos::subjects::wire_task_id(&format!("arith-{i}"), 0);
        let state = CoordinatorState {
            dataset_len: 10,
            epoch: 0,
            cursor: 8,
            queue: vec![TaskRef { index: 3, epoch: 0 }],
            leases: vec![PersistedLease {
                index: 4,
                epoch: 0,
                ..Default::default()
            }],
            quarantined: vec![7],
            ..Default::default()
        };
        let mut at = TaskWhereabouts {
            trained: [id(0), id(1)].into(),
            held: [id(2)].into(),
            in_stream: [id(5)].into(),
            drop_pending: [id(6)].into(),
        };
        let c = check_loss(&state, item, &at);
        assert_eq!(c.lost_count, 0, "{c:?}");
        assert_eq!(
            (
                c.issued,
                c.trained,
                c.held,
                c.queued,
                c.leased,
                c.in_stream,
                c.drop_pending,
                c.quarantined
            ),
            (8, 2, 1, 1, 1, 1, 1, 1)
        );
        // Task 2 neither trained nor held: lost. Tasks past the cursor
        // were never issued and count for nothing.
        at.held.clear();
        at.trained.insert(id(9));
        let c = check_loss(&state, item, &at);
        assert_eq!((c.lost_count, c.lost.clone()), (1, vec![id(2)]));
        assert_eq!(c.issued, 8);
    }

    #[test]
    fn a_task_trained_in_two_steps_is_caught_and_the_trained_tasks_are_listed() {
        let with_tasks = |step: u64, ids: &[&str], tasks: &[&str]| {
            let mut v: serde_json::Value =
                serde_json::from_str(line(step, ids, step as i64 - 1, 0.0).trim()).unwrap();
            v["tasks"] = serde_json::json!(tasks);
            v.to_string() + "\n"
        };
        let ok = with_tasks(1, &["a", "b"], &["t1"]) + &with_tasks(2, &["c", "d"], &["t2"]);
        let c = check_trained(&(ok.clone() + &with_tasks(2, &["c", "d"], &["t2"])), 1, 2);
        assert!(c.exactly_once.is_empty(), "{c:?}");
        assert_eq!(c.tasks, BTreeSet::from(["t1".into(), "t2".into()]));
        let again = ok + &with_tasks(3, &["e", "f"], &["t1"]);
        let c = check_trained(&again, 1, 2);
        assert_eq!(c.exactly_once.len(), 1, "{c:?}");
        assert!(c.exactly_once[0].contains("task t1"), "{c:?}");
    }
}
