//! Double binary tree all-reduce (NCCL's trees): two binary trees, each reducing and then
//! broadcasting one half of the buffer, run at the same time and pipelined in segments.
//!
//! Tree A is NCCL's in-order binary tree over member indices (`ncclGetBtree`: member v's parent is
//! `(v ^ b) | 2b`, or `v ^ b` when that is out of range, b = v's lowest set bit; member 0 is the
//! root, with one child). Tree B is tree A over a permuted order: mirrored (`p-1-m`) for even p,
//! shifted by one for odd p (`ncclGetDtree`), so the members interior in A are leaves in B and each
//! rank sends and receives about n bytes in all, not 2n.
//!
//! Schedule. Each half is cut into S segments of whole elements; time advances in global rounds,
//! one [`Ctx::exchange`] per round holding both trees' transfers. With H(x) the height of member x
//! in a tree (leaves 0), D(x) its depth (root 0) and R = H(root):
//! - reduce: x sends segment `t - H(x)` up to its parent in round t, after reducing that segment
//!   from its children, who sent it in earlier rounds (their heights are smaller);
//! - broadcast: the root sends segment s down in round `s + R`; x receives segment
//!   `t - (R + D(x) - 1)` from its parent in round t and forwards it to its children in round t+1.
//!
//! In any round a member touches distinct segments of its half (children's > its own upward one >
//! the one coming down > the one going down), and everything it sends was completed in an earlier
//! round. When both children deliver the same segment in one round, the second goes to scratch
//! and is reduced in after the exchange.
//!
//! Steps: S + 2R - 1 rounds, R = ⌈log2 p⌉. Bytes: an interior member of one tree sends each of
//! its segments up once and down twice, a leaf sends it up once: about 2n per rank in all, at most
//! four segments of n/(2S) bytes per round. Cost, p ranks, n bytes, per-byte reduction cost γ
//! (004 eq. 28.10 per round; compare the unpipelined tree of 004 eq. 28.13):
//! `(S + 2⌈log2 p⌉ - 1)·(α + 2n/S·β⁻¹ + 1.5·n/S·γ)` at most, which tends to `2n·β⁻¹` for large n
//! (the ring's bandwidth) while keeping a logarithmic number of latency terms beyond the S
//! pipeline rounds. S = ⌈(n/2) / [`DOUBLE_TREE_SEGMENT_BYTES`]⌉.
//!
//! That bound assumes the busiest rank's four segments of a round go one after another. With
//! ranks sharing cores the rounds overlap far better than that: 4 ranks on 2 cores over TCP,
//! 64 MiB, the tree ran 72-78 ms against the ring's 93-99 ms, where the bound says 115-124 ms.
//! So on a single host whose ranks talk over TCP its cost per byte is measured when the group
//! is created (`group::calibrate`), as the ring's is; elsewhere the bound prices it.
//!
//! Determinism: each segment's final value is computed on its tree's root in an order fixed by
//! the tree and the schedule (a member's own data, then its children in the rounds they deliver,
//! the second of a simultaneous pair last), and then broadcast, so every rank ends with the root's
//! bytes.
//!
//! Deadlock freedom: the rounds are the same on every member, and every transfer of round t is
//! matched by its peer's transfer in round t (both sides derive it from the same tree, heights and
//! round formulas). Nothing sent in round t depends on data received in round t, so a round never
//! waits on itself; by induction every member completes round t once every member has completed
//! round t-1. In particular the two trees cannot wait on each other in a cycle: a member never
//! holds back a send in one tree until it has heard from its children in the other. Same-peer,
//! same-direction messages of a round are listed tree A first on both sides, and each tree has at
//! most one per pair, direction and round.

use super::direct::{carve, ensure_scratch};
use super::{Ctx, Team, partition};
use crate::dtype::{ReduceOp, reduce_into};
use crate::engine::Xfer;
use crate::error::Result;
use std::ops::Range;

/// Target segment size of the pipeline (per half, per round).
pub const DOUBLE_TREE_SEGMENT_BYTES: usize = 256 * 1024;

/// Parent position in NCCL's in-order binary tree over positions 0..n (root 0).
fn btree_parent(v: usize, n: usize) -> Option<usize> {
    if v == 0 {
        return None;
    }
    let b = v & v.wrapping_neg();
    let up = (v ^ b) | (b << 1);
    Some(if up >= n { v ^ b } else { up })
}

/// One tree over the members: parents, children, heights and depths, indexed by member.
#[derive(Debug, Clone)]
struct Tree {
    parent: Vec<Option<usize>>,
    children: Vec<Vec<usize>>,
    height: Vec<usize>,
    depth: Vec<usize>,
    root: usize,
}

impl Tree {
    /// The binary tree over positions, placed on members by `member_at(position)`.
    fn new(p: usize, member_at: impl Fn(usize) -> usize) -> Tree {
        let mut parent = vec![None; p];
        let mut children = vec![Vec::new(); p];
        for pos in 0..p {
            if let Some(up) = btree_parent(pos, p) {
                parent[member_at(pos)] = Some(member_at(up));
                children[member_at(up)].push(member_at(pos));
            }
        }
        let root = member_at(0);
        let depth: Vec<usize> = (0..p)
            .map(|m| {
                let (mut x, mut d) = (m, 0);
                while let Some(up) = parent[x] {
                    x = up;
                    d += 1;
                }
                d
            })
            .collect();
        let mut height = vec![0; p];
        // Children are deeper than their parent: settle members deepest first.
        let mut order: Vec<usize> = (0..p).collect();
        order.sort_by_key(|&m| std::cmp::Reverse(depth[m]));
        for m in order {
            height[m] = children[m]
                .iter()
                .map(|&c| height[c] + 1)
                .max()
                .unwrap_or(0);
        }
        Tree {
            parent,
            children,
            height,
            depth,
            root,
        }
    }

    /// Tree B: tree A mirrored (`p-1-m`) for even p, shifted by one for odd p, so that no
    /// member (bar one, for odd p) is interior in both trees.
    fn second(p: usize) -> Tree {
        if p & 1 == 0 {
            Tree::new(p, |pos| p - 1 - pos)
        } else {
            Tree::new(p, |pos| (pos + 1) % p)
        }
    }
}

/// A planned transfer of one round; regions index [`Round::regions`].
#[derive(Debug, Clone, PartialEq, Eq)]
enum Planned {
    Send {
        peer: usize,
        region: usize,
    },
    Recv {
        peer: usize,
        region: usize,
    },
    RecvReduce {
        peer: usize,
        region: usize,
    },
    /// Receive into the next of the round's scratch ranges.
    RecvScratch {
        peer: usize,
    },
}

/// One round of this member's schedule.
#[derive(Debug, Clone, Default)]
struct Round {
    /// Buffer ranges touched, ascending and disjoint; `true` = read (sent).
    regions: Vec<(Range<usize>, bool)>,
    /// Scratch ranges received into, ascending (tree A's slot before tree B's).
    scratch: Vec<Range<usize>>,
    /// Transfers in canonical order: tree A's, then tree B's.
    xfers: Vec<Planned>,
    /// After the exchange: reduce the scratch range into the buffer range.
    post: Vec<(Range<usize>, Range<usize>)>,
}

/// Transfers of a round before the buffer regions are indexed.
enum Raw {
    Send(usize, Range<usize>),
    Recv(usize, Range<usize>),
    RecvReduce(usize, Range<usize>),
    RecvScratch(usize),
}

/// Double binary tree all-reduce, pipelined in segments.
pub struct DoubleTreeAllReduce {
    rounds: Vec<Round>,
    scratch_len: usize,
}

impl DoubleTreeAllReduce {
    /// Plans an all-reduce of `count` elements of `esz` bytes.
    pub fn new(team: Team, count: usize, esz: usize) -> Self {
        Self::with_segment(team, count, esz, DOUBLE_TREE_SEGMENT_BYTES)
    }

    /// As [`DoubleTreeAllReduce::new`] with a chosen segment size in bytes (rounded down to whole
    /// elements, at least one).
    pub fn with_segment(team: Team, count: usize, esz: usize, segment_bytes: usize) -> Self {
        let p = team.size();
        if p == 1 || count == 0 {
            return DoubleTreeAllReduce {
                rounds: Vec::new(),
                scratch_len: 0,
            };
        }
        let me = team.me;
        let trees = [Tree::new(p, |pos| pos), Tree::second(p)];
        let halves = partition(count, 2, esz);
        let seg_elems = (segment_bytes / esz).max(1);
        let half_elems = |h: &Range<usize>| h.len() / esz;
        let nseg = halves
            .iter()
            .map(half_elems)
            .max()
            .unwrap_or(0)
            .div_ceil(seg_elems)
            .max(1);
        let segs: Vec<Vec<Range<usize>>> = halves
            .iter()
            .map(|h| {
                partition(half_elems(h), nseg, esz)
                    .into_iter()
                    .map(|r| h.start + r.start..h.start + r.end)
                    .collect()
            })
            .collect();
        let max_seg = segs.iter().flatten().map(|r| r.len()).max().unwrap_or(0);
        let slot = [0..max_seg, max_seg..2 * max_seg];
        let root_h = trees[0].height[trees[0].root];
        let nrounds = nseg + 2 * root_h - 1;
        // Segment s of half h in round t at offset `lag`, if it exists and is not empty.
        let seg_at = |h: usize, t: usize, lag: usize| {
            (t >= lag && t - lag < nseg)
                .then(|| segs[h][t - lag].clone())
                .filter(|r| !r.is_empty())
        };

        let mut rounds = Vec::new();
        let mut scratch_len = 0;
        for t in 0..nrounds {
            let mut raw = Vec::new();
            let mut round = Round::default();
            for (h, tree) in trees.iter().enumerate() {
                let peer = |m: usize| team.peer(m);
                // Reduce: children's segments (two the same: the second into scratch).
                let mut first: Option<Range<usize>> = None;
                for &c in &tree.children[me] {
                    if let Some(s) = seg_at(h, t, tree.height[c]) {
                        if first.as_ref() == Some(&s) {
                            let spare = slot[h].start..slot[h].start + s.len();
                            raw.push(Raw::RecvScratch(peer(c)));
                            round.scratch.push(spare.clone());
                            round.post.push((s, spare));
                            scratch_len = scratch_len.max(slot[h].end);
                        } else {
                            raw.push(Raw::RecvReduce(peer(c), s.clone()));
                            first = Some(s);
                        }
                    }
                }
                if let Some(up) = tree.parent[me] {
                    // Reduce: own segment up; broadcast: segment down from the parent.
                    if let Some(s) = seg_at(h, t, tree.height[me]) {
                        raw.push(Raw::Send(peer(up), s));
                    }
                    if let Some(s) = seg_at(h, t, root_h + tree.depth[me] - 1) {
                        raw.push(Raw::Recv(peer(up), s));
                    }
                }
                // Broadcast: forward last round's segment to the children.
                if let Some(s) = seg_at(h, t, root_h + tree.depth[me]) {
                    for &c in &tree.children[me] {
                        raw.push(Raw::Send(peer(c), s.clone()));
                    }
                }
            }
            if raw.is_empty() {
                continue;
            }
            // Index the buffer regions: each range once (a segment sent to two children is one
            // shared region), ascending.
            for x in &raw {
                let (r, read) = match x {
                    Raw::Send(_, r) => (r, true),
                    Raw::Recv(_, r) | Raw::RecvReduce(_, r) => (r, false),
                    Raw::RecvScratch(_) => continue,
                };
                if !round.regions.iter().any(|(q, rd)| q == r && *rd && read) {
                    round.regions.push((r.clone(), read));
                }
            }
            round.regions.sort_by_key(|(r, _)| r.start);
            assert!(
                round.regions.windows(2).all(|w| w[0].0.end <= w[1].0.start),
                "double tree: overlapping regions in round {t}"
            );
            let index = |r: &Range<usize>| {
                round
                    .regions
                    .iter()
                    .position(|(q, _)| q == r)
                    .expect("region indexed above")
            };
            round.xfers = raw
                .iter()
                .map(|x| match x {
                    Raw::Send(peer, r) => Planned::Send {
                        peer: *peer,
                        region: index(r),
                    },
                    Raw::Recv(peer, r) => Planned::Recv {
                        peer: *peer,
                        region: index(r),
                    },
                    Raw::RecvReduce(peer, r) => Planned::RecvReduce {
                        peer: *peer,
                        region: index(r),
                    },
                    Raw::RecvScratch(peer) => Planned::RecvScratch { peer: *peer },
                })
                .collect();
            rounds.push(round);
        }
        DoubleTreeAllReduce {
            rounds,
            scratch_len,
        }
    }

    /// Runs it in place (the caller applies the final average, if any). `scratch` grows to at
    /// most two segments.
    pub fn run(
        &self,
        ctx: &mut Ctx<'_>,
        buf: &mut [u8],
        op: ReduceOp,
        scratch: &mut Vec<u8>,
    ) -> Result<()> {
        if self.rounds.is_empty() {
            return Ok(());
        }
        ensure_scratch(scratch, self.scratch_len);
        let dtype = ctx.dtype();
        for round in &self.rounds {
            {
                let mut reads: Vec<&[u8]> = Vec::with_capacity(round.regions.len());
                let mut writes: Vec<Option<&mut [u8]>> = Vec::with_capacity(round.regions.len());
                for ((_, read), part) in round
                    .regions
                    .iter()
                    .zip(carve(buf, round.regions.iter().map(|(r, _)| r.clone())))
                {
                    if *read {
                        reads.push(part);
                        writes.push(None);
                    } else {
                        reads.push(&[]);
                        writes.push(Some(part));
                    }
                }
                let mut spare = carve(&mut scratch[..], round.scratch.iter().cloned());
                let mut xs = Vec::with_capacity(round.xfers.len());
                for x in &round.xfers {
                    xs.push(match *x {
                        Planned::Send { peer, region } => Xfer::Send {
                            peer,
                            data: reads[region],
                        },
                        Planned::Recv { peer, region } => Xfer::Recv {
                            peer,
                            buf: writes[region].take().expect("one writer per region"),
                        },
                        Planned::RecvReduce { peer, region } => Xfer::RecvReduce {
                            peer,
                            acc: writes[region].take().expect("one writer per region"),
                            op,
                        },
                        Planned::RecvScratch { peer } => Xfer::Recv {
                            peer,
                            buf: spare.next().expect("one scratch range per receive"),
                        },
                    });
                }
                ctx.exchange(&mut xs)?;
            }
            for (b, s) in &round.post {
                reduce_into(dtype, op, &mut buf[b.clone()], &scratch[s.clone()]);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::{self, ALL_REDUCE_DTYPES};
    use super::*;

    #[test]
    fn btree_is_a_binary_tree_of_log_height() {
        for p in 1..=64 {
            for tree in [
                Tree::new(p, |q| q),
                Tree::new(p, |q| p - 1 - q),
                Tree::new(p, |q| (q + 1) % p),
            ] {
                assert!(tree.children.iter().all(|c| c.len() <= 2), "p={p}");
                assert_eq!(tree.children[tree.root].len(), usize::from(p > 1));
                assert_eq!(tree.children.iter().map(Vec::len).sum::<usize>(), p - 1);
                let lg = (p as f64).log2().ceil() as usize;
                assert_eq!(tree.height[tree.root], lg, "p={p}");
            }
        }
    }

    #[test]
    fn trees_are_complementary() {
        // No member has children in both trees (NCCL's double-tree property).
        for p in 2..=33 {
            let a = Tree::new(p, |q| q);
            let b = Tree::second(p);
            let both = (0..p)
                .filter(|&m| !a.children[m].is_empty() && !b.children[m].is_empty())
                .count();
            assert!(
                both <= p & 1,
                "p={p}: {both} members interior in both trees"
            );
        }
    }

    #[test]
    fn plan_spans_s_plus_2r_minus_1_rounds_and_uses_scratch() {
        // p = 8: R = 3; 1000 elements in segments of 10: S = 50 per half.
        let plans: Vec<DoubleTreeAllReduce> = (0..8)
            .map(|m| DoubleTreeAllReduce::with_segment(Team::world(m, 8), 1000, 4, 40))
            .collect();
        assert!(plans.iter().all(|d| d.rounds.len() < 50 + 2 * 3));
        assert!(plans.iter().any(|d| d.rounds.len() == 50 + 2 * 3 - 1));
        // Member 4 has two children of equal height in tree A: both deliver in the same round.
        assert!(plans[4].rounds.iter().any(|r| !r.post.is_empty()) && plans[4].scratch_len == 40);
    }

    #[test]
    fn all_reduce_matches_reference() {
        testkit::check_all_reduce(1..=8, ALL_REDUCE_DTYPES, |team, ctx, count, buf, op| {
            let esz = ctx.esz();
            DoubleTreeAllReduce::new(team.clone(), count, esz).run(ctx, buf, op, &mut Vec::new())
        });
    }

    #[test]
    fn pipelined_all_reduce_matches_reference() {
        // Tiny segments: many rounds in flight, simultaneous children, empty segments.
        for seg in [5, 64] {
            testkit::check_all_reduce(
                1..=8,
                &[crate::dtype::DType::F32, crate::dtype::DType::I64],
                |team, ctx, count, buf, op| {
                    let esz = ctx.esz();
                    DoubleTreeAllReduce::with_segment(team.clone(), count, esz, seg * esz).run(
                        ctx,
                        buf,
                        op,
                        &mut Vec::new(),
                    )
                },
            );
        }
    }

    #[test]
    fn large_all_reduce_with_default_segments() {
        // 600k i64 = 4.8 MB per rank: S = 10 segments of 240 KB per half.
        testkit::check_large(6, 600_000, |team, ctx, count, buf, op| {
            DoubleTreeAllReduce::new(team.clone(), count, ctx.esz()).run(
                ctx,
                buf,
                op,
                &mut Vec::new(),
            )
        });
    }

    #[test]
    fn all_reduce_on_sub_team() {
        testkit::check_sub_team(|team, ctx, count, buf, op| {
            let esz = ctx.esz();
            DoubleTreeAllReduce::with_segment(team.clone(), count, esz, 8 * esz).run(
                ctx,
                buf,
                op,
                &mut Vec::new(),
            )
        });
    }
}
