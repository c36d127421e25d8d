//! Downloading one object into a local file as ranged GETs, several in flight, each hedged.
//!
//! Cost: an object of `S` bytes in chunks of `c` takes `ceil(S / c)` requests, `k` in flight;
//! at one request's latency `a` and the link's bandwidth `B`, about
//! `ceil(S / (c k)) * a + S / B` (000 storage chapter: the object store is a high-latency,
//! high-bandwidth tier, so requests are made large and overlapped).
//!
//! Hedging (004 28.4, "hedged requests"): a request still unanswered after the hedge delay is
//! sent again, and whichever copy answers first is used; the other is dropped (its connection
//! closed). With [`Hedge::Adaptive`] the delay is an upper quantile of the latencies of the
//! last requests (a [`LatencyWindow`] shared by every download of a reader), so only the
//! slowest few percent are duplicated: the extra load is a few percent of requests, and the
//! tail a slow server or a lost packet adds to one request no longer sets the whole
//! download's pace.

use std::collections::VecDeque;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::Path as FsPath;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};

use crate::store::store_err;
use crate::{RemoteStore, Result, StoreError, io_err};

/// When to send a second copy of a ranged GET.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Hedge {
    /// Never: every request is sent once (object_store still retries failed ones).
    Off,
    /// After a fixed delay.
    After(Duration),
    /// After the `quantile` of the window's recent latencies, never sooner than `floor`;
    /// `initial` until the window holds [`LatencyWindow::MIN_SAMPLES`] latencies.
    Adaptive {
        /// Quantile of recent latencies, e.g. 0.95.
        quantile: f64,
        /// Shortest delay.
        floor: Duration,
        /// Delay before enough latencies are known.
        initial: Duration,
    },
}

impl Default for Hedge {
    /// Hedge the slowest 5 % of requests, never sooner than 20 ms, after 1 s at first.
    fn default() -> Self {
        Hedge::Adaptive {
            quantile: 0.95,
            floor: Duration::from_millis(20),
            initial: Duration::from_secs(1),
        }
    }
}

/// The latencies of the last [`LatencyWindow::CAPACITY`] requests (the first answer of each).
#[derive(Debug, Default)]
pub struct LatencyWindow {
    recent: Mutex<VecDeque<Duration>>,
}

impl LatencyWindow {
    /// Latencies kept.
    pub const CAPACITY: usize = 256;
    /// Latencies needed before an adaptive hedge uses the window.
    pub const MIN_SAMPLES: usize = 16;

    fn record(&self, d: Duration) {
        let mut r = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        if r.len() == Self::CAPACITY {
            r.pop_front();
        }
        r.push_back(d);
    }

    /// The `q` quantile of the window, `None` below [`Self::MIN_SAMPLES`] latencies.
    pub fn quantile(&self, q: f64) -> Option<Duration> {
        let mut v: Vec<Duration> = self
            .recent
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .copied()
            .collect();
        if v.len() < Self::MIN_SAMPLES {
            return None;
        }
        v.sort_unstable();
        Some(quantile(&v, q))
    }

    /// The delay after which `hedge` sends a second copy (`None`: never).
    pub fn delay(&self, hedge: Hedge) -> Option<Duration> {
        match hedge {
            Hedge::Off => None,
            Hedge::After(d) => Some(d),
            Hedge::Adaptive {
                quantile,
                floor,
                initial,
            } => Some(self.quantile(quantile).map_or(initial, |d| d.max(floor))),
        }
    }
}

/// How to download an object: chunk size, requests in flight, hedging.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RangedRead {
    /// Bytes per ranged GET.
    pub chunk: u64,
    /// Requests in flight at once (at least 1).
    pub in_flight: usize,
    /// When to hedge a request.
    pub hedge: Hedge,
}

impl Default for RangedRead {
    /// 8 MiB ranges, 4 in flight, the default adaptive hedge.
    fn default() -> Self {
        RangedRead {
            chunk: 8 << 20,
            in_flight: 4,
            hedge: Hedge::default(),
        }
    }
}

/// What one or more downloads did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReadStats {
    /// Ranged GETs made (not counting hedges).
    pub requests: u64,
    /// Bytes written.
    pub bytes: u64,
    /// Requests that were hedged.
    pub hedged: u64,
    /// Hedged requests whose second copy answered first.
    pub hedges_won: u64,
    /// Each request's latency as the reader saw it (the first answer).
    pub latencies: Vec<Duration>,
}

/// The `q` quantile (nearest rank) of `sorted` latencies, ascending; zero when empty.
pub fn quantile(sorted: &[Duration], q: f64) -> Duration {
    match sorted.len() {
        0 => Duration::ZERO,
        n => sorted[((n - 1) as f64 * q.clamp(0.0, 1.0)).round() as usize],
    }
}

/// One answered chunk: its offset, bytes, latency, and whether it was hedged / the hedge won.
struct Answer {
    at: u64,
    bytes: object_store::Result<bytes::Bytes>,
    latency: Duration,
    hedged: bool,
    hedge_won: bool,
}

/// GETs `range` of `path`, sending a second copy after `hedge_after` if the first has not
/// answered; the first answer wins.
async fn hedged_get(
    store: Arc<dyn ObjectStore>,
    path: Path,
    range: Range<u64>,
    hedge_after: Option<Duration>,
) -> Answer {
    let at = range.start;
    let began = Instant::now();
    let first = store.get_range(&path, range.clone());
    tokio::pin!(first);
    let Some(after) = hedge_after else {
        let bytes = first.await;
        return Answer {
            at,
            bytes,
            latency: began.elapsed(),
            hedged: false,
            hedge_won: false,
        };
    };
    tokio::select! {
        bytes = &mut first => Answer { at, bytes, latency: began.elapsed(), hedged: false, hedge_won: false },
        () = tokio::time::sleep(after) => {
            let second = store.get_range(&path, range);
            tokio::pin!(second);
            let (bytes, hedge_won) = tokio::select! {
                b = &mut first => (b, false),
                b = &mut second => (b, true),
            };
            Answer { at, bytes, latency: began.elapsed(), hedged: true, hedge_won }
        }
    }
}

impl RemoteStore {
    /// Downloads the object at `key`, which must be exactly `size` bytes, into `file` (`path`
    /// names it in errors) as `how` says; `window` holds the recent latencies the adaptive
    /// hedge reads and this download adds to.
    ///
    /// # Errors
    /// [`StoreError::Store`] / [`StoreError::Missing`] for a failed request,
    /// [`StoreError::ObjectSize`] when a range comes back short or long, [`StoreError::Io`]
    /// when the file cannot be written.
    pub fn read_ranged(
        &self,
        key: &str,
        size: u64,
        (file, path): (&File, &FsPath),
        how: &RangedRead,
        window: &LatencyWindow,
    ) -> Result<ReadStats> {
        let object = self.path(key)?;
        let chunk = how.chunk.max(1);
        let mut ranges = (0..size.div_ceil(chunk)).map(|i| i * chunk..size.min((i + 1) * chunk));
        let mut stats = ReadStats::default();
        self.runtime.block_on(async {
            let mut tasks = tokio::task::JoinSet::new();
            loop {
                while tasks.len() < how.in_flight.max(1) {
                    let Some(r) = ranges.next() else { break };
                    let after = window.delay(how.hedge);
                    tasks.spawn(hedged_get(self.store.clone(), object.clone(), r, after));
                }
                let Some(done) = tasks.join_next().await else {
                    return Ok(());
                };
                let a = done.map_err(|e| StoreError::Runtime(std::io::Error::other(e)))?;
                let bytes = a.bytes.map_err(store_err("get", key))?;
                let want = chunk.min(size - a.at);
                if bytes.len() as u64 != want {
                    return Err(StoreError::ObjectSize {
                        key: key.to_string(),
                        size: bytes.len() as u64,
                        expected: format!("{want} at offset {}", a.at),
                    });
                }
                file.write_all_at(&bytes, a.at)
                    .map_err(io_err("write", path))?;
                window.record(a.latency);
                stats.requests += 1;
                stats.bytes += want;
                stats.hedged += u64::from(a.hedged);
                stats.hedges_won += u64::from(a.hedge_won);
                stats.latencies.push(a.latency);
            }
        })?;
        Ok(stats)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adaptive_hedge_waits_for_enough_latencies_then_uses_the_quantile_above_the_floor() {
        let w = LatencyWindow::default();
        let hedge = Hedge::Adaptive {
            quantile: 0.9,
            floor: Duration::from_millis(5),
            initial: Duration::from_secs(1),
        };
        assert_eq!(w.delay(hedge), Some(Duration::from_secs(1)));
        for ms in 1..=20 {
            w.record(Duration::from_millis(ms));
        }
        // The 0.9 quantile of 1..=20 ms: index round(19 * 0.9) = 17, i.e. 18 ms.
        assert_eq!(w.delay(hedge), Some(Duration::from_millis(18)));
        assert_eq!(w.delay(Hedge::Off), None);
        let fast = LatencyWindow::default();
        for _ in 0..20 {
            fast.record(Duration::from_micros(100));
        }
        assert_eq!(fast.delay(hedge), Some(Duration::from_millis(5)));
    }

    #[test]
    fn a_file_remote_downloads_in_ranges_whatever_the_chunking() {
        let dir = tempfile::tempdir().unwrap();
        let store = RemoteStore::open(
            &format!("file://{}", dir.path().join("remote").display()),
            &crate::RemoteOptions::default(),
        )
        .unwrap();
        let data: Vec<u8> = (0..100_003u32).map(|i| (i * 7 % 251) as u8).collect();
        store.put_object("a/obj", data.clone()).unwrap();
        for (chunk, in_flight) in [(1 << 20, 1), (4096, 3), (99_999, 2), (7, 64)] {
            let path = dir.path().join(format!("out-{chunk}"));
            let file = File::create(&path).unwrap();
            let how = RangedRead {
                chunk,
                in_flight,
                hedge: Hedge::After(Duration::from_micros(1)),
            };
            let window = LatencyWindow::default();
            let stats = store
                .read_ranged("a/obj", data.len() as u64, (&file, &path), &how, &window)
                .unwrap();
            assert_eq!(std::fs::read(&path).unwrap(), data, "chunk {chunk}");
            assert_eq!(stats.requests, (data.len() as u64).div_ceil(chunk));
            assert_eq!(stats.bytes, data.len() as u64);
        }
        // A size that disagrees with the object is refused, not padded.
        let path = dir.path().join("short");
        let file = File::create(&path).unwrap();
        let err = store
            .read_ranged(
                "a/obj",
                data.len() as u64 + 10,
                (&file, &path),
                &RangedRead::default(),
                &LatencyWindow::default(),
            )
            .unwrap_err();
        assert!(
            matches!(
                err,
                StoreError::ObjectSize { .. } | StoreError::Store { .. }
            ),
            "{err}"
        );
    }
}
