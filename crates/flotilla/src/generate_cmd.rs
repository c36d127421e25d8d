//! `flotilla generate`: sample text from a model saved by `flotilla train --save`, or from a
//! Hugging Face GPT-2 or Llama directory (`--hf`).
use anyhow::Result;

use crate::flag_range::{MAX_THREADS, finite_nonneg_f64, usize_in};
use data::TokenizerSpec;
use model::Threads;
use model::model::Model;
use model::sample::{SampleConfig, generate};
use std::path::PathBuf;

/// Options of `flotilla generate`.
#[derive(clap::Args, Debug)]
#[command(allow_negative_numbers = true)]
pub struct Args {
    /// Directory written by `flotilla train --save`.
    #[arg(long, required_unless_present = "hf", conflicts_with = "hf")]
    model: Option<PathBuf>,
    /// A Hugging Face GPT-2 or Llama directory (config.json, model.safetensors or its shards),
    /// e.g. one written by `flotilla train --export-hf`; its tokenizer.json, when it has one,
    /// encodes the prompt, else --tokenizer, else the prompt is token ids.
    #[arg(long, value_name = "DIR")]
    hf: Option<PathBuf>,
    /// Tokenizer of an --hf directory without tokenizer.json: byte, gpt2 or a tokenizer.json.
    #[arg(long, requires = "hf")]
    tokenizer: Option<TokenizerSpec>,
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
    /// Print the token ids (prompt and continuation, space-separated) instead of the text.
    #[arg(long)]
    ids: bool,
}

/// Run `flotilla generate`.
pub fn run(a: Args) -> Result<()> {
    let loaded = match (&a.hf, &a.model) {
        (Some(dir), _) => train::generation::from_hf(dir, a.tokenizer.as_ref())?,
        (None, Some(dir)) => train::generation::from_saved(dir)?,
        (None, None) => anyhow::bail!("give --model DIR or --hf DIR"),
    };
    let ids = loaded.prompt_ids(&a.prompt)?;
    let (cfg, params, tok) = (&loaded.cfg, &loaded.params, &loaded.tok);
    let th = Threads::new(a.threads)?;
    // A context no longer than the text needs: causal attention makes the rest irrelevant.
    let ctx = cfg.seq_len.min(ids.len() + a.tokens).max(1);
    let mut m = Model::<f32>::new(cfg, 1, ctx, false)?;
    let sc = SampleConfig {
        temperature: a.temperature,
        top_k: a.top_k,
        seed: a.seed,
        vocab_limit: tok.as_ref().map(|t| t.vocab_size()),
    };
    let out = generate(&th, &mut m, params, &ids, a.tokens, &sc)?;
    match &tok {
        Some(t) if !a.ids => println!("{}", t.decode(&out)?),
        _ => println!(
            "{}",
            out.iter().map(u32::to_string).collect::<Vec<_>>().join(" ")
        ),
    }
    Ok(())
}
