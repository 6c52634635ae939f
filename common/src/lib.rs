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
    fn sha256_of_known_input() {
        assert_eq!(
            super::sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
