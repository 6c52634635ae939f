//! The coordinator process: one task (the actor) owns the state and handles
//! every event in order — worker requests from NATS, learner announcements,
//! knob and learner-status updates from the KV bucket, dropped-group reports,
//! admin commands and a timer. Events are taken in batches; the changes to
//! the persisted state are written to the KV bucket with one write for all
//! that were made while the previous write was in flight (pipelined group
//! commit), before any reply that depends on them is sent, so a reply never
//! promises something a restarted coordinator would not know.
//!
//! - [`actor`]: the actor's state, its preparation and the event loop with
//!   pipelined group commit;
//! - [`requests`]: worker requests (register, heartbeat, acquire, complete,
//!   return) turned into replies;
//! - [`persist`]: writing the state to the KV bucket, one write in flight;
//! - [`knob_admin`]: knob changes, pause/resume and checkpoints, with the
//!   journal;
//! - [`views`]: status, worker list, the capacity model and the metrics;
//! - [`inputs`]: the request and dropped-group forwarders;
//! - [`watch`]: KV watches and the ticker.
//!
//! This file holds the events the actor takes.

mod actor;
mod inputs;
mod knob_admin;
mod persist;
mod requests;
mod views;
mod watch;

use asyncrl_protos::subjects::{
    TASKS_ACQUIRE, TASKS_COMPLETE, TASKS_RETURN, WORKERS_HEARTBEAT, WORKERS_REGISTER,
};
use asyncrl_protos::v1::{
    ControlReply, GetKnobsReply, GroupDropped, KnobSchedule, LearnerStatus, ListWorkersReply,
    SetKnobsReply, SetKnobsRequest, StatusReply, WeightAnnouncement,
};
use asyncrl_transport::Request;
use tokio::sync::oneshot;

pub(crate) use actor::Actor;
pub(crate) use inputs::{spawn_group_dropped, spawn_request_forwarders};
pub(crate) use watch::{map_knobs, map_learner_status, map_version, spawn_ticker, spawn_watch};

/// Events the actor handles.
pub(crate) enum Event {
    Request {
        kind: RequestKind,
        req: Request,
    },
    Version(WeightAnnouncement),
    Knobs {
        schedule: KnobSchedule,
        revision: u64,
    },
    LearnerStatus(LearnerStatus),
    GroupDropped(GroupDropped),
    Admin(AdminCommand),
    /// The periodic check of lease deadlines and heartbeats, stamped when
    /// the ticker sent it.
    Tick(tokio::time::Instant),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RequestKind {
    Acquire,
    Complete,
    Return,
    Register,
    Heartbeat,
}

impl RequestKind {
    pub(super) fn subject(self) -> &'static str {
        match self {
            RequestKind::Acquire => TASKS_ACQUIRE,
            RequestKind::Complete => TASKS_COMPLETE,
            RequestKind::Return => TASKS_RETURN,
            RequestKind::Register => WORKERS_REGISTER,
            RequestKind::Heartbeat => WORKERS_HEARTBEAT,
        }
    }
}

/// Why an admin request was refused before it was considered.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Unauthorized(pub String);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ControlAction {
    Pause,
    Resume,
    Checkpoint,
}

impl ControlAction {
    pub(super) fn name(self) -> &'static str {
        match self {
            ControlAction::Pause => "pause",
            ControlAction::Resume => "resume",
            ControlAction::Checkpoint => "checkpoint",
        }
    }
}

pub(crate) enum AdminCommand {
    Status(oneshot::Sender<StatusReply>),
    Workers(oneshot::Sender<ListWorkersReply>),
    GetKnobs(oneshot::Sender<GetKnobsReply>),
    SetKnobs {
        req: SetKnobsRequest,
        peer: Option<String>,
        auth: Result<(), Unauthorized>,
        reply: oneshot::Sender<Result<SetKnobsReply, Unauthorized>>,
    },
    Control {
        action: ControlAction,
        who: String,
        peer: Option<String>,
        auth: Result<(), Unauthorized>,
        reply: oneshot::Sender<Result<ControlReply, Unauthorized>>,
    },
}
