//! The learner's trainer thread counts as live, like a model thread, until
//! it has dropped its engine: a process waits for it before it exits. Its
//! own test binary, since the count is per process.

use std::time::Duration;

use asyncrl_learner::actor::TrainerActor;
use asyncrl_learner::engine::TrainerEngine;
use asyncrl_learner::trainer::{Trainer, TrainerOptions};
use asyncrl_policy::{DeviceOptions, Policy, TinyModelSpec, wait_for_model_threads};

fn engine() -> Result<Box<dyn TrainerEngine>, anyhow::Error> {
    let spec = TinyModelSpec {
        hidden_size: 32,
        num_hidden_layers: 1,
        intermediate_size: 64,
        ..TinyModelSpec::default()
    };
    let policy = Policy::builtin_tiny(&spec, 0, DeviceOptions::cpu())?;
    Ok(Box::new(Trainer::new(policy, TrainerOptions::default())))
}

#[test]
fn the_trainer_thread_counts_until_its_last_handle_is_dropped() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .build()
        .expect("runtime");
    let actor = rt
        .block_on(TrainerActor::spawn(engine))
        .expect("thread")
        .expect("engine");
    let version = rt
        .block_on(actor.call(|t| t.version()))
        .expect("the thread serves");
    assert_eq!(version, 0);
    assert_eq!(
        wait_for_model_threads(Duration::ZERO),
        1,
        "the trainer thread with a handle counts as running"
    );
    drop(actor);
    assert_eq!(
        wait_for_model_threads(Duration::from_secs(60)),
        0,
        "the last handle dropped: the thread drops its engine and ends"
    );

    let failed = rt
        .block_on(TrainerActor::spawn(|| {
            Err::<Box<dyn TrainerEngine>, _>(anyhow::anyhow!("no engine"))
        }))
        .expect("thread");
    assert!(failed.is_err());
    assert_eq!(
        wait_for_model_threads(Duration::from_secs(60)),
        0,
        "a thread whose engine failed to build ends too"
    );
}
