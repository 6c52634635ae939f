//! The JetStream streams of the contract with the deployment's settings.
//! Every role that creates a stream (the buffer; test doubles) uses these, so
//! two creators never disagree on a spec.

use asyncrl_config::BusConfig;
use asyncrl_protos::subjects::{DEAD_LETTERS, StreamContract, TRAJECTORIES};
use asyncrl_transport::StreamSpec;

fn spec(contract: StreamContract, bus: &BusConfig) -> StreamSpec {
    StreamSpec {
        duplicate_window: bus.duplicate_window,
        replicas: bus.replicas,
        ..StreamSpec::new(contract.name, contract.subjects)
    }
}

/// The stream the workers publish trajectories to.
pub fn trajectory_stream_spec(bus: &BusConfig) -> StreamSpec {
    spec(TRAJECTORIES, bus)
}

/// The dead-letter stream of the buffer.
pub fn dead_letter_stream_spec(bus: &BusConfig) -> StreamSpec {
    spec(DEAD_LETTERS, bus)
}

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
}
