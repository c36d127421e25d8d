//! Shared-memory transport: SPSC byte rings in `/dev/shm` with FIFO doorbells.
//!
//! Each rank of a process group that shares a host creates one [`ShmDomain`]: a segment file
//! `{dir}/{name}-r{rank}` holding one INBOUND ring per local peer, and a doorbell FIFO
//! `{dir}/{name}-r{rank}.bell`. It publishes its [`ShmEndpoint`] (through the rendezvous store);
//! every peer [`ShmDomain::connect`]s to it, which maps the peer's segment to find its OUTBOUND
//! ring (the one the peer reserved for it). A [`ShmLink`] is thus two rings: inbound in my segment,
//! outbound in the peer's. Ranks may be processes or threads of one process.
//!
//! # Segment layout
//!
//! ```text
//! offset 0            SegmentHeader (128 B): magic, version, owner rank, rings, ring bytes, nonce
//! 128 + k*stride      ring k (inbound from peers[k]), stride = 384 + ring_bytes rounded up to 128:
//!   +0     producer line (128 B): head u64, writer_waiting u32, writer_closed u32
//!   +128   consumer line (128 B): tail u64, reader_waiting u32, reader_closed u32
//!   +256   info line     (128 B): magic, capacity, producer rank, consumer rank
//!   +384   data, `ring_bytes` bytes
//! ```
//!
//! Each line is written by one side only (the waiting/closed flags of a side live beside the
//! counter that side publishes), and lines are 128 B rather than 64 B so that the adjacent-line
//! prefetcher of x86 cores does not couple the producer's and the consumer's lines.
//!
//! # Ring protocol
//!
//! `head` and `tail` are monotonically increasing byte counts (u64, never wrap in practice); the
//! bytes `[tail, head)` are readable and `[head, tail + capacity)` writable, at position
//! `pos % capacity`. The producer copies, then publishes `head` with Release; the consumer reads
//! `head` with Acquire, copies out, publishes `tail` with Release. No locks, no syscalls.
//!
//! # Wake-up protocol (never a lost wake-up, never a busy spin)
//!
//! A stalled side arms its flag (`reader_waiting` on its inbound ring, `writer_waiting` on its
//! outbound ring), issues a SeqCst fence and re-checks the ring; if it can move it disarms and
//! reports [`Readiness::Ready`], else the engine sleeps in `poll` on the rank's doorbell. The other
//! side publishes `head`/`tail`, issues a SeqCst fence and reads the flag; if set, it swaps it to 0
//! and writes one byte to the sleeper's doorbell. The two fences form a Dekker pair: either the
//! sleeper's re-check sees the progress, or the waker sees the flag. The swap means one arm costs
//! at most one doorbell write. The doorbell is shared by all links of a domain; `after_wait`
//! drains it and the engine retries every link after any wake-up, so no wake-up is lost.
//!
//! # Close and death
//!
//! [`Link::shutdown`] (and drop) sets `writer_closed` on the outbound ring and `reader_closed` on
//! the inbound ring, then rings the peer's doorbell. The peer receives the bytes already in the
//! ring, then [`LinkError::Closed`]. A peer process that dies is seen through a pidfd
//! ([`Link::death_fd`]); the link polls it (zero timeout) only when a call moved nothing.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering, fence};
use std::sync::{Arc, Mutex};

use memmap2::{MmapOptions, MmapRaw};

use super::{Link, LinkError, LinkKind, Readiness};

/// Default data bytes per ring (4 MiB).
///
/// Why this size: with more ranks than cores a peer is often descheduled for a whole time slice
/// (several ms), and the ring is what lets the running rank keep going meanwhile. At memcpy speed
/// (~5-10 GB/s) 4 MiB is ~0.5 ms of copying, so each sleep/wake pair (a few µs) is amortised over
/// hundreds of µs of work and the doorbell costs nothing measurable; a producer can also stage a
/// whole pipeline chunk of a collective without waiting. The price is `local_peers × 4 MiB` of
/// `/dev/shm` per rank (28 MiB per rank, 224 MiB per host with 8 local ranks), allocated up front.
pub const DEFAULT_RING_BYTES: usize = 4 << 20;

/// Largest accepted ring (guards size arithmetic against hostile or corrupt endpoints).
pub const MAX_RING_BYTES: usize = 1 << 30;

const SEGMENT_MAGIC: u64 = u64::from_le_bytes(*b"FLOTSHMS");
const RING_MAGIC: u64 = u64::from_le_bytes(*b"FLOTRING");
const LAYOUT_VERSION: u64 = 1;
/// Alignment (and padding) of header lines and ring strides.
const LINE: usize = 128;

// ---------------------------------------------------------------------------------------------
// Shared layout
// ---------------------------------------------------------------------------------------------

/// First line of a segment. Written once by the owner before its endpoint is published.
#[repr(C, align(128))]
struct SegmentHeader {
    magic: AtomicU64,
    version: AtomicU64,
    owner_rank: AtomicU64,
    n_rings: AtomicU64,
    ring_bytes: AtomicU64,
    /// Random per-creation value, echoed in the endpoint, so a stale file is never mistaken.
    nonce: AtomicU64,
}

/// Written by the producer (and `writer_waiting` cleared by the consumer when it wakes it).
#[repr(C, align(128))]
struct ProducerLine {
    head: AtomicU64,
    writer_waiting: AtomicU32,
    writer_closed: AtomicU32,
}

/// Written by the consumer (and `reader_waiting` cleared by the producer when it wakes it).
#[repr(C, align(128))]
struct ConsumerLine {
    tail: AtomicU64,
    reader_waiting: AtomicU32,
    reader_closed: AtomicU32,
}

/// Constants of one ring, written at creation.
#[repr(C, align(128))]
struct RingInfo {
    magic: AtomicU64,
    capacity: AtomicU64,
    producer_rank: AtomicU64,
    consumer_rank: AtomicU64,
}

#[repr(C)]
struct RingHeader {
    prod: ProducerLine,
    cons: ConsumerLine,
    info: RingInfo,
}

const SEGMENT_HEADER: usize = size_of::<SegmentHeader>();
const RING_HEADER: usize = size_of::<RingHeader>();
const _: () = assert!(SEGMENT_HEADER == LINE && RING_HEADER == 3 * LINE);

/// Distance between consecutive rings of a segment (keeps every header 128-aligned).
fn ring_stride(ring_bytes: usize) -> usize {
    RING_HEADER + ring_bytes.next_multiple_of(LINE)
}

/// Total segment size, or `None` on overflow.
fn segment_len(n_rings: usize, ring_bytes: usize) -> Option<usize> {
    n_rings
        .checked_mul(ring_stride(ring_bytes))?
        .checked_add(SEGMENT_HEADER)
}

fn check_ring_bytes(ring_bytes: usize) -> io::Result<()> {
    if ring_bytes == 0 || ring_bytes & 63 != 0 || ring_bytes > MAX_RING_BYTES {
        return Err(invalid_data(format!(
            "ring size {ring_bytes} must be a non-zero multiple of 64 of at most {MAX_RING_BYTES}"
        )));
    }
    Ok(())
}

fn invalid_data(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

fn invalid_input(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

/// A segment's header, borrowed from a live mapping of at least `SEGMENT_HEADER` bytes.
fn segment_header(map: &MmapRaw) -> &SegmentHeader {
    // SAFETY: every mapping passed here is at least SEGMENT_HEADER long (checked by its creator),
    // page-aligned (so 128-aligned), and the header holds only atomics, which may be shared.
    unsafe { &*map.as_ptr().cast::<SegmentHeader>() }
}

/// Pointer to ring `k`'s header in a mapping laid out for `ring_bytes`.
///
/// # Safety
/// `k < n_rings` of a mapping of at least `segment_len(n_rings, ring_bytes)` bytes.
unsafe fn ring_header_ptr(map: &MmapRaw, k: usize, ring_bytes: usize) -> NonNull<RingHeader> {
    // SAFETY: the caller guarantees the offset lies inside the mapping, which is non-null.
    unsafe {
        let p = map
            .as_mut_ptr()
            .add(SEGMENT_HEADER + k * ring_stride(ring_bytes));
        NonNull::new_unchecked(p.cast::<RingHeader>())
    }
}

// ---------------------------------------------------------------------------------------------
// Ring view
// ---------------------------------------------------------------------------------------------

/// One ring, seen through a mapping that its owner (the link) keeps alive.
struct RingView {
    hdr: NonNull<RingHeader>,
    data: NonNull<u8>,
    cap: u64,
}

impl RingView {
    /// # Safety
    /// As for [`ring_header_ptr`]; the mapping must outlive the view.
    unsafe fn new(map: &MmapRaw, k: usize, ring_bytes: usize) -> RingView {
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
// Doorbells and pidfds
// ---------------------------------------------------------------------------------------------

/// Writes one byte to a doorbell; a full pipe (EAGAIN) means it is already rung.
fn ring_bell(fd: BorrowedFd<'_>) {
    let byte = 1u8;
    loop {
        // SAFETY: writes one byte from a live stack variable to an open descriptor.
        let r = unsafe { libc::write(fd.as_raw_fd(), (&raw const byte).cast(), 1) };
        if r >= 0 {
            return;
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EAGAIN) => return,
            _ => {
                tracing::debug!(error = %err, "shm doorbell write failed");
                return;
            }
        }
    }
}

/// Empties a (non-blocking) doorbell.
fn drain_bell(fd: BorrowedFd<'_>) {
    let mut buf = [0u8; 256];
    loop {
        // SAFETY: reads at most buf.len() bytes into a live stack buffer.
        let r = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if r > 0 && (r as usize) == buf.len() {
            continue;
        }
        if r < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        return; // short read (now empty), EAGAIN, or end of file
    }
}

/// Opens a pidfd for `pid` (readable once the process exits).
fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    let pid = libc::pid_t::try_from(pid)
        .ok()
        .filter(|&p| p > 0)
        .ok_or_else(|| invalid_data(format!("invalid peer pid {pid}")))?;
    // SAFETY: pidfd_open takes (pid_t, unsigned flags) and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0u32) };
    if fd < 0 {
        let err = io::Error::last_os_error();
        return Err(io::Error::new(
            err.kind(),
            format!("pidfd_open({pid}) of shm peer: {err}"),
        ));
    }
    // SAFETY: the kernel just returned this descriptor (close-on-exec) and nothing else owns it.
    Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as RawFd) })
}

/// True when `fd` polls readable right now (for a pidfd: the process has exited).
fn readable_now(fd: BorrowedFd<'_>) -> bool {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, zero timeout.
    let r = unsafe { libc::poll(&mut pfd, 1, 0) };
    r > 0 && pfd.revents != 0
}

/// Opens a FIFO read-write and non-blocking: never blocks, never ENXIO, never EPIPE.
fn open_fifo(path: &Path) -> io::Result<OwnedFd> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| io::Error::new(e.kind(), format!("doorbell {}: {e}", path.display())))?;
    if !file.metadata()?.file_type().is_fifo() {
        return Err(invalid_data(format!(
            "doorbell {} is not a FIFO",
            path.display()
        )));
    }
    Ok(file.into())
}

// ---------------------------------------------------------------------------------------------
// Domain
// ---------------------------------------------------------------------------------------------

/// Where a rank's shared-memory endpoint lives; published through the rendezvous store as JSON.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ShmEndpoint {
    /// Rank that owns the segment.
    pub rank: usize,
    /// Process id of the owner (a pidfd on it detects its death).
    pub pid: u32,
    /// Segment file holding the owner's inbound rings.
    pub segment: PathBuf,
    /// The owner's doorbell FIFO.
    pub doorbell: PathBuf,
    /// Data bytes per ring.
    pub ring_bytes: usize,
    /// Peer ranks, in the order of their inbound rings in the segment.
    pub peers: Vec<usize>,
    /// Random value also stored in the segment header (rejects stale files of the same name).
    pub nonce: u64,
}

/// State shared by a domain and its links (the inbound mapping and the doorbell stay valid for
/// as long as any link lives).
struct DomainShared {
    map: MmapRaw,
    bell: OwnedFd,
}

/// One rank's shared-memory endpoint within one process group: its inbound rings and doorbell.
pub struct ShmDomain {
    shared: Arc<DomainShared>,
    endpoint: ShmEndpoint,
    /// One flag per inbound ring: a ring is single-consumer, so each peer connects once.
    connected: Mutex<Vec<bool>>,
    unlinked: AtomicBool,
}

impl std::fmt::Debug for ShmDomain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmDomain")
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

/// Removes a half-created file if creation fails part-way.
struct RemoveOnError<'a>(Option<&'a Path>);

impl Drop for RemoveOnError<'_> {
    fn drop(&mut self) {
        if let Some(path) = self.0 {
            let _ = std::fs::remove_file(path);
        }
    }
}

impl ShmDomain {
    /// Creates rank `my_rank`'s segment `{dir}/{name}-r{my_rank}` (one inbound ring of
    /// `ring_bytes` per rank of `local_peers`, in that order) and doorbell `{…}.bell`.
    ///
    /// `name` must be unique per group and generation; existing files are never reused. The
    /// segment is allocated up front, so a full `/dev/shm` fails here, not with SIGBUS later.
    pub fn create(
        dir: &Path,
        name: &str,
        my_rank: usize,
        local_peers: &[usize],
        ring_bytes: usize,
    ) -> io::Result<ShmDomain> {
        check_ring_bytes(ring_bytes).map_err(|e| invalid_input(e.to_string()))?;
        if name.is_empty() || name.contains('/') {
            return Err(invalid_input(format!("invalid shm name {name:?}")));
        }
        for (i, &p) in local_peers.iter().enumerate() {
            if p == my_rank || local_peers[..i].contains(&p) {
                return Err(invalid_input(format!(
                    "bad local peer list {local_peers:?} for rank {my_rank}"
                )));
            }
        }
        let len = segment_len(local_peers.len(), ring_bytes)
            .ok_or_else(|| invalid_input("shm segment size overflows".into()))?;
        let segment = dir.join(format!("{name}-r{my_rank}"));
        let doorbell = dir.join(format!("{name}-r{my_rank}.bell"));

        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&segment)
            .map_err(|e| {
                io::Error::new(e.kind(), format!("shm segment {}: {e}", segment.display()))
            })?;
        let mut seg_guard = RemoveOnError(Some(&segment));
        allocate(&file, len)?;
        let map = MmapOptions::new().len(len).populate().map_raw(&file)?;

        let mut nonce = [0u8; 8];
        getrandom::getrandom(&mut nonce).map_err(|e| io::Error::other(e.to_string()))?;
        let nonce = u64::from_le_bytes(nonce);
        init_segment(&map, my_rank, local_peers, ring_bytes, nonce);

        let c_bell = std::ffi::CString::new(doorbell.as_os_str().as_bytes()).map_err(|_| {
            invalid_input(format!("doorbell path {} has a NUL", doorbell.display()))
        })?;
        // SAFETY: c_bell is a valid NUL-terminated path.
        if unsafe { libc::mkfifo(c_bell.as_ptr(), 0o600) } != 0 {
            let err = io::Error::last_os_error();
            return Err(io::Error::new(
                err.kind(),
                format!("mkfifo {}: {err}", doorbell.display()),
            ));
        }
        let mut bell_guard = RemoveOnError(Some(&doorbell));
        let bell = open_fifo(&doorbell)?;
        seg_guard.0 = None;
        bell_guard.0 = None;

        let endpoint = ShmEndpoint {
            rank: my_rank,
            pid: std::process::id(),
            segment: segment.clone(),
            doorbell: doorbell.clone(),
            ring_bytes,
            peers: local_peers.to_vec(),
            nonce,
        };
        Ok(ShmDomain {
            shared: Arc::new(DomainShared { map, bell }),
            endpoint,
            connected: Mutex::new(vec![false; local_peers.len()]),
            unlinked: AtomicBool::new(false),
        })
    }

    /// This rank's endpoint, to publish to its peers.
    pub fn endpoint(&self) -> &ShmEndpoint {
        &self.endpoint
    }

    /// The doorbell's read descriptor (shared by all links of this domain).
    pub fn doorbell_fd(&self) -> RawFd {
        self.shared.bell.as_raw_fd()
    }

    /// Connects to a peer's published endpoint, validating everything read from it.
    ///
    /// Fails with `InvalidData` on a mismatched or corrupt endpoint or segment, `InvalidInput` if
    /// `peer.rank` is not one of this domain's local peers, `AlreadyExists` on a second connect to
    /// the same peer, and the OS error if a file is missing or the peer process is gone.
    pub fn connect(&self, peer: &ShmEndpoint) -> io::Result<ShmLink> {
        let me = self.endpoint.rank;
        let inbound_idx = self
            .endpoint
            .peers
            .iter()
            .position(|&p| p == peer.rank)
            .ok_or_else(|| {
                invalid_input(format!(
                    "rank {} is not a local peer of rank {me}",
                    peer.rank
                ))
            })?;
        let outbound_idx = validate_endpoint(peer, me)?;
        let peer_map = map_peer_segment(peer, me, outbound_idx)?;
        let peer_bell = open_fifo(&peer.doorbell)?;
        let pidfd = if peer.pid == std::process::id() {
            None
        } else {
            Some(pidfd_open(peer.pid)?)
        };

        {
            let mut connected = self.connected.lock().unwrap_or_else(|e| e.into_inner());
            let slot = connected
                .get_mut(inbound_idx)
                .ok_or_else(|| invalid_input("inbound ring index out of range".into()))?;
            if *slot {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!(
                        "rank {me} is already connected to rank {} over shm",
                        peer.rank
                    ),
                ));
            }
            *slot = true;
        }
        let ring_bytes = self.endpoint.ring_bytes;
        // SAFETY: inbound_idx < peers.len() = n_rings of our own segment; outbound_idx < peer's
        // n_rings, and map_peer_segment checked that mapping's length. The link keeps both maps.
        let (inbound, outbound) = unsafe {
            (
                RingView::new(&self.shared.map, inbound_idx, ring_bytes),
                RingView::new(&peer_map, outbound_idx, peer.ring_bytes),
            )
        };
        tracing::debug!(me, peer = peer.rank, pid = peer.pid, "shm link connected");
        Ok(ShmLink {
            inbound,
            outbound,
            peer_rank: peer.rank,
            peer_pid: peer.pid,
            peer_bell,
            pidfd,
            local_closed: false,
            peer_gone: false,
            _peer_map: peer_map,
            domain: Arc::clone(&self.shared),
        })
    }

    /// Removes the segment and doorbell paths (mapped memory and open descriptors stay valid).
    /// Call once every peer has connected, so nothing is left behind even after a crash.
    /// Idempotent; a path already gone is not an error.
    pub fn unlink_files(&self) -> io::Result<()> {
        if self.unlinked.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let mut result = Ok(());
        for path in [&self.endpoint.segment, &self.endpoint.doorbell] {
            match std::fs::remove_file(path) {
                Err(e) if e.kind() != io::ErrorKind::NotFound && result.is_ok() => result = Err(e),
                _ => {}
            }
        }
        result
    }
}

impl Drop for ShmDomain {
    fn drop(&mut self) {
        if let Err(e) = self.unlink_files() {
            tracing::debug!(error = %e, "removing shm files");
        }
    }
}

/// Reserves `len` bytes of backing store (falls back to a sparse file where unsupported).
fn allocate(file: &File, len: usize) -> io::Result<()> {
    let off_len =
        libc::off_t::try_from(len).map_err(|_| invalid_input("segment too large".into()))?;
    // SAFETY: plain syscall on an open descriptor; returns an error number, not -1/errno.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, off_len) };
    match rc {
        0 => Ok(()),
        libc::EOPNOTSUPP | libc::EINVAL => file.set_len(len as u64),
        e => Err(io::Error::from_raw_os_error(e)),
    }
}

/// Writes the segment header and every ring header of a fresh (zeroed) segment.
fn init_segment(map: &MmapRaw, rank: usize, peers: &[usize], ring_bytes: usize, nonce: u64) {
    let seg = segment_header(map);
    seg.version.store(LAYOUT_VERSION, Ordering::Relaxed);
    seg.owner_rank.store(rank as u64, Ordering::Relaxed);
    seg.n_rings.store(peers.len() as u64, Ordering::Relaxed);
    seg.ring_bytes.store(ring_bytes as u64, Ordering::Relaxed);
    seg.nonce.store(nonce, Ordering::Relaxed);
    for (k, &p) in peers.iter().enumerate() {
        // SAFETY: k < peers.len() and the map was sized by segment_len(peers.len(), ring_bytes).
        let hdr = unsafe { ring_header_ptr(map, k, ring_bytes).as_ref() };
        hdr.info
            .capacity
            .store(ring_bytes as u64, Ordering::Relaxed);
        hdr.info.producer_rank.store(p as u64, Ordering::Relaxed);
        hdr.info.consumer_rank.store(rank as u64, Ordering::Relaxed);
        hdr.info.magic.store(RING_MAGIC, Ordering::Release);
    }
    seg.magic.store(SEGMENT_MAGIC, Ordering::Release);
}

/// Checks a peer's endpoint against this rank; returns the index of my outbound ring in it.
fn validate_endpoint(peer: &ShmEndpoint, me: usize) -> io::Result<usize> {
    if peer.rank == me {
        return Err(invalid_data(format!(
            "shm endpoint of rank {me} is this rank itself"
        )));
    }
    check_ring_bytes(peer.ring_bytes)?;
    let idx = peer.peers.iter().position(|&p| p == me).ok_or_else(|| {
        invalid_data(format!(
            "rank {me} is not in the peer list {:?} of rank {}",
            peer.peers, peer.rank
        ))
    })?;
    if peer.peers[idx + 1..].contains(&me) {
        return Err(invalid_data(format!(
            "rank {me} appears twice in rank {}'s peer list",
            peer.rank
        )));
    }
    Ok(idx)
}

/// Maps the peer's segment and checks its headers against the endpoint.
fn map_peer_segment(peer: &ShmEndpoint, me: usize, idx: usize) -> io::Result<MmapRaw> {
    let path = &peer.segment;
    let bad = |what: String| {
        invalid_data(format!(
            "shm segment {} of rank {}: {what}",
            path.display(),
            peer.rank
        ))
    };
    let expected = segment_len(peer.peers.len(), peer.ring_bytes)
        .ok_or_else(|| bad("size overflows".into()))?;
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("shm segment {} of rank {}: {e}", path.display(), peer.rank),
            )
        })?;
    let meta = file.metadata()?;
    if !meta.is_file() || meta.len() != expected as u64 {
        return Err(bad(format!(
            "size {} but the endpoint implies {expected}",
            meta.len()
        )));
    }
    let map = MmapOptions::new().len(expected).populate().map_raw(&file)?;
    let seg = segment_header(&map);
    let load = |a: &AtomicU64| a.load(Ordering::Acquire);
    if load(&seg.magic) != SEGMENT_MAGIC || load(&seg.version) != LAYOUT_VERSION {
        return Err(bad("bad magic or layout version".into()));
    }
    let fields = [
        load(&seg.owner_rank),
        load(&seg.n_rings),
        load(&seg.ring_bytes),
        load(&seg.nonce),
    ];
    let want = [
        peer.rank as u64,
        peer.peers.len() as u64,
        peer.ring_bytes as u64,
        peer.nonce,
    ];
    if fields != want {
        return Err(bad(format!(
            "header (rank, rings, ring bytes, nonce) = {fields:?}, endpoint says {want:?}"
        )));
    }
    // SAFETY: idx < peers.len() = n_rings and the mapping has the full expected length.
    let ring = unsafe { ring_header_ptr(&map, idx, peer.ring_bytes).as_ref() };
    let info = [
        load(&ring.info.magic),
        load(&ring.info.capacity),
        load(&ring.info.producer_rank),
        load(&ring.info.consumer_rank),
    ];
    let want = [
        RING_MAGIC,
        peer.ring_bytes as u64,
        me as u64,
        peer.rank as u64,
    ];
    if info != want {
        return Err(bad(format!(
            "ring {idx} header {info:?}, expected {want:?}"
        )));
    }
    Ok(map)
}

// ---------------------------------------------------------------------------------------------
// Link
// ---------------------------------------------------------------------------------------------

/// A full-duplex byte link to one peer on the same host over two shared-memory rings.
pub struct ShmLink {
    /// Ring I consume, in my segment (kept alive by `domain`).
    inbound: RingView,
    /// Ring I produce into, in the peer's segment (kept alive by `_peer_map`).
    outbound: RingView,
    peer_rank: usize,
    peer_pid: u32,
    /// The peer's doorbell, opened for writing.
    peer_bell: OwnedFd,
    /// Readable once the peer process exits; `None` for a peer in this process.
    pidfd: Option<OwnedFd>,
    local_closed: bool,
    /// Sticky: the pidfd reported the peer's exit.
    peer_gone: bool,
    _peer_map: MmapRaw,
    domain: Arc<DomainShared>,
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
