//! Helpers shared by every asyncrl crate, written once: wall-clock time and
//! an injectable [`Clock`], exponential [`Backoff`], [`sha256_hex`],
//! signal handling and the one-line error of a process ([`process`]), and
//! the torn-tail rule of append-only line files ([`linelog`]).
//!
//! Nothing here knows about the wire contract, the bus or tensors.

pub mod backoff;
pub mod clock;
pub mod linelog;
pub mod process;

pub use backoff::Backoff;
pub use clock::{Clock, SharedClock, SystemClock, TokioClock, unix_ms};

/// The sha256 of `data`.
pub fn sha256(data: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(data).into()
}

/// Lower-case hex sha256 of `data`.
pub fn sha256_hex(data: &[u8]) -> String {
    hex::encode(sha256(data))
}

/// Lower-case hex sha256 and size of the file at `path`, read in 8 MiB
/// pieces (a multi-GB weights shard is never held whole).
pub fn sha256_hex_of_file(path: &std::path::Path) -> std::io::Result<(String, u64)> {
    use sha2::Digest;
    use std::io::Read as _;
    let mut file = std::fs::File::open(path)?;
    let mut hasher = sha2::Sha256::new();
    let mut buf = vec![0u8; 8 << 20];
    let mut size = 0u64;
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        size += n as u64;
    }
    Ok((hex::encode(hasher.finalize()), size))
}

/// Bytes of the files under `dir`, recursively (0 when it does not exist;
/// entries that vanish during the walk are skipped). For reports of what a
/// store holds on disk, not for accounting that must be exact.
pub fn dir_bytes(dir: &std::path::Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(ft) if ft.is_dir() => dir_bytes(&e.path()),
            Ok(ft) if ft.is_file() => e.metadata().map_or(0, |m| m.len()),
            _ => 0,
        })
        .sum()
}

#[cfg(test)]
mod tests {
    #[test]
    fn sha256_of_a_file_is_the_sha256_of_its_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        // Across the 8 MiB read size.
        let data: Vec<u8> = (0..(9u32 << 20)).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let (hex, size) = super::sha256_hex_of_file(&path).unwrap();
        assert_eq!((hex, size), (super::sha256_hex(&data), data.len() as u64));
    }

    #[test]
    fn sha256_of_known_input() {
        assert_eq!(
            super::sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
