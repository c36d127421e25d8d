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

mod domain;
mod layout;
mod link;

pub use domain::{ShmDomain, ShmEndpoint};
pub use layout::{DEFAULT_RING_BYTES, MAX_RING_BYTES};
pub use link::ShmLink;

// Names the module documentation links to.
#[cfg(doc)]
use super::{Link, LinkError, Readiness};
