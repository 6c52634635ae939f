//! Learner batches as Arrow IPC streams.

use std::collections::BTreeMap;

use arrow::array::{AsArray, RecordBatch};
use arrow::datatypes::Int32Type;
use arrow::ipc::CompressionType;
use arrow::ipc::reader::StreamReader;
use arrow::ipc::writer::{IpcWriteOptions, StreamWriter};

use asyncrl_protos::arrow_schema::{POLICY_VERSIONS, trajectory_schema};

use crate::BufferError;

/// An encoded batch and what it holds.
#[derive(Debug)]
pub struct EncodedBatch {
    /// Arrow IPC stream (schema, one record batch, end of stream).
    pub ipc: Vec<u8>,
    pub rows: usize,
    /// Completion tokens per version lag (`version − token version`).
    pub lags: BTreeMap<i64, u64>,
}

/// Gathers `indices` (`(batch, row)`) from `batches` into one record batch
/// and encodes it as an Arrow IPC stream, zstd-compressed if asked.
/// `version` is the learner's, for the token staleness figures.
pub fn encode_batch(
    batches: &[RecordBatch],
    indices: &[(usize, usize)],
    zstd: bool,
    version: i32,
) -> Result<EncodedBatch, BufferError> {
    let arrow = BufferError::Arrow;
    let batch = if batches.is_empty() || indices.is_empty() {
        RecordBatch::new_empty(trajectory_schema())
    } else {
        let refs: Vec<&RecordBatch> = batches.iter().collect();
        arrow::compute::interleave_record_batch(&refs, indices).map_err(arrow)?
    };
    let mut lags = BTreeMap::new();
    if let Some(list) = batch
        .column_by_name(POLICY_VERSIONS)
        .and_then(|c| c.as_list_opt::<i32>())
        && let Some(values) = list.values().as_primitive_opt::<Int32Type>()
    {
        // Only the values the list offsets cover (a gathered list may share
        // a larger values buffer).
        let offsets = list.offsets();
        let (lo, hi) = (
            usize::try_from(offsets.first()).unwrap_or(0),
            usize::try_from(offsets.last()).unwrap_or(0),
        );
        for v in values.values().get(lo..hi).unwrap_or_default() {
            *lags.entry(i64::from(version) - i64::from(*v)).or_insert(0) += 1;
        }
    }
    let options = if zstd {
        IpcWriteOptions::default()
            .try_with_compression(Some(CompressionType::ZSTD))
            .map_err(arrow)?
    } else {
        IpcWriteOptions::default()
    };
    let mut writer =
        StreamWriter::try_new_with_options(Vec::new(), &batch.schema(), options).map_err(arrow)?;
    writer.write(&batch).map_err(arrow)?;
    writer.finish().map_err(arrow)?;
    let ipc = writer.into_inner().map_err(arrow)?;
    Ok(EncodedBatch {
        ipc,
        rows: batch.num_rows(),
        lags,
    })
}

/// Decodes a batch reply's Arrow IPC stream (compressed or not) into record
/// batches of the trajectory schema.
/// Never panics, whatever the bytes.
pub fn decode_batch(ipc: &[u8]) -> Result<Vec<RecordBatch>, BufferError> {
    crate::segment::guarded(|| {
        let reader =
            StreamReader::try_new(std::io::Cursor::new(ipc), None).map_err(|e| e.to_string())?;
        if reader.schema().fields() != trajectory_schema().fields() {
            return Err("batch schema differs from the trajectory schema".into());
        }
        reader.map(|b| b.map_err(|e| e.to_string())).collect()
    })
    .map_err(BufferError::BatchDecode)
}

#[cfg(test)]
mod tests {
    use asyncrl_protos::arrow_schema::{from_record_batch, to_record_batch};

    use super::*;
    use crate::testing::traj;

    #[test]
    fn gathers_in_order_and_round_trips_with_and_without_zstd() {
        let a = to_record_batch(&[traj(0, 2, 5, 10), traj(1, 2, 5, 10)]).unwrap();
        let b = to_record_batch(&[traj(2, 2, 3, 10), traj(3, 2, 3, 10)]).unwrap();
        for zstd in [false, true] {
            let enc = encode_batch(&[a.clone(), b.clone()], &[(1, 1), (0, 0)], zstd, 6).unwrap();
            assert_eq!(enc.rows, 2);
            let back = decode_batch(&enc.ipc).unwrap();
            let trajs: Vec<_> = back
                .iter()
                .flat_map(|b| from_record_batch(b).unwrap())
                .collect();
            assert_eq!(trajs, vec![traj(3, 2, 3, 10), traj(0, 2, 5, 10)]);
            // 10 completion tokens at version 3 (lag 3) and 10 at version 5 (lag 1).
            assert_eq!(enc.lags, BTreeMap::from([(1, 10), (3, 10)]));
        }
        // Corrupted replies are errors, never panics.
        let enc = encode_batch(std::slice::from_ref(&a), &[(0, 0)], false, 6).unwrap();
        for at in (0..enc.ipc.len()).step_by(7) {
            let mut bad = enc.ipc.clone();
            bad[at] ^= 0xa5;
            let _ = decode_batch(&bad);
            let _ = decode_batch(&enc.ipc[..at]);
        }
        let empty = encode_batch(&[], &[], false, 0).unwrap();
        assert_eq!(empty.rows, 0);
        assert!(decode_batch(b"garbage").is_err());
    }
}
