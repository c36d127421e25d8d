//! `flotilla generate`: sample text from a model saved by `flotilla train --save`.
use anyhow::{Context, Result};

use crate::flag_range::{MAX_THREADS, finite_nonneg_f64, usize_in};
use data::TokenizerKind;
use model::Threads;
use model::model::Model;
use model::sample::{SampleConfig, generate};
use std::path::PathBuf;

/// Options of `flotilla generate`.
#[derive(clap::Args, Debug)]
#[command(allow_negative_numbers = true)]
pub struct Args {
    /// Directory written by `flotilla train --save`.
    #[arg(long)]
    model: PathBuf,
    /// Text to continue (token ids separated by spaces for a model trained without a tokenizer).
    #[arg(long, default_value = "The ")]
    prompt: String,
    /// Tokens to generate.
    #[arg(long, default_value_t = 200)]
    tokens: usize,
    /// Softmax temperature (0 = greedy).
    #[arg(long, default_value_t = 0.8, value_parser = finite_nonneg_f64)]
    temperature: f64,
    /// Sample among the k most likely tokens (0 = all).
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// Sampling seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Compute threads.
    #[arg(long, default_value_t = 1, value_parser = usize_in(1, MAX_THREADS))]
    threads: usize,
}

/// Run `flotilla generate`.
pub fn run(a: Args) -> Result<()> {
    let (cfg, params, side) = train::saved::load(&a.model)?;
    let th = Threads::new(a.threads)?;
    let mut m = Model::<f32>::new(&cfg, 1, cfg.seq_len, false)?;
    let mut sc = SampleConfig {
        temperature: a.temperature,
        top_k: a.top_k,
        seed: a.seed,
        vocab_limit: None,
    };
    match side.tokenizer {
        Some(name) => {
            let kind: TokenizerKind = name.parse().context("tokenizer in flotilla.json")?;
            let tok = kind.build()?;
            sc.vocab_limit = Some(tok.vocab_size());
            let ids = tok.encode(&a.prompt);
            let out = generate(&th, &mut m, &params, &ids, a.tokens, &sc)?;
            println!("{}", tok.decode(&out)?);
        }
        None => {
            let ids = a
                .prompt
                .split_whitespace()
                .map(|s| {
                    s.parse::<u32>()
                        .with_context(|| format!("--prompt: {s:?} is not a token id"))
                })
                .collect::<Result<Vec<_>>>()?;
            let out = generate(&th, &mut m, &params, &ids, a.tokens, &sc)?;
            println!(
                "{}",
                out.iter().map(u32::to_string).collect::<Vec<_>>().join(" ")
            );
        }
    }
    Ok(())
}
