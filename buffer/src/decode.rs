//! A fast decoder of `Trajectory` messages for ingest.
//!
//! prost decodes the packed token columns one varint at a time into vectors
//! that grow as they go; for a 1 k-token trajectory that is most of the
//! buffer's ingest CPU. [`decode`] reads the same wire format with the
//! columns sized up front. It covers the messages that workers send (packed
//! repeated fields, known wire types); anything else — malformed bytes,
//! unpacked repeated fields, groups — is left to prost, so a message decodes
//! to the same trajectory, or fails with the same error, either way
//! (`decode_is_prost` in the tests checks that on arbitrary bytes).

use asyncrl_protos::{ContractError, Message, Trajectory, decode_trajectory};

/// Decodes and validates a trajectory, as
/// [`asyncrl_protos::decode_trajectory`] does.
pub fn decode(bytes: &[u8]) -> Result<Trajectory, ContractError> {
    match fast(bytes) {
        Some(t) => {
            t.validate()?;
            Ok(t)
        }
        None => decode_trajectory(bytes),
    }
}

/// The trajectory, or `None` where prost should decide.
fn fast(bytes: &[u8]) -> Option<Trajectory> {
    let mut t = Trajectory::default();
    let mut r = Reader { b: bytes };
    while !r.b.is_empty() {
        let key = r.varint()?;
        if key > u64::from(u32::MAX) {
            return None;
        }
        let (field, wire) = (key >> 3, key & 7);
        match (field, wire) {
            (1, 2) => t.uuid = r.string()?,
            (2, 2) => t.task_id = r.string()?,
            (3, 2) => t.group_id = r.string()?,
            (4, 2) => r.packed_i32(&mut t.prompt_token_ids)?,
            (5, 2) => r.packed_i32(&mut t.completion_token_ids)?,
            (6, 2) => {
                let b = r.bytes()?;
                if b.len() % 4 != 0 {
                    return None;
                }
                t.behaviour_logprobs.reserve(b.len() / 4);
                t.behaviour_logprobs.extend(
                    b.chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                );
            }
            (7, 2) => r.packed_i32(&mut t.policy_versions)?,
            (8, 5) => t.reward = f32::from_le_bytes(r.fixed32()?),
            (9, 0) => t.reward_status = r.varint()? as i32,
            (10, 0) => t.finish_reason = r.varint()? as i32,
            (11, 2) => t.worker_id = r.string()?,
            (12, 2) => {
                let b = r.bytes()?;
                t.timings
                    .get_or_insert_with(Default::default)
                    .merge(b)
                    .ok()?;
            }
            (13, 0) => t.group_size = r.varint()? as u32,
            (14, 0) => t.index_in_group = r.varint()? as u32,
            (15, 0) => t.admission_version = r.varint()? as i32,
            (1..=15, _) | (0, _) => return None,
            // Unknown fields are skipped, as prost does.
            (_, 0) => {
                r.varint()?;
            }
            (_, 1) => {
                r.take(8)?;
            }
            (_, 2) => {
                r.bytes()?;
            }
            (_, 5) => {
                r.take(4)?;
            }
            _ => return None,
        }
    }
    Some(t)
}

struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.b.len() {
            return None;
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Some(head)
    }

    fn varint(&mut self) -> Option<u64> {
        let (v, n) = varint(self.b)?;
        self.b = &self.b[n..];
        Some(v)
    }

    fn fixed32(&mut self) -> Option<[u8; 4]> {
        self.take(4)?.try_into().ok()
    }

    fn bytes(&mut self) -> Option<&'a [u8]> {
        let len = usize::try_from(self.varint()?).ok()?;
        self.take(len)
    }

    fn string(&mut self) -> Option<String> {
        std::str::from_utf8(self.bytes()?).ok().map(str::to_owned)
    }

    /// A packed run of int32 varints, appended to `out`.
    fn packed_i32(&mut self, out: &mut Vec<i32>) -> Option<()> {
        let mut b = self.bytes()?;
        // One value ends at every byte without the continuation bit.
        out.reserve(b.iter().filter(|x| **x < 0x80).count());
        while let Some(&first) = b.first() {
            if first < 0x80 {
                out.push(i32::from(first));
                b = &b[1..];
            } else {
                let (v, n) = varint(b)?;
                out.push(v as i32);
                b = &b[n..];
            }
        }
        Some(())
    }
}

/// A varint at the start of `b` and its length in bytes; `None` when it is
/// cut off or longer than ten bytes (prost's limits).
fn varint(b: &[u8]) -> Option<(u64, usize)> {
    let mut v = 0u64;
    for (i, &byte) in b.iter().take(10).enumerate() {
        v |= u64::from(byte & 0x7f) << (7 * i);
        if byte < 0x80 {
            // The tenth byte may carry only the top bit of a u64.
            if i == 9 && byte > 1 {
                return None;
            }
            return Some((v, i + 1));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::testing::traj;
    use asyncrl_protos::v1::Timings;

    /// Same result as prost (+ validation): the same trajectory, or an
    /// error with the same text.
    fn same(bytes: &[u8]) {
        match (decode(bytes), decode_trajectory(bytes)) {
            // Compared as bytes: NaN floats are not equal to themselves.
            (Ok(a), Ok(b)) => assert_eq!(a.encode_to_vec(), b.encode_to_vec()),
            (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
            (a, b) => panic!("fast {a:?} but prost {b:?}"),
        }
    }

    fn any_traj() -> impl Strategy<Value = Trajectory> {
        (
            any::<u32>(),
            prop::collection::vec(any::<i32>(), 0..40),
            prop::collection::vec(any::<i32>(), 0..40),
            prop::collection::vec(any::<f32>(), 0..40),
            any::<(i32, i32, u32, u32, i32, f32)>(),
            any::<Option<(i64, u32)>>(),
        )
            .prop_map(|(i, prompt, completion, lps, s, timings)| {
                let mut t = traj(i, 4, 0, 0);
                t.prompt_token_ids = prompt;
                t.completion_token_ids = completion;
                t.behaviour_logprobs = lps;
                t.policy_versions = (0..t.completion_token_ids.len() as i32).collect();
                (
                    t.reward_status,
                    t.finish_reason,
                    t.group_size,
                    t.index_in_group,
                    t.admission_version,
                    t.reward,
                ) = s;
                t.timings = timings.map(|(ms, n)| Timings {
                    started_at_unix_ms: ms,
                    generation_ms: n,
                    ..Default::default()
                });
                t
            })
    }

    #[test]
    fn a_worker_trajectory_decodes_the_fast_way_to_what_prost_gives() {
        let t = traj(7, 8, 3, 1024);
        let bytes = t.encode_to_vec();
        assert_eq!(fast(&bytes).as_ref(), Some(&t));
        assert_eq!(decode(&bytes).unwrap(), t);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

        /// Any trajectory, and any corruption of one (a flipped byte, a cut,
        /// bytes appended), decodes as prost decodes it.
        #[test]
        fn decode_is_prost(t in any_traj(), at in any::<prop::sample::Index>(), x in 1u8.., tail in prop::collection::vec(any::<u8>(), 0..16)) {
            let bytes = t.encode_to_vec();
            same(&bytes);
            let i = at.index(bytes.len());
            let mut flipped = bytes.clone();
            flipped[i] ^= x;
            same(&flipped);
            same(&bytes[..i]);
            let mut longer = bytes.clone();
            longer.extend_from_slice(&tail);
            same(&longer);
        }

        /// Arbitrary bytes decode (or fail) as prost decodes them.
        #[test]
        fn arbitrary_bytes_decode_as_prost_does(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            same(&bytes);
        }
    }
}
