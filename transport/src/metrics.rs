//! Transport metrics. Connection events are counted, never silent: a slow
//! consumer means the client dropped messages for a subscription.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EventLabels {
    pub event: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpLabels {
    pub op: String,
}

/// Cloneable handles; create once per process and register into the
/// process registry.
#[derive(Clone, Default, Debug)]
pub struct TransportMetrics {
    /// Connection events by kind (connected, disconnected, slow_consumer, ...).
    pub events: Family<EventLabels, Counter>,
    /// Failed bus operations by operation.
    pub errors: Family<OpLabels, Counter>,
    /// Publishes and subscriptions the server refused for lack of
    /// permission, by NATS operation (`publish`, `subscribe`).
    pub permission_violations: Family<OpLabels, Counter>,
}

impl TransportMetrics {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers under `asyncrl_transport_*` (the registry carries the
    /// `asyncrl` prefix).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "transport_events",
            "NATS connection events (connected, disconnected, slow_consumer, server_error, ...)",
            self.events.clone(),
        );
        registry.register(
            "transport_errors",
            "Failed bus operations by operation",
            self.errors.clone(),
        );
        registry.register(
            "transport_permission_violations",
            "Publishes and subscriptions the NATS server refused for lack of permission (the role's credentials), by operation",
            self.permission_violations.clone(),
        );
    }

    pub fn event(&self, event: &str) {
        self.events
            .get_or_create(&EventLabels {
                event: event.to_owned(),
            })
            .inc();
    }

    pub fn error(&self, op: &str) {
        self.errors
            .get_or_create(&OpLabels { op: op.to_owned() })
            .inc();
    }

    pub fn permission_violation(&self, op: &str) {
        self.permission_violations
            .get_or_create(&OpLabels { op: op.to_owned() })
            .inc();
    }

    pub fn permission_violation_count(&self, op: &str) -> u64 {
        self.permission_violations
            .get_or_create(&OpLabels { op: op.to_owned() })
            .get()
    }

    pub fn error_count(&self, op: &str) -> u64 {
        self.errors
            .get_or_create(&OpLabels { op: op.to_owned() })
            .get()
    }

    pub fn event_count(&self, event: &str) -> u64 {
        self.events
            .get_or_create(&EventLabels {
                event: event.to_owned(),
            })
            .get()
    }
}
