//! The JetStream streams of the contract with the deployment's settings.
//! Every role that creates a stream (the buffer; test doubles) uses these, so
//! two creators never disagree on a spec.

use asyncrl_config::{BusConfig, TrajectoryRetention};
use asyncrl_protos::subjects::{DEAD_LETTERS, GROUP_DROPS, StreamContract, TRAJECTORIES};
use asyncrl_transport::{Discard, Retention, StreamSpec};

fn spec(contract: StreamContract, bus: &BusConfig) -> StreamSpec {
    StreamSpec {
        duplicate_window: bus.duplicate_window,
        replicas: bus.replicas,
        ..StreamSpec::new(contract.name, contract.subjects)
    }
}

/// The stream the workers publish trajectories to. It never discards a
/// message the buffer has not stored: when full it refuses publishes (the
/// workers retry), and with `release` a message leaves it once the buffer
/// has written it to disk and acked it.
pub fn trajectory_stream_spec(bus: &BusConfig) -> StreamSpec {
    let storage = &bus.storage;
    let (retention, max_age) = match storage.trajectories {
        TrajectoryRetention::Release => (Retention::WorkQueue, std::time::Duration::ZERO),
        TrajectoryRetention::Keep => (Retention::Limits, storage.trajectories_max_age),
    };
    StreamSpec {
        retention,
        max_age,
        max_bytes: Some(storage.trajectories_max_bytes),
        discard: Discard::New,
        ..spec(TRAJECTORIES, bus)
    }
}

/// The dead-letter stream of the buffer: bounded by age and bytes, the
/// oldest dead letters go first (each was counted when it arrived).
pub fn dead_letter_stream_spec(bus: &BusConfig) -> StreamSpec {
    StreamSpec {
        max_age: bus.storage.dead_letters_max_age,
        max_bytes: Some(bus.storage.dead_letters_max_bytes),
        discard: Discard::Old,
        ..spec(DEAD_LETTERS, bus)
    }
}

/// The buffer's dropped-group reports: each stays until the coordinator has
/// applied it and persisted the effect (a work queue), and none ages out,
/// because a lost report is a task never issued again. Reports are a few
/// dozen bytes; when the stream is full a new report is refused and the
/// buffer retries it.
pub fn group_drop_stream_spec(bus: &BusConfig) -> StreamSpec {
    StreamSpec {
        retention: Retention::WorkQueue,
        max_age: std::time::Duration::ZERO,
        max_bytes: Some(GROUP_DROPS_MAX_BYTES),
        discard: Discard::New,
        ..spec(GROUP_DROPS, bus)
    }
}

/// Bytes the dropped-group stream may hold: about a million reports.
pub const GROUP_DROPS_MAX_BYTES: u64 = 128 * 1024 * 1024;

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn specs_take_the_bus_settings() {
        let bus = BusConfig {
            duplicate_window: Duration::from_secs(7),
            replicas: 3,
            ..BusConfig::default()
        };
        let t = trajectory_stream_spec(&bus);
        assert_eq!(t.name, TRAJECTORIES.name);
        assert_eq!(t.subjects, vec![TRAJECTORIES.subjects[0].to_owned()]);
        assert_eq!(
            (t.duplicate_window, t.replicas),
            (Duration::from_secs(7), 3)
        );
        let d = dead_letter_stream_spec(&bus);
        assert_eq!(d.name, DEAD_LETTERS.name);
        assert_ne!(d.subjects, t.subjects);
    }

    #[test]
    fn every_stream_is_bounded_and_trajectories_are_never_discarded() {
        let mut bus = BusConfig::default();
        let t = trajectory_stream_spec(&bus);
        assert_eq!(t.retention, Retention::WorkQueue);
        assert_eq!(t.discard, Discard::New);
        assert_eq!(t.max_bytes, Some(bus.storage.trajectories_max_bytes));
        assert_eq!(t.max_age, Duration::ZERO, "a backlog never ages out");
        let d = dead_letter_stream_spec(&bus);
        assert_eq!((d.retention, d.discard), (Retention::Limits, Discard::Old));
        assert!(d.max_bytes.is_some() && !d.max_age.is_zero());

        let g = group_drop_stream_spec(&bus);
        assert_eq!(
            (g.retention, g.discard, g.max_age),
            (Retention::WorkQueue, Discard::New, Duration::ZERO),
            "a drop report leaves only when the coordinator has applied it"
        );
        assert!(g.max_bytes.is_some());

        bus.storage.trajectories = TrajectoryRetention::Keep;
        let kept = trajectory_stream_spec(&bus);
        assert_eq!(
            (kept.retention, kept.discard),
            (Retention::Limits, Discard::New)
        );
        assert_eq!(kept.max_age, bus.storage.trajectories_max_age);
    }
}
