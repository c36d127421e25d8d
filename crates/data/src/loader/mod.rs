//! The loader: reader threads fill a bounded, ordered queue of batches (004 Algorithm 28.1).
//!
//! Batch `n` (counted from where the loader started) is this rank's share of global batch
//! `cursor + n G` (see [`crate::sampler`]). Worker threads claim batch numbers in order, but only
//! while fewer than `K` batches are ready or being built (`K` is the prefetch depth), build them
//! (map and verify shards on first use, copy each sequence's tokens), and file them under their
//! number; [`Loader::next`] hands them out strictly in order. A `next` call whose batch is not
//! ready claims and builds the next unclaimed batch itself, under the same rules, instead of
//! sleeping (a consumer faster than the workers becomes one more builder). The algorithm's
//! invariants:
//!
//! - (iii) ready + in-flight batches never exceed `K`: a batch `n` is claimed only when
//!   `n < delivered + K`; a worker waits on a condition variable otherwise (no unbounded
//!   prefetch, no spinning);
//! - (iv) a batch that fails (a corrupt shard, an I/O error, a panicking worker) is returned as
//!   that batch's error, in its place in the order, and nothing after it is delivered: a failure
//!   is never skipped;
//! - (i), (ii): a batch is handed over by value only once complete, and the consumer owns it
//!   until dropped, so it is never read before it is built nor overwritten while in use.
//!
//! A verifier thread (`verify_ahead.rs`) walks the order ahead of the workers and hashes the
//! shards they will need next, so a first epoch's verification overlaps the row copies instead
//! of stopping every worker that needs a new shard; a shard it has not reached is verified by
//! the worker, and a failure is always reported by the worker, in its batch's place.
//!
//! Every wait has a timeout: `next` gives up after [`LoaderConfig::timeout`] with an error that
//! says which batch it waited for and what the queue held.

mod batch;
mod metrics;
mod reader;
mod state;
mod verify_ahead;

pub use batch::{Batch, BatchTokens};
pub use metrics::{LoaderMetrics, auto_depth};
pub use state::LoaderState;

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::dataset::Dataset;
use crate::error::{DataError, Result};
use crate::sampler::{RankShare, Sampler, SequenceSpace};
use metrics::LatencyWindow;
use reader::{Builder, worker};

/// Shards each worker keeps mapped; a shuffle window spans a few shards, so this covers it.
const OPEN_PER_WORKER: usize = 8;

/// How far ahead of the row being copied the next rows' first lines are prefetched.
///
/// Measured on the 2-vCPU VM (random 2 KiB rows from 1 GiB of mapped shards, one thread):
/// no prefetch 313 ns a row; every line of the next row 416 ns (33 prefetches fill the line-fill
/// buffers and stall); the first 2 lines of the row 8 ahead 256 ns. The first lines start the
/// page walk and the DRAM access; the hardware streamer fetches the rest of the row.
const PREFETCH_ROWS: usize = 8;

/// Bytes at the start of a row that are prefetched (two cache lines).
const PREFETCH_BYTES: usize = 128;

/// Batches between refreshes of the latency percentiles and the automatic depth.
const REFRESH_EVERY: u64 = 64;

/// How far ahead the workers may build.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prefetch {
    /// Exactly this many batches (at least 1).
    Fixed(usize),
    /// From measured batch latency and step time (000 eq. 4.3), at most `max`.
    Auto {
        /// Upper bound on the depth.
        max: usize,
    },
}

/// How a loader cuts, orders and delivers sequences.
#[derive(Clone, Debug, PartialEq)]
pub struct LoaderConfig {
    /// Tokens per sequence (inputs), T; each row holds T + 1 tokens.
    pub seq_len: usize,
    /// Sequences per global batch, all ranks together (G).
    pub global_batch: u64,
    /// Data-parallel ranks (W); G must be a multiple of W.
    pub world: u64,
    /// This rank.
    pub rank: u64,
    /// Reader threads.
    pub workers: usize,
    /// Prefetch depth.
    pub prefetch: Prefetch,
    /// Shuffle seed.
    pub seed: u64,
    /// Shuffle window, in sequences (the bounded shuffle buffer).
    pub shuffle_window: u64,
    /// One mixture weight per dataset.
    pub weights: Vec<f64>,
    /// Longest `next` waits for one batch.
    pub timeout: Duration,
    /// Where datasets in object storage are cached ([`crate::cache`]); decides no batch.
    pub cache: crate::cache::CacheConfig,
}

impl LoaderConfig {
    /// Defaults for one rank of one: 2 workers, automatic prefetch up to 16, a shuffle window
    /// of 65536 sequences, a 120 s timeout, one dataset.
    pub fn new(seq_len: usize, global_batch: u64, seed: u64) -> LoaderConfig {
        LoaderConfig {
            seq_len,
            global_batch,
            world: 1,
            rank: 0,
            workers: 2,
            prefetch: Prefetch::Auto { max: 16 },
            seed,
            shuffle_window: 1 << 16,
            weights: vec![1.0],
            timeout: Duration::from_secs(120),
            cache: crate::cache::CacheConfig::default(),
        }
    }
}

/// What the workers and the consumer share, under one mutex.
struct Queue {
    /// Built batches (or their errors) by batch number.
    ready: BTreeMap<u64, Result<Batch>>,
    /// Next batch number a worker will claim.
    next_claim: u64,
    /// Batches handed to the consumer (the next one it wants is this number).
    delivered: u64,
    /// Current prefetch depth K.
    depth: usize,
    /// First batch number that failed; nothing at or after it is claimed.
    failed_at: Option<u64>,
    shutdown: bool,
    /// The consumer sleeps on `filed` (so a worker filing its batch must wake it).
    consumer_waiting: bool,
    /// Workers sleeping on `space`.
    workers_waiting: usize,
    /// Batches the consumer built itself while waiting (see [`Loader::next`]).
    consumer_built: u64,
    latencies: LatencyWindow,
    max_outstanding: usize,
    /// Token buffers handed back by [`Loader::recycle`], reused by the workers.
    pool: Vec<BatchTokens>,
}

struct Shared {
    queue: Mutex<Queue>,
    /// Signalled when a batch is filed.
    filed: Condvar,
    /// Signalled when a batch is taken, or on shutdown.
    space: Condvar,
    /// Signalled every few claimed batches, or on shutdown (the verifier sleeps on it).
    ahead: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The data loader of one rank.
pub struct Loader {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    builder: Builder,
    prefetch: Prefetch,
    worker_count: usize,
    timeout: Duration,
    state: LoaderState,
    metrics: LoaderMetrics,
    last_delivery: Option<Instant>,
    /// Consumer time between deliveries, smoothed, for the automatic depth.
    compute_ewma: Option<Duration>,
    /// The error that stopped the loader, repeated on later calls.
    stopped: Option<String>,
}

impl Loader {
    /// Starts a loader over `datasets` (mixed by `config.weights`), from the beginning or from
    /// a saved `resume` state.
    ///
    /// # Errors
    /// [`DataError::InvalidArgument`] for a bad batch/world/rank equation, zero workers, zero
    /// depth or sequence length; [`DataError::Mismatch`] if the datasets disagree on tokenizer
    /// or vocabulary, or `resume` was saved over a different order;
    /// [`DataError::DatasetTooSmall`] if a dataset has no sequence of this length.
    pub fn new(
        datasets: Vec<Arc<Dataset>>,
        config: &LoaderConfig,
        resume: Option<&LoaderState>,
    ) -> Result<Loader> {
        let share = RankShare::new(config.global_batch, config.world, config.rank)?;
        check_config(config)?;
        check_compatible(&datasets)?;
        let mut spaces = Vec::with_capacity(datasets.len());
        for d in &datasets {
            let tokens: Vec<u64> = d.manifest().shards.iter().map(|s| s.tokens).collect();
            let space = SequenceSpace::new(&tokens, config.seq_len);
            if space.total() == 0 {
                return Err(DataError::DatasetTooSmall {
                    name: d.dir().display().to_string(),
                    seq_len: config.seq_len,
                    longest_shard_tokens: tokens.iter().copied().max().unwrap_or(0),
                    needed: config.seq_len + 1,
                });
            }
            spaces.push(space);
        }
        let row_bytes = (config.seq_len as u64 + 1) * u64::from(datasets[0].manifest().token_bytes);
        let ahead = verify_ahead::Plan::new(&spaces, config.shuffle_window, row_bytes);
        let mut sampler =
            Sampler::new(spaces, &config.weights, config.seed, config.shuffle_window)?;
        let mut state = LoaderState {
            version: 1,
            seed: config.seed,
            seq_len: config.seq_len,
            shuffle_window: config.shuffle_window,
            weights: sampler.weights().to_vec(),
            snapshots: datasets
                .iter()
                .map(|d| d.manifest().snapshot.clone())
                .collect(),
            cursor: 0,
            steps: 0,
            epoch: 0,
        };
        if let Some(saved) = resume {
            saved.check_matches(&state)?;
            saved.check_position()?;
            state.cursor = saved.cursor;
            state.steps = saved.steps;
        }
        state.epoch = sampler.epoch_at(0, state.cursor);
        let depth = match config.prefetch {
            Prefetch::Fixed(k) => k,
            Prefetch::Auto { max } => (2 * config.workers).clamp(2, max.max(2)),
        };
        let builder = Builder {
            open: Vec::with_capacity(OPEN_PER_WORKER),
            width: datasets[0].manifest().token_bytes,
            datasets,
            sampler,
            share,
            seq_len: config.seq_len,
            cursor: state.cursor,
            steps: state.steps,
        };
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                ready: BTreeMap::new(),
                next_claim: 0,
                delivered: 0,
                depth,
                failed_at: None,
                shutdown: false,
                consumer_waiting: false,
                workers_waiting: 0,
                consumer_built: 0,
                latencies: LatencyWindow::default(),
                max_outstanding: 0,
                pool: Vec::new(),
            }),
            filed: Condvar::new(),
            space: Condvar::new(),
            ahead: Condvar::new(),
        });
        let mut workers = Vec::with_capacity(config.workers);
        for w in 0..config.workers {
            let (shared, builder) = (shared.clone(), builder.clone());
            let handle = std::thread::Builder::new()
                .name(format!("flotilla-loader-{w}"))
                .spawn(move || worker(&shared, builder))
                .map_err(|e| DataError::Loader(format!("cannot start reader thread {w}: {e}")))?;
            workers.push(handle);
        }
        // The verifier only reorders work (see verify_ahead): without it, readers verify.
        let (sh, b) = (shared.clone(), builder.clone());
        if let Ok(handle) = std::thread::Builder::new()
            .name("flotilla-loader-verify".into())
            .spawn(move || {
                let start = b.cursor;
                verify_ahead::run(
                    &sh,
                    &b.datasets,
                    b.sampler,
                    start,
                    b.share.global_batch,
                    ahead,
                )
            })
        {
            workers.push(handle);
        }
        Ok(Loader {
            shared,
            workers,
            builder,
            prefetch: config.prefetch,
            worker_count: config.workers,
            timeout: config.timeout,
            state,
            metrics: LoaderMetrics {
                depth,
                ..Default::default()
            },
            last_delivery: None,
            compute_ewma: None,
            stopped: None,
        })
    }

    /// The next batch, in order.
    ///
    /// # Errors
    /// The batch's own error (corrupt shard, I/O) in its place in the order; after that, and
    /// after a timeout, every call fails with [`DataError::Loader`] naming the cause.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> Result<Batch> {
        if let Some(why) = &self.stopped {
            return Err(DataError::Loader(format!("stopped: {why}")));
        }
        let called = Instant::now();
        let got = self.wait_for_batch(called);
        let now = Instant::now();
        match got {
            Ok(batch) => {
                self.record_delivery(called, now, &batch);
                Ok(batch)
            }
            Err(e) => {
                self.stopped = Some(e.to_string());
                Err(e)
            }
        }
    }

    fn wait_for_batch(&mut self, called: Instant) -> Result<Batch> {
        let mut q = self.shared.lock();
        let want = q.delivered;
        loop {
            if let Some(result) = q.ready.remove(&want) {
                q.delivered += 1;
                // Sleeping workers are woken once a few slots are free, not for every one:
                // fewer wake-ups and context switches, the same bound on the queue.
                let free = (q.delivered + q.depth as u64).saturating_sub(q.next_claim);
                let slack = (q.depth / 2).clamp(1, self.worker_count) as u64;
                let wake = q.workers_waiting > 0 && free >= slack;
                drop(q);
                if wake {
                    self.shared.space.notify_all();
                }
                return result;
            }
            let waited = called.elapsed();
            if waited >= self.timeout {
                return Err(DataError::Loader(format!(
                    "batch {} (step {}) not ready after {:.1} s; {} batches ready out of order, \
                     {} claimed, prefetch depth {}",
                    want,
                    self.builder.steps + want,
                    waited.as_secs_f64(),
                    q.ready.len(),
                    q.next_claim - q.delivered,
                    q.depth
                )));
            }
            // Rather than sleep until a worker files it, build the next unclaimed batch here:
            // a consumer that outpaces the workers adds a builder instead of a wake-up per
            // batch (2 cores, 2 workers, 4 epochs: 10.7-11.2 -> 11.3-12.6 GB/s, a third of the
            // context switches; docs/PERFORMANCE.md, ninth look). A consumer that computes
            // between calls finds its batch ready and never gets here.
            if let Some((n, buffer)) = reader::try_claim(&self.shared, &mut q) {
                drop(q);
                let started = Instant::now();
                let result = reader::build_guarded(&mut self.builder, n, buffer);
                q = self.shared.lock();
                reader::file(&mut q, n, result, started);
                q.consumer_built += 1;
                continue;
            }
            q.consumer_waiting = true;
            q = self
                .shared
                .filed
                .wait_timeout(q, self.timeout - waited)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            q.consumer_waiting = false;
        }
    }

    fn record_delivery(&mut self, called: Instant, now: Instant, batch: &Batch) {
        let stall = now - called;
        let m = &mut self.metrics;
        m.batches += 1;
        m.tokens += batch.tokens.len() as u64;
        m.last_stall = stall;
        if let Some(prev) = self.last_delivery {
            m.last_step = now - prev;
            m.total_step += m.last_step;
            m.total_stall += stall;
            let compute = called.saturating_duration_since(prev);
            self.compute_ewma = Some(match self.compute_ewma {
                None => compute,
                Some(c) => (c * 7 + compute) / 8,
            });
        }
        self.last_delivery = Some(now);
        self.state.cursor += self.builder.share.global_batch;
        self.state.steps += 1;
        // Percentiles sort the latency window: refreshed every few batches, not every one.
        if m.batches % REFRESH_EVERY != 1 {
            return;
        }
        let mut q = self.shared.lock();
        [m.p50_latency, m.p99_latency] = q.latencies.quantiles([0.50, 0.99]);
        m.max_outstanding = q.max_outstanding;
        m.consumer_built = q.consumer_built;
        if let (Prefetch::Auto { max }, Some(compute)) = (self.prefetch, self.compute_ewma) {
            q.depth = auto_depth(m.p99_latency, compute, self.worker_count, max);
        }
        m.depth = q.depth;
    }

    /// The state to save with a checkpoint: resuming from it continues right after the last
    /// batch returned by [`Loader::next`].
    pub fn state(&mut self) -> LoaderState {
        let mut s = self.state.clone();
        s.epoch = self.builder.sampler.epoch_at(0, s.cursor);
        s
    }

    /// Hands a used batch's token buffer back for the workers to fill again, which saves an
    /// allocation and its page faults per batch. Optional: batches that are simply dropped
    /// cost only that.
    pub fn recycle(&self, batch: Batch) {
        let mut q = self.shared.lock();
        // Never more buffers than the queue can hold.
        if q.pool.len() < q.depth {
            q.pool.push(batch.tokens);
        }
    }

    /// What the loader measured so far. Latency percentiles, depth and the outstanding
    /// maximum are refreshed every 64 batches (and after the first); counts and stall times
    /// after every batch.
    pub fn metrics(&self) -> &LoaderMetrics {
        &self.metrics
    }

    /// This rank's rows per batch.
    pub fn local_batch(&self) -> usize {
        self.builder.share.local_batch() as usize
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.space.notify_all();
        self.shared.filed.notify_all();
        self.shared.ahead.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

fn check_config(config: &LoaderConfig) -> Result<()> {
    let invalid = |field, value: usize, requirement: &str| {
        Err(DataError::InvalidArgument {
            field,
            value: value as u64,
            requirement: requirement.into(),
        })
    };
    if config.seq_len == 0 {
        return invalid("seq_len", 0, "at least 1 token");
    }
    if config.workers == 0 {
        return invalid("workers", 0, "at least 1 reader thread");
    }
    match config.prefetch {
        Prefetch::Fixed(0) => invalid("prefetch depth", 0, "at least 1 batch"),
        Prefetch::Auto { max: 0 } => invalid("prefetch max depth", 0, "at least 1 batch"),
        _ => Ok(()),
    }
}

fn check_compatible(datasets: &[Arc<Dataset>]) -> Result<()> {
    let Some(first) = datasets.first() else {
        return Err(DataError::InvalidArgument {
            field: "datasets",
            value: 0,
            requirement: "at least one dataset".into(),
        });
    };
    let (tok, vocab) = (&first.manifest().tokenizer, first.manifest().vocab_size);
    for d in &datasets[1..] {
        let m = d.manifest();
        if (&m.tokenizer, m.vocab_size) != (tok, vocab) {
            return Err(DataError::Mismatch {
                what: "mixture",
                detail: format!(
                    "{} uses tokenizer {} (vocab {}), {} uses {} (vocab {})",
                    first.dir().display(),
                    tok,
                    vocab,
                    d.dir().display(),
                    m.tokenizer,
                    m.vocab_size
                ),
            });
        }
    }
    Ok(())
}
