//! A network partition of this process, for fault injection (`--chaos partition@...`, see
//! `launch::chaos`): between [`cut_for`] and the moment it heals, this process's collective
//! transfers ([`crate::engine::exchange`]) and store requests ([`crate::store::StoreClient`])
//! neither send nor receive. They wait, without spinning, until the partition heals or their own
//! deadline passes, whichever comes first; at the deadline they fail as a silent peer makes them
//! fail (a timeout), so both sides of the cut notice it through their ordinary timeouts, and
//! nothing is reset or closed: a partition is silence.
//!
//! This is the one entry point of partitions into the comm crate. It is process-wide state on
//! purpose: a partition is a property of the host's network, which every link and store client
//! of the process shares, as they share the host's network interface. It needs no privileges
//! and no firewall, so it works the same on a real host and in the network-namespace harness;
//! what it cannot reproduce is a cut inside the host (links between ranks of the same node wait
//! too, which changes nothing for a job whose every collective spans nodes).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// When the current partition heals, in nanoseconds after [`origin`] (0: not cut).
static HEALS_AT: AtomicU64 = AtomicU64::new(0);

fn origin() -> Instant {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    *ORIGIN.get_or_init(Instant::now)
}

/// Cuts this process off the network for `d` from now (replacing any partition in force).
pub fn cut_for(d: Duration) {
    let o = origin();
    let at = (Instant::now() + d).saturating_duration_since(o);
    let nanos = u64::try_from(at.as_nanos()).unwrap_or(u64::MAX).max(1);
    HEALS_AT.store(nanos, Ordering::SeqCst);
}

/// How long the partition in force still lasts; `None` when this process is not cut off.
pub fn remaining() -> Option<Duration> {
    let heals = HEALS_AT.load(Ordering::SeqCst);
    if heals == 0 {
        return None;
    }
    let at = origin() + Duration::from_nanos(heals);
    let left = at.saturating_duration_since(Instant::now());
    if left.is_zero() {
        // Healed: forget it (a later cut_for may have replaced it meanwhile; keep that one).
        let _ = HEALS_AT.compare_exchange(heals, 0, Ordering::SeqCst, Ordering::SeqCst);
        return None;
    }
    Some(left)
}

/// Holds the caller while this process is cut off, until the partition heals or `deadline`
/// passes. Returns `true` when the deadline came first (still cut off: the caller fails as on a
/// timeout), `false` when the caller may talk (never cut, or healed).
pub fn hold(deadline: Instant) -> bool {
    while let Some(left) = remaining() {
        let now = Instant::now();
        if now >= deadline {
            return true;
        }
        std::thread::sleep(left.min(deadline - now));
    }
    false
}

// Tested in tests/partition.rs, a process of its own: a cut holds every thread of the process,
// and this crate's unit tests run side by side in one.
