//! From the buffer's Arrow record batches to padded training tensors.
//!
//! Sequences are right-padded: with causal attention a pad after the last
//! real token can never influence a real one, so the model needs no
//! attention mask and positions are simply `0..L`. Token ids, log-probs and
//! versions are copied row by row (one slice copy per row out of Arrow's
//! contiguous value buffers), never element by element.

use std::collections::HashMap;

use arrow::array::{Array, AsArray, RecordBatch};
use arrow::datatypes::{Float32Type, Int32Type};
use asyncrl_policy::SharedLanes;
use asyncrl_protos::arrow_schema as cols;
use tch::{Device, Kind, Tensor};

use crate::advantages::{AdvantageNorm, grpo_advantages};

/// A batch the learner refuses: it trains on none of it. Each names the
/// field (Arrow column) that was wrong ([`BatchError::field`]).
#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    #[error("record batch column `{0}` is missing or has the wrong type")]
    Column(&'static str),
    #[error("row {row}: `{field}` {reason}")]
    Row {
        row: usize,
        field: &'static str,
        reason: String,
    },
    #[error("the batch holds no trajectories")]
    Empty,
    #[error("the batch is not an Arrow IPC stream of trajectories: {0}")]
    Ipc(#[source] arrow::error::ArrowError),
    #[error("the batch's Arrow schema is not the trajectory schema (column `{0}`)")]
    Schema(String),
    /// The Arrow decoder panicked on the bytes (caught; the text is the
    /// panic's payload).
    #[error("the batch is not an Arrow IPC stream of trajectories: the decoder panicked: {0}")]
    DecoderPanic(String),
    /// The turn columns of a multi-turn row do not fit together.
    #[error("the batch's turn columns are invalid: {0}")]
    Turns(#[source] asyncrl_protos::ContractError),
}

impl BatchError {
    /// The field (column) at fault, as the `field` label of
    /// `asyncrl_learner_bad_batches_total`: a column name, or `arrow_ipc`
    /// for bytes that do not decode, `batch` for an empty one.
    pub fn field(&self) -> &'static str {
        match self {
            BatchError::Column(c) | BatchError::Row { field: c, .. } => c,
            BatchError::Empty => "batch",
            BatchError::Ipc(_) | BatchError::DecoderPanic(_) => "arrow_ipc",
            BatchError::Schema(_) => "schema",
            BatchError::Turns(_) => cols::TURN_MODEL_TOKENS,
        }
    }
}

/// What a batch may hold, from the learner's model and version: checked by
/// [`check`] before anything is sized from the batch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchLimits {
    /// Token ids lie in `[0, vocab_size)`.
    pub vocab_size: i64,
    /// Prompt + completion tokens of a row (the model's context length).
    pub max_seq_len: usize,
    /// The learner's version: no token can have been sampled by a newer one.
    pub max_version: i32,
}

/// Decodes a batch reply's Arrow IPC stream (compressed or not) into record
/// batches of the trajectory schema. Never panics, whatever the bytes: a
/// panic of the Arrow decoder is caught and returned as an error.
pub fn decode_ipc(bytes: &[u8]) -> Result<Vec<RecordBatch>, BatchError> {
    let decoded = std::panic::catch_unwind(|| {
        let reader = arrow::ipc::reader::StreamReader::try_new(std::io::Cursor::new(bytes), None)
            .map_err(BatchError::Ipc)?;
        let want = cols::trajectory_schema();
        let got = reader.schema();
        if let Some(f) = want
            .fields()
            .iter()
            .find(|f| got.field_with_name(f.name()).ok() != Some(f.as_ref()))
        {
            return Err(BatchError::Schema(f.name().clone()));
        }
        if got.fields().len() != want.fields().len() {
            let extra = got
                .fields()
                .iter()
                .find(|f| want.field_with_name(f.name()).is_err())
                .map(|f| f.name().clone())
                .unwrap_or_default();
            return Err(BatchError::Schema(extra));
        }
        reader
            .collect::<Result<Vec<_>, _>>()
            .map_err(BatchError::Ipc)
    });
    decoded.unwrap_or_else(|panic| {
        Err(BatchError::DecoderPanic(
            panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("(no message)")
                .to_owned(),
        ))
    })
}

fn row_error(row: usize, field: &'static str, reason: impl Into<String>) -> BatchError {
    BatchError::Row {
        row,
        field,
        reason: reason.into(),
    }
}

/// Checks every row of `batches` against the contract and `limits` before
/// the learner trains on them: token ids in the vocabulary, rows no longer
/// than the model's context, one log-prob and one version per completion
/// token, log-probs finite and ≤ 0 (1e-3 of rounding allowed, as the wire
/// contract does), versions in `[0, max_version]` (each token's own: the
/// objective needs no order among them), no null inside a list, rewards finite where present.
/// The first problem is returned, naming its row and field.
pub fn check(batches: &[RecordBatch], limits: &BatchLimits) -> Result<(), BatchError> {
    match check_rows(batches, limits)?.into_iter().next() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// As [`check`], but every row is checked: the problem of each bad row
/// (a [`BatchError::Row`], in row order). The error is a problem of the
/// batch as a whole (a column missing, no rows), which no row is to blame
/// for.
pub fn check_rows(
    batches: &[RecordBatch],
    limits: &BatchLimits,
) -> Result<Vec<BatchError>, BatchError> {
    let mut base = 0usize;
    let mut any = false;
    let mut bad: Vec<BatchError> = Vec::new();
    for batch in batches {
        let mut null_rows = std::collections::BTreeSet::new();
        for name in [
            cols::PROMPT_TOKEN_IDS,
            cols::COMPLETION_TOKEN_IDS,
            cols::BEHAVIOUR_LOGPROBS,
            cols::POLICY_VERSIONS,
        ] {
            let list = batch
                .column_by_name(name)
                .and_then(|c| c.as_list_opt::<i32>())
                .ok_or(BatchError::Column(name))?;
            for i in
                (0..list.len()).filter(|i| !list.is_null(*i) && list.value(*i).null_count() > 0)
            {
                if null_rows.insert(i) {
                    bad.push(row_error(base + i, name, "holds a null entry"));
                }
            }
        }
        let (p_vals, p_off) = list_rows::<Int32Type>(batch, cols::PROMPT_TOKEN_IDS)?;
        let (c_vals, c_off) = list_rows::<Int32Type>(batch, cols::COMPLETION_TOKEN_IDS)?;
        let (l_vals, l_off) = list_rows::<Float32Type>(batch, cols::BEHAVIOUR_LOGPROBS)?;
        let (v_vals, v_off) = list_rows::<Int32Type>(batch, cols::POLICY_VERSIONS)?;
        let reward = batch
            .column_by_name(cols::REWARD)
            .and_then(|c| c.as_primitive_opt::<Float32Type>())
            .ok_or(BatchError::Column(cols::REWARD))?;
        let turns = turns_of(batch)?;
        for i in 0..batch.num_rows() {
            any = true;
            if null_rows.contains(&i) {
                continue;
            }
            let row = base + i;
            let span = |off: &[i32]| off[i] as usize..off[i + 1] as usize;
            let checked = || -> Result<(), BatchError> {
                let (prompt, completion) = (&p_vals[span(p_off)], &c_vals[span(c_off)]);
                let (logprobs, versions) = (&l_vals[span(l_off)], &v_vals[span(v_off)]);
                if prompt.is_empty() {
                    return Err(row_error(row, cols::PROMPT_TOKEN_IDS, "is empty"));
                }
                let len = prompt.len() + completion.len();
                if len > limits.max_seq_len {
                    return Err(row_error(
                        row,
                        cols::COMPLETION_TOKEN_IDS,
                        format!(
                            "makes the row {len} tokens long, beyond the model's {}",
                            limits.max_seq_len
                        ),
                    ));
                }
                for (name, ids) in [
                    (cols::PROMPT_TOKEN_IDS, prompt),
                    (cols::COMPLETION_TOKEN_IDS, completion),
                ] {
                    if let Some(t) = ids
                        .iter()
                        .find(|t| **t < 0 || i64::from(**t) >= limits.vocab_size)
                    {
                        return Err(row_error(
                            row,
                            name,
                            format!(
                                "holds token id {t}, outside the vocabulary [0, {})",
                                limits.vocab_size
                            ),
                        ));
                    }
                }
                let model = asyncrl_protos::model_token_count(&turns[i], completion.len())
                    .map_err(|e| row_error(row, cols::TURN_MODEL_TOKENS, e.to_string()))?;
                let what = if turns[i].is_empty() {
                    "completion tokens"
                } else {
                    "model tokens"
                };
                if logprobs.len() != model {
                    return Err(row_error(
                        row,
                        cols::BEHAVIOUR_LOGPROBS,
                        format!("has {} entries for {model} {what}", logprobs.len()),
                    ));
                }
                if versions.len() != model {
                    return Err(row_error(
                        row,
                        cols::POLICY_VERSIONS,
                        format!("has {} entries for {model} {what}", versions.len()),
                    ));
                }
                if let Some(lp) = logprobs.iter().find(|lp| !lp.is_finite() || **lp > 1e-3) {
                    return Err(row_error(
                        row,
                        cols::BEHAVIOUR_LOGPROBS,
                        format!("{lp} is not a log-probability"),
                    ));
                }
                if let Some(v) = versions
                    .iter()
                    .find(|v| **v < 0 || **v > limits.max_version)
                {
                    return Err(row_error(
                        row,
                        cols::POLICY_VERSIONS,
                        format!(
                            "version {v} is outside [0, {}] (the learner's version)",
                            limits.max_version
                        ),
                    ));
                }
                if !reward.is_null(i) && !reward.value(i).is_finite() {
                    return Err(row_error(
                        row,
                        cols::REWARD,
                        format!("{} is not finite", reward.value(i)),
                    ));
                }
                Ok(())
            };
            if let Err(e) = checked() {
                bad.push(e);
            }
        }
        base += batch.num_rows();
    }
    if !any {
        return Err(BatchError::Empty);
    }
    Ok(bad)
}

/// The group id of every row of `batches`, in row order.
pub fn row_group_ids(batches: &[RecordBatch]) -> Result<Vec<String>, BatchError> {
    let mut out = Vec::new();
    for batch in batches {
        let ids = batch
            .column_by_name(cols::GROUP_ID)
            .and_then(|c| c.as_string_opt::<i32>())
            .ok_or(BatchError::Column(cols::GROUP_ID))?;
        out.extend((0..ids.len()).map(|i| ids.value(i).to_owned()));
    }
    Ok(out)
}

/// The groups to refuse for `errors` (rows' problems, as [`check_rows`]
/// gives them): each group once, with the first problem of its rows.
pub fn refused_groups(
    batches: &[RecordBatch],
    errors: &[BatchError],
) -> Result<Vec<(String, String)>, BatchError> {
    let ids = row_group_ids(batches)?;
    let mut out: Vec<(String, String)> = Vec::new();
    for e in errors {
        if let BatchError::Row { row, .. } = e
            && let Some(id) = ids.get(*row)
            && !out.iter().any(|(g, _)| g == id)
        {
            out.push((id.clone(), e.to_string()));
        }
    }
    Ok(out)
}

/// A training batch on the host, ready to move to a device.
#[derive(Debug)]
pub struct TrainBatch {
    /// `[N, L]` prompt + completion token ids, right-padded with `pad_id`.
    pub input_ids: Tensor,
    /// `[N, T]`: position in the shifted log-prob matrix (`[N, L−1]`, entry
    /// `j` = log-prob of token `j+1`) of completion token `t`, i.e.
    /// `prompt_len − 1 + t`; 0 on padding.
    pub gather_index: Tensor,
    /// `[N, T]` behaviour log-probs, versions, advantages; padding 0.
    pub behaviour: Tensor,
    pub versions: Tensor,
    pub advantages: Tensor,
    /// `[N, T]` bool: real completion tokens of trajectories with a reward.
    pub mask: Tensor,
    /// Per row: prompt + completion tokens (the row's unpadded length in
    /// `input_ids`).
    pub lengths: Vec<i64>,
    /// Per row: how many of its first tokens every row of its group has
    /// too (the group's longest common prefix; 0 for a group of one row).
    /// Shared-prefix lanes lay them out once ([`crate::shared`]).
    pub shared: Vec<i64>,
    /// Per row.
    pub uuids: Vec<String>,
    pub group_ids: Vec<String>,
    pub rewards: Vec<Option<f32>>,
    pub groups: usize,
    /// Valid (masked-in) completion tokens.
    pub tokens: i64,
    /// Oldest token version in the batch.
    pub min_version: i32,
}

fn list_rows<'a, T: arrow::datatypes::ArrowPrimitiveType>(
    batch: &'a RecordBatch,
    name: &'static str,
) -> Result<(&'a [T::Native], &'a [i32]), BatchError> {
    let list = batch
        .column_by_name(name)
        .and_then(|c| c.as_list_opt::<i32>())
        .ok_or(BatchError::Column(name))?;
    let values = list
        .values()
        .as_primitive_opt::<T>()
        .ok_or(BatchError::Column(name))?;
    Ok((values.values(), list.value_offsets()))
}

/// The turns of each row of `batch` (none for a single-turn row or a batch
/// without the turn columns).
fn turns_of(batch: &RecordBatch) -> Result<Vec<Vec<asyncrl_protos::Turn>>, BatchError> {
    cols::turns_of(batch).map_err(|e| match e {
        asyncrl_protos::ContractError::ArrowColumn { column } => BatchError::Column(column),
        other => BatchError::Turns(other),
    })
}

struct Row<'a> {
    prompt: &'a [i32],
    completion: &'a [i32],
    /// One per model token.
    logprobs: &'a [f32],
    versions: &'a [i32],
    /// An episode's per-completion-token mask: sampled by the policy.
    /// `None` for a single-turn row (every token a model token).
    model: Option<Vec<bool>>,
    reward: Option<f32>,
    uuid: String,
    group: String,
}

/// Assembles record batches (whole groups) into a [`TrainBatch`]. It sizes
/// the tensors from the rows' lengths: batches from outside the process go
/// through [`check`] first (`Trainer::train_step` does).
pub fn assemble(
    batches: &[RecordBatch],
    pad_id: i64,
    norm: AdvantageNorm,
) -> Result<TrainBatch, BatchError> {
    let mut rows: Vec<Row<'_>> = Vec::new();
    for batch in batches {
        let (p_vals, p_off) = list_rows::<Int32Type>(batch, cols::PROMPT_TOKEN_IDS)?;
        let (c_vals, c_off) = list_rows::<Int32Type>(batch, cols::COMPLETION_TOKEN_IDS)?;
        let (l_vals, l_off) = list_rows::<Float32Type>(batch, cols::BEHAVIOUR_LOGPROBS)?;
        let (v_vals, v_off) = list_rows::<Int32Type>(batch, cols::POLICY_VERSIONS)?;
        let reward = batch
            .column_by_name(cols::REWARD)
            .and_then(|c| c.as_primitive_opt::<Float32Type>())
            .ok_or(BatchError::Column(cols::REWARD))?;
        let uuid = batch
            .column_by_name(cols::UUID)
            .and_then(|c| c.as_string_opt::<i32>())
            .ok_or(BatchError::Column(cols::UUID))?;
        let group = batch
            .column_by_name(cols::GROUP_ID)
            .and_then(|c| c.as_string_opt::<i32>())
            .ok_or(BatchError::Column(cols::GROUP_ID))?;
        let turns = turns_of(batch)?;
        for i in 0..batch.num_rows() {
            let span = |off: &[i32]| off[i] as usize..off[i + 1] as usize;
            let completion = &c_vals[span(c_off)];
            let row = Row {
                prompt: &p_vals[span(p_off)],
                completion,
                logprobs: &l_vals[span(l_off)],
                versions: &v_vals[span(v_off)],
                model: (!turns[i].is_empty())
                    .then(|| asyncrl_protos::model_token_mask(&turns[i], completion.len())),
                reward: (!reward.is_null(i)).then(|| reward.value(i)),
                uuid: uuid.value(i).to_owned(),
                group: group.value(i).to_owned(),
            };
            let n = rows.len();
            if row.prompt.is_empty() {
                return Err(row_error(n, cols::PROMPT_TOKEN_IDS, "is empty"));
            }
            let model = row
                .model
                .as_ref()
                .map_or(row.completion.len(), |m| m.iter().filter(|m| **m).count());
            if row.logprobs.len() != model {
                return Err(row_error(
                    n,
                    cols::BEHAVIOUR_LOGPROBS,
                    "does not match the completion's model tokens",
                ));
            }
            if row.versions.len() != model {
                return Err(row_error(
                    n,
                    cols::POLICY_VERSIONS,
                    "does not match the completion's model tokens",
                ));
            }
            rows.push(row);
        }
    }
    if rows.is_empty() {
        return Err(BatchError::Empty);
    }

    // Advantages per group, in first-seen group order.
    let mut group_rows: Vec<(String, Vec<usize>)> = Vec::new();
    let mut group_index: HashMap<&str, usize> = HashMap::new();
    for (i, r) in rows.iter().enumerate() {
        let g = *group_index.entry(r.group.as_str()).or_insert_with(|| {
            group_rows.push((r.group.clone(), Vec::new()));
            group_rows.len() - 1
        });
        group_rows[g].1.push(i);
    }
    let mut adv = vec![None; rows.len()];
    for (_, members) in &group_rows {
        let rewards: Vec<Option<f32>> = members.iter().map(|i| rows[*i].reward).collect();
        for (i, a) in members.iter().zip(grpo_advantages(&rewards, norm)) {
            adv[*i] = a;
        }
    }

    let n = rows.len();
    let l = rows
        .iter()
        .map(|r| r.prompt.len() + r.completion.len())
        .max()
        .unwrap_or(1);
    let t = rows
        .iter()
        .map(|r| r.completion.len())
        .max()
        .unwrap_or(0)
        .max(1);
    let mut ids = vec![pad_id; n * l];
    let mut gather = vec![0i64; n * t];
    let mut behaviour = vec![0f32; n * t];
    let mut versions = vec![0i64; n * t];
    let mut advantages = vec![0f32; n * t];
    let mut mask = vec![false; n * t];
    let mut tokens = 0i64;
    let mut min_version = i32::MAX;
    for (i, r) in rows.iter().enumerate() {
        let (p, c) = (r.prompt.len(), r.completion.len());
        for (dst, src) in ids[i * l..i * l + p].iter_mut().zip(r.prompt) {
            *dst = i64::from(*src);
        }
        for (dst, src) in ids[i * l + p..i * l + p + c].iter_mut().zip(r.completion) {
            *dst = i64::from(*src);
        }
        let row = i * t..i * t + c;
        for (k, g) in gather[row.clone()].iter_mut().enumerate() {
            *g = (p - 1 + k) as i64;
        }
        min_version = r.versions.iter().copied().fold(min_version, i32::min);
        if let Some(model) = &r.model {
            // An episode: context tokens stay 0 and masked out of everything.
            let model = model
                .iter()
                .enumerate()
                .filter_map(|(k, m)| m.then_some(i * t + k));
            for ((at, lp), v) in model.zip(r.logprobs).zip(r.versions) {
                behaviour[at] = *lp;
                versions[at] = i64::from(*v);
                if let Some(a) = adv[i] {
                    advantages[at] = a;
                    mask[at] = true;
                    tokens += 1;
                }
            }
        } else {
            // Single-turn: every completion token is a model token.
            behaviour[row.clone()].copy_from_slice(r.logprobs);
            for (dst, src) in versions[row.clone()].iter_mut().zip(r.versions) {
                *dst = i64::from(*src);
            }
            if let Some(a) = adv[i] {
                advantages[row.clone()].fill(a);
                mask[row].fill(true);
                tokens += c as i64;
            }
        }
    }
    let mut shared = vec![0i64; n];
    for (_, members) in group_rows.iter().filter(|(_, m)| m.len() > 1) {
        let row =
            |i: &usize| &ids[i * l..i * l + rows[*i].prompt.len() + rows[*i].completion.len()];
        let common = crate::shared::common_prefix(members.iter().map(row)) as i64;
        for i in members {
            shared[*i] = common;
        }
    }
    let shape_l = [n as i64, l as i64];
    let shape_t = [n as i64, t as i64];
    Ok(TrainBatch {
        input_ids: Tensor::from_slice(&ids).view(shape_l),
        gather_index: Tensor::from_slice(&gather).view(shape_t),
        behaviour: Tensor::from_slice(&behaviour).view(shape_t),
        versions: Tensor::from_slice(&versions).view(shape_t),
        advantages: Tensor::from_slice(&advantages).view(shape_t),
        mask: Tensor::from_slice(&mask).view(shape_t),
        lengths: rows
            .iter()
            .map(|r| (r.prompt.len() + r.completion.len()) as i64)
            .collect(),
        shared,
        rewards: rows.iter().map(|r| r.reward).collect(),
        uuids: rows.iter().map(|r| r.uuid.clone()).collect(),
        group_ids: rows.into_iter().map(|r| r.group).collect(),
        groups: group_rows.len(),
        tokens,
        min_version: if min_version == i32::MAX {
            0
        } else {
            min_version
        },
    })
}

impl TrainBatch {
    /// Moves the tensors to `device`.
    pub fn to_device(&self, device: Device) -> TrainBatch {
        TrainBatch {
            input_ids: self.input_ids.to_device(device),
            gather_index: self.gather_index.to_device(device),
            behaviour: self.behaviour.to_device(device),
            versions: self.versions.to_device(device),
            advantages: self.advantages.to_device(device),
            mask: self.mask.to_device(device),
            lengths: self.lengths.clone(),
            shared: self.shared.clone(),
            uuids: self.uuids.clone(),
            group_ids: self.group_ids.clone(),
            rewards: self.rewards.clone(),
            groups: self.groups,
            tokens: self.tokens,
            min_version: self.min_version,
        }
    }

    /// Rows `rows` of the batch (a mini-batch).
    pub fn rows(&self, rows: &[i64]) -> TrainBatch {
        let idx = Tensor::from_slice(rows).to_device(self.input_ids.device());
        let pick = |t: &Tensor| t.index_select(0, &idx);
        let mask = pick(&self.mask);
        let tokens = mask.sum(Kind::Int64).int64_value(&[]);
        let sel = |v: &Vec<String>| rows.iter().map(|r| v[*r as usize].clone()).collect();
        TrainBatch {
            input_ids: pick(&self.input_ids),
            gather_index: pick(&self.gather_index),
            behaviour: pick(&self.behaviour),
            versions: pick(&self.versions),
            advantages: pick(&self.advantages),
            mask,
            lengths: rows.iter().map(|r| self.lengths[*r as usize]).collect(),
            shared: rows.iter().map(|r| self.shared[*r as usize]).collect(),
            uuids: sel(&self.uuids),
            group_ids: sel(&self.group_ids),
            rewards: rows.iter().map(|r| self.rewards[*r as usize]).collect(),
            groups: 0,
            tokens,
            min_version: self.min_version,
        }
    }

    /// Positions of one forward pass over every row
    /// ([`TrainBatch::forward_inputs`]): lanes × the lane width.
    pub fn positions(&self, lanes: Lanes) -> i64 {
        self.positions_of(&self.plan(lanes))
    }

    /// Positions of one forward pass laid out as `plan`.
    fn positions_of(&self, plan: &Plan) -> i64 {
        match plan {
            Plan::Padded => self.lengths.len() as i64 * self.padded_width(),
            Plan::Packed { width, lanes } => lanes.len() as i64 * width,
            Plan::Shared(p) => p.lanes * p.width,
        }
    }

    /// The padded layout's width: the longest row, at least two positions
    /// (the shifted log-prob matrix needs one).
    fn padded_width(&self) -> i64 {
        Lanes::Padded.width(self.longest(), self.input_ids.size()[1])
    }

    /// The layout of `lanes` for these rows, or a cheaper one: packing
    /// falls back to padding where it computes no fewer positions (rows of
    /// about one length: the padded forward's causal attention is then the
    /// cheaper one), and prefix sharing to packing (or padding) where it
    /// saves no positions (groups of one row, no common prefix).
    fn plan(&self, lanes: Lanes) -> Plan {
        let padded_len = self.input_ids.size()[1];
        let packed = |min_width: i64| {
            let width = Lanes::Packed { min_width }.width(self.longest(), padded_len);
            let packed = first_fit_decreasing(&self.lengths, width);
            let padded = self.lengths.len() as i64 * self.padded_width();
            if packed.len() as i64 * width < padded {
                Plan::Packed {
                    width,
                    lanes: packed,
                }
            } else {
                Plan::Padded
            }
        };
        match lanes {
            Lanes::Padded => Plan::Padded,
            Lanes::Packed { min_width } => packed(min_width),
            Lanes::Shared {
                min_width,
                max_width,
            } => {
                let other = packed(min_width);
                let base = Lanes::Packed { min_width }.width(self.longest(), padded_len);
                let plan = crate::shared::plan(
                    &self.lengths,
                    &self.shared,
                    &self.group_ids,
                    base,
                    max_width,
                );
                if plan.lanes * plan.width < self.positions_of(&other) {
                    Plan::Shared(plan)
                } else {
                    other
                }
            }
        }
    }

    /// The longest row (prompt + completion), at least 1.
    pub fn longest(&self) -> i64 {
        self.lengths.iter().copied().max().unwrap_or(1).max(1)
    }

    /// The same rows with `input_ids` cut to the longest row (at least two
    /// positions, as the shifted log-prob matrix needs one). Padding is on
    /// the right, so every `gather_index` stays valid: a completion token's
    /// index `prompt_len − 1 + t` is below its row's length − 1, and padding
    /// points at 0. With causal attention the result is the same as the
    /// untrimmed batch's.
    pub fn trimmed(mut self) -> TrainBatch {
        let l = self.input_ids.size()[1];
        let keep = self.longest().max(2).min(l);
        if keep < l {
            self.input_ids = self.input_ids.narrow(1, 0, keep).contiguous();
        }
        self
    }

    /// Splits the rows into micro-batches of at most `max_tokens`
    /// positions each. Returns the row indices of each micro-batch (into
    /// this batch).
    ///
    /// Padded, a micro-batch's positions are rows × its longest row;
    /// packed, they are lanes × the lane width, the rows packed into lanes
    /// as [`TrainBatch::forward_inputs`] packs them. Shared lanes split as
    /// packed ones do: sharing a prefix only lowers a micro-batch's
    /// positions.
    /// `max_tokens == 0`, or all rows fitting, gives one micro-batch of all
    /// rows in their order. Otherwise rows are sorted by length, longest
    /// first, and taken greedily, so each micro-batch pads to its own
    /// longest row and rows of similar length travel together. A row
    /// longer than `max_tokens` on its own is its own micro-batch: the
    /// budget is then exceeded by that one row, never refused.
    pub fn microbatches(&self, max_tokens: usize, lanes: Lanes) -> Vec<Vec<i64>> {
        match lanes {
            Lanes::Packed { min_width } | Lanes::Shared { min_width, .. } => {
                pack_microbatches_packed(&self.lengths, max_tokens, min_width)
            }
            Lanes::Padded => pack_microbatches(&self.lengths, max_tokens),
        }
    }

    /// The token each completion token's prediction is scored against,
    /// `[N, T]`: row `n`'s token `gather_index + 1` (padding reads a real
    /// entry and is masked out by `mask`).
    fn targets(&self) -> Tensor {
        targets(&self.input_ids, &self.gather_index)
    }

    /// The inputs of one forward pass over every row of this batch.
    ///
    /// Padded: `input_ids` as they are, cut to the longest row
    /// ([`TrainBatch::trimmed`]). Packed: the rows, longest first, each
    /// into the first lane with room (first-fit decreasing), lanes as wide
    /// as the longest row or `min_width` if that is more, in as many lanes
    /// as that takes, often far fewer than rows. Shared: each group's
    /// common prefix once, its rows' own tokens after it
    /// ([`crate::shared`]), the groups packed into lanes. Where a layout
    /// computes no fewer positions than a simpler one, the simpler one is
    /// used ([`TrainBatch::positions`]). The log-probs and entropies read
    /// through [`ForwardInputs::completion_logprobs`] are the same in every
    /// layout (up to float rounding): see
    /// [`asyncrl_policy::Policy::forward_packed`] and
    /// [`asyncrl_policy::Policy::forward_shared`].
    pub fn forward_inputs(&self, lanes: Lanes) -> ForwardInputs {
        let (n, l) = (self.input_ids.size()[0], self.input_ids.size()[1]);
        let device = self.input_ids.device();
        let to = |v: &[i64]| Tensor::from_slice(v).to_device(device);
        let gather_ids = |source: &[i64], lanes: i64, width: i64| {
            self.input_ids
                .reshape([-1])
                .index_select(0, &to(source))
                .view([lanes, width])
        };
        match self.plan(lanes) {
            Plan::Padded => {
                ForwardInputs::padded(&self.input_ids, &self.gather_index, self.padded_width())
            }
            Plan::Packed { width, lanes } => {
                let s = lanes.len() as i64;
                // Where each lane position's token comes from in the flat
                // `input_ids`; padding repeats position 0 (a real token id,
                // never attended and never read).
                let mut source = vec![0i64; (s * width) as usize];
                let mut segments = vec![0i64; (s * width) as usize];
                let mut base = vec![0i64; n as usize];
                for (lane, rows) in lanes.iter().enumerate() {
                    let mut offset = 0i64;
                    for (k, row) in rows.iter().enumerate() {
                        let len = self.lengths[*row as usize];
                        let at = lane as i64 * width + offset;
                        for j in 0..len {
                            source[(at + j) as usize] = row * l + j;
                            segments[(at + j) as usize] = k as i64 + 1;
                        }
                        base[*row as usize] = at;
                        offset += len;
                    }
                }
                ForwardInputs {
                    input_ids: gather_ids(&source, s, width),
                    layout: LaneLayout::Packed(to(&segments).view([s, width])),
                    predictor: &self.gather_index + to(&base).unsqueeze(1),
                    target: self.targets(),
                }
            }
            Plan::Shared(p) => {
                let source: Vec<i64> = p
                    .source
                    .iter()
                    .map(|s| s.map_or(0, |(row, q)| row as i64 * l + q))
                    .collect();
                let column = |f: fn(&crate::shared::RowPlace) -> i64| {
                    to(&p.rows.iter().map(f).collect::<Vec<_>>()).unsqueeze(1)
                };
                let q = &self.gather_index;
                let in_prefix = q.lt_tensor(&column(|r| r.shared));
                let predictor = (q + column(|r| r.prefix_at))
                    .where_self(&in_prefix, &(q + column(|r| r.own_at)));
                let shape = [p.lanes, p.width];
                ForwardInputs {
                    input_ids: gather_ids(&source, p.lanes, p.width),
                    layout: LaneLayout::Shared(SharedLanes {
                        positions: to(&p.positions).view(shape),
                        segments: to(&p.segments).view(shape),
                        parents: to(&p.parents).view(shape),
                    }),
                    predictor,
                    target: self.targets(),
                }
            }
        }
    }
}

/// A layout chosen for a batch ([`TrainBatch::plan`]).
enum Plan {
    Padded,
    Packed { width: i64, lanes: Vec<Vec<i64>> },
    Shared(crate::shared::SharedPlan),
}

/// Row `n`'s token `gather_index[n, t] + 1` of right-padded `input_ids`
/// (`[N, L]`), `[N, T]`; an index past the end (padding of a batch one
/// token wide) reads the last entry.
fn targets(input_ids: &Tensor, gather_index: &Tensor) -> Tensor {
    let (n, l) = (input_ids.size()[0], input_ids.size()[1]);
    let rows = Tensor::arange(n, (Kind::Int64, input_ids.device())) * l;
    let at = (gather_index + rows.unsqueeze(1) + 1).clamp_max(n * l - 1);
    input_ids
        .reshape([-1])
        .index_select(0, &at.reshape([-1]))
        .view(gather_index.size().as_slice())
}

/// How the rows of a forward pass are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lanes {
    /// One row per lane, each padded to the longest row.
    Padded,
    /// Rows packed end to end into lanes as wide as the longest row, or
    /// `min_width` positions if that is more.
    Packed { min_width: i64 },
    /// Packed, and the rows of a group share their common prefix (laid
    /// out once, [`crate::shared`]): lanes as wide as a group's prefix and
    /// rows, at most [`crate::shared::SHARED_SPAN`] packed widths and
    /// `max_width` positions (unless a row is wider).
    Shared { min_width: i64, max_width: i64 },
}

impl Lanes {
    /// The lane width for rows of at most `longest` positions in a padded
    /// batch `padded_len` wide: padded, the longest row (at least two
    /// positions, as the shifted log-prob matrix needs one, and within the
    /// padded width); packed, at least `min_width`. Shared lanes start
    /// from the packed width and widen to hold a group.
    pub fn width(self, longest: i64, padded_len: i64) -> i64 {
        let padded = longest.max(2).min(padded_len);
        match self {
            Lanes::Padded => padded,
            Lanes::Packed { min_width } | Lanes::Shared { min_width, .. } => {
                padded.max(2).max(min_width)
            }
        }
    }

    /// These lanes under a micro-batch budget of `max_tokens` positions
    /// (0: none): packed lanes at most that wide unless a row is wider.
    pub fn within(self, max_tokens: usize) -> Lanes {
        let cap = i64::try_from(max_tokens).unwrap_or(i64::MAX);
        match self {
            Lanes::Packed { min_width } if max_tokens > 0 => Lanes::Packed {
                min_width: min_width.min(cap),
            },
            Lanes::Shared {
                min_width,
                max_width,
            } if max_tokens > 0 => Lanes::Shared {
                min_width: min_width.min(cap),
                max_width: max_width.min(cap),
            },
            other => other,
        }
    }
}

/// How a forward pass's lanes hold their rows.
#[derive(Debug)]
pub enum LaneLayout {
    /// One row per lane, right-padded.
    Padded,
    /// `[S, W]`: which sequence of its lane each position belongs to (1,
    /// 2, ...; 0 = padding).
    Packed(Tensor),
    /// Groups sharing their prefixes.
    Shared(SharedLanes),
}

/// The rows of one forward pass as the model sees them: one row per lane
/// (padded), several rows per lane (packed), or groups of rows sharing
/// their prefix (shared).
#[derive(Debug)]
pub struct ForwardInputs {
    /// `[S, W]` token ids of each lane.
    pub input_ids: Tensor,
    pub layout: LaneLayout,
    /// `[N, T]`: for completion token `t` of row `n`, the flat index (into
    /// `[S · W]`) of the lane position whose next-token distribution
    /// produced it; padding points at a real entry and is masked out by
    /// the batch's `mask`.
    pub predictor: Tensor,
    /// `[N, T]`: the completion tokens themselves (padding: any real id).
    pub target: Tensor,
}

impl ForwardInputs {
    /// Right-padded rows `input_ids` (`[N, ≥ width]`) cut to `width`, their
    /// completion tokens at `gather_index` (`[N, T]`, into each row's
    /// shifted log-probs).
    fn padded(input_ids: &Tensor, gather_index: &Tensor, width: i64) -> Self {
        let n = input_ids.size()[0];
        let base = Tensor::arange(n, (Kind::Int64, input_ids.device())) * width;
        ForwardInputs {
            input_ids: input_ids.narrow(1, 0, width),
            layout: LaneLayout::Padded,
            predictor: gather_index + base.unsqueeze(1),
            target: targets(input_ids, gather_index),
        }
    }

    /// Positions the forward pass computes: lanes × lane width.
    pub fn positions(&self) -> i64 {
        self.input_ids.numel() as i64
    }

    /// The packed layout's segment ids, if packed.
    pub fn segments(&self) -> Option<&Tensor> {
        match &self.layout {
            LaneLayout::Packed(seg) => Some(seg),
            _ => None,
        }
    }

    /// Logits `[S, W, vocab]` of `policy` over these inputs.
    pub fn logits(&self, policy: &asyncrl_policy::Policy) -> asyncrl_policy::Result<Tensor> {
        match &self.layout {
            LaneLayout::Padded => policy.forward(&self.input_ids, None),
            LaneLayout::Packed(seg) => policy.forward_packed(&self.input_ids, seg),
            LaneLayout::Shared(lanes) => policy.forward_shared(&self.input_ids, lanes),
        }
    }

    /// The completion tokens' log-probs `[N, T]` at temperature
    /// `temperature` from `logits` (`[S, W, vocab]`, of these inputs).
    pub fn completion_logprobs(&self, logits: &Tensor, temperature: f64) -> Tensor {
        let v = logits.size()[2];
        let logp = scaled_flat(logits, temperature).log_softmax(-1, Kind::Float);
        logp.reshape([-1])
            .index_select(0, &(&self.predictor * v + &self.target).reshape([-1]))
            .view(self.predictor.size().as_slice())
    }

    /// The entropy `[N, T]` (no gradient) of the next-token distributions
    /// behind each completion token, at temperature `temperature`.
    pub fn completion_entropy(&self, logits: &Tensor, temperature: f64) -> Tensor {
        let _g = tch::no_grad_guard();
        let logp = scaled_flat(logits, temperature).log_softmax(-1, Kind::Float);
        let ent = -(logp.exp() * &logp).sum_dim_intlist(-1, false, Kind::Float);
        ent.index_select(0, &self.predictor.reshape([-1]))
            .view(self.predictor.size().as_slice())
    }
}

/// `logits` (`[S, W, V]`) as `[S · W, V]` float32, divided by the
/// temperature.
fn scaled_flat(logits: &Tensor, temperature: f64) -> Tensor {
    let v = logits.size()[2];
    let flat = logits.reshape([-1, v]).to_kind(Kind::Float);
    if (temperature - 1.0).abs() > f64::EPSILON {
        flat / temperature
    } else {
        flat
    }
}

/// Rows (by `lengths`) into lanes of `width` positions: longest first, each
/// into the first lane with room (first-fit decreasing; rows of equal
/// length keep their order). A row longer than `width` gets a lane of its
/// own (callers size `width` to the longest row).
pub fn first_fit_decreasing(lengths: &[i64], width: i64) -> Vec<Vec<i64>> {
    let mut order: Vec<i64> = (0..lengths.len() as i64).collect();
    order.sort_by_key(|i| std::cmp::Reverse(lengths[*i as usize]));
    let mut lanes: Vec<Vec<i64>> = Vec::new();
    let mut fill: Vec<i64> = Vec::new();
    for i in order {
        let len = lengths[i as usize];
        match fill.iter().position(|f| f + len <= width) {
            Some(k) => {
                fill[k] += len;
                lanes[k].push(i);
            }
            None => {
                fill.push(len);
                lanes.push(vec![i]);
            }
        }
    }
    lanes
}

/// [`TrainBatch::microbatches`] over row lengths, padded.
pub fn pack_microbatches(lengths: &[i64], max_tokens: usize) -> Vec<Vec<i64>> {
    let n = lengths.len();
    let longest = lengths.iter().copied().max().unwrap_or(0).max(1);
    let budget = i64::try_from(max_tokens).unwrap_or(i64::MAX);
    if max_tokens == 0 || n as i64 <= budget / longest {
        return vec![(0..n as i64).collect()];
    }
    let mut order: Vec<i64> = (0..n as i64).collect();
    // Stable: rows of equal length keep their order.
    order.sort_by_key(|i| std::cmp::Reverse(lengths[*i as usize]));
    let mut out: Vec<Vec<i64>> = Vec::new();
    let mut current: Vec<i64> = Vec::new();
    // Longest first: the first row of a micro-batch is its longest.
    let mut width = 1i64;
    for i in order {
        if current.is_empty() {
            width = lengths[i as usize].max(1);
        } else if (current.len() as i64 + 1).saturating_mul(width) > budget {
            out.push(std::mem::take(&mut current));
            width = lengths[i as usize].max(1);
        }
        current.push(i);
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

/// [`TrainBatch::microbatches`] over row lengths, packed: rows longest
/// first, each micro-batch's lanes as wide as its first (longest) row or
/// `min_width`, a row going to the first lane with room, and a new
/// micro-batch when a new lane would take it over the budget.
pub fn pack_microbatches_packed(
    lengths: &[i64],
    max_tokens: usize,
    min_width: i64,
) -> Vec<Vec<i64>> {
    let n = lengths.len();
    let lane = |longest: i64| longest.max(1).max(min_width);
    let longest = lane(lengths.iter().copied().max().unwrap_or(0));
    let budget = i64::try_from(max_tokens).unwrap_or(i64::MAX);
    if max_tokens == 0
        || (first_fit_decreasing(lengths, longest).len() as i64).saturating_mul(longest) <= budget
    {
        return vec![(0..n as i64).collect()];
    }
    let mut order: Vec<i64> = (0..n as i64).collect();
    order.sort_by_key(|i| std::cmp::Reverse(lengths[*i as usize]));
    let mut out: Vec<Vec<i64>> = Vec::new();
    let mut current: Vec<i64> = Vec::new();
    let mut fill: Vec<i64> = Vec::new();
    let mut width = 1i64;
    for i in order {
        let len = lengths[i as usize];
        if current.is_empty() {
            width = lane(len);
            fill = vec![len];
        } else if let Some(k) = fill.iter().position(|f| f + len <= width) {
            fill[k] += len;
        } else if (fill.len() as i64 + 1).saturating_mul(width) <= budget {
            fill.push(len);
        } else {
            out.push(std::mem::take(&mut current));
            width = lane(len);
            fill = vec![len];
        }
        current.push(i);
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

/// Log-probs of the completion tokens, `[N, T]`, from logits `[N, L, V]` of
/// the whole padded sequences, at sampling temperature `temperature` (the
/// same distribution the worker's behaviour log-probs refer to).
pub fn completion_logprobs(logits: &Tensor, batch: &TrainBatch, temperature: f64) -> Tensor {
    ForwardInputs::padded(&batch.input_ids, &batch.gather_index, logits.size()[1])
        .completion_logprobs(logits, temperature)
}

#[cfg(test)]
mod tests {
    use super::*;
    use asyncrl_protos::v1::{FinishReason, RewardStatus, Timings, Trajectory};

    fn traj(
        i: u128,
        group: &str,
        prompt: Vec<i32>,
        completion: Vec<i32>,
        reward: Option<f32>,
    ) -> Trajectory {
        let n = completion.len();
        Trajectory {
            uuid: uuid::Uuid::from_u128(i + 1).to_string(),
            task_id: format!("task-{group}"),
            group_id: group.into(),
            prompt_token_ids: prompt,
            completion_token_ids: completion,
            behaviour_logprobs: (0..n).map(|k| -0.1 * (k as f32 + 1.0)).collect(),
            policy_versions: (0..n).map(|k| 3 + k as i32 / 2).collect(),
            reward: reward.unwrap_or(f32::NAN),
            reward_status: if reward.is_some() {
                RewardStatus::Ok
            } else {
                RewardStatus::Failed
            } as i32,
            finish_reason: FinishReason::Stop as i32,
            worker_id: "w".into(),
            timings: Some(Timings::default()),
            group_size: 2,
            index_in_group: (i % 2) as u32,
            admission_version: 3,
            turns: Vec::new(),
        }
    }

    #[test]
    fn assembles_right_padded_aligned_tensors() {
        let rb = asyncrl_protos::arrow_schema::to_record_batch(&[
            traj(0, "g1", vec![1, 2, 3], vec![7, 8], Some(1.0)),
            traj(1, "g1", vec![1, 2, 3], vec![9], Some(0.0)),
            traj(2, "g2", vec![4], vec![5, 6, 7], Some(0.5)),
            traj(3, "g2", vec![4], vec![], None),
        ])
        .unwrap();
        let b = assemble(&[rb], 0, AdvantageNorm::Mean).unwrap();
        assert_eq!(b.input_ids.size(), [4, 5]);
        assert_eq!(
            Vec::<i64>::try_from(b.input_ids.view([-1])).unwrap(),
            vec![
                1, 2, 3, 7, 8, //
                1, 2, 3, 9, 0, //
                4, 5, 6, 7, 0, //
                4, 0, 0, 0, 0,
            ]
        );
        assert_eq!(
            Vec::<i64>::try_from(b.gather_index.view([-1])).unwrap(),
            vec![2, 3, 0, 2, 0, 0, 0, 1, 2, 0, 0, 0]
        );
        // g1: rewards 1, 0 → ±0.5; g2: one scored member → 0, the failed one masked.
        assert_eq!(
            Vec::<f32>::try_from(b.advantages.view([-1])).unwrap(),
            vec![0.5, 0.5, 0.0, -0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
        );
        assert_eq!(
            Vec::<bool>::try_from(b.mask.view([-1])).unwrap(),
            vec![
                true, true, false, true, false, false, true, true, true, false, false, false
            ]
        );
        assert_eq!(b.tokens, 6);
        assert_eq!(b.groups, 2);
        assert_eq!(b.min_version, 3);
        assert_eq!(b.rewards, vec![Some(1.0), Some(0.0), Some(0.5), None]);
    }

    #[test]
    fn completion_logprobs_pick_the_right_positions() {
        let rb = asyncrl_protos::arrow_schema::to_record_batch(&[
            traj(0, "g", vec![1, 2], vec![3, 1], Some(1.0)),
            traj(1, "g", vec![2], vec![0], Some(0.0)),
        ])
        .unwrap();
        let b = assemble(&[rb], 0, AdvantageNorm::Mean).unwrap();
        // Random logits: every (row, position, token) has its own value, so a
        // misaligned gather picks a different number.
        let v = 4;
        let logits = Tensor::randn([2, 4, v], (Kind::Float, Device::Cpu));
        let lp = completion_logprobs(&logits, &b, 1.0);
        let full = logits.log_softmax(-1, Kind::Float);
        let want = |row: i64, pos: i64, tok: i64| full.double_value(&[row, pos, tok]);
        assert!((lp.double_value(&[0, 0]) - want(0, 1, 3)).abs() < 1e-6);
        assert!((lp.double_value(&[0, 1]) - want(0, 2, 1)).abs() < 1e-6);
        assert!((lp.double_value(&[1, 0]) - want(1, 0, 0)).abs() < 1e-6);
        // Temperature scales the logits before the softmax.
        let hot = completion_logprobs(&logits, &b, 2.0);
        let full2 = (&logits / 2.0).log_softmax(-1, Kind::Float);
        assert!((hot.double_value(&[0, 1]) - full2.double_value(&[0, 2, 1])).abs() < 1e-6);
    }

    #[test]
    fn microbatches_pack_rows_under_the_budget() {
        /// Row lengths, budget, the micro-batches expected.
        type Case<'a> = (&'a [i64], usize, &'a [&'a [i64]]);
        let cases: &[Case<'_>] = &[
            // No budget, or everything fits: one micro-batch, rows in order.
            (&[3, 5, 2], 0, &[&[0, 1, 2]]),
            (&[3, 5, 2], 15, &[&[0, 1, 2]]),
            // Longest first, each micro-batch padded to its first row.
            (&[3, 5, 2], 14, &[&[1, 0], &[2]]),
            (&[3, 5, 2, 5], 10, &[&[1, 3], &[0, 2]]),
            (&[4, 4, 4, 4, 4], 8, &[&[0, 1], &[2, 3], &[4]]),
            // A row over the budget goes alone; so does every row under a tiny one.
            (&[9, 2, 2], 4, &[&[0], &[1, 2]]),
            (&[3, 5, 2], 1, &[&[1], &[0], &[2]]),
            (&[], 4, &[&[]]),
        ];
        for (lengths, budget, want) in cases {
            let got = pack_microbatches(lengths, *budget);
            let want: Vec<Vec<i64>> = want.iter().map(|m| m.to_vec()).collect();
            assert_eq!(got, want, "lengths {lengths:?}, budget {budget}");
            // Every row exactly once; under the budget unless alone.
            let mut all: Vec<i64> = got.iter().flatten().copied().collect();
            all.sort_unstable();
            assert_eq!(all, (0..lengths.len() as i64).collect::<Vec<_>>());
            if *budget > 0 {
                for m in &got {
                    let width = m.iter().map(|i| lengths[*i as usize]).max().unwrap_or(0);
                    assert!(m.len() == 1 || m.len() as i64 * width <= *budget as i64);
                }
            }
        }
    }

    #[test]
    fn packed_microbatches_fill_lanes_under_the_budget() {
        /// Row lengths, budget, the micro-batches expected.
        type Case<'a> = (&'a [i64], usize, &'a [&'a [i64]]);
        let cases: &[Case<'_>] = &[
            // No budget, or every lane fits: one micro-batch, rows in order.
            (&[3, 5, 2], 0, &[&[0, 1, 2]]),
            // 5 | 3+2: two lanes of 5.
            (&[3, 5, 2], 10, &[&[0, 1, 2]]),
            // One lane of 5 at a time: 5, then 3+2.
            (&[3, 5, 2], 9, &[&[1], &[0, 2]]),
            // Lanes 6 | 4+2 | 3+3 | 1 within 3 lanes of 6, then the 1.
            (&[4, 6, 3, 2, 3, 1], 18, &[&[1, 0, 2, 4, 3], &[5]]),
            // A row over the budget goes alone.
            (&[9, 2, 2], 4, &[&[0], &[1, 2]]),
            (&[], 4, &[&[]]),
        ];
        // Lanes of at least 10: 5 + 3 + 2 in one.
        assert_eq!(
            pack_microbatches_packed(&[3, 5, 2], 10, 10),
            vec![vec![0, 1, 2]]
        );
        assert_eq!(
            pack_microbatches_packed(&[3, 5, 2, 4], 10, 10),
            vec![vec![1, 3], vec![0, 2]]
        );
        for (lengths, budget, want) in cases {
            let got = pack_microbatches_packed(lengths, *budget, 0);
            let want: Vec<Vec<i64>> = want.iter().map(|m| m.to_vec()).collect();
            assert_eq!(got, want, "lengths {lengths:?}, budget {budget}");
            let mut all: Vec<i64> = got.iter().flatten().copied().collect();
            all.sort_unstable();
            assert_eq!(all, (0..lengths.len() as i64).collect::<Vec<_>>());
            if *budget > 0 {
                for m in &got {
                    let own: Vec<i64> = m.iter().map(|i| lengths[*i as usize]).collect();
                    let width = own.iter().copied().max().unwrap_or(0);
                    let lanes = first_fit_decreasing(&own, width).len() as i64;
                    assert!(m.len() == 1 || lanes * width <= *budget as i64, "{m:?}");
                }
            }
        }
        // First-fit decreasing: every row in one lane, no lane over width.
        let lengths = [4, 6, 3, 2, 3, 1, 6];
        let lanes = first_fit_decreasing(&lengths, 6);
        assert_eq!(
            lanes,
            vec![vec![1], vec![6], vec![0, 3], vec![2, 4], vec![5]]
        );
    }

    #[test]
    fn packed_inputs_lay_rows_end_to_end() {
        let rb = asyncrl_protos::arrow_schema::to_record_batch(&[
            traj(0, "g", vec![1, 2, 3, 4], vec![3, 1, 2], Some(1.0)),
            traj(1, "g", vec![2], vec![5, 3], Some(0.0)),
            traj(2, "h", vec![2, 1], vec![1], Some(0.0)),
            traj(3, "h", vec![3], vec![], Some(1.0)),
        ])
        .unwrap();
        let b = assemble(&[rb], 0, AdvantageNorm::Mean).unwrap();
        // Lengths 7, 3, 3, 1 into lanes of 7: [0] and [1, 2, 3].
        let fwd = b.forward_inputs(Lanes::Packed { min_width: 0 });
        let ids = Vec::<i64>::try_from(fwd.input_ids.reshape([-1])).unwrap();
        assert_eq!(ids, [1, 2, 3, 4, 3, 1, 2, 2, 5, 3, 2, 1, 1, 3]);
        let seg = Vec::<i64>::try_from(fwd.segments().unwrap().reshape([-1])).unwrap();
        assert_eq!(seg, [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 3]);
        assert_eq!(fwd.positions(), 14);
        assert_eq!(b.positions(Lanes::Packed { min_width: 0 }), 14);
        // Wider lanes: 7 | 3 + 3 + 1 in lanes of 8; all four in one of 14.
        assert_eq!(b.positions(Lanes::Packed { min_width: 8 }), 16);
        assert_eq!(b.positions(Lanes::Packed { min_width: 14 }), 14);
        let wide = b.forward_inputs(Lanes::Packed { min_width: 14 });
        let seg = Vec::<i64>::try_from(wide.segments().unwrap().reshape([-1])).unwrap();
        assert_eq!(seg, [1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4]);
        assert_eq!(b.positions(Lanes::Padded), 28);
        // Row 1's completion [5, 3] is predicted from lane 1's positions 0
        // and 1 (7 positions per lane); row 2's [1] from lane 1's
        // position 4.
        let gather = |row: i64| {
            Vec::<i64>::try_from(fwd.predictor.get(row).masked_select(&b.mask.get(row))).unwrap()
        };
        assert_eq!(gather(0), [3, 4, 5]);
        assert_eq!(gather(1), [7, 8]);
        assert_eq!(gather(2), [11]);
        assert!(gather(3).is_empty());
        let target = |row: i64| {
            Vec::<i64>::try_from(fwd.target.get(row).masked_select(&b.mask.get(row))).unwrap()
        };
        assert_eq!(target(0), [3, 1, 2]);
        assert_eq!(target(1), [5, 3]);

        // Rows that do not pack (two of 5 in lanes of 5) are padded: the
        // same positions, and the causal forward without segments.
        let rb = asyncrl_protos::arrow_schema::to_record_batch(&[
            traj(0, "g", vec![1, 2, 3], vec![3, 1], Some(1.0)),
            traj(1, "g", vec![2, 2], vec![1, 3, 2], Some(0.0)),
        ])
        .unwrap();
        let b = assemble(&[rb], 0, AdvantageNorm::Mean).unwrap();
        let lanes = Lanes::Packed { min_width: 0 };
        assert_eq!(b.positions(lanes), b.positions(Lanes::Padded));
        let fwd = b.forward_inputs(lanes);
        assert!(fwd.segments().is_none());
        assert_eq!(fwd.positions(), 10);
        // One lane of 10 computes as many positions as padding: padded.
        let wide = Lanes::Packed { min_width: 10 };
        assert!(b.forward_inputs(wide).segments().is_none());
        assert_eq!(b.positions(wide), 10);
    }

    #[test]
    fn trimmed_rows_keep_their_log_probs() {
        let rb = asyncrl_protos::arrow_schema::to_record_batch(&[
            traj(0, "g", vec![1, 2, 3, 4], vec![3, 1, 2], Some(1.0)),
            traj(1, "g", vec![2], vec![0, 3], Some(0.0)),
            traj(2, "h", vec![2, 1], vec![1], Some(0.0)),
            traj(3, "h", vec![3], vec![], Some(1.0)),
        ])
        .unwrap();
        let b = assemble(&[rb], 0, AdvantageNorm::Mean).unwrap();
        assert_eq!(b.lengths, vec![7, 3, 3, 1]);
        let v = 5;
        let logits = Tensor::randn([4, 7, v], (Kind::Float, Device::Cpu));
        let full = completion_logprobs(&logits, &b, 1.0);
        for rows in [vec![1i64, 2], vec![3], vec![2, 3]] {
            let part = b.rows(&rows).trimmed();
            let l = part.input_ids.size()[1];
            assert_eq!(l, part.longest().max(2));
            let idx = Tensor::from_slice(&rows);
            let part_logits = logits.index_select(0, &idx).narrow(1, 0, l);
            let got =
                completion_logprobs(&part_logits, &part, 1.0) * part.mask.to_kind(Kind::Float);
            let want = full.index_select(0, &idx) * part.mask.to_kind(Kind::Float);
            assert!(got.allclose(&want, 1e-6, 1e-6, false), "rows {rows:?}");
        }
    }

    #[test]
    fn empty_and_bad_batches_are_errors() {
        assert!(matches!(
            assemble(&[], 0, AdvantageNorm::Mean),
            Err(BatchError::Empty)
        ));
        let rb = asyncrl_protos::arrow_schema::to_record_batch(&[traj(
            0,
            "g",
            vec![1],
            vec![2],
            Some(1.0),
        )])
        .unwrap();
        let rb = rb.project(&[0, 1, 2]).unwrap();
        assert!(matches!(
            assemble(&[rb], 0, AdvantageNorm::Mean),
            Err(BatchError::Column(_))
        ));
    }
}
