//! `flotilla data ...`: building, inspecting and checking token datasets.
//!
//! Each subcommand lives in its own module with its `Args` and `run`; adding one is a variant
//! here and an arm in [`run`].

use anyhow::Result;

use crate::{
    data_bench_cmd, data_inspect_cmd, data_prepare_cmd, data_stress_cmd, data_synth_cmd,
    data_verify_cmd,
};

/// The `flotilla data` subcommands.
#[derive(clap::Subcommand)]
pub enum DataCommand {
    /// Tokenize text, JSON Lines or Parquet files into a sharded, hashed dataset.
    Prepare(data_prepare_cmd::Args),
    /// Print a dataset's manifest and decode a few documents.
    Inspect(data_inspect_cmd::Args),
    /// Re-hash every shard of a dataset; fails naming each bad shard.
    Verify(data_verify_cmd::Args),
    /// Write a synthetic (Markov-chain) token dataset of any size.
    Synth(data_synth_cmd::Args),
    /// Run the loader alone at a target rate: sustained tokens/s, latency, fd and memory growth.
    Stress(data_stress_cmd::Args),
    /// Loader bandwidth vs a plain sequential read of the same files, and mid-epoch resume time.
    Bench(data_bench_cmd::Args),
}

/// Runs one `flotilla data` subcommand.
pub fn run(command: DataCommand) -> Result<()> {
    match command {
        DataCommand::Prepare(a) => data_prepare_cmd::run(a),
        DataCommand::Inspect(a) => data_inspect_cmd::run(a),
        DataCommand::Verify(a) => data_verify_cmd::run(a),
        DataCommand::Synth(a) => data_synth_cmd::run(a),
        DataCommand::Stress(a) => data_stress_cmd::run(a),
        DataCommand::Bench(a) => data_bench_cmd::run(a),
    }
}
