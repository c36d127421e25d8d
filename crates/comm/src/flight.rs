//! The flight recorder: each group keeps its last N ops (state, sizes, algorithm, timings) and
//! prints them when anything fails, so a post-mortem shows what every rank was doing.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Default number of ops kept per group.
pub const DEFAULT_CAPACITY: usize = 64;

/// Where an op is in its life.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpState {
    /// Submitted (async) and waiting for its turn.
    Queued,
    /// Communicating.
    Running,
    /// Finished successfully.
    Done,
    /// Failed with this message.
    Failed(String),
}

/// One recorded op.
#[derive(Debug, Clone)]
pub struct FlightEntry {
    /// Recorder-local id (unique; collectives and point-to-point ops number `seq` separately).
    pub id: u64,
    /// Wire sequence number of the op (per group for collectives, per pair for send/recv).
    pub seq: u64,
    pub kind: &'static str,
    pub dtype: &'static str,
    pub bytes: usize,
    pub algo: &'static str,
    pub state: OpState,
    pub submitted: Instant,
    pub started: Option<Instant>,
    pub finished: Option<Instant>,
    /// Bytes this rank put on the wire.
    pub bytes_sent: u64,
    /// What an event entry ([`FlightRecorder::event`]) says; `None` for ops.
    pub note: Option<String>,
}

impl FlightEntry {
    /// Time spent communicating (so far, if still running).
    pub fn elapsed(&self) -> Option<Duration> {
        let s = self.started?;
        Some(self.finished.unwrap_or_else(Instant::now) - s)
    }
}

/// A bounded log of a group's recent ops.
pub struct FlightRecorder {
    capacity: usize,
    entries: Mutex<VecDeque<FlightEntry>>,
}

impl FlightRecorder {
    /// A recorder that keeps the last `capacity` ops.
    pub fn new(capacity: usize) -> Self {
        FlightRecorder {
            capacity: capacity.max(1),
            entries: Mutex::new(VecDeque::with_capacity(capacity.max(1))),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<FlightEntry>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records a new op in state `Queued` (or `Running` when `running`); returns its id for
    /// [`start`](Self::start) and [`finish`](Self::finish).
    pub fn record(
        &self,
        seq: u64,
        kind: &'static str,
        dtype: &'static str,
        bytes: usize,
        running: bool,
    ) -> u64 {
        let now = Instant::now();
        let mut e = self.lock();
        if e.len() == self.capacity {
            e.pop_front();
        }
        let id = e.back().map_or(0, |x| x.id + 1);
        e.push_back(FlightEntry {
            id,
            seq,
            kind,
            dtype,
            bytes,
            algo: "-",
            state: if running {
                OpState::Running
            } else {
                OpState::Queued
            },
            submitted: now,
            started: running.then_some(now),
            finished: None,
            bytes_sent: 0,
            note: None,
        });
        id
    }

    /// Records an event that is not an op, of kind `kind` (e.g. `straggler`), saying `note`:
    /// it is dumped among the ops around it, so a post-mortem shows it in context.
    pub fn event(&self, kind: &'static str, note: String) {
        let id = self.record(0, kind, "-", 0, true);
        self.update(id, |x| {
            x.finished = x.started;
            x.state = OpState::Done;
            x.note = Some(note);
        });
    }

    fn update(&self, id: u64, f: impl FnOnce(&mut FlightEntry)) {
        if let Some(x) = self.lock().iter_mut().rev().find(|x| x.id == id) {
            f(x);
        }
    }

    /// Marks op `id` running with `algo`.
    pub fn start(&self, id: u64, algo: &'static str) {
        self.update(id, |x| {
            x.state = OpState::Running;
            x.algo = algo;
            x.started.get_or_insert_with(Instant::now);
        });
    }

    /// Marks op `id` finished (`Ok`) or failed.
    pub fn finish(&self, id: u64, bytes_sent: u64, result: std::result::Result<(), String>) {
        self.update(id, |x| {
            x.finished = Some(Instant::now());
            x.bytes_sent = bytes_sent;
            x.state = match result {
                Ok(()) => OpState::Done,
                Err(m) => OpState::Failed(m),
            };
        });
    }

    /// A copy of the recorded ops, oldest first.
    pub fn entries(&self) -> Vec<FlightEntry> {
        self.lock().iter().cloned().collect()
    }

    /// The recorded ops as a table, oldest first.
    pub fn dump(&self) -> String {
        let mut s = String::from(
            "seq    op              dtype  bytes        algo              state     elapsed_us  sent\n",
        );
        for x in self.lock().iter() {
            let state = match &x.state {
                OpState::Queued => "queued".to_string(),
                OpState::Running => "RUNNING".to_string(),
                OpState::Done => "done".to_string(),
                OpState::Failed(m) => format!("FAILED: {m}"),
            };
            let el = x
                .elapsed()
                .map(|d| d.as_micros().to_string())
                .unwrap_or_else(|| "-".into());
            let _ = writeln!(
                s,
                "{:<6} {:<15} {:<6} {:<12} {:<17} {:<9} {:<11} {}",
                x.seq, x.kind, x.dtype, x.bytes, x.algo, state, el, x.bytes_sent
            );
            if let Some(n) = &x.note {
                let _ = writeln!(s, "       {n}");
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_dumped_among_the_ops() {
        let r = FlightRecorder::new(4);
        let id = r.record(0, "all_gather", "f64", 16, true);
        r.finish(id, 16, Ok(()));
        r.event("straggler", "rank 1 is 3.0x slower".into());
        let e = r.entries();
        assert_eq!(e[1].kind, "straggler");
        assert_eq!(e[1].state, OpState::Done);
        let d = r.dump();
        assert!(
            d.contains("straggler") && d.contains("rank 1 is 3.0x slower"),
            "{d}"
        );
    }

    #[test]
    fn keeps_last_n_and_reports_failure() {
        let r = FlightRecorder::new(2);
        let mut last = 0;
        for seq in 0..3 {
            last = r.record(seq, "all_reduce", "f32", 16, true);
            r.start(last, "ring");
        }
        r.finish(last, 10, Err("timeout".into()));
        let e = r.entries();
        assert_eq!(e.iter().map(|x| x.seq).collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!(e[1].state, OpState::Failed("timeout".into()));
        assert!(r.dump().contains("FAILED: timeout"));
    }
}
