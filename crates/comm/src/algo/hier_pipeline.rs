//! The single-copy hierarchical all-reduce, pipelined over segments so that the intra-host
//! phases of one segment run while the inter-host ring carries another.
//!
//! Segment k goes through intra-host reduce-scatter RS(k) (single-copy reads), the inter-host
//! ring all-reduce X(k) of this rank's shard, and intra-host all-gather AG(k). Two threads of
//! the calling rank share the work: the intra thread runs RS(0), RS(1), AG(0), RS(2), AG(1), …
//! over the shared-memory peers, the calling thread runs X(0), X(1), … over the remote peers.
//! Channels order RS(k) before X(k) and X(k) before AG(k). With K segments the cost drops from
//! `t_intra + t_inter` to about `max(t_intra, t_inter) + (t_intra + t_inter) / K`: on a slow
//! inter-host link only the first reduce-scatter and last all-gather segment stay exposed.
//!
//! Memory: at any moment the calling thread touches only this rank's shard of segment k, the
//! intra thread segments k+1 (RS) and k-1 (AG); peers' reads follow the same order (every host
//! member runs the same sequence, and AG(k) starts with a host barrier), so no byte is read
//! while it is written.

use super::direct_read::{DrAllReduce, Peers};
use super::ring::RingAllReduce;
use super::{Ctx, Team};
use crate::dtype::ReduceOp;
use crate::error::{CommError, Result};
use crate::transport::Link;
use std::ops::Range;
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::Instant;

/// Segment size: large enough that each phase streams, small enough that the first
/// reduce-scatter and the last all-gather (the exposed ends of the pipeline) are short: 32
/// segments at 64 MiB. Measured on 2 netns hosts x 2 ranks at 1 Gbit/s, 64 MiB (two runs each):
/// 8 MiB 565.4-568.1 ms, 4 MiB 563.1-564.1, 2 MiB 562.1-562.3, 1 MiB 562.1-562.2 ms, against
/// 561.4 ms for the 64 MiB on the wire at the link rate with TCP/IP framing (1514-byte frames
/// carry 1448 bytes).
pub const SEGMENT_BYTES: usize = 2 << 20;

/// What the pipeline needs of a [`super::hierarchical::HierAllReduce`].
pub struct Parts<'a> {
    pub host_team: &'a Team,
    pub cross_team: &'a Team,
    pub local_pids: &'a [i32],
    pub esz: usize,
}

/// A buffer shared by the two threads; each derives only the disjoint ranges the protocol above
/// allows it at that moment.
#[derive(Clone, Copy)]
struct Shared {
    base: *mut u8,
}

// SAFETY: the pointer is only dereferenced for ranges the two threads never use at the same
// time (see the module doc).
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

impl Shared {
    /// SAFETY: the caller owns `r` exclusively for the returned lifetime.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, r: Range<usize>) -> &mut [u8] {
        // SAFETY: r lies within the buffer the pointer came from (checked by the planner).
        unsafe { std::slice::from_raw_parts_mut(self.base.add(r.start), r.len()) }
    }
}

fn wait_for(rx: &Receiver<usize>, k: usize, deadline: Instant, what: &str) -> Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    match rx.recv_timeout(left) {
        Ok(got) if got == k => Ok(()),
        Ok(got) => Err(CommError::InvalidArgument(format!(
            "pipeline out of order: {what} {got}, expected {k}"
        ))),
        Err(RecvTimeoutError::Timeout) => Err(CommError::InvalidArgument(format!(
            "pipeline: {what} {k} not done before the deadline"
        ))),
        Err(RecvTimeoutError::Disconnected) => Err(CommError::InvalidArgument(format!(
            "pipeline: the other half stopped before {what} {k}"
        ))),
    }
}

/// Runs the pipelined all-reduce in place.
pub fn run(parts: Parts<'_>, ctx: &mut Ctx<'_>, buf: &mut [u8], op: ReduceOp) -> Result<()> {
    let esz = parts.esz;
    let seg = (SEGMENT_BYTES / esz).max(1) * esz;
    let segs: Vec<Range<usize>> = (0..buf.len().div_ceil(seg))
        .map(|k| k * seg..((k + 1) * seg).min(buf.len()))
        .collect();
    let plans: Vec<(DrAllReduce, RingAllReduce)> = segs
        .iter()
        .map(|r| {
            let dr = DrAllReduce::new(
                Peers::new(parts.host_team.clone(), parts.local_pids.to_vec()),
                r.len() / esz,
                esz,
            );
            let own = dr.own_chunk();
            (
                dr,
                RingAllReduce::new(parts.cross_team.clone(), own.len() / esz, esz),
            )
        })
        .collect();
    // The intra thread drives the host's peers; this thread keeps the remote ones.
    let me = parts.host_team.peer(parts.host_team.me);
    let local: Vec<usize> = parts
        .host_team
        .ranks
        .iter()
        .copied()
        .filter(|&r| r != me)
        .collect();
    let mut intra_links: Vec<Option<Box<dyn Link>>> = (0..ctx.links.len()).map(|_| None).collect();
    for &r in &local {
        intra_links[r] = ctx.links[r].take();
    }
    let intra_op = ctx.op.fork();
    let deadline = ctx.op.deadline;
    let shared = Shared {
        base: buf.as_mut_ptr(),
    };
    let (rs_tx, rs_rx) = channel::<usize>();
    let (x_tx, x_rx) = channel::<usize>();
    let (segs, plans) = (&segs, &plans);
    let (inter_result, intra_result) = std::thread::scope(|sc| {
        let intra_links = &mut intra_links;
        let intra = sc.spawn(move || -> (Result<()>, crate::engine::OpCtx) {
            let mut ictx = Ctx {
                links: intra_links,
                op: intra_op,
            };
            let mut scratch = Vec::new();
            let mut addrs: Vec<Vec<usize>> = vec![Vec::new(); segs.len()];
            let mut step = || -> Result<()> {
                for k in 0..=segs.len() {
                    if k < segs.len() {
                        // SAFETY: segment k is not touched by the other thread until RS(k) is sent.
                        let s = unsafe { shared.slice(segs[k].clone()) };
                        addrs[k] = plans[k]
                            .0
                            .reduce_own_chunk(&mut ictx, s, op, &mut scratch)?;
                        let _ = rs_tx.send(k);
                    }
                    if k >= 1 {
                        let j = k - 1;
                        wait_for(&x_rx, j, deadline, "inter-host all-reduce of segment")?;
                        // SAFETY: X(j) is done; segment j is ours again.
                        let s = unsafe { shared.slice(segs[j].clone()) };
                        plans[j].0.gather_chunks(&mut ictx, s, &addrs[j])?;
                    }
                }
                Ok(())
            };
            let r = step();
            drop(rs_tx);
            (r, ictx.op)
        });
        let inter = (|| -> Result<()> {
            for (k, (r, (dr, ring))) in segs.iter().zip(plans).enumerate() {
                wait_for(&rs_rx, k, deadline, "intra-host reduce-scatter of segment")?;
                let own = dr.own_chunk();
                // SAFETY: RS(k) is done and AG(k) waits for us: this shard is ours alone.
                let s = unsafe { shared.slice(r.start + own.start..r.start + own.end) };
                ring.run(ctx, s, op)?;
                let _ = x_tx.send(k);
            }
            Ok(())
        })();
        drop(x_tx);
        let intra = intra.join().unwrap_or_else(|_| {
            (
                Err(CommError::InvalidArgument(
                    "intra-host thread panicked".into(),
                )),
                ctx.op.fork(),
            )
        });
        (inter, intra)
    });
    for &r in &local {
        ctx.links[r] = intra_links[r].take();
    }
    let (intra_res, intra_op) = intra_result;
    ctx.op.absorb(&intra_op, &local);
    // Report the real failure, not the other half's "stopped" echo of it.
    match (inter_result, intra_res) {
        (Ok(()), Ok(())) => Ok(()),
        (Err(e), Ok(())) | (Ok(()), Err(e)) => Err(e),
        (Err(a), Err(b)) => Err(if matches!(a, CommError::InvalidArgument(_)) {
            b
        } else {
            a
        }),
    }
}
