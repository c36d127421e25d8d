//! The collective operations of a [`ProcessGroup`]: typed entry points over byte-level ones,
//! and the dispatch from the selected [`Algo`] to its implementation.

use super::core::{OpOptions, ProcessGroup, Turn};
use crate::algo::direct::{
    AllToAll, Barrier, DirectAllGather, DirectAllReduce, DirectReduceScatter,
};
use crate::algo::direct_read::{DrAllGather, DrAllReduce, DrBroadcast, DrReduceScatter, Peers};
use crate::algo::double_tree::DoubleTreeAllReduce;
use crate::algo::halving_doubling::{HdAllGather, HdAllReduce, HdReduceScatter};
use crate::algo::hierarchical::HierAllReduce;
use crate::algo::ring::{
    RingAllGather, RingAllReduce, RingBroadcast, RingReduce, RingReduceScatter,
};
use crate::algo::tree::{TreeAllReduce, TreeBroadcast, TreeReduce};
use crate::algo::{Algo, Team, partition};
use crate::dtype::{DType, Element, ReduceOp, as_bytes, as_bytes_mut, finish_reduce};
use crate::engine::Xfer;
use crate::error::{CommError, Result};
use crate::frame::OpKind;
use std::ops::Range;

fn check_elems(what: &str, len: usize, dtype: DType) -> Result<usize> {
    if !len.is_multiple_of(dtype.size()) {
        return Err(CommError::InvalidArgument(format!(
            "{what}: {len} bytes is not a whole number of {} elements",
            dtype.name()
        )));
    }
    Ok(len / dtype.size())
}

/// Byte ranges of consecutive blocks of `counts[i]` elements.
fn blocks(counts: &[usize], esz: usize) -> Vec<Range<usize>> {
    let mut off = 0;
    counts
        .iter()
        .map(|&c| {
            let r = off..off + c * esz;
            off = r.end;
            r
        })
        .collect()
}

/// Signature of a rooted op: element count with the root folded into the top bits.
fn rooted(count: usize, root: usize) -> u64 {
    count as u64 ^ ((root as u64) << 48)
}

fn unsupported(algo: Algo, kind: OpKind) -> CommError {
    CommError::InvalidArgument(format!(
        "algorithm {} does not implement {}",
        algo.name(),
        kind.name()
    ))
}

impl ProcessGroup {
    fn team(&self) -> Team {
        Team::world(self.rank(), self.size())
    }

    fn peers(&self) -> Peers {
        Peers::new(self.team(), self.inner.pids.clone())
    }

    fn check_root(&self, root: usize) -> Result<()> {
        if root >= self.size() {
            return Err(CommError::InvalidArgument(format!(
                "root {root} is not a rank of group '{}' (size {})",
                self.name(),
                self.size()
            )));
        }
        Ok(())
    }

    // === all-reduce ===

    /// Sums (or min/max/prod/avg) `buf` element-wise across all ranks; every rank gets the result.
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce_with(buf, op, &OpOptions::default())
    }

    /// [`all_reduce`](Self::all_reduce) with per-call options.
    pub fn all_reduce_with<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
        opts: &OpOptions,
    ) -> Result<()> {
        self.all_reduce_bytes(as_bytes_mut(buf), T::DTYPE, op, opts)
    }

    /// All-reduce over raw bytes holding `dtype` elements.
    pub fn all_reduce_bytes(
        &self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        opts: &OpOptions,
    ) -> Result<()> {
        check_elems("all_reduce", buf.len(), dtype)?;
        self.all_reduce_turn(self.collective_turn(), buf, dtype, op, opts)
    }

    pub(crate) fn all_reduce_turn(
        &self,
        turn: Turn,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        opts: &OpOptions,
    ) -> Result<()> {
        let (esz, count, size) = (dtype.size(), buf.len() / dtype.size(), self.size());
        let team = self.team();
        let host_of = self.host_of().to_vec();
        let rank = self.rank();
        let peers = self.peers();
        let (direct_read, pids) = (
            self.inner.topo.direct_read.is_some(),
            self.inner.pids.clone(),
        );
        self.run_op(turn, OpKind::AllReduce, dtype, count as u64, buf.len(), opts, |ctx, algo, s| {
            match algo {
                Algo::Ring => RingAllReduce::new(team, count, esz).run(ctx, buf, op),
                Algo::Tree => TreeAllReduce::new(team).run(ctx, buf, op, &mut s.algo),
                Algo::DoubleTree => DoubleTreeAllReduce::new(team, count, esz).run(ctx, buf, op, &mut s.algo),
                Algo::HalvingDoubling => HdAllReduce::new(team, count, esz).run(ctx, buf, op, &mut s.algo),
                Algo::Direct => DirectAllReduce::new(team, buf.len()).run(ctx, buf, op, &mut s.algo),
                Algo::DirectRead => DrAllReduce::new(peers, count, esz).run(ctx, buf, op, &mut s.algo),
                Algo::Hierarchical => HierAllReduce::new(rank, &host_of, count, esz)
                    .map(|h| if direct_read { h.with_direct_read(&pids) } else { h })
                    .ok_or_else(|| CommError::InvalidArgument("hierarchical all_reduce needs at least 2 hosts with the same number of ranks each".into()))?
                    .run(ctx, buf, op, &mut s.algo),
                a => Err(unsupported(a, OpKind::AllReduce)),
            }?;
            finish_reduce(dtype, op, buf, size);
            Ok(())
        })
    }

    // === reduce-scatter ===

    /// Reduces `input` (size x `output.len()` elements) across ranks; rank r gets block r.
    pub fn reduce_scatter<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.reduce_scatter_with(input, output, op, &OpOptions::default())
    }

    /// [`reduce_scatter`](Self::reduce_scatter) with per-call options.
    pub fn reduce_scatter_with<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
        opts: &OpOptions,
    ) -> Result<()> {
        self.reduce_scatter_bytes(as_bytes(input), as_bytes_mut(output), T::DTYPE, op, opts)
    }

    /// Reduce-scatter over raw bytes.
    pub fn reduce_scatter_bytes(
        &self,
        input: &[u8],
        output: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        opts: &OpOptions,
    ) -> Result<()> {
        check_elems("reduce_scatter output", output.len(), dtype)?;
        if input.len() != output.len() * self.size() {
            return Err(CommError::InvalidArgument(format!(
                "reduce_scatter: input has {} bytes, expected group size {} x output {} bytes",
                input.len(),
                self.size(),
                output.len()
            )));
        }
        self.reduce_scatter_turn(self.collective_turn(), input, output, dtype, op, opts)
    }

    pub(crate) fn reduce_scatter_turn(
        &self,
        turn: Turn,
        input: &[u8],
        output: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        opts: &OpOptions,
    ) -> Result<()> {
        let (esz, size, rank) = (dtype.size(), self.size(), self.rank());
        let count = input.len() / esz;
        let team = self.team();
        let peers = self.peers();
        self.run_op(
            turn,
            OpKind::ReduceScatter,
            dtype,
            count as u64,
            input.len(),
            opts,
            |ctx, algo, s| {
                let chunks = partition(count, size, esz);
                if algo == Algo::DirectRead {
                    // Single copy: reads the peers' inputs in place, no staging.
                    DrReduceScatter::new(peers, chunks).run(ctx, input, output, op, &mut s.algo)?;
                    finish_reduce(dtype, op, output, size);
                    return Ok(());
                }
                let (stage, tmp) = s.stage_copy(input);
                match algo {
                    Algo::Ring => RingReduceScatter::new(team, chunks.clone()).run(ctx, stage, op),
                    Algo::HalvingDoubling => {
                        HdReduceScatter::new(team, chunks.clone()).run(ctx, stage, op, tmp)
                    }
                    Algo::Direct => {
                        DirectReduceScatter::new(team, chunks.clone()).run(ctx, stage, op, tmp)
                    }
                    a => Err(unsupported(a, OpKind::ReduceScatter)),
                }?;
                output.copy_from_slice(&stage[chunks[rank].clone()]);
                finish_reduce(dtype, op, output, size);
                Ok(())
            },
        )
    }

    // === all-gather ===

    /// Concatenates every rank's `input` (equal sizes) into `output` on every rank.
    pub fn all_gather<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        let counts = vec![input.len(); self.size()];
        self.all_gather_v_with(input, output, &counts, &OpOptions::default())
    }

    /// Variable-size all-gather: rank i contributes `counts[i]` elements.
    pub fn all_gather_v<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        counts: &[usize],
    ) -> Result<()> {
        self.all_gather_v_with(input, output, counts, &OpOptions::default())
    }

    /// [`all_gather_v`](Self::all_gather_v) with per-call options.
    pub fn all_gather_v_with<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        counts: &[usize],
        opts: &OpOptions,
    ) -> Result<()> {
        self.all_gather_bytes(
            as_bytes(input),
            as_bytes_mut(output),
            counts,
            T::DTYPE,
            opts,
        )
    }

    /// All-gather over raw bytes; `counts` in elements.
    pub fn all_gather_bytes(
        &self,
        input: &[u8],
        output: &mut [u8],
        counts: &[usize],
        dtype: DType,
        opts: &OpOptions,
    ) -> Result<()> {
        let esz = dtype.size();
        let n = check_elems("all_gather input", input.len(), dtype)?;
        if counts.len() != self.size()
            || counts[self.rank()] != n
            || counts.iter().sum::<usize>() * esz != output.len()
        {
            return Err(CommError::InvalidArgument(format!(
                "all_gather: counts {counts:?} must have one entry per rank (size {}), entry {} = input length {n}, and sum to the output length {}",
                self.size(),
                self.rank(),
                output.len() / esz
            )));
        }
        self.all_gather_turn(self.collective_turn(), input, output, counts, dtype, opts)
    }

    pub(crate) fn all_gather_turn(
        &self,
        turn: Turn,
        input: &[u8],
        output: &mut [u8],
        counts: &[usize],
        dtype: DType,
        opts: &OpOptions,
    ) -> Result<()> {
        let chunks = blocks(counts, dtype.size());
        let team = self.team();
        let total: usize = counts.iter().sum();
        let mine = chunks[self.rank()].clone();
        let peers = self.peers();
        self.run_op(
            turn,
            OpKind::AllGather,
            dtype,
            total as u64,
            output.len(),
            opts,
            |ctx, algo, _| {
                output[mine].copy_from_slice(input);
                match algo {
                    Algo::Ring => RingAllGather::new(team, chunks).run(ctx, output),
                    Algo::HalvingDoubling => HdAllGather::new(team, chunks).run(ctx, output),
                    Algo::Direct => DirectAllGather::new(team, chunks).run(ctx, output),
                    Algo::DirectRead => DrAllGather::new(peers, chunks).run(ctx, output),
                    a => Err(unsupported(a, OpKind::AllGather)),
                }
            },
        )
    }

    // === broadcast and reduce ===

    /// Copies `root`'s `buf` into every rank's `buf`.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.broadcast_bytes(as_bytes_mut(buf), T::DTYPE, root, &OpOptions::default())
    }

    /// Broadcast over raw bytes.
    pub fn broadcast_bytes(
        &self,
        buf: &mut [u8],
        dtype: DType,
        root: usize,
        opts: &OpOptions,
    ) -> Result<()> {
        let count = check_elems("broadcast", buf.len(), dtype)?;
        self.check_root(root)?;
        let team = self.team();
        let peers = self.peers();
        self.run_op(
            self.collective_turn(),
            OpKind::Broadcast,
            dtype,
            rooted(count, root),
            buf.len(),
            opts,
            |ctx, algo, _| match algo {
                Algo::Ring => RingBroadcast::new(team, root, buf.len(), dtype.size()).run(ctx, buf),
                Algo::Tree => TreeBroadcast::new(team, root).run(ctx, buf),
                Algo::DirectRead => DrBroadcast::new(peers, root).run(ctx, buf),
                a => Err(unsupported(a, OpKind::Broadcast)),
            },
        )
    }

    /// Reduces every rank's `buf` into `root`'s `buf`; other ranks' buffers are left unchanged.
    pub fn reduce<T: Element>(&self, buf: &mut [T], root: usize, op: ReduceOp) -> Result<()> {
        self.reduce_bytes(as_bytes_mut(buf), T::DTYPE, root, op, &OpOptions::default())
    }

    /// Reduce over raw bytes.
    pub fn reduce_bytes(
        &self,
        buf: &mut [u8],
        dtype: DType,
        root: usize,
        op: ReduceOp,
        opts: &OpOptions,
    ) -> Result<()> {
        let count = check_elems("reduce", buf.len(), dtype)?;
        self.check_root(root)?;
        let (team, size, is_root) = (self.team(), self.size(), self.rank() == root);
        self.run_op(
            self.collective_turn(),
            OpKind::Reduce,
            dtype,
            rooted(count, root),
            buf.len(),
            opts,
            |ctx, algo, s| {
                let (stage, tmp) = s.stage_copy(buf);
                match algo {
                    Algo::Ring => {
                        RingReduce::new(team, root, count, dtype.size()).run(ctx, stage, op)
                    }
                    Algo::Tree => TreeReduce::new(team, root).run(ctx, stage, op, tmp),
                    a => Err(unsupported(a, OpKind::Reduce)),
                }?;
                if is_root {
                    buf.copy_from_slice(stage);
                    finish_reduce(dtype, op, buf, size);
                }
                Ok(())
            },
        )
    }

    // === all-to-all ===

    /// Rank i's block j (equal blocks) goes to rank j's block i.
    pub fn all_to_all<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        let p = self.size();
        if input.len() != output.len() || !input.len().is_multiple_of(p) {
            return Err(CommError::InvalidArgument(format!(
                "all_to_all: input ({}) and output ({}) must have equal lengths divisible by the group size {p}",
                input.len(),
                output.len()
            )));
        }
        let counts = vec![input.len() / p; p];
        self.all_to_all_v_with(input, &counts, output, &counts, &OpOptions::default())
    }

    /// Variable all-to-all: `send_counts[j]` elements go to rank j, `recv_counts[j]` come from it.
    pub fn all_to_all_v<T: Element>(
        &self,
        input: &[T],
        send_counts: &[usize],
        output: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        self.all_to_all_v_with(
            input,
            send_counts,
            output,
            recv_counts,
            &OpOptions::default(),
        )
    }

    /// [`all_to_all_v`](Self::all_to_all_v) with per-call options.
    pub fn all_to_all_v_with<T: Element>(
        &self,
        input: &[T],
        send_counts: &[usize],
        output: &mut [T],
        recv_counts: &[usize],
        opts: &OpOptions,
    ) -> Result<()> {
        let p = self.size();
        if send_counts.len() != p
            || recv_counts.len() != p
            || send_counts.iter().sum::<usize>() != input.len()
            || recv_counts.iter().sum::<usize>() != output.len()
        {
            return Err(CommError::InvalidArgument(format!(
                "all_to_all_v: send_counts {send_counts:?} must sum to the input length {} and recv_counts {recv_counts:?} to the output length {}, one entry per rank (size {p})",
                input.len(),
                output.len()
            )));
        }
        let esz = T::DTYPE.size();
        let (send, recv) = (blocks(send_counts, esz), blocks(recv_counts, esz));
        let team = self.team();
        let (ib, ob) = (as_bytes(input), as_bytes_mut(output));
        let equal = send_counts.iter().all(|&c| c == send_counts[0]) && send_counts == recv_counts;
        let signature = if equal { input.len() as u64 } else { u64::MAX };
        self.run_op(
            self.collective_turn(),
            OpKind::AllToAll,
            T::DTYPE,
            signature,
            ib.len(),
            opts,
            |ctx, algo, _| match algo {
                Algo::Direct => AllToAll::new(team, send, recv, false).run(ctx, ib, ob),
                Algo::Pairwise => AllToAll::new(team, send, recv, true).run(ctx, ib, ob),
                a => Err(unsupported(a, OpKind::AllToAll)),
            },
        )
    }

    // === barrier and point-to-point ===

    /// Returns once every rank has entered the barrier.
    pub fn barrier(&self) -> Result<()> {
        self.barrier_with(&OpOptions::default())
    }

    /// [`barrier`](Self::barrier) with per-call options.
    pub fn barrier_with(&self, opts: &OpOptions) -> Result<()> {
        let team = self.team();
        self.run_op(
            self.collective_turn(),
            OpKind::Barrier,
            DType::U8,
            0,
            0,
            opts,
            |ctx, _, _| Barrier::new(team).run(ctx),
        )
    }

    fn p2p_turn(&self, peer: usize, sending: bool) -> Result<Turn> {
        if peer >= self.size() || peer == self.rank() {
            return Err(CommError::InvalidArgument(format!(
                "peer {peer} is not another rank of group '{}' (size {})",
                self.name(),
                self.size()
            )));
        }
        let m = if sending {
            &self.inner.p2p_send
        } else {
            &self.inner.p2p_recv
        };
        let mut v = m.lock().unwrap_or_else(|p| p.into_inner());
        let seq = v[peer];
        v[peer] += 1;
        Ok(Turn {
            ticket: self.inner.gate.take(),
            seq,
        })
    }

    /// Sends `buf` to `peer` (matched by that rank's `recv` from this one, in call order).
    pub fn send<T: Element>(&self, buf: &[T], peer: usize) -> Result<()> {
        let turn = self.p2p_turn(peer, true)?;
        let data = as_bytes(buf);
        self.run_op(
            turn,
            OpKind::SendRecv,
            T::DTYPE,
            buf.len() as u64,
            data.len(),
            &OpOptions::default(),
            |ctx, _, _| ctx.exchange(&mut [Xfer::Send { peer, data }]),
        )
    }

    /// Receives exactly `buf.len()` elements from `peer`.
    pub fn recv<T: Element>(&self, buf: &mut [T], peer: usize) -> Result<()> {
        let turn = self.p2p_turn(peer, false)?;
        let count = buf.len() as u64;
        let dst = as_bytes_mut(buf);
        let len = dst.len();
        self.run_op(
            turn,
            OpKind::SendRecv,
            T::DTYPE,
            count,
            len,
            &OpOptions::default(),
            |ctx, _, _| ctx.exchange(&mut [Xfer::Recv { peer, buf: dst }]),
        )
    }
}
