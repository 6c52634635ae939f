//! The asyncrl coordinator: the learner's version clock, bounded-staleness
//! admission, task leases, the worker registry, live knobs with a JSONL
//! journal, the admin gRPC API and the capacity model.
//!
//! The same coordinator runs in-process (local mode, over
//! [`asyncrl_transport::LocalBus`]) or as its own process over NATS:
//! [`run`] (or [`Coordinator::start`]) takes the bus. `asyncrl ctl` is
//! [`ctl::ctl`].
//!
//! State that survives a restart (task cursor, queue, leases, accepted count,
//! learner session) lives in the KV bucket `asyncrl_control` under
//! `coordinator.state`; the knobs under `knobs` (see [`knobs`]).

pub mod admin;
pub mod capacity;
pub mod ctl;
pub mod dataset;
mod error;
pub mod journal;
/// The knob schedule lives in the control crate (the learner seals it too).
pub use asyncrl_control::knobs;
pub mod metrics;
pub mod registry;
pub mod scheduler;
mod service;

use std::net::SocketAddr;
use std::sync::Arc;

use asyncrl_common::{SharedClock, SystemClock};
use asyncrl_config::Config;
use asyncrl_protos::subjects::{LEARNER_STATUS_KEY, POLICY_VERSION_KEY};
use asyncrl_protos::v1::{GetKnobsReply, ListWorkersReply, StatusReply};
use asyncrl_telemetry::{Health, Metrics};
use asyncrl_transport::Bus;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

pub use asyncrl_tasks::{TaskError, TaskItem};
pub use dataset::TaskSet;
pub use error::CoordinatorError;
pub use journal::JournalError;
pub use knobs::{KnobError, StepKnobs, seal_step};
pub use scheduler::StateError;
pub use tokio_util::sync::CancellationToken as ShutdownToken;

use crate::service::{Actor, AdminCommand, Event};

/// A running coordinator.
pub struct Coordinator {
    tx: mpsc::Sender<Event>,
    admin_addr: Option<SocketAddr>,
    shutdown: CancellationToken,
    actor: tokio::task::JoinHandle<Result<(), CoordinatorError>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Coordinator {
    /// Loads the task set and the persisted state, starts serving the NATS
    /// subjects (or their in-process equivalents), the watches and the admin
    /// API. `shutdown` stops it (a child token is used, so cancelling the
    /// coordinator does not cancel the caller's token).
    pub async fn start(
        config: Config,
        bus: Arc<dyn Bus>,
        metrics: Metrics,
        health: Health,
        shutdown: &CancellationToken,
    ) -> Result<Self, CoordinatorError> {
        Self::start_with_clock(
            config,
            bus,
            metrics,
            health,
            shutdown,
            SystemClock::shared(),
        )
        .await
    }

    /// [`Coordinator::start`] on `clock`: the time lease deadlines and
    /// heartbeat silence are measured by (tests pass an
    /// [`asyncrl_common::TokioClock`] to run on paused tokio time).
    pub async fn start_with_clock(
        config: Config,
        bus: Arc<dyn Bus>,
        metrics: Metrics,
        health: Health,
        shutdown: &CancellationToken,
        clock: SharedClock,
    ) -> Result<Self, CoordinatorError> {
        config.validate()?;
        health.set_not_ready("coordinator", "starting");
        let shutdown = shutdown.child_token();
        let coordinator_metrics = metrics::CoordinatorMetrics::register(&metrics)?;
        let actor = Actor::prepare(
            &config,
            &bus,
            coordinator_metrics.clone(),
            health.clone(),
            clock,
        )
        .await?;
        let (tx, rx) = mpsc::channel(4096);
        let mut tasks = service::spawn_request_forwarders(&bus, &tx, &shutdown).await?;
        tasks.push(service::spawn_watch(
            bus.clone(),
            POLICY_VERSION_KEY,
            tx.clone(),
            shutdown.clone(),
            service::map_version,
        ));
        tasks.push(service::spawn_watch(
            bus.clone(),
            knobs::KNOBS_KEY,
            tx.clone(),
            shutdown.clone(),
            service::map_knobs,
        ));
        tasks.push(service::spawn_watch(
            bus.clone(),
            LEARNER_STATUS_KEY,
            tx.clone(),
            shutdown.clone(),
            service::map_learner_status,
        ));
        let drops = service::group_drop_consumer(&bus, &config.bus).await?;
        tasks.push(service::spawn_group_dropped(
            drops,
            tx.clone(),
            coordinator_metrics,
            shutdown.clone(),
        ));
        tasks.push(service::spawn_ticker(
            actor.tick_interval(),
            tx.clone(),
            shutdown.clone(),
        ));
        tasks.push(service::spawn_epochs_closed(
            bus.clone(),
            actor.closed_epochs(),
            shutdown.clone(),
        ));
        let admin_addr = match config.coordinator.admin_addr()? {
            Some(addr) => {
                let (bound, handle) =
                    admin::start(&config.coordinator, addr, tx.clone(), shutdown.clone()).await?;
                tasks.push(handle);
                Some(bound)
            }
            None => None,
        };
        let actor_shutdown = shutdown.clone();
        let actor = tokio::spawn(async move {
            let result = actor.run(rx, actor_shutdown.clone()).await;
            // Whatever ended the actor ends the rest.
            actor_shutdown.cancel();
            result
        });
        // Push the subscriptions out to the server before declaring ready.
        if let Err(e) = bus.flush().await {
            tracing::warn!(error = %e, "could not flush the bus after subscribing");
        }
        health.set_ready("coordinator");
        tracing::info!(
            bus = bus.kind(),
            admin = ?admin_addr,
            "coordinator started"
        );
        Ok(Self {
            tx,
            admin_addr,
            shutdown,
            actor,
            tasks,
        })
    }

    /// The bound address of the admin API (None when disabled).
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin_addr
    }

    async fn ask<R>(
        &self,
        make: impl FnOnce(oneshot::Sender<R>) -> AdminCommand,
    ) -> Result<R, CoordinatorError> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Event::Admin(make(tx)))
            .await
            .map_err(|_| CoordinatorError::Stopped)?;
        rx.await.map_err(|_| CoordinatorError::Stopped)
    }

    /// The same status the admin API serves.
    pub async fn status(&self) -> Result<StatusReply, CoordinatorError> {
        self.ask(AdminCommand::Status).await
    }

    pub async fn workers(&self) -> Result<ListWorkersReply, CoordinatorError> {
        self.ask(AdminCommand::Workers).await
    }

    pub async fn knobs(&self) -> Result<GetKnobsReply, CoordinatorError> {
        self.ask(AdminCommand::GetKnobs).await
    }

    /// Asks the coordinator to stop (it writes its state a last time).
    pub fn shutdown(&self) {
        self.shutdown.cancel();
    }

    /// Waits until the coordinator stopped; the error that stopped it, if any.
    pub async fn join(self) -> Result<(), CoordinatorError> {
        let result = match self.actor.await {
            Ok(r) => r,
            Err(e) => Err(CoordinatorError::Join(e)),
        };
        self.shutdown.cancel();
        for t in self.tasks {
            let _ = t.await;
        }
        result
    }
}

/// Runs a coordinator until `shutdown` is cancelled or it fails.
pub async fn run(
    config: Config,
    bus: Arc<dyn Bus>,
    metrics: Metrics,
    shutdown: CancellationToken,
) -> Result<(), CoordinatorError> {
    Coordinator::start(config, bus, metrics, Health::new(), &shutdown)
        .await?
        .join()
        .await
}
