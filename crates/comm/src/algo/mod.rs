//! Collective algorithms, one module each (gloo style): the constructor plans (chunk ranges,
//! peers), `run()` only communicates and reduces. Each module's doc gives the step count, the
//! bytes each rank puts on the wire and the alpha-beta cost, with p ranks and n bytes.
//!
//! Algorithms run on a [`Team`]: an ordered subset of the group's ranks. The whole group is one
//! team; the hierarchical all-reduce runs the same ring code on the host-local team and on the
//! cross-host team.

pub mod direct;
pub mod direct_read;
pub mod double_tree;
pub mod halving_doubling;
pub mod hier_pipeline;
pub mod hierarchical;
pub mod ring;
#[cfg(test)]
pub(crate) mod testkit;
pub mod tree;

use crate::dtype::DType;
use crate::engine::{OpCtx, Xfer, exchange};
use crate::error::Result;
use crate::transport::Link;
use std::ops::Range;

/// Algorithms the library can run; not every algorithm serves every op (see [`Algo::serves`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Algo {
    /// Ring: reduce-scatter and/or all-gather around the ring (bandwidth optimal).
    Ring,
    /// Binomial tree (reduce to a root, broadcast from it).
    Tree,
    /// Two complementary binary trees, each carrying half the data.
    DoubleTree,
    /// Recursive halving-doubling (Rabenseifner), with a fold for non-powers of two.
    HalvingDoubling,
    /// Every rank exchanges directly with every other rank at once.
    Direct,
    /// Pairwise exchange in p-1 rounds (all-to-all).
    Pairwise,
    /// Intra-host reduce-scatter, inter-host all-reduce of the shard, intra-host all-gather.
    Hierarchical,
    /// Single copy within a host: ranks read each other's buffers in place (cross-memory attach).
    DirectRead,
}

impl Algo {
    /// Every algorithm.
    pub const ALL: [Algo; 8] = [
        Algo::Ring,
        Algo::Tree,
        Algo::DoubleTree,
        Algo::HalvingDoubling,
        Algo::Direct,
        Algo::Pairwise,
        Algo::Hierarchical,
        Algo::DirectRead,
    ];

    /// snake_case name.
    pub const fn name(self) -> &'static str {
        match self {
            Algo::Ring => "ring",
            Algo::Tree => "tree",
            Algo::DoubleTree => "double_tree",
            Algo::HalvingDoubling => "halving_doubling",
            Algo::Direct => "direct",
            Algo::Pairwise => "pairwise",
            Algo::Hierarchical => "hierarchical",
            Algo::DirectRead => "direct_read",
        }
    }

    /// Parses a name as printed by [`Algo::name`].
    pub fn parse(s: &str) -> Option<Algo> {
        Algo::ALL.into_iter().find(|a| a.name() == s)
    }

    /// Whether this algorithm implements `op`.
    pub fn serves(self, op: crate::frame::OpKind) -> bool {
        use crate::frame::OpKind::*;
        match self {
            Algo::Ring => matches!(
                op,
                AllReduce | ReduceScatter | AllGather | Broadcast | Reduce
            ),
            Algo::Tree => matches!(op, AllReduce | Broadcast | Reduce),
            Algo::DoubleTree => matches!(op, AllReduce),
            Algo::HalvingDoubling => matches!(op, AllReduce | ReduceScatter | AllGather),
            Algo::Direct => matches!(
                op,
                AllReduce | ReduceScatter | AllGather | AllToAll | Barrier
            ),
            Algo::Pairwise => matches!(op, AllToAll),
            Algo::Hierarchical => matches!(op, AllReduce),
            Algo::DirectRead => matches!(op, AllReduce | ReduceScatter | AllGather | Broadcast),
        }
    }
}

/// An ordered subset of group ranks that runs an algorithm together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Team {
    /// Group ranks, in algorithm order.
    pub ranks: Vec<usize>,
    /// This rank's index in `ranks`.
    pub me: usize,
}

impl Team {
    /// The team of all `size` ranks, with this rank at `rank`.
    pub fn world(rank: usize, size: usize) -> Team {
        Team {
            ranks: (0..size).collect(),
            me: rank,
        }
    }

    /// Number of members.
    pub fn size(&self) -> usize {
        self.ranks.len()
    }

    /// Group rank of member `i` (taken modulo the team size).
    pub fn peer(&self, i: usize) -> usize {
        self.ranks[i % self.ranks.len()]
    }

    /// Group rank of the member `d` places after this one on the ring.
    pub fn next(&self, d: usize) -> usize {
        self.peer(self.me + d)
    }

    /// Group rank of the member `d` places before this one on the ring.
    pub fn prev(&self, d: usize) -> usize {
        let p = self.size();
        self.peer(self.me + p - d % p)
    }
}

/// What an algorithm's `run()` communicates through: the group's links and the op's identity.
pub struct Ctx<'a> {
    /// Links indexed by group rank (None for this rank).
    pub links: &'a mut [Option<Box<dyn Link>>],
    /// The op being run.
    pub op: OpCtx,
}

impl Ctx<'_> {
    /// Runs one step's transfers to completion.
    pub fn exchange(&mut self, xfers: &mut [Xfer<'_>]) -> Result<()> {
        exchange(self.links, &mut self.op, xfers)
    }

    /// Element size of the op's dtype.
    pub fn esz(&self) -> usize {
        self.op.dtype.size()
    }

    /// The op's dtype.
    pub fn dtype(&self) -> DType {
        self.op.dtype
    }
}

/// Balanced partition of `count` elements into `parts` ranges, as byte ranges for elements of
/// `esz` bytes. Part i holds elements `[i*count/parts, (i+1)*count/parts)`, so sizes differ by at
/// most one element and parts may be empty when `count < parts`.
pub fn partition(count: usize, parts: usize, esz: usize) -> Vec<Range<usize>> {
    (0..parts)
        .map(|i| {
            let lo = (i as u128 * count as u128 / parts as u128) as usize;
            let hi = ((i + 1) as u128 * count as u128 / parts as u128) as usize;
            lo * esz..hi * esz
        })
        .collect()
}

/// Borrows two disjoint ranges of one buffer, the first shared and the second mutable.
///
/// Panics if the ranges overlap (a planning bug, never input-driven).
pub fn split_ref_mut(buf: &mut [u8], a: Range<usize>, b: Range<usize>) -> (&[u8], &mut [u8]) {
    assert!(
        a.end <= b.start || b.end <= a.start || a.is_empty() || b.is_empty(),
        "overlapping ranges {a:?} {b:?}"
    );
    if a.is_empty() {
        return (&[], &mut buf[b]);
    }
    if a.start < b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&hi[..a.end - a.start], &mut lo[b])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_tiles_exactly() {
        for count in [0, 1, 3, 7, 100] {
            for parts in 1..9 {
                let r = partition(count, parts, 4);
                assert_eq!(r.len(), parts);
                assert_eq!(r[0].start, 0);
                assert_eq!(r[parts - 1].end, count * 4);
                for w in r.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                }
            }
        }
    }

    #[test]
    fn team_neighbours_wrap() {
        let t = Team {
            ranks: vec![4, 6, 9],
            me: 0,
        };
        assert_eq!(t.next(1), 6);
        assert_eq!(t.prev(1), 9);
        assert_eq!(t.prev(3), 4);
    }

    #[test]
    fn split_both_orders() {
        let mut b: Vec<u8> = (0..10).collect();
        let (x, y) = split_ref_mut(&mut b, 6..8, 1..3);
        assert_eq!(x, &[6, 7]);
        y[0] = 99;
        assert_eq!(b[1], 99);
    }
}
