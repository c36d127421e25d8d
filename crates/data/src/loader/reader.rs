//! A reader thread and what it needs to build any batch: the sample order, the shards it
//! holds mapped, and the row copies (see the module docs of [`super`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::verify_ahead;
use super::{Batch, BatchTokens, OPEN_PER_WORKER, PREFETCH_BYTES, PREFETCH_ROWS, Queue, Shared};
use crate::dataset::Dataset;
use crate::error::{DataError, Result};
use crate::sampler::{RankShare, SampleRef, Sampler};
use crate::shard::Shard;

/// What one worker needs to build any batch.
#[derive(Clone)]
pub(super) struct Builder {
    /// The mixture's datasets.
    pub(super) datasets: Vec<Arc<Dataset>>,
    /// This worker's handles on the shards it used last, most recent first (at most
    /// [`OPEN_PER_WORKER`]); older ones are let go (the dataset decides which stay mapped).
    pub(super) open: Vec<(usize, usize, Arc<Shard>)>,
    /// Bytes per token id.
    pub(super) width: u32,
    /// The global sample order.
    pub(super) sampler: Sampler,
    /// This rank's share of each global batch.
    pub(super) share: RankShare,
    /// Tokens per sequence (rows hold one more).
    pub(super) seq_len: usize,
    /// Global position of batch 0.
    pub(super) cursor: u64,
    /// Step number of batch 0.
    pub(super) steps: u64,
}

impl Builder {
    /// Builds batch `n` into `tokens` (a recycled buffer of the right size, or a fresh one);
    /// every id of it is overwritten.
    fn build(&mut self, n: u64, tokens: Option<BatchTokens>) -> Result<Batch> {
        let start = self.cursor + n * self.share.global_batch;
        let positions = self.share.positions(start);
        let w = self.seq_len + 1;
        let rows = positions.clone().count();
        let mut tokens = tokens
            .filter(|t| t.len() == rows * w)
            .unwrap_or_else(|| BatchTokens::zeroed(self.width, rows * w));
        let samples: Vec<SampleRef> = positions.clone().map(|p| self.sampler.sample(p)).collect();
        // The batch's distinct shards (a window spans a few), each handle taken once, and each
        // row's index into them: no reference-count traffic per row on handles that every
        // worker shares.
        let mut used: Vec<((u32, u32), Arc<Shard>)> = Vec::new();
        let mut row_shard = Vec::with_capacity(rows);
        for s in &samples {
            let key = (s.source, s.shard);
            let i = match used.iter().position(|(k, _)| *k == key) {
                Some(i) => i,
                None => {
                    used.push((key, self.shard(s.source as usize, s.shard as usize)?));
                    used.len() - 1
                }
            };
            row_shard.push(i);
        }
        let shard_of = |row: usize| &*used[row_shard[row]].1;
        // Rows are scattered over the shuffle window: keep the first lines of the rows
        // PREFETCH_ROWS ahead on their way while one is copied, so that several rows' memory
        // accesses overlap.
        let start_of = |s: &SampleRef| s.index * self.seq_len as u64;
        let ahead_tokens = (PREFETCH_BYTES / self.width as usize).min(w);
        for (row, s) in samples.iter().enumerate().take(PREFETCH_ROWS) {
            shard_of(row).prefetch(start_of(s), ahead_tokens);
        }
        for (row, s) in samples.iter().enumerate() {
            if let Some(ahead) = samples.get(row + PREFETCH_ROWS) {
                shard_of(row + PREFETCH_ROWS).prefetch(start_of(ahead), ahead_tokens);
            }
            tokens.fill_from(row * w, shard_of(row), start_of(s), w)?;
        }
        Ok(Batch {
            step: self.steps + n,
            position: positions.start,
            seq_len: self.seq_len,
            tokens,
            samples,
        })
    }
}

impl Builder {
    fn shard(&mut self, source: usize, shard: usize) -> Result<Arc<Shard>> {
        if let Some(i) = self
            .open
            .iter()
            .position(|(d, s, _)| (*d, *s) == (source, shard))
        {
            let hit = self.open.remove(i);
            let s = hit.2.clone();
            self.open.insert(0, hit);
            return Ok(s);
        }
        let s = self.datasets[source].shard(shard)?;
        self.open.truncate(OPEN_PER_WORKER - 1);
        self.open.insert(0, (source, shard, s.clone()));
        Ok(s)
    }
}

/// Claims the next batch number if the queue has room (invariant iii) and nothing before it
/// failed, with a recycled buffer to build it in.
pub(super) fn try_claim(shared: &Shared, q: &mut Queue) -> Option<(u64, Option<BatchTokens>)> {
    let blocked = q.failed_at.is_some_and(|f| q.next_claim >= f);
    let full = q.next_claim >= q.delivered + q.depth as u64;
    if blocked || full {
        return None;
    }
    let n = q.next_claim;
    q.next_claim += 1;
    if q.next_claim.is_multiple_of(verify_ahead::NOTIFY_EVERY) {
        shared.ahead.notify_one();
    }
    q.max_outstanding = q.max_outstanding.max((q.next_claim - q.delivered) as usize);
    Some((n, q.pool.pop()))
}

/// Builds batch `n`; a panic in the build becomes that batch's error (invariant iv).
pub(super) fn build_guarded(
    builder: &mut Builder,
    n: u64,
    buffer: Option<BatchTokens>,
) -> Result<Batch> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| builder.build(n, buffer)))
        .unwrap_or_else(|panic| {
            let why = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(DataError::Loader(format!(
                "a loader thread panicked building batch {n}: {why}"
            )))
        })
}

/// Files batch `n`'s result under its number, with its build latency; says whether the
/// consumer sleeps waiting for exactly this batch (the caller wakes it after unlocking).
pub(super) fn file(q: &mut Queue, n: u64, result: Result<Batch>, started: Instant) -> bool {
    q.latencies.push(started.elapsed());
    if result.is_err() {
        q.failed_at = Some(q.failed_at.map_or(n, |f| f.min(n)));
    }
    q.ready.insert(n, result);
    q.consumer_waiting && n == q.delivered
}

/// A reader thread: claim the next batch number while the queue has room, build, file.
pub(super) fn worker(shared: &Shared, mut builder: Builder) {
    loop {
        let (n, buffer) = {
            let mut q = shared.lock();
            loop {
                if q.shutdown {
                    return;
                }
                if let Some(claim) = try_claim(shared, &mut q) {
                    break claim;
                }
                // Woken by a delivery or shutdown; the timeout only bounds a lost wake-up.
                q.workers_waiting += 1;
                q = shared
                    .space
                    .wait_timeout(q, Duration::from_secs(1))
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
                q.workers_waiting -= 1;
            }
        };
        let started = Instant::now();
        let result = build_guarded(&mut builder, n, buffer);
        let wake = file(&mut shared.lock(), n, result, started);
        if wake {
            shared.filed.notify_one();
        }
    }
}
