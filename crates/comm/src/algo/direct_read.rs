//! Single-copy intra-host collectives: every rank reads its peers' buffers in place through
//! Linux cross-memory attach (`process_vm_readv`), the way Open MPI's vader/CMA and NCCL's P2P
//! read work. No ring buffer sits in between, so each byte is copied once, and nobody ever waits
//! for ring space: a step is bounded only by memory bandwidth.
//!
//! Protocol of every op (members of one host only): (1) an all-gather of buffer addresses (one
//! direct step of 8-byte messages), (2) the reads, (3) a dissemination barrier so no rank reuses
//! its buffer while a peer may still read it. The all-reduce adds a barrier between its
//! reduce-scatter and all-gather halves, because the all-gather overwrites regions peers read in
//! the first half.
//!
//! Cost, p ranks on a host with c cores (s = max(1, p/c) ranks share a core), n bytes, β_r the
//! single-core `process_vm_readv` bandwidth, γ the reduction cost, L = ⌈log2 p⌉:
//! - all-reduce: `(2 + 2L)·α + s·((p-1)/p·n·(2/β_r + γ))`
//! - reduce-scatter (n = input): `(1 + L)·α + s·((p-1)/p·n·(1/β_r + γ) + n/p/β_r)`
//! - all-gather (n = output): `(1 + L)·α + s·(p-1)/p·n/β_r`
//! - broadcast: `(1 + L)·α + (p-1)·n/(β_r·min(p-1, c))`
//!
//! Determinism: each result chunk is reduced by exactly one rank, in member order (own buffer
//! first, then the others in increasing member order), and copied by everyone else.
//!
//! Memory safety: the kernel reads a peer's memory while that peer holds the buffer; the barriers
//! guarantee no rank writes a region while another reads it (see each `run`).

use super::direct::{Barrier, DirectAllGather, ensure_scratch};
use super::{Ctx, Team, partition};
use crate::dtype::{ReduceOp, reduce_into};
use crate::error::{CommError, Result};
use std::ops::Range;

/// Bytes read per `process_vm_readv` when reducing: the piece and the accumulator stay in L2.
pub const PIECE_BYTES: usize = 256 * 1024;

/// A byte that [`probe`] reads from a peer to test whether cross-memory attach is permitted.
pub static PROBE_BYTE: u8 = 0xA5;

/// Reads `dst.len()` bytes at address `addr` of process `pid` into `dst`.
pub fn read_remote(pid: i32, addr: usize, dst: &mut [u8]) -> std::io::Result<()> {
    let mut done = 0;
    while done < dst.len() {
        let local = libc::iovec {
            iov_base: dst[done..].as_mut_ptr().cast(),
            iov_len: dst.len() - done,
        };
        let remote = libc::iovec {
            iov_base: (addr + done) as *mut libc::c_void,
            iov_len: dst.len() - done,
        };
        // SAFETY: `local` describes writable memory we own; the kernel validates `remote`
        // against the target's address space and fails with EFAULT rather than touching anything
        // else.
        let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "process_vm_readv read nothing",
            ));
        }
        done += n as usize;
    }
    Ok(())
}

/// Whether this process may read process `pid`'s memory, tested on the byte at `probe_addr`
/// (that process's [`PROBE_BYTE`]).
pub fn probe(pid: i32, probe_addr: usize) -> bool {
    let mut b = [0u8; 1];
    read_remote(pid, probe_addr, &mut b).is_ok() && b[0] == PROBE_BYTE
}

/// The temporary piece buffer: at most [`PIECE_BYTES`], carved from the group's scratch.
fn piece_buf(scratch: &mut Vec<u8>, want: usize) -> &mut [u8] {
    let len = PIECE_BYTES.min(want).max(1);
    ensure_scratch(scratch, len);
    &mut scratch[..len]
}

/// What every direct-read algorithm needs: the team and each member's process id.
#[derive(Debug, Clone)]
pub struct Peers {
    team: Team,
    pids: Vec<i32>,
}

impl Peers {
    /// `pids[i]` is the process of team member i.
    pub fn new(team: Team, pids: Vec<i32>) -> Self {
        debug_assert_eq!(team.size(), pids.len());
        Peers { team, pids }
    }

    /// Publishes this rank's buffer address and learns every member's.
    fn exchange_addrs(&self, ctx: &mut Ctx<'_>, mine: usize) -> Result<Vec<usize>> {
        let p = self.team.size();
        let mut raw = vec![0u8; p * 8];
        raw[self.team.me * 8..][..8].copy_from_slice(&(mine as u64).to_le_bytes());
        DirectAllGather::new(self.team.clone(), partition(p, p, 8)).run(ctx, &mut raw)?;
        Ok(raw
            .chunks(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")) as usize)
            .collect())
    }

    fn barrier(&self, ctx: &mut Ctx<'_>) -> Result<()> {
        Barrier::new(self.team.clone()).run(ctx)
    }

    /// Reads member `m`'s bytes `[off, off+dst.len())` of the buffer at `addrs[m]`.
    fn read(
        &self,
        ctx: &Ctx<'_>,
        addrs: &[usize],
        m: usize,
        off: usize,
        dst: &mut [u8],
    ) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        read_remote(self.pids[m], addrs[m] + off, dst).map_err(|e| CommError::PeerLost {
            op: Box::new(ctx.op.desc.clone()),
            peer: self.team.peer(m),
            detail: format!("reading its memory (process {}): {e}", self.pids[m]),
            cause: None,
        })
    }

    /// Reduces into `acc` (which holds this rank's own values of `range`) the same range of every
    /// other member's buffer, piece by piece, in member order.
    fn reduce_range(
        &self,
        ctx: &Ctx<'_>,
        addrs: &[usize],
        range: Range<usize>,
        acc: &mut [u8],
        op: ReduceOp,
        tmp: &mut [u8],
    ) -> Result<()> {
        let dtype = ctx.dtype();
        let piece = (tmp.len() / dtype.size()).max(1) * dtype.size();
        let mut off = 0;
        while off < range.len() {
            let len = piece.min(range.len() - off);
            for m in (0..self.team.size()).filter(|&m| m != self.team.me) {
                self.read(ctx, addrs, m, range.start + off, &mut tmp[..len])?;
                reduce_into(dtype, op, &mut acc[off..off + len], &tmp[..len]);
            }
            off += len;
        }
        Ok(())
    }
}

/// Direct-read all-reduce over the balanced partition.
pub struct DrAllReduce {
    peers: Peers,
    chunks: Vec<Range<usize>>,
}

impl DrAllReduce {
    /// Plans an all-reduce of `count` elements of `esz` bytes.
    pub fn new(peers: Peers, count: usize, esz: usize) -> Self {
        let chunks = partition(count, peers.team.size(), esz);
        DrAllReduce { peers, chunks }
    }

    /// Runs it in place.
    ///
    /// Member m reduces chunk m into its own buffer, reading chunk m of the others (which they do
    /// not write in this half); after a barrier it copies every chunk k from member k (which no
    /// one writes in this half); a last barrier keeps buffers alive until all reads are done.
    pub fn run(
        &self,
        ctx: &mut Ctx<'_>,
        buf: &mut [u8],
        op: ReduceOp,
        scratch: &mut Vec<u8>,
    ) -> Result<()> {
        if self.peers.team.size() == 1 {
            return Ok(());
        }
        let addrs = self.reduce_own_chunk(ctx, buf, op, scratch)?;
        self.gather_chunks(ctx, buf, &addrs)
    }

    /// The byte range of `buf` this rank reduces.
    pub fn own_chunk(&self) -> Range<usize> {
        self.chunks[self.peers.team.me].clone()
    }

    /// First half: publishes `buf`'s address and reduces this rank's chunk in place from every
    /// member's copy. Afterwards this rank may keep working on its own chunk (the hierarchical
    /// all-reduce runs its cross-host step there): no member reads it until `gather_chunks`.
    pub fn reduce_own_chunk(
        &self,
        ctx: &mut Ctx<'_>,
        buf: &mut [u8],
        op: ReduceOp,
        scratch: &mut Vec<u8>,
    ) -> Result<Vec<usize>> {
        let p = &self.peers;
        let addrs = p.exchange_addrs(ctx, buf.as_ptr() as usize)?;
        let mine = self.own_chunk();
        let tmp = piece_buf(scratch, mine.len());
        p.reduce_range(ctx, &addrs, mine.clone(), &mut buf[mine], op, tmp)?;
        Ok(addrs)
    }

    /// Second half: once every member's chunk is final (barrier), copies each from its owner;
    /// a last barrier keeps buffers alive until all reads are done.
    pub fn gather_chunks(&self, ctx: &mut Ctx<'_>, buf: &mut [u8], addrs: &[usize]) -> Result<()> {
        let p = &self.peers;
        p.barrier(ctx)?;
        for (m, c) in self
            .chunks
            .iter()
            .enumerate()
            .filter(|(m, _)| *m != p.team.me)
        {
            p.read(ctx, addrs, m, c.start, &mut buf[c.clone()])?;
        }
        p.barrier(ctx)
    }
}

/// Direct-read reduce-scatter: member m reduces block m of everyone's input into its output.
pub struct DrReduceScatter {
    peers: Peers,
    chunks: Vec<Range<usize>>,
}

impl DrReduceScatter {
    /// Plans a reduce-scatter of byte `chunks` (one per member).
    pub fn new(peers: Peers, chunks: Vec<Range<usize>>) -> Self {
        DrReduceScatter { peers, chunks }
    }

    /// Runs it; `input` is only read (by this rank and its peers), `output` gets block `me`.
    pub fn run(
        &self,
        ctx: &mut Ctx<'_>,
        input: &[u8],
        output: &mut [u8],
        op: ReduceOp,
        scratch: &mut Vec<u8>,
    ) -> Result<()> {
        let p = &self.peers;
        let mine = self.chunks[p.team.me].clone();
        output.copy_from_slice(&input[mine.clone()]);
        if p.team.size() == 1 {
            return Ok(());
        }
        let addrs = p.exchange_addrs(ctx, input.as_ptr() as usize)?;
        let tmp = piece_buf(scratch, mine.len());
        p.reduce_range(ctx, &addrs, mine, output, op, tmp)?;
        p.barrier(ctx)
    }
}

/// Direct-read all-gather: member m's block m is already in place; it copies every other block.
pub struct DrAllGather {
    peers: Peers,
    chunks: Vec<Range<usize>>,
}

impl DrAllGather {
    /// Plans an all-gather of byte `chunks` (any sizes).
    pub fn new(peers: Peers, chunks: Vec<Range<usize>>) -> Self {
        DrAllGather { peers, chunks }
    }

    /// Runs it in place on `buf`.
    pub fn run(&self, ctx: &mut Ctx<'_>, buf: &mut [u8]) -> Result<()> {
        let p = &self.peers;
        if p.team.size() == 1 {
            return Ok(());
        }
        let addrs = p.exchange_addrs(ctx, buf.as_ptr() as usize)?;
        for (m, c) in self
            .chunks
            .iter()
            .enumerate()
            .filter(|(m, _)| *m != p.team.me)
        {
            p.read(ctx, &addrs, m, c.start, &mut buf[c.clone()])?;
        }
        p.barrier(ctx)
    }
}

/// Direct-read broadcast: every member copies the root's buffer.
pub struct DrBroadcast {
    peers: Peers,
    root: usize,
}

impl DrBroadcast {
    /// Plans a broadcast from member `root`.
    pub fn new(peers: Peers, root: usize) -> Self {
        DrBroadcast { peers, root }
    }

    /// Runs it in place on `buf`.
    pub fn run(&self, ctx: &mut Ctx<'_>, buf: &mut [u8]) -> Result<()> {
        let p = &self.peers;
        if p.team.size() == 1 {
            return Ok(());
        }
        let addrs = p.exchange_addrs(ctx, buf.as_ptr() as usize)?;
        if p.team.me != self.root {
            p.read(ctx, &addrs, self.root, 0, buf)?;
        }
        p.barrier(ctx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_own_memory_and_probe_byte() {
        let src: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        read_remote(std::process::id() as i32, src.as_ptr() as usize, &mut dst).unwrap();
        assert_eq!(src, dst);
        assert!(probe(
            std::process::id() as i32,
            &PROBE_BYTE as *const u8 as usize
        ));
    }

    #[test]
    fn bad_address_is_an_error_not_a_crash() {
        let mut dst = [0u8; 16];
        assert!(read_remote(std::process::id() as i32, 8, &mut dst).is_err());
    }
}
