//! `asyncrl buffer export`: the trajectories held in the segments as one
//! Parquet file (zstd) that pandas, polars, duckdb and pyarrow read.
//!
//! Safe while the buffer runs: segments are only read (a segment being
//! written ends at its last complete frame; a segment deleted meanwhile is
//! skipped). Each trajectory appears once (deduplicated by uuid), in ingest
//! order, with the schema of `asyncrl_protos::arrow_schema`; a trajectory
//! that took the `index_in_group` of an earlier one (dead-lettered by the
//! buffer) is left out. With
//! `retention = "delete"` only what the buffer still holds is there; keep
//! every segment with `retention = "keep"` to export a whole run.

use std::collections::HashSet;
use std::fs::File;
use std::path::{Path, PathBuf};

use arrow::array::{AsArray, BooleanArray, RecordBatch};
use arrow::datatypes::Int32Type;
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;

use asyncrl_config::Config;
use asyncrl_protos::arrow_schema::{
    ADMISSION_VERSION, GROUP_ID, INDEX_IN_GROUP, UUID, trajectory_schema,
};

use crate::segment::{list_segments, read_segment, segment_path};
use crate::{BufferError, segment_dir};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportFormat {
    Parquet,
}

/// `asyncrl buffer export --format parquet [--from-version A --to-version B] --out FILE`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportArgs {
    /// The buffer's data directory (see [`ExportArgs::from_config`]).
    pub data_dir: PathBuf,
    pub format: ExportFormat,
    /// Only trajectories whose `admission_version` is in `[from, to]`
    /// (inclusive; either end open when `None`).
    pub from_version: Option<i32>,
    pub to_version: Option<i32>,
    pub out: PathBuf,
}

impl ExportArgs {
    /// Export everything from the data directory `config` names.
    pub fn from_config(config: &Config, out: PathBuf) -> Self {
        Self {
            data_dir: config.buffer.data_dir_in(&config.run.output_dir),
            format: ExportFormat::Parquet,
            from_version: None,
            to_version: None,
            out,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportSummary {
    pub segments: usize,
    pub trajectories: u64,
    pub bytes: u64,
}

impl std::fmt::Display for ExportSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exported {} trajectories from {} segments ({} bytes)",
            self.trajectories, self.segments, self.bytes
        )
    }
}

/// Writes the export. The output appears complete or not at all (it is
/// written to a temporary file and renamed).
pub fn export(args: &ExportArgs) -> Result<ExportSummary, BufferError> {
    if let (Some(a), Some(b)) = (args.from_version, args.to_version)
        && a > b
    {
        return Err(BufferError::Export(format!(
            "--from-version {a} is above --to-version {b}"
        )));
    }
    let dir = segment_dir(&args.data_dir);
    if !args.data_dir.is_dir() {
        return Err(BufferError::Export(format!(
            "{} is not a buffer data directory",
            args.data_dir.display()
        )));
    }
    let tmp = tmp_path(&args.out);
    let file = File::create(&tmp).map_err(|e| BufferError::io("create", &tmp, e))?;
    let props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(ZstdLevel::default()))
        .build();
    let schema = trajectory_schema();
    let parquet = BufferError::Parquet;
    let mut writer = ArrowWriter::try_new(file, schema.clone(), Some(props)).map_err(parquet)?;
    let mut seen = Seen::default();
    let mut summary = ExportSummary {
        segments: 0,
        trajectories: 0,
        bytes: 0,
    };
    let result = (|| {
        for id in list_segments(&dir)? {
            let scan = match read_segment(&dir, id, &schema) {
                Ok(scan) => scan,
                Err(BufferError::Io { source, .. })
                    if source.kind() == std::io::ErrorKind::NotFound =>
                {
                    continue; // deleted by retention meanwhile
                }
                Err(e) => return Err(e),
            };
            if let Some(reason) = &scan.tail_error {
                tracing::debug!(segment = %segment_path(&dir, id).display(), reason, "segment ends in an incomplete frame (being written or torn)");
            }
            summary.segments += 1;
            for batch in scan.batches {
                let kept = select(&batch, args, &mut seen)?;
                if kept.num_rows() > 0 {
                    summary.trajectories += kept.num_rows() as u64;
                    writer.write(&kept).map_err(parquet)?;
                }
            }
        }
        Ok(())
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    writer.close().map_err(parquet)?;
    std::fs::rename(&tmp, &args.out).map_err(|e| BufferError::io("rename", &tmp, e))?;
    summary.bytes = std::fs::metadata(&args.out)
        .map_err(|e| BufferError::io("stat", &args.out, e))?
        .len();
    Ok(summary)
}

fn tmp_path(out: &Path) -> PathBuf {
    let mut name = out.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    out.with_file_name(name)
}

/// What was exported already: uuids, and group slots (a second trajectory
/// for the same `index_in_group` of a group broke the group contract and was
/// dead-lettered by the buffer; the first one is the group's member).
#[derive(Default)]
struct Seen {
    uuids: HashSet<String>,
    slots: HashSet<(String, i32)>,
}

/// The rows of `batch` in the version range not exported yet.
fn select(
    batch: &RecordBatch,
    args: &ExportArgs,
    seen: &mut Seen,
) -> Result<RecordBatch, BufferError> {
    let column = |name: &'static str| {
        batch.column_by_name(name).ok_or(BufferError::Contract(
            asyncrl_protos::ContractError::ArrowColumn { column: name },
        ))
    };
    let uuids = column(UUID)?
        .as_string_opt::<i32>()
        .ok_or(BufferError::Contract(
            asyncrl_protos::ContractError::ArrowColumn { column: UUID },
        ))?;
    let versions = column(ADMISSION_VERSION)?
        .as_primitive_opt::<Int32Type>()
        .ok_or(BufferError::Contract(
            asyncrl_protos::ContractError::ArrowColumn {
                column: ADMISSION_VERSION,
            },
        ))?;
    let groups = column(GROUP_ID)?
        .as_string_opt::<i32>()
        .ok_or(BufferError::Contract(
            asyncrl_protos::ContractError::ArrowColumn { column: GROUP_ID },
        ))?;
    let indexes = column(INDEX_IN_GROUP)?
        .as_primitive_opt::<Int32Type>()
        .ok_or(BufferError::Contract(
            asyncrl_protos::ContractError::ArrowColumn {
                column: INDEX_IN_GROUP,
            },
        ))?;
    let keep: BooleanArray = (0..batch.num_rows())
        .map(|i| {
            let v = versions.value(i);
            let in_range =
                args.from_version.is_none_or(|a| v >= a) && args.to_version.is_none_or(|b| v <= b);
            let slot = (groups.value(i).to_owned(), indexes.value(i));
            let fresh = !seen.uuids.contains(uuids.value(i)) && !seen.slots.contains(&slot);
            if fresh {
                seen.uuids.insert(uuids.value(i).to_owned());
                seen.slots.insert(slot);
            }
            Some(in_range && fresh)
        })
        .collect();
    arrow::compute::filter_record_batch(batch, &keep).map_err(BufferError::Arrow)
}
