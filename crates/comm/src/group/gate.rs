//! Local ordering of a group's ops: tickets handed out at submission, served in order.
//!
//! Blocking calls and async submissions share one queue, so an op never overtakes one that was
//! submitted before it on the same rank. Once the group is poisoned (an op failed), every waiter
//! is released with the reason.

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

struct State {
    next: u64,
    serving: u64,
    poisoned: Option<String>,
}

/// A ticket gate.
pub(crate) struct Gate {
    state: Mutex<State>,
    cv: Condvar,
}

/// Why a turn was not granted.
pub(crate) enum TurnError {
    /// The group failed earlier.
    Poisoned(String),
    /// The ops before this one did not finish within the timeout.
    Timeout { waiting_for: u64 },
}

impl Gate {
    pub fn new() -> Gate {
        Gate {
            state: Mutex::new(State {
                next: 0,
                serving: 0,
                poisoned: None,
            }),
            cv: Condvar::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes the next ticket.
    pub fn take(&self) -> u64 {
        let mut s = self.lock();
        s.next += 1;
        s.next - 1
    }

    /// Blocks until `ticket` is served (or the group is poisoned, or `timeout` passes).
    pub fn wait_turn(&self, ticket: u64, timeout: Duration) -> Result<(), TurnError> {
        let deadline = Instant::now() + timeout;
        let mut s = self.lock();
        loop {
            if let Some(p) = &s.poisoned {
                return Err(TurnError::Poisoned(p.clone()));
            }
            if s.serving == ticket {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(TurnError::Timeout {
                    waiting_for: s.serving,
                });
            }
            s = self
                .cv
                .wait_timeout(s, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Finishes the ticket being served.
    pub fn done(&self) {
        self.lock().serving += 1;
        self.cv.notify_all();
    }

    /// Poisons the gate (first reason wins) and releases every waiter.
    pub fn poison(&self, reason: String) {
        let mut s = self.lock();
        if s.poisoned.is_none() {
            s.poisoned = Some(reason);
        }
        drop(s);
        self.cv.notify_all();
    }

    /// The reason the gate was poisoned, if it was.
    pub fn poisoned(&self) -> Option<String> {
        self.lock().poisoned.clone()
    }
}
