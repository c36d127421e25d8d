//! The collectives' timeline for a trace (`flotilla train --trace DIR`): when switched on, every
//! op a group runs (collectives and point-to-point) is recorded with its thread, start and
//! duration, group, size and algorithm, for the caller to [`take`] and write out.
//!
//! One recorder per process (a process is one rank): off, an op pays one atomic load. At most
//! [`CAPACITY`] events are kept between two [`take`]s; later ones are counted as dropped.
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Most events kept between two [`take`]s.
pub const CAPACITY: usize = 1 << 20;

static ON: AtomicBool = AtomicBool::new(false);
static DROPPED: AtomicU64 = AtomicU64::new(0);
static EVENTS: Mutex<Vec<OpEvent>> = Mutex::new(Vec::new());

/// One op as it ran on this rank.
#[derive(Debug, Clone, PartialEq)]
pub struct OpEvent {
    /// The op (`all_reduce`, `send`, ...).
    pub kind: &'static str,
    /// The group it ran in.
    pub group: String,
    /// Payload bytes.
    pub bytes: usize,
    /// The algorithm chosen.
    pub algo: &'static str,
    /// When it started communicating.
    pub start: Instant,
    /// How long it took.
    pub dur: Duration,
    /// The thread that ran it (its name, or its id).
    pub thread: String,
}

/// Starts recording (for the rest of the process).
pub fn enable() {
    ON.store(true, Ordering::Release);
}

/// Whether ops are recorded.
pub fn enabled() -> bool {
    ON.load(Ordering::Acquire)
}

/// The events recorded since the last call, and how many were dropped over [`CAPACITY`].
pub fn take() -> (Vec<OpEvent>, u64) {
    let events = std::mem::take(&mut *EVENTS.lock().unwrap_or_else(PoisonError::into_inner));
    (events, DROPPED.swap(0, Ordering::AcqRel))
}

/// Records an op that started at `start` and has just finished.
pub(crate) fn record(
    kind: &'static str,
    group: &str,
    bytes: usize,
    algo: &'static str,
    start: Instant,
) {
    let dur = start.elapsed();
    let t = std::thread::current();
    let thread = t
        .name()
        .map_or_else(|| format!("{:?}", t.id()), str::to_string);
    let mut events = EVENTS.lock().unwrap_or_else(PoisonError::into_inner);
    if events.len() >= CAPACITY {
        DROPPED.fetch_add(1, Ordering::Relaxed);
        return;
    }
    events.push(OpEvent {
        kind,
        group: group.to_string(),
        bytes,
        algo,
        start,
        dur,
        thread,
    });
}
