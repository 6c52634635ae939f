//! Helpers shared by the learner's integration tests.

use std::collections::BTreeMap;
use std::path::Path;

use asyncrl_learner::outputs::{TRAINED_JSONL, TrainedStep, read_trained};

/// The last `trained.jsonl` entry of each step in the run folder `dir`
/// (none before the learner created the file; a step trained again after a
/// crash is listed once, as readers keep the last entry).
pub fn trained_steps(dir: &Path) -> BTreeMap<u64, TrainedStep> {
    let path = dir.join(TRAINED_JSONL);
    if !path.exists() {
        return BTreeMap::new();
    }
    read_trained(&path)
        .unwrap()
        .into_iter()
        .map(|t| (t.step, t))
        .collect()
}
