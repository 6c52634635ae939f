//! Prefix sharing: the layout of a forward pass in which the rows of a
//! group (completions of one prompt) share the tokens they have in common.
//!
//! A group's G rows start with the same prompt (and often the same first
//! completion tokens). Packed or padded, each row recomputes that prefix:
//! on the main job a prompt of about 6 tokens and a completion of about 3,
//! so two thirds of the positions are the same prompt again. Here a group
//! becomes a *unit*: its common prefix once, then each row's own tokens
//! after it. Each row's tokens attend to the prefix and to their own
//! earlier tokens, with positions continuing the prefix's, so every token
//! gets exactly the hidden state of the unpacked forward of its own row
//! ([`asyncrl_policy::Policy::forward_shared`]). The prefix's hidden states
//! feed every row of the unit, so the backward pass sums the rows'
//! gradients through them, as the per-row computation does: the loss and
//! gradients are the padded ones up to float rounding (the same
//! computation as "Prefix Grouper", Liu et al. 2025, arXiv:2506.05433).
//!
//! A unit is at most [`SHARED_SPAN`] times the packed lane width: a group
//! too long for that is split into several units, each with its own copy of
//! the prefix, so that attention (a lane costs its width squared) stays
//! bounded. Units are then packed into lanes first-fit decreasing, like
//! rows are in plain packing.
//!
//! This module only plans (host integers); [`crate::batch`] turns a plan
//! into tensors.

use std::collections::HashMap;

use crate::batch::first_fit_decreasing;

/// A unit is at most this many packed lane widths wide (a group longer
/// than that is split into several units, each repeating the prefix).
pub const SHARED_SPAN: i64 = 4;

/// The plan of one shared-prefix forward pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedPlan {
    /// Lane width.
    pub width: i64,
    /// Number of lanes.
    pub lanes: i64,
    /// Per lane position (`lanes × width`, row-major): the row and the
    /// position in that row whose token it holds; `None` is padding.
    pub source: Vec<Option<(usize, i64)>>,
    /// Per lane position: the token's position in its own row.
    pub positions: Vec<i64>,
    /// Per lane position: its part of the lane (1, 2, ...; 0 = padding).
    pub segments: Vec<i64>,
    /// Per lane position: the segment of the prefix its part continues, 0
    /// for a prefix or an unshared row.
    pub parents: Vec<i64>,
    /// Per row: where in the flattened lanes its position `q` lies:
    /// `prefix_at + q` below `shared`, `own_at + q` from `shared` on.
    pub rows: Vec<RowPlace>,
}

/// Where a row's tokens lie in a [`SharedPlan`]'s flattened lanes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RowPlace {
    /// Tokens of the row laid out once for its unit (0: none).
    pub shared: i64,
    /// Flat index of the row's position 0 (in its unit's prefix).
    pub prefix_at: i64,
    /// Flat index of the row's position `shared`, minus `shared`.
    pub own_at: i64,
}

impl RowPlace {
    /// Flat lane index of the row's position `q`.
    pub fn at(&self, q: i64) -> i64 {
        if q < self.shared {
            self.prefix_at + q
        } else {
            self.own_at + q
        }
    }
}

/// The length of the longest prefix every one of `rows` starts with.
pub fn common_prefix<'a>(mut rows: impl Iterator<Item = &'a [i64]>) -> usize {
    let Some(first) = rows.next() else {
        return 0;
    };
    rows.fold(first.len(), |n, r| {
        n.min(r.iter().zip(first).take_while(|(a, b)| a == b).count())
    })
}

/// Plans the lanes of rows with `lengths`, each sharing its first
/// `shared[i]` tokens with every row of the same `groups[i]` (the same
/// key and the same `shared`), in lanes at least `base_width` wide (the
/// packed width: the longest row, or more) and at most `max_width` unless
/// the longest row is wider.
pub fn plan(
    lengths: &[i64],
    shared: &[i64],
    groups: &[String],
    base_width: i64,
    max_width: i64,
) -> SharedPlan {
    // Units: (prefix length, rows), in first-seen order.
    let mut units: Vec<(i64, Vec<usize>)> = Vec::new();
    let mut by_key: HashMap<(&str, i64), Vec<usize>> = HashMap::new();
    let mut keys: Vec<(&str, i64)> = Vec::new();
    for (i, (g, s)) in groups.iter().zip(shared).enumerate() {
        let key = (g.as_str(), (*s).clamp(0, lengths[i]));
        by_key
            .entry(key)
            .or_insert_with(|| {
                keys.push(key);
                Vec::new()
            })
            .push(i);
    }
    let longest_row = lengths.iter().copied().max().unwrap_or(1).max(1);
    let cap = (base_width.saturating_mul(SHARED_SPAN))
        .min(max_width)
        .max(base_width)
        .max(longest_row);
    let mut widest = base_width.max(longest_row);
    for key in keys {
        let members = &by_key[&key];
        let s = key.1;
        if s == 0 || members.len() < 2 {
            units.extend(members.iter().map(|r| (0, vec![*r])));
            continue;
        }
        // Longest own part first; a new unit (with the prefix again) when
        // the next row would take this one past the cap.
        let mut order = members.clone();
        order.sort_by_key(|r| std::cmp::Reverse(lengths[*r]));
        let mut current: Vec<usize> = Vec::new();
        let mut fill = s;
        for r in order {
            let own = lengths[r] - s;
            if !current.is_empty() && fill + own > cap {
                units.push((s, std::mem::take(&mut current)));
                fill = s;
            }
            current.push(r);
            fill += own;
            widest = widest.max(fill);
        }
        units.push((s, current));
    }
    let unit_len = |(s, rows): &(i64, Vec<usize>)| -> i64 {
        if *s == 0 {
            rows.iter().map(|r| lengths[*r]).sum()
        } else {
            s + rows.iter().map(|r| lengths[*r] - s).sum::<i64>()
        }
    };
    let width = widest.min(cap).max(base_width).max(2);
    let unit_lengths: Vec<i64> = units.iter().map(unit_len).collect();
    let lanes = first_fit_decreasing(&unit_lengths, width);
    let total = lanes.len() * width as usize;
    let mut p = SharedPlan {
        width,
        lanes: lanes.len() as i64,
        source: vec![None; total],
        positions: vec![0; total],
        segments: vec![0; total],
        parents: vec![0; total],
        rows: vec![RowPlace::default(); lengths.len()],
    };
    for (lane, members) in lanes.iter().enumerate() {
        let mut w = LaneWriter {
            at: lane as i64 * width,
            segment: 0,
        };
        for u in members {
            let (s, rows) = &units[*u as usize];
            if *s == 0 {
                for r in rows {
                    let start = w.at;
                    w.lay(&mut p, *r, 0..lengths[*r], 0);
                    p.rows[*r] = RowPlace {
                        shared: 0,
                        prefix_at: start,
                        own_at: start,
                    };
                }
                continue;
            }
            let prefix_at = w.at;
            let prefix = w.lay(&mut p, rows[0], 0..*s, 0);
            for r in rows {
                let own_at = w.at - s;
                w.lay(&mut p, *r, *s..lengths[*r], prefix);
                p.rows[*r] = RowPlace {
                    shared: *s,
                    prefix_at,
                    own_at,
                };
            }
        }
    }
    p
}

/// Lays parts of rows one after the other into a lane.
struct LaneWriter {
    /// The next flat index.
    at: i64,
    /// The last segment id given in this lane.
    segment: i64,
}

impl LaneWriter {
    /// Lays positions `span` of `row` as a new segment continuing `parent`
    /// (0: none); returns the segment's id.
    fn lay(
        &mut self,
        p: &mut SharedPlan,
        row: usize,
        span: std::ops::Range<i64>,
        parent: i64,
    ) -> i64 {
        self.segment += 1;
        for q in span {
            let k = self.at as usize;
            p.source[k] = Some((row, q));
            p.positions[k] = q;
            p.segments[k] = self.segment;
            p.parents[k] = parent;
            self.at += 1;
        }
        self.segment
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(g: &[&str]) -> Vec<String> {
        g.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn common_prefixes() {
        let rows: [&[i64]; 3] = [&[1, 2, 3, 4], &[1, 2, 3], &[1, 2, 5]];
        assert_eq!(common_prefix(rows.into_iter()), 2);
        assert_eq!(common_prefix([&[1i64, 2][..]].into_iter()), 2);
        assert_eq!(common_prefix(std::iter::empty()), 0);
        let rows: [&[i64]; 2] = [&[7, 2], &[1, 2]];
        assert_eq!(common_prefix(rows.into_iter()), 0);
    }

    #[test]
    fn a_group_lays_its_prefix_once() {
        // Group g: rows 0 and 2 share 3 tokens; row 1 is alone.
        let p = plan(&[5, 4, 4], &[3, 0, 3], &keys(&["g", "h", "g"]), 5, i64::MAX);
        // Unit g: 3 + 2 + 1 = 6 positions, so lanes of 6; row 1 its own.
        assert_eq!((p.width, p.lanes), (6, 2));
        let src: Vec<Option<(usize, i64)>> = p.source[..6].to_vec();
        assert_eq!(
            src,
            [
                Some((0, 0)),
                Some((0, 1)),
                Some((0, 2)),
                Some((0, 3)),
                Some((0, 4)),
                Some((2, 3))
            ]
        );
        assert_eq!(p.positions[..6], [0, 1, 2, 3, 4, 3]);
        assert_eq!(p.segments[..6], [1, 1, 1, 2, 2, 3]);
        assert_eq!(p.parents[..6], [0, 0, 0, 1, 1, 1]);
        // Row 2's position 1 is the prefix's, its position 3 lane 0's 5.
        assert_eq!(p.rows[2].at(1), 1);
        assert_eq!(p.rows[2].at(3), 5);
        assert_eq!(p.rows[0].at(4), 4);
        // Row 1 in lane 1, unshared.
        assert_eq!(p.rows[1].at(0), 6);
        assert_eq!(p.segments[6..], [1, 1, 1, 1, 0, 0]);
        assert_eq!(p.parents[6..], [0; 6]);
    }

    #[test]
    fn a_long_group_splits_into_units_that_repeat_the_prefix() {
        // Four rows of 10 sharing 6: one unit would be 6 + 4 × 4 = 22; the
        // cap (2 × the base width 10, as max_width) is 20, so two units of
        // 6 + 3 × 4 = 18 and 6 + 4 = 10.
        let p = plan(&[10; 4], &[6; 4], &keys(&["g"; 4]), 10, 20);
        assert_eq!(p.width, 18);
        assert_eq!(p.lanes, 2);
        let prefixes = p
            .source
            .iter()
            .zip(&p.parents)
            .filter(|(s, parent)| matches!(s, Some((_, q)) if *q < 6) && **parent == 0)
            .count();
        assert_eq!(prefixes, 12, "the prefix twice");
        // Every row position is laid out, exactly once for its own part.
        for r in 0..4 {
            for q in 6..10 {
                let k = p.rows[r].at(q) as usize;
                assert_eq!(p.source[k], Some((r, q)));
            }
            for q in 0..6 {
                let k = p.rows[r].at(q) as usize;
                assert_eq!(p.source[k].map(|(_, q)| q), Some(q));
            }
        }
    }

    #[test]
    fn whole_rows_can_be_the_prefix() {
        // Identical rows: the prefix is all of them, their own parts empty.
        let p = plan(&[4, 4, 4], &[4, 4, 4], &keys(&["g"; 3]), 4, i64::MAX);
        assert_eq!((p.width, p.lanes), (4, 1));
        for r in 0..3 {
            assert_eq!(p.rows[r].at(3), 3);
        }
    }
}
