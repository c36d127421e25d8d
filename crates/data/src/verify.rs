//! Re-hashing a whole dataset (`flotilla data verify`).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use rayon::prelude::*;

use crate::dataset::Dataset;
use crate::error::{DataError, Result};

/// The outcome of checking one shard.
#[derive(Debug)]
pub struct ShardCheck {
    /// Index in the manifest.
    pub index: usize,
    /// File name, as the manifest records it.
    pub file: String,
    /// Bytes the manifest records for it.
    pub bytes: u64,
    /// `Ok` if the shard's header, index, footer checksum and manifest checksum all agree.
    pub result: Result<()>,
    /// Time spent on this shard.
    pub elapsed: Duration,
}

/// Every shard's check, and the totals.
#[derive(Debug)]
pub struct VerifyReport {
    /// One entry per shard, in manifest order.
    pub shards: Vec<ShardCheck>,
    /// Wall time of the whole check.
    pub elapsed: Duration,
}

impl VerifyReport {
    /// The shards that failed.
    pub fn failures(&self) -> impl Iterator<Item = &ShardCheck> {
        self.shards.iter().filter(|c| c.result.is_err())
    }

    /// Bytes hashed (every shard's recorded size).
    pub fn bytes(&self) -> u64 {
        self.shards.iter().map(|c| c.bytes).sum()
    }

    /// Hashing rate in GB/s (10^9 bytes).
    pub fn gb_per_s(&self) -> f64 {
        self.bytes() as f64 / 1e9 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// `{"shards": [{"file", "bytes", "ok", "error", "seconds"}...], "bytes", "seconds",
    /// "gb_per_s", "failed": [file...]}`, as `flotilla data verify --json` prints it (with the
    /// dataset's directory and snapshot added).
    pub fn to_json(&self) -> serde_json::Value {
        let shards: Vec<_> = (self.shards.iter())
            .map(|c| {
                serde_json::json!({"file": c.file, "bytes": c.bytes, "ok": c.result.is_ok(),
                    "error": c.result.as_ref().err().map(|e| e.to_string()),
                    "seconds": c.elapsed.as_secs_f64()})
            })
            .collect();
        let failed: Vec<&str> = self.failures().map(|c| c.file.as_str()).collect();
        serde_json::json!({"shards": shards, "bytes": self.bytes(),
            "seconds": self.elapsed.as_secs_f64(), "gb_per_s": self.gb_per_s(), "failed": failed})
    }
}

/// Maps and fully verifies every shard of `dataset` afresh ([`Dataset::open_verified`]), on
/// `threads` threads (0: every core), shards in parallel. Every shard is checked, even after
/// a failure, so the report names all bad shards.
///
/// # Errors
/// [`DataError::InvalidArgument`] if the thread pool cannot start. Shard problems are not
/// errors of this function: they are in the report.
pub fn verify_dataset(dataset: &Dataset, threads: usize) -> Result<VerifyReport> {
    verify_dataset_with_progress(dataset, threads, |_, _| {})
}

/// [`verify_dataset`], calling `progress(bytes_done, bytes_total)` as each shard finishes (from
/// whichever thread checked it, one call at a time; the total is every shard's recorded size).
pub fn verify_dataset_with_progress(
    dataset: &Dataset,
    threads: usize,
    progress: impl FnMut(u64, u64) + Send,
) -> Result<VerifyReport> {
    let start = Instant::now();
    let total = (dataset.manifest().shards.iter()).fold(0u64, |n, s| n.saturating_add(s.bytes));
    let done = Mutex::new((0u64, progress));
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| DataError::InvalidArgument {
            field: "threads",
            value: threads as u64,
            requirement: format!("could not start the thread pool: {e}"),
        })?;
    let shards = pool.install(|| {
        (0..dataset.num_shards())
            .into_par_iter()
            .with_max_len(1)
            .map(|index| {
                let entry = &dataset.manifest().shards[index];
                let t = Instant::now();
                let result = dataset.open_verified(index).map(drop);
                let elapsed = t.elapsed();
                // A poisoned lock means another shard's callback panicked: report nothing more.
                if let Ok(mut guard) = done.lock() {
                    let (bytes, report) = &mut *guard;
                    *bytes = bytes.saturating_add(entry.bytes);
                    report(*bytes, total);
                }
                ShardCheck {
                    index,
                    file: entry.file.clone(),
                    bytes: entry.bytes,
                    result,
                    elapsed,
                }
            })
            .collect()
    });
    Ok(VerifyReport {
        shards,
        elapsed: start.elapsed(),
    })
}
