//! A process waits for its model threads before it exits: each counts as
//! running from its spawn until it has dropped its policy. Its own test
//! binary, since the count is per process.

use std::time::Duration;

use asyncrl_policy::{
    DeviceOptions, EngineOptions, ModelHandle, Policy, PolicyError, TinyModelSpec,
    wait_for_model_threads,
};

fn tiny() -> Result<Policy, PolicyError> {
    let spec = TinyModelSpec {
        hidden_size: 32,
        num_hidden_layers: 1,
        intermediate_size: 64,
        ..TinyModelSpec::default()
    };
    Policy::builtin_tiny(&spec, 0, DeviceOptions::cpu())
}

#[test]
fn a_model_thread_counts_until_its_last_handle_is_dropped_and_a_failed_load_not_at_all() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .build()
        .expect("runtime");
    assert_eq!(wait_for_model_threads(Duration::ZERO), 0);

    let handle = rt
        .block_on(ModelHandle::spawn(EngineOptions::default(), tiny))
        .expect("spawn");
    let second = handle.clone();
    assert_eq!(
        wait_for_model_threads(Duration::ZERO),
        1,
        "a model thread with handles counts as running"
    );
    drop(handle);
    assert_eq!(
        wait_for_model_threads(Duration::ZERO),
        1,
        "one handle left: the thread serves on"
    );
    drop(second);
    assert_eq!(
        wait_for_model_threads(Duration::from_secs(60)),
        0,
        "the last handle dropped: the thread ends and the wait sees it"
    );

    let failed = rt.block_on(ModelHandle::spawn(EngineOptions::default(), || {
        Err(PolicyError::ModelThreadGone)
    }));
    assert!(failed.is_err());
    assert_eq!(
        wait_for_model_threads(Duration::from_secs(60)),
        0,
        "a thread whose load failed ends too"
    );
}
