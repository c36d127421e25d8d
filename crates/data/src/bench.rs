//! `flotilla data bench`: loader bandwidth against a plain sequential read of the same files,
//! in the same run, and the time to resume mid-epoch (docs/PERFORMANCE.md).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cache::FetchStats;
use crate::dataset::Dataset;
use crate::error::Result;
use crate::loader::{Loader, LoaderConfig};
use crate::sampler::SequenceSpace;
use crate::stress::{StressConfig, StressReport, sequential_read};

/// What to measure.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BenchConfig {
    /// Epochs of the first dataset the loader reads (fractions allowed).
    pub epochs: f64,
    /// Where in the first epoch the resume test restarts, as a fraction.
    pub resume_at: f64,
    /// Drop the page cache before each read (the caller's `drop_caches`).
    pub cold: bool,
}

/// The figures of one bench: as JSON, and as lines for a person.
pub struct BenchReport {
    /// Every figure, by name.
    pub json: serde_json::Value,
    /// The same, as lines.
    pub lines: Vec<String>,
}

/// Measures `datasets` (an s3:// dataset fetched into its cache first: the warm cache is what
/// is measured) under `config`: a raw sequential read of the shard files before and after, the
/// loader's first and later epochs, and a resume from `reopen`'s fresh datasets at
/// `bench.resume_at` of the first epoch. With `bench.cold`, `drop_caches` runs before each
/// read.
///
/// # Errors
/// The first failed read, fetch or loader error.
pub fn run(
    datasets: Vec<Arc<Dataset>>,
    config: &LoaderConfig,
    bench: &BenchConfig,
    reopen: &dyn Fn() -> Result<Vec<Arc<Dataset>>>,
    drop_caches: &dyn Fn() -> Result<()>,
) -> Result<BenchReport> {
    let fetched: Vec<FetchStats> = (datasets.iter().map(|d| crate::cache::warm(d)))
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .flatten()
        .collect();
    let paths: Vec<PathBuf> = datasets
        .iter()
        .flat_map(|d| {
            (0..d.num_shards())
                .map(|i| d.shard_path(i))
                .collect::<Vec<_>>()
        })
        .collect();
    let width = datasets[0].manifest().token_bytes;
    let dataset_tokens: u64 = datasets.iter().map(|d| d.manifest().tokens).sum();
    let epoch_len = epoch_len(&datasets[0], config.seq_len);

    if bench.cold {
        drop_caches()?;
    }
    let raw_before = sequential_read(&paths)?;
    if bench.cold {
        drop_caches()?;
    }
    // The loader owns the only handles on the datasets: dropping it unmaps every shard, so a
    // cold re-read really is cold.
    let mut loader = Loader::new(datasets, config, None)?;
    let local = loader.local_batch() as u64;
    let batches = (((bench.epochs * epoch_len as f64) / local as f64).ceil() as u64).max(1);
    // The first epoch (which hashes every shard before its first use) and the later ones
    // (which reuse that verification and the mappings) are timed apart.
    let first_epoch = batches.min(epoch_len.div_ceil(local).max(1));
    let drive = |loader: &mut Loader, n: u64| {
        let stress = StressConfig {
            target_tokens_per_s: None,
            duration: Duration::from_secs(24 * 3600),
            max_batches: Some(n),
        };
        crate::stress::stress(loader, &stress, width)
    };
    let first = drive(&mut loader, first_epoch)?;
    let later = match batches - first_epoch {
        0 => None,
        n => Some(drive(&mut loader, n)?),
    };
    // The loader's own counters, over both phases.
    let metrics = loader.metrics().clone();
    let mut state = loader.state();
    drop(loader);
    if bench.cold {
        drop_caches()?;
    }
    let raw_after = sequential_read(&paths)?;

    // Payload without the one token consecutive rows share.
    let payload =
        |batches: u64| (batches * local * config.seq_len as u64 * u64::from(width)) as f64;
    let bps = |r: &StressReport| payload(r.batches) / r.elapsed.as_secs_f64();
    let all_batches = first.batches + later.as_ref().map_or(0, |r| r.batches);
    let elapsed = first.elapsed + later.as_ref().map_or(Duration::ZERO, |r| r.elapsed);
    let loader_bps = payload(all_batches) / elapsed.as_secs_f64();
    let (first_bps, later_bps) = (bps(&first), later.as_ref().map(bps));
    let tokens_per_s = loader_bps / f64::from(width);
    let raw_bps = raw_before.bytes_per_s.max(raw_after.bytes_per_s);

    // Resume: a fresh process's work, from opening the datasets to holding the first batch.
    let cursor =
        (bench.resume_at * epoch_len as f64) as u64 / config.global_batch * config.global_batch;
    state.cursor = cursor;
    state.steps = cursor / config.global_batch;
    if bench.cold {
        drop_caches()?;
    }
    let t0 = Instant::now();
    let reopened = reopen()?;
    let t_open = t0.elapsed();
    let mut resumed = Loader::new(reopened, config, Some(&state))?;
    let t_new = t0.elapsed();
    let first = resumed.next()?;
    let t_first = t0.elapsed();

    let json = serde_json::json!({
        "files": paths.len(),
        "cold": bench.cold,
        "dataset_tokens": dataset_tokens,
        "dataset_bytes": raw_before.bytes,
        "raw_read_before_gbps": raw_before.bytes_per_s / 1e9,
        "raw_read_after_gbps": raw_after.bytes_per_s / 1e9,
        "loader_gbps": loader_bps / 1e9,
        "loader_vs_raw": loader_bps / raw_bps,
        "loader_first_epoch_gbps": first_bps / 1e9,
        "loader_first_epoch_vs_raw": first_bps / raw_bps,
        "loader_later_epochs_gbps": later_bps.map(|b| b / 1e9),
        "loader_later_epochs_vs_raw": later_bps.map(|b| b / raw_bps),
        "loader_tokens_per_s": tokens_per_s,
        "loader_batches": all_batches,
        "loader_seconds": elapsed.as_secs_f64(),
        "loader_stall_pct": metrics.stall_pct(),
        "build_p99_ms": metrics.p99_latency.as_secs_f64() * 1e3,
        "consumer_built": metrics.consumer_built,
        "resume_position": cursor,
        "resume_step": first.step,
        "resume_open_ms": t_open.as_secs_f64() * 1e3,
        "resume_loader_ms": (t_new - t_open).as_secs_f64() * 1e3,
        "resume_first_batch_ms": t_first.as_secs_f64() * 1e3,
        "fetched": fetched.iter().map(FetchStats::to_json).collect::<Vec<_>>(),
    });
    let mut lines = vec![];
    lines.push(format!(
        "data bench ({} page cache): {} shard files, {} tokens, {:.2} GB",
        if bench.cold { "cold" } else { "warm" },
        paths.len(),
        dataset_tokens,
        raw_before.bytes as f64 / 1e9
    ));
    lines.push(format!(
        "  raw sequential read (8 MiB reads)  {:.2} GB/s before, {:.2} GB/s after",
        raw_before.bytes_per_s / 1e9,
        raw_after.bytes_per_s / 1e9
    ));
    fetched
        .iter()
        .for_each(|f| lines.push(format!("  object store: {}", f.line())));
    lines.push(format!(
        "  loader ({} workers, {} batches, {} built by the consumer)    {:.2} GB/s of tokens = {:.0} % of raw; {:.3e} tokens/s",
        config.workers,
        all_batches,
        metrics.consumer_built,
        loader_bps / 1e9,
        100.0 * loader_bps / raw_bps,
        tokens_per_s
    ));
    if let Some(later_bps) = later_bps {
        lines.push(format!(
            "    first epoch (hashes each shard before use) {:.2} GB/s = {:.0} % of raw; later epochs {:.2} GB/s = {:.0} % of raw",
            first_bps / 1e9,
            100.0 * first_bps / raw_bps,
            later_bps / 1e9,
            100.0 * later_bps / raw_bps
        ));
    }
    lines.push(format!(
        "  resume at sequence {cursor} (step {}): datasets open {:.2} ms, loader {:.2} ms, \
         first batch {:.2} ms (total)",
        first.step,
        t_open.as_secs_f64() * 1e3,
        (t_new - t_open).as_secs_f64() * 1e3,
        t_first.as_secs_f64() * 1e3
    ));
    Ok(BenchReport { json, lines })
}

/// Sequences per epoch of `dataset` at `seq_len`.
fn epoch_len(dataset: &Arc<Dataset>, seq_len: usize) -> u64 {
    let tokens: Vec<u64> = dataset.manifest().shards.iter().map(|s| s.tokens).collect();
    SequenceSpace::new(&tokens, seq_len).total()
}
