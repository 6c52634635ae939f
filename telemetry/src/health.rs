//! Liveness and readiness.
//!
//! `/healthz` answers 200 for as long as the process serves HTTP. `/readyz`
//! answers 200 only when the role has declared at least one readiness
//! condition and every declared condition is ready; otherwise 503 with the
//! reasons. Conditions are named (`bus`, `weights`, `started`, ...), so each
//! part of a role reports its own state without knowing the others.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

/// A cloneable handle to the readiness conditions of one process.
#[derive(Clone, Default)]
pub struct Health {
    conditions: Arc<Mutex<BTreeMap<String, Option<String>>>>,
}

/// The readiness of a process at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    Ready,
    /// `(condition, reason)` for every condition that is not ready, in name
    /// order; a single `("started", ...)` entry when none was declared yet.
    NotReady(Vec<(String, String)>),
}

impl Health {
    pub fn new() -> Self {
        Self::default()
    }

    /// Declares condition `name` not ready, for `reason` (shown by `/readyz`).
    pub fn set_not_ready(&self, name: &str, reason: impl Into<String>) {
        self.lock().insert(name.to_owned(), Some(reason.into()));
    }

    /// Declares condition `name` ready.
    pub fn set_ready(&self, name: &str) {
        self.lock().insert(name.to_owned(), None);
    }

    /// Forgets condition `name` (e.g. a component that was shut down cleanly).
    pub fn clear(&self, name: &str) {
        self.lock().remove(name);
    }

    pub fn readiness(&self) -> Readiness {
        let conditions = self.lock();
        if conditions.is_empty() {
            return Readiness::NotReady(vec![(
                "started".to_owned(),
                "no readiness condition declared yet".to_owned(),
            )]);
        }
        let pending: Vec<(String, String)> = conditions
            .iter()
            .filter_map(|(name, reason)| reason.as_ref().map(|r| (name.clone(), r.clone())))
            .collect();
        if pending.is_empty() {
            Readiness::Ready
        } else {
            Readiness::NotReady(pending)
        }
    }

    pub fn is_ready(&self) -> bool {
        self.readiness() == Readiness::Ready
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Option<String>>> {
        // A panic while holding this lock cannot leave the map half-updated
        // (every update is one insert/remove), so a poisoned lock is usable.
        self.conditions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl fmt::Debug for Health {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Health").field(&self.readiness()).finish()
    }
}

impl fmt::Display for Readiness {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Readiness::Ready => writeln!(f, "ready"),
            Readiness::NotReady(pending) => {
                writeln!(f, "not ready")?;
                for (name, reason) in pending {
                    writeln!(f, "{name}: {reason}")?;
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_when_every_condition_is() {
        let h = Health::new();
        assert!(!h.is_ready(), "nothing declared is not ready");
        h.set_not_ready("bus", "connecting to nats://127.0.0.1:4222");
        h.set_ready("weights");
        assert_eq!(
            h.readiness(),
            Readiness::NotReady(vec![(
                "bus".into(),
                "connecting to nats://127.0.0.1:4222".into()
            )])
        );
        h.clone().set_ready("bus");
        assert!(h.is_ready());
        h.set_not_ready("weights", "fetching v3");
        assert!(h.readiness().to_string().contains("weights: fetching v3"));
        h.clear("weights");
        assert!(h.is_ready());
    }
}
