//! `flotilla data bench`: loader bandwidth against a plain sequential read of the same files,
//! in the same run, and the time to resume mid-epoch.

use anyhow::Result;
use data::bench::BenchConfig;

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
    let bench = BenchConfig {
        epochs: args.epochs,
        resume_at: args.resume_at,
        cold: args.cold,
    };
    let reopen = || {
        args.run
            .loader
            .open()
            .map_err(|e| data::DataError::Loader(format!("{e:#}")))
    };
    let drop = || drop_caches().map_err(|e| data::DataError::Loader(e.to_string()));
    let config = args.run.config()?;
    let report = data::bench::run(args.run.loader.open()?, &config, &bench, &reopen, &drop)?;
    match args.json {
        true => println!("{}", report.json),
        false => report.lines.iter().for_each(|l| println!("{l}")),
    }
    Ok(())
}
