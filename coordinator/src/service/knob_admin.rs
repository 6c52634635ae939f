//! Knob administration: the knob schedule loaded or created at start, knob
//! changes, pause/resume and checkpoints asked for over the admin API
//! (written to the schedule with compare-and-set), and their journal
//! entries — the request's outcome, then "applied" once its step has come.

use asyncrl_config::Config;
use asyncrl_protos::v1::{
    ControlReply, GetKnobsReply, KnobChange, KnobSchedule, Knobs, SetKnobsReply,
};
use asyncrl_transport::{KvBucket, TransportError};

use super::actor::{Actor, PendingApply};
use super::{AdminCommand, ControlAction, Unauthorized};
use crate::CoordinatorError;
use crate::journal::{entry, now_unix_ms};
use crate::knobs::{self, Decision, KNOBS_KEY};
use crate::metrics::OutcomeLabel;

pub(super) async fn load_or_create_schedule(
    kv: &dyn KvBucket,
    config: &Config,
) -> Result<(KnobSchedule, u64), CoordinatorError> {
    for _ in 0..4 {
        if let Some(e) = kv
            .get(KNOBS_KEY)
            .await
            .map_err(|e| CoordinatorError::transport("read the knob schedule", e))?
        {
            return Ok((knobs::decode_schedule(&e.value)?, e.revision));
        }
        let s = knobs::new_schedule(knobs::initial_knobs(config));
        match kv.create(KNOBS_KEY, knobs::encode_schedule(&s)).await {
            Ok(rev) => return Ok((s, rev)),
            Err(TransportError::KeyExists { .. }) => continue,
            Err(e) => return Err(CoordinatorError::transport("create the knob schedule", e)),
        }
    }
    Err(CoordinatorError::transport(
        "create the knob schedule",
        TransportError::KeyExists {
            key: KNOBS_KEY.into(),
        },
    ))
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
            e.ref_seq = Some(p.seq);
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

    async fn journal_outcome(&mut self, mut e: crate::journal::JournalEntry) -> u64 {
        self.metrics
            .knob_requests
            .get_or_create(&OutcomeLabel {
                outcome: e.outcome.clone(),
            })
            .inc();
        e.unix_ms = now_unix_ms();
        match self.journal.append(e).await {
            Ok(seq) => seq,
            Err(err) => {
                tracing::error!(error = %err, "cannot append to the knob journal");
                0
            }
        }
    }

    /// Writes a modified schedule with compare-and-set; `edit` returns the
    /// step the change lands at, or a refusal. Retries on concurrent writes
    /// (the learner sealing a step).
    async fn edit_schedule(
        &mut self,
        mut edit: impl FnMut(&mut KnobSchedule, i32) -> Decision,
    ) -> Result<Decision, String> {
        for _ in 0..16 {
            let entry = match self.kv.get(KNOBS_KEY).await {
                Ok(Some(e)) => e,
                Ok(None) => return Err("the knob schedule is missing from the KV bucket".into()),
                Err(e) => return Err(format!("cannot read the knob schedule: {e}")),
            };
            let mut s = knobs::decode_schedule(&entry.value).map_err(|e| e.to_string())?;
            let decision = edit(&mut s, self.sched.version());
            if let Decision::Refused(_) = decision {
                self.schedule = s;
                self.schedule_rev = self.schedule_rev.max(entry.revision);
                return Ok(decision);
            }
            knobs::compact(&mut s, self.sched.version().max(0) as u64);
            match self
                .kv
                .update(KNOBS_KEY, knobs::encode_schedule(&s), entry.revision)
                .await
            {
                Ok(rev) => {
                    self.schedule = s;
                    self.schedule_rev = rev;
                    return Ok(decision);
                }
                Err(TransportError::RevisionMismatch { .. }) => continue,
                Err(e) => return Err(format!("cannot store the knob schedule: {e}")),
            }
        }
        Err("the knob schedule kept changing under compare-and-set".into())
    }

    async fn set_knobs(
        &mut self,
        action: &str,
        knobs_req: Knobs,
        apply_at_step: u64,
        who: &str,
        peer: Option<String>,
        auth: Result<(), Unauthorized>,
    ) -> Result<(bool, u64, String, u64), Unauthorized> {
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
            let seq = self.journal_outcome(e).await;
            return Ok((false, 0, reason, seq));
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
        let (accepted, step, reason) = match result {
            Ok(Decision::At(n)) => (true, n, String::new()),
            Ok(Decision::Refused(r)) => (false, 0, r),
            Err(r) => (false, 0, r),
        };
        e.outcome = if accepted { "accepted" } else { "refused" }.into();
        e.effective_step = accepted.then_some(step);
        e.reason = (!reason.is_empty()).then(|| reason.clone());
        let seq = self.journal_outcome(e).await;
        if accepted {
            tracing::info!(who, action, step, seq, knobs = ?knobs::knob_rows(&knobs_req), "knob change accepted");
            self.pending_applied.push(PendingApply {
                seq,
                step,
                admission_only,
            });
            self.check_applied().await;
        } else {
            tracing::info!(who, action, reason = %reason, "knob change refused");
        }
        Ok((accepted, step, reason, seq))
    }

    async fn checkpoint(
        &mut self,
        who: &str,
        peer: Option<String>,
        auth: Result<(), Unauthorized>,
    ) -> Result<ControlReply, Unauthorized> {
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
        let (accepted, step, reason) = match result {
            Ok(Decision::At(n)) => (true, n, String::new()),
            Ok(Decision::Refused(r)) | Err(r) => (false, 0, r),
        };
        e.outcome = if accepted { "accepted" } else { "refused" }.into();
        e.effective_step = accepted.then_some(step);
        e.reason = (!reason.is_empty()).then(|| reason.clone());
        let seq = self.journal_outcome(e).await;
        if accepted {
            self.pending_applied.push(PendingApply {
                seq,
                step,
                admission_only: false,
            });
            self.check_applied().await;
        }
        Ok(ControlReply {
            accepted,
            effective_step: step,
            reason,
            journal_seq: seq,
        })
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
                let current = self.current_step();
                let _ = reply.send(GetKnobsReply {
                    knobs: Some(knobs::effective(&self.schedule, current)),
                    pending: self
                        .schedule
                        .changes
                        .iter()
                        .filter(|c| c.from_step > current)
                        .cloned()
                        .collect(),
                    current_step: current,
                    sealed_through_step: self.schedule.sealed_through_step,
                });
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
                    .map(
                        |(accepted, effective_step, reason, journal_seq)| SetKnobsReply {
                            accepted,
                            effective_step,
                            reason,
                            journal_seq,
                        },
                    );
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
                    ControlAction::Pause | ControlAction::Resume => self
                        .set_knobs(
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
                        .map(
                            |(accepted, effective_step, reason, journal_seq)| ControlReply {
                                accepted,
                                effective_step,
                                reason,
                                journal_seq,
                            },
                        ),
                };
                let _ = reply.send(r);
            }
        }
    }
}
