//! The Arrow schema of a stored trajectory, defined once.
//!
//! The buffer keeps trajectories in record batches of this schema, writes its
//! segments with it, serves learner batches with it and exports it as
//! Parquet. Token ids and versions are `list<int32>`, log-probs
//! `list<float32>`; `reward` is null when the reward could not be computed.
//!
//! A multi-turn episode adds its turns as three parallel lists
//! (`turn_context_tokens`, `turn_model_tokens`, `turn_rewards`, the last
//! with a null where the environment gave no reward); they are empty for a
//! single-turn completion. Log-probs and versions hold one entry per model
//! token, as on the wire. Record batches written before the turns existed
//! (the [`LEGACY_COLUMNS`] alone) are read as single-turn ([`upgrade`]).

use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, AsArray, Float32Array, Float32Builder, Int32Array, Int32Builder, Int64Array,
    ListBuilder, RecordBatch, StringArray,
};
use arrow::datatypes::{DataType, Field, Float32Type, Int32Type, Int64Type, Schema, SchemaRef};

use crate::ContractError;
use crate::v1::{FinishReason, RewardStatus, Timings, Trajectory};

pub const UUID: &str = "uuid";
pub const TASK_ID: &str = "task_id";
pub const GROUP_ID: &str = "group_id";
pub const WORKER_ID: &str = "worker_id";
pub const PROMPT_TOKEN_IDS: &str = "prompt_token_ids";
pub const COMPLETION_TOKEN_IDS: &str = "completion_token_ids";
pub const BEHAVIOUR_LOGPROBS: &str = "behaviour_logprobs";
pub const POLICY_VERSIONS: &str = "policy_versions";
pub const REWARD: &str = "reward";
pub const FINISH_REASON: &str = "finish_reason";
pub const GROUP_SIZE: &str = "group_size";
pub const INDEX_IN_GROUP: &str = "index_in_group";
pub const ADMISSION_VERSION: &str = "admission_version";
pub const STARTED_AT_UNIX_MS: &str = "started_at_unix_ms";
pub const FINISHED_AT_UNIX_MS: &str = "finished_at_unix_ms";
pub const GENERATION_MS: &str = "generation_ms";
pub const REWARD_MS: &str = "reward_ms";
pub const WEIGHT_SWAPS: &str = "weight_swaps";
pub const TURN_CONTEXT_TOKENS: &str = "turn_context_tokens";
pub const TURN_MODEL_TOKENS: &str = "turn_model_tokens";
pub const TURN_REWARDS: &str = "turn_rewards";

/// The columns of the schema before multi-turn episodes, in order: data
/// written then has exactly these.
pub const LEGACY_COLUMNS: usize = 18;

fn list_of(item: DataType) -> DataType {
    DataType::List(Arc::new(Field::new("item", item, false)))
}

/// The schema of a stored trajectory.
pub fn trajectory_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new(UUID, DataType::Utf8, false),
        Field::new(TASK_ID, DataType::Utf8, false),
        Field::new(GROUP_ID, DataType::Utf8, false),
        Field::new(WORKER_ID, DataType::Utf8, false),
        Field::new(PROMPT_TOKEN_IDS, list_of(DataType::Int32), false),
        Field::new(COMPLETION_TOKEN_IDS, list_of(DataType::Int32), false),
        Field::new(BEHAVIOUR_LOGPROBS, list_of(DataType::Float32), false),
        Field::new(POLICY_VERSIONS, list_of(DataType::Int32), false),
        Field::new(REWARD, DataType::Float32, true),
        Field::new(FINISH_REASON, DataType::Utf8, false),
        Field::new(GROUP_SIZE, DataType::Int32, false),
        Field::new(INDEX_IN_GROUP, DataType::Int32, false),
        Field::new(ADMISSION_VERSION, DataType::Int32, false),
        Field::new(STARTED_AT_UNIX_MS, DataType::Int64, false),
        Field::new(FINISHED_AT_UNIX_MS, DataType::Int64, false),
        Field::new(GENERATION_MS, DataType::Int32, false),
        Field::new(REWARD_MS, DataType::Int32, false),
        Field::new(WEIGHT_SWAPS, DataType::Int32, false),
        Field::new(TURN_CONTEXT_TOKENS, list_of(DataType::Int32), false),
        Field::new(TURN_MODEL_TOKENS, list_of(DataType::Int32), false),
        Field::new(
            TURN_REWARDS,
            DataType::List(Arc::new(Field::new("item", DataType::Float32, true))),
            false,
        ),
    ]))
}

/// Whether `schema` is the trajectory schema as it was before the turn
/// columns: exactly today's first [`LEGACY_COLUMNS`] columns.
pub fn is_legacy(schema: &Schema) -> bool {
    let today = trajectory_schema();
    schema.fields().len() == LEGACY_COLUMNS
        && schema
            .fields()
            .iter()
            .zip(today.fields())
            .all(|(a, b)| a == b)
}

/// A record batch of [`trajectory_schema`] from one written before the turn
/// columns existed (exactly the first [`LEGACY_COLUMNS`] columns of today's
/// schema): every row single-turn. A batch of today's schema is returned as
/// it is; any other schema is an error naming the first column that differs.
pub fn upgrade(batch: RecordBatch) -> Result<RecordBatch, ContractError> {
    let schema = trajectory_schema();
    if batch.schema().fields() == schema.fields() {
        return Ok(batch);
    }
    let got = batch.schema();
    if is_legacy(&got) {
        let n = batch.num_rows();
        let empty = |item: DataType, nullable: bool| -> ArrayRef {
            Arc::new(arrow::array::ListArray::new(
                Arc::new(Field::new("item", item.clone(), nullable)),
                arrow::buffer::OffsetBuffer::new_zeroed(n),
                arrow::array::new_empty_array(&item),
                None,
            ))
        };
        let mut columns = batch.columns().to_vec();
        columns.push(empty(DataType::Int32, false));
        columns.push(empty(DataType::Int32, false));
        columns.push(empty(DataType::Float32, true));
        return RecordBatch::try_new(schema, columns)
            .map_err(|e| ContractError::Arrow(e.to_string()));
    }
    let differs = schema
        .fields()
        .iter()
        .zip(got.fields().iter().map(Some).chain(std::iter::repeat(None)))
        .find(|(want, have)| have.is_none_or(|h| h != *want))
        .map_or_else(
            || "(extra columns)".to_owned(),
            |(want, _)| want.name().clone(),
        );
    Err(ContractError::Arrow(format!(
        "the record batch's schema is not the trajectory schema (column `{differs}`)"
    )))
}

fn finish_reason_name(code: i32) -> &'static str {
    FinishReason::try_from(code).map_or("unspecified", FinishReason::label)
}

fn finish_reason_code(name: &str) -> i32 {
    FinishReason::from_label(name).unwrap_or(FinishReason::Unspecified) as i32
}

fn i32_list<'a>(rows: impl Iterator<Item = &'a [i32]>, cap: usize) -> ArrayRef {
    let mut b = ListBuilder::with_capacity(Int32Builder::new(), cap)
        .with_field(Arc::new(Field::new("item", DataType::Int32, false)));
    for r in rows {
        b.values().append_slice(r);
        b.append(true);
    }
    Arc::new(b.finish())
}

fn saturating_i32(v: u32) -> i32 {
    i32::try_from(v).unwrap_or(i32::MAX)
}

/// Builds one record batch of [`trajectory_schema`] from trajectories.
pub fn to_record_batch(trajs: &[Trajectory]) -> Result<RecordBatch, ContractError> {
    let n = trajs.len();
    let strings = |f: fn(&Trajectory) -> &str| -> ArrayRef {
        Arc::new(StringArray::from_iter_values(trajs.iter().map(f)))
    };
    let timing = |f: fn(&Timings) -> i64| -> Vec<i64> {
        trajs
            .iter()
            .map(|t| t.timings.as_ref().map(f).unwrap_or(0))
            .collect()
    };
    let mut logprobs = ListBuilder::with_capacity(Float32Builder::new(), n)
        .with_field(Arc::new(Field::new("item", DataType::Float32, false)));
    for t in trajs {
        logprobs.values().append_slice(&t.behaviour_logprobs);
        logprobs.append(true);
    }
    let reward: Float32Array = trajs
        .iter()
        .map(|t| (t.reward_status == RewardStatus::Ok as i32).then_some(t.reward))
        .collect();
    let turn_ints = |f: fn(&crate::v1::Turn) -> u32| -> ArrayRef {
        let rows: Vec<Vec<i32>> = trajs
            .iter()
            .map(|t| t.turns.iter().map(|turn| saturating_i32(f(turn))).collect())
            .collect();
        i32_list(rows.iter().map(Vec::as_slice), n)
    };
    let mut turn_rewards = ListBuilder::with_capacity(Float32Builder::new(), n)
        .with_field(Arc::new(Field::new("item", DataType::Float32, true)));
    for t in trajs {
        for turn in &t.turns {
            turn_rewards.values().append_option(turn.reward);
        }
        turn_rewards.append(true);
    }
    let ints = |f: fn(&Trajectory) -> i32| -> ArrayRef {
        Arc::new(Int32Array::from_iter_values(trajs.iter().map(f)))
    };
    let columns: Vec<ArrayRef> = vec![
        strings(|t| &t.uuid),
        strings(|t| &t.task_id),
        strings(|t| &t.group_id),
        strings(|t| &t.worker_id),
        i32_list(trajs.iter().map(|t| t.prompt_token_ids.as_slice()), n),
        i32_list(trajs.iter().map(|t| t.completion_token_ids.as_slice()), n),
        Arc::new(logprobs.finish()),
        i32_list(trajs.iter().map(|t| t.policy_versions.as_slice()), n),
        Arc::new(reward),
        Arc::new(StringArray::from_iter_values(
            trajs.iter().map(|t| finish_reason_name(t.finish_reason)),
        )),
        ints(|t| saturating_i32(t.group_size)),
        ints(|t| saturating_i32(t.index_in_group)),
        ints(|t| t.admission_version),
        Arc::new(Int64Array::from(timing(|t| t.started_at_unix_ms))),
        Arc::new(Int64Array::from(timing(|t| t.finished_at_unix_ms))),
        ints(|t| {
            t.timings
                .as_ref()
                .map(|t| saturating_i32(t.generation_ms))
                .unwrap_or(0)
        }),
        ints(|t| {
            t.timings
                .as_ref()
                .map(|t| saturating_i32(t.reward_ms))
                .unwrap_or(0)
        }),
        ints(|t| {
            t.timings
                .as_ref()
                .map(|t| saturating_i32(t.weight_swaps))
                .unwrap_or(0)
        }),
        turn_ints(|t| t.context_tokens),
        turn_ints(|t| t.model_tokens),
        Arc::new(turn_rewards.finish()),
    ];
    RecordBatch::try_new(trajectory_schema(), columns)
        .map_err(|e| ContractError::Arrow(e.to_string()))
}

fn column<'a>(batch: &'a RecordBatch, name: &'static str) -> Result<&'a ArrayRef, ContractError> {
    batch
        .column_by_name(name)
        .ok_or(ContractError::ArrowColumn { column: name })
}

fn strs<'a>(batch: &'a RecordBatch, name: &'static str) -> Result<&'a StringArray, ContractError> {
    column(batch, name)?
        .as_string_opt::<i32>()
        .ok_or(ContractError::ArrowColumn { column: name })
}

fn i32s<'a>(batch: &'a RecordBatch, name: &'static str) -> Result<&'a Int32Array, ContractError> {
    column(batch, name)?
        .as_primitive_opt::<Int32Type>()
        .ok_or(ContractError::ArrowColumn { column: name })
}

fn i64s<'a>(batch: &'a RecordBatch, name: &'static str) -> Result<&'a Int64Array, ContractError> {
    column(batch, name)?
        .as_primitive_opt::<Int64Type>()
        .ok_or(ContractError::ArrowColumn { column: name })
}

fn list_i32(batch: &RecordBatch, name: &'static str) -> Result<Vec<Vec<i32>>, ContractError> {
    let list = column(batch, name)?
        .as_list_opt::<i32>()
        .ok_or(ContractError::ArrowColumn { column: name })?;
    let values = list
        .values()
        .as_primitive_opt::<Int32Type>()
        .ok_or(ContractError::ArrowColumn { column: name })?;
    Ok(list
        .offsets()
        .windows(2)
        .map(|w| values.values()[w[0] as usize..w[1] as usize].to_vec())
        .collect())
}

fn list_f32(batch: &RecordBatch, name: &'static str) -> Result<Vec<Vec<f32>>, ContractError> {
    let list = column(batch, name)?
        .as_list_opt::<i32>()
        .ok_or(ContractError::ArrowColumn { column: name })?;
    let values = list
        .values()
        .as_primitive_opt::<Float32Type>()
        .ok_or(ContractError::ArrowColumn { column: name })?;
    Ok(list
        .offsets()
        .windows(2)
        .map(|w| values.values()[w[0] as usize..w[1] as usize].to_vec())
        .collect())
}

/// The turns of each row (empty rows for a batch without the turn
/// columns: data written before multi-turn episodes).
pub fn turns_of(batch: &RecordBatch) -> Result<Vec<Vec<crate::v1::Turn>>, ContractError> {
    let n = batch.num_rows();
    if batch.column_by_name(TURN_MODEL_TOKENS).is_none() {
        return Ok(vec![Vec::new(); n]);
    }
    let context = list_i32(batch, TURN_CONTEXT_TOKENS)?;
    let model = list_i32(batch, TURN_MODEL_TOKENS)?;
    let rewards =
        column(batch, TURN_REWARDS)?
            .as_list_opt::<i32>()
            .ok_or(ContractError::ArrowColumn {
                column: TURN_REWARDS,
            })?;
    let reward_values =
        rewards
            .values()
            .as_primitive_opt::<Float32Type>()
            .ok_or(ContractError::ArrowColumn {
                column: TURN_REWARDS,
            })?;
    let offsets = rewards.value_offsets();
    let u32_of = |column: &'static str, v: i32| {
        u32::try_from(v).map_err(|_| ContractError::Field {
            field: column,
            reason: format!("{v} is negative"),
        })
    };
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let (c, m) = (&context[i], &model[i]);
        let (lo, hi) = (offsets[i] as usize, offsets[i + 1] as usize);
        if c.len() != m.len() || hi - lo != m.len() {
            return Err(ContractError::Field {
                field: TURN_MODEL_TOKENS,
                reason: format!(
                    "row {i}: the turn lists differ in length ({}, {}, {})",
                    c.len(),
                    m.len(),
                    hi - lo
                ),
            });
        }
        let mut turns = Vec::with_capacity(m.len());
        for k in 0..m.len() {
            let at = lo + k;
            turns.push(crate::v1::Turn {
                context_tokens: u32_of(TURN_CONTEXT_TOKENS, c[k])?,
                model_tokens: u32_of(TURN_MODEL_TOKENS, m[k])?,
                reward: (!reward_values.is_null(at)).then(|| reward_values.value(at)),
            });
        }
        out.push(turns);
    }
    Ok(out)
}

/// Reads trajectories back from a record batch of [`trajectory_schema`] and
/// validates each one.
pub fn from_record_batch(batch: &RecordBatch) -> Result<Vec<Trajectory>, ContractError> {
    let turns = turns_of(batch)?;
    let uuid = strs(batch, UUID)?;
    let task = strs(batch, TASK_ID)?;
    let group = strs(batch, GROUP_ID)?;
    let worker = strs(batch, WORKER_ID)?;
    let mut prompt = list_i32(batch, PROMPT_TOKEN_IDS)?.into_iter();
    let mut completion = list_i32(batch, COMPLETION_TOKEN_IDS)?.into_iter();
    let mut logprobs = list_f32(batch, BEHAVIOUR_LOGPROBS)?.into_iter();
    let mut versions = list_i32(batch, POLICY_VERSIONS)?.into_iter();
    let reward = column(batch, REWARD)?
        .as_primitive_opt::<Float32Type>()
        .ok_or(ContractError::ArrowColumn { column: REWARD })?;
    let finish = strs(batch, FINISH_REASON)?;
    let group_size = i32s(batch, GROUP_SIZE)?;
    let index = i32s(batch, INDEX_IN_GROUP)?;
    let admission = i32s(batch, ADMISSION_VERSION)?;
    let started = i64s(batch, STARTED_AT_UNIX_MS)?;
    let finished = i64s(batch, FINISHED_AT_UNIX_MS)?;
    let gen_ms = i32s(batch, GENERATION_MS)?;
    let reward_ms = i32s(batch, REWARD_MS)?;
    let swaps = i32s(batch, WEIGHT_SWAPS)?;
    let u32_of = |v: i32| u32::try_from(v).unwrap_or(0);
    let mut out = Vec::with_capacity(batch.num_rows());
    for i in 0..batch.num_rows() {
        let failed = reward.is_null(i);
        let t = Trajectory {
            uuid: uuid.value(i).to_owned(),
            task_id: task.value(i).to_owned(),
            group_id: group.value(i).to_owned(),
            prompt_token_ids: prompt.next().unwrap_or_default(),
            completion_token_ids: completion.next().unwrap_or_default(),
            behaviour_logprobs: logprobs.next().unwrap_or_default(),
            policy_versions: versions.next().unwrap_or_default(),
            reward: if failed { f32::NAN } else { reward.value(i) },
            reward_status: if failed {
                RewardStatus::Failed as i32
            } else {
                RewardStatus::Ok as i32
            },
            finish_reason: finish_reason_code(finish.value(i)),
            worker_id: worker.value(i).to_owned(),
            timings: Some(Timings {
                started_at_unix_ms: started.value(i),
                finished_at_unix_ms: finished.value(i),
                generation_ms: u32_of(gen_ms.value(i)),
                reward_ms: u32_of(reward_ms.value(i)),
                weight_swaps: u32_of(swaps.value(i)),
            }),
            group_size: u32_of(group_size.value(i)),
            index_in_group: u32_of(index.value(i)),
            admission_version: admission.value(i),
            turns: turns.get(i).cloned().unwrap_or_default(),
        };
        t.validate()?;
        out.push(t);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn traj(i: u32, completion_len: usize, failed: bool) -> Trajectory {
        Trajectory {
            uuid: uuid::Uuid::from_u128(u128::from(i) + 1).to_string(),
            task_id: format!("task-{}", i / 2),
            group_id: format!("lease-{}", i / 2),
            prompt_token_ids: vec![1, 2, 3 + i as i32],
            completion_token_ids: (0..completion_len as i32).collect(),
            behaviour_logprobs: (0..completion_len).map(|k| -(k as f32) * 0.25).collect(),
            policy_versions: (0..completion_len).map(|k| 7 + (k / 3) as i32).collect(),
            reward: if failed { f32::NAN } else { i as f32 * 0.5 },
            reward_status: if failed {
                RewardStatus::Failed as i32
            } else {
                RewardStatus::Ok as i32
            },
            finish_reason: FinishReason::Length as i32,
            worker_id: "w1".into(),
            timings: Some(Timings {
                started_at_unix_ms: 1_700_000_000_000,
                finished_at_unix_ms: 1_700_000_000_500,
                generation_ms: 500,
                reward_ms: 3,
                weight_swaps: 1,
            }),
            group_size: 2,
            index_in_group: i % 2,
            admission_version: 7,
            turns: Vec::new(),
        }
    }

    /// An episode of three turns (context tokens 0, 2, 1; model tokens 2,
    /// 1, 3), the second rewarded.
    fn episode(i: u32) -> Trajectory {
        let turns = vec![
            crate::v1::Turn {
                context_tokens: 0,
                model_tokens: 2,
                reward: None,
            },
            crate::v1::Turn {
                context_tokens: 2,
                model_tokens: 1,
                reward: Some(0.5),
            },
            crate::v1::Turn {
                context_tokens: 1,
                model_tokens: 3,
                reward: None,
            },
        ];
        Trajectory {
            completion_token_ids: (10..19).collect(),
            behaviour_logprobs: vec![-0.5; 6],
            policy_versions: vec![7, 7, 8, 8, 8, 9],
            turns,
            ..traj(i, 0, false)
        }
    }

    #[test]
    fn episodes_round_trip_and_legacy_batches_read_as_single_turn() {
        let trajs = vec![episode(0), traj(1, 3, false), episode(2)];
        let batch = to_record_batch(&trajs).unwrap();
        assert_eq!(from_record_batch(&batch).unwrap(), trajs);
        // A batch written before the turn columns: the first 18 columns.
        let single = vec![traj(0, 4, false), traj(1, 2, false)];
        let legacy = to_record_batch(&single)
            .unwrap()
            .project(&(0..LEGACY_COLUMNS).collect::<Vec<_>>())
            .unwrap();
        assert_eq!(from_record_batch(&legacy).unwrap(), single);
        let upgraded = upgrade(legacy).unwrap();
        assert_eq!(upgraded.schema(), trajectory_schema());
        assert_eq!(from_record_batch(&upgraded).unwrap(), single);
        // Any other schema is refused, naming the column.
        let other = to_record_batch(&single).unwrap().project(&[0, 1]).unwrap();
        let err = upgrade(other).unwrap_err().to_string();
        assert!(err.contains("`group_id`"), "{err}");
    }

    #[test]
    fn record_batch_round_trip() {
        let trajs = vec![
            traj(0, 5, false),
            traj(1, 0, false),
            traj(2, 9, true),
            traj(3, 1, false),
        ];
        let batch = to_record_batch(&trajs).unwrap();
        assert_eq!(batch.schema(), trajectory_schema());
        assert_eq!(batch.num_rows(), 4);
        let back = from_record_batch(&batch).unwrap();
        for (a, b) in trajs.iter().zip(&back) {
            // NaN != NaN: compare failed rewards by status.
            let mut a = a.clone();
            let mut b = b.clone();
            if a.reward_status == RewardStatus::Failed as i32 {
                assert!(b.reward.is_nan());
                a.reward = 0.0;
                b.reward = 0.0;
            }
            assert_eq!(a, b);
        }
        // A failed reward is null in Arrow, never a silent 0.
        assert!(batch.column_by_name(REWARD).unwrap().is_null(2));
    }

    #[test]
    fn missing_column_is_named() {
        let batch = to_record_batch(&[traj(0, 2, false)]).unwrap();
        let batch = batch.project(&[0, 1, 2]).unwrap();
        let err = from_record_batch(&batch).unwrap_err();
        assert_eq!(err, ContractError::ArrowColumn { column: WORKER_ID });
    }
}

/// The rows a trainer engine trains on (`TrainStepRequest.batch_arrow_ipc`,
/// trainer.proto): one row per trajectory, as the learner assembled and
/// checked them.
pub mod trainer_rows {
    use std::sync::Arc;

    use arrow::array::{
        ArrayRef, BooleanBuilder, Float32Builder, Int32Builder, Int64Builder, ListBuilder,
        RecordBatch,
    };
    use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
    use arrow::error::ArrowError;

    pub const INPUT_IDS: &str = "input_ids";
    pub const GATHER_INDEX: &str = "gather_index";
    pub const BEHAVIOUR: &str = "behaviour";
    pub const VERSIONS: &str = "versions";
    pub const ADVANTAGES: &str = "advantages";
    pub const MASK: &str = "mask";

    fn list_of(item: DataType) -> DataType {
        DataType::List(Arc::new(Field::new("item", item, true)))
    }

    pub fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new(INPUT_IDS, list_of(DataType::Int64), false),
            Field::new(GATHER_INDEX, list_of(DataType::Int64), false),
            Field::new(BEHAVIOUR, list_of(DataType::Float32), false),
            Field::new(VERSIONS, list_of(DataType::Int32), false),
            Field::new(ADVANTAGES, list_of(DataType::Float32), false),
            Field::new(MASK, list_of(DataType::Boolean), false),
        ]))
    }

    /// One row: prompt + completion ids, and per trained token its gather
    /// index, behaviour log-prob, version, advantage and mask (one length).
    pub struct Row<'a> {
        pub input_ids: &'a [i64],
        pub gather_index: &'a [i64],
        pub behaviour: &'a [f32],
        pub versions: &'a [i32],
        pub advantages: &'a [f32],
        pub mask: &'a [bool],
    }

    /// The rows as one record batch of [`schema`], as an Arrow IPC stream.
    pub fn encode(rows: &[Row<'_>]) -> Result<Vec<u8>, ArrowError> {
        let mut ids = ListBuilder::new(Int64Builder::new());
        let mut gather = ListBuilder::new(Int64Builder::new());
        let mut behaviour = ListBuilder::new(Float32Builder::new());
        let mut versions = ListBuilder::new(Int32Builder::new());
        let mut advantages = ListBuilder::new(Float32Builder::new());
        let mut mask = ListBuilder::new(BooleanBuilder::new());
        for (i, r) in rows.iter().enumerate() {
            let t = r.gather_index.len();
            if [
                r.behaviour.len(),
                r.versions.len(),
                r.advantages.len(),
                r.mask.len(),
            ]
            .iter()
            .any(|&n| n != t)
            {
                return Err(ArrowError::InvalidArgumentError(format!(
                    "trainer row {i}: the per-token lists differ in length"
                )));
            }
            ids.values().append_slice(r.input_ids);
            ids.append(true);
            gather.values().append_slice(r.gather_index);
            gather.append(true);
            behaviour.values().append_slice(r.behaviour);
            behaviour.append(true);
            versions.values().append_slice(r.versions);
            versions.append(true);
            advantages.values().append_slice(r.advantages);
            advantages.append(true);
            mask.values().append_slice(r.mask);
            mask.append(true);
        }
        let columns: Vec<ArrayRef> = vec![
            Arc::new(ids.finish()),
            Arc::new(gather.finish()),
            Arc::new(behaviour.finish()),
            Arc::new(versions.finish()),
            Arc::new(advantages.finish()),
            Arc::new(mask.finish()),
        ];
        let batch = RecordBatch::try_new(schema(), columns)?;
        let mut out = Vec::new();
        {
            let mut w = arrow::ipc::writer::StreamWriter::try_new(&mut out, &batch.schema())?;
            w.write(&batch)?;
            w.finish()?;
        }
        Ok(out)
    }
}
