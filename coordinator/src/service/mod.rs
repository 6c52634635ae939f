//! The coordinator process: one task (the actor) owns the state and handles
//! every event in order — worker requests from NATS, learner announcements,
//! knob and learner-status updates from the KV bucket, dropped-group reports,
//! admin commands and a timer. Events are taken in batches; the changes to
//! the persisted state are written to the KV bucket with one write for all
//! that were made while the previous write was in flight (pipelined group
//! commit), before any reply that depends on them is sent, so a reply never
//! promises something a restarted coordinator would not know.
//!
//! The actor composes owned sub-states, each in its own file, none of which
//! knows the actor:
//! - [`actor`]: the actor — its preparation, the event loop with pipelined
//!   group commit, the events that touch several sub-states, the status;
//! - [`batch`]: what one batch of events leaves to do: the replies, the
//!   durable ones waiting for the state write;
//! - [`persist`]: the persisted state in the KV bucket ([`persist::StateStore`]):
//!   reading it at start, writing it, one write in flight;
//! - [`knob_admin`]: the knob schedule and the journal
//!   ([`knob_admin::KnobAdmin`]): knob changes, pause/resume and checkpoints;
//! - [`fleet`]: the workers ([`fleet::Fleet`]): the registry and the capacity
//!   model;
//! - [`requests`]: worker requests (register, heartbeat, acquire, complete,
//!   return) turned into replies, over the sub-states they touch;
//! - [`settings`]: timing and sizing from the config;
//! - [`events`]: the events the actor takes;
//! - [`inputs`]: the request and dropped-group forwarders;
//! - [`watch`]: KV watches and the ticker.

mod actor;
mod batch;
mod events;
mod fleet;
mod inputs;
mod knob_admin;
mod persist;
mod requests;
mod settings;
mod watch;

pub(crate) use actor::Actor;
pub(crate) use events::{AdminCommand, ControlAction, Event, Unauthorized};
pub(crate) use inputs::{group_drop_consumer, spawn_group_dropped, spawn_request_forwarders};
pub(crate) use watch::{
    map_knobs, map_learner_status, map_version, spawn_epochs_closed, spawn_ticker, spawn_watch,
};
