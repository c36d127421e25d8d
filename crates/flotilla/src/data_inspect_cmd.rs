//! `flotilla data inspect`: a dataset's manifest, and its first documents decoded.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use data::{Tokenizer, TokenizerKind, TokenizerSpec};

/// Options of `flotilla data inspect`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Dataset directory (holding manifest.json), or s3://bucket/prefix (its shards fetched
    /// into the default data cache; feature s3).
    dir: PathBuf,
    /// Documents to decode, from the start of the dataset.
    #[arg(long, default_value_t = 3)]
    samples: usize,
    /// Characters shown per document.
    #[arg(long, default_value_t = 300)]
    chars: usize,
    /// Tokenizer to decode with: needed for a tokenizer.json dataset (otherwise ids are shown);
    /// it must be the one the manifest names.
    #[arg(long)]
    tokenizer: Option<TokenizerSpec>,
    /// End-of-text token of a tokenizer.json given with --tokenizer.
    #[arg(long)]
    eot: Option<String>,
    /// Print the manifest as JSON and nothing else.
    #[arg(long)]
    json: bool,
}

/// Run `flotilla data inspect`.
pub fn run(a: Args) -> Result<()> {
    let ds = data::cache::open(&a.dir, &data::CacheConfig::default())
        .with_context(|| format!("opening dataset {}", a.dir.display()))?;
    let m = ds.manifest();
    if a.json {
        println!("{}", serde_json::to_string_pretty(m)?);
        return Ok(());
    }
    println!("dataset       {}", a.dir.display());
    println!("snapshot      {}", m.snapshot);
    let eot = m.eot.map_or("none".to_string(), |e| e.to_string());
    println!(
        "tokenizer     {} (vocab {}, eot {eot}, {} bytes/token)",
        m.tokenizer, m.vocab_size, m.token_bytes
    );
    println!("preprocessing {}", m.preprocessing);
    println!(
        "totals        {} documents, {} tokens, {} shards, {} bytes",
        m.docs,
        m.tokens,
        m.shards.len(),
        m.bytes
    );
    println!(
        "{:<20} {:>14} {:>14} {:>10}  xxh3_128",
        "file", "bytes", "tokens", "docs"
    );
    for s in &m.shards {
        println!(
            "{:<20} {:>14} {:>14} {:>10}  {}",
            s.file, s.bytes, s.tokens, s.docs, s.xxh3_128
        );
    }
    if a.samples == 0 {
        return Ok(());
    }
    let tokenizer = decoder(&a, &m.tokenizer)?;
    let mut shown = 0;
    'shards: for i in 0..ds.num_shards() {
        let shard = ds.shard(i)?;
        for d in 0..shard.info().docs {
            if shown == a.samples {
                break 'shards;
            }
            let Some(range) = shard.doc_range(d) else {
                break;
            };
            let len = range.end - range.start;
            // Enough ids for the characters shown, never the whole of a huge document.
            let take = len.min(a.chars as u64 + 16);
            let mut ids = vec![0u32; take as usize];
            shard.read_tokens(range.start, &mut ids)?;
            if take == len && m.eot.is_some() && ids.last().copied() == m.eot {
                ids.pop();
            }
            let shown_text = match &tokenizer {
                Some(t) => {
                    let text: String = t.decode(&ids)?.chars().take(a.chars).collect();
                    format!("{text:?}")
                }
                None => format!("ids {:?}", &ids[..ids.len().min(a.chars / 4)]),
            };
            println!(
                "\n# document {shown} ({}, {len} tokens)\n{shown_text}",
                ds.manifest().shards[i].file
            );
            shown += 1;
        }
    }
    Ok(())
}

/// The tokenizer to decode with: `--tokenizer` if given (checked against the manifest), else
/// the manifest's when it is built in, else none (ids are printed).
fn decoder(a: &Args, recorded: &str) -> Result<Option<Box<dyn Tokenizer + Send + Sync>>> {
    if let Some(spec) = &a.tokenizer {
        let t = spec.build(a.eot.as_deref())?;
        if t.name() != recorded {
            bail!(
                "--tokenizer {spec} is {}, but the dataset was tokenized with {recorded}",
                t.name()
            );
        }
        return Ok(Some(t));
    }
    match recorded.parse::<TokenizerKind>() {
        Ok(kind) => Ok(Some(kind.build()?)),
        Err(_) => {
            println!(
                "(tokenizer {recorded} is not built in: pass --tokenizer path/to/tokenizer.json to decode)"
            );
            Ok(None)
        }
    }
}
