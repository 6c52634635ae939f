//! The per-process metrics registry.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};

use prometheus_client::encoding::EncodeMetric;
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::{Metric, Registry, Unit};

use crate::TelemetryError;
use crate::exposition::openmetrics_to_prometheus_text;

/// Prefix of every metric of the process: `asyncrl_`.
pub const METRIC_PREFIX: &str = "asyncrl";

/// A handle to the process's one metrics registry. Clones share it.
///
/// Register each metric once per process (a role's constructor is a good
/// place); when several instances of a component live in one process (the
/// local mode runs every role in one), use [`Metrics::get_or_register`] so
/// that they share one metric instead of exposing a name twice.
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<RwLock<Inner>>,
}

struct Inner {
    registry: Registry,
    /// Registered metrics by full name (without prefix), to refuse duplicates
    /// and to hand out the existing metric in `get_or_register`.
    by_name: HashMap<String, Box<dyn Any + Send + Sync>>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.inner.read().unwrap_or_else(PoisonError::into_inner);
        let mut names: Vec<&String> = inner.by_name.keys().collect();
        names.sort();
        f.debug_struct("Metrics").field("names", &names).finish()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A fresh registry with the `asyncrl` prefix.
    pub fn new() -> Self {
        Self {
            inner: Arc::new(RwLock::new(Inner {
                registry: Registry::with_prefix(METRIC_PREFIX),
                by_name: HashMap::new(),
            })),
        }
    }

    /// Registers `metric` as `asyncrl_<name>` and returns it (metrics are
    /// cheap handles: the returned clone and the registry share the value).
    ///
    /// Counters must not end in `_total` (the suffix is added on encoding).
    /// A name registered twice is an error.
    pub fn register<M: Metric + Clone>(
        &self,
        name: &str,
        help: &str,
        metric: M,
    ) -> Result<M, TelemetryError> {
        self.register_inner(name, help, None, metric)
    }

    /// Like [`Metrics::register`], with a unit appended to the name
    /// (`asyncrl_<name>_<unit>`), e.g. `Unit::Seconds`.
    pub fn register_with_unit<M: Metric + Clone>(
        &self,
        name: &str,
        help: &str,
        unit: Unit,
        metric: M,
    ) -> Result<M, TelemetryError> {
        self.register_inner(name, help, Some(unit), metric)
    }

    /// Returns the metric registered under `name` if there is one of type `M`,
    /// otherwise registers `make()` and returns it.
    pub fn get_or_register<M: Metric + Clone>(
        &self,
        name: &str,
        help: &str,
        make: impl FnOnce() -> M,
    ) -> Result<M, TelemetryError> {
        let mut inner = self.inner.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(existing) = inner.by_name.get(name) {
            return existing.downcast_ref::<M>().cloned().ok_or_else(|| {
                TelemetryError::MetricTypeMismatch {
                    name: format!("{METRIC_PREFIX}_{name}"),
                }
            });
        }
        let metric = make();
        Self::insert(&mut inner, name, help, None, metric.clone())?;
        Ok(metric)
    }

    /// Registers an `asyncrl_<name>_info` metric whose labels carry static
    /// facts about the process (version, role, device).
    pub fn register_info(
        &self,
        name: &str,
        help: &str,
        labels: Vec<(String, String)>,
    ) -> Result<(), TelemetryError> {
        let info = Info::new(labels);
        let mut inner = self.inner.write().unwrap_or_else(PoisonError::into_inner);
        validate_name(name, &info)?;
        if inner.by_name.contains_key(name) {
            return Err(TelemetryError::DuplicateMetric {
                name: format!("{METRIC_PREFIX}_{name}"),
            });
        }
        inner.by_name.insert(name.to_owned(), Box::new(()));
        inner.registry.register(name, help, info);
        Ok(())
    }

    /// Runs `f` with the registry itself (prefix `asyncrl` already applied),
    /// for metric sets that register through `fn register(&self, &mut
    /// Registry)`. Names registered this way bypass the duplicate check, so
    /// call it once per metric set and process.
    pub fn with_registry<R>(&self, f: impl FnOnce(&mut Registry) -> R) -> R {
        let mut inner = self.inner.write().unwrap_or_else(PoisonError::into_inner);
        f(&mut inner.registry)
    }

    fn register_inner<M: Metric + Clone>(
        &self,
        name: &str,
        help: &str,
        unit: Option<Unit>,
        metric: M,
    ) -> Result<M, TelemetryError> {
        let mut inner = self.inner.write().unwrap_or_else(PoisonError::into_inner);
        Self::insert(&mut inner, name, help, unit, metric.clone())?;
        Ok(metric)
    }

    fn insert<M: Metric + Clone>(
        inner: &mut Inner,
        name: &str,
        help: &str,
        unit: Option<Unit>,
        metric: M,
    ) -> Result<(), TelemetryError> {
        validate_name(name, &metric)?;
        let key = match &unit {
            Some(unit) => format!("{name}_{}", unit.as_str()),
            None => name.to_owned(),
        };
        if inner.by_name.contains_key(&key) {
            return Err(TelemetryError::DuplicateMetric {
                name: format!("{METRIC_PREFIX}_{key}"),
            });
        }
        inner.by_name.insert(key, Box::new(metric.clone()));
        match unit {
            Some(unit) => inner.registry.register_with_unit(name, help, unit, metric),
            None => inner.registry.register(name, help, metric),
        }
        Ok(())
    }

    /// The OpenMetrics 1.0 text of every registered metric, ending in `# EOF`.
    pub fn encode_openmetrics(&self) -> Result<String, TelemetryError> {
        let inner = self.inner.read().unwrap_or_else(PoisonError::into_inner);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &inner.registry)?;
        Ok(out)
    }

    /// The Prometheus text format 0.0.4 (what `promtool check metrics` reads).
    pub fn encode_prometheus_text(&self) -> Result<String, TelemetryError> {
        let inner = self.inner.read().unwrap_or_else(PoisonError::into_inner);
        let mut out = String::new();
        prometheus_client::encoding::text::encode_registry(&mut out, &inner.registry)?;
        Ok(openmetrics_to_prometheus_text(&out))
    }
}

/// Metric names are `[a-zA-Z_:][a-zA-Z0-9_:]*`; counters get `_total` appended
/// by the encoder, so they must not carry it themselves.
fn validate_name(name: &str, metric: &dyn EncodeMetric) -> Result<(), TelemetryError> {
    let invalid = |reason| TelemetryError::InvalidMetricName {
        name: name.to_owned(),
        reason,
    };
    let mut chars = name.chars();
    match chars.next() {
        None => return Err(invalid("is empty")),
        Some(c) if !(c.is_ascii_alphabetic() || c == '_' || c == ':') => {
            return Err(invalid("must start with a letter, `_` or `:`"));
        }
        Some(_) => {}
    }
    if !chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':') {
        return Err(invalid("may hold only letters, digits, `_` and `:`"));
    }
    if name.starts_with(&format!("{METRIC_PREFIX}_")) {
        return Err(invalid(
            "must not repeat the `asyncrl_` prefix (it is added)",
        ));
    }
    if metric.metric_type() == MetricType::Counter && name.ends_with("_total") {
        return Err(invalid(
            "is a counter and must not end in `_total` (it is added)",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::gauge::Gauge;

    use super::*;

    #[test]
    fn registers_encodes_and_refuses_duplicates() {
        let m = Metrics::new();
        let c = m
            .register("jobs", "Jobs done", Counter::<u64>::default())
            .unwrap();
        c.inc_by(3);
        let err = m
            .register("jobs", "Again", Counter::<u64>::default())
            .unwrap_err();
        assert!(
            matches!(err, TelemetryError::DuplicateMetric { .. }),
            "{err}"
        );
        let text = m.encode_openmetrics().unwrap();
        assert!(text.contains("asyncrl_jobs_total 3\n"), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
        let text = m.encode_prometheus_text().unwrap();
        assert!(
            text.contains("# TYPE asyncrl_jobs_total counter\n"),
            "{text}"
        );
        assert!(!text.contains("EOF"), "{text}");
        m.with_registry(|r| r.register("raw", "Registered directly", Gauge::<i64>::default()));
        let text = m.encode_prometheus_text().unwrap();
        assert!(text.contains("\nasyncrl_raw 0\n"), "{text}");
    }

    #[test]
    fn get_or_register_shares_one_metric() {
        let m = Metrics::new();
        let a = m
            .get_or_register("depth", "Queue depth", Gauge::<i64>::default)
            .unwrap();
        let b = m
            .get_or_register("depth", "Queue depth", Gauge::<i64>::default)
            .unwrap();
        a.set(7);
        assert_eq!(b.get(), 7);
        let err = m
            .get_or_register("depth", "Queue depth", Counter::<u64>::default)
            .unwrap_err();
        assert!(
            matches!(err, TelemetryError::MetricTypeMismatch { .. }),
            "{err}"
        );
    }

    #[test]
    fn bad_names_are_errors_not_panics() {
        let m = Metrics::new();
        for name in ["", "9lives", "has-dash", "asyncrl_twice", "done_total"] {
            let r = m.register(name, "x", Counter::<u64>::default());
            assert!(
                matches!(r, Err(TelemetryError::InvalidMetricName { .. })),
                "{name:?}: {r:?}"
            );
        }
        m.register("seconds", "ok", Gauge::<i64>::default())
            .unwrap();
    }
}
