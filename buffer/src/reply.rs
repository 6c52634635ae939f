//! Learner batches as Arrow IPC streams.

use std::collections::BTreeMap;

use arrow::array::{AsArray, RecordBatch};
use arrow::buffer::Buffer;
use arrow::datatypes::Int32Type;
use arrow::ipc::CompressionType;
use arrow::ipc::reader::StreamReader;
use arrow::ipc::writer::{IpcWriteOptions, StreamEncoder, StreamWriter};

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

/// At most this many record batches in one encoded batch: rows that lie in
/// longer runs of the resident batches are sent as zero-copy slices of them
/// (one IPC message each); more fragmented rows are gathered into one batch.
pub const MAX_SLICES: usize = 64;

/// Gathers `indices` (`(batch, row)`) from `batches` into one record batch
/// and encodes it as an Arrow IPC stream, zstd-compressed if asked.
/// `version` is the learner's, for the token staleness figures.
///
/// Rows keep the order of `indices`. Runs of consecutive rows of one batch
/// are encoded as slices of it, without gathering them first (the stream
/// then holds up to [`MAX_SLICES`] record batches); the bytes are copied once,
/// into the stream.
pub fn encode_batch(
    batches: &[RecordBatch],
    indices: &[(usize, usize)],
    zstd: bool,
    version: i32,
) -> Result<EncodedBatch, BufferError> {
    let parts = batch_parts(batches, indices)?;
    let lags = token_lags(&parts, version);
    let rows = parts.iter().map(RecordBatch::num_rows).sum();
    let ipc = if zstd {
        let options = IpcWriteOptions::default()
            .try_with_compression(Some(CompressionType::ZSTD))
            .map_err(BufferError::Arrow)?;
        let mut writer =
            StreamWriter::try_new_with_options(Vec::new(), &parts[0].schema(), options)?;
        for part in &parts {
            writer.write(part)?;
        }
        writer.finish()?;
        writer.into_inner()?
    } else {
        let buffers = encode_parts(&parts)?;
        let mut ipc = Vec::with_capacity(buffers.iter().map(Buffer::len).sum());
        for b in &buffers {
            ipc.extend_from_slice(b.as_slice());
        }
        ipc
    };
    Ok(EncodedBatch { ipc, rows, lags })
}

/// The record batches holding `indices` in order: zero-copy slices of
/// `batches` for runs of consecutive rows, or, when that would take more
/// than [`MAX_SLICES`] slices, one gathered batch.
pub fn batch_parts(
    batches: &[RecordBatch],
    indices: &[(usize, usize)],
) -> Result<Vec<RecordBatch>, BufferError> {
    if batches.is_empty() || indices.is_empty() {
        return Ok(vec![RecordBatch::new_empty(trajectory_schema())]);
    }
    // (batch, first row, rows)
    let mut runs: Vec<(usize, usize, usize)> = Vec::new();
    for &(b, row) in indices {
        match runs.last_mut() {
            Some((rb, start, len)) if *rb == b && *start + *len == row => *len += 1,
            _ => {
                if runs.len() == MAX_SLICES {
                    let refs: Vec<&RecordBatch> = batches.iter().collect();
                    return Ok(vec![arrow::compute::interleave_record_batch(
                        &refs, indices,
                    )?]);
                }
                runs.push((b, row, 1));
            }
        }
    }
    runs.into_iter()
        .map(|(b, start, len)| {
            let batch = batches.get(b).ok_or_else(|| {
                BufferError::Arrow(arrow::error::ArrowError::InvalidArgumentError(format!(
                    "batch {b} of {} to gather from",
                    batches.len()
                )))
            })?;
            if start + len > batch.num_rows() {
                return Err(BufferError::Arrow(
                    arrow::error::ArrowError::InvalidArgumentError(format!(
                        "rows {start}..{} of a batch of {}",
                        start + len,
                        batch.num_rows()
                    )),
                ));
            }
            Ok(batch.slice(start, len))
        })
        .collect()
}

/// An uncompressed Arrow IPC stream of `parts` (schema, one message per
/// part, end of stream) as the buffers to write one after the other; the
/// data buffers are those of `parts` where no re-encoding is needed (no
/// copy).
pub fn encode_parts(parts: &[RecordBatch]) -> Result<Vec<Buffer>, BufferError> {
    let schema = parts
        .first()
        .map_or_else(trajectory_schema, RecordBatch::schema);
    let mut encoder = StreamEncoder::try_new(&schema)?;
    let mut out = Vec::new();
    for part in parts {
        out.extend(encoder.encode(part)?);
    }
    out.extend(encoder.finish()?);
    Ok(out)
}

/// Completion tokens per version lag (`version − token version`) in `parts`.
fn token_lags(parts: &[RecordBatch], version: i32) -> BTreeMap<i64, u64> {
    let mut lags = BTreeMap::new();
    for batch in parts {
        if let Some(list) = batch
            .column_by_name(POLICY_VERSIONS)
            .and_then(|c| c.as_list_opt::<i32>())
            && let Some(values) = list.values().as_primitive_opt::<Int32Type>()
        {
            // Only the values the list offsets cover (a slice or a gathered
            // list may share a larger values buffer).
            let offsets = list.offsets();
            let (lo, hi) = (
                usize::try_from(offsets.first()).unwrap_or(0),
                usize::try_from(offsets.last()).unwrap_or(0),
            );
            // Runs of one version are counted at once (a trajectory's
            // tokens mostly share theirs): one map update per run.
            let mut vs = values.values().get(lo..hi).unwrap_or_default();
            while let Some(&v) = vs.first() {
                let run = vs.iter().position(|x| *x != v).unwrap_or(vs.len());
                *lags.entry(i64::from(version) - i64::from(v)).or_insert(0) += run as u64;
                vs = &vs[run..];
            }
        }
    }
    lags
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
        assert!(
            decode_batch(&empty.ipc)
                .unwrap()
                .iter()
                .all(|b| b.num_rows() == 0)
        );
        assert_eq!(empty.rows, 0);
        assert!(decode_batch(b"garbage").is_err());
    }

    /// Runs of rows go out as slices (only their bytes, in order); rows
    /// scattered over more than `MAX_SLICES` runs are gathered into one batch;
    /// both decode to the same trajectories in the asked order.
    #[test]
    fn slices_carry_only_their_rows_and_fragmented_rows_are_gathered() {
        let all: Vec<_> = (0..200)
            .map(|i| traj(i, 4, (1 + i % 3) as i32, 50))
            .collect();
        let a = to_record_batch(&all[..100]).unwrap();
        let b = to_record_batch(&all[100..]).unwrap();
        let batches = [a.clone(), b.clone()];
        let decode = |ipc: &[u8]| -> Vec<_> {
            decode_batch(ipc)
                .unwrap()
                .iter()
                .flat_map(|b| from_record_batch(b).unwrap())
                .collect()
        };
        // Two runs: rows 10..14 of b, then 40..44 of a.
        let idx: Vec<(usize, usize)> = (10..14)
            .map(|r| (1, r))
            .chain((40..44).map(|r| (0, r)))
            .collect();
        let parts = batch_parts(&batches, &idx).unwrap();
        assert_eq!(
            parts.iter().map(RecordBatch::num_rows).collect::<Vec<_>>(),
            [4, 4]
        );
        let want: Vec<_> = idx
            .iter()
            .map(|&(bi, r)| all[bi * 100 + r].clone())
            .collect();
        for zstd in [false, true] {
            let enc = encode_batch(&batches, &idx, zstd, 3).unwrap();
            assert_eq!(enc.rows, 8);
            assert_eq!(decode(&enc.ipc), want);
        }
        // A slice's stream holds its rows, not the whole batch's buffers.
        let whole = encode_batch(
            std::slice::from_ref(&a),
            &(0..100).map(|r| (0, r)).collect::<Vec<_>>(),
            false,
            3,
        )
        .unwrap();
        let eight = encode_batch(&batches, &idx, false, 3).unwrap();
        assert!(
            eight.ipc.len() * 5 < whole.ipc.len(),
            "{} vs {}",
            eight.ipc.len(),
            whole.ipc.len()
        );
        // Every other row of both batches: 200 runs, more than MAX_SLICES.
        let idx: Vec<(usize, usize)> = (0..100).step_by(2).flat_map(|r| [(0, r), (1, r)]).collect();
        assert!(idx.len() > MAX_SLICES);
        assert_eq!(batch_parts(&batches, &idx).unwrap().len(), 1);
        let enc = encode_batch(&batches, &idx, false, 3).unwrap();
        let want: Vec<_> = idx
            .iter()
            .map(|&(bi, r)| all[bi * 100 + r].clone())
            .collect();
        assert_eq!(decode(&enc.ipc), want);
        // Token lags count only the served rows: 100 rows × 50 tokens.
        assert_eq!(enc.lags.values().sum::<u64>(), 100 * 50);
        // Batches of one row each, one part each.
        let ones: Vec<RecordBatch> = all[..3]
            .iter()
            .map(|t| to_record_batch(std::slice::from_ref(t)).unwrap())
            .collect();
        for idx in [vec![(0, 0), (1, 0)], vec![(2, 0), (0, 0), (1, 0)]] {
            let enc = encode_batch(&ones, &idx, false, 3).unwrap();
            let want: Vec<_> = idx.iter().map(|&(bi, _)| all[bi].clone()).collect();
            assert_eq!(decode(&enc.ipc), want);
        }
        // Rows of different sizes, each its own slice, in reverse order.
        let varied: Vec<_> = (0..12)
            .map(|i| traj(i * 37, 4, 2, 10 + 3 * i as usize))
            .collect();
        let one = [to_record_batch(&varied).unwrap()];
        let idx: Vec<(usize, usize)> = (0..12).rev().map(|r| (0, r)).collect();
        for zstd in [false, true] {
            let enc = encode_batch(&one, &idx, zstd, 3).unwrap();
            let want: Vec<_> = varied.iter().rev().cloned().collect();
            assert_eq!(decode(&enc.ipc), want);
        }
        // Rows that are not there are an error, not a panic.
        assert!(encode_batch(&batches, &[(0, 99), (0, 100)], false, 3).is_err());
        assert!(encode_batch(&batches, &[(2, 0)], false, 3).is_err());
    }
}
