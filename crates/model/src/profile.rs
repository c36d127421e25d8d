//! Where a step's time goes: per-kernel wall time, off unless enabled.
//!
//! Kernel call sites open a [`scope`]; when profiling is enabled the scope
//! adds its wall time to a per-thread table under its name. When disabled
//! a scope costs one relaxed atomic load.
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

static ENABLED: AtomicBool = AtomicBool::new(false);

thread_local! {
    static TOTALS: RefCell<Vec<(&'static str, f64, u64)>> = const { RefCell::new(Vec::new()) };
}

/// Turn profiling on or off (process-wide).
pub fn enable(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// A timed region; its time is recorded when it is dropped.
pub struct Scope {
    name: &'static str,
    start: Option<Instant>,
}

/// Open a timed region called `name`.
#[inline]
pub fn scope(name: &'static str) -> Scope {
    let start = ENABLED.load(Ordering::Relaxed).then(Instant::now);
    Scope { name, start }
}

impl Drop for Scope {
    fn drop(&mut self) {
        if let Some(s) = self.start {
            let dt = s.elapsed().as_secs_f64();
            TOTALS.with(|t| {
                let mut t = t.borrow_mut();
                match t.iter_mut().find(|e| e.0 == self.name) {
                    Some(e) => {
                        e.1 += dt;
                        e.2 += 1;
                    }
                    None => t.push((self.name, dt, 1)),
                }
            });
        }
    }
}

/// This thread's (name, seconds, calls) table, largest first; clears it.
pub fn take() -> Vec<(&'static str, f64, u64)> {
    let mut v = TOTALS.with(|t| std::mem::take(&mut *t.borrow_mut()));
    v.sort_by(|a, b| b.1.total_cmp(&a.1));
    v
}

/// Evaluate `$e` inside a [`scope`] called `$name`.
macro_rules! timed {
    ($name:expr, $e:expr) => {{
        let _p = $crate::profile::scope($name);
        $e
    }};
}
pub(crate) use timed;
