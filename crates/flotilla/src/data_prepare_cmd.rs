//! `flotilla data prepare`: tokenize input files into a sharded dataset, with a summary.

use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::{Context, Result};
use data::prepare::{InputFormat, PrepareConfig, TextDocs, parse_byte_size, prepare};
use data::{Tokenizer, TokenizerSpec};
use indicatif::{ProgressBar, ProgressStyle};

use crate::flag_range::{MAX_THREADS, usize_in};

/// Options of `flotilla data prepare`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Input files, directories (walked recursively, hidden files skipped) and glob patterns;
    /// `.gz` and `.zst` files are decompressed as they are read (e.g. `web.jsonl.zst`).
    #[arg(required = true)]
    inputs: Vec<String>,
    /// Dataset directory to write (created if needed), or s3://bucket/prefix (prepared in the
    /// data cache, then uploaded, manifest last; needs the `s3` feature).
    #[arg(long, short)]
    output: PathBuf,
    /// Tokenizer: `byte`, `gpt2`, or a Hugging Face tokenizer.json.
    #[arg(long, default_value = "gpt2")]
    tokenizer: TokenizerSpec,
    /// End-of-text token of a tokenizer.json (default: `<|endoftext|>`, `</s>` or `<eos>`).
    #[arg(long)]
    eot: Option<String>,
    /// Input format for every file: text, jsonl or parquet (default: from each extension).
    #[arg(long)]
    format: Option<InputFormat>,
    /// How plain text splits into documents: file, line, or paragraph (blank-line separated).
    #[arg(long, default_value = "paragraph")]
    text_docs: TextDocs,
    /// JSON Lines field or Parquet column holding the text.
    #[arg(long, default_value = "text")]
    field: String,
    /// Count and skip malformed JSON Lines lines instead of stopping at the first.
    #[arg(long)]
    skip_bad_lines: bool,
    /// Target shard size in token bytes, e.g. 64MiB, 1GiB, or plain bytes.
    #[arg(long, default_value = "64MiB", value_parser = shard_size)]
    shard_size: u64,
    /// Longest document; longer ones are cut at line boundaries.
    #[arg(long, default_value = "64MiB", value_parser = doc_size)]
    max_doc_size: u64,
    /// Tokenizer threads (0: every core).
    #[arg(long, default_value_t = 0, value_parser = usize_in(0, MAX_THREADS))]
    threads: usize,
    /// Replace a dataset already in the output directory (or at the s3:// URL).
    #[arg(long)]
    force: bool,
    /// Hide the progress bar (it is also hidden when stderr is not a terminal).
    #[arg(long)]
    no_progress: bool,
    /// One JSON object (the counts, rates, tokenizer and snapshot) instead of lines.
    #[arg(long)]
    json: bool,
}

/// A progress bar over bytes on stderr for the long `data` and `ckpt` commands: hidden with
/// `--no-progress` or when stderr is not a terminal.
pub(crate) fn byte_bar(no_progress: bool) -> Result<ProgressBar> {
    let pb = if no_progress || !std::io::stderr().is_terminal() {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(0)
    };
    pb.set_style(
        ProgressStyle::with_template(
            "{bar:30} {bytes}/{total_bytes} {bytes_per_sec} {msg} [{elapsed_precise}<{eta_precise}]",
        )
        .context("progress template")?,
    );
    Ok(pb)
}

/// The `(done, total)` progress callback of a library call, moving `bar`.
pub(crate) fn advance(bar: &ProgressBar) -> impl FnMut(u64, u64) + Send + '_ {
    move |done, total| {
        bar.set_length(total);
        bar.set_position(done.min(total));
    }
}

fn shard_size(s: &str) -> Result<u64, data::DataError> {
    parse_byte_size("--shard-size", s)
}

fn doc_size(s: &str) -> Result<u64, data::DataError> {
    parse_byte_size("--max-doc-size", s)
}

/// Run `flotilla data prepare`.
pub fn run(a: Args) -> Result<()> {
    let tokenizer = a
        .tokenizer
        .build(a.eot.as_deref())
        .with_context(|| format!("loading tokenizer {}", a.tokenizer))?;
    let remote = data::cache::is_remote(&a.output).then(|| a.output.display().to_string());
    // An s3:// output is prepared in a scratch directory of this process, removed afterwards.
    let scratch = std::env::temp_dir().join(format!("flotilla-prepare-{}", std::process::id()));
    let local = if remote.is_some() {
        scratch.clone()
    } else {
        a.output
    };
    let mut cfg = PrepareConfig::new(a.inputs, local);
    cfg.format = a.format;
    cfg.text_docs = a.text_docs;
    cfg.field = a.field;
    cfg.skip_bad_lines = a.skip_bad_lines;
    cfg.shard_bytes = a.shard_size;
    cfg.max_doc_bytes = usize::try_from(a.max_doc_size).context("--max-doc-size")?;
    cfg.threads = a.threads;
    cfg.force = a.force;

    let pb = byte_bar(a.no_progress)?;
    let mut moved = advance(&pb);
    let tok: &(dyn Tokenizer + Sync) = tokenizer.as_ref();
    let summary = prepare(&cfg, tok, &mut |p| {
        moved(p.input_bytes_done, p.input_bytes);
        pb.set_message(format!(
            "{} docs, {} tokens, {} shards",
            p.docs, p.tokens, p.shards
        ));
    })
    .with_context(|| format!("preparing {}", cfg.output.display()))?;
    pb.finish_and_clear();

    let uploaded = match &remote {
        Some(url) => {
            let up = data::cache::upload(&cfg.output, url, a.force);
            std::fs::remove_dir_all(&scratch)
                .with_context(|| format!("removing {}", scratch.display()))?;
            Some(up.with_context(|| format!("uploading to {url}"))?)
        }
        None => None,
    };
    let output = remote.unwrap_or_else(|| cfg.output.display().to_string());
    match a.json {
        true => println!("{}", summary.to_json(&output, uploaded)),
        false => (summary.lines(&output, uploaded).iter()).for_each(|l| println!("{l}")),
    }
    Ok(())
}
