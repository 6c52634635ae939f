//! The worker registry: who is there, with what capacity and version, and
//! whether it is alive (heard from within `dead_after`). Not persisted: after
//! a coordinator restart, workers reappear with their next heartbeat or
//! request.

use std::collections::BTreeMap;

/// What the coordinator knows about one worker.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerEntry {
    pub worker_id: String,
    pub hostname: String,
    /// Sequences it generates concurrently.
    pub capacity: u32,
    pub policy_version: i32,
    pub registered_at_ms: i64,
    pub last_heard_ms: i64,
    pub alive: bool,
    pub draining: bool,
    pub tokens_per_second: f64,
    /// Whether it registered (or only appeared through a heartbeat/request).
    pub registered: bool,
}

#[derive(Debug, Default, Clone)]
pub struct Registry {
    workers: BTreeMap<String, WorkerEntry>,
}

/// Outcome of a liveness sweep.
#[derive(Debug, Default, PartialEq)]
pub struct Sweep {
    pub died: Vec<String>,
}

impl Registry {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers (or re-registers) a worker.
    pub fn register(&mut self, id: &str, hostname: &str, capacity: u32, version: i32, now_ms: i64) {
        let e = self.touch(id, now_ms);
        e.hostname = hostname.to_owned();
        e.capacity = capacity;
        e.policy_version = version;
        e.registered = true;
        e.draining = false;
    }

    /// Records that a worker was heard from; creates an entry for an unknown
    /// one (e.g. after a coordinator restart). Returns true if it was dead.
    pub fn touch(&mut self, id: &str, now_ms: i64) -> &mut WorkerEntry {
        let e = self
            .workers
            .entry(id.to_owned())
            .or_insert_with(|| WorkerEntry {
                worker_id: id.to_owned(),
                hostname: String::new(),
                capacity: 0,
                policy_version: 0,
                registered_at_ms: now_ms,
                last_heard_ms: now_ms,
                alive: true,
                draining: false,
                tokens_per_second: 0.0,
                registered: false,
            });
        e.last_heard_ms = e.last_heard_ms.max(now_ms);
        e.alive = true;
        e
    }

    pub fn get(&self, id: &str) -> Option<&WorkerEntry> {
        self.workers.get(id)
    }

    /// Marks workers not heard from within `dead_after_ms` dead. Silence
    /// counts only from `hearing_since_ms` on (when the coordinator's own
    /// connection last came up): a worker that heartbeats into a server the
    /// coordinator cannot reach is not dead.
    pub fn sweep(&mut self, now_ms: i64, dead_after_ms: i64, hearing_since_ms: i64) -> Sweep {
        let mut sweep = Sweep::default();
        for e in self.workers.values_mut() {
            let heard = e.last_heard_ms.max(hearing_since_ms);
            if e.alive && now_ms - heard >= dead_after_ms {
                e.alive = false;
                sweep.died.push(e.worker_id.clone());
            }
        }
        sweep
    }

    pub fn iter(&self) -> impl Iterator<Item = &WorkerEntry> {
        self.workers.values()
    }

    pub fn live(&self) -> impl Iterator<Item = &WorkerEntry> {
        self.workers.values().filter(|w| w.alive)
    }

    pub fn alive_count(&self) -> usize {
        self.live().count()
    }

    pub fn dead_count(&self) -> usize {
        self.workers.values().filter(|w| !w.alive).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_heartbeats_mark_a_worker_dead_and_a_heartbeat_revives_it() {
        let mut r = Registry::new();
        r.register("w1", "host-a", 16, 0, 0);
        r.register("w2", "host-b", 8, 0, 0);
        r.touch("w1", 4_000);
        assert_eq!(r.sweep(5_000, 5_000, 0).died, vec!["w2".to_owned()]);
        assert_eq!((r.alive_count(), r.dead_count()), (1, 1));
        assert!(r.sweep(5_500, 5_000, 0).died.is_empty());
        assert_eq!(r.sweep(9_000, 5_000, 0).died, vec!["w1".to_owned()]);
        r.touch("w2", 9_100).tokens_per_second = 12.5;
        let w2 = r.get("w2").unwrap();
        assert!(w2.alive && w2.registered && w2.capacity == 8 && w2.hostname == "host-b");
        // An unknown worker appears through a heartbeat.
        r.touch("w3", 9_200);
        assert!(!r.get("w3").unwrap().registered);
        assert_eq!(r.iter().count(), 3);
    }

    #[test]
    fn silence_before_the_coordinator_could_hear_does_not_count() {
        let mut r = Registry::new();
        r.register("w1", "host-a", 16, 0, 0);
        // The coordinator's connection came back at 4 s: 4.9 s of silence
        // since its last heartbeat, but only 0.9 s that it could have heard.
        assert!(r.sweep(4_900, 3_000, 4_000).died.is_empty());
        // 3 s after the reconnect with nothing heard: dead.
        assert_eq!(r.sweep(7_000, 3_000, 4_000).died, vec!["w1".to_owned()]);
    }
}
