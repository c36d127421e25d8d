//! SIGTERM as a pre-emption notice (a scheduler taking the nodes back: Slurm's `--signal`,
//! `scancel --signal=TERM`, a Kubernetes pod deletion), not as death: the handler only notes
//! the time of the first one, and the agent and the training loop act on it at their next look
//! (the agent within its poll, a worker after its current step).
//!
//! A signal handler is process-wide state by nature; [`Termination`] is the handle that says
//! this process installed one, and whoever acts on it is handed that handle explicitly.

use crate::error::{LaunchError, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// CLOCK_MONOTONIC nanoseconds of the first SIGTERM, plus one (0: none yet).
static TERM_AT_NS: AtomicU64 = AtomicU64::new(0);

/// Nanoseconds on CLOCK_MONOTONIC (0 if the clock cannot be read).
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime(2) writes one timespec we own; it is async-signal-safe (POSIX), so
    // the handler may call it too.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    if rc != 0 {
        return 0;
    }
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

extern "C" fn on_sigterm(_sig: libc::c_int) {
    // Only the first signal's time counts: a scheduler may signal the launcher and every
    // worker (Slurm's `--full`), and the launcher forwards it too.
    let _ = TERM_AT_NS.compare_exchange(
        0,
        monotonic_ns().saturating_add(1),
        Ordering::SeqCst,
        Ordering::SeqCst,
    );
}

/// This process turns SIGTERM into a request to stop (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct Termination {
    _installed: (),
}

impl Termination {
    /// Installs the SIGTERM handler (SA_RESTART: system calls it interrupts are restarted where
    /// the kernel can; the comm and store code retry the rest, EINTR).
    pub fn install() -> Result<Termination> {
        // SAFETY: sigaction(2) with a zeroed struct, an empty mask and a handler that only
        // reads the clock and stores to an atomic (both async-signal-safe).
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_sigterm as extern "C" fn(libc::c_int) as libc::sighandler_t;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            if libc::sigaction(libc::SIGTERM, &sa, std::ptr::null_mut()) != 0 {
                return Err(LaunchError::io(
                    "installing the SIGTERM handler",
                    std::io::Error::last_os_error(),
                ));
            }
        }
        Ok(Termination { _installed: () })
    }

    /// Time since the first SIGTERM, if one arrived.
    pub fn requested(&self) -> Option<Duration> {
        match TERM_AT_NS.load(Ordering::SeqCst) {
            0 => None,
            at => Some(Duration::from_nanos(
                monotonic_ns().saturating_sub(at.saturating_sub(1)),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A SIGTERM to this process is noted, not fatal, and its age grows.
    #[test]
    fn a_sigterm_is_a_request() {
        let t = Termination::install().unwrap();
        assert!(t.requested().is_none());
        // SAFETY: raise(3) on this process; the handler above is installed.
        unsafe {
            libc::raise(libc::SIGTERM);
        }
        let first = t.requested().expect("noted");
        std::thread::sleep(Duration::from_millis(20));
        assert!(t.requested().unwrap() >= first + Duration::from_millis(20));
    }
}
