//! Tests of the shared-memory transport ([`comm::transport::shm`]), with threads as ranks.
//!
//! Every test works in its own directory under `/dev/shm`, removed when it ends.
//!
//! This file holds the helpers shared by the test modules, which are grouped by theme.
mod endpoints;
mod shutdown;
mod streaming;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use comm::transport::shm::{ShmDomain, ShmLink};
use comm::transport::{Link, LinkError, Readiness};

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// A fresh directory under /dev/shm, removed on drop.
pub(crate) struct TempDir(PathBuf);

impl TempDir {
    pub(crate) fn new(tag: &str) -> TempDir {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let path = PathBuf::from(format!(
            "/dev/shm/flotilla-shm-test-{}-{tag}-{n}",
            std::process::id()
        ));
        std::fs::create_dir_all(&path).expect("create temp dir under /dev/shm");
        TempDir(path)
    }

    pub(crate) fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Domains for ranks 0 and 1 and the link pair between them.
pub(crate) fn pair(dir: &Path, ring_bytes: usize) -> (ShmDomain, ShmDomain, ShmLink, ShmLink) {
    let d0 = ShmDomain::create(dir, "pair", 0, &[1], ring_bytes).expect("create rank 0");
    let d1 = ShmDomain::create(dir, "pair", 1, &[0], ring_bytes).expect("create rank 1");
    let l01 = d0.connect(d1.endpoint()).expect("connect 0->1");
    let l10 = d1.connect(d0.endpoint()).expect("connect 1->0");
    (d0, d1, l01, l10)
}

/// Deterministic pseudo-random bytes (xorshift64), different per seed.
pub(crate) fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Sleeps on a stalled link like the progress engine does (5 s limit).
pub(crate) fn wait_one(link: &mut ShmLink, want_send: bool, want_recv: bool) {
    if let Readiness::Fd { fd, events } = link.prepare_wait(want_send, want_recv) {
        poll_fds(&[(fd, events)]);
        link.after_wait();
    }
}

pub(crate) fn poll_fds(fds: &[(i32, i16)]) {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|&(fd, events)| libc::pollfd {
            fd,
            events,
            revents: 0,
        })
        .collect();
    // SAFETY: pfds is a live array of valid pollfd structs.
    let r = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, 5000) };
    assert!(r > 0, "poll timed out or failed (lost wake-up?): {r}");
}

pub(crate) fn expect_closed<T: std::fmt::Debug>(r: Result<T, LinkError>) -> String {
    match r {
        Err(LinkError::Closed(msg)) => msg,
        other => panic!("expected LinkError::Closed, got {other:?}"),
    }
}
