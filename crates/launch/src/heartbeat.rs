//! Heartbeats (001 section 12.6: failure detection by heartbeat timeout and watchdog).
//!
//! Each worker runs a background thread that publishes a [`Beat`] under
//! [`key`]`(generation, rank)` in the rendezvous store every period, and at once whenever the
//! training loop reports progress. The store fences requests by generation, so a worker of an
//! older generation cannot write into the new one's keys. The agent times beats with its own
//! clock (it notes when the value last changed), so clocks of different hosts never compare.

use crate::error::Result;
use comm::group::Rendezvous;
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Longest a store request of the heartbeat thread may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// The store key of `rank`'s heartbeat in `generation`.
pub fn key(generation: u64, rank: usize) -> String {
    format!("launch/g{generation}/hb/{rank}")
}

/// One heartbeat: a counter that moves on every publication, and the worker's progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Beat {
    /// Publications so far (so an unchanged value means a silent worker).
    pub seq: u64,
    /// The step the worker resumed from (0 for a fresh start), once it knows.
    pub resumed: Option<u64>,
    /// The last completed step (equal to `resumed` before the first step of this generation).
    pub step: Option<u64>,
    /// Training is over (final save, barrier, exit): the step no longer advances.
    pub finishing: bool,
    /// Inside a step (started `step + 1`, not yet completed it). A rank stuck outside a step
    /// holds up peers that wait inside one, so this tells the culprit from its victims.
    pub busy: bool,
}

impl Beat {
    /// The text stored in the store: `seq resumed step finishing busy`, `-` for unknown.
    pub fn encode(&self) -> String {
        let opt = |v: Option<u64>| v.map_or_else(|| "-".to_string(), |v| v.to_string());
        format!(
            "{} {} {} {} {}",
            self.seq,
            opt(self.resumed),
            opt(self.step),
            u8::from(self.finishing),
            u8::from(self.busy)
        )
    }

    /// Parses [`Beat::encode`]'s text; `None` if malformed.
    pub fn decode(bytes: &[u8]) -> Option<Beat> {
        let text = std::str::from_utf8(bytes).ok()?;
        let mut f = text.split_whitespace();
        let opt = |s: &str| -> Option<Option<u64>> {
            if s == "-" {
                Some(None)
            } else {
                s.parse().ok().map(Some)
            }
        };
        let beat = Beat {
            seq: f.next()?.parse().ok()?,
            resumed: opt(f.next()?)?,
            step: opt(f.next()?)?,
            finishing: f.next()? == "1",
            busy: f.next()? == "1",
        };
        f.next().is_none().then_some(beat)
    }
}

enum Msg {
    Resumed(u64),
    Started,
    Completed(u64),
    Finishing,
    Stop,
}

/// What the thread has published, for [`Heartbeat::flush`].
#[derive(Default)]
struct Published {
    step: Option<u64>,
    stopped: bool,
}

/// The worker side: a thread publishing this rank's beats until dropped.
pub struct Heartbeat {
    tx: Sender<Msg>,
    published: Arc<(Mutex<Published>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl Heartbeat {
    /// Connects to the store of `rdv` (stamped with its generation) and starts publishing
    /// `rank`'s beats every `period`.
    pub fn start(rdv: &Rendezvous, rank: usize, period: Duration) -> Result<Heartbeat> {
        let store = rdv.connect(Duration::from_secs(60))?;
        let store = store.with_timeout(REQUEST_TIMEOUT);
        let key = key(rdv.generation, rank);
        let (tx, rx) = mpsc::channel();
        let published = Arc::new((Mutex::new(Published::default()), Condvar::new()));
        let shared = published.clone();
        let thread = std::thread::Builder::new()
            .name(format!("heartbeat-{rank}"))
            .spawn(move || {
                let mut beat = Beat::default();
                let mut failed = false;
                loop {
                    let stop = match rx.recv_timeout(period) {
                        Ok(Msg::Resumed(s)) => {
                            (beat.resumed, beat.step) = (Some(s), Some(s));
                            false
                        }
                        Ok(Msg::Started) => {
                            beat.busy = true;
                            false
                        }
                        Ok(Msg::Completed(s)) => {
                            (beat.step, beat.busy) = (Some(s), false);
                            false
                        }
                        Ok(Msg::Finishing) => {
                            beat.finishing = true;
                            false
                        }
                        Err(RecvTimeoutError::Timeout) => false,
                        Ok(Msg::Stop) | Err(RecvTimeoutError::Disconnected) => true,
                    };
                    if stop {
                        break;
                    }
                    beat.seq += 1;
                    match store.set(&key, beat.encode().as_bytes()) {
                        Ok(()) => failed = false,
                        // Said once per outage: the agent notices the silence and acts.
                        Err(e) if !failed => {
                            failed = true;
                            tracing::warn!("heartbeat of rank {rank} not published: {e}");
                        }
                        Err(_) => {}
                    }
                    let (lock, cv) = &*shared;
                    let mut p = lock.lock().unwrap_or_else(|e| e.into_inner());
                    p.step = beat.step;
                    cv.notify_all();
                }
                let (lock, cv) = &*shared;
                lock.lock().unwrap_or_else(|e| e.into_inner()).stopped = true;
                cv.notify_all();
            })
            .map_err(|e| crate::LaunchError::io("start the heartbeat thread", e))?;
        Ok(Heartbeat {
            tx,
            published,
            thread: Some(thread),
        })
    }

    /// The worker resumed from `step` (0: a fresh start); training is about to begin.
    pub fn resumed(&self, step: u64) {
        let _ = self.tx.send(Msg::Resumed(step));
    }

    /// The training loop starts its next step.
    pub fn started(&self) {
        let _ = self.tx.send(Msg::Started);
    }

    /// The training loop completed `step`.
    pub fn completed(&self, step: u64) {
        let _ = self.tx.send(Msg::Completed(step));
    }

    /// The loop is over; the step will not advance again (final save, barrier).
    pub fn finishing(&self) {
        let _ = self.tx.send(Msg::Finishing);
    }

    /// Waits (at most `timeout`) until a beat with step `step` or later has been published.
    pub fn flush(&self, step: u64, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let (lock, cv) = &*self.published;
        let mut p = lock.lock().unwrap_or_else(|e| e.into_inner());
        while !p.stopped && p.step.is_none_or(|s| s < step) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            p = cv
                .wait_timeout(p, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        let _ = self.tx.send(Msg::Stop);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use comm::store::{Secret, StoreServer};

    #[test]
    fn beats_round_trip() {
        for b in [
            Beat::default(),
            Beat {
                seq: 9,
                resumed: Some(4),
                step: Some(6),
                finishing: true,
                busy: true,
            },
        ] {
            assert_eq!(Beat::decode(b.encode().as_bytes()), Some(b));
        }
        for bad in ["", "1 - - 0", "x - - 0 0", "1 - - 0 0 extra", "1 a - 0 0"] {
            assert_eq!(Beat::decode(bad.as_bytes()), None, "{bad}");
        }
    }

    #[test]
    fn a_worker_publishes_progress_and_is_fenced_after_a_bump() {
        let secret = Secret::new(b"0123456789abcdef0123456789abcdef".to_vec()).unwrap();
        let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), secret.clone()).unwrap();
        let rdv = Rendezvous {
            addr: server.local_addr(),
            secret,
            generation: 0,
        };
        let store = rdv.connect(Duration::from_secs(5)).unwrap();
        let hb = Heartbeat::start(&rdv, 1, Duration::from_millis(20)).unwrap();
        hb.resumed(4);
        hb.completed(5);
        hb.flush(5, Duration::from_secs(10));
        let beat = Beat::decode(&store.get(&key(0, 1)).unwrap().unwrap()).unwrap();
        assert_eq!((beat.resumed, beat.step), (Some(4), Some(5)));
        // Generation 1 starts: the old worker's beats no longer land anywhere.
        store.bump_generation(0).unwrap();
        store.set_generation(1);
        hb.completed(6);
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(store.get(&key(1, 1)).unwrap(), None);
        drop(hb);
    }
}
