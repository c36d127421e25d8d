//! Recursive halving-doubling (Rabenseifner; Thakur, Rabenseifner, Gropp 2005): reduce-scatter by
//! recursive halving, all-gather by recursive doubling, all-reduce as the two in sequence.
//!
//! Reduce-scatter, p a power of two: in the step of distance d = p/2, p/4, …, 1 each member pairs
//! with `me ^ d`; the pair splits its current window of chunks in two, each keeps the half that
//! holds its own chunk, sends the other half and reduces the partner's copy of the kept half into
//! its own. Windows halve each step, so after log2 p steps member m holds exactly chunk m, reduced.
//!
//! Other p (MPICH's fold): let p' be the largest power of two ≤ p and r = p - p'. The first 2r
//! members pair up; each even member sends its whole buffer to the odd member above it, which
//! reduces it in and stands for both in a power-of-two reduce-scatter over p' "super-chunks" (the
//! pair's two chunks, or a single member's chunk). Finally each odd member hands the even one its
//! reduced chunk.
//!
//! All-gather, p a power of two: distance d = 1, 2, …, p/2, member m swaps its window of d chunks
//! with `me ^ d`. Other p: Bruck-style dissemination, which needs no fold: before the step of
//! distance d member m holds chunks m, m+1, …, m+d-1 (mod p); it sends the first min(d, p-d) of
//! them to member m-d and receives the next min(d, p-d) from member m+d.
//!
//! Every transfer is a list of byte ranges (the window's chunks, sorted and merged where they
//! touch), so chunks may have any sizes, be empty or lie in any order; with the balanced partition
//! a window is one contiguous range and each step one message each way.
//!
//! Cost, p ranks, n bytes (the whole buffer), lg = log2, per-byte reduction cost γ:
//! - p a power of two (004 eqs. 28.10-28.12): reduce-scatter `lg p·α + (p-1)/p·n·(β⁻¹ + γ)`,
//!   all-gather `lg p·α + (p-1)/p·n·β⁻¹`, all-reduce `2 lg p·α + 2(p-1)/p·n·β⁻¹ + (p-1)/p·n·γ`:
//!   the ring's bytes in 2 lg p steps instead of 2(p-1).
//! - otherwise: the reduce-scatter adds the fold and the hand-back, `(⌊lg p⌋ + 2)·α` in all, plus
//!   `n·(β⁻¹ + γ)` on the folding pairs and up to 2n/p per super-chunk in the core; the Bruck
//!   all-gather is `⌈lg p⌉·α + (p-1)/p·n·β⁻¹`. All-reduce:
//!   `(⌊lg p⌋ + ⌈lg p⌉ + 2)·α + (n + n/p + 2(p-1)/p·n)·β⁻¹ + (n + (p-1)/p·n)·γ` (upper bound).
//!
//! Determinism: every chunk is reduced on one rank, in an order fixed by the pairing (fold first,
//! then one partner per halving step), never by arrival; the all-gather only copies. Every rank
//! therefore ends an all-reduce with the same bytes.
//!
//! Deadlock freedom: each step is one exchange with at most one send peer and one receive peer,
//! and both sides of every message plan it at the same step from the same chunk list. Halving and
//! doubling steps are symmetric pairwise swaps; in a Bruck step every member sends and receives, so
//! the step completes everywhere once every member has reached it. The fold's even members wait
//! only for their odd partner's hand-back, and the odd partner never waits for them after the fold:
//! the wait-for relation always points to a step some member can complete.

use super::{Ctx, Team, partition};
use crate::dtype::ReduceOp;
use crate::engine::Xfer;
use crate::error::Result;
use std::ops::Range;

use super::direct::carve;

/// One planned step: sends to one peer and receives from one (maybe the same) peer.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Step {
    send_peer: usize,
    recv_peer: usize,
    /// Byte ranges of the buffer, ascending and disjoint; `true` = sent, `false` = received.
    parts: Vec<(Range<usize>, bool)>,
    /// Whether received data is combined into the buffer (else it overwrites it).
    reduce: bool,
}

impl Step {
    /// A step sending `send` to `send_peer` and receiving `recv` from `recv_peer`; None if both
    /// are empty (then neither side of any of its messages has anything to move).
    fn new(
        send_peer: usize,
        send: Vec<Range<usize>>,
        recv_peer: usize,
        recv: Vec<Range<usize>>,
        reduce: bool,
    ) -> Option<Step> {
        let mut parts: Vec<(Range<usize>, bool)> = send
            .into_iter()
            .map(|r| (r, true))
            .chain(recv.into_iter().map(|r| (r, false)))
            .collect();
        if parts.is_empty() {
            return None;
        }
        parts.sort_by_key(|(r, _)| r.start);
        debug_assert!(
            parts.windows(2).all(|w| w[0].0.end <= w[1].0.start),
            "overlapping step ranges {parts:?}"
        );
        Some(Step {
            send_peer,
            recv_peer,
            parts,
            reduce,
        })
    }
}

/// The byte ranges of `chunks[i]` for each member i in `members`, empty ones dropped, sorted and
/// merged where they touch: the canonical message list both ends of a transfer compute.
fn ranges_of(
    chunks: &[Range<usize>],
    members: impl IntoIterator<Item = usize>,
) -> Vec<Range<usize>> {
    let mut rs: Vec<Range<usize>> = members
        .into_iter()
        .map(|i| chunks[i].clone())
        .filter(|r| !r.is_empty())
        .collect();
    rs.sort_by_key(|r| r.start);
    let mut out: Vec<Range<usize>> = Vec::with_capacity(rs.len());
    for r in rs {
        match out.last_mut() {
            Some(last) if last.end == r.start => last.end = r.end,
            _ => out.push(r),
        }
    }
    out
}

/// Runs planned steps on `buf`; `op` is used by the steps that reduce.
fn run_steps(ctx: &mut Ctx<'_>, buf: &mut [u8], steps: &[Step], op: ReduceOp) -> Result<()> {
    for st in steps {
        let mut xs = Vec::with_capacity(st.parts.len());
        for ((_, send), part) in st
            .parts
            .iter()
            .zip(carve(buf, st.parts.iter().map(|(r, _)| r.clone())))
        {
            xs.push(match (*send, st.reduce) {
                (true, _) => Xfer::Send {
                    peer: st.send_peer,
                    data: part,
                },
                (false, true) => Xfer::RecvReduce {
                    peer: st.recv_peer,
                    acc: part,
                    op,
                },
                (false, false) => Xfer::Recv {
                    peer: st.recv_peer,
                    buf: part,
                },
            });
        }
        ctx.exchange(&mut xs)?;
    }
    Ok(())
}

/// Largest power of two ≤ p (p ≥ 1).
fn pof2_floor(p: usize) -> usize {
    1 << (usize::BITS - 1 - p.leading_zeros())
}

/// Recursive-halving reduce-scatter over byte `chunks`; afterwards member m's chunk m is reduced.
pub struct HdReduceScatter {
    steps: Vec<Step>,
}

impl HdReduceScatter {
    /// Plans a reduce-scatter of `chunks` (one per member, in member order, disjoint, any sizes).
    pub fn new(team: Team, chunks: Vec<Range<usize>>) -> Self {
        let p = team.size();
        debug_assert_eq!(p, chunks.len());
        let me = team.me;
        let mut steps = Vec::new();
        if p > 1 {
            let pof2 = pof2_floor(p);
            let r = p - pof2;
            // Super-chunk j of the core stands for members 2j, 2j+1 (j < r) or j + r; its active
            // member is the odd one of a pair, or the member itself.
            let members_of = |j: usize| {
                if j < r {
                    2 * j..2 * j + 2
                } else {
                    j + r..j + r + 1
                }
            };
            let active = |j: usize| if j < r { 2 * j + 1 } else { j + r };
            let super_ranges = |js: Range<usize>| ranges_of(&chunks, js.flat_map(members_of));
            let all = ranges_of(&chunks, 0..p);
            let odd = me & 1 == 1;
            let newrank = if me < 2 * r {
                odd.then_some(me / 2)
            } else {
                Some(me - r)
            };
            if me < 2 * r {
                let partner = team.peer(me ^ 1);
                steps.extend(if !odd {
                    Step::new(partner, all.clone(), partner, Vec::new(), true)
                } else {
                    Step::new(partner, Vec::new(), partner, all.clone(), true)
                });
            }
            if let Some(nr) = newrank {
                let (mut lo, mut d) = (0, pof2 / 2);
                while d >= 1 {
                    let partner = team.peer(active(nr ^ d));
                    let (keep, give) = if nr & d == 0 {
                        (lo..lo + d, lo + d..lo + 2 * d)
                    } else {
                        (lo + d..lo + 2 * d, lo..lo + d)
                    };
                    lo = keep.start;
                    steps.extend(Step::new(
                        partner,
                        super_ranges(give),
                        partner,
                        super_ranges(keep),
                        true,
                    ));
                    d /= 2;
                }
            }
            if me < 2 * r {
                let partner = team.peer(me ^ 1);
                steps.extend(if odd {
                    Step::new(
                        partner,
                        ranges_of(&chunks, [me - 1]),
                        partner,
                        Vec::new(),
                        false,
                    )
                } else {
                    Step::new(
                        partner,
                        Vec::new(),
                        partner,
                        ranges_of(&chunks, [me]),
                        false,
                    )
                });
            }
        }
        HdReduceScatter { steps }
    }

    /// Runs it in place on `buf`. `scratch` is not needed (received halves are combined into
    /// `buf` as they arrive).
    pub fn run(
        &self,
        ctx: &mut Ctx<'_>,
        buf: &mut [u8],
        op: ReduceOp,
        scratch: &mut Vec<u8>,
    ) -> Result<()> {
        let _ = scratch;
        run_steps(ctx, buf, &self.steps, op)
    }
}

/// Recursive-doubling (p a power of two) or Bruck (other p) all-gather over byte `chunks`.
pub struct HdAllGather {
    steps: Vec<Step>,
}

impl HdAllGather {
    /// Plans an all-gather of `chunks` (one per member, disjoint, any sizes): member m starts
    /// with chunk m and ends with all of them.
    pub fn new(team: Team, chunks: Vec<Range<usize>>) -> Self {
        let p = team.size();
        debug_assert_eq!(p, chunks.len());
        let me = team.me;
        let mut steps = Vec::new();
        let mut d = 1;
        while d < p {
            if p.is_power_of_two() {
                // Windows of d members sharing all bits above d's.
                let partner = me ^ d;
                let mine = me & !(d - 1);
                let theirs = partner & !(d - 1);
                let peer = team.peer(partner);
                steps.extend(Step::new(
                    peer,
                    ranges_of(&chunks, mine..mine + d),
                    peer,
                    ranges_of(&chunks, theirs..theirs + d),
                    false,
                ));
            } else {
                let cnt = d.min(p - d);
                let send = ranges_of(&chunks, (me..me + cnt).map(|i| i % p));
                let recv = ranges_of(&chunks, (me + d..me + d + cnt).map(|i| i % p));
                steps.extend(Step::new(team.prev(d), send, team.next(d), recv, false));
            }
            d *= 2;
        }
        HdAllGather { steps }
    }

    /// Runs it in place on `buf`.
    pub fn run(&self, ctx: &mut Ctx<'_>, buf: &mut [u8]) -> Result<()> {
        // The op is unused: no all-gather step reduces.
        run_steps(ctx, buf, &self.steps, ReduceOp::Sum)
    }
}

/// Rabenseifner all-reduce: halving reduce-scatter, then doubling (or Bruck) all-gather, over the
/// balanced p-way partition.
pub struct HdAllReduce {
    rs: HdReduceScatter,
    ag: HdAllGather,
}

impl HdAllReduce {
    /// Plans an all-reduce of `count` elements of `esz` bytes.
    pub fn new(team: Team, count: usize, esz: usize) -> Self {
        let chunks = partition(count, team.size(), esz);
        HdAllReduce {
            rs: HdReduceScatter::new(team.clone(), chunks.clone()),
            ag: HdAllGather::new(team, chunks),
        }
    }

    /// Runs it in place (the caller applies the final average, if any).
    pub fn run(
        &self,
        ctx: &mut Ctx<'_>,
        buf: &mut [u8],
        op: ReduceOp,
        scratch: &mut Vec<u8>,
    ) -> Result<()> {
        self.rs.run(ctx, buf, op, scratch)?;
        self.ag.run(ctx, buf)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::{self, ALL_REDUCE_DTYPES};
    use super::*;

    #[test]
    fn ranges_merge_and_sort() {
        let chunks = vec![4..6, 0..2, 2..4, 6..6, 9..10];
        assert_eq!(ranges_of(&chunks, [0, 1, 2, 3, 4]), vec![0..6, 9..10]);
        assert_eq!(ranges_of(&chunks, [3]), Vec::<Range<usize>>::new());
    }

    #[test]
    fn step_counts() {
        let steps = |p: usize, me: usize| {
            HdReduceScatter::new(Team::world(me, p), partition(64, p, 4))
                .steps
                .len()
        };
        assert_eq!(steps(8, 3), 3);
        // p = 6: p' = 4, r = 2; member 0 folds then waits for its chunk; member 1 folds, 2 core
        // steps, hands back; member 5 only runs the core.
        assert_eq!((steps(6, 0), steps(6, 1), steps(6, 5)), (2, 4, 2));
        let ag = |p: usize| {
            HdAllGather::new(Team::world(0, p), partition(64, p, 4))
                .steps
                .len()
        };
        assert_eq!((ag(1), ag(2), ag(5), ag(7), ag(8)), (0, 1, 3, 3, 3));
    }

    #[test]
    fn all_reduce_matches_reference() {
        testkit::check_all_reduce(1..=8, ALL_REDUCE_DTYPES, |team, ctx, count, buf, op| {
            let esz = ctx.esz();
            HdAllReduce::new(team.clone(), count, esz).run(ctx, buf, op, &mut Vec::new())
        });
    }

    #[test]
    fn reduce_scatter_matches_reference() {
        testkit::check_reduce_scatter(1..=8, |team, ctx, chunks, buf, op| {
            HdReduceScatter::new(team.clone(), chunks.to_vec()).run(ctx, buf, op, &mut Vec::new())
        });
    }

    #[test]
    fn all_gather_fills_every_chunk() {
        testkit::check_all_gather(1..=8, |team, ctx, chunks, buf| {
            HdAllGather::new(team.clone(), chunks.to_vec()).run(ctx, buf)
        });
    }

    #[test]
    fn large_all_reduce_with_fold() {
        testkit::check_large(6, 600_000, |team, ctx, count, buf, op| {
            HdAllReduce::new(team.clone(), count, ctx.esz()).run(ctx, buf, op, &mut Vec::new())
        });
    }

    #[test]
    fn all_reduce_on_sub_team() {
        testkit::check_sub_team(|team, ctx, count, buf, op| {
            let esz = ctx.esz();
            HdAllReduce::new(team.clone(), count, esz).run(ctx, buf, op, &mut Vec::new())
        });
    }
}
