//! Segment and ring layout: header structs, constants, offsets, and the initialisation and
//! validation of a mapped segment.

use std::fs::OpenOptions;
use std::io;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use memmap2::{MmapOptions, MmapRaw};

use super::domain::ShmEndpoint;

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
pub(super) struct ProducerLine {
    pub(super) head: AtomicU64,
    pub(super) writer_waiting: AtomicU32,
    pub(super) writer_closed: AtomicU32,
}

/// Written by the consumer (and `reader_waiting` cleared by the producer when it wakes it).
#[repr(C, align(128))]
pub(super) struct ConsumerLine {
    pub(super) tail: AtomicU64,
    pub(super) reader_waiting: AtomicU32,
    pub(super) reader_closed: AtomicU32,
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
pub(super) struct RingHeader {
    pub(super) prod: ProducerLine,
    pub(super) cons: ConsumerLine,
    info: RingInfo,
}

const SEGMENT_HEADER: usize = size_of::<SegmentHeader>();
pub(super) const RING_HEADER: usize = size_of::<RingHeader>();
const _: () = assert!(SEGMENT_HEADER == LINE && RING_HEADER == 3 * LINE);

/// Distance between consecutive rings of a segment (keeps every header 128-aligned).
fn ring_stride(ring_bytes: usize) -> usize {
    RING_HEADER + ring_bytes.next_multiple_of(LINE)
}

/// Total segment size, or `None` on overflow.
pub(super) fn segment_len(n_rings: usize, ring_bytes: usize) -> Option<usize> {
    n_rings
        .checked_mul(ring_stride(ring_bytes))?
        .checked_add(SEGMENT_HEADER)
}

pub(super) fn check_ring_bytes(ring_bytes: usize) -> io::Result<()> {
    if ring_bytes == 0 || ring_bytes & 63 != 0 || ring_bytes > MAX_RING_BYTES {
        return Err(invalid_data(format!(
            "ring size {ring_bytes} must be a non-zero multiple of 64 of at most {MAX_RING_BYTES}"
        )));
    }
    Ok(())
}

pub(super) fn invalid_data(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

pub(super) fn invalid_input(msg: String) -> io::Error {
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
pub(super) unsafe fn ring_header_ptr(
    map: &MmapRaw,
    k: usize,
    ring_bytes: usize,
) -> NonNull<RingHeader> {
    // SAFETY: the caller guarantees the offset lies inside the mapping, which is non-null.
    unsafe {
        let p = map
            .as_mut_ptr()
            .add(SEGMENT_HEADER + k * ring_stride(ring_bytes));
        NonNull::new_unchecked(p.cast::<RingHeader>())
    }
}

// ---------------------------------------------------------------------------------------------
// Segment initialisation and validation
// ---------------------------------------------------------------------------------------------

/// Writes the segment header and every ring header of a fresh (zeroed) segment.
pub(super) fn init_segment(
    map: &MmapRaw,
    rank: usize,
    peers: &[usize],
    ring_bytes: usize,
    nonce: u64,
) {
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

/// Maps the peer's segment and checks its headers against the endpoint.
pub(super) fn map_peer_segment(peer: &ShmEndpoint, me: usize, idx: usize) -> io::Result<MmapRaw> {
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
