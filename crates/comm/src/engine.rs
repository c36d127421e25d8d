//! The progress engine: drives a set of sends and receives over [`Link`]s from one thread.
//!
//! An algorithm step is a list of [`Xfer`]s (send this slice to rank a, receive into that slice
//! from rank b, receive and reduce into another slice from rank c). [`exchange`] moves all of them
//! at once without blocking on any single one, so a ring step sends to its successor while it
//! receives from its predecessor, and a reducing receive combines each piece as it arrives. When
//! nothing can move it sleeps in `poll(2)` on the links' descriptors until the op's deadline: no
//! busy-polling, and no thread hand-off on the critical path.
//!
//! Every message starts with a [`FrameHeader`]; the receiver checks group, generation, sequence
//! number, op kind, dtype, element count and length against its own call before it accepts a
//! payload byte, which is how mismatched calls are caught instead of hanging or corrupting data.

use crate::dtype::{DType, ReduceOp, reduce_into};
use crate::error::{CommError, OpDesc, Result};
use crate::frame::{FrameHeader, FrameType, HEADER_LEN, OpKind};
use crate::transport::{Link, LinkError, Readiness};
use std::time::{Duration, Instant};

/// One transfer of an algorithm step.
pub enum Xfer<'a> {
    /// Send `data` to group rank `peer`.
    Send { peer: usize, data: &'a [u8] },
    /// Receive exactly `buf.len()` bytes from `peer`.
    Recv { peer: usize, buf: &'a mut [u8] },
    /// Receive `acc.len()` bytes from `peer` and combine them into `acc` with `op`.
    RecvReduce {
        peer: usize,
        acc: &'a mut [u8],
        op: ReduceOp,
    },
}

impl Xfer<'_> {
    fn peer(&self) -> usize {
        match self {
            Xfer::Send { peer, .. } | Xfer::Recv { peer, .. } | Xfer::RecvReduce { peer, .. } => {
                *peer
            }
        }
    }
    fn is_send(&self) -> bool {
        matches!(self, Xfer::Send { .. })
    }
    fn len(&self) -> usize {
        match self {
            Xfer::Send { data, .. } => data.len(),
            Xfer::Recv { buf, .. } => buf.len(),
            Xfer::RecvReduce { acc, .. } => acc.len(),
        }
    }
}

/// The identity and deadline of one op, shared by all its steps.
pub struct OpCtx {
    /// What the op is (for errors).
    pub desc: OpDesc,
    /// Op kind on the wire.
    pub kind: OpKind,
    /// Element type.
    pub dtype: DType,
    /// Element count of the whole call: must agree on every rank.
    pub signature: u64,
    /// Group id and generation stamped on every frame.
    pub group_id: u64,
    pub generation: u64,
    /// This rank in the group.
    pub rank: usize,
    /// The op's timeout and absolute deadline.
    pub timeout: Duration,
    pub deadline: Instant,
    /// How long to keep retrying (yielding the CPU between tries) before sleeping in `poll`.
    /// Waking a sleeping rank costs tens of microseconds on a virtual machine whose idle vCPU
    /// halts; a short spin avoids that for peers that answer quickly. Zero: sleep at once.
    pub spin: Duration,
    /// Messages sent to / received from each peer so far in this op (the header's `step`).
    sent: Vec<u32>,
    recvd: Vec<u32>,
    /// Bytes this rank put on the wire in this op.
    pub bytes_sent: u64,
}

impl OpCtx {
    /// Starts an op: the deadline runs from now.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        desc: OpDesc,
        kind: OpKind,
        dtype: DType,
        signature: u64,
        group_id: u64,
        generation: u64,
        rank: usize,
        size: usize,
        timeout: Duration,
    ) -> OpCtx {
        OpCtx {
            desc,
            kind,
            dtype,
            signature,
            group_id,
            generation,
            rank,
            timeout,
            deadline: Instant::now() + timeout,
            sent: vec![0; size],
            recvd: vec![0; size],
            bytes_sent: 0,
            spin: Duration::ZERO,
        }
    }

    /// A copy for a second thread that drives a disjoint set of peers within the same op.
    pub fn fork(&self) -> OpCtx {
        OpCtx {
            desc: self.desc.clone(),
            sent: self.sent.clone(),
            recvd: self.recvd.clone(),
            bytes_sent: 0,
            ..*self
        }
    }

    /// Takes back from a fork the message counters of `peers` (the ones it drove) and its bytes.
    pub fn absorb(&mut self, fork: &OpCtx, peers: &[usize]) {
        for &p in peers {
            self.sent[p] = fork.sent[p];
            self.recvd[p] = fork.recvd[p];
        }
        self.bytes_sent += fork.bytes_sent;
    }

    fn header(&self, peer_step: u32, len: usize) -> FrameHeader {
        FrameHeader {
            frame_type: FrameType::Data,
            kind: self.kind,
            dtype: self.dtype,
            group_id: self.group_id,
            generation: self.generation,
            seq: self.desc.seq,
            signature: self.signature,
            payload_len: len as u64,
            sender: self.rank as u32,
            step: peer_step,
        }
    }

    fn describe(kind: OpKind, seq: u64, dtype: DType, count: u64, len: u64) -> String {
        format!(
            "called {} #{} ({} x {}, {} bytes in this message)",
            kind.name(),
            seq,
            dtype.name(),
            count,
            len
        )
    }

    fn lost(&self, peer: usize, e: LinkError) -> CommError {
        CommError::PeerLost {
            op: Box::new(self.desc.clone()),
            peer,
            detail: e.to_string(),
            cause: None,
        }
    }

    /// Checks a received header against what this rank expects.
    fn check(&self, peer: usize, step: u32, len: usize, h: &FrameHeader) -> Result<()> {
        let bad = |reason: String| Err(CommError::BadFrame { peer, reason });
        if h.frame_type != FrameType::Data {
            return bad(format!(
                "unexpected {:?} frame during {}",
                h.frame_type, self.desc
            ));
        }
        if h.group_id != self.group_id {
            return bad(format!(
                "frame for group id {:#x}, expected {:#x}",
                h.group_id, self.group_id
            ));
        }
        if h.generation < self.generation {
            return Err(CommError::StaleGeneration {
                got: h.generation,
                current: self.generation,
            });
        }
        if h.generation > self.generation {
            return bad(format!(
                "frame from future generation {} (this rank is at {})",
                h.generation, self.generation
            ));
        }
        if h.sender as usize != peer {
            return bad(format!(
                "frame claims sender {} on the link of rank {peer}",
                h.sender
            ));
        }
        if h.kind != self.kind
            || h.seq != self.desc.seq
            || h.dtype != self.dtype
            || h.signature != self.signature
            || h.payload_len != len as u64
            || h.step != step
        {
            return Err(CommError::Mismatch {
                op: Box::new(self.desc.clone()),
                peer,
                theirs: Self::describe(h.kind, h.seq, h.dtype, h.signature, h.payload_len),
                ours: Self::describe(
                    self.kind,
                    self.desc.seq,
                    self.dtype,
                    self.signature,
                    len as u64,
                ),
            });
        }
        Ok(())
    }
}

/// Progress of one transfer.
#[derive(Clone, Copy)]
struct State {
    step: u32,
    hdr: [u8; HEADER_LEN],
    hdr_done: usize,
    /// Payload bytes taken from the link (for a reducing receive: reduced, plus `carry_len`).
    done: usize,
    complete: bool,
    /// A reducing receive's partial element, waiting for its remaining bytes.
    carry: [u8; 8],
    carry_len: usize,
}

/// Largest payload sent in the same write as its header (one syscall for small messages).
const COALESCE_BYTES: usize = 8192;

/// Runs all `xfers` to completion (or to the op's deadline). Transfers to the same peer in the
/// same direction complete in list order; everything else proceeds concurrently.
pub fn exchange(
    links: &mut [Option<Box<dyn Link>>],
    ctx: &mut OpCtx,
    xfers: &mut [Xfer<'_>],
) -> Result<()> {
    let n = links.len();
    let mut st: Vec<State> = Vec::with_capacity(xfers.len());
    for x in xfers.iter() {
        let p = x.peer();
        if p >= n || p == ctx.rank || links[p].is_none() {
            return Err(CommError::InvalidArgument(format!(
                "transfer with rank {p}: no link (group size {n}, this rank {})",
                ctx.rank
            )));
        }
        let counter = if x.is_send() {
            &mut ctx.sent[p]
        } else {
            &mut ctx.recvd[p]
        };
        let step = *counter;
        *counter += 1;
        let hdr = if x.is_send() {
            ctx.header(step, x.len()).encode()
        } else {
            [0u8; HEADER_LEN]
        };
        st.push(State {
            step,
            hdr,
            hdr_done: 0,
            done: 0,
            complete: false,
            carry: [0; 8],
            carry_len: 0,
        });
    }
    let mut busy_send = vec![false; n];
    let mut busy_recv = vec![false; n];
    let mut coalesce: Vec<u8> = Vec::new();
    let mut pollfds: Vec<libc::pollfd> = Vec::new();
    let mut idle_since: Option<Instant> = None;
    loop {
        // A chaos partition of this process: nothing moves until it heals (see
        // `crate::partition`); past the op's deadline this is the timeout a silent peer causes.
        if crate::partition::hold(ctx.deadline) {
            return Err(timeout_error(ctx, xfers, &st));
        }
        // One pass: move every active transfer as far as it goes.
        let mut moved = false;
        let mut remaining = false;
        busy_send.iter_mut().for_each(|b| *b = false);
        busy_recv.iter_mut().for_each(|b| *b = false);
        for (x, s) in xfers.iter_mut().zip(st.iter_mut()) {
            if s.complete {
                continue;
            }
            remaining = true;
            let p = x.peer();
            let busy = if x.is_send() {
                &mut busy_send[p]
            } else {
                &mut busy_recv[p]
            };
            if *busy {
                continue; // an earlier transfer on this peer and direction goes first
            }
            *busy = true;
            let link = links[p].as_deref_mut().expect("checked above");
            let progressed = step_xfer(link, ctx, x, s, &mut coalesce)?;
            moved |= progressed;
            if s.complete {
                *busy = false;
            }
        }
        if !remaining {
            return Ok(());
        }
        if moved {
            idle_since = None;
            continue;
        }
        let now = Instant::now();
        if now >= ctx.deadline {
            return Err(timeout_error(ctx, xfers, &st));
        }
        // Nothing moved. First a short yielding spin (see `OpCtx::spin`): it keeps this CPU
        // awake for a peer that is about to answer, while `yield_now` hands the CPU to any
        // co-located rank that can run, so nobody is starved.
        let idle = *idle_since.get_or_insert(now);
        if now - idle < ctx.spin {
            std::thread::yield_now();
            continue;
        }
        // Then sleep until a link can move or the deadline passes.
        pollfds.clear();
        let mut ready = false;
        for p in 0..n {
            if !(busy_send[p] || busy_recv[p]) {
                continue;
            }
            let link = links[p].as_deref_mut().expect("busy implies a link");
            match link.prepare_wait(busy_send[p], busy_recv[p]) {
                Readiness::Ready => ready = true,
                Readiness::Fd { fd, events } => pollfds.push(libc::pollfd {
                    fd,
                    events,
                    revents: 0,
                }),
            }
            if let Some(fd) = link.death_fd() {
                pollfds.push(libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                });
            }
        }
        if !ready {
            let wait_ms = (ctx.deadline - now).as_millis().clamp(1, i32::MAX as u128) as i32;
            // SAFETY: pollfds is a valid array of pollfd of the given length.
            let rc =
                unsafe { libc::poll(pollfds.as_mut_ptr(), pollfds.len() as libc::nfds_t, wait_ms) };
            if rc < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(CommError::io(format!("poll during {}", ctx.desc), e));
                }
            }
        }
        for p in 0..n {
            if busy_send[p] || busy_recv[p] {
                links[p]
                    .as_deref_mut()
                    .expect("busy implies a link")
                    .after_wait();
            }
        }
    }
}

/// Moves one transfer as far as the link allows; returns whether any byte moved.
fn step_xfer(
    link: &mut dyn Link,
    ctx: &mut OpCtx,
    x: &mut Xfer<'_>,
    s: &mut State,
    coalesce: &mut Vec<u8>,
) -> Result<bool> {
    let p = x.peer();
    let mut moved = false;
    match x {
        Xfer::Send { data, .. } => {
            if s.hdr_done < HEADER_LEN {
                let n = if s.hdr_done == 0 && data.len() <= COALESCE_BYTES {
                    coalesce.clear();
                    coalesce.extend_from_slice(&s.hdr);
                    coalesce.extend_from_slice(data);
                    link.try_send(coalesce).map_err(|e| ctx.lost(p, e))?
                } else {
                    link.try_send(&s.hdr[s.hdr_done..])
                        .map_err(|e| ctx.lost(p, e))?
                };
                let h = n.min(HEADER_LEN - s.hdr_done);
                s.hdr_done += h;
                s.done += n - h;
                moved |= n > 0;
            }
            while s.hdr_done == HEADER_LEN && s.done < data.len() {
                let n = link.try_send(&data[s.done..]).map_err(|e| ctx.lost(p, e))?;
                if n == 0 {
                    break;
                }
                s.done += n;
                moved = true;
            }
            if s.hdr_done == HEADER_LEN && s.done == data.len() {
                s.complete = true;
                ctx.bytes_sent += (HEADER_LEN + data.len()) as u64;
            }
        }
        Xfer::Recv { buf, .. } => {
            if !recv_header(link, ctx, p, buf.len(), s, &mut moved)? {
                return Ok(moved);
            }
            while s.done < buf.len() {
                let n = link
                    .try_recv_into(&mut buf[s.done..])
                    .map_err(|e| ctx.lost(p, e))?;
                if n == 0 {
                    break;
                }
                s.done += n;
                moved = true;
            }
            s.complete = s.done == buf.len();
        }
        Xfer::RecvReduce { acc, op, .. } => {
            if !recv_header(link, ctx, p, acc.len(), s, &mut moved)? {
                return Ok(moved);
            }
            let esz = ctx.dtype.size();
            let (dtype, op) = (ctx.dtype, *op);
            while s.done < acc.len() {
                // Reduced so far: everything taken except a carried partial element.
                let base = s.done - s.carry_len;
                let max = acc.len() - s.done;
                let target = &mut acc[base..];
                let (carry, carry_len) = (&mut s.carry, &mut s.carry_len);
                let mut off = 0usize;
                // The sink takes every byte offered, so a link never holds back a partial
                // element (a shared-memory ring whose writer waits for space would otherwise
                // never see it consumed): whole elements are reduced in place, a split one is
                // carried until its remaining bytes arrive.
                let n = link
                    .try_recv_with(max, &mut |piece: &[u8]| {
                        let mut used = 0;
                        if *carry_len > 0 {
                            let take = (esz - *carry_len).min(piece.len());
                            carry[*carry_len..*carry_len + take].copy_from_slice(&piece[..take]);
                            *carry_len += take;
                            used = take;
                            if *carry_len < esz {
                                return used;
                            }
                            reduce_into(dtype, op, &mut target[off..off + esz], &carry[..esz]);
                            off += esz;
                            *carry_len = 0;
                        }
                        let rest = &piece[used..];
                        let whole = rest.len() / esz * esz;
                        reduce_into(dtype, op, &mut target[off..off + whole], &rest[..whole]);
                        off += whole;
                        let tail = rest.len() - whole;
                        carry[..tail].copy_from_slice(&rest[whole..]);
                        *carry_len = tail;
                        used + rest.len()
                    })
                    .map_err(|e| ctx.lost(p, e))?;
                if n == 0 {
                    break;
                }
                s.done += n;
                moved = true;
            }
            s.complete = s.done == acc.len();
        }
    }
    Ok(moved)
}

/// Reads and checks the header of a receive; returns true once it is complete and valid.
fn recv_header(
    link: &mut dyn Link,
    ctx: &OpCtx,
    p: usize,
    len: usize,
    s: &mut State,
    moved: &mut bool,
) -> Result<bool> {
    while s.hdr_done < HEADER_LEN {
        let n = link
            .try_recv_into(&mut s.hdr[s.hdr_done..])
            .map_err(|e| ctx.lost(p, e))?;
        if n == 0 {
            return Ok(false);
        }
        s.hdr_done += n;
        *moved = true;
        if s.hdr_done == HEADER_LEN {
            let h = FrameHeader::decode(&s.hdr).map_err(|e| CommError::BadFrame {
                peer: p,
                reason: e.to_string(),
            })?;
            ctx.check(p, s.step, len, &h)?;
        }
    }
    Ok(true)
}

fn timeout_error(ctx: &OpCtx, xfers: &[Xfer<'_>], st: &[State]) -> CommError {
    let mut missing: Vec<usize> = xfers
        .iter()
        .zip(st)
        .filter(|(_, s)| !s.complete)
        .map(|(x, _)| x.peer())
        .collect();
    missing.sort_unstable();
    missing.dedup();
    CommError::Timeout {
        op: Box::new(ctx.desc.clone()),
        timeout: ctx.timeout,
        missing,
        cause: None,
    }
}
