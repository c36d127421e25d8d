//! `flotilla ckpt bench`: checkpoint save and load bandwidth against the disk's own sequential
//! write and read bandwidth, measured in the same round on the same directory
//! ([`ckpt::bench`] has the mechanics and what each figure measures).

use std::path::PathBuf;

use anyhow::Result;
use ckpt::bench::{Round, Settings};
use data::prepare::parse_byte_size;

/// `--ranks`, `--reshard-ranks`: 1 to [`crate::flag_range::MAX_THREADS`] (each rank is a
/// thread).
fn bench_ranks() -> clap::builder::RangedI64ValueParser<u32> {
    clap::value_parser!(u32).range(1..=crate::flag_range::MAX_THREADS as i64)
}

/// Options of `flotilla ckpt bench`.
#[derive(clap::Args)]
pub struct Args {
    /// Directory to write in (created if missing; the benchmark removes what it writes).
    #[arg(long)]
    pub dir: PathBuf,
    /// Approximate size of the checkpoint state and of the plain test file (e.g. 1GiB, 64MiB).
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    pub size: u64,
    /// Ranks (threads) that save and load with the same layout.
    #[arg(long, default_value_t = 2, value_parser = bench_ranks())]
    pub ranks: u32,
    /// Ranks of the resharding load (default: `--ranks` + 1).
    #[arg(long, value_parser = bench_ranks())]
    pub reshard_ranks: Option<u32>,
    /// Rounds to run.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub rounds: u32,
    /// Cold page cache: drop the kernel's caches before every read (root only: writes
    /// /proc/sys/vm/drop_caches).
    #[arg(long)]
    pub cold: bool,
    /// Print one JSON object per round instead of a table.
    #[arg(long)]
    pub json: bool,
}

fn parse_size(s: &str) -> Result<u64, data::DataError> {
    parse_byte_size("--size", s)
}

/// Runs the benchmark and prints one line (or JSON object) per round.
pub fn run(args: Args) -> Result<()> {
    let settings = Settings {
        dir: args.dir.clone(),
        size: args.size,
        ranks: args.ranks,
        reshard_ranks: args.reshard_ranks.unwrap_or(args.ranks + 1),
        rounds: args.rounds,
        cold: args.cold,
    };
    if !args.json {
        print_header(settings.ranks, settings.reshard_ranks, args.cold);
    }
    Ok(ckpt::bench::run(&settings, &mut |r| {
        print_round(&args, r);
        Ok(())
    })?)
}

fn print_header(ranks: u32, reshard: u32, cold: bool) {
    println!(
        "{:>5} {:>12} {:>7} {:>7} {:>7} {:>9} {:>9} {:>7} {:>7} {:>9} {:>9} {:>12}",
        "round",
        "bytes",
        "disk_w",
        "disk_r",
        "save",
        "async_s",
        "async_tot",
        "load",
        "reshard",
        "save/disk",
        "load/disk",
        "reshard/load"
    );
    println!(
        "# GB/s, but async_s: the slowest rank's foreground pause in seconds; save and load by \
         {ranks} ranks, reshard load by {reshard}{}",
        if cold { ", cold cache" } else { "" }
    );
}

/// Runs one round and prints its line (or JSON object).
fn print_round(args: &Args, r: &Round) {
    if args.json {
        println!("{}", serde_json::json!(r));
    } else {
        println!(
            "{:>5} {:>12} {:>7.2} {:>7.2} {:>7.2} {:>9.3} {:>9.2} {:>7.2} {:>7.2} {:>9.2} {:>9.2} {:>12.2}",
            r.round,
            r.bytes,
            r.disk_write_gbps,
            r.disk_read_gbps,
            r.save_gbps,
            r.async_pause_s,
            r.async_total_gbps,
            r.load_same_gbps,
            r.load_reshard_gbps,
            r.save_over_disk_write,
            r.load_over_disk_read,
            r.reshard_over_same
        );
    }
}
