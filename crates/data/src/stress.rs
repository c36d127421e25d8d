//! Measuring the loader on its own: the seeds' pipeline stress test (000 L855: run the loader
//! alone for long enough to catch descriptor leaks, memory growth and latency tails) and the raw
//! sequential read bandwidth of the same files, to compare against.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::error::{DataError, Result};
use crate::loader::{Loader, LoaderMetrics};

/// How hard and how long to drive a loader.
#[derive(Clone, Copy, Debug)]
pub struct StressConfig {
    /// Tokens per second the consumer asks for; `None` takes batches as fast as they come.
    pub target_tokens_per_s: Option<f64>,
    /// How long to run.
    pub duration: Duration,
    /// Stop after this many batches even if time is left.
    pub max_batches: Option<u64>,
}

/// Open descriptors and resident memory of this process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProcessStats {
    /// Entries in `/proc/self/fd`.
    pub open_fds: u64,
    /// Resident anonymous memory (heap, stacks) in bytes: what a leak grows.
    pub rss_anon_bytes: u64,
    /// Resident file-backed memory in bytes: mapped shard pages, which the kernel can reclaim.
    pub rss_file_bytes: u64,
}

impl ProcessStats {
    /// Reads them from `/proc/self` (zeros where `/proc` is unavailable).
    pub fn now() -> ProcessStats {
        let open_fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64);
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let kib = |key: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
                .map_or(0, |k| k * 1024)
        };
        ProcessStats {
            open_fds,
            rss_anon_bytes: kib("RssAnon:"),
            rss_file_bytes: kib("RssFile:"),
        }
    }
}

/// What a stress run measured.
#[derive(Clone, Debug)]
pub struct StressReport {
    /// Batches delivered.
    pub batches: u64,
    /// Tokens delivered.
    pub tokens: u64,
    /// Wall time of the run.
    pub elapsed: Duration,
    /// Sustained tokens per second.
    pub tokens_per_s: f64,
    /// Bytes of token payload per second (tokens x the shards' bytes per token).
    pub bytes_per_s: f64,
    /// Median time `next` waited.
    pub p50_wait: Duration,
    /// 99th-percentile time `next` waited.
    pub p99_wait: Duration,
    /// The loader's own metrics at the end (batch build latency, stall %, depth).
    pub metrics: LoaderMetrics,
    /// Process state before the loader was driven.
    pub before: ProcessStats,
    /// Process state at the end, loader still open.
    pub after: ProcessStats,
}

/// Drives `loader` as `config` says. `token_bytes` is the shards' bytes per token.
///
/// # Errors
/// The first error the loader returns.
pub fn stress(
    loader: &mut Loader,
    config: &StressConfig,
    token_bytes: u32,
) -> Result<StressReport> {
    let before = ProcessStats::now();
    let start = Instant::now();
    let mut waits = WaitHistogram::default();
    let mut tokens = 0u64;
    while start.elapsed() < config.duration && config.max_batches.is_none_or(|m| waits.count < m) {
        if let Some(rate) = config.target_tokens_per_s {
            // Pace the consumer: batch i is due when the target rate has consumed `tokens`.
            let due = Duration::from_secs_f64(tokens as f64 / rate);
            if let Some(sleep) = due.checked_sub(start.elapsed()) {
                std::thread::sleep(sleep);
            }
        }
        let asked = Instant::now();
        let batch = loader.next()?;
        waits.record(asked.elapsed());
        tokens += batch.tokens.len() as u64;
        loader.recycle(batch);
    }
    let elapsed = start.elapsed();
    let after = ProcessStats::now();
    let secs = elapsed.as_secs_f64().max(1e-9);
    Ok(StressReport {
        batches: waits.count,
        tokens,
        elapsed,
        tokens_per_s: tokens as f64 / secs,
        bytes_per_s: (tokens * u64::from(token_bytes)) as f64 / secs,
        p50_wait: waits.quantile(0.5),
        p99_wait: waits.quantile(0.99),
        metrics: loader.metrics().clone(),
        before,
        after,
    })
}

/// Wait times in logarithmic buckets (8 per power of two, so a quantile is within 9 %): fixed
/// memory however long the run, so the harness itself never looks like a leak.
#[derive(Debug)]
struct WaitHistogram {
    buckets: Vec<u64>,
    count: u64,
}

impl Default for WaitHistogram {
    fn default() -> Self {
        WaitHistogram {
            buckets: vec![0; 64 * 8],
            count: 0,
        }
    }
}

impl WaitHistogram {
    fn bucket(ns: u64) -> usize {
        let ns = ns.max(1);
        let log2 = 63 - ns.leading_zeros() as usize;
        // The three bits below the leading one pick one of 8 sub-buckets.
        let sub = if log2 >= 3 {
            (ns >> (log2 - 3)) as usize & 7
        } else {
            (ns << (3 - log2)) as usize & 7
        };
        log2 * 8 + sub
    }

    fn record(&mut self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.buckets[Self::bucket(ns)] += 1;
        self.count += 1;
    }

    /// The upper edge of the bucket holding the `q`-quantile (nearest rank).
    fn quantile(&self, q: f64) -> Duration {
        if self.count == 0 {
            return Duration::ZERO;
        }
        let rank = ((q * self.count as f64).ceil() as u64).clamp(1, self.count);
        let mut seen = 0;
        for (i, &n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= rank {
                let (log2, sub) = ((i / 8) as u32, (i % 8) as f64);
                let upper = 2f64.powi(log2 as i32) * (1.0 + (sub + 1.0) / 8.0);
                return Duration::from_nanos(upper as u64);
            }
        }
        Duration::MAX
    }
}

/// Raw sequential read of files.
#[derive(Clone, Debug)]
pub struct ReadReport {
    /// Bytes read.
    pub bytes: u64,
    /// Wall time.
    pub elapsed: Duration,
    /// Bytes per second.
    pub bytes_per_s: f64,
}

/// Reads each file front to back with plain `read` calls into one 8 MiB buffer (the
/// baseline a loader's bandwidth is compared with, like `dd bs=8M`).
///
/// # Errors
/// [`DataError::Io`] naming the file.
pub fn sequential_read(paths: &[PathBuf]) -> Result<ReadReport> {
    let mut buf = vec![0u8; 8 << 20];
    let start = Instant::now();
    let mut bytes = 0u64;
    for path in paths {
        bytes += read_all(path, &mut buf)?;
    }
    let elapsed = start.elapsed();
    Ok(ReadReport {
        bytes,
        elapsed,
        bytes_per_s: bytes as f64 / elapsed.as_secs_f64().max(1e-9),
    })
}

fn read_all(path: &Path, buf: &mut [u8]) -> Result<u64> {
    let io = |source| DataError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut f = std::fs::File::open(path).map_err(io)?;
    let mut total = 0u64;
    loop {
        match f.read(buf) {
            Ok(0) => return Ok(total),
            Ok(n) => total += n as u64,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_quantiles_are_within_a_bucket() {
        let mut h = WaitHistogram::default();
        for us in 1..=1000u64 {
            h.record(Duration::from_micros(us));
        }
        let p50 = h.quantile(0.5).as_secs_f64() * 1e6;
        let p99 = h.quantile(0.99).as_secs_f64() * 1e6;
        assert!((500.0..=500.0 * 1.13).contains(&p50), "{p50}");
        assert!((990.0..=990.0 * 1.13).contains(&p99), "{p99}");
        assert_eq!(h.count, 1000);
    }
}
