//! Direct algorithms: every member talks to every other member in one step (all-reduce,
//! reduce-scatter, all-gather, all-to-all), the pairwise all-to-all, and the dissemination barrier.
//!
//! One exchange each (pairwise all-to-all: p-1; barrier: ⌈log2 p⌉), so latency is a single α
//! however large p is, but every rank's link carries p-1 messages: these are the small-message
//! algorithms. Cost (004 eqs. 28.10-28.12), p ranks, n bytes, per-byte reduction cost γ:
//! - all-reduce (n = one rank's buffer): each rank sends its whole buffer to the p-1 others and
//!   reduces the p contributions locally: 1 step, (p-1)·n bytes sent,
//!   `α + (p-1)·n·β⁻¹ + (p-1)·n·γ`; scratch (p-1)·n bytes.
//! - reduce-scatter (n = whole buffer): member m receives chunk m from everyone: 1 step,
//!   (p-1)/p·n bytes sent, `α + (p-1)/p·n·β⁻¹ + (p-1)/p·n·γ`; scratch (p-1)·n/p bytes.
//! - all-gather / all-to-all (n = whole buffer): 1 step, (p-1)/p·n bytes, `α + (p-1)/p·n·β⁻¹`.
//! - pairwise all-to-all: p-1 steps, round k sends to me+k and receives from me-k:
//!   `(p-1)·α + (p-1)/p·n·β⁻¹`, never more than one message in flight per direction.
//! - barrier (dissemination, Hensgen-Finkel-Manber): ⌈log2 p⌉ steps of zero-byte messages, round
//!   k to me+2^k and from me-2^k: `⌈log2 p⌉·α`.
//!
//! Determinism: reductions combine the p contributions in member order 0, 1, …, p-1
//! (`((x0 op x1) op x2) …`) on the one rank that owns the result (or on every rank, for the
//! all-reduce, each computing the same expression over the same bytes), never in arrival order.
//!
//! Deadlock freedom: every step is one [`Ctx::exchange`] whose transfers are all posted at once on
//! every member, with exactly one message per ordered pair of members and step; no transfer of a
//! step waits for another, so each completes as soon as both ends reach that step.

use super::{Ctx, Team};
use crate::dtype::{DType, ReduceOp, reduce_into};
use crate::engine::Xfer;
use crate::error::{CommError, Result};
use std::ops::Range;

/// Borrows the byte `ranges` of `buf` mutably at once, in the order given, without allocating.
///
/// The ranges must be ascending and disjoint (empty ranges may appear anywhere); an overlap or a
/// range out of order is a planning bug and panics. Shared with the other algorithm modules.
pub(crate) fn carve<'a, I>(buf: &'a mut [u8], ranges: I) -> impl Iterator<Item = &'a mut [u8]>
where
    I: IntoIterator<Item = Range<usize>>,
{
    let mut rest: &'a mut [u8] = buf;
    let mut base = 0usize;
    ranges.into_iter().map(move |r| {
        if r.is_empty() {
            return <&mut [u8]>::default();
        }
        assert!(
            r.start >= base,
            "carve: range {r:?} overlaps or precedes byte {base}"
        );
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(r.start - base);
        let (mine, tail) = tail.split_at_mut(r.len());
        rest = tail;
        base = r.end;
        mine
    })
}

/// Member `k`-th other than `me`, in member order (k in 0..p-1).
fn other(me: usize, k: usize) -> usize {
    if k < me { k } else { k + 1 }
}

/// `own = x0 op x1 op … op x(p-1)`, left to right, where `own` holds x(me) on entry and `slots`
/// holds the other members' contributions, `n` bytes each, in member order skipping `me`.
fn reduce_in_member_order(dtype: DType, op: ReduceOp, own: &mut [u8], me: usize, slots: &mut [u8]) {
    let n = own.len();
    let others = slots.len() / n;
    if me == 0 {
        for k in 0..others {
            reduce_into(dtype, op, own, &slots[k * n..(k + 1) * n]);
        }
        return;
    }
    // x0 lives in slot 0: accumulate there, then copy the result home.
    let (acc, rest) = slots.split_at_mut(n);
    for j in 1..=others {
        let src: &[u8] = if j == me {
            own
        } else {
            let k = if j < me { j } else { j - 1 };
            &rest[(k - 1) * n..k * n]
        };
        reduce_into(dtype, op, acc, src);
    }
    own.copy_from_slice(acc);
}

/// Grows the group's scratch buffer to at least `len` bytes (never shrinks it).
pub(crate) fn ensure_scratch(scratch: &mut Vec<u8>, len: usize) {
    if scratch.len() < len {
        scratch.resize(len, 0);
    }
}

/// All-reduce by full exchange: every member sends its whole buffer to every other member and
/// reduces all p contributions locally in member order, so every rank computes identical bytes.
pub struct DirectAllReduce {
    team: Team,
    len: usize,
}

impl DirectAllReduce {
    /// Plans an all-reduce of a `len`-byte buffer.
    pub fn new(team: Team, len: usize) -> Self {
        DirectAllReduce { team, len }
    }

    /// Runs it in place; `scratch` grows to (p-1)·len bytes.
    pub fn run(
        &self,
        ctx: &mut Ctx<'_>,
        buf: &mut [u8],
        op: ReduceOp,
        scratch: &mut Vec<u8>,
    ) -> Result<()> {
        let p = self.team.size();
        if p == 1 || buf.is_empty() {
            return Ok(());
        }
        let n = buf.len();
        debug_assert_eq!(n, self.len);
        ensure_scratch(scratch, (p - 1) * n);
        let slots = &mut scratch[..(p - 1) * n];
        let me = self.team.me;
        {
            let mut xs = Vec::with_capacity(2 * (p - 1));
            for (k, slot) in slots.chunks_mut(n).enumerate() {
                let peer = self.team.peer(other(me, k));
                xs.push(Xfer::Send { peer, data: &*buf });
                xs.push(Xfer::Recv { peer, buf: slot });
            }
            ctx.exchange(&mut xs)?;
        }
        reduce_in_member_order(ctx.dtype(), op, buf, me, slots);
        Ok(())
    }
}

/// Reduce-scatter by direct exchange: member m receives chunk m from everyone and reduces the p
/// contributions in member order.
pub struct DirectReduceScatter {
    team: Team,
    chunks: Vec<Range<usize>>,
}

impl DirectReduceScatter {
    /// Plans a reduce-scatter of byte `chunks` (one per member, in member order, disjoint).
    pub fn new(team: Team, chunks: Vec<Range<usize>>) -> Self {
        debug_assert_eq!(team.size(), chunks.len());
        DirectReduceScatter { team, chunks }
    }

    /// Runs it in place on `buf`; afterwards member m's chunk m is reduced. `scratch` grows to
    /// (p-1) times this member's chunk.
    pub fn run(
        &self,
        ctx: &mut Ctx<'_>,
        buf: &mut [u8],
        op: ReduceOp,
        scratch: &mut Vec<u8>,
    ) -> Result<()> {
        let p = self.team.size();
        let me = self.team.me;
        let mine = self.chunks[me].clone();
        if p == 1 || self.chunks.iter().all(|c| c.is_empty()) {
            return Ok(());
        }
        let n = mine.len();
        ensure_scratch(scratch, (p - 1) * n);
        let slots = &mut scratch[..(p - 1) * n];
        {
            // Empty chunks are skipped on both sides: every member plans from the same chunks.
            let mut xs = Vec::with_capacity(2 * (p - 1));
            for j in (0..p).filter(|&j| j != me && !self.chunks[j].is_empty()) {
                xs.push(Xfer::Send {
                    peer: self.team.peer(j),
                    data: &buf[self.chunks[j].clone()],
                });
            }
            if n > 0 {
                for (k, slot) in slots.chunks_mut(n).enumerate() {
                    xs.push(Xfer::Recv {
                        peer: self.team.peer(other(me, k)),
                        buf: slot,
                    });
                }
            }
            ctx.exchange(&mut xs)?;
        }
        if n > 0 {
            reduce_in_member_order(ctx.dtype(), op, &mut buf[mine], me, slots);
        }
        Ok(())
    }
}

/// All-gather by direct exchange: every member sends its chunk to every other member at once.
pub struct DirectAllGather {
    team: Team,
    chunks: Vec<Range<usize>>,
    /// Member indices ordered by chunk start (the order [`carve`] needs).
    by_start: Vec<usize>,
}

impl DirectAllGather {
    /// Plans an all-gather of byte `chunks` (one per member, any sizes, disjoint).
    pub fn new(team: Team, chunks: Vec<Range<usize>>) -> Self {
        debug_assert_eq!(team.size(), chunks.len());
        let mut by_start: Vec<usize> = (0..chunks.len()).collect();
        by_start.sort_by_key(|&j| chunks[j].start);
        DirectAllGather {
            team,
            chunks,
            by_start,
        }
    }

    /// Runs it in place on `buf`: member m starts with chunk m, ends with all of them.
    pub fn run(&self, ctx: &mut Ctx<'_>, buf: &mut [u8]) -> Result<()> {
        let p = self.team.size();
        if p == 1 || self.chunks.iter().all(|c| c.is_empty()) {
            return Ok(());
        }
        let me = self.team.me;
        let mut xs = Vec::with_capacity(2 * (p - 1));
        let mut own: &[u8] = &[];
        for (&j, part) in self.by_start.iter().zip(carve(
            buf,
            self.by_start.iter().map(|&j| self.chunks[j].clone()),
        )) {
            if j == me {
                own = part;
            } else if !part.is_empty() {
                xs.push(Xfer::Recv {
                    peer: self.team.peer(j),
                    buf: part,
                });
            }
        }
        if !own.is_empty() {
            for j in (0..p).filter(|&j| j != me) {
                xs.push(Xfer::Send {
                    peer: self.team.peer(j),
                    data: own,
                });
            }
        }
        ctx.exchange(&mut xs)
    }
}

/// All-to-all with per-member byte ranges (variable sizes), direct or pairwise.
pub struct AllToAll {
    team: Team,
    send: Vec<Range<usize>>,
    recv: Vec<Range<usize>>,
    pairwise: bool,
    /// Other members ordered by the start of their receive range (the order [`carve`] needs).
    recv_by_start: Vec<usize>,
}

impl AllToAll {
    /// Plans an all-to-all: `send[j]` is the byte range of the input destined to member j,
    /// `recv[j]` the byte range of the output that receives member j's block. The caller
    /// guarantees that i's `send[j]` has the length of j's `recv[i]`. `pairwise` selects p-1
    /// rounds of one partner each instead of one step with everyone.
    pub fn new(
        team: Team,
        send: Vec<Range<usize>>,
        recv: Vec<Range<usize>>,
        pairwise: bool,
    ) -> Self {
        debug_assert_eq!(team.size(), send.len());
        debug_assert_eq!(team.size(), recv.len());
        let me = team.me;
        let mut recv_by_start: Vec<usize> = (0..recv.len()).filter(|&j| j != me).collect();
        recv_by_start.sort_by_key(|&j| recv[j].start);
        AllToAll {
            team,
            send,
            recv,
            pairwise,
            recv_by_start,
        }
    }

    /// Runs it from `input` into `output`. Every block travels, empty ones included (as zero-byte
    /// messages), so a caller whose sizes disagree gets a mismatch error rather than a hang.
    pub fn run(&self, ctx: &mut Ctx<'_>, input: &[u8], output: &mut [u8]) -> Result<()> {
        let p = self.team.size();
        let me = self.team.me;
        let in_end = self.send.iter().map(|r| r.end).max().unwrap_or(0);
        let out_end = self.recv.iter().map(|r| r.end).max().unwrap_or(0);
        if in_end > input.len()
            || out_end > output.len()
            || self.send[me].len() != self.recv[me].len()
        {
            return Err(CommError::InvalidArgument(format!(
                "all_to_all: input {} bytes (ranges need {in_end}), output {} bytes (ranges need {out_end}), own block {} -> {} bytes",
                input.len(),
                output.len(),
                self.send[me].len(),
                self.recv[me].len()
            )));
        }
        output[self.recv[me].clone()].copy_from_slice(&input[self.send[me].clone()]);
        if p == 1 {
            return Ok(());
        }
        if self.pairwise {
            for k in 1..p {
                let (to, from) = ((me + k) % p, (me + p - k) % p);
                ctx.exchange(&mut [
                    Xfer::Send {
                        peer: self.team.peer(to),
                        data: &input[self.send[to].clone()],
                    },
                    Xfer::Recv {
                        peer: self.team.peer(from),
                        buf: &mut output[self.recv[from].clone()],
                    },
                ])?;
            }
            return Ok(());
        }
        let mut xs = Vec::with_capacity(2 * (p - 1));
        for j in (0..p).filter(|&j| j != me) {
            xs.push(Xfer::Send {
                peer: self.team.peer(j),
                data: &input[self.send[j].clone()],
            });
        }
        let parts = carve(
            output,
            self.recv_by_start.iter().map(|&j| self.recv[j].clone()),
        );
        for (&j, part) in self.recv_by_start.iter().zip(parts) {
            xs.push(Xfer::Recv {
                peer: self.team.peer(j),
                buf: part,
            });
        }
        ctx.exchange(&mut xs)
    }
}

/// Dissemination barrier: ⌈log2 p⌉ rounds of zero-byte messages; in round k each member signals
/// member me+2^k and waits for member me-2^k. After the last round every member has heard,
/// directly or transitively, from every other member.
pub struct Barrier {
    team: Team,
}

impl Barrier {
    /// Plans a barrier of the team.
    pub fn new(team: Team) -> Self {
        Barrier { team }
    }

    /// Returns once every member has entered the barrier.
    pub fn run(&self, ctx: &mut Ctx<'_>) -> Result<()> {
        let p = self.team.size();
        let mut d = 1;
        while d < p {
            ctx.exchange(&mut [
                Xfer::Send {
                    peer: self.team.next(d),
                    data: &[],
                },
                Xfer::Recv {
                    peer: self.team.prev(d),
                    buf: &mut [],
                },
            ])?;
            d *= 2;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::partition;
    use super::super::testkit::{self, ALL_REDUCE_DTYPES};
    use super::*;

    #[test]
    fn carve_splits_in_order() {
        let mut b: Vec<u8> = (0..10).collect();
        let parts: Vec<&mut [u8]> = carve(&mut b, [1..3, 3..3, 4..5, 7..10]).collect();
        assert_eq!(
            parts.iter().map(|p| p.len()).collect::<Vec<_>>(),
            vec![2, 0, 1, 3]
        );
        assert_eq!(parts[3][0], 7);
    }

    #[test]
    #[should_panic(expected = "overlaps")]
    fn carve_rejects_overlap() {
        let mut b = vec![0u8; 10];
        let _: Vec<&mut [u8]> = carve(&mut b, [2..5, 4..6]).collect();
    }

    #[test]
    fn all_reduce_matches_reference() {
        testkit::check_all_reduce(1..=8, ALL_REDUCE_DTYPES, |team, ctx, count, buf, op| {
            let esz = ctx.esz();
            DirectAllReduce::new(team.clone(), count * esz).run(ctx, buf, op, &mut Vec::new())
        });
    }

    #[test]
    fn reduce_scatter_matches_reference() {
        testkit::check_reduce_scatter(1..=8, |team, ctx, chunks, buf, op| {
            DirectReduceScatter::new(team.clone(), chunks.to_vec()).run(
                ctx,
                buf,
                op,
                &mut Vec::new(),
            )
        });
    }

    #[test]
    fn all_gather_fills_every_chunk() {
        testkit::check_all_gather(1..=8, |team, ctx, chunks, buf| {
            DirectAllGather::new(team.clone(), chunks.to_vec()).run(ctx, buf)
        });
    }

    /// Block sizes vary with (sender, receiver), including empty blocks; output ranges are laid
    /// out in reverse member order to exercise out-of-order carving.
    fn check_all_to_all(pairwise: bool) {
        let size = |i: usize, j: usize| (i * 3 + j * 5) % 4;
        for p in 1..=7 {
            let outs = testkit::run_ranks(p, |me, ctx| {
                let team = Team::world(me, p);
                let mut send = Vec::new();
                let mut off = 0;
                for j in 0..p {
                    send.push(off..off + size(me, j));
                    off += size(me, j);
                }
                let input: Vec<u8> = (0..off).map(|b| (me * 50 + b) as u8).collect();
                let mut recv = vec![0..0; p];
                let mut off = 0;
                for j in (0..p).rev() {
                    recv[j] = off..off + size(j, me);
                    off += size(j, me);
                }
                let mut output = vec![0xffu8; off];
                AllToAll::new(team, send, recv.clone(), pairwise)
                    .run(ctx, &input, &mut output)
                    .unwrap();
                (output, recv)
            });
            for (me, (output, recv)) in outs.iter().enumerate() {
                for j in 0..p {
                    let start: usize = (0..me).map(|k| size(j, k)).sum();
                    let want: Vec<u8> = (start..start + size(j, me))
                        .map(|b| (j * 50 + b) as u8)
                        .collect();
                    assert_eq!(
                        &output[recv[j].clone()],
                        &want[..],
                        "p={p} pairwise={pairwise} {j}->{me}"
                    );
                }
            }
        }
    }

    #[test]
    fn all_to_all_direct() {
        check_all_to_all(false);
    }

    #[test]
    fn all_to_all_pairwise() {
        check_all_to_all(true);
    }

    #[test]
    fn barrier_completes_on_every_size() {
        for p in 1..=8 {
            let rounds = testkit::run_ranks(p, |me, ctx| {
                let b = Barrier::new(Team::world(me, p));
                for _ in 0..3 {
                    b.run(ctx).unwrap();
                }
                ctx.op.bytes_sent
            });
            let lg = (p as f64).log2().ceil() as u64;
            // Three barriers of ⌈log2 p⌉ header-only messages each.
            assert!(
                rounds
                    .iter()
                    .all(|&b| b == 3 * lg * crate::frame::HEADER_LEN as u64),
                "p={p} {rounds:?}"
            );
        }
    }

    #[test]
    fn all_reduce_on_sub_team() {
        testkit::check_sub_team(|team, ctx, count, buf, op| {
            let esz = ctx.esz();
            DirectAllReduce::new(team.clone(), count * esz).run(ctx, buf, op, &mut Vec::new())
        });
    }

    #[test]
    fn reduce_scatter_scratch_is_reused() {
        let outs = testkit::run_ranks(3, |me, ctx| {
            ctx.op.dtype = DType::I64;
            let chunks = partition(6, 3, 8);
            let mut scratch = vec![0u8; 1000];
            let mut buf = testkit::input(DType::I64, me, 6, 0);
            DirectReduceScatter::new(Team::world(me, 3), chunks)
                .run(ctx, &mut buf, ReduceOp::Sum, &mut scratch)
                .unwrap();
            scratch.len()
        });
        assert_eq!(outs, vec![1000; 3]);
    }
}
