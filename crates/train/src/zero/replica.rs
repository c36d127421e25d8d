//! ZeRO-1 over the data-parallel replicas of a model-parallel engine (a pipeline stage, a
//! tensor-parallel rank; 000 §2.20: ZeRO composes with PP and TP along the DP axis): each
//! replica keeps AdamW's moments for one contiguous part of a flat range, steps only that part
//! after the gradients are summed and clipped, and the parts are all-gathered back into every
//! replica's parameters. AdamW is elementwise, so the parameters are bit-identical to the
//! unsharded update; the optimizer state per rank is `1/d` of it.
use std::ops::Range;

use comm::group::ProcessGroup;

use crate::error::Result;

/// Part `j` of `range` cut into `d` contiguous parts: `start + j L / d .. start + (j + 1) L / d`
/// for `L = range.len()`.
pub fn replica_part(range: &Range<usize>, d: usize, j: usize) -> Range<usize> {
    let cut = |i: usize| range.start + i * range.len() / d.max(1);
    cut(j)..cut(j + 1)
}

/// The overlap of `a` and `b`, if not empty.
pub fn intersect(a: &Range<usize>, b: &Range<usize>) -> Option<Range<usize>> {
    let r = a.start.max(b.start)..a.end.min(b.end);
    (r.start < r.end).then_some(r)
}

/// `r` without the parts covered by `cuts`, in ascending order.
pub fn minus(r: &Range<usize>, cuts: &[Range<usize>]) -> Vec<Range<usize>> {
    let mut sorted: Vec<&Range<usize>> = cuts.iter().filter(|c| !c.is_empty()).collect();
    sorted.sort_by_key(|c| c.start);
    let (mut out, mut at) = (Vec::new(), r.start);
    for c in sorted {
        if c.end <= at || c.start >= r.end {
            continue;
        }
        if c.start > at {
            out.push(at..c.start);
        }
        at = at.max(c.end);
    }
    if at < r.end {
        out.push(at..r.end);
    }
    out
}

/// Replica `j`'s part of a flat range under ZeRO-1 over `d` replicas.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicaShard {
    /// The whole range in the flat buffers.
    pub range: Range<usize>,
    /// This replica's part of it.
    pub shard: Range<usize>,
    /// Every replica's part length, in replica order (empty when `d = 1`).
    pub counts: Vec<usize>,
}

impl ReplicaShard {
    /// `range` cut into `d` parts ([`replica_part`]), of which replica `j` keeps its own.
    pub fn new(range: Range<usize>, d: usize, j: usize) -> Self {
        let shard = replica_part(&range, d, j);
        let counts = match d {
            1 => Vec::new(),
            _ => (0..d).map(|i| replica_part(&range, d, i).len()).collect(),
        };
        Self {
            range,
            shard,
            counts,
        }
    }

    /// The parts of `decay` (ranges of the flat buffers) inside this replica's part, relative
    /// to its start (the decayed ranges of an optimizer over the part).
    pub fn decay_in(&self, decay: &[Range<usize>]) -> Vec<Range<usize>> {
        decay
            .iter()
            .filter_map(|x| intersect(x, &self.shard))
            .map(|x| x.start - self.shard.start..x.end - self.shard.start)
            .collect()
    }

    /// Every replica's part of `buf[range]` (each replica's own part current) gathered into
    /// `buf[range]` on every replica, over `dp` (a collective; exact copies).
    pub fn gather(&self, dp: &ProcessGroup, buf: &mut [f32]) -> Result<()> {
        if self.counts.is_empty() {
            return Ok(());
        }
        let mut whole = vec![0f32; self.range.len()];
        dp.all_gather_v(&buf[self.shard.clone()], &mut whole, &self.counts)?;
        buf[self.range.clone()].copy_from_slice(&whole);
        Ok(())
    }

    /// `part` (this replica's part) gathered into the whole range over `dp`, as a new buffer.
    pub fn gather_part(&self, dp: &ProcessGroup, part: &[f32]) -> Result<Vec<f32>> {
        let mut whole = vec![0f32; self.range.len()];
        if self.counts.is_empty() {
            whole.copy_from_slice(part);
        } else {
            dp.all_gather_v(part, &mut whole, &self.counts)?;
        }
        Ok(whole)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_the_range_once_and_decay_is_relative() {
        let r = 10..27;
        let parts: Vec<_> = (0..3).map(|j| replica_part(&r, 3, j)).collect();
        assert_eq!(parts, vec![10..15, 15..21, 21..27]);
        let s = ReplicaShard::new(r.clone(), 3, 1);
        assert_eq!(s.counts, vec![5, 6, 6]);
        assert_eq!(s.decay_in(&[0..12, 14..17, 20..30]), vec![0..2, 5..6]);
        assert_eq!(ReplicaShard::new(r.clone(), 1, 0).shard, r);
        assert!(intersect(&(0..3), &(3..5)).is_none());
    }
}
