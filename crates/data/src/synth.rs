//! Synthetic datasets: Markov-chain token shards of any size, written through the same
//! [`ShardWriter`] and [`Manifest`] as `prepare`, for benchmarks (the 1-billion-token resume
//! test) and for training runs that need a dataset on disk without any text.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::corpus::MarkovCorpus;
use crate::error::{DataError, Result};
use crate::manifest::Manifest;
use crate::shard::{EXTENSION, ShardWriter};

/// The tokenizer name recorded for synthetic shards.
pub const SYNTH_TOKENIZER: &str = "markov";

/// What to generate.
#[derive(Clone, Copy, Debug)]
pub struct SynthConfig {
    /// Total tokens.
    pub tokens: u64,
    /// Vocabulary size.
    pub vocab: u32,
    /// Likely successors per token (the chain's branching).
    pub branching: usize,
    /// Tokens per document.
    pub doc_tokens: u64,
    /// Target bytes of tokens per shard.
    pub shard_bytes: u64,
    /// Chain seed.
    pub seed: u64,
}

/// What was written.
#[derive(Clone, Debug)]
pub struct SynthSummary {
    /// The manifest, as written.
    pub manifest: Manifest,
    /// Wall time.
    pub elapsed: Duration,
}

/// Writes a synthetic dataset into `dir` (which must not hold a manifest yet).
///
/// # Errors
/// [`DataError::InvalidArgument`] for zero sizes or a vocabulary the chain refuses;
/// [`DataError::Mismatch`] if `dir` already holds a dataset; I/O errors naming the file.
pub fn write_synthetic(
    dir: &Path,
    config: &SynthConfig,
    mut progress: impl FnMut(u64),
) -> Result<SynthSummary> {
    for (field, value) in [
        ("tokens", config.tokens),
        ("doc_tokens", config.doc_tokens),
        ("shard_bytes", config.shard_bytes),
    ] {
        if value == 0 {
            return Err(DataError::InvalidArgument {
                field,
                value,
                requirement: "must be positive".into(),
            });
        }
    }
    if dir.join(crate::manifest::MANIFEST_FILE).exists() {
        return Err(DataError::Mismatch {
            what: "output directory",
            detail: format!("{} already holds a dataset", dir.display()),
        });
    }
    std::fs::create_dir_all(dir).map_err(|source| DataError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let start = Instant::now();
    let mut chain = MarkovCorpus::new(config.vocab as usize, config.seed, config.branching)?;
    let mut doc = vec![0u32; config.doc_tokens.min(config.tokens) as usize];
    let mut shards = Vec::new();
    let mut written = 0u64;
    while written < config.tokens {
        let path = dir.join(format!("shard-{:05}.{EXTENSION}", shards.len()));
        let mut w = ShardWriter::create(&path, config.vocab, SYNTH_TOKENIZER)?;
        while written < config.tokens && w.token_bytes() < config.shard_bytes {
            let n = doc.len().min((config.tokens - written) as usize);
            chain.fill(&mut doc[..n]);
            w.push_doc(&doc[..n])?;
            written += n as u64;
            progress(written);
        }
        shards.push(w.finish()?);
    }
    let preprocessing = format!(
        "flotilla-data {} synth: markov vocab {} branching {} seed {} doc {} shard {} B",
        env!("CARGO_PKG_VERSION"),
        config.vocab,
        config.branching,
        config.seed,
        config.doc_tokens,
        config.shard_bytes
    );
    let manifest = Manifest::new(SYNTH_TOKENIZER, config.vocab, None, &preprocessing, &shards);
    manifest.write_atomic(dir)?;
    Ok(SynthSummary {
        manifest,
        elapsed: start.elapsed(),
    })
}
