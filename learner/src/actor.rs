//! The trainer on its own OS thread. tch tensors are not `Sync` and the
//! model must never block the async runtime, so every operation on the
//! trainer is a closure sent to that thread; the caller awaits the reply.

use std::sync::mpsc;

use tokio::sync::oneshot;

use crate::trainer::Trainer;

type Job = Box<dyn FnOnce(&mut Trainer) + Send>;

pub use asyncrl_policy::pin_current_thread;

/// A handle to the thread that owns the [`Trainer`].
#[derive(Clone)]
pub struct TrainerActor {
    tx: mpsc::Sender<Job>,
}

#[derive(Debug, thiserror::Error)]
#[error("the trainer thread is gone (it panicked or was shut down)")]
pub struct ActorGone;

impl TrainerActor {
    /// Builds the trainer on a new thread with `build` and serves it.
    pub async fn spawn<E: Send + 'static>(
        build: impl FnOnce() -> Result<Trainer, E> + Send + 'static,
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
                        job(&mut trainer)
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
        f: impl FnOnce(&mut Trainer) -> R + Send + 'static,
    ) -> Result<R, ActorGone> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Box::new(move |t: &mut Trainer| {
                let _ = tx.send(f(t));
            }))
            .map_err(|_| ActorGone)?;
        rx.await.map_err(|_| ActorGone)
    }
}
