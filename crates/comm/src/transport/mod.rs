//! Transports: byte links between two ranks, behind one trait (the seam of gloo's `Pair`).
//!
//! A [`Link`] is one full-duplex, in-order byte stream to one peer, driven without blocking:
//! `try_send` and `try_recv_*` move what they can and return at once, and `prepare_wait` tells the
//! progress engine ([`crate::engine`]) what to sleep on (a file descriptor for `poll(2)`) when
//! nothing can move. The engine never spins: it blocks in `poll` with a deadline, and the link
//! wakes it through its socket (TCP) or its doorbell (shared memory).
//!
//! Implementations: [`tcp::TcpLink`] between any two ranks, [`shm::ShmLink`] between ranks that
//! share a host (mapped ring buffers with blocking wake-ups).

pub mod shm;
pub mod tcp;

use std::os::fd::RawFd;

/// Which transport a link uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum LinkKind {
    /// TCP socket (any two hosts).
    Tcp,
    /// Shared-memory ring buffers (same host).
    Shm,
}

impl LinkKind {
    /// Lower-case name.
    pub const fn name(self) -> &'static str {
        match self {
            LinkKind::Tcp => "tcp",
            LinkKind::Shm => "shm",
        }
    }
}

/// A failure of a link (mapped to an op-level error by the engine, which knows the op).
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// The peer closed the connection or its process is gone.
    #[error("peer closed the link ({0})")]
    Closed(String),
    /// Any other I/O error.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// What the engine should wait on before calling the link again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    /// The link can make progress now; do not sleep.
    Ready,
    /// Sleep until `fd` reports any of `events` (`libc::POLLIN`/`POLLOUT`).
    Fd { fd: RawFd, events: i16 },
}

/// One full-duplex, in-order byte stream to a peer, driven without blocking.
pub trait Link: Send {
    /// Which transport this is.
    fn kind(&self) -> LinkKind;

    /// Writes a prefix of `buf`; returns how many bytes were taken (0 when it would block).
    fn try_send(&mut self, buf: &[u8]) -> Result<usize, LinkError>;

    /// Reads available bytes into a prefix of `dst`; returns how many (0 when it would block).
    fn try_recv_into(&mut self, dst: &mut [u8]) -> Result<usize, LinkError>;

    /// Offers up to `max` available bytes to `sink` in contiguous pieces without copying them
    /// first where the transport allows it (shared memory); `sink` returns how many bytes of each
    /// piece it consumed (it may leave a partial element, which is offered again next time).
    /// Returns the number of bytes consumed.
    fn try_recv_with(
        &mut self,
        max: usize,
        sink: &mut dyn FnMut(&[u8]) -> usize,
    ) -> Result<usize, LinkError>;

    /// Called when no transfer can move: arms whatever wake-up the link needs for sending
    /// (`want_send`) and/or receiving (`want_recv`) and says what to sleep on. Must re-check the
    /// condition after arming, so that a wake-up is never lost.
    fn prepare_wait(&mut self, want_send: bool, want_recv: bool) -> Readiness;

    /// Called after the engine woke up (drains doorbells, disarms flags).
    fn after_wait(&mut self) {}

    /// A second descriptor that becomes readable when the peer dies (a pidfd), if the transport
    /// has no end-of-stream of its own.
    fn death_fd(&self) -> Option<RawFd> {
        None
    }

    /// Shuts the link down so the peer sees end-of-stream (best effort).
    fn shutdown(&mut self) {}
}
