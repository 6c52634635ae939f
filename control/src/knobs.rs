//! Live knobs: typed values with ranges, a schedule of changes keyed by the
//! learner step they apply from, and the seal protocol that makes "applied at
//! step N" exact.
//!
//! The schedule lives in the KV key `knobs` (a [`KnobSchedule`]). Two parties
//! write it, both with compare-and-set on the key's revision:
//! - the learner, at each step boundary, calls [`seal_step`] for the step it is
//!   about to train: it marks the step sealed and gets the knobs in effect;
//! - the coordinator accepts a change for step N only while N is above the
//!   sealed step, so a change is applied at exactly the step it names, or
//!   refused; it is never applied late.
//!
//! Admission knobs (η, paused) take effect for grants made while the learner
//! works on step ≥ N (v + 1 ≥ N). A change that only pauses or resumes
//! admission may name the learner's current step (it needs no seal).

use asyncrl_config::{
    ClipModeName, Config, ImportanceCorrectionName, InitialKnobs, KnobRange, StalenessConfig,
    knob_ranges,
};
use asyncrl_protos::v1::{ClipMode, ImportanceCorrection, KnobChange, KnobSchedule, Knobs};
use asyncrl_transport::{KvBucket, TransportError};

use crate::kv::{Change, EditError};
use bytes::Bytes;
use prost::Message;

/// KV key of the knob schedule (bucket `asyncrl_control`).
pub use asyncrl_protos::subjects::KNOBS_KEY;

#[derive(Debug, thiserror::Error)]
pub enum KnobError {
    #[error("knob `{name}` = {value} is out of range {range}")]
    OutOfRange {
        name: &'static str,
        value: f64,
        range: KnobRange,
    },
    #[error("knob `clip_mode` must be ppo, adaptive, m2po or gspo")]
    ClipMode,
    #[error("knob `importance_correction` must be mask, truncate (tis) or icepop")]
    ImportanceCorrection,
    #[error("the change sets no knob")]
    Empty,
    #[error(
        "unknown knob `{0}` (known: eta, eps_low, eps_high, clip_mode, adaptive_quantile, adaptive_temperature, importance_weight_cap, importance_correction, importance_weight_floor, dual_clip, learning_rate (lr), paused)"
    )]
    Unknown(String),
    #[error("`{0}` is not a knob assignment; write name=value, e.g. eta=2")]
    Syntax(String),
    #[error("knob `{name}`: cannot parse {value:?} ({expected})")]
    Value {
        name: &'static str,
        value: String,
        expected: &'static str,
    },
    #[error("no knob schedule in the KV bucket yet (key `knobs`): is the coordinator running?")]
    NoSchedule,
    #[error("the knob schedule (KV key `knobs`) does not decode: {0}")]
    Decode(#[source] prost::DecodeError),
    #[error("the knob schedule kept changing under compare-and-set ({0} attempts)")]
    Contended(u32),
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error("cannot {action} the knob schedule (KV key `knobs`): {source}")]
    Store {
        action: &'static str,
        #[source]
        source: TransportError,
    },
}

/// The wire value of a clip mode.
pub fn clip_mode_to_wire(name: ClipModeName) -> ClipMode {
    match name {
        ClipModeName::Ppo => ClipMode::Ppo,
        ClipModeName::Adaptive => ClipMode::Adaptive,
        ClipModeName::M2po => ClipMode::M2po,
        ClipModeName::Gspo => ClipMode::Gspo,
    }
}

/// The clip mode of a wire value (None: unspecified or unknown).
pub fn clip_mode_from_wire(mode: i32) -> Option<ClipModeName> {
    match ClipMode::try_from(mode) {
        Ok(ClipMode::Ppo) => Some(ClipModeName::Ppo),
        Ok(ClipMode::Adaptive) => Some(ClipModeName::Adaptive),
        Ok(ClipMode::M2po) => Some(ClipModeName::M2po),
        Ok(ClipMode::Gspo) => Some(ClipModeName::Gspo),
        Ok(ClipMode::Unspecified) | Err(_) => None,
    }
}

/// The name of a wire clip mode (`unspecified` for none).
pub fn clip_mode_name(mode: i32) -> &'static str {
    clip_mode_from_wire(mode).map_or("unspecified", ClipModeName::as_str)
}

/// The wire value of an importance correction.
pub fn importance_correction_to_wire(name: ImportanceCorrectionName) -> ImportanceCorrection {
    match name {
        ImportanceCorrectionName::Mask => ImportanceCorrection::Mask,
        ImportanceCorrectionName::Truncate => ImportanceCorrection::Truncate,
        ImportanceCorrectionName::Icepop => ImportanceCorrection::Icepop,
    }
}

/// The importance correction of a wire value (None: unspecified or unknown).
pub fn importance_correction_from_wire(value: i32) -> Option<ImportanceCorrectionName> {
    match ImportanceCorrection::try_from(value) {
        Ok(ImportanceCorrection::Mask) => Some(ImportanceCorrectionName::Mask),
        Ok(ImportanceCorrection::Truncate) => Some(ImportanceCorrectionName::Truncate),
        Ok(ImportanceCorrection::Icepop) => Some(ImportanceCorrectionName::Icepop),
        Ok(ImportanceCorrection::Unspecified) | Err(_) => None,
    }
}

/// The knobs a new run starts with: η from `[staleness]`, the rest from
/// `[coordinator.initial_knobs]`. Every field is set.
pub fn initial_knobs(config: &Config) -> Knobs {
    let k = &config.coordinator.initial_knobs;
    Knobs {
        eta: Some(config.staleness.eta),
        eps_low: Some(k.eps_low as f32),
        eps_high: Some(k.eps_high as f32),
        clip_mode: Some(clip_mode_to_wire(k.clip_mode) as i32),
        adaptive_quantile: Some(k.adaptive_quantile as f32),
        adaptive_temperature: Some(k.adaptive_temperature as f32),
        importance_weight_cap: Some(k.importance_weight_cap as f32),
        importance_correction: Some(importance_correction_to_wire(k.importance_correction) as i32),
        importance_weight_floor: Some(k.importance_weight_floor as f32),
        dual_clip: Some(k.dual_clip as f32),
        learning_rate: Some(k.learning_rate),
        paused: Some(k.paused),
    }
}

fn check(range: KnobRange, value: Option<f64>) -> Result<(), KnobError> {
    match value {
        Some(v) if !range.contains(v) => Err(KnobError::OutOfRange {
            name: range.name,
            value: v,
            range,
        }),
        _ => Ok(()),
    }
}

/// Checks every set field against its range.
pub fn validate(k: &Knobs) -> Result<(), KnobError> {
    if *k == Knobs::default() {
        return Err(KnobError::Empty);
    }
    check(knob_ranges::ETA, k.eta.map(f64::from))?;
    check(knob_ranges::EPS_LOW, k.eps_low.map(f64::from))?;
    check(knob_ranges::EPS_HIGH, k.eps_high.map(f64::from))?;
    check(
        knob_ranges::ADAPTIVE_QUANTILE,
        k.adaptive_quantile.map(f64::from),
    )?;
    check(
        knob_ranges::ADAPTIVE_TEMPERATURE,
        k.adaptive_temperature.map(f64::from),
    )?;
    check(
        knob_ranges::IMPORTANCE_WEIGHT_CAP,
        k.importance_weight_cap.map(f64::from),
    )?;
    check(
        knob_ranges::IMPORTANCE_WEIGHT_FLOOR,
        k.importance_weight_floor.map(f64::from),
    )?;
    check(knob_ranges::DUAL_CLIP, k.dual_clip.map(f64::from))?;
    check(knob_ranges::LEARNING_RATE, k.learning_rate)?;
    if k.clip_mode
        .is_some_and(|m| clip_mode_from_wire(m).is_none())
    {
        return Err(KnobError::ClipMode);
    }
    if k.importance_correction
        .is_some_and(|m| importance_correction_from_wire(m).is_none())
    {
        return Err(KnobError::ImportanceCorrection);
    }
    Ok(())
}

/// Whether a change touches only admission (pause/resume): it needs no seal.
pub fn is_admission_only(k: &Knobs) -> bool {
    k.paused.is_some() && Knobs { paused: None, ..*k } == Knobs::default()
}

/// Applies the set fields of `change` onto `base`.
pub fn merge(base: &mut Knobs, change: &Knobs) {
    macro_rules! take {
        ($($f:ident),*) => { $( if change.$f.is_some() { base.$f = change.$f; } )* };
    }
    take!(
        eta,
        eps_low,
        eps_high,
        clip_mode,
        adaptive_quantile,
        adaptive_temperature,
        importance_weight_cap,
        importance_correction,
        importance_weight_floor,
        dual_clip,
        learning_rate,
        paused
    );
}

/// A new schedule starting from `initial` (every field set).
pub fn new_schedule(initial: Knobs) -> KnobSchedule {
    KnobSchedule {
        base: Some(initial),
        base_step: 0,
        changes: Vec::new(),
        sealed_through_step: 0,
        checkpoint_steps: Vec::new(),
    }
}

/// The knobs in effect at learner step `step`.
pub fn effective(s: &KnobSchedule, step: u64) -> Knobs {
    let mut k = s.base.unwrap_or_default();
    for c in s.changes.iter().filter(|c| c.from_step <= step) {
        if let Some(change) = &c.knobs {
            merge(&mut k, change);
        }
    }
    k
}

/// Inserts a change in application order (from_step, then journal seq).
pub fn insert_change(s: &mut KnobSchedule, change: KnobChange) {
    let at = s.changes.partition_point(|c| {
        (c.from_step, c.journal_seq) <= (change.from_step, change.journal_seq)
    });
    s.changes.insert(at, change);
}

/// Folds changes of steps ≤ `through` (steps the learner has finished) into
/// the base, and forgets checkpoint requests of those steps.
pub fn compact(s: &mut KnobSchedule, through: u64) {
    if through <= s.base_step && s.changes.iter().all(|c| c.from_step > through) {
        return;
    }
    let mut base = s.base.unwrap_or_default();
    let (done, rest): (Vec<KnobChange>, Vec<KnobChange>) =
        s.changes.drain(..).partition(|c| c.from_step <= through);
    for c in &done {
        if let Some(k) = &c.knobs {
            merge(&mut base, k);
        }
    }
    s.base = Some(base);
    s.base_step = s.base_step.max(through);
    s.changes = rest;
    s.checkpoint_steps.retain(|&st| st > through);
}

/// Where a request lands, or why it is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Applies from this step on.
    At(u64),
    Refused(String),
}

/// Decides at which step a change applies. `version` is the learner's
/// current version (it is working on step `version + 1`); `requested` is the
/// step asked for, 0 meaning "the next control point".
pub fn decide(s: &KnobSchedule, version: i32, requested: u64, admission_only: bool) -> Decision {
    let current = version.max(0) as u64 + 1;
    let sealed = s.sealed_through_step;
    if admission_only {
        let n = if requested == 0 { current } else { requested };
        if n < current {
            return Decision::Refused(format!(
                "step {n} has passed (the learner is at step {current}); ask for step {current} or later, or 0 for now"
            ));
        }
        return Decision::At(n);
    }
    let next = (sealed + 1).max(current);
    let n = if requested == 0 { next } else { requested };
    if n <= sealed {
        return Decision::Refused(format!(
            "step {n} has already started (the learner sealed its knobs through step {sealed}); ask for step {next} or later, or 0 for the next step boundary"
        ));
    }
    if n < current {
        return Decision::Refused(format!(
            "step {n} has passed (the learner is at step {current}); ask for step {next} or later, or 0 for the next step boundary"
        ));
    }
    Decision::At(n)
}

pub fn decode_schedule(bytes: &[u8]) -> Result<KnobSchedule, KnobError> {
    KnobSchedule::decode(bytes).map_err(KnobError::Decode)
}

pub fn encode_schedule(s: &KnobSchedule) -> Bytes {
    Bytes::from(s.encode_to_vec())
}

/// The knobs of one learner step, typed.
#[derive(Debug, Clone, PartialEq)]
pub struct StepKnobs {
    pub step: u64,
    pub eta: u32,
    pub eps_low: f32,
    pub eps_high: f32,
    pub clip_mode: ClipModeName,
    pub adaptive_quantile: f32,
    pub adaptive_temperature: f32,
    pub importance_weight_cap: f32,
    pub importance_correction: ImportanceCorrectionName,
    pub importance_weight_floor: f32,
    /// Dual-clip PPO's bound (0: off).
    pub dual_clip: f32,
    pub learning_rate: f64,
    pub paused: bool,
    /// Write a checkpoint before training this step.
    pub checkpoint: bool,
}

impl StepKnobs {
    /// The knobs in effect at `step`. A knob the schedule leaves unset (a
    /// coordinator always sets every one) takes the config's default:
    /// `[staleness] eta` and `[coordinator.initial_knobs]`, the one home of
    /// the knobs' defaults.
    pub fn at(s: &KnobSchedule, step: u64) -> Self {
        let k = effective(s, step);
        let d = InitialKnobs::default();
        Self {
            step,
            eta: k.eta.unwrap_or(StalenessConfig::default().eta),
            eps_low: k.eps_low.unwrap_or(d.eps_low as f32),
            eps_high: k.eps_high.unwrap_or(d.eps_high as f32),
            clip_mode: k
                .clip_mode
                .and_then(clip_mode_from_wire)
                .unwrap_or(d.clip_mode),
            adaptive_quantile: k.adaptive_quantile.unwrap_or(d.adaptive_quantile as f32),
            adaptive_temperature: k
                .adaptive_temperature
                .unwrap_or(d.adaptive_temperature as f32),
            importance_weight_cap: k
                .importance_weight_cap
                .unwrap_or(d.importance_weight_cap as f32),
            importance_correction: k
                .importance_correction
                .and_then(importance_correction_from_wire)
                .unwrap_or(d.importance_correction),
            importance_weight_floor: k
                .importance_weight_floor
                .unwrap_or(d.importance_weight_floor as f32),
            dual_clip: k.dual_clip.unwrap_or(d.dual_clip as f32),
            learning_rate: k.learning_rate.unwrap_or(d.learning_rate),
            paused: k.paused.unwrap_or(d.paused),
            checkpoint: s.checkpoint_steps.contains(&step),
        }
    }
}

/// For the learner: call before training step `step` (1-based). Seals the
/// step (no knob change for it is accepted from now on) and returns the knobs
/// in effect for it. Calling it again for a sealed step (a restarted learner
/// replaying it) returns the same knobs without writing.
pub async fn seal_step(kv: &dyn KvBucket, step: u64) -> Result<StepKnobs, KnobError> {
    const ATTEMPTS: u32 = 64;
    let sealed = crate::kv::edit(kv, KNOBS_KEY, ATTEMPTS, |entry| {
        let entry = entry.ok_or(KnobError::NoSchedule)?;
        let mut s = decode_schedule(&entry.value)?;
        let knobs = StepKnobs::at(&s, step);
        if s.sealed_through_step >= step {
            return Ok(Change::Keep(knobs));
        }
        s.sealed_through_step = step;
        Ok(Change::Write(encode_schedule(&s), knobs))
    })
    .await;
    match sealed {
        Ok(edited) => Ok(edited.outcome),
        Err(e) => Err(KnobError::from_edit(e)),
    }
}

impl KnobError {
    /// The error of a compare-and-set edit of the knob schedule.
    pub fn from_edit(e: EditError<KnobError>) -> Self {
        match e {
            EditError::Refused(e) => e,
            EditError::Transport { action, source, .. } => KnobError::Store { action, source },
            EditError::Contended { attempts, .. } => KnobError::Contended(attempts),
        }
    }
}

/// Parses `name=value` (as `asyncrl ctl set` takes it) into a change.
pub fn parse_assignment(text: &str, into: &mut Knobs) -> Result<(), KnobError> {
    let (name, value) = text
        .split_once('=')
        .map(|(n, v)| (n.trim(), v.trim()))
        .filter(|(n, v)| !n.is_empty() && !v.is_empty())
        .ok_or_else(|| KnobError::Syntax(text.to_owned()))?;
    fn num<T: std::str::FromStr>(name: &'static str, v: &str) -> Result<T, KnobError> {
        v.parse().map_err(|_| KnobError::Value {
            name,
            value: v.to_owned(),
            expected: "a number",
        })
    }
    match name.to_ascii_lowercase().replace('-', "_").as_str() {
        "eta" => {
            into.eta = Some(v_eta(value)?);
        }
        "eps_low" => into.eps_low = Some(num("eps_low", value)?),
        "eps_high" => into.eps_high = Some(num("eps_high", value)?),
        "clip_mode" => {
            let mode: ClipModeName = value.parse().map_err(|_| KnobError::ClipMode)?;
            into.clip_mode = Some(clip_mode_to_wire(mode) as i32);
        }
        "adaptive_quantile" => into.adaptive_quantile = Some(num("adaptive_quantile", value)?),
        "adaptive_temperature" => {
            into.adaptive_temperature = Some(num("adaptive_temperature", value)?)
        }
        "importance_weight_cap" | "iw_cap" => {
            into.importance_weight_cap = Some(num("importance_weight_cap", value)?)
        }
        "importance_correction" | "is_correction" => {
            let mode: ImportanceCorrectionName =
                value.parse().map_err(|_| KnobError::ImportanceCorrection)?;
            into.importance_correction = Some(importance_correction_to_wire(mode) as i32);
        }
        "importance_weight_floor" | "iw_floor" => {
            into.importance_weight_floor = Some(num("importance_weight_floor", value)?)
        }
        "dual_clip" | "clip_ratio_c" => into.dual_clip = Some(num("dual_clip", value)?),
        "learning_rate" | "lr" => into.learning_rate = Some(num("learning_rate", value)?),
        "paused" => {
            into.paused = Some(match value.to_ascii_lowercase().as_str() {
                "true" | "yes" | "1" | "on" => true,
                "false" | "no" | "0" | "off" => false,
                _ => {
                    return Err(KnobError::Value {
                        name: "paused",
                        value: value.to_owned(),
                        expected: "true or false",
                    });
                }
            })
        }
        _ => return Err(KnobError::Unknown(name.to_owned())),
    }
    Ok(())
}

fn v_eta(value: &str) -> Result<u32, KnobError> {
    value.parse().map_err(|_| KnobError::Value {
        name: "eta",
        value: value.to_owned(),
        expected: "a whole number",
    })
}

/// `(name, value)` of every set field, in a fixed order (tables, metrics).
pub fn knob_rows(k: &Knobs) -> Vec<(&'static str, String)> {
    let mut rows = Vec::new();
    if let Some(v) = k.eta {
        rows.push(("eta", v.to_string()));
    }
    if let Some(v) = k.eps_low {
        rows.push(("eps_low", v.to_string()));
    }
    if let Some(v) = k.eps_high {
        rows.push(("eps_high", v.to_string()));
    }
    if let Some(v) = k.clip_mode {
        rows.push(("clip_mode", clip_mode_name(v).to_owned()));
    }
    if let Some(v) = k.adaptive_quantile {
        rows.push(("adaptive_quantile", v.to_string()));
    }
    if let Some(v) = k.adaptive_temperature {
        rows.push(("adaptive_temperature", v.to_string()));
    }
    if let Some(v) = k.importance_weight_cap {
        rows.push(("importance_weight_cap", v.to_string()));
    }
    if let Some(v) = k.importance_correction {
        rows.push((
            "importance_correction",
            importance_correction_from_wire(v)
                .map_or("unspecified", ImportanceCorrectionName::as_str)
                .to_owned(),
        ));
    }
    if let Some(v) = k.importance_weight_floor {
        rows.push(("importance_weight_floor", v.to_string()));
    }
    if let Some(v) = k.dual_clip {
        rows.push(("dual_clip", v.to_string()));
    }
    if let Some(v) = k.learning_rate {
        rows.push(("learning_rate", format!("{v:e}")));
    }
    if let Some(v) = k.paused {
        rows.push(("paused", v.to_string()));
    }
    rows
}

/// `(name, numeric value)` of every set field (clip mode and importance
/// correction as their enum numbers).
pub fn knob_values(k: &Knobs) -> Vec<(&'static str, f64)> {
    let mut out = Vec::new();
    let mut push = |n, v: Option<f64>| {
        if let Some(v) = v {
            out.push((n, v));
        }
    };
    push("eta", k.eta.map(f64::from));
    push("eps_low", k.eps_low.map(f64::from));
    push("eps_high", k.eps_high.map(f64::from));
    push("clip_mode", k.clip_mode.map(f64::from));
    push("adaptive_quantile", k.adaptive_quantile.map(f64::from));
    push(
        "adaptive_temperature",
        k.adaptive_temperature.map(f64::from),
    );
    push(
        "importance_weight_cap",
        k.importance_weight_cap.map(f64::from),
    );
    push(
        "importance_correction",
        k.importance_correction.map(f64::from),
    );
    push(
        "importance_weight_floor",
        k.importance_weight_floor.map(f64::from),
    );
    push("dual_clip", k.dual_clip.map(f64::from));
    push("learning_rate", k.learning_rate);
    push("paused", k.paused.map(|p| if p { 1.0 } else { 0.0 }));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use asyncrl_transport::{Bus, LocalBus};

    fn base() -> Knobs {
        initial_knobs(&Config::default())
    }

    #[test]
    fn unset_knobs_fall_back_to_the_config_defaults() {
        let config = Config::default();
        let unset = StepKnobs::at(&new_schedule(Knobs::default()), 1);
        let configured = StepKnobs::at(&new_schedule(initial_knobs(&config)), 1);
        assert_eq!(unset, configured);
        assert_eq!(unset.clip_mode, config.coordinator.initial_knobs.clip_mode);
        assert_eq!(unset.eta, config.staleness.eta);
        // A knob that is set wins; the others still fall back.
        let partial = StepKnobs::at(
            &new_schedule(Knobs {
                eta: Some(1),
                clip_mode: Some(ClipMode::M2po as i32),
                ..Default::default()
            }),
            1,
        );
        assert_eq!(
            partial,
            StepKnobs {
                eta: 1,
                clip_mode: ClipModeName::M2po,
                ..configured
            }
        );
    }

    fn change(from: u64, seq: u64, k: Knobs) -> KnobChange {
        KnobChange {
            from_step: from,
            knobs: Some(k),
            journal_seq: seq,
            requested_by: "t".into(),
        }
    }

    #[test]
    fn ranges_are_checked_per_knob() {
        for (k, want) in [
            (
                Knobs {
                    eta: Some(65),
                    ..Default::default()
                },
                "`eta` = 65",
            ),
            (
                Knobs {
                    eps_low: Some(1.0),
                    ..Default::default()
                },
                "`eps_low`",
            ),
            (
                Knobs {
                    eps_high: Some(-0.1),
                    ..Default::default()
                },
                "`eps_high`",
            ),
            (
                Knobs {
                    adaptive_quantile: Some(0.0),
                    ..Default::default()
                },
                "`adaptive_quantile`",
            ),
            (
                Knobs {
                    adaptive_temperature: Some(f32::NAN),
                    ..Default::default()
                },
                "`adaptive_temperature`",
            ),
            (
                Knobs {
                    importance_weight_cap: Some(0.5),
                    ..Default::default()
                },
                "`importance_weight_cap`",
            ),
            (
                Knobs {
                    importance_weight_floor: Some(1.5),
                    ..Default::default()
                },
                "`importance_weight_floor` = 1.5",
            ),
            (
                Knobs {
                    importance_correction: Some(0),
                    ..Default::default()
                },
                "importance_correction",
            ),
            (
                Knobs {
                    importance_correction: Some(9),
                    ..Default::default()
                },
                "mask, truncate (tis) or icepop",
            ),
            (
                Knobs {
                    dual_clip: Some(0.5),
                    ..Default::default()
                },
                "`dual_clip` = 0.5 is out of range [1, 1000] or 0 (off)",
            ),
            (
                Knobs {
                    dual_clip: Some(f32::INFINITY),
                    ..Default::default()
                },
                "`dual_clip`",
            ),
            (
                Knobs {
                    learning_rate: Some(2.0),
                    ..Default::default()
                },
                "`learning_rate`",
            ),
            (
                Knobs {
                    clip_mode: Some(0),
                    ..Default::default()
                },
                "clip_mode",
            ),
            (Knobs::default(), "sets no knob"),
        ] {
            let err = validate(&k).unwrap_err().to_string();
            assert!(err.contains(want), "{k:?}: {err}");
        }
        validate(&base()).unwrap();
        validate(&Knobs {
            eta: Some(0),
            ..Default::default()
        })
        .unwrap();
        // Dual clip: 0 turns it off; a bound of at least 1 turns it on.
        for on_or_off in [0.0, 1.0, 3.0] {
            validate(&Knobs {
                dual_clip: Some(on_or_off),
                ..Default::default()
            })
            .unwrap();
        }
    }

    #[test]
    fn schedule_applies_changes_from_their_step() {
        let mut s = new_schedule(base());
        insert_change(
            &mut s,
            change(
                5,
                2,
                Knobs {
                    learning_rate: Some(2e-6),
                    ..Default::default()
                },
            ),
        );
        insert_change(
            &mut s,
            change(
                3,
                1,
                Knobs {
                    eta: Some(1),
                    ..Default::default()
                },
            ),
        );
        insert_change(
            &mut s,
            change(
                5,
                3,
                Knobs {
                    learning_rate: Some(3e-6),
                    ..Default::default()
                },
            ),
        );
        assert_eq!(
            s.changes.iter().map(|c| c.journal_seq).collect::<Vec<_>>(),
            [1, 2, 3]
        );
        assert_eq!(effective(&s, 2).eta, Some(4));
        assert_eq!(effective(&s, 3).eta, Some(1));
        assert_eq!(effective(&s, 4).learning_rate, Some(1e-6));
        assert_eq!(effective(&s, 5).learning_rate, Some(3e-6));
        let before: Vec<Knobs> = (0..8).map(|st| effective(&s, st)).collect();
        compact(&mut s, 4);
        assert_eq!(s.changes.len(), 2);
        for st in 4..8 {
            assert_eq!(effective(&s, st), before[st as usize], "step {st}");
        }
    }

    #[test]
    fn decisions_refuse_sealed_and_past_steps() {
        let mut s = new_schedule(base());
        s.sealed_through_step = 6;
        // Learner at version 5, working on (sealed) step 6.
        assert_eq!(decide(&s, 5, 0, false), Decision::At(7));
        assert_eq!(decide(&s, 5, 9, false), Decision::At(9));
        let Decision::Refused(r) = decide(&s, 5, 6, false) else {
            panic!()
        };
        assert!(
            r.contains("step 6 has already started")
                && r.contains("sealed its knobs through step 6"),
            "{r}"
        );
        assert!(matches!(decide(&s, 5, 2, false), Decision::Refused(_)));
        // Pause/resume only needs the step not to have passed.
        assert_eq!(decide(&s, 5, 0, true), Decision::At(6));
        assert_eq!(decide(&s, 5, 6, true), Decision::At(6));
        assert!(matches!(decide(&s, 5, 5, true), Decision::Refused(_)));
        // A learner that never sealed: the current step is the floor.
        let fresh = new_schedule(base());
        assert_eq!(decide(&fresh, 3, 0, false), Decision::At(4));
        assert!(matches!(decide(&fresh, 3, 3, false), Decision::Refused(_)));
    }

    #[test]
    fn assignments_parse_with_clear_errors() {
        let mut k = Knobs::default();
        for a in [
            "eta=2",
            "lr=3e-6",
            "clip_mode=M2PO",
            "paused=yes",
            "iw_cap = 4",
            "eps-high=0.3",
            "clip_mode=gspo",
            "importance_correction=TIS",
            "iw_floor=0.25",
            "clip_ratio_c=3",
        ] {
            parse_assignment(a, &mut k).unwrap();
        }
        assert_eq!(k.eta, Some(2));
        assert_eq!(k.learning_rate, Some(3e-6));
        assert_eq!(k.clip_mode, Some(ClipMode::Gspo as i32));
        assert_eq!(
            k.importance_correction,
            Some(ImportanceCorrection::Truncate as i32)
        );
        assert_eq!(k.importance_weight_floor, Some(0.25));
        assert_eq!(k.dual_clip, Some(3.0));
        parse_assignment("is_correction=icepop", &mut k).unwrap();
        assert_eq!(
            k.importance_correction,
            Some(ImportanceCorrection::Icepop as i32)
        );
        assert_eq!(k.paused, Some(true));
        assert_eq!(k.importance_weight_cap, Some(4.0));
        assert_eq!(k.eps_high, Some(0.3));
        for (a, want) in [
            ("eta", "name=value"),
            ("eta=", "name=value"),
            ("beta=1", "unknown knob `beta`"),
            ("eta=-1", "whole number"),
            ("lr=fast", "`learning_rate`"),
            ("paused=maybe", "true or false"),
            ("clip_mode=x", "ppo, adaptive, m2po or gspo"),
            (
                "importance_correction=clip",
                "mask, truncate (tis) or icepop",
            ),
            ("iw_floor=low", "`importance_weight_floor`"),
        ] {
            let err = parse_assignment(a, &mut k).unwrap_err().to_string();
            assert!(err.contains(want), "{a}: {err}");
        }
        assert!(is_admission_only(&Knobs {
            paused: Some(true),
            ..Default::default()
        }));
        assert!(!is_admission_only(&Knobs {
            paused: Some(true),
            eta: Some(1),
            ..Default::default()
        }));
    }

    #[tokio::test]
    async fn seal_step_seals_and_replays() {
        let bus = LocalBus::new();
        let kv = bus
            .kv(asyncrl_protos::subjects::CONTROL_BUCKET)
            .await
            .unwrap();
        assert!(matches!(
            seal_step(kv.as_ref(), 1).await,
            Err(KnobError::NoSchedule)
        ));
        let mut s = new_schedule(base());
        insert_change(
            &mut s,
            change(
                2,
                1,
                Knobs {
                    eta: Some(0),
                    ..Default::default()
                },
            ),
        );
        s.checkpoint_steps.push(2);
        kv.put(KNOBS_KEY, encode_schedule(&s)).await.unwrap();
        let k1 = seal_step(kv.as_ref(), 1).await.unwrap();
        assert_eq!(
            (k1.eta, k1.checkpoint, k1.clip_mode),
            (4, false, ClipModeName::Adaptive)
        );
        let k2 = seal_step(kv.as_ref(), 2).await.unwrap();
        assert_eq!((k2.eta, k2.checkpoint), (0, true));
        let stored = decode_schedule(&kv.get(KNOBS_KEY).await.unwrap().unwrap().value).unwrap();
        assert_eq!(stored.sealed_through_step, 2);
        // Replaying step 1 after a restart: same knobs, nothing written.
        let rev = kv.get(KNOBS_KEY).await.unwrap().unwrap().revision;
        assert_eq!(seal_step(kv.as_ref(), 1).await.unwrap(), k1);
        assert_eq!(kv.get(KNOBS_KEY).await.unwrap().unwrap().revision, rev);
    }
}
