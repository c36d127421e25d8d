//! [`ShmLink`]: the [`Link`] over a pair of rings, and the ring view with its copy routines.

use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::ptr::{self, NonNull};
use std::sync::Arc;
use std::sync::atomic::{Ordering, fence};

use memmap2::MmapRaw;

use super::domain::{DomainShared, drain_bell, readable_now, ring_bell};
use super::layout::{RING_HEADER, RingHeader, invalid_data, ring_header_ptr};
use crate::transport::{Link, LinkError, LinkKind, Readiness};

// ---------------------------------------------------------------------------------------------
// Ring view
// ---------------------------------------------------------------------------------------------

/// One ring, seen through a mapping that its owner (the link) keeps alive.
pub(super) struct RingView {
    hdr: NonNull<RingHeader>,
    data: NonNull<u8>,
    cap: u64,
}

impl RingView {
    /// # Safety
    /// As for [`ring_header_ptr`]; the mapping must outlive the view.
    pub(super) unsafe fn new(map: &MmapRaw, k: usize, ring_bytes: usize) -> RingView {
        // SAFETY: forwarded to the caller; data follows the header inside the same ring.
        unsafe {
            let hdr = ring_header_ptr(map, k, ring_bytes);
            let data = NonNull::new_unchecked(hdr.as_ptr().cast::<u8>().add(RING_HEADER));
            RingView {
                hdr,
                data,
                cap: ring_bytes as u64,
            }
        }
    }

    fn hdr(&self) -> &RingHeader {
        // SAFETY: the header lies in a live mapping (the owning link holds it) and holds atomics.
        unsafe { self.hdr.as_ref() }
    }

    /// Bytes in `[tail, head)`, or an error if a corrupt peer broke `head - tail <= cap`.
    fn used(&self, head: u64, tail: u64) -> Result<u64, LinkError> {
        let used = head.wrapping_sub(tail);
        if used > self.cap {
            return Err(LinkError::Io(invalid_data(format!(
                "shared-memory ring corrupted: head {head}, tail {tail}, capacity {}",
                self.cap
            ))));
        }
        Ok(used)
    }

    /// Splits `len` bytes at logical position `pos` into (offset, first piece, second piece).
    fn split(&self, pos: u64, len: usize) -> (usize, usize, usize) {
        let off = (pos % self.cap) as usize;
        let first = len.min(self.cap as usize - off);
        (off, first, len - first)
    }

    /// Copies `src` into the ring at logical position `pos`, wrapping.
    ///
    /// # Safety
    /// `[pos, pos + src.len())` must be free space owned by the caller (the producer).
    unsafe fn copy_in(&self, pos: u64, src: &[u8]) {
        let (off, first, second) = self.split(pos, src.len());
        // SAFETY: off + first <= cap and second <= cap - first, inside the data area, which the
        // consumer does not touch until head is published; src cannot overlap shared memory we own.
        unsafe {
            ptr::copy_nonoverlapping(src.as_ptr(), self.data.as_ptr().add(off), first);
            ptr::copy_nonoverlapping(src.as_ptr().add(first), self.data.as_ptr(), second);
        }
    }

    /// Copies `dst.len()` bytes out of the ring from logical position `pos`, wrapping.
    ///
    /// # Safety
    /// `[pos, pos + dst.len())` must be published data owned by the caller (the consumer).
    unsafe fn copy_out(&self, pos: u64, dst: &mut [u8]) {
        let (off, first, second) = self.split(pos, dst.len());
        // SAFETY: as in copy_in; the producer does not write here until tail moves past them.
        unsafe {
            ptr::copy_nonoverlapping(self.data.as_ptr().add(off), dst.as_mut_ptr(), first);
            ptr::copy_nonoverlapping(self.data.as_ptr(), dst.as_mut_ptr().add(first), second);
        }
    }

    /// Borrows `len` contiguous bytes at data offset `off`.
    ///
    /// # Safety
    /// The bytes must be published data owned by the consumer for the borrow's duration.
    unsafe fn slice(&self, off: usize, len: usize) -> &[u8] {
        // SAFETY: forwarded to the caller; off + len <= cap by construction at the call site.
        unsafe { std::slice::from_raw_parts(self.data.as_ptr().add(off), len) }
    }
}

// ---------------------------------------------------------------------------------------------
// Link
// ---------------------------------------------------------------------------------------------

/// A full-duplex byte link to one peer on the same host over two shared-memory rings.
pub struct ShmLink {
    /// Ring I consume, in my segment (kept alive by `domain`).
    pub(super) inbound: RingView,
    /// Ring I produce into, in the peer's segment (kept alive by `_peer_map`).
    pub(super) outbound: RingView,
    pub(super) peer_rank: usize,
    pub(super) peer_pid: u32,
    /// The peer's doorbell, opened for writing.
    pub(super) peer_bell: OwnedFd,
    /// Readable once the peer process exits; `None` for a peer in this process.
    pub(super) pidfd: Option<OwnedFd>,
    pub(super) local_closed: bool,
    /// Sticky: the pidfd reported the peer's exit.
    pub(super) peer_gone: bool,
    pub(super) _peer_map: MmapRaw,
    pub(super) domain: Arc<DomainShared>,
}

// SAFETY: the raw pointers in the ring views point into mappings owned by this link (the peer map
// and the Arc'd domain map), which are not tied to a thread; all shared state is accessed through
// atomics or through the ring ownership protocol, which does not depend on the calling thread.
unsafe impl Send for ShmLink {}

impl std::fmt::Debug for ShmLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmLink")
            .field("peer_rank", &self.peer_rank)
            .field("peer_pid", &self.peer_pid)
            .field("local_closed", &self.local_closed)
            .finish_non_exhaustive()
    }
}

impl ShmLink {
    /// The rank at the other end.
    pub fn peer_rank(&self) -> usize {
        self.peer_rank
    }

    fn check_open(&self) -> Result<(), LinkError> {
        if self.local_closed {
            return Err(LinkError::Closed(format!(
                "shm link to rank {} was shut down locally",
                self.peer_rank
            )));
        }
        Ok(())
    }

    /// Slow path of a call that moved nothing: is the peer closed or dead?
    fn check_peer(&mut self, peer_closed: bool) -> Result<(), LinkError> {
        if peer_closed {
            return Err(LinkError::Closed(format!(
                "rank {} shut down its shm link",
                self.peer_rank
            )));
        }
        if !self.peer_gone {
            self.peer_gone = self
                .pidfd
                .as_ref()
                .is_some_and(|fd| readable_now(fd.as_fd()));
        }
        if self.peer_gone {
            return Err(LinkError::Closed(format!(
                "process {} of rank {} exited",
                self.peer_pid, self.peer_rank
            )));
        }
        Ok(())
    }

    /// Inbound state: (tail, bytes available, writer closed). Closed is read before head, so a
    /// closed writer's final head is always seen.
    fn inbound_state(&self) -> Result<(u64, u64, bool), LinkError> {
        let h = self.inbound.hdr();
        let closed = h.prod.writer_closed.load(Ordering::Acquire) != 0;
        let head = h.prod.head.load(Ordering::Acquire);
        let tail = h.cons.tail.load(Ordering::Relaxed);
        Ok((tail, self.inbound.used(head, tail)?, closed))
    }

    /// Outbound state: (head, free bytes, reader closed).
    fn outbound_state(&self) -> Result<(u64, u64, bool), LinkError> {
        let h = self.outbound.hdr();
        let closed = h.cons.reader_closed.load(Ordering::Acquire) != 0;
        let tail = h.cons.tail.load(Ordering::Acquire);
        let head = h.prod.head.load(Ordering::Relaxed);
        Ok((
            head,
            self.outbound.cap - self.outbound.used(head, tail)?,
            closed,
        ))
    }

    /// After publishing a new tail: wake the peer if it sleeps waiting for space.
    fn publish_tail(&self, tail: u64) {
        let h = self.inbound.hdr();
        h.cons.tail.store(tail, Ordering::Release);
        fence(Ordering::SeqCst);
        let flag = &h.prod.writer_waiting;
        if flag.load(Ordering::Relaxed) != 0 && flag.swap(0, Ordering::AcqRel) != 0 {
            ring_bell(self.peer_bell.as_fd());
        }
    }

    /// Finishes a receive of `n` bytes at `tail`.
    fn finish_recv(&self, tail: u64, n: usize) -> usize {
        if n > 0 {
            self.publish_tail(tail + n as u64);
        }
        n
    }

    fn clear_flags(&self) {
        self.outbound
            .hdr()
            .prod
            .writer_waiting
            .store(0, Ordering::Relaxed);
        self.inbound
            .hdr()
            .cons
            .reader_waiting
            .store(0, Ordering::Relaxed);
    }
}

impl Link for ShmLink {
    fn kind(&self) -> LinkKind {
        LinkKind::Shm
    }

    fn try_send(&mut self, buf: &[u8]) -> Result<usize, LinkError> {
        self.check_open()?;
        if buf.is_empty() {
            return Ok(0);
        }
        let (head, free, closed) = self.outbound_state()?;
        if closed {
            return Err(LinkError::Closed(format!(
                "rank {} shut down its shm link",
                self.peer_rank
            )));
        }
        let n = buf.len().min(free as usize);
        if n == 0 {
            self.check_peer(false)?;
            return Ok(0);
        }
        // SAFETY: [head, head + n) is free (n <= cap - used) and only this producer writes there.
        unsafe { self.outbound.copy_in(head, &buf[..n]) };
        let h = self.outbound.hdr();
        h.prod.head.store(head + n as u64, Ordering::Release);
        fence(Ordering::SeqCst);
        let flag = &h.cons.reader_waiting;
        if flag.load(Ordering::Relaxed) != 0 && flag.swap(0, Ordering::AcqRel) != 0 {
            ring_bell(self.peer_bell.as_fd());
        }
        Ok(n)
    }

    fn try_recv_into(&mut self, dst: &mut [u8]) -> Result<usize, LinkError> {
        self.check_open()?;
        if dst.is_empty() {
            return Ok(0);
        }
        let (tail, avail, closed) = self.inbound_state()?;
        let n = dst.len().min(avail as usize);
        if n == 0 {
            self.check_peer(closed)?;
            return Ok(0);
        }
        // SAFETY: [tail, tail + n) is published (n <= head - tail) and only this consumer reads it.
        unsafe { self.inbound.copy_out(tail, &mut dst[..n]) };
        Ok(self.finish_recv(tail, n))
    }

    fn try_recv_with(
        &mut self,
        max: usize,
        sink: &mut dyn FnMut(&[u8]) -> usize,
    ) -> Result<usize, LinkError> {
        self.check_open()?;
        if max == 0 {
            return Ok(0);
        }
        let (tail, avail, closed) = self.inbound_state()?;
        let n = max.min(avail as usize);
        if n == 0 {
            self.check_peer(closed)?;
            return Ok(0);
        }
        let (off, first, second) = self.inbound.split(tail, n);
        // SAFETY: [tail, tail + n) is published data owned by this consumer until tail is
        // published below; the borrow ends when the sink returns.
        let mut taken = sink(unsafe { self.inbound.slice(off, first) }).min(first);
        if taken == first && second > 0 {
            // SAFETY: as above, for the wrapped part at the start of the data area.
            taken += sink(unsafe { self.inbound.slice(0, second) }).min(second);
        }
        Ok(self.finish_recv(tail, taken))
    }

    fn prepare_wait(&mut self, want_send: bool, want_recv: bool) -> Readiness {
        if self.local_closed || self.peer_gone {
            return Readiness::Ready;
        }
        if want_send {
            self.outbound
                .hdr()
                .prod
                .writer_waiting
                .store(1, Ordering::SeqCst);
        }
        if want_recv {
            self.inbound
                .hdr()
                .cons
                .reader_waiting
                .store(1, Ordering::SeqCst);
        }
        fence(Ordering::SeqCst);
        // A corrupt ring counts as ready, so the next try_* call reports the error.
        let send_ready = want_send
            && self
                .outbound_state()
                .map_or(true, |(_, free, c)| free > 0 || c);
        let recv_ready = want_recv
            && self
                .inbound_state()
                .map_or(true, |(_, avail, c)| avail > 0 || c);
        if send_ready || recv_ready {
            self.clear_flags();
            return Readiness::Ready;
        }
        Readiness::Fd {
            fd: self.domain.bell.as_raw_fd(),
            events: libc::POLLIN,
        }
    }

    fn after_wait(&mut self) {
        drain_bell(self.domain.bell.as_fd());
        self.clear_flags();
    }

    fn death_fd(&self) -> Option<RawFd> {
        self.pidfd.as_ref().map(|fd| fd.as_raw_fd())
    }

    fn shutdown(&mut self) {
        if self.local_closed {
            return;
        }
        self.local_closed = true;
        self.outbound
            .hdr()
            .prod
            .writer_closed
            .store(1, Ordering::Release);
        self.inbound
            .hdr()
            .cons
            .reader_closed
            .store(1, Ordering::Release);
        fence(Ordering::SeqCst);
        ring_bell(self.peer_bell.as_fd());
    }
}

impl Drop for ShmLink {
    fn drop(&mut self) {
        self.shutdown();
    }
}
