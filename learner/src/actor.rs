//! The trainer engine on its own OS thread. tch tensors are not `Sync`, the
//! model must never block the async runtime, and the `torch` engine's
//! client blocks on its calls, so every operation on the engine is a
//! closure sent to that thread; the caller awaits the reply.

use std::sync::mpsc;

use tokio::sync::oneshot;

use crate::engine::TrainerEngine;

type Engine = Box<dyn TrainerEngine>;
type Job = Box<dyn FnOnce(&mut dyn TrainerEngine) + Send>;

pub use asyncrl_policy::pin_current_thread;

/// A handle to the thread that owns the [`TrainerEngine`].
#[derive(Clone)]
pub struct TrainerActor {
    tx: mpsc::Sender<Job>,
}

#[derive(Debug, thiserror::Error)]
#[error("the trainer thread is gone (it panicked or was shut down)")]
pub struct ActorGone;

impl TrainerActor {
    /// Builds the engine on a new thread with `build` and serves it (the
    /// engine is dropped on that thread when every handle is gone).
    pub async fn spawn<E: Send + 'static>(
        build: impl FnOnce() -> Result<Engine, E> + Send + 'static,
    ) -> Result<Result<Self, E>, ActorGone> {
        let (tx, rx) = mpsc::channel::<Job>();
        let (ready_tx, ready_rx) = oneshot::channel();
        std::thread::Builder::new()
            .name("asyncrl-learner".into())
            .spawn(move || {
                let mut trainer = match build() {
                    Ok(t) => {
                        let _ = ready_tx.send(Ok(()));
                        t
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                while let Ok(job) = rx.recv() {
                    // A panicking job must not take the trainer down with it
                    // silently: the caller sees its reply channel dropped.
                    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        job(trainer.as_mut())
                    }));
                    if outcome.is_err() {
                        tracing::error!("a trainer job panicked; the trainer keeps serving");
                    }
                }
            })
            .map_err(|_| ActorGone)?;
        match ready_rx.await {
            Ok(Ok(())) => Ok(Ok(Self { tx })),
            Ok(Err(e)) => Ok(Err(e)),
            Err(_) => Err(ActorGone),
        }
    }

    /// Runs `f` on the trainer thread and returns its result.
    pub async fn call<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut dyn TrainerEngine) -> R + Send + 'static,
    ) -> Result<R, ActorGone> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Box::new(move |t: &mut dyn TrainerEngine| {
                let _ = tx.send(f(t));
            }))
            .map_err(|_| ActorGone)?;
        rx.await.map_err(|_| ActorGone)
    }
}
