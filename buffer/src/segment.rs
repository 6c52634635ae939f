//! On-disk segments: append-only files of Arrow IPC messages, each in a
//! checksummed frame.
//!
//! ```text
//! segment  := MAGIC frame*
//! MAGIC    := "ASRLSEG" 0x01                       (8 bytes)
//! frame    := len:u32le crc32:u32le payload[len]
//! payload  := one encapsulated Arrow IPC message: the first frame holds the
//!             schema (asyncrl_protos::arrow_schema), every later frame one
//!             record batch of trajectories
//! ```
//!
//! Stripping the 8-byte frame headers leaves a plain Arrow IPC stream; the
//! frames add what a stream lacks for crash recovery: a length and a CRC-32
//! per message, so that a torn or garbled tail (a crash mid-write) is told
//! apart from data and cut off, and so that no garbage ever reaches the Arrow
//! decoder. A segment is only ever appended to; after a restart the buffer
//! starts a new one (see the crate docs for why this format, and for the
//! fsync policy).

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use arrow::array::RecordBatch;
use arrow::buffer::Buffer;
use arrow::datatypes::SchemaRef;
use arrow::ipc::CompressionType;
use arrow::ipc::reader::StreamDecoder;
use arrow::ipc::writer::{IpcWriteOptions, StreamWriter};

use asyncrl_config::{FsyncPolicy, SegmentCompression};
use asyncrl_protos::arrow_schema;

use crate::BufferError;

pub const MAGIC: &[u8; 8] = b"ASRLSEG\x01";
const FRAME_HEADER: usize = 8;
/// No frame is larger than this; a larger length is garbage.
pub const MAX_FRAME: u32 = 1 << 30;
const SEGMENT_EXT: &str = "arrows";

/// Path of segment `id` in `dir`.
pub fn segment_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("seg-{id:016}.{SEGMENT_EXT}"))
}

/// The segment ids in `dir`, ascending. Files that are not segments are
/// ignored.
pub fn list_segments(dir: &Path) -> Result<Vec<u64>, BufferError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(BufferError::io("list segments in", dir, e)),
    };
    let mut ids = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| BufferError::io("list segments in", dir, e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if let Some(id) = name
            .strip_prefix("seg-")
            .and_then(|rest| rest.strip_suffix(&format!(".{SEGMENT_EXT}")))
            .and_then(|digits| digits.parse::<u64>().ok())
        {
            ids.push(id);
        }
    }
    ids.sort_unstable();
    Ok(ids)
}

/// Makes a directory entry change (create, rename, delete) durable.
pub fn sync_dir(dir: &Path) -> Result<(), BufferError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| BufferError::io("fsync directory", dir, e))
}

fn frame(payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(FRAME_HEADER + payload.len());
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
    out.extend_from_slice(payload);
    out
}

/// The writer of the active segment.
pub struct SegmentWriter {
    dir: PathBuf,
    id: u64,
    path: PathBuf,
    file: File,
    /// Bytes known to be completely written (a failed append is cut back to it).
    len: u64,
    /// A failed append left bytes past `len` that could not be cut off yet:
    /// the next append cuts them first (never writes after garbage).
    torn: bool,
    ipc: StreamWriter<Vec<u8>>,
    fsync: FsyncPolicy,
}

/// Where an appended batch went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Appended {
    pub segment: u64,
    pub bytes: u64,
}

impl SegmentWriter {
    /// Creates segment `id` in `dir` and writes its header and schema,
    /// durably. The file must not exist yet, except as the leftover of an
    /// earlier failed creation (no longer than a header: nothing in it), which
    /// is replaced. A failed creation removes what it wrote, so that a full
    /// disk leaves no half-made segment behind.
    pub fn create(
        dir: &Path,
        id: u64,
        schema: &SchemaRef,
        compression: SegmentCompression,
        fsync: FsyncPolicy,
    ) -> Result<Self, BufferError> {
        fs::create_dir_all(dir).map_err(|e| BufferError::io("create directory", dir, e))?;
        let path = segment_path(dir, id);
        let options = match compression {
            SegmentCompression::None => IpcWriteOptions::default(),
            SegmentCompression::Zstd => IpcWriteOptions::default()
                .try_with_compression(Some(CompressionType::ZSTD))
                .map_err(BufferError::Arrow)?,
        };
        let mut ipc = StreamWriter::try_new_with_options(Vec::new(), schema, options)
            .map_err(BufferError::Arrow)?;
        let schema_msg = std::mem::take(ipc.get_mut());
        let mut head = MAGIC.to_vec();
        head.extend_from_slice(&frame(&schema_msg));
        let mut file = match OpenOptions::new().write(true).create_new(true).open(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                // Only a leftover of a failed creation may be replaced.
                let len = fs::metadata(&path)
                    .map_err(|e| BufferError::io("create segment", &path, e))?
                    .len();
                if len > head.len() as u64 {
                    return Err(BufferError::io("create segment", &path, e));
                }
                OpenOptions::new().write(true).truncate(true).open(&path)
            }
            r => r,
        }
        .map_err(|e| BufferError::io("create segment", &path, e))?;
        let written = file
            .write_all(&head)
            .and_then(|()| file.sync_all())
            .map_err(|e| BufferError::io("write segment header", &path, e))
            .and_then(|()| sync_dir(dir));
        if let Err(e) = written {
            drop(file);
            // Best effort; a leftover is replaced by the next attempt.
            let _ = fs::remove_file(&path);
            return Err(e);
        }
        Ok(Self {
            dir: dir.to_owned(),
            id,
            path,
            file,
            len: head.len() as u64,
            torn: false,
            ipc,
            fsync,
        })
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    /// Bytes in the file.
    pub fn bytes(&self) -> u64 {
        self.len
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Appends one record batch as one frame and, with `fsync = "always"`,
    /// makes it durable before returning. On error (a full disk: `ENOSPC`,
    /// `EFBIG`, `EDQUOT`, or `EIO`) the file is cut back to its last complete
    /// frame, so the segment stays valid and the append can be retried; if
    /// even the cut fails, the next append makes it first.
    pub fn append(&mut self, batch: &RecordBatch) -> Result<Appended, BufferError> {
        if self.torn {
            self.cut_back()?;
        }
        // The frame is built in place: its header, then the IPC message
        // written after it, in a buffer kept from one append to the next.
        let buf = self.ipc.get_mut();
        buf.clear();
        buf.extend_from_slice(&[0; FRAME_HEADER]);
        let encoded = self.ipc.write(batch).map_err(BufferError::Arrow);
        let framed = self.ipc.get_mut();
        if let Err(e) = encoded {
            framed.clear();
            return Err(e);
        }
        let payload_len = framed.len() - FRAME_HEADER;
        let crc = crc32fast::hash(&framed[FRAME_HEADER..]);
        framed[..4].copy_from_slice(&(payload_len as u32).to_le_bytes());
        framed[4..FRAME_HEADER].copy_from_slice(&crc.to_le_bytes());
        let frame_len = framed.len() as u64;
        // Positioned at the end of the last complete frame: after a failed
        // append the file offset may lie past it.
        let file = &mut self.file;
        let written = file
            .seek(SeekFrom::Start(self.len))
            .and_then(|_| file.write_all(self.ipc.get_ref()));
        if let Err(e) = written {
            self.torn = true;
            let _ = self.cut_back();
            return Err(BufferError::io("append to segment", &self.path, e));
        }
        if self.fsync == FsyncPolicy::Always
            && let Err(e) = self.file.sync_data()
        {
            // Not known to be durable, so not acked: cut it off.
            self.torn = true;
            let _ = self.cut_back();
            return Err(BufferError::io("fsync segment", &self.path, e));
        }
        self.len += frame_len;
        Ok(Appended {
            segment: self.id,
            bytes: frame_len,
        })
    }

    /// Cuts the file back to its last complete frame.
    fn cut_back(&mut self) -> Result<(), BufferError> {
        self.file
            .set_len(self.len)
            .map_err(|e| BufferError::io("cut a failed append off", &self.path, e))?;
        self.torn = false;
        Ok(())
    }
}

/// What a segment holds.
#[derive(Debug)]
pub struct SegmentScan {
    /// The record batches of every complete, valid frame, in order.
    pub batches: Vec<RecordBatch>,
    /// Bytes up to the end of the last valid frame.
    pub valid_len: u64,
    /// Why reading stopped before the end of the bytes (torn or garbled tail).
    pub tail_error: Option<String>,
}

/// Runs a decoding step of the Arrow IPC reader, turning a panic into an
/// error. arrow-ipc 60 panics on some malformed messages (e.g. a buffer
/// offset past the body, found by this module's proptest); a frame only
/// reaches the decoder after its CRC matched, so this is a second line of
/// defence against files that were written wrong, never a crash path.
pub(crate) fn guarded<T>(f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(panic) => Err(format!(
            "the Arrow decoder panicked: {}",
            panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("(no message)")
        )),
    }
}

/// Decodes a segment from bytes. Never panics; a torn or garbled tail ends
/// the scan (`tail_error`) with every frame before it intact. Errors only if
/// the header or the schema frame is unusable, or a frame that passed its
/// checksum does not decode (a different format, not a crash).
pub fn decode_segment(bytes: &[u8], expected: &SchemaRef) -> Result<SegmentScan, String> {
    if bytes.len() < MAGIC.len() && MAGIC.starts_with(bytes) {
        // A crash while the segment was being created.
        return Ok(SegmentScan {
            batches: Vec::new(),
            valid_len: 0,
            tail_error: Some("torn segment header".into()),
        });
    }
    if bytes.len() < MAGIC.len() || &bytes[..MAGIC.len()] != MAGIC {
        return Err("not a segment (bad magic)".into());
    }
    let mut pos = MAGIC.len();
    let mut decoder = StreamDecoder::new();
    let mut batches = Vec::new();
    let mut have_schema = false;
    // A segment written before the turn columns existed: its batches are
    // upgraded to today's schema as they are read.
    let mut legacy = false;
    let mut tail_error = None;
    while pos < bytes.len() {
        let rest = &bytes[pos..];
        if rest.len() < FRAME_HEADER {
            tail_error = Some(format!("torn frame header at byte {pos}"));
            break;
        }
        let len = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
        let crc = u32::from_le_bytes([rest[4], rest[5], rest[6], rest[7]]);
        if len > MAX_FRAME {
            tail_error = Some(format!("frame length {len} at byte {pos} is garbage"));
            break;
        }
        let Some(payload) = rest.get(FRAME_HEADER..FRAME_HEADER + len as usize) else {
            tail_error = Some(format!(
                "torn frame at byte {pos}: {len} bytes announced, {} present",
                rest.len() - FRAME_HEADER
            ));
            break;
        };
        if crc32fast::hash(payload) != crc {
            tail_error = Some(format!("checksum mismatch in frame at byte {pos}"));
            break;
        }
        if !have_schema {
            // The first frame is the schema (its message has no body, which
            // the push decoder only finishes on its next input).
            let schema = guarded(|| {
                arrow::ipc::reader::StreamReader::try_new(payload, None)
                    .map(|r| r.schema())
                    .map_err(|e| e.to_string())
            })
            .map_err(|e| format!("first frame at byte {pos} is not a schema: {e}"))?;
            legacy = expected.fields() == arrow_schema::trajectory_schema().fields()
                && arrow_schema::is_legacy(&schema);
            if schema.fields() != expected.fields() && !legacy {
                return Err(format!(
                    "schema differs from the trajectory schema: {:?}",
                    schema.fields()
                ));
            }
            have_schema = true;
        }
        let first = batches.is_empty() && pos == MAGIC.len();
        let mut buf = Buffer::from(payload.to_vec());
        let decoded = guarded(|| decoder.decode(&mut buf).map_err(|e| e.to_string()))
            .map_err(|e| format!("frame at byte {pos} does not decode: {e}"))?;
        if !buf.is_empty() {
            return Err(format!(
                "frame at byte {pos} holds more than one IPC message"
            ));
        }
        match decoded {
            Some(batch) if legacy => batches.push(
                arrow_schema::upgrade(batch).map_err(|e| format!("frame at byte {pos}: {e}"))?,
            ),
            Some(batch) => batches.push(batch),
            None if !first => {
                return Err(format!("frame at byte {pos} is not a record batch"));
            }
            None => {}
        }
        pos += FRAME_HEADER + len as usize;
    }
    if !have_schema {
        // A crash while the segment was being created (its header is made
        // durable before any batch is appended): nothing in it.
        return Ok(SegmentScan {
            batches: Vec::new(),
            valid_len: 0,
            tail_error: Some(tail_error.unwrap_or_else(|| "no schema frame".into())),
        });
    }
    let valid_len = if tail_error.is_some() {
        pos as u64
    } else {
        bytes.len() as u64
    };
    Ok(SegmentScan {
        batches,
        valid_len,
        tail_error,
    })
}

/// Reads segment `id` from `dir`.
pub fn read_segment(dir: &Path, id: u64, expected: &SchemaRef) -> Result<SegmentScan, BufferError> {
    let path = segment_path(dir, id);
    let mut bytes = Vec::new();
    File::open(&path)
        .and_then(|mut f| f.read_to_end(&mut bytes))
        .map_err(|e| BufferError::io("read segment", &path, e))?;
    decode_segment(&bytes, expected).map_err(|reason| BufferError::Segment {
        path: path.clone(),
        reason,
    })
}

/// Cuts a segment back to `len` bytes (its valid prefix) durably.
pub fn truncate_segment(dir: &Path, id: u64, len: u64) -> Result<(), BufferError> {
    let path = segment_path(dir, id);
    OpenOptions::new()
        .write(true)
        .open(&path)
        .and_then(|f| {
            f.set_len(len)?;
            f.sync_all()
        })
        .map_err(|e| BufferError::io("truncate segment", &path, e))
}

/// Deletes segment `id` durably. A segment already gone is not an error.
pub fn delete_segment(dir: &Path, id: u64) -> Result<(), BufferError> {
    let path = segment_path(dir, id);
    match fs::remove_file(&path) {
        Ok(()) => sync_dir(dir),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(BufferError::io("delete segment", &path, e)),
    }
}

/// Total bytes of the segments in `dir`.
pub fn disk_bytes(dir: &Path) -> u64 {
    list_segments(dir)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|id| fs::metadata(segment_path(dir, id)).ok())
        .map(|m| m.len())
        .sum()
}

#[cfg(test)]
mod tests {
    use asyncrl_protos::arrow_schema::{to_record_batch, trajectory_schema};

    use super::*;
    use crate::testing::traj;

    fn batch(from: u32, n: u32) -> RecordBatch {
        let trajs: Vec<_> = (from..from + n).map(|i| traj(i, 4, 0, 16)).collect();
        to_record_batch(&trajs).unwrap()
    }

    fn write(dir: &Path, compression: SegmentCompression, batches: &[RecordBatch]) -> Vec<u64> {
        let schema = trajectory_schema();
        let mut w =
            SegmentWriter::create(dir, 7, &schema, compression, FsyncPolicy::Always).unwrap();
        let mut ends = vec![w.bytes()];
        for b in batches {
            w.append(b).unwrap();
            ends.push(w.bytes());
        }
        ends
    }

    #[test]
    fn round_trip_plain_and_zstd() {
        for compression in [SegmentCompression::None, SegmentCompression::Zstd] {
            let dir = tempfile::tempdir().unwrap();
            let batches = vec![batch(0, 3), batch(3, 5), batch(8, 1)];
            write(dir.path(), compression, &batches);
            assert_eq!(list_segments(dir.path()).unwrap(), vec![7]);
            let scan = read_segment(dir.path(), 7, &trajectory_schema()).unwrap();
            assert_eq!(scan.tail_error, None);
            assert_eq!(scan.batches, batches);
        }
    }

    #[test]
    fn a_segment_written_before_the_turn_columns_reads_as_single_turn_rows() {
        let dir = tempfile::tempdir().unwrap();
        let legacy_columns: Vec<usize> = (0..arrow_schema::LEGACY_COLUMNS).collect();
        let old = batch(0, 3).project(&legacy_columns).unwrap();
        let mut w = SegmentWriter::create(
            dir.path(),
            7,
            &old.schema(),
            SegmentCompression::None,
            FsyncPolicy::Always,
        )
        .unwrap();
        w.append(&old).unwrap();
        let scan = read_segment(dir.path(), 7, &trajectory_schema()).unwrap();
        assert_eq!(scan.tail_error, None);
        assert_eq!(scan.batches, vec![batch(0, 3)]);
    }

    #[test]
    fn stripped_frames_are_a_plain_arrow_ipc_stream() {
        let dir = tempfile::tempdir().unwrap();
        let batches = vec![batch(0, 2), batch(2, 2)];
        write(dir.path(), SegmentCompression::None, &batches);
        let bytes = fs::read(segment_path(dir.path(), 7)).unwrap();
        let mut stream = Vec::new();
        let mut pos = MAGIC.len();
        while pos < bytes.len() {
            let len = u32::from_le_bytes(bytes[pos..pos + 4].try_into().unwrap()) as usize;
            stream.extend_from_slice(&bytes[pos + 8..pos + 8 + len]);
            pos += 8 + len;
        }
        let reader =
            arrow::ipc::reader::StreamReader::try_new(std::io::Cursor::new(stream), None).unwrap();
        let back: Vec<RecordBatch> = reader.map(|b| b.unwrap()).collect();
        assert_eq!(back, batches);
    }

    #[test]
    fn every_torn_tail_keeps_the_complete_frames() {
        let dir = tempfile::tempdir().unwrap();
        let batches = vec![batch(0, 2), batch(2, 3), batch(5, 2)];
        let ends = write(dir.path(), SegmentCompression::None, &batches);
        let bytes = fs::read(segment_path(dir.path(), 7)).unwrap();
        let schema = trajectory_schema();
        // Cut the file at every byte past the schema frame: the scan returns
        // exactly the frames that end at or before the cut.
        for cut in ends[0] as usize..=bytes.len() {
            let scan = decode_segment(&bytes[..cut], &schema).unwrap();
            let complete = ends.iter().skip(1).filter(|e| **e as usize <= cut).count();
            assert_eq!(scan.batches.len(), complete, "cut at {cut}");
            assert_eq!(scan.batches[..], batches[..complete]);
            assert_eq!(scan.valid_len, ends[complete], "cut at {cut}");
            assert_eq!(scan.tail_error.is_some(), cut != ends[complete] as usize);
        }
    }

    #[test]
    fn garbled_frame_ends_the_scan_before_it() {
        let dir = tempfile::tempdir().unwrap();
        let batches = vec![batch(0, 2), batch(2, 3)];
        let ends = write(dir.path(), SegmentCompression::None, &batches);
        let mut bytes = fs::read(segment_path(dir.path(), 7)).unwrap();
        // Flip one byte inside the second batch's payload.
        let at = ends[1] as usize + 40;
        bytes[at] ^= 0x55;
        let scan = decode_segment(&bytes, &trajectory_schema()).unwrap();
        assert_eq!(scan.batches, batches[..1]);
        assert_eq!(scan.valid_len, ends[1]);
        assert!(
            scan.tail_error.as_deref().unwrap().contains("checksum"),
            "{scan:?}"
        );
    }

    #[test]
    fn truncate_and_append_continue_cleanly() {
        let dir = tempfile::tempdir().unwrap();
        let ends = write(dir.path(), SegmentCompression::None, &[batch(0, 2)]);
        let path = segment_path(dir.path(), 7);
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(&[1, 2, 3, 4, 5]).unwrap();
        let scan = read_segment(dir.path(), 7, &trajectory_schema()).unwrap();
        assert!(scan.tail_error.is_some());
        truncate_segment(dir.path(), 7, scan.valid_len).unwrap();
        assert_eq!(fs::metadata(&path).unwrap().len(), ends[1]);
        let scan = read_segment(dir.path(), 7, &trajectory_schema()).unwrap();
        assert_eq!(scan.tail_error, None);
        assert_eq!(scan.batches.len(), 1);
        delete_segment(dir.path(), 7).unwrap();
        delete_segment(dir.path(), 7).unwrap();
        assert!(list_segments(dir.path()).unwrap().is_empty());
    }

    #[test]
    fn wrong_schema_and_bad_magic_are_errors() {
        let schema = trajectory_schema();
        assert!(decode_segment(b"nope", &schema).is_err());
        assert!(decode_segment(b"ASRLSEG\x02xxxx", &schema).is_err());
        // A crash while creating a segment leaves nothing valid, not an error.
        for torn in [
            &MAGIC[..3],
            &MAGIC[..],
            &[MAGIC.as_slice(), &[9, 0, 0]].concat(),
        ] {
            let scan = decode_segment(torn, &schema).unwrap();
            assert_eq!(scan.valid_len, 0);
            assert!(scan.batches.is_empty() && scan.tail_error.is_some());
        }
        let dir = tempfile::tempdir().unwrap();
        let other = std::sync::Arc::new(arrow::datatypes::Schema::new(vec![
            arrow::datatypes::Field::new("x", arrow::datatypes::DataType::Int32, false),
        ]));
        SegmentWriter::create(
            dir.path(),
            1,
            &other,
            SegmentCompression::None,
            FsyncPolicy::Never,
        )
        .unwrap();
        let err = read_segment(dir.path(), 1, &schema).unwrap_err();
        assert!(err.to_string().contains("schema"), "{err}");
    }

    /// A valid two-batch segment's bytes and its batches (built once).
    fn sample() -> &'static (Vec<u8>, Vec<RecordBatch>) {
        static SAMPLE: std::sync::OnceLock<(Vec<u8>, Vec<RecordBatch>)> =
            std::sync::OnceLock::new();
        SAMPLE.get_or_init(|| {
            let dir = tempfile::tempdir().unwrap();
            let batches = vec![batch(0, 2), batch(2, 1)];
            write(dir.path(), SegmentCompression::None, &batches);
            (fs::read(segment_path(dir.path(), 7)).unwrap(), batches)
        })
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]
        /// Random bytes, with or without a valid magic, never panic the reader.
        #[test]
        fn random_bytes_never_panic(
            magic in proptest::bool::ANY,
            bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..2048),
        ) {
            let mut input = if magic { MAGIC.to_vec() } else { Vec::new() };
            input.extend_from_slice(&bytes);
            let _ = decode_segment(&input, &trajectory_schema());
        }

        /// Random payloads in frames with valid checksums reach the Arrow
        /// decoder (as the schema frame, or after a valid schema frame, or as
        /// a mutated real batch message): no panic.
        #[test]
        fn random_checksummed_frames_never_panic(
            payload in proptest::collection::vec(proptest::num::u8::ANY, 0..1024),
            edits in proptest::collection::vec((proptest::num::usize::ANY, proptest::num::u8::ANY), 1..6),
        ) {
            let schema = trajectory_schema();
            let _ = decode_segment(&[MAGIC.as_slice(), &frame(&payload)].concat(), &schema);
            let bytes = &sample().0;
            let schema_len = u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize;
            let head = &bytes[..8 + 8 + schema_len];
            let _ = decode_segment(&[head, &frame(&payload)].concat(), &schema);
            // The real batch message with a few bytes changed, re-checksummed.
            let first_len =
                u32::from_le_bytes(bytes[head.len()..head.len() + 4].try_into().unwrap()) as usize;
            let mut msg = bytes[head.len() + 8..head.len() + 8 + first_len].to_vec();
            for (at, b) in edits {
                let at = at % msg.len();
                msg[at] = b;
            }
            let _ = decode_segment(&[head, &frame(&msg)].concat(), &schema);
            // And a mutated schema message.
            let mut schema_msg = head[16..].to_vec();
            let at = payload.len() % schema_msg.len();
            schema_msg[at] ^= 0xff;
            let _ = decode_segment(&[MAGIC.as_slice(), &frame(&schema_msg)].concat(), &schema);
        }

        /// A valid segment with random bytes overwritten or appended never
        /// panics the reader, and every batch it returns is one that was written.
        #[test]
        fn mutated_segments_never_panic(
            edits in proptest::collection::vec((proptest::num::usize::ANY, proptest::num::u8::ANY), 0..8),
            append in proptest::collection::vec(proptest::num::u8::ANY, 0..64),
        ) {
            let (bytes, batches) = sample();
            let mut bytes = bytes.clone();
            for (at, b) in edits {
                let at = at % bytes.len();
                bytes[at] = b;
            }
            bytes.extend_from_slice(&append);
            if let Ok(scan) = decode_segment(&bytes, &trajectory_schema()) {
                for b in &scan.batches {
                    proptest::prop_assert!(batches.contains(b));
                }
            }
        }
    }
}
