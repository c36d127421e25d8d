//! `flotilla data bench`: loader bandwidth against a plain sequential read of the same files,
//! in the same run, and the time to resume mid-epoch.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use data::stress::{StressConfig, sequential_read};
use data::{Dataset, Loader};

use crate::flag_range::{fraction_below_one, positive_f64};
use crate::loader_args::LoaderRunArgs;
use ckpt::bench::drop_caches;

/// Options of `flotilla data bench`.
#[derive(clap::Args)]
#[command(allow_negative_numbers = true)]
pub struct Args {
    #[command(flatten)]
    pub run: LoaderRunArgs,
    /// Epochs of the first dataset the loader reads (fractions allowed).
    #[arg(long, default_value_t = 1.0, value_parser = positive_f64)]
    pub epochs: f64,
    /// Where in the first epoch the resume test restarts, as a fraction.
    #[arg(long, default_value_t = 0.5, value_parser = fraction_below_one)]
    pub resume_at: f64,
    /// Cold page cache: drop the kernel's caches before the raw read and before the loader
    /// (root only: writes /proc/sys/vm/drop_caches), so both read the disk.
    #[arg(long)]
    pub cold: bool,
    /// Print the results as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Runs the benchmark and prints its figures.
pub fn run(args: Args) -> Result<()> {
    let datasets = args.run.loader.open()?;
    let config = args.run.config()?;
    // An s3:// dataset is fetched into its cache first: what follows measures the warm cache.
    let fetched: Vec<data::FetchStats> = (datasets.iter().map(|d| data::cache::warm(d)))
        .collect::<data::Result<Vec<_>>>()?
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
    let epoch_len = epoch_len(&datasets[0], args.run.seq_len);

    if args.cold {
        drop_caches()?;
    }
    let raw_before = sequential_read(&paths)?;
    if args.cold {
        drop_caches()?;
    }
    // The loader owns the only handles on the datasets: dropping it unmaps every shard, so a
    // cold re-read really is cold.
    let mut loader = Loader::new(datasets, &config, None)?;
    let local = loader.local_batch() as u64;
    let batches = (((args.epochs * epoch_len as f64) / local as f64).ceil() as u64).max(1);
    // The first epoch (which hashes every shard before its first use) and the later ones
    // (which reuse that verification and the mappings) are timed apart.
    let first_epoch = batches.min(epoch_len.div_ceil(local).max(1));
    let drive = |loader: &mut Loader, n: u64| {
        let stress = StressConfig {
            target_tokens_per_s: None,
            duration: Duration::from_secs(24 * 3600),
            max_batches: Some(n),
        };
        data::stress::stress(loader, &stress, width)
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
    if args.cold {
        drop_caches()?;
    }
    let raw_after = sequential_read(&paths)?;

    // Payload without the one token consecutive rows share.
    let payload =
        |batches: u64| (batches * local * args.run.seq_len as u64 * u64::from(width)) as f64;
    let bps = |r: &data::stress::StressReport| payload(r.batches) / r.elapsed.as_secs_f64();
    let all_batches = first.batches + later.as_ref().map_or(0, |r| r.batches);
    let elapsed = first.elapsed + later.as_ref().map_or(Duration::ZERO, |r| r.elapsed);
    let loader_bps = payload(all_batches) / elapsed.as_secs_f64();
    let (first_bps, later_bps) = (bps(&first), later.as_ref().map(bps));
    let tokens_per_s = loader_bps / f64::from(width);
    let raw_bps = raw_before.bytes_per_s.max(raw_after.bytes_per_s);

    // Resume: a fresh process's work, from opening the datasets to holding the first batch.
    let cursor =
        (args.resume_at * epoch_len as f64) as u64 / args.run.global_batch * args.run.global_batch;
    state.cursor = cursor;
    state.steps = cursor / args.run.global_batch;
    if args.cold {
        drop_caches()?;
    }
    let t0 = Instant::now();
    let reopened = args.run.loader.open()?;
    let t_open = t0.elapsed();
    let mut resumed = Loader::new(reopened, &config, Some(&state))?;
    let t_new = t0.elapsed();
    let first = resumed.next()?;
    let t_first = t0.elapsed();

    let out = serde_json::json!({
        "files": paths.len(),
        "cold": args.cold,
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
        "fetched": fetched.iter().map(data::FetchStats::to_json).collect::<Vec<_>>(),
    });
    if args.json {
        println!("{out}");
        return Ok(());
    }
    println!(
        "data bench ({} page cache): {} shard files, {} tokens, {:.2} GB",
        if args.cold { "cold" } else { "warm" },
        paths.len(),
        dataset_tokens,
        raw_before.bytes as f64 / 1e9
    );
    println!(
        "  raw sequential read (8 MiB reads)  {:.2} GB/s before, {:.2} GB/s after",
        raw_before.bytes_per_s / 1e9,
        raw_after.bytes_per_s / 1e9
    );
    fetched
        .iter()
        .for_each(|f| println!("  object store: {}", f.line()));
    println!(
        "  loader ({} workers, {} batches, {} built by the consumer)    {:.2} GB/s of tokens = {:.0} % of raw; {:.3e} tokens/s",
        config.workers,
        all_batches,
        metrics.consumer_built,
        loader_bps / 1e9,
        100.0 * loader_bps / raw_bps,
        tokens_per_s
    );
    if let Some(later_bps) = later_bps {
        println!(
            "    first epoch (hashes each shard before use) {:.2} GB/s = {:.0} % of raw; later epochs {:.2} GB/s = {:.0} % of raw",
            first_bps / 1e9,
            100.0 * first_bps / raw_bps,
            later_bps / 1e9,
            100.0 * later_bps / raw_bps
        );
    }
    println!(
        "  resume at sequence {cursor} (step {}): datasets open {:.2} ms, loader {:.2} ms, \
         first batch {:.2} ms (total)",
        first.step,
        t_open.as_secs_f64() * 1e3,
        (t_new - t_open).as_secs_f64() * 1e3,
        t_first.as_secs_f64() * 1e3
    );
    Ok(())
}

/// Sequences per epoch of `dataset` at `seq_len`.
fn epoch_len(dataset: &Arc<Dataset>, seq_len: usize) -> u64 {
    let tokens: Vec<u64> = dataset.manifest().shards.iter().map(|s| s.tokens).collect();
    data::SequenceSpace::new(&tokens, seq_len).total()
}
