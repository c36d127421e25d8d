//! Which elements of the flat buffer each ZeRO rank owns.
//!
//! The flat buffer is cut into segments (the data-parallel gradient buckets for ZeRO-1/2, the
//! model's units for ZeRO-3: [`crate::ddp::plan_buckets`]), and each segment of `len` elements
//! into `N` equal parts of `ceil(len / N)`, the last padded: rank `r` owns part `r` of every
//! segment. A segment is then exactly one reduce-scatter (its gradient) and one all-gather (its
//! parameters) with equal blocks, and a rank's shard (its optimizer state, its reduced
//! gradients, its ZeRO-3 parameters) is the concatenation of its parts, in segment order:
//! `sum(ceil(len_s / N))` elements, at most one element per segment more than `P / N`.

use std::ops::Range;

/// The segments and this rank's parts of them (see the module doc).
#[derive(Clone, Debug)]
pub struct ShardPlan {
    world: usize,
    rank: usize,
    /// Segments over the flat buffer, in launch (backward) order.
    segments: Vec<Range<usize>>,
    /// Elements of each segment per rank (`ceil(len / world)`).
    part: Vec<usize>,
    /// Where each segment's part starts in the shard.
    at: Vec<usize>,
    /// Shard length.
    len: usize,
}

impl ShardPlan {
    /// Rank `rank` of `world`'s parts of `segments`.
    pub fn new(segments: Vec<Range<usize>>, world: usize, rank: usize) -> ShardPlan {
        let world = world.max(1);
        let part: Vec<usize> = segments.iter().map(|s| s.len().div_ceil(world)).collect();
        let mut at = Vec::with_capacity(part.len());
        let mut len = 0;
        for p in &part {
            at.push(len);
            len += p;
        }
        ShardPlan {
            world,
            rank,
            segments,
            part,
            at,
            len,
        }
    }

    /// The segments, in launch order.
    pub fn segments(&self) -> &[Range<usize>] {
        &self.segments
    }

    /// Elements of segment `s` per rank (its padded part).
    pub fn part_len(&self, s: usize) -> usize {
        self.part[s]
    }

    /// Shard length: the sum of this rank's padded parts.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the shard is empty (a model without parameters).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The flat-buffer range rank `rank` owns of segment `s` (empty for a rank past its end).
    pub fn owned_by(&self, s: usize, rank: usize) -> Range<usize> {
        let seg = &self.segments[s];
        let start = (seg.start + rank * self.part[s]).min(seg.end);
        let end = (start + self.part[s]).min(seg.end);
        start..end
    }

    /// The flat-buffer range this rank owns of segment `s`.
    pub fn owned(&self, s: usize) -> Range<usize> {
        self.owned_by(s, self.rank)
    }

    /// Where segment `s`'s owned elements sit in the shard (the padded part's first
    /// `owned(s).len()` elements).
    pub fn local(&self, s: usize) -> Range<usize> {
        self.at[s]..self.at[s] + self.owned(s).len()
    }

    /// Segment `s`'s whole padded part in the shard.
    pub fn part(&self, s: usize) -> Range<usize> {
        self.at[s]..self.at[s] + self.part[s]
    }

    /// The segment that is exactly `range`, if any.
    pub fn segment_of(&self, range: &Range<usize>) -> Option<usize> {
        self.segments.iter().position(|s| s == range)
    }

    /// `decay` (flat-buffer ranges) in shard coordinates: the owned elements that decay.
    pub fn local_ranges(&self, decay: &[Range<usize>]) -> Vec<Range<usize>> {
        let mut out = Vec::new();
        for s in 0..self.segments.len() {
            let owned = self.owned(s);
            for d in decay {
                let (a, b) = (d.start.max(owned.start), d.end.min(owned.end));
                if a < b {
                    let base = self.at[s];
                    out.push(base + a - owned.start..base + b - owned.start);
                }
            }
        }
        out
    }

    /// Ranks in the plan.
    pub fn world(&self) -> usize {
        self.world
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_tile_every_segment_once() {
        let segs = vec![90..100, 0..7, 7..90];
        for world in 1..5 {
            let mut seen = vec![0; 100];
            let mut total = 0;
            for rank in 0..world {
                let p = ShardPlan::new(segs.clone(), world, rank);
                total = p.len();
                for s in 0..segs.len() {
                    for i in p.owned(s) {
                        seen[i] += 1;
                    }
                    assert!(p.local(s).end <= p.part(s).end);
                }
            }
            assert!(seen.iter().all(|&c| c == 1), "world {world}: {seen:?}");
            assert_eq!(
                total,
                segs.iter().map(|s| s.len().div_ceil(world)).sum::<usize>()
            );
        }
    }

    #[test]
    fn decay_maps_into_the_shard() {
        let p = ShardPlan::new(vec![10..20, 0..10], 2, 1);
        // Rank 1 owns 15..20 (shard 0..5) and 5..10 (shard 5..10).
        assert_eq!(p.local_ranges(&[0..6, 12..17]), vec![0..2, 5..6]);
    }
}
