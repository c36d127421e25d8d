//! `flotilla data synth`: a Markov-chain token dataset of any size, with no text needed.

use std::path::PathBuf;

use anyhow::{Result, bail};
use data::prepare::parse_byte_size;
use data::synth::{SynthConfig, write_synthetic};
use indicatif::{ProgressBar, ProgressStyle};

use crate::flag_range::{positive_u64, positive_usize};

/// Options of `flotilla data synth`.
#[derive(clap::Args)]
pub struct Args {
    /// Output directory (created; must not hold a dataset yet).
    #[arg(long)]
    pub out: PathBuf,
    /// Total tokens, e.g. 1000000 or 1e9.
    #[arg(long, default_value = "1e7")]
    pub tokens: String,
    /// Vocabulary size (GPT-2's by default).
    #[arg(long, default_value_t = 50257)]
    pub vocab: u32,
    /// Likely successors per token.
    #[arg(long, default_value_t = 4, value_parser = positive_usize())]
    pub branching: usize,
    /// Tokens per document.
    #[arg(long, default_value_t = 4096, value_parser = positive_u64())]
    pub doc_tokens: u64,
    /// Target shard size in token bytes, e.g. 64MiB.
    #[arg(long, default_value = "64MiB", value_parser = shard_size)]
    pub shard_size: u64,
    /// Chain seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
}

fn shard_size(s: &str) -> Result<u64, data::DataError> {
    parse_byte_size("--shard-size", s)
}

/// Writes the dataset and prints a summary.
pub fn run(args: Args) -> Result<()> {
    let tokens = match args.tokens.parse::<f64>() {
        Ok(t) if t >= 1.0 && t <= u64::MAX as f64 => t as u64,
        _ => bail!(
            "--tokens {}: expected a positive count such as 1e9",
            args.tokens
        ),
    };
    let bar = if args.no_progress || !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(tokens)
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {human_pos}/{human_len} tokens {per_sec} {eta}")
            .expect("static template"),
    );
    let config = SynthConfig {
        tokens,
        vocab: args.vocab,
        branching: args.branching,
        doc_tokens: args.doc_tokens,
        shard_bytes: args.shard_size,
        seed: args.seed,
    };
    let summary = write_synthetic(&args.out, &config, |n| bar.set_position(n))?;
    bar.finish_and_clear();
    let m = &summary.manifest;
    println!(
        "wrote {}: {} tokens, {} documents, {} shards, {:.2} GB in {:.1} s; snapshot {}",
        args.out.display(),
        m.tokens,
        m.docs,
        m.shards.len(),
        m.bytes as f64 / 1e9,
        summary.elapsed.as_secs_f64(),
        m.snapshot
    );
    Ok(())
}
