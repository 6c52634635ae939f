//! The events the actor takes, and the admin commands among them.

use asyncrl_protos::subjects::{
    TASKS_ACQUIRE, TASKS_COMPLETE, TASKS_RETURN, WORKERS_HEARTBEAT, WORKERS_REGISTER,
};
use asyncrl_protos::v1::{
    ControlReply, GetKnobsReply, GroupDropped, KnobSchedule, LearnerStatus, ListWorkersReply,
    SetKnobsReply, SetKnobsRequest, StatusReply, WeightAnnouncement,
};
use asyncrl_transport::{Delivery, Request};
use tokio::sync::oneshot;

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
    /// A drop report from the buffer; `delivery` is acked once its effect
    /// is written (see the actor).
    GroupDropped {
        report: GroupDropped,
        delivery: Delivery,
    },
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
