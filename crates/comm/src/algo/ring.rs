//! Ring algorithms: reduce-scatter, all-gather, all-reduce, broadcast and reduce.
//!
//! Reduce-scatter: p-1 steps; in step s member m sends chunk (m-s-1) mod p to its successor and
//! reduces chunk (m-s-2) mod p arriving from its predecessor, so chunk c travels c+1 → c+2 → … → c
//! and ends, fully reduced, on member c. All-gather then circulates the finished chunks the same
//! way in p-1 more steps. Each rank sends (p-1)/p·n bytes per phase.
//!
//! Cost (004 eqs. 28.11-28.12, 000 F16), p ranks, n bytes, per-byte reduction cost γ:
//! - reduce-scatter / all-gather: `(p-1)·α + (p-1)/p·n·β⁻¹` (+ `(p-1)/p·n·γ` for reduce-scatter)
//! - all-reduce: `2(p-1)·α + 2(p-1)/p·n·β⁻¹ + (p-1)/p·n·γ`
//! - broadcast (pipelined chain, s segments): `(s+p-2)·(α + n/s·β⁻¹)`
//! - reduce: reduce-scatter, then the root gathers the chunks: `2(p-1)·α + 2(p-1)/p·n·β⁻¹`
//!
//! Receives reduce each piece as it arrives (see [`crate::engine`]), so receive and reduce overlap.

use super::direct::carve;
use super::{Ctx, Team, partition, split_ref_mut};
use crate::dtype::ReduceOp;
use crate::engine::Xfer;
use crate::error::Result;
use std::ops::Range;

/// Ring reduce-scatter over byte `chunks` of one buffer; afterwards member m's chunk m is reduced.
pub struct RingReduceScatter {
    team: Team,
    chunks: Vec<Range<usize>>,
}

impl RingReduceScatter {
    /// Plans a reduce-scatter of `chunks` (one per team member, in member order).
    pub fn new(team: Team, chunks: Vec<Range<usize>>) -> Self {
        debug_assert_eq!(team.size(), chunks.len());
        RingReduceScatter { team, chunks }
    }

    /// Plans the balanced partition of `count` elements of `esz` bytes.
    pub fn balanced(team: Team, count: usize, esz: usize) -> Self {
        let chunks = partition(count, team.size(), esz);
        Self::new(team, chunks)
    }

    /// Runs it in place on `buf`.
    pub fn run(&self, ctx: &mut Ctx<'_>, buf: &mut [u8], op: ReduceOp) -> Result<()> {
        let p = self.team.size();
        if p == 1 {
            return Ok(());
        }
        let m = self.team.me;
        pipelined(
            ctx,
            &self.team,
            &self.chunks,
            buf,
            |s| (m + 2 * p - s - 1) % p,
            |s| (m + 2 * p - s - 2) % p,
            Some(op),
        )
    }
}

/// Segment size of the pipelined ring: chunks move in segments of this size, so a segment
/// reduced (or received) in one step is forwarded in the next while later segments are still
/// arriving, and no step waits for a whole chunk.
pub const RING_SEGMENT_BYTES: usize = 2 << 20;

/// Drives p-1 ring steps over segments of `chunks`. Step s sends chunk `send_of(s)` to the
/// successor and receives chunk `recv_of(s)` from the predecessor (reducing it with `op`, or
/// copying it when `op` is None); `send_of(s+1) == recv_of(s)` is what makes it a ring.
///
/// Exchange k carries, for every step s, segment j = k - s of that step's chunks, so segment j
/// of step s is forwarded by step s+1 one exchange after it arrived: a software pipeline of
/// S + p - 2 exchanges for S segments per chunk. The ranges of one exchange are disjoint: step
/// s+1 sends segment j-1 of the chunk whose segment j step s is receiving.
fn pipelined(
    ctx: &mut Ctx<'_>,
    team: &Team,
    chunks: &[Range<usize>],
    buf: &mut [u8],
    send_of: impl Fn(usize) -> usize,
    recv_of: impl Fn(usize) -> usize,
    op: Option<ReduceOp>,
) -> Result<()> {
    let p = team.size();
    let esz = ctx.esz();
    let seg = (RING_SEGMENT_BYTES / esz).max(1) * esz;
    let seg_of = |c: &Range<usize>, j: usize| {
        (c.start + j * seg).min(c.end)..(c.start + (j + 1) * seg).min(c.end)
    };
    let nseg = chunks
        .iter()
        .map(|c| c.len().div_ceil(seg))
        .max()
        .unwrap_or(0);
    let (next, prev) = (team.next(1), team.prev(1));
    let mut ranges: Vec<(Range<usize>, bool)> = Vec::with_capacity(2 * p);
    for k in 0..nseg + p - 2 {
        ranges.clear();
        for s in 0..p - 1 {
            let Some(j) = k.checked_sub(s).filter(|&j| j < nseg) else {
                continue;
            };
            ranges.push((seg_of(&chunks[send_of(s)], j), true));
            ranges.push((seg_of(&chunks[recv_of(s)], j), false));
        }
        ranges.retain(|(r, _)| !r.is_empty());
        if ranges.is_empty() {
            continue;
        }
        let mut order: Vec<usize> = (0..ranges.len()).collect();
        order.sort_by_key(|&i| ranges[i].0.start);
        let mut slices: Vec<Option<&mut [u8]>> = (0..ranges.len()).map(|_| None).collect();
        for (i, sl) in order
            .iter()
            .zip(carve(buf, order.iter().map(|&i| ranges[i].0.clone())))
        {
            slices[*i] = Some(sl);
        }
        let mut xs: Vec<Xfer<'_>> = ranges
            .iter()
            .zip(slices)
            .map(|((_, is_send), sl)| {
                let sl = sl.expect("every range carved");
                match (is_send, op) {
                    (true, _) => Xfer::Send {
                        peer: next,
                        data: sl,
                    },
                    (false, Some(op)) => Xfer::RecvReduce {
                        peer: prev,
                        acc: sl,
                        op,
                    },
                    (false, None) => Xfer::Recv {
                        peer: prev,
                        buf: sl,
                    },
                }
            })
            .collect();
        ctx.exchange(&mut xs)?;
    }
    Ok(())
}

/// Ring all-gather over byte `chunks`; member m starts with chunk m, ends with all of them.
pub struct RingAllGather {
    team: Team,
    chunks: Vec<Range<usize>>,
}

impl RingAllGather {
    /// Plans an all-gather of `chunks` (one per member, any sizes).
    pub fn new(team: Team, chunks: Vec<Range<usize>>) -> Self {
        debug_assert_eq!(team.size(), chunks.len());
        RingAllGather { team, chunks }
    }

    /// Runs it in place on `buf`.
    pub fn run(&self, ctx: &mut Ctx<'_>, buf: &mut [u8]) -> Result<()> {
        let p = self.team.size();
        if p == 1 {
            return Ok(());
        }
        let m = self.team.me;
        pipelined(
            ctx,
            &self.team,
            &self.chunks,
            buf,
            |s| (m + p - s) % p,
            |s| (m + 2 * p - s - 1) % p,
            None,
        )
    }
}

/// Ring all-reduce: reduce-scatter then all-gather of balanced chunks.
pub struct RingAllReduce {
    rs: RingReduceScatter,
    ag: RingAllGather,
}

impl RingAllReduce {
    /// Plans an all-reduce of `count` elements of `esz` bytes.
    pub fn new(team: Team, count: usize, esz: usize) -> Self {
        let chunks = partition(count, team.size(), esz);
        RingAllReduce {
            rs: RingReduceScatter::new(team.clone(), chunks.clone()),
            ag: RingAllGather::new(team, chunks),
        }
    }

    /// Runs it in place (the caller applies the final average, if any).
    pub fn run(&self, ctx: &mut Ctx<'_>, buf: &mut [u8], op: ReduceOp) -> Result<()> {
        self.rs.run(ctx, buf, op)?;
        self.ag.run(ctx, buf)
    }
}

/// Segment size of the pipelined chain broadcast.
pub const BCAST_SEGMENT_BYTES: usize = 1 << 20;

/// Pipelined chain broadcast from team member `root` along the ring.
pub struct RingBroadcast {
    team: Team,
    root: usize,
    segments: Vec<Range<usize>>,
}

impl RingBroadcast {
    /// Plans a broadcast of `len` bytes from member `root`, in segments of whole elements.
    pub fn new(team: Team, root: usize, len: usize, esz: usize) -> Self {
        let seg = (BCAST_SEGMENT_BYTES / esz).max(1) * esz;
        let nseg = len.div_ceil(seg).max(1);
        let segments = (0..nseg)
            .map(|i| (i * seg).min(len)..((i + 1) * seg).min(len))
            .collect();
        RingBroadcast {
            team,
            root,
            segments,
        }
    }

    /// Runs it in place on `buf`.
    pub fn run(&self, ctx: &mut Ctx<'_>, buf: &mut [u8]) -> Result<()> {
        let p = self.team.size();
        if p == 1 {
            return Ok(());
        }
        // Position on the chain: 0 is the root, p-1 the last receiver.
        let pos = (self.team.me + p - self.root) % p;
        let (next, prev) = (self.team.next(1), self.team.prev(1));
        let nseg = self.segments.len();
        if pos == 0 {
            for seg in &self.segments {
                ctx.exchange(&mut [Xfer::Send {
                    peer: next,
                    data: &buf[seg.clone()],
                }])?;
            }
            return Ok(());
        }
        // Step k: receive segment k while forwarding segment k-1.
        for k in 0..=nseg {
            let mut xs: Vec<Xfer<'_>> = Vec::with_capacity(2);
            let fwd = (pos < p - 1 && k > 0).then(|| self.segments[k - 1].clone());
            let rcv = (k < nseg).then(|| self.segments[k].clone());
            match (fwd, rcv) {
                (Some(f), Some(r)) => {
                    let (data, dst) = split_ref_mut(buf, f, r);
                    xs.push(Xfer::Send { peer: next, data });
                    xs.push(Xfer::Recv {
                        peer: prev,
                        buf: dst,
                    });
                }
                (Some(f), None) => xs.push(Xfer::Send {
                    peer: next,
                    data: &buf[f],
                }),
                (None, Some(r)) => xs.push(Xfer::Recv {
                    peer: prev,
                    buf: &mut buf[r],
                }),
                (None, None) => {}
            }
            if !xs.is_empty() {
                ctx.exchange(&mut xs)?;
            }
        }
        Ok(())
    }
}

/// Ring reduce: reduce-scatter, then every member sends its finished chunk to the root.
pub struct RingReduce {
    rs: RingReduceScatter,
    team: Team,
    root: usize,
    chunks: Vec<Range<usize>>,
}

impl RingReduce {
    /// Plans a reduce of `count` elements of `esz` bytes to member `root`.
    pub fn new(team: Team, root: usize, count: usize, esz: usize) -> Self {
        let chunks = partition(count, team.size(), esz);
        RingReduce {
            rs: RingReduceScatter::new(team.clone(), chunks.clone()),
            team,
            root,
            chunks,
        }
    }

    /// Runs it; the root's `buf` holds the result, other buffers hold partial sums afterwards.
    pub fn run(&self, ctx: &mut Ctx<'_>, buf: &mut [u8], op: ReduceOp) -> Result<()> {
        self.rs.run(ctx, buf, op)?;
        let p = self.team.size();
        if p == 1 {
            return Ok(());
        }
        if self.team.me == self.root {
            let mut rest: &mut [u8] = buf;
            let mut base = 0;
            let mut xs = Vec::with_capacity(p - 1);
            for (i, c) in self.chunks.iter().enumerate() {
                let (_, tail) = std::mem::take(&mut rest).split_at_mut(c.start - base);
                let (mine, tail) = tail.split_at_mut(c.len());
                rest = tail;
                base = c.end;
                if i != self.root {
                    xs.push(Xfer::Recv {
                        peer: self.team.peer(i),
                        buf: mine,
                    });
                }
            }
            ctx.exchange(&mut xs)
        } else {
            let c = self.chunks[self.team.me].clone();
            ctx.exchange(&mut [Xfer::Send {
                peer: self.team.peer(self.root),
                data: &buf[c],
            }])
        }
    }
}
