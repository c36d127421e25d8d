//! TCP link: one full-duplex socket per pair of ranks, driven non-blocking.
//!
//! Receives that reduce (`try_recv_with`) read into a cache-sized scratch buffer and hand it to
//! the reducer, so receive and reduce interleave in pieces of [`SCRATCH_BYTES`] while the kernel
//! keeps filling the socket buffer behind them. Plain receives read straight into the
//! destination (no intermediate copy).

use super::{Link, LinkError, LinkKind, Readiness};
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;

/// Scratch size for receive-and-reduce: large enough to amortise the syscall, small enough to
/// stay in L2 while it is reduced.
pub const SCRATCH_BYTES: usize = 256 * 1024;

// Socket buffer sizes are left to the kernel's autotuning (tcp_rmem/tcp_wmem): fixing them
// with SO_SNDBUF/SO_RCVBUF turns autotuning off, and measured slower on loopback.

/// A TCP connection to one peer.
pub struct TcpLink {
    stream: TcpStream,
    scratch: Vec<u8>,
    start: usize,
    end: usize,
}

impl TcpLink {
    /// Wraps a connected stream: no Nagle delay, non-blocking, large buffers.
    pub fn new(stream: TcpStream) -> std::io::Result<TcpLink> {
        stream.set_nodelay(true)?;
        stream.set_nonblocking(true)?;
        Ok(TcpLink {
            stream,
            scratch: Vec::new(),
            start: 0,
            end: 0,
        })
    }
}

fn map_err(e: std::io::Error) -> Result<usize, LinkError> {
    match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::Interrupted => Ok(0),
        ErrorKind::ConnectionReset
        | ErrorKind::BrokenPipe
        | ErrorKind::ConnectionAborted
        | ErrorKind::UnexpectedEof => Err(LinkError::Closed(e.to_string())),
        _ => Err(LinkError::Io(e)),
    }
}

impl Link for TcpLink {
    fn kind(&self) -> LinkKind {
        LinkKind::Tcp
    }

    fn try_send(&mut self, buf: &[u8]) -> Result<usize, LinkError> {
        if buf.is_empty() {
            return Ok(0);
        }
        match self.stream.write(buf) {
            Ok(0) => Err(LinkError::Closed("write returned 0".into())),
            Ok(n) => Ok(n),
            Err(e) => map_err(e),
        }
    }

    fn try_recv_into(&mut self, dst: &mut [u8]) -> Result<usize, LinkError> {
        if dst.is_empty() {
            return Ok(0);
        }
        // Bytes already pulled into scratch by an earlier reducing receive come first.
        if self.start < self.end {
            let n = (self.end - self.start).min(dst.len());
            dst[..n].copy_from_slice(&self.scratch[self.start..self.start + n]);
            self.start += n;
            return Ok(n);
        }
        match self.stream.read(dst) {
            Ok(0) => Err(LinkError::Closed("end of stream".into())),
            Ok(n) => Ok(n),
            Err(e) => map_err(e),
        }
    }

    fn try_recv_with(
        &mut self,
        max: usize,
        sink: &mut dyn FnMut(&[u8]) -> usize,
    ) -> Result<usize, LinkError> {
        if max == 0 {
            return Ok(0);
        }
        if self.scratch.is_empty() {
            self.scratch = vec![0u8; SCRATCH_BYTES];
        }
        // Keep any partial element at the front, then top up from the socket.
        if self.start > 0 {
            self.scratch.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let want = max.min(SCRATCH_BYTES);
        if self.end < want {
            match self.stream.read(&mut self.scratch[self.end..want]) {
                Ok(0) => return Err(LinkError::Closed("end of stream".into())),
                Ok(n) => self.end += n,
                Err(e) => {
                    map_err(e)?;
                }
            }
        }
        let avail = (self.end - self.start).min(max);
        if avail == 0 {
            return Ok(0);
        }
        let used = sink(&self.scratch[self.start..self.start + avail]);
        self.start += used;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        // Bytes read but not yet consumed (a partial element) stay in scratch; the caller sees
        // zero progress and waits for the rest of the element.
        Ok(used)
    }

    fn prepare_wait(&mut self, want_send: bool, want_recv: bool) -> Readiness {
        let mut events = 0;
        if want_send {
            events |= libc::POLLOUT;
        }
        if want_recv {
            events |= libc::POLLIN;
        }
        Readiness::Fd {
            fd: self.stream.as_raw_fd(),
            events,
        }
    }

    fn shutdown(&mut self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}
