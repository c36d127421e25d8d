//! Turning the SIGBUS of a shard truncated under a running job into an error naming the shard.
//!
//! Shards are read through memory maps. When a mapped file shrinks (another process truncates
//! it), the kernel unmaps its pages past the new end, and the next read of one raises SIGBUS,
//! whose default action kills the process without a word. A length check before mapping cannot
//! close that window: the file can shrink at any time after.
//!
//! So every shard map is registered here ([`Guard::register`]: its address range, in a fixed
//! table of atomics a signal handler can read), and a SIGBUS handler is installed once. On a
//! fault inside a registered range the handler marks that map faulted and maps one anonymous
//! zero page over the faulting page (`mmap(MAP_FIXED)`, a plain system call), then returns:
//! the read is retried and sees zeros. Every reader of a shard checks the mark after it has
//! copied ([`Guard::faulted`], through `Shard::intact`), so the zeros are never used: the read
//! fails with [`crate::DataError::CorruptShard`] naming the file, and every later read of that
//! map too. A fault anywhere else goes to the handler that was installed before (Rust's own,
//! which reports stack overflows), or, where there was none, restores the default action and
//! returns, so the fault repeats and ends the process as it would have.
//!
//! When the table is full (more than [`SLOTS`] maps at once) a map is not registered and reads
//! of it are unprotected, as before.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Maps that can be registered at once.
pub const SLOTS: usize = 1024;

/// Start address of each registered map (0: free slot).
static START: [AtomicUsize; SLOTS] = [const { AtomicUsize::new(0) }; SLOTS];
/// Length of each registered map (0 while being registered or released).
static LEN: [AtomicUsize; SLOTS] = [const { AtomicUsize::new(0) }; SLOTS];
/// Whether a read of each registered map faulted.
static FAULTED: [AtomicBool; SLOTS] = [const { AtomicBool::new(false) }; SLOTS];
/// The system page size, read when the handler is installed.
static PAGE: AtomicUsize = AtomicUsize::new(4096);
/// The SIGBUS action before ours (None: installing ours failed).
static PREVIOUS: OnceLock<Option<libc::sigaction>> = OnceLock::new();

/// A map's registration: released when dropped (before the map is unmapped).
#[derive(Debug)]
pub(crate) struct Guard {
    slot: Option<usize>,
}

impl Guard {
    /// Registers the `len` bytes mapped at `start` (installing the handler the first time).
    pub(crate) fn register(start: *const u8, len: usize) -> Guard {
        if PREVIOUS.get_or_init(install).is_none() || len == 0 {
            return Guard { slot: None };
        }
        let addr = start as usize;
        let slot = (0..SLOTS).find(|&i| {
            START[i]
                .compare_exchange(0, addr, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        });
        if let Some(i) = slot {
            FAULTED[i].store(false, Ordering::Relaxed);
            LEN[i].store(len, Ordering::Release);
        }
        Guard { slot }
    }

    /// Whether a read of the map faulted (it shrank on disk): its contents cannot be trusted.
    pub(crate) fn faulted(&self) -> bool {
        self.slot
            .is_some_and(|i| FAULTED[i].load(Ordering::Acquire))
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(i) = self.slot {
            LEN[i].store(0, Ordering::Release);
            START[i].store(0, Ordering::Release);
        }
    }
}

/// Installs [`on_sigbus`], returning the action it replaced (None if it could not).
fn install() -> Option<libc::sigaction> {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if page > 0 {
        PAGE.store(page as usize, Ordering::Relaxed);
    }
    // SAFETY: a zeroed sigaction is a valid value (empty mask, no flags) that is then filled;
    // `on_sigbus` has the SA_SIGINFO signature; `previous` is written by the call.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_sigbus as *const () as libc::sighandler_t;
        action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        libc::sigemptyset(&mut action.sa_mask);
        let mut previous: libc::sigaction = std::mem::zeroed();
        (libc::sigaction(libc::SIGBUS, &action, &mut previous) == 0).then_some(previous)
    }
}

/// The SIGBUS handler (see the module doc). Async-signal-safe: atomics and system calls only.
extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as usize;
    for i in 0..SLOTS {
        let len = LEN[i].load(Ordering::Acquire);
        let start = START[i].load(Ordering::Acquire);
        if len == 0 || start == 0 || addr < start || addr - start >= len {
            continue;
        }
        FAULTED[i].store(true, Ordering::Release);
        let page = PAGE.load(Ordering::Relaxed);
        // SAFETY: replaces one page inside a live read-only map this process owns (the slot is
        // registered only while the map lives) with a private zero page; nothing is freed.
        let mapped = unsafe {
            libc::mmap(
                (addr & !(page - 1)) as *mut libc::c_void,
                page,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if mapped != libc::MAP_FAILED {
            return;
        }
        break;
    }
    chain(sig, info, ctx);
}

/// Passes a fault that is not ours to the action before ours, or restores the default action
/// so that the repeated fault ends the process.
fn chain(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let previous = PREVIOUS.get().copied().flatten();
    match previous {
        Some(p) if p.sa_sigaction != libc::SIG_DFL && p.sa_sigaction != libc::SIG_IGN => {
            if p.sa_flags & libc::SA_SIGINFO != 0 {
                // SAFETY: the previous handler was installed with SA_SIGINFO, so it has this
                // signature, and is called with the arguments the kernel gave us.
                let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                    unsafe { std::mem::transmute(p.sa_sigaction) };
                f(sig, info, ctx);
            } else {
                // SAFETY: a handler installed without SA_SIGINFO takes the signal number only.
                let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(p.sa_sigaction) };
                f(sig);
            }
        }
        _ => {
            // SAFETY: restoring the default action; the faulting read then repeats and the
            // process ends by SIGBUS, as it would have without this module.
            unsafe {
                let mut dfl: libc::sigaction = std::mem::zeroed();
                dfl.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(sig, &dfl, std::ptr::null_mut());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_read_past_a_truncated_end_is_caught() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shard");
        let mut f = std::fs::File::create(&path).unwrap();
        f.write_all(&vec![7u8; 1 << 16]).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        // SAFETY: a read-only map of a file this test owns (truncated below on purpose).
        let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
        let guard = Guard::register(map.as_ptr(), map.len());
        assert_eq!(map[40_000], 7);
        assert!(!guard.faulted());
        f.set_len(4096).unwrap();
        // Without the handler this read ends the test process by SIGBUS.
        let v = std::hint::black_box(&map[..])[40_000];
        assert_eq!(v, 0);
        assert!(guard.faulted());
        // The part still on disk reads as before.
        assert_eq!(map[100], 7);
    }
}
