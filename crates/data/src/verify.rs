//! Re-hashing a whole dataset (`flotilla data verify`).

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
}

/// Maps and fully verifies every shard of `dataset` afresh ([`Dataset::open_verified`]), on
/// `threads` threads (0: every core), shards in parallel. Every shard is checked, even after
/// a failure, so the report names all bad shards.
///
/// # Errors
/// [`DataError::InvalidArgument`] if the thread pool cannot start. Shard problems are not
/// errors of this function: they are in the report.
pub fn verify_dataset(dataset: &Dataset, threads: usize) -> Result<VerifyReport> {
    let start = Instant::now();
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
                ShardCheck {
                    index,
                    file: entry.file.clone(),
                    bytes: entry.bytes,
                    result,
                    elapsed: t.elapsed(),
                }
            })
            .collect()
    });
    Ok(VerifyReport {
        shards,
        elapsed: start.elapsed(),
    })
}
