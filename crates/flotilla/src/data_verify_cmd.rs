//! `flotilla data verify`: re-hash every shard of a dataset.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use data::{Dataset, verify_dataset};

use crate::flag_range::{MAX_THREADS, usize_in};

/// Options of `flotilla data verify`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Dataset directory (holding manifest.json).
    dir: PathBuf,
    /// Threads hashing shards in parallel (0: every core).
    #[arg(long, default_value_t = 0, value_parser = usize_in(0, MAX_THREADS))]
    threads: usize,
    /// One JSON object (every shard's outcome and the totals) instead of lines.
    #[arg(long)]
    json: bool,
}

/// Run `flotilla data verify`: prints one line per shard and fails naming every bad one.
pub fn run(a: Args) -> Result<()> {
    let dataset =
        Dataset::open(&a.dir).with_context(|| format!("opening dataset {}", a.dir.display()))?;
    let report = verify_dataset(&dataset, a.threads)?;
    let bad: Vec<&str> = report.failures().map(|c| c.file.as_str()).collect();
    if a.json {
        let shards: Vec<_> = (report.shards.iter())
            .map(|c| {
                serde_json::json!({"file": c.file, "bytes": c.bytes, "ok": c.result.is_ok(),
                "error": c.result.as_ref().err().map(|e| e.to_string()),
                "seconds": c.elapsed.as_secs_f64()})
            })
            .collect();
        let v = serde_json::json!({"dataset": a.dir, "snapshot": dataset.manifest().snapshot,
            "shards": shards, "bytes": report.bytes(), "seconds": report.elapsed.as_secs_f64(),
            "gb_per_s": report.gb_per_s(), "failed": bad});
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
