//! `flotilla data verify`: re-hash every shard of a dataset.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use data::verify_dataset_with_progress;
use serde_json::json;

use crate::data_prepare_cmd::{advance, byte_bar};
use crate::flag_range::{MAX_THREADS, usize_in};

/// Options of `flotilla data verify`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Dataset directory (holding manifest.json), or s3://bucket/prefix (its shards fetched
    /// into the default data cache; feature s3).
    dir: PathBuf,
    /// Threads hashing shards in parallel (0: every core).
    #[arg(long, default_value_t = 0, value_parser = usize_in(0, MAX_THREADS))]
    threads: usize,
    /// One JSON object (every shard's outcome and the totals) instead of lines.
    #[arg(long)]
    json: bool,
    /// Hide the progress bar (it is also hidden when stderr is not a terminal).
    #[arg(long)]
    no_progress: bool,
}

/// Run `flotilla data verify`: prints one line per shard and fails naming every bad one.
pub fn run(a: Args) -> Result<()> {
    let dataset = data::cache::open(&a.dir, &data::CacheConfig::default())
        .with_context(|| format!("opening dataset {}", a.dir.display()))?;
    let bar = byte_bar(a.no_progress)?;
    let report = verify_dataset_with_progress(&dataset, a.threads, advance(&bar))?;
    bar.finish_and_clear();
    let bad: Vec<&str> = report.failures().map(|c| c.file.as_str()).collect();
    if a.json {
        let mut v = report.to_json();
        (v["dataset"], v["snapshot"]) = (json!(a.dir), json!(dataset.manifest().snapshot));
        println!("{v}");
    } else {
        print_lines(&report, &dataset.manifest().snapshot);
    }
    if !bad.is_empty() {
        bail!(
            "{} of {} shards of {} failed verification: {}",
            bad.len(),
            report.shards.len(),
            a.dir.display(),
            bad.join(", ")
        );
    }
    Ok(())
}

/// The human-readable outcome: one line per shard, then the totals.
fn print_lines(report: &data::VerifyReport, snapshot: &str) {
    for check in &report.shards {
        match &check.result {
            Ok(()) => println!(
                "ok   {} ({} bytes, {:.3} s)",
                check.file,
                check.bytes,
                check.elapsed.as_secs_f64()
            ),
            Err(e) => println!("BAD  {}: {e}", check.file),
        }
    }
    println!(
        "checked {} shards, {} bytes in {:.3} s: {:.2} GB/s; snapshot {}",
        report.shards.len(),
        report.bytes(),
        report.elapsed.as_secs_f64(),
        report.gb_per_s(),
        snapshot
    );
}
