//! Append-only files of one record per line (the learner's CSV and
//! trained.jsonl, the coordinator's knob journal, the buffer's served log),
//! with one rule for a crash in the middle of a write:
//!
//! **the torn-tail rule**: when such a file is opened, everything after the
//! last whole line is cut off (and logged), so that the next record starts a
//! line of its own and a reader never sees half a record. A log whose lines
//! can be checked (a checksum) may cut earlier, at its first invalid line.
//!
//! Writers write each record with one `write` call of a whole line.

use std::fs::{File, OpenOptions};
use std::io::{Read as _, Seek as _, SeekFrom};
use std::path::Path;

/// The length of the prefix of `bytes` that ends with a newline (0 if none).
pub fn whole_lines_len(bytes: &[u8]) -> usize {
    bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1)
}

/// Opens (or creates) `path` for appending, cutting off a torn last line.
/// Reads only the file's tail, so it is cheap on a long log.
pub fn open(path: &Path) -> std::io::Result<File> {
    let mut file = open_rw(path)?;
    let len = file.metadata()?.len();
    let keep = whole_lines_end(&mut file, len)?;
    cut(path, &file, len, keep)?;
    Ok(file)
}

/// Opens (or creates) `path` for appending and returns the file and the
/// bytes it keeps: the prefix `valid(bytes)` says is valid, never more than
/// the whole lines. The rest is cut off (synced) before the first append.
pub fn open_checked(
    path: &Path,
    valid: impl FnOnce(&[u8]) -> usize,
) -> std::io::Result<(File, Vec<u8>)> {
    let mut file = open_rw(path)?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)?;
    let keep = valid(&bytes).min(whole_lines_len(&bytes));
    cut(path, &file, bytes.len() as u64, keep as u64)?;
    bytes.truncate(keep);
    Ok((file, bytes))
}

fn open_rw(path: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .create(true)
        .read(true)
        .append(true)
        .open(path)
}

fn cut(path: &Path, file: &File, len: u64, keep: u64) -> std::io::Result<()> {
    if keep < len {
        tracing::warn!(
            file = %path.display(),
            dropped_bytes = len - keep,
            "cutting off a tail torn by a crash mid-write"
        );
        file.set_len(keep)?;
        file.sync_all()?;
    }
    Ok(())
}

/// The end of the last whole line of `file` (of `len` bytes), scanning back
/// from the end.
fn whole_lines_end(file: &mut File, len: u64) -> std::io::Result<u64> {
    let mut buf = vec![0u8; 8192];
    let mut end = len;
    while end > 0 {
        let start = end.saturating_sub(buf.len() as u64);
        let chunk = &mut buf[..(end - start) as usize];
        file.seek(SeekFrom::Start(start))?;
        file.read_exact(chunk)?;
        if let Some(i) = chunk.iter().rposition(|&b| b == b'\n') {
            return Ok(start + i as u64 + 1);
        }
        end = start;
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use super::*;

    /// Opens `before` both ways, appends a line, and checks what is kept.
    fn check(before: &[u8], valid: fn(&[u8]) -> usize, kept: &[u8], kept_checked: &[u8]) {
        let dir = tempfile::tempdir().unwrap();
        for (checked, want_kept) in [(false, kept), (true, kept_checked)] {
            let path = dir.path().join(format!("log-{checked}"));
            std::fs::write(&path, before).unwrap();
            let mut file = if checked {
                let (file, got) = open_checked(&path, valid).unwrap();
                assert_eq!(got, want_kept, "{:?}", String::from_utf8_lossy(before));
                file
            } else {
                open(&path).unwrap()
            };
            file.write_all(b"next\n").unwrap();
            let mut want = want_kept.to_vec();
            want.extend_from_slice(b"next\n");
            assert_eq!(std::fs::read(&path).unwrap(), want, "checked: {checked}");
        }
    }

    #[test]
    fn a_torn_last_line_is_cut_off_before_appending() {
        let all = |b: &[u8]| b.len();
        check(b"", all, b"", b"");
        check(b"a\nb\n", all, b"a\nb\n", b"a\nb\n");
        check(b"a\nb\nhalf", all, b"a\nb\n", b"a\nb\n");
        check(b"half", all, b"", b"");
        // A checked log also cuts at its first invalid line.
        check(b"a\nBAD\nc\n", |_| 2, b"a\nBAD\nc\n", b"a\n");
        // A tail longer than one read chunk.
        let long = [vec![b'x'; 20_000], b"\n".to_vec(), vec![b'y'; 20_000]].concat();
        check(&long, all, &long[..20_001], &long[..20_001]);
    }

    #[test]
    fn a_missing_file_is_created() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("new.jsonl");
        drop(open(&path).unwrap());
        assert!(path.exists());
        assert_eq!(whole_lines_len(b"x\ny"), 2);
    }
}
