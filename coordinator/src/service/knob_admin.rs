//! Knob administration: the knob schedule loaded or created at start, knob
//! changes, pause/resume and checkpoints asked for over the admin API
//! (written to the schedule with compare-and-set), and their journal
//! entries — the request's outcome, then "applied" once its step has come.

use asyncrl_config::Config;
use asyncrl_protos::v1::{ControlReply, KnobChange, KnobSchedule, Knobs, SetKnobsReply};
use asyncrl_transport::KvBucket;

use super::actor::{Actor, PendingApply};
use super::{AdminCommand, ControlAction, Unauthorized};
use crate::CoordinatorError;
use crate::journal::entry;
use crate::knobs::{self, Decision, KNOBS_KEY, KnobError};
use crate::metrics::OutcomeLabel;
use asyncrl_control::kv::Change;

/// The knob schedule as stored in the KV bucket, and its revision.
pub(super) struct StoredSchedule {
    pub(super) schedule: KnobSchedule,
    pub(super) revision: u64,
}

/// The outcome of a knob change, pause/resume or checkpoint request, as the
/// requester is told.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct KnobOutcome {
    pub(super) accepted: bool,
    /// The step the change lands at (0 when refused).
    pub(super) effective_step: u64,
    /// Why it was refused (empty when accepted).
    pub(super) reason: String,
    /// The journal entry of the outcome; None when it could not be written.
    pub(super) journal_seq: Option<u64>,
}

impl KnobOutcome {
    /// What a schedule edit decided, before it is journaled.
    /// The outcome of a decision; an error storing it is a refusal whose
    /// reason (the error with its causes) goes back to the caller.
    fn decided(result: Result<Decision, KnobError>) -> Self {
        let (accepted, effective_step, reason) = match result {
            Ok(Decision::At(n)) => (true, n, String::new()),
            Ok(Decision::Refused(r)) => (false, 0, r),
            Err(e) => {
                tracing::warn!(error = %e, "a knob change could not be stored");
                (false, 0, e.to_string())
            }
        };
        Self {
            accepted,
            effective_step,
            reason,
            journal_seq: None,
        }
    }

    /// The journal seq on the wire, where 0 means "not journaled" (journal
    /// seqs start at 1).
    fn wire_journal_seq(&self) -> u64 {
        self.journal_seq.unwrap_or(0)
    }

    fn into_set_knobs_reply(self) -> SetKnobsReply {
        SetKnobsReply {
            journal_seq: self.wire_journal_seq(),
            accepted: self.accepted,
            effective_step: self.effective_step,
            reason: self.reason,
        }
    }

    fn into_control_reply(self) -> ControlReply {
        ControlReply {
            journal_seq: self.wire_journal_seq(),
            accepted: self.accepted,
            effective_step: self.effective_step,
            reason: self.reason,
        }
    }
}

pub(super) async fn load_or_create_schedule(
    kv: &dyn KvBucket,
    config: &Config,
) -> Result<StoredSchedule, CoordinatorError> {
    let loaded = asyncrl_control::kv::edit(kv, KNOBS_KEY, 4, |entry| match entry {
        Some(e) => Ok(Change::Keep(knobs::decode_schedule(&e.value)?)),
        None => {
            let s = knobs::new_schedule(knobs::initial_knobs(config));
            Ok(Change::Write(knobs::encode_schedule(&s), s))
        }
    })
    .await
    .map_err(KnobError::from_edit)?;
    Ok(StoredSchedule {
        schedule: loaded.outcome,
        revision: loaded.revision,
    })
}

impl Actor {
    /// Journals "applied" for changes whose step has come.
    pub(super) async fn check_applied(&mut self) {
        let sealed = self.schedule.sealed_through_step;
        let current = self.current_step();
        let (due, rest): (Vec<PendingApply>, Vec<PendingApply>) =
            self.pending_applied.drain(..).partition(|p| {
                if p.admission_only {
                    current >= p.step
                } else {
                    sealed >= p.step
                }
            });
        self.pending_applied = rest;
        for p in due {
            let mut e = entry("coordinator", "applied", "applied");
            e.unix_ms = self.clock.now_unix_ms();
            e.ref_seq = p.seq;
            e.effective_step = Some(p.step);
            e.reason = Some(if p.admission_only {
                format!("in effect for grants from learner step {}", p.step)
            } else {
                format!("sealed by the learner for step {}", p.step)
            });
            match self.journal.append(e).await {
                Ok(_) => tracing::info!(request = p.seq, step = p.step, "knob change applied"),
                Err(err) => tracing::error!(error = %err, "cannot journal an applied knob change"),
            }
        }
    }

    /// Journals a request's outcome; its seq, or None when the journal
    /// could not be written (logged).
    async fn journal_outcome(&mut self, mut e: crate::journal::JournalEntry) -> Option<u64> {
        self.metrics
            .knob_requests
            .get_or_create(&OutcomeLabel {
                outcome: e.outcome.clone(),
            })
            .inc();
        e.unix_ms = self.clock.now_unix_ms();
        match self.journal.append(e).await {
            Ok(seq) => Some(seq),
            Err(err) => {
                tracing::error!(error = %err, "cannot append to the knob journal");
                None
            }
        }
    }

    /// Writes a modified schedule with compare-and-set; `edit` returns the
    /// step the change lands at, or a refusal. Retries on concurrent writes
    /// (the learner sealing a step).
    async fn edit_schedule(
        &mut self,
        mut edit: impl FnMut(&mut KnobSchedule, i32) -> Decision,
    ) -> Result<Decision, KnobError> {
        let version = self.sched.version();
        let edited = asyncrl_control::kv::edit(self.kv.as_ref(), KNOBS_KEY, 16, |entry| {
            let entry = entry.ok_or(KnobError::NoSchedule)?;
            let mut s = knobs::decode_schedule(&entry.value)?;
            let decision = edit(&mut s, version);
            if let Decision::Refused(_) = decision {
                return Ok(Change::Keep((s, decision)));
            }
            knobs::compact(&mut s, version.max(0) as u64);
            Ok(Change::Write(knobs::encode_schedule(&s), (s, decision)))
        })
        .await
        .map_err(KnobError::from_edit)?;
        let (schedule, decision) = edited.outcome;
        self.schedule = schedule;
        self.schedule_rev = if edited.wrote {
            edited.revision
        } else {
            self.schedule_rev.max(edited.revision)
        };
        Ok(decision)
    }

    async fn set_knobs(
        &mut self,
        action: &str,
        knobs_req: Knobs,
        apply_at_step: u64,
        who: &str,
        peer: Option<String>,
        auth: Result<(), Unauthorized>,
    ) -> Result<KnobOutcome, Unauthorized> {
        let mut e = entry(who, action, "refused");
        e.peer = peer;
        e.request = serde_json::json!({
            "knobs": knobs::knob_rows(&knobs_req).into_iter().collect::<std::collections::BTreeMap<_, _>>(),
            "apply_at_step": apply_at_step,
        });
        if let Err(Unauthorized(reason)) = auth {
            e.reason = Some(reason.clone());
            self.journal_outcome(e).await;
            tracing::warn!(who, action, reason = %reason, "admin request refused");
            return Err(Unauthorized(reason));
        }
        if let Err(err) = knobs::validate(&knobs_req) {
            let reason = err.to_string();
            e.reason = Some(reason.clone());
            let journal_seq = self.journal_outcome(e).await;
            return Ok(KnobOutcome {
                accepted: false,
                effective_step: 0,
                reason,
                journal_seq,
            });
        }
        let seq = self.journal.next_seq();
        let admission_only = knobs::is_admission_only(&knobs_req);
        let change = KnobChange {
            from_step: 0,
            knobs: Some(knobs_req),
            journal_seq: seq,
            requested_by: who.to_owned(),
        };
        let result = self
            .edit_schedule(|s, v| {
                let d = knobs::decide(s, v, apply_at_step, admission_only);
                if let Decision::At(n) = d {
                    knobs::insert_change(
                        s,
                        KnobChange {
                            from_step: n,
                            ..change.clone()
                        },
                    );
                }
                d
            })
            .await;
        let outcome = self.journal_decision(e, result).await;
        if outcome.accepted {
            let (step, seq) = (outcome.effective_step, outcome.journal_seq);
            tracing::info!(who, action, step, seq, knobs = ?knobs::knob_rows(&knobs_req), "knob change accepted");
            self.pending_applied.push(PendingApply {
                seq,
                step,
                admission_only,
            });
            self.check_applied().await;
        } else {
            tracing::info!(who, action, reason = %outcome.reason, "knob change refused");
        }
        Ok(outcome)
    }

    /// Journals what a schedule edit decided (`e` is the request's entry).
    async fn journal_decision(
        &mut self,
        mut e: crate::journal::JournalEntry,
        result: Result<Decision, KnobError>,
    ) -> KnobOutcome {
        let mut outcome = KnobOutcome::decided(result);
        e.outcome = if outcome.accepted {
            "accepted"
        } else {
            "refused"
        }
        .into();
        e.effective_step = outcome.accepted.then_some(outcome.effective_step);
        e.reason = (!outcome.reason.is_empty()).then(|| outcome.reason.clone());
        outcome.journal_seq = self.journal_outcome(e).await;
        outcome
    }

    async fn checkpoint(
        &mut self,
        who: &str,
        peer: Option<String>,
        auth: Result<(), Unauthorized>,
    ) -> Result<KnobOutcome, Unauthorized> {
        let mut e = entry(who, "checkpoint", "refused");
        e.peer = peer;
        if let Err(Unauthorized(reason)) = auth {
            e.reason = Some(reason.clone());
            self.journal_outcome(e).await;
            return Err(Unauthorized(reason));
        }
        let result = self
            .edit_schedule(|s, v| {
                let d = knobs::decide(s, v, 0, false);
                if let Decision::At(n) = d
                    && !s.checkpoint_steps.contains(&n)
                {
                    s.checkpoint_steps.push(n);
                    s.checkpoint_steps.sort_unstable();
                }
                d
            })
            .await;
        let outcome = self.journal_decision(e, result).await;
        if outcome.accepted {
            self.pending_applied.push(PendingApply {
                seq: outcome.journal_seq,
                step: outcome.effective_step,
                admission_only: false,
            });
            self.check_applied().await;
        }
        Ok(outcome)
    }

    pub(super) async fn handle_admin(&mut self, cmd: AdminCommand) {
        match cmd {
            AdminCommand::Status(reply) => {
                let _ = reply.send(self.status());
            }
            AdminCommand::Workers(reply) => {
                let _ = reply.send(self.workers());
            }
            AdminCommand::GetKnobs(reply) => {
                let _ = reply.send(self.knobs_view());
            }
            AdminCommand::SetKnobs {
                req,
                peer,
                auth,
                reply,
            } => {
                let who = if req.requested_by.is_empty() {
                    "anonymous".to_owned()
                } else {
                    req.requested_by.clone()
                };
                let r = self
                    .set_knobs(
                        "set_knobs",
                        req.knobs.unwrap_or_default(),
                        req.apply_at_step,
                        &who,
                        peer,
                        auth,
                    )
                    .await
                    .map(KnobOutcome::into_set_knobs_reply);
                let _ = reply.send(r);
            }
            AdminCommand::Control {
                action,
                who,
                peer,
                auth,
                reply,
            } => {
                let who = if who.is_empty() {
                    "anonymous".to_owned()
                } else {
                    who
                };
                let r = match action {
                    ControlAction::Checkpoint => self.checkpoint(&who, peer, auth).await,
                    ControlAction::Pause | ControlAction::Resume => {
                        self.set_knobs(
                            action.name(),
                            Knobs {
                                paused: Some(action == ControlAction::Pause),
                                ..Default::default()
                            },
                            0,
                            &who,
                            peer,
                            auth,
                        )
                        .await
                    }
                };
                let _ = reply.send(r.map(KnobOutcome::into_control_reply));
            }
        }
    }
}
