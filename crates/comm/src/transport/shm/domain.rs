//! A rank's shared-memory domain: its segment and doorbell, endpoints, connecting to peers, and
//! the doorbell and pidfd helpers.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use memmap2::{MmapOptions, MmapRaw};

use super::layout::{
    check_ring_bytes, init_segment, invalid_data, invalid_input, map_peer_segment, segment_len,
};
use super::link::{RingView, ShmLink};

// ---------------------------------------------------------------------------------------------
// Doorbells and pidfds
// ---------------------------------------------------------------------------------------------

/// Writes one byte to a doorbell; a full pipe (EAGAIN) means it is already rung.
pub(super) fn ring_bell(fd: BorrowedFd<'_>) {
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
pub(super) fn drain_bell(fd: BorrowedFd<'_>) {
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
pub(super) fn readable_now(fd: BorrowedFd<'_>) -> bool {
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
pub(super) struct DomainShared {
    map: MmapRaw,
    pub(super) bell: OwnedFd,
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
