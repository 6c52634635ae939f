//! Knob administration ([`KnobAdmin`]): the knob schedule loaded or created
//! at start and followed since, knob changes, pause/resume and checkpoints
//! asked for over the admin API (written to the schedule with
//! compare-and-set), and their journal entries — the request's outcome,
//! then "applied" once its step has come. Also what the knobs say: the
//! admission knobs in effect, the knobs view and the knob gauges.
//!
//! The methods take the learner's current `version` (it works on step
//! `version + 1`).

use std::sync::Arc;

use asyncrl_common::SharedClock;
use asyncrl_config::Config;
use asyncrl_control::kv::Change;
use asyncrl_protos::v1::{
    ControlReply, GetKnobsReply, KnobChange, KnobSchedule, Knobs, SetKnobsReply, SetKnobsRequest,
};
use asyncrl_transport::KvBucket;

use super::events::{ControlAction, Unauthorized};
use crate::error::CoordinatorError;
use crate::journal::{self, Journal, JournalEntry, entry};
use crate::knobs::{self, Decision, KNOBS_KEY, KnobError, StepKnobs};
use crate::metrics::{CoordinatorMetrics, KnobLabel, OutcomeLabel};

/// The learner step that `version` works on.
pub(super) fn current_step(version: i32) -> u64 {
    version.max(0) as u64 + 1
}

/// The admission knobs in effect: the staleness bound η and whether
/// admission is paused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Admission {
    pub(super) eta: u32,
    pub(super) paused: bool,
}

/// A pending "applied" journal entry: the request's journal seq (None when
/// its outcome could not be journaled), the step, and what seals it.
#[derive(Debug, Clone, Copy, PartialEq)]
struct PendingApply {
    seq: Option<u64>,
    step: u64,
    admission_only: bool,
}

/// Who asks (`anonymous` when unnamed), from where, and whether the admin
/// API let them.
struct Asker {
    who: String,
    peer: Option<String>,
    auth: Result<(), Unauthorized>,
}

impl Asker {
    fn new(who: String, peer: Option<String>, auth: Result<(), Unauthorized>) -> Self {
        let who = if who.is_empty() {
            "anonymous".to_owned()
        } else {
            who
        };
        Self { who, peer, auth }
    }
}

/// The knob schedule as this coordinator last read or wrote it, and the
/// journal of the requests that change it.
pub(super) struct KnobAdmin {
    schedule: KnobSchedule,
    /// The schedule's revision in the KV bucket.
    revision: u64,
    kv: Arc<dyn KvBucket>,
    journal: Journal,
    /// Accepted changes whose "applied" entry is still to be journaled.
    pending_applied: Vec<PendingApply>,
    metrics: CoordinatorMetrics,
    clock: SharedClock,
}

/// The outcome of a knob change, pause/resume or checkpoint request, as the
/// requester is told.
#[derive(Debug, Clone, PartialEq)]
struct KnobOutcome {
    accepted: bool,
    /// The step the change lands at (0 when refused).
    effective_step: u64,
    /// Why it was refused (empty when accepted).
    reason: String,
    /// The journal entry of the outcome; None when it could not be written.
    journal_seq: Option<u64>,
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

/// The knob schedule stored in the KV bucket, written from the config's
/// initial knobs when there is none; its revision.
async fn load_or_create_schedule(
    kv: &dyn KvBucket,
    config: &Config,
) -> Result<(KnobSchedule, u64), CoordinatorError> {
    let loaded = asyncrl_control::kv::edit(kv, KNOBS_KEY, 4, |entry| match entry {
        Some(e) => Ok(Change::Keep(knobs::decode_schedule(&e.value)?)),
        None => {
            let s = knobs::new_schedule(knobs::initial_knobs(config));
            Ok(Change::Write(knobs::encode_schedule(&s), s))
        }
    })
    .await
    .map_err(KnobError::from_edit)?;
    Ok((loaded.outcome, loaded.revision))
}

impl KnobAdmin {
    /// Loads the knob schedule (writing the config's initial knobs when
    /// there is none) and opens the journal; the changes accepted for steps
    /// after `version` whose "applied" is not journaled yet are still to be.
    pub(super) async fn load(
        kv: Arc<dyn KvBucket>,
        config: &Config,
        version: i32,
        metrics: CoordinatorMetrics,
        clock: SharedClock,
    ) -> Result<Self, CoordinatorError> {
        let (schedule, revision) = load_or_create_schedule(kv.as_ref(), config).await?;
        let journal = Journal::open(&journal::path(config)).await?;
        let version = version.max(0) as u64;
        let pending_applied = schedule
            .changes
            .iter()
            .filter(|ch| !journal.was_applied(ch.journal_seq) && ch.journal_seq > 0)
            .map(|ch| PendingApply {
                seq: Some(ch.journal_seq),
                step: ch.from_step,
                admission_only: ch.knobs.as_ref().is_some_and(knobs::is_admission_only),
            })
            .filter(|p| p.step > version)
            .collect();
        Ok(Self {
            schedule,
            revision,
            kv,
            journal,
            pending_applied,
            metrics,
            clock,
        })
    }

    /// The schedule as stored at `revision` (from the watch): adopted when
    /// newer than the one this coordinator knows, then journals what has
    /// been applied since.
    pub(super) async fn on_stored(&mut self, schedule: KnobSchedule, revision: u64, version: i32) {
        if revision > self.revision {
            self.schedule = schedule;
            self.revision = revision;
            self.check_applied(version).await;
        }
    }

    /// The step the learner has sealed the knobs through.
    pub(super) fn sealed_through_step(&self) -> u64 {
        self.schedule.sealed_through_step
    }

    /// The admission knobs in effect for the current step.
    pub(super) fn admission(&self, version: i32) -> Admission {
        let k = StepKnobs::at(&self.schedule, current_step(version));
        Admission {
            eta: k.eta,
            paused: k.paused,
        }
    }

    /// The knobs in effect and the changes still to come.
    pub(super) fn view(&self, version: i32) -> GetKnobsReply {
        let current = current_step(version);
        GetKnobsReply {
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
        }
    }

    /// The gauges of the knobs in effect (a labelled series each).
    pub(super) fn update_metrics(&self, version: i32) {
        let k = knobs::effective(&self.schedule, current_step(version));
        for (name, v) in knobs::knob_values(&k) {
            self.metrics
                .knob
                .get_or_create(&KnobLabel { knob: name.into() })
                .set(v);
        }
    }

    /// Journals "applied" for changes whose step has come.
    pub(super) async fn check_applied(&mut self, version: i32) {
        let sealed = self.schedule.sealed_through_step;
        let current = current_step(version);
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
    async fn journal_outcome(&mut self, mut e: JournalEntry) -> Option<u64> {
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
        version: i32,
        mut edit: impl FnMut(&mut KnobSchedule, i32) -> Decision,
    ) -> Result<Decision, KnobError> {
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
        self.revision = if edited.wrote {
            edited.revision
        } else {
            self.revision.max(edited.revision)
        };
        Ok(decision)
    }

    async fn set_knobs(
        &mut self,
        action: &str,
        knobs_req: Knobs,
        apply_at_step: u64,
        asker: Asker,
        version: i32,
    ) -> Result<KnobOutcome, Unauthorized> {
        let Asker { who, peer, auth } = asker;
        let who = who.as_str();
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
            .edit_schedule(version, |s, v| {
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
            self.check_applied(version).await;
        } else {
            tracing::info!(who, action, reason = %outcome.reason, "knob change refused");
        }
        Ok(outcome)
    }

    /// Journals what a schedule edit decided (`e` is the request's entry).
    async fn journal_decision(
        &mut self,
        mut e: JournalEntry,
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
        asker: Asker,
        version: i32,
    ) -> Result<KnobOutcome, Unauthorized> {
        let Asker { who, peer, auth } = asker;
        let mut e = entry(&who, "checkpoint", "refused");
        e.peer = peer;
        if let Err(Unauthorized(reason)) = auth {
            e.reason = Some(reason.clone());
            self.journal_outcome(e).await;
            return Err(Unauthorized(reason));
        }
        let result = self
            .edit_schedule(version, |s, v| {
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
            self.check_applied(version).await;
        }
        Ok(outcome)
    }

    /// A knob change asked for over the admin API.
    pub(super) async fn set_knobs_request(
        &mut self,
        req: SetKnobsRequest,
        peer: Option<String>,
        auth: Result<(), Unauthorized>,
        version: i32,
    ) -> Result<SetKnobsReply, Unauthorized> {
        let asker = Asker::new(req.requested_by.clone(), peer, auth);
        self.set_knobs(
            "set_knobs",
            req.knobs.unwrap_or_default(),
            req.apply_at_step,
            asker,
            version,
        )
        .await
        .map(KnobOutcome::into_set_knobs_reply)
    }

    /// A pause, resume or checkpoint asked for over the admin API.
    pub(super) async fn control(
        &mut self,
        action: ControlAction,
        who: String,
        peer: Option<String>,
        auth: Result<(), Unauthorized>,
        version: i32,
    ) -> Result<ControlReply, Unauthorized> {
        let asker = Asker::new(who, peer, auth);
        let r = match action {
            ControlAction::Checkpoint => self.checkpoint(asker, version).await,
            ControlAction::Pause | ControlAction::Resume => {
                self.set_knobs(
                    action.name(),
                    Knobs {
                        paused: Some(action == ControlAction::Pause),
                        ..Default::default()
                    },
                    0,
                    asker,
                    version,
                )
                .await
            }
        };
        r.map(KnobOutcome::into_control_reply)
    }
}
