//! `flotilla data stress`: the loader alone, at a target rate, for a given time.

use std::time::Duration;

use anyhow::Result;
use data::{Loader, stress::StressConfig, stress::StressReport};

use crate::flag_range::{finite_nonneg_f64, seconds};
use crate::loader_args::LoaderRunArgs;

/// Options of `flotilla data stress`.
#[derive(clap::Args)]
#[command(allow_negative_numbers = true)]
pub struct Args {
    #[command(flatten)]
    pub run: LoaderRunArgs,
    /// Tokens per second to consume; 0 takes batches as fast as the loader makes them.
    #[arg(long, default_value_t = 0.0, value_parser = finite_nonneg_f64)]
    pub rate: f64,
    /// Seconds to run.
    #[arg(long, default_value_t = 10.0, value_parser = seconds)]
    pub duration: f64,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Runs the stress test and prints its report.
pub fn run(args: Args) -> Result<()> {
    let datasets = args.run.loader.open()?;
    let width = datasets[0].manifest().token_bytes;
    let config = args.run.config()?;
    let mut loader = Loader::new(datasets, &config, None)?;
    let stress = StressConfig {
        target_tokens_per_s: (args.rate > 0.0).then_some(args.rate),
        duration: Duration::from_secs_f64(args.duration),
        max_batches: None,
    };
    let report = data::stress::stress(&mut loader, &stress, width)?;
    if args.json {
        println!("{}", report_json(&report, args.rate));
    } else {
        print_report(&report, args.rate);
    }
    Ok(())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn print_report(r: &StressReport, rate: f64) {
    let m = &r.metrics;
    println!(
        "data stress: {:.1} s, {} batches, {} tokens",
        r.elapsed.as_secs_f64(),
        r.batches,
        r.tokens
    );
    let target = if rate > 0.0 {
        format!("{rate:.0}")
    } else {
        "unpaced".into()
    };
    println!(
        "  sustained      {:.0} tokens/s ({:.1} MB/s of tokens), target {target}",
        r.tokens_per_s,
        r.bytes_per_s / 1e6
    );
    println!(
        "  batch build    P50 {:.3} ms  P99 {:.3} ms",
        ms(m.p50_latency),
        ms(m.p99_latency)
    );
    println!(
        "  consumer wait  P50 {:.3} ms  P99 {:.3} ms  data stall {:.2} % (eq. 4.2)",
        ms(r.p50_wait),
        ms(r.p99_wait),
        m.stall_pct()
    );
    println!(
        "  prefetch depth {} (most outstanding {})",
        m.depth, m.max_outstanding
    );
    println!(
        "  open fds       {} -> {} ({:+})",
        r.before.open_fds,
        r.after.open_fds,
        r.after.open_fds as i64 - r.before.open_fds as i64
    );
    let mib = |b: u64| b as f64 / 1048576.0;
    println!(
        "  rss anonymous  {:.1} MiB -> {:.1} MiB ({:+.1} MiB); mapped shard pages {:.1} MiB -> {:.1} MiB",
        mib(r.before.rss_anon_bytes),
        mib(r.after.rss_anon_bytes),
        mib(r.after.rss_anon_bytes) - mib(r.before.rss_anon_bytes),
        mib(r.before.rss_file_bytes),
        mib(r.after.rss_file_bytes),
    );
}

fn report_json(r: &StressReport, rate: f64) -> serde_json::Value {
    let m = &r.metrics;
    serde_json::json!({
        "seconds": r.elapsed.as_secs_f64(),
        "batches": r.batches,
        "tokens": r.tokens,
        "target_tokens_per_s": rate,
        "tokens_per_s": r.tokens_per_s,
        "bytes_per_s": r.bytes_per_s,
        "build_p50_ms": ms(m.p50_latency),
        "build_p99_ms": ms(m.p99_latency),
        "wait_p50_ms": ms(r.p50_wait),
        "wait_p99_ms": ms(r.p99_wait),
        "stall_pct": m.stall_pct(),
        "depth": m.depth,
        "max_outstanding": m.max_outstanding,
        "fds_before": r.before.open_fds,
        "fds_after": r.after.open_fds,
        "rss_anon_before": r.before.rss_anon_bytes,
        "rss_anon_after": r.after.rss_anon_bytes,
        "rss_file_before": r.before.rss_file_bytes,
        "rss_file_after": r.after.rss_file_bytes,
    })
}
